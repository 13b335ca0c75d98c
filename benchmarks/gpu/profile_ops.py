"""Where our CUDA ops spend their time, on an H100/H200: the companion of check.py for the rows it shows slow.

    python benchmarks/gpu/profile_ops.py [--out FILE]  # on the GPU machine, after `python setup.py build_ext --inplace`

For each op at check.py's (non-quick) timing shapes, forward + backward:
  - host syncs: every device-to-host synchronisation one call makes, with the line of ours that asked for it
    (torch.cuda.set_sync_debug_mode("warn") and the Python stack at each warning);
  - a torch.profiler table: kernel launches, device time against host time, the top operators by device time.
Then fused_linear_grpo_loss's chunk size swept (its weight-gradient accumulation is per chunk), and the fp32
accumulation of a bf16 product by one cuBLAS call (torch.addmm(..., out_dtype=torch.float32)) checked against
fp64 and timed against the bf16 product + cast + add it replaces. Prints everything; --out also writes it.
"""

import argparse
import io
import sys
import traceback
import warnings
from contextlib import redirect_stdout
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch
import triton

import grpo_kernels

LOSS = dict(loss_type="dapo", beta=0.04, epsilon_high=0.28)
OURS = str(Path(grpo_kernels.__file__).resolve().parent)


def ops():
    """{name: fwd+bwd closure} at gpu_check's timing shapes."""
    dev = "cuda"
    out = {}
    rewards = torch.randint(0, 2, (1 << 22,), device=dev).float()
    out["group_advantages N=4M G=16"] = lambda: grpo_kernels.group_advantages(rewards, group_size=16, impl="triton")

    g = torch.Generator().manual_seed(0)
    b, length = 64, 2048
    logps = (-torch.rand(b, length, generator=g) * 3).to(dev).requires_grad_()
    old = logps.detach() + 0.1 * torch.randn(b, length, generator=g).to(dev)
    ref = logps.detach() + 0.1 * torch.randn(b, length, generator=g).to(dev)
    mask = (torch.rand(b, length, generator=g) > 0.1).float().to(dev)
    adv = torch.randn(b, generator=g).to(dev)

    def loss():
        out, _ = grpo_kernels.grpo_loss(logps, old, adv, ref_logps=ref, mask=mask, impl="triton", **LOSS)
        torch.autograd.grad(out, logps)

    out["grpo_loss T=131072 dapo+KL"] = loss

    t, v = 16384, 151936
    logits = torch.randn(t, v, device=dev, dtype=torch.bfloat16).requires_grad_()
    ids = torch.randint(0, v, (t,), device=dev)

    def logprobs():
        lp = grpo_kernels.selective_logprobs(logits, ids, impl="triton")
        torch.autograd.grad(lp.sum(), logits)

    out["selective_logprobs T=16384 V=151936 bf16"] = logprobs

    t, h = 8192, 4096
    hidden = torch.randn(t, h, device=dev, dtype=torch.bfloat16).requires_grad_()
    weight = (torch.randn(v, h, device=dev) * 0.02).to(torch.bfloat16).requires_grad_()
    ids2 = torch.randint(0, v, (t,), device=dev)
    old2 = -torch.rand(t, device=dev) * 3
    kw = dict(ref_logps=old2 + 0.05, mask=torch.ones(t, device=dev), cu_seqlens=torch.tensor([0, t], device=dev),
              old_logps=old2, impl="triton", **LOSS)  # fmt: skip
    adv2 = torch.randn(1, device=dev)

    def fused(chunk_tokens="auto"):
        out, _ = grpo_kernels.fused_linear_grpo_loss(hidden, weight, ids2, adv2, chunk_tokens=chunk_tokens, **kw)
        torch.autograd.grad(out, (hidden, weight))

    out["fused_linear_grpo_loss T=8192 H=4096 V=151936 bf16"] = fused
    return out, fused


def host_syncs(fn) -> list[str]:
    """One line per synchronisation fn makes: the innermost frame of ours on the stack when it happened."""
    seen = []

    def record(message, category, filename, lineno, file=None, line=None):
        frames = [f for f in traceback.extract_stack() if f.filename.startswith(OURS)]
        where = f"{Path(frames[-1].filename).name}:{frames[-1].lineno} {frames[-1].line}" if frames else "(not ours)"
        seen.append(f"{where}  [{str(message).splitlines()[0][:80]}]")

    torch.cuda.synchronize()
    old_show = warnings.showwarning
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = record
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
            warnings.showwarning = old_show
    return seen


def profile_table(fn, rows: int = 12) -> str:
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
    events = prof.key_averages()
    launches = sum(e.count for e in events if e.key in ("cudaLaunchKernel", "cuLaunchKernel", "cuLaunchKernelEx"))
    device_us = sum(e.self_device_time_total for e in events) / 3
    head = f"  per call: {launches / 3:.0f} kernel launches, device busy {device_us / 1e3:.3f} ms\n"
    return head + events.table(sort_by="self_device_time_total", row_limit=rows, max_name_column_width=60)


def fp32_accumulate_check() -> list[str]:
    """torch.addmm(C, A, B, out_dtype=float32, out=C) with bf16 A, B: right, and faster than C += (A @ B).float()?"""
    lines = []
    if not hasattr(torch.ops.aten.addmm, "dtype_out"):
        return ["  aten::addmm.dtype_out: not in this torch"]
    dev = "cuda"
    v, h, c = 151936, 4096, 883
    a = torch.randn(v, c, device=dev).to(torch.bfloat16)
    bm = torch.randn(c, h, device=dev).to(torch.bfloat16)
    acc = torch.randn(v, h, device=dev)
    want = acc.double() + a.double() @ bm.double()
    got = acc.clone()
    torch.addmm(got, a, bm, out_dtype=torch.float32, out=got)
    err = float((got.double() - want).abs().max() / want.abs().max())
    lines.append(f"  addmm(out_dtype=float32, out=C aliasing C): rel err vs fp64 {err:.2e}")
    ms_new = triton.testing.do_bench(lambda: torch.addmm(acc, a, bm, out_dtype=torch.float32, out=acc),
                                     return_mode="median")  # fmt: skip
    ms_old = triton.testing.do_bench(lambda: acc.add_(torch.mm(a, bm).float()), return_mode="median")
    lines.append(f"  [{v}x{c}] @ [{c}x{h}] into fp32: addmm out_dtype {ms_new:.3f} ms, bf16 mm + float + add "
                 f"{ms_old:.3f} ms ({ms_old / ms_new:.2f}x)")  # fmt: skip
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="also write the report here")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("gpu_profile: no CUDA device")
    buf = io.StringIO()

    def say(text=""):
        print(text, flush=True)
        buf.write(text + "\n")

    say(f"gpu_profile on {torch.cuda.get_device_name()}: torch {torch.__version__}, triton {triton.__version__}")
    cases, fused = ops()
    for name, fn in cases.items():
        say(f"\n## {name}")
        try:
            fn()  # compiled and warm before anything is counted
            syncs = host_syncs(fn)
            say(f"  host syncs per call: {len(syncs)}")
            for line in syncs:
                say(f"    {line}")
            with redirect_stdout(io.StringIO()):
                table = profile_table(fn)
            say(table)
        except Exception as exc:
            say(f"  {type(exc).__name__}: {str(exc).splitlines()[0][:300] if str(exc) else ''}")
    say("\n## fused_linear_grpo_loss: chunk size (T=8192 H=4096 V=151936 bf16, fwd+bwd)")
    for chunk in ("auto", 2048, 4096, 8192):
        try:
            ms = triton.testing.do_bench(lambda chunk=chunk: fused(chunk), return_mode="median")
            peak_from = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            fused(chunk)
            peak = (torch.cuda.max_memory_allocated() - peak_from) / 2**20
            say(f"  chunk_tokens={chunk}: {ms:.3f} ms, peak {peak:.0f} MiB above the inputs")
        except Exception as exc:
            say(f"  chunk_tokens={chunk}: {type(exc).__name__}: {str(exc).splitlines()[0][:200]}")
    say("\n## fp32 accumulation of a bf16 product")
    try:
        for line in fp32_accumulate_check():
            say(line)
    except Exception as exc:
        say(f"  {type(exc).__name__}: {str(exc).splitlines()[0][:300] if str(exc) else ''}")
    if args.out:
        Path(args.out).write_text(buf.getvalue())


if __name__ == "__main__":
    main()

"""Benchmark grpo_kernels.selective_logprobs (log-probs of the sampled ids + entropy) against PyTorch baselines.

Usage (from the repository root):
    .venv/bin/python benchmarks/ops/logprobs.py                  # full sweep on the CPU (C++ kernels)
    .venv/bin/python benchmarks/ops/logprobs.py --quick          # T x V = 512 x 8192 on CPU only, shorter timing
    .venv/bin/python benchmarks/ops/logprobs.py --device cuda    # Triton kernels, timed with do_bench
    .venv/bin/python benchmarks/ops/logprobs.py --plot           # also write logprobs_<device>.png
    .venv/bin/python benchmarks/ops/logprobs.py --csv out.csv    # append rows to out.csv instead

Packed logits [T, V] (randn * 2, float32 and bfloat16) and random ids; temperature 1 unless --temperature.
Providers:
    eager         log_softmax(logits.float() / temperature) + gather, entropy -(p logp).sum(-1), all in fp32:
                  TRL's computation written as plain PyTorch. (TRL's own selective_log_softmax and
                  entropy_from_logits take their fused Triton kernel only on CUDA/XPU; on CPU they fall back
                  to Python loops over rows / 128-row chunks in the logits' dtype, so they are not used here.)
    compiled      torch.compile(eager), static shapes, compiled afresh per shape, dtype and mode.
    ours          grpo_kernels.selective_logprobs(..., return_entropy=True) (impl="auto": C++ on CPU, Triton
                  on CUDA).
    ours_inplace  the same with inplace_backward=True (fwd+bwd only): d logits overwrite the logits buffer.
    liger         liger_kernel.ops.grpo_loss.fused_selective_log_softmax: Triton only, log-probs only (no
                  entropy) and no backward, so it runs in fwd on CUDA and is printed as skipped otherwise.
Modes:
    fwd           logps and entropy from logits that do not require grad.
    fwd+bwd       timed region: x = leaf.clone() (a fresh non-leaf copy of the logits, which the in-place
                  backward needs and every provider pays for), the forward, and
                  torch.autograd.grad(logps.sum() + entropy.sum(), x).
Every provider is checked against ours once per shape before timing (logps, entropy and, in fwd+bwd, the
gradient). gbps counts the bytes of an ideal kernel: one read of the logits in fwd; in fwd+bwd one more read
and one write of d logits (3 passes; the clone is timed but not counted). peak_mb (CUDA only) is the memory one
call allocates on top of what was allocated before it. Rows are appended to
benchmarks/results/logprobs_<device>.csv; speedup_vs_baseline is that provider's time / ours' time (empty on
ours' rows). A provider that is unavailable, fails to compile or runs out of memory is printed as skipped and
left out of the CSV.
On CPU, fwd+bwd times are dominated by fresh [T, V] allocations: glibc serves them with mmap and unmaps them on
free, so every call pays page faults for the clone, d logits and each eager intermediate (ours_inplace saves the
d logits one). The CUDA caching allocator has no such cost.
"""

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # importable from a plain checkout too

import torch

import grpo_kernels
from benchmarks.common import RESULTS, append_csv, compile_checked, median_ms, plot_bars, print_environment, run_meta

COLUMNS = ["timestamp", "device", "torch", "triton", "git_sha", "mode", "T", "V", "dtype", "provider", "median_ms",
           "gbps", "peak_mb", "speedup_vs_baseline"]  # fmt: skip
MODES = ("fwd", "fwd+bwd")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
CPU_SHAPES = [(1024, 32000), (4096, 32000), (1024, 152064)]
CUDA_SHAPES = CPU_SHAPES + [(t, v) for t in (4096, 32768) for v in (32000, 152064) if (t, v) not in CPU_SHAPES]
QUICK_SHAPES = {"cpu": [(512, 8192)], "cuda": [(4096, 32000), (4096, 152064)]}
# (logps/entropy atol, rtol), (gradient atol, rtol): bf16 inputs are read into fp32 by every provider, but the
# gradient is rounded to bf16, where one ulp is 2^-8 relative.
TOLERANCES = {"fp32": ((1e-4, 1e-5), (1e-6, 1e-4)), "bf16": ((2e-4, 1e-4), (1e-5, 1.6e-2))}


def eager(logits: torch.Tensor, ids: torch.Tensor, temperature: float = 1.0):
    """log softmax(logits / temperature)[ids] and the entropy, in fp32 (TRL's computation in plain PyTorch)."""
    z = logits.float()
    if temperature != 1.0:
        z = z / temperature
    logp = torch.log_softmax(z, dim=-1)
    logps = logp.gather(-1, ids[..., None]).squeeze(-1)
    entropy = -(logp.exp() * logp).sum(-1)
    return logps, entropy


def ours(logits, ids, temperature=1.0, inplace_backward=False):
    return grpo_kernels.selective_logprobs(
        logits, ids, temperature=temperature, return_entropy=True, inplace_backward=inplace_backward
    )


def liger_unavailable(device: str, mode: str) -> str | None:
    """Why the liger provider cannot run here, or None."""
    if device != "cuda":
        return "liger_kernel's selective log-softmax is a Triton (CUDA) kernel with no CPU path"
    if mode != "fwd":
        return "liger_kernel's fused_selective_log_softmax is no-grad (no backward)"
    try:
        from liger_kernel.ops.grpo_loss import fused_selective_log_softmax  # noqa: F401
    except Exception as exc:
        return f"liger_kernel import failed: {type(exc).__name__}: {exc}"[:200]
    return None


def providers(mode: str) -> list:
    return ["eager", "compiled", "ours", *(["ours_inplace"] if mode == "fwd+bwd" else []), "liger"]


def check(got, want, dtype: str) -> None:
    """Assert (logps, entropy[, grad]) match ours; liger's logps-only output checks the logps."""
    (atol, rtol), (gatol, grtol) = TOLERANCES[dtype]
    for i, (g, w) in enumerate(zip(got, want, strict=False)):
        tol = dict(atol=gatol, rtol=grtol) if i == 2 else dict(atol=atol, rtol=rtol)
        torch.testing.assert_close(g, w, **tol)


def make_point(t: int, v: int, dtype: str, mode: str, device: str, temperature: float):
    """One sweep point: ({provider: base callable (logits, ids) -> outputs}, timed-call factory, inputs)."""
    logits_buf = (torch.randn(t + 1, v, device=device) * 2).to(DTYPES[dtype])  # row T: liger reads [B, L + 1, V]
    logits = logits_buf.requires_grad_(mode == "fwd+bwd")[:t]  # a view: a non-leaf when it requires grad
    ids = torch.randint(0, v, (t,), device=device)

    fns = {
        "eager": lambda x, i: eager(x, i, temperature),
        "ours": lambda x, i: ours(x, i, temperature),
        "ours_inplace": lambda x, i: ours(x, i, temperature, inplace_backward=True),
    }

    def timed(fn):
        """The callable that is timed for base function fn (see the module docstring for the timed region)."""
        if mode == "fwd":
            return lambda: fn(logits, ids)

        def step():
            x = logits.clone()  # fresh non-leaf logits every call, for every provider
            logps, entropy = fn(x, ids)
            (grad,) = torch.autograd.grad(logps.sum() + entropy.sum(), x)
            return logps, entropy, grad

        return step

    if mode == "fwd" and device == "cuda":
        from liger_kernel.ops.grpo_loss import fused_selective_log_softmax

        fns["liger"] = lambda x, i: (fused_selective_log_softmax(logits_buf[None], i[None], temperature)[0],)  # logps
    return fns, timed


def peak_mb(fn, device: str):
    """CUDA memory one call of fn allocates above what was allocated before it, in MB; None on CPU."""
    if device != "cuda":
        return None
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return round((torch.cuda.max_memory_allocated() - before) / 2**20, 1)


def run_point(label, t, v, dtype, mode, device, temperature, min_time, skip_notes) -> dict:
    """Check every provider against ours, then time them; returns {provider: (ms, peak_mb) or None if skipped}."""
    fns, timed = make_point(t, v, dtype, mode, device, temperature)
    results = {}
    want = timed(fns["ours"])()
    for name in providers(mode):
        results[name] = None
        reason = liger_unavailable(device, mode) if name == "liger" else None
        if reason is not None:
            if reason not in skip_notes.setdefault(name, set()):
                print(f"  {name} skipped ({reason})")
            skip_notes[name].add(reason)
            continue
        try:
            if name == "compiled":
                base = lambda x, i: eager(x, i, temperature)
                fn, reason = compile_checked(base, lambda c: check(timed(c)(), want, dtype))
                if fn is None:
                    print(f"  {label}: {name} skipped ({reason})")
                    continue
            else:
                fn = fns[name]
                if name != "ours":
                    check(timed(fn)(), want, dtype)
            ms = median_ms(timed(fn), device, min_time)
            results[name] = (ms, peak_mb(timed(fn), device))
        except torch.OutOfMemoryError as exc:
            print(f"  {label}: {name} skipped (out of memory: {str(exc).splitlines()[0][:160]})")
        except AssertionError as exc:
            print(f"  {label}: {name} FAILED the check against ours, not timed: {' '.join(str(exc).split())[:300]}")
        if device == "cuda":
            torch.cuda.empty_cache()
    return results


def plot(rows, path: Path) -> None:
    """Median ms per shape (log y), one bar per provider, one subplot per panel."""
    plot_bars(
        rows, path, panel=lambda r: f"{r['mode']}, {r['dtype']}", shape=lambda r: f"{r['T']}x{r['V']}", xlabel="T x V"
    )


def main() -> None:
    """Run the sweep, print the tables, append the CSV, optionally plot."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer shapes and shorter timing")
    parser.add_argument("--plot", action="store_true", help="write a PNG of this run next to the CSV")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--csv", type=Path, help="append here, not to benchmarks/results/logprobs_<device>.csv")
    args = parser.parse_args()
    dev, min_time = args.device, (0.1 if args.quick else 0.3)
    shapes = QUICK_SHAPES[dev] if args.quick else (CUDA_SHAPES if dev == "cuda" else CPU_SHAPES)
    csv_path = args.csv or RESULTS / f"logprobs_{dev}.csv"
    meta = run_meta(dev)
    print_environment(meta)
    torch.manual_seed(0)
    rows, skip_notes, started = [], {}, time.perf_counter()

    for mode in MODES:
        names = providers(mode)
        speedups = [(o, b) for o in names if o.startswith("ours") for b in ("eager", "compiled")]
        labels = [f"{'inpl' if o == 'ours_inplace' else 'ours'}/{b}" for o, b in speedups]
        head = " ".join(f"{n:>12}" for n in names) + " " + " ".join(f"{x:>13}" for x in labels)
        print(f"\n[{mode}] median ms, speedups, (ours GB/s)\n{'T':>6} {'V':>7} {'dtype':>5} {head}")
        for (t, v), dtype in [(s, d) for s in shapes for d in DTYPES]:
            nbytes = (1 if mode == "fwd" else 3) * t * v * DTYPES[dtype].itemsize
            res = run_point(f"{mode} {t}x{v} {dtype}", t, v, dtype, mode, dev, args.temperature, min_time, skip_notes)
            ours_ms = res["ours"][0] if res["ours"] else None
            for name, r in res.items():
                if r is not None:
                    speedup = "" if name == "ours" or ours_ms is None else round(r[0] / ours_ms, 3)
                    rows.append({**meta, "mode": mode, "T": t, "V": v, "dtype": dtype, "provider": name,
                                 "median_ms": round(r[0], 4), "gbps": round(nbytes / r[0] / 1e6, 3),
                                 "peak_mb": "" if r[1] is None else r[1], "speedup_vs_baseline": speedup})  # fmt: skip
            cells = " ".join(f"{res[n][0]:12.2f}" if res[n] else f"{'skipped':>12}" for n in names)
            gbps = f"({nbytes / ours_ms / 1e6:.1f})" if ours_ms else ""
            ratios = [f"{res[b][0] / res[o][0]:.2f}x" if res[o] and res[b] else "-" for o, b in speedups]
            print(f"{t:>6} {v:>7} {dtype:>5} {cells} {' '.join(f'{x:>13}' for x in ratios)}  {gbps}", flush=True)

    for name, reasons in skip_notes.items():
        for reason in sorted(reasons):
            print(f"{name} skipped: {reason}")
    append_csv(rows, csv_path, COLUMNS)
    print(f"\nappended {len(rows)} rows to {csv_path} ({time.perf_counter() - started:.0f} s)")
    if args.plot:
        plot(rows, csv_path.with_suffix(".png") if args.csv else csv_path.parent / f"logprobs_{dev}.png")


if __name__ == "__main__":
    main()

"""One script for an H100/H200: every CUDA path checked against grpo_kernels.reference, then timed against its
baselines at realistic shapes, with achieved GB/s or TFLOP/s against ceilings measured on the same card.

    python setup.py build_ext --inplace -q && python benchmarks/gpu/check.py      # on the GPU machine, < 8 min
    python benchmarks/gpu/check.py --quick                                       # smaller timing shapes
    python benchmarks/gpu/check.py --dry-run      # anywhere: every check and timing case at tiny shapes on the CPU
                                                  # (C++ kernels instead of Triton), no CUDA, no torch.compile

Needs only torch and triton (Liger is timed when installed). Checks (Triton against the fp64 reference, fp32 and
bf16, odd shapes, forward and backward): group_advantages, selective_logprobs, grpo_loss, grpo_loss_from_logits,
fused_linear_grpo_loss, varlen_attention (torch varlen / flash-attn against per-sequence SDPA), checkpoint_offload
(model.activation_checkpointing "offload" against "blocks" on a stack of MLP blocks: same loss and gradients; its
peak memory and step time beside "blocks" as rows of kind "memory" and "time"). Timings
(`triton.testing.do_bench` medians, forward + backward where there is one): each op's eager PyTorch baseline,
torch.compile of it, Liger where it has the op, and ours. Ceilings: a device-to-device copy (GB/s) and a bf16
8192^3 matmul (TFLOP/s). Writes benchmarks/results/gpu_check_<device>.csv and prints the table last.
"""

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # importable from a plain checkout too

import torch

import grpo_kernels
from benchmarks.common import RESULTS, write_csv
from grpo_kernels import reference
from grpo_kernels.attention import varlen_attention

LOSS = dict(loss_type="dapo", beta=0.04, epsilon_high=0.28)
BF16_TOL, FP32_TOL = 2e-2, 1e-4


def rel_err(got, want) -> float:
    """max |got - want| / max |want| (fp64)."""
    got, want = got.double(), want.double()
    return float((got - want).abs().max() / want.abs().max().clamp_min(1e-12))


class Env:
    """Device, kernel impl, timer and shapes of this run (CUDA/Triton, or the CPU dry run)."""

    def __init__(self, dry_run: bool, quick: bool):
        self.dry = dry_run
        self.device = torch.device("cpu" if dry_run else "cuda")
        self.impl = "auto" if dry_run else "triton"
        self.quick = quick or dry_run

    def time_ms(self, fn) -> float:
        if self.dry:
            fn()
            start = time.perf_counter()
            fn()
            return (time.perf_counter() - start) * 1e3
        import triton

        return triton.testing.do_bench(fn, return_mode="median")

    def compiled(self, forward, *leaves):
        """fwd+bwd of torch.compile(forward) (None in the dry run: no compiler there)."""
        return None if self.dry else _fwd_bwd(torch.compile(forward, dynamic=False), *leaves)


# ---------------------------------------------------------------------------------------------------------------
# Correctness: ours (Triton) against the reference, fp32 and bf16.


def _loss_inputs(env, b, length, dtype):
    g = torch.Generator().manual_seed(b * length)
    logps = (-torch.rand(b, length, generator=g) * 3).to(env.device, dtype).requires_grad_()
    old = (logps.detach().float() + 0.1 * torch.randn(b, length, generator=g).to(env.device)).to(dtype)
    ref = (logps.detach().float() + 0.1 * torch.randn(b, length, generator=g).to(env.device)).to(dtype)
    mask = (torch.rand(b, length, generator=g) > 0.1).float().to(env.device)
    return logps, old, ref, mask, torch.randn(b, generator=g).to(env.device)


def check_cases(env):
    """[(name, dtype, fn -> [relative errors])] of every CUDA path."""
    dev, impl = env.device, env.impl
    vocab = 1003 if env.dry else 32003  # odd vocabularies, one not a multiple of any block size
    cases = []

    def advantages(dtype):
        rewards = torch.randint(0, 2, (4231 * 7,)).to(dev, dtype)
        ours = grpo_kernels.group_advantages(rewards, group_size=7, impl=impl).advantages
        want = reference.group_advantages(rewards.double(), group_size=7).advantages
        return [rel_err(ours, want)]

    def logprobs(dtype):
        logits = torch.randn(7, 613, vocab).to(dev, dtype).requires_grad_()
        ids = torch.randint(0, vocab, (7, 613), device=dev)
        lp, ent = grpo_kernels.selective_logprobs(logits, ids, temperature=0.7, return_entropy=True, impl=impl)
        w = torch.randn_like(lp)
        (g,) = torch.autograd.grad((lp * w).sum() + ent.sum(), logits)
        x = logits.detach().double().requires_grad_()
        lp_r, ent_r = reference.selective_logprobs(x, ids, temperature=0.7, return_entropy=True)
        (g_r,) = torch.autograd.grad((lp_r * w.double()).sum() + ent_r.sum(), x)
        return [rel_err(lp, lp_r), rel_err(ent, ent_r), rel_err(g, g_r)]

    def loss(dtype):
        logps, old, ref, mask, adv = _loss_inputs(env, 7, 611, dtype)
        out, _ = grpo_kernels.grpo_loss(logps, old, adv, ref_logps=ref, mask=mask, impl=impl, **LOSS)
        (g,) = torch.autograd.grad(out, logps)
        x = logps.detach().double().requires_grad_()
        want, _ = reference.grpo_loss(x, old.double(), adv.double(), ref_logps=ref.double(), mask=mask.double(),
                                      **LOSS)  # fmt: skip
        (g_r,) = torch.autograd.grad(want, x)
        return [rel_err(out.reshape(1), want.reshape(1)), rel_err(g, g_r)]

    def from_logits(dtype):
        logits = torch.randn(5, 301, vocab).to(dev, dtype).requires_grad_()
        ids = torch.randint(0, vocab, (5, 301), device=dev)
        _, old, ref, mask, adv = _loss_inputs(env, 5, 301, torch.float32)
        out, _ = grpo_kernels.grpo_loss_from_logits(logits, ids, old, adv, ref_logps=ref, mask=mask, impl=impl, **LOSS)
        (g,) = torch.autograd.grad(out, logits)
        x = logits.detach().double().requires_grad_()
        want, _ = reference.grpo_loss(reference.selective_logprobs(x, ids), old.double(), adv.double(),
                                      ref_logps=ref.double(), mask=mask.double(), **LOSS)  # fmt: skip
        (g_r,) = torch.autograd.grad(want, x)
        return [rel_err(out.reshape(1), want.reshape(1)), rel_err(g, g_r)]

    def fused_linear(dtype):
        hidden = torch.randn(3, 333, 256).to(dev, dtype).requires_grad_()
        weight = (torch.randn(vocab, 256) * 0.05).to(dev, dtype).requires_grad_()
        ids = torch.randint(0, vocab, (3, 333), device=dev)
        _, old, ref, mask, adv = _loss_inputs(env, 3, 333, torch.float32)
        out, _ = grpo_kernels.fused_linear_grpo_loss(hidden, weight, ids, adv, old_logps=old, ref_logps=ref, mask=mask,
                                                     impl=impl, **LOSS)  # fmt: skip
        gh, gw = torch.autograd.grad(out, (hidden, weight))
        h, w = hidden.detach().double().requires_grad_(), weight.detach().double().requires_grad_()
        want, _ = reference.grpo_loss(reference.selective_logprobs(h @ w.T, ids), old.double(), adv.double(),
                                      ref_logps=ref.double(), mask=mask.double(), **LOSS)  # fmt: skip
        gh_r, gw_r = torch.autograd.grad(want, (h, w))
        return [rel_err(out.reshape(1), want.reshape(1)), rel_err(gh, gh_r), rel_err(gw, gw_r)]

    def attention(dtype):
        lengths = [1, 77, 300, 513]
        cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], device=dev)
        t = int(cu[-1])
        q, k, v = (torch.randn(t, h, 64).to(dev, dtype) for h in (8, 2, 2))
        want = varlen_attention(q.double(), k.double(), v.double(), cu, max(lengths), backend="sdpa")
        backend = "sdpa" if env.dry else "auto"  # auto: flash-attn or torch varlen when the card has them
        return [rel_err(varlen_attention(q, k, v, cu, max(lengths), backend=backend), want)]

    def attention_features(dtype):  # sliding window, sinks, soft-capping: whichever backend honours them all
        lengths = [1, 77, 300]
        cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], device=dev)
        q, k, v = (torch.randn(int(cu[-1]), h, 64).to(dev, dtype) for h in (8, 2, 2))
        sinks = torch.randn(8, device=dev)
        errs = []
        for opts in (dict(window=37), dict(window=37, sinks=sinks, softcap=5.0)):
            want = varlen_attention(q.double(), k.double(), v.double(), cu, max(lengths), backend="math",
                                    **{n: x.double() if torch.is_tensor(x) else x for n, x in opts.items()})
            errs.append(rel_err(varlen_attention(q, k, v, cu, max(lengths), **opts), want))
        return errs

    def offload(dtype):  # the offloaded checkpoints against plain block checkpointing: the same loss and grads
        ref, out = (_offload_fwd_bwd(env, dtype, mode, small=True) for mode in ("blocks", "offload"))
        return [rel_err(a, b) for a, b in zip(out, ref, strict=True)]

    for name, fn in [("group_advantages", advantages), ("selective_logprobs", logprobs), ("grpo_loss", loss),
                     ("grpo_loss_from_logits", from_logits), ("fused_linear_grpo_loss", fused_linear),
                     ("varlen_attention", attention), ("varlen_attention_features", attention_features),
                     ("checkpoint_offload", offload)]:  # fmt: skip
        for dtype in (torch.float32, torch.bfloat16):
            cases.append((name, dtype, fn))
    return cases


class _MLPBlock(torch.nn.Module):
    def __init__(self, hidden: int):
        super().__init__()
        self.up, self.down = torch.nn.Linear(hidden, 4 * hidden), torch.nn.Linear(4 * hidden, hidden)

    def forward(self, x):
        return x + self.down(torch.nn.functional.silu(self.up(x)))


def _offload_model(env, dtype, mode: str, small: bool):
    """(a stack of residual MLP blocks checkpointed by the trainer's checkpoint_blocks in mode, its input)."""
    from grpo_kernels.train.model.activation import checkpoint_blocks

    tokens, hidden, layers = (64, 32, 4) if env.dry or small else ((4096, 4096, 8) if env.quick else (8192, 4096, 16))
    torch.manual_seed(0)
    blocks = torch.nn.Sequential(*[_MLPBlock(hidden) for _ in range(layers)]).to(env.device, dtype)
    checkpoint_blocks(list(blocks), mode)
    x = torch.randn(tokens, hidden, device=env.device, dtype=dtype, requires_grad=True)
    return blocks, x


def _offload_fwd_bwd(env, dtype, mode: str, small: bool):
    """[loss, input gradient, first and last block's weight gradients] of one forward + backward."""
    blocks, x = _offload_model(env, dtype, mode, small)
    loss = blocks(x).float().square().mean()
    loss.backward()
    return [loss.detach(), x.grad, blocks[0].up.weight.grad, blocks[-1].down.weight.grad]


def offload_rows(env) -> list[dict]:
    """Peak device memory and step time of one forward + backward with "blocks" and "offload" (bf16)."""
    rows = []
    for mode in ("blocks", "offload"):
        blocks, x = _offload_model(env, torch.bfloat16, mode, small=False)

        def step(blocks=blocks, x=x):
            blocks(x).float().square().mean().backward()

        step()
        if not env.dry:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        step()
        peak = float("nan") if env.dry else (torch.cuda.max_memory_allocated() - torch.cuda.memory_allocated()) / 2**20
        rows.append(dict(kind="memory", op="checkpoint_offload", shape=f"{len(blocks)} MLP blocks x {tuple(x.shape)} "
                         "bf16", provider=mode, value=f"{peak:.0f}", unit="MiB above the resident"))  # fmt: skip
        rows.append(dict(kind="time", op="checkpoint_offload fwd+bwd", shape=rows[-1]["shape"],
                         provider="ours" if mode == "offload" else mode, value=f"{env.time_ms(step):.3f}",
                         unit="ms"))  # fmt: skip
        blocks = x = step = None  # freed before the next mode is built
    base = float(rows[1]["value"])
    rows[3]["vs_best_baseline"] = f"{base / float(rows[3]['value']):.2f}x"
    rows[1]["vs_best_baseline"] = "1.00x"
    return rows


# ---------------------------------------------------------------------------------------------------------------
# Timings: ours against the baselines at realistic shapes.


def _fwd_bwd(fn, *leaves):
    def run():
        out = fn()
        loss = out[0] if isinstance(out, tuple) else out
        torch.autograd.grad(loss.float().sum(), leaves)

    return run


def timing_cases(env):
    """Yields (op, shape, {provider: fn}, bytes moved or None, flops or None), one case at a time: each is timed
    before the next is built (its tensors freed, and the closures see their own case's tensors, not the next's)."""
    dev, impl, q = env.device, env.impl, env.quick

    n = 4096 if env.dry else (1 << 18 if q else 1 << 22)
    rewards = torch.randint(0, 2, (n,), device=dev).float()
    eager = lambda: reference.group_advantages(rewards, group_size=16).advantages  # noqa: E731
    yield ("group_advantages", f"N={n} G=16", {
        "eager": eager, "compiled": None if env.dry else torch.compile(eager, dynamic=False),
        "ours": lambda: grpo_kernels.group_advantages(rewards, group_size=16, impl=impl).advantages,
    }, 8 * n, None)  # fmt: skip

    t, v = (64, 1000) if env.dry else ((4096, 151936) if q else (16384, 151936))
    logits = torch.randn(t, v, device=dev, dtype=torch.bfloat16).requires_grad_()
    ids = torch.randint(0, v, (t,), device=dev)
    eager = lambda: torch.log_softmax(logits.float(), -1).gather(-1, ids[:, None])[:, 0]  # noqa: E731
    yield ("selective_logprobs fwd+bwd", f"T={t} V={v} bf16", {
        "eager": _fwd_bwd(eager, logits), "compiled": env.compiled(eager, logits),
        "ours": _fwd_bwd(lambda: grpo_kernels.selective_logprobs(logits, ids, impl=impl), logits),
    }, 3 * t * v * 2, None)  # fmt: skip

    b, length = (4, 64) if env.dry else ((16, 2048) if q else (64, 2048))
    logps, old, ref, mask, adv = _loss_inputs(env, b, length, torch.float32)
    eager = lambda: reference.grpo_loss(logps, old, adv, ref_logps=ref, mask=mask, **LOSS)  # noqa: E731
    ours = lambda: grpo_kernels.grpo_loss(logps, old, adv, ref_logps=ref, mask=mask, impl=impl, **LOSS)  # noqa: E731
    yield ("grpo_loss fwd+bwd", f"T={b * length} dapo+KL", {
        "eager": _fwd_bwd(eager, logps), "compiled": env.compiled(eager, logps),
        "ours": _fwd_bwd(ours, logps),
    }, 6 * b * length * 4, None)  # fmt: skip

    _, old2, ref2, mask2, adv2 = _loss_inputs(env, 1, t, torch.float32)
    packed = dict(ref_logps=ref2.reshape(-1), mask=mask2.reshape(-1), cu_seqlens=torch.tensor([0, t], device=dev))

    def eager_from_logits():
        lp = torch.log_softmax(logits.float(), -1).gather(-1, ids[:, None])[:, 0]
        return reference.grpo_loss(lp, old2.reshape(-1), adv2, **packed, **LOSS)

    def ours_from_logits():
        return grpo_kernels.grpo_loss_from_logits(logits, ids, old2.reshape(-1), adv2, impl=impl, **packed, **LOSS)

    yield ("grpo_loss_from_logits fwd+bwd", f"T={t} V={v} bf16", {
        "eager": _fwd_bwd(eager_from_logits, logits), "compiled": env.compiled(eager_from_logits, logits),
        "ours": _fwd_bwd(ours_from_logits, logits),
    }, 3 * t * v * 2, None)  # fmt: skip

    # the dry run's T differs from the cases above, so a closure that saw another case's tensors would fail there
    t, h, v = (48, 32, 1000) if env.dry else ((4096, 4096, 151936) if q else (8192, 4096, 151936))
    hidden = torch.randn(t, h, device=dev, dtype=torch.bfloat16).requires_grad_()
    weight = (torch.randn(v, h, device=dev) * 0.02).to(torch.bfloat16).requires_grad_()
    ids = torch.randint(0, v, (t,), device=dev)
    _, old3, ref3, mask3, adv3 = _loss_inputs(env, 1, t, torch.float32)
    kw = dict(ref_logps=ref3.reshape(-1), mask=mask3.reshape(-1), cu_seqlens=torch.tensor([0, t], device=dev), **LOSS)

    def naive():
        lp = torch.log_softmax((hidden @ weight.T).float(), -1).gather(-1, ids[:, None])[:, 0]
        return reference.grpo_loss(lp, old3.reshape(-1), adv3, **kw)

    def ours():
        return grpo_kernels.fused_linear_grpo_loss(hidden, weight, ids, adv3, old_logps=old3.reshape(-1), impl=impl,
                                                   **kw)  # fmt: skip

    def floor():
        logits_ = hidden.detach() @ weight.detach().T
        return logits_ @ weight.detach(), logits_.T @ hidden.detach()

    providers = {"naive": _fwd_bwd(naive, hidden, weight), "ours": _fwd_bwd(ours, hidden, weight), "floor": floor}
    liger = _liger_fused_linear(hidden, weight, ids, adv3, old3, ref3, mask3, env)
    if liger is not None:
        providers["liger"] = _fwd_bwd(liger, hidden, weight)
    yield ("fused_linear_grpo_loss fwd+bwd", f"T={t} H={h} V={v} bf16", providers, None, 6 * t * h * v)


def _liger_fused_linear(hidden, weight, ids, adv, old, ref, mask, env):
    if env.dry:
        return None
    try:
        from liger_kernel.chunked_loss import LigerFusedLinearGRPOLoss
    except ImportError:
        return None
    module = LigerFusedLinearGRPOLoss(beta=LOSS["beta"], epsilon_high=LOSS["epsilon_high"], loss_type="dapo")
    return lambda: module(hidden[None], weight, ids[None], mask, adv, ref_per_token_logps=ref, old_per_token_logp=old)


def ceilings(env) -> tuple[float, float]:
    """(copy GB/s, bf16 matmul TFLOP/s) measured on this device (nan in the dry run)."""
    if env.dry:
        return float("nan"), float("nan")
    x = torch.empty(1 << 30, dtype=torch.uint8, device=env.device)
    y = torch.empty_like(x)
    copy_gbs = 2 * x.numel() / env.time_ms(lambda: y.copy_(x)) / 1e6
    a = torch.randn(8192, 8192, device=env.device, dtype=torch.bfloat16)
    return copy_gbs, 2 * 8192**3 / env.time_ms(lambda: a @ a) / 1e9


def _worst(errors: list[float]) -> float:
    """The largest error, NaN if any is NaN (Python's max would drop a NaN that is not first)."""
    return float("nan") if any(e != e for e in errors) else max(errors)


class _Rows(list):
    """The result rows, written to the CSV after each one is added."""

    FIELDS = ["kind", "op", "shape", "provider", "value", "unit", "ok", "rate", "vs_best_baseline"]

    def __init__(self, path: Path):
        super().__init__()
        self.path = path

    def append(self, row: dict) -> None:
        super().append(row)
        write_csv(self, self.path, self.FIELDS)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true", help="CPU, tiny shapes, no CUDA (a smoke test)")
    parser.add_argument("--quick", action="store_true", help="smaller timing shapes")
    parser.add_argument("--out", help="CSV path (default benchmarks/results/gpu_check_<device>.csv)")
    args = parser.parse_args()
    if not args.dry_run and not torch.cuda.is_available():
        raise SystemExit("gpu_check: no CUDA device (use --dry-run on a machine without a GPU)")
    env = Env(args.dry_run, args.quick)
    name = "cpu-dry-run" if env.dry else torch.cuda.get_device_name().replace(" ", "_")
    started, failed = time.perf_counter(), []
    print(f"gpu_check on {name}: torch {torch.__version__}, impl={env.impl}", flush=True)
    out = Path(args.out) if args.out else RESULTS / f"gpu_check_{name}.csv"
    out.parent.mkdir(parents=True, exist_ok=True)
    rows = _Rows(out)  # rewritten after every row: a run stopped at its time limit keeps what it measured
    for op, dtype, fn in check_cases(env):
        tol = BF16_TOL if dtype == torch.bfloat16 else FP32_TOL
        try:
            worst, note = _worst(fn(dtype)), ""
        except Exception as exc:  # one broken path is reported and the others still run
            worst, note = float("nan"), f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"
            torch.cuda.empty_cache() if not env.dry else None
        ok = worst <= tol  # NaN (a non-finite result, or an error) fails
        failed += [] if ok else [f"{op} {dtype}"]
        rows.append(dict(kind="check", op=op, shape=str(dtype).replace("torch.", ""), provider="ours",
                         value=note or f"{worst:.2e}", unit=f"rel err (tol {tol:g})", ok=ok))  # fmt: skip
        print(f"  check {op:26s} {dtype}: {note or f'max rel err {worst:.2e}'} {'ok' if ok else 'FAIL'}"
              f"  [{time.perf_counter() - started:.0f} s]", flush=True)  # fmt: skip
    copy_gbs, mm_tflops = ceilings(env)
    rows.append(dict(kind="ceiling", op="copy", shape="1 GiB", provider="torch", value=f"{copy_gbs:.0f}", unit="GB/s"))
    rows.append(dict(kind="ceiling", op="matmul", shape="8192^3 bf16", provider="torch", value=f"{mm_tflops:.0f}",
                     unit="TFLOP/s"))  # fmt: skip
    for op, shape, providers, nbytes, flops in timing_cases(env):
        times = {}
        for p, fn in providers.items():
            try:
                times[p] = env.time_ms(fn) if fn is not None else None
            except Exception as exc:  # a baseline that fails (a compiler error, out of memory) is reported, not fatal;
                print(f"  {op} {p}: {type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}")
                torch.cuda.empty_cache() if not env.dry else None
                failed += [f"{op} (ours, at the timing shape)"] if p == "ours" else []  # ours failing is a failure
        times = {p: ms for p, ms in times.items() if ms is not None}
        base = min((ms for p, ms in times.items() if p not in ("ours", "floor")), default=float("nan"))
        for p, ms in times.items():
            rate = (f"{nbytes / ms / 1e6:.0f} GB/s ({nbytes / ms / 1e6 / copy_gbs:.0%} of copy)" if nbytes
                    else f"{flops / ms / 1e9:.0f} TFLOP/s ({flops / ms / 1e9 / mm_tflops:.0%} of matmul)")  # fmt: skip
            rows.append(dict(kind="time", op=op, shape=shape, provider=p, value=f"{ms:.3f}", unit="ms",
                             rate=rate if p == "ours" or not nbytes else "",
                             vs_best_baseline=f"{base / ms:.2f}x"))  # fmt: skip
        print(f"  time  {op:32s} {shape}: " + ", ".join(f"{p} {ms:.3f} ms" for p, ms in times.items())
              + f"  [{time.perf_counter() - started:.0f} s]", flush=True)  # fmt: skip
    try:
        for row in offload_rows(env):
            rows.append(row)
            print(f"  {row['kind']:5s} {row['op']:32s} {row['shape']} {row['provider']}: {row['value']} {row['unit']}",
                  flush=True)  # fmt: skip
    except Exception as exc:  # reported, not fatal: the kernel timings above are kept
        print(f"  checkpoint_offload rows: {type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}")
    print(f"\n{name}, {time.perf_counter() - started:.0f} s, wrote {out}\n")
    print("| op | shape | provider | value | rate | vs best baseline |\n|---|---|---|---|---|---|")
    for r in rows:
        if r["kind"] != "check":
            print(f"| {r['op']} | {r['shape']} | {r['provider']} | {r['value']} {r['unit']} | {r.get('rate', '')} | "
                  f"{r.get('vs_best_baseline', '')} |")  # fmt: skip
    print(f"\nchecks: {sum(r['kind'] == 'check' for r in rows) - len(failed)} ok, failed: {failed or 'none'}")
    if failed:
        raise SystemExit(1)


if __name__ == "__main__":
    main()

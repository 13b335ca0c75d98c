"""Benchmark fused_linear_grpo_loss (LM head + GRPO loss, no logits) against the naive path, Liger, and the floor.

Usage (from the repository root):
    .venv/bin/python benchmarks/ops/fused_linear.py                 # CPU: T=2048, H=896, V=151936, fp32
    .venv/bin/python benchmarks/ops/fused_linear.py --quick         # a small shape (smoke run)
    .venv/bin/python benchmarks/ops/fused_linear.py --device cuda   # T x H x V sweep, fp32 and bf16
    .venv/bin/python benchmarks/ops/fused_linear.py --chunk-tokens 256   # ours with a fixed chunk

Inputs: hidden [B, 1024, H] (randn), weight [V, H] (randn * 0.02), random ids, old and reference log-probs, a
~10% padding mask; loss_type "dapo", beta = 0.04, epsilon_high = 0.28. Timed: forward + backward
(torch.autograd.grad w.r.t. hidden and weight), median of --repeats calls after one checked call.
Providers:
    naive   logits = hidden W^T, log_softmax + gather in fp32, the reference (TRL) loss, autograd.
    liger   liger_kernel.chunked_loss.LigerFusedLinearGRPOLoss (compiled=False on CPU, its default on CUDA).
    ours    grpo_kernels.FusedLinearGRPOLoss (chunk_tokens "auto" unless --chunk-tokens).
    floor   the three matmuls nothing can avoid: hidden W^T, then [T, V] x W and [T, V]^T x hidden.
peak_extra_mb: memory one forward + backward allocates beyond the unavoidable gradient buffers (grad_hidden and
grad_weight in the parameter dtype), each provider in a fresh process: on CPU the peak RSS (VmHWM, reset through
/proc/self/clear_refs after a small warm-up call) minus the RSS before the call; on CUDA max_memory_allocated
minus memory_allocated. Rows are appended to benchmarks/results/fused_linear_<device>.csv.
"""

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # importable from a plain checkout too

import torch

import grpo_kernels
from benchmarks.common import RESULTS, append_csv, print_environment, run_meta, status_kb
from grpo_kernels import reference

COLUMNS = ["timestamp", "device", "torch", "triton", "git_sha", "T", "H", "V", "dtype", "provider", "median_ms",
           "tflops", "peak_extra_mb", "vs_floor", "speedup_vs_ours"]  # fmt: skip
CFG = dict(beta=0.04, loss_type="dapo", epsilon_high=0.28)
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
SHAPES = {
    "cpu": [(2048, 896, 151936, "fp32")],
    "quick": [(1024, 256, 8192, "fp32")],
    "cuda": [(t, h, v, d) for d in ("bf16", "fp32") for t in (1024, 4096, 16384) for h in (896, 4096)
             for v in (32000, 151936)],
}  # fmt: skip
PROVIDERS = ("floor", "naive", "liger", "ours")


def make_inputs(t, h, v, dtype, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    b, length = max(t // 1024, 1), min(t, 1024)
    lengths = torch.randint(int(0.8 * length), length + 1, (b,), generator=g)
    lengths[0] = length
    x = {
        "hidden": torch.randn(b, length, h, generator=g), "weight": torch.randn(v, h, generator=g) * 0.02,
        "ids": torch.randint(0, v, (b, length), generator=g), "old": -torch.rand(b, length, generator=g) * 12,
        "mask": (torch.arange(length)[None, :] < lengths[:, None]).float(), "adv": torch.randn(b, generator=g),
    }  # fmt: skip
    x["ref"] = x["old"] + 0.1 * torch.randn(b, length, generator=g)
    x = {k: val.to(device) for k, val in x.items()}
    for k in ("hidden", "weight"):
        x[k] = x[k].to(DTYPES[dtype]).requires_grad_()
    return x


def provider_fn(name, x, device, chunk_tokens):
    """f() -> (loss, grad hidden, grad weight); or a skip reason (str)."""
    h, w = x["hidden"], x["weight"]

    def grads(loss):
        return (loss, *torch.autograd.grad(loss, (h, w)))

    if name == "floor":

        def floor():
            with torch.no_grad():
                h2 = h.reshape(-1, h.shape[-1])
                logits = h2 @ w.t()
                return None, logits @ w, logits.t() @ h2

        return floor
    if name == "naive":

        def naive():
            logits = torch.nn.functional.linear(h, w).float()
            logps = torch.log_softmax(logits, -1).gather(-1, x["ids"][..., None]).squeeze(-1)
            loss, _ = reference.grpo_loss(logps, x["old"], x["adv"], ref_logps=x["ref"], mask=x["mask"], **CFG)
            return grads(loss)

        return naive
    kwargs = dict(ref_per_token_logps=x["ref"], old_per_token_logps=x["old"])
    if name == "liger":
        try:
            from liger_kernel.chunked_loss import LigerFusedLinearGRPOLoss
        except Exception as exc:
            return f"liger_kernel import failed: {type(exc).__name__}: {exc}"[:200]
        module = LigerFusedLinearGRPOLoss(compiled=device == "cuda", **CFG)
    else:
        module = grpo_kernels.FusedLinearGRPOLoss(chunk_tokens=chunk_tokens, **CFG)
    return lambda: grads(module(h, w, x["ids"], x["mask"], x["adv"], **kwargs)[0])


def sync(device):
    if device == "cuda":
        torch.cuda.synchronize()


def time_ms(fn, device, repeats) -> float:
    times = []
    for _ in range(repeats):
        sync(device)
        start = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def measure_peak(t, h, v, dtype, provider, device, chunk_tokens) -> float:
    """MB one fwd+bwd allocates beyond grad_hidden + grad_weight, in this (fresh) process."""
    small = make_inputs(min(t, 64), h, v, dtype, device, seed=1)
    provider_fn(provider, small, device, chunk_tokens)()  # warm-up: threads, lazy pages, compile on CUDA
    del small
    x = make_inputs(t, h, v, dtype, device)
    fn = provider_fn(provider, x, device, chunk_tokens)
    grads_mb = (x["hidden"].numel() + x["weight"].numel()) * x["hidden"].itemsize / 2**20
    if device == "cuda":
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        fn()
        torch.cuda.synchronize()
        return (torch.cuda.max_memory_allocated() - before) / 2**20 - grads_mb
    before = status_kb("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM (the peak RSS) to the current RSS
    fn()
    return (status_kb("VmHWM") - before) / 2**10 - grads_mb


def peak_in_fresh_process(*args) -> float | None:
    out = subprocess.run([sys.executable, __file__, "--peak", json.dumps(args)], capture_output=True, text=True)
    if out.returncode != 0:
        print(f"  peak memory of {args[4]} failed: {out.stderr.strip().splitlines()[-1:]}")
        return None
    return round(float(out.stdout.strip().splitlines()[-1]), 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="one small shape, no memory runs")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--repeats", type=int, default=3, help="timed calls per provider (after one checked call)")
    parser.add_argument("--chunk-tokens", default="auto", help="ours: tokens per chunk, or 'auto'")
    parser.add_argument("--csv", type=Path, help="append here, not to benchmarks/results/fused_linear_<device>.csv")
    parser.add_argument("--peak", help=argparse.SUPPRESS)  # internal: one peak-memory measurement
    args = parser.parse_args()
    chunk = args.chunk_tokens if args.chunk_tokens == "auto" else int(args.chunk_tokens)
    if args.peak:
        print(measure_peak(*json.loads(args.peak)))
        return
    dev = args.device
    meta = run_meta(dev)
    print_environment(meta)
    rows, started = [], time.perf_counter()
    for t, h, v, dtype in SHAPES["quick" if args.quick else dev]:
        x = make_inputs(t, h, v, dtype, dev)
        res, want = {}, None
        for name in ("ours", "floor", "naive", "liger"):
            fn = provider_fn(name, x, dev, chunk)
            if isinstance(fn, str):
                print(f"  {name} skipped ({fn})")
                continue
            try:
                got = fn()  # the checked call, also the warm-up
                if name == "ours":
                    want = got
                elif name != "floor":
                    tol = dict(rtol=2e-3, atol=1e-5) if dtype == "fp32" else dict(rtol=5e-2, atol=1e-3)
                    for a, b in zip(got, want, strict=True):
                        torch.testing.assert_close(a.float(), b.float(), **tol)
                ms = time_ms(fn, dev, args.repeats)
            except torch.OutOfMemoryError:
                print(f"  {name} skipped (out of memory)")
                continue
            peak = None if args.quick else peak_in_fresh_process(t, h, v, dtype, name, dev, chunk)
            res[name] = (ms, peak)
            print(f"  T={t} H={h} V={v} {dtype} {name}: {ms:.1f} ms" + (f", {peak:.0f} MB extra" if peak else ""),
                  flush=True)  # fmt: skip
            if dev == "cuda":
                torch.cuda.empty_cache()
        flops = 3 * 2 * t * h * v
        for name, (ms, peak) in res.items():
            rows.append({**meta, "T": t, "H": h, "V": v, "dtype": dtype, "provider": name, "median_ms": round(ms, 2),
                         "tflops": round(flops / ms / 1e9, 4), "peak_extra_mb": "" if peak is None else peak,
                         "vs_floor": round(ms / res["floor"][0], 3) if "floor" in res else "",
                         "speedup_vs_ours": "" if name == "ours" else round(ms / res["ours"][0], 3)})  # fmt: skip
        print(f"T={t} H={h} V={v} {dtype}: " + " | ".join(
            f"{r['provider']} {r['median_ms']:.0f} ms ({r['vs_floor']}x floor, {r['peak_extra_mb']} MB)"
            for r in rows[-len(res):]))  # fmt: skip
    csv_path = args.csv or RESULTS / f"fused_linear_{dev}.csv"
    append_csv(rows, csv_path, COLUMNS)
    print(f"\nappended {len(rows)} rows to {csv_path} ({time.perf_counter() - started:.0f} s)")


if __name__ == "__main__":
    main()

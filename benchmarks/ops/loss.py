"""Benchmark grpo_kernels.grpo_loss and grpo_loss_from_logits against the eager PyTorch path TRL writes.

Usage (from the repository root):
    .venv/bin/python benchmarks/ops/loss.py                  # full sweep on the CPU (C++ kernels)
    .venv/bin/python benchmarks/ops/loss.py --quick          # small shapes, shorter timing (a smoke run)
    .venv/bin/python benchmarks/ops/loss.py --device cuda    # Triton kernels, timed with do_bench
    .venv/bin/python benchmarks/ops/loss.py --plot           # also write loss_<device>.png

Two ops, fp32 inputs, padded [B, 2048] completions with ~10% padding (mask), loss_type "dapo" with beta = 0.04
(ref log-probs) and old log-probs, epsilon_high = 0.28:
    loss          T in {4k, 32k, 128k} log-probs -> (loss, metrics). Also GSPO ("grpo", sequence level).
    from_logits   T = 4k tokens of logits, V in {32k, 152k} -> (loss, metrics).
Providers:
    eager         grpo_kernels.reference.grpo_loss in fp32: TRL's loss code (tests check it against TRL's own),
                  after log_softmax(logits.float()) + gather for from_logits (as TRL writes it, fp32 [T, V]).
    compiled      torch.compile(eager), static shapes.
    ours          grpo_kernels.grpo_loss / grpo_loss_from_logits (impl="auto": C++ on CPU, Triton on CUDA).
    ours_inplace  from_logits with inplace_backward=True (fwd+bwd): d logits overwrite the logits buffer.
    liger         liger_kernel.transformers.grpo_loss.triton_grpo_loss (from_logits, token level): CUDA only, skipped on
                  CPU with the reason. (Liger's chunked loss takes hidden states: see benchmarks/ops/fused_linear.py.)
Modes: fwd (no grad) and fwd+bwd (timed: the forward and torch.autograd.grad on a leaf input that requires
grad, as in training, where the logits come fresh from the LM head). ours_inplace overwrites its input with
d logits, so it is checked on a copy and timed on its own copy, whose values after the first call are the
previous call's d logits (finite; the work per call is the same).
Every provider is checked against ours before timing. peak_mb: memory one fwd+bwd allocates above what was
resident before it, measured in a fresh process per provider: on CPU the peak RSS (VmHWM, reset through
/proc/self/clear_refs just before the call) minus the RSS before it; on CUDA max_memory_allocated minus
memory_allocated. Rows are appended to benchmarks/results/loss_<device>.csv.
"""

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # importable from a plain checkout too

import torch

import grpo_kernels
from benchmarks.common import (
    RESULTS,
    append_csv,
    compile_checked,
    median_ms,
    plot_bars,
    print_environment,
    run_meta,
    status_kb,
)
from grpo_kernels import reference

COLUMNS = ["timestamp", "device", "torch", "triton", "git_sha", "op", "config", "mode", "T", "V", "provider",
           "median_ms", "gbps", "peak_mb", "speedup_vs_baseline"]  # fmt: skip
LENGTH = 2048
CONFIGS = {
    "dapo": dict(loss_type="dapo", beta=0.04, epsilon_high=0.28),
    "gspo": dict(loss_type="grpo", beta=0.0, epsilon_low=3e-4, epsilon_high=4e-4, importance_sampling_level="sequence"),
}
SHAPES = {
    "loss": {"full": [(4096, 0), (32768, 0), (131072, 0)], "quick": [(4096, 0)]},
    "from_logits": {"full": [(4096, 32000), (4096, 152064)], "quick": [(512, 8192)]},
}


def make_inputs(op: str, t: int, v: int, device: str, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    b, length = max(t // LENGTH, 1), min(t, LENGTH)
    lengths = torch.randint(int(0.8 * length), length + 1, (b,), generator=g)
    lengths[0] = length
    mask = (torch.arange(length)[None, :] < lengths[:, None]).float()
    old = -torch.rand(b, length, generator=g) * 3
    ref = old + 0.05 * torch.randn(b, length, generator=g)
    adv = torch.randn(b, generator=g)
    x = {"old": old, "ref": ref, "mask": mask, "adv": adv}
    if op == "loss":
        x["logps"] = old + 0.1 * torch.randn(b, length, generator=g)
    else:
        x["logits"] = torch.randn(b, length, v, generator=g) * 2
        x["ids"] = torch.randint(0, v, (b, length), generator=g)
    return {k: val.to(device) for k, val in x.items()}


def eager_loss(logps, x, cfg):
    return reference.grpo_loss(logps, x["old"], x["adv"], ref_logps=x["ref"], mask=x["mask"], **cfg)


def eager_from_logits(logits, x, cfg):
    logps = torch.log_softmax(logits.float(), dim=-1).gather(-1, x["ids"][..., None]).squeeze(-1)
    return eager_loss(logps, x, cfg)


def provider_fns(op: str, x, cfg, device: str) -> dict:
    """{provider: f(input) -> (loss, metrics)} for the providers that can run here, else a skip reason (str)."""
    kw = dict(ref_logps=x["ref"], mask=x["mask"], **cfg)
    if op == "loss":
        fns = {"eager": lambda lp: eager_loss(lp, x, cfg),
               "ours": lambda lp: grpo_kernels.grpo_loss(lp, x["old"], x["adv"], **kw)}  # fmt: skip
        return {**fns, "compiled": fns["eager"]}
    fns = {
        "eager": lambda lg: eager_from_logits(lg, x, cfg),
        "ours": lambda lg: grpo_kernels.grpo_loss_from_logits(lg, x["ids"], x["old"], x["adv"], **kw),
        "ours_inplace": lambda lg: grpo_kernels.grpo_loss_from_logits(
            lg, x["ids"], x["old"], x["adv"], inplace_backward=True, **kw
        ),
    }
    fns["compiled"] = fns["eager"]
    fns["liger"] = liger_fn(x, cfg, device)
    return fns


def liger_fn(x, cfg, device):
    if device != "cuda":
        return "liger_kernel's grpo loss on logits is a Triton kernel with no CPU path"
    if cfg.get("importance_sampling_level", "token") != "token":
        return "liger_kernel's triton_grpo_loss has no sequence-level importance sampling"
    try:
        from liger_kernel.transformers.grpo_loss import triton_grpo_loss
    except Exception as exc:
        return f"liger_kernel import failed: {type(exc).__name__}: {exc}"[:200]

    def run(logits):  # liger reads logits [B, L + 1, V] (the last position is dropped), ids [B, L]
        padded = torch.cat([logits, logits[:, -1:]], dim=1)
        loss, metrics = triton_grpo_loss(
            padded, x["old"], x["ref"], x["ids"], x["adv"], x["mask"], temperature=1.0, beta=cfg["beta"],
            eps_low=0.2, eps_high=cfg["epsilon_high"], inplace=False, loss_type=cfg["loss_type"],
            max_completion_length=x["mask"].shape[1], reduce=True,
        )  # fmt: skip
        return loss, {}

    return run


def timed_call(fn, inp, mode):
    if mode == "fwd":

        def fwd():
            with torch.no_grad():
                return fn(inp)[0], None

        return fwd

    def step():
        loss, _ = fn(inp)
        (grad,) = torch.autograd.grad(loss, inp)
        return loss, grad

    return step


def check(got, want):
    torch.testing.assert_close(got[0].float(), want[0].float(), rtol=1e-4, atol=1e-6)
    if got[1] is not None:
        torch.testing.assert_close(got[1].float(), want[1].float(), rtol=1e-3, atol=1e-7)


def measure_peak(op, config, t, v, provider, device) -> float:
    """Memory (MB) one fwd+bwd allocates above what is resident before it, in this (fresh) process."""
    x = make_inputs(op, t, v, device)
    fn = provider_fns(op, x, CONFIGS[config], device)[provider]
    inp = (x["logps"] if op == "loss" else x["logits"]).requires_grad_()
    if provider == "compiled":
        fn = torch.compile(fn, dynamic=False)
    fn(inp.detach().clone().requires_grad_())[0].backward()  # warm-up on a copy: compile, threads, lazy pages
    if device == "cuda":
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    else:
        before = status_kb("VmRSS")
        Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM (the peak RSS) to the current RSS
    loss, _ = fn(inp)
    loss.backward()
    if device == "cuda":
        torch.cuda.synchronize()
        return (torch.cuda.max_memory_allocated() - before) / 2**20
    return (status_kb("VmHWM") - before) / 2**10


def peak_in_fresh_process(op, config, t, v, provider, device) -> float | None:
    cmd = [sys.executable, __file__, "--peak", json.dumps([op, config, t, v, provider, device])]
    out = subprocess.run(cmd, capture_output=True, text=True)
    if out.returncode != 0:
        print(f"  peak memory of {provider} failed: {out.stderr.strip().splitlines()[-1:]}")
        return None
    return round(float(out.stdout.strip().splitlines()[-1]), 1)


def run_point(op, config, t, v, mode, device, min_time, memory) -> dict:
    x = make_inputs(op, t, v, device)
    cfg = CONFIGS[config]
    inp = (x["logps"] if op == "loss" else x["logits"]).requires_grad_(mode == "fwd+bwd")
    fns = provider_fns(op, x, cfg, device)
    want = timed_call(fns["ours"], inp, mode)()
    results = {}
    for name, fn in fns.items():
        if name == "ours_inplace" and mode == "fwd":
            continue
        if isinstance(fn, str):
            print(f"  {op}/{config} {name} skipped ({fn})")
            continue
        own = inp.detach().clone().requires_grad_() if name == "ours_inplace" else inp  # it overwrites its input
        if name == "compiled":
            fn, reason = compile_checked(fn, lambda c: check(timed_call(c, inp, mode)(), want))
            if fn is None:
                print(f"  {op}/{config} T={t} V={v}: compiled skipped ({reason})")
                continue
        else:
            check(timed_call(fn, own, mode)(), want)
        ms = median_ms(timed_call(fn, own, mode), device, min_time)
        peak = peak_in_fresh_process(op, config, t, v, name, device) if memory and mode == "fwd+bwd" else None
        results[name] = (ms, peak)
    return results


def plot(rows, path: Path) -> None:
    """Median ms per shape (log y), one bar per provider, one subplot per panel."""
    plot_bars(
        rows,
        path,
        panel=lambda r: f"{r['op']} {r['config']} {r['mode']}",
        shape=lambda r: f"{r['T']}" + (f"x{r['V']}" if r["V"] else ""),
        xlabel="T (x V)",
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small shapes, shorter timing, no memory runs")
    parser.add_argument("--plot", action="store_true", help="write a PNG of this run next to the CSV")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--csv", type=Path, help="append here, not to benchmarks/results/loss_<device>.csv")
    parser.add_argument("--peak", help=argparse.SUPPRESS)  # internal: one peak-memory measurement
    args = parser.parse_args()
    if args.peak:
        print(measure_peak(*json.loads(args.peak)))
        return
    dev, size = args.device, "quick" if args.quick else "full"
    meta = run_meta(dev)
    print_environment(meta)
    rows, started = [], time.perf_counter()
    points = [("loss", c) for c in CONFIGS] + [("from_logits", "dapo")]
    for (op, config), mode in [(p, m) for p in points for m in ("fwd", "fwd+bwd")]:
        print(f"\n[{op} {config} {mode}] median ms (peak MB), speedup = provider / ours")
        for t, v in SHAPES[op][size]:
            res = run_point(op, config, t, v, mode, dev, 0.1 if args.quick else 0.3, memory=not args.quick)
            nbytes = t * (4 * 5 if op == "loss" else 4 * v * (1 if mode == "fwd" else 3))
            ours_ms = res["ours"][0]
            cells = []
            for name, (ms, peak) in res.items():
                speedup = "" if name == "ours" else round(ms / ours_ms, 3)
                rows.append({**meta, "op": op, "config": config, "mode": mode, "T": t, "V": v, "provider": name,
                             "median_ms": round(ms, 4), "gbps": round(nbytes / ms / 1e6, 3),
                             "peak_mb": "" if peak is None else peak, "speedup_vs_baseline": speedup})  # fmt: skip
                cells.append(f"{name} {ms:.3f}" + (f" ({peak:.0f} MB)" if peak is not None else "")
                             + (f" {speedup}x" if speedup else ""))  # fmt: skip
            print(f"  T={t}" + (f" V={v}" if v else "") + ": " + " | ".join(cells), flush=True)
    csv_path = args.csv or RESULTS / f"loss_{dev}.csv"
    append_csv(rows, csv_path, COLUMNS)
    print(f"\nappended {len(rows)} rows to {csv_path} ({time.perf_counter() - started:.0f} s)")
    if args.plot:
        plot(rows, csv_path.with_suffix(".png") if args.csv else csv_path.parent / f"loss_{dev}.png")


if __name__ == "__main__":
    main()

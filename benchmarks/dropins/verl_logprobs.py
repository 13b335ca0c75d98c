"""verl's fused log-prob + entropy head (its `use_fused_kernels` call shape) on CPU: grpo_kernels vs verl's own torch
implementation vs the unfused path, forward + backward time and peak memory, side by side.

Usage (from the repository root; verl lives in the side venv):
    .venv-trainers/bin/python benchmarks/dropins/verl_logprobs.py              # T=4096, H=896, V=151936, fp32
    .venv-trainers/bin/python benchmarks/dropins/verl_logprobs.py --quick      # T=256, H=64, V=4099 (smoke run)

Inputs (seed 0): hidden [T, H] (randn), the LM head [V, H] (randn * 0.02), random ids, temperature 0.7. Timed: one
forward `(log_probs, entropy) = f(hidden_states, vocab_weights, input_ids, temperature)` and the backward of
sum(g1 log_probs + g2 entropy) (fixed random g1, g2) to hidden and weight, median of --repeats calls.
Providers:
    ours        grpo_kernels.integrations.verl.FusedLinearForPPO (grpo_kernels.fused_linear_logprobs: C++ row kernels,
                logits chunk "auto" = 256 MiB, the backward recomputes each chunk)
    verl_torch  verl.utils.experimental.torch_functional.FusedLinearForPPO(impl_backend="torch") (chunks of 512)
    unfused     logits = hidden W^T / temperature [T, V] in fp32, log_softmax + gather, entropy
                logsumexp - sum softmax * logits, autograd
peak_extra_mb: each provider runs in a fresh process; the peak RSS (VmHWM, reset through /proc/self/clear_refs after
the inputs exist) during its first forward + backward, minus the RSS before it, minus the two gradient buffers every
provider must return (grad_hidden, grad_weight). It is what the call allocates on top of its inputs and outputs.
max_rel_diff: over 2000 fixed elements of each of log_probs, entropy, grad_hidden and grad_weight, the largest
max |x - x_unfused| / max |x_unfused|.
Rows are appended to benchmarks/results/verl_fused_logprobs_cpu.csv.
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

from benchmarks.common import RESULTS, append_csv, print_environment, run_meta, status_kb

PROVIDERS = ("ours", "verl_torch", "unfused")
COLUMNS = ["timestamp", "device", "torch", "triton", "git_sha", "T", "H", "V", "dtype", "provider", "median_ms",
           "peak_extra_mb", "speedup_vs_verl_torch", "max_rel_diff"]  # fmt: skip
TEMPERATURE = 0.7


def unfused(hidden, weight, ids, temperature):
    logits = (hidden @ weight.t() / temperature).float()
    log_probs = logits.log_softmax(-1).gather(-1, ids[:, None]).squeeze(-1)
    entropy = torch.logsumexp(logits, -1) - (logits.softmax(-1) * logits).sum(-1)
    return log_probs, entropy


def provider(name):
    if name == "ours":
        from grpo_kernels.integrations.verl import FusedLinearForPPO

        return FusedLinearForPPO()
    if name == "verl_torch":
        from verl.utils.experimental.torch_functional import FusedLinearForPPO

        return FusedLinearForPPO(impl_backend="torch")
    return unfused


def child(name, t, h, v, repeats) -> dict:
    """One provider in this (fresh) process: peak memory of the first call, median time, a digest of the results."""
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(t, h, generator=gen)
    weight = torch.randn(v, h, generator=gen) * 0.02
    ids = torch.randint(0, v, (t,), generator=gen)
    g1, g2 = torch.randn(t, generator=gen), torch.randn(t, generator=gen)
    fn = provider(name)

    def step():
        hh, ww = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        log_probs, entropy = fn(hh, ww, ids, TEMPERATURE)
        grads = torch.autograd.grad((g1 * log_probs).sum() + (g2 * entropy.float()).sum(), (hh, ww))
        return log_probs.detach(), entropy.detach().float(), *grads

    small = slice(0, 8)  # warm-up on a few tokens: library loading and lazy initialisation out of the peak
    fn(hidden[small], weight, ids[small], TEMPERATURE)
    before = status_kb("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM (the peak RSS) to the current RSS
    start = time.perf_counter()
    out = step()
    times = [time.perf_counter() - start]
    grads_mb = (hidden.numel() + weight.numel()) * hidden.element_size() / 2**20
    peak = (status_kb("VmHWM") - before) / 2**10 - grads_mb
    picks = torch.Generator().manual_seed(1)  # the same 2000 elements of each output in every provider
    digest = [x.reshape(-1)[torch.randint(0, x.numel(), (2000,), generator=picks)].tolist() for x in out]
    del out
    for _ in range(repeats - 1):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return {"median_ms": statistics.median(times) * 1e3, "peak_extra_mb": peak, "digest": digest}


def rel_diff(x, ref) -> float:
    return (x - ref).abs().max().item() / max(ref.abs().max().item(), 1e-30)


def in_fresh_process(name, t, h, v, repeats) -> dict:
    args = json.dumps([name, t, h, v, repeats])
    out = subprocess.run([sys.executable, __file__, "--child", args], capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeError(f"{name} failed:\n{out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a small shape (smoke run)")
    parser.add_argument("--repeats", type=int, default=3, help="timed forward + backward calls per provider")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(*json.loads(args.child))))
        return
    t, h, v = (256, 64, 4099) if args.quick else (4096, 896, 151936)
    meta = run_meta("cpu")
    print_environment(meta)
    results = {name: in_fresh_process(name, t, h, v, args.repeats) for name in PROVIDERS}
    rows = []
    for name, r in results.items():
        ref = results["unfused"]["digest"]
        diff = max(rel_diff(torch.tensor(a), torch.tensor(b)) for a, b in zip(r["digest"], ref, strict=True))
        rows.append({**meta, "T": t, "H": h, "V": v, "dtype": "float32", "provider": name,
                     "median_ms": round(r["median_ms"], 1), "peak_extra_mb": round(r["peak_extra_mb"], 1),
                     "speedup_vs_verl_torch": round(results["verl_torch"]["median_ms"] / r["median_ms"], 2),
                     "max_rel_diff": f"{diff:.2e}"})  # fmt: skip
    append_csv(rows, RESULTS / "verl_fused_logprobs_cpu.csv", COLUMNS)
    print(f"T={t} H={h} V={v} fp32, forward + backward (log-probs and entropy), {args.repeats} calls each")
    print(f"{'provider':<12}{'median ms':>12}{'peak extra MB':>15}{'vs verl_torch':>15}{'max rel diff':>14}")
    for row in rows:
        print(f"{row['provider']:<12}{row['median_ms']:>12}{row['peak_extra_mb']:>15}"
              f"{row['speedup_vs_verl_torch']:>14}x{row['max_rel_diff']:>14}")  # fmt: skip


if __name__ == "__main__":
    main()

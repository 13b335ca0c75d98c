"""Benchmark grpo_kernels.planner.plan_micro_batches: C++ vs the pure-Python reference, both algorithms.

Usage (from the repository root):
    .venv/bin/python benchmarks/ops/planner.py                  # 1k / 10k / 100k samples, both backends
    .venv/bin/python benchmarks/ops/planner.py --quick          # skip the reference at 100k samples
    .venv/bin/python benchmarks/ops/planner.py --csv out.csv    # append rows to out.csv instead

Lengths are lognormal(6.5, 1) clipped to 16..8192 (mean ~1000 tokens), token_budget 65536, 8 ranks, a fixed
seed. The time is the whole public call (argument checks, planning, building the Plan), median of the
repeats after one warmup call. The target: 100k samples in < 0.5 s with the C++ backend. Each row also has
the number of micro-batches per rank, the rank imbalance (max / mean rank load) and the fullest
micro-batch; both backends must produce the same plan (checked). Rows are appended to
benchmarks/results/planner_cpu.csv.
"""

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # importable from a plain checkout too

import numpy as np

from benchmarks.common import RESULTS, append_csv, print_environment, run_meta
from grpo_kernels.planner import plan_micro_batches

TOKEN_BUDGET, NUM_RANKS = 65536, 8
COLUMNS = ["timestamp", "device", "torch", "triton", "git_sha", "N", "num_ranks", "token_budget", "algorithm",
           "provider", "median_ms", "micro_batches", "imbalance", "max_micro_batch_load"]  # fmt: skip


def timed(fn, min_time: float, max_repeats: int) -> tuple:
    """(median seconds, last result) over >= 3 repeats (fewer if one call outlasts min_time), after a warmup."""
    result = fn()
    times = []
    while len(times) < max_repeats and (len(times) < 3 or sum(times) < min_time):
        start = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - start)
        if times[0] > min_time:
            break
    return statistics.median(times), result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="skip the reference backend at 100k samples")
    parser.add_argument("--csv", type=Path, default=RESULTS / "planner_cpu.csv")
    args = parser.parse_args()

    meta = run_meta("cpu")
    print_environment(meta)
    rng = np.random.default_rng(0)
    rows = []
    print(
        f"{'N':>7} {'algorithm':>15} {'provider':>10} {'ms':>10} {'micro-batches':>14} {'imbalance':>10} {'max mb':>7}"
    )
    for n in (1_000, 10_000, 100_000):
        lengths = np.clip(rng.lognormal(6.5, 1.0, n), 16, 8192).astype(np.int64)
        for algorithm in ("karmarkar_karp", "greedy"):
            plans = {}
            for impl in ("cpp", "reference"):
                if args.quick and impl == "reference" and n >= 100_000:
                    continue
                seconds, plan = timed(
                    lambda impl=impl, algorithm=algorithm, lengths=lengths: plan_micro_batches(
                        lengths, token_budget=TOKEN_BUDGET, num_ranks=NUM_RANKS, algorithm=algorithm, impl=impl
                    ),
                    min_time=1.0,
                    max_repeats=20,
                )
                plans[impl] = plan
                max_mb = max(max(loads) for loads in plan.micro_batch_loads)
                print(
                    f"{n:>7} {algorithm:>15} {impl:>10} {seconds * 1e3:>10.2f} {plan.num_micro_batches:>14}"
                    f" {plan.imbalance:>10.6f} {max_mb:>7}"
                )
                rows.append(meta | dict(N=n, num_ranks=NUM_RANKS, token_budget=TOKEN_BUDGET, algorithm=algorithm,
                                        provider=impl, median_ms=round(seconds * 1e3, 3),
                                        micro_batches=plan.num_micro_batches, imbalance=round(plan.imbalance, 7),
                                        max_micro_batch_load=max_mb))  # fmt: skip
            if len(plans) == 2 and plans["cpp"] != plans["reference"]:
                raise SystemExit(f"cpp and reference plans differ at N={n}, {algorithm}")
    append_csv(rows, args.csv, COLUMNS)
    print(f"appended {len(rows)} rows to {args.csv}")


if __name__ == "__main__":
    main()

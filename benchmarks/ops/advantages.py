"""Benchmark grpo_kernels.group_advantages against eager and torch.compile'd PyTorch baselines.

Usage (from the repository root):
    .venv/bin/python benchmarks/ops/advantages.py                  # full sweep on the CPU
    .venv/bin/python benchmarks/ops/advantages.py --quick          # fewer sizes, shorter timing
    .venv/bin/python benchmarks/ops/advantages.py --device cuda    # Triton kernel, timed with do_bench
    .venv/bin/python benchmarks/ops/advantages.py --plot           # also write advantages_<device>.png
    .venv/bin/python benchmarks/ops/advantages.py --csv out.csv    # append rows to out.csv instead

Sweep "uniform": contiguous groups of G, Bernoulli(0.3) rewards (binary, so some groups are all-0/all-1 and
invalid). Baseline: the inline advantage code of TRL's GRPOTrainer, eager and torch.compile'd.
Sweep "variable": group sizes uniform in [1, 2 G_mean - 1] given as int64 offsets. Baseline: an eager
segment implementation (everything from rewards and offsets to the outputs is timed), eager and compiled.
Every baseline is checked against ours once per shape before timing. Rows are appended to
benchmarks/results/advantages_<device>.csv; speedup_vs_baseline is that provider's time / ours' time
(empty on ours' rows). A provider that fails to compile is printed as skipped and left out of the CSV.
"""

import argparse
import itertools
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # importable from a plain checkout too

import torch

import grpo_kernels
from benchmarks.common import RESULTS, append_csv, compile_checked, median_ms, plot_panels, print_environment, run_meta

EPS, MIN_STD = 1e-6, 1e-4
COLUMNS = ["timestamp", "device", "torch", "triton", "git_sha", "sweep", "N", "G", "provider", "median_ms", "gbps",
           "speedup_vs_baseline"]  # fmt: skip


def trl_advantages(rewards: torch.Tensor, group_size: int):
    """TRL GRPOTrainer's group normalization (view, mean/std, repeat_interleave), plus zero-std masking."""
    grouped = rewards.view(-1, group_size)
    mean = grouped.mean(dim=1)
    std = grouped.std(dim=1)
    is_std_zero = std <= MIN_STD
    adv = (rewards - mean.repeat_interleave(group_size)) / (std.repeat_interleave(group_size) + EPS)
    adv = torch.where(is_std_zero.repeat_interleave(group_size), 0.0, adv)
    return adv, ~is_std_zero, mean, std, is_std_zero.float().mean()


def segment_advantages(rewards: torch.Tensor, offsets: torch.Tensor):
    """Eager variable-size groups. torch.segment_reduce beat index_add_ over segment ids by ~2x on CPU."""
    sizes = offsets.diff()
    n = sizes.to(rewards.dtype)
    mean = torch.segment_reduce(rewards, "sum", offsets=offsets) / n
    d = rewards - mean.repeat_interleave(sizes, output_size=rewards.numel())
    std = torch.sqrt(torch.segment_reduce(d * d, "sum", offsets=offsets) / (n - 1).clamp(min=1))
    valid = std > MIN_STD
    scale = torch.where(valid, 1.0 / (std + EPS), 0.0)
    adv = d * scale.repeat_interleave(sizes, output_size=rewards.numel())
    return adv, valid, mean, std, 1.0 - valid.float().mean()


def check(baseline, ours) -> None:
    """Assert a baseline's (advantages, valid, mean, std, invalid_fraction) match ours."""
    for got, want in zip(baseline, ours, strict=True):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def compiled(fn, args, ours):
    """torch.compile fn for these shapes and check it against ours; returns (callable, None) or (None, reason)."""
    return compile_checked(fn, lambda compiled_fn: check(compiled_fn(*args), ours))


def variable_offsets(n: int, g_mean: int, gen: torch.Generator) -> torch.Tensor:
    """int64 offsets [num_groups + 1] of sizes uniform in [1, 2 g_mean - 1], the last one cut to end at n."""
    sizes = torch.randint(1, 2 * g_mean, (2 * n // g_mean + 16,), generator=gen)
    ends = sizes.cumsum(0)
    k = int(torch.searchsorted(ends, n)) + 1
    ends = ends[:k].clone()
    ends[-1] = n
    return torch.cat([torch.zeros(1, dtype=torch.int64), ends])


def make_point(sweep: str, n: int, g: int, device: str, gen: torch.Generator):
    """One sweep point: (ours, {baseline: (fn, args)}, bytes an ideal kernel moves)."""
    rewards = torch.bernoulli(torch.full((n,), 0.3), generator=gen).to(device)
    if sweep == "uniform":
        ours = lambda: grpo_kernels.group_advantages(rewards, group_size=g)
        fn, args, base, num_groups, offset_bytes = trl_advantages, (rewards, g), "trl", n // g, 0
    else:
        offsets = variable_offsets(n, g, gen).to(device)
        ours = lambda: grpo_kernels.group_advantages(rewards, group_offsets=offsets)
        num_groups = offsets.numel() - 1
        fn, args, base, offset_bytes = segment_advantages, (rewards, offsets), "segment", 8 * (num_groups + 1)
    baselines = {f"{base}_eager": (fn, args), f"{base}_compiled": (fn, args)}
    return ours, baselines, 8 * n + 9 * num_groups + offset_bytes


def run_point(label: str, ours_fn, baselines: dict, device: str, min_time: float) -> dict:
    """Check and time the baselines, then ours; returns {provider: median ms, or None if skipped}."""
    ours = ours_fn()
    timings = {}
    for name, (fn, args) in baselines.items():
        if name.endswith("_compiled"):
            fn, reason = compiled(fn, args, ours)
            if fn is None:
                print(f"  {label}: {name} skipped ({reason})")
                timings[name] = None
                continue
        else:
            check(fn(*args), ours)
        timings[name] = median_ms(lambda fn=fn, args=args: fn(*args), device, min_time)
    timings["ours"] = median_ms(ours_fn, device, min_time)
    return timings


def plot(rows, path: Path) -> None:
    """ms vs N (log-log), one line per provider, one subplot per uniform G and per variable G_mean."""
    panels = {}
    for r in sorted(rows, key=lambda r: (r["sweep"] != "uniform", r["G"])):
        panels.setdefault(f"{r['sweep']}, {'G' if r['sweep'] == 'uniform' else 'G_mean'}={r['G']}", []).append(r)

    def draw(ax, panel_rows):
        series = {}
        for r in panel_rows:
            series.setdefault(r["provider"], []).append((r["N"], r["median_ms"]))
        for provider, pts in series.items():
            ax.loglog(*zip(*pts, strict=True), marker="o", base=2, label=provider)
        ax.set(xlabel="N", ylabel="median ms")
        ax.legend(fontsize=7)

    plot_panels(panels, path, draw)


def main() -> None:
    """Run both sweeps, print the table, append the CSV, optionally plot."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer sizes and shorter timing")
    parser.add_argument("--plot", action="store_true", help="write a PNG of this run next to the CSV")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--csv", type=Path, help="append here, not to benchmarks/results/advantages_<device>.csv")
    args = parser.parse_args()
    dev, min_time = args.device, (0.1 if args.quick else 0.3)
    csv_path = args.csv or RESULTS / f"advantages_{dev}.csv"
    meta = run_meta(dev)
    print_environment(meta)
    gen = torch.Generator().manual_seed(0)
    rows, started = [], time.perf_counter()

    sweeps = [
        ("uniform", [12, 14, 16, 18, 20, 22], (4, 8, 16, 64)),
        ("variable", [16, 18, 20], (4, 16, 64)),
    ]
    if args.quick:  # a smoke run of every provider: the smallest size at the smallest and largest G, one variable
        sweeps = [("uniform", [12], (4, 64)), ("variable", [16], (64,))]
    for sweep, log_ns, gs in sweeps:
        base = "trl" if sweep == "uniform" else "segment"
        head = f"{'N':>9} {'G' if sweep == 'uniform' else 'G_mean':>6} {base + '_eager':>16} {base + '_compiled':>16}"
        print(f"\n[{sweep}] median ms\n{head} {'ours':>9} {'vs eager':>9} {'vs compiled':>11}")
        for n, g in itertools.product([2**k for k in log_ns], gs):
            ours, baselines, nbytes = make_point(sweep, n, g, dev, gen)
            t = run_point(f"{sweep} N={n} G={g}", ours, baselines, dev, min_time)
            for provider, ms in t.items():
                if ms is not None:
                    speedup = "" if provider == "ours" else round(ms / t["ours"], 3)
                    rows.append({**meta, "sweep": sweep, "N": n, "G": g, "provider": provider,
                                 "median_ms": round(ms, 5), "gbps": round(nbytes / ms / 1e6, 3),
                                 "speedup_vs_baseline": speedup})  # fmt: skip
            base_ms = [t[k] for k in baselines]
            cells = " ".join(f"{ms:16.3f}" if ms is not None else f"{'skipped':>16}" for ms in base_ms)
            ratios = [f"{ms / t['ours']:.2f}x" if ms is not None else "-" for ms in base_ms]
            print(f"{n:>9} {g:>6} {cells} {t['ours']:9.3f} {ratios[0]:>9} {ratios[1]:>11}", flush=True)

    append_csv(rows, csv_path, COLUMNS)
    print(f"\nappended {len(rows)} rows to {csv_path} ({time.perf_counter() - started:.0f} s)")
    if args.plot:
        plot(rows, csv_path.with_suffix(".png") if args.csv else csv_path.parent / f"advantages_{dev}.png")


if __name__ == "__main__":
    main()

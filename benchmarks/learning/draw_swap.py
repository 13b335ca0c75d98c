"""What the draw-swapping runs of `benchmarks/learning/vs_trl.py` show, from their committed files alone.

    python -m benchmarks.learning.draw_swap [--step 4] [--out benchmarks/results/learning_vs_trl/draw_swap.md]

1. Same draws: every `trl_ourdraw` run (TRL drawing its rollouts from our seeded stream) against our run of the same
   seed and loss, step by step: the largest difference in mean reward and completion length, the largest relative
   difference in gradient norm, and how many held-out evaluations agree exactly.
2. Held-out success after --step steps, per arm (TRL's own draw, ours, ours with HF's draw, TRL with ours): mean and
   95 % t-interval over the seeds, sd, range, runs below 0.25; then differences paired by seed (a seed fixes the
   prompt stream, shared by every arm) with their 95 % t-intervals, and a two-sided permutation test of the
   difference in means on the unpaired values (20,000 relabellings, seeded).
3. The first step's rollouts, per arm: every arm samples them from the same model (the base policy) on the same
   prompts, so only the draw differs: mean reward, completion length, truncated fraction and (ours only: TRL's
   count misses all-equal groups of non-integer reward) the invalid-group rate, mean and 95 % interval over the
   seeds and paired differences.
Arms read from results/learning_vs_trl (the 40-step runs, seeds 0-4), results/learning_vs_trl_early (4-step runs of
more seeds), results/learning_vs_trl_hfdraw and results/learning_vs_trl_ourdraw.
"""

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # importable from a plain checkout too

from benchmarks.common import ROOT
from benchmarks.learning.intervals import mean_ci, permutation_p

RESULTS = ROOT / "benchmarks" / "results"
ARMS = {  # name: (result directories, run-name prefix)
    "TRL, its own draw": (("learning_vs_trl", "learning_vs_trl_early"), "trl_dapo_seed"),
    "ours, our draw": (("learning_vs_trl", "learning_vs_trl_early"), "grpo_kernels_dapo_seed"),
    "ours, HF's draw": (("learning_vs_trl_hfdraw",), "grpo_kernels_hfdraw_dapo_seed"),
    "TRL, our draw": (("learning_vs_trl_ourdraw",), "trl_ourdraw_dapo_seed"),
}
PAIRS = (("ours, our draw", "TRL, its own draw"), ("ours, HF's draw", "TRL, its own draw"),
         ("ours, our draw", "ours, HF's draw"))  # fmt: skip


def _jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def finished(results: Path, dirs, prefix: str) -> dict:
    """{seed: run directory} of the finished runs (summary.json) named prefix<seed> under dirs/runs."""
    out = {}
    for name in dirs:
        for run in sorted((results / name / "runs").glob(f"{prefix}*")):
            if (run / "summary.json").exists():
                out[int(run.name[len(prefix) :])] = run
    return out


def held_out_after(run: Path, steps: int) -> float | None:
    """The held-out success evaluated after `steps` steps (eval.jsonl's step is the 0-based last step)."""
    return next((e["eval_success"] for e in _jsonl(run / "eval.jsonl") if e["step"] == steps - 1), None)


def paired(a: dict, b: dict) -> tuple:
    """(seeds in both, mean of a - b over them, half-width of its 95 % t-interval)."""
    seeds = sorted(set(a) & set(b))
    diff = [a[s] - b[s] for s in seeds]
    mean, half = mean_ci(diff)
    return seeds, mean, half


def same_draws(results: Path) -> list[str]:
    ours = finished(results, ("learning_vs_trl",), "grpo_kernels_dapo_seed")
    theirs = finished(results, ("learning_vs_trl_ourdraw",), "trl_ourdraw_dapo_seed")
    seeds = sorted(set(ours) & set(theirs))
    if not seeds:
        return []
    pairs, reward, length, norm, agree, evals = 0, 0.0, 0.0, 0.0, 0, 0
    for s in seeds:
        mine = {m["step"]: m for m in _jsonl(ours[s] / "metrics.jsonl")}
        for m in _jsonl(theirs[s] / "metrics.jsonl"):  # TRL's names for the same quantities
            o = mine[m["step"]]
            pairs += 1
            reward = max(reward, abs(o["reward"] - m["reward"]))
            length = max(length, abs(o["completion_length"] - m["completions/mean_length"]))
            norm = max(norm, abs(o["grad_norm"] - m["grad_norm"]) / o["grad_norm"])
        mine = {e["step"]: e["eval_success"] for e in _jsonl(ours[s] / "eval.jsonl")}
        for e in _jsonl(theirs[s] / "eval.jsonl"):
            evals, agree = evals + 1, agree + (e["eval_success"] == mine.get(e["step"]))
    return ["## Same draws: TRL drawing from our stream against our run", "",
            f"Seeds {', '.join(map(str, seeds))}, {pairs} (seed, step) pairs: mean reward differs by at most "
            f"{reward:.2g}, completion length by at most {length:.2g} tokens, gradient norm by at most "
            f"{100 * norm:.2g} %; {agree} of {evals} held-out evaluations equal.", ""]  # fmt: skip


def held_out_table(results: Path, steps: int) -> list[str]:
    values = {}
    for name, (dirs, prefix) in ARMS.items():
        runs = finished(results, dirs, prefix)
        values[name] = {s: v for s, run in runs.items() if (v := held_out_after(run, steps)) is not None}
    lines = [f"## Held-out success after step {steps} (loss dapo)", "",
             "| arm | seeds | mean ± 95 % interval | sd | min - max | below 0.25 |", "|---|---:|---:|---:|---:|---:|"]
    for name, v in values.items():
        if len(v) < 2:
            continue
        x = list(v.values())
        mean, half = mean_ci(x)
        lines.append(f"| {name} | {len(x)} ({min(v)}-{max(v)}) | {mean:.3f} ± {half:.3f} | {statistics.stdev(x):.3f} "
                     f"| {min(x):.3f} - {max(x):.3f} | {sum(y < 0.25 for y in x)} |")  # fmt: skip
    lines += ["", "| difference | seeds paired | mean ± 95 % interval | permutation p (unpaired) |",
              "|---|---:|---:|---:|"]
    for a, b in PAIRS:
        if len(values[a]) < 2 or len(values[b]) < 2:
            continue
        seeds, mean, half = paired(values[a], values[b])
        if len(seeds) < 2:
            continue
        p = permutation_p(list(values[a].values()), list(values[b].values()))
        lines.append(f"| {a} - {b} | {len(seeds)} | {mean:+.3f} ± {half:.3f} | {p:.2f} |")
    return lines + [""]


FIRST_STEP = {  # quantity: (our metric, TRL's metric)
    "reward": ("reward", "reward"),
    "completion length": ("completion_length", "completions/mean_length"),
    "truncated": ("truncated_fraction", "completions/clipped_ratio"),
    "invalid groups": ("invalid_group_rate", None),
}


def first_step_table(results: Path) -> list[str]:
    values = {}  # quantity: {arm: {seed: value}}
    for name, (dirs, prefix) in ARMS.items():
        for s, run in finished(results, dirs, prefix).items():
            m = next((m for m in _jsonl(run / "metrics.jsonl") if m["step"] == 0), None)
            for q, keys in FIRST_STEP.items():
                key = keys[1] if name.startswith("TRL") else keys[0]
                if m is not None and key is not None:
                    values.setdefault(q, {}).setdefault(name, {})[s] = m[key]
    lines = ["## The first step's rollouts (same model, same prompts: only the draw differs)", "",
             "| quantity | " + " | ".join(ARMS) + " |", "|---|" + "---:|" * len(ARMS)]  # fmt: skip
    for q, arms in values.items():
        cells = []
        for name in ARMS:
            x = list(arms.get(name, {}).values())
            cells.append(f"{mean_ci(x)[0]:.3f} ± {mean_ci(x)[1]:.3f} ({len(x)})" if len(x) >= 2 else "-")
        lines.append(f"| {q} | " + " | ".join(cells) + " |")
    lines += ["", "| quantity | difference | seeds paired | mean ± 95 % interval |", "|---|---|---:|---:|"]
    for q, arms in values.items():
        for a, b in PAIRS:
            if a in arms and b in arms:
                seeds, mean, half = paired(arms[a], arms[b])
                if len(seeds) >= 2:
                    lines.append(f"| {q} | {a} - {b} | {len(seeds)} | {mean:+.3f} ± {half:.3f} |")
    return lines + [""]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--step", type=int, default=4, help="the held-out evaluation after this many steps")
    parser.add_argument("--results", type=Path, default=RESULTS)
    parser.add_argument("--out", type=Path, default=RESULTS / "learning_vs_trl" / "draw_swap.md")
    args = parser.parse_args(argv)
    if args.step < 1:
        raise SystemExit(f"draw-swap: --step must be >= 1, got {args.step}")
    lines = ["# The random draws swapped between TRL and grpo-kernels", "",
             f"Command: `python -m benchmarks.learning.draw_swap --step {args.step}`", "",
             *same_draws(args.results), *held_out_table(args.results, args.step),
             *first_step_table(args.results)]  # fmt: skip
    args.out.write_text("\n".join(lines))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())

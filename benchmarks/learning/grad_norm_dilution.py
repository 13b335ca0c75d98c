"""The gradient norm of GRPO runs with the invalid groups' dilution taken out, from their metrics.jsonl alone.

    python -m benchmarks.learning.grad_norm_dilution RUN_DIR [RUN_DIR ...] [--windows 0,10,20,40,60]

Without dynamic sampling a step's loss (token-mean: "dapo") is normalized by the tokens of every group, and an
invalid group (all rewards equal: advantage 0) adds tokens but no gradient, so the logged gradient norm is the
valid groups' gradient scaled by about their share of the tokens. With dynamic sampling only valid groups are kept
and nothing dilutes it. "undiluted" = grad_norm / (1 - invalid_group_rate) puts both on one footing (equal lengths
assumed: an approximation). TRL's frac_reward_zero_std is the invalid-group rate. Steps without an update (every
group invalid) are left out. Per window of steps: the mean gradient norm, the mean undiluted norm and the mean
completion length.
"""

import argparse
import json
import statistics
import sys
from pathlib import Path

TRL_NAMES = {"frac_reward_zero_std": "invalid_group_rate", "completions/mean_length": "completion_length"}


def rows_of(run: Path) -> list[dict]:
    """The steps with an update; a TRL run's names (benchmarks/learning/trl_worker.py logs TRL's) mapped to ours."""
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    rows = [{**r, **{ours: r[theirs] for theirs, ours in TRL_NAMES.items() if theirs in r}} for r in rows]
    return [r for r in rows if "grad_norm" in r and r["invalid_group_rate"] < 1]


def table(runs: list[Path], edges: list[int]) -> str:
    windows = list(zip(edges, edges[1:], strict=False))
    head = " | ".join(f"steps {a}-{b - 1}: grad norm / undiluted / length" for a, b in windows)
    lines = [f"| run | {head} |", "|---|" + "---:|" * len(windows)]
    for run in runs:
        rows, cells = rows_of(run), []
        for a, b in windows:
            w = [r for r in rows if a <= r["step"] < b]
            if not w:
                cells.append("-")
                continue
            gn = statistics.mean(r["grad_norm"] for r in w)
            undiluted = statistics.mean(r["grad_norm"] / (1 - r["invalid_group_rate"]) for r in w)
            cells.append(f"{gn:.1f} / {undiluted:.1f} / {statistics.mean(r['completion_length'] for r in w):.1f}")
        lines.append(f"| {run.name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+", type=Path, help="run directories with a metrics.jsonl")
    parser.add_argument("--windows", default="0,10,20,40,60", help="the steps where the windows start and end")
    args = parser.parse_args(argv)
    missing = [str(r) for r in args.runs if not (r / "metrics.jsonl").is_file()]
    if missing:
        raise SystemExit(f"grad-norm-dilution: no metrics.jsonl in {', '.join(missing)}")
    try:
        edges = [int(e) for e in args.windows.split(",")]
    except ValueError:
        raise SystemExit(f"grad-norm-dilution: --windows {args.windows!r}: increasing step numbers, e.g. "
                         "0,10,20") from None
    if len(edges) < 2 or edges != sorted(set(edges)):
        raise SystemExit(f"grad-norm-dilution: --windows {args.windows!r}: at least two increasing step numbers")
    print(table(args.runs, edges))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Learning vs TRL, round 3: the primary comparison fixed in benchmarks/results/learning_vs_trl_round3/endpoints.md,
from the committed run files alone.

    python -m benchmarks.learning.round3 [--results DIR] [--write]

Held-out success after step 4 (the `eval_success` of the evaluation after 4 optimizer steps: eval.jsonl's "step" is
the 0-based index of the last step done, so its line with "step": 3, in the 40-step runs of round 1 as in the 4-step
ones), ours (`grpo_kernels`) against TRL (`trl`), loss dapo, seeds 0-46 of each arm, pooled as endpoints.md says
(round 1's values, since reproduction.md found them reproduced):
- ours: seeds 0-4 from learning_vs_trl/runs (the 40-step runs), 5-20 from learning_vs_trl_early/runs, 21-46 from
  learning_vs_trl_round3/runs;
- TRL: seeds 0-4 from learning_vs_trl/runs, 5-19 from learning_vs_trl_early/runs, 20-46 from
  learning_vs_trl_round3/runs.
A run counts once it has finished (its summary.json); a finished run without the step-4 line is an error.

The primary: ours - TRL, the difference of the means with its 95 % Welch interval (`intervals.welch_difference`) and
the two-sided permutation p (`intervals.permutation_p`, 20,000 relabellings, seed 0); resolved when the Welch
interval excludes 0. Reported beside it, not the primary: the mean difference paired by seed and its 95 % t-interval.
Not resolved: the bound (|mean| + half-width, the largest gap the interval leaves possible at 95 %) and the gap these
seeds find four times in five (`intervals.smallest_gap`). Until each arm has its 47 seeds the report says which are
missing and labels every number interim. --write writes the report to <results>/learning_vs_trl_round3/primary.md;
benchmarks/readme.py puts the same comparison on the performance page.
"""

import argparse
import json
import re
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # importable from a plain checkout too

from benchmarks.common import ROOT
from benchmarks.learning.intervals import mean_ci, permutation_p, smallest_gap, welch_difference

RESULTS = ROOT / "benchmarks" / "results"
STUDY = "learning_vs_trl_round3"
STEPS = 4  # the endpoint: held-out success after this many optimizer steps
EVAL_STEP = STEPS - 1  # eval.jsonl's "step" of that evaluation (0-based: the last step done)
SEEDS = range(47)  # per arm
ROUNDS, PERMUTATION_SEED = 20_000, 0
ARMS = {"grpo_kernels": "ours", "trl": "TRL"}  # trainer: the name the report gives it
SOURCES = {  # trainer: ((result directory, the seeds read from it), ...): endpoints.md's pooling
    "grpo_kernels": (("learning_vs_trl", range(0, 5)), ("learning_vs_trl_early", range(5, 21)), (STUDY, range(21, 47))),
    "trl": (("learning_vs_trl", range(0, 5)), ("learning_vs_trl_early", range(5, 20)), (STUDY, range(20, 47))),
}


def _jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def step4_success(run: Path) -> float:
    """The run's held-out success after step 4: its eval.jsonl line with "step" == EVAL_STEP; ValueError without one
    (or with two that disagree)."""
    path = run / "eval.jsonl"
    rows = _jsonl(path) if path.exists() else []
    hits = {row["eval_success"] for row in rows if row.get("step") == EVAL_STEP}
    if len(hits) != 1:
        steps = [row.get("step") for row in rows]
        what = "no line" if not hits else f"lines that disagree ({sorted(hits)})"
        raise ValueError(f"{path}: {what} with \"step\": {EVAL_STEP}, the held-out evaluation after {STEPS} optimizer "
                         f"steps (\"step\" is the 0-based last step done); its lines' steps: {steps}")  # fmt: skip
    return hits.pop()


@dataclass
class Pool:
    """The pooled step-4 values and what is not there yet."""

    values: dict  # trainer: {seed: held-out success after step 4}
    sources: dict  # trainer: {seed: the result directory it came from}
    died: dict  # trainer: [seeds whose run directory has no summary.json (a run that died: failed.txt)]
    outside: dict  # trainer: [(directory, seed, step-4 value or None) of finished runs outside the seeds planned
    # from that directory: not pooled]

    def missing(self, trainer: str) -> list[int]:
        return [s for s in SEEDS if s not in self.values[trainer]]

    @property
    def complete(self) -> bool:
        return not any(self.missing(t) for t in ARMS)


def pooled(results: Path = RESULTS) -> Pool:
    """Every finished run endpoints.md pools, by trainer and seed, with its step-4 held-out success."""
    pool = Pool({t: {} for t in ARMS}, {t: {} for t in ARMS}, {t: [] for t in ARMS}, {t: [] for t in ARMS})
    for trainer, sources in SOURCES.items():
        name = re.compile(rf"{trainer}_dapo_seed(\d+)")
        for directory, seeds in sources:
            for run in sorted((results / directory / "runs").glob(f"{trainer}_dapo_seed*")):
                match = name.fullmatch(run.name)
                if not match:
                    continue
                seed = int(match[1])
                if seed not in seeds:
                    if (run / "summary.json").exists():
                        try:
                            value = step4_success(run)
                        except ValueError:
                            value = None
                        pool.outside[trainer].append((directory, seed, value))
                elif not (run / "summary.json").exists():
                    pool.died[trainer].append(seed)
                else:
                    pool.values[trainer][seed] = step4_success(run)
                    pool.sources[trainer][seed] = directory
    return pool


@dataclass
class Primary:
    """endpoints.md's primary comparison, ours - TRL, on the seeds that are there."""

    seeds: dict  # trainer: the seeds compared
    n: dict  # trainer: how many
    mean: dict  # trainer: (mean, half-width of its 95 % t-interval)
    sd: dict  # trainer: sample sd
    diff: float  # mean(ours) - mean(TRL)
    half: float  # half-width of its 95 % Welch interval
    p: float  # two-sided permutation p
    paired_seeds: int
    paired: tuple  # (mean of ours - TRL seed by seed, half-width of its 95 % t-interval)

    @property
    def resolved(self) -> bool:
        """The Welch interval excludes 0."""
        return self.diff - self.half > 0 or self.diff + self.half < 0

    @property
    def bound(self) -> float:
        """The largest gap the Welch interval leaves possible at 95 %."""
        return abs(self.diff) + self.half

    @property
    def gap(self) -> float:
        """The true gap these seeds find four times in five (two-sided, 0.05)."""
        ours, trl = ARMS
        return smallest_gap(self.sd[ours], self.sd[trl], self.n[ours], self.n[trl])


def primary(values: dict) -> Primary:
    """The comparison of values ({trainer: {seed: success}}), each arm's values in seed order."""
    ours, trl = ({s: values[t][s] for s in sorted(values[t])} for t in ARMS)
    if min(len(ours), len(trl)) < 2:
        raise ValueError(f"the primary comparison needs two seeds per arm at least, got {len(ours)} (ours) and "
                         f"{len(trl)} (TRL)")  # fmt: skip
    a, b = list(ours.values()), list(trl.values())
    arms = dict(zip(ARMS, (a, b), strict=True))
    diff, half = welch_difference(a, b)
    both = [s for s in ours if s in trl]
    paired = mean_ci([ours[s] - trl[s] for s in both]) if both else (float("nan"), float("nan"))
    return Primary(seeds={t: sorted(values[t]) for t in ARMS}, n={t: len(v) for t, v in arms.items()},
                   mean={t: mean_ci(v) for t, v in arms.items()}, sd={t: statistics.stdev(v) for t, v in arms.items()},
                   diff=diff, half=half, p=permutation_p(a, b, rounds=ROUNDS, seed=PERMUTATION_SEED),
                   paired_seeds=len(both), paired=paired)  # fmt: skip


def spans(seeds) -> str:
    """[0, 1, 2, 5, 7, 8] -> '0-2, 5, 7-8'."""
    out, seeds = [], sorted(seeds)
    for i, s in enumerate(seeds):
        if i and s == seeds[i - 1] + 1:
            out[-1][1] = s
        else:
            out.append([s, s])
    return ", ".join(f"{a}" if a == b else f"{a}-{b}" for a, b in out) or "none"


def counts(pool: Pool) -> str:
    """'N of 47 seeds per arm' ('N (ours) and M (TRL) of 47 ...' when they differ)."""
    n = {t: len(pool.values[t]) for t in ARMS}
    ours, trl = n.values()
    each = f"{ours}" if ours == trl else " and ".join(f"{k} ({ARMS[t]})" for t, k in n.items())
    return f"{each} of {len(SEEDS)} seeds per arm"


def state(pool: Pool) -> str:
    """'complete, 47 of 47 seeds per arm' or 'interim, N of 47 seeds per arm'."""
    return f"{'complete' if pool.complete else 'interim'}, {counts(pool)}"


def findings(result: Primary, interim: bool) -> list[str]:
    """The comparison as a list: the arms, the primary, the paired difference, the verdict (the performance page's
    block and the report's body); interim: every number labelled so, the verdict not the endpoint's."""
    tag = "interim; " if interim else ""
    lines = []
    for t in ARMS:
        mean, half = result.mean[t]
        lines.append(f"- {ARMS[t]} (`{t}`): {mean:.3f} ± {half:.3f} (95 % t-interval), sd {result.sd[t]:.3f}, "
                     f"{result.n[t]} seeds ({spans(result.seeds[t])}).")  # fmt: skip
    low, high = result.diff - result.half, result.diff + result.half
    lines.append(f"- **ours - TRL ({tag}the primary): {result.diff:+.3f} ± {result.half:.3f}** (95 % Welch interval "
                 f"{low:+.3f} to {high:+.3f}); permutation p {result.p:.3f} (two-sided, {ROUNDS:,} relabellings, seed "
                 f"{PERMUTATION_SEED}).")  # fmt: skip
    mean, half = result.paired
    lines.append(f"- Paired by seed ({tag}reported, not the primary): {mean:+.3f} ± {half:.3f} (95 % t-interval, "
                 f"{result.paired_seeds} seeds in both arms).")  # fmt: skip
    if result.resolved:
        verdict = "resolved: the Welch interval excludes 0"
        then = (f"What {'would follow' if interim else 'follows'} (endpoints.md): the swap arms on the same seeds, "
                "then bisect to the cause, fix it and rerun the comparison.")  # fmt: skip
    else:
        verdict = "not resolved: the Welch interval includes 0"
        then = (f"Bound: {result.bound:.3f} (|mean| + half-width, the largest gap the interval leaves possible at "
                f"95 %); these seeds would find a true gap of {result.gap:.3f} four times in five (smallest_gap, "
                "two-sided at 0.05).")  # fmt: skip
    if interim:
        lines.append(f"- Interim verdict, not the endpoint (read at {len(SEEDS)} seeds per arm): {verdict} so far. "
                     f"{then}")  # fmt: skip
    else:
        lines.append(f"- Verdict: **{verdict}**. {then}")
    return lines


def report(results: Path = RESULTS) -> str:
    pool = pooled(results)
    result = primary(pool.values)
    lines = ["# Learning vs TRL, round 3: the primary comparison", "",
             "Command: `python -m benchmarks.learning.round3 --write` (the endpoint and its analysis: `endpoints.md`; "
             "the pooling of round 1's values: `reproduction.md`).", "",
             f"Held-out success after step {STEPS} (eval.jsonl's line with \"step\": {EVAL_STEP}), loss dapo, ours "
             "(`grpo_kernels`) against TRL (`trl`).", ""]  # fmt: skip
    if pool.complete:
        lines += [f"**Complete: {counts(pool)}.**", ""]
    else:
        lines += [f"**Interim: {counts(pool)}.** The study is incomplete: every number below is interim, not the "
                  f"endpoint, which is read at {len(SEEDS)} seeds per arm. Missing seeds: "
                  + "; ".join(f"{ARMS[t]} {spans(pool.missing(t))} ({len(pool.missing(t))})" for t in ARMS)
                  + ".", ""]  # fmt: skip
    lines += findings(result, not pool.complete) + [""]
    lines += ["Where each arm's seeds came from (endpoints.md's pooling):", ""]
    for t in ARMS:
        by_dir = {}
        for seed, directory in sorted(pool.sources[t].items()):
            by_dir.setdefault(directory, []).append(seed)
        where = "; ".join(f"`{d}/runs` {spans(s)}" for d, s in by_dir.items())
        lines.append(f"- {ARMS[t]}: {where}.")
    for t in ARMS:
        if pool.died[t]:
            lines.append(f"- {ARMS[t]}: runs without summary.json (died or unfinished), not counted: seeds "
                         f"{spans(pool.died[t])}.")  # fmt: skip
        for directory in dict.fromkeys(d for d, _, _ in pool.outside[t]):
            runs = [(s, v) for d, s, v in pool.outside[t] if d == directory]
            same = [s for s, v in runs if s in pool.values[t] and v == pool.values[t][s]]
            differ = [s for s, v in runs if s in pool.values[t] and v != pool.values[t][s]]
            note = f"; step-4 value equal to the pooled one: {spans(same)}" if same else ""
            note += f"; step-4 value NOT equal to the pooled one: {spans(differ)}" if differ else ""
            lines.append(f"- {ARMS[t]}: finished runs in `{directory}/runs` outside the seeds read from it, not "
                         f"pooled: {spans(s for s, _ in runs)}{note}.")  # fmt: skip
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--results", type=Path, default=RESULTS, help="the directory holding the result directories")
    parser.add_argument("--write", action="store_true", help=f"write the report to <results>/{STUDY}/primary.md")
    args = parser.parse_args(argv)
    text = report(args.results)
    print(text, end="")
    if args.write:
        (args.results / STUDY / "primary.md").write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())

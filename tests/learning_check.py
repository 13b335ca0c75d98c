"""The learning check: does a short GRPO run still learn, at full strength? Six seeds of a tiny task, one verdict.

Each seed is a real `grpo_kernels.train.train` run of the built-in tiny decoder on single-digit addition: RL_STEPS
steps of DAPO with G = 8, 16 prompts per step, two optimizer iterations per rollout (so that the ratio clip acts),
lr 5e-4, evaluated on 256 held-out prompts before and after RL, from one shared 120-step SFT warm start (seed 0's:
`fixed_warm_start`). The check passes when the held-out success gained, averaged over SEEDS, is at least
MIN_MEAN_GAIN. The check of six seeds took 52 s of CPU, the old one (three seeds of 80 steps, each from its own warm
start) 54 s, run side by side on a loaded machine; on the test's seeds 0-5 it gains +0.151.

Calibration (one core each, this package's CPU paths, an Intel Xeon with AVX-512; the rows are in
benchmarks/results/learning_check/calibration.csv, the rates in calibration.md beside it; seeds 100-159, none of the
test's):
- as configured: every one of 60 seeds gained (+0.09 to +0.22, mean +0.154, sd 0.028). A check of six seeds fails
  0.15 % of the time (normal approximation of the six-seed mean; 0.09 % resampling the 60 gains; 0 of 10 disjoint
  sets of six).
- a weak learner, lr WEAK_LR (lr / 5): +0.092 (sd 0.023), 0.60x the real gain over the same 60 seeds; the check fails
  it 99.8 % of the time (10 of 10 sets). The gain falls slowly with the lr: 0.68x at lr / 4.2 (failed 90 %), 0.51x
  at lr / 6.25, 0.36x at lr / 16.7, so the check fails any learner at 0.6x or less of the gain at least ~99 % of the
  time, and one at 0.68x nine times in ten.
- broken on purpose: the advantage's sign flipped -0.24 (4 seeds); old log-probs taken from the policy 8 optimizer
  steps back -0.13 (12 seeds, every one below 0); the ratio clip removed (epsilon_low 0.999999, epsilon_high 1e9) at
  NO_CLIP_LR, 2x this lr: +0.024 (18 seeds, the check fails it 99.97 %), where the clip on gains +0.139 (fails
  17 %). At this lr without the clip +0.118 (6 seeds: the clip matters less there); at 1.5e-3 the run fails with
  the clip too (-0.03, 4 seeds), so the no-clip variant runs at 1e-3, where the clip decides.
- why one warm start: each seed's own warm start (as before) starts between 0.10 and 0.38 held-out, and that spread
  made the gain's: sd 0.12 per seed (80 steps, 10 seeds) against 0.028 from one warm start, where a learner at half
  the lr still gained 0.88x of the real one. Three seeds of 80 steps could not tell a learner at 0.6x from the real
  one; six of 40 steps from one warm start do, in the same CPU time.
Every number above is reproduced by this file run as a script (one run at a time, one thread: pin it to a core),
each run appending its seeds to a CSV:

    OMP_NUM_THREADS=1 python tests/learning_check.py --seeds 100-159 --out cal.csv              # as configured
    OMP_NUM_THREADS=1 python tests/learning_check.py --seeds 100-159 --variant weak --out cal.csv
    OMP_NUM_THREADS=1 python tests/learning_check.py --seeds 100-117 --variant no-clip --out cal.csv  # or stale
    OMP_NUM_THREADS=1 python tests/learning_check.py --seeds 100-117 --lr 1e-3 --out cal.csv    # the clip on there
    python tests/learning_check.py --rates cal.csv                                              # the rates
"""

import argparse
import contextlib
import copy
import csv
import random
import sys
import tempfile
from pathlib import Path
from statistics import NormalDist, fmean, stdev
from unittest import mock

import torch

from grpo_kernels.train import build, step
from grpo_kernels.train.build import load
from grpo_kernels.train.config.io import load_config
from grpo_kernels.train.rollout import batch as rollout
from grpo_kernels.train.trainer import train

SEEDS = (0, 1, 2, 3, 4, 5)
WARM_START_SEED = 0
SFT_STEPS = 120
RL_STEPS = 40
LR = 5e-4
MIN_MEAN_GAIN = 0.12
WEAK_LR = 1e-4
NO_CLIP_LR = 1e-3
STALE_LAG = 8
NO_CLIP = ("--loss.epsilon_low=0.999999", "--loss.epsilon_high=1e9")


def overrides(seed: int, run_dir) -> list[str]:
    return [f"--seed={seed}", "--model.name=tiny", "--model.activation_checkpointing=none", "--task.name=add",
            "--task.difficulty=1", f"--task.sft_warmup_steps={SFT_STEPS}", "--task.num_eval_prompts=256",
            "--sampling.sampler=hf", "--sampling.group_size=8", "--sampling.prompts_per_step=16",
            "--sampling.max_new_tokens=4", "--loss.loss_type=dapo", f"--optim.lr={LR}", "--optim.num_iterations=2",
            f"--optim.steps={RL_STEPS}", f"--logging.run_dir={run_dir}", f"--logging.log_every={RL_STEPS}",
            "--checkpoint.every=0"]  # fmt: skip


def run(seed: int, run_dir, extra: tuple = ()) -> dict:
    """One seed's run from the shared warm start: `train`'s summary."""
    config = load_config(None, [*overrides(seed, run_dir), *extra])
    with fixed_warm_start():
        return train(config, log=lambda *a, **k: None)


def gains(tmp_path, seeds=SEEDS, extra: tuple = ()) -> list[float]:
    """Held-out success after RL minus before, one per seed; extra: more overrides (a broken setting)."""
    out = []
    for seed in seeds:
        summary = run(seed, tmp_path / f"seed{seed}", extra)
        out.append(summary["eval_success_end"] - summary["eval_success_start"])
    return out


_WARM_START: dict = {}  # the weights after WARM_START_SEED's SFT warm start, its losses


@contextlib.contextmanager
def fixed_warm_start():
    """Every run's RL starts from one SFT warm start: the one a plain run of WARM_START_SEED makes (that seed's
    initial weights and SFT batches), computed once per process whatever seed runs first. Each seed's own warm start
    differs in held-out success (0.10 to 0.38 after these 120 steps) and that spread, not the RL, made most of the
    gain's spread over seeds (sd 0.11, against 0.03 from one warm start): from one warm start a few seeds measure the
    RL itself. It is the same in every variant: its batches are seeded alone, it runs beside the run's random
    streams (forked) and no variant touches it (the variants' lr is optim.lr; the warm start has its own)."""
    computed = build.sft_warmup

    def warm_start(model, tokenizer, task, *, steps, seed, **kwargs):
        if steps != SFT_STEPS or kwargs:  # not the check's warm start: no reuse
            return computed(model, tokenizer, task, steps=steps, seed=seed, **kwargs)
        if not _WARM_START:
            with torch.random.fork_rng(devices=[]), tempfile.TemporaryDirectory() as tmp:
                config = load_config(None, overrides(WARM_START_SEED, Path(tmp)))
                own = load(config)  # the initial weights of a WARM_START_SEED run
                _WARM_START["losses"] = computed(own.model, own.tok, own.task, steps=steps, seed=WARM_START_SEED)
                _WARM_START["weights"] = own.model.state_dict()
        model.load_state_dict(_WARM_START["weights"])
        model.train()  # as sft_warmup leaves it
        return list(_WARM_START["losses"])

    with mock.patch.object(build, "sft_warmup", warm_start):
        yield


def verdict(values: list[float]) -> tuple[bool, str]:
    """(passes, a line saying why)."""
    mean = sum(values) / len(values)
    shown = ", ".join(f"{v:+.3f}" for v in values)
    return mean >= MIN_MEAN_GAIN, f"mean held-out gain {mean:+.3f} over seeds ({shown}); needs >= {MIN_MEAN_GAIN}"


@contextlib.contextmanager
def flipped_advantages():
    """Every advantage with its sign flipped."""
    computed = rollout._advantages

    def flipped(rewards, group_size):
        a = computed(rewards, group_size)
        return a._replace(advantages=-a.advantages)

    with mock.patch.object(rollout, "_advantages", flipped):
        yield


@contextlib.contextmanager
def stale_old_logprobs(lag: int = STALE_LAG, calls: list | None = None):
    """The old log-probs (the ratio's denominator) of the policy as it was `lag` optimizer steps back, not of the
    policy that sampled the rollout; calls (if given) gets one entry per computation."""
    computed, snapshots = step.completion_logprobs, []

    def stale(policy, packed, *, temperature, dist=step.SINGLE):
        model = policy.model if isinstance(policy, step.Policy) else policy
        snapshots.append(copy.deepcopy(model.state_dict()))
        if calls is not None:
            calls.append(len(snapshots))
        old = copy.deepcopy(model)
        old.load_state_dict(snapshots[max(0, len(snapshots) - 1 - lag)])
        return computed(old, packed, temperature=temperature, dist=dist)

    with mock.patch.object(step, "completion_logprobs", stale):
        yield


VARIANT_LR = {"none": LR, "flipped": LR, "stale": LR, "no-clip": NO_CLIP_LR, "weak": WEAK_LR}


def fail_rates(gains_per_seed: list[float], n: int = len(SEEDS), threshold: float = MIN_MEAN_GAIN,
               draws: int = 100_000) -> dict:
    """How often a check of n seeds drawn from these calibration gains fails (mean below threshold): by the normal
    approximation of the n-seed mean (the calibration's mean and sd), by resampling n of the gains with replacement
    (draws times, seeded), and counted over the disjoint sets of n consecutive calibration seeds."""

    mean, sd = fmean(gains_per_seed), stdev(gains_per_seed)
    rng = random.Random(0)
    resampled = sum(fmean(rng.choices(gains_per_seed, k=n)) < threshold for _ in range(draws)) / draws
    sets = [gains_per_seed[i : i + n] for i in range(0, len(gains_per_seed) - n + 1, n)]
    return {"seeds": len(gains_per_seed), "mean": mean, "sd": sd,
            "normal": NormalDist(mean, sd / n**0.5).cdf(threshold) if sd > 0 else float(mean < threshold),
            "resampled": resampled,
            "sets_failed": sum(fmean(x) < threshold for x in sets), "sets": len(sets)}  # fmt: skip


def calibration_lines(path: Path) -> list[str]:
    """The check's failure rate per variant from a calibration CSV (main's --out), with the gain per seed."""
    by_variant: dict = {}
    with path.open() as f:
        for row in csv.DictReader(f):
            by_variant.setdefault((row["variant"], float(row["lr"])), []).append(float(row["gain"]))
    real = next((g for (v, lr), g in by_variant.items() if (v, lr) == ("none", LR)), None)
    lines = [f"the check: mean gain of {len(SEEDS)} seeds >= {MIN_MEAN_GAIN}, from seed {WARM_START_SEED}'s warm start"]
    for (variant, lr), values in by_variant.items():
        r = fail_rates(values)
        ratio = f", {r['mean'] / fmean(real):.2f}x the real learner's" if real and variant != "none" else ""
        lines.append(f"{variant} (lr {lr:g}): {r['seeds']} seeds, gain {r['mean']:+.3f} (sd {r['sd']:.3f}{ratio}); "
                     f"fails {r['normal']:.2%} (normal), {r['resampled']:.2%} (resampled), "
                     f"{r['sets_failed']} of {r['sets']} disjoint sets")  # fmt: skip
    return lines


def main(argv=None) -> int:
    from benchmarks.common import append_csv, number_list

    parser = argparse.ArgumentParser(description="the learning check over any seeds, as configured or broken")
    parser.add_argument("--seeds", default="0-5", help='"0-5" or "3,7"')
    parser.add_argument("--variant", choices=tuple(VARIANT_LR), default="none",
                        help=f"weak: lr {WEAK_LR} (a learner at ~0.6x the gain)")  # fmt: skip
    parser.add_argument("--lr", type=float, help="default: the variant's (" +
                        ", ".join(f"{v} {lr:g}" for v, lr in VARIANT_LR.items()) + ")")  # fmt: skip
    parser.add_argument("--eval-prompts", type=int, help="held-out prompts (default 256)")
    parser.add_argument("--out", type=Path, help="append a row per seed to this CSV (a calibration)")
    parser.add_argument("--rates", type=Path, help="only report the failure rates of a calibration CSV")
    args = parser.parse_args(argv)
    if args.rates:
        print("\n".join(calibration_lines(args.rates)))
        return 0
    lr = args.lr or VARIANT_LR[args.variant]
    extra = [*([f"--task.num_eval_prompts={args.eval_prompts}"] if args.eval_prompts else []),
             *(NO_CLIP if args.variant == "no-clip" else ()), f"--optim.lr={lr}"]  # fmt: skip
    broken = {"flipped": flipped_advantages, "stale": stale_old_logprobs}.get(args.variant, contextlib.nullcontext)
    with tempfile.TemporaryDirectory() as tmp, broken():
        values = []
        for seed in number_list(args.seeds):
            summary = run(seed, Path(tmp) / f"seed{seed}", tuple(extra))
            start, end = summary["eval_success_start"], summary["eval_success_end"]
            values.append(end - start)
            print(f"seed {seed}: {values[-1]:+.3f}", flush=True)
            if args.out:
                append_csv([dict(variant=args.variant, lr=lr, seed=seed, start=start, end=end, gain=end - start)],
                           args.out, ["variant", "lr", "seed", "start", "end", "gain"])  # fmt: skip
    print(verdict(values)[1])
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks.common, run as a script
    sys.exit(main())

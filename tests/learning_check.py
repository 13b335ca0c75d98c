"""The learning check: does a short GRPO run still learn? Three seeds of a tiny task, one verdict.

Each seed is a real `grpo_kernels.train.train` run: the built-in tiny decoder on single-digit addition, a 120-step SFT
warm start, then RL_STEPS steps of DAPO with G = 8, 16 prompts per step, two optimizer iterations per rollout (so
that the ratio clip acts), lr 5e-4, evaluated on 256 held-out prompts before and after RL. The check passes when the
held-out success gained, averaged over the seeds, is at least MIN_MEAN_GAIN. ~14 s of CPU per seed.

Calibration (one core, this package's CPU paths, an Intel Xeon with AVX-512; the runs of
tests/test_learning_check.py are the ones with seeds 0-2):
- as configured here, seeds 3..32: every seed gained (+0.01 to +0.32, mean +0.20, sd 0.09); the 10 sets of three
  consecutive seeds averaged +0.14 to +0.27: all 10 pass. Seeds 0-2: see the test.
- broken on purpose, seeds 0-2: the advantage's sign flipped -0.27 (every seed ends at 0.0); old log-probs taken
  from the policy 8 optimizer steps back -0.19; the ratio clip removed (epsilon_low 0.999999, epsilon_high 1e9) at
  NO_CLIP_LR, 3x this lr: seeds 0-5 -0.16 (with the clip at that lr +0.08).
- what the clip is worth, two iterations per rollout: at lr 1e-3 (128 held-out prompts) with it seeds 3..32 gained
  +0.155 on average, without it seeds 3..17 +0.009 (but a set of three with it fell to +0.04: 1e-3 is past where
  this run is robust, which is why the check runs 5e-4); at 1.5e-3 +0.08 against -0.16 (seeds 0-5); at 2e-3 the
  run fails with the clip too (seeds 0-2: -0.03), so the no-clip variant runs at 1.5e-3, where the clip decides.
The threshold lies between them: the broken runs end below where they started, the working ones ~0.2 above.
Every number above is reproduced by this file run as a script (one run at a time, one thread: pin it to a core):

    OMP_NUM_THREADS=1 python tests/learning_check.py --seeds 3-32                       # as configured
    OMP_NUM_THREADS=1 python tests/learning_check.py --seeds 0-2 --variant flipped      # or stale, or no-clip
    OMP_NUM_THREADS=1 python tests/learning_check.py --seeds 0-5 --lr 1.5e-3            # the clip on at NO_CLIP_LR
    OMP_NUM_THREADS=1 python tests/learning_check.py --seeds 3-17 --variant no-clip --lr 1e-3 --eval-prompts 128
"""

import argparse
import contextlib
import copy
import sys
import tempfile
from pathlib import Path
from unittest import mock

from grpo_kernels.train import rollout, step, trainer
from grpo_kernels.train.config_io import load_config
from grpo_kernels.train.trainer import train

SEEDS = (0, 1, 2)
SFT_STEPS = 120
RL_STEPS = 80
MIN_MEAN_GAIN = 0.08
NO_CLIP_LR = 1.5e-3
STALE_LAG = 8
NO_CLIP = ("--loss.epsilon_low=0.999999", "--loss.epsilon_high=1e9")


def overrides(seed: int, run_dir) -> list[str]:
    return [f"--seed={seed}", "--model.name=tiny", "--model.activation_checkpointing=none", "--task.name=add",
            "--task.difficulty=1", f"--task.sft_warmup_steps={SFT_STEPS}", "--task.num_eval_prompts=256",
            "--sampling.sampler=hf", "--sampling.group_size=8", "--sampling.prompts_per_step=16",
            "--sampling.max_new_tokens=4", "--loss.loss_type=dapo", "--optim.lr=5e-4", "--optim.num_iterations=2",
            f"--optim.steps={RL_STEPS}", f"--logging.run_dir={run_dir}", f"--logging.log_every={RL_STEPS}",
            "--checkpoint.every=0"]  # fmt: skip


def gains(tmp_path, seeds=SEEDS, extra: tuple = ()) -> list[float]:
    """Held-out success after RL minus before, one per seed; extra: more overrides (a broken setting)."""
    out = []
    for seed in seeds:
        config = load_config(None, [*overrides(seed, tmp_path / f"seed{seed}"), *extra])
        with _shared_warm_start():
            summary = train(config, log=lambda *a, **k: None)
        out.append(summary["eval_success_end"] - summary["eval_success_start"])
    return out


_WARM_STARTS: dict = {}  # seed -> (the weights after the SFT warm start, its losses)


@contextlib.contextmanager
def _shared_warm_start():
    """The SFT warm start computed once per seed in this process and reused by every later run of that seed (about a
    seventh of a run). It is the same in every variant: its batches are seeded by the seed alone, it draws nothing from
    the global RNG, and no variant touches it (the no-clip lr is optim.lr; the warm start has its own)."""
    computed = trainer.sft_warmup

    def warm_start(model, tokenizer, task, *, steps, seed, **kwargs):
        if steps != SFT_STEPS or kwargs:  # not the check's warm start: no reuse
            return computed(model, tokenizer, task, steps=steps, seed=seed, **kwargs)
        if seed not in _WARM_STARTS:
            losses = computed(model, tokenizer, task, steps=steps, seed=seed)
            _WARM_STARTS[seed] = (copy.deepcopy(model.state_dict()), losses)
        weights, losses = _WARM_STARTS[seed]
        model.load_state_dict(weights)
        model.train()  # as sft_warmup leaves it
        return list(losses)

    with mock.patch.object(trainer, "sft_warmup", warm_start):
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


def main(argv=None) -> int:
    from benchmarks.common import number_list

    parser = argparse.ArgumentParser(description="the learning check over any seeds, as configured or broken")
    parser.add_argument("--seeds", default="0-2", help='"0-2" or "3,7"')
    parser.add_argument("--variant", choices=("none", "flipped", "stale", "no-clip"), default="none")
    parser.add_argument("--lr", type=float, help=f"default 5e-4 ({NO_CLIP_LR} with --variant no-clip)")
    parser.add_argument("--eval-prompts", type=int, help="held-out prompts (default 256)")
    args = parser.parse_args(argv)
    extra = [*([f"--task.num_eval_prompts={args.eval_prompts}"] if args.eval_prompts else []),
             *(NO_CLIP if args.variant == "no-clip" else ())]
    if args.lr or args.variant == "no-clip":
        extra.append(f"--optim.lr={args.lr or NO_CLIP_LR}")
    broken = {"flipped": flipped_advantages, "stale": stale_old_logprobs}.get(args.variant, contextlib.nullcontext)
    with tempfile.TemporaryDirectory() as tmp, broken():
        values = []
        for seed in number_list(args.seeds):
            values += gains(Path(tmp), (seed,), tuple(extra))
            print(f"seed {seed}: {values[-1]:+.3f}", flush=True)
    print(verdict(values)[1])
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks.common, run as a script
    sys.exit(main())

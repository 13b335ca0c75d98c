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
"""

from grpo_kernels.train.config_io import load_config
from grpo_kernels.train.trainer import train

SEEDS = (0, 1, 2)
RL_STEPS = 80
MIN_MEAN_GAIN = 0.08
NO_CLIP_LR = 1.5e-3


def overrides(seed: int, run_dir) -> list[str]:
    return [f"--seed={seed}", "--model.name=tiny", "--model.activation_checkpointing=none", "--task.name=add",
            "--task.difficulty=1", "--task.sft_warmup_steps=120", "--task.num_eval_prompts=256",
            "--sampling.sampler=hf", "--sampling.group_size=8", "--sampling.prompts_per_step=16",
            "--sampling.max_new_tokens=4", "--loss.loss_type=dapo", "--optim.lr=5e-4", "--optim.num_iterations=2",
            f"--optim.steps={RL_STEPS}", f"--logging.run_dir={run_dir}", "--logging.log_every=1000",
            "--checkpoint.every=0"]  # fmt: skip


def gains(tmp_path, seeds=SEEDS, extra: tuple = ()) -> list[float]:
    """Held-out success after RL minus before, one per seed; extra: more overrides (a broken setting)."""
    out = []
    for seed in seeds:
        config = load_config(None, [*overrides(seed, tmp_path / f"seed{seed}"), *extra])
        summary = train(config, log=lambda *a, **k: None)
        out.append(summary["eval_success_end"] - summary["eval_success_start"])
    return out


def verdict(values: list[float]) -> tuple[bool, str]:
    """(passes, a line saying why)."""
    mean = sum(values) / len(values)
    shown = ", ".join(f"{v:+.3f}" for v in values)
    return mean >= MIN_MEAN_GAIN, f"mean held-out gain {mean:+.3f} over seeds ({shown}); needs >= {MIN_MEAN_GAIN}"

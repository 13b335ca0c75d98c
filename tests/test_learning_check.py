"""The learning check (tests/learning_check.py) passes on this code and fails on a weak learner (lr WEAK_LR, about
0.6x the gain) and on three ways of breaking GRPO: the advantage's sign flipped, the ratio clip removed at a large lr,
old log-probs taken from the wrong step. Each is a real training run of the check's seeds from the shared SFT warm
start, but for the flipped sign (one seed) and the stale log-probs (two): every one of their calibration seeds ended
below where it started (-0.24 and -0.13 on average, benchmarks/results/learning_check/), far under the threshold,
while the weak learner and the no-clip run are judged on the six seeds' mean, as the check is."""

import pytest
from learning_check import (
    NO_CLIP,
    NO_CLIP_LR,
    SEEDS,
    STALE_LAG,
    WEAK_LR,
    flipped_advantages,
    gains,
    stale_old_logprobs,
    verdict,
)

pytestmark = pytest.mark.slow


def test_a_short_grpo_run_learns(tmp_path):
    ok, why = verdict(gains(tmp_path))
    assert ok, why


def test_the_learning_check_fails_a_weak_learner(tmp_path):
    ok, why = verdict(gains(tmp_path, extra=(f"--optim.lr={WEAK_LR}",)))
    assert not ok, why


def test_the_learning_check_fails_with_the_advantage_sign_flipped(tmp_path):
    with flipped_advantages():
        ok, why = verdict(gains(tmp_path, seeds=SEEDS[:1]))
    assert not ok, why


def test_the_learning_check_fails_without_the_ratio_clip(tmp_path):
    ok, why = verdict(gains(tmp_path, extra=(*NO_CLIP, f"--optim.lr={NO_CLIP_LR}")))
    assert not ok, why


def test_the_learning_check_fails_with_old_logprobs_from_the_wrong_step(tmp_path):
    calls = []
    with stale_old_logprobs(calls=calls):
        ok, why = verdict(gains(tmp_path, seeds=SEEDS[:2]))
    assert not ok, why
    assert len(calls) > STALE_LAG  # the old log-probs went through the stand-in


def test_every_run_starts_from_the_same_warm_start_whatever_ran_first(tmp_path):
    """The check's runs do not depend on their order in the process: the shared warm start is WARM_START_SEED's own
    (its initial weights and batches), not the first run's."""
    import json

    import learning_check

    from grpo_kernels.train.trainer import TIMING_METRICS

    def step_metrics(run_dir):
        rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        return [{k: v for k, v in row.items() if k not in TIMING_METRICS} for row in rows]

    short = ("--optim.steps=1", "--logging.log_every=1", "--task.num_eval_prompts=16")
    learning_check._WARM_START.clear()
    first = learning_check.run(1, tmp_path / "a", short)
    learning_check._WARM_START.clear()
    learning_check.run(learning_check.WARM_START_SEED, tmp_path / "b", short)
    again = learning_check.run(1, tmp_path / "c", short)
    assert step_metrics(tmp_path / "a") == step_metrics(tmp_path / "c")  # loss, rewards, grad norm: bit for bit
    assert (again["eval_success_start"], again["eval_success_end"]) == (first["eval_success_start"],
                                                                         first["eval_success_end"])  # fmt: skip

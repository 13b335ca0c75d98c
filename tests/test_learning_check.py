"""The learning check (tests/learning_check.py) passes on this code and fails on three ways of breaking GRPO: the
advantage's sign flipped, the ratio clip removed at a large lr, old log-probs taken from the wrong step. Each is a
real training run of three seeds (~45 s of CPU), but for the flipped sign: one seed, since every flipped seed ends at
a success of 0.0 (tests/learning_check.py), far below the threshold, while each of the other two breaks is judged on
the three seeds' mean."""

import pytest
from learning_check import NO_CLIP, NO_CLIP_LR, STALE_LAG, flipped_advantages, gains, stale_old_logprobs, verdict

pytestmark = pytest.mark.slow


def test_a_short_grpo_run_learns(tmp_path):
    ok, why = verdict(gains(tmp_path))
    assert ok, why


def test_the_learning_check_fails_with_the_advantage_sign_flipped(tmp_path):
    with flipped_advantages():
        ok, why = verdict(gains(tmp_path, seeds=(0,)))
    assert not ok, why


def test_the_learning_check_fails_without_the_ratio_clip(tmp_path):
    ok, why = verdict(gains(tmp_path, extra=(*NO_CLIP, f"--optim.lr={NO_CLIP_LR}")))
    assert not ok, why


def test_the_learning_check_fails_with_old_logprobs_from_the_wrong_step(tmp_path):
    calls = []
    with stale_old_logprobs(calls=calls):
        ok, why = verdict(gains(tmp_path))
    assert not ok, why
    assert len(calls) > STALE_LAG  # the old log-probs went through the stand-in

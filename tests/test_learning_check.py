"""The learning check (tests/learning_check.py) passes on this code and fails on three ways of breaking GRPO: the
advantage's sign flipped, the ratio clip removed at a large lr, old log-probs taken from the wrong step. Each is a
real training run of three seeds (~45 s of CPU)."""

import copy

import pytest
from learning_check import NO_CLIP_LR, gains, verdict

from grpo_kernels.train import rollout, step

pytestmark = pytest.mark.slow


def test_a_short_grpo_run_learns(tmp_path):
    ok, why = verdict(gains(tmp_path))
    assert ok, why


def test_the_learning_check_fails_with_the_advantage_sign_flipped(tmp_path, monkeypatch):
    computed = rollout._advantages

    def flipped(rewards, group_size):
        a = computed(rewards, group_size)
        return a._replace(advantages=-a.advantages)

    monkeypatch.setattr(rollout, "_advantages", flipped)
    ok, why = verdict(gains(tmp_path))
    assert not ok, why


def test_the_learning_check_fails_without_the_ratio_clip(tmp_path):
    off = ("--loss.epsilon_low=0.999999", "--loss.epsilon_high=1e9", f"--optim.lr={NO_CLIP_LR}")
    ok, why = verdict(gains(tmp_path, extra=off))
    assert not ok, why


def test_the_learning_check_fails_with_old_logprobs_from_the_wrong_step(tmp_path, monkeypatch):
    """The old log-probs (the ratio's denominator) of the policy as it was LAG optimizer steps back, not of the
    policy that sampled the rollout."""
    lag, computed, snapshots = 8, step.completion_logprobs, []

    def stale(policy, packed, *, temperature, dist=step.SINGLE):
        model = policy.model if isinstance(policy, step.Policy) else policy
        snapshots.append(copy.deepcopy(model.state_dict()))
        old = copy.deepcopy(model)
        old.load_state_dict(snapshots[max(0, len(snapshots) - 1 - lag)])
        return computed(old, packed, temperature=temperature, dist=dist)

    monkeypatch.setattr(step, "completion_logprobs", stale)
    ok, why = verdict(gains(tmp_path))
    assert not ok, why
    assert len(snapshots) > lag  # the old log-probs went through the stand-in

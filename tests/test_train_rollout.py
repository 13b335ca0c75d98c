"""The rollout owns the group layout: groups stay whole and in order through select / concat (dynamic sampling),
and the advantages it carries are the kernel's on the groups it holds, bit for bit."""

import pytest
import torch

from grpo_kernels import group_advantages
from grpo_kernels.train.config.io import load_config
from grpo_kernels.train.data.rewards import RewardFunction, Rewards
from grpo_kernels.train.data.tasks import Example
from grpo_kernels.train.model.fsdp import SINGLE, Dist
from grpo_kernels.train.rollout import sampling
from grpo_kernels.train.rollout.batch import Rollout

G = 3
REWARDS = [[1.0, 0.0, 0.1], [0.5, 0.5, 0.5], [0.0, 1.1, 1.0]]  # group 1 has no signal


def rollout(num_groups=3, g=G, first=0):
    """Completion (k, j) is the tokens [k, j] of prompt [k], so every entry names its group and member."""
    ks = range(first, first + num_groups)
    return Rollout(prompt_ids=[torch.tensor([k]) for k in ks for _ in range(g)],
                   completion_ids=[torch.tensor([k, j]) for k in ks for j in range(g)],
                   sampler_logps=[torch.full((2,), -float(k * g + j)) for k in ks for j in range(g)],
                   group_size=g)  # fmt: skip


def members(r):
    return [tuple(c.tolist()) for c in r.completion_ids]


def assert_same_advantages(a, b):
    for x, y in zip(a, b, strict=True):
        assert x.dtype == y.dtype and torch.equal(x, y) or bool(torch.isnan(x).all() and torch.isnan(y).all()), (x, y)


def test_the_rollout_gives_the_group_layout_and_the_kernels_advantages():
    r = rollout().with_rewards([x for row in REWARDS for x in row])
    assert r.num_groups == 3 and r.group_ids == [0, 0, 0, 1, 1, 1, 2, 2, 2]
    assert r.rewards.shape == (3, G) and r.rewards.dtype == torch.float64 and r.rewards.tolist() == REWARDS
    assert r.pass_rates() == [sum(row) / G for row in REWARDS]  # Python sums of the scores, as logged before
    assert_same_advantages(r.advantages, group_advantages(torch.tensor(REWARDS).flatten(), group_size=G))
    assert r.advantages.valid.tolist() == [True, False, True]
    assert rollout().rewards is None and rollout().advantages is None  # what the samplers return
    zeros = rollout(4).with_rewards([0.0] * G + [0.0, 0.0, 1.0] + [1.0] * G + [0.0, -0.0, 0.0])
    assert zeros.all_zero_fraction() == 0.5  # groups 0 and 3 (-0.0 is 0); group 1 is valid, group 2 all right
    assert r.all_zero_fraction() == 0.0


def test_keeping_groups_0_and_2_of_3_keeps_them_whole_with_their_own_rewards_and_advantages():
    r = rollout().with_rewards([x for row in REWARDS for x in row])
    kept = r.select(r.advantages.valid.nonzero().flatten().tolist())
    assert kept.num_groups == 2 and kept.group_ids == [0, 0, 0, 1, 1, 1]
    assert members(kept) == [(0, j) for j in range(G)] + [(2, j) for j in range(G)]
    assert [int(p[0]) for p in kept.prompt_ids] == [0] * G + [2] * G
    assert [float(lp[0]) for lp in kept.sampler_logps] == [-0.0, -1.0, -2.0, -6.0, -7.0, -8.0]
    assert kept.rewards.tolist() == [REWARDS[0], REWARDS[2]]
    assert kept.pass_rates() == [r.pass_rates()[k] for k in (0, 2)]
    fresh = group_advantages(torch.tensor([REWARDS[0], REWARDS[2]]).flatten(), group_size=G)
    assert_same_advantages(kept.advantages, fresh)  # carried over, not recomputed, and the same bits
    assert float(kept.advantages.invalid_fraction) == 0.0
    backwards = r.select([2, 0])
    assert members(backwards) == members(kept.select([1, 0])) and backwards.rewards.tolist() == [REWARDS[2], REWARDS[0]]
    assert r.select([0, 1, 2]) is r
    none = r.select([])
    assert none.num_groups == 0 and none.group_ids == [] and none.rewards.shape == (0, G)
    assert none.advantages.advantages.shape == (0,) and torch.isnan(none.advantages.invalid_fraction)


def test_concat_of_uneven_parts_equals_the_whole_bit_for_bit():
    whole = rollout().with_rewards([x for row in REWARDS for x in row])
    parts = [whole.select([0]), whole.select([]), whole.select([1, 2])]
    joined = Rollout.concat(parts)
    assert members(joined) == members(whole) and torch.equal(joined.rewards, whole.rewards)
    assert_same_advantages(joined.advantages, whole.advantages)  # invalid_fraction 1/3: counted as the kernel does
    assert Rollout.concat([rollout(1), rollout(2, first=1)]).group_ids == [0, 0, 0, 1, 1, 1, 2, 2, 2]
    with pytest.raises(ValueError, match="group sizes"):
        Rollout.concat([rollout(1, g=2), rollout(1, g=3)])
    with pytest.raises(ValueError, match="scored and unscored"):
        Rollout.concat([whole, rollout()])


@pytest.mark.parametrize("make, message", [
    (lambda: Rollout(prompt_ids=[1, 2], completion_ids=[1, 2, 3], sampler_logps=[1, 2, 3], group_size=1), "one prompt"),
    (lambda: Rollout(**{**_fields(rollout(1)), "group_size": 2}), "does not divide"),
    (lambda: rollout().with_rewards([1.0] * 8), "one reward per completion"),
    (lambda: Rollout(**_fields(rollout()), rewards=torch.zeros(G, 3 * G)), r"shape \[num_groups, G\]"),
    (lambda: Rollout(**_fields(rollout()), rewards=torch.zeros(3, G, dtype=torch.long)), "float tensor"),
    (lambda: rollout().select([3]), "out of range"),
])  # fmt: skip
def test_a_bad_rollout_is_refused_with_a_clear_error(make, message):
    with pytest.raises(ValueError, match=message):
        make()


def _fields(r):
    return dict(prompt_ids=r.prompt_ids, completion_ids=r.completion_ids, sampler_logps=r.sampler_logps,
                group_size=r.group_size)  # fmt: skip


class _Tok:
    def encode_prompt(self, prompt):
        return [int(prompt)]

    def decode(self, ids):
        return ",".join(str(int(i)) for i in ids)


class _Sampler:
    """Completion j of prompt k is [k, j]; the reward table below scores it."""

    def sample(self, prompts, g, *, seeds):
        return Rollout(prompt_ids=[torch.tensor(p) for p in prompts for _ in range(g)],
                       completion_ids=[torch.tensor([p[0], j]) for p in prompts for j in range(g)],
                       sampler_logps=[torch.zeros(2) for _ in prompts for _ in range(g)], group_size=g)  # fmt: skip


class _Table:
    """The reward functions (`rewards()`): completion j of group k earns table[k][j]."""

    table = {0: REWARDS[0], 1: REWARDS[1], 2: REWARDS[2], 3: [0.0, 0.0, 1.0], 4: [1.0, 1.0, 1.0]}

    @classmethod
    def rewards(cls):
        return Rewards([RewardFunction("table", cls().score, "test")])

    def score(self, prompts, completions, **kwargs):
        out = []
        for prompt, completion in zip(prompts, completions, strict=True):
            k, j = (int(x) for x in completion.split(","))
            assert int(prompt) == k  # each completion is scored against its own group's example
            out.append(self.table[k][j])
        return out


def test_dynamic_sampling_keeps_groups_0_and_2_then_fills_the_batch_from_the_next_round():
    examples = iter([Example(prompt=str(k), answer="") for k in range(5)])
    config = load_config(None, ["--sampling.prompts_per_step=3", "--group_size.dynamic_sampling=true",
                                "--group_size.max_resample_rounds=2"])  # fmt: skip
    out, sampled, rounds, tokens = sampling.collect(config, _Sampler(), _Tok(), _Table.rewards(),
                                            lambda n: [next(examples) for _ in range(n)], 0, G, SINGLE)  # fmt: skip
    assert sampled == 4 and rounds == 1  # round 0: 3 prompts, 2 kept; round 1: 1 prompt, kept
    assert tokens == 4 * G * 2  # the tokens of every sampled completion (2 each), the dropped group's too
    assert [int(p[0]) for p in out.prompt_ids[::G]] == [0, 2, 3] and out.group_ids == [0] * G + [1] * G + [2] * G
    assert out.rewards.tolist() == [REWARDS[0], REWARDS[2], _Table.table[3]]
    fresh = group_advantages(out.rewards.float().flatten(), group_size=G)
    assert_same_advantages(out.advantages, fresh)


def test_two_ranks_gather_the_same_rollout_as_one(monkeypatch):
    examples = [Example(prompt=str(k), answer="") for k in range(5)]
    one = sampling.sample_scored(_Sampler(), _Tok(), _Table.rewards(), examples, G, list(range(5)), SINGLE)
    sent = {}

    class Sent(Exception):
        pass

    def send(obj, d):  # first pass: what each rank contributes
        sent[d.rank] = obj
        raise Sent

    ranks = [Dist(rank=r, world=2, distributed=True) for r in (0, 1)]
    monkeypatch.setattr(sampling, "all_gather_objects", send)
    for d in ranks:
        with pytest.raises(Sent):
            sampling.sample_scored(_Sampler(), _Tok(), _Table.rewards(), examples, G, list(range(5)), d)
    assert sent[0][0] == [0, 2, 4] and sent[1][0] == [1, 3] and sent[1][1].group_ids == [0] * G + [1] * G
    monkeypatch.setattr(sampling, "all_gather_objects", lambda obj, d: [sent[0], sent[1]])
    for d in ranks:
        two = sampling.sample_scored(_Sampler(), _Tok(), _Table.rewards(), examples, G, list(range(5)), d)
        assert members(two) == members(one) and torch.equal(two.rewards, one.rewards)
        assert_same_advantages(two.advantages, one.advantages)

"""plan_micro_batches: the plan's invariants on both backends, C++ == reference, edge cases, argument checks."""

import numpy as np
import pytest
import torch

from grpo_kernels.planner import Plan, plan_micro_batches

IMPLS = ("cpp", "reference")
ALGORITHMS = ("karmarkar_karp", "greedy")


def lognormal_lengths(rng, n, mean=6.0, lo=16, hi=8192):
    return np.clip(rng.lognormal(mean, 1.0, n), lo, hi).astype(np.int64)


def check_plan(plan: Plan, lengths, token_budget, num_ranks, group_ids=None, keep_groups=False):
    """Every sample once, budgets, same micro-batch count on every rank, loads and order as documented."""
    lengths = np.asarray(lengths, dtype=np.int64)
    assert len(plan.micro_batches) == num_ranks == len(plan.rank_loads)
    k = len(plan.micro_batches[0])
    assert k >= 1 and all(len(rank) == k for rank in plan.micro_batches)
    seen = sorted(s for rank in plan.micro_batches for mb in rank for s in mb)
    assert seen == list(range(len(lengths)))
    for rank, loads, rank_load in zip(plan.micro_batches, plan.micro_batch_loads, plan.rank_loads, strict=True):
        assert [int(lengths[mb].sum()) for mb in rank] == loads
        assert sum(loads) == rank_load
        assert loads == sorted(loads, reverse=True)
        for mb, load in zip(rank, loads, strict=True):
            assert mb == sorted(mb)
            items = len({int(group_ids[s]) for s in mb}) if keep_groups else len(mb)
            assert load <= token_budget or items == 1, (load, mb)
    if keep_groups:
        where = {}
        for r, rank in enumerate(plan.micro_batches):
            for m, mb in enumerate(rank):
                for s in mb:
                    assert where.setdefault(int(group_ids[s]), (r, m)) == (r, m), "a group was split"
    total = int(lengths.sum())
    expected = max(plan.rank_loads) * num_ranks / total if total else 1.0
    assert plan.imbalance == pytest.approx(expected)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("algorithm", ALGORITHMS)
@pytest.mark.parametrize("num_ranks", [1, 3, 8])
def test_plan_invariants_hold_on_random_lengths(impl, algorithm, num_ranks):
    rng = np.random.default_rng(num_ranks)
    lengths = lognormal_lengths(rng, 700)
    plan = plan_micro_batches(lengths, token_budget=4096, num_ranks=num_ranks, algorithm=algorithm, impl=impl)
    check_plan(plan, lengths, 4096, num_ranks)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_keep_groups_keeps_each_group_in_one_micro_batch(impl, algorithm):
    rng = np.random.default_rng(1)
    lengths = lognormal_lengths(rng, 400)
    group_ids = rng.integers(0, 60, 400) * 7 - 100  # shuffled, not adjacent, negative and sparse ids
    plan = plan_micro_batches(
        lengths, token_budget=8192, group_ids=group_ids, keep_groups=True, num_ranks=4, algorithm=algorithm, impl=impl
    )
    check_plan(plan, lengths, 8192, 4, group_ids=group_ids, keep_groups=True)
    split = plan_micro_batches(lengths, token_budget=8192, group_ids=group_ids, num_ranks=4, impl=impl)
    check_plan(split, lengths, 8192, 4)  # group_ids without keep_groups: samples are the items


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_cpp_and_reference_give_identical_plans(algorithm):
    rng = np.random.default_rng(2)
    for trial in range(60):
        n = int(rng.integers(0, 500))
        num_ranks = int(rng.integers(1, 10))
        token_budget = int(rng.choice([1, 100, 1000, 4096, 20000, 10**9]))
        lengths = rng.integers(0, 3000, n) if trial % 3 else lognormal_lengths(rng, n)
        if trial % 4 == 0:
            lengths[rng.random(n) < 0.3] = 0  # ties and zero-weight items
        kwargs = dict(token_budget=token_budget, num_ranks=num_ranks, algorithm=algorithm)
        if trial % 5 == 0 and n:
            kwargs.update(group_ids=rng.integers(0, max(1, n // 4), n), keep_groups=True)
        ours = plan_micro_batches(lengths, impl="cpp", **kwargs)
        ref = plan_micro_batches(lengths, impl="reference", **kwargs)
        assert ours == ref, (trial, kwargs)
        check_plan(ours, lengths, token_budget, num_ranks, kwargs.get("group_ids"), kwargs.get("keep_groups", False))


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_sequence_longer_than_budget_gets_its_own_micro_batch(impl, algorithm):
    lengths = [100, 5000, 200, 300, 9000, 50, 0]
    plan = plan_micro_batches(lengths, token_budget=1000, num_ranks=2, algorithm=algorithm, impl=impl)
    check_plan(plan, lengths, 1000, 2)
    mbs = [mb for rank in plan.micro_batches for mb in rank]
    assert [1] in mbs and [4] in mbs


@pytest.mark.parametrize("impl", IMPLS)
def test_budget_below_every_item_gives_one_item_per_micro_batch_and_no_extra_empty_ones(impl):
    plan = plan_micro_batches([5, 3, 8, 2, 7, 1, 4], token_budget=1, num_ranks=2, impl=impl)
    assert plan.num_micro_batches == max(sum(map(len, rank)) for rank in plan.micro_batches) == 4
    assert all(len(mb) == 1 for rank in plan.micro_batches for mb in rank if mb)


@pytest.mark.parametrize("impl", IMPLS)
def test_items_over_half_the_budget_never_share(impl):
    lengths = [600] * 10  # every pair exceeds 1000: ten micro-batches, found without ten retries
    plan = plan_micro_batches(lengths, token_budget=1000, impl=impl)
    assert plan.num_micro_batches == 10 and plan.micro_batch_loads == [[600] * 10]


@pytest.mark.parametrize("impl", IMPLS)
def test_max_item_tokens_raises_naming_the_item(impl):
    with pytest.raises(ValueError, match=r"item 2 \(sample 2\) has 9000 tokens > max_item_tokens=8192"):
        plan_micro_batches([10, 20, 9000], token_budget=100, max_item_tokens=8192, impl=impl)
    with pytest.raises(ValueError, match=r"item 1 \(group 7\) has 8200 tokens"):
        plan_micro_batches(
            [10, 8000, 200, 5], token_budget=100, group_ids=[3, 7, 7, 3], keep_groups=True, max_item_tokens=8192
        )
    plan = plan_micro_batches([10, 20, 8192], token_budget=100, max_item_tokens=8192, impl=impl)
    assert plan.rank_loads == [8222]


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_empty_zero_and_more_ranks_than_items(impl, algorithm):
    empty = plan_micro_batches([], token_budget=10, num_ranks=3, algorithm=algorithm, impl=impl)
    assert empty.micro_batches == [[[]]] * 3 and empty.rank_loads == [0, 0, 0] and empty.imbalance == 1.0
    zeros = plan_micro_batches(torch.zeros(5, dtype=torch.int32), token_budget=10, num_ranks=2, impl=impl)
    check_plan(zeros, [0] * 5, 10, 2)
    assert zeros.imbalance == 1.0 and zeros.num_micro_batches == 1
    few = plan_micro_batches([5, 3], token_budget=10, num_ranks=4, algorithm=algorithm, impl=impl)
    check_plan(few, [5, 3], 10, 4)
    assert few.micro_batches == [[[0]], [[1]], [[]], [[]]] and few.imbalance == 2.5
    uneven = plan_micro_batches([9, 9, 9, 1], token_budget=10, num_ranks=2, algorithm=algorithm, impl=impl)
    check_plan(uneven, [9, 9, 9, 1], 10, 2)
    assert uneven.num_micro_batches == 2 and [] not in uneven.micro_batches[0]
    assert "2 ranks x 2 micro-batches" in str(uneven)


def test_karmarkar_karp_balances_at_least_as_well_as_greedy():
    rng = np.random.default_rng(3)
    for num_ranks in (2, 4, 8):
        lengths = lognormal_lengths(rng, 60, mean=7.0)
        kk, lpt = (
            plan_micro_batches(lengths, token_budget=10**9, num_ranks=num_ranks, algorithm=a) for a in ALGORITHMS
        )
        assert kk.imbalance <= lpt.imbalance, (num_ranks, kk.imbalance, lpt.imbalance)
    lengths = lognormal_lengths(rng, 10_000, mean=6.5)
    kk = plan_micro_batches(lengths, token_budget=65536, num_ranks=8)
    assert kk.imbalance <= 1.05
    check_plan(kk, lengths, 65536, 8)


def test_inputs_may_be_lists_arrays_or_tensors():
    lengths = [5, 1, 7, 3, 2]
    plans = [
        plan_micro_batches(x, token_budget=8, num_ranks=2)
        for x in (lengths, np.array(lengths, dtype=np.uint16), torch.tensor(lengths))
    ]
    assert plans[0] == plans[1] == plans[2]


@pytest.mark.parametrize(
    "kwargs, name",
    [
        (dict(lengths=[[1, 2]]), "lengths"),
        (dict(lengths=[1, -2]), "lengths"),
        (dict(lengths=[1.5, 2.0]), "lengths"),
        (dict(lengths=torch.ones(3)), "lengths"),
        (dict(token_budget=0), "token_budget"),
        (dict(token_budget=2.5), "token_budget"),
        (dict(num_ranks=0), "num_ranks"),
        (dict(algorithm="first_fit"), "algorithm"),
        (dict(group_ids=[0, 1]), "group_ids"),
        (dict(group_ids=[0.5, 1, 2]), "group_ids"),
        (dict(keep_groups=True), "keep_groups"),
        (dict(impl="triton"), "impl"),
        (dict(max_item_tokens="big"), "max_item_tokens"),
    ],
)
def test_bad_arguments_raise_value_error_naming_them(kwargs, name):
    args = dict(lengths=[1, 2, 3], token_budget=10) | kwargs
    with pytest.raises(ValueError, match=name):
        plan_micro_batches(args.pop("lengths"), **args)


def test_plan_is_frozen():
    plan = plan_micro_batches([1, 2], token_budget=2)
    with pytest.raises(AttributeError):
        plan.imbalance = 0.0


@pytest.mark.parametrize("impl", ["cpp", "reference"])
@pytest.mark.parametrize(
    "lengths,budget",
    [([2**61, 2**61], 1), ([1, 2, 3], 2**62), ([2**62 - 10, 5, 5], 1), ([2**40] * 2**22 + [1], 1),
     ([2**63 - 1], 1)],
)  # fmt: skip
def test_budgets_and_lengths_past_int64_planning_are_refused(impl, lengths, budget):
    """The C++ planner adds weights in int64: near 2^62 it overflowed (before: wrong plans, no error)."""
    with pytest.raises(ValueError, match=r"sum\(lengths\) \+ token_budget = \d+ is past what can be planned"):
        plan_micro_batches(np.array(lengths, dtype=np.int64), token_budget=budget, num_ranks=2, impl=impl)
    ok = plan_micro_batches([2**60, 2**60, 5], token_budget=2**60, num_ranks=2, impl=impl)
    assert sorted(i for rank in ok.micro_batches for mb in rank for i in mb) == [0, 1, 2]

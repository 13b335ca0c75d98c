"""The statistics the learning benchmarks report with: Student's t quantile, the chi-square test of a sampler's
token counts (it passes a right draw and rejects a draw at the wrong temperature), the test that the sampler's
seeded draws are independent across a group's rows, across steps and along a row, and the within-group rollout
statistics."""

import itertools
import math

import pytest
import torch

from benchmarks.common import t975
from benchmarks.learning.intervals import (
    clopper_pearson,
    fisher_exact,
    permutation_p,
    seeds_needed,
    smallest_gap,
    welch_difference,
)
from benchmarks.learning.sampler_distribution import (
    chi2_sf,
    chi_square,
    independence,
    multinomial_counts,
    ours_counts,
    pair_draws,
    rollout_stats,
)


def _exact_permutation_p(a, b):
    """Every split of the pooled values into len(a) and len(b): the exact two-sided p."""
    pooled, n = a + b, len(a)
    observed = abs(sum(a) / n - sum(b) / len(b))
    splits = list(itertools.combinations(range(len(pooled)), n))
    far = 0
    for idx in splits:
        first = [pooled[i] for i in idx]
        rest = [pooled[i] for i in range(len(pooled)) if i not in idx]
        far += abs(sum(first) / n - sum(rest) / len(rest)) >= observed - 1e-12
    return far / len(splits)


@pytest.mark.parametrize("a, b", [([0.31, 0.35, 0.28, 0.40, 0.33], [0.42, 0.39, 0.45, 0.37, 0.44, 0.41]),
                                  ([0.2, 0.3, 0.25], [0.21, 0.29, 0.26, 0.24]), ([1.0, 1.0, 1.0], [1.0, 1.0])])
def test_permutation_p_approaches_the_exact_enumeration(a, b):
    exact = _exact_permutation_p(a, b)
    assert permutation_p(a, b, rounds=40_000, seed=3) == pytest.approx(exact, abs=0.01)
    assert permutation_p(a, b, rounds=1000, seed=3) == permutation_p(a, b, rounds=1000, seed=3)  # seeded
    with pytest.raises(ValueError, match="a value on each side"):
        permutation_p([], b)


def test_seeds_needed_is_the_textbook_two_sample_size_and_smallest_gap_its_inverse():
    """(1.96 + 0.8416)^2 (0.094^2 + 0.077^2) / 0.05^2 = 46.3: the issue's 46 per arm for a gap of 0.05."""
    assert seeds_needed(0.094, 0.077, 0.05) == 47
    assert seeds_needed(0.094, 0.077, 0.03) == 129
    assert seeds_needed(1.0, 1.0, 1.0, power=0.9) == 22  # 2 (1.96 + 1.2816)^2 = 21.01
    assert smallest_gap(0.094, 0.077, 47, 47) == pytest.approx(0.05, rel=0.01)
    for bad in (dict(gap=0.0), dict(gap=-0.05), dict(power=1.0)):
        with pytest.raises(ValueError, match="seeds_needed needs gap > 0"):
            seeds_needed(0.094, 0.077, **{"gap": 0.05, **bad})


@pytest.mark.parametrize("dof, quantile", [(1, 12.7062), (4, 2.7764), (30, 2.0423), (31, 2.0395), (40, 2.0211),
                                           (60, 2.0003), (120, 1.9799), (10**6, 1.9600)])  # fmt: skip
def test_t975_matches_students_t(dof, quantile):
    assert t975(dof) == pytest.approx(quantile, abs=5e-4 if dof <= 30 else 1e-4)  # the table has 3 decimals
    with pytest.raises(ValueError, match="degrees of freedom must be >= 1"):
        t975(0)


@pytest.mark.parametrize("stat, dof, p", [(3.841, 1, 0.05), (18.307, 10, 0.05), (23.209, 10, 0.01), (10.0, 10, 0.4405)])
def test_chi2_sf_matches_the_table(stat, dof, p):
    assert chi2_sf(stat, dof) == pytest.approx(p, abs=2e-4)


def test_chi_square_passes_the_samplers_draw_and_rejects_a_wrong_temperature():
    logits = torch.randn(3000, generator=torch.Generator().manual_seed(1)) * 3
    probs = torch.softmax(logits / 0.7, -1)
    for counts in (ours_counts(logits, 3000, 0.7, seed=5), multinomial_counts(logits, 3000, 0.7, seed=5)):
        stat, dof = chi_square(counts, probs)
        assert dof > 20 and chi2_sf(stat, dof) > 1e-3, (stat, dof)
    stat, dof = chi_square(ours_counts(logits, 3000, 0.8, seed=5), probs)  # drawn at T = 0.8, tested against 0.7
    assert chi2_sf(stat, dof) < 1e-6, (stat, dof)
    assert chi_square(torch.tensor([0, 5]), torch.tensor([1.0, 0.0]))[0] == math.inf  # a draw of a zero-mass token


def test_draw_swap_statistics_pair_by_seed_and_permute(tmp_path):
    """benchmarks/learning/draw_swap.py: differences paired by seed, a permutation test that separates shifted samples
    and not equal ones, and the tables from run files (a seed missing from one arm is left out of the pairing)."""
    import json

    from benchmarks.learning import draw_swap

    seeds, mean, half = draw_swap.paired({0: 0.5, 1: 0.7, 2: 0.4}, {0: 0.4, 1: 0.5, 3: 0.9})
    # differences 0.1 and 0.2: sd 0.1 / sqrt(2), standard error 0.05, t quantile on 1 dof 12.7062
    assert seeds == [0, 1] and mean == pytest.approx(0.15) and half == pytest.approx(12.7062 * 0.05, abs=1e-3)
    assert permutation_p([1.0, 1.1, 0.9, 1.2, 1.0, 1.05], [0.0, 0.1, -0.1, 0.2, 0.0, 0.05]) < 0.01
    assert permutation_p([0.3, 0.4, 0.5], [0.5, 0.4, 0.3]) == 1.0

    def run(arm_dir, name, evals, metrics=()):
        d = tmp_path / arm_dir / "runs" / name
        d.mkdir(parents=True)
        (d / "summary.json").write_text("{}")
        (d / "eval.jsonl").write_text("".join(json.dumps({"step": s, "eval_success": v}) + "\n" for s, v in evals))
        (d / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in metrics))

    for seed, (ours, trl) in enumerate([(0.30, 0.40), (0.20, 0.40), (0.35, 0.30)]):
        run("learning_vs_trl_early", f"grpo_kernels_dapo_seed{seed}", [(3, ours)],
            [{"step": 0, "reward": 0.25 + seed / 10, "completion_length": 10.0, "grad_norm": 2.0,
              "truncated_fraction": 0.5, "invalid_group_rate": 0.25}])  # fmt: skip
        run("learning_vs_trl_early", f"trl_dapo_seed{seed}", [(3, trl)],
            [{"step": 0, "reward": 0.2 + seed / 10, "completions/mean_length": 12.0 - seed,
              "completions/clipped_ratio": 0.5, "frac_reward_zero_std": 0.9}])  # fmt: skip
    text = "\n".join(draw_swap.held_out_table(tmp_path, 4))
    assert "| ours, our draw | 3 (0-2) | 0.283 ± " in text and "| TRL, its own draw | 3 (0-2) | 0.367 ± " in text
    assert "| ours, our draw - TRL, its own draw | 3 | -0.083 ± " in text
    text = "\n".join(draw_swap.first_step_table(tmp_path))  # TRL's metric names read; its zero-std count not used
    assert "| reward | 0.300 ± 0.248 (3) | 0.350 ± 0.248 (3) | - | - |" in text
    assert "| invalid groups | - | 0.250 ± 0.000 (3) | - | - |" in text
    assert "| reward | ours, our draw - TRL, its own draw | 3 | +0.050 ± 0.000 |" in text
    assert "| completion length | ours, our draw - TRL, its own draw | 3 | -1.000 ± 2.484 |" in text
    assert draw_swap.same_draws(tmp_path) == []  # no trl_ourdraw runs: no section


@pytest.mark.parametrize("kind", ["rows", "steps", "positions"])
def test_seeded_draws_are_independent_across_rows_steps_and_positions(kind, monkeypatch):
    """The sampler's per-row seeded draws: two draws that share a group, a row across steps, or a row's successive
    tokens are independent (chi-square of their contingency table); a seeding that correlates them is rejected."""
    import grpo_kernels.train.rollout.hf_sampler as sampler

    logits = torch.randn(300, generator=torch.Generator().manual_seed(3)) * 2.0
    probs = torch.softmax(logits / 0.7, -1)
    stat, dof = independence(pair_draws(kind, logits, 3000, 0.7, seed=11), probs)
    assert dof >= 9 and chi2_sf(stat, dof) > 1e-3, (stat, dof)
    # broken seedings: the member left out of a row's seed (rows), the step left out of a group's (steps), and a
    # row's generator back at its start before every token (positions)
    if kind == "rows":
        monkeypatch.setattr(sampler, "row_seed", lambda seed, member: sampler.splitmix64(seed))
    elif kind == "steps":
        import grpo_kernels.train.rollout.sampling as sampling

        monkeypatch.setattr(sampling, "seed_for", lambda seed, step, rounds, k: sampler.splitmix64(seed * 1000 + k))
    else:
        draw = sampler.SeededSampling.__call__

        def restarting(self, input_ids, scores):
            states = [g.get_state() for g in self.generators]
            out = draw(self, input_ids, scores)
            for g, state in zip(self.generators, states, strict=True):
                g.set_state(state)
            return out

        monkeypatch.setattr(sampler.SeededSampling, "__call__", restarting)
    stat, dof = independence(pair_draws(kind, logits, 3000, 0.7, seed=11), probs)
    assert dof >= 9 and chi2_sf(stat, dof) < 1e-9, (stat, dof)


def test_rollout_stats_within_group_and_across_rounds():
    """rollout_stats: rows (r * prompts + k) * G ... are prompt k's round-r group; invalid = all rewards equal,
    reward_sd within a group, distinct completions / G, and the spread of a prompt's group means over rounds."""

    class Task:
        def reward(self, text, example):
            return float(text == example)

        def correct(self, text, example):
            return text == example

    class Tok:
        def decode(self, ids):
            return "".join(chr(97 + int(i)) for i in ids)

    examples = ["a", "b"]  # prompt k is right when its completion decodes to examples[k]
    t = torch.tensor
    groups = [[t([0]), t([0]), t([0]), t([0])],  # round 0, prompt 0: all right (invalid), one distinct
              [t([1]), t([2]), t([1]), t([3])],  # round 0, prompt 1: rewards 1 0 1 0
              [t([0]), t([1]), t([2]), t([3])],  # round 1, prompt 0: 1 0 0 0, all distinct
              [t([0]), t([0]), t([2]), t([2])]]  # round 1, prompt 1: all wrong (invalid)
    completions = [c for group in groups for c in group]
    out = rollout_stats(Task(), Tok(), examples, completions, [False] * 16, 4, rounds=2)
    assert out["invalid"] == [0.5, 0.5]
    assert out["reward"] == [pytest.approx(0.625), pytest.approx(0.25)]
    assert out["reward_sd"] == [pytest.approx(math.sqrt(3) / 8), pytest.approx(0.25)]
    assert out["distinct"] == [pytest.approx((1 / 4 + 1) / 2), pytest.approx((3 / 4 + 2 / 4) / 2)]
    assert out["group_mean_sd"] == [pytest.approx(0.75 / math.sqrt(2)), pytest.approx(0.5 / math.sqrt(2))]
    assert "group_mean_sd" not in rollout_stats(Task(), Tok(), examples, completions[:8], [False] * 8, 4)


def test_the_difference_of_the_means_has_a_welch_interval():
    # a = 1, 2, 3 (variance 1), b = 1, 1 (variance 0): se^2 = 1/3, Welch's dof = (1/3)^2 / ((1/3)^2 / 2) = 2
    diff, half = welch_difference([1.0, 2.0, 3.0], [1.0, 1.0])
    assert diff == 1.0 and half == pytest.approx(4.303 * (1 / 3) ** 0.5, rel=1e-3)
    assert welch_difference([0.5, 0.5], [0.25, 0.25]) == (0.25, 0.0)
    diff, half = welch_difference([0.5], [0.25, 0.75])
    assert diff == 0.0 and half != half  # one value on a side: no interval (nan)


@pytest.mark.parametrize("k, n, low, high", [(3, 5, 0.146633, 0.947255), (0, 10, 0.0, 0.308497),
                                             (10, 10, 0.691503, 1.0), (7, 20, 0.153909, 0.592189),
                                             (1, 1, 0.025, 1.0)])  # fmt: skip
def test_clopper_pearson_matches_the_exact_binomial_interval(k, n, low, high):
    # the beta quantiles Beta(k, n - k + 1) at 0.025 and Beta(k + 1, n - k) at 0.975, found by root-finding on
    # mpmath's regularized incomplete beta at 30 digits (independent of the bisection on binomial sums tested)
    assert clopper_pearson(k, n) == pytest.approx((low, high), abs=2e-6)
    with pytest.raises(ValueError, match="0 <= k <= n"):
        clopper_pearson(6, 5)


@pytest.mark.parametrize("table, p", [((3, 5, 0, 5), 0.166667), ((6, 10, 2, 10), 0.169802),
                                      ((0, 10, 10, 10), 1.082509e-05), ((2, 7, 2, 7), 1.0),
                                      ((1, 12, 9, 14), 0.005304)])  # fmt: skip
def test_fisher_exact_matches_the_two_sided_test(table, p):
    # the two-sided p summed in exact rational arithmetic (fractions.Fraction) over the tables with these margins
    assert fisher_exact(*table) == pytest.approx(p, rel=1e-4)
    assert fisher_exact(*table) == pytest.approx(fisher_exact(*table[2:], *table[:2]), rel=1e-12)  # symmetric
    with pytest.raises(ValueError, match="n >= 1"):
        fisher_exact(0, 0, 1, 2)


def test_the_learning_checks_failure_rates_from_calibration_gains():
    """tests/learning_check.py's fail_rates: how often a check of n seeds drawn like the calibration's would fail."""
    from learning_check import fail_rates

    gains = [0.1, 0.3] * 10  # mean 0.2, sd 0.1026 (n - 1)
    r = fail_rates(gains, n=4, threshold=0.14, draws=20_000)
    sd = (sum((g - 0.2) ** 2 for g in gains) / 19) ** 0.5
    assert r["mean"] == pytest.approx(0.2) and r["sd"] == pytest.approx(sd)
    assert r["normal"] == pytest.approx(0.5 * math.erfc((0.2 - 0.14) / (sd / 2) / math.sqrt(2)), rel=1e-9)
    # resampling four of {0.1, 0.3}: the mean is under 0.14 only with four 0.1s (three make 0.15)
    assert r["resampled"] == pytest.approx(1 / 16, abs=0.01)
    assert (r["sets_failed"], r["sets"]) == (0, 5)  # each set of four consecutive gains: mean 0.2
    assert fail_rates([0.2] * 6, n=6, threshold=0.12)["normal"] == 0.0  # no spread: the mean decides
    assert fail_rates([0.1] * 6, n=6, threshold=0.12)["normal"] == 1.0

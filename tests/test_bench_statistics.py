"""The statistics the learning benchmarks report with: Student's t quantile, the chi-square test of a sampler's
token counts (it passes a right draw and rejects a draw at the wrong temperature)."""

import math

import pytest
import torch

from benchmarks.common import t975
from benchmarks.sampler_distribution import chi2_sf, chi_square, multinomial_counts, ours_counts


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
    """benchmarks/draw_swap.py: differences paired by seed, a permutation test that separates shifted samples and
    not equal ones, and the tables from run files (a seed missing from one arm is left out of the pairing)."""
    import json

    from benchmarks import draw_swap

    seeds, mean, half = draw_swap.paired({0: 0.5, 1: 0.7, 2: 0.4}, {0: 0.4, 1: 0.5, 3: 0.9})
    # differences 0.1 and 0.2: sd 0.1 / sqrt(2), standard error 0.05, t quantile on 1 dof 12.7062
    assert seeds == [0, 1] and mean == pytest.approx(0.15) and half == pytest.approx(12.7062 * 0.05, abs=1e-3)
    assert draw_swap.permutation_p([1.0, 1.1, 0.9, 1.2, 1.0, 1.05], [0.0, 0.1, -0.1, 0.2, 0.0, 0.05]) < 0.01
    assert draw_swap.permutation_p([0.3, 0.4, 0.5], [0.5, 0.4, 0.3]) == 1.0

    def run(arm_dir, name, evals, metrics=()):
        d = tmp_path / arm_dir / "runs" / name
        d.mkdir(parents=True)
        (d / "summary.json").write_text("{}")
        (d / "eval.jsonl").write_text("".join(json.dumps({"step": s, "eval_success": v}) + "\n" for s, v in evals))
        (d / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in metrics))

    for seed, (ours, trl) in enumerate([(0.30, 0.40), (0.20, 0.40), (0.35, 0.30)]):
        run("learning_vs_trl_early", f"grpo_kernels_dapo_seed{seed}", [(3, ours)],
            [{"step": 0, "reward": 0.25, "completion_length": 10.0, "grad_norm": 2.0}])  # fmt: skip
        run("learning_vs_trl_early", f"trl_dapo_seed{seed}", [(3, trl)])
    text = "\n".join(draw_swap.held_out_table(tmp_path, 4))
    assert "| ours, our draw | 3 (0-2) | 0.283 ± " in text and "| TRL, its own draw | 3 (0-2) | 0.367 ± " in text
    assert "| ours, our draw - TRL, its own draw | 3 | -0.083 ± " in text
    assert draw_swap.same_draws(tmp_path) == []  # no trl_ourdraw runs: no section

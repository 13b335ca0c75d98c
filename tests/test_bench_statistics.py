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

"""Group-size maths: the paper's figures, and Monte-Carlo draws through group_advantages agree with theory."""

import pytest

from grpo_kernels import theory


@pytest.mark.parametrize("g,p,percent", [(4, 0.2, 41.1), (16, 0.2, 2.8), (4, 0.5, 12.5), (8, 0.5, 0.78)])
def test_invalid_group_rate_reproduces_paper_figures(g, p, percent):
    assert round(100 * theory.invalid_group_rate(g, p), 2 if percent < 1 else 1) == percent


def test_invalid_group_rate_edges_and_signal_fraction():
    assert theory.invalid_group_rate(1, 0.3) == pytest.approx(1.0)  # one sample is always "all equal"
    assert theory.invalid_group_rate(8, 0.0) == 1.0 and theory.invalid_group_rate(8, 1.0) == 1.0
    assert theory.expected_signal_fraction(4, 0.2) == pytest.approx(1 - 0.4112)
    rates = [theory.invalid_group_rate(g, 0.1) for g in (2, 4, 8, 16, 32, 64)]
    assert rates == sorted(rates, reverse=True)


def test_min_group_size_is_the_smallest_sufficient_g():
    g = theory.min_group_size(0.2, 0.05)
    assert theory.invalid_group_rate(g, 0.2) <= 0.05 < theory.invalid_group_rate(g - 1, 0.2)
    with pytest.raises(ValueError, match="every group is invalid"):
        theory.min_group_size(0.0, 0.5)


@pytest.mark.parametrize("g,p", [(2, 0.5), (4, 0.2), (16, 0.2), (8, 0.05)])
def test_simulated_invalid_rate_and_baseline_error_match_theory(g, p):
    sim = theory.simulate_advantages(g, p, 20_000, seed=g)
    assert abs(sim.invalid_rate - sim.invalid_rate_theory) < 5 * sim.invalid_rate_stderr + 1e-9
    assert sim.baseline_mse == pytest.approx(sim.baseline_mse_theory, rel=0.1)
    # With unbiased group std every valid group's advantages have sum(A^2) = G - 1 (up to eps).
    expected = (1 - sim.invalid_rate) * (g - 1) / g
    assert sim.advantage_var == pytest.approx(expected, rel=1e-3)


@pytest.mark.parametrize("args", [(0, 0.5), (4, 1.5), (4, -0.1), (True, 0.5)])
def test_bad_arguments_raise(args):
    with pytest.raises(ValueError):
        theory.invalid_group_rate(*args)

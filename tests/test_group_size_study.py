"""benchmarks/group_size/study.py: the theory table, the Monte-Carlo trends, and `--quick` end to end (via the CLI)."""

import pytest

from benchmarks.group_size import study
from grpo_kernels import cli


def test_theory_reproduces_the_paper_figures():
    figures = study.paper_figures()
    assert [(p, g) for p, g, _, _ in figures] == [(0.2, 4), (0.2, 16), (0.5, 4), (0.5, 8)]
    for _, _, paper, ours in figures:
        assert ours == paper
    table = study.theory_table()
    assert "| 0.2 | 68.00% | 41.12% | 16.78% | 2.81% |" in table and "| 0.5 | 50.00% | 12.50% | 0.78% |" in table


def test_monte_carlo_noise_falls_and_alignment_rises_with_group_size():
    rows = study.monte_carlo(group_sizes=(2, 4, 8, 16, 32), reps=1000, seed=0)
    relative = [r["relative_variance"] for r in rows]
    cosine = [r["cosine"] for r in rows]
    assert all(a > 1.5 * b for a, b in zip(relative, relative[1:], strict=False)), relative
    assert all(a < b for a, b in zip(cosine, cosine[1:], strict=False)), cosine
    assert rows[-1]["cosine"] > 0.95
    raw = [r["variance"] for r in rows]
    assert all(a > b for a, b in zip(raw[1:], raw[2:], strict=False)), raw  # from G=4 on (G=2: mostly invalid)


def test_beta_binomial_prediction():
    # groups that are all right or all wrong: pass rates at 0 and 1, every group of any size is invalid
    assert study.betabinom_all_equal([0, 4, 0, 4], 4, 8) == pytest.approx(1.0, abs=1e-3)
    # binomial counts (no overdispersion) of p = 0.5: the homogeneous formula
    counts = [0] * 1 + [1] * 4 + [2] * 6 + [3] * 4 + [4] * 1
    assert study.betabinom_all_equal(counts, 4, 4) == pytest.approx(0.125, abs=0.01)


@pytest.mark.slow
def test_quick_study_end_to_end(tmp_path, capsys):
    cli.main(["group-size-study", "--quick", "--out", str(tmp_path)])
    for name in ("summary.md", "runs.csv", "montecarlo.png", "empirical.png", "invalid_vs_theory.png"):
        assert (tmp_path / name).stat().st_size > 0, name
    summary = (tmp_path / "summary.md").read_text()
    assert "paper 41.1%, here 41.1%" in summary and "| G=2 |" in summary and "| adaptive 8->16 |" in summary
    assert not (tmp_path / "runs").exists()
    assert "wrote" in capsys.readouterr().out


def test_model_study_prediction_is_unbiased_and_measurement_counts_disjoint_groups():
    import math

    from benchmarks.group_size import model as gm

    for p in (0.0, 0.1, 0.37, 0.9):  # E over s ~ Binomial(K, p) of the estimate equals p^G + (1-p)^G exactly
        for k, g in ((8, 2), (32, 8), (32, 32)):
            mean = sum(math.comb(k, s) * p**s * (1 - p) ** (k - s) * gm.unbiased_invalid(s, k, g) for s in range(k + 1))
            assert abs(mean - (p**g + (1 - p) ** g)) < 1e-12
    assert gm.measured_invalid([True, True, False, True, False, False, True], 2) == 2 / 3  # the 7th is left over
    rows = [{"successes_a": 4, "outcomes_b": [True] * 4 + [False] * 4}, {"successes_a": 0, "outcomes_b": [False] * 8}]
    table = {r["G"]: r for r in gm.compare(rows, k=8)}
    assert set(table) == {2, 4, 8}
    assert table[4]["measured"] == 1.0 and table[8]["measured"] == 0.5
    assert abs(table[2]["predicted"] - (2 * math.comb(4, 2) / math.comb(8, 2) + 1) / 2) < 1e-12
    assert table[2]["naive"] == 0.25**2 + 0.75**2
    assert [label for label, _ in gm.histogram([0.0, 0.5, 1.0])][0] == "p = 0"
    assert sum(count for _, count in gm.histogram([0.0, 0.01, 0.05, 0.5, 0.96, 1.0])) == 6

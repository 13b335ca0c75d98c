"""benchmarks/group_size_study.py: the theory table, the Monte-Carlo trends, and `--quick` end to end (via the CLI)."""

import importlib.util
from pathlib import Path

import pytest

from grpo_kernels import cli

PATH = Path(__file__).resolve().parents[1] / "benchmarks" / "group_size_study.py"
spec = importlib.util.spec_from_file_location("group_size_study", PATH)
study = importlib.util.module_from_spec(spec)
spec.loader.exec_module(study)


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

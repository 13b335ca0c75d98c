"""benchmarks/learning/round3.py: round 3's primary comparison (endpoints.md) from run files, on synthetic run
directories: the step-4 line of each run, the pooling of the three result directories, the Welch interval and the
permutation p of benchmarks.learning.intervals, the interim label and missing seeds, the verdict, and the
performance page's block (benchmarks/readme.py)."""

import json
import statistics
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks import readme  # noqa: E402
from benchmarks.learning import round3  # noqa: E402
from benchmarks.learning.intervals import mean_ci, permutation_p, smallest_gap, welch_difference  # noqa: E402


def write_run(results: Path, directory: str, name: str, evals: list, finished: bool = True) -> Path:
    run = results / directory / "runs" / name
    run.mkdir(parents=True)
    (run / "eval.jsonl").write_text("".join(json.dumps({"step": s, "eval_success": v}) + "\n" for s, v in evals))
    if finished:
        (run / "summary.json").write_text("{}")
    return run


def home(trainer: str, seed: int) -> str:
    """The result directory endpoints.md reads this seed of this trainer from."""
    return next(d for d, seeds in round3.SOURCES[trainer] if seed in seeds)


def write_study(results: Path, values: dict) -> None:
    """values: {trainer: {seed: step-4 success}}, each run where the study keeps it: 40-step runs (an evaluation
    every 4 steps) in learning_vs_trl, 4-step runs elsewhere."""
    (results / round3.STUDY).mkdir(parents=True, exist_ok=True)
    (results / round3.STUDY / "endpoints.md").write_text("# endpoints\n")
    for trainer, by_seed in values.items():
        for seed, value in by_seed.items():
            directory = home(trainer, seed)
            evals = [(3, value)] + ([(s, 0.9) for s in range(7, 40, 4)] if directory == "learning_vs_trl" else [])
            write_run(results, directory, f"{trainer}_dapo_seed{seed}", evals)


def spread(seeds, centre: float, step: float = 0.01) -> dict:
    return {s: round(centre + step * ((s * 7) % 5 - 2), 4) for s in seeds}


@pytest.fixture
def short_permutation(monkeypatch):
    """200 relabellings instead of 20,000 where a test does not check the permutation p (keeps this file fast); the
    test of the p itself runs the real setting."""
    monkeypatch.setattr(round3, "ROUNDS", 200)


def test_pooling_reads_the_step4_line_of_each_directory(tmp_path):
    """eval.jsonl's "step" is the 0-based last step: the step-4 evaluation is "step": 3, the first of a 40-step run's
    evaluations and the only one of a 4-step run's; a line at "step": 4 (the evaluation after 5 steps) is not it."""
    write_run(tmp_path, "learning_vs_trl", "grpo_kernels_dapo_seed0", [(3, 0.25), (4, 0.99), (7, 0.5), (39, 0.6)])
    write_run(tmp_path, "learning_vs_trl", "grpo_kernels_dapo_seed5", [(3, 0.70)])  # seed 5 is read from _early
    write_run(tmp_path, "learning_vs_trl_early", "grpo_kernels_dapo_seed5", [(3, 0.30)])
    write_run(tmp_path, "learning_vs_trl_early", "grpo_kernels_dapo_seed21", [(3, 0.80)])  # 21 is read from round 3
    write_run(tmp_path, round3.STUDY, "grpo_kernels_dapo_seed21", [(3, 0.35)])
    write_run(tmp_path, round3.STUDY, "grpo_kernels_hfdraw_dapo_seed22", [(3, 0.95)])  # another arm
    write_run(tmp_path, round3.STUDY, "trl_dapo_seed20", [(-1, 0.1), (3, 0.45)])
    write_run(tmp_path, "learning_vs_trl_early", "trl_dapo_seed20", [(3, 0.85)])  # TRL's 20 is a new seed
    pool = round3.pooled(tmp_path)
    assert pool.values == {"grpo_kernels": {0: 0.25, 5: 0.30, 21: 0.35}, "trl": {20: 0.45}}
    assert pool.sources["grpo_kernels"] == {0: "learning_vs_trl", 5: "learning_vs_trl_early", 21: round3.STUDY}
    assert pool.outside["grpo_kernels"] == [("learning_vs_trl", 5, 0.70), ("learning_vs_trl_early", 21, 0.80)]
    assert pool.outside["trl"] == [("learning_vs_trl_early", 20, 0.85)]


def test_a_run_without_its_step4_line_is_a_clear_error(tmp_path):
    run = write_run(tmp_path, round3.STUDY, "trl_dapo_seed30", [(4, 0.4), (7, 0.5)])  # 1-based steps: no step 3
    with pytest.raises(ValueError, match=r'trl_dapo_seed30/eval.jsonl: no line with "step": 3, the held-out '
                       r"evaluation after 4 optimizer steps .*steps: \[4, 7\]"):  # fmt: skip
        round3.pooled(tmp_path)
    (run / "eval.jsonl").unlink()
    with pytest.raises(ValueError, match=r'no line with "step": 3.*steps: \[\]'):
        round3.pooled(tmp_path)
    (run / "eval.jsonl").write_text('{"step": 3, "eval_success": 0.4}\n{"step": 3, "eval_success": 0.5}\n')
    with pytest.raises(ValueError, match=r"lines that disagree \(\[0.4, 0.5\]\)"):
        round3.pooled(tmp_path)


def test_the_primary_is_intervals_welch_difference_and_permutation_p_on_the_pooled_values(tmp_path):
    ours, trl = spread(range(0, 7), 0.33) | {22: 0.41}, spread(range(1, 6), 0.37) | {25: 0.30, 30: 0.44}
    write_study(tmp_path, {"grpo_kernels": ours, "trl": trl})
    pool = round3.pooled(tmp_path)
    assert pool.values == {"grpo_kernels": ours, "trl": trl}
    result = round3.primary(pool.values)
    a, b = [ours[s] for s in sorted(ours)], [trl[s] for s in sorted(trl)]
    assert (result.diff, result.half) == welch_difference(a, b)
    assert result.p == permutation_p(a, b, rounds=20_000, seed=0)
    assert result.n == {"grpo_kernels": 8, "trl": 7}
    assert result.mean == {"grpo_kernels": mean_ci(a), "trl": mean_ci(b)}
    assert result.sd == {"grpo_kernels": statistics.stdev(a), "trl": statistics.stdev(b)}
    both = [1, 2, 3, 4, 5]  # seeds in both arms: paired by seed over them only
    assert result.paired_seeds == 5 and result.paired == mean_ci([ours[s] - trl[s] for s in both])
    text = "\n".join(round3.findings(result, interim=True))
    assert f"**ours - TRL (interim; the primary): {result.diff:+.3f} ± {result.half:.3f}**" in text
    assert f"permutation p {result.p:.3f} (two-sided, 20,000 relabellings, seed 0)" in text


def test_an_incomplete_study_lists_the_missing_seeds_and_says_interim(tmp_path, short_permutation):
    ours, trl = spread(list(range(0, 23)) + [40], 0.33), spread(range(0, 21), 0.37)
    write_study(tmp_path, {"grpo_kernels": ours, "trl": trl})
    write_run(tmp_path, round3.STUDY, "trl_dapo_seed21", [], finished=False)  # died: failed.txt, no summary.json
    pool = round3.pooled(tmp_path)
    assert not pool.complete and pool.died == {"grpo_kernels": [], "trl": [21]}
    assert pool.missing("grpo_kernels") == [*range(23, 40), 41, 42, 43, 44, 45, 46]
    assert pool.missing("trl") == list(range(21, 47))
    assert round3.state(pool) == "interim, 24 (ours) and 21 (TRL) of 47 seeds per arm"
    text = round3.report(tmp_path)
    assert "**Interim: 24 (ours) and 21 (TRL) of 47 seeds per arm.**" in text
    assert "Missing seeds: ours 23-39, 41-46 (23); TRL 21-46 (26)." in text
    assert "runs without summary.json (died or unfinished), not counted: seeds 21." in text
    assert "Interim verdict, not the endpoint" in text and "Verdict: **" not in text
    page = "\n".join(readme.learning_round3_section(tmp_path))
    assert "ours - TRL (interim, 24 (ours) and 21 (TRL) of 47 seeds per arm)**" in page
    assert "Missing seeds: ours 23-39, 41-46; TRL 21-46." in page
    write_study(tmp_path / "even", {"grpo_kernels": spread(range(30), 0.3), "trl": spread(range(30), 0.4)})
    assert round3.state(round3.pooled(tmp_path / "even")) == "interim, 30 of 47 seeds per arm"


def test_a_complete_study_is_not_interim_and_the_page_block_carries_its_numbers(tmp_path, short_permutation):
    write_study(tmp_path, {"grpo_kernels": spread(range(47), 0.33, 0.05), "trl": spread(range(47), 0.34, 0.05)})
    pool = round3.pooled(tmp_path)
    assert pool.complete and round3.state(pool) == "complete, 47 of 47 seeds per arm"
    result = round3.primary(pool.values)
    text = round3.report(tmp_path)
    assert "**Complete: 47 of 47 seeds per arm.**" in text and "nterim" not in text and "Missing" not in text
    assert "- Verdict: **not resolved: the Welch interval includes 0**. Bound: " in text
    page = "\n".join(readme.learning_round3_section(tmp_path))
    assert "ours - TRL (complete, 47 of 47 seeds per arm)**" in page and "nterim" not in page
    assert f"**ours - TRL (the primary): {result.diff:+.3f} ± {result.half:.3f}**" in page
    assert f"permutation p {result.p:.3f} (two-sided, 200 relabellings" in page
    assert f"Bound: {result.bound:.3f}" in page and f"true gap of {result.gap:.3f}" in page


def test_the_verdict_resolved_when_the_welch_interval_excludes_0_else_the_bound_and_smallest_gap(short_permutation):
    low, high = spread(range(8), 0.30), spread(range(8), 0.40)  # sd 0.016 each, 0.1 apart: resolved
    result = round3.primary({"grpo_kernels": low, "trl": high})
    assert result.resolved and result.diff + result.half < 0
    text = "\n".join(round3.findings(result, interim=True))
    assert "resolved: the Welch interval excludes 0 so far. What would follow (endpoints.md): the swap arms" in text
    assert "Bound" not in text
    text = "\n".join(round3.findings(result, interim=False))
    assert "- Verdict: **resolved: the Welch interval excludes 0**. What follows (endpoints.md)" in text
    wide = {s: v + (0.2 if s % 2 else -0.2) for s, v in spread(range(8), 0.40).items()}  # the same 0.1 gap, sd 0.2
    result = round3.primary({"grpo_kernels": low, "trl": wide})
    assert not result.resolved and result.diff - result.half < 0 < result.diff + result.half
    assert result.bound == pytest.approx(0.1 + result.half)
    sd_a, sd_b = statistics.stdev(low.values()), statistics.stdev(wide.values())
    assert result.gap == smallest_gap(sd_a, sd_b, 8, 8)
    text = "\n".join(round3.findings(result, interim=True))
    assert "not resolved: the Welch interval includes 0 so far." in text
    assert f"Bound: {result.bound:.3f} (|mean| + half-width" in text and f"gap of {result.gap:.3f} four" in text
    with pytest.raises(ValueError, match="two seeds per arm"):
        round3.primary({"grpo_kernels": {0: 0.3}, "trl": high})


def test_write_puts_the_report_beside_the_endpoints_and_the_page_has_no_block_without_them(
    tmp_path, capsys, short_permutation
):
    write_study(tmp_path, {"grpo_kernels": spread(range(3), 0.3), "trl": spread(range(3), 0.4)})
    assert round3.main(["--results", str(tmp_path), "--write"]) == 0
    written = (tmp_path / round3.STUDY / "primary.md").read_text()
    assert written == capsys.readouterr().out and written.startswith("# Learning vs TRL, round 3")
    (tmp_path / round3.STUDY / "endpoints.md").unlink()
    assert readme.learning_round3_section(tmp_path) == []

"""Smoke tests of the benchmark runner (benchmarks/run.py --quick) and of benchmarks/trainer/e2e_vs_trl.py --quick.

    .venv/bin/python -m pytest -q tests/test_bench_run.py     # ~4-5 minutes on 2 cores

Both run as subprocesses from the repository root, writing into a tmp dir; the committed results under
benchmarks/results/ must come out byte for byte unchanged.
"""

import csv
import hashlib
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
OPS = ("advantages", "logprobs", "loss", "loss_from_logits", "fused_linear", "packing", "planner", "trl_dropin")


def snapshot() -> dict:
    """{path: sha256} of the files in benchmarks/results/ (its subdirectories belong to other studies)."""
    return {p: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(RESULTS.iterdir()) if p.is_file()}


def rows(path: Path) -> list:
    with path.open(newline="") as f:
        return list(csv.DictReader(f))


@pytest.mark.slow
def test_quick_runner_writes_rows_tables_and_plots(tmp_path):
    before = snapshot()
    out = subprocess.run([sys.executable, "-m", "benchmarks.run", "--quick", "--out", str(tmp_path)], cwd=ROOT,
                         capture_output=True, text=True, timeout=600)  # fmt: skip
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "[7/7] trl_dropin:" in out.stdout
    combined = rows(tmp_path / "cpu.csv")
    assert {r["op"] for r in combined} == set(OPS)
    for r in combined:
        assert float(r["median_ms"]) > 0 and r["git_sha"] and r["shape"] and r["provider"]
    assert any(r["provider"] == "ours" and r["vs_best_baseline"] for r in combined)
    report = (tmp_path / "cpu.md").read_text()
    for op in OPS:
        assert f"\n## {op}\n\n| case | shape | provider | median ms | peak MB | vs best baseline |" in report
        assert (tmp_path / f"cpu_{op}.png").stat().st_size > 0
    assert snapshot() == before


@pytest.mark.slow
def test_e2e_vs_trl_quick_has_three_providers(tmp_path):
    before = snapshot()
    csv_path = tmp_path / "e2e.csv"
    out = subprocess.run([sys.executable, "benchmarks/trainer/e2e_vs_trl.py", "--quick", "--csv", str(csv_path)],
                         cwd=ROOT, capture_output=True, text=True, timeout=600)  # fmt: skip
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    result = rows(csv_path)
    assert [r["provider"] for r in result] == ["trl", "fused_trl", "grpo_kernels"]
    for r in result:
        assert r["steps"] == "2"
        for key in ("step_s", "loss_step_s", "completion_tokens_per_s", "peak_rss_mb"):
            assert float(r[key]) > 0, (r["provider"], key)
    assert "| grpo_kernels |" in out.stdout
    assert snapshot() == before


# docs/performance.md (benchmarks/readme.py): generated from the results files, never hand-edited.


def test_performance_page_matches_the_committed_results():
    from benchmarks import readme

    text = readme.PAGE.read_text()
    assert text.count(readme.BEGIN) == 1 and text.count(readme.END) == 1
    section = text.split(readme.BEGIN)[1].split(readme.END)[0]
    assert section.strip(), "empty Performance section"
    assert readme.updated_page(text, readme.render()) == text, "run: .venv/bin/python -m benchmarks.readme"
    for table in readme.TABLES:  # every op of `make bench` has its table (cpu.csv is committed)
        assert table.title in section, table.op


def write_csv(path: Path, rows: list) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)


def combined_row(provider, ms, *, op="planner", case="greedy", shape="N=100000", timestamp="2026-01-02T03:04:05",
                 sha="abc1234", peak=""):  # fmt: skip
    return {"timestamp": timestamp, "device": "Test CPU", "git_sha": sha, "benchmark": op, "op": op, "case": case,
            "shape": shape, "provider": provider, "median_ms": ms, "peak_mb": peak, "vs_best_baseline": "",
            "torch": "9.9", "threads": 3}  # fmt: skip


def test_readme_render_takes_the_latest_rows_and_computes_speedups(tmp_path):
    from benchmarks import readme

    write_csv(tmp_path / "cpu.csv", [
        combined_row("reference", 800.0), combined_row("cpp", 100.0),            # an older run: replaced below
        combined_row("reference", 700.0, timestamp="2026-02-03T00:00:00", sha="def5678"),
        combined_row("cpp", 140.0, timestamp="2026-02-03T00:00:00", sha="def5678"),
        combined_row("reference", 5.0, shape="N=1000"),                         # not in the page's planner table
        combined_row("naive", 300.0, op="fused_linear", case="fp32", shape="8x4x16", peak=40.0),
        combined_row("floor", 90.0, op="fused_linear", case="fp32", shape="8x4x16", peak=10.0),
        combined_row("ours", 120.0, op="fused_linear", case="fp32", shape="8x4x16", peak=2.0),
    ])  # fmt: skip
    section = readme.render(tmp_path)
    assert "on Test CPU, torch 9.9, 3 threads" in section
    assert "| greedy | N=100000 | 700 | 140 | **5.00x** |" in section  # the latest rows: 700 / 140
    assert "2026-02-03, commit def5678" in section and "abc1234" not in section.split("plan_micro_batches")[1]
    assert "N=1000 " not in section
    # the floor is not a baseline: speed-up vs naive (300 / 120), and a time-vs-floor column (120 / 90)
    assert "| fp32 | 8x4x16 | 90 (10 MB) | 300 (40 MB) |  | 120 (2 MB) | **2.50x** | 1.33x |" in section
    assert "selective_logprobs" not in section  # an op without rows has no table
    assert "**GPU:** no numbers yet" in section


def test_readme_render_errors_on_a_table_without_rows_and_on_missing_markers(tmp_path):
    from benchmarks import readme

    write_csv(tmp_path / "cpu.csv", [combined_row("reference", 5.0, shape="N=1000")])
    with pytest.raises(SystemExit, match="no planner rows"):
        readme.render(tmp_path)
    with pytest.raises(SystemExit, match="exactly one"):
        readme.updated_page("# a page without the markers\n", "## Performance\n")
    assert readme.updated_page(f"a\n{readme.BEGIN}\nold\n{readme.END}\nb\n", "new\n") == (
        f"a\n{readme.BEGIN}\nnew\n{readme.END}\nb\n"
    )


def test_readme_render_shows_a_gpu_check_csv(tmp_path):
    from benchmarks import readme

    write_csv(tmp_path / "gpu_check_NVIDIA_H200.csv", [
        {"kind": "check", "op": "advantages", "shape": "float32", "provider": "ours", "value": "1e-7",
         "unit": "rel err", "ok": "True", "rate": "", "vs_best_baseline": ""},
        {"kind": "check", "op": "logprobs", "shape": "bfloat16", "provider": "ours", "value": "9e-1",
         "unit": "rel err", "ok": "False", "rate": "", "vs_best_baseline": ""},
        {"kind": "time", "op": "logprobs", "shape": "4096x152064", "provider": "ours", "value": "1.234", "unit": "ms",
         "ok": "", "rate": "2000 GB/s (50% of copy)", "vs_best_baseline": "3.10x"},
    ])  # fmt: skip
    write_csv(tmp_path / "gpu_check_cpu-dry-run.csv", [
        {"kind": "check", "op": "x", "shape": "", "provider": "", "value": "", "unit": "", "ok": "True", "rate": "",
         "vs_best_baseline": ""}])  # fmt: skip
    section = readme.render(tmp_path)
    assert "**NVIDIA H200**" in section and "1 of 2 checks against the reference pass" in section
    assert "| logprobs | 4096x152064 | ours | 1.234 ms | 2000 GB/s (50% of copy) | 3.10x |" in section
    assert "dry-run" not in section and "no numbers yet" not in section


def test_readme_render_shows_the_latest_run_of_each_real_model_e2e_csv(tmp_path):
    from benchmarks import readme

    def row(provider, step, timestamp):
        return {"timestamp": timestamp, "device": "Test CPU", "torch": "9.9", "triton": "1.0", "git_sha": "abc1234",
                "trl": "1.16.0", "provider": provider, "steps": 4, "group_size": 8, "prompts_per_step": 4,
                "max_new_tokens": 64, "step_s": step, "loss_step_s": step / 2, "completion_tokens_per_s": 10.0,
                "peak_rss_mb": 100.0, "step_vs_trl": step / 20.0, "loss_step_vs_trl": step / 20.0}  # fmt: skip

    write_csv(tmp_path / "e2e_smollm2-135m_cpu.csv", [
        row("trl", 30.0, "2026-01-01T00:00:00"), row("grpo_kernels", 25.0, "2026-01-01T00:00:00"),  # older
        row("trl", 20.0, "2026-01-02T00:00:00"), row("grpo_kernels", 8.0, "2026-01-02T00:00:00"),
    ])  # fmt: skip
    section = readme.render(tmp_path)
    assert "benchmarks/trainer/e2e_vs_trl.py --model smollm2-135m`" in section
    assert "smollm2-135m, task arith, G = 8" in section
    assert "| `grpo-kernels train` | 8.000 | 4.000 | 10 | 100 | 0.40x |" in section
    assert "25.000" not in section and "tiny Qwen2" not in section  # the older run; no e2e_cpu.csv here


def test_render_shows_the_group_size_studies_of_a_real_model_from_their_reports(tmp_path):
    """The gradient-agreement and time-to-target tables come from the studies' own generated reports (their command
    and tables, nothing typed by hand), after the claims they test; the tiny quick study is left out."""
    from benchmarks import readme

    write_csv(tmp_path / "cpu.csv", [combined_row("reference", 700.0), combined_row("cpp", 140.0)])
    grads = tmp_path / "group_size_study" / "m_arith_d2"
    grads.mkdir(parents=True)
    (grads / "gradients.md").write_text("# Gradient agreement\n\nCommand: `gk --gradients` (9 s). Per G: ...\n\n"
                                        "| G | cosine |\n|---|---|\n| 2 | 0.1 |\n")  # fmt: skip
    learn = tmp_path / "group_size_learning" / "m"
    learn.mkdir(parents=True)
    (learn / "summary.md").write_text("# Learning\n\nCommand: `gk --learning`\n\n**In progress: 3 of the 14 runs "
                                      "asked for are finished** (...).\n\nPer setting ...\n\n| setting | steps |\n"
                                      "|---|---|\n| 8 | 12 |\n\n## What the adaptive schedule did\n\n| run | step |\n"
                                      "|---|---|\n")  # fmt: skip
    (learn / "reading.md").write_text("Reading, by hand: G = 8 is the optimum here.\n")
    tiny = tmp_path / "group_size_learning" / "tiny"
    tiny.mkdir()
    (tiny / "summary.md").write_text("Command: `quick`\n\n| setting |\n|---|\n| 2 |\n")
    section = readme.render(tmp_path)
    study = section.split("**Group size on a real model.**")[1]
    assert "3,400 to 1,280" in study and "(`gk --gradients`;" in study and "| 2 | 0.1 |" in study
    assert "(`gk --learning`;" in study and "| 8 | 12 |" in study and "### What the adaptive schedule did" in study
    assert "**In progress: 3 of the 14 runs" in study and "Per setting" not in study  # the tables, not the prose
    assert study.index("| run | step |") < study.index("Reading, by hand: G = 8 is the optimum here.")
    assert "quick" not in study
    empty = tmp_path / "empty"
    write_csv(empty / "cpu.csv", [combined_row("reference", 700.0), combined_row("cpp", 140.0)])
    assert "Group size on a real model" not in readme.render(empty)


def test_render_shows_the_learning_vs_trl_study_from_its_report(tmp_path):
    """The same run in TRL and here: the report's command and tables, then the reading written beside it."""
    from benchmarks import readme

    write_csv(tmp_path / "cpu.csv", [combined_row("reference", 700.0), combined_row("cpp", 140.0)])
    assert "Learning vs TRL" not in readme.render(tmp_path)
    study = tmp_path / "learning_vs_trl"
    study.mkdir()
    (study / "summary.md").write_text("# Learning vs TRL\n\nCommand: `python -m benchmarks.learning.vs_trl`\n\n"
                                      "## loss dapo\n\nHeld-out success ...\n\n| after step | trl | grpo_kernels |"
                                      " verdict |\n|---:|---|---|---|\n| 4 | 0.4 ± 0.1 (3) | 0.5 ± 0.1 (3) | ok |\n")
    (study / "reading.md").write_text("Reading, by hand: they learn alike.\n")
    section = readme.render(tmp_path).split("**Learning vs TRL")[1]
    assert "(`python -m benchmarks.learning.vs_trl`;" in section and "### loss dapo" in section
    assert "| 4 | 0.4 ± 0.1 (3) | 0.5 ± 0.1 (3) | ok |" in section and "Held-out success ..." not in section
    assert section.index("| 4 | 0.4") < section.index("Reading, by hand: they learn alike.")


def test_readme_learning_section_carries_the_endpoints_and_the_seeds_that_ran(tmp_path):
    """The learning-vs-TRL report's endpoint list and its seeds line reach the performance page with its tables."""
    from benchmarks import readme

    (tmp_path / "learning_vs_trl").mkdir()
    (tmp_path / "learning_vs_trl" / "summary.md").write_text("\n".join([
        "# Learning vs TRL", "", "Command: `python -m benchmarks.learning.vs_trl --seeds 0-9`", "",
        "Seeds that ran: grpo_kernels dapo: 0, 1; trl dapo: 0.", "", "## Endpoints, loss dapo", "",
        "- Held-out success after step 40, ours - TRL: +0.010 ± 0.100.", "- Collapsed, trl: 0 of 1.", "",
        "## loss dapo", "", "| after step | trl |", "|---:|---|", "| 40 | 0.5 |", ""]))  # fmt: skip
    text = "\n".join(readme.learning_vs_trl_section(tmp_path))
    assert "`python -m benchmarks.learning.vs_trl --seeds 0-9`" in text
    assert "\n\nSeeds that ran: grpo_kernels dapo: 0, 1; trl dapo: 0.\n\n" in text
    assert ("### Endpoints, loss dapo\n\n- Held-out success after step 40, ours - TRL: +0.010 ± 0.100.\n"
            "- Collapsed, trl: 0 of 1.\n\n### loss dapo\n\n| after step | trl |") in text  # fmt: skip


def test_readme_shows_the_learning_checks_calibration_under_its_own_heading(tmp_path):
    from benchmarks import readme

    assert readme.learning_check_section(tmp_path) == []  # no calibration: no section
    (tmp_path / "learning_check").mkdir()
    (tmp_path / "learning_check" / "calibration.md").write_text("# Its title\n\nHow it ran.\n\n```\nrates\n```\n")
    lines = readme.learning_check_section(tmp_path)
    assert lines[0].startswith("**The CI learning check, calibrated**") and "# Its title" not in lines
    assert lines[1:] == ["", "How it ran.", "", "```", "rates", "```", ""]

"""Smoke tests of the benchmark runner (benchmarks/run.py --quick) and of benchmarks/e2e_vs_trl.py --quick.

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
    out = subprocess.run([sys.executable, "benchmarks/e2e_vs_trl.py", "--quick", "--csv", str(csv_path)], cwd=ROOT,
                         capture_output=True, text=True, timeout=600)  # fmt: skip
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    result = rows(csv_path)
    assert [r["provider"] for r in result] == ["trl", "fused_trl", "grpo_kernels"]
    for r in result:
        assert r["steps"] == "2"
        for key in ("step_s", "loss_step_s", "completion_tokens_per_s", "peak_rss_mb"):
            assert float(r[key]) > 0, (r["provider"], key)
    assert "| grpo_kernels |" in out.stdout
    assert snapshot() == before

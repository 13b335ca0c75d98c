"""The GPU stages of benchmarks/gpu/ run here as CPU dry runs: every row they write comes out, so a lent GPU's few
minutes go to measuring, not to fixing a script."""

import csv
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_ops_limits_dry_run_writes_every_row(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "benchmarks.gpu.ops_limits", "--dry-run", "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=300, cwd=ROOT)  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = list(csv.DictReader((tmp_path / "ops_limits.csv").open()))
    kinds = {(r["kind"], r["op"]) for r in rows}
    for op in ("grpo_loss fwd+bwd", "group_advantages"):
        assert {("time", op), ("launches", op), ("host", op), ("syncs", op), ("determinism", op)} <= kinds, op
    assert [r["value"] for r in rows if r["kind"] == "determinism"] == ["20/20", "20/20"]
    shapes = {r["shape"] for r in rows if r["op"] == "group_advantages" and r["kind"] == "time"}
    assert any("G=16" in s for s in shapes) and any("G=8..24" in s for s in shapes)


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="this machine has CUDA: the stage would run")
def test_ops_limits_without_cuda_refuses_in_one_line():
    proc = subprocess.run([sys.executable, "-m", "benchmarks.gpu.ops_limits"], capture_output=True, text=True,
                          timeout=120, cwd=ROOT)  # fmt: skip
    assert proc.returncode != 0 and "no CUDA device" in proc.stderr

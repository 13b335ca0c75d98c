"""benchmarks/gpu/check.py's CPU dry run: every check and timing case builds and runs at tiny shapes (C++ kernels
instead of Triton), every check passes, and the CSV and the table come out, so the script is ready for a GPU."""

import csv
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu" / "check.py"


@pytest.mark.slow
def test_the_gpu_check_dry_run_passes_every_check_and_writes_its_table(tmp_path):
    out = tmp_path / "gpu_check.csv"
    proc = subprocess.run([sys.executable, str(SCRIPT), "--dry-run", "--out", str(out)], capture_output=True,
                          text=True, timeout=600)  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = list(csv.DictReader(out.open()))
    checks = [r for r in rows if r["kind"] == "check"]
    assert len(checks) == 16 and all(r["ok"] == "True" for r in checks)
    assert {r["op"] for r in checks} >= {"checkpoint_offload"}
    ops = {r["op"] for r in rows if r["kind"] == "time"}
    assert ops == {"group_advantages", "selective_logprobs fwd+bwd", "grpo_loss fwd+bwd",
                   "grpo_loss_from_logits fwd+bwd", "fused_linear_grpo_loss fwd+bwd",
                   "checkpoint_offload fwd+bwd"}  # fmt: skip
    assert [r["provider"] for r in rows if r["kind"] == "memory"] == ["blocks", "offload"]
    assert "checks: 16 ok, failed: none" in proc.stdout and "| op | shape |" in proc.stdout


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="this machine has CUDA: the full run would run")
def test_without_cuda_the_full_run_refuses_clearly():
    proc = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and "no CUDA device" in proc.stderr


def test_a_nan_error_fails_the_check_wherever_it_is_in_the_list():
    from benchmarks.gpu.check import _worst

    nan = float("nan")
    assert _worst([1e-6, 2e-6]) == 2e-6
    assert all(not (_worst(e) <= 1.0) for e in ([nan, 0.1], [0.1, nan], [nan]))


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="this machine has CUDA: the profile would run")
def test_the_gpu_profile_imports_and_refuses_clearly_without_cuda():
    script = SCRIPT.parent / "profile_ops.py"
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and "no CUDA device" in proc.stderr, proc.stderr[-2000:]

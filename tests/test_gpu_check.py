"""benchmarks/gpu/check.py and profile_ops.py without a GPU: they refuse clearly, and a NaN fails a check. The check's
CPU dry run (every check and timing case at tiny shapes, every check passing, the CSV and the table) runs inside
run.sh's dry run in test_gpu_stages.py."""

import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu" / "check.py"


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

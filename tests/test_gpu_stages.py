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


def torchrun_dry_run(module: str, out: Path) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1", "-m", module,
               "--dry-run", "--out", str(out)]  # fmt: skip
    proc = subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def test_trainer_learns_dry_run_trains_under_torchrun_and_writes_the_verdict(tmp_path):
    torchrun_dry_run("benchmarks.gpu.trainer_learns", tmp_path)
    rows = list(csv.DictReader((tmp_path / "trainer_learns.csv").open()))
    assert [r["seed"] for r in rows] == ["0", "all"] and (rows[0]["backend"], rows[0]["dtype"]) == ("gloo", "float32")
    assert -1.0 <= float(rows[0]["gain"]) <= 1.0 and "mean held-out gain" in rows[-1]["verdict"]
    assert (tmp_path / "learns_seed0" / "metrics.jsonl").read_text().count("\n") == 2  # the two dry-run steps


def test_trainer_resume_dry_run_replays_exactly_on_the_cpu(tmp_path):
    torchrun_dry_run("benchmarks.gpu.trainer_resume", tmp_path)
    rows = list(csv.DictReader((tmp_path / "trainer_resume.csv").open()))
    assert [r["quantity"] for r in rows] == ["every metric", "every metric", "weights", "replayed", "verdict"]
    assert rows[-2]["verdict"] == "yes"
    assert rows[-1]["verdict"] == "exact"  # on the CPU every kernel is deterministic (the GPU may differ)


def test_trainer_speed_dry_run_measures_every_mode(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "benchmarks.gpu.trainer_speed", "--dry-run", "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=300, cwd=ROOT)  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = list(csv.DictReader((tmp_path / "trainer_speed.csv").open()))
    steps = {r["mode"]: r for r in rows if r["quantity"] == "train step"}
    assert set(steps) == {"none", "selective", "blocks", "offload", "auto"}
    assert all(float(steps[m]["value"]) > 0 for m in ("none", "selective", "blocks", "auto"))
    assert "CUDA only" in steps["offload"]["note"] and '"auto": "' in steps["auto"]["note"]
    assert {r["quantity"] for r in rows} >= {"train MFU", "old + ref log-probs", "peak above static", "generation"}


def test_trl_side_by_side_dry_run_agrees_with_trl_and_writes_every_provider(tmp_path):
    """On the CPU in fp32 the drop-in's and our trainer's loss sums equal TRL's own on the same batch and model."""
    proc = subprocess.run([sys.executable, "-m", "benchmarks.gpu.trl_side_by_side", "--dry-run", "--out",
                           str(tmp_path)], capture_output=True, text=True, timeout=600, cwd=ROOT)  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = list(csv.DictReader((tmp_path / "trl_side_by_side.csv").open()))
    assert {(r["provider"], r["step"]) for r in rows} == {(p, s) for p in ("trl", "dropin", "ours")
                                                         for s in ("loss step", "long chains")}  # fmt: skip
    for r in rows:
        assert float(r["note"].split(", ")[-1].split()[0]) < 1e-5, r  # relative difference from TRL's loss
    assert sum("best" in r["note"] for r in rows) == 6

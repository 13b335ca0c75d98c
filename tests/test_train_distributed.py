"""Data parallelism and checkpoints: 1 and 2 FSDP2 ranks (torchrun, gloo) train the same; a run killed after a
checkpoint and resumed ends exactly where an uninterrupted run ends."""

import json
import os
import subprocess
import sys

import pytest
import torch

from grpo_kernels.train import trainer
from grpo_kernels.train.checkpoint import latest_checkpoint, load_checkpoint
from grpo_kernels.train.config.io import load_config
from grpo_kernels.train.data.tasks import CharTokenizer, tiny_model
from grpo_kernels.train.model.policy import Policy

ARGS = ["--optim.steps=3", "--optim.lr=1e-2", "--sampling.group_size=4", "--sampling.prompts_per_step=4",
        "--sampling.max_new_tokens=4", "--task.name=add", "--task.sft_warmup_steps=60", "--task.num_eval_prompts=4",
        "--packing.token_budget=48", "--checkpoint.every=1"]  # fmt: skip


def _metrics(run):
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def _weights(checkpoint):
    """The policy's parameters in a checkpoint, loaded into a single unsharded process."""
    policy = Policy(tiny_model(CharTokenizer().vocab_size))
    optimizer = torch.optim.AdamW(policy.parameters())
    load_checkpoint(checkpoint, policy=policy, optimizer=optimizer, ref_policy=None)
    return {k: v.detach().clone() for k, v in policy.state_dict().items()}


def _torchrun(nproc, run):
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK")}
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", "--standalone",
           "-m", "grpo_kernels.cli", "train", f"--logging.run_dir={run}", *ARGS]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]


@pytest.mark.distributed
@pytest.mark.slow
def test_one_and_two_fsdp_ranks_give_the_same_losses_and_weights(tmp_path):
    one, two = tmp_path / "one", tmp_path / "two"
    _torchrun(1, one)
    _torchrun(2, two)
    m1, m2 = _metrics(one), _metrics(two)
    assert [r["step"] for r in m2] == [0, 1, 2]
    assert any(r["loss"] != 0 for r in m2), "no gradient signal: the comparison would prove nothing"
    assert all(r["loss"] == r["loss"] and r["grad_norm"] == r["grad_norm"] for r in m2)
    assert [r["completion_tokens"] for r in m1] == [r["completion_tokens"] for r in m2]  # the same rollouts
    for a, b in zip(m1, m2, strict=True):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5, abs=1e-7)
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-4)
    w1, w2 = _weights(one / "checkpoints" / "step_3"), _weights(two / "checkpoints" / "step_3")
    first = _weights(two / "checkpoints" / "step_1")
    assert any(not torch.equal(first[k], w2[k]) for k in w2), "the weights did not change"
    # Adam divides by sqrt(v): an element whose gradient is zero up to rounding moves by up to lr either way, so a
    # rounding difference between the runs can flip its step. The key biases get no gradient at all in exact
    # arithmetic (softmax ignores a shift common to all keys): their update is rounding noise, not compared. In every
    # other tensor, at most 0.1% of the elements may differ by more than 2% of the update, and the mean difference is
    # below 0.1% of the mean update: an unsynchronised gradient would move most elements (a mis-scaled one barely
    # changes Adam's step; the grad_norm comparison above catches that).
    for k in w1:
        if k.endswith("k_proj.bias"):
            continue
        diff, update = (w1[k] - w2[k]).abs(), (w2[k] - first[k]).abs()
        off = float((diff > 0.02 * update.max()).float().mean())
        assert off <= 1e-3 and diff.mean() <= 1e-3 * update.mean(), (k, off, diff.max(), diff.mean())
    summary = json.loads((two / "summary.json").read_text())
    assert summary["world_size"] == 2
    # the model the two ranks exported together from their FSDP2 shards at the end is the last checkpoint's weights,
    # and what `grpo-kernels export` writes from that checkpoint on one process
    from safetensors.torch import load_file

    from grpo_kernels.train.checkpoint_export import export_checkpoint

    exported = load_file(str(two / "model" / "model.safetensors"))
    assert sorted(exported) == sorted(k.removeprefix("model.") for k in w2 if k != "model.lm_head.weight")  # tied
    assert all(torch.equal(exported[k], w2[f"model.{k}"]) for k in exported)
    again = load_file(str(export_checkpoint(two, tmp_path / "again") / "model.safetensors"))
    assert all(torch.equal(again[k], exported[k]) for k in exported)


def test_a_killed_and_resumed_run_ends_like_an_uninterrupted_one(tmp_path, monkeypatch):
    args = [*ARGS, "--optim.steps=4", "--checkpoint.every=2", "--group_size.adaptive=true",
            "--group_size.max_group_size=6", "--group_size.window=1", "--group_size.invalid_rate_threshold=0.1",
            "--optim.schedule=cosine"]  # fmt: skip
    full, cut = tmp_path / "full", tmp_path / "cut"
    trainer.train(load_config(None, [*args, f"--logging.run_dir={full}"]), log=lambda *a: None)

    real_step, calls = trainer.grpo_step, []

    def dies_on_the_third_step(*a, **k):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt  # a kill after the checkpoint of step 2
        return real_step(*a, **k)

    monkeypatch.setattr(trainer, "grpo_step", dies_on_the_third_step)
    with pytest.raises(KeyboardInterrupt):
        trainer.train(load_config(None, [*args, f"--logging.run_dir={cut}"]), log=lambda *a: None)
    assert latest_checkpoint(cut).name == "step_2" and len(_metrics(cut)) == 2
    monkeypatch.setattr(trainer, "grpo_step", real_step)
    from grpo_kernels.cli import main

    main(["train", "--resume", str(cut)])
    a, b = _metrics(full), _metrics(cut)
    assert [r["step"] for r in b] == [0, 1, 2, 3]
    assert len({r["group_size"] for r in a}) > 1, "the adaptive group size never moved: its state is untested"
    drop = trainer.TIMING_METRICS
    assert [{k: v for k, v in r.items() if k not in drop} for r in a] == [
        {k: v for k, v in r.items() if k not in drop} for r in b
    ]
    wa, wb = _weights(full / "checkpoints" / "step_4"), _weights(cut / "checkpoints" / "step_4")
    assert all(torch.equal(wa[k], wb[k]) for k in wa)


def test_a_fresh_run_refuses_a_run_dir_with_checkpoints(tmp_path):
    (tmp_path / "checkpoints" / "step_2").mkdir(parents=True)
    (tmp_path / "checkpoints" / "step_2" / "trainer_state.json").write_text("{}")
    with pytest.raises(ValueError, match="holds checkpoints of an earlier run"):
        trainer.train(load_config(None, [f"--logging.run_dir={tmp_path}"]), log=lambda *a: None)


def test_resume_without_a_checkpoint_is_an_error(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "grpo_kernels.cli", "train", "--resume", str(tmp_path)],
                          capture_output=True, text=True)  # fmt: skip
    assert proc.returncode != 0 and "config.toml" in proc.stderr, proc.stderr

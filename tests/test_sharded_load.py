"""Sharded loading (grpo_kernels.train.model.sharded_load): the meta-device model filled from the checkpoint equals
from_pretrained's bit for bit; under torchrun (1 and 2 gloo ranks) the run trains the same losses as the whole-model
loading (and 2 ranks resume from a checkpoint as they ran); a rank's peak memory at load is its shard of SmolLM2, not
the model; a checkpoint tensor of another shape is named, a shard larger than the rank's memory is refused with the
numbers, and a parameter a converter adds is set by it."""

import copy
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from grpo_kernels.train.model.hf import load_policy, write_tiny_checkpoint
from grpo_kernels.train.model.policy import Policy
from grpo_kernels.train.trainer import TIMING_METRICS

CHECK = Path(__file__).with_name("sharded_load_check.py")


def bf16_shards(directory: Path) -> Path:
    """The tiny checkpoint's weights rewritten in bf16 as two files with an index (as large checkpoints come)."""
    from safetensors.torch import load_file, save_file

    state = load_file(str(directory / "model.safetensors"))
    names = sorted(state)
    parts = {"model-00001-of-00002.safetensors": names[: len(names) // 2],
             "model-00002-of-00002.safetensors": names[len(names) // 2 :]}  # fmt: skip
    for file, keys in parts.items():
        save_file({k: state[k].to(torch.bfloat16) for k in keys}, str(directory / file), metadata={"format": "pt"})
    (directory / "model.safetensors").unlink()
    index = {"metadata": {}, "weight_map": {k: file for file, keys in parts.items() for k in keys}}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index))
    return directory


@pytest.fixture
def tiny_dir(tmp_path):
    return bf16_shards(write_tiny_checkpoint(tmp_path / "tiny", hidden_size=64, head_dim=32, num_heads=2,
                                             num_kv_heads=1, seed=3))  # fmt: skip


def test_the_meta_model_filled_from_the_files_is_from_pretrained_bit_for_bit(tiny_dir):
    from grpo_kernels.train.model import sharded_load

    whole, _ = load_policy(tiny_dir, attn_implementation="sdpa")
    meta, _ = load_policy(tiny_dir, attn_implementation="sdpa", weights=False)
    assert sharded_load.is_meta(meta) and not any(b.is_meta for b in meta.buffers())
    policy = Policy(meta)
    sharded_load.load_shards([policy])
    assert not sharded_load.is_meta(meta) and meta.training is whole.training
    assert meta.get_output_embeddings().weight is meta.get_input_embeddings().weight  # tied, as loaded
    a, b = whole.state_dict(), meta.state_dict()
    assert sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) and a[k].dtype == b[k].dtype for k in a)
    buffers = dict(whole.named_buffers())
    assert all(torch.equal(buffers[k], v) for k, v in meta.named_buffers())  # rotary inv_freq, computed at init
    assert meta.config.to_dict() == whole.config.to_dict()
    assert meta.generation_config.to_dict() == whole.generation_config.to_dict()


def test_a_checkpoint_tensor_of_another_shape_is_named(tiny_dir):
    config = json.loads((tiny_dir / "config.json").read_text())
    (tiny_dir / "config.json").write_text(json.dumps(config | {"intermediate_size": 96}))
    with pytest.raises(ValueError) as info:
        load_policy(tiny_dir, attn_implementation="sdpa", weights=False)
    line = str(info.value)
    assert "\n" not in line and "model-00001-of-00002.safetensors: tensor model.layers.0.mlp.gate_proj.weight" in line
    assert "has shape [128, 64], but the model's config" in line and line.endswith("makes it [96, 64]")


def test_a_shard_larger_than_the_rank_memory_is_refused_with_the_numbers(tiny_dir, monkeypatch):
    from grpo_kernels.train.model import sharded_load

    meta, _ = load_policy(tiny_dir, attn_implementation="sdpa", weights=False)
    policies = [Policy(meta), Policy(meta)]
    sharded_load.check_fits(policies)  # fits this host
    monkeypatch.setattr(sharded_load, "available_bytes", lambda device: 1024)
    with pytest.raises(ValueError) as info:
        sharded_load.load_shards(policies)
    line = str(info.value)
    size = sum(p.numel() for p in meta.parameters()) * 4 / 2**30
    assert "\n" not in line and line.startswith("rank 0's shard of the model does not fit")
    assert f"needs {2 * size:.2f} GiB ({size:.2f} GiB policy + {size:.2f} GiB reference policy" in line
    assert "has 0.00 GiB available" in line
    assert sharded_load.is_meta(meta)  # refused before anything was allocated


class AddGate:
    """A converter that adds a parameter the checkpoint does not hold (a gain on the final norm), as an adapter does;
    with_init: it sets the gain after a sharded load (`init_weights`)."""

    def __init__(self, with_init: bool):
        if with_init:
            self.init_weights = lambda model: model.base_model.norm.gain.data.fill_(0.5)

    def convert(self, model, config):
        model.base_model.norm.gain = torch.nn.Parameter(torch.ones(model.config.hidden_size))
        return model

    def hf_weights(self, named):
        for name, tensor in named:
            if not name.endswith("norm.gain"):
                yield name, tensor


def test_a_parameter_a_converter_made_is_set_by_it_after_the_load_and_copied_to_the_reference(tiny_dir):
    from grpo_kernels.train.model import sharded_load
    from grpo_kernels.train.model.converters import apply_converters

    for with_init in (False, True):
        meta, _ = load_policy(tiny_dir, attn_implementation="sdpa", weights=False)
        meta = apply_converters(meta, None, [AddGate(with_init)])
        policies = [Policy(meta), Policy(copy.deepcopy(meta))]
        if not with_init:
            with pytest.raises(ValueError, match=r"made 1 parameters the checkpoint does not hold \(e.g. "
                                                 r"\['model.norm.gain'\]\); sharded loading needs the converter's "
                                                 r"init_weights\(model\)"):  # fmt: skip
                sharded_load.load_shards(policies)
            continue
        sharded_load.load_shards(policies)
        assert all(torch.equal(p.model.base_model.norm.gain, torch.full((64,), 0.5)) for p in policies)
        assert torch.equal(policies[1].model.base_model.norm.weight, policies[0].model.base_model.norm.weight)


def _torchrun(nproc: int, mode: str, out: Path, args: list[str]) -> list[dict]:
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK")}
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).parent.parent), str(Path(__file__).parent),
                                         env.get("PYTHONPATH", "")])
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", "--standalone", str(CHECK),
           mode, str(out), "--", *args]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(nproc)]


def _metrics(run: Path) -> list[dict]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if k not in TIMING_METRICS and "memory" not in k} for r in rows]


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("ranks", [1, 2])
def test_sharded_loading_trains_the_losses_of_whole_loading_bit_for_bit(tiny_dir, tmp_path, ranks):
    args = [f"--model.name={tiny_dir}", "--model.attn_implementation=grpo_varlen", "--task.name=add",
            "--task.sft_warmup_steps=0", "--task.num_eval_prompts=0", "--optim.steps=2", "--optim.lr=1e-2",
            "--sampling.group_size=4", "--sampling.prompts_per_step=2", "--sampling.max_new_tokens=4",
            "--packing.token_budget=64", "--loss.beta=0.04", "--model.converters=sharded_check_wrap",
            "--task.reward_funcs=test_model_converters:varied"] + ["--checkpoint.every=1"] * (ranks == 2)  # fmt: skip
    ranks_out = _torchrun(ranks, "losses", tmp_path / "out", args)
    assert all(r["whole_load_shards_calls"] == 0 and r["sharded_load_shards_calls"] == 1 for r in ranks_out)
    whole, sharded = _metrics(tmp_path / "out" / "whole"), _metrics(tmp_path / "out" / "sharded")
    assert [r["step"] for r in sharded] == [0, 1] and any(r["loss"] != 0 for r in sharded)
    assert whole == sharded
    if ranks == 2:  # the sharded run resumed from its step-1 checkpoint
        resumed = _metrics(tmp_path / "out" / "resumed")
        assert resumed[-1] == sharded[-1] and resumed[-1]["step"] == 1


@pytest.mark.distributed
@pytest.mark.slow
def test_a_rank_holds_its_shard_of_smollm2_at_load_not_the_model(tmp_path):
    args = ["--model.name=smollm2-135m", "--task.name=add", "--task.sft_warmup_steps=0", "--sampling.group_size=2",
            "--sampling.prompts_per_step=2", "--sampling.max_new_tokens=4", "--task.num_eval_prompts=0"]  # fmt: skip
    for r in _torchrun(2, "memory", tmp_path, args):
        full, grown = r["full_model_mib"], r["loaded_mib"] - r["start_mib"]
        assert r["load_shards_calls"] == 1 and full > 500  # SmolLM2-135M in fp32: 513 MiB
        # (measured: 245 MiB; the whole model loaded on every rank grew it by 422 MiB, 1.75 GiB by the end of build)
        assert grown < full / 2 + 64, (r, f"rank {r['rank']} grew {grown:.0f} MiB loading, its shard is {full / 2}")

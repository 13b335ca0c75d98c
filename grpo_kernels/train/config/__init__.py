"""The trainer's configuration: one dataclass per section, validated when built (field types, ranges, the rules
between fields; nothing about this host, which grpo_kernels.train.preflight checks), loaded from TOML plus overrides
by grpo_kernels.train.config.io:

    config = load_config("run.toml", ["--sampling.group_size=16", "loss.beta=0.04"])
    save_config(config, "runs/demo/config.toml")   # load_config of that file gives back an equal config

Example TOML (every key is optional and defaults to a tiny CPU demo; tables are the sections, `seed` is
top-level; TOML has no null, so the string "none" sets an optional field to None):

    seed = 0

    [model]
    name = "tiny"            # or a local HF model directory
    dtype = "auto"           # bfloat16 on CUDA, float32 on CPU

    [task]
    name = "add"
    difficulty = 3

    [sampling]
    group_size = 16
    max_new_tokens = 8

    [loss]
    loss_type = "dapo"
    epsilon_high = 0.28

    [optim]
    lr = 1e-3
    betas = [0.9, 0.95]
    grad_clip = "none"

Override strings are `section.field=value` (or `seed=value`), with or without leading dashes; the value is
parsed by the field's type: bools as true/false/1/0/yes/no, "none"/"null" for None, tuples as "0.9,0.95".
"""

import dataclasses
from dataclasses import dataclass, field, fields, make_dataclass
from typing import ClassVar

from ...options import LossOptions
from ...planner import ALGORITHMS
from .run import REPORT_TO, CheckpointConfig, DistributedConfig, ExportConfig, LoggingConfig, report_to_names
from .sampling import SamplingConfig
from .schema import check, field_types, typed_value, validate
from .task import TaskConfig

__all__ = [  # (load_config, save_config, to_dict and describe: grpo_kernels.train.config.io)
    "REPORT_TO", "CheckpointConfig", "DistributedConfig", "ExportConfig", "GroupSizeConfig", "LoggingConfig",
    "LossConfig", "ModelConfig", "OptimConfig", "PackingConfig", "SamplingConfig", "TaskConfig", "TrainConfig",
    "for_device", "report_to_names",
]  # fmt: skip

# ---------------------------------------------------------------------------------------------------------------
# Sections.


@dataclass(kw_only=True, slots=True)
class ModelConfig:
    section: ClassVar[str] = "model"

    name: str = "tiny"
    """"tiny" (the built-in random-init decoder, `tasks.tiny_model`), a known model ("smollm2-135m": converted once
    into a cache by `grpo-kernels prepare-model`, see grpo_kernels.train.model.known) or a local HF model directory."""
    hidden_size: int = 128
    """Hidden size of the tiny decoder (the sizes below apply to "tiny" only; an HF model brings its own)."""
    num_layers: int = 2
    """Decoder layers of the tiny model."""
    num_heads: int = 4
    """Attention (query) heads of the tiny model."""
    num_kv_heads: int = 2
    """Key/value heads of the tiny model (grouped-query attention); divides num_heads."""
    head_dim: int = 32
    """Per-head size of the tiny model; >= 32 (vLLM's CPU minimum)."""
    dtype: str = "auto"
    """Compute dtype: "bfloat16" (bf16 compute with fp32 master weights and fp32 optimizer state, as torchtitan
    trains), "float32", or "auto" (the default): "bfloat16" when the run trains on CUDA, "float32" on CPU. A run's
    config.toml records the dtype it chose."""
    attn_implementation: str = "grpo_varlen"
    """HF attention: "grpo_varlen" (packed, padding-free; registered by the trainer), "sdpa" or "eager"."""
    activation_checkpointing: str = "auto"
    """How the backward gets the activations (the loss and gradients are the same in every mode). "none": keep
    every activation (fastest; memory grows with layers x tokens). "selective": keep the outputs of the matmuls and
    of attention, recompute only the cheap ops between them (norms, activations, rotary embeddings). "blocks": one
    torch.utils.checkpoint (non-reentrant) per decoder block: activation memory drops to a [tokens, hidden] tensor
    per block plus one block's working set, for roughly one more forward per step. "offload" (CUDA only): "blocks"
    with each block's checkpointed input in pinned host memory between the forward (copied on a side stream) and
    its recompute. "auto" (the default): the fastest of none, selective, "blocks" on only the first n decoder blocks
    (the last ones keeping every activation, so the backward recomputes n blocks instead of all) and blocks, whose
    estimated activations for a micro-batch of packing.token_budget tokens fit model.activation_memory_gb, logged
    at the start (grpo_kernels.train.model.activation)."""
    activation_memory_gb: float | None = None
    """"auto"'s activation budget in GiB; None: on CUDA 90 % of the device memory free after the model loads, on
    CPU half the available memory, less the gradients and AdamW's moments (12 bytes per parameter). A budget that
    cannot hold one completion with "blocks" is refused before the first step."""
    mlp_tile_tokens: int = 0
    """Sequence-tiled MLP (grpo_kernels.train.model.activation.tiled_mlp): > 0 runs every decoder block's MLP over
    tiles of this many tokens of the packed row, each tile checkpointed, so a block's MLP intermediates (4 x
    intermediate_size floats per token for a SwiGLU MLP) exist for one tile at a time instead of the whole row, in the
    forward and in the recompute; for one more MLP forward per block. For long rows (thousands of tokens), e.g. 512;
    below packing.token_budget (the longest row). 0: off. The loss and gradients are the same either way."""
    converters: tuple[str, ...] = ()
    """Model converters (grpo_kernels.train.model.converters), applied in this order after loading and the SFT warm
    start, before the reference copy, activation memory and sharding: a registered name or "module:factory". None by
    default."""

    def __post_init__(self):
        validate(
            self, at_least={"hidden_size": 1, "num_layers": 1, "num_heads": 1, "num_kv_heads": 1, "head_dim": 32,
                            "mlp_tile_tokens": 0},
            choices={"dtype": ("auto", "float32", "bfloat16"), "attn_implementation": ("grpo_varlen", "sdpa", "eager"),
                     "activation_checkpointing": ("auto", "none", "blocks", "selective", "offload")},
        )  # fmt: skip
        gb = self.activation_memory_gb
        if gb is not None:
            check(self, "activation_memory_gb", 0 < gb < float("inf"), "a positive finite number of GiB or none")
        check(self, "name", self.name != "", "a non-empty string")
        for i, spec in enumerate(self.converters):
            check(self, "converters", spec.strip() != "", f"a list of names or 'module:factory' (entry {i} is empty)")
        check(self, "num_kv_heads", self.num_heads % self.num_kv_heads == 0, f"a divisor of {self.num_heads}")


class _LossSection:
    """What the [loss] section adds to LossOptions' fields: its name, validation, and the conversions."""

    __slots__ = ()
    section: ClassVar[str] = "loss"

    def __post_init__(self):
        validate(self)
        try:
            self.options()
        except ValueError as exc:  # LossOptions' message starts with the option's name
            raise ValueError(f"loss.{exc}") from None

    def options(self) -> LossOptions:
        """These options as the loss's own (frozen, validated) type."""
        return LossOptions(**self.kwargs())

    def kwargs(self) -> dict:
        """The keyword arguments of `grpo_kernels.grpo_loss` (and `fused_linear_grpo_loss`) for this config."""
        return {name: getattr(self, name) for name in field_types(LossConfig)}


# The fields are LossOptions' own (names, types, defaults; documented there): one source for both.
LossConfig = make_dataclass(
    "LossConfig", [(f.name, field_types(LossOptions)[f.name], field(default=f.default)) for f in fields(LossOptions)],
    bases=(_LossSection,), kw_only=True, slots=True,
    namespace={"__doc__": "The options of `grpo_kernels.grpo_loss` that a run sets: the fields of "
               "`grpo_kernels.options.LossOptions` (same names, defaults and meaning, documented there), as a TOML "
               "section; validated by LossOptions (messages start \"loss.\")."},
)  # fmt: skip
LossConfig.__module__ = __name__  # (make_dataclass takes module= from Python 3.12)


@dataclass(kw_only=True, slots=True)
class OptimConfig:
    section: ClassVar[str] = "optim"

    lr: float = 1e-3
    """Peak learning rate of AdamW (> 0)."""
    weight_decay: float = 0.0
    """AdamW weight decay (>= 0)."""
    betas: tuple[float, float] = (0.9, 0.95)
    """AdamW betas, each in [0, 1); "0.9,0.95" on the command line."""
    warmup_steps: int = 0
    """Linear warm-up steps from 0 to lr (0 = none)."""
    schedule: str = "constant"
    """Learning rate after the warm-up: "constant" or "cosine" (to 0 at the last step)."""
    grad_clip: float | None = 1.0
    """Clip the global gradient norm at this value (> 0); None = no clipping."""
    num_iterations: int = 1
    """mu, optimizer steps on each batch of completions (> 1 makes old log-probs differ from the policy's)."""
    steps: int = 50
    """Training steps (each samples a new batch of completions)."""

    def __post_init__(self):
        validate(
            self, at_least={"weight_decay": 0, "warmup_steps": 0, "num_iterations": 1, "steps": 1},
            choices={"schedule": ("constant", "cosine")},
        )  # fmt: skip
        check(self, "lr", self.lr > 0, "> 0")
        check(self, "betas", all(0 <= b < 1 for b in self.betas), "two numbers in [0, 1)")
        check(self, "grad_clip", self.grad_clip is None or self.grad_clip > 0, "> 0 or none")


@dataclass(kw_only=True, slots=True)
class PackingConfig:
    section: ClassVar[str] = "packing"

    token_budget: int = 4096
    """Most tokens in one packed micro-batch (a longer sample runs alone)."""
    shared_prefix: bool = False
    """Pack each group's prompt once, its completions attending to it (needs attn_implementation "grpo_varlen")."""
    algorithm: str = "karmarkar_karp"
    """How samples are split into micro-batches: "karmarkar_karp" (best balance) or "greedy"."""

    def __post_init__(self):
        validate(self, at_least={"token_budget": 1}, choices={"algorithm": tuple(ALGORITHMS)})


@dataclass(kw_only=True, slots=True)
class GroupSizeConfig:
    section: ClassVar[str] = "group_size"

    adaptive: bool = False
    """Grow G (up to max_group_size) while the invalid-group rate exceeds invalid_rate_threshold."""
    max_group_size: int = 32
    """Upper bound on the adaptive G; >= sampling.group_size when adaptive."""
    invalid_rate_threshold: float = 0.5
    """Invalid-group rate (all-equal rewards, no gradient) above which G grows, in (0, 1)."""
    window: int = 5
    """Steps over which the invalid-group rate is averaged."""
    dynamic_sampling: bool = False
    """DAPO's dynamic sampling: resample prompts whose group came back invalid."""
    max_resample_rounds: int = 2
    """Resampling rounds per step with dynamic_sampling (0 = none)."""

    def __post_init__(self):
        validate(self, at_least={"max_group_size": 2, "window": 1, "max_resample_rounds": 0})
        check(self, "invalid_rate_threshold", 0 < self.invalid_rate_threshold < 1, "in (0, 1)")


@dataclass(kw_only=True, slots=True)
class TrainConfig:
    """A whole run: the sections and the seed; checks the rules that span sections."""

    seed: int = 0
    """Seed of the model's initialization, the sampling and the training."""
    model: ModelConfig = field(default_factory=ModelConfig)
    """The policy."""
    task: TaskConfig = field(default_factory=TaskConfig)
    """Prompts and reward."""
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    """Completion generation."""
    loss: LossConfig = field(default_factory=LossConfig)
    """grpo_loss options."""
    optim: OptimConfig = field(default_factory=OptimConfig)
    """Optimizer and schedule."""
    packing: PackingConfig = field(default_factory=PackingConfig)
    """Micro-batch packing."""
    group_size: GroupSizeConfig = field(default_factory=GroupSizeConfig)
    """Adaptive group size and dynamic sampling."""
    distributed: DistributedConfig = field(default_factory=DistributedConfig)
    """Multi-process training."""
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    """Metrics."""
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    """Checkpoints and resuming."""
    export: ExportConfig = field(default_factory=ExportConfig)
    """The trained model as a Hugging Face directory (<run_dir>/model/)."""

    def __post_init__(self):
        self.seed = typed_value("seed", int, self.seed)
        if not -(2**63) <= self.seed < 2**63:  # torch.manual_seed and the samplers' seed hashes take 64-bit seeds
            raise ValueError(f"seed must be in [-2**63, 2**63), got {self.seed}")
        for name, cls in section_classes().items():
            if not isinstance(getattr(self, name), cls):
                raise ValueError(f"{name} must be a {cls.__name__}, got {getattr(self, name)!r}")
        g, gs = self.sampling.group_size, self.group_size
        if gs.adaptive and gs.max_group_size < g:
            raise ValueError(
                f"group_size.max_group_size must be >= sampling.group_size ({g}) when group_size.adaptive is true, "
                f"got {gs.max_group_size}"
            )
        s = self.sampling
        g_max = max(g, gs.max_group_size) if gs.adaptive else g
        if s.prompts_per_step * g_max * s.max_new_tokens > s.max_step_tokens:
            raise ValueError(
                f"a step would sample up to prompts_per_step * G * max_new_tokens = {s.prompts_per_step} * {g_max} * "
                f"{s.max_new_tokens} tokens, more than sampling.max_step_tokens = {s.max_step_tokens} (G: "
                f"{'group_size.max_group_size' if gs.adaptive else 'sampling.group_size'}): lower it or raise the bound"
            )
        rounds = 1 + gs.max_resample_rounds if gs.dynamic_sampling else 1
        if rounds > 1 and rounds * s.prompts_per_step * g_max * s.max_new_tokens > s.max_step_tokens:
            raise ValueError(
                f"with dynamic sampling a step may sample (1 + group_size.max_resample_rounds) * prompts_per_step * G"
                f" * max_new_tokens = {rounds} * {s.prompts_per_step} * {g_max} * {s.max_new_tokens} tokens, more "
                f"than sampling.max_step_tokens = {s.max_step_tokens}: lower max_resample_rounds or raise the bound"
            )
        if not gs.dynamic_sampling and gs.max_resample_rounds != GroupSizeConfig().max_resample_rounds:
            import warnings

            warnings.warn(f"group_size.max_resample_rounds = {gs.max_resample_rounds} has no effect: "
                          "group_size.dynamic_sampling is off", stacklevel=2)  # fmt: skip
        sp = self.distributed.sequence_parallel
        if sp > 1 and self.model.attn_implementation != "grpo_varlen":
            raise ValueError(f'distributed.sequence_parallel = {sp} needs model.attn_implementation "grpo_varlen" '
                             f'(the all-to-alls live in its attention), got "{self.model.attn_implementation}"')
        if sp > 1 and self.model.name == "tiny" and self.model.num_heads % sp:
            raise ValueError(f"distributed.sequence_parallel = {sp} must divide the attention heads "
                             f"(model.num_heads = {self.model.num_heads})")  # fmt: skip
        if self.packing.shared_prefix and self.model.attn_implementation != "grpo_varlen":
            raise ValueError(f'packing.shared_prefix needs model.attn_implementation "grpo_varlen" (with '
                             f'"{self.model.attn_implementation}" the completions of a group would attend to each '
                             "other), got shared_prefix = true")  # fmt: skip
        if self.task.eval_every and s.placement == "decoupled":
            raise ValueError(f"task.eval_every = {self.task.eval_every} needs sampling.placement \"colocated\" (the "
                             "decoupled servers sample ahead of the evaluations), got \"decoupled\"")  # fmt: skip
        delta, high = self.loss.delta, self.loss.epsilon_high
        if delta is not None and delta <= 1 + high:
            raise ValueError(f"loss.delta must be above 1 + loss.epsilon_high = {1 + high:g} (the two-sided clip caps "
                             f"the ratio above the upper clip), got {delta}")  # fmt: skip
        steps = self.optim.steps
        if self.optim.warmup_steps > steps:
            raise ValueError(f"optim.warmup_steps = {self.optim.warmup_steps} is more than the run's optim.steps = "
                             f"{steps}: the learning rate would never reach optim.lr")  # fmt: skip
        if s.max_staleness >= steps:
            raise ValueError(f"sampling.max_staleness must be below optim.steps ({steps}): with {s.max_staleness} "
                             "every batch of the run would be sampled before its first update")  # fmt: skip
        for name, every in (("logging.log_every", self.logging.log_every), ("checkpoint.every", self.checkpoint.every)):
            if every > steps:
                import warnings

                what = ("only the first and the last steps' metrics lines will be written" if name[0] == "l"
                        else "only the final checkpoint will be saved")
                warnings.warn(f"{name} = {every} is more than optim.steps = {steps}: {what}", stacklevel=2)
        tile, budget = self.model.mlp_tile_tokens, self.packing.token_budget
        if tile >= budget:
            raise ValueError(f"model.mlp_tile_tokens must be below packing.token_budget ({budget}, the longest row: a "
                             f"tile that holds the whole row tiles nothing), got {tile}")  # fmt: skip
        mcl, new = self.loss.max_completion_length, self.sampling.max_new_tokens
        if mcl is not None and mcl < new:
            raise ValueError(f"loss.max_completion_length must be >= sampling.max_new_tokens ({new}), got {mcl}")


def for_device(config: "TrainConfig", device_type: str) -> "TrainConfig":
    """config with the choices that depend on the device made concrete: model.dtype "auto" is "bfloat16" when
    device_type is "cuda", else "float32". (The config itself stays free of torch: the caller names the device.)"""
    if config.model.dtype != "auto":
        return config
    dtype = "bfloat16" if device_type == "cuda" else "float32"
    return dataclasses.replace(config, model=dataclasses.replace(config.model, dtype=dtype))


def section_classes() -> dict[str, type]:
    """{section name: dataclass} in TrainConfig's order."""
    return {name: tp for name, tp in field_types(TrainConfig).items() if name != "seed"}

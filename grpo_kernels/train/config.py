"""The trainer's configuration: one dataclass per section, validated when built (field types, ranges, the rules
between fields; nothing about this host, which grpo_kernels.train.preflight checks), loaded from TOML plus overrides
by grpo_kernels.train.config_io:

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
from urllib.parse import urlparse

from ..options import LossOptions
from ..planner import ALGORITHMS
from .config_fields import _check, _field_types, _typed, _validate

TASK_NAMES = ("reverse", "add", "arith", "jsonl")
MIN_TEMPERATURE = 1e-3

__all__ = [  # (load_config, save_config, to_dict and describe: grpo_kernels.train.config_io)
    "REPORT_TO", "CheckpointConfig", "DistributedConfig", "GroupSizeConfig", "LoggingConfig", "LossConfig",
    "ModelConfig", "OptimConfig", "PackingConfig", "SamplingConfig", "TaskConfig", "TrainConfig", "for_device",
    "report_to_names",
]  # fmt: skip

# ---------------------------------------------------------------------------------------------------------------
# Sections.


@dataclass(kw_only=True, slots=True)
class ModelConfig:
    section: ClassVar[str] = "model"

    name: str = "tiny"
    """"tiny" (the built-in random-init decoder, `tasks.tiny_model`), a known model ("smollm2-135m": converted once
    into a cache by `grpo-kernels prepare-model`, see grpo_kernels.train.models) or a local HF model directory."""
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
    at the start (grpo_kernels.train.activation)."""
    activation_memory_gb: float | None = None
    """"auto"'s activation budget in GiB; None: on CUDA 90 % of the device memory free after the model loads, on
    CPU half the available memory, less the gradients and AdamW's moments (12 bytes per parameter). A budget that
    cannot hold one completion with "blocks" is refused before the first step."""
    mlp_tile_tokens: int = 0
    """Sequence-tiled MLP (grpo_kernels.train.activation.tiled_mlp): > 0 runs every decoder block's MLP over tiles of
    this many tokens of the packed row, each tile checkpointed, so a block's MLP intermediates (4 x intermediate_size
    floats per token for a SwiGLU MLP) exist for one tile at a time instead of the whole row, in the forward and in the
    recompute; for one more MLP forward per block. For long rows (thousands of tokens), e.g. 512; below
    packing.token_budget (the longest row). 0: off. The loss and gradients are the same either way."""

    def __post_init__(self):
        _validate(
            self, at_least={"hidden_size": 1, "num_layers": 1, "num_heads": 1, "num_kv_heads": 1, "head_dim": 32,
                            "mlp_tile_tokens": 0},
            choices={"dtype": ("auto", "float32", "bfloat16"), "attn_implementation": ("grpo_varlen", "sdpa", "eager"),
                     "activation_checkpointing": ("auto", "none", "blocks", "selective", "offload")},
        )  # fmt: skip
        gb = self.activation_memory_gb
        if gb is not None:
            _check(self, "activation_memory_gb", 0 < gb < float("inf"), "a positive finite number of GiB or none")
        _check(self, "name", self.name != "", "a non-empty string")
        _check(self, "num_kv_heads", self.num_heads % self.num_kv_heads == 0, f"a divisor of {self.num_heads}")


@dataclass(kw_only=True, slots=True)
class TaskConfig:
    section: ClassVar[str] = "task"

    name: str = "reverse"
    """The task: "reverse", "add" (built in, for the tiny model's characters), "arith" (built in, questions in English
    for instruction-tuned models, with a format reward) or "jsonl" (prompt/answer lines from `path`)."""
    difficulty: int = 1
    """Difficulty of a built-in task, 1..10 (ignored by "jsonl")."""
    path: str | None = None
    """JSONL file of {"prompt": ..., "answer": ...} lines; required for "jsonl", not allowed otherwise."""
    reward: str = "exact"
    """Reward of a "jsonl" task: "exact" (stripped string match), "numeric" (the last number in the completion)
    or "math_verify" (needs the math_verify package); the built-in tasks bring their own."""
    format_weight: float | None = None
    """"arith" only: the reward's bonus for a completion that is one bare integer, in [0, 1] (None = 0.2). The
    bonus is paid for wrong bare answers too, so a policy can trade correctness for it: at 0.2, runs of SmolLM2 at
    lr 2e-5 fall into answering bare guesses (benchmarks/results/learning_vs_trl/reading.md); 0 pays correctness
    alone."""
    num_train_prompts: int = 512
    """Training prompts (a built-in task generates them; "jsonl" takes at most this many)."""
    num_eval_prompts: int = 64
    """Held-out prompts for evaluation (0 = no evaluation)."""
    eval_every: int = 0
    """Held-out evaluation every this many steps too (logged to eval.jsonl in the run directory); 0 = only
    before and after training."""
    target_success: float | None = None
    """Stop training once a held-out evaluation reaches this success rate, in (0, 1] (needs eval_every); None =
    run all optim.steps."""
    seed: int = 0
    """Seed of the prompt generator and of the train/eval split."""
    sft_warmup_steps: int = 0
    """Supervised steps on the reference answers before GRPO (0 = none)."""
    chat_template: str = "auto"
    """Prompts through the tokenizer's chat template: "on", "off" (plain text after a bos) or "auto" (on when the
    tokenizer has a chat template: HF instruction-tuned models; off for the built-in character tokenizer).
    Conversational JSONL prompts need it on."""
    system_prompt: str | None = None
    """A system message before every prompt (needs the chat template); None = the template's own default."""

    def __post_init__(self):
        _validate(
            self, at_least={"num_train_prompts": 1, "num_eval_prompts": 0, "sft_warmup_steps": 0, "eval_every": 0},
            choices={"name": TASK_NAMES, "reward": ("exact", "numeric", "math_verify"),
                     "chat_template": ("auto", "on", "off")},
        )  # fmt: skip
        if self.system_prompt is not None:
            _check(self, "system_prompt", self.chat_template != "off", 'none when task.chat_template is "off"')
        _check(self, "difficulty", 1 <= self.difficulty <= 10, "in 1..10")
        if self.format_weight is not None:
            _check(self, "format_weight", self.name == "arith", 'none unless task.name is "arith" (the only task '
                   "with a format bonus)")
            _check(self, "format_weight", 0.0 <= self.format_weight <= 1.0, "in [0, 1] or none")
        if self.eval_every:
            _check(self, "eval_every", self.num_eval_prompts > 0, "0 when task.num_eval_prompts is 0")
        if self.target_success is not None:
            _check(self, "target_success", 0.0 < self.target_success <= 1.0, "in (0, 1] or none")
            _check(self, "target_success", self.eval_every > 0, "none when task.eval_every is 0 (it is checked at "
                   "the evaluations)")
        _check(self, "seed", -(2**63) <= self.seed < 2**63, "in [-2**63, 2**63)")
        if self.name == "jsonl":
            _check(self, "path", self.path not in (None, ""), 'a JSONL file path when task.name is "jsonl"')
        else:
            _check(self, "path", self.path is None, f"none for the built-in task {self.name!r}")
            _check(self, "reward", self.reward == "exact", f'"exact" for the built-in task {self.name!r}')


@dataclass(kw_only=True, slots=True)
class SamplingConfig:
    section: ClassVar[str] = "sampling"

    sampler: str = "hf"
    """Who generates the completions: "hf" (the policy's own `generate`) or "vllm"."""
    group_size: int = 8
    """G, completions per prompt; >= 2 (a group of one has no relative advantage)."""
    prompts_per_step: int = 8
    """Prompts per optimizer step, so prompts_per_step * group_size completions."""
    max_new_tokens: int = 16
    """Longest completion, in tokens (long chains of thought: thousands, e.g. 8192; then raise packing.token_budget
    to at least the longest prompt + max_new_tokens). A completion that reaches it without <eos> or a stop id is
    truncated: flagged in the rollout, counted in the metric truncated_fraction, and masked out of the loss with
    mask_truncated_completions. The longest prompt + max_new_tokens must fit the model's max_position_embeddings and
    max_model_len (checked when the model is loaded, before anything is written)."""
    max_model_len: int | None = None
    """Longest prompt + completion the samplers allow, in tokens: vLLM's max_model_len (which sizes its KV cache)
    and the rollout servers' --max-model-len. None = the task's longest prompt + max_new_tokens (vLLM's own default,
    the model's whole context, may allocate a KV cache that does not fit). Must hold the longest prompt +
    max_new_tokens and be at most the model's max_position_embeddings (checked when the model is loaded). On CPU,
    vLLM's cache is VLLM_CPU_KVCACHE_SPACE GiB: it needs max_model_len tokens to start, G x max_model_len to sample a
        group at once (grpo_kernels.train.lengths.kv_cache_gib; SmolLM2-135M in float32 takes 45 KiB a token, so G = 8
    completions of 8,000 tokens want VLLM_CPU_KVCACHE_SPACE=3)."""
    mask_truncated_completions: bool = False
    """Leave truncated completions (see max_new_tokens) out of the loss, as TRL's GRPOConfig option of that name:
    their tokens get mask 0, so they add nothing to the loss and count in no token normalizer (dapo/cispo/vespo's
    num_items_in_batch, bnpo's token count); grpo/sapo/luspo still count them, with 0, in the mean over sequences.
    Their rewards still count in the group advantages. A step whose completions are all truncated has loss 0 and no
    gradient."""
    temperature: float = 1.0
    """Sampling temperature (>= 0.001); the trainer's log-probs use the same temperature."""
    top_p: float = 1.0
    """Nucleus sampling mass, 0 < top_p <= 1 (1 = off)."""
    hf_max_batch_rows: int = 256
    """The HF sampler generates equal-length prompts together, at most this many completions per `generate` call
    (it bounds the rows of a call, never a completion's length; its KV cache grows with rows x (prompt +
    max_new_tokens), so lower it for long completions)."""
    max_step_tokens: int = 1 << 24
    """Bound on what one step may sample, prompts_per_step * G * max_new_tokens tokens (G: the largest group size,
    group_size.max_group_size when adaptive): a larger config is refused at load rather than left to run out of
    memory (or time) in the first rollout. Raise it for runs that really sample more."""
    vllm_gpu_memory_utilization: float = 0.3
    """Share of the GPU's memory the vLLM sampler takes on each rank (weights + KV cache), in (0, 1); on CPU the
    KV cache is VLLM_CPU_KVCACHE_SPACE GiB instead (1 unless set). Decoupled: each server's share of its GPUs."""
    placement: str = "colocated"
    """"colocated": the trainer's ranks sample (HF or an in-process vLLM engine). "decoupled": vLLM servers (sampler
    "vllm") on their own devices sample, and receive the weights after every optimizer step."""
    max_staleness: int = 0
    """Decoupled: how many steps the servers may sample ahead of the trainer (0 = synchronous). With k >= 1 the
    batch of step t + k is sampled while step t trains, and the loss corrects with the sampler's log-probs
    (loss.sampler_is_mode, "token_truncate" unless set)."""
    servers: int = 1
    """Decoupled: how many servers the trainer starts (data parallel; group k goes to server k % servers)."""
    server_urls: str = ""
    """Decoupled: comma-separated URLs of servers already running (`grpo-kernels serve-rollout`), instead of
    starting `servers` of them."""
    server_tensor_parallel_size: int = 1
    """Decoupled: devices per server the trainer starts (vLLM tensor parallelism)."""
    server_devices: str = ""
    """Decoupled: the devices of each started server, ";" between servers. GPUs: server_tensor_parallel_size
    device indices each, none shared (like "2,3;4,5"); default: the devices after the trainer's ranks on this node.
    CPU servers: core lists (like "0-3;4-7"), within this process's cores and leaving the trainer at least one;
    default: the first half of the cores, shared. Checked at load."""
    server_timeout_s: float = 60.0
    """Decoupled: a server that stops answering (/health, a weight transfer) for this long ends the run."""
    server_start_timeout_s: float = 900.0
    """Decoupled: how long a started server may take to answer /health."""
    weight_transfer: str = "auto"
    """Decoupled: how the weights travel, "nccl" (GPUs), "gloo" (CPUs) or "auto" (nccl with CUDA, else gloo)."""
    weight_transfer_address: str = ""
    """Decoupled: the address of trainer rank 0 that servers connect to for the transfer; default 127.0.0.1 when
    every server is local, else this host's name."""
    weight_sync_bucket_mb: int = 256
    """Decoupled: the weights are gathered (FSDP) and sent in buckets of at most this many MiB."""
    verify_weight_sync: bool = True
    """Decoupled: after each sync, compare a fixed sequence's log-probs on every server with the trainer's (the
    metric weight_sync_logp_max_diff)."""

    def __post_init__(self):
        _validate(
            self,
            at_least={"group_size": 2, "prompts_per_step": 1, "max_new_tokens": 1, "hf_max_batch_rows": 1,
                      "max_step_tokens": 1, "max_staleness": 0, "servers": 1, "server_tensor_parallel_size": 1,
                      "weight_sync_bucket_mb": 1},
            choices={"sampler": ("hf", "vllm"), "placement": ("colocated", "decoupled"),
                     "weight_transfer": ("auto", "gloo", "nccl")},
        )  # fmt: skip
        _check(self, "temperature", self.temperature >= MIN_TEMPERATURE,
               f">= {MIN_TEMPERATURE:g} (below, logits / T leave the range where log-probs and their ratios are "
               "meaningful in float32; GRPO needs sampling, not greedy decoding)")  # fmt: skip
        _check(self, "top_p", 0 < self.top_p <= 1, "in (0, 1]")
        if self.max_model_len is not None and self.max_model_len <= self.max_new_tokens:
            raise ValueError(f"sampling.max_model_len ({self.max_model_len}) must exceed sampling.max_new_tokens "
                             f"({self.max_new_tokens}): it holds a prompt and a completion (or set it to none)")
        _check(self, "vllm_gpu_memory_utilization", 0 < self.vllm_gpu_memory_utilization < 1, "in (0, 1)")
        _check(self, "server_timeout_s", self.server_timeout_s > 0, "> 0")
        _check(self, "server_start_timeout_s", self.server_start_timeout_s > 0, "> 0")
        decoupled = self.placement == "decoupled"
        if decoupled and self.sampler != "vllm":
            raise ValueError('sampling.placement "decoupled" needs sampling.sampler "vllm" (the servers are vLLM), '
                             f'got "{self.sampler}"')  # fmt: skip
        if not decoupled:
            for name in ("max_staleness", "server_urls", "server_devices"):
                if getattr(self, name) != SamplingConfig.__dataclass_fields__[name].default:
                    raise ValueError(f'sampling.{name} needs sampling.placement "decoupled" (it is "colocated")')
        if self.server_urls and self.server_devices:
            raise ValueError("sampling.server_devices is for servers the trainer starts; with sampling.server_urls "
                             "the servers are already running")  # fmt: skip
        if self.server_devices and len(self.server_devices.split(";")) != self.servers:
            raise ValueError(f"sampling.server_devices must list the devices of each of the {self.servers} servers "
                             f'(";" between servers), got {self.server_devices!r}')  # fmt: skip
        if decoupled:
            self.urls()  # checks them
            if self.weight_transfer_address and not self.weight_transfer_address.strip():
                raise ValueError("sampling.weight_transfer_address is blank: a host name or IP address, or leave it "
                                 "unset")  # fmt: skip

    def urls(self) -> list[str]:
        """sampling.server_urls as a list (empty: the trainer starts its servers); ValueError naming the option for
        an empty item or one that is not an http(s)://host:port URL."""
        if not self.server_urls.strip():
            return []
        out, seen = [], {}
        for i, item in enumerate(self.server_urls.split(",")):
            url = item.strip()
            if not url:
                raise ValueError(f"sampling.server_urls: item {i} of {self.server_urls!r} is empty (comma-separated "
                                 "URLs like http://host:8000)")  # fmt: skip
            try:
                parts = urlparse(url)
                port = parts.port
            except ValueError:
                parts, port = None, None
            if parts is None or parts.scheme not in ("http", "https") or not parts.hostname or port is None:
                raise ValueError(f"sampling.server_urls: {url!r} is not a server URL like http://host:8000 (scheme, "
                                 "host and port)")  # fmt: skip
            key = (parts.scheme, parts.hostname.lower(), port)
            if key in seen:
                raise ValueError(f"sampling.server_urls: {url!r} names the same server as item {seen[key]}: each "
                                 "server once (group k goes to server k % n)")  # fmt: skip
            seen[key] = i
            out.append(url)
        return out


class _LossSection:
    """What the [loss] section adds to LossOptions' fields: its name, validation, and the conversions."""

    __slots__ = ()
    section: ClassVar[str] = "loss"

    def __post_init__(self):
        _validate(self)
        try:
            self.options()
        except ValueError as exc:  # LossOptions' message starts with the option's name
            raise ValueError(f"loss.{exc}") from None

    def options(self) -> LossOptions:
        """These options as the loss's own (frozen, validated) type."""
        return LossOptions(**self.kwargs())

    def kwargs(self) -> dict:
        """The keyword arguments of `grpo_kernels.grpo_loss` (and `fused_linear_grpo_loss`) for this config."""
        return {name: getattr(self, name) for name in _field_types(LossConfig)}


# The fields are LossOptions' own (names, types, defaults; documented there): one source for both.
LossConfig = make_dataclass(
    "LossConfig", [(f.name, _field_types(LossOptions)[f.name], field(default=f.default)) for f in fields(LossOptions)],
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
        _validate(
            self, at_least={"weight_decay": 0, "warmup_steps": 0, "num_iterations": 1, "steps": 1},
            choices={"schedule": ("constant", "cosine")},
        )  # fmt: skip
        _check(self, "lr", self.lr > 0, "> 0")
        _check(self, "betas", all(0 <= b < 1 for b in self.betas), "two numbers in [0, 1)")
        _check(self, "grad_clip", self.grad_clip is None or self.grad_clip > 0, "> 0 or none")


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
        _validate(self, at_least={"token_budget": 1}, choices={"algorithm": tuple(ALGORITHMS)})


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
        _validate(self, at_least={"max_group_size": 2, "window": 1, "max_resample_rounds": 0})
        _check(self, "invalid_rate_threshold", 0 < self.invalid_rate_threshold < 1, "in (0, 1)")


@dataclass(kw_only=True, slots=True)
class DistributedConfig:
    section: ClassVar[str] = "distributed"

    backend: str = "auto"
    """torch.distributed backend under torchrun: "auto" (nccl on CUDA, else gloo), "gloo" or "nccl"."""
    sequence_parallel: int = 1
    """N > 1: Ulysses sequence parallelism. The world splits into world / N data-parallel groups of N consecutive
    ranks; a group trains the same packed micro-batches (up to N x packing.token_budget tokens), each rank a
    contiguous 1/N of every row, with two all-to-alls around every attention call. Needs torchrun with a world size
    divisible by N, attention heads divisible by N and model.attn_implementation "grpo_varlen". The loss and the
    update equal the unsharded run's."""

    def __post_init__(self):
        _validate(self, at_least={"sequence_parallel": 1}, choices={"backend": ("auto", "gloo", "nccl")})


REPORT_TO = ("tensorboard", "wandb", "trackio")  # each is also its package's and its extra's name


def report_to_names(report_to: tuple, tensorboard: bool) -> tuple:
    """logging.report_to without "none", with "tensorboard" added when the logging.tensorboard alias is on; "all"
    (alone, as in transformers) is kept as ("all",) for preflight.check to resolve to the installed trackers; an
    unknown tracker, one named twice or one beside "none" or "all" is a ValueError."""
    if "all" in report_to:
        if len(report_to) > 1:
            raise ValueError(f'logging.report_to: "all" stands alone (every installed tracker), got {list(report_to)}')
        return ("all",)
    names = tuple(n for n in report_to if n != "none")
    for n in names:
        if n not in REPORT_TO:
            raise ValueError(f"logging.report_to: {n!r} is not a tracker here; one of "
                             f"{', '.join(map(repr, REPORT_TO))} (or \"none\")")  # fmt: skip
    if len(set(names)) < len(names) or ("none" in report_to and names):
        raise ValueError(f"logging.report_to names a tracker twice or with \"none\": {list(report_to)}")
    return names + ("tensorboard",) if tensorboard and "tensorboard" not in names else names


@dataclass(kw_only=True, slots=True)
class LoggingConfig:
    section: ClassVar[str] = "logging"

    run_dir: str = "runs/grpo"
    """Directory of the run: config.toml, metrics, checkpoints."""
    log_every: int = 1
    """Log metrics every this many steps."""
    report_to: tuple[str, ...] = ()
    """Experiment trackers, TRL's names: any of "tensorboard" (<run_dir>/tensorboard), "wandb" (offline with
    WANDB_MODE=offline), "trackio"; "all" = those installed; "none" or empty = none. Metrics under TRL GRPOTrainer's
    names where the quantity is the same, against train/global_step (grpo_kernels.train.tracking). Each needs its
    package: pip install 'grpo-kernels[wandb]' (or [tensorboard], [trackio]). On the command line:
    --logging.report_to=tensorboard,wandb."""
    project: str = "grpo-kernels"
    """The W&B / Trackio project of the run."""
    run_name: str | None = None
    """The W&B / Trackio run name; None: the run directory's name."""
    tensorboard: bool = False
    """The same as adding "tensorboard" to report_to (kept for configs written before report_to)."""
    completions_every: int = 0
    """Write every completion of every this many steps to completions.jsonl (step, group, prompt, text, reward,
    truncated), to read what the policy says (0 = never)."""

    def __post_init__(self):
        _validate(self, at_least={"log_every": 1, "completions_every": 0})
        _check(self, "run_dir", self.run_dir != "", "a non-empty path")
        self.report_to = report_to_names(self.report_to, self.tensorboard)
        _check(self, "project", self.project.strip() != "", "a non-empty name")


@dataclass(kw_only=True, slots=True)
class CheckpointConfig:
    section: ClassVar[str] = "checkpoint"

    every: int = 0
    """Save a checkpoint every this many steps and after the last one (0 = never)."""
    keep_last: int = 0
    """Keep only this many newest checkpoints (older ones are deleted after a save); 0 = keep every one."""
    resume: str | None = None
    """Run directory to resume from (its latest checkpoint); None = start fresh."""
    resume_step: int | None = None
    """Resume from checkpoints/step_<N> instead of the latest: the explicit fallback when the latest checkpoint is
    damaged (a damaged checkpoint is an error, never skipped). Needs resume; used once (config.toml keeps none)."""
    allow_config_change: bool = False
    """Resume although the config differs from the checkpoint's in a field that changes the run (a warning lists
    them); without it that is an error. Every field counts except logging.*, checkpoint.* and distributed.backend
    (grpo_kernels.train.checkpoint.RUN_NEUTRAL_FIELDS). Used once (config.toml keeps false)."""

    def __post_init__(self):
        _validate(self, at_least={"every": 0, "keep_last": 0})
        _check(self, "resume", self.resume != "", "a run directory or none")
        if self.resume_step is not None:
            _check(self, "resume_step", self.resume_step >= 1, ">= 1")
            _check(self, "resume_step", self.resume is not None, "none unless checkpoint.resume is set")


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

    def __post_init__(self):
        self.seed = _typed("seed", int, self.seed)
        if not -(2**63) <= self.seed < 2**63:  # torch.manual_seed and the samplers' seed hashes take 64-bit seeds
            raise ValueError(f"seed must be in [-2**63, 2**63), got {self.seed}")
        for name, cls in _sections().items():
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


def _sections() -> dict[str, type]:
    """{section name: dataclass} in TrainConfig's order."""
    return {name: tp for name, tp in _field_types(TrainConfig).items() if name != "seed"}

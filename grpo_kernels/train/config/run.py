"""The trainer config's run-level sections: distribution, logging (and its trackers' names) and checkpoints. Their
fields' types, ranges and rules only; grpo_kernels.train.config gathers the sections."""

from dataclasses import dataclass
from typing import ClassVar

from .schema import check, validate

__all__ = ["REPORT_TO", "CheckpointConfig", "DistributedConfig", "ExportConfig", "LoggingConfig", "report_to_names"]


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
        validate(self, at_least={"sequence_parallel": 1}, choices={"backend": ("auto", "gloo", "nccl")})


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
        validate(self, at_least={"log_every": 1, "completions_every": 0})
        check(self, "run_dir", self.run_dir != "", "a non-empty path")
        self.report_to = report_to_names(self.report_to, self.tensorboard)
        check(self, "project", self.project.strip() != "", "a non-empty name")


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
        validate(self, at_least={"every": 0, "keep_last": 0})
        check(self, "resume", self.resume != "", "a run directory or none")
        if self.resume_step is not None:
            check(self, "resume_step", self.resume_step >= 1, ">= 1")
            check(self, "resume_step", self.resume is not None, "none unless checkpoint.resume is set")


SIZE_UNITS = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30,
              "TIB": 2**40}  # fmt: skip


def parse_size(text) -> int:
    """Bytes of "5GB", "500MB", "2GiB" (save_pretrained's max_shard_size units) or of an int; ValueError otherwise."""
    if isinstance(text, int) and not isinstance(text, bool):
        return text
    s = str(text).strip().upper().replace(" ", "")
    number = s.rstrip("KMGTIB")
    unit = s[len(number):] or "B"
    try:
        value = float(number)
    except ValueError:
        value = -1.0
    if unit not in SIZE_UNITS or not value > 0:
        raise ValueError(f"a size is a positive number of bytes, KB, MB, GB, KiB, MiB or GiB, got {text!r}")
    return int(value * SIZE_UNITS[unit])


@dataclass(kw_only=True, slots=True)
class ExportConfig:
    section: ClassVar[str] = "export"

    at_end: bool = True
    """Write the trained model to <run_dir>/model/ when the run ends: a Hugging Face directory (config, safetensors,
    generation config, the tokenizer with its chat template, a model card) that transformers and `vllm serve` load
    without this package."""
    every: int = 0
    """Also write it every this many steps (the latest replaces the one before); 0 = only at the end."""
    dtype: str = "auto"
    """The weights' dtype: "auto" (the training compute dtype: model.dtype), "bfloat16" or "float32" (the fp32
    master weights)."""
    max_shard_size: str = "5GB"
    """Above this size the weights are split into shards with an index (save_pretrained's max_shard_size: "5GB",
    "500MB", "2GiB", or bytes)."""

    def __post_init__(self):
        validate(self, at_least={"every": 0}, choices={"dtype": ("auto", "bfloat16", "float32")})
        try:
            parse_size(self.max_shard_size)
            ok = True
        except ValueError:
            ok = False
        check(self, "max_shard_size", ok, 'a size such as "5GB", "500MB" or "2GiB"')


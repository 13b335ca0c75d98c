"""The [task] section: what a run trains on (a built-in task or a JSONL file) and the reward functions that score it.
Nothing here imports the rest of the trainer (the config's ground floor)."""

from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

from .schema import check, validate

__all__ = ["TASK_NAMES", "TaskConfig", "is_file_spec", "resolve_spec"]

TASK_NAMES = ("reverse", "add", "arith", "jsonl", "dataset")


@dataclass(kw_only=True, slots=True)
class TaskConfig:
    section: ClassVar[str] = "task"

    name: str = "reverse"
    """The task: "reverse", "add" (built in, for the tiny model's characters), "arith" (built in, questions in English
    for instruction-tuned models, an optional format bonus) or "jsonl" (prompt/answer lines from `path`)."""
    difficulty: int = 1
    """Difficulty of a built-in task, 1..10 (ignored by "jsonl")."""
    path: str | None = None
    """JSONL file of {"prompt": ..., "answer": ...} lines; required for "jsonl", not allowed otherwise."""
    reward: str = "exact"
    """Reward of a "jsonl" task: "exact" (stripped string match), "numeric" (the last number in the completion)
    or "math_verify" (needs the math_verify package); the built-in tasks bring their own."""
    format_weight: float | None = None
    """"arith" only: the reward's bonus for a completion that is one bare integer, in [0, 1] (None = the task's
    own, 0: correctness alone; 0.2 before 2026-12). The bonus is paid for wrong bare answers too, so a policy can
    trade correctness for it: at 0.2, runs of SmolLM2 at lr 2e-5 fell into answering bare guesses, in TRL's
    trainer as in ours (benchmarks/results/learning_vs_trl/reading.md)."""
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
    """Prompts through the tokenizer's chat template: "on" (every prompt; a plain-text one as a user message),
    "off" (plain text after a bos; conversational prompts refused), "conversational" (TRL's rule: a conversational
    prompt, a list of {"role", "content"} messages, through the template; a plain-text one as the tokenizer encodes
    text, its own special tokens included) or "auto": "conversational" for task.name = "dataset" (as TRL feeds
    the same dataset); for the other tasks "on" when the tokenizer has a chat template (HF instruction-tuned
    models), "off" otherwise (the built-in character tokenizer)."""
    system_prompt: str | None = None
    """A system message before every prompt (needs task.chat_template "on", or "auto" where that means "on");
    None = the template's own default."""
    dataset: str | None = None
    """task.name = "dataset": a local JSON / JSONL / CSV / Parquet file or folder, or the name of a dataset in the
    local Hugging Face cache (read by `datasets`: pip install 'grpo-kernels[datasets]')."""
    dataset_download: bool = False
    """Let a task.dataset name that no local Hugging Face cache holds be fetched from the Hub (and cached there);
    false = the local caches only, and no request leaves (local files never need the network)."""
    split: str = "train"
    """The dataset's split to train on (a single file is the split "train")."""
    eval_split: str | None = None
    """The split of the held-out prompts; None = task.num_eval_prompts examples held out of task.split (shuffled
    by task.seed, never trained on)."""
    prompt_column: str = "prompt"
    """The dataset's column of prompts: text, or a list of {"role", "content"} messages (the chat template's)."""
    answer_column: str | None = None
    """The dataset's column of reference answers (task.reward compares with it; the SFT warm start's target);
    None = none (then task.reward_funcs score). Every column but the prompt goes to the reward functions."""
    reward_funcs: tuple[str, ...] = ()
    """Your own reward functions, replacing the task's: "module.path:function" or "path/to/file.py:function" (a
    relative file path resolves against the config file's folder, or the working directory for a command-line
    override), TRL's calling convention or verl's compute_score (grpo_kernels.train.data.rewards); the built-in rewards
    by name: "exact", "numeric", "math_verify", "arith_correct", "arith_format". Empty = the task's own."""
    reward_weights: tuple[float, ...] | None = None
    """One weight per reward function (the step's reward is the weighted sum, None skipped); None = 1 each."""
    success_reward: str | None = None
    """The reward function (by name) whose mean is the held-out "success"; it must return 0 or 1 (or None).
    None = the first function."""
    reward_timeout_s: float | None = None
    """Seconds a reward function call may take before the run stops with an error naming it (where a hung call can
    be stopped: a plain function in the main thread, an awaiting async one, worker processes); None = no limit."""
    reward_processes: int = 0
    """Worker processes that run the plain reward functions, each on a slice of the rows (0 = in the trainer's own
    thread)."""

    def __post_init__(self):
        validate(
            self, at_least={"num_train_prompts": 1, "num_eval_prompts": 0, "sft_warmup_steps": 0, "eval_every": 0},
            choices={"name": TASK_NAMES, "reward": ("exact", "numeric", "math_verify"),
                     "chat_template": ("auto", "on", "off", "conversational")},
        )  # fmt: skip
        if self.system_prompt is not None:
            check(self, "system_prompt", self.chat_template != "off", 'none when task.chat_template is "off"')
            check(self, "system_prompt", self.prompt_format(True) == "on", "none when plain-text prompts go in "
                  'raw, as with task.chat_template "conversational" (task.name "dataset"\'s "auto"; "on" puts every '
                  "prompt and the system message through the template)")
        check(self, "difficulty", 1 <= self.difficulty <= 10, "in 1..10")
        if self.format_weight is not None:
            check(self, "format_weight", self.name == "arith", 'none unless task.name is "arith" (the only task '
                   "with a format bonus)")
            check(self, "format_weight", 0.0 <= self.format_weight <= 1.0, "in [0, 1] or none")
        if self.eval_every:
            check(self, "eval_every", self.num_eval_prompts > 0, "0 when task.num_eval_prompts is 0")
        if self.target_success is not None:
            check(self, "target_success", 0.0 < self.target_success <= 1.0, "in (0, 1] or none")
            check(self, "target_success", self.eval_every > 0, "none when task.eval_every is 0 (it is checked at "
                   "the evaluations)")
        check(self, "seed", -(2**63) <= self.seed < 2**63, "in [-2**63, 2**63)")
        if self.name == "dataset":
            check(self, "dataset", self.dataset not in (None, ""), 'a file, folder or dataset name when task.name '
                   'is "dataset"')  # fmt: skip
            check(self, "answer_column", self.answer_column is not None or len(self.reward_funcs) > 0,
                   "a column name unless task.reward_funcs score without one (task.reward compares with it)")
            check(self, "path", self.path is None, 'none for task.name "dataset" (the data is task.dataset)')
            if self.sft_warmup_steps:
                check(self, "sft_warmup_steps", self.answer_column is not None, "0 unless task.answer_column "
                       "names the answers the warm start trains on")  # fmt: skip
        else:
            check(self, "dataset", self.dataset is None, 'none unless task.name is "dataset"')
            check(self, "dataset_download", not self.dataset_download, 'false unless task.name is "dataset"')
        if self.name == "jsonl":
            check(self, "path", self.path not in (None, ""), 'a JSONL file path when task.name is "jsonl"')
        elif self.name != "dataset":
            check(self, "path", self.path is None, f"none for the built-in task {self.name!r}")
            check(self, "reward", self.reward == "exact", f'"exact" for the built-in task {self.name!r}')
        if self.reward_weights is not None:
            check(self, "reward_weights", len(self.reward_funcs) > 0, "none unless task.reward_funcs names the "
                   "functions they weigh")  # fmt: skip
            check(self, "reward_weights", len(self.reward_weights) == len(self.reward_funcs),
                   f"one weight per function of task.reward_funcs ({len(self.reward_funcs)})")
        for i, spec in enumerate(self.reward_funcs):
            check(self, "reward_funcs", spec.strip() != "", f"a list of specs (entry {i} is empty)")
        if self.reward_timeout_s is not None:
            check(self, "reward_timeout_s", self.reward_timeout_s > 0, "> 0 or none")

    def prompt_format(self, has_chat_template: bool) -> str:
        """How prompts are encoded, "on", "off" or "conversational" (see chat_template): "auto" resolved for a
        tokenizer that has a chat template or not. The built-in and JSONL tasks keep the template's wrapping that
        their results were measured with; a dataset follows TRL's rule, so the same dataset gives the same prompt
        ids as in trl.GRPOTrainer."""
        if self.chat_template != "auto":
            return self.chat_template
        if self.name == "dataset":
            return "conversational"
        return "on" if has_chat_template else "off"


def is_file_spec(spec: str) -> bool:
    """True when the spec names a file (a ".py" path, with or without ":function")."""
    where = spec.rsplit(":", 1)[0] if ":" in spec and not spec.endswith(".py") else spec
    return where.endswith(".py")


def resolve_spec(spec: str, base: Path) -> str:
    """The spec with a relative file path made absolute against base (module specs and built-ins unchanged)."""
    if not is_file_spec(spec):
        return spec
    path, sep, name = spec.rpartition(":") if not spec.endswith(".py") else (spec, "", "")
    full = Path(path).expanduser()
    return str(full if full.is_absolute() else (Path(base) / full).resolve()) + sep + name

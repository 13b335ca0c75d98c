"""Built-in verifiable tasks, a character tokenizer and a tiny decoder: GRPO with no download.

    reverse   "reverse:abcd=" -> "dcba"          difficulty d: d + 1 .. 2d + 1 letters
    add       "37+405=" -> "442"                  difficulty d: operands of 1 .. d digits
    arith     "What is 7 + 5? Reply with only the number." -> "12"   for chat models; a format bonus if asked
    jsonl     {"prompt": ..., "answer": ...} lines from a file, for real models and tokenizers; the prompt is text
              or TRL's conversational form, a list of {"role", "content"} messages

Each task brings its rewards as named reward functions in TRL's form (grpo_kernels.train.data.rewards): "exact" (match
after stripping whitespace), "numeric" (the same number), "math_verify" (the JSONL task, when installed and asked
for), and arith's "arith_correct" plus "arith_format" weighted by its format bonus. `task.reward_funcs` replaces them
with the user's own; the run's `Rewards` (grpo_kernels.train.build.task_rewards) score a task's completions and are
passed where they are used, not kept on the task. Everything is deterministic given a seed (`random.Random`), so a
resumed run sees the same prompts.
"""

import random
import string
import warnings

from . import rewards_builtin
from .datasets import Example, examples_from_rows, load_jsonl, load_rows

__all__ = [
    "ArithTask", "CharTokenizer", "Example", "PromptStream", "Task", "exact_match", "load_jsonl", "make_task",
    "numeric_match", "tiny_model",
]  # fmt: skip


class CharTokenizer:
    """Characters to ids, built in code: <pad> = 0, <bos> = 1, <eos> = 2, then a fixed printable alphabet."""

    SPECIALS = ("<pad>", "<bos>", "<eos>")
    ALPHABET = string.ascii_lowercase + string.digits + "+-*=:?., "

    def __init__(self):
        self.pad_id, self.bos_id, self.eos_id = 0, 1, 2
        self._ids = {c: i + len(self.SPECIALS) for i, c in enumerate(self.ALPHABET)}
        self._chars = {i: c for c, i in self._ids.items()}

    @property
    def vocab_size(self) -> int:
        return len(self.SPECIALS) + len(self.ALPHABET)

    def encode(self, text: str, *, bos: bool = False, eos: bool = False) -> list[int]:
        """Token ids of text; ValueError on a character outside the alphabet."""
        bad = sorted({c for c in text if c not in self._ids})
        if bad:
            raise ValueError(f"characters {bad} are not in the tokenizer's alphabet {self.ALPHABET!r}")
        return [self.bos_id] * bos + [self._ids[c] for c in text] + [self.eos_id] * eos

    @property
    def stop_ids(self) -> tuple:
        return (self.eos_id,)

    has_chat_template = False
    chat_template = False

    def encode_prompt(self, prompt) -> list[int]:
        """<bos> + the prompt's ids (plain text only: a character tokenizer has no chat template)."""
        if not isinstance(prompt, str):
            raise ValueError("a conversational prompt (a list of messages) needs a tokenizer with a chat template; "
                             "the built-in character tokenizer has none")  # fmt: skip
        return self.encode(prompt, bos=True)

    def decode(self, ids) -> str:
        """Text of ids up to the first <eos>; <pad>/<bos> are dropped."""
        out = []
        for i in (int(x) for x in ids):
            if i == self.eos_id:
                break
            if i in self._chars:
                out.append(self._chars[i])
        return "".join(out)


def exact_match(completion: str, answer: str) -> float:
    return rewards_builtin.exact([completion], [answer])[0]


numeric_match = rewards_builtin.numeric_match


class Task:
    """A source of examples and their reward."""

    name = "task"

    def __init__(self, difficulty: int = 1):
        if isinstance(difficulty, bool) or not isinstance(difficulty, int) or not 1 <= difficulty <= 10:
            raise ValueError(f"difficulty must be an int in 1..10, got {difficulty!r}")
        self.difficulty = difficulty

    def example(self, rng: random.Random) -> Example:
        raise NotImplementedError

    def examples(self, n: int, seed: int) -> list[Example]:
        rng = random.Random(seed)
        return [self.example(rng) for _ in range(n)]

    REWARDS = ("exact",)
    """The task's reward functions (built-in names), the first its success."""

    def reward_weights(self) -> list:
        return [1.0] * len(self.REWARDS)


class ReverseTask(Task):
    """Reverse a string of lowercase letters: multi-token answers whose length grows with the difficulty."""

    name = "reverse"

    def example(self, rng):
        length = rng.randint(self.difficulty + 1, 2 * self.difficulty + 1)
        word = "".join(rng.choice(string.ascii_lowercase) for _ in range(length))
        return Example(prompt=f"reverse:{word}=", answer=word[::-1])


class AddTask(Task):
    """Add two non-negative integers of 1 .. difficulty digits."""

    name = "add"
    REWARDS = ("numeric",)

    def example(self, rng):
        a, b = (rng.randint(0, 10 ** rng.randint(1, self.difficulty) - 1) for _ in range(2))
        return Example(prompt=f"{a}+{b}=", answer=str(a + b))


class ArithTask(Task):
    """Arithmetic questions in English for instruction-tuned models, with a required answer format.

    "What is 7 + 5? Reply with only the number." Difficulty d: operands of 1 .. d digits; from d = 2 on, subtraction
    too (a result never below 0); from d = 4 on, a third operand. Reward: "arith_correct" (1.0 when the last integer
    in the completion is the answer) plus FORMAT_WEIGHT x "arith_format" (1.0 when the whole completion is one
    integer). FORMAT_WEIGHT is 0 unless asked for: the bonus pushes a model that rambles towards the asked-for
    form, but it pays wrong bare answers too, and at 0.2 runs of both this trainer and TRL's fell into answering
    bare guesses (benchmarks/results/learning_vs_trl/reading.md). Held-out success is "arith_correct".
    The difficulty sets the base model's pass rate: at temperature 0.7, SmolLM2-135M-Instruct solves single-digit
    sums about 40 % of the time, almost never in the asked-for form.
    """

    name = "arith"
    REWARDS = ("arith_correct", "arith_format")
    FORMAT_WEIGHT = 0.0  # 0.2 until 2026-12 (the learning-vs-TRL study's decision)
    INSTRUCTION = "Reply with only the number."

    def __init__(self, difficulty: int = 1, *, format_weight: float | None = None):
        super().__init__(difficulty)
        if format_weight is not None:
            if isinstance(format_weight, bool) or not isinstance(format_weight, (int, float)) or not (
                    0.0 <= format_weight <= 1.0):  # fmt: skip
                raise ValueError(f"format_weight must be a number in [0, 1], got {format_weight!r}")
            self.FORMAT_WEIGHT = float(format_weight)

    def example(self, rng):
        d = self.difficulty
        terms = [rng.randint(0, 10 ** rng.randint(1, min(d, 9)) - 1) for _ in range(3 if d >= 4 else 2)]
        expr, total = str(terms[0]), terms[0]
        for t in terms[1:]:
            op = "-" if d >= 2 and t <= total and rng.random() < 0.5 else "+"
            expr, total = f"{expr} {op} {t}", total - t if op == "-" else total + t
        return Example(prompt=f"What is {expr}? {self.INSTRUCTION}", answer=str(total))

    def reward_weights(self):
        return [1.0, self.FORMAT_WEIGHT]


class RowsTask(Task):
    """A task over a fixed list of examples (train_rows; eval_rows when a held-out split of its own is given),
    split without overlap by `split_examples`: the held-out examples are never trained on."""

    source = "the examples"

    def __init__(self, train_rows: list, eval_rows: list | None = None):
        super().__init__(1)
        self.train_rows, self.eval_rows = train_rows, eval_rows

    def split_examples(self, num_train: int, num_eval: int, seed: int) -> tuple[list, list]:
        """(training examples, held-out examples): disjoint, each in an order shuffled by seed. Without eval_rows
        the first num_eval examples of the shuffled rows are held out. A split smaller than asked is a warning with
        the numbers (the run uses what there is: the prompt stream reshuffles the training examples every epoch,
        and the held-out success's standard error is that of the examples there are); holding out every example is
        an error."""
        order = list(range(len(self.train_rows)))
        random.Random(seed).shuffle(order)
        if self.eval_rows is None:
            if num_eval >= len(order):
                raise ValueError(f"task.num_eval_prompts = {num_eval} holds out every one of the {len(order)} "
                                 f"examples of {self.source}: none is left to train on")  # fmt: skip
            held, order = order[:num_eval], order[num_eval:]
            held_out = [self.train_rows[i] for i in held]
        else:
            held = list(range(len(self.eval_rows)))
            random.Random(seed + 1).shuffle(held)
            held_out = [self.eval_rows[i] for i in held[:num_eval]]
            if len(held_out) < num_eval:
                warnings.warn(f"task.num_eval_prompts = {num_eval}, but the held-out split of {self.source} has "
                              f"{len(held_out)} examples: evaluating on {len(held_out)}", stacklevel=2)  # fmt: skip
        if len(order) < num_train:
            after = f" after holding out {num_eval}" if self.eval_rows is None and num_eval else ""
            warnings.warn(f"task.num_train_prompts = {num_train}, but {self.source} has {len(order)} examples to "
                          f"train on{after}: training on {len(order)}, reshuffled every epoch",
                          stacklevel=2)  # fmt: skip
        self.trained = [self.train_rows[i] for i in order[:num_train]]
        return self.trained, held_out

    def example(self, rng):
        """A training example (the SFT warm start's draw): from the training side of `split_examples`."""
        pool = getattr(self, "trained", None)
        if pool is None:
            raise ValueError(f"{type(self).__name__}.example: split_examples has not chosen the training examples yet")
        return rng.choice(pool)


class JsonlTask(RowsTask):
    """Examples from a JSONL file of {"prompt", "answer"} objects; reward by exact, numeric or math_verify match.
    Held-out examples are held out of the file, as a dataset's are (`RowsTask.split_examples`)."""

    name = "jsonl"

    def __init__(self, path, *, reward: str = "exact"):
        if reward not in ("exact", "numeric", "math_verify"):
            raise ValueError(f"reward must be 'exact', 'numeric' or 'math_verify', got {reward!r}")
        if reward == "math_verify":
            try:
                import math_verify  # noqa: F401
            except ImportError as exc:
                raise ValueError("reward='math_verify' needs the math_verify package") from exc
        super().__init__(load_jsonl(path))
        self.data, self.kind, self.source = self.train_rows, reward, str(path)
        self.REWARDS = (reward,)


class DatasetTask(RowsTask):
    """Examples of a dataset (grpo_kernels.train.data.datasets.load_rows): the prompt column, the answer column when
    named, every other column for the reward functions. Split without overlap (`RowsTask.split_examples`): the first
    num_eval examples of the split shuffled by the seed are held out, unless eval_split names a split of its own."""

    name = "dataset"

    def __init__(self, source: str, *, split: str = "train", eval_split: str | None = None,
                 prompt_column: str = "prompt", answer_column: str | None = None, reward: str = "exact",
                 download: bool = False):  # fmt: skip
        read = lambda name: examples_from_rows(load_rows(source, name, download=download),  # noqa: E731
                                               prompt_column=prompt_column, answer_column=answer_column,
                                               source=f"{source} [{name}]")  # fmt: skip
        super().__init__(read(split), read(eval_split) if eval_split is not None else None)
        self.source, self.REWARDS = source, (reward,)


TASKS = {"reverse": ReverseTask, "add": AddTask, "arith": ArithTask}


class PromptStream:
    """The training prompts in the order a run takes them: the examples reshuffled at the start of every epoch by
    `random.Random(seed)`. The trainer draws from it (identically on every rank); a benchmark that gives another
    trainer the same prompts in the same order builds the same stream. `state_dict` / `load_state_dict` carry its
    position through a checkpoint."""

    def __init__(self, examples: list, seed: int):
        if not examples:
            raise ValueError("PromptStream: examples is empty (no prompt to train on)")
        self.examples, self.order, self.cursor = examples, list(range(len(examples))), 0
        self.rng = random.Random(seed)

    def take(self, n: int) -> list:
        """The next n examples."""
        if n < 0:
            raise ValueError(f"PromptStream.take: n must be >= 0, got {n}")
        out = []
        for _ in range(n):
            if self.cursor % len(self.order) == 0:
                self.rng.shuffle(self.order)
            out.append(self.examples[self.order[self.cursor % len(self.order)]])
            self.cursor += 1
        return out

    def state_dict(self) -> dict:
        return {"cursor": self.cursor, "order": list(self.order), "rng": self.rng.getstate()}

    def load_state_dict(self, state: dict) -> None:
        self.cursor, self.order = state["cursor"], list(state["order"])
        rng = state["rng"]  # a checkpoint's JSON turns the state's middle tuple into a list
        self.rng.setstate((rng[0], tuple(rng[1]), rng[2]))


def make_task(name: str, *, difficulty: int = 1, path=None, reward: str = "exact",
              format_weight: float | None = None, dataset: dict | None = None) -> Task:  # fmt: skip
    """A built-in task ("reverse", "add", "arith") at a difficulty, "jsonl" from `path`, or "dataset" (dataset: the
    DatasetTask's arguments, source first); format_weight: arith's bonus for a bare-integer answer (None:
    ArithTask.FORMAT_WEIGHT), refused for the other tasks."""
    if name == "jsonl":
        if path is None:
            raise ValueError("task 'jsonl' needs a path")
        return JsonlTask(path, reward=reward)
    if name == "dataset":
        if not dataset or not dataset.get("source"):
            raise ValueError("task 'dataset' needs a dataset (task.dataset)")
        return DatasetTask(**dataset, reward=reward)
    if name not in TASKS:
        raise ValueError(f"unknown task {name!r}; built-in tasks: {sorted(TASKS)} (or 'jsonl', 'dataset')")
    if format_weight is not None:
        if name != "arith":
            raise ValueError(f"format_weight is arith's format bonus; task {name!r} has none")
        return ArithTask(difficulty, format_weight=format_weight)
    return TASKS[name](difficulty)


def tiny_model(vocab_size: int, *, hidden_size=128, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=32,
               attn_implementation="grpo_varlen", seed=0):  # fmt: skip
    """A random-init Qwen2-style decoder built from a config (no download). head_dim >= 32 (vLLM's CPU minimum)."""
    import torch
    import transformers

    if head_dim < 32:
        raise ValueError(f"head_dim must be >= 32, got {head_dim}")
    if attn_implementation == "grpo_varlen":
        from ...attention import register_hf_attention

        register_hf_attention()
    config = transformers.Qwen2Config(
        vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=2 * hidden_size, num_hidden_layers=num_layers,
        num_attention_heads=num_heads, num_key_value_heads=num_kv_heads, head_dim=head_dim,
        max_position_embeddings=1024, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, pad_token_id=0,
    )  # fmt: skip
    torch.manual_seed(seed)
    return transformers.AutoModelForCausalLM.from_config(config, attn_implementation=attn_implementation)

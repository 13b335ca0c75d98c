"""Built-in verifiable tasks, a character tokenizer and a tiny decoder: GRPO with no download.

    reverse   "reverse:abcd=" -> "dcba"          difficulty d: d + 1 .. 2d + 1 letters
    add       "37+405=" -> "442"                  difficulty d: operands of 1 .. d digits
    arith     "What is 7 + 5? Reply with only the number." -> "12"   for chat models; a format reward on top
    jsonl     {"prompt": ..., "answer": ...} lines from a file, for real models and tokenizers; the prompt is text
              or TRL's conversational form, a list of {"role", "content"} messages

Rewards are binary (1.0 for a correct answer, else 0.0; "arith" adds a format bonus): exact match after stripping
whitespace, or numeric equality for numbers; `math_verify` is used for the JSONL task when installed and asked for.
Everything is deterministic given a seed (`random.Random`), so a resumed run sees the same prompts.
"""

import json
import math
import random
import re
import string
from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "ArithTask", "CharTokenizer", "Example", "PromptStream", "Task", "exact_match", "load_jsonl", "make_task",
    "numeric_match", "tiny_model",
]  # fmt: skip


_INT = re.compile(r"-?\d+")
_WHOLE_INT = re.compile(r"-?\d+\.?")


@dataclass(frozen=True, slots=True)
class Example:
    """One prompt with its reference answer."""

    prompt: str | tuple
    """Plain text, or a conversation: a tuple of {"role", "content"} dicts (rendered by the chat template)."""
    answer: str


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
    return float(completion.strip() == answer.strip())


def numeric_match(completion: str, answer: str) -> float:
    """1.0 when both parse as the same number (int or float), else 0.0."""
    try:
        return float(abs(float(completion.strip()) - float(answer.strip())) <= 1e-9 * max(1.0, abs(float(answer))))
    except ValueError:
        return 0.0


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

    def reward(self, completion: str, example: Example) -> float:
        return exact_match(completion, example.answer)

    def correct(self, completion: str, example: Example) -> float:
        """1.0 when the completion answers correctly (held-out success); the reward itself unless it adds a bonus."""
        return self.reward(completion, example)


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

    def example(self, rng):
        a, b = (rng.randint(0, 10 ** rng.randint(1, self.difficulty) - 1) for _ in range(2))
        return Example(prompt=f"{a}+{b}=", answer=str(a + b))

    def reward(self, completion, example):
        return numeric_match(completion, example.answer)


class ArithTask(Task):
    """Arithmetic questions in English for instruction-tuned models, with a required answer format.

    "What is 7 + 5? Reply with only the number." Difficulty d: operands of 1 .. d digits; from d = 2 on, subtraction
    too (a result never below 0); from d = 4 on, a third operand. Reward: `correct` (1.0 when the last integer in the
    completion is the answer) plus FORMAT_WEIGHT when the whole completion is that one integer, so a model that
    rambles is pushed towards the asked-for form. Held-out success is `correct` alone. The difficulty sets the base
    model's pass rate: at temperature 0.7, SmolLM2-135M-Instruct solves single-digit sums about 40 % of the time,
    almost never in the asked-for form.
    """

    name = "arith"
    FORMAT_WEIGHT = 0.2
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

    def correct(self, completion, example):
        numbers = _INT.findall(completion.replace(",", ""))
        return float(bool(numbers) and int(numbers[-1]) == int(example.answer))

    def reward(self, completion, example):
        formatted = _WHOLE_INT.fullmatch(completion.strip()) is not None
        return self.correct(completion, example) + self.FORMAT_WEIGHT * formatted


class JsonlTask(Task):
    """Examples from a JSONL file of {"prompt", "answer"} objects; reward by exact, numeric or math_verify match."""

    name = "jsonl"

    def __init__(self, path, *, reward: str = "exact"):
        super().__init__(1)
        if reward not in ("exact", "numeric", "math_verify"):
            raise ValueError(f"reward must be 'exact', 'numeric' or 'math_verify', got {reward!r}")
        if reward == "math_verify":
            try:
                import math_verify  # noqa: F401
            except ImportError as exc:
                raise ValueError("reward='math_verify' needs the math_verify package") from exc
        self.data, self.kind = load_jsonl(path), reward

    def example(self, rng):
        return rng.choice(self.data)

    def reward(self, completion, example):
        if self.kind == "numeric":
            return numeric_match(completion, example.answer)
        if self.kind == "math_verify":
            from math_verify import parse, verify

            return float(verify(parse(example.answer), parse(completion)))
        return exact_match(completion, example.answer)


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
              format_weight: float | None = None) -> Task:  # fmt: skip
    """A built-in task ("reverse", "add", "arith") at a difficulty, or "jsonl" from `path`; format_weight: arith's
    bonus for a bare-integer answer (None: ArithTask.FORMAT_WEIGHT), refused for the other tasks."""
    if name == "jsonl":
        if path is None:
            raise ValueError("task 'jsonl' needs a path")
        return JsonlTask(path, reward=reward)
    if name not in TASKS:
        raise ValueError(f"unknown task {name!r}; built-in tasks: {sorted(TASKS)} (or 'jsonl')")
    if format_weight is not None:
        if name != "arith":
            raise ValueError(f"format_weight is arith's format bonus; task {name!r} has none")
        return ArithTask(difficulty, format_weight=format_weight)
    return TASKS[name](difficulty)


def load_jsonl(path) -> list[Example]:
    """Examples from a JSONL file; a clear ValueError for an unreadable file, bad JSON or missing keys."""
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except OSError as exc:
        raise ValueError(f"cannot read {path}: {exc.strerror or exc}") from exc
    except UnicodeDecodeError as exc:
        raise ValueError(f"{path} is not UTF-8 text (byte {exc.start}: {exc.reason})") from exc
    out = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line, object_pairs_hook=_no_duplicate_keys)
        except _DuplicateKey as exc:
            raise ValueError(f"{path}:{number}: key {json.dumps(str(exc))} appears twice in the row (which one is "
                             "meant?)") from None  # fmt: skip
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}:{number}: not JSON ({exc.msg})") from exc
        except RecursionError:
            raise ValueError(f"{path}:{number}: not JSON this reader accepts (nested too deeply)") from None
        missing = [k for k in ("prompt", "answer") if not isinstance(row, dict) or k not in row]
        if missing:
            raise ValueError(f"{path}:{number}: missing key(s) {missing}")
        where = f"{path}:{number}"
        out.append(Example(prompt=_prompt(row["prompt"], where), answer=_answer(row["answer"], where)))
    if not out:
        raise ValueError(f"{path}: no examples")
    return out


class _DuplicateKey(Exception):
    pass


def _no_duplicate_keys(pairs: list) -> dict:
    keys = [k for k, _ in pairs]
    for k in keys:
        if keys.count(k) > 1:
            raise _DuplicateKey(k)
    return dict(pairs)


def _text(value: str, where: str, what: str) -> str:
    """A JSONL text field: not blank, no NUL and no lone surrogate (neither survives tokenization as written)."""
    if not value.strip():
        raise ValueError(f"{where}: {what} is empty" + (" (only whitespace)" if value else ""))
    if "\x00" in value:
        raise ValueError(f"{where}: {what} contains a NUL character (\\u0000)")
    bad = next((c for c in value if 0xD800 <= ord(c) <= 0xDFFF), None)
    if bad is not None:
        raise ValueError(f"{where}: {what} contains a lone surrogate (\\u{ord(bad):04x}): not encodable text")
    return value


def _answer(value, where: str) -> str:
    """A JSONL answer: a non-blank string, or a finite number (kept as its JSON text: 4 -> "4", 0.5 -> "0.5")."""
    if isinstance(value, str):
        return _text(value, where, '"answer"')
    if isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value):
        return str(value)
    raise ValueError(f'{where}: "answer" must be a string or a finite number, got {_shown(value)}')


def _shown(value) -> str:
    """A JSON value as an error message shows it (NaN and infinities as JSON's readers write them)."""
    try:
        return json.dumps(value)[:80]
    except (ValueError, RecursionError):
        return repr(value)[:80]


CHAT_ROLES = ("system", "user", "assistant")


def _prompt(value, where: str):
    """A JSONL prompt: text, or TRL's conversational form (a non-empty list of {"role", "content"} strings)."""
    if isinstance(value, str):
        return _text(value, where, '"prompt"')
    if isinstance(value, list) and value and all(
        isinstance(m, dict) and set(m) == {"role", "content"} and all(isinstance(v, str) for v in m.values())
        for m in value
    ):
        for i, m in enumerate(value):
            if m["role"] not in CHAT_ROLES:
                raise ValueError(f'{where}: "prompt" message {i} has role {json.dumps(m["role"])}; a role is one of '
                                 f"{', '.join(CHAT_ROLES)}")  # fmt: skip
            _text(m["content"], where, f'"prompt" message {i}\'s content')
        if not any(m["role"] == "user" for m in value):
            raise ValueError(f'{where}: "prompt" has no user message (roles: '
                             f"{', '.join(m['role'] for m in value)})")  # fmt: skip
        if value[-1]["role"] == "assistant":
            raise ValueError(f'{where}: "prompt" ends with an assistant message: the completion is sampled as the '
                             "assistant's answer to the last user message, so a prompt ends with one")  # fmt: skip
        return tuple({"role": m["role"], "content": m["content"]} for m in value)
    raise ValueError(f'{where}: "prompt" must be a string or a non-empty list of {{"role": str, "content": str}} '
                     f"messages, got {_shown(value)}")  # fmt: skip


def tiny_model(vocab_size: int, *, hidden_size=128, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=32,
               attn_implementation="grpo_varlen", seed=0):  # fmt: skip
    """A random-init Qwen2-style decoder built from a config (no download). head_dim >= 32 (vLLM's CPU minimum)."""
    import torch
    import transformers

    if head_dim < 32:
        raise ValueError(f"head_dim must be >= 32, got {head_dim}")
    if attn_implementation == "grpo_varlen":
        from ..attention import register_hf_attention

        register_hf_attention()
    config = transformers.Qwen2Config(
        vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=2 * hidden_size, num_hidden_layers=num_layers,
        num_attention_heads=num_heads, num_key_value_heads=num_kv_heads, head_dim=head_dim,
        max_position_embeddings=1024, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, pad_token_id=0,
    )  # fmt: skip
    torch.manual_seed(seed)
    return transformers.AutoModelForCausalLM.from_config(config, attn_implementation=attn_implementation)

"""The built-in rewards, as reward functions in TRL's form (the built-in tasks score with them, and
`task.reward_funcs` names them): "exact", "numeric", "math_verify" (needs math-verify), "arith_correct" and
"arith_format"."""

import re

__all__ = ["BUILTIN", "arith_correct", "arith_format", "completion_text", "exact", "math_verify", "numeric",
           "numeric_match"]  # fmt: skip


_INT = re.compile(r"-?\d+")
_WHOLE_INT = re.compile(r"-?\d+\.?")


def completion_text(completion) -> str:
    """A completion as text: itself, or the content of TRL's conversational form (a list of messages)."""
    if isinstance(completion, str):
        return completion
    return "".join(m["content"] for m in completion)


def exact(completions, answer, **kwargs) -> list:
    """1.0 when the completion, stripped, is the answer, else 0.0."""
    return [float(completion_text(c).strip() == a.strip()) for c, a in zip(completions, answer, strict=True)]


def numeric_match(text: str, answer: str) -> float:
    """1.0 when both parse as the same number (int or float), else 0.0."""
    try:
        return float(abs(float(text.strip()) - float(answer.strip())) <= 1e-9 * max(1.0, abs(float(answer))))
    except ValueError:
        return 0.0


def numeric(completions, answer, **kwargs) -> list:
    """1.0 when the completion and the answer parse as the same number, else 0.0."""
    return [numeric_match(completion_text(c), a) for c, a in zip(completions, answer, strict=True)]


def math_verify(completions, answer, **kwargs) -> list:
    """1.0 when math_verify finds the completion's answer equal to the reference, else 0.0."""
    from math_verify import parse, verify

    return [float(verify(parse(a), parse(completion_text(c)))) for c, a in zip(completions, answer, strict=True)]


def arith_correct(completions, answer, **kwargs) -> list:
    """1.0 when the last integer in the completion is the answer (the "arith" task's correctness)."""
    out = []
    for c, a in zip(completions, answer, strict=True):
        numbers_ = _INT.findall(completion_text(c).replace(",", ""))
        out.append(float(bool(numbers_) and int(numbers_[-1]) == int(a)))
    return out


def arith_format(completions, **kwargs) -> list:
    """1.0 when the whole completion is one bare integer (the "arith" task's format bonus, weighted)."""
    return [float(_WHOLE_INT.fullmatch(completion_text(c).strip()) is not None) for c in completions]


BUILTIN = {"exact": exact, "numeric": numeric, "math_verify": math_verify, "arith_correct": arith_correct,
           "arith_format": arith_format}  # fmt: skip

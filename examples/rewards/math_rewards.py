"""Math rewards in TRL's form: the same file works as `reward_funcs` of trl.GRPOTrainer and as `task.reward_funcs`
of `grpo-kernels train` (see examples/train_smollm2_dataset_cpu.toml).

    correct        1.0 when math_verify finds the completion's answer equal to the `solution` column, else 0.0
    bare_number    1.0 when the completion is one number and nothing else (the format the prompts ask for)

Needs math-verify (pip install 'grpo-kernels[math]').
"""

import re

_NUMBER = re.compile(r"\s*-?\d+(?:\.\d+)?\.?\s*")


def _text(completion) -> str:
    """A completion as text: plain, or the content of TRL's conversational form."""
    return completion if isinstance(completion, str) else "".join(m["content"] for m in completion)


def correct(completions, solution, **kwargs) -> list:
    from math_verify import parse, verify

    return [float(verify(parse(str(s)), parse(_text(c)))) for c, s in zip(completions, solution, strict=True)]


def bare_number(completions, **kwargs) -> list:
    return [float(_NUMBER.fullmatch(_text(c)) is not None) for c in completions]

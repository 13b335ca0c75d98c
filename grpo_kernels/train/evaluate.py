"""Score any model directory (a run's model/, an export, the base model) on a run's held-out prompts with its reward
functions:

    grpo-kernels eval MODEL --run RUN_DIR [--samples K] [--out DIR] [--section.field=value ...]
    grpo-kernels eval MODEL --config run.toml ...

By default with the run's own settings (task and held-out prompts, reward functions, sampler, temperature, top-p,
max_new_tokens, attention, batch rows, seed), so that a run's model/ scores exactly as the run's final held-out
evaluation did. Reports success (pass@1: the success function's mean over the answers it scored, with how many it
scored and how many it could not, None: those are left out, as TRL's means leave a None out) and each reward
function's mean; with --samples K, K answers per prompt and the unbiased pass@k for k = 1, 2, 4, ..., K (Chen et al.
2021: 1 - C(n - c, k) / C(n, k) per prompt, n scored answers of which c succeed, averaged over the prompts with at
least k scored answers) and mean@K (the mean reward over them). --out writes completions.jsonl (every answer with its
scores) and summary.json.
"""

import dataclasses
import json
import math
import sys
from pathlib import Path

import torch

from .build import load
from .config import TrainConfig
from .model.fsdp import SINGLE
from .rollout.colocated import make_sampler
from .rollout.sampling import held_out_result, held_out_rollout, standard_error

__all__ = ["evaluate_model", "pass_at_k"]


def pass_at_k(n: int, c: int, k: int) -> float:
    """The unbiased estimate of pass@k from n answers of which c succeed (k <= n)."""
    if not 1 <= k <= n or not 0 <= c <= n:
        raise ValueError(f"pass@k needs 1 <= k <= n and 0 <= c <= n, got n={n}, c={c}, k={k}")
    return 1.0 if n - c < k else 1.0 - math.comb(n - c, k) / math.comb(n, k)


def evaluate_model(model_dir, config: TrainConfig, *, samples: int = 1, out=None, progress: bool | None = None) -> dict:
    """The summary (see the module) of model_dir on config's held-out prompts; writes completions.jsonl and
    summary.json to `out` when given."""
    if samples < 1:
        raise ValueError(f"--samples must be >= 1, got {samples}")
    config = dataclasses.replace(config, model=dataclasses.replace(config.model, name=str(model_dir),
                                                                   converters=()))  # fmt: skip
    inputs = load(config)
    if not inputs.eval_set:
        raise ValueError("the task has no held-out prompts (task.num_eval_prompts = 0)")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    sampler = make_sampler(config, inputs.model.to(device), inputs.tok, SINGLE)
    try:
        if progress if progress is not None else sys.stderr.isatty():
            _count_rows(sampler, len(inputs.eval_set) * samples)
        rollout = held_out_rollout(sampler, inputs.tok, inputs.rewards, inputs.eval_set, seed=config.seed + 7,
                                   samples=samples)  # fmt: skip
    finally:
        if hasattr(sampler, "close"):
            sampler.close()
    summary = _summary(rollout, inputs, samples, model_dir)
    if out is not None:
        _write(Path(out), rollout, inputs, samples, summary)
    return summary


def _summary(rollout, inputs, samples: int, model_dir) -> dict:
    rewards, n = inputs.rewards, len(inputs.eval_set)
    result = held_out_result(rollout, rewards)
    per_func = rollout.rewards_per_func.reshape(n, samples, len(rewards.names))
    scored = [row[~row.isnan()] for row in per_func[:, :, rewards.success]]  # (an unscorable answer: left out)
    ks = sorted({k for k in (2**i for i in range(samples.bit_length())) if k <= samples} | {samples})
    summary = {"model": str(model_dir), "prompts": n, "samples": samples, "success": result.success,
               "success_se": standard_error(result.success, result.scored) if samples == 1 else float("nan"),
               "scored": result.scored, "unscorable": result.unscorable,
               **{f"pass@{k}": _mean_pass_at(scored, k) for k in ks},
               f"mean@{samples}": float(rollout.rewards.reshape(n, samples).nanmean(dim=1).nanmean()),
               "means": result.means}  # fmt: skip
    return summary


def _mean_pass_at(scored: list, k: int) -> float:
    """pass@k averaged over the prompts with at least k scored answers (each its success values); NaN if none."""
    rates = [pass_at_k(len(row), int((row == 1).sum()), k) for row in scored if len(row) >= k]
    return sum(rates) / len(rates) if rates else float("nan")


def _write(out: Path, rollout, inputs, samples: int, summary: dict) -> None:
    out.mkdir(parents=True, exist_ok=True)
    names, tok = inputs.rewards.names, inputs.tok
    rewards = rollout.rewards.flatten().tolist()
    per_func = rollout.rewards_per_func.reshape(len(rewards), len(names)).tolist()
    with (out / "completions.jsonl").open("w") as f:
        for row, ids in enumerate(rollout.completion_ids):
            example = inputs.eval_set[row // samples]
            line = {"prompt_index": row // samples, "sample": row % samples, "prompt": example.prompt,
                    "answer": example.answer, "completion": tok.decode(ids), "reward": rewards[row],
                    "rewards": dict(zip(names, per_func[row], strict=True))}  # fmt: skip
            f.write(json.dumps(line) + "\n")
    (out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")


def _count_rows(sampler, total: int) -> None:
    """A progress bar over the answers sampled, where the sampler reports them (the HF sampler's generate calls)."""
    from tqdm.auto import tqdm

    if hasattr(sampler, "progress"):
        sampler.progress = tqdm(total=total, desc="eval", unit="answer").update

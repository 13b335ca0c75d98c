"""The step's scored samples: the sampling seeds, G samples of every prompt spread over the ranks and scored,
dynamic sampling's extra rounds, and the held-out evaluation (one answer per prompt, `task.correct`)."""

import math

from .config import TrainConfig
from .fsdp import SINGLE, Dist, all_gather_objects
from .rollout import Rollout

__all__ = ["collect", "evaluate", "sample_scored", "seed_for", "standard_error", "with_standard_error"]


def seed_for(*parts: int) -> int:
    """A sampling seed for (run seed, step, round, prompt index); distinct for distinct inputs in range."""
    out = 0
    for p in parts:
        out = out * 1_000_003 + p
    return out % 2**63


def sample_scored(sampler, tok, task, examples, g: int, seeds: list, d: Dist, *, score=None) -> Rollout:
    """The scored rollout of G samples of every example, group k for examples[k]: rank r samples and scores the
    examples r, r + world, ... and every rank receives the whole result. score(completion, example): task.reward
    unless given."""
    score = score or task.reward
    mine = list(range(d.rank, len(examples), d.world))
    r = sampler.sample([tok.encode_prompt(examples[k].prompt) for k in mine], g, seeds=[seeds[k] for k in mine])
    part = r.with_rewards([score(tok.decode(c), examples[mine[k]]) for k, c in zip(r.group_ids, r.completion_ids,
                                                                                   strict=True)])  # fmt: skip
    gathered = all_gather_objects((mine, part), d)
    position = {k: i for i, k in enumerate(k for ks, _ in gathered for k in ks)}
    return Rollout.concat([p for _, p in gathered]).select([position[k] for k in range(len(examples))])


def collect(config: TrainConfig, sampler, tok, task, next_prompts, step: int, g: int, d: Dist):
    """The step's (scored rollout, prompts sampled, extra rounds, completion tokens sampled). With dynamic
    sampling, groups without a gradient signal are dropped and more prompts sampled, for at most
    max_resample_rounds more rounds; the rollout is None when no group survived. With
    sampling.mask_truncated_completions its truncated completions are masked out of the loss (their rewards still
    count in the group advantages)."""
    s, gs = config.sampling, config.group_size
    parts, sampled, rounds, tokens = [], 0, 0, 0
    while True:
        batch = next_prompts(s.prompts_per_step - sum(r.num_groups for r in parts))
        seeds = [seed_for(config.seed, step, rounds, k) for k in range(len(batch))]
        rollout = sample_scored(sampler, tok, task, batch, g, seeds, d)
        sampled, tokens = sampled + len(batch), tokens + sum(len(c) for c in rollout.completion_ids)
        if gs.dynamic_sampling:  # keep the groups with a gradient signal: the advantage kernel's own verdict
            rollout = rollout.select(rollout.advantages.valid.nonzero().flatten().tolist())
        if rollout.num_groups:
            parts.append(rollout)
        full = sum(r.num_groups for r in parts) >= s.prompts_per_step
        if not gs.dynamic_sampling or full or rounds >= gs.max_resample_rounds:
            break
        rounds += 1
    rollout = Rollout.concat(parts) if parts else None
    if rollout is not None and s.mask_truncated_completions:
        rollout = rollout.mask_truncated()
    return rollout, sampled, rounds, tokens


def evaluate(sampler, tok, task, examples, *, seed: int, d: Dist = SINGLE) -> float:
    """Success rate (`task.correct`) of one sampled answer per held-out prompt."""
    if not examples:
        return float("nan")
    rates = sample_scored(sampler, tok, task, examples, 1, [seed_for(seed, k) for k in range(len(examples))], d,
                    score=task.correct).pass_rates()  # fmt: skip
    return sum(rates) / len(rates)


def standard_error(rate: float, n: int) -> float:
    """Binomial standard error of a success rate measured on n prompts (nan without prompts)."""
    return math.sqrt(rate * (1 - rate) / n) if n else float("nan")


def with_standard_error(rate: float, n: int) -> str:
    return f"{rate:.3f} ± {standard_error(rate, n):.3f}" if n else "n/a (no held-out prompts)"

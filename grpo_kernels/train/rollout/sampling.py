"""The step's scored samples: the sampling seeds, G samples of every prompt spread over the ranks and scored by
the run's reward functions (a `Rewards`), dynamic sampling's extra rounds, and the held-out evaluation (one
answer per prompt: the success function's mean over the answers it scored, and every function's)."""

import math
import warnings
from typing import NamedTuple

from ..config import TrainConfig
from ..model.fsdp import SINGLE, Dist, all_gather_objects
from .batch import Rollout

__all__ = ["HeldOut", "collect", "evaluate", "held_out", "held_out_result", "held_out_rollout", "sample_scored",
           "seed_for", "standard_error", "with_standard_error"]  # fmt: skip


def seed_for(*parts: int) -> int:
    """A sampling seed for (run seed, step, round, prompt index); distinct for distinct inputs in range."""
    out = 0
    for p in parts:
        out = out * 1_000_003 + p
    return out % 2**63


def sample_scored(sampler, tok, rewards, examples, g: int, seeds: list, d: Dist, *, evaluation: bool = False,
                  step: int = 0, max_steps: int = 0) -> Rollout:  # fmt: skip
    """The scored rollout of G samples of every example, group k for examples[k]: rank r samples and scores the
    examples r, r + world, ... and every rank receives the whole result. Scored by rewards: the weighted sum
    (NaN: unscorable), each function's values in rollout.rewards_per_func. evaluation: a held-out evaluation's
    samples (the same scoring; samplers and benchmarks may tell them apart); step: the trainer_state's global_step
    the reward functions see."""
    mine = list(range(d.rank, len(examples), d.world))
    r = sampler.sample([tok.encode_prompt(examples[k].prompt) for k in mine], g, seeds=[seeds[k] for k in mine])
    rows = [examples[mine[k]] for k in r.group_ids]
    texts = [tok.decode(c) for c in r.completion_ids]
    completions = [t if isinstance(e.prompt, str) else [{"role": "assistant", "content": t}]
                   for t, e in zip(texts, rows, strict=True)]  # fmt: skip
    ids = [[int(t) for t in c] for c in r.completion_ids]
    per_func = rewards.score(rows, completions, ids, step=step, max_steps=max_steps, record=not evaluation)
    part = r.with_rewards(rewards.combine(per_func), per_func=per_func)
    gathered = all_gather_objects((mine, part), d)
    position = {k: i for i, k in enumerate(k for ks, _ in gathered for k in ks)}
    return Rollout.concat([p for _, p in gathered]).select([position[k] for k in range(len(examples))])


def collect(config: TrainConfig, sampler, tok, rewards, next_prompts, step: int, g: int, d: Dist):
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
        rollout = sample_scored(sampler, tok, rewards, batch, g, seeds, d, step=step, max_steps=config.optim.steps)
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


class HeldOut(NamedTuple):
    """A held-out evaluation: success (the success function's mean over the answers it scored: NaN where it is not
    0/1 or scored none), every reward function's mean over the answers it applied to, how many answers the success
    function scored (success's n, that of its standard error) and how many it returned None for (unscorable: left
    out of success, as TRL's mean of a function leaves its None values out)."""

    success: float
    means: dict
    scored: int = 0
    unscorable: int = 0


def held_out(sampler, tok, rewards, examples, *, seed: int, d: Dist = SINGLE, step: int = 0) -> HeldOut:
    """One sampled answer per held-out prompt, scored by every reward function."""
    if not examples:
        return HeldOut(float("nan"), {name: float("nan") for name in rewards.names})
    return held_out_result(held_out_rollout(sampler, tok, rewards, examples, seed=seed, d=d, step=step), rewards)


def held_out_rollout(sampler, tok, rewards, examples, *, seed: int, d: Dist = SINGLE, step: int = 0,
                     samples: int = 1) -> Rollout:  # fmt: skip
    """The held-out evaluation's scored samples: `samples` answers to each prompt (one: the run's evaluation), prompt
    k's seeded by seed_for(seed, k)."""
    seeds = [seed_for(seed, k) for k in range(len(examples))]
    return sample_scored(sampler, tok, rewards, examples, samples, seeds, d, evaluation=True, step=step)


def held_out_result(rollout: Rollout, rewards) -> HeldOut:
    """Success (the success function's mean over the answers it scored; an unscorable one, None, is left out and
    counted; NaN where it is not 0/1, or where no answer could be scored, with a warning that says so) and each
    function's mean over the answers it scored."""
    names = rewards.names
    per_func = rollout.rewards_per_func.reshape(-1, len(names))
    means = {name: float(per_func[:, k].nanmean()) for k, name in enumerate(names)}
    values = per_func[:, rewards.success]
    scored = values[~values.isnan()]
    result = HeldOut(float("nan"), means, len(scored), len(values) - len(scored))
    if not len(scored):
        if len(values):
            warnings.warn(f"held-out success: the success function {names[rewards.success]!r} returned None for "
                          f"every one of the {len(values)} answers: none could be scored, success is n/a",
                          stacklevel=3)  # fmt: skip
        return result
    if not bool(((scored == 0) | (scored == 1)).all()):
        warnings.warn(f"held-out success: the success function {names[rewards.success]!r} returned values "
                      "other than 0 and 1; success is reported as NaN (name a 0/1 function in task.success_reward)",
                      stacklevel=3)  # fmt: skip
        return result
    return result._replace(success=float(scored.sum() / len(scored)))


def evaluate(sampler, tok, rewards, examples, *, seed: int, d: Dist = SINGLE) -> float:
    """Success rate (the success function's mean) of one sampled answer per held-out prompt."""
    return held_out(sampler, tok, rewards, examples, seed=seed, d=d).success


def standard_error(rate: float, n: int) -> float:
    """Binomial standard error of a success rate measured on n prompts (nan without prompts)."""
    return math.sqrt(rate * (1 - rate) / n) if n else float("nan")


def with_standard_error(rate: float, n: int, *, unscorable: int = 0) -> str:
    """"0.500 ± 0.102" of a success rate measured on n answers, and how many unscorable ones were left out."""
    if not n:
        return f"n/a (none of the {unscorable} answers could be scored)" if unscorable else "n/a (no held-out prompts)"
    left_out = f" ({unscorable} unscorable, left out)" if unscorable else ""
    return f"{rate:.3f} ± {standard_error(rate, n):.3f}{left_out}"

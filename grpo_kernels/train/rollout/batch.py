"""The rollout: a batch of sampled completions, G per prompt, with its group layout, rewards and advantages.

The one owner of the group layout: group k is the completions k*G .. k*G + G - 1 of the per-completion lists, and
row k of `rewards` and of the advantage result. Callers ask it for `group_ids`, `pass_rates()`, `select(groups)`
and `Rollout.concat(parts)` instead of rebuilding the layout from `i // G`.

The samplers return a rollout without rewards; `with_rewards` scores it, and its advantages (`group_advantages` of
the rewards rounded to float32, the kernels' input, with the default options) are computed there once. A NaN reward
marks an unscorable completion (every reward function returned None for it): it is left out of its group's
statistics (the kernel sees the group without it) and its advantage is 0, as TRL does. They are
per group (scale="group": a group's advantages depend on its own rewards only), so `select` and `concat` carry
their parts' rows over instead of calling the kernel again; only `invalid_fraction` is recounted, as the C++
kernel counts it (the invalid groups over the groups, divided in fp64 and rounded once to fp32).

Two per-completion flags travel with the completions through `select` and `concat`: `truncated` (the sampler's:
the completion reached the token limit instead of ending at <eos> or a stop id) and `masked` (the trainer's: the
loss leaves the completion's tokens out, while its reward still counts in its group's advantages; `mask_truncated`
masks the truncated ones, TRL's mask_truncated_completions).
"""

import math
from dataclasses import dataclass, replace

import torch

from ...advantages import group_advantages
from ...types import GroupAdvantages

__all__ = ["Rollout"]


@dataclass(frozen=True, kw_only=True, slots=True)
class Rollout:
    """Sampled completions of a batch of prompts, G per prompt: completion i belongs to group `group_ids[i]`."""

    prompt_ids: list
    """list[Tensor]: the prompt of every completion (G equal entries per group)."""
    completion_ids: list
    """list[Tensor]: every completion, up to and including <eos> when it was generated."""
    sampler_logps: list
    """list[Tensor]: the sampler's log-prob of each completion token (at the sampling temperature)."""
    group_size: int
    """G, the completions per prompt: group k is entries k*G .. k*G + G - 1 of the lists above."""
    rewards: torch.Tensor | None = None
    """[num_groups, G] float (float64 from `with_rewards`: the scores exactly), row k the rewards of group k; None
    before scoring (what the samplers return)."""
    rewards_per_func: torch.Tensor | None = None
    """[num_groups, G, K] float64: each reward function's value (NaN where it returned None), when the rollout was
    scored by K functions; `rewards` is their weighted sum."""
    advantages: GroupAdvantages | None = None
    """The advantage result of the rewards (`group_advantages(rewards.float().flatten(), group_size=G)`), computed
    here when rewards are given without it; `select` and `concat` pass their parts' rows on. None without rewards."""
    truncated: list | None = None
    """list[bool]: True for a completion that ended because it reached the token limit (max_new_tokens, or the
    sampler's max_model_len), not at <eos> or a stop id. None when the sampler did not say (a concatenation with
    such a part is None too)."""
    masked: list | None = None
    """list[bool]: completions whose tokens the loss leaves out (mask 0: they add nothing to the loss and count in
    no token normalizer; grpo/sapo/luspo still count them in the mean over sequences, as TRL does). Their rewards
    still count in the group advantages. None = none masked."""

    def __post_init__(self):
        n = len(self.completion_ids)
        if len(self.prompt_ids) != n or len(self.sampler_logps) != n:
            raise ValueError(f"a rollout needs one prompt, completion and sampler log-prob list per completion, got "
                             f"{len(self.prompt_ids)}, {n} and {len(self.sampler_logps)}")  # fmt: skip
        for name in ("truncated", "masked"):
            flags = getattr(self, name)
            if flags is not None:
                flags = [bool(f) for f in flags]
                if len(flags) != n:
                    raise ValueError(f"{name} needs one flag per completion ({n}), got {len(flags)}")
                object.__setattr__(self, name, flags)
        g = self.group_size
        if isinstance(g, bool) or not isinstance(g, int) or g < 1:
            raise ValueError(f"group_size must be a positive int, got {g!r}")
        if n % g:
            raise ValueError(f"group_size={g} does not divide the number of completions {n}")
        if self.rewards is None:
            if self.advantages is not None:
                raise ValueError("a rollout without rewards has no advantages")
            return
        r = self.rewards
        if not isinstance(r, torch.Tensor) or not r.is_floating_point() or tuple(r.shape) != (n // g, g):
            got = tuple(r.shape) if isinstance(r, torch.Tensor) else type(r).__name__
            raise ValueError(f"rewards must be a float tensor of shape [num_groups, G] = {(n // g, g)}, got {got}")
        p = self.rewards_per_func
        if p is not None and (not isinstance(p, torch.Tensor) or p.dim() != 3 or tuple(p.shape[:2]) != (n // g, g)):
            got = tuple(p.shape) if isinstance(p, torch.Tensor) else type(p).__name__
            raise ValueError(f"rewards_per_func must be a tensor of shape [num_groups, G, K], got {got}")
        if self.advantages is None:
            object.__setattr__(self, "advantages", _advantages(r, g))
        elif tuple(self.advantages.advantages.shape) != (n,) or tuple(self.advantages.valid.shape) != (n // g,):
            raise ValueError(f"advantages must hold [{n}] advantages and [{n // g}] groups, got "
                             f"{tuple(self.advantages.advantages.shape)} and {tuple(self.advantages.valid.shape)}")

    @property
    def num_groups(self) -> int:
        """The number of groups (prompts)."""
        return len(self.completion_ids) // self.group_size

    @property
    def group_ids(self) -> list:
        """list[int]: the group of every completion, [0]*G + [1]*G + ..."""
        return [k for k in range(self.num_groups) for _ in range(self.group_size)]

    def with_rewards(self, rewards, per_func=None) -> "Rollout":
        """This rollout scored: rewards, one per completion in order (a flat sequence or tensor of N, or
        [num_groups, G]; NaN: unscorable), kept as float64; their advantages are computed here, once. per_func: the
        [N, K] values of K reward functions whose weighted sum the rewards are (kept for their metrics)."""
        r = torch.as_tensor(rewards, dtype=torch.float64)
        if r.numel() != len(self.completion_ids):
            raise ValueError(f"one reward per completion: {len(self.completion_ids)} completions, {r.numel()} rewards")
        shape = (self.num_groups, self.group_size)
        if per_func is not None:
            per_func = torch.as_tensor(per_func, dtype=torch.float64)
            if per_func.dim() != 2 or per_func.shape[0] != r.numel():
                raise ValueError(f"per_func must be [N, K] with N = {r.numel()} completions, got "
                                 f"{tuple(per_func.shape)}")  # fmt: skip
            per_func = per_func.reshape(*shape, per_func.shape[1])
        return replace(self, rewards=r.reshape(shape), rewards_per_func=per_func, advantages=None)

    def mask_truncated(self) -> "Rollout":
        """This rollout with its truncated completions masked out of the loss (added to those already masked)."""
        if self.truncated is None:
            raise ValueError("this rollout does not say which completions are truncated (its sampler set no flags)")
        masked = self.masked or [False] * len(self.completion_ids)
        return replace(self, masked=[m or t for m, t in zip(masked, self.truncated, strict=True)])

    def pass_rates(self) -> list:
        """list[float]: the mean reward of every group (summed in order in Python floats), over its scorable
        completions (NaN for a group with none)."""
        out = []
        for row in self._scored().tolist():
            kept = [r for r in row if not math.isnan(r)]
            out.append(sum(kept) / len(kept) if kept else float("nan"))
        return out

    def all_zero_fraction(self) -> float:
        """The share of groups whose every (scorable) reward is 0: for 0/1 rewards the invalid groups that are all
        wrong (the rest of the invalid groups are all right); 0.0 without groups."""
        rows = self._scored()
        all_zero = ((rows == 0) | rows.isnan()).all(dim=1) & (rows == 0).any(dim=1)
        return float(all_zero.double().mean()) if rows.shape[0] else 0.0

    def unscorable_fraction(self) -> float:
        """The share of completions no reward function scored (NaN rewards); 0.0 without completions."""
        rows = self._scored()
        return float(rows.isnan().double().mean()) if rows.numel() else 0.0

    def select(self, groups) -> "Rollout":
        """The rollout of the given groups (indices, in that order: a subset, a permutation, or repeats)."""
        groups = [int(k) for k in groups]
        if groups == list(range(self.num_groups)):
            return self
        bad = [k for k in groups if not 0 <= k < self.num_groups]
        if bad:
            raise ValueError(f"group {bad[0]} is out of range for a rollout of {self.num_groups} groups")
        g = self.group_size
        idx = [k * g + j for k in groups for j in range(g)]
        pick = lambda xs: [xs[i] for i in idx]  # noqa: E731
        rewards = advantages = per_func = None
        if self.rewards is not None:
            rows, a = torch.tensor(groups, dtype=torch.long, device=self.rewards.device), self.advantages
            rewards, valid = self.rewards[rows], a.valid[rows]
            per_func = None if self.rewards_per_func is None else self.rewards_per_func[rows]
            advantages = GroupAdvantages(a.advantages.view(self.num_groups, g)[rows].flatten(), valid,
                                         a.group_mean[rows], a.group_std[rows], _invalid_fraction(valid))  # fmt: skip
        flags = {name: None if getattr(self, name) is None else pick(getattr(self, name))
                 for name in ("truncated", "masked")}  # fmt: skip
        return Rollout(prompt_ids=pick(self.prompt_ids), completion_ids=pick(self.completion_ids),
                       sampler_logps=pick(self.sampler_logps), group_size=g, rewards=rewards,
                       rewards_per_func=per_func, advantages=advantages, **flags)  # fmt: skip

    @staticmethod
    def concat(parts) -> "Rollout":
        """The groups of every part, in order, as one rollout (equal group sizes; all scored or none)."""
        parts = list(parts)
        if not parts:
            raise ValueError("concat needs at least one rollout")
        if len(parts) == 1:
            return parts[0]
        g = parts[0].group_size
        if any(p.group_size != g for p in parts):
            raise ValueError(f"cannot concatenate rollouts of group sizes {sorted({p.group_size for p in parts})}")
        scored = {p.rewards is not None for p in parts}
        if len(scored) > 1:
            raise ValueError("cannot concatenate scored and unscored rollouts")
        cat = lambda name: [x for p in parts for x in getattr(p, name)]  # noqa: E731
        rewards = advantages = per_func = None
        if scored == {True}:
            rewards = torch.cat([p.rewards for p in parts])
            if all(p.rewards_per_func is not None for p in parts):
                per_func = torch.cat([p.rewards_per_func for p in parts])
            adv, valid, mean, std = (torch.cat([p.advantages[i] for p in parts]) for i in range(4))
            advantages = GroupAdvantages(adv, valid, mean, std, _invalid_fraction(valid))
        truncated = None if any(p.truncated is None for p in parts) else cat("truncated")
        masked = None
        if any(p.masked is not None for p in parts):  # a part without flags has nothing masked
            masked = [m for p in parts for m in (p.masked or [False] * len(p.completion_ids))]
        return Rollout(prompt_ids=cat("prompt_ids"), completion_ids=cat("completion_ids"),
                       sampler_logps=cat("sampler_logps"), group_size=g, rewards=rewards,
                       rewards_per_func=per_func, advantages=advantages, truncated=truncated,
                       masked=masked)  # fmt: skip

    def _scored(self) -> torch.Tensor:
        if self.rewards is None:
            raise ValueError("this rollout has no rewards yet: score it with with_rewards")
        return self.rewards


def _invalid_fraction(valid: torch.Tensor) -> torch.Tensor:
    """[] float32: the invalid groups over the groups, divided in fp64 and rounded once (the C++ kernel's count);
    NaN without groups."""
    return ((~valid).sum(dtype=torch.float64) / valid.numel()).float()


def _advantages(rewards: torch.Tensor, group_size: int) -> GroupAdvantages:
    if rewards.shape[0] == 0:  # no group (every one dropped, or a rank without prompts): the kernel takes none
        valid = torch.zeros(0, dtype=torch.bool, device=rewards.device)
        empty = torch.zeros(0, dtype=torch.float32, device=rewards.device)
        return GroupAdvantages(empty, valid, empty, empty, _invalid_fraction(valid))
    unscorable = rewards.isnan()
    if not unscorable.any():
        return group_advantages(rewards.float().flatten(), group_size=group_size)
    # Unscorable completions left out: the kernel normalizes each group over its scorable members (groups of
    # unequal sizes, by offsets); a group with none is invalid; the left-out completions get advantage 0.
    kept = (~unscorable).sum(dim=1)
    scorable = kept > 0
    num_groups, device = rewards.shape[0], rewards.device
    advantages = torch.zeros(rewards.numel(), dtype=torch.float32, device=device)
    valid = torch.zeros(num_groups, dtype=torch.bool, device=device)
    mean = torch.full((num_groups,), float("nan"), dtype=torch.float32, device=device)
    std = torch.full((num_groups,), float("nan"), dtype=torch.float32, device=device)
    if scorable.any():
        offsets = torch.cat([kept.new_zeros(1), kept[scorable].cumsum(0)])
        inner = group_advantages(rewards[~unscorable].float(), group_offsets=offsets)
        advantages[(~unscorable).flatten()] = inner.advantages
        valid[scorable], mean[scorable], std[scorable] = inner.valid, inner.group_mean, inner.group_std
    return GroupAdvantages(advantages, valid, mean, std, _invalid_fraction(valid))

"""Group-size maths for GRPO with binary (verifiable) rewards.

A prompt the policy solves with probability p yields a group of G Bernoulli(p) rewards. The group carries
no gradient when all G agree (its std is 0), which happens with probability

    invalid_group_rate(G, p) = p^G + (1 - p)^G.

The group mean is the baseline; as an estimate of p its mean squared error is p (1 - p) / G.
`simulate_advantages` checks both against draws pushed through `group_advantages` itself.
"""

import math
from dataclasses import dataclass

import torch

__all__ = [
    "SimulationResult",
    "expected_signal_fraction",
    "invalid_group_rate",
    "min_group_size",
    "simulate_advantages",
]


def _check(group_size: int, p: float) -> None:
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1:
        raise ValueError(f"group_size must be a positive int, got {group_size!r}")
    if not (isinstance(p, (int, float)) and 0.0 <= p <= 1.0):
        raise ValueError(f"p must be a probability in [0, 1], got {p!r}")


def invalid_group_rate(group_size: int, p: float) -> float:
    """Probability that G Bernoulli(p) rewards are all equal: p^G + (1 - p)^G."""
    _check(group_size, p)
    return p**group_size + (1.0 - p) ** group_size


def expected_signal_fraction(group_size: int, p: float) -> float:
    """Expected fraction of groups that carry a gradient: 1 - invalid_group_rate(G, p)."""
    return 1.0 - invalid_group_rate(group_size, p)


def min_group_size(p: float, max_invalid_rate: float, *, limit: int = 4096) -> int:
    """Smallest G whose invalid-group rate is at most `max_invalid_rate` (for choosing or adapting G)."""
    _check(1, p)
    if not 0.0 < max_invalid_rate <= 1.0:
        raise ValueError(f"max_invalid_rate must be in (0, 1], got {max_invalid_rate!r}")
    if p in (0.0, 1.0) and max_invalid_rate < 1.0:
        raise ValueError(f"with p={p} every group is invalid whatever its size")
    for g in range(1, limit + 1):
        if invalid_group_rate(g, p) <= max_invalid_rate:
            return g
    raise ValueError(f"no group size up to {limit} reaches an invalid rate of {max_invalid_rate} at p={p}")


@dataclass(frozen=True, slots=True, kw_only=True)
class SimulationResult:
    """Monte-Carlo estimates for `n_groups` groups of G Bernoulli(p) rewards, next to their theory."""

    invalid_rate: float
    """Fraction of groups masked as invalid by `group_advantages`."""
    invalid_rate_theory: float
    """p^G + (1 - p)^G."""
    invalid_rate_stderr: float
    """Binomial standard error of `invalid_rate` at the theoretical rate."""
    advantage_var: float
    """Mean of A^2 over all completions (invalid groups contribute 0): the learning signal that survives."""
    baseline_mse: float
    """Mean of (group mean - p)^2: the error of the group baseline."""
    baseline_mse_theory: float
    """p (1 - p) / G."""


def simulate_advantages(
    group_size: int, p: float, n_groups: int, *, scale: str = "group", seed: int = 0
) -> SimulationResult:
    """Draw n_groups groups of G Bernoulli(p) rewards and measure them with `group_advantages` (CPU)."""
    from .advantages import group_advantages

    _check(group_size, p)
    if isinstance(n_groups, bool) or not isinstance(n_groups, int) or n_groups < 1:
        raise ValueError(f"n_groups must be a positive int, got {n_groups!r}")
    gen = torch.Generator().manual_seed(seed)
    rewards = torch.bernoulli(torch.full((n_groups * group_size,), float(p)), generator=gen)
    out = group_advantages(rewards, group_size=group_size, scale=scale)
    theory = invalid_group_rate(group_size, p)
    return SimulationResult(
        invalid_rate=float(out.invalid_fraction),
        invalid_rate_theory=theory,
        invalid_rate_stderr=math.sqrt(theory * (1.0 - theory) / n_groups),
        advantage_var=float((out.advantages.double() ** 2).mean()),
        baseline_mse=float(((out.group_mean.double() - p) ** 2).mean()),
        baseline_mse_theory=p * (1.0 - p) / group_size,
    )

"""The spec: eager PyTorch definitions of every op, readable like the maths.

Every backend (Triton, C++) is tested against these functions. They compute in the dtype of their
input, so `f(x.double())` is the fp64 oracle and `f(x.bfloat16())` is "PyTorch's own bf16 computation of
the same thing" that bf16 backends must match or beat. They assume valid input (the public API checks it)
and are differentiable with autograd. Nothing here imports Triton or the compiled extension.
"""

import torch

from .types import GroupAdvantages

__all__ = ["group_advantages", "group_sizes_of"]


def group_sizes_of(n: int, group_size: int | None, group_offsets: torch.Tensor | None, device) -> torch.Tensor:
    """Sizes `[num_groups]` (int64) of contiguous blocks of `group_size`, or of the segments in `group_offsets`."""
    if group_offsets is not None:
        return group_offsets.to(device=device, dtype=torch.int64).diff()
    return torch.full((n // group_size,), group_size, dtype=torch.int64, device=device)


def _segment_sum(x: torch.Tensor, segment: torch.Tensor, num_groups: int) -> torch.Tensor:
    return torch.zeros(num_groups, dtype=x.dtype, device=x.device).index_add(0, segment, x)


def _sqrt0(x: torch.Tensor) -> torch.Tensor:
    """sqrt with sqrt(0) = 0 and a zero (not NaN) gradient there."""
    pos = x > 0
    return torch.where(pos, torch.sqrt(torch.where(pos, x, torch.ones_like(x))), torch.zeros_like(x))


def group_advantages(
    rewards: torch.Tensor,
    *,
    group_size: int | None = None,
    group_offsets: torch.Tensor | None = None,
    scale: str = "group",
    eps: float = 1e-6,
    std: str = "unbiased",
    min_std: float = 1e-4,
    reward_weights: torch.Tensor | None = None,
    nan: str = "error",
) -> GroupAdvantages:
    """Group-relative advantages with invalid-group masking.

    r_i    = sum_k w_k R_ik                                   (R: [N] or [N, K] rewards, w: reward_weights)
    m_g    = mean_{i in g} r_i
    s_g    = sqrt( sum_{i in g} (r_i - m_g)^2 / (n_g - c) )   c = 1 ("unbiased") or 0 ("biased"); s_g = 0 if n_g = c
    valid_g = s_g > min_std and every r_i in g is finite
    A_i    = valid_g * (r_i - m_g) / D                         D = s_g + eps  ("group")
                                                               D = S + eps    ("batch": S the std, same c, of all
                                                                               rewards in groups with finite rewards)
                                                               D = 1          ("none", Dr. GRPO)
    Groups are contiguous blocks of `group_size`, or segments [o_g, o_{g+1}) of `group_offsets`.
    A group holding a non-finite reward reports NaN mean and std (only reachable with nan="invalid").
    """
    if nan == "error" and not bool(torch.isfinite(rewards).all()):
        raise ValueError("rewards hold a non-finite value")
    columns = rewards if rewards.dim() == 2 else rewards.unsqueeze(1)
    w = torch.ones(columns.shape[1], dtype=rewards.dtype, device=rewards.device)
    if reward_weights is not None:
        w = reward_weights.to(rewards.dtype)
    finite = torch.isfinite((columns * w).sum(dim=1))
    # Rows with a non-finite reward are zeroed before combining, so they carry no NaN into any gradient.
    r0 = (torch.where(finite[:, None], columns, torch.zeros_like(columns)) * w).sum(dim=1)
    sizes = group_sizes_of(r0.shape[0], group_size, group_offsets, r0.device)
    num_groups = sizes.shape[0]
    segment = torch.repeat_interleave(torch.arange(num_groups, device=r0.device), sizes)
    c = 1.0 if std == "unbiased" else 0.0

    bad = _segment_sum((~finite).to(r0.dtype), segment, num_groups) > 0
    n = sizes.to(r0.dtype)
    mean = _segment_sum(r0, segment, num_groups) / n
    d = r0 - mean[segment]
    dof = n - c
    var = torch.where(dof > 0, _segment_sum(d * d, segment, num_groups) / dof.clamp(min=1), torch.zeros_like(n))
    s = _sqrt0(var)
    valid = ~bad & (s > min_std)

    if scale == "group":
        denom = s[segment] + eps
    elif scale == "batch":
        good = ~bad[segment]
        count = good.sum().to(r0.dtype)
        big_mean = torch.where(good, r0, torch.zeros_like(r0)).sum() / count.clamp(min=1)
        dev = torch.where(good, r0 - big_mean, torch.zeros_like(r0))
        big_var = torch.where(count - c > 0, (dev * dev).sum() / (count - c).clamp(min=1), torch.zeros_like(count))
        denom = _sqrt0(big_var) + eps
    elif scale == "none":
        denom = torch.ones_like(d)
    else:
        raise ValueError(f"unknown scale {scale!r}")

    adv = torch.where(valid[segment], d / denom, torch.zeros_like(d))
    nan_g = torch.full_like(mean, float("nan"))
    return GroupAdvantages(
        advantages=adv,
        valid=valid,
        group_mean=torch.where(bad, nan_g, mean),
        group_std=torch.where(bad, nan_g, s),
        invalid_fraction=1.0 - valid.to(r0.dtype).mean(),
    )

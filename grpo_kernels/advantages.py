"""Public API: group-relative advantages with invalid-group masking."""

from collections.abc import Sequence

import torch

from . import reference
from ._checks import (
    check_choice,
    check_group_offsets,
    check_impl,
    check_impl_device,
    check_nonnegative,
    check_reward_weights,
)
from .ops import advantages as _ops
from .types import GroupAdvantages

__all__ = ["group_advantages", "GroupAdvantages"]

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def group_advantages(
    rewards: torch.Tensor,
    *,
    group_size: int | None = None,
    group_offsets: torch.Tensor | None = None,
    scale: str = "group",
    eps: float = 1e-6,
    std: str = "unbiased",
    min_std: float = 1e-4,
    reward_weights: torch.Tensor | Sequence[float] | None = None,
    nan: str = "error",
    impl: str = "auto",
) -> GroupAdvantages:
    """Normalize rewards inside their group; mask the groups that carry no signal.

    Args:
        rewards: `[N]`, or `[N, K]` for K reward functions combined as `r = rewards @ reward_weights`
            (weights default to 1). Any float dtype; computed in float32.
        group_size: groups are contiguous blocks of this many completions (must divide N). Or:
        group_offsets: `[num_groups + 1]` int32/int64, strictly increasing from 0 to N (like cu_seqlens):
            group g is `rewards[offsets[g]:offsets[g+1]]`. Give exactly one of the two.
        scale: "group": A = (r - mean_g) / (std_g + eps); "batch": the std of the whole batch instead of
            std_g (TRL's `scale_rewards="batch"`, here over this call's batch); "none": A = r - mean_g (Dr. GRPO).
        std: "unbiased" (divide by G - 1, as TRL and verl) or "biased" (divide by G).
        min_std: a group with std_g <= min_std (all-0, all-1, all-equal, or a single member) is invalid:
            its advantages are exactly 0 and `valid` is False.
        nan: "error" raises ValueError naming the first non-finite reward; "invalid" marks its group invalid.
        impl: "auto" (C++ for CPU tensors, Triton for CUDA), "cpp", "triton" or "reference". An explicit
            choice never falls back: "cpp" needs CPU tensors, "triton" needs CUDA or TRITON_INTERPRET=1.

    Returns:
        GroupAdvantages(advantages [N] f32, valid [num_groups] bool, group_mean [num_groups] f32,
        group_std [num_groups] f32, invalid_fraction [] f32). Differentiable w.r.t. rewards and weights.

    Under torch.compile the value checks that need the data on the host (non-finite rewards, offsets
    order) are skipped; shape and type checks always run. With nan="error" the kernel runs first and flags
    the groups with a non-finite reward; the error is raised from its result (no extra pass over rewards).
    """
    if not isinstance(rewards, torch.Tensor):
        raise ValueError(f"rewards must be a torch.Tensor, got {type(rewards)}")
    if rewards.dtype not in _FLOAT_DTYPES:
        raise ValueError(f"rewards must be a floating tensor (float16/bfloat16/float32/float64), got {rewards.dtype}")
    if rewards.dim() not in (1, 2) or rewards.shape[0] == 0 or (rewards.dim() == 2 and rewards.shape[1] == 0):
        raise ValueError(f"rewards must be [N] or [N, K] with N, K >= 1, got shape {tuple(rewards.shape)}")
    check_choice("scale", scale, ("group", "batch", "none"))
    check_choice("std", std, ("unbiased", "biased"))
    check_choice("nan", nan, ("error", "invalid"))
    eps, min_std = check_nonnegative("eps", eps), check_nonnegative("min_std", min_std)
    check_impl(impl)
    check_impl_device(impl, rewards.device, "rewards")
    n = rewards.shape[0]
    if (group_size is None) == (group_offsets is None):
        raise ValueError("give exactly one of group_size and group_offsets")
    if group_size is not None:
        if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1:
            raise ValueError(f"group_size must be a positive int, got {group_size!r}")
        if n % group_size:
            raise ValueError(f"group_size={group_size} does not divide the number of rewards N={n}")
    else:
        # The C++ kernel checks the offsets' values in its own loop (no extra pass); the detailed error comes
        # from the Python check, run only when the kernel refuses them.
        kernel_checks = impl in ("auto", "cpp") and rewards.device.type == "cpu"
        check_group_offsets(group_offsets, n, rewards.device, values=not kernel_checks)
    rewards_2d = rewards if rewards.dim() == 2 else rewards.unsqueeze(1)
    weights = check_reward_weights(reward_weights, rewards_2d.shape[1], rewards.dim() == 1, rewards.device)
    try:
        out, num_bad = _dispatch(impl, rewards, rewards_2d, weights, group_size, group_offsets, scale, eps, std,
                                 min_std)  # fmt: skip
    except RuntimeError as exc:
        if group_offsets is not None and "group_offsets" in str(exc):
            check_group_offsets(group_offsets, n, rewards.device)  # raises the ValueError that names the group
        raise
    if nan == "error" and not torch.compiler.is_compiling():
        # The call's one host sync: one int from the kernel where it counts the bad groups, else O(num_groups).
        if bool(num_bad) if num_bad is not None else bool(torch.isnan(out.group_mean).any()):
            _raise_on_non_finite(rewards, out.group_mean, group_size, group_offsets)
    return out


def _dispatch(impl, rewards, rewards_2d, weights, group_size, group_offsets, scale, eps, std, min_std):
    """Run one backend with nan='invalid' semantics (a non-finite reward makes its group's mean NaN) -> (result,
    the number of groups with a non-finite reward as a device tensor where the kernel counts them, else None)."""
    if impl == "reference":
        wide = rewards_2d.to(torch.promote_types(rewards.dtype, torch.float32))
        out = reference.group_advantages(
            wide, group_size=group_size, group_offsets=group_offsets, scale=scale, eps=eps, std=std,
            min_std=min_std, reward_weights=weights, nan="invalid",
        )  # fmt: skip
        return GroupAdvantages(*(t if t.dtype == torch.bool else t.float() for t in out)), None
    offsets = None if group_offsets is None else group_offsets.contiguous()
    *out, num_bad = _ops.group_advantages(rewards_2d, weights, offsets, group_size or 0, scale, eps,
                                          std == "unbiased", min_std, impl)  # fmt: skip
    return GroupAdvantages(*out), num_bad


def _raise_on_non_finite(rewards, group_mean, group_size, group_offsets) -> None:
    """nan='error', where a group holds a non-finite reward (the kernels flag it: its mean is NaN; no separate
    pass over the rewards): raises naming the first bad index."""
    g = int(torch.isnan(group_mean).nonzero()[0])
    start = g * group_size if group_offsets is None else int(group_offsets[g])
    end = start + group_size if group_offsets is None else int(group_offsets[g + 1])
    rows = rewards[start:end]
    if bool(torch.isfinite(rows).all()):
        raise ValueError(f"the weighted reward of a row in rows {start}..{end - 1} overflows to a non-finite value")
    idx = (~torch.isfinite(rows)).nonzero()[0].tolist()
    idx[0] += start
    raise ValueError(
        f"rewards[{', '.join(map(str, idx))}] = {rewards[tuple(idx)].item()} is not finite; "
        "pass nan='invalid' to mask its group instead"
    )

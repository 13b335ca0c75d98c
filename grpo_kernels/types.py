"""Result types and the group layout shared by the reference and the backends (no imports beyond torch, so the spec
can use them)."""

from typing import NamedTuple

import torch


def group_sizes(n: int, group_size: int | None, group_offsets: torch.Tensor | None, device) -> torch.Tensor:
    """Sizes `[num_groups]` (int64) of the contiguous blocks of `group_size` among n rewards, or of the segments
    [o_g, o_{g+1}) of `group_offsets`: the group layout, shared by the reference and the backends."""
    if group_offsets is not None:
        return group_offsets.to(device=device, dtype=torch.int64).diff()
    return torch.full((n // group_size,), group_size, dtype=torch.int64, device=device)


class GroupAdvantages(NamedTuple):
    """What `group_advantages` returns. All tensors live on the rewards' device.

    advantages:       [N] float32, the normalized advantage of every completion (0 in invalid groups).
    valid:            [num_groups] bool, False for a group with std <= min_std or with a non-finite reward.
    group_mean:       [num_groups] float32, mean reward of the group (NaN if it holds a non-finite reward).
    group_std:        [num_groups] float32, std of the group's rewards (NaN if it holds a non-finite reward).
    invalid_fraction: [] float32, the fraction of groups that are not valid (a tensor: no host sync).
    """

    advantages: torch.Tensor
    valid: torch.Tensor
    group_mean: torch.Tensor
    group_std: torch.Tensor
    invalid_fraction: torch.Tensor

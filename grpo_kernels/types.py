"""Result types shared by the reference and the backends (no imports beyond torch, so the spec can use them)."""

from typing import NamedTuple

import torch


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

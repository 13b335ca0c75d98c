"""Backends: Triton kernels and their launchers, and the `torch.ops.grpo_kernels` registrations.

Importing this package registers every op. `KERNELS` (in `registry`) lists every Triton kernel with
example arguments, for the ahead-of-time Hopper compile check.
"""

from . import advantages, logprobs, loss

__all__ = ["advantages", "logprobs", "loss"]

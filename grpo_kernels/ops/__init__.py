"""Backends: Triton kernels and their launchers, and the `torch.ops.grpo_kernels` registrations.

Importing this package registers every op. `aot_report.kernel_variants()` lists every Triton kernel with
example signatures, for the ahead-of-time Hopper compile report (`python -m grpo_kernels.ops.aot_report`).
"""

from . import advantages, logprobs, loss

__all__ = ["advantages", "logprobs", "loss"]

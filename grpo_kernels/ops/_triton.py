"""What every Triton launcher shares."""

import torch
from triton.runtime.jit import JITFunction


def require_triton_device(kernel, tensor: torch.Tensor) -> None:
    """CPU tensors run only in the Triton interpreter (TRITON_INTERPRET=1 set before kernels are defined)."""
    if tensor.device.type == "cpu" and isinstance(kernel, JITFunction):
        raise RuntimeError(
            "the Triton backend runs CPU tensors only in the Triton interpreter: set TRITON_INTERPRET=1 before "
            "importing grpo_kernels, or use impl='cpp'"
        )

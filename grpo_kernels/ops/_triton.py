"""What every Triton launcher shares."""

import torch
from triton.runtime.jit import JITFunction

_COUNTERS: dict = {}


def stream_counters(owner: str, n: int, device: torch.device) -> torch.Tensor:
    """n int32 counters of `owner`'s kernel for the current stream on device: zeroed when first made, and kept at
    zero between launches by the kernel itself (its last program resets them), so a launch needs no memset. One
    set per stream: two launches in flight on different streams never share them."""
    stream = torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0
    key = (owner, device, stream)
    counters = _COUNTERS.get(key)
    if counters is None:
        counters = _COUNTERS[key] = torch.zeros(n, dtype=torch.int32, device=device)
    return counters


def require_triton_device(kernel, tensor: torch.Tensor) -> None:
    """CPU tensors run only in the Triton interpreter (TRITON_INTERPRET=1 set before kernels are defined)."""
    if tensor.device.type == "cpu" and isinstance(kernel, JITFunction):
        raise RuntimeError(
            "the Triton backend runs CPU tensors only in the Triton interpreter: set TRITON_INTERPRET=1 before "
            "importing grpo_kernels, or use impl='cpp'"
        )

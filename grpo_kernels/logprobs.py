"""Public API: per-token log-probs of the sampled ids (log-softmax + gather) and entropy, without [T, V] buffers."""

import math

import torch

from . import reference
from .ops import logprobs as _ops

__all__ = ["selective_logprobs"]

_LOGIT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _check(logits, ids, temperature, cu_seqlens, impl, flags):
    if not isinstance(logits, torch.Tensor) or logits.dtype not in _LOGIT_DTYPES:
        got = logits.dtype if isinstance(logits, torch.Tensor) else type(logits)
        raise ValueError(f"logits must be a float16/bfloat16/float32 tensor, got {got}")
    if logits.dim() not in (2, 3) or logits.shape[-1] == 0:
        raise ValueError(f"logits must be [B, L, V] or packed [T, V] with V >= 1, got {tuple(logits.shape)}")
    if not isinstance(ids, torch.Tensor) or ids.dtype not in (torch.int32, torch.int64):
        raise ValueError("ids must be an int32 or int64 tensor")
    if tuple(ids.shape) != tuple(logits.shape[:-1]):
        raise ValueError(f"ids must have shape {tuple(logits.shape[:-1])} (logits without V), got {tuple(ids.shape)}")
    if ids.device != logits.device:
        raise ValueError(f"ids are on {ids.device} but logits are on {logits.device}")
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or not (
        math.isfinite(temperature) and temperature > 0
    ):
        raise ValueError(f"temperature must be a finite number > 0, got {temperature!r}")
    for name, value in flags.items():
        if not isinstance(value, bool):
            raise ValueError(f"{name} must be a bool, got {value!r}")
    if impl not in ("auto", "triton", "cpp", "reference"):
        raise ValueError(f"impl must be one of 'auto', 'triton', 'cpp', 'reference', got {impl!r}")
    if impl == "cpp" and logits.device.type != "cpu":
        raise ValueError(f"impl='cpp' runs CPU tensors only; logits are on {logits.device}")
    if impl == "auto" and logits.device.type not in ("cpu", "cuda"):
        raise ValueError(f"no grpo_kernels backend for {logits.device} tensors (CPU and CUDA only)")
    if cu_seqlens is not None:
        if logits.dim() != 2:
            raise ValueError("cu_seqlens goes with packed logits [T, V]")
        if not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.dtype not in (torch.int32, torch.int64):
            raise ValueError("cu_seqlens must be an int32 or int64 tensor")
        if cu_seqlens.dim() != 1 or cu_seqlens.shape[0] < 2:
            raise ValueError("cu_seqlens must be a 1-D tensor [num_sequences + 1]")
        if not torch.compiler.is_compiling():
            c = cu_seqlens.cpu()
            if c[0] != 0 or c[-1] != logits.shape[0] or bool((c.diff() < 0).any()):
                raise ValueError(f"cu_seqlens must rise from 0 to T={logits.shape[0]}, got {c.tolist()[:8]}...")
    if ids.numel() and not torch.compiler.is_compiling():
        lo, hi = int(ids.min()), int(ids.max())
        if lo < 0 or hi >= logits.shape[-1]:
            bad = lo if lo < 0 else hi
            raise ValueError(f"ids must lie in [0, V={logits.shape[-1]}), found {bad}")


def selective_logprobs(
    logits: torch.Tensor,
    ids: torch.Tensor,
    *,
    temperature: float = 1.0,
    return_entropy: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    inplace_backward: bool = False,
    impl: str = "auto",
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """log softmax(logits / temperature)[ids] per token, and optionally the entropy of that distribution.

    Args:
        logits: `[B, L, V]` or packed `[T, V]`, float32/bfloat16/float16, any V.
        ids: `[B, L]` or `[T]` int64/int32 token ids in [0, V).
        temperature: the sampling temperature (a runtime argument: changing it recompiles nothing).
        return_entropy: also return `-sum_v p log p` per token.
        cu_seqlens: `[num_sequences + 1]` boundaries of packed sequences (checked; the op is per token).
        inplace_backward: the backward writes d logits into the logits' own buffer and returns it as their
            gradient, saving a [T, V] allocation. Only when nothing else needs the logits after the forward.
        impl: "auto" (C++ on CPU, Triton on CUDA), "cpp", "triton" or "reference"; never falls back.

    Returns:
        logps with the shape of ids (float32), and entropy of the same shape when asked. Differentiable
        w.r.t. logits: the backward writes d logits = (g (onehot - p) - gH p (log p + H)) / temperature in
        one pass, from the per-token log-sum-exp saved by the forward (no [T, V] buffer is kept).
    """
    flags = dict(return_entropy=return_entropy, inplace_backward=inplace_backward)
    _check(logits, ids, temperature, cu_seqlens, impl, flags)
    shape = ids.shape
    flat = logits.reshape(-1, logits.shape[-1])
    if flat.shape[0] and flat.stride(-1) != 1:
        flat = flat.contiguous()
    flat_ids = ids.reshape(-1).to(torch.int64).contiguous()
    temperature = float(temperature)
    if impl == "reference":
        out = reference.selective_logprobs(flat.float(), flat_ids, temperature=temperature, return_entropy=True)
        logps, entropy = out
    elif impl == "triton" and flat.device.type == "cpu":
        logps, entropy, _ = _ops.TritonDirect.apply(flat, flat_ids, temperature, return_entropy, inplace_backward)
    else:
        args = (flat, flat_ids, temperature, return_entropy, inplace_backward)
        logps, entropy, _ = torch.ops.grpo_kernels.selective_logprobs(*args)
    if return_entropy:
        return logps.reshape(shape), entropy.reshape(shape)
    return logps.reshape(shape)

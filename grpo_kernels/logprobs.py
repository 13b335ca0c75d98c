"""Public API: per-token log-probs of the sampled ids (log-softmax + gather) and entropy, without [T, V] buffers."""

import torch

from . import reference
from ._checks import check_logprobs_args
from .ops import logprobs as _ops

__all__ = ["selective_logprobs"]

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
        ids: `[B, L]` or `[T]` int64/int32 token ids in [0, V) (else ValueError; under torch.compile that
            check is skipped: the C++ kernel still raises, the Triton kernel gives a NaN log-prob for such an id).
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
    check_logprobs_args(logits, ids, temperature, cu_seqlens, impl, flags)
    shape = ids.shape
    flat = logits.reshape(-1, logits.shape[-1])
    shared = _overlapping(flat)  # e.g. an expand(): elements share memory (a transpose does not)
    if inplace_backward and shared:
        raise ValueError(f"inplace_backward=True writes d logits over the logits, whose elements share memory here "
                         f"(strides {tuple(flat.stride())} for [T, V] = {list(flat.shape)}, e.g. an expand()): pass "
                         "contiguous logits or inplace_backward=False")  # fmt: skip
    if flat.shape[0] and (flat.stride(-1) != 1 or shared):
        flat = flat.contiguous()  # (inplace_backward then writes over this copy: correct, but nothing is saved)
    flat_ids = ids.reshape(-1).to(torch.int64).contiguous()
    temperature = float(temperature)
    if impl == "reference":
        out = reference.selective_logprobs(flat.float(), flat_ids, temperature=temperature, return_entropy=True)
        logps, entropy = out
    else:
        logps, entropy, _ = _ops.selective_logprobs(flat, flat_ids, temperature, return_entropy, inplace_backward, impl)
    if return_entropy:
        return logps.reshape(shape), entropy.reshape(shape)
    return logps.reshape(shape)


def _overlapping(x: torch.Tensor) -> bool:
    """Whether two elements of the 2-D view x share memory (strides sorted ascending must each pass the extent of
    the dimensions below them)."""
    extent = 0
    for stride, size in sorted((st, n) for st, n in zip(x.stride(), x.shape, strict=True) if n > 1):
        if stride <= extent:
            return True
        extent += stride * (size - 1)
    return False

"""The token-level GRPO loss in one kernel launch forward and one backward (Triton, eager calls).

Design. The launch-bound part of the loss is everything around its kernel: on an H200 the GPU was busy 0.085 ms of
a 1.5 ms fwd+bwd call at T = 131,072, the rest being 28 launches of aten glue (casts, the [B] sums, the
normalizer, the metrics) and the host time of issuing them. Here the forward kernel of ops/loss.py runs with
FINISH: each program writes its (sequence, chunk) partial sums as before, takes an integer ticket, and the last
program reduces every partial in a fixed order into the loss (with TRL's normalizer), the metrics and the factor
d loss / d (sum_t m l) of each sequence, so the forward is one launch and stays deterministic (no float atomics;
the ticket decides only which program adds, not the order). The backward is one launch that reads the upstream
gradient on the device: grad_t = g a_s coef_t. No host sync: a num_items_in_batch tensor is read by the kernel
(<= 0 gives a NaN loss, since its value is never seen on the host). Inputs are read in their own dtypes (bf16 old
log-probs, a bool mask: no cast kernels), padded [B, L] input needs no cu_seqlens tensor.

Which loss types take this path: every one whose per-token term needs no statistic of its whole sequence
(`LossOptions.whole_sequence` false): grpo, bnpo, dr_grpo, dapo, cispo, sapo and luspo at token level, with or
without KL and a token-level sampler correction. GSPO (sequence level), the sequence-level sampler modes and vespo
need each sequence's sums before any token's term: they take ops/loss.py's path (a first launch for those sums,
then the per-token kernel and the small torch reductions of `finish`). Under torch.compile the registered op runs
(ops/loss.py), whose glue the compiler fuses.

The ticket counter is one int32 per (device, stream), zero between calls: the last program resets it.
"""

import torch
import triton

from ..options import LossOptions
from ._triton import require_triton_device, stream_counters
from .loss import NUM_KERNEL_STATS, NUM_WARPS
from .loss_kernels import grpo_loss_bwd_kernel, grpo_loss_fwd_kernel

__all__ = ["FusedTokenLoss", "divisor_of", "flat", "metric_picks", "token_loss"]

BLOCK = 1024
CHUNK = BLOCK  # one block per program: at B = 64 rows of 2,048 tokens that is 128 programs, not 64


def _counter(device: torch.device) -> torch.Tensor:
    """The ticket counter of the current stream on `device` (see _triton.stream_counters)."""
    return stream_counters("grpo_loss", 1, device)


def divisor_of(options: LossOptions, num_seqs: int, num_items_in_batch) -> tuple[int, float, torch.Tensor | None]:
    """(div_kind, div_value, num_items tensor or None) of `_finish_loss` for these options (see the kernel)."""
    loss_type = options.loss_type
    if loss_type in ("grpo", "sapo"):
        return 0, 0.0, None
    if loss_type == "luspo":
        return 1, float(num_seqs), None
    if loss_type == "bnpo":
        return 2, 0.0, None
    if loss_type == "dr_grpo":
        longest = options.max_completion_length
        return (1, float(num_seqs * longest), None) if longest else (3, 0.0, None)
    if num_items_in_batch is None:
        return 2, 0.0, None
    if isinstance(num_items_in_batch, torch.Tensor):
        return 4, 0.0, num_items_in_batch.reshape(())
    return 1, max(float(num_items_in_batch), 1.0), None


def flat(x: torch.Tensor | None) -> torch.Tensor | None:
    """An optional input as the fused kernel reads it: flat, contiguous, in its own dtype (no cast kernel)."""
    if x is None:
        return None
    return x.detach().view(-1) if x.is_contiguous() else x.detach().reshape(-1).contiguous()


_PICKS: dict = {}


def metric_picks(options: LossOptions, sampler: bool) -> tuple[int, ...]:
    """Positions in the kernel's metrics (clip low, high, region, ratio, KL, sampler diff) of options.metric_names."""
    key = (options.loss_type == "cispo", options.beta != 0.0, sampler)
    picks = _PICKS.get(key)
    if picks is None:
        picks = _PICKS[key] = ((0, 3) if key[0] else (0, 1, 2, 3)) + (4,) * key[1] + (5,) * sampler
    return picks


def token_loss(logps, old, ref, sampler, adv, adv_per_token, mask, cu_seqlens, b, max_seqlen, scalars, divisor):
    """Flat [T] inputs of b sequences (any float dtypes; mask any dtype; cu_seqlens None for padded input, then
    max_seqlen is the row length) -> (loss 0-d f32, metrics [6] f32, coef [T] f32, scale f32 [b] or [1]). One
    launch."""
    require_triton_device(grpo_loss_fwd_kernel, logps)
    dev = logps.device
    padded = cu_seqlens is None
    chunks = max(triton.cdiv(max_seqlen, CHUNK), 1)
    div_kind, div_value, items = divisor
    coef = torch.empty(logps.shape[0], dtype=torch.float32, device=dev)
    part = torch.empty(b * chunks * NUM_KERNEL_STATS, dtype=torch.float64, device=dev)
    loss = torch.empty((), dtype=torch.float32, device=dev)
    metrics = torch.empty(6, dtype=torch.float32, device=dev)
    scale = torch.empty(b if div_kind == 0 else 1, dtype=torch.float32, device=dev)
    grpo_loss_fwd_kernel[(b * chunks,)](
        logps, logps if old is None else old, logps if ref is None else ref, logps if sampler is None else sampler,
        adv, logps if mask is None else mask, logps if padded else cu_seqlens, logps, logps, logps, coef, part, chunks,
        scalars.eps_low, scalars.eps_high, scalars.delta, scalars.beta, int(scalars.bias_kl), scalars.sampler_cap,
        int(scalars.sampler_mode in (0, 2)), 0, scalars.tau_pos, scalars.tau_neg,
        max_seqlen if padded else 0, _counter(dev), loss, metrics, scale, logps if items is None else items, b,
        div_kind, div_value,
        LOSS=scalars.loss_family, SEQ_LEVEL=False, HAS_OLD=old is not None, HAS_KL=ref is not None,
        HAS_SAMPLER=sampler is not None, HAS_MASK=mask is not None, ADV_PER_TOKEN=adv_per_token, PADDED=padded,
        FINISH=True, BLOCK=BLOCK, CHUNK=CHUNK, num_warps=NUM_WARPS,
    )  # fmt: skip
    return loss, metrics, coef, scale


def token_loss_bwd(g, coef, scale, cu_seqlens, max_seqlen, num_seqs, out_dtype):
    """d loss / d logps [T] in out_dtype = g scale[s] coef_t (g: the upstream 0-d gradient, read on the device)."""
    grad = torch.empty(coef.shape[0], dtype=out_dtype, device=coef.device)
    chunks = max(triton.cdiv(max_seqlen, CHUNK), 1)
    padded = cu_seqlens is None
    grpo_loss_bwd_kernel[(num_seqs * chunks,)](
        scale, scale, coef, coef, coef if padded else cu_seqlens, grad, chunks, int(scale.shape[0] > 1), g,
        max_seqlen if padded else 0,
        SEQ_LEVEL=False, HAS_MASK=False, HAS_G=True, PADDED=padded, BLOCK=BLOCK, CHUNK=CHUNK, num_warps=NUM_WARPS,
    )  # fmt: skip
    return grad


class FusedTokenLoss(torch.autograd.Function):
    """`FusedTokenLoss.apply(logps, rest)` -> (loss, metrics [6]); `rest` is token_loss's other arguments (old, ref,
    sampler, adv, adv_per_token, mask, cu_seqlens, b, max_seqlen, scalars, divisor) as a tuple (one autograd
    input besides logps keeps the per-call Python cost low). logps: contiguous, any shape; its gradient has its
    shape and dtype."""

    @staticmethod
    def forward(ctx, logps, rest):
        cu_seqlens, b, max_seqlen = rest[6:9]
        loss, metrics, coef, scale = token_loss(logps.view(-1), *rest)
        ctx.save_for_backward(coef, scale, cu_seqlens)
        ctx.meta = (max_seqlen, b, logps.dtype, logps.shape)
        ctx.mark_non_differentiable(metrics)
        ctx.set_materialize_grads(False)
        return loss, metrics

    @staticmethod
    def backward(ctx, grad_loss, _grad_metrics):
        if grad_loss is None:
            return None, None
        coef, scale, cu_seqlens = ctx.saved_tensors
        max_seqlen, num_seqs, dtype, shape = ctx.meta
        grad = token_loss_bwd(grad_loss, coef, scale, cu_seqlens, max_seqlen, num_seqs, dtype)
        return grad.view(shape), None

"""Selective log-probs (log-softmax + gather) and entropy: Triton kernels, launchers, registration, autograd.

Design. One program per token row (the token dimension on grid axis 0: any T up to 2^31 - 1). The forward
reads the row once in BLOCK_V chunks with an online log-sum-exp kept per lane, in the units of the raw logits x
(as the C++ backend): a running max m of x, s = sum exp(d) and, for the entropy, u = sum exp(d) d, with
d = (x - m) / T; the lanes are combined at the end into (M, S, U). Then
    logp = (x_id - M) / T - log S,   entropy = log S - U / S,   lse = M / T + log S.
x_id - M is exact near the top of the row, so huge logits or a tiny T lose no bits to x / T (the z - lse form
did: |x| / T * 2^-24), and the entropy is a difference of two non-negative terms, never of two large ones.
d is clamped below at -120 (exp = 0 in fp32): a -inf logit, or a difference past fp32's range (rows of
+-3e38), adds exactly 0 to S and U (no 0 * -inf). It writes the log-prob of the chosen id (NaN for an id
outside [0, V), which is never read), the entropy and the row's lse for the backward, so no [T, V] buffer is
stored. The backward reads the row once more and writes (it compares the id with the columns, never indexes
with it: a bad id just gets no one-hot term)
    dlogits = (g (onehot - p) - gH p (log p + H)) / T,   log p = (x - c) / T + k,
with c = 0, k = -lse while |lse| < 32 (the fp32 lse is good to ~1e-6 there) and, past it, the row's (M, S)
computed again (one more read): c = M, k = -log S. Everything is accumulated in fp32; T is a runtime argument.
"""

import torch
import triton
import triton.language as tl

from .. import _C
from ._triton import require_triton_device

MAX_BLOCK_V = 4096
MIN_ARG = tl.constexpr(-120.0)  # exp(-120) is 0 in fp32
EXACT_LSE = tl.constexpr(32.0)  # from |lse| = 32 up (fp32 spacing >= 2^-18) the backward recomputes (M, S)


# ----------------------------------------------------------------------------------------------- kernels
@triton.jit
def _row_stats(base, V, inv_temperature, RETURN_ENTROPY: tl.constexpr, BLOCK_V: tl.constexpr):
    """One pass over a row: (M, S, U) with M the max of the raw logits x, d = (x - M) / T clamped below at
    MIN_ARG, S = sum exp(d) and U = sum exp(d) d (only with RETURN_ENTROPY). Per lane first, then combined."""
    cols = tl.arange(0, BLOCK_V)
    m = tl.full((BLOCK_V,), -3.4028234663852886e38, dtype=tl.float32)  # -FLT_MAX: m - m is never -inf - -inf
    s = tl.zeros((BLOCK_V,), dtype=tl.float32)
    u = tl.zeros((BLOCK_V,), dtype=tl.float32)
    for v0 in range(0, V, BLOCK_V):
        x = tl.load(base + v0 + cols, mask=v0 + cols < V, other=float("-inf")).to(tl.float32)
        m_new = tl.maximum(m, x)
        # where(d < MIN_ARG) keeps a NaN (a NaN logit makes the row's sums NaN, as it should); x = -inf or a
        # difference past fp32's range lands on MIN_ARG, whose exp is 0 and whose term in U is 0 * MIN_ARG = 0.
        shift = (m - m_new) * inv_temperature
        shift = tl.where(shift < MIN_ARG, MIN_ARG, shift)
        w = tl.exp(shift)
        d = (x - m_new) * inv_temperature
        d = tl.where(d < MIN_ARG, MIN_ARG, d)
        e = tl.exp(d)
        if RETURN_ENTROPY:
            u = w * (u + shift * s) + e * d
        s = s * w + e
        m = m_new
    big_m = tl.max(m, axis=0)
    shift = (m - big_m) * inv_temperature
    shift = tl.where(shift < MIN_ARG, MIN_ARG, shift)
    w = tl.exp(shift)
    total = tl.sum(s * w, axis=0)
    if RETURN_ENTROPY:
        us = tl.sum(w * (u + shift * s), axis=0)
    else:
        us = total * 0.0
    return big_m, total, us


@triton.jit
def _logprobs_fwd_kernel(
    logits_ptr, stride_t, ids_ptr, logps_ptr, entropy_ptr, lse_ptr, V, inv_temperature,
    RETURN_ENTROPY: tl.constexpr, BLOCK_V: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    base = logits_ptr + row * stride_t
    big_m, total, us = _row_stats(base, V, inv_temperature, RETURN_ENTROPY, BLOCK_V)
    log_s = tl.log(total)
    # An id outside [0, V) (the wrapper rejects it, but its checks do not run under torch.compile) reads
    # nothing: the row's log-prob is NaN; its entropy and lse are still written.
    target = tl.load(ids_ptr + row)
    in_range = (target >= 0) & (target < V)
    x_id = tl.load(base + tl.where(in_range, target, 0), mask=in_range, other=float("nan")).to(tl.float32)
    tl.store(logps_ptr + row, (x_id - big_m) * inv_temperature - log_s)  # x_id - M: exact near the top
    tl.store(lse_ptr + row, big_m * inv_temperature + log_s)
    if RETURN_ENTROPY:
        tl.store(entropy_ptr + row, log_s - us / total)  # two non-negative terms: no cancellation of large z


@triton.jit
def _logprobs_bwd_kernel(
    grad_ptr, grad_entropy_ptr, logits_ptr, stride_t, ids_ptr, lse_ptr, entropy_ptr, dlogits_ptr, stride_dt,
    V, inv_temperature, HAS_GRAD_ENTROPY: tl.constexpr, BLOCK_V: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    base = logits_ptr + row * stride_t
    out = dlogits_ptr + row * stride_dt
    g = tl.load(grad_ptr + row)
    lse = tl.load(lse_ptr + row)
    target = tl.load(ids_ptr + row)
    if HAS_GRAD_ENTROPY:
        g_h = tl.load(grad_entropy_ptr + row)
        h = tl.load(entropy_ptr + row)
    # log p = (x - c) / T + k. Below |lse| = EXACT_LSE the fp32 lse is good to ~1e-6: c = 0, k = -lse. From
    # there up every p of the row would inherit the lse's rounding, so the row's (M, S) are computed again
    # (one more read of the row): c = M, k = -log S, as exact as the forward.
    c = lse * 0.0
    k = -lse
    if tl.abs(lse) >= EXACT_LSE:
        big_m, total, _ = _row_stats(base, V, inv_temperature, False, BLOCK_V)
        c = big_m
        k = -tl.log(total)
    cols = tl.arange(0, BLOCK_V)
    for v0 in range(0, V, BLOCK_V):
        valid = v0 + cols < V
        x = tl.load(base + v0 + cols, mask=valid, other=0.0)
        log_p = (x.to(tl.float32) - c) * inv_temperature + k
        log_p = tl.where(log_p < MIN_ARG, MIN_ARG, log_p)  # p = 0 and p log p = 0, also for -inf logits
        p = tl.exp(log_p)
        d = g * (tl.where(v0 + cols == target, 1.0, 0.0) - p)
        if HAS_GRAD_ENTROPY:
            d -= g_h * p * (log_p + h)
        tl.store(out + v0 + cols, (d * inv_temperature).to(x.dtype), mask=valid)


# --------------------------------------------------------------------------------------------- launchers
def _block_v(v: int) -> int:
    return min(triton.next_power_of_2(v), MAX_BLOCK_V)


def _num_warps(block_v: int) -> int:
    return 8 if block_v >= 2048 else 4


def logprobs_fwd_triton(logits, ids, temperature: float, return_entropy: bool):
    """logits [T, V] (last dim contiguous), ids [T] int64 -> (logps [T] f32, entropy [T] or [0] f32, lse [T] f32)."""
    require_triton_device(_logprobs_fwd_kernel, logits)
    t, v = logits.shape
    logps = torch.empty(t, dtype=torch.float32, device=logits.device)
    lse = torch.empty(t, dtype=torch.float32, device=logits.device)
    entropy = torch.empty(t if return_entropy else 0, dtype=torch.float32, device=logits.device)
    if t:
        block = _block_v(v)
        _logprobs_fwd_kernel[(t,)](
            logits, logits.stride(0), ids, logps, entropy if return_entropy else lse, lse, v, 1.0 / temperature,
            RETURN_ENTROPY=return_entropy, BLOCK_V=block, num_warps=_num_warps(block),
        )  # fmt: skip
    return logps, entropy, lse


def logprobs_bwd_triton(grad_logps, grad_entropy, logits, ids, lse, entropy, temperature: float, inplace: bool):
    """dlogits [T, V] in logits' dtype (written into logits when inplace)."""
    require_triton_device(_logprobs_fwd_kernel, logits)
    t, v = logits.shape
    out = logits if inplace else torch.empty_like(logits, memory_format=torch.contiguous_format)
    has_h = grad_entropy is not None
    if t:
        block = _block_v(v)
        _logprobs_bwd_kernel[(t,)](
            grad_logps, grad_entropy if has_h else grad_logps, logits, logits.stride(0), ids, lse,
            entropy if has_h else lse, out, out.stride(0), v, 1.0 / temperature,
            HAS_GRAD_ENTROPY=has_h, BLOCK_V=block, num_warps=_num_warps(block),
        )  # fmt: skip
    return out


# ----------------------------------------------------------------------------------------- registration
@torch.library.custom_op("grpo_kernels::selective_logprobs", mutates_args=(), device_types="cuda")
def selective_logprobs_op(
    logits: torch.Tensor, ids: torch.Tensor, temperature: float, return_entropy: bool, inplace_backward: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """inplace_backward only matters to autograd: the backward then writes d logits into `logits`."""
    return logprobs_fwd_triton(logits, ids, temperature, return_entropy)


@selective_logprobs_op.register_kernel("cpu")
def _selective_logprobs_cpu(logits, ids, temperature, return_entropy, inplace_backward):
    return _C.selective_logprobs(logits, ids, temperature, return_entropy)


@selective_logprobs_op.register_fake
def _selective_logprobs_fake(logits, ids, temperature, return_entropy, inplace_backward):
    t = logits.shape[0]
    f32 = dict(dtype=torch.float32)
    return logits.new_empty(t, **f32), logits.new_empty(t if return_entropy else 0, **f32), logits.new_empty(t, **f32)


@torch.library.custom_op("grpo_kernels::selective_logprobs_backward", mutates_args=(), device_types="cuda")
def selective_logprobs_backward_op(
    grad_logps: torch.Tensor,
    grad_entropy: torch.Tensor | None,
    logits: torch.Tensor,
    ids: torch.Tensor,
    lse: torch.Tensor,
    entropy: torch.Tensor | None,
    temperature: float,
) -> torch.Tensor:
    return logprobs_bwd_triton(grad_logps, grad_entropy, logits, ids, lse, entropy, temperature, False)


@selective_logprobs_backward_op.register_kernel("cpu")
def _selective_logprobs_backward_cpu(grad_logps, grad_entropy, logits, ids, lse, entropy, temperature):
    return _C.selective_logprobs_backward(grad_logps, grad_entropy, logits, ids, lse, entropy, temperature, False)


@selective_logprobs_backward_op.register_fake
def _selective_logprobs_backward_fake(grad_logps, grad_entropy, logits, ids, lse, entropy, temperature):
    return torch.empty_like(logits, memory_format=torch.contiguous_format)


@torch.library.custom_op("grpo_kernels::selective_logprobs_backward_", mutates_args=("logits",), device_types="cuda")
def selective_logprobs_backward_inplace_op(
    grad_logps: torch.Tensor,
    grad_entropy: torch.Tensor | None,
    logits: torch.Tensor,
    ids: torch.Tensor,
    lse: torch.Tensor,
    entropy: torch.Tensor | None,
    temperature: float,
) -> None:
    """The backward written over the logits themselves (the caller gives up the logits)."""
    logprobs_bwd_triton(grad_logps, grad_entropy, logits, ids, lse, entropy, temperature, True)


@selective_logprobs_backward_inplace_op.register_kernel("cpu")
def _selective_logprobs_backward_inplace_cpu(grad_logps, grad_entropy, logits, ids, lse, entropy, temperature):
    _C.selective_logprobs_backward(grad_logps, grad_entropy, logits, ids, lse, entropy, temperature, True)


@selective_logprobs_backward_inplace_op.register_fake
def _selective_logprobs_backward_inplace_fake(grad_logps, grad_entropy, logits, ids, lse, entropy, temperature):
    return None


# ------------------------------------------------------------------------------------------------ autograd
def _setup_context(ctx, inputs, output):
    logits, ids, temperature, return_entropy, inplace_backward = inputs
    _, entropy, lse = output
    ctx.save_for_backward(logits, ids, lse, entropy if return_entropy else None)
    ctx.temperature, ctx.inplace = temperature, inplace_backward
    ctx.mark_non_differentiable(lse)


def _grads(ctx, g_logps, g_entropy):
    logits, ids, lse, entropy = ctx.saved_tensors
    g_logps = torch.zeros_like(lse) if g_logps is None else g_logps.float().contiguous()
    if entropy is None or g_entropy is None:
        g_entropy, entropy = None, None
    else:
        g_entropy = g_entropy.float().contiguous()
    return logits, ids, lse, entropy, g_logps, g_entropy


def _backward(ctx, g_logps, g_entropy, _g_lse):
    logits, ids, lse, entropy, g_logps, g_entropy = _grads(ctx, g_logps, g_entropy)
    args = (g_logps, g_entropy, logits, ids, lse, entropy, ctx.temperature)
    if ctx.inplace:
        torch.ops.grpo_kernels.selective_logprobs_backward_(*args)
        return logits, None, None, None, None
    return torch.ops.grpo_kernels.selective_logprobs_backward(*args), None, None, None, None


selective_logprobs_op.register_autograd(_backward, setup_context=_setup_context)


class TritonDirect(torch.autograd.Function):
    """The Triton launchers called outside the dispatcher (CPU tensors under TRITON_INTERPRET=1), same maths."""

    @staticmethod
    def forward(logits, ids, temperature, return_entropy, inplace_backward):
        return logprobs_fwd_triton(logits, ids, temperature, return_entropy)

    setup_context = staticmethod(_setup_context)

    @staticmethod
    def backward(ctx, g_logps, g_entropy, g_lse):
        logits, ids, lse, entropy, g_logps, g_entropy = _grads(ctx, g_logps, g_entropy)
        dlogits = logprobs_bwd_triton(g_logps, g_entropy, logits, ids, lse, entropy, ctx.temperature, ctx.inplace)
        return dlogits, None, None, None, None


# ------------------------------------------------------------------------------------------- the one entry
def selective_logprobs(logits, ids, temperature: float, return_entropy: bool, inplace_backward: bool, impl: str):
    """What the public function runs on flat, checked inputs: (logps, entropy, lse), differentiable w.r.t. logits.

    The registered op (its Triton kernel on CUDA, C++ on CPU, and what torch.compile traces), or the Triton
    launchers directly for impl="triton" on CPU tensors (the interpreter)."""
    if impl == "triton" and logits.device.type == "cpu":
        return TritonDirect.apply(logits, ids, temperature, return_entropy, inplace_backward)
    return torch.ops.grpo_kernels.selective_logprobs(logits, ids, temperature, return_entropy, inplace_backward)


def row_logprobs(backend: str, logits, ids, temperature: float, return_entropy: bool):
    """The forward row kernel of one backend ("triton" or "cpp") without autograd, for the fused LM head:
    (logps, entropy, lse) fp32 [T]."""
    if backend == "triton":
        return logprobs_fwd_triton(logits, ids, temperature, return_entropy)
    return _C.selective_logprobs(logits, ids, temperature, return_entropy)


def row_dlogits_(backend: str, grad_logps, logits, ids, lse, temperature: float, grad_entropy=None,
                 entropy=None) -> None:
    """Overwrite logits with d sum(grad_logps logps + grad_entropy entropy) / d logits (the fused LM head's in-place
    backward; grad_entropy and the forward's entropy go together, or are both None)."""
    if (grad_entropy is None) != (entropy is None):
        raise ValueError("row_dlogits_: grad_entropy and entropy go together")
    if backend == "triton":
        logprobs_bwd_triton(grad_logps, grad_entropy, logits, ids, lse, entropy, temperature, True)
    else:
        _C.selective_logprobs_backward(grad_logps, grad_entropy, logits, ids, lse, entropy, temperature, True)

"""Selective log-probs (log-softmax + gather) and entropy: Triton kernels, launchers, registration, autograd.

Design. One program per token row (the token dimension on grid axis 0: any T up to 2^31 - 1). The forward
reads the row once in BLOCK_V chunks with an online log-sum-exp kept per lane (running max m, sum of
exp(z - m), and for the entropy the sum of exp(z - m) (z - m)), combined across lanes at the end; it writes
the log-prob of the chosen id (NaN for an id outside [0, V), which is never read), the entropy, and the
row's log-sum-exp for the backward, so no [T, V] buffer is stored. The backward reads the row once more and
writes (it compares the id with the columns, never indexes with it: a bad id just gets no one-hot term)
    dlogits = (g (onehot - p) - gH p (log p + H)) / temperature,   p = exp(z - lse), z = logits / temperature.
Entropy uses the shifted sum (z - m), so a peaked row with large logits keeps its small entropy accurate.
A -inf logit (a masked vocabulary) adds exactly 0 to the entropy and gets exactly 0 gradient (no 0 * -inf).
Everything is accumulated in fp32; the temperature is a runtime argument.
"""

import torch
import triton
import triton.language as tl

from .. import _C
from ._triton import require_triton_device

MAX_BLOCK_V = 4096


# ----------------------------------------------------------------------------------------------- kernels
@triton.jit
def _logprobs_fwd_kernel(
    logits_ptr, stride_t, ids_ptr, logps_ptr, entropy_ptr, lse_ptr, V, inv_temperature,
    RETURN_ENTROPY: tl.constexpr, BLOCK_V: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    base = logits_ptr + row * stride_t
    cols = tl.arange(0, BLOCK_V)
    m = tl.full((BLOCK_V,), float("-inf"), dtype=tl.float32)
    s = tl.zeros((BLOCK_V,), dtype=tl.float32)
    sz = tl.zeros((BLOCK_V,), dtype=tl.float32)  # sum of exp(z - m) (z - m), per lane
    for v0 in range(0, V, BLOCK_V):
        valid = v0 + cols < V
        z = tl.load(base + v0 + cols, mask=valid, other=float("-inf")).to(tl.float32) * inv_temperature
        m_new = tl.maximum(m, z)
        # Lanes that have seen no value yet keep m = -inf; the finite stand-ins below keep -inf - -inf (NaN)
        # out of every expression, selected or not.
        # A NaN logit counts as seen (tl.maximum drops NaN): its exp is NaN, and so become the row's sums and lse.
        seen = (m_new > float("-inf")) | (z != z)
        m_ref = tl.where(seen, m_new, 0.0)
        z_fin = tl.where(valid, z, m_ref)
        scale = tl.exp(m - m_ref)
        e = tl.where(valid & seen, tl.exp(z_fin - m_ref), 0.0)
        if RETURN_ENTROPY:
            shift = tl.where(m > float("-inf"), m, m_ref) - m_ref
            # A -inf logit has e = 0 and z - m = -inf: its term is exactly 0, not 0 * -inf = NaN.
            sz = scale * (sz + s * shift) + tl.where(z_fin != float("-inf"), e * (z_fin - m_ref), 0.0)
        s = s * scale + e
        m = m_new
    big_m = tl.max(m, axis=0)
    w = tl.where(m > float("-inf"), tl.exp(m - big_m), 0.0)
    total = tl.sum(s * w, axis=0)
    lse = big_m + tl.log(total)
    # An id outside [0, V) (the wrapper rejects it, but its checks do not run under torch.compile) reads
    # nothing: the row's log-prob is NaN; its entropy and lse are still written.
    target = tl.load(ids_ptr + row)
    in_range = (target >= 0) & (target < V)
    z_id = tl.load(base + tl.where(in_range, target, 0), mask=in_range, other=float("nan"))
    z_id = z_id.to(tl.float32) * inv_temperature
    tl.store(logps_ptr + row, z_id - lse)
    tl.store(lse_ptr + row, lse)
    if RETURN_ENTROPY:
        # sum_v p (z - M) with every lane moved to the row max M; H = log(total) - that.
        shifted = tl.sum(w * (sz + s * (tl.where(m > float("-inf"), m, big_m) - big_m)), axis=0) / total
        tl.store(entropy_ptr + row, tl.log(total) - shifted)


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
    cols = tl.arange(0, BLOCK_V)
    for v0 in range(0, V, BLOCK_V):
        valid = v0 + cols < V
        x = tl.load(base + v0 + cols, mask=valid, other=0.0)
        log_p = x.to(tl.float32) * inv_temperature - lse
        p = tl.exp(log_p)
        d = g * (tl.where(v0 + cols == target, 1.0, 0.0) - p)
        if HAS_GRAD_ENTROPY:
            # p (log p + H) is 0, not 0 * -inf = NaN, for a -inf logit.
            d -= tl.where(log_p != float("-inf"), g_h * p * (log_p + h), 0.0)
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

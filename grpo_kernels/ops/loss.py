"""The GRPO policy loss (ratio / clip / KL / sampler correction): Triton kernels, launchers, registration, autograd.

Design. Every input is a flat token vector [T] (padded [B, L] is flattened; its row starts are s * L) and the
sequence s owns tokens cu_seqlens[s] .. cu_seqlens[s+1]. A program handles CHUNK tokens of one sequence
(grid axis 0 = num_seqs * num_chunks, so any T up to 2^31 - 1) and writes per-(sequence, chunk) partial sums,
which are added in a fixed order afterwards: the forward is deterministic, with no atomics.

    forward  (1) only for GSPO, a sequence-level sampler correction or vespo: per-sequence sums of m (logp - old),
                 m and m (old - sampler), turned into the sequence's log-ratio and sampler weight, and for vespo
                 sum m clamp(logp - old, +-20) (+ the sampler weights' clamped logs), turned (in fp64, on [B]) into
                 VESPO's two gamma weights phi_s (for A >= 0 and A < 0), a detached per-sequence scale;
             (2) per token: the loss term l_t and the token's own derivative, stored as one fp32 coefficient
                 coef_t = m_t dl_t/dlogp_t (token level) or m_t (the direct part) (sequence level), plus the
                 partial sums of m l, m, m dl/dw (GSPO), and the metric numerators (vespo: m phi in the clip_low
                 column; no clip flags).
    backward d loss / d logp_t = a_s coef_t + b_s m_t, one elementwise pass: a_s = d loss / d (sum_t m l) of the
             sequence (the normalizer, from autograd on the [B] sums) and, for GSPO, b_s = a_s w_s S_s / n_s
             with S_s = sum_t m dl/dw_s.

The op returns stats [B, NUM_STATS] fp64 (per sequence: the columns named in STATS) and coef [T]; `finish` turns stats
into the loss with TRL's normalizer (luspo: the family-0 kernel, its own normalizer) and into the metrics.
`grpo_loss_fwd` (the op's inputs, the scalars as options.KernelScalars) is the one way in, for the public function,
the fused LM head and torch.compile. Hyperparameters (epsilons, delta, beta, the sampler cap, the SAPO temperatures,
VESPO's k and lambda) are runtime arguments; the constexprs are the loss family and which inputs exist. Per token
everything is computed in fp32; the value sums (loss, dl/dw, ratio, KL, sampler diff) are accumulated in fp64 and the
stats are fp64, so a finite mean of finite terms stays finite (a sequence of ratios near e^88 sums past FLT_MAX);
`finish` returns fp32.

Non-finite values (the behaviour grpo_kernels.grpo_loss documents). A NaN in logp, old, the advantage or (KL on)
ref of a token with m != 0 makes its loss term and its coef NaN (min / clamp propagate NaN, as torch's do; at
sequence level the whole sequence's); a token with m == 0 adds exactly nothing, whatever its inputs. vespo follows
TRL's nan_to_num of phi: a NaN in a sequence's ratio zeroes its phi, so its policy gradient is 0 (-phi A), while a
NaN logp still makes its loss term NaN. A ratio
beyond fp32 (w = inf for log w > 88.72) never meets an exact zero as inf * 0 = NaN: a clipped branch, a zero
advantage, derivative or sampler weight gives 0 as in exact arithmetic (a clipped token's gradient is 0); only a
value that itself exceeds fp32 (the unclipped -w A with A < 0 and no delta) is inf. The KL term takes
beta exp(ref - logp) (times w with the bias correction) as one exp, finite wherever that product is.
"""

import math
from typing import NamedTuple

import torch
import triton

from .. import _C
from ..options import LOSS_FAMILIES, SAMPLER_MODES, KernelScalars, LossOptions
from ._triton import require_triton_device
from .loss_kernels import NUM_SEQ_SUMS, grpo_loss_bwd_kernel, grpo_loss_fwd_kernel, grpo_seq_stats_kernel

__all__ = ["LOSS_FAMILIES", "NUM_STATS", "SAMPLER_MODES", "STATS", "finish", "flat_input", "grpo_loss_fwd"]

# Columns of the per-sequence stats. The kernel writes the first NUM_KERNEL_STATS; the launcher appends the
# sequence's log importance weight (GSPO; 0 at token level) and vespo's phi of the sequence's advantage (0 otherwise).
STATS = ("loss", "count", "dl_dw", "clip_low", "clip_high", "clip_region", "ratio", "kl", "sampler_abs_diff",
         "log_w", "phi")  # fmt: skip
NUM_KERNEL_STATS = 9
NUM_STATS = len(STATS)
BLOCK = 1024
CHUNK = 4 * BLOCK
NUM_WARPS = 8


# --------------------------------------------------------------------------------------------- launchers
def _num_chunks(max_seqlen: int) -> int:
    return max(triton.cdiv(max_seqlen, CHUNK), 1)


def _sampler_weights(partial_is: torch.Tensor, cap: float, truncate: bool) -> torch.Tensor:
    r = torch.exp(partial_is)
    return r.clamp(max=cap) if truncate else r.masked_fill(r > cap, 0.0)


def vespo_weights(log_sum: torch.Tensor, k_pos: float, lam_pos: float, k_neg: float, lam_neg: float) -> torch.Tensor:
    """[B] sums S_s (clamped log-ratios, + the sampler weights' logs) -> [B, 2] fp32 gamma weights phi_s for A >= 0
    and A < 0: exp(lam + k log v - lam v), log v = clamp(S, log 1e-8, 20), NaN / inf -> 0 (lam as floored by the
    options). Computed in fp64."""
    log_v = log_sum.double().clamp(math.log(1e-8), 20.0)[:, None]
    k = log_v.new_tensor([k_pos, k_neg])
    lam = log_v.new_tensor([lam_pos, lam_neg])
    phi = torch.exp(lam + k * log_v - lam * log_v.exp())
    return phi.nan_to_num(nan=0.0, posinf=0.0, neginf=0.0).float().contiguous()


def per_sequence_phi(phi: torch.Tensor, adv: torch.Tensor, adv_per_token: bool) -> torch.Tensor:
    """The stats column "phi": each sequence's phi for its advantage's sign (0 with per-token advantages)."""
    if adv_per_token:
        return torch.zeros_like(phi[:, 0])
    return torch.where(adv >= 0, phi[:, 0], phi[:, 1])


def grpo_loss_fwd_triton(
    logps, old, ref, sampler, adv, adv_per_token, mask, cu_seqlens, max_seqlen, loss_family, seq_level, sampler_mode,
    eps_low, eps_high, delta, beta, bias_kl, sampler_cap, tau_pos, tau_neg, vespo_k_pos, vespo_lambda_pos, vespo_k_neg,
    vespo_lambda_neg,
):  # fmt: skip
    """Flat [T] inputs -> (stats [B, NUM_STATS] f64, coef [T] f32). See the module docstring."""
    require_triton_device(grpo_loss_fwd_kernel, logps)
    dev, f32 = logps.device, torch.float32
    b, t = cu_seqlens.shape[0] - 1, logps.shape[0]
    chunks = _num_chunks(max_seqlen)
    grid = (b * chunks,)
    dummy = logps
    flags = dict(HAS_OLD=old is not None, HAS_SAMPLER=sampler is not None, HAS_MASK=mask is not None)
    seq_logw = torch.zeros(b, dtype=f32, device=dev)
    seq_is = torch.ones(b, dtype=f32, device=dev)
    seq_sampler = sampler is not None and sampler_mode >= 2
    vespo = loss_family == 3
    seq_phi = seq_is  # (unread unless vespo)
    if seq_level or seq_sampler or vespo:
        part = torch.empty(b, chunks, NUM_SEQ_SUMS, dtype=f32, device=dev)
        if b:
            grpo_seq_stats_kernel[grid](
                logps, dummy if old is None else old, dummy if sampler is None else sampler,
                dummy if mask is None else mask, cu_seqlens, part, chunks, sampler_cap, int(sampler_mode in (0, 2)),
                **flags, VESPO=vespo, BLOCK=BLOCK, CHUNK=CHUNK, num_warps=NUM_WARPS,
            )  # fmt: skip
        sums = part.sum(1)
        if seq_level:
            seq_logw = sums[:, 0] / sums[:, 1].clamp(min=1.0)
        if seq_sampler:
            seq_is = _sampler_weights(sums[:, 2], sampler_cap, sampler_mode == 2)
        if vespo:
            seq_phi = vespo_weights(sums[:, 3] + sums[:, 4], vespo_k_pos, vespo_lambda_pos, vespo_k_neg,
                                    vespo_lambda_neg)  # fmt: skip
    coef = torch.empty(t, dtype=f32, device=dev)
    part = torch.empty(b, chunks, NUM_KERNEL_STATS, dtype=torch.float64, device=dev)
    if b:
        grpo_loss_fwd_kernel[grid](
            logps, dummy if old is None else old, dummy if ref is None else ref, dummy if sampler is None else sampler,
            adv, dummy if mask is None else mask, cu_seqlens, seq_logw, seq_is, seq_phi, coef, part, chunks,
            eps_low, eps_high, delta, beta, int(bias_kl), sampler_cap, int(sampler_mode in (0, 2)),
            int(seq_sampler), tau_pos, tau_neg, 0, *(dummy,) * 5, b, 0, 0.0,
            LOSS=loss_family, SEQ_LEVEL=seq_level, HAS_KL=ref is not None, ADV_PER_TOKEN=adv_per_token,
            **flags, PADDED=False, FINISH=False, BLOCK=BLOCK, CHUNK=CHUNK, num_warps=NUM_WARPS,
        )  # fmt: skip
    phi_col = per_sequence_phi(seq_phi, adv, adv_per_token) if vespo else torch.zeros_like(seq_logw)
    return torch.cat([part.sum(1), seq_logw[:, None].double(), phi_col[:, None].double()], dim=1), coef


def grpo_loss_bwd_triton(a, b_coef, coef, mask, cu_seqlens, max_seqlen, seq_level, out_dtype):
    """d loss / d logps [T] in out_dtype from the per-sequence a_s, b_s (see the module docstring)."""
    require_triton_device(grpo_loss_bwd_kernel, coef)
    b = cu_seqlens.shape[0] - 1
    grad = torch.empty(coef.shape[0], dtype=out_dtype, device=coef.device)
    chunks = _num_chunks(max_seqlen)
    if b:
        grpo_loss_bwd_kernel[(b * chunks,)](
            a, b_coef, coef, coef if mask is None else mask, cu_seqlens, grad, chunks, 1, a, 0,
            SEQ_LEVEL=seq_level, HAS_MASK=mask is not None, HAS_G=False, PADDED=False, BLOCK=BLOCK, CHUNK=CHUNK,
            num_warps=NUM_WARPS,
        )  # fmt: skip
    return grad


# ----------------------------------------------------------------------------------------- registration
@torch.library.custom_op("grpo_kernels::grpo_loss_fwd", mutates_args=(), device_types="cuda")
def grpo_loss_fwd_op(
    logps: torch.Tensor,
    old_logps: torch.Tensor | None,
    ref_logps: torch.Tensor | None,
    sampler_logps: torch.Tensor | None,
    advantages: torch.Tensor,
    adv_per_token: bool,
    mask: torch.Tensor | None,
    cu_seqlens: torch.Tensor,
    max_seqlen: int,
    loss_family: int,
    seq_level: bool,
    sampler_mode: int,
    eps_low: float,
    eps_high: float,
    delta: float,
    beta: float,
    bias_kl: bool,
    sampler_cap: float,
    tau_pos: float,
    tau_neg: float,
    vespo_k_pos: float,
    vespo_lambda_pos: float,
    vespo_k_neg: float,
    vespo_lambda_neg: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Flat inputs (logps [T] f32/bf16/f16; the others f32 contiguous; advantages [B], or [T] with adv_per_token;
    cu_seqlens int64 [B + 1]) -> (stats [B, NUM_STATS] fp64, coef [T] fp32). `delta` is +inf for no two-sided clamp;
    `sampler_mode` indexes SAMPLER_MODES (ignored without sampler_logps); `ref_logps` is given exactly when the KL
    term is on; the VESPO lambdas are floored (at 1e-4) already."""
    return grpo_loss_fwd_triton(
        logps, old_logps, ref_logps, sampler_logps, advantages, adv_per_token, mask, cu_seqlens, max_seqlen,
        loss_family, seq_level, sampler_mode, eps_low, eps_high, delta, beta, bias_kl, sampler_cap, tau_pos, tau_neg,
        vespo_k_pos, vespo_lambda_pos, vespo_k_neg, vespo_lambda_neg,
    )  # fmt: skip


@grpo_loss_fwd_op.register_kernel("cpu")
def _grpo_loss_fwd_cpu(
    logps, old_logps, ref_logps, sampler_logps, advantages, adv_per_token, mask, cu_seqlens, max_seqlen, loss_family,
    seq_level, sampler_mode, eps_low, eps_high, delta, beta, bias_kl, sampler_cap, tau_pos, tau_neg, vespo_k_pos,
    vespo_lambda_pos, vespo_k_neg, vespo_lambda_neg,
):  # fmt: skip
    del max_seqlen  # it only sizes the Triton grid
    return _C.grpo_loss_fwd(
        logps, old_logps, ref_logps, sampler_logps, advantages, adv_per_token, mask, cu_seqlens, loss_family,
        seq_level, sampler_mode, eps_low, eps_high, delta, beta, bias_kl, sampler_cap, tau_pos, tau_neg, vespo_k_pos,
        vespo_lambda_pos, vespo_k_neg, vespo_lambda_neg,
    )  # fmt: skip


@grpo_loss_fwd_op.register_fake
def _grpo_loss_fwd_fake(logps, old_logps, ref_logps, sampler_logps, advantages, adv_per_token, mask, cu_seqlens, *_):
    b = cu_seqlens.shape[0] - 1
    return logps.new_empty(b, NUM_STATS, dtype=torch.float64), logps.new_empty(logps.shape[0], dtype=torch.float32)


@torch.library.custom_op("grpo_kernels::grpo_loss_bwd", mutates_args=(), device_types="cuda")
def grpo_loss_bwd_op(
    a: torch.Tensor,
    b: torch.Tensor,
    coef: torch.Tensor,
    mask: torch.Tensor | None,
    cu_seqlens: torch.Tensor,
    max_seqlen: int,
    seq_level: bool,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """grad [T] (out_dtype) = a[seq] coef + (seq_level: b[seq] mask)."""
    return grpo_loss_bwd_triton(a, b, coef, mask, cu_seqlens, max_seqlen, seq_level, out_dtype)


@grpo_loss_bwd_op.register_kernel("cpu")
def _grpo_loss_bwd_cpu(a, b, coef, mask, cu_seqlens, max_seqlen, seq_level, out_dtype):
    return _C.grpo_loss_bwd(a, b, coef, mask, cu_seqlens, seq_level).to(out_dtype)


@grpo_loss_bwd_op.register_fake
def _grpo_loss_bwd_fake(a, b, coef, mask, cu_seqlens, max_seqlen, seq_level, out_dtype):
    return torch.empty_like(coef, dtype=out_dtype)


# ------------------------------------------------------------------------------------------------ autograd
# The op's inputs by name, in schema order: the tensors and their layout, then the KernelScalars.
_OpInputs = NamedTuple("_OpInputs", [(name, object) for name in (
    "logps", "old_logps", "ref_logps", "sampler_logps", "advantages", "adv_per_token", "mask", "cu_seqlens",
    "max_seqlen", *KernelScalars._fields)])  # fmt: skip


def _setup_context(ctx, inputs, output):
    x = _OpInputs(*inputs)
    stats, coef = output
    ctx.save_for_backward(stats, coef, x.mask, x.cu_seqlens)
    ctx.max_seqlen, ctx.seq_level, ctx.dtype = x.max_seqlen, x.seq_level, x.logps.dtype
    ctx.mark_non_differentiable(coef)
    ctx.set_materialize_grads(False)


def _per_sequence_factors(ctx, grad_stats):
    """a_s = d loss / d (sum_t m l)_s, and b_s = a_s w_s S_s / n_s for GSPO (zeros at token level)."""
    stats, coef, mask, cu_seqlens = ctx.saved_tensors
    a = grad_stats[:, 0].float().contiguous()
    if ctx.seq_level:
        col = {name: stats[:, i] for i, name in enumerate(STATS)}
        w_s = torch.exp(col["log_w"])  # S_s = 0 gives b_s = 0 also for w_s = inf (see _times_w)
        w_dl_dw = torch.where(col["dl_dw"] == 0, 0.0, w_s * col["dl_dw"])  # fp64: w_s S_s may pass FLT_MAX
        b = (a * w_dl_dw / col["count"].clamp(min=1.0)).float().contiguous()
    else:
        b = a
    return a, b, coef, mask, cu_seqlens


def _backward(ctx, grad_stats, _grad_coef):
    a, b, coef, mask, cu_seqlens = _per_sequence_factors(ctx, grad_stats)
    grad = torch.ops.grpo_kernels.grpo_loss_bwd(a, b, coef, mask, cu_seqlens, ctx.max_seqlen, ctx.seq_level, ctx.dtype)
    return (grad,) + (None,) * (len(_OpInputs._fields) - 1)


grpo_loss_fwd_op.register_autograd(_backward, setup_context=_setup_context)


class Direct(torch.autograd.Function):
    """The same kernels called without the dispatcher, for eager calls: `Direct.apply(backend, *op_inputs)` with
    backend "triton" (CUDA, or CPU tensors under TRITON_INTERPRET=1) or "cpp". A custom op's Python dispatch and
    autograd wrapper cost ~0.2 ms per forward + backward, more than the whole C++ kernel at 128k tokens; under
    torch.compile `grpo_loss_fwd` calls the registered op instead."""

    @staticmethod
    def forward(ctx, backend, *inputs):  # (not the setup_context style: its per-call signature binding costs more)
        output = grpo_loss_fwd_triton(*inputs) if backend == "triton" else _grpo_loss_fwd_cpu(*inputs)
        _setup_context(ctx, inputs, output)
        ctx.backend = backend
        return output

    @staticmethod
    def backward(ctx, grad_stats, _grad_coef):
        a, b, coef, mask, cu_seqlens = _per_sequence_factors(ctx, grad_stats)
        if ctx.backend == "triton":
            grad = grpo_loss_bwd_triton(a, b, coef, mask, cu_seqlens, ctx.max_seqlen, ctx.seq_level, ctx.dtype)
        else:
            grad = _C.grpo_loss_bwd(a, b, coef, mask, cu_seqlens, ctx.seq_level).to(ctx.dtype)
        return (None, grad) + (None,) * (len(_OpInputs._fields) - 1)


# ------------------------------------------------------------------------------------------------ dispatch
def flat_input(x: torch.Tensor | None) -> torch.Tensor | None:
    """An optional input (old/ref/sampler log-probs, advantages, mask) as the op takes it: flat fp32 contiguous."""
    return None if x is None else x.detach().reshape(-1).to(torch.float32).contiguous()


def grpo_loss_fwd(backend, logps, old_logps, ref_logps, sampler_logps, advantages, adv_per_token, mask, cu_seqlens,
                  max_seqlen, scalars: KernelScalars):  # fmt: skip
    """The loss op on flat inputs (see grpo_loss_fwd_op) -> (stats [B, NUM_STATS], coef [T]), differentiable w.r.t.
    logps: the registered op under torch.compile, else `Direct` on `backend` ("triton" or "cpp")."""
    if torch.compiler.is_compiling():
        return torch.ops.grpo_kernels.grpo_loss_fwd(
            logps, old_logps, ref_logps, sampler_logps, advantages, adv_per_token, mask, cu_seqlens, max_seqlen,
            **scalars._asdict(),
        )  # fmt: skip
    return Direct.apply(backend, logps, old_logps, ref_logps, sampler_logps, advantages, adv_per_token, mask,
                        cu_seqlens, max_seqlen, *scalars)  # fmt: skip


def finish(stats, advantages_per_seq, options: LossOptions, *, sampler: bool, cu_seqlens, num_items_in_batch):
    """stats [B, NUM_STATS] fp64 -> (loss with TRL's normalizer, metrics dict of fp32 0-d tensors). Few, small ops.

    advantages_per_seq: the advantages [B] when given per sequence (None when per token); sampler: sampler_logps
    were given. dr_grpo's constant without max_completion_length is the longest sequence, taken from cu_seqlens on
    the device (L for padded input): never the caller's max_seqlen, which only bounds the lengths."""
    loss_type = options.loss_type
    b = stats.shape[0]
    plain = stats.detach()
    totals = plain.sum(0)
    tokens = totals[1].clamp(min=1.0)
    loss_sums = stats[:, 0]
    if loss_type in ("grpo", "sapo"):
        loss = (loss_sums / plain[:, 1].clamp(min=1.0)).sum() / b
    elif loss_type == "luspo":
        loss = loss_sums.sum() / b
    elif loss_type == "bnpo":
        loss = loss_sums.sum() / tokens
    elif loss_type == "dr_grpo":
        longest = options.max_completion_length or cu_seqlens.diff().max().to(totals)
        loss = loss_sums.sum() / (b * longest)
    elif num_items_in_batch is None:
        loss = loss_sums.sum() / tokens
    else:
        loss = loss_sums.sum() / torch.as_tensor(num_items_in_batch).to(totals).clamp(min=1.0)
    low, high, region, ratio, kl, sampler_diff = (totals[3:9] / tokens).unbind()
    if loss_type == "vespo" and advantages_per_seq is not None:  # TRL: phi is [B, 1], its mean is over sequences
        low = plain[:, STATS.index("phi")].mean()
    if options.seq_level:  # the ratio is one value per sequence (TRL: a [B, 1] tensor), so are the clip flags if A is
        w = plain[:, STATS.index("log_w")].exp()
        ratio = w.mean()
        if advantages_per_seq is not None and loss_type != "vespo":
            a = advantages_per_seq.detach().float()
            eps_low, eps_high, delta = options.epsilon_low, options.epsilon_high, options.delta
            if loss_type == "cispo":
                low = ((w > eps_high) & (a > 0)).float().mean()
            else:
                w_m = w if delta is None or loss_type == "sapo" else w.clamp(max=delta)
                flags = torch.stack([(w_m < 1 - eps_low) & (a < 0), (w_m > 1 + eps_high) & (a > 0)])
                low, high, region = torch.cat([flags, flags.any(0, keepdim=True)]).float().mean(1).unbind()
    values = [low, ratio] if loss_type in ("cispo", "vespo") else [low, high, region, ratio]
    values += [kl] * (options.beta != 0.0) + [sampler_diff] * sampler
    return loss.float(), {k: v.float() for k, v in zip(options.metric_names(sampler=sampler), values, strict=True)}

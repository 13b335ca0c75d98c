"""Public API: the GRPO policy loss with TRL's math and normalizers, from log-probs or fused with log-softmax."""

import inspect
import math

import torch

from . import reference
from ._checks import check_cu_seqlens, check_impl
from .logprobs import selective_logprobs
from .ops import loss as _ops

__all__ = ["GRPOLoss", "LOSS_TYPES", "SAMPLER_IS_MODES", "grpo_loss", "grpo_loss_from_logits"]

LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo")
SAMPLER_IS_MODES = tuple(_ops.SAMPLER_MODES)
_FLOATS = (torch.float16, torch.bfloat16, torch.float32)


def _number(name, value, *, low=None, high=None, low_open=False, allow_none=False):
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value!r}")
    if low is not None and (value <= low if low_open else value < low):
        raise ValueError(f"{name} must be {'>' if low_open else '>='} {low}, got {value!r}")
    if high is not None and value >= high:
        raise ValueError(f"{name} must be < {high}, got {value!r}")
    return float(value)


def _options(loss_type, epsilon_low, epsilon_high, delta, beta, importance_sampling_level, max_completion_length,
             num_items_in_batch, sampler_logps, sampler_is_mode, sampler_is_cap, use_bias_correction_kl,
             sapo_temperature_pos, sapo_temperature_neg, ref_logps):  # fmt: skip
    if loss_type not in LOSS_TYPES:
        raise ValueError(f"loss_type must be one of {', '.join(map(repr, LOSS_TYPES))}, got {loss_type!r}")
    if importance_sampling_level not in ("token", "sequence"):
        raise ValueError(f"importance_sampling_level must be 'token' or 'sequence', got {importance_sampling_level!r}")
    _number("epsilon_low", epsilon_low, low=0.0, high=1.0)
    _number("epsilon_high", epsilon_high, low=0.0)
    _number("delta", delta, low=0.0, low_open=True, allow_none=True)
    _number("beta", beta, low=0.0)
    _number("sampler_is_cap", sampler_is_cap, low=0.0, low_open=True)
    _number("sapo_temperature_pos", sapo_temperature_pos, low=0.0, low_open=True)
    _number("sapo_temperature_neg", sapo_temperature_neg, low=0.0, low_open=True)
    if not isinstance(use_bias_correction_kl, bool):
        raise ValueError(f"use_bias_correction_kl must be a bool, got {use_bias_correction_kl!r}")
    if max_completion_length is not None and (
        isinstance(max_completion_length, bool)
        or not isinstance(max_completion_length, int)
        or max_completion_length < 1
    ):
        raise ValueError(f"max_completion_length must be a positive int, got {max_completion_length!r}")
    if isinstance(num_items_in_batch, torch.Tensor):
        if num_items_in_batch.numel() != 1:
            raise ValueError(f"num_items_in_batch must be a scalar, got shape {tuple(num_items_in_batch.shape)}")
        if num_items_in_batch.device.type == "meta":
            raise ValueError("num_items_in_batch is a meta tensor: it has no value")
        if not torch.compiler.is_compiling():  # one scalar host read (TRL's value lives on the device)
            _number("num_items_in_batch", num_items_in_batch.item(), low=0.0, low_open=True)
    else:
        _number("num_items_in_batch", num_items_in_batch, low=0.0, low_open=True, allow_none=True)
    if (sampler_logps is None) != (sampler_is_mode is None):
        raise ValueError("sampler_logps and sampler_is_mode go together: give both or neither")
    if sampler_is_mode is not None and sampler_is_mode not in SAMPLER_IS_MODES:
        raise ValueError(
            f"sampler_is_mode must be one of {', '.join(map(repr, SAMPLER_IS_MODES))}, got {sampler_is_mode!r}"
        )
    if beta != 0.0 and ref_logps is None:
        raise ValueError("beta > 0 needs ref_logps (the reference model's per-token log-probs)")


def _check_tensor(name, x, logps, *, float_only=True):
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"{name} must be a tensor, got {type(x).__name__}")
    if x.shape != logps.shape:
        raise ValueError(f"{name} must have the shape of logps {tuple(logps.shape)}, got {tuple(x.shape)}")
    if x.device != logps.device:
        raise ValueError(f"{name} is on {x.device} but logps are on {logps.device}")
    if float_only and not x.is_floating_point():
        raise ValueError(f"{name} must be a floating-point tensor, got {x.dtype}")
    if float_only and x.requires_grad:
        raise ValueError(f"{name} requires grad, but grpo_loss differentiates w.r.t. logps only: detach it")


def _layout(logps, advantages, mask, cu_seqlens, max_seqlen):
    """-> (num_seqs, cu_seqlens int64 on the device, max_seqlen, advantages per token?)."""
    if not isinstance(logps, torch.Tensor) or logps.dtype not in _FLOATS:
        got = logps.dtype if isinstance(logps, torch.Tensor) else type(logps).__name__
        raise ValueError(f"logps must be a float32/bfloat16/float16 tensor, got {got}")
    if cu_seqlens is None:
        if logps.dim() != 2:
            raise ValueError(
                f"logps must be padded [B, L] (with mask) or packed [T] with cu_seqlens, got {tuple(logps.shape)}"
            )
        b, length = logps.shape
        cu = torch.arange(b + 1, device=logps.device, dtype=torch.int64) * length
        max_len = length
    else:
        if logps.dim() != 1:
            raise ValueError(f"cu_seqlens goes with packed logps [T], got logps of shape {tuple(logps.shape)}")
        max_len = check_cu_seqlens(cu_seqlens, logps.shape[0], logps.device, max_seqlen=max_seqlen)
        b, cu = cu_seqlens.shape[0] - 1, cu_seqlens.to(torch.int64).contiguous()
    if b == 0:
        raise ValueError("empty batch: logps hold no sequence")
    if not isinstance(advantages, torch.Tensor) or not advantages.is_floating_point():
        raise ValueError("advantages must be a floating-point tensor")
    if advantages.device != logps.device:
        raise ValueError(f"advantages are on {advantages.device} but logps are on {logps.device}")
    if advantages.requires_grad:
        raise ValueError("advantages require grad, but grpo_loss differentiates w.r.t. logps only: detach them")
    if advantages.shape == logps.shape:
        per_token = True
    elif advantages.shape == (b,):
        per_token = False
    else:
        raise ValueError(
            f"advantages must be per sequence [{b}] or per token {tuple(logps.shape)}, got {tuple(advantages.shape)}"
        )
    if mask is not None:
        _check_tensor("mask", mask, logps, float_only=False)
        if mask.dtype.is_complex:
            raise ValueError("mask must be bool, integer or floating point")
    return b, cu, max_len, per_token


def _flat(x):
    return None if x is None else x.detach().reshape(-1).to(torch.float32).contiguous()


def _finish(stats, advantages_per_seq, *, loss_type, seq_level, epsilon_low, epsilon_high, delta, beta, sampler,
            max_completion_length, cu_seqlens, num_items_in_batch):  # fmt: skip
    """stats [B, NUM_STATS] -> (loss with TRL's normalizer, metrics dict of 0-d tensors). Few, small ops.

    dr_grpo's constant without max_completion_length is the longest sequence, taken from cu_seqlens on the device
    (L for padded input): never the caller's max_seqlen, which only bounds the lengths."""
    b = stats.shape[0]
    plain = stats.detach()
    totals = plain.sum(0)
    tokens = totals[1].clamp(min=1.0)
    loss_sums = stats[:, 0]
    if loss_type in ("grpo", "sapo"):
        loss = (loss_sums / plain[:, 1].clamp(min=1.0)).sum() / b
    elif loss_type == "bnpo":
        loss = loss_sums.sum() / tokens
    elif loss_type == "dr_grpo":
        longest = max_completion_length or cu_seqlens.diff().max().to(totals)
        loss = loss_sums.sum() / (b * longest)
    elif num_items_in_batch is None:
        loss = loss_sums.sum() / tokens
    else:
        loss = loss_sums.sum() / torch.as_tensor(num_items_in_batch).to(totals).clamp(min=1.0)
    low, high, region, ratio, kl, sampler_diff = (totals[3:9] / tokens).unbind()
    if seq_level:  # the ratio is one value per sequence (TRL: a [B, 1] tensor), so are the clip flags if A is
        w = plain[:, _ops.STATS.index("log_w")].exp()
        ratio = w.mean()
        if advantages_per_seq is not None:
            a = advantages_per_seq.detach().float()
            if loss_type == "cispo":
                low = ((w > epsilon_high) & (a > 0)).float().mean()
            else:
                w_m = w if delta is None or loss_type == "sapo" else w.clamp(max=delta)
                flags = torch.stack([(w_m < 1 - epsilon_low) & (a < 0), (w_m > 1 + epsilon_high) & (a > 0)])
                low, high, region = torch.cat([flags, flags.any(0, keepdim=True)]).float().mean(1).unbind()
    if loss_type == "cispo":
        metrics = {"cispo_clip_ratio": low, "ratio_mean": ratio}
    else:
        metrics = {"clip_ratio/low_mean": low, "clip_ratio/high_mean": high, "clip_ratio/region_mean": region,
                   "ratio_mean": ratio}  # fmt: skip
    if beta != 0.0:
        metrics["kl"] = kl
    if sampler:
        metrics["sampler_logp_abs_diff"] = sampler_diff
    return loss, metrics


def grpo_loss(
    logps: torch.Tensor,
    old_logps: torch.Tensor | None,
    advantages: torch.Tensor,
    *,
    ref_logps: torch.Tensor | None = None,
    mask: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | None = None,
    max_seqlen: int | None = None,
    loss_type: str = "dapo",
    epsilon_low: float = 0.2,
    epsilon_high: float = 0.2,
    delta: float | None = None,
    beta: float = 0.0,
    importance_sampling_level: str = "token",
    max_completion_length: int | None = None,
    num_items_in_batch: float | torch.Tensor | None = None,
    sampler_logps: torch.Tensor | None = None,
    sampler_is_mode: str | None = None,
    sampler_is_cap: float = 3.0,
    use_bias_correction_kl: bool = False,
    sapo_temperature_pos: float = 1.0,
    sapo_temperature_neg: float = 1.05,
    impl: str = "auto",
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The GRPO policy loss of one micro-batch, exactly as TRL's GRPOTrainer computes it (before its
    gradient-accumulation scaling), differentiable w.r.t. `logps`.

    Per token (per sequence for importance_sampling_level="sequence", GSPO, where log w is the masked mean of
    logp - old over the sequence):
        w = exp(logp - old)
        grpo/bnpo/dr_grpo/dapo: l = -min(min(w, delta) A, clip(w, 1 - epsilon_low, 1 + epsilon_high) A)
        cispo: l = -stopgrad(min(w, epsilon_high)) A logp;  sapo: l = -(4 / tau) sigmoid(tau (w - 1)) A
        sampler correction: l *= r, r = exp(old - sampler) per token or exp(sum over the sequence), truncated
            at sampler_is_cap ("*_truncate") or zeroed above it ("*_mask")
        KL (beta > 0): l += beta k3, k3 = exp(ref - logp) - (ref - logp) - 1 (times w with use_bias_correction_kl)
    Aggregation (mask m): grpo/sapo: mean over sequences of sum_t m l / sum_t m; bnpo: sum m l / sum m;
    dr_grpo: sum m l / (B max_completion_length); dapo/cispo: sum m l / num_items_in_batch (default sum m).

    Non-finite values, the same on every backend (reference, C++, Triton) and loss type:
        - a token with m = 0 takes no part: NaN / inf in any of its inputs reaches neither the loss nor a gradient;
        - a NaN in logps, old_logps, advantages or (beta > 0) ref_logps of a token with m != 0 propagates: the loss
          is NaN (never inf or a finite number), that token's gradient is NaN (at sequence level, where the
          sequence's ratio is NaN, every token's of the sequence), the other sequences' gradients are unaffected;
          sampler_logps go through nan_to_num, as in TRL;
        - w is computed in fp32 (the reference: in the input's dtype): for log w > 88.72 it is inf. The C++ and
          Triton backends never turn that into NaN: where it meets an exact zero (a clipped branch, A = 0, a zero
          derivative or sampler weight) the result is 0, as in exact arithmetic, so a clipped token has a zero
          gradient and a finite loss term; only a value that itself exceeds fp32 (the unclipped -w A of a token
          with A < 0 and no delta) is inf, and so is that token's gradient. The KL term takes beta exp(ref - logp)
          (times w with use_bias_correction_kl) as one exp: finite wherever that product fits fp32, e.g. for a
          token the policy has all but ruled out. (The eager reference follows TRL's arithmetic: exact in fp64,
          where w = exp(100) is finite, but in fp32 it has these infs and NaNs.)

    Args:
        logps: the policy's per-token log-probs, padded `[B, L]` (with `mask`) or packed `[T]` (with
            `cu_seqlens`), float32/bfloat16/float16. The gradient flows to them only.
        old_logps: log-probs of the policy that sampled (same shape), or None for on-policy (w = 1, the
            gradient still flows, as TRL does with `per_token_logps.detach()`).
        advantages: per sequence `[B]` or per token (the shape of logps; read per token when both fit).
        ref_logps: the reference model's log-probs; required when beta > 0.
        mask: 0/1 (or weights) of the shape of logps; None = every token counts.
        cu_seqlens: `[B + 1]` int32/int64 boundaries of packed sequences. max_seqlen: a bound on their lengths
            (>= the longest; computed from cu_seqlens when not given) that sizes the kernels' grids only: it never
            changes the result.
        max_completion_length: dr_grpo's constant (TRL: the generation budget). Default: L for padded input, the
            longest packed sequence (from cu_seqlens, whatever max_seqlen says) for packed input.
        num_items_in_batch: what dapo/cispo divide the masked sum by (TRL passes the generation batch's token
            count rescaled to one accumulation window); default: this micro-batch's token count.
        sampler_logps, sampler_is_mode, sampler_is_cap: the truncated importance-sampling correction for the
            trainer/sampler mismatch (modes "token_truncate", "token_mask", "sequence_truncate", "sequence_mask").
        impl: "auto" (C++ on CPU, Triton on CUDA), "cpp", "triton" or "reference"; never falls back.

    Returns:
        (loss, metrics): a 0-d float32 loss and 0-d tensors (no host sync) named as TRL logs them:
        "clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean" (or "cispo_clip_ratio"),
        "ratio_mean", "kl" (beta > 0), "sampler_logp_abs_diff" (mean |logp - sampler_logp|, with sampler_logps).
    """
    _options(loss_type, epsilon_low, epsilon_high, delta, beta, importance_sampling_level, max_completion_length,
             num_items_in_batch, sampler_logps, sampler_is_mode, sampler_is_cap, use_bias_correction_kl,
             sapo_temperature_pos, sapo_temperature_neg, ref_logps)  # fmt: skip
    b, cu, max_len, adv_per_token = _layout(logps, advantages, mask, cu_seqlens, max_seqlen)
    use_ref = beta != 0.0
    for name, x in (("old_logps", old_logps), ("ref_logps", ref_logps), ("sampler_logps", sampler_logps)):
        if x is not None:
            _check_tensor(name, x, logps)
    check_impl(impl, logps.device, "logps")
    if impl == "reference":
        return reference.grpo_loss(
            logps, old_logps, advantages, ref_logps=ref_logps, mask=mask, cu_seqlens=cu_seqlens, loss_type=loss_type,
            epsilon_low=epsilon_low, epsilon_high=epsilon_high, delta=delta, beta=beta,
            importance_sampling_level=importance_sampling_level, max_completion_length=max_completion_length,
            num_items_in_batch=num_items_in_batch, sampler_logps=sampler_logps, sampler_is_mode=sampler_is_mode,
            sampler_is_cap=sampler_is_cap, use_bias_correction_kl=use_bias_correction_kl,
            sapo_temperature_pos=sapo_temperature_pos, sapo_temperature_neg=sapo_temperature_neg,
        )  # fmt: skip
    seq_level = importance_sampling_level == "sequence"
    args = (
        logps.reshape(-1) if logps.is_contiguous() else logps.contiguous().reshape(-1),
        _flat(old_logps), _flat(ref_logps if use_ref else None), _flat(sampler_logps), _flat(advantages),
        adv_per_token, _flat(mask), cu, max_len, _ops.LOSS_FAMILIES[loss_type], seq_level,
        _ops.SAMPLER_MODES.get(sampler_is_mode, 0), float(epsilon_low), float(epsilon_high),
        math.inf if delta is None else float(delta), float(beta), use_bias_correction_kl, float(sampler_is_cap),
        float(sapo_temperature_pos), float(sapo_temperature_neg),
    )  # fmt: skip
    if torch.compiler.is_compiling():
        stats, _ = torch.ops.grpo_kernels.grpo_loss_fwd(*args)
    else:  # the same kernels without the custom op's dispatch overhead (see ops.loss.Direct)
        stats, _ = _ops.Direct.apply("triton" if impl == "triton" or logps.is_cuda else "cpp", *args)
    return _finish(
        stats, None if adv_per_token else advantages, loss_type=loss_type, seq_level=seq_level,
        epsilon_low=epsilon_low, epsilon_high=epsilon_high, delta=delta, beta=beta, sampler=sampler_logps is not None,
        max_completion_length=max_completion_length, cu_seqlens=cu, num_items_in_batch=num_items_in_batch,
    )  # fmt: skip


def grpo_loss_from_logits(
    logits: torch.Tensor,
    ids: torch.Tensor,
    old_logps: torch.Tensor | None,
    advantages: torch.Tensor,
    *,
    temperature: float = 1.0,
    inplace_backward: bool = False,
    impl: str = "auto",
    **options,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """`selective_logprobs` then `grpo_loss`: logits `[B, L, V]` or packed `[T, V]` straight to the loss.

    The logits are read once in the forward (an online log-sum-exp; only per-token values are kept) and read
    once and written once in the backward (d logits; over the logits' own buffer with inplace_backward=True,
    when nothing else needs them). No [T, V] intermediate exists. `options` are grpo_loss's keyword
    arguments (mask, cu_seqlens, loss_type, ...); the metrics also hold "entropy" (masked token mean).
    """
    mask = options.get("mask")
    logps, entropy = selective_logprobs(
        logits, ids, temperature=temperature, return_entropy=True, cu_seqlens=options.get("cu_seqlens"),
        inplace_backward=inplace_backward, impl=impl,
    )  # fmt: skip
    loss, metrics = grpo_loss(logps, old_logps, advantages, impl=impl, **options)
    with torch.no_grad():
        m = torch.ones_like(entropy) if mask is None else mask.to(entropy.dtype)
        metrics["entropy"] = (entropy * m).sum() / m.sum().clamp(min=1.0)
    return loss, metrics


class GRPOLoss(torch.nn.Module):
    """`grpo_loss` as a module holding its options: `GRPOLoss(loss_type="grpo", beta=0.04)(logps, old, adv, ...)`.

    Keyword arguments given at call time override the constructor's (e.g. num_items_in_batch per step). Names
    are checked here; values are checked at each call, with the tensors they go with.
    """

    def __init__(self, **options):
        super().__init__()
        unknown = sorted(set(options) - _OPTION_NAMES)
        if unknown:
            raise TypeError(f"GRPOLoss got unknown option(s) {unknown}; grpo_loss takes {sorted(_OPTION_NAMES)}")
        self.options = options

    def forward(self, logps, old_logps, advantages, **kwargs):
        return grpo_loss(logps, old_logps, advantages, **{**self.options, **kwargs})

    def extra_repr(self) -> str:
        return ", ".join(f"{k}={v!r}" for k, v in self.options.items())


_OPTION_NAMES = frozenset(inspect.signature(grpo_loss).parameters) - {"logps", "old_logps", "advantages"}

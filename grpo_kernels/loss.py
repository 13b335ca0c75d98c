"""Public API: the GRPO policy loss with TRL's math and normalizers, from log-probs or fused with log-softmax.

Non-finite values, the same on every backend (reference, C++, Triton) and loss type:
    - a token with m = 0 takes no part: NaN / inf in any of its inputs reaches neither the loss nor a gradient;
    - a NaN in logps, old_logps, advantages or (beta > 0) ref_logps of a token with m != 0 propagates: the loss
      is NaN (never inf or a finite number), that token's gradient is NaN (at sequence level, where the
      sequence's ratio is NaN, every token's of the sequence), the other sequences' gradients are unaffected;
    - a NaN mask entry (NaN != 0: its token takes part) makes that token's term m l NaN, and the normalizers that
      sum the mask: the loss is NaN, and so is every gradient such a normalizer scales (every token's for bnpo,
      vespo and dapo / cispo without num_items_in_batch, the sequence's for grpo / sapo, else that token's own).
      The C++ and Triton backends take a token's gradient as the product (d loss / d sum m l) m dl/dlogp, so there
      a masked or clipped token's is NaN too, where the reference's autograd gives 0 through the mask or the clip;
      and a NaN loss term (also one of inf * 0 or inf - inf, e.g. cispo's stop-gradient ratio 0 times logp = -inf)
      has a NaN gradient there. An infinite mask entry is a weight like the others (inf / inf = NaN where it meets
      its normalizer); the clip fractions and sampler_logp_abs_diff add m over the flagged (non-NaN) tokens only;
    - sampler_logps go through nan_to_num, as in TRL (in fp32: inf -> FLT_MAX); vespo's phi too (TRL's
      nan_to_num): a NaN in a sequence's ratio sets its phi to 0, so the policy gradient of that sequence is 0
      (its loss is NaN only through a NaN term, e.g. a NaN logp);
    - w is computed in fp32 (the reference: in the input's dtype): for log w > 88.72 it is inf. The C++ and
      Triton backends never turn that into NaN: where it meets an exact zero (a clipped branch, A = 0, a zero
      derivative or sampler weight) the result is 0, as in exact arithmetic, so a clipped token has a zero
      gradient and a finite loss term; only a value that itself exceeds fp32 (the unclipped -w A of a token
      with A < 0 and no delta) is inf, and so is that token's gradient. The KL term takes beta exp(ref - logp)
      (times w with use_bias_correction_kl) as one exp: finite wherever that product fits fp32, e.g. for a
      token the policy has all but ruled out. (The eager reference follows TRL's arithmetic: exact in fp64,
      where w = exp(100) is finite, but in fp32 it has these infs and NaNs.)
"""

import inspect

import torch

from . import reference
from ._checks import check_impl, check_impl_device, check_like, check_loss_inputs, check_loss_layout, padded_cu_seqlens
from .logprobs import selective_logprobs
from .ops import loss as _ops
from .ops import loss_fused as _fused_ops
from .options import LOSS_TYPES, SAMPLER_IS_MODES, loss_options

__all__ = ["GRPOLoss", "LOSS_TYPES", "SAMPLER_IS_MODES", "grpo_loss", "grpo_loss_from_logits"]


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
    vespo_k_pos: float = 2.0,
    vespo_lambda_pos: float = 3.0,
    vespo_k_neg: float = 3.0,
    vespo_lambda_neg: float = 2.0,
    impl: str = "auto",
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The GRPO policy loss of one micro-batch, exactly as TRL's GRPOTrainer computes it (before its
    gradient-accumulation scaling), differentiable w.r.t. `logps`.

    Per token (per sequence for importance_sampling_level="sequence", GSPO, where log w is the masked mean of
    logp - old over the sequence):
        w = exp(logp - old)
        grpo/bnpo/dr_grpo/dapo/luspo: l = -min(min(w, delta) A, clip(w, 1 - epsilon_low, 1 + epsilon_high) A)
        cispo: l = -stopgrad(min(w, epsilon_high)) A logp;  sapo: l = -(4 / tau) sigmoid(tau (w - 1)) A
        vespo: l = -stopgrad(phi) A logp, phi = exp(lam + k log v - lam v) (NaN / inf -> 0), k = vespo_k_pos and
            lam = max(vespo_lambda_pos, 1e-4) for A >= 0 (the _neg pair for A < 0), log v = clamp(S, log 1e-8, 20),
            S = sum_t m clamp(logp - old, -20, 20) over the sequence (+ sum of clamp(log r, log 1e-8, 20) of the
            token-level sampler weights r over its positions: "token_*" sampler modes only)
        sampler correction: l *= r (not vespo), r = exp(old - sampler) per token or exp(sum over the sequence),
            truncated at sampler_is_cap ("*_truncate") or zeroed above it ("*_mask")
        KL (beta > 0): l += beta k3, k3 = exp(ref - logp) - (ref - logp) - 1 (times w with use_bias_correction_kl)
    Aggregation (mask m): grpo/sapo: mean over sequences of sum_t m l / sum_t m; luspo: mean over sequences of
    sum_t m l; bnpo: sum m l / sum m; dr_grpo: sum m l / (B max_completion_length); dapo/cispo/vespo: sum m l /
    num_items_in_batch (default sum m).

    Non-finite values (NaN, inf, ratios past fp32): the rules every backend follows are in this module's docstring.

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
            count rescaled to one accumulation window); default: this micro-batch's token count. A number or a CPU
            tensor <= 0 is a ValueError; a CUDA tensor's value is never read on the host (that read would be the
            call's only host sync): there a value <= 0 makes the loss NaN.
        sampler_logps, sampler_is_mode, sampler_is_cap: the truncated importance-sampling correction for the
            trainer/sampler mismatch (modes "token_truncate", "token_mask", "sequence_truncate", "sequence_mask").
        impl: "auto" (C++ on CPU, Triton on CUDA), "cpp", "triton" or "reference"; never falls back. On Triton,
            outside torch.compile, the loss types whose terms need no whole-sequence statistic (all but GSPO's
            sequence level, the sequence-level sampler modes and vespo) take one kernel launch forward and one
            backward, with no host sync, and read old/ref/sampler log-probs, advantages and mask in their own dtypes.

    Returns:
        (loss, metrics): a 0-d float32 loss and 0-d tensors (no host sync) named as TRL logs them:
        "clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean" (or "cispo_clip_ratio"),
        "ratio_mean", "kl" (beta > 0), "sampler_logp_abs_diff" (mean |logp - sampler_logp|, with sampler_logps);
        vespo reports "vespo/phi_seq_mean" (mean of phi over sequences; over tokens with per-token advantages)
        instead of the clip ratios.
    """
    options = loss_options(
        loss_type=loss_type, epsilon_low=epsilon_low, epsilon_high=epsilon_high, delta=delta, beta=beta,
        importance_sampling_level=importance_sampling_level, max_completion_length=max_completion_length,
        sampler_is_mode=sampler_is_mode, sampler_is_cap=sampler_is_cap, use_bias_correction_kl=use_bias_correction_kl,
        sapo_temperature_pos=sapo_temperature_pos, sapo_temperature_neg=sapo_temperature_neg, vespo_k_pos=vespo_k_pos,
        vespo_lambda_pos=vespo_lambda_pos, vespo_k_neg=vespo_k_neg, vespo_lambda_neg=vespo_lambda_neg,
    )  # fmt: skip
    check_loss_inputs(options, num_items_in_batch=num_items_in_batch, ref_logps=ref_logps, sampler_logps=sampler_logps)
    check_impl(impl)
    b, cu, max_len, adv_per_token = check_loss_layout(logps, advantages, mask, cu_seqlens, max_seqlen, padded_cu=False)
    check_impl_device(impl, logps.device, "logps")
    for name, x in (("old_logps", old_logps), ("ref_logps", ref_logps), ("sampler_logps", sampler_logps)):
        if x is not None:
            check_like(name, x, logps)
    # The token-level loss types on the Triton backend, outside torch.compile: one launch each way (ops/loss_fused).
    fused = (impl == "triton" or (impl == "auto" and logps.is_cuda)) and not options.whole_sequence
    if fused and not torch.compiler.is_compiling():
        return _fused_loss(logps, old_logps, advantages, ref_logps if options.beta != 0.0 else None, sampler_logps,
                           mask, cu, b, max_len, adv_per_token, options, num_items_in_batch)  # fmt: skip
    if impl == "reference":
        return reference.grpo_loss(
            logps, old_logps, advantages, ref_logps=ref_logps, mask=mask, cu_seqlens=cu_seqlens,
            num_items_in_batch=num_items_in_batch, sampler_logps=sampler_logps, **options.kwargs(),
        )  # fmt: skip
    flat = _ops.flat_input
    cu = padded_cu_seqlens(b, max_len, logps.device) if cu is None else cu
    stats, _ = _ops.grpo_loss_fwd(
        "triton" if impl == "triton" or logps.is_cuda else "cpp",
        logps.reshape(-1) if logps.is_contiguous() else logps.contiguous().reshape(-1), flat(old_logps),
        flat(ref_logps if options.beta != 0.0 else None), flat(sampler_logps), flat(advantages), adv_per_token,
        flat(mask), cu, max_len, options.kernel_scalars(),
    )  # fmt: skip
    return _ops.finish(stats, None if adv_per_token else advantages, options, sampler=sampler_logps is not None,
                       cu_seqlens=cu, num_items_in_batch=num_items_in_batch)  # fmt: skip


def _fused_loss(logps, old, adv, ref, sampler, mask, cu, b, max_len, adv_per_token, options, num_items_in_batch):
    """grpo_loss through ops/loss_fused: inputs in their own dtypes, flat views (a copy only where not contiguous)."""
    if num_items_in_batch is not None and isinstance(num_items_in_batch, torch.Tensor):
        num_items_in_batch = num_items_in_batch.to(logps.device)  # (a no-op on the same device)
    rest = (*map(_fused_ops.flat, (old, ref, sampler, adv)), adv_per_token, _fused_ops.flat(mask), cu, b, max_len,
            options.kernel_scalars(), _fused_ops.divisor_of(options, b, num_items_in_batch))  # fmt: skip
    loss, metrics = _fused_ops.FusedTokenLoss.apply(logps if logps.is_contiguous() else logps.contiguous(), rest)
    values = metrics.unbind()
    picks = _fused_ops.metric_picks(options, sampler is not None)
    return loss, dict(zip(options.metric_names(sampler=sampler is not None), [values[i] for i in picks], strict=True))


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

"""Drop-in for Liger's `LigerFusedLinearGRPOLoss` on the fused LM head, and the adapters its options need: Liger's
luspo aggregation over padded positions, vllm_is_ratio as the sampler correction, and vespo's gamma weight with
importance ratios (`vespo_sampler_logps`, shared with the TRL integration)."""

import math
import warnings

import torch

from .fused_linear import fused_linear_grpo_loss, fused_linear_logprobs
from .loss import grpo_loss
from .options import LossOptions

__all__ = ["FusedLinearGRPOLoss", "vespo_sampler_logps"]

_FLT_MAX = float(torch.finfo(torch.float32).max)


def vespo_sampler_logps(old: torch.Tensor, mask: torch.Tensor | None, ratio: torch.Tensor) -> torch.Tensor:
    """Importance-sampling ratios [B, L] (or [B, 1]) as vespo's sampler log-probs: TRL's and Liger's phi adds each
    sequence's sum of clamp(log ratio, log 1e-8, 20) over all of the ratio's positions (padding included); the
    kernels add clamp(d_t, log 1e-8, 20) over the tokens, d_t = m_t (old_t - sampler_t) (token_truncate, cap float32
    max). The sum is spread evenly over the sequence's tokens: exact while its share per token stays in the clamp
    range. A sequence without tokens has no loss term: its sum is dropped."""
    m = torch.ones_like(old, dtype=torch.float32) if mask is None else mask.to(torch.float32)
    log_sum = torch.log(ratio.float()).clamp(math.log(1e-8), 20.0).sum(-1, keepdim=True)
    on = m != 0
    share = log_sum / on.sum(-1, keepdim=True).clamp(min=1)
    return old.float() - torch.where(on, share / torch.where(on, m, 1.0), 0.0)


class FusedLinearGRPOLoss(torch.nn.Module):
    """Drop-in for `liger_kernel.chunked_loss.LigerFusedLinearGRPOLoss`: the same constructor and forward argument
    names and the same return value, `(loss, [kl (beta != 0)], clip_ratio)` as `(loss, metrics_list)`.

    The metrics are Liger's: at sequence level each sequence's clip flag counts once per token (one more no-grad
    pass; `fused_linear_grpo_loss`, as TRL, averages over sequences). As in Liger, the kl slot is there whenever
    beta != 0 (0 with use_ref_model=False), and the reference log-probs come from `ref_per_token_logps`, else from
    `ref_input`/`ref_weight`/`ref_bias` (computed chunk by chunk, no [T, V] logits), which are ignored otherwise.
    `compiled` and `chunk_size` are accepted for compatibility (the chunk is sized by `chunk_tokens`); as in Liger,
    dapo/cispo divide `num_items_in_batch` by the world size.
    `vllm_is_ratio` multiplies the per-token loss before the KL term, as Liger's (run as the sampler correction).
    "vespo" (token level only, as in Liger) folds vllm_is_ratio into its gamma weight instead: the clamped logs of
    the ratios over all of a sequence's positions (padding included, as Liger sums them), spread over its tokens
    (exact while their mean per token stays within TRL's clamp [log 1e-8, 20]); its clip slot is 0, as Liger's.
    "luspo" follows Liger's aggregation, sum over s, t of per_token_loss * len_s / (B L'), where per_token_loss is
    [B, 1] (L' = 1: GSPO without a KL term or per-token ratios, then equal to TRL's) or else [B, L] with its padded
    positions included: then the loss is composed of grpo_loss calls on the differentiable fused log-probs (the
    padding carried by a weight mask len_s / L), except Liger's bias-corrected KL at sequence level with beta != 0
    (NotImplementedError). The loss options are held (and checked) as a `LossOptions`, `self.options`.
    """

    def __init__(self, beta=0.04, compiled=True, use_ref_model=True, chunk_size=1, epsilon_low=0.2, epsilon_high=0.2,
                 loss_type="dapo", max_completion_length=None, importance_sampling_level="token",
                 sapo_temperature_pos=1.0, sapo_temperature_neg=1.05, temperature=1.0, delta=None,
                 use_bias_correction_kl=False, chunk_tokens="auto", **vespo):  # fmt: skip
        super().__init__()
        self.kl_slot = beta != 0.0  # Liger returns [kl, clip] whenever beta != 0, [0, clip] without a reference
        self.use_ref_model = use_ref_model
        unknown = set(vespo) - {"vespo_k_pos", "vespo_lambda_pos", "vespo_k_neg", "vespo_lambda_neg"}
        if unknown:
            raise TypeError(f"FusedLinearGRPOLoss got unknown argument(s) {sorted(unknown)}")
        self.temperature, self.chunk_tokens = temperature, chunk_tokens
        self.options = LossOptions(
            loss_type=loss_type, epsilon_low=epsilon_low, epsilon_high=epsilon_high, delta=delta,
            beta=beta if use_ref_model else 0.0, importance_sampling_level=importance_sampling_level,
            max_completion_length=max_completion_length, sapo_temperature_pos=sapo_temperature_pos,
            sapo_temperature_neg=sapo_temperature_neg, use_bias_correction_kl=use_bias_correction_kl, **vespo,
        )  # fmt: skip

    def forward(self, _input, lin_weight, selected_token_ids, attention_mask, advantages, bias=None,
                ref_per_token_logps=None, old_per_token_logps=None, ref_input=None, ref_weight=None, ref_bias=None,
                vllm_is_ratio=None, num_items_in_batch=None):  # fmt: skip
        beta, loss_type = self.options.beta, self.options.loss_type
        if loss_type == "vespo" and self.options.seq_level:
            raise ValueError("loss_type='vespo' takes importance_sampling_level='token' only (its phi is already a "
                             "weight of the whole sequence); Liger refuses 'sequence' too")  # fmt: skip
        if self.use_ref_model and ref_per_token_logps is not None and ref_input is not None:  # as Liger, a warning
            warnings.warn("ref_per_token_logps and ref_input both given. Using ref_per_token_logps; ref_input is "
                          "ignored", UserWarning, stacklevel=2)  # fmt: skip
        if beta and ref_per_token_logps is None and ref_input is not None:  # else Liger ignores ref_input & co.
            if ref_weight is None:
                raise ValueError("ref_input needs ref_weight (the reference model's LM head)")
            with torch.no_grad():  # Liger's reference log-probs carry no gradient (even if ref_weight requires one)
                ref_per_token_logps = fused_linear_logprobs(
                    ref_input.reshape(*selected_token_ids.shape, ref_input.shape[-1]), ref_weight, selected_token_ids,
                    bias=ref_bias, temperature=self.temperature, chunk_tokens=self.chunk_tokens,
                )  # fmt: skip
        if num_items_in_batch is not None and torch.distributed.is_available() and torch.distributed.is_initialized():
            num_items_in_batch = num_items_in_batch / torch.distributed.get_world_size()
        if loss_type == "luspo" and (not self.options.seq_level or beta or vllm_is_ratio is not None):
            return self._liger_luspo(_input, lin_weight, bias, selected_token_ids, attention_mask, advantages,
                                     old_per_token_logps, ref_per_token_logps, vllm_is_ratio)  # fmt: skip
        options = self.options.kwargs()
        if vllm_is_ratio is not None:  # Liger: per-token loss x ratio, before the KL term (vespo: in its phi)
            old_per_token_logps, sampler = self._ratio_as_sampler_logps(vllm_is_ratio, old_per_token_logps, _input,
                                                                        lin_weight, bias, selected_token_ids,
                                                                        attention_mask)  # fmt: skip
            cap = _FLT_MAX if loss_type == "vespo" else 2.0 * float(vllm_is_ratio.max()) + 1.0
            options.update(sampler_logps=sampler, sampler_is_mode="token_truncate", sampler_is_cap=cap)
        loss, metrics = fused_linear_grpo_loss(
            _input, lin_weight, selected_token_ids, advantages, bias=bias, old_logps=old_per_token_logps,
            ref_logps=ref_per_token_logps if beta else None, mask=attention_mask, temperature=self.temperature,
            chunk_tokens=self.chunk_tokens, num_items_in_batch=num_items_in_batch, **options,
        )  # fmt: skip
        clip = metrics.get("clip_ratio/region_mean", metrics.get("cispo_clip_ratio", metrics["ratio_mean"]))
        if loss_type in ("sapo", "vespo"):  # Liger reports no clipping for SAPO's soft gate nor VESPO's weight
            clip = torch.zeros_like(clip)
        elif self.options.importance_sampling_level == "sequence":
            clip = self._sequence_clip_ratio(old_per_token_logps, _input, lin_weight, bias, selected_token_ids,
                                             attention_mask, advantages, clip)  # fmt: skip
        kl = metrics["kl"] if beta else torch.zeros((), dtype=clip.dtype, device=clip.device)
        return loss, ([kl] if self.kl_slot else []) + [clip]

    def _sequence_clip_ratio(self, old, hidden, weight, bias, ids, mask, advantages, like, logps=None):
        """Liger's sequence-level clip ratio: each sequence's clip flag counted once per token (the fused loss, as TRL,
        averages the flags over sequences). Its ratio needs the current log-probs: one more no-grad pass (none
        on-policy, where no sequence clips) unless they are given."""
        if old is None:
            return torch.zeros_like(like)
        if logps is None:
            logps = fused_linear_logprobs(hidden.detach(), weight.detach(), ids, temperature=self.temperature,
                                          bias=None if bias is None else bias.detach(), chunk_tokens=self.chunk_tokens)
        m = torch.ones_like(logps) if mask is None else mask.to(logps.dtype)
        coef = torch.exp(((logps - old.float()) * m).sum(-1) / m.sum(-1).clamp(min=1.0))
        o, a = self.options, advantages.to(logps.dtype)
        if o.loss_type == "cispo":
            clipped = (coef > o.epsilon_high) & (a > 0)
        else:
            clipped = ((coef < 1 - o.epsilon_low) & (a < 0)) | ((coef > 1 + o.epsilon_high) & (a > 0))
        return ((clipped.to(m.dtype)[:, None] * m).sum() / m.sum().clamp(min=1.0)).to(like.dtype)

    def _ratio_as_sampler_logps(self, ratio, old, hidden, weight, bias, ids, mask=None, *, as_given=False):
        """Liger's vllm_is_ratio ([B, L] or [B, 1] weights) as the sampler correction of the fused loss: sampler
        log-probs old - log(ratio) give the weight exp(old - sampler) = ratio (token_truncate, its cap above every
        ratio). Without old log-probs they are computed (one pass without grad), as Liger's old = logps.detach().
        vespo: each sequence's sum of clamp(log ratio, log 1e-8, 20) over the ratio's positions (Liger's), spread
        evenly over the sequence's tokens. as_given: (old, the checked ratio [B, L or 1]) instead."""
        ratio = torch.as_tensor(ratio)
        if ratio.dim() == 1:
            ratio = ratio[:, None]
        if ratio.dim() != 2 or ratio.shape[0] != ids.shape[0] or ratio.shape[1] not in (1, ids.shape[1]):
            raise ValueError(f"vllm_is_ratio must be [B, L] or [B, 1] for ids {tuple(ids.shape)}, got "
                             f"{tuple(ratio.shape)}")  # fmt: skip
        if not bool(torch.isfinite(ratio).all()) or bool((ratio < 0).any()):
            raise ValueError("vllm_is_ratio must be finite and >= 0")
        if old is None:
            old = fused_linear_logprobs(hidden.detach(), weight.detach(), ids, bias=None if bias is None else
                                        bias.detach(), temperature=self.temperature, chunk_tokens=self.chunk_tokens)
        ratio = ratio.to(device=old.device, dtype=torch.float32)
        if as_given:
            return old, ratio
        if self.options.loss_type == "vespo":
            return old, vespo_sampler_logps(old, mask, ratio)
        return old, old.float() - torch.log(ratio.clamp(min=1e-30).expand(ids.shape))

    def _liger_luspo(self, hidden, weight, bias, ids, mask, advantages, old, ref, ratio):
        """Liger's luspo where its per-token loss P is [B, L]: sum_{s, t} P_st len_s / (B L) over every position.
        On the differentiable fused log-probs (no [T, V] logits): at token level one grpo_loss("luspo") with the
        weight mask len_s / L on every position (ratios as sampler log-probs, divided by that weight); at sequence
        level P_st = l_s r_st + beta k3_st, so the policy term is luspo on the real mask with each sequence's mean
        ratio, plus the KL term as luspo at token level with zero advantages and the weight mask. The metrics
        (kl, clip) are Liger's, on the real mask."""
        o = self.options
        if o.seq_level and o.beta and o.use_bias_correction_kl:
            raise NotImplementedError(
                "FusedLinearGRPOLoss(loss_type='luspo', importance_sampling_level='sequence', "
                "use_bias_correction_kl=True) with beta != 0: Liger's KL times the sequence ratio over padded "
                "positions is not composed here"
            )
        logps = fused_linear_logprobs(hidden.reshape(*ids.shape, hidden.shape[-1]), weight, ids, bias=bias,
                                      temperature=self.temperature, chunk_tokens=self.chunk_tokens)  # fmt: skip
        old = logps.detach() if old is None else old.float()
        m = torch.ones_like(logps) if mask is None else mask.to(logps.dtype)
        weights = (m.sum(-1, keepdim=True) / m.shape[-1]).expand_as(m).contiguous()  # len_s / L, padding included
        kw = o.kwargs()
        ref = ref if o.beta else None
        if ratio is not None:
            old, ratio = self._ratio_as_sampler_logps(ratio, old, hidden, weight, bias, ids, as_given=True)
        sampler = {}
        if not o.seq_level:
            if ratio is not None:
                log_r = torch.log(ratio.clamp(min=1e-30)).expand_as(old)
                safe = torch.where(weights > 0, weights, 1.0)
                sampler = dict(sampler_logps=old - log_r / safe, sampler_is_mode="token_truncate",
                               sampler_is_cap=2.0 * float(ratio.max()) + 1.0)  # fmt: skip
            loss = grpo_loss(logps, old, advantages, mask=weights, ref_logps=ref, **{**kw, **sampler})[0]
        else:
            if ratio is not None:  # sum_t l_s r_st over every position = L l_s mean_t r_st
                mean_r = ratio.mean(-1, keepdim=True).clamp(min=1e-30)
                sampler = dict(sampler_logps=old - torch.log(mean_r).expand_as(old), sampler_is_mode="token_truncate",
                               sampler_is_cap=2.0 * float(mean_r.max()) + 1.0)  # fmt: skip
            loss = grpo_loss(logps, old, advantages, mask=m, **{**kw, "beta": 0.0, **sampler})[0]
            if o.beta:
                loss = loss + grpo_loss(logps, old, torch.zeros_like(advantages, dtype=torch.float32), mask=weights,
                                        ref_logps=ref, **{**kw, "importance_sampling_level": "token"})[0]
        with torch.no_grad():
            _, metrics = grpo_loss(logps.detach(), old, advantages, mask=m, ref_logps=ref, **kw)
        clip = metrics["clip_ratio/region_mean"]
        if o.seq_level:
            clip = self._sequence_clip_ratio(old, None, None, None, ids, mask, advantages, clip, logps=logps.detach())
        kl = metrics["kl"] if o.beta else torch.zeros((), dtype=clip.dtype, device=clip.device)
        return loss, ([kl] if self.kl_slot else []) + [clip]

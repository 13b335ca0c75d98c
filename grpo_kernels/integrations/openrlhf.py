"""OpenRLHF (0.11) drop-ins: `PolicyLoss` on grpo_kernels' loss op, and the Actor's log-probs from the fused LM head.

Design. `PolicyLoss` has the constructor, forward signature and return tuple of `openrlhf.models.loss.PolicyLoss`
and computes the loss with `grpo_kernels.grpo_loss` (C++ on CPU, Triton on CUDA):

    ratio     ppo: w = exp(clamp(logp - old, -20, 20)) per token; gspo: w = exp(masked mean of logp - old) per sequence
              (old = rollout_log_probs when the IS correction is on)
    policy    l = -min(w A, clip(w, 1 - clip_eps_low, 1 + clip_eps_high) A); dual clip c: l = min(l, -c A) for A < 0
    vLLM IS   (ppo, is_correction_level != "off") l *= coef, a per-token weight from old and rollout log-probs
    reduce    token_level_loss: sum m l / sum m, or sum m l / batch_num_tokens * dp_size;
              else (gspo always): sum_s (sum_t m l / n_s) / #non-empty sequences, or / global_batch_size * dp_size

How each piece maps onto the op:
  - the +-20 clamp of ppo's log-ratio: tokens outside the band enter the op as old + the clamped log-ratio, with no
    gradient (torch.where on the log-probs), so the op's ratio is OpenRLHF's;
  - dual clip c > 1 + clip_eps_high is the op's `delta` (min(w, delta) A inside the min: equal to OpenRLHF's
    max(min(w A, clip(w) A), c A) for A < 0, and inert for A > 0 since clip(w) <= 1 + clip_eps_high < c). For
    1 < c <= 1 + clip_eps_high delta would differ (it would also cap positive advantages), so ppo caps the log-ratio
    of negative-advantage tokens at log c with the same where as the +-20 clamp; gspo, whose ratio is a whole
    sequence's, raises NotImplementedError there;
  - the IS correction's weight (OpenRLHF's gates: ratio / binary_kl / tv statistic, per token or per sequence, masked
    or clipped) is computed here from old and rollout log-probs (data, no gradient) and handed to the op as sampler
    log-probs s = old - log(coef) with an inert cap: the op's exp(old - s) is coef (a dropped unit: s = old + 1e4,
    whose weight exp(-1e4) is exactly 0);
  - token_level_loss is the op's "dapo" (sum m l / sum m, or the masked sum with num_items_in_batch=1 divided here
    by batch_num_tokens); per-sample is the op's "grpo" (mean over all B sequences), rescaled here to the non-empty
    sequences or to global_batch_size;
  - clip_ratio is the op's clip_ratio/region_mean (the masked token mean of [w < 1 - eps_low, A < 0] or
    [w > 1 + eps_high, A > 0], which is OpenRLHF's surr2 < surr1); ppo_kl, vllm_kl and is_filter_ratio are masked
    means computed here without gradient.

Where OpenRLHF divides 0 by 0 (an all-masked micro-batch without batch_num_tokens / global_batch_size) this returns
0 with zero gradients instead of NaN; everywhere else it returns OpenRLHF's values. The loss is float32 whatever the
input dtype (the op accumulates in fp32).

`actor_log_probs` computes what `Actor.forward` returns (action log-probs times action_mask, or all log-probs, and the
entropy) from the last hidden states and the LM head with `fused_linear_logprobs`, never building [B, S, V] logits;
`use_grpo_kernels(actor)` switches an Actor instance's forward to it. This module never imports openrlhf.
"""

import math
import types

import torch

from .._checks import check_flag
from ..fused_linear import fused_linear_logprobs
from ..hf_head import backbone, check_plain_head, head_inputs, lm_head, logit_multiplier, logit_softcap
from ..loss import grpo_loss

__all__ = ["FusedActorOutput", "POLICY_LOSS_TYPES", "PolicyLoss", "actor_log_probs", "use_grpo_kernels"]

POLICY_LOSS_TYPES = ("ppo", "gspo")
IS_LEVELS, IS_MODES, IS_GATINGS = ("off", "token", "seq"), ("mask", "clip"), ("ratio", "binary_kl", "tv")
LOG_RATIO_BOUND = 20.0  # OpenRLHF's ppo clamps logp - old to [-20, 20]
PROB_CLAMP = 1e-6  # the divergence gates clamp both probabilities to [1e-6, 1 - 1e-6]
_DROPPED = 1e4  # old - sampler = -1e4 for a dropped unit: its weight exp(-1e4) is exactly 0 in fp32
_INERT_CAP = torch.finfo(torch.float32).max


def _real(name, value, *, low=None) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value):
        raise ValueError(f"{name} must be a real number, got {value!r}")
    if low is not None and not value > low:
        raise ValueError(f"{name} must be > {low}, got {value!r}")
    return float(value)


def _choice(name, value, allowed) -> None:
    if value not in allowed:
        raise ValueError(f"{name} must be one of {', '.join(map(repr, allowed))}, got {value!r}")


def _masked_mean(x, mask):
    """sum(x m) / sum(m) over everything (0 for an empty mask)."""
    return (x * mask).sum() / mask.sum().clamp(min=1.0)


def _seq_mean(x, mask):
    """Per-sequence masked mean [B, 1]; NaN for an empty sequence (its statistic is undefined: the gate drops it)."""
    return (x * mask).sum(-1, keepdim=True) / mask.sum(-1, keepdim=True)


class PolicyLoss(torch.nn.Module):
    """`openrlhf.models.loss.PolicyLoss` (0.11.2) computed by `grpo_kernels.grpo_loss`.

    Constructor: OpenRLHF's arguments (see the module docstring for the formulas), plus `impl` ("auto", "cpp",
    "triton", "reference") for the loss op. forward(log_probs [B, A], old_log_probs [B, A], advantages [B, A] or
    [B, 1], action_mask [B, A] 0/1 or None (= all ones), rollout_log_probs [B, A] (needed by the IS correction),
    dp_size, batch_num_tokens, global_batch_size) -> (loss, clip_ratio, ppo_kl, vllm_kl, is_filter_ratio), the last
    two None unless policy_loss_type="ppo" and is_correction_level != "off". The gradient flows to log_probs only.
    """

    def __init__(self, clip_eps_low: float = 0.2, clip_eps_high: float = 0.2, dual_clip: float | None = None,
                 token_level_loss: bool = True, policy_loss_type: str = "ppo", is_correction_level: str = "off",
                 is_correction_mode: str = "mask", is_correction_gating: str = "ratio",
                 is_correction_threshold=(0.5, 5.0), *, impl: str = "auto") -> None:  # fmt: skip
        super().__init__()
        self.clip_eps_low = _real("clip_eps_low", clip_eps_low)
        self.clip_eps_high = _real("clip_eps_high", clip_eps_high)
        if not 0.0 <= self.clip_eps_low < 1.0 or self.clip_eps_high < 0.0:
            raise ValueError(f"clip_eps_low must lie in [0, 1) and clip_eps_high be >= 0, got {clip_eps_low!r}, "
                             f"{clip_eps_high!r}")  # fmt: skip
        self.dual_clip = None if dual_clip is None else _real("dual_clip", dual_clip, low=1.0)
        check_flag("token_level_loss", token_level_loss)
        _choice("policy_loss_type", policy_loss_type, POLICY_LOSS_TYPES)
        _choice("is_correction_level", is_correction_level, IS_LEVELS)
        _choice("is_correction_mode", is_correction_mode, IS_MODES)
        _choice("is_correction_gating", is_correction_gating, IS_GATINGS)
        if is_correction_mode == "clip" and (is_correction_level == "seq" or is_correction_gating != "ratio"):
            raise ValueError("is_correction_mode='clip' needs is_correction_level='token' and "
                             "is_correction_gating='ratio' (only a per-token ratio is a weight that can be clamped)")
        if not isinstance(is_correction_threshold, (tuple, list)) or len(is_correction_threshold) != 2:
            raise ValueError(f"is_correction_threshold must be (low, high), got {is_correction_threshold!r}")
        low, high = (_real(f"is_correction_threshold[{i}]", v) for i, v in enumerate(is_correction_threshold))
        if low > high:
            raise ValueError(f"is_correction_threshold must have low <= high, got {is_correction_threshold!r}")
        if is_correction_gating != "ratio" and is_correction_level != "off" and low > 0:
            raise ValueError(f"is_correction_gating={is_correction_gating!r} bounds a divergence from above only: "
                             f"is_correction_threshold must be (0, delta), got {is_correction_threshold!r}")
        self.policy_loss_type = policy_loss_type
        self.token_level_loss = token_level_loss and policy_loss_type != "gspo"  # GSPO: per-sample mean, always
        self.is_correction_level, self.is_correction_mode = is_correction_level, is_correction_mode
        self.is_correction_gating, self.is_correction_threshold = is_correction_gating, (low, high)
        self.impl = impl
        # Dual clip as the op's delta where they are equal; else (ppo) a cap on the negative tokens' log-ratio.
        above = self.dual_clip is not None and self.dual_clip > 1.0 + self.clip_eps_high
        self._delta = self.dual_clip if above else None
        self._cap_negative = None if above or self.dual_clip is None else math.log(self.dual_clip)
        if self._cap_negative is not None and policy_loss_type == "gspo":
            raise NotImplementedError(
                f"dual_clip={dual_clip} <= 1 + clip_eps_high with policy_loss_type='gspo': the loss op's delta equals "
                "OpenRLHF's dual clip only above 1 + clip_eps_high, and a sequence ratio cannot be capped per token"
            )

    def extra_repr(self) -> str:
        return (f"policy_loss_type={self.policy_loss_type!r}, clip_eps=({self.clip_eps_low}, {self.clip_eps_high}), "
                f"dual_clip={self.dual_clip}, token_level_loss={self.token_level_loss}, "
                f"is_correction={self.is_correction_level}/{self.is_correction_mode}/{self.is_correction_gating}"
                f"{self.is_correction_threshold}")  # fmt: skip

    def forward(self, log_probs, old_log_probs, advantages, action_mask=None, rollout_log_probs=None, dp_size=1,
                batch_num_tokens=None, global_batch_size=None):  # fmt: skip
        mask, adv = self._check(log_probs, old_log_probs, advantages, action_mask, rollout_log_probs, dp_size,
                                batch_num_tokens, global_batch_size)  # fmt: skip
        correction = self.is_correction_level != "off"
        sampler = vllm_kl = is_filter_ratio = None
        if self.policy_loss_type == "ppo":
            logps, old = self._clamped_log_ratio(log_probs, old_log_probs, adv), old_log_probs
            if correction:
                sampler, vllm_kl, is_filter_ratio = self._is_weights(old_log_probs, rollout_log_probs, mask)
        else:  # gspo: with the IS correction on, the sequence ratio is taken against the rollout policy
            logps, old = log_probs, rollout_log_probs if correction else old_log_probs
        sum_only = self.token_level_loss and batch_num_tokens is not None
        loss, metrics = grpo_loss(
            logps, old, adv, mask=mask, loss_type="dapo" if self.token_level_loss else "grpo",
            epsilon_low=self.clip_eps_low, epsilon_high=self.clip_eps_high, delta=self._delta,
            importance_sampling_level="sequence" if self.policy_loss_type == "gspo" else "token",
            num_items_in_batch=1.0 if sum_only else None, sampler_logps=sampler,
            sampler_is_mode=None if sampler is None else "token_truncate", sampler_is_cap=_INERT_CAP, impl=self.impl,
        )  # fmt: skip
        if self.token_level_loss:
            if batch_num_tokens is not None:
                loss = loss / batch_num_tokens * dp_size
        elif global_batch_size is None:  # the op's mean runs over all B sequences; OpenRLHF's over the non-empty ones
            loss = loss * (mask.shape[0] / (mask.sum(-1) > 0).sum().clamp(min=1))
        else:
            loss = loss * mask.shape[0] / global_batch_size * dp_size
        with torch.no_grad():
            ppo_kl = _masked_mean(old_log_probs.float() - log_probs.detach().float(), mask)
        return loss, metrics["clip_ratio/region_mean"], ppo_kl, vllm_kl, is_filter_ratio

    def _clamped_log_ratio(self, log_probs, old_log_probs, adv):
        """ppo: fp32 log-probs whose log-ratio to old is clamped to [-20, 20] (and to log dual_clip for A < 0 when
        dual_clip <= 1 + clip_eps_high); a clamped token has no gradient, as in OpenRLHF."""
        old = old_log_probs.detach().float()
        d = log_probs.detach().float() - old
        high = LOG_RATIO_BOUND
        if self._cap_negative is not None:
            high = torch.where(adv < 0, min(self._cap_negative, LOG_RATIO_BOUND), LOG_RATIO_BOUND)
        clamped = torch.minimum(d.clamp(min=-LOG_RATIO_BOUND), torch.as_tensor(high, device=d.device))
        outside = (d < -LOG_RATIO_BOUND) | (d > high)
        return torch.where(outside, old + clamped, log_probs.float())

    @torch.no_grad()
    def _is_weights(self, old_log_probs, rollout_log_probs, mask):
        """OpenRLHF's vLLM IS correction -> (sampler log-probs old - log(coef) for the op, vllm_kl, is_filter_ratio).

        The gate reads a statistic per unit (token, or the sequence's masked mean: the ratio's geometric mean, a
        divergence's plain mean): the ratio r = exp(old - rollout), or with p = exp(rollout), q = exp(old) (both
        clamped to [1e-6, 1 - 1e-6]) binary_kl p log(p/q) + (1-p) log((1-p)/(1-q)) or tv |p - q|. mask: units out
        of [low, high] get coef 0, the others their token's r; clip (token ratio only): coef = clamp(r, low, high).
        is_filter_ratio: the fraction of units out of band (per sequence at seq level: empty sequences count).
        """
        low, high = self.is_correction_threshold
        old, rollout = old_log_probs.float(), rollout_log_probs.float()
        seq = self.is_correction_level == "seq"
        if self.is_correction_gating == "ratio":
            stat = torch.exp(_seq_mean(old - rollout, mask) if seq else old - rollout)
        else:
            p = rollout.exp().clamp(PROB_CLAMP, 1 - PROB_CLAMP)
            q = old.exp().clamp(PROB_CLAMP, 1 - PROB_CLAMP)
            if self.is_correction_gating == "binary_kl":
                stat = p * torch.log(p / q) + (1 - p) * torch.log((1 - p) / (1 - q))
            else:
                stat = (p - q).abs()
            stat = _seq_mean(stat, mask) if seq else stat
        if self.is_correction_mode == "clip":
            below, above = stat < low, stat > high
            log_low = math.log(low) if low > 0 else -math.inf
            sampler = torch.where(below, old - log_low, torch.where(above, old - math.log(high), rollout))
            filtered = below | above
        else:
            keep = (stat >= low) & (stat <= high)  # a NaN statistic (an empty sequence) is dropped
            sampler = torch.where(keep, rollout, old + _DROPPED)
            filtered = ~keep
        ratio = filtered.float().mean() if seq else _masked_mean(filtered.float(), mask)
        return sampler, _masked_mean(rollout - old, mask), ratio

    def _check(self, log_probs, old_log_probs, advantages, action_mask, rollout_log_probs, dp_size,
               batch_num_tokens, global_batch_size):  # fmt: skip
        """-> (float32 mask [B, A], advantages [B, A]); ValueError naming the first bad argument."""
        if not isinstance(log_probs, torch.Tensor) or log_probs.dim() != 2 or not log_probs.is_floating_point():
            got = tuple(log_probs.shape) if isinstance(log_probs, torch.Tensor) else type(log_probs).__name__
            raise ValueError(f"log_probs must be a floating-point tensor [batch, num_actions], got {got}")
        shape = log_probs.shape
        for name, x in (("old_log_probs", old_log_probs), ("rollout_log_probs", rollout_log_probs),
                        ("action_mask", action_mask)):  # fmt: skip
            if x is not None and (not isinstance(x, torch.Tensor) or x.shape != shape):
                got = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
                raise ValueError(f"{name} must be a tensor shaped like log_probs {tuple(shape)}, got {got}")
        if old_log_probs is None:
            raise ValueError("old_log_probs is required (OpenRLHF's PolicyLoss always takes them)")
        for name, x in (("old_log_probs", old_log_probs), ("rollout_log_probs", rollout_log_probs),
                        ("advantages", advantages)):  # fmt: skip
            if isinstance(x, torch.Tensor) and x.requires_grad:
                raise ValueError(f"{name} requires grad, but PolicyLoss differentiates w.r.t. log_probs only: "
                                 "detach it")  # fmt: skip
        if self.is_correction_level != "off" and rollout_log_probs is None:
            raise ValueError(f"is_correction_level={self.is_correction_level!r} needs rollout_log_probs (the "
                             "sampler's per-token log-probs)")  # fmt: skip
        if not isinstance(advantages, torch.Tensor) or advantages.shape not in (shape, (shape[0], 1)):
            got = tuple(advantages.shape) if isinstance(advantages, torch.Tensor) else type(advantages).__name__
            raise ValueError(f"advantages must be shaped like log_probs {tuple(shape)} or [{shape[0]}, 1], got {got}")
        if isinstance(dp_size, bool) or not isinstance(dp_size, int) or dp_size < 1:
            raise ValueError(f"dp_size must be an int >= 1, got {dp_size!r}")
        for name, value in (("batch_num_tokens", batch_num_tokens), ("global_batch_size", global_batch_size)):
            if isinstance(value, torch.Tensor):
                if value.numel() != 1:
                    raise ValueError(f"{name} must be a number or a one-element tensor, got shape {tuple(value.shape)}")
            elif value is not None:
                _real(name, value, low=0.0)
        mask = torch.ones(shape, device=log_probs.device) if action_mask is None else action_mask.float()
        return mask, advantages.expand(shape)


class FusedActorOutput:
    """The `output` of a fused Actor.forward: `entropy` (when asked) and no logits. OpenRLHF reads `aux_loss` from
    it for MoE models when aux_loss_coef > 0: the fused path does not compute the router's load-balancing loss."""

    def __init__(self, entropy=None):
        self.entropy = entropy

    def __getattr__(self, name):
        if name in ("logits", "aux_loss"):
            raise NotImplementedError(f"the fused Actor.forward computes no {name} (grpo_kernels never builds the "
                                      "logits; a MoE load-balancing loss needs actor.aux_loss_coef = 0)")  # fmt: skip
        raise AttributeError(name)

    def __getitem__(self, name):
        return getattr(self, name)


def actor_log_probs(hidden, weight, sequences, *, action_mask=None, attention_mask=None, packed=False, bias=None,
                    temperature=1.0, softcap=None, return_entropy=False, chunk_tokens="auto", impl="auto"):  # fmt: skip
    """Actor.forward's log-probs from the last hidden states and the LM head (`fused_linear_logprobs`, no logits).

    Position p predicts token p + 1: lp[b, p] = log softmax(z[b, p] / temperature)[sequences[b, p + 1]], with
    z = hidden W^T + bias (softcap c: c tanh(z / c), before the temperature), p = 0 .. S - 2.

    Args:
        hidden: the decoder's last hidden states, `[B, S, H]` for the padded batch, or with packed=True the packed
            row `[1, T, H]` / `[T, H]` of the attended tokens (attention_mask's ones in row-major order, as
            OpenRLHF's packing_samples lays them out).
        weight: the LM head `[V, H]`; bias `[V]` or None. sequences: `[B, S]` token ids.
        action_mask: `[B, A]`: return the last A positions (p = S - 1 - A .. S - 2) times action_mask, `[B, A]`,
            as Actor.forward's action log-probs; None: all S - 1 positions `[B, S - 1]` (return_logprobs).
        attention_mask: `[B, S]`, required with packed=True: positions outside it get 0, as the Actor's pad_input.
        temperature: Actor.temperature (divided by the model's logit scale, if any).
        return_entropy: also the entropy of softmax(z / temperature) at the same positions (unmasked, as the
            Actor's output.entropy, of which the trainer reads these last A columns).

    Returns:
        float32 log-probs (and entropy), differentiable w.r.t. hidden, weight and bias.
    """
    if not isinstance(sequences, torch.Tensor) or sequences.dim() != 2 or sequences.shape[1] < 2:
        raise ValueError("sequences must be a [batch, seq_len >= 2] tensor of token ids")
    b, s = sequences.shape
    n = s - 1 if action_mask is None else action_mask.shape[-1]
    if action_mask is not None and (action_mask.dim() != 2 or action_mask.shape[0] != b or not 1 <= n <= s - 1):
        raise ValueError(f"action_mask must be [{b}, A] with 1 <= A <= {s - 1}, got {tuple(action_mask.shape)}")
    first = s - 1 - n
    ids = sequences[:, first + 1 :]
    kwargs = dict(bias=bias, temperature=temperature, softcap=softcap, return_entropy=True, chunk_tokens=chunk_tokens,
                  impl=impl)  # fmt: skip
    if not packed:
        if hidden.dim() != 3 or hidden.shape[:2] != (b, s):
            raise ValueError(f"hidden must be [B={b}, S={s}, H] (or packed=True), got {tuple(hidden.shape)}")
        lp, ent = fused_linear_logprobs(hidden[:, first : s - 1], weight, ids, **kwargs)
    else:
        if not isinstance(attention_mask, torch.Tensor) or attention_mask.shape != (b, s):
            raise ValueError(f"packed=True needs attention_mask [{b}, {s}]")
        on = attention_mask.bool()
        rows = hidden.reshape(-1, hidden.shape[-1])
        if rows.shape[0] != int(on.sum()):
            raise ValueError(f"packed hidden has {rows.shape[0]} rows, attention_mask {int(on.sum())} ones")
        index = on.flatten().long().cumsum(0).view(b, s)[:, first : s - 1] - 1
        valid = on[:, first : s - 1]
        lp_v, ent_v = fused_linear_logprobs(rows[index[valid]], weight, ids[valid], **kwargs)
        zeros = torch.zeros(b, n, dtype=torch.float32, device=hidden.device)
        lp, ent = zeros.masked_scatter(valid, lp_v), zeros.masked_scatter(valid, ent_v)
    if action_mask is not None:
        lp = lp * action_mask.float()
    return (lp, ent) if return_entropy else lp


def _hf_model(model):
    """The HF causal LM inside an Actor's `model` (a PEFT wrapper's base model)."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def _check_actor(actor) -> None:
    if getattr(actor, "is_vlm", False):
        raise NotImplementedError("a vision-language Actor: grpo_kernels' fused head runs text-only causal LMs")
    from transformers.integrations.deepspeed import is_deepspeed_zero3_enabled

    model = _hf_model(actor.model)
    check_plain_head(model)
    if is_deepspeed_zero3_enabled() or hasattr(model.get_output_embeddings().weight, "ds_id"):
        raise NotImplementedError("DeepSpeed ZeRO-3: the fused head reads lm_head.weight outside the head's forward, "
                                  "where ZeRO-3 keeps it partitioned (use ZeRO stage 1 or 2)")  # fmt: skip


def _fused_forward(self, sequences, action_mask=None, attention_mask=None, return_output=False,
                   allgather_logits=False, return_logprobs=False, ring_attn_group=None, packed_seq_lens=None,
                   return_entropy=False, **mm_inputs):  # fmt: skip
    """Actor.forward with the LM head fused (see actor_log_probs); calls that want the logits (no action_mask, no
    return_logprobs) run the original forward."""
    if action_mask is None and not return_logprobs:
        return self._grpo_kernels_previous_forward(
            sequences, action_mask, attention_mask, return_output, allgather_logits, return_logprobs,
            ring_attn_group, packed_seq_lens, return_entropy, **mm_inputs,
        )  # fmt: skip
    if mm_inputs:
        raise NotImplementedError(f"multimodal inputs {sorted(mm_inputs)}: the fused Actor runs text-only models")
    if ring_attn_group is not None:
        raise NotImplementedError("ring attention (ring_attn_group): the fused Actor runs unsliced sequences")
    if return_entropy and not return_output:
        raise ValueError("return_entropy=True needs return_output=True (the entropy is output.entropy)")
    if not isinstance(attention_mask, torch.Tensor) or attention_mask.shape != sequences.shape:
        raise ValueError("the Actor's forward needs an attention_mask shaped like sequences")
    model = _hf_model(self.model)
    packed = getattr(self, "packing_samples", False)
    positions = attention_mask.long().cumsum(-1) - 1
    if packed:  # the attended tokens in one row, positions restarting per sequence: no cross-sequence attention
        on = attention_mask.bool()
        out = backbone(model)(input_ids=sequences[on].unsqueeze(0), position_ids=positions.clamp(min=0)[on][None],
                              use_cache=False)  # fmt: skip
    else:
        positions = positions.masked_fill(attention_mask == 0, 1)
        out = backbone(model)(input_ids=sequences, attention_mask=attention_mask, position_ids=positions,
                              use_cache=False)  # fmt: skip
    hidden, weight, bias = head_inputs(out.last_hidden_state, *lm_head(model))
    with torch.autocast(hidden.device.type, enabled=False):  # a logit scale s: softcap c / s, temperature T / s
        lp, entropy = actor_log_probs(
            hidden, weight, sequences, action_mask=action_mask, attention_mask=attention_mask, packed=packed,
            bias=bias, temperature=self.temperature / logit_multiplier(model.config),
            softcap=logit_softcap(model.config), return_entropy=True,
        )  # fmt: skip
    return (lp, FusedActorOutput(entropy if return_entropy else None)) if return_output else lp


_fused_forward._grpo_kernels = True


def use_grpo_kernels(actor):
    """Switch an OpenRLHF `Actor` (or a DeepSpeed engine wrapping one) to the fused LM head, in place; returns it.

    Its forward then returns the same action log-probs (`[B, A]`, times action_mask) and `output.entropy` of those
    positions without building the logits; calls without action_mask or return_logprobs (which want the logits)
    run the original forward. Raises NotImplementedError for a VLM, DeepSpeed ZeRO-3, or a head the fused path does
    not compute (see `hf.check_plain_head`); multimodal inputs and ring attention raise at call time.
    """
    inner = actor.module if not hasattr(actor, "model") and hasattr(actor, "module") else actor
    if not hasattr(inner, "model") or not hasattr(inner, "temperature"):
        raise TypeError(f"use_grpo_kernels takes an OpenRLHF Actor (with .model and .temperature), got "
                        f"{type(actor).__name__}")  # fmt: skip
    _check_actor(inner)
    if not getattr(inner.forward, "_grpo_kernels", False):
        inner._grpo_kernels_previous_forward = inner.forward
        inner.forward = types.MethodType(_fused_forward, inner)
    return actor

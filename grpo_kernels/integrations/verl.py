"""verl's policy losses and its fused log-prob/entropy head, computed by grpo_kernels.

Policy losses. `register_verl_losses()` adds four entries to verl's `POLICY_LOSS_REGISTRY` (through verl's own
`register_policy_loss`), selected with `actor_rollout_ref.actor.policy_loss.loss_mode`:

    grpo_kernels_vanilla  = verl "vanilla" (PPO clip, clip_ratio_low/high, dual clip clip_ratio_c)
    grpo_kernels_gspo     = verl "gspo"    (sequence-level ratio, clip_ratio_low/high)
    grpo_kernels_cispo    = verl "cispo"   (stop-gradient clipped ratio times log-prob, clip_ratio_low/high)
    grpo_kernels_sapo     = verl "sapo"    (soft gate, tau_pos/tau_neg; always seq-mean-token-mean, as verl)

Each has verl's signature `(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, config,
rollout_is_weights) -> (loss, metrics)`, all tensors `[B, L]`, and returns verl's metrics (floats):
"actor/pg_clipfrac", "actor/ppo_kl", "actor/pg_clipfrac_lower". The loss, its gradient w.r.t. log_prob and the
metrics are verl's; the loss and gradient come from one `grpo_kernels.grpo_loss` call (two for the dual-clip case
below), whose C++ (CPU) / Triton (CUDA) kernel computes the per-token loss, its derivative and the weighted sum.

How verl's math maps onto the op (A: advantages, m: response_mask, d = log_prob - old_log_prob):
  - aggregation. Every loss_agg_mode, with verl's global batch normalisation (config.global_batch_info: dp_size,
    batch_num_tokens, global_batch_size, loss_scale_factor), is a weighted token sum sum_t c_t m_t l_t with c
    constant per sequence (`aggregation_weights`); the weights c m (times the rollout IS weights, which verl
    multiplies into the per-token loss) are the op's mask, with loss_type "dapo"/"cispo" and num_items_in_batch=1.
  - vanilla: verl clamps d to [-20, 20] (no gradient outside): the op gets log-probs old + clamp(d) there.
    Dual clip: for A < 0 verl's loss is |A| min(c, max(w, clip(w))); the op's delta caps w, which equals it when
    c >= 1 + clip_ratio_high (the usual case: one op call, delta = c). For 1 < c < 1 + clip_ratio_high the op runs
    twice: A > 0 tokens without delta, A <= 0 tokens with epsilon_high = c - 1 and delta = c. clip_ratio_c = inf
    turns the dual clip off (delta None).
  - gspo: verl's token ratio is s_t = exp(log_prob_t - sg(log_prob_t) + sg(min(seq mean of d, 10))): value the
    sequence ratio, gradient s per token. The op's token level computes exactly that with old log-probs shifted to
    sg(log_prob) - min(mean d, 10) (in fp32); a sequence above the clamp gets no gradient, as in verl.
  - cispo: verl clips the (clamped) ratio on both sides, [1 - clip_ratio_low, 1 + clip_ratio_high]; the op caps it
    above (epsilon_high = 1 + clip_ratio_high) and the lower clip goes into the shifted old log-probs (fp32).
  - sapo: the op's "sapo" (its per-sequence token mean is verl's), scaled by B dp / global_batch_size; the rollout
    IS weights go in as the op's sampler correction (sampler log-probs old - log w, token_truncate, no cap).
Where verl would propagate NaN from padding (masked tokens), these losses do not: masked tokens take no part.
Not computed here, with a clear error: a rollout_is_weights tensor that requires grad (NotImplementedError),
clip_ratio_c <= 1, unknown loss_agg_mode or global_batch_info keys, dp_size > 1 without the global counts.

Fused head. `fused_linear_for_ppo(hidden_states, vocab_weights, input_ids, temperature)` has the call shape and
return of verl's `FusedLinearForPPO.forward` (log-probs fp32, entropy in the hidden dtype) and runs
`grpo_kernels.fused_linear_logprobs` (chunked, no [T, V] logits). `use_grpo_kernels_fused_linear()` puts
`FusedLinearForPPO` (this module's) in place of verl's class in `verl.utils.experimental.torch_functional`,
which verl's patched model forwards look up at each call when `use_fused_kernels=True` with
`fused_kernel_options.impl_backend=torch` ("liger" still runs verl's class, "triton" verl's own kernel).

verl is imported only inside the functions that need it: grpo_kernels (and this module) import without verl.
`grpo_kernels.integrations.verl_register` is the module to give verl's `external_lib`.
"""

import math

import torch

from ..fused_linear import fused_linear_logprobs
from ..loss import grpo_loss

__all__ = [
    "AGG_MODES",
    "LOSS_MODES",
    "FusedLinearForPPO",
    "aggregation_weights",
    "fused_linear_for_ppo",
    "register_verl_losses",
    "use_grpo_kernels_fused_linear",
]

AGG_MODES = ("token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")
_BATCH_INFO_KEYS = ("dp_size", "batch_num_tokens", "global_batch_size", "loss_scale_factor")
_LOG_RATIO_BOUND = 20.0  # verl clamps the token log-ratio of vanilla / cispo / sapo here
_GSPO_LOG_RATIO_MAX = 10.0  # and GSPO's sequence log-ratio here (above: no gradient)
_NO_CAP = torch.finfo(torch.float32).max


# ------------------------------------------------------------------------------------------------ aggregation
def _batch_info(config) -> dict:
    info = dict(getattr(config, "global_batch_info", None) or {})
    unknown = sorted(set(info) - set(_BATCH_INFO_KEYS))
    if unknown:
        raise TypeError(f"config.global_batch_info has keys verl's agg_loss does not take: {unknown}")
    return info


def _sequence_count(mask, dp_size, global_batch_size):
    """global_batch_size, or (one rank) the number of sequences with at least one token, as verl's agg_loss."""
    if global_batch_size is None:
        if dp_size > 1:
            raise ValueError("global_batch_size is required in config.global_batch_info when dp_size > 1")
        return (mask.sum(-1) > 0).sum()
    return global_batch_size


def aggregation_weights(mask, loss_agg_mode, *, dp_size=1, batch_num_tokens=None, global_batch_size=None,
                        loss_scale_factor=None) -> torch.Tensor:  # fmt: skip
    """Per-token weights c (float32, the shape of mask [B, L]) with verl's agg_loss(x, mask, mode, **info) equal to
    sum_t c_t x_t for every loss matrix x (zero where mask is 0):

        token-mean:              c = m dp / batch_num_tokens          (default sum m)
        token-sum:               c = m dp
        seq-mean-token-sum:      c = m dp / G                         (G = global_batch_size, default: the number
        seq-mean-token-sum-norm: c = m dp / (G loss_scale_factor)      of sequences with sum m > 0; factor default L)
        seq-mean-token-mean:     c = m dp / (G (sum_t m + 1e-8))
    """
    m = mask.to(torch.float32)
    if loss_agg_mode == "token-mean":
        if batch_num_tokens is None:
            if dp_size > 1:
                raise ValueError("batch_num_tokens is required in config.global_batch_info when dp_size > 1")
            batch_num_tokens = m.sum()
        c = m * (dp_size / batch_num_tokens)
    elif loss_agg_mode == "token-sum":
        c = m * dp_size
    elif loss_agg_mode in ("seq-mean-token-sum", "seq-mean-token-sum-norm"):
        c = m * (dp_size / _sequence_count(m, dp_size, global_batch_size))
        if loss_agg_mode == "seq-mean-token-sum-norm":
            c = c / (m.shape[-1] if loss_scale_factor is None else loss_scale_factor)
    elif loss_agg_mode == "seq-mean-token-mean":
        per_seq = dp_size / (_sequence_count(m, dp_size, global_batch_size) * (m.sum(-1, keepdim=True) + 1e-8))
        c = m * per_seq
    else:
        raise ValueError(f"loss_agg_mode must be one of {', '.join(AGG_MODES)}; got {loss_agg_mode!r}")
    return torch.where(m != 0, c, 0.0)


# ------------------------------------------------------------------------------------------------ the losses
class _Batch:
    """The checked inputs of one verl loss call, in a common dtype (log_prob's gradient flows through `lp`)."""

    def __init__(self, old_log_prob, log_prob, advantages, response_mask, config, rollout_is_weights):
        if config is None:
            raise ValueError("config (verl's actor config) is required")
        if log_prob.dim() != 2:
            raise ValueError(f"log_prob must be [B, L], got shape {tuple(log_prob.shape)}")
        for name, x in (("old_log_prob", old_log_prob), ("advantages", advantages), ("response_mask", response_mask)):
            if x.shape != log_prob.shape:
                raise ValueError(f"{name} must have log_prob's shape {tuple(log_prob.shape)}, got {tuple(x.shape)}")
        self.dtype = torch.promote_types(log_prob.dtype, old_log_prob.dtype)
        self.lp, self.old = log_prob.to(self.dtype), old_log_prob.detach().to(self.dtype)
        self.adv = advantages.detach().to(self.dtype)
        self.mask = response_mask.detach()
        self.on = self.mask != 0
        # d in fp32 whatever the inputs (verl: in their dtype); padding's NaN stays out
        self.d = torch.where(self.on, self.lp.detach().float() - self.old.float(), 0.0)
        self.info = _batch_info(config)
        self.is_weights = None
        if rollout_is_weights is not None:
            if rollout_is_weights.requires_grad:
                raise NotImplementedError("rollout_is_weights that require grad: the losses treat them as constants")
            if torch.broadcast_shapes(rollout_is_weights.shape, log_prob.shape) != log_prob.shape:
                raise ValueError(f"rollout_is_weights {tuple(rollout_is_weights.shape)} do not broadcast to "
                                 f"{tuple(log_prob.shape)}")  # fmt: skip
            self.is_weights = rollout_is_weights.expand(log_prob.shape)

    def token_weights(self, loss_agg_mode):
        """The op's mask: aggregation weights times the rollout IS weights (0 on masked tokens)."""
        c = aggregation_weights(self.mask, loss_agg_mode, **self.info)
        if self.is_weights is not None:
            c = torch.where(self.on, c * self.is_weights.float(), 0.0)
        return c

    def clamped_lp(self):
        """log_prob with verl's clamp of d to [-20, 20]: value old + clamp(d), no gradient where it binds."""
        bound = _LOG_RATIO_BOUND
        at_bound = (self.old.float() + self.d.clamp(-bound, bound)).to(self.dtype)
        return torch.where(self.d.abs() <= bound, self.lp, at_bound)

    def masked_mean(self, x) -> float:
        """verl's masked mean of a per-token metric: sum over the mask / (sum of the mask + 1e-8)."""
        m = self.mask.float()
        return float((torch.where(self.on, x.float(), 0.0) * m).sum() / (m.sum() + 1e-8))

    def metrics(self, clipfrac, lower, kl_of=None) -> dict:
        kl = -(self.d.clamp(-_LOG_RATIO_BOUND, _LOG_RATIO_BOUND) if kl_of is None else kl_of)
        return {"actor/pg_clipfrac": clipfrac, "actor/ppo_kl": self.masked_mean(kl), "actor/pg_clipfrac_lower": lower}


def _clip_ratios(config):
    clip = config.clip_ratio
    low = config.clip_ratio_low if config.clip_ratio_low is not None else clip
    high = config.clip_ratio_high if config.clip_ratio_high is not None else clip
    if not 0.0 <= low < 1.0:
        raise ValueError(f"clip_ratio_low must be in [0, 1), got {low!r}")
    if not 0.0 <= high:
        raise ValueError(f"clip_ratio_high must be >= 0, got {high!r}")
    return float(low), float(high)


def _op_sum(lp, old, adv, weights, **options):
    """sum_t weights_t l_t by the op (loss_type "dapo" or "cispo": masked sum over num_items_in_batch = 1)."""
    return grpo_loss(lp, old, adv, mask=weights, num_items_in_batch=1.0, **options)[0]


def compute_policy_loss_vanilla(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode="token-mean",
                                config=None, rollout_is_weights=None):  # fmt: skip
    """verl's "vanilla" PPO loss: per token (w = exp(clamp(d, -20, 20)))
    l = max(-A w, -A clip(w, 1 - lo, 1 + hi)), and for A < 0 min(that, -A clip_ratio_c); l x rollout IS weight;
    aggregated by loss_agg_mode. Metrics: pg_clipfrac (clipped term larger), ppo_kl (mean -d), pg_clipfrac_lower
    (dual clip binding, A < 0)."""
    b = _Batch(old_log_prob, log_prob, advantages, response_mask, config, rollout_is_weights)
    low, high = _clip_ratios(config)
    c = float(config.get("clip_ratio_c", 3.0))
    if not c > 1.0:
        raise ValueError(f"clip_ratio_c (dual clip) must be > 1, got {c!r}")
    weights, lp = b.token_weights(loss_agg_mode), b.clamped_lp()
    common = dict(loss_type="dapo", epsilon_low=low)
    if c == math.inf or c >= 1.0 + high:
        loss = _op_sum(lp, b.old, b.adv, weights, epsilon_high=high, delta=None if c == math.inf else c, **common)
    else:  # the cap c sits inside the clip range: A > 0 tokens see no cap, A <= 0 tokens clip at c
        positive = b.adv > 0
        loss = _op_sum(lp, b.old, b.adv, torch.where(positive, weights, 0.0), epsilon_high=high, **common)
        loss = loss + _op_sum(lp, b.old, b.adv, torch.where(positive, 0.0, weights), epsilon_high=c - 1.0,
                              delta=c, **common)  # fmt: skip
    with torch.no_grad():
        ratio = torch.exp(b.d.clamp(-_LOG_RATIO_BOUND, _LOG_RATIO_BOUND))
        plain, clipped = -b.adv * ratio, -b.adv * ratio.clamp(1.0 - low, 1.0 + high)
        lower = (torch.maximum(plain, clipped) > -b.adv * c) & (b.adv < 0)
        metrics = b.metrics(b.masked_mean(clipped > plain), b.masked_mean(lower))
    return loss, metrics


def compute_policy_loss_gspo(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode="seq-mean-token-mean",
                             config=None, rollout_is_weights=None):  # fmt: skip
    """verl's "gspo": s = exp(min(mean_t d over the sequence, 10)) for every token of a sequence (gradient s per
    token: log s_t = log_prob_t - sg(log_prob_t) + sg(log s)); l = max(-A s, -A clip(s, 1 - lo, 1 + hi)) x rollout
    IS weight, aggregated by loss_agg_mode. Metrics: pg_clipfrac, ppo_kl (mean -d, unclamped), pg_clipfrac_lower 0."""
    b = _Batch(old_log_prob, log_prob, advantages, response_mask, config, rollout_is_weights)
    low, high = _clip_ratios(config)
    m = b.mask.float()
    seq = (b.d * m).sum(-1, keepdim=True) / m.sum(-1, keepdim=True).clamp(min=1.0)
    lp = b.lp.float()
    above = seq > _GSPO_LOG_RATIO_MAX  # verl's clamp binds: no gradient for that sequence
    lp_in = torch.where(above, lp.detach(), lp)
    old_in = lp.detach() - seq.clamp(max=_GSPO_LOG_RATIO_MAX).expand_as(lp)
    loss = _op_sum(lp_in, old_in, b.adv.float(), b.token_weights(loss_agg_mode), loss_type="dapo", epsilon_low=low,
                   epsilon_high=high)  # fmt: skip
    with torch.no_grad():
        ratio = torch.exp(seq.clamp(max=_GSPO_LOG_RATIO_MAX)).expand_as(lp)
        plain, clipped = -b.adv * ratio, -b.adv * ratio.clamp(1.0 - low, 1.0 + high)
        metrics = b.metrics(b.masked_mean(clipped > plain), 0.0, kl_of=b.d)
    return loss, metrics


def compute_policy_loss_cispo(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode="token-mean",
                              config=None, rollout_is_weights=None):  # fmt: skip
    """verl's "cispo": l = -sg(clip(w, 1 - lo, 1 + hi)) A log_prob, w = exp(clamp(d, -20, 20)), x rollout IS weight,
    aggregated by loss_agg_mode. Metrics: pg_clipfrac (w outside the clip range), ppo_kl, pg_clipfrac_lower 0."""
    b = _Batch(old_log_prob, log_prob, advantages, response_mask, config, rollout_is_weights)
    low, high = _clip_ratios(config)
    log_w = b.d.clamp(-_LOG_RATIO_BOUND, _LOG_RATIO_BOUND)
    if low > 0.0:
        log_w = log_w.clamp(min=math.log(1.0 - low))
    lp = b.lp.float()
    loss = _op_sum(lp, lp.detach() - log_w, b.adv.float(), b.token_weights(loss_agg_mode), loss_type="cispo",
                   epsilon_high=1.0 + high)  # fmt: skip
    with torch.no_grad():
        ratio = torch.exp(b.d.clamp(-_LOG_RATIO_BOUND, _LOG_RATIO_BOUND))
        metrics = b.metrics(b.masked_mean(ratio != ratio.clamp(1.0 - low, 1.0 + high)), 0.0)
    return loss, metrics


def compute_policy_loss_sapo(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode="seq-mean-token-mean",
                             config=None, rollout_is_weights=None):  # fmt: skip
    """verl's "sapo": l = -(4 / tau) sigmoid(tau (w - 1)) A, tau = tau_pos for A > 0 else tau_neg,
    w = exp(clamp(d, -20, 20)), x rollout IS weight; aggregated "seq-mean-token-mean" whatever loss_agg_mode says
    (as verl). Metrics: pg_clipfrac 0, ppo_kl, pg_clipfrac_lower 0."""
    b = _Batch(old_log_prob, log_prob, advantages, response_mask, config, rollout_is_weights)
    tau_pos, tau_neg = float(config.tau_pos), float(config.tau_neg)
    for name, tau in (("tau_pos", tau_pos), ("tau_neg", tau_neg)):
        if not (math.isfinite(tau) and tau > 0.0):
            raise ValueError(f"{name} must be a finite number > 0, got {tau!r}")
    m = b.mask.float()
    tokens = m.sum(-1)
    if bool(((tokens > 0) & (tokens < 1)).any()):
        raise ValueError("response_mask: a sequence whose mask sums to a value in (0, 1) (sapo's token mean divides "
                         "by max(sum, 1)); use a 0/1 mask")  # fmt: skip
    sampler = {}
    if b.is_weights is not None:
        rw = b.is_weights.float()
        if bool((b.on & ~(rw >= 0)).any()):
            raise ValueError("rollout_is_weights must be finite and >= 0 on the response tokens for sapo")
        log_rw = torch.where(b.on, torch.log(rw), 0.0).clamp(min=-1e4)  # exp(-1e4) is exactly 0
        sampler = dict(sampler_logps=b.old.float() - log_rw, sampler_is_mode="token_truncate", sampler_is_cap=_NO_CAP)
    info = b.info
    dp = info.get("dp_size", 1)
    scale = m.shape[0] * dp / _sequence_count(m, dp, info.get("global_batch_size"))
    loss, _ = grpo_loss(b.clamped_lp(), b.old, b.adv, mask=m, loss_type="sapo", sapo_temperature_pos=tau_pos,
                        sapo_temperature_neg=tau_neg, **sampler)  # fmt: skip
    return loss * scale, b.metrics(0.0, 0.0)


LOSS_MODES = {
    "grpo_kernels_vanilla": compute_policy_loss_vanilla,
    "grpo_kernels_gspo": compute_policy_loss_gspo,
    "grpo_kernels_cispo": compute_policy_loss_cispo,
    "grpo_kernels_sapo": compute_policy_loss_sapo,
}
"""The loss_mode names registered in verl, and their functions."""


def register_verl_losses() -> tuple[str, ...]:
    """Register LOSS_MODES with verl's `register_policy_loss` (idempotent); returns the names."""
    from verl.trainer.ppo.core_algos import POLICY_LOSS_REGISTRY, register_policy_loss

    for name, fn in LOSS_MODES.items():
        if POLICY_LOSS_REGISTRY.get(name) is not fn:
            register_policy_loss(name)(fn)
    return tuple(LOSS_MODES)


# ------------------------------------------------------------------------------------------------ fused head
def fused_linear_for_ppo(hidden_states, vocab_weights, input_ids, temperature=1.0, *, chunk_tokens="auto"):
    """verl's fused head: log softmax(hidden W^T / temperature)[input_ids] and the entropy of that softmax,
    H_t = logsumexp(z_t) - sum_v p_tv z_tv, per token, without [T, V] logits (grpo_kernels.fused_linear_logprobs).

    hidden_states `[T, H]` or `[B, T, H]`, vocab_weights `[V, H]`, input_ids of hidden_states' leading shape.
    Returns (log_probs float32, entropy in hidden_states' dtype), both of input_ids' shape, as verl's
    FusedLinearForPPO; their gradients flow to hidden_states and vocab_weights.
    """
    if hidden_states.dim() not in (2, 3):
        raise ValueError(f"hidden_states must be [T, H] or [B, T, H], got shape {tuple(hidden_states.shape)}")
    if input_ids.shape != hidden_states.shape[:-1]:
        raise ValueError(f"input_ids shape {tuple(input_ids.shape)} must be hidden_states' leading shape "
                         f"{tuple(hidden_states.shape[:-1])}")  # fmt: skip
    log_probs, entropy = fused_linear_logprobs(hidden_states, vocab_weights, input_ids.long(), temperature=temperature,
                                               return_entropy=True, chunk_tokens=chunk_tokens)  # fmt: skip
    return log_probs, entropy.to(hidden_states.dtype)


_VERL_CLASS = {}  # verl's own FusedLinearForPPO, kept by use_grpo_kernels_fused_linear


class FusedLinearForPPO(torch.nn.Module):
    """Stands in for verl's `FusedLinearForPPO(chunk_size, impl_backend)`: impl_backend "torch" runs
    `fused_linear_for_ppo`; "liger" runs verl's own class. chunk_size: tokens per chunk (None: grpo_kernels'
    "auto", a logits chunk of at most 256 MiB)."""

    def __init__(self, chunk_size: int | None = None, impl_backend: str = "torch"):
        super().__init__()
        if impl_backend not in ("torch", "liger"):
            raise ValueError(f"impl_backend must be 'torch' or 'liger', got {impl_backend!r}")
        self.chunk_size, self.impl_backend = chunk_size, impl_backend

    def forward(self, hidden_states, vocab_weights, input_ids, temperature=1.0):
        if self.impl_backend == "liger":
            verl_class = _VERL_CLASS.get("class") or _verl_torch_functional().FusedLinearForPPO
            return verl_class(impl_backend="liger")(hidden_states, vocab_weights, input_ids, temperature)
        chunk_tokens = "auto" if self.chunk_size is None else self.chunk_size
        return fused_linear_for_ppo(hidden_states, vocab_weights, input_ids, temperature, chunk_tokens=chunk_tokens)


def _verl_torch_functional():
    from verl.utils.experimental import torch_functional

    return torch_functional


def use_grpo_kernels_fused_linear(enable: bool = True) -> None:
    """Make verl's `use_fused_kernels` forward (impl_backend "torch") run grpo_kernels: replace FusedLinearForPPO in
    `verl.utils.experimental.torch_functional`, which verl's patched forwards (dense_common, qwen2_vl, qwen3_vl,
    qwen3_5, glm4v) import at each call. enable=False puts verl's class back. Idempotent."""
    module = _verl_torch_functional()
    if module.FusedLinearForPPO is not FusedLinearForPPO:
        _VERL_CLASS["class"] = module.FusedLinearForPPO
    module.FusedLinearForPPO = FusedLinearForPPO if enable else _VERL_CLASS.get("class", module.FusedLinearForPPO)

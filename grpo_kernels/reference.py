"""The spec: eager PyTorch definitions of every op, readable like the maths.

Every backend (Triton, C++) is tested against these functions. They compute in the dtype of their
input, so `f(x.double())` is the fp64 oracle and `f(x.bfloat16())` is "PyTorch's own bf16 computation of
the same thing" that bf16 backends must match or beat. They assume valid input (the public API checks it)
and are differentiable with autograd. Nothing here imports Triton or the compiled extension.
"""

import math

import torch

from .types import GroupAdvantages, group_sizes

__all__ = ["group_advantages", "grpo_loss", "selective_logprobs", "unpack"]


def _segment_sum(x: torch.Tensor, segment: torch.Tensor, num_groups: int) -> torch.Tensor:
    return torch.zeros(num_groups, dtype=x.dtype, device=x.device).index_add(0, segment, x)


def _sqrt0(x: torch.Tensor) -> torch.Tensor:
    """sqrt with sqrt(0) = 0 and a zero (not NaN) gradient there."""
    pos = x > 0
    return torch.where(pos, torch.sqrt(torch.where(pos, x, torch.ones_like(x))), torch.zeros_like(x))


def group_advantages(
    rewards: torch.Tensor,
    *,
    group_size: int | None = None,
    group_offsets: torch.Tensor | None = None,
    scale: str = "group",
    eps: float = 1e-6,
    std: str = "unbiased",
    min_std: float = 1e-4,
    reward_weights: torch.Tensor | None = None,
    nan: str = "error",
) -> GroupAdvantages:
    """Group-relative advantages with invalid-group masking.

    r_i    = sum_k w_k R_ik                                   (R: [N] or [N, K] rewards, w: reward_weights)
    m_g    = mean_{i in g} r_i
    s_g    = sqrt( sum_{i in g} (r_i - m_g)^2 / (n_g - c) )   c = 1 ("unbiased") or 0 ("biased"); s_g = 0 if n_g = c
    valid_g = s_g > min_std and every r_i in g is finite
    A_i    = valid_g * (r_i - m_g) / D                         D = s_g + eps  ("group")
                                                               D = S + eps    ("batch": S the std, same c, of all
                                                                               rewards in groups with finite rewards)
                                                               D = 1          ("none", Dr. GRPO)
    Groups are contiguous blocks of `group_size`, or segments [o_g, o_{g+1}) of `group_offsets`.
    A group holding a non-finite reward reports NaN mean and std (only reachable with nan="invalid").
    """
    if nan == "error" and not bool(torch.isfinite(rewards).all()):
        raise ValueError("rewards hold a non-finite value")
    columns = rewards if rewards.dim() == 2 else rewards.unsqueeze(1)
    w = torch.ones(columns.shape[1], dtype=rewards.dtype, device=rewards.device)
    if reward_weights is not None:
        w = reward_weights.to(rewards.dtype)
    finite = torch.isfinite((columns * w).sum(dim=1))
    # Rows with a non-finite reward are zeroed before combining, so they carry no NaN into any gradient.
    r0 = (torch.where(finite[:, None], columns, torch.zeros_like(columns)) * w).sum(dim=1)
    sizes = group_sizes(r0.shape[0], group_size, group_offsets, r0.device)
    num_groups = sizes.shape[0]
    segment = torch.repeat_interleave(torch.arange(num_groups, device=r0.device), sizes)
    c = 1.0 if std == "unbiased" else 0.0

    bad = _segment_sum((~finite).to(r0.dtype), segment, num_groups) > 0
    n = sizes.to(r0.dtype)
    mean = _segment_sum(r0, segment, num_groups) / n
    d = r0 - mean[segment]
    dof = n - c
    var = torch.where(dof > 0, _segment_sum(d * d, segment, num_groups) / dof.clamp(min=1), torch.zeros_like(n))
    s = _sqrt0(var)
    valid = ~bad & (s > min_std)

    if scale == "group":
        denom = s[segment] + eps
    elif scale == "batch":
        good = ~bad[segment]
        count = good.sum().to(r0.dtype)
        big_mean = torch.where(good, r0, torch.zeros_like(r0)).sum() / count.clamp(min=1)
        dev = torch.where(good, r0 - big_mean, torch.zeros_like(r0))
        big_var = torch.where(count - c > 0, (dev * dev).sum() / (count - c).clamp(min=1), torch.zeros_like(count))
        denom = _sqrt0(big_var) + eps
    elif scale == "none":
        denom = torch.ones_like(d)
    else:
        raise ValueError(f"unknown scale {scale!r}")

    adv = torch.where(valid[segment], d / denom, torch.zeros_like(d))
    nan_g = torch.full_like(mean, float("nan"))
    return GroupAdvantages(
        advantages=adv,
        valid=valid,
        group_mean=torch.where(bad, nan_g, mean),
        group_std=torch.where(bad, nan_g, s),
        invalid_fraction=1.0 - valid.to(r0.dtype).mean(),
    )


# ------------------------------------------------------------------------------------- log-probs and loss
def selective_logprobs(
    logits: torch.Tensor, ids: torch.Tensor, *, temperature: float = 1.0, return_entropy: bool = False
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Log-probability of the chosen token, and optionally the entropy, of softmax(logits / temperature).

    logps[t] = log softmax(z_t)[ids_t],   entropy[t] = -sum_v p_tv log p_tv,   z_t = logits[t] / temperature
    logits [..., V], ids [...] (int64) -> logps [...] (and entropy [...]).
    """
    logp = torch.log_softmax(logits / temperature, dim=-1)
    logps = logp.gather(-1, ids.unsqueeze(-1)).squeeze(-1)
    if not return_entropy:
        return logps
    # 0 log 0 = 0: a -inf logit (a masked vocabulary) adds nothing to the entropy and gets no gradient.
    return logps, -(logp.exp() * logp.masked_fill(logp == float("-inf"), 0.0)).sum(dim=-1)


def _vespo_phi(log_ratio, mask, valid, is_ratio, adv, k_pos, lambda_pos, k_neg, lambda_neg):
    """VESPO's gamma weight phi(v) = e^lam v^k e^(-lam v) of the sequence ratio v (phi(1) = 1), in log space:
    [B, 1] with advantages per sequence, [B, L] per token (k, lam chosen by the sign of each advantage)."""
    s = (torch.clamp(log_ratio, -20.0, 20.0) * mask).sum(-1, keepdim=True)
    floor = math.log(1e-8)
    if is_ratio is not None:  # token-level sampler weights, every position of the sequence (masked ones: r = f(0))
        s = s + (torch.clamp(torch.log(is_ratio), floor, 20.0) * valid).sum(-1, keepdim=True)
    log_v = torch.clamp(s, floor, 20.0)
    nonneg = adv >= 0
    k = torch.where(nonneg, log_v.new_tensor(k_pos), log_v.new_tensor(k_neg))
    lam = torch.where(nonneg, log_v.new_tensor(lambda_pos), log_v.new_tensor(lambda_neg)).clamp(min=1e-4)
    return torch.exp(lam + k * log_v - lam * torch.exp(log_v)).nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)


def unpack(x: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    """Packed [T, ...] with cu_seqlens [B + 1] -> padded [B, L_max, ...] (zeros past each sequence's end)."""
    lengths = cu_seqlens.diff().tolist()
    out = x.new_zeros((len(lengths), max(lengths, default=0), *x.shape[1:]))
    for b, (start, n) in enumerate(zip(cu_seqlens[:-1].tolist(), lengths, strict=True)):
        out[b, :n] = x[start : start + n]
    return out


def grpo_loss(
    logps: torch.Tensor,
    old_logps: torch.Tensor | None,
    advantages: torch.Tensor,
    *,
    ref_logps: torch.Tensor | None = None,
    mask: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | None = None,
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
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The GRPO policy loss with TRL's math and normalizers, for one micro-batch (no gradient-accumulation scaling).

    Per token (or per sequence for importance_sampling_level="sequence", GSPO):
      w = exp(logp - old)  (sequence: exp(masked mean of logp - old over the sequence))
      grpo/bnpo/dr_grpo/dapo: l = -min(w' A, clip(w, 1 - eps_low, 1 + eps_high) A), w' = min(w, delta) if delta
      (luspo: the same l as grpo)
      cispo: l = -stopgrad(min(w, eps_high)) A logp;   sapo: l = -(4 / tau) sigmoid(tau (w - 1)) A, tau by sign of A
      vespo: l = -stopgrad(phi) A logp, phi = nan_to_num(exp(lam + k log v - lam v)) (NaN, inf -> 0), (k, lam) by
        A >= 0 or A < 0, lam floored at 1e-4, v = exp(clamp(S, log 1e-8, 20)), S = sum_t m clamp(logp - old, -20, 20)
        (+ sum over the sequence's positions of clamp(log r, log 1e-8, 20) with a token-level sampler weight r)
      sampler correction: l *= r (not vespo), r = exp(old - sampler) per token or per sequence (sum), truncated at
        the cap ("*_truncate") or zeroed above it ("*_mask")
      KL (beta > 0): l += beta k3, k3 = exp(ref - logp) - (ref - logp) - 1 (times w if use_bias_correction_kl)
    Aggregation over tokens with mask m: grpo/sapo: mean_b (sum_t m l / sum_t m); luspo: mean_b sum_t m l;
    bnpo: sum m l / sum m; dr_grpo: sum m l / (B max_completion_length); dapo/cispo/vespo: sum m l /
    num_items_in_batch (default sum m). vespo's metric "vespo/phi_seq_mean" is the mean of phi over sequences (over
    masked tokens with per-token advantages); it reports no clip ratios.
    Inputs padded [B, L] with mask, or packed [T] with cu_seqlens [B + 1]; advantages [B] or per token.

    Non-finite inputs: a token with m = 0 takes no part whatever its values (NaN / inf padding is replaced by 0
    before any arithmetic, so it reaches neither the loss nor a gradient). A NaN in logps, old_logps, advantages or
    (beta > 0) ref_logps of a token with m != 0 propagates: the loss is NaN, and so is that token's gradient (every
    token's of its sequence where the sequence's ratio or dl/dw is NaN: GSPO). sampler_logps go through
    nan_to_num, as in TRL (vespo's phi too: a NaN in a sequence's ratio zeroes its phi). Ratios: this is the spec
    in fp64 (exp(100) is finite there); run in fp32 it overflows like TRL (inf * 0 = NaN gradients for clipped
    tokens above log w = 88.72), which the C++ and Triton backends avoid (see grpo_kernels.grpo_loss, "Non-finite
    values").
    """
    if cu_seqlens is not None:
        packed = {"logps": logps, "old": old_logps, "ref": ref_logps, "sampler": sampler_logps, "mask": mask}
        if advantages.shape[0] == logps.shape[0]:  # per token (when B == T, too: read per token)
            packed["adv"] = advantages
        padded = {k: None if v is None else unpack(v, cu_seqlens) for k, v in packed.items()}
        valid = unpack(torch.ones_like(logps), cu_seqlens)
        logps, old_logps, ref_logps, sampler_logps = padded["logps"], padded["old"], padded["ref"], padded["sampler"]
        mask = valid if padded["mask"] is None else padded["mask"] * valid
        advantages = padded.get("adv", advantages)
    else:
        valid = torch.ones_like(logps)  # each sequence's positions (vespo's sampler sum runs over them)
    mask = torch.ones_like(logps) if mask is None else mask.to(logps.dtype)
    on = mask != 0
    logps, old_logps, ref_logps, sampler_logps = (
        None if x is None else torch.where(on, x, 0.0) for x in (logps, old_logps, ref_logps, sampler_logps)
    )
    old = logps.detach() if old_logps is None else old_logps
    adv = advantages.unsqueeze(1) if advantages.dim() == 1 else advantages
    adv_t = torch.where(on, adv, 0.0)  # per token, masked ones zeroed (the clip metrics keep adv's shape)
    log_ratio = logps - old
    if importance_sampling_level == "token":
        log_w = log_ratio
    else:
        log_w = ((log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).unsqueeze(-1)
    w = torch.exp(log_w)
    ratio_for_metrics = w.detach()

    if beta != 0.0:
        kl = torch.exp(ref_logps - logps) - (ref_logps - logps) - 1
        if use_bias_correction_kl:
            kl = kl * w
    is_ratio = None if sampler_logps is None else _sampler_weight(old, sampler_logps, mask, sampler_is_mode,
                                                                  sampler_is_cap)  # fmt: skip
    if loss_type == "vespo":
        with torch.no_grad():
            phi = _vespo_phi(log_ratio, mask, valid, is_ratio, adv, vespo_k_pos, vespo_lambda_pos, vespo_k_neg,
                             vespo_lambda_neg)  # fmt: skip
        per_token = -phi * adv_t * logps
    elif loss_type == "cispo":
        per_token = -torch.clamp(w, max=epsilon_high).detach() * adv_t * logps
    elif loss_type in ("grpo", "bnpo", "dr_grpo", "dapo", "luspo"):
        clipped = torch.clamp(w, 1 - epsilon_low, 1 + epsilon_high)
        if delta is not None:
            w = torch.clamp(w, max=delta)
        per_token = -torch.min(w * adv_t, clipped * adv_t)
    elif loss_type == "sapo":
        tau = torch.where(adv_t > 0, sapo_temperature_pos, sapo_temperature_neg)
        per_token = -torch.sigmoid(tau * (w - 1)) * 4 / tau * adv_t
    else:
        raise ValueError(f"unknown loss_type {loss_type!r}")

    if is_ratio is not None and loss_type != "vespo":  # vespo's phi holds the sampler weights
        per_token = per_token * is_ratio
    per_token = per_token + beta * kl if beta != 0.0 else per_token

    loss = _aggregate(per_token, mask, loss_type, max_completion_length, num_items_in_batch)

    diff = None if sampler_logps is None else torch.nan_to_num((logps - sampler_logps).abs(), nan=0.0)
    extra = {"kl": kl if beta != 0.0 else None, "phi": phi if loss_type == "vespo" else None, "sampler_diff": diff}
    metrics = _metrics(w.detach(), ratio_for_metrics, adv, mask, loss_type, epsilon_low, epsilon_high, **extra)
    return loss, metrics


def _sampler_weight(old, sampler_logps, mask, mode: str, cap: float) -> torch.Tensor:
    """The truncated importance-sampling weight exp(old - sampler) per token, or per sequence (its sum), truncated at
    cap ("*_truncate") or zeroed above it ("*_mask"); NaN differences count 0 (TRL's nan_to_num)."""
    diff = torch.nan_to_num((old - sampler_logps) * mask, nan=0.0)
    if mode.startswith("sequence"):
        diff = diff.sum(dim=-1, keepdim=True)
    weight = torch.exp(diff)
    return torch.clamp(weight, max=cap) if mode.endswith("truncate") else weight.masked_fill(weight > cap, 0.0)


def _aggregate(per_token, mask, loss_type: str, max_completion_length, num_items_in_batch) -> torch.Tensor:
    """The loss from its per-token terms [B, L] with TRL's normalizer of loss_type (see grpo_loss)."""
    total = (per_token * mask).sum()
    if loss_type in ("grpo", "sapo"):
        return ((per_token * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).mean()
    if loss_type == "luspo":
        return (per_token * mask).sum(-1).mean()
    if loss_type == "bnpo":
        return total / mask.sum().clamp(min=1.0)
    if loss_type == "dr_grpo":
        return total / (per_token.shape[0] * (max_completion_length or per_token.shape[-1]))
    items = mask.sum() if num_items_in_batch is None else torch.as_tensor(num_items_in_batch, dtype=total.dtype)
    return total / items.clamp(min=1.0)


def _metrics(w, ratio, adv, mask, loss_type, epsilon_low, epsilon_high, *, kl, phi, sampler_diff) -> dict:
    """TRL's logged metrics: masked token means (plain means of per-sequence values) of the clip flags, the ratio,
    and the KL, vespo's phi and |logp - sampler| where they exist."""

    def masked_mean(x: torch.Tensor) -> torch.Tensor:
        x = x.detach().to(mask.dtype)
        if x.shape[-1] == 1:  # one value per sequence
            return x.mean()
        return (x * mask).sum() / mask.sum().clamp(min=1.0)

    low, high = (w < 1 - epsilon_low) & (adv < 0), (w > 1 + epsilon_high) & (adv > 0)
    if loss_type == "cispo":
        metrics = {"cispo_clip_ratio": masked_mean((w > epsilon_high) & (adv > 0))}
    elif loss_type == "vespo":
        metrics = {"vespo/phi_seq_mean": masked_mean(phi)}
    else:
        metrics = {"clip_ratio/low_mean": masked_mean(low), "clip_ratio/high_mean": masked_mean(high),
                   "clip_ratio/region_mean": masked_mean(low | high)}  # fmt: skip
    metrics["ratio_mean"] = masked_mean(ratio)
    if kl is not None:
        metrics["kl"] = masked_mean(kl)
    if sampler_diff is not None:
        metrics["sampler_logp_abs_diff"] = masked_mean(sampler_diff)
    return metrics

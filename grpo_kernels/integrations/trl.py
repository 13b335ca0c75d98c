"""TRL's GRPOTrainer with the LM head fused into the GRPO loss: `FusedGRPOTrainer` and `use_grpo_kernels`.

Design. TRL (1.16) computes the per-token log-probs with its own chunked LM head, then the loss from them in
`_compute_loss`. `FusedGRPOTrainer` overrides `_compute_loss` only: the decoder body runs, the hidden states
of the completion positions (TRL's alignment: positions -logits_to_keep - 1 .. -2 predict the completion
tokens) go with the LM-head weight (and bias) to `grpo_kernels.fused_linear_grpo_loss`, which computes the
loss, its gradients and the metrics chunk by chunk, never holding [T, V] logits. Generation, rewards,
advantages, old / reference / sampler log-probs, buffering and the optimizer stay TRL's.

The body and the head run inside the model's forward (reached through `model(...)`, so DDP / FSDP / PEFT
wrappers see a forward): a small wrapper is installed on the model *instance* (as TRL's own fused head is),
which, given the keyword `grpo_kernels_head`, returns that callable's result on (last hidden states, head weight,
head bias) and otherwise calls the previous forward. Under FSDP2 the head is gathered there with
`DTensor.full_tensor()`. DeepSpeed ZeRO-3 is refused: the fused loss computes its weight gradient in the
forward, when ZeRO-3 has the parameter gathered, and returns it in the backward, when it is partitioned again.

Padding-free loss forward (`packed=True`, see `trl_packing`). TRL pads prompts left and completions right to the
longest in the micro-batch, so with uneven completion lengths most of its batch can be padding. With packed=True
the loss forward strips that padding and packs every sample (its real prompt, then its completion up to its last
real token, tokens the loss mask excludes included) into one row that the decoder body runs with varlen attention
("grpo_varlen"; `shared_prefix=True` also stores each repeated prompt once); the fused loss takes the completion
tokens flat with cu_seqlens. The model's attention is routed per call, so TRL's padded forwards (generation, old /
reference log-probs) keep the model's sdpa / eager attention and gradient checkpointing recomputes the packed
layers packed. Everything else (masks, normalizers, metrics) is unchanged; the packed row restarts positions at 0
for each sample, as generation does, where TRL's padded forward shifts them by the left padding (the same numbers
for rotary embeddings up to rounding). Off by default: under bf16 autocast the packed body rounds differently
from TRL's padded one.

Every GRPOConfig option TRL's loss reads is honoured: loss_type, epsilon / epsilon_high, delta, beta (with TRL's
reference log-probs), use_bias_correction_kl, importance_sampling_level, sapo temperatures, temperature,
old log-probs (num_iterations > 1, steps_per_generation > gradient_accumulation_steps, vLLM), the vLLM
importance-sampling correction (TRL's ratio, already truncated / masked, multiplies the policy term before the
KL is added: passed as sampler log-probs old - log(ratio) with an inert cap), cast_lm_head_to_fp32, TRL's
normalizers (gradient accumulation, num_items_in_batch over processes and steps_per_generation), tool masks.
mask_truncated_completions acts on the completion mask before the loss. The logged metrics are TRL's names:
kl, entropy, clip_ratio/{low_mean,high_mean,region_mean,low_min,high_max} (also for luspo), cispo_clip_ratio or
vespo/phi_seq_mean. vespo takes TRL's importance_sampling_ratio (whenever the inputs hold one, as TRL) into its
gamma weight: the sum of its clamped logs over each sequence's positions, spread over the sequence's tokens as
sampler log-probs (see `liger_compat.vespo_sampler_logps`). The per-sequence
low_min / high_max need per-token ratios: on-policy they are exactly 1; with old log-probs they cost one extra
no-grad `fused_linear_logprobs` pass (one more [T, H] x [H, V] matmul).

top_entropy_quantile < 1 and off_policy_mask_threshold (masks on the policy term, built by TRL's own functions from
the current log-probs and entropies) cost one extra no-grad `fused_linear_logprobs` pass and travel as per-token
weights through the same sampler-log-prob route as the vLLM ratio.

An MoE model's load-balancing loss (router_aux_loss_coef) is the model's own function on its router logits, added
as TRL adds it. The entropy bonus (entropy_coef, use_adaptive_entropy and its controller) is the fused loss's
entropy_coef: the mean entropy over TRL's effective mask, its gradient computed in the same chunks, the coefficient
rescaled so that the bonus survives the policy normalizer exactly as TRL applies it (policy_loss / entropy_coef
logged as TRL does). A soft-capped head (Gemma 2's final_logit_softcapping) is computed by the fused head; a logit
scale (Cohere's logit_scale, Granite's logits_scaling, ...) is folded into the temperature.

What the fused loss does not compute raises NotImplementedError at construction, naming the option: loss_type
"vespo" with top_entropy_quantile < 1 or off_policy_mask_threshold (those masks would have to scale vespo's policy
term apart from its sampler weights), a router auxiliary loss the model computes otherwise, a PEFT adapter on the
LM head, DeepSpeed ZeRO-3, vision-language models, a head that is not a plain linear layer (see
`hf.check_plain_head`).
"""

import functools
import inspect
import re
import types

import torch
from accelerate.utils import is_peft_model
from trl import GRPOTrainer
from trl.trainer.utils import nanmax, nanmin

from ..fused_linear import fused_linear_grpo_loss, fused_linear_logprobs
from ..hf_head import backbone, check_plain_head, head_inputs, lm_head, logit_multiplier, logit_softcap
from ..liger_compat import vespo_sampler_logps
from ..options import LossOptions
from .trl_packing import PaddedLayout, pack_trl_batch, use_packed_attention

__all__ = ["FusedGRPOTrainer", "check_config", "use_grpo_kernels"]

CLIP_LOSSES = ("grpo", "bnpo", "dr_grpo", "dapo", "luspo")
FUSED_LOSSES = (*CLIP_LOSSES, "cispo", "sapo", "vespo")
TOKEN_SUM_LOSSES = ("dapo", "cispo", "vespo")  # TRL divides their masked sum by num_items_in_batch (see _normalizer)
_HEAD_KWARG = "grpo_kernels_head"
_ROUTER_MASK_KWARG = "grpo_kernels_router_mask"  # the tokens the load-balancing loss averages over (packed rows)


def _names_lm_head(pattern) -> bool:
    if pattern is None:
        return False
    if isinstance(pattern, str):  # PEFT: a regex matched against the full module name ("all-linear" skips the head)
        return pattern != "all-linear" and re.fullmatch(pattern, "lm_head") is not None
    return any(name == "lm_head" or name.endswith(".lm_head") for name in pattern)


def check_config(args=None, peft_config=None) -> None:
    """Raise NotImplementedError naming the first GRPOConfig (or PEFT) option the fused loss does not run."""
    if peft_config is not None and any(
        _names_lm_head(getattr(peft_config, key, None)) for key in ("target_modules", "modules_to_save")
    ):
        raise NotImplementedError(
            "a PEFT adapter on lm_head (peft_config target_modules / modules_to_save): grpo_kernels reads "
            "lm_head.weight directly, so the adapter would be ignored"
        )
    if args is None:
        return
    if args.loss_type not in FUSED_LOSSES:
        raise NotImplementedError(
            f"loss_type={args.loss_type!r} is not fused by grpo_kernels (supported: {', '.join(FUSED_LOSSES)})"
        )
    if args.loss_type == "vespo" and (args.top_entropy_quantile < 1.0 or args.off_policy_mask_threshold is not None):
        raise NotImplementedError(
            f"loss_type='vespo' with top_entropy_quantile={args.top_entropy_quantile} / off_policy_mask_threshold="
            f"{args.off_policy_mask_threshold}: the fused loss carries those masks as sampler weights, which vespo "
            "folds into its phi instead of its policy term"
        )


def _enable(trainer, packed: bool = False, shared_prefix: bool = False) -> None:
    """The checks that need the built trainer, the forward wrapper on the (unwrapped) policy model, and the packed
    loss forward's attention routing (see _packing)."""
    check_config(trainer.args)
    from transformers.integrations.deepspeed import is_deepspeed_zero3_enabled

    if is_deepspeed_zero3_enabled():
        raise NotImplementedError(
            "DeepSpeed ZeRO-3: the fused loss computes the LM-head gradient in the forward, while ZeRO-3 has "
            "re-partitioned the head by the backward (use FSDP2, whose sharded head is gathered with full_tensor())"
        )
    model = trainer.accelerator.unwrap_model(trainer.model)
    model = model.get_base_model() if is_peft_model(model) else model  # PEFT: the HF model inside
    check_plain_head(model)
    # A model that scales its logits (Cohere's logit_scale, ...): the fused head's temperature is T / scale.
    trainer._grpo_kernels_temperature = trainer.temperature / logit_multiplier(model.config)
    trainer._grpo_kernels_softcap = logit_softcap(model.config)  # Gemma 2: c tanh(z / c), computed by the fused head
    if trainer.aux_loss_enabled:
        _router_aux_loss_function(model, trainer.router_aux_loss_coef)  # raises when the model computes it otherwise
    trainer._grpo_kernels_packed = _packing(trainer, model, packed, shared_prefix)
    trainer._grpo_kernels_shared_prefix = shared_prefix
    tokenizer = getattr(trainer, "_tokenizer", trainer.processing_class)
    trainer._grpo_kernels_pad_token_id = getattr(tokenizer, "pad_token_id", None)
    if not getattr(model.forward, "_grpo_kernels", False):
        previous = model.forward

        @functools.wraps(type(model).forward)  # keep the signature generate() validates its kwargs against
        def forward(self, *args, **kwargs):
            head = kwargs.pop(_HEAD_KWARG, None)
            router_mask = kwargs.pop(_ROUTER_MASK_KWARG, None)
            if head is None:
                return previous(*args, **kwargs)
            kwargs["use_cache"] = False
            out = backbone(self)(*args, **kwargs)
            result = head(out.last_hidden_state, *lm_head(self))
            if not kwargs.get("output_router_logits"):
                return result
            aux = _router_aux_loss_function(self)(out.router_logits, self.num_experts, self.num_experts_per_tok,
                                                  kwargs.get("attention_mask") if router_mask is None
                                                  else router_mask)  # fmt: skip
            return result, aux

        forward._grpo_kernels = True
        model.forward = types.MethodType(forward, model)


def _check_packing_options(packed, shared_prefix) -> None:
    if not isinstance(packed, bool) or not isinstance(shared_prefix, bool):
        raise TypeError(f"packed and shared_prefix must be bools, got {packed!r}, {shared_prefix!r}")
    if shared_prefix and not packed:
        raise ValueError("shared_prefix=True shares prompts inside the packed loss forward: it needs packed=True")


def _packing(trainer, model, packed, shared_prefix) -> bool:
    """Whether the loss forward runs packed (grpo_kernels.integrations.trl_packing): NotImplementedError naming the
    option where packed=True / shared_prefix=True cannot be honoured."""
    _check_packing_options(packed, shared_prefix)
    if shared_prefix and trainer.aux_loss_enabled:
        raise NotImplementedError(
            f"shared_prefix=True with router_aux_loss_coef={trainer.router_aux_loss_coef}: the load-balancing loss "
            "would count each shared prompt once instead of once per sample (use shared_prefix=False)"
        )
    if packed:
        try:
            use_packed_attention(model, shared_prefix=shared_prefix)
        except NotImplementedError as error:
            raise NotImplementedError(f"packed=True: {error} (use packed=False)") from None
    return packed


def _router_aux_loss_function(model, coef=None):
    """The MoE load-balancing loss as the model's own CausalLM forward computes it: its module's
    `load_balancing_loss_func(router_logits, model.num_experts, model.num_experts_per_tok, attention_mask)`
    (Mixtral, Qwen2-MoE, ...); NotImplementedError naming router_aux_loss_coef for a model built otherwise."""
    function = getattr(inspect.getmodule(type(model)), "load_balancing_loss_func", None)
    if function is None or not all(hasattr(model, a) for a in ("num_experts", "num_experts_per_tok")):
        raise NotImplementedError(
            f"router_aux_loss_coef={coef}: {type(model).__name__} does not compute its load-balancing loss the way "
            "the fused path reproduces it (load_balancing_loss_func, num_experts, num_experts_per_tok); set "
            "router_aux_loss_coef=0.0 to train without it"
        )
    return function


def _loss_options(trainer, inputs, old, mask) -> dict:
    """fused_linear_grpo_loss's keyword arguments for this micro-batch (num_items_in_batch: see _normalizer)."""
    args = trainer.args
    vespo = trainer.loss_type == "vespo"
    # TRL: vespo reads the ratio whenever the inputs hold one; the others only with the vLLM correction on.
    sampler = "importance_sampling_ratio" in inputs if vespo else (
        trainer.use_vllm and trainer.vllm_importance_sampling_correction)  # fmt: skip
    # TRL multiplies the policy term by its ratio (truncated or masked already). As sampler log-probs
    # old - log(ratio), the kernel's exp(old - sampler) is that ratio; the cap (float32 max) never binds.
    options = LossOptions(
        loss_type=trainer.loss_type, epsilon_low=trainer.epsilon_low, epsilon_high=trainer.epsilon_high,
        delta=args.delta if trainer.loss_type in CLIP_LOSSES else None, beta=trainer.beta,
        importance_sampling_level=trainer.importance_sampling_level,
        max_completion_length=trainer.max_completion_length, use_bias_correction_kl=args.use_bias_correction_kl,
        sapo_temperature_pos=args.sapo_temperature_pos, sapo_temperature_neg=args.sapo_temperature_neg,
        vespo_k_pos=args.vespo_k_pos, vespo_lambda_pos=args.vespo_lambda_pos, vespo_k_neg=args.vespo_k_neg,
        vespo_lambda_neg=args.vespo_lambda_neg,
        **(dict(sampler_is_mode="token_truncate", sampler_is_cap=torch.finfo(torch.float32).max) if sampler else {}),
    )  # fmt: skip
    sampler_logps = None
    if sampler and vespo:  # into phi: each sequence's clamped log-ratio sum (TRL computes old with vLLM)
        sampler_logps = vespo_sampler_logps(old, mask, inputs["importance_sampling_ratio"])
    elif sampler:  # log(0) is floored at -1e4, whose exp is exactly 0
        log_ratio = torch.log(inputs["importance_sampling_ratio"].float()).clamp(min=-1e4).expand_as(old)
        sampler_logps = old - log_ratio
    return dict(
        mask=mask, ref_logps=inputs["ref_per_token_logps"] if trainer.beta != 0.0 else None,
        num_items_in_batch=1.0 if trainer.loss_type in TOKEN_SUM_LOSSES else None, sampler_logps=sampler_logps,
        **options.kwargs(),
    )  # fmt: skip


def _policy_term_weights(trainer, inputs, options, old, advantages, mask, h, w, b, layout):
    """TRL's masks on the policy term, top_entropy_quantile (tokens below the batch's entropy quantile) and
    off_policy_mask_threshold (negative-advantage sequences that drifted too far from the sampler): both multiply
    the per-token policy loss (before the KL term, the normalizers unchanged), as TRL's vLLM ratio does, so they go
    into the same sampler log-probs old - log(weight) (log 0 floored at -1e4, whose exp is 0). They need the current
    log-probs and entropies first: one no-grad `fused_linear_logprobs` pass, whose log-probs are also the old ones
    when TRL has none (its old = logps.detach()). The masks are TRL's own functions on them. Returns (old, options,
    the entropy bonus's token mask: mask x the entropy mask, and the mean entropy over it; both None without
    top_entropy_quantile)."""
    with torch.no_grad():
        logps, entropies = fused_linear_logprobs(h.detach(), w.detach(), layout.ids,
                                                 temperature=trainer._grpo_kernels_temperature,
                                                 softcap=trainer._grpo_kernels_softcap,
                                                 bias=None if b is None else b.detach(), return_entropy=True)
        logps, entropies = layout.padded(logps), layout.padded(entropies)  # TRL's [B, C] for its mask functions
    old = logps if old is None else old
    options = dict(options)
    log_w = torch.zeros_like(old) if options.get("sampler_logps") is None else old - options["sampler_logps"]
    entropy_mask = None
    if trainer.top_entropy_quantile < 1.0:
        keep = trainer.get_high_entropy_mask(entropies, mask, 1 - trainer.top_entropy_quantile)
        log_w = log_w + torch.log(keep.float()).clamp(min=-1e4)
        entropy_mask = (mask * keep).float()
    if trainer.off_policy_mask_threshold is not None:
        a = advantages.unsqueeze(1) if advantages.dim() == 1 else advantages
        keep = trainer.get_off_policy_mask(advantages=a, per_token_logps=logps,
                                           sampling_per_token_logps=inputs.get("sampling_per_token_logps", old),
                                           mask=mask, off_policy_threshold=trainer.off_policy_mask_threshold)
        log_w = log_w + torch.log(keep.float()).clamp(min=-1e4)
    options.update(sampler_logps=old - log_w.clamp(min=-1e4), sampler_is_mode="token_truncate",
                   sampler_is_cap=torch.finfo(torch.float32).max)  # fmt: skip
    bonus_entropy = None if entropy_mask is None else (entropies * entropy_mask).sum() / entropy_mask.sum().clamp(
        min=1.0)  # fmt: skip
    return old, options, entropy_mask, bonus_entropy


def _normalizer(trainer, inputs, mode):
    """What TRL divides the micro-batch loss by (dapo / cispo: the fused loss is their masked sum)."""
    accumulation = trainer.current_gradient_accumulation_steps if mode == "train" else 1.0
    if trainer.loss_type in TOKEN_SUM_LOSSES:
        normalizer = inputs["num_items_in_batch"].clamp(min=1.0) / trainer.accelerator.num_processes
        return normalizer * accumulation / trainer.args.steps_per_generation if mode == "train" else normalizer
    return accumulation


def _fused_compute_loss(self, model, inputs):
    """TRL's `_compute_loss` with the LM head fused into the loss (grpo_kernels.integrations.trl)."""
    completion_mask = inputs["completion_mask"]
    layout = PaddedLayout(inputs)
    if self._grpo_kernels_packed:  # per-token tensors stay TRL's [B, C]; layout.flat at the fused calls
        layout = pack_trl_batch(inputs, pad_token_id=self._grpo_kernels_pad_token_id,
                                shared_prefix=self._grpo_kernels_shared_prefix)  # fmt: skip
    flat = layout.flat
    mask = completion_mask if "tool_mask" not in inputs else completion_mask * inputs["tool_mask"]
    mode = "train" if self.model.training else "eval"
    old, advantages = inputs.get("old_per_token_logps"), inputs["advantages"]
    options = _loss_options(self, inputs, old, mask)
    extremes = self.loss_type in CLIP_LOSSES and old is not None  # low_min / high_max need the current log-probs
    normalizer = _normalizer(self, inputs, mode)
    accumulation = self.current_gradient_accumulation_steps if mode == "train" else 1.0
    bonus = self._entropy_bonus_enabled
    # TRL: loss / normalizer - coef * H / accumulation, H the mean entropy over the effective mask. The fused loss
    # is divided by the normalizer below, so its coefficient is coef * normalizer / accumulation.
    coef = float(_entropy_coef(self) * normalizer / accumulation) if bonus else 0.0

    def head(hidden, weight, bias):
        h, w, b = head_inputs(layout.hidden(hidden), weight, bias, fp32=self.args.cast_lm_head_to_fp32)
        if not torch.is_grad_enabled():  # eval: no gradient buffers
            h, w, b = (None if x is None else x.detach() for x in (h, w, b))
        fused = dict(temperature=self._grpo_kernels_temperature, softcap=self._grpo_kernels_softcap)
        with torch.autocast(h.device.type, enabled=False):
            old_logps, opts, entropy_mask, bonus_entropy = old, options, None, None
            if self.top_entropy_quantile < 1.0 or self.off_policy_mask_threshold is not None:
                old_logps, opts, entropy_mask, bonus_entropy = _policy_term_weights(
                    self, inputs, options, old, advantages, mask, h, w, b, layout)  # fmt: skip
            loss, metrics = fused_linear_grpo_loss(
                h, w, layout.ids, flat(advantages), bias=b, old_logps=flat(old_logps), return_entropy=True,
                entropy_coef=coef, entropy_mask=flat(entropy_mask), **fused, **{k: flat(v) for k, v in opts.items()},
                **layout.loss_kwargs,
            )  # fmt: skip
            if bonus:  # the bonus's mean entropy and token count (TRL's effective mask)
                metrics["bonus_entropy"] = metrics["entropy"] if entropy_mask is None else bonus_entropy
                metrics["bonus_tokens"] = (mask if entropy_mask is None else entropy_mask).sum().float()
            logps = None
            if extremes:
                logps = fused_linear_logprobs(h.detach(), w.detach(), layout.ids,
                                              bias=None if b is None else b.detach(), **fused)  # fmt: skip
                logps = layout.padded(logps)
        return loss, metrics, logps

    call = {_HEAD_KWARG: head}
    if self.aux_loss_enabled:
        call.update({"output_router_logits": True, _ROUTER_MASK_KWARG: layout.router_mask()})
    with self.accelerator.autocast(), layout.forward():
        out = model(**layout.model_kwargs(), **call)
    (loss, metrics, logps), aux = out if self.aux_loss_enabled else (out, None)
    _log_metrics(self, mode, metrics, mask, advantages, logps, old)
    if bonus:
        _entropy_bonus_step(self, mode, loss.detach() + coef * metrics["bonus_entropy"], normalizer, metrics)
    loss = loss / normalizer
    if aux is not None:  # TRL: the router's load-balancing loss, scaled for gradient accumulation only
        loss = loss + self.router_aux_loss_coef * aux / (self.current_gradient_accumulation_steps
                                                         if mode == "train" else 1.0)  # fmt: skip
        self._metrics[mode]["aux_loss"].append(self.accelerator.gather_for_metrics(aux).mean().item())
    return loss


def _entropy_coef(trainer) -> float:
    """The coefficient TRL applies this step: entropy_coef, or with adaptive control entropy_coef only while the last
    window's entropy is at or below entropy_target (both from the end of the previous optimizer step)."""
    if trainer.use_adaptive_entropy and trainer._last_world_entropy > trainer.args.entropy_target:
        return 0.0
    return trainer.entropy_coef


def _entropy_bonus_step(trainer, mode, policy_loss, normalizer, metrics) -> None:
    """TRL's bookkeeping of the entropy bonus: the policy_loss metric (before the bonus; divided by the normalizer
    for the token-sum losses, as TRL logs it), and the adaptive controller (window sums of entropy and tokens over
    the effective mask, reduced over processes at the optimizer step, coef moved by entropy_coef_delta within
    [entropy_coef_min, entropy_coef_max]); entropy_coef logged at every train optimizer step."""
    if trainer.loss_type in TOKEN_SUM_LOSSES:
        policy_loss = policy_loss / normalizer
    log = trainer._metrics[mode]
    log["policy_loss"].append(trainer.accelerator.gather(policy_loss).nanmean().item())
    args = trainer.args
    if trainer.use_adaptive_entropy and mode == "train":
        tokens = metrics["bonus_tokens"]
        stats = torch.stack([metrics["bonus_entropy"] * tokens, tokens]).detach()
        window = trainer._entropy_window_stats
        trainer._entropy_window_stats = stats if window is None else window + stats
        if trainer.accelerator.sync_gradients:
            total = trainer.accelerator.reduce(trainer._entropy_window_stats, reduction="sum")
            world = (total[0] / total[1].clamp(min=1.0)).item()
            if world <= args.entropy_target:
                trainer.entropy_coef = min(trainer.entropy_coef + args.entropy_coef_delta, args.entropy_coef_max)
            else:
                trainer.entropy_coef = max(trainer.entropy_coef - args.entropy_coef_delta, args.entropy_coef_min)
            trainer._last_world_entropy, trainer._entropy_window_stats = world, None
    if mode == "train" and trainer.accelerator.sync_gradients:
        log["entropy_coef"].append(trainer.entropy_coef)


def _log_metrics(trainer, mode, metrics, mask, advantages, logps, old) -> None:
    """TRL's loss metrics: means reduced over processes as (sum, count), clip extremes gathered per sequence."""
    log = trainer._metrics[mode]
    tokens = mask.sum().float()
    seq_level = trainer.importance_sampling_level == "sequence" and advantages.dim() == 1
    per_seq = torch.tensor(float(mask.shape[0]), device=tokens.device)

    def global_mean(value, count):
        totals = trainer.accelerator.reduce(torch.stack([value.float() * count, count]), reduction="sum")
        return (totals[0] / totals[1].clamp(min=1.0)).item()

    if trainer.beta != 0.0:
        log["kl"].append(global_mean(metrics["kl"], tokens))
    log["entropy"].append(global_mean(metrics["entropy"], tokens))
    count = per_seq if seq_level else tokens
    if trainer.loss_type in CLIP_LOSSES:
        for name in ("low_mean", "high_mean", "region_mean"):
            log[f"clip_ratio/{name}"].append(global_mean(metrics[f"clip_ratio/{name}"], count))
        low, high = _clip_flags(trainer, mask, advantages, logps, old)
        log["clip_ratio/low_min"].append(nanmin(trainer.accelerator.gather(_seq_mean(low, mask))).item())
        log["clip_ratio/high_max"].append(nanmax(trainer.accelerator.gather(_seq_mean(high, mask))).item())
    elif trainer.loss_type == "cispo":
        log["cispo_clip_ratio"].append(global_mean(metrics["cispo_clip_ratio"], count))
    elif trainer.loss_type == "vespo":  # phi is one value per sequence (per token with per-token advantages)
        phi_count = per_seq if advantages.dim() == 1 else tokens
        log["vespo/phi_seq_mean"].append(global_mean(metrics["vespo/phi_seq_mean"], phi_count))


def _clip_flags(trainer, mask, advantages, logps, old):
    """TRL's is_low_clipped / is_high_clipped, [B, T] (token level) or [B, 1] (sequence level)."""
    log_ratio = torch.zeros_like(mask, dtype=torch.float32) if logps is None else logps - old
    if trainer.importance_sampling_level == "sequence":
        log_ratio = ((log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).unsqueeze(-1)
    ratio = torch.exp(log_ratio)
    if trainer.args.delta is not None:
        ratio = ratio.clamp(max=trainer.args.delta)
    a = advantages.unsqueeze(1) if advantages.dim() == 1 else advantages
    return (ratio < 1 - trainer.epsilon_low) & (a < 0), (ratio > 1 + trainer.epsilon_high) & (a > 0)


def _seq_mean(flags, mask):
    """Per-sequence mean of flags over the mask (NaN for an empty sequence, as TRL's masked_seq_mean)."""
    if flags.shape[1] == 1:
        return flags.float().squeeze(1)
    return (flags.float() * mask).sum(-1) / mask.sum(-1)


class FusedGRPOTrainer(GRPOTrainer):
    """`trl.GRPOTrainer` whose training loss runs `grpo_kernels.fused_linear_grpo_loss` on the hidden states and
    the LM head (no [T, V] logits). Same constructor, config and logged metric names; options the fused loss
    cannot run raise NotImplementedError here (see the module docstring).

    Two keyword arguments of its own: `packed=True` runs the loss forward padding-free (one packed row, the model's
    attention routed to grpo_varlen for it; NotImplementedError where that cannot be honoured), `shared_prefix=True`
    (with packed=True) lets samples with identical prompt ids share one copy of the prompt in that row.
    """

    def __init__(self, *args, packed: bool = False, shared_prefix: bool = False, **kwargs):
        bound = inspect.signature(GRPOTrainer.__init__).bind(self, *args, **kwargs).arguments
        check_config(bound.get("args"), bound.get("peft_config"))  # fail before TRL loads anything
        _check_packing_options(packed, shared_prefix)
        super().__init__(*args, **kwargs)
        _enable(self, packed, shared_prefix)

    _compute_loss = _fused_compute_loss


def use_grpo_kernels(trainer: GRPOTrainer, *, packed: bool = False, shared_prefix: bool = False) -> GRPOTrainer:
    """Switch an existing GRPOTrainer (or a subclass instance) to the fused loss, in place; returns it.

    Checks the options as FusedGRPOTrainer does, installs the forward wrapper on its model and binds the fused
    `_compute_loss` on this instance only (no class is patched). A subclass's own `_compute_loss` is replaced.
    `packed` and `shared_prefix` as FusedGRPOTrainer's.
    """
    if not isinstance(trainer, GRPOTrainer):
        raise TypeError(f"use_grpo_kernels takes a trl.GRPOTrainer, got {type(trainer).__name__}")
    _enable(trainer, packed, shared_prefix)
    trainer._compute_loss = types.MethodType(_fused_compute_loss, trainer)
    return trainer

"""An HF causal LM's decoder body and LM head, as the fused loss and log-probs read them: the trainer's policy and the
drop-ins for other trainers (grpo_kernels.integrations) share these.

`lm_head(model)` returns the head's weight and bias. Inside the model's forward FSDP has swapped in the unsharded
parameters; a head still sharded as DTensors (FSDP2) is all-gathered with the differentiable
`DTensor.full_tensor()`. The head's logits are h W^T + b, soft-capped when the config sets
`final_logit_softcapping` (Gemma 2: c tanh(z / c)), scaled when it sets a logit scale (Cohere's `logit_scale`,
Granite's `logits_scaling`, ...: folded into the temperature). `check_plain_head` raises NotImplementedError for
anything else: a head that is not a plain linear layer (a PEFT adapter), quantized heads.
"""

import torch

__all__ = ["backbone", "check_plain_head", "head_inputs", "lm_head", "logit_multiplier", "logit_softcap"]


def logit_multiplier(config) -> float:
    """The factor a model's forward multiplies its logits by, from the (text) config: `logit_scale` (Cohere),
    `output_multiplier`, `lm_head_multiplier` (Falcon-H1), or 1 / `logits_scaling` (Granite, MiniCPM3; HyperCLOVA X
    multiplies by it); 1.0 when none is set. The fused head folds it into the temperature: log_softmax(s z / T) is
    log_softmax(z / (T / s))."""
    config = config.get_text_config()
    for name in ("logit_scale", "output_multiplier", "lm_head_multiplier"):
        value = getattr(config, name, None)
        if value is not None:
            return _positive(name, value)
    value = getattr(config, "logits_scaling", None)
    if value is None:
        return 1.0
    value = _positive("logits_scaling", value)
    return value if config.model_type == "hyperclovax" else 1.0 / value


def _positive(name, value) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < float("inf"):
        raise NotImplementedError(f"the model config sets {name}={value!r}: the fused LM head needs a finite "
                                  "value > 0 there")  # fmt: skip
    return float(value)


def logit_softcap(config) -> float | None:
    """The soft-cap the fused head applies to h W^T + b, or None: from the config's `final_logit_softcapping` c
    (Gemma 2: logits c tanh(z / c)). With a logit scale s as well (applied first, as TRL's distillation trainer
    does), c tanh(s z / c) = s (c / s) tanh(z / (c / s)): the cap becomes c / s and s goes into the temperature."""
    value = getattr(config.get_text_config(), "final_logit_softcapping", None)
    if value is None:
        return None
    return _positive("final_logit_softcapping", value) / logit_multiplier(config)


def check_plain_head(model) -> None:
    """Raise NotImplementedError unless the model's logits are `lm_head(h)` of an unadapted float nn.Linear, scaled
    (`logit_multiplier`) or soft-capped (`logit_softcap`)."""
    config = model.config
    if config.get_text_config() is not config:
        raise NotImplementedError(
            f"{type(model).__name__} is a vision-language model: grpo_kernels runs text-only causal LMs"
        )
    logit_multiplier(config)  # raises on a scale it cannot fold
    logit_softcap(config)
    head = model.get_output_embeddings()
    if not isinstance(head, torch.nn.Linear):
        raise NotImplementedError(
            f"the LM head is a {type(head).__name__}, not a torch.nn.Linear (a PEFT/LoRA adapter or modules_to_save "
            "on the LM head?): grpo_kernels reads lm_head.weight directly, so an adapter would be ignored"
        )
    if not head.weight.is_floating_point():
        raise NotImplementedError(f"the LM head weight is {head.weight.dtype}: quantized LM heads are not fused")


def backbone(model):
    """The decoder body of an HF causal LM (`model.base_model`), which returns `last_hidden_state`."""
    body = model.base_model
    if body is model:
        raise NotImplementedError(f"{type(model).__name__} exposes no decoder body (base_model_prefix)")
    return body


def lm_head(model) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(weight `[V, H]`, bias `[V]` or None) of the LM head, gathered if sharded as DTensors (FSDP2)."""
    check_plain_head(model)
    head = model.get_output_embeddings()
    weight, bias = head.weight, head.bias
    from torch.distributed.tensor import DTensor

    if isinstance(weight, DTensor):
        weight = weight.full_tensor()
    if isinstance(bias, DTensor):
        bias = bias.full_tensor()
    return weight, bias


def head_inputs(hidden, weight, bias, *, fp32: bool = False):
    """hidden, weight, bias in one dtype: float32 (fp32=True), else the autocast dtype if autocast is on, else
    the weight's. The casts are differentiable (no-ops when the dtype already matches)."""
    if fp32:
        dtype = torch.float32
    elif torch.is_autocast_enabled(hidden.device.type):
        dtype = torch.get_autocast_dtype(hidden.device.type)
    else:
        dtype = weight.dtype
    return hidden.to(dtype), weight.to(dtype), None if bias is None else bias.to(dtype)

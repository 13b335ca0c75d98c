"""Per-token log-probs of an HF causal LM without logits, and the LM-head access the TRL integration shares.

Design. An HF causal LM is a decoder body (`model.base_model`, returning `last_hidden_state`) followed by the
LM head. `compute_logprobs` runs the body only and projects its hidden states through the head with
`fused_linear_logprobs`, chunk by chunk, so [T, V] logits never exist. Position i of the hidden states predicts
token i + 1, the same shift as `log_softmax(model(input_ids).logits[:, :-1]).gather(input_ids[:, 1:])`; with
`logits_to_keep=k` only the last k tokens are scored (TRL's convention: they are the completion).

`lm_head(model)` returns the head's weight and bias. Inside the model's forward FSDP has swapped in the unsharded
parameters; a head still sharded as DTensors (FSDP2) is all-gathered with the differentiable
`DTensor.full_tensor()`. The head's logits are h W^T + b, soft-capped when the config sets
`final_logit_softcapping` (Gemma 2: c tanh(z / c)), scaled when it sets a logit scale (Cohere's `logit_scale`,
Granite's `logits_scaling`, ...: folded into the temperature). It raises NotImplementedError for anything else:
a head that is not a plain linear layer (a PEFT adapter), quantized heads.
"""

import torch

from ..fused_linear import fused_linear_logprobs
from ..packing import PackedBatch

__all__ = ["backbone", "check_plain_head", "compute_logprobs", "head_inputs", "lm_head", "logit_multiplier",
           "logit_softcap"]


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


@torch.no_grad()
def compute_logprobs(model, input_ids: torch.Tensor | None, *, attention_mask: torch.Tensor | None = None,
                     logits_to_keep: int | None = None, temperature: float = 1.0, packed: PackedBatch | None = None,
                     chunk_tokens: int | str = "auto") -> torch.Tensor:  # fmt: skip
    """log softmax(logits / temperature) of each next token, from the hidden states and the LM head, no logits.

    For old / reference log-probs in hand-written loops: the result carries no gradient.

    Args:
        model: an HF causal LM (`AutoModelForCausalLM`), text-only, plain linear LM head (see `lm_head`).
        input_ids: `[B, L]` int64 (None with `packed`).
        attention_mask: `[B, L]`, passed to the model (left or right padding).
        logits_to_keep: score only the last k tokens (k <= L - 1); default: tokens 1 .. L - 1.
        temperature: the sampling temperature.
        packed: a `grpo_kernels.packing.PackedBatch`: the model runs the packed row
            (`model.base_model(**packed.model_kwargs())`, which needs a varlen attention such as
            `attn_implementation="grpo_varlen"`) and every completion token is scored.
        chunk_tokens: rows per logits chunk for `fused_linear_logprobs` ("auto": at most 256 MiB).

    Returns:
        float32 `[B, L - 1]` (or `[B, logits_to_keep]`): entry j is the log-prob of the token that follows
        position j (padding positions hold the log-prob of whatever id is there: mask them); with `packed`,
        `[N]`, one per completion token in `packed.completion_ids` order (`packed.completions(x)` pads them).
    """
    weight, bias = lm_head(model)
    if packed is not None:
        if input_ids is not None or attention_mask is not None or logits_to_keep is not None:
            raise ValueError("with packed, pass input_ids=None and no attention_mask / logits_to_keep")
        hidden = backbone(model)(**packed.model_kwargs()).last_hidden_state[0][packed.logit_rows]
        ids = packed.completion_ids
    else:
        if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2:
            raise ValueError("input_ids must be a [B, L] tensor (or None with packed)")
        length = input_ids.shape[1]
        keep = length - 1 if logits_to_keep is None else logits_to_keep
        if isinstance(keep, bool) or not isinstance(keep, int) or not 1 <= keep <= length - 1:
            raise ValueError(f"logits_to_keep must be an int in [1, {length - 1}], got {logits_to_keep!r}")
        if attention_mask is not None and (not isinstance(attention_mask, torch.Tensor)
                                           or attention_mask.shape != input_ids.shape):  # fmt: skip
            got = tuple(attention_mask.shape) if isinstance(attention_mask, torch.Tensor) else type(attention_mask)
            raise ValueError(f"attention_mask must be a tensor shaped like input_ids {tuple(input_ids.shape)}, "
                             f"got {got}")  # fmt: skip
        out = backbone(model)(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
        hidden = out.last_hidden_state[:, length - keep - 1 : length - 1]
        ids = input_ids[:, length - keep :]
    hidden, weight, bias = head_inputs(hidden, weight, bias)
    with torch.autocast(hidden.device.type, enabled=False):
        return fused_linear_logprobs(hidden, weight, ids, bias=bias, chunk_tokens=chunk_tokens,
                                     temperature=temperature / logit_multiplier(model.config),
                                     softcap=logit_softcap(model.config))  # fmt: skip

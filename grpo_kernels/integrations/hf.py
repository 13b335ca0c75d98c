"""Per-token log-probs of an HF causal LM without logits (the body and head access: grpo_kernels.hf_head).

Design. An HF causal LM is a decoder body (`model.base_model`, returning `last_hidden_state`) followed by the
LM head. `compute_logprobs` runs the body only and projects its hidden states through the head with
`fused_linear_logprobs`, chunk by chunk, so [T, V] logits never exist. Position i of the hidden states predicts
token i + 1, the same shift as `log_softmax(model(input_ids).logits[:, :-1]).gather(input_ids[:, 1:])`; with
`logits_to_keep=k` only the last k tokens are scored (TRL's convention: they are the completion).
"""

import torch

from ..fused_linear import fused_linear_logprobs
from ..hf_head import backbone, head_inputs, lm_head, logit_multiplier, logit_softcap
from ..packing import PackedBatch

__all__ = ["compute_logprobs"]


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

"""The policy a run trains: an HF causal LM with the fused LM-head loss inside its forward (`Policy`), run on a packed
micro-batch whole or, under sequence parallelism, as this rank's shard (`run_policy`), and the per-token log-probs of
a packed batch without logits (`completion_logprobs`)."""

import torch

from ...attention import HF_ATTENTION_NAME
from ...fused_linear import fused_linear_grpo_loss, fused_linear_logprobs
from ...hf_head import check_plain_head, logit_multiplier, logit_softcap
from ...loss import grpo_loss
from ...sequence_parallel import shard_packed
from .fsdp import SINGLE, Dist

__all__ = ["Policy", "completion_logprobs", "run_policy"]


class Policy(torch.nn.Module):
    """A causal LM with the fused LM-head loss inside its forward, never building logits.

    FSDP2 unshards a module's own parameters around its forward, so wrapping the loss in the root module is what
    lets the fused kernels read the full LM-head weight (and send its gradient back to the shards).
    compute_dtype: hidden states and head weight are cast to it before the loss (bf16 under autocast)."""

    def __init__(self, model: torch.nn.Module, *, compute_dtype: torch.dtype | None = None):
        super().__init__()
        self.model = model
        self.compute_dtype = compute_dtype
        check_plain_head(model)  # the head's logits: h W^T + b, scaled (into the temperature) or soft-capped
        self.logit_scale, self.softcap = logit_multiplier(model.config), logit_softcap(model.config)

    def forward(self, inputs: dict, logit_rows: torch.Tensor, completion_ids: torch.Tensor,
                advantages: torch.Tensor | None = None, *, temperature: float, **loss_options):  # fmt: skip
        """Per-token log-probs of completion_ids (advantages None), else (loss, metrics) of the fused loss.

        inputs holding "sequence_parallel" (a SequenceShard): logit_rows / completion_ids are the shard's own; the
        log-probs are gathered over the group and the loss computed from the whole row's on every rank."""
        shard = inputs.get("sequence_parallel")
        h = self.model.base_model(**inputs).last_hidden_state[0][logit_rows]
        lm_head = self.model.get_output_embeddings()
        dtype = self.compute_dtype or lm_head.weight.dtype
        h, head = h.to(dtype), lm_head.weight.to(dtype)
        bias = None if lm_head.bias is None else lm_head.bias.to(dtype)
        kw = dict(bias=bias, temperature=temperature / self.logit_scale, softcap=self.softcap)
        if shard is not None:
            logps = shard.gather(fused_linear_logprobs(h, head, completion_ids, **kw))
            if advantages is None:
                return logps
            old = loss_options.pop("old_logps", None)
            return grpo_loss(logps, old, advantages, **loss_options)
        if advantages is None:
            return fused_linear_logprobs(h, head, completion_ids, **kw)
        return fused_linear_grpo_loss(h, head, completion_ids, advantages, **kw, **loss_options)


def run_policy(policy, packed, advantages=None, *, dist: Dist = SINGLE, **options):
    """The policy on a packed micro-batch: whole, or this rank's shard of it under sequence parallelism."""
    if packed.prefix_groups is not None:
        attn = getattr(policy.model.config, "_attn_implementation", None)
        if attn != HF_ATTENTION_NAME:  # HF's own packing detection splits at position 0 only: groups would mix
            raise ValueError(f"a shared-prefix packed batch needs attn_implementation={HF_ATTENTION_NAME!r}; this "
                             f"model runs {attn!r}, whose completions of a group would attend to each other (pack "
                             "with shared_prefix=False, or load the model with grpo_varlen)")  # fmt: skip
    if dist.sp > 1:
        shard = shard_packed(packed, group=dist.sp_group)
        return policy(shard.model_kwargs(), shard.logit_rows, shard.completion_ids, advantages, **options)
    return policy(packed.model_kwargs(), packed.logit_rows, packed.completion_ids, advantages, **options)


def completion_logprobs(policy, packed, *, temperature: float, dist: Dist = SINGLE) -> torch.Tensor:
    """Per-completion-token log-probs of a packed batch under a Policy (or a bare HF model); no grad, no logits.
    Under sequence parallelism (dist.sp > 1) every rank of the group gets the whole batch's log-probs.

    An FSDP2 root keeps its own parameters (embeddings, final norm, LM head) gathered after a forward, for the
    backward that follows; this forward has none, so they go back to their shards (the reference policy, which
    never runs a backward, would hold them whole on every rank for the whole run)."""
    if not isinstance(policy, Policy):
        policy = Policy(policy)
    with torch.no_grad():
        logps = run_policy(policy, packed, temperature=temperature, dist=dist)
    if hasattr(policy, "reshard"):  # an FSDPModule
        policy.reshard()
    return logps

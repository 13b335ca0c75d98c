"""Samplers: G completions per prompt, with the sampler's own per-token log-probs.

Every sampler draws group k with its own seed `seeds[k]`, so a prompt's completions do not depend on which other
prompts share the call (or the rank): 1 and N data-parallel ranks sample the same rollout.

`HFSampler` runs transformers' `generate` on a local model (SDPA attention while generating, the packed
"grpo_varlen" attention restored afterwards): the training model itself in a single process, or a full copy
that `load_weights` refreshes after every optimizer step when the training model is sharded. A group's G copies
of one prompt have equal lengths, so no padding mask is needed; groups are generated one after another.
"""

from dataclasses import dataclass

import torch

__all__ = ["HFSampler", "Rollout"]


@dataclass(frozen=True, slots=True)
class Rollout:
    """Sampled completions of a batch of prompts, G per prompt, sample i belonging to group i // G."""

    prompt_ids: list
    """list[Tensor]: the prompt of every sample (G equal entries per group)."""
    completion_ids: list
    """list[Tensor]: every sample's completion, up to and including <eos> when it was generated."""
    sampler_logps: list
    """list[Tensor]: the sampler's log-prob of each completion token (at the sampling temperature)."""
    group_size: int


class HFSampler:
    """Batched `generate` on a local HF model."""

    def __init__(self, model, *, eos_id: int, pad_id: int, max_new_tokens: int, temperature: float = 1.0,
                 top_p: float = 1.0):  # fmt: skip
        self.model, self.eos_id, self.pad_id = model, eos_id, pad_id
        self.max_new_tokens, self.temperature, self.top_p = max_new_tokens, temperature, top_p

    @torch.no_grad()
    def sample(self, prompts: list, group_size: int, *, seeds: list) -> Rollout:
        """G samples of every prompt (lists or 1-D tensors of token ids); group k reproducible for seeds[k]."""
        if len(seeds) != len(prompts):
            raise ValueError(f"one seed per prompt: {len(prompts)} prompts, {len(seeds)} seeds")
        model = self.model
        attn = model.config._attn_implementation
        training = model.training
        model.eval()
        model.set_attn_implementation("sdpa")
        generator_state = torch.random.get_rng_state()
        out_prompts, out_completions, out_logps = [], [], []
        try:
            for prompt, seed in zip(prompts, seeds, strict=True):
                torch.manual_seed(seed)
                ids = torch.as_tensor(prompt, dtype=torch.long)[None].repeat(group_size, 1)
                out = model.generate(
                    ids, max_new_tokens=self.max_new_tokens, do_sample=True, temperature=self.temperature, top_k=0,
                    top_p=self.top_p, output_logits=True, return_dict_in_generate=True, pad_token_id=self.pad_id,
                    eos_token_id=self.eos_id, use_cache=True,
                )  # fmt: skip
                new = out.sequences[:, ids.shape[1] :]
                logits = torch.stack(out.logits, dim=1).float() / self.temperature  # [G, steps, V]
                logps = torch.log_softmax(logits, -1).gather(-1, new[..., None])[..., 0]
                for g in range(group_size):
                    ends = (new[g] == self.eos_id).nonzero()
                    n = int(ends[0]) + 1 if ends.numel() else new.shape[1]
                    out_prompts.append(ids[g])
                    out_completions.append(new[g, :n].clone())
                    out_logps.append(logps[g, :n].clone())
        finally:
            torch.random.set_rng_state(generator_state)
            model.set_attn_implementation(attn)
            model.train(training)
        return Rollout(prompt_ids=out_prompts, completion_ids=out_completions, sampler_logps=out_logps,
                       group_size=group_size)  # fmt: skip

    @torch.no_grad()
    def load_weights(self, state_dict: dict) -> None:
        """Copy new weights (full tensors, HF names) into the sampling model."""
        self.model.load_state_dict(state_dict, strict=True)

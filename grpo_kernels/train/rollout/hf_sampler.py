"""Samplers: G completions per prompt, with the sampler's own per-token log-probs, as an unscored `Rollout`.

Every sampler draws group k with its own seed `seeds[k]`, so a prompt's completions do not depend on which other
prompts share the call (or the rank): 1 and N data-parallel ranks sample the same rollout.

`HFSampler` runs transformers' `generate` on a local model (SDPA attention while generating, the packed
"grpo_varlen" attention restored afterwards): the training model itself in a single process, or a full copy
that `load_weights` refreshes after every optimizer step when the training model is sharded. Prompts of equal
length are generated together, every group in one batch (up to `max_batch_rows` rows), so no padding mask is
needed. The draw does not use the global RNG: `SeededSampling` gives every row (group k, member j) its own
generator, seeded from (seeds[k], j), and draws its token by Gumbel-max from softmax(top_p(logits / T)); generate
then takes that token as its greedy pick. So a row's tokens do not depend on its batch. `generate` gets a fresh
GenerationConfig and the model's own generation defaults (repetition penalty, top-k, ...) are set aside while it
runs, so they never change the draw.
"""

import logging

import torch
from transformers import GenerationConfig, LogitsProcessor, LogitsProcessorList

from .batch import Rollout

__all__ = ["HFSampler", "Rollout"]


class SeededSampling(LogitsProcessor):
    """Draw each row's next token from softmax(top_p(scores / T)) with that row's generator (Gumbel-max) and return
    scores that are -inf except at the drawn token, for generate's greedy step. `logps` collects, per step, each
    row's log-prob of its token under log_softmax(scores / T) over the whole vocabulary (the raw logits: generate
    adds no processor of its own with a fresh GenerationConfig), so no [B, steps, V] logits are kept."""

    def __init__(self, generators: list, temperature: float, top_p: float):
        self.generators, self.temperature, self.top_p = generators, temperature, top_p
        self.logps = []

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        logits = scores.float() / self.temperature
        log_probs = torch.log_softmax(logits, -1)
        if self.top_p < 1.0:  # drop the tokens after the smallest set whose probability reaches top_p
            sorted_logits, order = logits.sort(dim=-1, descending=True)
            probs = sorted_logits.softmax(-1)
            drop = probs.cumsum(-1) - probs >= self.top_p  # the mass before this token already reaches top_p
            logits = logits.scatter(-1, order, sorted_logits.masked_fill(drop, float("-inf")))
        uniform = torch.stack([torch.rand(logits.shape[-1], generator=g, device=logits.device)
                               for g in self.generators])  # fmt: skip
        gumbel = -torch.log(-torch.log(uniform.clamp_min(torch.finfo(torch.float32).tiny)))
        token = (logits + gumbel).argmax(-1, keepdim=True)
        self.logps.append(log_probs.gather(-1, token)[:, 0])
        return torch.full_like(scores, float("-inf")).scatter_(-1, token, 0.0)


_GOLDEN = 0x9E3779B97F4A7C15  # SplitMix64's increment


def splitmix64(z: int) -> int:
    """SplitMix64's finalizer of z (mod 2^64), shifted to 63 bits: a well-mixed seed from a structured one."""
    mask = (1 << 64) - 1
    z &= mask
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & mask
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & mask
    return (z ^ (z >> 31)) >> 1


def row_seed(seed: int, member: int) -> int:
    """A 63-bit seed for member j of the group drawn with seed, distinct across groups and members. torch's CPU
    generator (mt19937) keeps only its low 32 bits (CUDA's Philox keeps all 64): on CPU two of n rows draw the same
    stream with probability about n^2 / 2^33, about 1e-6 within a step of 256 rows, and a repeated stream is a
    repeated completion only where the two rows share a prompt. Draws of distinct rows, of one row across steps
    and along a row are tested for independence (tests/test_bench_statistics.py)."""
    return splitmix64(seed * _GOLDEN + member + 1)


class _OneLengthBatches(logging.Filter):
    """transformers' "The attention mask is not set ..." warning, for a `generate` call of prompts of one length (no
    padding: nothing to mask), where it is harmless; a logger filter, so that the inputs (and the draws) stay as
    they are."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "attention mask" not in record.getMessage()


_QUIET = _OneLengthBatches()
_GENERATE_LOG = logging.getLogger("transformers.generation.utils")


class HFSampler:
    """Batched `generate` on a local HF model."""

    def __init__(self, model, *, eos_id: int, pad_id: int, max_new_tokens: int, temperature: float = 1.0,
                 top_p: float = 1.0, max_batch_rows: int = 256, stop_ids=()):  # fmt: skip
        """A completion ends at eos_id or any of stop_ids (kept as its last token), or after max_new_tokens (then it
        is flagged truncated). Nothing else bounds its length: max_batch_rows only splits the rows of a `generate`
        call (lower it for long completions: the KV cache of a call grows with rows x (prompt + max_new_tokens))."""
        if max_batch_rows < 1:
            raise ValueError(f"max_batch_rows must be >= 1, got {max_batch_rows}")
        self.model, self.eos_id, self.pad_id = model, eos_id, pad_id
        self.stop_ids = list(dict.fromkeys([eos_id, *(int(i) for i in stop_ids)]))
        self.max_new_tokens, self.temperature, self.top_p = max_new_tokens, temperature, top_p
        self.progress = None  # called with the number of rows after each generate call (a progress bar), if set
        self.max_batch_rows = max_batch_rows

    @torch.no_grad()
    def sample(self, prompts: list, group_size: int, *, seeds: list) -> Rollout:
        """G samples of every prompt (lists or 1-D tensors of token ids); group k reproducible for seeds[k]."""
        if len(seeds) != len(prompts):
            raise ValueError(f"one seed per prompt: {len(prompts)} prompts, {len(seeds)} seeds")
        model = self.model
        attn = model.config._attn_implementation
        training = model.training
        generation_defaults = model.generation_config
        model.eval()
        model.set_attn_implementation("sdpa")
        model.generation_config = GenerationConfig()  # generate fills unset options from it: the library's defaults
        prompts = [torch.as_tensor(p, dtype=torch.long) for p in prompts]
        rows = [(k, j) for k in range(len(prompts)) for j in range(group_size)]
        by_length = {}
        for k, j in rows:
            by_length.setdefault(prompts[k].numel(), []).append((k, j))
        completions, logps, truncated = {}, {}, {}
        try:
            for batch_rows in by_length.values():
                for start in range(0, len(batch_rows), self.max_batch_rows):
                    batch = batch_rows[start : start + self.max_batch_rows]
                    new, lp = self._generate(torch.stack([prompts[k] for k, _ in batch]),
                                             [row_seed(seeds[k], j) for k, j in batch])  # fmt: skip
                    if self.progress is not None:
                        self.progress(len(batch))
                    for i, row in enumerate(batch):
                        ends = torch.isin(new[i], torch.tensor(self.stop_ids)).nonzero()
                        n = int(ends[0]) + 1 if ends.numel() else new.shape[1]
                        completions[row], logps[row] = new[i, :n].clone(), lp[i, :n].clone()
                        truncated[row] = not ends.numel()  # no stop id: it ran for max_new_tokens
        finally:
            model.generation_config = generation_defaults
            model.set_attn_implementation(attn)
            model.train(training)
        return Rollout(prompt_ids=[prompts[k] for k, _ in rows], completion_ids=[completions[r] for r in rows],
                       sampler_logps=[logps[r] for r in rows], group_size=group_size,
                       truncated=[truncated[r] for r in rows])  # fmt: skip

    def _generate(self, ids: torch.Tensor, row_seeds: list) -> tuple:
        """(new tokens [B, steps], their log-probs at the sampling temperature) for prompts ids [B, L]."""
        device = self.model.device
        generators = [torch.Generator(device=device).manual_seed(s) for s in row_seeds]
        config = GenerationConfig(max_new_tokens=self.max_new_tokens, do_sample=False, pad_token_id=self.pad_id,
                                  eos_token_id=self.stop_ids, use_cache=True)  # fmt: skip
        draw = SeededSampling(generators, self.temperature, self.top_p)
        _GENERATE_LOG.addFilter(_QUIET)  # every row of ids has the prompt's length: no padding to mask
        try:
            sequences = self.model.generate(ids.to(device), generation_config=config,
                                            logits_processor=LogitsProcessorList([draw]))  # fmt: skip
        finally:
            _GENERATE_LOG.removeFilter(_QUIET)
        new = sequences[:, ids.shape[1] :].cpu()
        # A finished row gets pad tokens after its stop token, not its draws: callers cut at the first stop.
        return new, torch.stack(draw.logps, dim=1).cpu()[:, : new.shape[1]]

    @torch.no_grad()
    def load_weights(self, state_dict: dict) -> None:
        """Copy new weights (full tensors, HF names) into the sampling model."""
        self.model.load_state_dict(state_dict, strict=True)

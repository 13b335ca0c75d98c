"""HFSampler's draw: per-row seeded Gumbel-max from softmax(top_p(logits / T)), independent of the batch a row is
generated in, of the global RNG and of the model's own generation defaults."""

import math

import pytest
import torch

from grpo_kernels.train.data.tasks import CharTokenizer, make_task, tiny_model
from grpo_kernels.train.rollout.hf_sampler import HFSampler, SeededSampling, row_seed


def draw_frequencies(logits: torch.Tensor, rows: int, temperature: float, top_p: float) -> torch.Tensor:
    generators = [torch.Generator().manual_seed(row_seed(11, j)) for j in range(rows)]
    out = SeededSampling(generators, temperature, top_p)(None, logits.expand(rows, -1).clone())
    assert bool((out.isfinite().sum(-1) == 1).all())  # exactly one finite entry per row: generate's greedy pick
    return torch.bincount(out.argmax(-1), minlength=logits.numel()).double() / rows


@pytest.mark.parametrize(("temperature", "top_p"), [(1.0, 1.0), (0.7, 1.0), (1.3, 0.8)])
def test_draws_follow_the_tempered_nucleus_distribution(temperature, top_p):
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -3.0])
    probs = torch.softmax(logits.double() / temperature, -1)
    if top_p < 1:  # the smallest prefix (by probability) whose mass reaches top_p, renormalised
        keep = (probs.cumsum(-1) - probs) < top_p
        probs = torch.where(keep, probs, 0) / probs[keep].sum()
        assert not bool(keep.all())  # the case does cut the tail
    rows = 20000
    freq = draw_frequencies(logits, rows, temperature, top_p)
    se = (probs * (1 - probs) / rows).sqrt()
    assert bool(((freq - probs).abs() <= 4.5 * se + 1e-12).all()), (freq, probs)
    assert bool((freq[probs == 0] == 0).all())


def test_row_seeds_are_distinct_across_groups_and_members():
    seeds = {row_seed(k, j) for k in range(200) for j in range(64)}
    assert len(seeds) == 200 * 64 and all(0 <= s < 2**63 for s in seeds)


@pytest.fixture(scope="module")
def model_and_prompts():
    tok = CharTokenizer()
    model = tiny_model(tok.vocab_size, seed=5)
    examples = make_task("add", difficulty=2).examples(12, seed=3)
    prompts = [tok.encode(e.prompt, bos=True) for e in examples]
    assert len({len(p) for p in prompts}) > 1  # several lengths: several batches
    return tok, model, prompts


def as_lists(rollout):
    return [c.tolist() for c in rollout.completion_ids], [lp.tolist() for lp in rollout.sampler_logps]


def test_a_rows_draw_does_not_depend_on_its_batch(model_and_prompts):
    tok, model, prompts = model_and_prompts
    sampler = HFSampler(model, eos_id=tok.eos_id, pad_id=tok.pad_id, max_new_tokens=6, temperature=1.2)
    seeds = list(range(100, 112))
    full = sampler.sample(prompts, 4, seeds=seeds)
    assert [p.tolist() for p in full.prompt_ids] == [p for p in prompts for _ in range(4)]
    completions, logps = as_lists(full)
    assert len({tuple(c) for c in completions}) > 4  # the draw is random
    small_batches = HFSampler(model, eos_id=tok.eos_id, pad_id=tok.pad_id, max_new_tokens=6, temperature=1.2,
                              max_batch_rows=3)  # fmt: skip
    chunked_completions, chunked_logps = as_lists(small_batches.sample(prompts, 4, seeds=seeds))
    assert chunked_completions == completions
    for a, b in zip(chunked_logps, logps, strict=True):
        assert max((x - y for x, y in zip(a, b, strict=True)), key=abs, default=0.0) == pytest.approx(0, abs=1e-5)
    alone_completions, _ = as_lists(sampler.sample([prompts[7]], 4, seeds=[seeds[7]]))
    assert alone_completions == completions[28:32]
    other_seed, _ = as_lists(sampler.sample([prompts[7]], 4, seeds=[seeds[7] + 1]))
    assert other_seed != alone_completions


def test_global_rng_and_generation_defaults_are_left_alone(model_and_prompts):
    tok, model, prompts = model_and_prompts
    sampler = HFSampler(model, eos_id=tok.eos_id, pad_id=tok.pad_id, max_new_tokens=6)
    before = sampler.sample(prompts[:3], 4, seeds=[1, 2, 3])
    state = torch.get_rng_state()
    saved = model.generation_config
    odd = type(saved)(repetition_penalty=5.0, top_k=1, temperature=0.1, do_sample=True, no_repeat_ngram_size=1)
    model.generation_config = odd
    try:
        after = sampler.sample(prompts[:3], 4, seeds=[1, 2, 3])
        assert model.generation_config is odd  # put back after sampling
    finally:
        model.generation_config = saved
    assert torch.equal(torch.get_rng_state(), state)
    assert as_lists(after) == as_lists(before)
    for c, lp in zip(after.completion_ids, after.sampler_logps, strict=True):
        assert lp.shape == c.shape and bool((lp <= 0).all()) and math.isfinite(float(lp.sum()))


def test_max_batch_rows_is_checked(model_and_prompts):
    tok, model, _ = model_and_prompts
    with pytest.raises(ValueError, match="max_batch_rows"):
        HFSampler(model, eos_id=tok.eos_id, pad_id=tok.pad_id, max_new_tokens=4, max_batch_rows=0)


def test_generate_batches_of_one_prompt_length_do_not_warn_about_the_attention_mask(model_and_prompts):
    """transformers warns that no attention mask is set when pad and end-of-sequence ids are one (SmolLM2's): every
    call here holds prompts of one length, so the warning is harmless and filtered, the inputs unchanged."""
    import logging

    from transformers.utils import logging as hf_logging

    tok, model, prompts = model_and_prompts
    seen = []
    handler = logging.Handler()
    handler.emit = lambda record: seen.append(record.getMessage())
    log = logging.getLogger("transformers.generation.utils")
    log.addHandler(handler)
    hf_logging.logging.Logger.warning_once.cache_clear()  # (a warning given once already in this process)
    try:
        sampler = HFSampler(model, eos_id=tok.eos_id, pad_id=tok.eos_id, max_new_tokens=4)
        sampler.sample(prompts, 2, seeds=list(range(len(prompts))))
        assert not [m for m in seen if "attention mask" in m], seen
        log.warning("The attention mask is not set (a test line)")  # the filter is on only during generate
        assert seen[-1] == "The attention mask is not set (a test line)"
    finally:
        log.removeHandler(handler)

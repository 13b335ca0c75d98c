"""Packed forward (one row, reset position ids, varlen attention) == padded forward, for HF decoders built from a
config (no downloads), log-probs and gradients; PackedBatch bookkeeping; varlen attention against SDPA."""

import pytest
import torch
from helpers import assert_close

import grpo_kernels as gk
from grpo_kernels.attention import register_hf_attention, varlen_attention
from grpo_kernels.packing import pack_sequences

transformers = pytest.importorskip("transformers")


def tiny_model(kind: str, attn: str):
    common = dict(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=2,
                  num_key_value_heads=1, max_position_embeddings=256, tie_word_embeddings=False)  # fmt: skip
    config = (transformers.Qwen2Config if kind == "qwen2" else transformers.LlamaConfig)(**common)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation=attn, dtype=torch.float32)
    return model.eval()


def samples(n=6, group_size=3):
    """n samples in groups of group_size sharing their prompt; one empty completion."""
    g = torch.Generator().manual_seed(1)
    length = lambda lo, hi: int(torch.randint(lo, hi, (1,), generator=g))  # noqa: E731
    group_prompts = [torch.randint(0, 97, (length(1, 9),), generator=g) for _ in range(n // group_size)]
    prompts = [group_prompts[i // group_size] for i in range(n)]
    completions = [torch.randint(0, 97, (length(0, 13),), generator=g) for _ in range(n)]
    completions[1] = completions[1][:0]
    return prompts, completions, [i // group_size for i in range(n)]


def packed_completion_logps(model, packed):
    logits = model(**packed.model_kwargs()).logits[0]
    return packed.completions(gk.selective_logprobs(logits[packed.logit_rows], packed.completion_ids))


def padded_completion_logps(model, prompts, completions):
    """Reference: each sample alone, no padding at all (so no mask is involved)."""
    width = max(c.numel() for c in completions)
    out = torch.zeros(len(prompts), width)
    for i, (p, c) in enumerate(zip(prompts, completions, strict=True)):
        if c.numel() == 0:
            continue
        ids = torch.cat([p, c])[None]
        logits = model(input_ids=ids, use_cache=False).logits[0, p.numel() - 1 : -1]
        out[i, : c.numel()] = torch.log_softmax(logits, -1).gather(-1, c[:, None])[:, 0]
    return out


@pytest.mark.parametrize("kind", ["qwen2", "llama"])
def test_packed_forward_and_gradients_equal_per_sample_forward(kind):
    """Plain packing and shared-prefix packing against each sample run alone: log-probs and parameter grads."""
    register_hf_attention()
    prompts, completions, groups = samples()
    weights = torch.randn(len(prompts), 12)
    results = {}
    for layout in ("alone", "packed", "shared_prefix"):
        model = tiny_model(kind, "sdpa" if layout == "alone" else "grpo_varlen")
        if layout == "alone":
            logps = padded_completion_logps(model, prompts, completions)
        else:
            shared = layout == "shared_prefix"
            packed = pack_sequences(prompts, completions, shared_prefix=shared, group_ids=groups if shared else None)
            logps = packed_completion_logps(model, packed)
        (logps * weights[:, : logps.shape[1]]).sum().backward()
        results[layout] = ([p.grad.clone() for p in model.parameters()], logps.detach())
    g_ref, lp_ref = results["alone"]
    for layout in ("packed", "shared_prefix"):
        grads, logps = results[layout]
        assert logps.shape == lp_ref.shape
        assert (logps - lp_ref).abs().max() <= 1e-5, layout
        for a, b in zip(grads, g_ref, strict=True):
            assert_close(a, b, name=f"parameter grad ({layout})", rtol=1e-4, atol=1e-6)


def test_packed_batch_bookkeeping():
    prompts, completions, groups = samples()
    packed = pack_sequences(prompts, completions)
    lengths = [p.numel() + c.numel() for p, c in zip(prompts, completions, strict=True)]
    assert packed.cu_seqlens.tolist() == [0, *torch.tensor(lengths).cumsum(0).tolist()]
    assert packed.max_seqlen == max(lengths) and packed.num_tokens == sum(lengths)
    back = packed.completions(packed.completion_ids.float())  # the completion tokens, in TRL's padded layout
    for i, c in enumerate(completions):
        assert back[i, : c.numel()].long().tolist() == c.tolist()
        assert bool((back[i, c.numel() :] == 0).all())
    ids = packed.input_ids[0]  # each completion token is predicted by the token before it in its own sample
    starts = packed.cu_seqlens[:-1].long()
    for i, c in enumerate(completions):
        rows = packed.logit_rows[packed.completion_cu_seqlens[i] : packed.completion_cu_seqlens[i + 1]]
        assert ids[rows].tolist() == torch.cat([prompts[i][-1:], c[:-1]]).tolist()[: c.numel()]
        assert bool((rows >= starts[i]).all())
    for layout in (packed, pack_sequences(prompts, completions, shared_prefix=True, group_ids=groups)):
        rows = layout.unpack(layout.input_ids[0], pad=-1)  # each sample's tokens back, in both layouts
        for i, (p, c) in enumerate(zip(prompts, completions, strict=True)):
            assert rows[i, : lengths[i]].tolist() == torch.cat([p, c]).tolist()
            assert bool((rows[i, lengths[i] :] == -1).all())
        assert int(layout.completion_mask.sum()) == sum(c.numel() for c in completions)
        assert layout.seq_index.shape == (layout.num_tokens,)
    shared = pack_sequences(prompts, completions, shared_prefix=True, group_ids=groups)
    assert shared.num_tokens == packed.num_tokens - sum(p.numel() for p in prompts[1::3] + prompts[2::3])
    assert torch.equal(shared.completion_ids, packed.completion_ids)
    with pytest.raises(ValueError, match="share a group id"):
        pack_sequences(prompts, completions, shared_prefix=True, group_ids=[0] * len(prompts))
    with pytest.raises(ValueError, match="prompts"):
        pack_sequences([[]], [[1]])
    with pytest.raises(ValueError, match="pair up"):
        pack_sequences([[1]], [])


def test_varlen_attention_matches_masked_sdpa():
    torch.manual_seed(0)
    cu = torch.tensor([0, 5, 5, 12, 13])  # with an empty sequence
    q, k, v = torch.randn(13, 4, 32), torch.randn(13, 2, 32), torch.randn(13, 2, 32)
    out = varlen_attention(q, k, v, cu, 7)
    seq = torch.repeat_interleave(torch.arange(4), cu.diff())
    allowed = (seq[:, None] == seq[None, :]) & torch.ones(13, 13, dtype=torch.bool).tril()
    kk, vv = k.repeat_interleave(2, 1), v.repeat_interleave(2, 1)
    ref = torch.nn.functional.scaled_dot_product_attention(q.transpose(0, 1), kk.transpose(0, 1), vv.transpose(0, 1),
                                                           attn_mask=allowed).transpose(0, 1)  # fmt: skip
    assert_close(out, ref, name="varlen attention")


def test_hf_padding_mask_is_refused():
    register_hf_attention()
    model = tiny_model("qwen2", "grpo_varlen")
    ids = torch.randint(0, 97, (2, 6))
    mask = torch.ones(2, 6, dtype=torch.long)
    mask[1, 4:] = 0
    with pytest.raises(ValueError, match="padding"):
        model(input_ids=ids, attention_mask=mask, use_cache=False)


def test_empty_completions_give_no_loss_tokens_and_no_nan():
    prompts, completions, _ = samples()
    packed = pack_sequences(prompts, completions)
    n = packed.completion_ids.shape[0]
    logps = (-torch.rand(n)).requires_grad_()
    loss, metrics = gk.grpo_loss(logps, None, torch.randn(len(prompts)), cu_seqlens=packed.completion_cu_seqlens,
                                 loss_type="grpo")  # fmt: skip
    loss.backward()
    assert torch.isfinite(loss) and all(bool(torch.isfinite(v)) for v in metrics.values())
    assert packed.completion_lengths[1] == 0 and bool(torch.isfinite(logps.grad).all())

"""Packed attention honours sliding windows, attention sinks and logit soft-capping, or refuses the model.

`varlen_attention` is checked against dense attention written out here (one [T, T] mask over the whole packed
batch); the HF hook against each architecture's own eager attention on every sequence run alone, on tiny models
built from a config with windows shorter than the sequences, sinks and soft-capping scaled up so that an ignored
feature shows (it did: per-token log-prob errors of 0.4 to 1.8 before).
"""

import subprocess
import sys

import pytest
import torch
from helpers import assert_close

import grpo_kernels as gk
from grpo_kernels.attention import check_packed_attention, register_hf_attention, varlen_attention
from grpo_kernels.packing import pack_sequences

transformers = pytest.importorskip("transformers")

V = 97


def dense_attention(q, k, v, cu, *, causal, window, sinks, softcap):
    """Every token against every token of the packed batch, masked to its own sequence (and window), in fp64."""
    t = q.shape[0]
    seq = torch.repeat_interleave(torch.arange(cu.numel() - 1), cu.diff())
    pos = torch.arange(t) - cu[seq]
    rep = q.shape[1] // k.shape[1]
    k, v = k.double().repeat_interleave(rep, 1), v.double().repeat_interleave(rep, 1)
    s = torch.einsum("qhd,khd->hqk", q.double(), k) * q.shape[2] ** -0.5
    if softcap is not None:
        s = softcap * torch.tanh(s / softcap)
    dist = pos[:, None] - pos[None, :]
    allowed = seq[:, None] == seq[None, :]
    if causal:
        allowed &= dist >= 0
    if window is not None:
        allowed &= (dist < window) if causal else (dist.abs() <= window)
    s = s.masked_fill(~allowed, float("-inf"))
    if sinks is not None:
        s = torch.cat([s, sinks.double()[:, None, None].expand(-1, t, 1)], -1)
    p = torch.softmax(s, -1)[..., :t]
    return torch.einsum("hqk,khd->qhd", p, v)


FEATURES = [
    dict(window=None, sinks=False, softcap=None),
    dict(window=3, sinks=False, softcap=None),
    dict(window=1, sinks=False, softcap=None),
    dict(window=None, sinks=True, softcap=None),
    dict(window=None, sinks=False, softcap=0.7),
    dict(window=4, sinks=True, softcap=0.7),
]


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("feat", FEATURES, ids=lambda f: "-".join(f"{k}={v}" for k, v in f.items()))
@pytest.mark.parametrize("backend", ["auto", "sdpa", "math"])
def test_varlen_attention_honours_window_sinks_softcap_forward_and_backward(backend, feat, causal):
    cu = torch.tensor([0, 9, 9, 10, 23])  # an empty and a one-token sequence, windows shorter than the others
    q = (2 * torch.randn(23, 4, 16)).requires_grad_()
    k, v = torch.randn(23, 2, 16, requires_grad=True), torch.randn(23, 2, 16, requires_grad=True)
    sinks = torch.randn(4, requires_grad=True) if feat["sinks"] else None
    opts = dict(causal=causal, window=feat["window"], sinks=sinks, softcap=feat["softcap"])
    if backend == "sdpa" and (sinks is not None or feat["softcap"] is not None):
        with pytest.raises(ValueError, match="cannot honour"):
            varlen_attention(q, k, v, cu, 13, backend=backend, **opts)
        return
    out = varlen_attention(q, k, v, cu, 13, backend=backend, **opts)
    ref = dense_attention(q, k, v, cu, **opts)
    assert_close(out, ref.float(), name="forward", atol=2e-5, rtol=2e-5)
    w = torch.randn_like(out)
    inputs = [x for x in (q, k, v, sinks) if x is not None]
    got = torch.autograd.grad((out * w).sum(), inputs)
    want = torch.autograd.grad((ref * w.double()).sum(), inputs)
    for name, g, r in zip("qkvs", got, want, strict=False):
        assert_close(g, r.float(), name=f"grad {name}", atol=2e-5, rtol=2e-5)


def _fake_torch_varlen(gqa: bool):
    """A stand-in for torch.nn.attention.varlen.varlen_attn with torch 2.11's signature (no window, no GQA flag)
    or one that takes `enable_gqa`, computing the dense fp64 answer; it records the head counts it was given."""
    seen = []

    def without_gqa(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, is_causal=False, return_aux=None,
                    scale=None):  # fmt: skip
        seen.append((query.shape[1], key.shape[1], value.shape[1]))
        assert query.shape[1] == key.shape[1] == value.shape[1], "this signature takes equal head counts only"
        assert torch.equal(cu_seq_q, cu_seq_k) and cu_seq_q.dtype == torch.int32 and max_q == max_k
        return dense_attention(query, key, value, cu_seq_q.long(), causal=is_causal, window=None, sinks=None,
                               softcap=None).to(query.dtype)  # fmt: skip

    def with_gqa(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, is_causal=False, scale=None,
                 enable_gqa=False):  # fmt: skip
        seen.append((query.shape[1], key.shape[1], value.shape[1]))
        assert enable_gqa == (query.shape[1] != key.shape[1])
        return dense_attention(query, key, value, cu_seq_q.long(), causal=is_causal, window=None, sinks=None,
                               softcap=None).to(query.dtype)  # fmt: skip

    return (with_gqa if gqa else without_gqa), seen


@pytest.mark.parametrize("gqa_flag", [False, True])
def test_torch_varlen_backend_gets_grouped_query_heads_its_signature_takes(monkeypatch, gqa_flag):
    """torch 2.10/2.11's varlen_attn has no enable_gqa (seen failing on an H200 with torch 2.11): K/V heads are
    repeated for it, and passed as they are to a signature that takes the flag; forward and backward as dense."""
    fake, seen = _fake_torch_varlen(gqa_flag)
    monkeypatch.setattr(gk.attention, "_torch_varlen", lambda: fake)
    cu = torch.tensor([0, 9, 9, 10, 23])
    q = torch.randn(23, 4, 16).bfloat16().requires_grad_()  # the flash backends take half precision only
    k, v = (torch.randn(23, 2, 16).bfloat16().requires_grad_() for _ in range(2))
    out = varlen_attention(q, k, v, cu, 13, backend="torch_varlen")
    assert seen == [(4, 2, 2) if gqa_flag else (4, 4, 4)]
    ref = dense_attention(q, k, v, cu, causal=True, window=None, sinks=None, softcap=None)
    assert_close(out, ref, name="forward", dtype=torch.bfloat16)
    w = torch.randn(out.shape, dtype=torch.float64)
    for name, g, r in zip("qkv", torch.autograd.grad((out.double() * w).sum(), (q, k, v)),
                          torch.autograd.grad((ref * w).sum(), (q, k, v)), strict=True):  # fmt: skip
        assert_close(g, r, name=f"grad {name}", dtype=torch.bfloat16)


def test_flash_backends_are_picked_for_half_precision_only(monkeypatch):
    """fp32 on CUDA went to torch's varlen_attn, which raised 'FlashAttention only support fp16 and bf16' (seen on
    an H200): "auto" picks SDPA for it, and forcing a flash backend on fp32 is refused naming the dtype."""
    fake, _ = _fake_torch_varlen(True)
    monkeypatch.setattr(gk.attention, "_torch_varlen", lambda: fake)
    monkeypatch.setattr(gk.attention, "_flash_attn", lambda: None)
    cuda = torch.device("cuda")
    assert gk.attention._pick_backend(cuda, set(), torch.bfloat16) == "torch_varlen"
    assert gk.attention._pick_backend(cuda, set(), torch.float16) == "torch_varlen"
    assert gk.attention._pick_backend(cuda, set(), torch.float32) == "sdpa"
    q = k = v = torch.randn(5, 2, 8)
    with pytest.raises(ValueError, match="float16 or bfloat16, got torch.float32"):
        varlen_attention(q, k, v, torch.tensor([0, 5]), 5, backend="torch_varlen")


def test_varlen_attention_refuses_bad_feature_arguments():
    q = k = v = torch.randn(5, 2, 8)
    cu = torch.tensor([0, 5])
    for kwargs, match in [(dict(window=0), "window"), (dict(window=2.5), "window"), (dict(softcap=0.0), "softcap"),
                          (dict(sinks=torch.zeros(3)), "sinks"), (dict(backend="flash"), "backend")]:  # fmt: skip
        with pytest.raises(ValueError, match=match):
            varlen_attention(q, k, v, cu, 5, **kwargs)


def _users_of(leaf, out):
    """The autograd nodes that pass a gradient straight to `leaf`."""
    seen, stack, users = set(), [out.grad_fn], []
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        for child, _ in node.next_functions:
            if child is not None and getattr(child, "variable", None) is leaf:
                users.append(type(node).__name__)
            stack.append(child)
    return users


@pytest.mark.parametrize("shared_prefix", [False, True])
def test_per_sequence_cpu_path_cuts_its_inputs_once_and_matches_dense(shared_prefix):
    """The per-sequence path takes its q/k/v pieces from one split per tensor, not a slice per sequence (each
    slice's backward is a zero-filled [T, H, D] gradient: per layer, per sequence; most of a CPU training step at
    64 completions), and its forward and backward still equal dense attention."""
    g = torch.Generator().manual_seed(5)
    lengths = [int(x) for x in torch.randint(1, 9, (40,), generator=g)]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    t = int(cu[-1])
    q, k, v = (torch.randn(t, h, 8, generator=g, dtype=torch.float64, requires_grad=True) for h in (4, 2, 2))
    if shared_prefix:  # sequence 0 of each 4 is a prompt, 1-3 its completions
        groups = [(int(cu[i]), int(cu[i + 1]), tuple((int(cu[j]), int(cu[j + 1])) for j in range(i + 1, i + 4)))
                  for i in range(0, 40, 4)]  # fmt: skip
        out = varlen_attention(q, k, v, cu, max(lengths), prefix_groups=groups)
    else:
        out = varlen_attention(q, k, v, cu, max(lengths))
    for x in (q, k, v):  # per sequence this was a SliceBackward0 each (40)
        assert _users_of(x, out) == ["SplitWithSizesBackward0"]
    if not shared_prefix:
        want = dense_attention(q, k, v, cu, causal=True, window=None, sinks=None, softcap=None)
        torch.testing.assert_close(out, want)
        grads = torch.autograd.grad(out.square().sum(), (q, k, v))
        wants = torch.autograd.grad(want.square().sum(), (q, k, v))
        for a, b in zip(grads, wants, strict=True):
            torch.testing.assert_close(a, b)
    if shared_prefix:  # a group with an empty prompt: its completions attend to themselves only
        empty = [(int(cu[0]), int(cu[0]), ((int(cu[0]), int(cu[1])),))]
        alone = varlen_attention(q, k, v, cu[:2], lengths[0], prefix_groups=empty)[: lengths[0]]
        torch.testing.assert_close(alone, varlen_attention(q, k, v, cu[:2], lengths[0])[: lengths[0]])
    with pytest.raises(ValueError, match="sequence bounds"):
        varlen_attention(q, k, v, torch.tensor([0, t + 3]), t + 3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shared_prefix", [False, True])
def test_sdpa_batched_by_length_equals_one_call_per_sequence_bit_for_bit(shared_prefix, dtype):
    """The CPU path stacks the sequences (or [prompt; completion] calls) of one length into one SDPA: outputs and
    gradients are those of one SDPA per sequence, exactly (the learning check's calibrated runs rely on it)."""
    from grpo_kernels.attention_sdpa import _sdpa

    g = torch.Generator().manual_seed(11)
    lengths = [int(x) for x in torch.randint(1, 6, (48,), generator=g)]  # many repeats: batches of up to ~12
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    t = int(cu[-1])
    q, k, v = (torch.randn(t, h, 16, generator=g).to(dtype).requires_grad_() for h in (4, 2, 2))
    spans = [(int(cu[i]), int(cu[i + 1])) for i in range(48)]
    if shared_prefix:  # sequence 0 of each 4 is a prompt, 1-3 its completions
        groups = [(*spans[i], tuple(spans[i + 1 : i + 4])) for i in range(0, 48, 4)]
        out = varlen_attention(q, k, v, cu, max(lengths), prefix_groups=groups)
        pieces = []
        for p0, p1, completions in groups:
            for j, (s, e) in enumerate(completions):
                both = _sdpa(torch.cat([q[p0:p1], q[s:e]]), torch.cat([k[p0:p1], k[s:e]]),
                             torch.cat([v[p0:p1], v[s:e]]), None, causal=True)  # fmt: skip
                pieces += [both[: p1 - p0]] if j == 0 else []
                pieces.append(both[p1 - p0 :])
        want = torch.cat(pieces)
    else:
        out = varlen_attention(q, k, v, cu, max(lengths), backend="sdpa")
        want = torch.cat([_sdpa(q[s:e], k[s:e], v[s:e], None, causal=True) for s, e in spans])
    assert torch.equal(out, want)
    weight = torch.randn(out.shape, generator=g).to(dtype)
    grads = torch.autograd.grad((out.float() * weight).sum(), (q, k, v))
    wants = torch.autograd.grad((want.float() * weight).sum(), (q, k, v))
    for a, b in zip(grads, wants, strict=True):
        assert torch.equal(a, b)


# Tiny configs of the decoders transformers ships with windowed, sink or soft-capped attention (and plain ones):
# window 8 against sequences of up to 34 tokens.
ARCHITECTURES = {
    "llama": ("LlamaConfig", {}),
    "mistral": ("MistralConfig", dict(sliding_window=8)),
    "qwen2": ("Qwen2Config", dict(use_sliding_window=True, sliding_window=8, max_window_layers=1)),
    "qwen3": ("Qwen3Config", dict(use_sliding_window=True, sliding_window=8, max_window_layers=1)),
    "phi3": ("Phi3Config", dict(sliding_window=8)),
    "starcoder2": ("Starcoder2Config", dict(sliding_window=8)),
    "gemma2": ("Gemma2Config", dict(sliding_window=8, attn_logit_softcapping=2.0, final_logit_softcapping=None)),
    "gemma3_text": ("Gemma3TextConfig", dict(sliding_window=8, final_logit_softcapping=None)),
    "cohere2": ("Cohere2Config", dict(sliding_window=8)),
    "gpt_oss": ("GptOssConfig", dict(sliding_window=8, num_local_experts=2, num_experts_per_tok=1)),
    "olmo3": ("Olmo3Config", dict(sliding_window=8)),
    "exaone4": ("Exaone4Config", dict(sliding_window=8)),
}
REFUSED = {
    "llama4_text": ("Llama4TextConfig", dict(attention_chunk_size=8, num_local_experts=2, intermediate_size_mlp=96),
                    "attention_chunk_size"),
    "phimoe": ("PhimoeConfig", dict(sliding_window=8, num_local_experts=2), "sliding_window=8 only through its"),
}


def build(kind, attn):
    cls, extra = {**ARCHITECTURES, **{k: v[:2] for k, v in REFUSED.items()}}[kind]
    common = dict(vocab_size=V, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, max_position_embeddings=256, tie_word_embeddings=False,
                  pad_token_id=0, bos_token_id=1, eos_token_id=2)  # fmt: skip
    config = getattr(transformers, cls)(**common, **extra)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation=attn, dtype=torch.float32)
    with torch.no_grad():  # sharper attention, so that a dropped window / sink / cap moves the log-probs
        for name, p in model.named_parameters():
            if "sinks" in name:
                p.normal_(0.0, 1.0)
            elif p.dim() >= 2:
                p.mul_(3.0)
    return model.eval()


def samples():
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, V, (n,), generator=g) for n in (5, 5, 9)]
    prompts[1] = prompts[0]
    completions = [torch.randint(3, V, (n,), generator=g) for n in (20, 14, 25)]
    return prompts, completions, [0, 0, 1]


@pytest.mark.parametrize("layout", ["packed", "shared_prefix"])
@pytest.mark.parametrize("kind", sorted(ARCHITECTURES))
def test_packed_logprobs_and_grads_equal_eager_alone(kind, layout):
    register_hf_attention()
    eager, packed_model = build(kind, "eager"), build(kind, "grpo_varlen")
    prompts, completions, groups = samples()
    w = torch.randn(sum(c.numel() for c in completions))

    alone = []
    for p, c in zip(prompts, completions, strict=True):
        logits = eager(input_ids=torch.cat([p, c])[None], use_cache=False).logits[0, p.numel() - 1 : -1]
        alone.append(torch.log_softmax(logits, -1).gather(-1, c[:, None])[:, 0])
    ref = torch.cat(alone)
    (ref * w).sum().backward()

    batch = pack_sequences(prompts, completions, shared_prefix=layout == "shared_prefix", group_ids=groups)
    logits = packed_model(**batch.model_kwargs()).logits[0]
    got = gk.selective_logprobs(logits[batch.logit_rows], batch.completion_ids)
    (got * w).sum().backward()

    assert_close(got, ref, name=f"{kind} {layout} log-probs", atol=5e-5, rtol=1e-5)
    grads = dict(eager.named_parameters())
    for name, p in packed_model.named_parameters():
        assert_close(p.grad, grads[name].grad, name=f"{kind} {layout} grad {name}", atol=5e-4, rtol=1e-4)


@pytest.mark.parametrize("kind", sorted(REFUSED))
def test_attention_packing_cannot_honour_is_refused_naming_the_feature(kind):
    register_hf_attention()
    model = build(kind, "grpo_varlen")
    with pytest.raises(NotImplementedError, match=REFUSED[kind][2]):
        check_packed_attention(model)
    batch = pack_sequences(*samples()[:2])
    with pytest.raises(NotImplementedError, match=REFUSED[kind][2]):
        model(**batch.model_kwargs())


@pytest.mark.parametrize("config,message", [
    ("GPTNeoConfig(num_layers=2, attention_types=[[['global', 'local'], 1]], hidden_size=64, num_heads=2)",
     r"^GPTNeoForCausalLM \(gpt_neo\) has local attention on 1 of its 2 layers \(window_size=256\), attention "
     r"chosen from its own classes, not transformers' attention interface: attn_implementation='grpo_varlen' cannot"),
    ("GPTJConfig(n_layer=2, n_head=2, n_embd=64, rotary_dim=16)", r"^GPTJForCausalLM \(gptj\) has attention chosen"),
    ("Llama4TextConfig(attention_chunk_size=8)", r"^the model config \(llama4_text\) sets attention_chunk_size=8"),
])  # fmt: skip
def test_architectures_grpo_varlen_cannot_build_are_refused_from_the_config(config, message, tmp_path):
    """GPT-Neo (local attention) and GPT-J pick attention from their own tables: building them with grpo_varlen was
    KeyError: 'grpo_varlen' from inside transformers. The config check names the architecture and the feature,
    and load_policy runs it before building (one ValueError line)."""
    import transformers

    from grpo_kernels.attention import check_packed_config
    from grpo_kernels.train.model.hf import load_policy

    cfg = eval(f"transformers.{config}")
    with pytest.raises(NotImplementedError, match=message):
        check_packed_config(cfg)
    cfg.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=rf"^the model in {tmp_path} cannot run packed: " + message.lstrip("^")):
        load_policy(tmp_path)
    for fine in (transformers.LlamaConfig(), transformers.Qwen2Config(), transformers.GPT2Config()):
        check_packed_config(fine)


def test_unknown_attention_argument_is_refused_not_dropped():
    register_hf_attention()
    model = build("llama", "grpo_varlen")
    check_packed_attention(model)  # a plain decoder passes
    batch = pack_sequences(*samples()[:2])
    with pytest.raises(NotImplementedError, match="position_bias"):
        model(**batch.model_kwargs(), position_bias=torch.zeros(1))


@pytest.mark.parametrize("order", ["grpo_kernels first", "transformers first"])
def test_import_grpo_kernels_registers_grpo_varlen_in_either_import_order(order):
    imports = ["import grpo_kernels", "import transformers"]
    code = "\n".join([
        *(imports if order == "grpo_kernels first" else imports[::-1]),
        "import sys, torch",
        "assert order_ok or 'transformers.modeling_utils' not in sys.modules",
        "config = transformers.LlamaConfig(vocab_size=50, hidden_size=32, intermediate_size=32, num_hidden_layers=1,",
        "                                  num_attention_heads=2, num_key_value_heads=1)",
        "m = transformers.AutoModelForCausalLM.from_config(config, attn_implementation='grpo_varlen')",
        "ids = torch.tensor([[1, 2, 3, 4]])",
        "packed = m(input_ids=ids, position_ids=torch.tensor([[0, 1, 0, 1]])).logits[0]",
        "alone = torch.cat([m(input_ids=ids[:, :2]).logits[0], m(input_ids=ids[:, 2:]).logits[0]])",
        "assert m.config._attn_implementation == 'grpo_varlen' and torch.allclose(packed, alone, atol=1e-5)",
        "print('ok')",
    ])  # fmt: skip
    code = code.replace("order_ok", str(order == "transformers first"))
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-2000:]

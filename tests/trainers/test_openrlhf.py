"""grpo_kernels.integrations.openrlhf against OpenRLHF 0.11.2 itself: its PolicyLoss, its log-prob and entropy
functions, and its Actor.forward (the real class, imported with stand-ins for flash-attn and peft, which this venv
lacks and which the Actor's unpacked forward never calls).

Run: .venv-trainers/bin/python -m pytest -q tests/trainers/test_openrlhf.py
"""

import importlib
import importlib.util
import math
import sys
import types

import pytest
import torch
from helpers import assert_close, assert_lowp_no_worse
from oracles import openrlhf_models

from grpo_kernels import grpo_loss
from grpo_kernels.integrations.openrlhf import PolicyLoss, actor_log_probs, use_grpo_kernels

ORACLE_LOSS, ORACLE_UTILS = openrlhf_models()
IS_CONFIGS = [  # (level, mode, gating, threshold): every combination OpenRLHF's constructor accepts, and off
    ("off", "mask", "ratio", (0.5, 5.0)),
    ("token", "mask", "ratio", (0.8, 1.25)),
    ("token", "clip", "ratio", (0.8, 1.25)),
    ("seq", "mask", "ratio", (0.9, 1.1)),
    ("token", "mask", "binary_kl", (0.0, 0.02)),
    ("token", "mask", "tv", (0.0, 0.05)),
    ("seq", "mask", "binary_kl", (0.0, 0.01)),
    ("seq", "mask", "tv", (0.0, 0.04)),
]
NORMALISATIONS = [  # forward's keyword arguments: OpenRLHF's own defaults, global numbers, global tensors
    {},
    dict(dp_size=2, batch_num_tokens=123.0, global_batch_size=9.0),
    dict(dp_size=4, batch_num_tokens=torch.tensor(301.0), global_batch_size=torch.tensor(21.0)),
]


def policy_inputs(b=6, a=37, dtype=torch.float32, spread=0.7):
    """Ragged right-padded action masks with holes and one empty row, ratios spread around 1 (clips and dual clip
    bind), per-token advantages of both signs, rollout log-probs off the old ones."""
    lengths = torch.randint(1, a + 1, (b,))
    lengths[1] = 0
    mask = (torch.arange(a) < lengths[:, None]) & (torch.rand(b, a) > 0.1)
    old = -torch.rand(b, a) * 3 - 0.01
    logp = old + torch.randn(b, a) * spread
    rollout = old + torch.randn(b, a) * 0.3
    adv = torch.randn(b, 1) + 0.3 * torch.randn(b, a)
    logp, old, adv, rollout = (x.to(dtype) for x in (logp, old, adv, rollout))
    return logp, old, adv, mask, rollout


def run(loss_fn, logp, old, adv, mask, rollout, **kwargs):
    """(outputs, grad w.r.t. log_probs) of one PolicyLoss call."""
    x = logp.detach().clone().requires_grad_()
    out = loss_fn(x, old, adv, action_mask=mask, rollout_log_probs=rollout, **kwargs)
    out[0].backward()
    return out, x.grad


def assert_same(ours, theirs, *, rtol=1e-5, atol=1e-7, grad_tol=None):
    (out, grad), (ref, ref_grad) = ours, theirs
    names = ("loss", "clip_ratio", "ppo_kl", "vllm_kl", "is_filter_ratio")
    for name, x, y in zip(names, out, ref, strict=True):
        assert (x is None) == (y is None), f"{name}: {x} vs {y}"
        if x is not None:
            assert_close(x.float(), y.float(), name=name, rtol=rtol, atol=atol)
    assert_close(grad, ref_grad, name="grad log_probs", **(grad_tol or dict(rtol=rtol, atol=atol)))


def both(kwargs):
    return PolicyLoss(**kwargs), ORACLE_LOSS.PolicyLoss(**kwargs)


# ----------------------------------------------------------------------------------------------- PolicyLoss
# dual clip 3.0 runs as the op's delta, 1.1 (<= 1 + clip_eps_high) as a log-ratio cap (ppo only: gspo refuses it)
LOSS_TYPES_DUAL = [("ppo", None), ("ppo", 3.0), ("ppo", 1.1), ("gspo", None), ("gspo", 3.0)]


@pytest.mark.parametrize("token_level_loss", [True, False], ids=["token_mean", "seq_mean"])
@pytest.mark.parametrize("is_config", IS_CONFIGS, ids=lambda c: "-".join(map(str, c[:3])))
@pytest.mark.parametrize("policy_loss_type, dual_clip", LOSS_TYPES_DUAL, ids=lambda x: str(x))
def test_policy_loss_equals_openrlhf(policy_loss_type, dual_clip, is_config, token_level_loss):
    level, mode, gating, threshold = is_config
    kwargs = dict(clip_eps_low=0.2, clip_eps_high=0.28, dual_clip=dual_clip, token_level_loss=token_level_loss,
                  policy_loss_type=policy_loss_type, is_correction_level=level, is_correction_mode=mode,
                  is_correction_gating=gating, is_correction_threshold=threshold)  # fmt: skip
    ours, theirs = both(kwargs)
    inputs = policy_inputs()
    for norm in NORMALISATIONS:
        assert_same(run(ours, *inputs, **norm), run(theirs, *inputs, **norm))


@pytest.mark.parametrize("impl", ["reference", "triton"])
@pytest.mark.parametrize("kwargs", [
    dict(dual_clip=3.0, is_correction_level="token", is_correction_mode="clip", is_correction_threshold=(0.8, 1.25)),
    dict(policy_loss_type="gspo", is_correction_level="seq", is_correction_threshold=(0.9, 1.1)),
    dict(token_level_loss=False, dual_clip=1.1, is_correction_level="seq", is_correction_gating="tv",
         is_correction_threshold=(0.0, 0.04)),
], ids=["ppo-clip", "gspo", "ppo-seq-tv"])  # fmt: skip
def test_policy_loss_other_backends_equal_openrlhf(impl, kwargs):
    """The reference and the Triton kernels (interpreted on CPU) give OpenRLHF's values too."""
    inputs = policy_inputs(b=3, a=11)
    ours, theirs = PolicyLoss(**kwargs, impl=impl), ORACLE_LOSS.PolicyLoss(**kwargs)
    norm = NORMALISATIONS[1]
    assert_same(run(ours, *inputs, **norm), run(theirs, *inputs, **norm))


@pytest.mark.parametrize("policy_loss_type", ["ppo", "gspo"])
@pytest.mark.parametrize("is_level", ["off", "token", "seq"])
def test_policy_loss_bf16(policy_loss_type, is_level):
    """bf16 inputs: ours computes in fp32 from the bf16 values, so it equals OpenRLHF run in fp64 on the same values
    (the gradient is rounded to bf16), and is at least as close to that as OpenRLHF's own bf16 computation."""
    kwargs = dict(dual_clip=3.0, policy_loss_type=policy_loss_type, is_correction_level=is_level,
                  is_correction_threshold=(0.5, 5.0))  # fmt: skip
    logp, old, adv, mask, rollout = policy_inputs(dtype=torch.bfloat16)
    ours, theirs = both(kwargs)
    norm = NORMALISATIONS[1]
    out = run(ours, logp, old, adv, mask, rollout, **norm)
    exact = run(theirs, *(x.double() for x in (logp, old, adv)), mask, rollout.double(), **norm)
    lowp = run(theirs, logp, old, adv, mask, rollout, **norm)
    assert out[1].dtype == torch.bfloat16
    assert_same(out, exact, rtol=1e-5, atol=1e-6, grad_tol=dict(dtype=torch.bfloat16))
    assert_lowp_no_worse(out[0][0], lowp[0][0], exact[0][0], name="bf16 loss")
    assert_lowp_no_worse(out[1], lowp[1], exact[1], name="bf16 grad")


@pytest.mark.parametrize("dual_clip", [None, 3.0, 1.1])
def test_ppo_log_ratio_clamp_at_20(dual_clip):
    """ppo clamps logp - old to [-20, 20] (no gradient beyond): tokens at +-30 with both advantage signs."""
    logp, old, adv, mask, rollout = policy_inputs()
    logp[:, :4] = old[:, :4] + torch.tensor([30.0, -30.0, 25.0, -21.0])
    adv[0, :4], adv[2, :4] = -1.0, 1.0
    mask[0, :4] = mask[2, :4] = True
    ours, theirs = both(dict(dual_clip=dual_clip, is_correction_level="token", is_correction_mode="clip"))
    assert_same(run(ours, logp, old, adv, mask, rollout), run(theirs, logp, old, adv, mask, rollout))


def test_op_delta_is_openrlhf_dual_clip_only_above_one_plus_clip_eps_high():
    """grpo_loss's delta equals OpenRLHF's dual clip c for c > 1 + eps_high; below, delta also caps positive
    advantages, which is why PolicyLoss caps the negative tokens' log-ratio itself there."""
    logp, old, adv, mask, _ = policy_inputs(spread=1.0)

    def op_loss(c):
        x = logp.clone().requires_grad_()
        loss, _ = grpo_loss(x, old, adv, mask=mask.float(), loss_type="dapo", epsilon_high=0.28, delta=c)
        loss.backward()
        return loss, x.grad

    def oracle(c):
        (loss, *_), grad = run(ORACLE_LOSS.PolicyLoss(clip_eps_high=0.28, dual_clip=c), logp, old, adv, mask, None)
        return loss, grad

    for c in (1.3, 2.0, 3.0):
        for x, y, name in zip(op_loss(c), oracle(c), ("loss", "grad"), strict=True):
            assert_close(x, y, name=f"delta={c} {name}", rtol=1e-5, atol=1e-7)
    assert not torch.allclose(op_loss(1.1)[0], oracle(1.1)[0])
    ours = run(PolicyLoss(clip_eps_high=0.28, dual_clip=1.1), logp, old, adv, mask, None)
    assert_same(ours, run(ORACLE_LOSS.PolicyLoss(clip_eps_high=0.28, dual_clip=1.1), logp, old, adv, mask, None))


def test_policy_loss_advantages_per_sequence_and_no_mask():
    logp, old, adv, mask, rollout = policy_inputs()
    adv_seq = adv[:, :1].contiguous()
    ours, theirs = both(dict(policy_loss_type="gspo"))
    assert_same(run(ours, logp, old, adv_seq, mask, None), run(theirs, logp, old, adv_seq, mask, None))
    ours, theirs = both(dict(is_correction_level="token"))  # OpenRLHF runs action_mask=None in token mode only
    assert_same(run(ours, logp, old, adv, None, rollout), run(theirs, logp, old, adv, None, rollout))
    for kwargs in (dict(policy_loss_type="gspo"), dict(token_level_loss=False)):
        x, y = run(PolicyLoss(**kwargs), logp, old, adv, None, None), run(PolicyLoss(**kwargs), logp, old, adv,
                                                                           torch.ones_like(mask), None)
        assert_same(x, y, rtol=0, atol=0)


def test_all_masked_micro_batch_is_zero_not_nan():
    """Where OpenRLHF divides 0 by 0 (nothing unmasked) ours gives 0: without global normalizers the loss, and
    always the metrics; the gradient is zero. With global normalizers the loss is OpenRLHF's (0) too."""
    logp, old, adv, mask, rollout = policy_inputs()
    mask = torch.zeros_like(mask)
    for kwargs in (dict(), dict(token_level_loss=False), dict(policy_loss_type="gspo", is_correction_level="seq")):
        for norm in NORMALISATIONS[:2]:
            (loss, clip, kl, *_), grad = run(PolicyLoss(**kwargs), logp, old, adv, mask, rollout, **norm)
            assert float(loss) == 0.0 and float(clip) == 0.0 and float(kl) == 0.0
            assert not grad.any()
        (ref_loss, ref_clip, *_), ref_grad = run(ORACLE_LOSS.PolicyLoss(**kwargs), logp, old, adv, mask, rollout,
                                                 **NORMALISATIONS[1])  # fmt: skip
        assert float(ref_loss) == 0.0 and not ref_grad.any() and math.isnan(ref_clip)


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(policy_loss_type="grpo"), ValueError, "policy_loss_type"),
    (dict(is_correction_level="sequence"), ValueError, "is_correction_level"),
    (dict(is_correction_mode="truncate"), ValueError, "is_correction_mode"),
    (dict(is_correction_gating="kl"), ValueError, "is_correction_gating"),
    (dict(is_correction_level="seq", is_correction_mode="clip"), ValueError, "clip"),
    (dict(is_correction_level="token", is_correction_mode="clip", is_correction_gating="tv"), ValueError, "clip"),
    (dict(is_correction_level="token", is_correction_gating="tv"), ValueError, "from above only"),
    (dict(is_correction_threshold=(0.5,)), ValueError, "is_correction_threshold"),
    (dict(is_correction_threshold=(2.0, 1.0)), ValueError, "low <= high"),
    (dict(dual_clip=1.0), ValueError, "dual_clip"),
    (dict(clip_eps_low=1.0), ValueError, "clip_eps_low"),
    (dict(token_level_loss=1), ValueError, "token_level_loss"),
    (dict(policy_loss_type="gspo", dual_clip=1.2), NotImplementedError, "dual_clip"),
])  # fmt: skip
def test_constructor_rejects_invalid_options(kwargs, error, match):
    with pytest.raises(error, match=match):
        PolicyLoss(**kwargs)


def test_forward_rejects_invalid_arguments():
    logp, old, adv, mask, rollout = policy_inputs(b=3, a=5)
    loss = PolicyLoss(is_correction_level="token")
    cases = [
        (dict(old_log_probs=old[:, :4]), "old_log_probs"),
        (dict(action_mask=mask[:2]), "action_mask"),
        (dict(rollout_log_probs=None), "rollout_log_probs"),
        (dict(advantages=adv[:, 0]), "advantages"),
        (dict(dp_size=0), "dp_size"),
        (dict(batch_num_tokens=0.0), "batch_num_tokens"),
        (dict(global_batch_size=torch.ones(2)), "global_batch_size"),
        (dict(log_probs=logp[0]), "log_probs"),
    ]
    base = dict(log_probs=logp, old_log_probs=old, advantages=adv, action_mask=mask, rollout_log_probs=rollout)
    for change, match in cases:
        with pytest.raises(ValueError, match=match):
            loss(**{**base, **change})
    for name in ("old_log_probs", "rollout_log_probs", "advantages"):
        with pytest.raises(ValueError, match=f"{name} requires grad"):
            loss(**{**base, name: base[name].clone().requires_grad_()})


# --------------------------------------------------------------------------------------- fused log-probs
def oracle_actor_log_probs(logits, sequences, action_mask, temperature):
    """What Actor.forward computes from full logits: OpenRLHF's own log_probs_from_logits and compute_entropy on
    logits / temperature, the next-token shift, the last A positions, times action_mask."""
    scaled = logits.float() / temperature
    with torch.compiler.set_stance("force_eager"):  # compute_entropy is torch.compile'd: run it eagerly here
        entropy = ORACLE_UTILS.compute_entropy(scaled)[:, :-1]
    lp = ORACLE_UTILS.log_probs_from_logits(scaled, torch.roll(sequences, -1, dims=1))[:, :-1]
    if action_mask is None:
        return lp, entropy
    a = action_mask.shape[1]
    return lp[:, -a:] * action_mask.float(), entropy[:, -a:]


@pytest.mark.parametrize("variant", ["actions", "all_positions", "bias_softcap", "packed"])
def test_actor_log_probs_equal_openrlhf_functions(variant):
    """actor_log_probs (fused head) = OpenRLHF's log_probs_from_logits / compute_entropy on the full logits, forward
    and gradients w.r.t. hidden and weight (and bias)."""
    b, s, h, v, a, t = 3, 13, 24, 131, 7, 0.7
    hidden = torch.randn(b, s, h, requires_grad=True)
    weight = (torch.randn(v, h) / h**0.5).requires_grad_()
    bias = torch.randn(v, requires_grad=True) if variant == "bias_softcap" else None
    softcap = 2.5 if variant == "bias_softcap" else None
    sequences = torch.randint(0, v, (b, s))
    action_mask = None if variant == "all_positions" else torch.rand(b, a) > 0.2
    attention = torch.ones(b, s, dtype=torch.long)
    attention[0, :3] = 0  # left-padded prompt
    attention[1, -2:] = 0  # right-padded response
    z = torch.nn.functional.linear(hidden, weight, bias)
    logits = z if softcap is None else softcap * torch.tanh(z / softcap)
    ref_lp, ref_ent = oracle_actor_log_probs(logits, sequences, action_mask, t)
    if variant == "packed":  # the Actor's pad_input: 0 where the predicting position is not attended
        ref_lp, ref_ent = (x * attention[:, :-1][:, -a:] for x in (ref_lp, ref_ent))
        lp, ent = actor_log_probs(hidden[attention.bool()], weight, sequences, action_mask=action_mask,
                                  attention_mask=attention, packed=True, temperature=t, return_entropy=True)
    else:
        lp, ent = actor_log_probs(hidden, weight, sequences, action_mask=action_mask, bias=bias, softcap=softcap,
                                  temperature=t, return_entropy=True)  # fmt: skip
    assert_close(lp, ref_lp, name="log_probs", rtol=1e-5, atol=1e-5)
    assert_close(ent, ref_ent, name="entropy", rtol=1e-5, atol=1e-5)
    g_lp, g_ent = torch.randn_like(lp), torch.randn_like(ent)
    params = [p for p in (hidden, weight, bias) if p is not None]
    ours = torch.autograd.grad((lp * g_lp).sum() + (ent * g_ent).sum(), params)
    theirs = torch.autograd.grad((ref_lp * g_lp).sum() + (ref_ent * g_ent).sum(), params)
    for name, x, y in zip(("hidden", "weight", "bias"), ours, theirs, strict=False):
        assert_close(x, y, name=f"grad {name}", rtol=1e-4, atol=1e-5)


def test_actor_log_probs_rejects_bad_shapes():
    hidden, weight, seq = torch.randn(2, 5, 8), torch.randn(11, 8), torch.randint(0, 11, (2, 5))
    with pytest.raises(ValueError, match="action_mask"):
        actor_log_probs(hidden, weight, seq, action_mask=torch.ones(2, 5))
    with pytest.raises(ValueError, match="hidden"):
        actor_log_probs(hidden[:, :4], weight, seq)
    with pytest.raises(ValueError, match="attention_mask"):
        actor_log_probs(hidden[0], weight, seq, packed=True)
    with pytest.raises(ValueError, match="rows"):
        actor_log_probs(hidden[0], weight, seq, packed=True, attention_mask=torch.ones(2, 5))


# ------------------------------------------------------------------------------------ the real Actor
_STANDINS = {  # modules actor.py imports that this venv lacks, with the names it takes from them
    "flash_attn": (), "flash_attn.bert_padding": ("index_first_axis", "pad_input", "rearrange", "unpad_input"),
    "flash_attn.utils": (), "flash_attn.utils.distributed": ("all_gather",),
    "peft": ("LoraConfig", "TaskType", "get_peft_model"), "peft.tuners": (), "peft.tuners.lora": ("LoraLayer",),
}  # fmt: skip


def _absent(*args, **kwargs):
    raise RuntimeError("a stand-in for a package this venv lacks was called")


@pytest.fixture(scope="module")
def actor_class():
    """openrlhf.models.actor.Actor. Its module imports flash-attn (no CPU build) and peft at import time: missing
    ones get stand-in modules for the import only (removed after), whose functions raise if ever called."""
    if "openrlhf.models.actor" not in sys.modules:
        missing = {name: names for name, names in _STANDINS.items()
                   if name.split(".")[0] not in sys.modules and importlib.util.find_spec(name.split(".")[0]) is None}
        for name, names in missing.items():
            module = sys.modules[name] = types.ModuleType(name)
            module.__path__ = []
            for attr in names:
                setattr(module, attr, _absent)
        try:
            importlib.import_module("openrlhf.models.actor")
        finally:
            for name in missing:
                del sys.modules[name]
    return sys.modules["openrlhf.models.actor"].Actor


def tiny_model(kind: str):
    """A random tiny causal LM: "untied" / "tied" Llama, or "gemma2" (tied, soft-capped final logits)."""
    import transformers

    sizes = dict(vocab_size=97, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=64)  # fmt: skip
    if kind == "gemma2":
        config = transformers.Gemma2Config(**sizes, head_dim=8, final_logit_softcapping=3.0)
        return transformers.Gemma2ForCausalLM(config).float()
    config = transformers.LlamaConfig(**sizes, tie_word_embeddings=kind == "tied")
    return transformers.LlamaForCausalLM(config).float()


def actor_batch(b=3, prompt=6, response=7, v=97):
    """Left-padded prompts, right-padded responses (OpenRLHF's layout), and the action mask of the responses."""
    s = prompt + response
    sequences = torch.randint(1, v, (b, s))
    attention = torch.ones(b, s, dtype=torch.long)
    attention[0, :2] = 0
    attention[1, -3:] = 0
    attention[2, :1] = 0
    attention[2, -1:] = 0
    sequences[attention == 0] = 0
    action_mask = attention[:, -(response - 1) :].bool()  # A = response - 1 log-probs end at the last token
    return sequences, attention, action_mask


@pytest.mark.parametrize("kind, packed", [("untied", False), ("untied", True), ("tied", False), ("tied", True),
                                          ("gemma2", False)])  # fmt: skip
def test_fused_actor_forward_equals_openrlhf_actor(actor_class, kind, packed):
    """use_grpo_kernels(actor): the same action log-probs and entropy as OpenRLHF's Actor.forward on the model's
    logits (its unpacked forward, the oracle for the packed one too), and the same gradients in every parameter."""
    model = tiny_model(kind)
    reference, fused = actor_class(model, temperature=0.8), actor_class(model, temperature=0.8)
    reference.packing_samples, fused.packing_samples = False, packed
    assert use_grpo_kernels(fused) is fused
    sequences, attention, action_mask = actor_batch()

    def step(actor):
        model.zero_grad()
        lp, out = actor(sequences, action_mask, attention_mask=attention, return_output=True, return_entropy=True)
        entropy = out.entropy[:, -action_mask.shape[1] :]
        weights = torch.linspace(-1, 1, lp.numel()).view_as(lp)
        ((lp * weights).sum() + (entropy * weights * action_mask).sum()).backward()
        return lp, entropy * action_mask, {n: p.grad.clone() for n, p in model.named_parameters()}

    with torch.compiler.set_stance("force_eager"):  # the Actor's compute_entropy is torch.compile'd
        ref_lp, ref_ent, ref_grads = step(reference)
    lp, ent, grads = step(fused)
    assert_close(lp, ref_lp, name="action log-probs", rtol=1e-5, atol=2e-5)
    assert_close(ent, ref_ent, name="entropy", rtol=1e-5, atol=2e-5)
    for name, g in ref_grads.items():
        assert_close(grads[name], g, name=f"grad {name}", rtol=1e-4, atol=1e-5)
    log_probs_only = fused(sequences, action_mask, attention_mask=attention)
    assert_close(log_probs_only, ref_lp, name="action log-probs (no output)", rtol=1e-5, atol=2e-5)
    if not packed:  # return_logprobs without action_mask: every position
        full = fused(sequences, attention_mask=attention, return_logprobs=True)
        with torch.compiler.set_stance("force_eager"):
            ref_full = reference(sequences, attention_mask=attention, return_logprobs=True)
        assert_close(full, ref_full, name="all log-probs", rtol=1e-5, atol=2e-5)


def test_fused_actor_refusals(actor_class):
    model = tiny_model("untied")
    fused = use_grpo_kernels(actor_class(model))
    fused.packing_samples = False
    sequences, attention, action_mask = actor_batch()
    with pytest.raises(ValueError, match="return_output"):
        fused(sequences, action_mask, attention_mask=attention, return_entropy=True)
    with pytest.raises(NotImplementedError, match="ring attention"):
        fused(sequences, action_mask, attention_mask=attention, ring_attn_group=object())
    _, out = fused(sequences, action_mask, attention_mask=attention, return_output=True)
    with pytest.raises(NotImplementedError, match="aux_loss"):
        out.aux_loss  # noqa: B018
    logits = fused(sequences, attention_mask=attention, return_output=True)["logits"]  # wants logits: original path
    assert logits.shape == (*sequences.shape, model.config.vocab_size)
    with pytest.raises(TypeError, match="Actor"):
        use_grpo_kernels(model)
    with pytest.raises(NotImplementedError, match="multimodal"):
        fused(sequences, action_mask, attention_mask=attention, pixel_values=torch.zeros(1))
    assert use_grpo_kernels(fused).forward.__func__ is fused.forward.__func__  # switching twice changes nothing
    adapted = actor_class(tiny_model("untied"))
    adapted.model.lm_head = torch.nn.Sequential(adapted.model.lm_head)  # not a plain Linear (as an adapter)
    with pytest.raises(NotImplementedError, match="LM head"):
        use_grpo_kernels(adapted)
    vlm = actor_class(tiny_model("untied"))
    vlm.is_vlm = True
    with pytest.raises(NotImplementedError, match="vision-language"):
        use_grpo_kernels(vlm)
    zero3 = actor_class(tiny_model("untied"))
    zero3.model.lm_head.weight.ds_id = 0  # how DeepSpeed ZeRO-3 marks a partitioned parameter
    with pytest.raises(NotImplementedError, match="ZeRO-3"):
        use_grpo_kernels(zero3)

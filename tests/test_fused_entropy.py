"""The fused LM head's entropy with its gradient, and soft-capped heads (Gemma 2's final_logit_softcapping).

fused_linear_logprobs is differentiable in both outputs (log-probs and entropy); fused_linear_grpo_loss takes an
entropy bonus (entropy_coef, entropy_mask) whose gradient flows through the same chunks; both take softcap. Every
backend against the fp64 eager oracle (full logits, c tanh(z / c), log-softmax, entropy, reference loss), forward
and backward, fp32 and bf16 (no worse than PyTorch's own bf16), odd shapes, padded and packed.
"""

import pytest
import torch
from helpers import assert_close, assert_lowp_no_worse, device_for

import grpo_kernels as gk

B, L, H, V = 3, 7, 17, 101  # odd everywhere; V prime, never a multiple of the chunk


def head(device="cpu", dtype=torch.float32, bias=True, packed=False):
    t = (B * L,) if packed else (B, L)
    hidden = torch.randn(*t, H).to(device, dtype)
    weight = (torch.randn(V, H) * 0.5).to(device, dtype)
    b = (torch.randn(V) * 0.2).to(device, dtype) if bias else None
    ids = torch.randint(0, V, t, device=device)
    return hidden, weight, b, ids


def oracle_logprobs(hidden, weight, bias, ids, temperature, softcap):
    """fp64 eager: full logits, soft-capped, log-softmax / entropy."""
    logits = torch.nn.functional.linear(hidden, weight, bias)
    if softcap is not None:
        logits = softcap * torch.tanh(logits / softcap)
    logp = torch.log_softmax(logits / temperature, -1)
    return logp.gather(-1, ids[..., None])[..., 0], -(logp.exp() * logp).sum(-1)


def grads(fn, tensors, g_logps, g_entropy):
    leaves = [None if x is None else x.detach().clone().requires_grad_() for x in tensors]
    logps, entropy = fn(*leaves)
    ((logps * g_logps).sum() + (entropy * g_entropy).sum()).backward()
    return [logps.detach(), entropy.detach()] + [None if x is None else x.grad for x in leaves]


NAMES = ("logps", "entropy", "grad hidden", "grad weight", "grad bias")


@pytest.mark.parametrize("impl", ["cpp", "triton"])
@pytest.mark.parametrize("softcap", [None, 2.5])
@pytest.mark.parametrize("bias,packed", [(True, False), (False, True)])
def test_logprobs_and_entropy_gradients_match_fp64(impl, softcap, bias, packed, triton_device):
    hidden, weight, b, ids = head(device_for(impl, triton_device), bias=bias, packed=packed)
    g_logps, g_entropy = torch.randn(ids.shape, device=ids.device), torch.randn(ids.shape, device=ids.device)
    got = grads(lambda h, w, bb: gk.fused_linear_logprobs(h, w, ids, bias=bb, temperature=0.7, return_entropy=True,
                                                          chunk_tokens=5, impl=impl, softcap=softcap),
                (hidden, weight, b), g_logps, g_entropy)  # fmt: skip
    want = grads(lambda h, w, bb: oracle_logprobs(h, w, bb, ids, 0.7, softcap),
                 [None if x is None else x.double() for x in (hidden, weight, b)], g_logps.double(),
                 g_entropy.double())  # fmt: skip
    for name, g, e in zip(NAMES, got, want, strict=True):
        if e is None:
            assert g is None, name
        else:
            assert_close(g.double(), e, name=f"{name} [{impl} softcap={softcap}]", rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("softcap", [None, 1.5])
def test_bf16_gradients_no_worse_than_pytorch(softcap):
    hidden, weight, b, ids = head(dtype=torch.bfloat16)
    g_logps, g_entropy = torch.randn(ids.shape), torch.randn(ids.shape)
    got = grads(lambda h, w, bb: gk.fused_linear_logprobs(h, w, ids, bias=bb, temperature=0.9, return_entropy=True,
                                                          chunk_tokens=4, softcap=softcap),
                (hidden, weight, b), g_logps, g_entropy)  # fmt: skip
    assert got[3].dtype == torch.bfloat16
    lowp = grads(lambda h, w, bb: oracle_logprobs(h, w, bb, ids, 0.9, softcap), (hidden, weight, b),
                 g_logps.bfloat16(), g_entropy.bfloat16())  # fmt: skip
    exact = grads(lambda h, w, bb: oracle_logprobs(h, w, bb, ids, 0.9, softcap),
                  [x.double() for x in (hidden, weight, b)], g_logps.double(), g_entropy.double())  # fmt: skip
    for name, g, t, e in zip(NAMES, got, lowp, exact, strict=True):
        assert_lowp_no_worse(g, t, e, name=f"{name} softcap={softcap}")


def test_one_output_used_and_no_grad_paths():
    """Only the log-probs (entropy unused, or not returned) or only the entropy in the loss; and no graph at all
    when nothing requires grad or grad is disabled."""
    hidden, weight, b, ids = head()
    exact = [x.double().requires_grad_() for x in (hidden, weight, b)]
    logps_e, entropy_e = oracle_logprobs(*exact, ids, 1.0, None)
    for pick, use in ((0, "logps"), (1, "entropy")):
        h = hidden.clone().requires_grad_()
        out = gk.fused_linear_logprobs(h, weight, ids, bias=b, return_entropy=True, chunk_tokens=3)
        out[pick].sum().backward()
        (g_e,) = torch.autograd.grad((logps_e, entropy_e)[pick].sum(), exact[0], retain_graph=True)
        assert_close(h.grad.double(), g_e, name=f"grad hidden, {use} only", rtol=1e-4, atol=1e-5)
    h = hidden.clone().requires_grad_()
    gk.fused_linear_logprobs(h, weight, ids, bias=b).sum().backward()
    (g_e,) = torch.autograd.grad(logps_e.sum(), exact[0])
    assert_close(h.grad.double(), g_e, name="grad hidden, return_entropy=False", rtol=1e-4, atol=1e-5)
    assert not gk.fused_linear_logprobs(hidden, weight, ids).requires_grad
    with torch.no_grad():
        assert not gk.fused_linear_logprobs(h, weight, ids).requires_grad


# ------------------------------------------------------------------------------------- the loss's entropy bonus
def loss_inputs(packed):
    lengths = torch.tensor([L, 4, 0])  # an empty sequence
    mask = (torch.arange(L)[None] < lengths[:, None]).float()
    x = dict(old=-torch.rand(B, L) * 4, adv=torch.randn(B), emask=(torch.rand(B, L) < 0.6).float() * mask,
             mask=mask)  # fmt: skip
    if packed:
        keep = mask.bool()
        x = {k: v[keep] if v.shape == (B, L) else v for k, v in x.items()}
        x["cu_seqlens"] = torch.cat([lengths.new_zeros(1), lengths.cumsum(0)])
        del x["mask"]
    return x


def run_loss(impl, hidden, weight, bias, ids, x, **kw):
    h, w, b = (t.detach().clone().requires_grad_() for t in (hidden, weight, bias))
    layout = {k: x[k] for k in ("mask", "cu_seqlens") if k in x}
    if "cu_seqlens" in x:
        layout["max_completion_length"] = L
    loss, metrics = gk.fused_linear_grpo_loss(h, w, ids, x["adv"], bias=b, old_logps=x["old"], temperature=0.8,
                                              return_entropy=True, impl=impl, **layout, **kw)  # fmt: skip
    loss.backward()
    return loss.detach(), h.grad, w.grad, b.grad, metrics


@pytest.mark.parametrize("impl", ["cpp", "triton"])
@pytest.mark.parametrize("level,loss_type", [("token", "dapo"), ("token", "grpo"), ("sequence", "grpo")])
@pytest.mark.parametrize("packed", [False, True])
def test_entropy_bonus_matches_reference(impl, level, loss_type, packed, triton_device):
    """loss - coef * mean entropy over entropy_mask (default: the loss mask), one pass or two (sequence level)."""
    x = loss_inputs(packed)
    ids_shape = x["old"].shape
    hidden, weight, b, _ = head()
    hidden = torch.randn(*ids_shape, H)
    ids = torch.randint(0, V, ids_shape)
    dev = device_for(impl, triton_device)
    to = lambda d: {k: v.to(dev) for k, v in d.items()}  # noqa: E731
    for emask in (None, "emask"):
        kw = dict(loss_type=loss_type, importance_sampling_level=level, entropy_coef=0.3, softcap=3.0,
                  entropy_mask=None if emask is None else x[emask])  # fmt: skip
        want = run_loss("reference", hidden.double(), weight.double(), b.double(), ids, x, **kw)
        kw["entropy_mask"] = None if emask is None else x[emask].to(dev)
        got = run_loss(impl, hidden.to(dev), weight.to(dev), b.to(dev), ids.to(dev), to(x), chunk_tokens=4, **kw)
        tag = f"{impl} {level} {loss_type} packed={packed} entropy_mask={emask}"
        for name, g, e in zip(("loss", "grad hidden", "grad weight", "grad bias"), got, want, strict=False):
            assert_close(g.double().cpu(), e, name=f"{name} [{tag}]", rtol=1e-4, atol=1e-5)
        assert set(got[4]) == set(want[4]), tag
        for key in want[4]:
            assert_close(got[4][key].double().cpu(), want[4][key].double(), name=f"{key} [{tag}]", rtol=1e-4,
                         atol=1e-5)  # fmt: skip


def test_entropy_bonus_is_the_loss_minus_coef_times_entropy():
    """The bonus's value and gradient are exactly the difference of two runs (coef and 0), whatever the chunking."""
    x = loss_inputs(False)
    hidden, weight, b, ids = head()
    base = run_loss("cpp", hidden, weight, b, ids, x, loss_type="grpo", chunk_tokens=2)
    with_bonus = run_loss("cpp", hidden, weight, b, ids, x, loss_type="grpo", chunk_tokens=6, entropy_coef=-0.5)
    _, entropy = oracle_logprobs(hidden.double(), weight.double(), b.double(), ids, 0.8, None)
    mean_h = (entropy * x["mask"]).sum() / x["mask"].sum()
    assert_close(with_bonus[0].double() - base[0].double(), 0.5 * mean_h, name="bonus value", rtol=1e-5, atol=1e-6)
    assert not torch.allclose(with_bonus[1], base[1])  # the bonus moves the gradient


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(softcap=0.0), "softcap"),
        (dict(softcap=-1.0), "softcap"),
        (dict(softcap=True), "softcap"),
        (dict(softcap=float("inf")), "softcap"),
        (dict(entropy_coef=float("nan")), "entropy_coef"),
        (dict(entropy_coef=0.1, entropy_mask=torch.ones(B, L + 1)), "entropy_mask"),
    ],
)
def test_bad_arguments_raise(kwargs, match):
    hidden, weight, b, ids = head()
    x = loss_inputs(False)
    with pytest.raises(ValueError, match=match):
        gk.fused_linear_grpo_loss(hidden, weight, ids, x["adv"], mask=x["mask"], **kwargs)
    if "softcap" in kwargs:
        with pytest.raises(ValueError, match=match):
            gk.fused_linear_logprobs(hidden, weight, ids, **kwargs)

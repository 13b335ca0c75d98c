"""grpo_loss_from_logits (selective log-probs fused with the loss) against the reference composition, and against
Liger's chunked GRPO loss where Liger supports the case."""

import pytest
import torch
from helpers import assert_close, assert_lowp_no_worse, device_for

import grpo_kernels as gk
from grpo_kernels import reference

IMPLS = ["cpp", "triton"]


def make(b=4, length=7, v=389, *, device="cpu", dtype=torch.float32):
    logits = (torch.randn(b, length, v) * 3).to(device=device, dtype=dtype)
    ids = torch.randint(0, v, (b, length), device=device)
    old = -torch.rand(b, length, device=device) * 4
    ref = old + 0.2 * torch.randn(b, length, device=device)
    lengths = torch.randint(1, length + 1, (b,), device=device)
    mask = (torch.arange(length, device=device)[None, :] < lengths[:, None]).float()
    adv = torch.randn(b, device=device)
    return logits, ids, old, ref, mask, adv


def reference_loss(logits, ids, old, adv, *, temperature, **kw):
    lg = logits.detach().double().requires_grad_()
    logps = reference.selective_logprobs(lg, ids, temperature=temperature)
    loss, metrics = reference.grpo_loss(logps, old.double(), adv.double(), **kw)
    (grad,) = torch.autograd.grad(loss, lg)
    return loss, grad, metrics


@pytest.mark.parametrize("loss_type,level", [("dapo", "token"), ("grpo", "sequence"), ("cispo", "token")])
@pytest.mark.parametrize("impl", IMPLS)
def test_loss_and_dlogits_match_reference(impl, triton_device, loss_type, level):
    logits, ids, old, ref, mask, adv = make(device=device_for(impl, triton_device))
    kw = dict(ref_logps=ref, mask=mask, loss_type=loss_type, beta=0.04, importance_sampling_level=level)
    lg = logits.clone().requires_grad_()
    loss, metrics = gk.grpo_loss_from_logits(lg, ids, old, adv, temperature=0.7, impl=impl, **kw)
    loss.backward()
    e_loss, e_grad, e_metrics = reference_loss(logits, ids, old, adv, temperature=0.7, **kw)
    assert_close(loss, e_loss, name="loss")
    assert_close(lg.grad, e_grad, name="d loss / d logits")
    for key in e_metrics:
        assert_close(metrics[key], e_metrics[key], name=key)
    entropy = reference.selective_logprobs(logits.double(), ids, temperature=0.7, return_entropy=True)[1]
    assert_close(metrics["entropy"], (entropy * mask).sum() / mask.sum(), name="entropy")


@pytest.mark.parametrize("impl", IMPLS)
def test_packed_logits_inplace_backward(impl, triton_device):
    logits, ids, old, ref, mask, adv = make(device=device_for(impl, triton_device))
    keep = mask.bool()
    lengths = keep.sum(1)
    cu = torch.cat([lengths.new_zeros(1), lengths.cumsum(0)])
    kw = dict(loss_type="bnpo", beta=0.04)
    lg = logits[keep].clone().requires_grad_()
    buffer = lg.detach().clone()
    view = buffer.requires_grad_()
    loss, _ = gk.grpo_loss_from_logits(
        view, ids[keep], old[keep], adv, ref_logps=ref[keep], cu_seqlens=cu, inplace_backward=True, impl=impl, **kw
    )
    loss.backward()
    e_loss, e_grad, _ = reference_loss(logits, ids, old, adv, temperature=1.0, ref_logps=ref, mask=mask, **kw)
    assert_close(loss, e_loss, name="loss")
    assert_close(view.grad, e_grad[keep], name="d logits (in place)")
    assert view.grad.data_ptr() == buffer.data_ptr(), "inplace_backward must reuse the logits buffer"


@pytest.mark.parametrize("impl", IMPLS)
def test_bf16_logits_no_worse_than_pytorch(impl, triton_device):
    logits, ids, old, ref, mask, adv = make(device=device_for(impl, triton_device), dtype=torch.bfloat16)
    kw = dict(mask=mask, loss_type="grpo")
    lg = logits.clone().requires_grad_()
    loss, _ = gk.grpo_loss_from_logits(lg, ids, old, adv, impl=impl, **kw)
    loss.backward()
    assert lg.grad.dtype == torch.bfloat16
    e_loss, e_grad, _ = reference_loss(logits, ids, old, adv, temperature=1.0, **kw)
    lt = logits.clone().requires_grad_()  # PyTorch in bf16: log_softmax + gather + the loss
    t_logps = torch.log_softmax(lt, -1).gather(-1, ids[..., None])[..., 0]
    t_loss, _ = reference.grpo_loss(t_logps, old.bfloat16(), adv.bfloat16(), mask=mask.bfloat16(), loss_type="grpo")
    t_loss.backward()
    assert_lowp_no_worse(loss, t_loss, e_loss, name="loss")
    assert_lowp_no_worse(lg.grad, lt.grad, e_grad, name="d logits")


liger_grpo = pytest.importorskip("liger_kernel.chunked_loss.grpo_loss")


@pytest.mark.parametrize(
    "loss_type,level,beta",
    [("dapo", "token", 0.0), ("grpo", "token", 0.04), ("bnpo", "sequence", 0.04), ("dr_grpo", "token", 0.0),
     ("cispo", "token", 0.04), ("sapo", "token", 0.0), ("dapo", "sequence", 0.04)],
)  # fmt: skip
def test_matches_liger_chunked_grpo_loss(loss_type, level, beta):
    """Liger's LigerFusedLinearGRPOLoss (hidden @ W inside) vs ours on the same logits: loss and d hidden."""
    b, length, h, v = 3, 6, 16, 97
    hidden = torch.randn(b, length, h)
    weight = torch.randn(v, h) * 0.3
    _, ids, old, ref, mask, adv = make(b, length, v)
    eps_high = 5.0 if loss_type == "cispo" else 0.28
    liger = liger_grpo.LigerFusedLinearGRPOLoss(
        beta=beta, compiled=False, use_ref_model=beta > 0, epsilon_high=eps_high, loss_type=loss_type,
        max_completion_length=length, importance_sampling_level=level, temperature=0.9,
    )  # fmt: skip
    x1 = hidden.clone().requires_grad_()
    out = liger(x1, weight, ids, mask, adv, ref_per_token_logps=ref if beta else None, old_per_token_logps=old)
    out[0].backward()
    x2 = hidden.clone().requires_grad_()
    ours, metrics = gk.grpo_loss_from_logits(
        x2 @ weight.T, ids, old, adv, ref_logps=ref if beta else None, mask=mask, loss_type=loss_type, beta=beta,
        epsilon_high=eps_high, importance_sampling_level=level, temperature=0.9, max_completion_length=length,
    )  # fmt: skip
    ours.backward()
    assert_close(ours, out[0], name="loss vs Liger", rtol=1e-5, atol=1e-6)
    assert_close(x2.grad, x1.grad, name="d hidden vs Liger", rtol=1e-4, atol=1e-6)
    if beta:
        assert_close(metrics["kl"], out[1][0], name="kl vs Liger", rtol=1e-5, atol=1e-6)


def test_torch_compile_fullgraph_forward_and_backward():
    logits, ids, old, ref, mask, adv = make()
    kw = dict(ref_logps=ref, mask=mask, loss_type="dapo", beta=0.04)

    def step(lg):
        loss, metrics = gk.grpo_loss_from_logits(lg, ids, old, adv, temperature=0.8, **kw)
        return loss, metrics["entropy"]

    lg = logits.clone().requires_grad_()
    loss, entropy = torch.compile(step, fullgraph=True)(lg)
    loss.backward()
    lg_e = logits.clone().requires_grad_()
    e_loss, e_entropy = step(lg_e)
    e_loss.backward()
    assert_close(loss, e_loss, name="compiled loss")
    assert_close(entropy, e_entropy, name="compiled entropy")
    assert_close(lg.grad, lg_e.grad, name="compiled d logits")

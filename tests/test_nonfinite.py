"""grpo_loss and fused_linear_grpo_loss on non-finite inputs and on ratios beyond fp32, every backend against the
fp64 reference: the behaviour documented in grpo_kernels.grpo_loss ("Non-finite values").

  * NaN in logps / old_logps / advantages / ref_logps (beta > 0) of a token with mask != 0: NaN loss on every
    backend and loss type, NaN gradient exactly where the reference has one, other gradients unchanged.
  * NaN / inf in tokens with mask 0: no effect at all, in the reference too.
  * log-ratios above 88.72 (exp overflows fp32): a clipped token (and A = 0, a zero sampler weight) has gradient
    0 and a finite loss term; only a value that itself exceeds fp32 is inf, never NaN; the KL term stays finite
    wherever beta exp(ref - logp) (times w with the bias correction) is.
"""

import pytest
import torch
from helpers import LOSS_TYPES, assert_close, device_for
from test_fused_linear import check as check_fused
from test_fused_linear import make as make_fused
from test_fused_linear import run as run_fused
from test_loss import IMPLS, _small_triton_chunks, make_batch, oracle, run  # noqa: F401 (autouse fixture)

import grpo_kernels as gk

NAN, BIG = float("nan"), 100.0  # exp(100) = 2.7e43 > FLT_MAX = 3.4e38; fp64 holds it
# Per-sequence advantages of make_batch(6, ...): positive, zero, negative, positive, negative; row 5 is empty.
ADV = torch.tensor([0.8, 0.0, -0.6, 1.1, -0.9, 0.3], dtype=torch.float64)


def _as_fp32(metrics):
    """The fp64 oracle's metrics rounded to fp32 (a ratio of 1e43 is inf there, as in every fp32 backend)."""
    return {k: v.float() for k, v in metrics.items()}


def check_all(impl, x, *, unchecked_metrics=(), dtype=torch.float32, **kw):
    """Loss, gradient (NaN where and only where the oracle's is) and metrics of a backend, with logps in dtype,
    against the fp64 oracle rounded to fp32. Returns the backend's (loss, grad)."""
    loss, grad, metrics = run(impl, x, dtype=dtype, **kw)
    e_loss, e_grad, e_metrics = oracle(x, **kw)
    assert_close(loss, e_loss.float(), name=f"loss [{impl} {kw}]")
    assert_close(grad * x["mask"], (e_grad * x["mask"]).float(), name=f"grad [{impl} {kw}]", dtype=dtype)
    assert set(metrics) == set(e_metrics)
    for key, value in _as_fp32(e_metrics).items():
        if key not in unchecked_metrics:
            assert_close(metrics[key], value, name=f"metric {key} [{impl} {kw}]")
    return loss, grad


# ------------------------------------------------------------------------------------------------------- NaN
@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("impl", IMPLS)
def test_nan_in_an_unmasked_input_gives_nan_loss_and_the_references_nan_gradients(impl, triton_device, level):
    """Advantages per sequence and per token (the kernels' two advantage paths); the KL term on, bias-corrected."""
    dev = device_for(impl, triton_device)
    for key, adv_per_token in (("logps", False), ("old", False), ("ref", False), ("adv", False), ("adv", True)):
        for loss_type in LOSS_TYPES:
            x = make_batch(device=dev)
            if key == "adv":
                x["adv"][1] = NAN  # sequence 1's advantage (each of its tokens' with adv_per_token)
            else:
                x[key][1, 0] = NAN  # mask[1, 0] = 1 (every row but the last has a token)
            kw = dict(loss_type=loss_type, beta=0.04, importance_sampling_level=level, use_bias_correction_kl=True,
                      adv_per_token=adv_per_token)  # fmt: skip
            loss, grad = check_all(impl, x, **kw)
            assert torch.isnan(loss), f"{key} NaN became {loss.item()} [{impl} {loss_type}]"
            assert not bool(torch.isnan(grad[[0, 2, 3, 4]]).any()), "a NaN reached another sequence's gradient"


@pytest.mark.parametrize("impl", IMPLS)
def test_nan_and_inf_in_masked_tokens_change_nothing_in_reference_and_backends(impl, triton_device):
    """Padding holding NaN / inf (logps, old, ref, sampler): the fp64 reference on the garbage equals the
    reference on clean inputs (before: NaN * 0 = NaN made its loss NaN), and every backend equals both."""
    dev = device_for(impl, triton_device)
    clean = make_batch(device=dev)
    pad = clean["mask"] == 0
    dirty = dict(clean)
    for key in ("logps", "old", "ref", "sampler"):
        dirty[key] = clean[key].masked_fill(pad, NAN)
    dirty["logps"] = dirty["logps"].masked_fill(pad & (torch.arange(21, device=dev) % 3 == 0), float("inf"))
    dirty["old"] = dirty["old"].masked_fill(pad & (torch.arange(21, device=dev) % 3 == 1), float("-inf"))
    for loss_type in LOSS_TYPES:
        for level in ("token", "sequence"):
            kw = dict(loss_type=loss_type, beta=0.04, importance_sampling_level=level,
                      sampler_is_mode="token_mask", use_bias_correction_kl=True)  # fmt: skip
            e_loss, e_grad, e_metrics = oracle(clean, **kw)
            d_loss, d_grad, d_metrics = oracle(dirty, **kw)
            assert_close(d_loss, e_loss, name="reference loss with garbage padding", dtype=torch.float64)
            assert_close(
                d_grad, e_grad * clean["mask"], name="reference grad with garbage padding", dtype=torch.float64
            )
            for key in e_metrics:
                assert_close(d_metrics[key], e_metrics[key], name=f"reference {key}", dtype=torch.float64)
            check_all(impl, dirty, **kw)


def _run_with_mask(impl, x, keep, *, packed, **kw):
    """run() with the mask passed in both layouts: packed keeps the positions `keep` of each row (zeros and NaN of
    the mask inside them included), as test_loss.run's packing (which drops the mask) cannot."""
    if not packed:
        return run(impl, x, **kw)
    lengths = keep.sum(1)
    cu = torch.cat([lengths.new_zeros(1), lengths.cumsum(0)])
    lp = x["logps"][keep].float().requires_grad_()
    gk._C.set_loss_simd(impl != "cpp-portable")
    try:
        loss, metrics = gk.grpo_loss(lp, x["old"][keep].float(), x["adv"].float(), mask=x["mask"][keep].float(),
                                     cu_seqlens=cu, max_completion_length=x["logps"].shape[1],
                                     impl=impl.removesuffix("-portable"), **kw)  # fmt: skip
        (grad,) = torch.autograd.grad(loss, lp)
    finally:
        gk._C.set_loss_simd(True)
    full = torch.zeros_like(x["logps"], dtype=grad.dtype)
    full[keep] = grad
    return loss, full, metrics


@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
@pytest.mark.parametrize("impl", ["reference", *IMPLS])
def test_nan_in_the_mask_gives_nan_loss_and_nan_gradients_wherever_its_normalizer_reaches(impl, triton_device,
                                                                                         packed):  # fmt: skip
    """mask[0, 17] = NaN (the second chunk of a row; the Triton tiles here are 16 tokens), a masked token inside
    row 2: the loss and every metric are NaN, as the fp64 oracle's; the normalizer that sums the mask is NaN, so on
    the C++ and Triton backends every gradient it scales is NaN (masked and clipped tokens' too): every token's
    for bnpo, vespo and dapo / cispo (sum m), row 0's for grpo / sapo, only that token's for dr_grpo, luspo and dapo
    with num_items_in_batch; every other gradient is the oracle's. (Triton's one-launch path took max(NaN, 1) = 1
    for the normalizer: finite gradients at the wrong scale.)"""
    dev = device_for(impl, triton_device)
    x = make_batch(device=dev)
    keep = x["mask"].bool()
    x["mask"][0, 17], x["mask"][2, 0] = NAN, 0.0
    cases = [dict(loss_type=t) for t in LOSS_TYPES] + [dict(loss_type="dapo", num_items_in_batch=50.0)]
    for kw in cases:
        loss, grad, metrics = _run_with_mask(impl, x, keep, packed=packed, **kw)
        e_loss, e_grad, e_metrics = oracle(x, **kw)
        assert torch.isnan(loss) and torch.isnan(e_loss), kw
        for key, value in e_metrics.items():
            assert_close(metrics[key], value.float(), name=f"metric {key} [{impl} {kw}]")
        loss_type = kw["loss_type"]
        sums_mask = loss_type in ("bnpo", "vespo") or (loss_type in ("dapo", "cispo") and len(kw) == 1)
        scope = torch.full_like(keep, sums_mask)  # the gradients the NaN normalizer scales
        scope[0] |= loss_type in ("grpo", "sapo")
        scope[0, 17] = True
        if packed:
            scope &= keep  # (the positions past a row's end do not exist)
        outside = ~scope & keep
        assert_close(grad[outside], e_grad[outside].float(), name=f"grad outside the NaN's reach [{impl} {kw}]")
        if impl != "reference":  # (the reference's autograd gives 0 through a clip or a mask: NaN * 0 dropped)
            assert bool(torch.isnan(grad[scope]).all()), f"{impl} {kw}: a finite gradient inside the NaN's reach"


# ------------------------------------------------------------------------------------------ ratios beyond fp32
def _overflowing(dev, level, seqs, *, big=BIG):
    """make_batch with ADV and log-ratio logp - old = big at tokens 0 and 2 (token level) or at every token
    (sequence level: the sequence's ratio is exp(big)) of the sequences `seqs`."""
    x = make_batch(device=dev)
    x["adv"] = ADV.to(dev)
    cols = slice(None) if level == "sequence" else [0, 2]
    for s in seqs:
        x["old"][s, cols] = x["logps"][s, cols] - big
    return x


@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("impl", IMPLS)
def test_clipped_overflowing_ratio_gives_zero_gradient_and_finite_loss(impl, triton_device, level):
    """w = exp(100): clipped for A > 0 (grpo family: the clip branch is the min), for A < 0 with dual clip delta,
    gated by cispo's stop-gradient min and sapo's saturated sigmoid; A = 0 multiplies it by an exact 0. The fp64
    reference is finite there, and so must every fp32 backend be (before: NaN gradients, inf * 0)."""
    dev = device_for(impl, triton_device)
    for loss_type in LOSS_TYPES:
        for delta in (None, 1.5):
            family0 = loss_type not in ("cispo", "sapo")
            seqs = [0, 1, 3] + ([2, 4] if delta is not None or not family0 else [])
            x = _overflowing(dev, level, seqs)
            for beta in (0.0, 0.04):
                kw = dict(loss_type=loss_type, importance_sampling_level=level, delta=delta, beta=beta,
                          epsilon_high=0.28)  # fmt: skip
                loss, grad = check_all(impl, x, **kw)
                assert torch.isfinite(loss) and bool(torch.isfinite(grad).all()), kw
                if family0 or loss_type == "sapo":
                    tokens = x["mask"][seqs].bool() if level == "sequence" else x["mask"][seqs][:, [0, 2]].bool()
                    pol_grad = grad[seqs] if level == "sequence" else grad[seqs][:, [0, 2]]
                    if beta == 0.0:
                        assert bool((pol_grad[tokens] == 0).all()), "a clipped token got a gradient"


@pytest.mark.parametrize("impl", IMPLS)
def test_unclipped_overflow_is_inf_not_nan_and_spares_other_tokens(impl, triton_device):
    """grpo family, A < 0, no delta, w = exp(100): -w A = 1.6e43 really exceeds fp32, so the loss is +inf (the
    fp64 reference rounded to fp32) and so is that token's gradient; no NaN anywhere, the other tokens' gradients
    are exact. A zero sampler weight (token_mask above the cap) on such a token gives 0, not inf * 0."""
    dev = device_for(impl, triton_device)
    x = _overflowing(dev, "token", [0, 2, 4])
    for loss_type in ("grpo", "bnpo", "dr_grpo", "dapo"):
        loss, grad = check_all(impl, x, loss_type=loss_type)
        assert loss.item() == float("inf") and not bool(torch.isnan(grad).any())
        assert bool(torch.isfinite(grad[[0, 1, 3]]).all())
        zeroed = dict(x, sampler=x["old"].clone())  # sampler weight exp(old - sampler) = 1 ...
        zeroed["sampler"][:, [0, 2]] -= 5.0  # ... but e^5 > cap 3 at the overflowing tokens: token_mask zeroes them
        loss, grad = check_all(impl, zeroed, loss_type=loss_type, sampler_is_mode="token_mask")
        assert torch.isfinite(loss) and bool(torch.isfinite(grad).all())


@pytest.mark.parametrize("impl", IMPLS)
def test_unclipped_overflow_with_the_bias_corrected_kl_gives_the_sign_of_the_sum_not_nan(impl, triton_device):
    """w = exp(100) with A < 0 (no delta) and the bias-corrected KL term: d/dlogp = w (-A - beta dr), whose two parts
    each overflow fp32 with opposite signs where dr > 0. The token's gradient is +-inf with the sign of the sum, as
    the fp64 reference rounded to fp32 (before: inf - inf = NaN on Triton and C++); with beta = 0.5 and dr = 3 the
    KL part wins."""
    dev = device_for(impl, triton_device)
    x = _overflowing(dev, "token", [0, 2, 4])
    x["ref"] = x["logps"] + torch.where(torch.arange(21, device=dev) % 2 == 0, 3.0, -3.0).double()
    for loss_type in ("grpo", "dapo", "luspo"):
        for beta in (0.04, 0.5):
            kw = dict(loss_type=loss_type, beta=beta, use_bias_correction_kl=True)
            loss, grad = check_all(impl, x, **kw)
            assert loss.item() == float("inf") and not bool(torch.isnan(grad).any()), kw
            on = x["mask"][[2, 4]][:, [0, 2]] != 0
            signs = torch.sign(grad[[2, 4]][:, [0, 2]])[on]
            assert bool(on.any()) and bool((signs == (1.0 if beta == 0.04 else -1.0)).all()), kw


@pytest.mark.parametrize("impl", IMPLS)
def test_an_infinite_advantage_times_a_zero_ratio_is_nan_as_in_the_reference(impl, triton_device):
    """logp = -inf (w = 0) with A = inf: w A = 0 inf = NaN, so the loss is NaN on every backend, as the reference's
    (before: the AVX-512 C++ kernel's min of a NaN and an inf dropped the NaN: -inf)."""
    dev = device_for(impl, triton_device)
    x = make_batch(device=dev)
    x["adv"][1] = float("inf")
    x["logps"][1, 0] = float("-inf")
    for loss_type in ("grpo", "bnpo", "dapo"):
        loss, grad = check_all(impl, x, loss_type=loss_type)
        assert torch.isnan(loss) and bool(torch.isnan(grad[1, 0])), loss_type


@pytest.mark.parametrize("impl", IMPLS)
def test_vespo_nan_ratio_with_the_bias_corrected_kl_is_nan_even_where_ref_equals_logp(impl, triton_device):
    """vespo zeroes a NaN ratio's policy term (phi = 0), but its bias-corrected KL term k3 w is NaN: also where
    ref = logp (k3 = 0, 0 NaN = NaN), as the reference's (before: the kernels took the w = inf branch for a NaN
    w, 0 for dr = 0, so the loss was finite and the token's gradient 0)."""
    dev = device_for(impl, triton_device)
    x = make_batch(device=dev)
    x["old"][0, 1] = NAN
    x["ref"][0, 1] = x["logps"][0, 1]
    loss, grad = check_all(impl, x, loss_type="vespo", beta=0.04, use_bias_correction_kl=True)
    assert torch.isnan(loss) and bool(torch.isnan(grad[0, 1]))


@pytest.mark.parametrize("impl", IMPLS)
def test_kl_term_finite_wherever_its_fp64_value_fits_fp32(impl, triton_device):
    """ref - logp = 90: exp overflows fp32 but beta exp = 4.9e37 does not (no bias correction; the "kl" metric, a
    mean of per-token k3 with one of 1.2e39, is inf). A collapsed token (logp = -150, old = -1, ref = -2) with the
    bias correction: w = e^-149 underflows and exp(ref - logp) = e^148 overflows, k3 w ~ e^-1. Both were inf or
    NaN in fp32; the loss and gradients must match the fp64 reference."""
    dev = device_for(impl, triton_device)
    for loss_type in LOSS_TYPES:
        x = make_batch(device=dev)
        x["ref"][0, 3] = x["logps"][0, 3] + 90.0
        kw = dict(loss_type=loss_type, beta=0.04)
        loss, grad = check_all(impl, x, unchecked_metrics=("kl",), **kw)
        assert torch.isfinite(loss) and bool(torch.isfinite(grad).all()), loss_type
        x = make_batch(device=dev)
        x["logps"][1, 0], x["old"][1, 0], x["ref"][1, 0] = -150.0, -1.0, -2.0
        kw = dict(loss_type=loss_type, beta=0.04, use_bias_correction_kl=True)
        loss, grad = check_all(impl, x, **kw)
        assert torch.isfinite(loss) and bool(torch.isfinite(grad).all()), loss_type


@pytest.mark.parametrize("impl", IMPLS)
def test_bf16_logps_nan_propagates_and_clipped_overflow_stays_finite(impl, triton_device):
    """The same two behaviours with bf16 logps (widened to fp32 in the kernels, gradient returned in bf16)."""
    dev = device_for(impl, triton_device)
    for loss_type in ("grpo", "cispo", "sapo"):
        x = make_batch(device=dev)
        x["logps"] = x["logps"].bfloat16().double()  # exactly representable: the oracle sees the same values
        x["old"][2, 0] = NAN
        loss, _ = check_all(impl, x, dtype=torch.bfloat16, loss_type=loss_type, beta=0.04)
        assert torch.isnan(loss)
        x = _overflowing(dev, "token", [0, 1, 3] if loss_type == "grpo" else [0, 1, 2, 3, 4])
        x["logps"] = x["logps"].bfloat16().double()
        x["old"] = torch.where(x["old"] < x["logps"] - 50, x["logps"] - BIG, x["old"])
        loss, grad = check_all(impl, x, dtype=torch.bfloat16, loss_type=loss_type, beta=0.04)
        assert torch.isfinite(loss) and bool(torch.isfinite(grad).all())


@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("impl", IMPLS)
def test_finite_mean_of_finite_terms_stays_finite(impl, triton_device, level):
    """Log-ratios in [80, 88.7] at every token: each term (-w A up to 2.6e38) fits fp32 but a sequence's sum does
    not. Every loss whose fp64 value fits fp32 (the per-sequence and per-token means) must be finite and match
    the reference, with its gradient (GSPO's w_s sum_t dl/dw passes FLT_MAX too). Rows of 300 tokens: more than 8
    terms per lane of the C++ AVX-512 blocks (blocks of 128 tokens); 40 for Triton (16-token chunks in the tests)."""
    dev = device_for(impl, triton_device)
    gen = torch.Generator().manual_seed(11)
    x = make_batch(b=4, length=40 if impl == "triton" else 300, device=dev, empty_row=False)
    x["mask"] = torch.ones_like(x["mask"])
    x["old"] = x["logps"] - (80.0 + 8.7 * torch.rand(x["logps"].shape, generator=gen, dtype=torch.float64)).to(dev)
    x["adv"] = torch.tensor([-1.0, 0.7, -0.4, -0.9], dtype=torch.float64, device=dev)
    for loss_type in LOSS_TYPES:
        kw = dict(loss_type=loss_type, importance_sampling_level=level)
        e_loss = oracle(x, **kw)[0]
        loss, grad = check_all(impl, x, **kw)
        if e_loss.abs() < 3.4e38:
            assert torch.isfinite(loss) and bool(torch.isfinite(grad).all()), (loss_type, loss)


@pytest.mark.parametrize("impl", IMPLS)
def test_the_reported_overflow_case(impl, triton_device):
    """grpo_loss(lp = -ones(2, 4), old = lp - 88, adv = [1, -1]): 8.26e37 in fp64 (was inf in C++ and Triton);
    at sequence level its gradient (2.06e37 in fp64) was inf."""
    dev = device_for(impl, triton_device)
    lp = -torch.ones(2, 4, dtype=torch.float64)
    x = dict(logps=lp, old=lp - 88.0, ref=lp, sampler=lp, mask=torch.ones_like(lp),
             adv=torch.tensor([1.0, -1.0], dtype=torch.float64))  # fmt: skip
    x = {k: v.to(dev) for k, v in x.items()}
    for level in ("token", "sequence"):
        loss, grad = check_all(impl, x, loss_type="grpo", importance_sampling_level=level)
        assert torch.isfinite(loss) and bool(torch.isfinite(grad).all()), (level, loss, grad)
        assert abs(loss.item() / 8.26e37 - 1) < 1e-2


# ------------------------------------------------------------------------------------------------ fused linear
@pytest.mark.parametrize("impl,level", [("cpp", "token"), ("cpp", "sequence"), ("triton", "token")])
def test_fused_linear_overflowing_clipped_token_keeps_weight_gradient_finite(triton_device, impl, level):
    """One token (two at sequence level: a whole sequence) with log-ratio 100 and A > 0: the clipped branch, zero
    gradient. The weight gradient sums every token's, so one inf * 0 = NaN there made all of it NaN."""
    dev = device_for(impl, triton_device)
    x = make_fused(device=dev)
    logits = torch.nn.functional.linear(x["hidden"].double(), x["weight"].double(), x["bias"].double()) / 0.8
    logps = torch.log_softmax(logits, -1).gather(-1, x["ids"][..., None])[..., 0].float()
    x["adv"] = torch.tensor([0.7, -0.5, 0.2], device=dev)
    x["old"] = logps + 0.2 * torch.randn_like(logps)
    if level == "sequence":
        x["old"][0] = logps[0] - BIG
    else:
        x["old"][0, 4] = logps[0, 4] - BIG
    kw = dict(loss_type="grpo", importance_sampling_level=level, beta=0.04)
    got = run_fused(impl, x, chunk_tokens=5, **kw)
    want = run_fused("reference", {k: v.double() if v.is_floating_point() else v for k, v in x.items()}, **kw)
    want = (*want[:4], _as_fp32(want[4]))
    for g in got[:4]:
        assert bool(torch.isfinite(g).all())
    check_fused(got, want, f"{impl} {level}")

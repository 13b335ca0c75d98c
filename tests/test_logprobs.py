"""selective_logprobs: every backend against the fp64 reference, forward and backward, plus the op contract."""

import math

import pytest
import torch
from helpers import assert_close, assert_lowp_no_worse, device_for

import grpo_kernels
from grpo_kernels import reference

# "cpp-portable" is the C++ backend with its AVX-512 path switched off (the code other CPUs run).
IMPLS = ["cpp", "cpp-portable", "triton"]


def logprobs(logits, ids, impl: str, **kw):
    """grpo_kernels.selective_logprobs with impl, where "cpp-portable" runs C++ without AVX-512."""
    grpo_kernels._C.set_logprobs_simd(impl != "cpp-portable")
    try:
        return grpo_kernels.selective_logprobs(logits, ids, impl="cpp" if impl == "cpp-portable" else impl, **kw)
    finally:
        grpo_kernels._C.set_logprobs_simd(True)


def make(t, v, dtype=torch.float32, scale=3.0):
    logits = (torch.randn(t, v) * scale).to(dtype)
    return logits, torch.randint(0, v, (t,))


def oracle(logits, ids, temperature, grads=None):
    """fp64 reference on the same (rounded) logits; with grads, also d logits by autograd."""
    x = logits.detach().double().cpu().requires_grad_()
    logps, entropy = reference.selective_logprobs(x, ids.cpu(), temperature=temperature, return_entropy=True)
    if grads is None:
        return logps, entropy, None
    (dx,) = torch.autograd.grad((logps * grads[0]).sum() + (entropy * grads[1]).sum(), x)
    return logps, entropy, dx


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("t,v", [(1, 1), (7, 17), (5, 1000), (3, 4099)])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_forward_and_backward_match_reference(impl, triton_device, t, v, temperature):
    dev = device_for(impl, triton_device)
    logits, ids = make(t, v)
    g, g_h = torch.randn(t, dtype=torch.float64), torch.randn(t, dtype=torch.float64)
    ref_lp, ref_h, ref_dx = oracle(logits, ids, temperature, (g, g_h))
    x = logits.to(dev).requires_grad_()
    logps, entropy = logprobs(x, ids.to(dev), impl, temperature=temperature, return_entropy=True)
    assert logps.dtype == torch.float32 and logps.shape == ids.shape
    assert_close(logps, ref_lp, name="logps")
    assert_close(entropy, ref_h, name="entropy")
    (dx,) = torch.autograd.grad((logps * g.float().to(dev)).sum() + (entropy * g_h.float().to(dev)).sum(), x)
    assert_close(dx, ref_dx, name="d logits")


@pytest.mark.parametrize("impl", IMPLS)
def test_logps_only_backward_and_batched_shape(impl, triton_device):
    dev = device_for(impl, triton_device)
    logits = torch.randn(2, 5, 33) * 2
    ids = torch.randint(0, 33, (2, 5))
    x = logits.to(dev).requires_grad_()
    logps = logprobs(x, ids.to(dev), impl)
    assert logps.shape == (2, 5)
    g = torch.randn(2, 5, dtype=torch.float64)
    ref_lp, _, ref_dx = oracle(logits.reshape(10, 33), ids.reshape(10), 1.0, (g.reshape(10), torch.zeros(10).double()))
    (dx,) = torch.autograd.grad((logps * g.float().to(dev)).sum(), x)
    assert_close(logps.reshape(10), ref_lp, name="logps")
    assert_close(dx.reshape(10, 33), ref_dx, name="d logits")


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_logits_no_worse_than_pytorch(impl, triton_device, dtype):
    dev = device_for(impl, triton_device)
    logits, ids = make(6, 301, dtype)
    ref_lp, ref_h, _ = oracle(logits, ids, 1.0)
    logps, entropy = logprobs(logits.to(dev), ids.to(dev), impl, return_entropy=True)
    torch_lp, torch_h = reference.selective_logprobs(logits, ids, return_entropy=True)  # PyTorch in bf16/fp16
    assert_lowp_no_worse(logps, torch_lp, ref_lp, name="logps")
    assert_lowp_no_worse(entropy, torch_h, ref_h, name="entropy")
    assert_close(logps, ref_lp, name="logps vs fp64 on the rounded inputs")


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_backward_no_worse_than_pytorch(impl, triton_device, dtype):
    dev = device_for(impl, triton_device)
    logits, ids = make(6, 301, dtype)
    g, g_h = torch.randn(6, dtype=torch.float64), torch.randn(6, dtype=torch.float64)
    _, _, ref_dx = oracle(logits, ids, 0.8, (g, g_h))
    x = logits.to(dev).requires_grad_()
    logps, entropy = logprobs(x, ids.to(dev), impl, temperature=0.8, return_entropy=True)
    (dx,) = torch.autograd.grad((logps * g.float().to(dev)).sum() + (entropy * g_h.float().to(dev)).sum(), x)
    assert dx.dtype == dtype
    xt = logits.clone().requires_grad_()  # PyTorch's own autograd in bf16/fp16
    t_lp, t_h = reference.selective_logprobs(xt, ids, temperature=0.8, return_entropy=True)
    (t_dx,) = torch.autograd.grad((t_lp * g.to(dtype)).sum() + (t_h * g_h.to(dtype)).sum(), xt)
    assert_lowp_no_worse(dx, t_dx, ref_dx, name="d logits")


@pytest.mark.parametrize("impl", IMPLS)
def test_extreme_logits_stay_finite_and_exact(impl, triton_device):
    dev = device_for(impl, triton_device)
    logits = torch.randn(4, 50) * 1e4  # the online max matters
    logits[1] = -1e4
    logits[1, 7] = 1e4  # one dominant logit: entropy ~ 0, log-prob of it ~ 0
    ids = torch.tensor([3, 7, 0, 49])
    ref_lp, ref_h, _ = oracle(logits, ids, 1.0)
    logps, entropy = logprobs(logits.to(dev), ids.to(dev), impl, return_entropy=True)
    assert bool(torch.isfinite(logps).all()) and bool(torch.isfinite(entropy).all())
    assert_close(logps, ref_lp, name="logps", rtol=1e-6, atol=1e-3)  # |z| = 1e4: fp32 spacing is ~1e-3
    assert_close(entropy, ref_h, name="entropy", atol=1e-3)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("a", [1e4, 1e6, 3e7, 1e38])
def test_tied_huge_logits_keep_their_log_prob(impl, triton_device, a):
    """Row [a, a, 0, 1], id 0: log p = -log 2 for every a (the z - lse form gave -0.6875 at 1e6 and 0.0 at 3e7)."""
    dev = device_for(impl, triton_device)
    logits = torch.tensor([[a, a, 0.0, 1.0], [a, 0.0, a, -a]])
    ids = torch.tensor([0, 2])
    x = logits.to(dev).requires_grad_()
    logps, entropy = logprobs(x, ids.to(dev), impl, return_entropy=True)
    assert_close(logps, torch.full((2,), -math.log(2), dtype=torch.float64), name="logps", rtol=1e-6, atol=1e-6)
    assert_close(entropy, torch.full((2,), math.log(2), dtype=torch.float64), name="entropy", rtol=1e-6, atol=1e-6)
    (dx,) = torch.autograd.grad(logps.sum() + entropy.sum(), x)
    # d logp / dx = onehot - p = [0.5, -0.5, 0, 0]; d H / dx = -p (log p + H) = 0
    expect = torch.tensor([[0.5, -0.5, 0.0, 0.0], [-0.5, 0.0, 0.5, 0.0]], dtype=torch.float64)
    assert_close(dx, expect, name="d logits", rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("temperature", [1.0, 0.5])
def test_rows_at_the_edge_of_fp32_stay_finite(impl, triton_device, temperature):
    """Rows of +-3e38 (and their difference past fp32's range): finite log-probs, entropy and gradients."""
    dev = device_for(impl, triton_device)
    gen = torch.Generator().manual_seed(3)
    logits = torch.where(torch.rand(3, 37, generator=gen) < 0.5, -3e38, 3e38)
    logits[0, 5], logits[1, :] = 3e38, -3e38  # row 1 all equal: uniform, entropy log 37
    logits[1, 0] = 3e38
    ids = torch.tensor([5, 0, 7])
    x = logits.to(dev).requires_grad_()
    logps, entropy = logprobs(x, ids.to(dev), impl, temperature=temperature, return_entropy=True)
    (dx,) = torch.autograd.grad(logps.sum() + entropy.sum(), x)
    assert bool(torch.isfinite(entropy).all()) and bool(torch.isfinite(dx).all()), (entropy, dx)
    top = (logits == 3e38).sum(-1).double()  # the row is uniform over its +3e38 entries
    assert_close(entropy, top.log(), name="entropy", rtol=1e-6, atol=1e-6)
    expect_lp = torch.where(logits[torch.arange(3), ids] == 3e38, -top.log(), float("-inf"))
    fin = torch.isfinite(expect_lp)
    assert_close(logps.cpu()[fin], expect_lp[fin], name="logps", rtol=1e-6, atol=1e-6)
    assert bool((logps.cpu()[~fin] < -1e30).all())


@pytest.mark.parametrize(
    "impl,logits_kind",
    [("cpp", "peaked"), ("cpp", "near_tie"), ("cpp-portable", "peaked"), ("cpp-portable", "near_tie"),
     ("triton", "peaked"), ("triton", "near_tie")],
)  # fmt: skip
@pytest.mark.parametrize("temperature", [1e-3, 1e-5])
def test_backward_exact_at_small_temperatures(impl, triton_device, temperature, logits_kind):
    """|lse| = |logits| / T is ~3e3 (T = 1e-3) to ~3e5 (1e-5) here, where an fp32 lse is off by up to half its
    spacing (1e-4 to 1.6e-2) and so was every p of the C++ backward. "peaked": N(0, 9) logits with the top one
    raised by 1 (p = 1 for it, 0 for the rest, in fp64); "near_tie": logits within ~3 T of each other (every p
    matters). Rows 0-2 score the argmax (d logits = g (1 - p) / T: the cancellation the lse error spoils most)."""
    dev = device_for(impl, triton_device)
    t, v = 6, 257
    if logits_kind == "peaked":
        logits = torch.randn(t, v) * 3
        logits[torch.arange(t), logits.argmax(-1)] += 1.0
    else:
        logits = 2.0 + torch.randn(t, v) * 3 * temperature
    ids = torch.randint(0, v, (t,))
    ids[:3] = logits[:3].argmax(-1)
    g, g_h = torch.randn(t, dtype=torch.float64), torch.randn(t, dtype=torch.float64)
    ref_lp, ref_h, ref_dx = oracle(logits, ids, temperature, (g, g_h))
    x = logits.to(dev).requires_grad_()
    logps, entropy = logprobs(x, ids.to(dev), impl, temperature=temperature, return_entropy=True)
    (dx,) = torch.autograd.grad((logps * g.float().to(dev)).sum() + (entropy * g_h.float().to(dev)).sum(), x)
    assert_close(dx, ref_dx, name="d logits", rtol=1e-5, atol=1e-6 * ref_dx.abs().max().item())
    assert_close(entropy, ref_h, name="entropy", atol=1e-5)
    assert_close(logps, ref_lp, name="logps", rtol=1e-6, atol=1e-5)  # fp32 output: |logp| up to ~|x| / T


@pytest.mark.parametrize("impl", IMPLS)
def test_non_contiguous_rows(impl, triton_device):
    dev = device_for(impl, triton_device)
    big = torch.randn(6, 80)
    logits, ids = big[:, :51], torch.randint(0, 51, (6,))
    ref_lp, _, _ = oracle(logits, ids, 1.3)
    logps = logprobs(logits.to(dev), ids.to(dev), impl, temperature=1.3)
    assert_close(logps, ref_lp, name="logps")


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(temperature=0.0), "temperature must be"),
        (dict(temperature=float("inf")), "temperature must be"),
        (dict(impl="cuda"), "impl must be one of"),
        (dict(cu_seqlens=torch.tensor([0, 2, 5])), "rise from 0 to T=6"),
        (dict(cu_seqlens=torch.tensor([0.0, 6.0])), "cu_seqlens must be an int32 or int64"),
        (dict(return_entropy=1), "return_entropy must be a bool"),
        (dict(inplace_backward="yes"), "inplace_backward must be a bool"),
    ],
)
def test_bad_arguments_raise_value_error(kwargs, match):
    logits, ids = make(6, 11)
    with pytest.raises(ValueError, match=match):
        grpo_kernels.selective_logprobs(logits, ids, **kwargs)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_kernel_never_reads_out_of_bounds_for_bad_ids(triton_device, dtype):
    # The launchers directly, past the Python id checks (as under torch.compile): ids V, V + 5 and -1 must read
    # nothing outside the row; such a row's log-prob is NaN, its entropy / lse and every other row unchanged.
    from grpo_kernels.ops import logprobs as ops

    t, v = 6, 17
    logits, good_ids = make(t, v, dtype)
    bad_rows = [0, 2, 5]  # the first and last rows: an unguarded read would leave the [T, V] buffer
    ids = good_ids.clone()
    ids[bad_rows] = torch.tensor([-1, v, v + 5])
    x, dev_ids = logits.to(triton_device), ids.to(triton_device)
    logps, entropy, lse = ops.logprobs_fwd_triton(x, dev_ids, 0.9, True)
    ok_lp, ok_h, ok_lse = ops.logprobs_fwd_triton(x, good_ids.to(triton_device), 0.9, True)
    ref_lp, ref_h, _ = oracle(logits, good_ids, 0.9)
    ok = torch.tensor([i not in bad_rows for i in range(t)])
    assert bool(torch.isnan(logps[bad_rows]).all()), "an out-of-range id gives a NaN log-prob"
    assert torch.equal(logps.cpu()[ok], ok_lp.cpu()[ok]), "in-range rows are unchanged"
    assert_close(logps.cpu()[ok], ref_lp[ok], name="in-range logps")
    assert torch.equal(entropy, ok_h) and torch.equal(lse, ok_lse)
    assert_close(entropy, ref_h, name="entropy")
    # The backward compares ids with the columns (never indexes with them): the bad rows get no one-hot term.
    g = torch.randn(t).to(triton_device)
    dx = ops.logprobs_bwd_triton(g, None, x, dev_ids, lse, None, 0.9, False)
    ok_dx = ops.logprobs_bwd_triton(g, None, x, good_ids.to(triton_device), lse, None, 0.9, False)
    assert torch.equal(dx.cpu()[ok], ok_dx.cpu()[ok]) and bool(torch.isfinite(dx.float()).all())


def test_bad_ids_and_shapes_raise_value_error():
    logits, ids = make(6, 11)
    with pytest.raises(ValueError, match=r"ids must lie in \[0, V=11\), found 11"):
        grpo_kernels.selective_logprobs(logits, torch.full((6,), 11))
    with pytest.raises(ValueError, match=r"ids must have shape \(6,\)"):
        grpo_kernels.selective_logprobs(logits, ids[:5])
    with pytest.raises(ValueError, match="float16/bfloat16/float32"):
        grpo_kernels.selective_logprobs(logits.double(), ids)
    with pytest.raises(ValueError, match="int32 or int64"):
        grpo_kernels.selective_logprobs(logits, ids.float())


@pytest.mark.parametrize("impl", IMPLS)
def test_inplace_backward_matches_and_reuses_the_logits_buffer(impl, triton_device):
    dev = device_for(impl, triton_device)
    base = torch.randn(5, 3, 29).to(dev)
    ids = torch.randint(0, 29, (5, 3)).to(dev)
    grads = []
    for inplace in (False, True):
        leaf = base.clone().requires_grad_()
        logits = leaf * 1.0  # a non-leaf [B, L, V] activation, as an LM head would produce
        logps, entropy = logprobs(logits, ids, impl, return_entropy=True, inplace_backward=inplace)
        (logps.sum() + 0.5 * entropy.sum()).backward()
        grads.append(leaf.grad)
        if inplace:
            assert torch.equal(logits.detach(), leaf.grad), "the logits buffer holds the gradient"
    assert_close(grads[1], grads[0], name="inplace vs out-of-place", rtol=0, atol=0)


# --------------------------------------------------------------------------------------- op contract
@pytest.mark.parametrize("return_entropy", [True, False])
def test_opcheck(return_entropy):
    logits = torch.randn(9, 37, requires_grad=True)
    ids = torch.randint(0, 37, (9,))
    torch.library.opcheck(torch.ops.grpo_kernels.selective_logprobs, (logits, ids, 0.8, return_entropy, False))
    lse = torch.logsumexp(logits.detach() / 0.8, dim=-1)
    h = torch.rand(9)
    args = (torch.randn(9), torch.randn(9) if return_entropy else None, logits.detach(), ids, lse,
            h if return_entropy else None, 0.8)  # fmt: skip
    torch.library.opcheck(torch.ops.grpo_kernels.selective_logprobs_backward, args)
    inplace_args = (*args[:2], logits.detach().clone(), *args[3:])
    torch.library.opcheck(torch.ops.grpo_kernels.selective_logprobs_backward_, inplace_args)


@pytest.mark.parametrize("inplace", [False, True])
def test_torch_compile_fullgraph_forward_and_backward(inplace):
    def f(x, ids):
        logits = x * 2.0
        logps, entropy = grpo_kernels.selective_logprobs(
            logits, ids, temperature=0.9, return_entropy=True, inplace_backward=inplace
        )
        return (logps * torch.arange(logps.shape[0])).sum() + entropy.sum()

    x = torch.randn(12, 40, requires_grad=True)
    ids = torch.randint(0, 40, (12,))
    compiled = torch.compile(f, fullgraph=True)
    (g_c,) = torch.autograd.grad(compiled(x, ids), x)
    (g_e,) = torch.autograd.grad(f(x, ids), x)
    assert_close(g_c, g_e, name="compiled grad")


@pytest.mark.slow
def test_a_million_packed_tokens_on_cpu():
    t, v = 2**20, 6
    logits = torch.randn(t, v)
    ids = torch.randint(0, v, (t,))
    logps = grpo_kernels.selective_logprobs(logits, ids, cu_seqlens=torch.tensor([0, 5, t]))
    rows = torch.randint(0, t, (1000,))
    ref = reference.selective_logprobs(logits[rows].double(), ids[rows])
    assert_close(logps[rows], ref, name="logps at sampled rows of a 1M-token batch")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_minus_inf_non_target_logits_give_finite_entropy_and_grads(triton_device, dtype):
    # A masked / padded vocabulary: -inf logits (not the target) contribute exactly 0 to the entropy and get
    # exactly 0 gradient; 0 * -inf terms must not turn the row into NaN. Row 3 is -inf except its target
    # (entropy 0, log-prob 0). The launchers directly plus autograd, against C++ and the fp64 oracle.
    from grpo_kernels.ops import logprobs as ops

    t, v, temp = 5, 37, 0.9
    logits, ids = make(t, v, dtype)
    ids[:] = torch.tensor([0, 5, 36, 12, 20])
    inf_cols = {0: [1, 2, 36], 1: [0, 4, 30, 31, 32], 2: [3], 4: list(range(21, 37))}
    for r, cols in inf_cols.items():
        logits[r, cols] = float("-inf")
    logits[3] = float("-inf")
    logits[3, 12] = 1.5
    inf = torch.isinf(logits)
    g, g_h = torch.randn(t, dtype=torch.float64), torch.randn(t, dtype=torch.float64)
    ref_lp, ref_h, ref_dx = oracle(logits, ids, temp, (g, g_h))
    _, _, ref_dx_lp = oracle(logits, ids, temp, (g, torch.zeros(t, dtype=torch.float64)))
    assert float(ref_h[3]) == 0.0 and float(ref_lp[3]) == 0.0
    x, dev_ids = logits.to(triton_device), ids.to(triton_device)
    logps, entropy, lse = ops.logprobs_fwd_triton(x, dev_ids, temp, True)
    gf, g_hf = g.float().to(triton_device), g_h.float().to(triton_device)
    dx = ops.logprobs_bwd_triton(gf, g_hf, x, dev_ids, lse, entropy, temp, False)
    dx_lp = ops.logprobs_bwd_triton(gf, None, x, dev_ids, lse, None, temp, False)
    for name, val in [("logps", logps), ("entropy", entropy), ("lse", lse), ("d logits", dx), ("d logits", dx_lp)]:
        assert bool(torch.isfinite(val.float()).all()), f"triton {name} not finite: {val}"
    assert_close(logps, ref_lp, name="logps")
    assert_close(entropy, ref_h, name="entropy")
    assert_close(dx, ref_dx, name="d logits (logp + entropy grads)", dtype=dtype)
    assert_close(dx_lp, ref_dx_lp, name="d logits (logp grad only)", dtype=dtype)
    assert bool((dx.cpu()[inf] == 0).all()) and bool((dx_lp.cpu()[inf] == 0).all()), "-inf logits get 0 grad"
    assert float(entropy[3]) == 0.0 and float(logps[3]) == 0.0
    # The same through the public API (autograd) and the C++ backend.
    for impl, dev in [("triton", triton_device), ("cpp", "cpu")]:
        xi = logits.to(dev).requires_grad_()
        lp_i, h_i = logprobs(xi, ids.to(dev), impl, temperature=temp, return_entropy=True)
        (dx_i,) = torch.autograd.grad((lp_i * g.float().to(dev)).sum() + (h_i * g_h.float().to(dev)).sum(), xi)
        assert_close(lp_i, ref_lp, name=f"{impl} logps")
        assert_close(h_i, ref_h, name=f"{impl} entropy")
        assert_close(dx_i, ref_dx, name=f"{impl} d logits", dtype=dtype)


def test_triton_minus_inf_target_logit_matches_reference(triton_device):
    # A -inf TARGET logit: log-prob -inf like the reference (and C++), entropy finite (0 log 0 = 0 in the reference
    # too), d logits finite: +g at the target, like autograd.
    from grpo_kernels.ops import logprobs as ops

    logits, _ = make(3, 11)
    ids = torch.tensor([4, 0, 10])
    logits[0, [4, 7]] = float("-inf")
    g, g_h = torch.randn(3, dtype=torch.float64), torch.randn(3, dtype=torch.float64)
    ref_lp, ref_h, ref_dx = oracle(logits, ids, 1.0, (g, g_h))
    assert float(ref_lp[0]) == float("-inf")
    plain_lp = reference.selective_logprobs(logits.double(), ids)
    x, dev_ids = logits.to(triton_device), ids.to(triton_device)
    logps, entropy, lse = ops.logprobs_fwd_triton(x, dev_ids, 1.0, True)
    dx = ops.logprobs_bwd_triton(g.float().to(triton_device), g_h.float().to(triton_device), x, dev_ids, lse,
                                 entropy, 1.0, False)  # fmt: skip
    assert float(logps[0]) == float("-inf") and float(plain_lp[0]) == float("-inf")
    assert_close(logps[1:], ref_lp[1:], name="logps")
    assert_close(entropy, ref_h, name="entropy")
    assert_close(dx, ref_dx, name="d logits")
    c_lp, c_h = grpo_kernels._C.selective_logprobs(logits, ids, 1.0, True)[:2]
    assert float(c_lp[0]) == float("-inf")
    assert_close(c_h, ref_h, name="cpp entropy")

"""group_advantages: every backend against the fp64 reference, forward and backward, plus the op contract."""

import contextlib

import pytest
import torch
from helpers import assert_close, assert_lowp_no_worse, device_for

import grpo_kernels
from grpo_kernels import reference
from grpo_kernels.ops import advantages as ops

# "cpp-portable" is the C++ backend with its AVX-512 paths switched off (the code other CPUs run).
IMPLS = ["cpp", "cpp-portable", "triton"]


@contextlib.contextmanager
def cpu_simd(on: bool):
    grpo_kernels._C.set_cpu_simd(on)
    try:
        yield
    finally:
        grpo_kernels._C.set_cpu_simd(True)


def advantages(rewards, impl: str, **kw):
    """grpo_kernels.group_advantages with impl, where "cpp-portable" runs C++ without AVX-512."""
    with cpu_simd(impl != "cpp-portable"):
        return grpo_kernels.group_advantages(rewards, impl="cpp" if impl == "cpp-portable" else impl, **kw)


def random_offsets(sizes, dtype=torch.int64):
    return torch.cat([torch.zeros(1, dtype=torch.int64), torch.tensor(sizes).cumsum(0)]).to(dtype)


def oracle(rewards, **kw):
    """The reference in fp64 on the very values the backend saw (after any low-precision rounding)."""
    w = kw.pop("reward_weights", None)
    offsets = kw.pop("group_offsets", None)
    return reference.group_advantages(
        rewards.double().cpu(),
        reward_weights=None if w is None else torch.as_tensor(w, dtype=torch.float64),
        group_offsets=None if offsets is None else offsets.cpu(),
        **kw,
    )


def check_against_reference(impl, device, rewards, **kw):
    offsets = kw.get("group_offsets")
    if offsets is not None:
        kw["group_offsets"] = offsets.to(device)
    out = advantages(rewards.to(device), impl, **kw)
    ref = oracle(rewards, **kw)
    for field in ref._fields:
        assert_close(getattr(out, field), getattr(ref, field), name=f"{impl} {field}")
    assert out.advantages.dtype == torch.float32 and out.valid.dtype == torch.bool
    return out, ref


# ------------------------------------------------------------------------------------------ forward
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("n,g", [(1, 1), (7, 7), (7, 1), (4231, 1), (4231, 4231), (4232, 8), (4232, 23), (2048, 1024)])
@pytest.mark.parametrize("scale", ["group", "batch", "none"])
@pytest.mark.parametrize("std", ["unbiased", "biased"])
def test_uniform_groups_match_reference(impl, triton_device, n, g, scale, std):
    rewards = torch.randn(n) * 3 + 1
    check_against_reference(impl, device_for(impl, triton_device), rewards, group_size=g, scale=scale, std=std)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("offset_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_variable_group_sizes_match_reference(impl, triton_device, offset_dtype, scale):
    sizes = torch.randint(1, 40, (60,)).tolist() + [1, 3000, 1, 2, 1024, 1025]  # chunked walk past 1024
    perm = torch.randperm(len(sizes)).tolist()
    sizes = [sizes[i] for i in perm]
    rewards = torch.randn(sum(sizes))
    offsets = random_offsets(sizes, offset_dtype)
    check_against_reference(impl, device_for(impl, triton_device), rewards, group_offsets=offsets, scale=scale)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("g", [2, 4, 16, 64])
def test_binary_rewards_mask_all_equal_groups_exactly(impl, triton_device, g):
    rewards = torch.bernoulli(torch.full((128 * g,), 0.3))
    rewards[:g] = 1.0  # at least one all-1 group
    rewards[g : 2 * g] = 0.0  # and one all-0 group
    out, ref = check_against_reference(impl, device_for(impl, triton_device), rewards, group_size=g)
    groups = rewards.view(-1, g)
    expected_valid = ~((groups == 0).all(1) | (groups == 1).all(1))
    assert torch.equal(out.valid.cpu(), expected_valid)
    masked = out.advantages.cpu().view(-1, g)[~expected_valid]
    assert bool((masked == 0).all()), "invalid groups must get advantage exactly 0"
    assert float(out.invalid_fraction) == pytest.approx(float((~expected_valid).float().mean()), abs=1e-7)


@pytest.mark.parametrize("impl", IMPLS)
def test_all_equal_non_binary_groups_are_invalid(impl, triton_device):
    values = torch.tensor([0.3, -7.1, 1e3, 0.1, 1e4 / 3, 3e5 + 0.1, -7.7e6, 1e30])
    rewards = values.repeat_interleave(9)  # groups of 9 equal values: rounding must not make them valid
    out, _ = check_against_reference(impl, device_for(impl, triton_device), rewards, group_size=9)
    assert not bool(out.valid.any()) and bool((out.advantages == 0).all())


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("std", ["unbiased", "biased"])
def test_singleton_groups_are_invalid(impl, triton_device, std):
    sizes = [1, 5, 1, 1, 3]
    rewards = torch.randn(sum(sizes))
    out, _ = check_against_reference(
        impl, device_for(impl, triton_device), rewards, group_offsets=random_offsets(sizes), std=std
    )
    assert out.valid.tolist() == [False, True, False, False, True]


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("scale", ["group", "batch"])
def test_multiple_reward_functions_are_weighted(impl, triton_device, scale):
    rewards = torch.randn(96, 3)
    weights = [1.0, 0.5, -2.0]
    check_against_reference(
        impl, device_for(impl, triton_device), rewards, group_size=8, reward_weights=weights, scale=scale
    )


@pytest.mark.parametrize("impl", IMPLS)
def test_non_contiguous_rewards(impl, triton_device):
    dev = device_for(impl, triton_device)
    base = torch.randn(3, 120)
    check_against_reference(impl, dev, base.t(), group_size=6, reward_weights=[0.2, 1.0, 3.0])  # [120, 3] stride 1,120
    check_against_reference(impl, dev, base[1, ::2], group_size=5)  # [60], stride 2


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float64])
def test_low_and_high_precision_rewards(impl, triton_device, dtype):
    rewards = (torch.randn(40, 16) * 2 + 0.5).to(dtype).flatten()
    out, ref = check_against_reference(impl, device_for(impl, triton_device), rewards, group_size=16)
    if dtype in (torch.bfloat16, torch.float16):
        torch_lowp = reference.group_advantages(rewards, group_size=16)  # PyTorch computing in bf16/fp16
        for field in ("advantages", "group_mean", "group_std"):
            assert_lowp_no_worse(getattr(out, field), getattr(torch_lowp, field), getattr(ref, field), name=field)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_rewards_invalidate_their_group(impl, triton_device, bad):
    rewards = torch.randn(64, 2)
    rewards[13, 1] = bad  # group 1 of 8
    rewards[40, 0] = bad  # group 5
    for scale in ("group", "batch", "none"):
        out, _ = check_against_reference(
            impl, device_for(impl, triton_device), rewards, group_size=8, nan="invalid", scale=scale
        )
        assert out.valid.tolist() == [True, False, True, True, True, False, True, True]
        assert bool(torch.isnan(out.group_mean[[1, 5]]).all()) and bool(torch.isfinite(out.advantages).all())


@pytest.mark.parametrize("impl", [*IMPLS, "reference"])
@pytest.mark.parametrize("case", ["all_equal", "equal_groups_mixed_values", "all_non_finite"])
def test_batch_scale_with_eps_zero_and_no_valid_group_gives_exact_zeros(impl, triton_device, case):
    # Every group invalid: the batch std S can be 0 (1 / (S + eps) is inf), yet advantages are exactly 0.
    if case == "all_equal":
        rewards = torch.full((32,), 0.7)  # S = 0
    elif case == "equal_groups_mixed_values":
        rewards = torch.tensor([1.0, -2.0, 0.5, 3.0]).repeat_interleave(8)  # S > 0, all groups still invalid
    else:
        rewards = torch.randn(32)
        rewards[::8] = float("nan")  # no finite group: S over zero rewards is 0
    kw = dict(group_size=8, scale="batch", eps=0.0, nan="invalid")
    out, _ = check_against_reference(impl, device_for(impl, triton_device), rewards, **kw)
    assert not bool(out.valid.any())
    assert torch.equal(out.advantages.cpu(), torch.zeros(32)), "invalid groups must get advantage exactly 0"


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("std", ["unbiased", "biased"])
def test_batch_scale_with_eps_zero_mixed_groups_match_reference(impl, triton_device, std):
    rewards = torch.randn(64) * 2 + 1
    rewards[:8] = 0.25  # invalid: all equal
    rewards[24:32] = 1.0  # invalid: all equal
    rewards[45] = float("inf")  # invalid: non-finite
    kw = dict(group_size=8, scale="batch", eps=0.0, std=std, nan="invalid")
    out, _ = check_against_reference(impl, device_for(impl, triton_device), rewards, **kw)
    assert out.valid.tolist() == [False, True, True, False, True, False, True, True]
    assert bool(torch.isfinite(out.advantages).all())


@pytest.mark.parametrize("impl", [*IMPLS, "reference"])
def test_nan_error_names_the_first_bad_index(impl, triton_device):
    dev = device_for(impl, triton_device)
    rewards = torch.randn(16, 2)
    rewards[5, 1] = float("nan")
    rewards[9, 0] = float("inf")
    with pytest.raises(ValueError, match=r"rewards\[5, 1\] = nan is not finite"):
        advantages(rewards.to(dev), impl, group_size=4)
    flat = torch.randn(20)
    flat[13] = float("-inf")
    offsets = random_offsets([3, 9, 8]).to(dev)
    with pytest.raises(ValueError, match=r"rewards\[13\] = -inf is not finite"):
        advantages(flat.to(dev), impl, group_offsets=offsets)


def test_nan_error_reports_an_overflowing_weighted_sum():
    rewards = torch.full((8, 2), 3e38)
    with pytest.raises(ValueError, match=r"rows 0..3 overflows"):
        grpo_kernels.group_advantages(rewards, group_size=4)


@pytest.mark.parametrize("impl", IMPLS)
def test_many_groups_span_many_programs(impl, triton_device):
    rewards = torch.rand(2**16)
    check_against_reference(impl, device_for(impl, triton_device), rewards, group_size=4)


def test_auto_routes_cpu_to_cpp_bitwise():
    rewards = torch.randn(300, 2)
    a = grpo_kernels.group_advantages(rewards, group_size=10)
    b = grpo_kernels.group_advantages(rewards, group_size=10, impl="cpp")
    assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def test_reference_impl_matches_the_fp64_oracle():
    rewards = torch.randn(50)
    out = grpo_kernels.group_advantages(rewards, group_size=5, impl="reference")
    for field, value in oracle(rewards, group_size=5)._asdict().items():
        assert_close(getattr(out, field), value, name=field)


# ----------------------------------------------------------------------------------------- backward
def test_reference_gradients_pass_gradcheck():
    rewards = torch.randn(24, 2, dtype=torch.float64, requires_grad=True)
    weights = torch.tensor([0.7, -1.3], dtype=torch.float64, requires_grad=True)
    offsets = random_offsets([5, 1, 8, 10])
    for scale in ("group", "batch", "none"):

        def f(r, w, scale=scale):
            out = reference.group_advantages(r, group_offsets=offsets, reward_weights=w, scale=scale, min_std=0.0)
            return out.advantages, out.group_mean, out.group_std

        assert torch.autograd.gradcheck(f, (rewards, weights))


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("scale", ["group", "batch", "none"])
@pytest.mark.parametrize("std", ["unbiased", "biased"])
def test_gradients_match_reference(impl, triton_device, scale, std):
    dev = device_for(impl, triton_device)
    sizes = [4, 1, 7, 4, 12, 3]
    n = sum(sizes)
    rewards = torch.randn(n, 3)
    rewards[n - 3 :, :] = torch.tensor([1.0, 2.0, 3.0])  # an all-equal (invalid) last group
    rewards[5, 2] = float("nan")  # a non-finite group (index 5 is in group 2)
    weights = torch.tensor([1.0, -0.5, 2.0])
    g_adv, g_mean, g_std = torch.randn(n), torch.randn(len(sizes)), torch.randn(len(sizes))
    offsets = random_offsets(sizes)
    kw = dict(group_offsets=offsets, scale=scale, std=std, nan="invalid")

    r64, w64 = rewards.double().requires_grad_(), weights.double().requires_grad_()
    ref = reference.group_advantages(r64, reward_weights=w64, **kw)
    good = torch.isfinite(ref.group_mean)
    loss = (ref.advantages * g_adv).sum() + (ref.group_mean * g_mean)[good].sum() + (ref.group_std * g_std)[good].sum()
    ref_gr, ref_gw = torch.autograd.grad(loss, (r64, w64))
    ref_gr = torch.where(torch.isfinite(ref_gr), ref_gr, 0.0)

    r, w = rewards.to(dev).requires_grad_(), weights.to(dev).requires_grad_()
    out = advantages(r, impl, reward_weights=w, **{**kw, "group_offsets": offsets.to(dev)})
    good_d = good.to(dev)
    loss = (
        (out.advantages * g_adv.to(dev)).sum()
        + (out.group_mean * g_mean.to(dev))[good_d].sum()
        + (out.group_std * g_std.to(dev))[good_d].sum()
    )
    gr, gw = torch.autograd.grad(loss, (r, w))
    assert_close(gr, ref_gr, name="grad rewards", rtol=1e-4, atol=1e-4)
    assert_close(gw, ref_gw, name="grad weights", rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_gradients_no_worse_than_pytorch(impl, triton_device, dtype):
    dev = device_for(impl, triton_device)
    rewards = (torch.randn(48, 2) * 2).to(dtype)
    g_adv = torch.randn(48, dtype=torch.float64)
    r64 = rewards.double().requires_grad_()
    (ref_g,) = torch.autograd.grad((reference.group_advantages(r64, group_size=8).advantages * g_adv).sum(), r64)
    rt = rewards.clone().requires_grad_()  # PyTorch's own autograd in bf16/fp16
    torch_adv = reference.group_advantages(rt, group_size=8).advantages
    (torch_g,) = torch.autograd.grad((torch_adv * g_adv.to(dtype)).sum(), rt)
    r = rewards.to(dev).requires_grad_()
    (g,) = torch.autograd.grad((advantages(r, impl, group_size=8).advantages * g_adv.float().to(dev)).sum(), r)
    assert g.dtype == dtype
    assert_lowp_no_worse(g, torch_g, ref_g, name="grad rewards")


# --------------------------------------------------------------------------------------- op contract
def _op_args(rewards, offsets=None, group_size=4, scale="group"):
    weights = torch.ones(rewards.shape[1])
    return (rewards, weights, offsets, group_size if offsets is None else 0, scale, 1e-6, True, 1e-4)


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_opcheck_uniform_and_offsets(scale):
    r = torch.randn(32, 2, requires_grad=True)
    torch.library.opcheck(torch.ops.grpo_kernels.group_advantages, _op_args(r, scale=scale))
    offsets = random_offsets([3, 9, 1, 19])
    torch.library.opcheck(torch.ops.grpo_kernels.group_advantages, _op_args(r, offsets, scale=scale))


def test_torch_compile_fullgraph_forward_and_backward():
    def step(rewards, weights):
        out = grpo_kernels.group_advantages(rewards, group_size=8, reward_weights=weights)
        return (out.advantages**2 * torch.arange(rewards.shape[0])).sum() + out.group_std.sum(), out.invalid_fraction

    compiled = torch.compile(step, fullgraph=True)
    r = torch.randn(64, 2, requires_grad=True)
    w = torch.tensor([1.0, 0.5], requires_grad=True)
    loss_c, frac_c = compiled(r, w)
    (gr_c,) = torch.autograd.grad(loss_c, r)
    loss_e, frac_e = step(r, w)
    (gr_e,) = torch.autograd.grad(loss_e, r)
    assert_close(loss_c, loss_e, name="loss")
    assert_close(gr_c, gr_e, name="grad")
    assert float(frac_c) == float(frac_e)


# ------------------------------------------------------------------------------------------ bad input
@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(group_size=3), "does not divide"),
        (dict(), "exactly one of group_size and group_offsets"),
        (dict(group_size=4, group_offsets=torch.tensor([0, 8])), "exactly one"),
        (dict(group_size=0), "positive int"),
        (dict(group_size=True), "positive int"),
        (dict(group_offsets=torch.tensor([0, 3, 8])), "end at N=16"),
        (dict(group_offsets=torch.tensor([1, 3, 16])), "start at 0"),
        (dict(group_offsets=torch.tensor([0, 5, 5, 16])), r"strictly increasing: group 1 is \[5, 5\)"),
        (dict(group_offsets=torch.tensor([0, 9, 4, 16])), "strictly increasing: group 1"),
        (dict(group_offsets=torch.tensor([0.0, 16.0])), "int32 or int64"),
        (dict(group_offsets=torch.tensor([[0, 16]])), "1-D"),
        (dict(group_size=4, scale="rank"), "scale must be one of"),
        (dict(group_size=4, std="sample"), "std must be one of"),
        (dict(group_size=4, nan="ignore"), "nan must be one of"),
        (dict(group_size=4, impl="cuda"), "impl must be one of"),
        (dict(group_size=4, eps=-1.0), "eps must be"),
        (dict(group_size=4, min_std=float("nan")), "min_std must be"),
        (dict(group_size=4, reward_weights=[1.0, 2.0]), r"shape \(1,\)"),
    ],
)
def test_bad_arguments_raise_value_error(kwargs, match):
    with pytest.raises(ValueError, match=match):
        grpo_kernels.group_advantages(torch.randn(16), **kwargs)


@pytest.mark.parametrize(
    "rewards,match",
    [
        (torch.randint(0, 2, (8,)), "floating"),
        (torch.zeros(0), "N, K >= 1"),
        (torch.zeros(8, 0), "N, K >= 1"),
        (torch.zeros(2, 2, 2), r"\[N\] or \[N, K\]"),
        ([1.0, 0.0], "torch.Tensor"),
    ],
)
def test_bad_rewards_raise_value_error(rewards, match):
    with pytest.raises(ValueError, match=match):
        grpo_kernels.group_advantages(rewards, group_size=1)


def test_weights_must_match_columns_and_be_finite():
    with pytest.raises(ValueError, match=r"shape \(3,\)"):
        grpo_kernels.group_advantages(torch.randn(8, 3), group_size=2, reward_weights=[1.0, 1.0])
    with pytest.raises(ValueError, match="non-finite"):
        grpo_kernels.group_advantages(torch.randn(8, 2), group_size=2, reward_weights=[1.0, float("inf")])


def test_cpp_refuses_non_cpu_tensors():
    with pytest.raises(ValueError, match="impl='cpp' runs CPU tensors only"):
        grpo_kernels.group_advantages(torch.randn(8, device="meta"), group_size=2, impl="cpp", nan="invalid")


def test_triton_on_cpu_without_interpreter_raises_clear_error(tmp_path):
    import os
    import subprocess
    import sys

    code = (
        "import torch, grpo_kernels\n"
        "try:\n"
        "    grpo_kernels.group_advantages(torch.randn(8), group_size=4, impl='triton')\n"
        "except RuntimeError as e:\n"
        "    print('RAISED', e)\n"
    )
    if torch.cuda.is_available():
        pytest.skip("with CUDA present the interpreter is not involved")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert "RAISED" in proc.stdout and "TRITON_INTERPRET=1" in proc.stdout, proc.stdout + proc.stderr


def test_block_shape_covers_typical_group_and_caps_tile():
    assert ops._block_shape(4096, 1024, 4, False) == (ops.TILE // 4, 4)
    assert ops._block_shape(5000, 10, 0, True) == (1, min(1024, ops.MAX_BLOCK_M))  # twice the mean size, capped
    assert ops._block_shape(600, 50, 0, True) == (ops.TILE // 32, 32)
    assert ops._block_shape(10**6, 2, 0, True) == (1, ops.MAX_BLOCK_M)


@pytest.mark.parametrize("impl", [*IMPLS, "reference"])
@pytest.mark.parametrize(
    "offsets,match",
    [([0, 5, 5, 16], r"group 1 is \[5, 5\)"), ([0, 9, 4, 16], "group 1 is"), ([0, 3, 20], "end at N=16")],
)
def test_bad_offset_values_raise_value_error_for_every_backend(impl, triton_device, offsets, match):
    dev = device_for(impl, triton_device)
    with pytest.raises(ValueError, match=match):
        advantages(torch.randn(16, device=dev), impl, group_offsets=torch.tensor(offsets, device=dev))


@pytest.mark.parametrize("magnitude", [1e-30, 1e20, 1e37])
@pytest.mark.parametrize("scale", ["group", "batch", "none"])
@pytest.mark.parametrize("impl", IMPLS)
def test_huge_and_tiny_rewards_match_the_fp64_reference(impl, triton_device, magnitude, scale):
    """Squared deviations of rewards beyond ~1e19 overflow fp32 (the Triton kernel marked such groups invalid with
    a NaN std): every backend must give the fp64 reference's statistics, rounded to fp32."""
    rewards = torch.randn(4 * 6) * magnitude
    device = device_for(impl, triton_device)
    out = advantages(rewards.to(device), impl, group_size=6, scale=scale)
    ref = oracle(rewards, group_size=6, scale=scale)
    assert torch.equal(out.valid.cpu(), ref.valid)
    for field in ("advantages", "group_mean", "group_std"):
        want = getattr(ref, field).float()
        assert_close(getattr(out, field), want, name=f"{impl} {field}", rtol=2e-5, atol=2e-5 * float(want.abs().max()))

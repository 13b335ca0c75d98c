"""grpo_loss backends (C++, Triton) against the spec, reference.grpo_loss (itself checked against TRL's own code in
test_loss_reference.py), plus direct TRL parity, packing, edge values, bad input and the torch.library contract."""

import itertools

import pytest
import torch
from helpers import LOSS_TYPES, assert_close, assert_lowp_no_worse, device_for

import grpo_kernels as gk
from grpo_kernels import reference
from grpo_kernels.ops import loss as loss_ops
from grpo_kernels.ops import loss_fused

# "cpp-portable" is the C++ backend with its AVX-512 path switched off (the code other CPUs run).
IMPLS = ["cpp", "cpp-portable", "triton"]
SAMPLER_MODES = [None, "token_truncate", "token_mask", "sequence_truncate", "sequence_mask"]
# Every combination of the options that change the kernels' code paths (delta, KL bias correction, on-policy,
# per-token advantages, sampler mode): 80 per (loss_type, level, beta).
OPTION_SETS = list(itertools.product(SAMPLER_MODES, [None, 1.5], [False, True], [False, True], [False, True]))


@pytest.fixture(autouse=True)
def _small_triton_chunks(monkeypatch):
    """Small Triton tiles: the interpreter runs faster and short test sequences still span several chunks."""
    monkeypatch.setattr(loss_ops, "BLOCK", 8)
    monkeypatch.setattr(loss_ops, "CHUNK", 16)
    monkeypatch.setattr(loss_fused, "BLOCK", 8)  # the fused token-level path: two blocks of one sequence per chunk
    monkeypatch.setattr(loss_fused, "CHUNK", 16)


def make_batch(b=6, length=21, *, device="cpu", dtype=torch.float64, empty_row=True):
    logps = -torch.rand(b, length, dtype=dtype) * 3
    old = logps + 0.3 * torch.randn(b, length, dtype=dtype)  # ratios on both sides of the clip range
    ref = logps + 0.2 * torch.randn(b, length, dtype=dtype)
    sampler = old + 0.4 * torch.randn(b, length, dtype=dtype)  # some exp(old - sampler) above the cap
    lengths = torch.randint(1, length + 1, (b,))
    lengths[0] = length
    if empty_row:
        lengths[-1] = 0  # a fully masked sequence
    mask = (torch.arange(length)[None, :] < lengths[:, None]).to(dtype)
    adv = torch.randn(b, dtype=dtype)
    return {
        k: v.to(device) for k, v in dict(logps=logps, old=old, ref=ref, sampler=sampler, mask=mask, adv=adv).items()
    }


def run(impl, x, *, dtype=torch.float32, packed=False, old=True, adv_per_token=False, **kw):
    """(loss, d loss / d logps, metrics) of one backend; inputs cast to dtype (logps) / float32 (the others)."""
    cast = {k: v.detach().to(torch.float32) for k, v in x.items()}
    lp = x["logps"].detach().to(dtype)
    adv = cast["adv"][:, None].expand_as(lp).contiguous() * (1 + cast["mask"]) if adv_per_token else cast["adv"]
    args = dict(ref_logps=cast["ref"], mask=cast["mask"])
    if kw.get("sampler_is_mode"):
        args["sampler_logps"] = cast["sampler"]
    old_lp = cast["old"] if old else None
    if packed:  # the same data without the padding: 1-D tokens + cu_seqlens
        keep = cast["mask"].bool()
        lengths = keep.sum(1)
        cu = torch.cat([lengths.new_zeros(1), lengths.cumsum(0)])
        lp, old_lp = lp[keep], None if old_lp is None else old_lp[keep]
        adv = adv[keep] if adv_per_token else adv
        args = {k: v[keep] for k, v in args.items() if k != "mask"}
        args.update(cu_seqlens=cu, max_completion_length=x["logps"].shape[1])
    lp = lp.requires_grad_()
    gk._C.set_loss_simd(impl != "cpp-portable")
    try:
        loss, metrics = (reference.grpo_loss if impl == "oracle" else gk.grpo_loss)(
            lp, old_lp, adv, **args, **kw, **({} if impl == "oracle" else {"impl": impl.removesuffix("-portable")})
        )
        (grad,) = torch.autograd.grad(loss, lp)
    finally:
        gk._C.set_loss_simd(True)
    if packed:
        full = torch.zeros_like(x["logps"], dtype=grad.dtype)
        full[cast["mask"].bool()] = grad
        grad = full
    return loss, grad, metrics


def oracle(x, **kw):
    """The reference in fp64 on the padded layout."""
    return run("oracle", x, dtype=torch.float64, **kw)


def check_against_oracle(impl, x, *, packed=False, **kw):
    loss, grad, metrics = run(impl, x, packed=packed, **kw)
    e_loss, e_grad, e_metrics = oracle(x, **kw)
    tag = f"{impl} {'packed' if packed else 'padded'} {kw}"
    assert_close(loss, e_loss, name=f"loss [{tag}]")
    assert_close(grad * x["mask"], e_grad * x["mask"], name=f"grad [{tag}]")
    assert set(metrics) == set(e_metrics), tag
    for key in metrics:
        assert metrics[key].dim() == 0 and metrics[key].device == x["logps"].device
        assert_close(metrics[key], e_metrics[key], name=f"metric {key} [{tag}]")


@pytest.mark.parametrize(
    "loss_type,level,beta", list(itertools.product(LOSS_TYPES, ["token", "sequence"], [0.0, 0.04]))
)
@pytest.mark.parametrize("impl", IMPLS)
def test_every_option_matches_reference(impl, triton_device, loss_type, level, beta):
    """C++: all 80 option sets, padded and packed. Triton (slow in the interpreter): 6 of them, rotating, so that
    every option value is covered across the 24 (loss_type, level, beta) cases."""
    x = make_batch(device=device_for(impl, triton_device))
    case = (LOSS_TYPES.index(loss_type) * 4 + ["token", "sequence"].index(level) * 2 + int(beta > 0)) * 6
    options = (
        OPTION_SETS if impl.startswith("cpp") else [OPTION_SETS[(case + 13 * i) % len(OPTION_SETS)] for i in range(6)]
    )
    for i, (mode, delta, bias_kl, on_policy, adv_per_token) in enumerate(options):
        if loss_type == "vespo" and mode:  # vespo takes token-level sampler weights only (into its phi)
            mode = mode.replace("sequence", "token")
        kw = dict(loss_type=loss_type, importance_sampling_level=level, beta=beta, delta=delta, epsilon_high=0.28,
                  use_bias_correction_kl=bias_kl, sampler_is_mode=mode, old=not on_policy,
                  adv_per_token=adv_per_token)  # fmt: skip
        check_against_oracle(impl, x, packed=impl != "triton" or i % 2 == 1, **kw)
        if impl != "triton":
            check_against_oracle(impl, x, packed=False, **kw)


@pytest.mark.parametrize(
    "loss_type,level,beta", list(itertools.product(LOSS_TYPES, ["token", "sequence"], [0.0, 0.04]))
)
def test_matches_trl_own_loss_code(loss_type, level, beta):
    """Our default backend against TRL's _compute_loss itself (not only through the reference)."""
    from test_loss_reference import trl_loss  # skips this test where TRL is not installed (the others still run)

    x = make_batch(5, 9, empty_row=False)
    num_items = x["mask"].sum() * 1.5
    inputs = {
        "prompt_ids": torch.zeros(5, 2, dtype=torch.long), "prompt_mask": torch.ones(5, 2, dtype=torch.long),
        "completion_ids": torch.zeros(5, 9, dtype=torch.long), "completion_mask": x["mask"].long(),
        "advantages": x["adv"].float(), "old_per_token_logps": x["old"].float(),
        "ref_per_token_logps": x["ref"].float(), "num_items_in_batch": num_items.float(),
    }  # fmt: skip
    lp_trl = x["logps"].float().requires_grad_()
    expected, trl_metrics = trl_loss(lp_trl, inputs, loss_type=loss_type, beta=beta, level=level)
    (g_trl,) = torch.autograd.grad(expected, lp_trl)
    loss, grad, metrics = run(
        "auto", x, loss_type=loss_type, beta=beta, importance_sampling_level=level, epsilon_high=0.28,
        num_items_in_batch=num_items,
    )  # fmt: skip
    assert_close(loss, expected, name="loss vs TRL")
    assert_close(grad * x["mask"], g_trl * x["mask"], name="grad vs TRL")
    for key, values in trl_metrics.items():
        if key in metrics:
            assert metrics[key].item() == pytest.approx(values[-1], abs=1e-6), key


@pytest.mark.parametrize("loss_type", ["grpo", "luspo", "vespo"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("impl", IMPLS)
def test_low_precision_logps_no_worse_than_pytorch(impl, triton_device, dtype, loss_type):
    """Low-precision logps (the other inputs fp32): our fp32 arithmetic vs PyTorch's on all-low-precision
    tensors, both against the fp64 oracle of the same (rounded) inputs."""
    x = make_batch(7, 33, device=device_for(impl, triton_device))
    x["logps"] = x["logps"].to(dtype).double()  # exactly representable: every path sees the same values
    kw = dict(loss_type=loss_type, beta=0.04, sampler_is_mode="token_truncate")
    loss, grad, _ = run(impl, x, dtype=dtype, **kw)
    assert grad.dtype == dtype
    e_loss, e_grad, _ = oracle(x, **kw)
    lowp = {k: v.to(dtype) for k, v in x.items()}
    lp = lowp["logps"].requires_grad_()
    t_loss, _ = reference.grpo_loss(lp, lowp["old"], lowp["adv"], ref_logps=lowp["ref"], mask=lowp["mask"],
                                    sampler_logps=lowp["sampler"], **kw)  # fmt: skip
    (t_grad,) = torch.autograd.grad(t_loss, lp)
    assert_lowp_no_worse(loss, t_loss, e_loss, name="loss")
    assert_lowp_no_worse(grad * x["mask"], t_grad * x["mask"], e_grad * x["mask"], name="grad")


@pytest.mark.parametrize("impl", IMPLS)
def test_long_sequences_span_many_chunks_packed_equals_padded(impl, triton_device):
    """Sequences far longer than a chunk (here 16 tokens for Triton) and very uneven lengths, packed vs padded."""
    dev = device_for(impl, triton_device)
    x = make_batch(4, 150, device=dev)
    for kw in (dict(loss_type="dapo", beta=0.04), dict(loss_type="grpo", importance_sampling_level="sequence",
                                                       sampler_is_mode="sequence_mask")):  # fmt: skip
        padded = run(impl, x, **kw)
        packed = run(impl, x, packed=True, **kw)
        assert_close(packed[0], padded[0], name="loss packed vs padded")
        assert_close(packed[1], padded[1] * x["mask"], name="grad packed vs padded")
        check_against_oracle(impl, x, packed=True, **kw)


@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("impl", IMPLS)
def test_extreme_log_ratios_stay_finite(impl, triton_device, level):
    dev = device_for(impl, triton_device)
    x = make_batch(4, 10, device=dev)
    sign = torch.where(torch.rand(4, 10, device=dev) > 0.5, 1.0, -1.0).double()
    x["old"] = x["logps"] - 80 * sign
    x["ref"] = x["logps"] + 80 * sign.flip(1)
    x["sampler"] = x["old"] + 80 * sign
    for loss_type in LOSS_TYPES:
        kw = dict(loss_type=loss_type, beta=0.04, importance_sampling_level=level, sampler_is_mode="token_truncate")
        loss, grad, metrics = run(impl, x, **kw)
        assert torch.isfinite(loss) and bool(torch.isfinite(grad).all()), loss_type
        assert all(bool(torch.isfinite(v)) for v in metrics.values()), loss_type
        e_loss, e_grad, _ = oracle(x, **kw)
        assert_close(loss, e_loss, name=f"{loss_type} loss", rtol=1e-5)
        assert_close(grad * x["mask"], e_grad * x["mask"], name=f"{loss_type} grad", rtol=1e-5)


@pytest.mark.parametrize("impl", IMPLS)
def test_fully_masked_sequences_contribute_nothing_even_with_garbage(impl, triton_device):
    dev = device_for(impl, triton_device)
    x = make_batch(5, 12, device=dev)
    clean = {k: v.clone() for k, v in x.items()}
    pad = x["mask"] == 0
    for key in ("logps", "old", "ref", "sampler"):
        x[key] = x[key].masked_fill(pad, float("nan"))
    x["logps"] = x["logps"].masked_fill(pad & (torch.arange(12, device=dev) % 2 == 0), float("inf"))
    for loss_type in LOSS_TYPES:
        for level in ("token", "sequence"):
            mode = "token_truncate" if loss_type == "vespo" else "sequence_truncate"
            kw = dict(loss_type=loss_type, beta=0.04, importance_sampling_level=level, sampler_is_mode=mode)
            loss, grad, metrics = run(impl, x, **kw)
            assert torch.isfinite(loss) and not bool(torch.isnan(grad).any())
            assert bool((grad[pad] == 0).all()), "padding got a gradient"
            e_loss, e_grad, e_metrics = oracle(clean, **kw)
            assert_close(loss, e_loss, name=f"{loss_type}/{level} loss")
            assert_close(grad, e_grad * clean["mask"], name=f"{loss_type}/{level} grad")
            for key in metrics:
                assert_close(metrics[key], e_metrics[key], name=key)


def test_a_million_packed_tokens_on_cpu():
    """1M tokens in 300 packed sequences (the Triton kernel's grid is checked by the AOT compile test)."""
    lengths = torch.randint(1, 6000, (300,))
    lengths = (lengths * (1_000_000 / lengths.sum())).long().clamp(min=1)
    cu = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)])
    t = int(cu[-1])
    logps = -torch.rand(t) * 3
    old = logps + 0.1 * torch.randn(t)
    adv = torch.randn(300)
    lp = logps.clone().requires_grad_()
    loss, _ = gk.grpo_loss(lp, old, adv, cu_seqlens=cu, loss_type="bnpo")
    loss.backward()
    seq = torch.repeat_interleave(torch.arange(300), lengths)
    w = (logps - old).double().exp()
    a = adv.double()[seq]
    per_token = -torch.minimum(w * a, w.clamp(0.8, 1.2) * a)
    assert loss.item() == pytest.approx(per_token.mean().item(), rel=1e-5)
    assert lp.grad.shape == (t,) and bool(torch.isfinite(lp.grad).all())


def test_module_wrapper_matches_function_and_checks_names():
    x = make_batch(empty_row=False)
    f = gk.GRPOLoss(loss_type="grpo", beta=0.04, epsilon_high=0.28)
    a = f(x["logps"].float(), x["old"].float(), x["adv"].float(), ref_logps=x["ref"].float(), mask=x["mask"])
    b = gk.grpo_loss(x["logps"].float(), x["old"].float(), x["adv"].float(), ref_logps=x["ref"].float(),
                     mask=x["mask"], loss_type="grpo", beta=0.04, epsilon_high=0.28)  # fmt: skip
    assert torch.equal(a[0], b[0])
    assert "loss_type='grpo'" in repr(f)
    with pytest.raises(TypeError, match="epsilon"):
        gk.GRPOLoss(epsilon=0.2)


def _args(**over):
    x = make_batch(3, 5, dtype=torch.float32, empty_row=False)
    args = dict(logps=x["logps"], old_logps=x["old"], advantages=x["adv"], mask=x["mask"])
    args.update(over)
    return args


@pytest.mark.parametrize(
    "over,match",
    [
        (dict(loss_type="ppo"), "loss_type"),
        (dict(epsilon_low=1.0), "epsilon_low"),
        (dict(epsilon_low=-0.1), "epsilon_low"),
        (dict(epsilon_high=float("nan")), "epsilon_high"),
        (dict(delta=0.0), "delta"),
        (dict(beta=-1.0), "beta"),
        (dict(beta=0.04), "ref_logps"),
        (dict(importance_sampling_level="seq"), "importance_sampling_level"),
        (dict(sampler_is_mode="token_truncate"), "sampler_logps"),
        (dict(sampler_logps=torch.zeros(3, 5), sampler_is_mode="tok"), "sampler_is_mode"),
        (dict(sampler_is_cap=0.0), "sampler_is_cap"),
        (dict(max_completion_length=0), "max_completion_length"),
        (dict(num_items_in_batch=-1.0), "num_items_in_batch"),
        (dict(advantages=torch.zeros(4)), "advantages"),
        (dict(advantages=torch.zeros(3, 1)), "advantages"),
        (dict(old_logps=torch.zeros(3, 4)), "old_logps"),
        (dict(mask=torch.ones(3, 6)), "mask"),
        (dict(logps=torch.zeros(3, 5, dtype=torch.float64)), "logps"),
        (dict(logps=torch.zeros(0, 5)), "empty batch"),
        (dict(old_logps=torch.zeros(3, 5, requires_grad=True)), "old_logps"),
        (dict(impl="cuda"), "impl"),
        (dict(use_bias_correction_kl=1), "use_bias_correction_kl"),
        (dict(loss_type="vespo", vespo_k_pos=-1.0), "vespo_k_pos"),
        (dict(loss_type="vespo", vespo_lambda_neg=float("inf")), "vespo_lambda_neg"),
        (dict(loss_type="vespo", sampler_logps=torch.zeros(3, 5), sampler_is_mode="sequence_mask"), "sampler_is_mode"),
    ],
)
def test_bad_arguments_raise_value_error_naming_them(over, match):
    args = _args(**over)
    if args["logps"].shape[0] == 0:
        args.update(advantages=torch.zeros(0), mask=None, old_logps=None)
    with pytest.raises(ValueError, match=match):
        gk.grpo_loss(**args)


@pytest.mark.parametrize(
    "cu,match",
    [
        ([0, 7, 4, 12], "cu_seqlens"),  # not monotone
        ([0, 5, 11], "cu_seqlens"),  # does not end at T
        ([1, 5, 12], "cu_seqlens"),  # does not start at 0
        ([12], "cu_seqlens"),  # no sequence
    ],
)
def test_bad_cu_seqlens_raise_value_error(cu, match):
    logps = torch.zeros(12)
    with pytest.raises(ValueError, match=match):
        gk.grpo_loss(logps, None, torch.zeros(max(len(cu) - 1, 1)), cu_seqlens=torch.tensor(cu))
    with pytest.raises(ValueError, match="cu_seqlens"):
        gk.grpo_loss(logps, None, torch.zeros(2), cu_seqlens=torch.tensor([0, 4.0, 12]))
    with pytest.raises(ValueError, match="packed"):
        gk.grpo_loss(torch.zeros(3, 4), None, torch.zeros(3), cu_seqlens=torch.tensor([0, 4, 8, 12]))


def _op_args(seq_level: bool, family: int = 0):
    x = make_batch(4, 6, dtype=torch.float32)
    t = x["logps"].reshape(-1)
    cu = torch.arange(5, dtype=torch.int64) * 6
    flat = [x[k].reshape(-1) for k in ("old", "ref", "sampler")]
    hyper = (0.2, 0.28, 1.5, 0.04, True, 3.0, 1.0, 1.05, 2.0, 3.0, 3.0, 2.0)
    return (t.clone().requires_grad_(), *flat, x["adv"], False, x["mask"].reshape(-1), cu, 6, family, seq_level,
            1 if family == 3 else 3, *hyper)  # fmt: skip


@pytest.mark.parametrize("family", [0, 3])
@pytest.mark.parametrize("seq_level", [False, True])
def test_opcheck(seq_level, family):
    torch.library.opcheck(torch.ops.grpo_kernels.grpo_loss_fwd, _op_args(seq_level, family))
    coef = torch.randn(24)
    bwd = (torch.randn(4), torch.randn(4), coef, torch.ones(24), torch.arange(5) * 6, 6, seq_level, torch.float32)
    torch.library.opcheck(torch.ops.grpo_kernels.grpo_loss_bwd, bwd)


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_torch_compile_fullgraph_forward_and_backward(level):
    x = make_batch(dtype=torch.float32)
    kw = dict(ref_logps=x["ref"], mask=x["mask"], loss_type="grpo", beta=0.04, importance_sampling_level=level)

    def step(lp):
        loss, metrics = gk.grpo_loss(lp, x["old"], x["adv"], **kw)
        return loss, metrics["ratio_mean"]

    lp = x["logps"].clone().requires_grad_()
    loss, ratio = torch.compile(step, fullgraph=True)(lp)
    loss.backward()
    lp_e = x["logps"].clone().requires_grad_()
    e_loss, e_ratio = step(lp_e)
    e_loss.backward()
    assert_close(loss, e_loss, name="compiled loss")
    assert_close(ratio, e_ratio, name="compiled ratio")
    assert_close(lp.grad, lp_e.grad, name="compiled grad")


@pytest.mark.parametrize("impl", ["cpp", "triton"])
def test_per_token_advantages_when_num_seqs_equals_num_tokens(impl, triton_device):
    """Packed, B == T with an empty sequence: advantages of T values are read per token, as the reference does."""
    dev = device_for(impl, triton_device)
    logps, old = torch.tensor([-1.0, -2.0], device=dev), torch.tensor([-1.1, -1.7], device=dev)
    adv, cu = torch.tensor([0.5, -2.0], device=dev), torch.tensor([0, 0, 2], device=dev)
    loss, _ = gk.grpo_loss(logps, old, adv, cu_seqlens=cu, loss_type="grpo", impl=impl)
    expected, _ = reference.grpo_loss(logps.double(), old.double(), adv.double(), cu_seqlens=cu, loss_type="grpo")
    assert_close(loss, expected, name="loss")

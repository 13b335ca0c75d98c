"""Property test: the same random and edge-case inputs (+-inf, NaN, huge values, empty rows, -inf vocabulary
entries, extreme temperatures) through every backend of every op; each must give the reference's verdict.

The verdict is the fp64 reference's (`grpo_kernels.reference` on float64 copies of the inputs), rounded to
float32: a ValueError from the public checks for every backend or for none; NaN exactly where the oracle is NaN,
+-inf exactly where it is +-inf (a value beyond float32's range is inf there too); finite values within a
tolerance scaled by the output's magnitude. Inputs come from a seeded generator per case, not from the
cases the kernels were written against.
"""

import math

import pytest
import torch

import grpo_kernels as gk
from grpo_kernels import reference
from grpo_kernels.ops import loss as loss_ops
from grpo_kernels.ops import loss_fused

BACKENDS = ["cpp", "triton"]
EDGE = [float("nan"), float("inf"), -float("inf"), 3e38, -3e38, 1e30, -1e30, 1e-30, 0.0, -0.0]
CASES = 24


@pytest.fixture(autouse=True)
def _small_triton_chunks(monkeypatch):
    monkeypatch.setattr(loss_ops, "BLOCK", 8)
    monkeypatch.setattr(loss_ops, "CHUNK", 16)
    monkeypatch.setattr(loss_fused, "BLOCK", 8)  # the fused token-level path: two blocks of one sequence per chunk
    monkeypatch.setattr(loss_fused, "CHUNK", 16)


def sprinkle(x: torch.Tensor, g: torch.Generator, values, p: float) -> torch.Tensor:
    """x with a fraction p of its entries replaced by values drawn from `values`."""
    x = x.clone()
    hit = torch.rand(x.shape, generator=g) < p
    picks = torch.tensor(values, dtype=x.dtype)[torch.randint(0, len(values), x.shape, generator=g)]
    return torch.where(hit, picks, x)


def verdict_equal(got, oracle, *, name, rtol=1e-4, gradient=False):
    """got (float32) against oracle (float64, rounded to float32): same NaN / +-inf positions, finite close.

    gradient=True: where the oracle's gradient is beyond float32 (+-inf once rounded), any non-finite value is
    accepted: with an infinite upstream gradient, d hidden = g (onehot - p) W mixes +inf and -inf (NaN)."""
    want = oracle.detach().double().float().double()  # values beyond float32 become inf, as they must
    got = got.detach().double().cpu()
    want = want.cpu()
    if gradient:
        beyond = torch.isinf(want)
        assert not torch.isfinite(got[beyond]).any(), f"{name}: finite where the gradient overflows float32"
        got, want = got[~beyond], want[~beyond]
    for kind, test in (("NaN", torch.isnan), ("+inf", lambda t: t == math.inf), ("-inf", lambda t: t == -math.inf)):
        a, b = test(got), test(want)
        where = lambda m: m.reshape(-1).nonzero().flatten()[:6].tolist()  # noqa: E731
        assert torch.equal(a, b), f"{name}: {kind} at flat {where(a)} but the reference has it at {where(b)}"
    finite = torch.isfinite(want)
    if finite.any():
        scale = want[finite].abs().max().clamp(min=1.0)
        err = (got[finite] - want[finite]).abs()
        bad = err > rtol * (want[finite].abs() + scale * 1e-2)
        assert not bad.any(), (f"{name}: {int(bad.sum())} values off; worst |err| {float(err.max()):.3g}, got "
                               f"{got[finite][bad][:3].tolist()} want {want[finite][bad][:3].tolist()}")  # fmt: skip


def outcome(fn):
    try:
        return fn(), None
    except ValueError as exc:
        return None, exc


def same_verdict(ours, oracle, name):
    """Both raise ValueError, or neither; returns (ours, oracle) results when neither raised."""
    (got, err), (want, want_err) = outcome(ours), outcome(oracle)
    assert (err is None) == (want_err is None), f"{name}: ours raised {err!r}, the reference raised {want_err!r}"
    return got, want


# ------------------------------------------------------------------------------------------- group_advantages
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", range(CASES))
def test_group_advantages_verdict(backend, case, triton_device):
    g = torch.Generator().manual_seed(1000 + case)
    group_size = [2, 3, 5, 8][case % 4]
    groups = 1 + case % 7
    kind = case % 3
    rewards = torch.randn(groups * group_size, generator=g) * [1.0, 1e-6, 1e20][kind]
    if case % 2:
        rewards = sprinkle(rewards, g, EDGE, 0.15)
    if case % 5 == 0:  # identical rewards: an invalid group
        rewards[:group_size] = 0.5
    opts = dict(group_size=group_size, scale=["group", "batch", "none"][case % 3], eps=[1e-6, 0.0][case % 2],
                std=["unbiased", "biased"][case % 2], nan=["invalid", "error"][(case // 2) % 2])  # fmt: skip
    dev = triton_device if backend == "triton" else "cpu"
    got, want = same_verdict(lambda: gk.group_advantages(rewards.to(dev), impl=backend, **opts),
                             lambda: gk.group_advantages(rewards.double(), impl="reference", **opts),
                             f"case {case} {opts}")  # fmt: skip
    if got is None:
        return
    assert torch.equal(got.valid.cpu(), want.valid), f"case {case}: valid {got.valid} vs {want.valid}"
    for field in ("advantages", "group_mean", "group_std"):
        verdict_equal(getattr(got, field), getattr(want, field), name=f"case {case} {field} {opts}")


# ------------------------------------------------------------------------------------------ selective_logprobs
def logits_case(case):
    g = torch.Generator().manual_seed(2000 + case)
    t, v = 1 + case % 6, [1, 2, 7, 33, 130][case % 5]
    logits = torch.randn(t, v, generator=g) * [1.0, 30.0, 1e4][case % 3]
    if case % 2:  # a masked vocabulary: -inf logits, never on the target
        logits = sprinkle(logits, g, [-float("inf")], 0.4)
    if case % 7 == 3:  # values the reference turns into NaN or inf
        logits = sprinkle(logits, g, [float("nan"), float("inf"), 3e38, -3e38], 0.1)
    ids = torch.randint(0, v, (t,), generator=g)
    if case % 2:
        logits[torch.arange(t), ids] = torch.randn(t, generator=g)
    temperature = [1.0, 0.7, 1e-3, 1e-5, 50.0][case % 5]
    return logits, ids, temperature


def oracle_logprobs(logits, ids, temperature):
    gk.selective_logprobs(logits, ids, temperature=temperature, impl="reference")  # the public checks' verdict
    return reference.selective_logprobs(logits.double(), ids, temperature=temperature, return_entropy=True)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", range(CASES))
def test_selective_logprobs_verdict(backend, case, triton_device):
    logits, ids, temperature = logits_case(case)
    dev = triton_device if backend == "triton" else "cpu"
    x = logits.to(dev).requires_grad_()
    got, want = same_verdict(
        lambda: gk.selective_logprobs(x, ids.to(dev), temperature=temperature, return_entropy=True, impl=backend),
        lambda: oracle_logprobs(logits, ids, temperature),
        f"case {case}",
    )  # fmt: skip
    if got is None:
        return
    verdict_equal(got[0], want[0], name=f"case {case} logps (T={temperature})")
    verdict_equal(got[1], want[1], name=f"case {case} entropy (T={temperature})")
    x64 = logits.double().requires_grad_()
    w = torch.randn(ids.shape[0], generator=torch.Generator().manual_seed(case))
    lp, ent = reference.selective_logprobs(x64 / 1.0, ids, temperature=temperature, return_entropy=True)
    (g_want,) = torch.autograd.grad((lp * w.double() + 0.5 * ent).sum(), x64)
    (g_got,) = torch.autograd.grad((got[0] * w.to(dev) + 0.5 * got[1]).sum(), x)
    verdict_equal(g_got, g_want, name=f"case {case} d logits (T={temperature})", rtol=1e-3)


# ---------------------------------------------------------------------------------------------------- grpo_loss
LOSS_TYPES = ["grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo"]


def loss_case(case, logps=None):
    """Packed inputs (empty sequences too) with: log-ratios up to +-60 (w up to 1e26), and in some cases tokens
    whose ratio or KL overflows fp32 (log-ratio +-200: w = e^200, finite in fp64, so the oracle stays exact), NaN in
    unmasked tokens, and NaN / +-inf / 1e30 garbage in masked ones (which must change nothing)."""
    g = torch.Generator().manual_seed(3000 + case)
    lengths = [int(n) for n in torch.randint(0, 9, (1 + case % 4,), generator=g)]
    lengths[0] = max(lengths[0], 1)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    t = int(cu[-1])
    if logps is None:
        logps = -torch.rand(t, generator=g) * 3
    noise = lambda scale: (torch.randn(t, generator=g) * scale).clamp(-60, 60)  # noqa: E731
    old = logps + noise([0.1, 2.0, 20.0][case % 3])
    ref = logps + noise([0.1, 5.0, 20.0][(case // 3) % 3])
    mask = (torch.rand(t, generator=g) > 0.2).float()
    on = mask > 0
    if case % 4 == 1:  # ratios past fp32 (clipped or not, by the sign of A) and NaN, in unmasked tokens
        old = torch.where(on, sprinkle(old, g, [float("nan")], 0.1), old)
        old = torch.where(on, old - sprinkle(torch.zeros(t), g, [-200.0, 200.0], 0.2), old)
    if case % 5 == 2:  # a KL term past fp32
        ref = torch.where(on, ref + sprinkle(torch.zeros(t), g, [200.0], 0.2), ref)
    garbage = [float("nan"), float("inf"), -float("inf"), 1e30, -1e30]
    old, ref = (torch.where(on, x, sprinkle(x, g, garbage, 0.7)) for x in (old, ref))
    adv = torch.randn(len(lengths), generator=g) * [1.0, 1e3][case % 2]
    opts = dict(loss_type=LOSS_TYPES[case % 6], beta=[0.0, 0.04][(case // 2) % 2],
                importance_sampling_level=["token", "sequence"][(case // 6) % 2],
                delta=[None, 3.0][(case // 4) % 2])  # fmt: skip
    return logps, old, ref, adv, mask, cu, opts


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", range(CASES))
def test_grpo_loss_verdict(backend, case, triton_device):
    logps, old, ref, adv, mask, cu, opts = loss_case(case)
    dev = triton_device if backend == "triton" else "cpu"
    x = logps.to(dev).requires_grad_()
    x64 = logps.double().requires_grad_()
    got, want = same_verdict(
        lambda: gk.grpo_loss(x, old.to(dev), adv.to(dev), ref_logps=ref.to(dev), mask=mask.to(dev),
                             cu_seqlens=cu.to(dev), impl=backend, **opts),
        lambda: reference.grpo_loss(x64, old.double(), adv.double(), ref_logps=ref.double(), mask=mask.double(),
                                    cu_seqlens=cu, **opts),
        f"case {case} {opts}",
    )  # fmt: skip
    if got is None:
        return
    verdict_equal(got[0], want[0], name=f"case {case} loss {opts}")
    (g_got,) = torch.autograd.grad(got[0], x)
    (g_want,) = torch.autograd.grad(want[0], x64)
    verdict_equal(g_got, g_want, name=f"case {case} d logps {opts}", rtol=1e-3, gradient=True)


# ------------------------------------------------------------------------------------- fused_linear (LM head)
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", range(CASES // 2))
def test_fused_linear_grpo_loss_verdict(backend, case, triton_device):
    t = loss_case(case)[0].shape[0]
    g = torch.Generator().manual_seed(4000 + case)
    h, v = 16, [3, 37][case % 2]
    hidden = torch.randn(t, h, generator=g) * [1.0, 8.0][case % 2]
    weight = torch.randn(v, h, generator=g)
    ids = torch.randint(0, v, (t,), generator=g)
    _, old, ref, adv, mask, cu, opts = loss_case(case, reference.selective_logprobs(hidden @ weight.T, ids))
    dev = triton_device if backend == "triton" else "cpu"
    hid, w = hidden.to(dev).requires_grad_(), weight.to(dev).requires_grad_()
    h64, w64 = hidden.double().requires_grad_(), weight.double().requires_grad_()

    def oracle():
        lp = reference.selective_logprobs(h64 @ w64.T, ids)
        return reference.grpo_loss(lp, old.double(), adv.double(), ref_logps=ref.double(), mask=mask.double(),
                                   cu_seqlens=cu, **opts)  # fmt: skip

    got, want = same_verdict(
        lambda: gk.fused_linear_grpo_loss(hid, w, ids.to(dev), adv.to(dev), old_logps=old.to(dev),
                                          ref_logps=ref.to(dev), mask=mask.to(dev), cu_seqlens=cu.to(dev),
                                          impl=backend, **opts),
        oracle, f"case {case} {opts}",
    )  # fmt: skip
    if got is None:
        return
    verdict_equal(got[0], want[0], name=f"case {case} loss {opts}")
    g_got = torch.autograd.grad(got[0], (hid, w))
    g_want = torch.autograd.grad(want[0], (h64, w64))
    for name, a, b in zip(("d hidden", "d weight"), g_got, g_want, strict=True):
        verdict_equal(a, b, name=f"case {case} {name} {opts}", rtol=1e-3, gradient=True)

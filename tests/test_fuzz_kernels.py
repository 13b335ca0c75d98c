"""Property-based tests (hypothesis) of the one-launch kernels against the fp64 reference, with NaN, +-inf and huge
finite values placed by hypothesis in every input, the mask included: grpo_loss's token-level loss types on Triton
(ops/loss_fused: padded and packed grids, advantages per sequence and per token) and group_advantages (uniform
groups and offsets, every scale); the C++ backend on the same examples.

The oracle is grpo_kernels.reference in fp64 and the rules for non-finite values of grpo_kernels.loss's docstring.
Where the rules deliberately differ from the fp64 reference, the oracle encodes the rule (no wider tolerance):
  * a ratio beyond fp64 too (log w > 600 here: log-probs of +-1e4, an old log-prob of -inf) is exact arithmetic:
    inf times an exact zero (a clip, A = 0, a zero derivative or sampler weight) is 0. The oracle runs such a token
    at log w = 600 (w = 4e260: finite in fp64 even times 1e10 twice, inf once rounded to fp32), old and sampler
    log-probs shifted together;
  * the KL term takes beta exp(ref - logp) (times w with the bias correction) as one exp: closed form here;
  * an exact zero sampler weight zeroes its token's term (not a NaN one); a NaN term has a NaN gradient; a token's
    gradient is the product (d loss / d sum m l) m dl/dlogp (a NaN normalizer reaches masked and clipped tokens);
  * the clip fractions and sampler_logp_abs_diff add m over the flagged (non-NaN) tokens, a select (an infinite m
    elsewhere adds nothing); the latter takes nan_to_num in fp32 (TRL's: inf -> FLT_MAX), the mean exact, and is
    not compared where some m FLT_MAX passes fp32 (Triton and portable C++ round it per token, the AVX-512 C++
    adds (m / 8) FLT_MAX: both by design);
  * group_advantages combines K reward columns in fp32: a row whose weighted sum overflows is non-finite.
The oracle takes the per-token terms and derivatives from the reference one token at a time, the normalizers from
reference._aggregate. Values are multiples of 1/256 (huge: 1e4 for log-probs, 1e10 for advantages and mask, 1e30
and 3e38 for rewards), so fp32 differences of inputs are exact and no exp lands in (88.7, 709), where fp32
overflows and fp64 does not. The tolerance is fp32's: 2e-5 of the sum of the magnitudes of the parts.
Left out by assume(): a +inf logp, and a second infinity (ref - logp, A, a mask entry) beside a ratio beyond fp64,
whose limit the stand-in cannot give; an infinite mask entry with the KL term on (fp32's KL term at ref = logp is
within an ulp of beta of its exact 0: inf times it is +-inf or NaN at random); "batch" advantages of rewards whose
deviations pass FLT_MAX (near 3e38: the kernels write r - mean unscaled in fp32, a limit left as it is).
"""

import math

import pytest
import torch
from helpers import assert_close
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

import grpo_kernels as gk
from grpo_kernels import reference
from grpo_kernels.ops import loss_fused

INF, NAN, FLT_MAX = math.inf, math.nan, torch.finfo(torch.float32).max
TOKEN_TYPES = ["grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo"]
LOGP_SPECIALS = [NAN, INF, -INF, 1e4, -1e4]
SPECIALS = {"logps": LOGP_SPECIALS, "old": LOGP_SPECIALS, "ref": LOGP_SPECIALS, "sampler": LOGP_SPECIALS,
            "adv": [NAN, INF, -INF, 1e10, -1e10], "mask": [NAN, INF, -INF, 1e10]}  # fmt: skip
# (numpy's warnings from the interpreter's arithmetic on inf / NaN are what these tests are made of)
pytestmark = pytest.mark.filterwarnings("ignore:.*encountered in:RuntimeWarning")


def fuzz(examples: int):
    """Reproducible (derandomized, no example database) and bounded: the file runs in ~30 s of one core."""
    return settings(max_examples=examples, deadline=None, derandomize=True, database=None,
                    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])  # fmt: skip


@pytest.fixture(autouse=True)
def _small_tiles(monkeypatch):
    """Tiles of 8 tokens, chunks of 16: rows of up to 20 tokens span two programs."""
    monkeypatch.setattr(loss_fused, "BLOCK", 8)
    monkeypatch.setattr(loss_fused, "CHUNK", 16)


def _grid(x: torch.Tensor) -> torch.Tensor:
    return (x * 256).round() / 256  # fp32-exact sums and differences at these magnitudes


@st.composite
def loss_cases(draw):
    """(inputs: padded fp64 [B, L] tensors and lengths, options, call layout)."""
    b, length = draw(st.integers(1, 3)), draw(st.integers(1, 20))
    lengths = torch.tensor(draw(st.lists(st.integers(0, length), min_size=b, max_size=b)))
    assume(int(lengths.sum()) > 0)
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
    lp = _grid(-3 * torch.rand(b, length, generator=g, dtype=torch.float64))
    x = dict(logps=lp, old=_grid(lp + 0.4 * torch.randn(b, length, generator=g, dtype=torch.float64)),
             ref=_grid(lp + 0.3 * torch.randn(b, length, generator=g, dtype=torch.float64)),
             adv=_grid(torch.randn(b, length, generator=g, dtype=torch.float64)))  # fmt: skip
    x["sampler"] = _grid(x["old"] + 0.5 * torch.randn(b, length, generator=g, dtype=torch.float64))
    inside = torch.arange(length)[None, :] < lengths[:, None]
    weights = torch.tensor([0.0, 1.0, 1.0, 1.0, 0.5, 2.0], dtype=torch.float64)
    x["mask"] = weights[torch.randint(0, 6, (b, length), generator=g)] * inside
    per_token = draw(st.booleans())
    if not per_token:
        x["adv"] = x["adv"][:, 0].clone()
    names = list(SPECIALS)
    for name, i, k in draw(st.lists(st.tuples(st.sampled_from(names), st.integers(0, b * length - 1),
                                              st.integers(0, 4)), max_size=5)):  # fmt: skip
        flat = x[name].view(-1)
        flat[i % flat.numel()] = SPECIALS[name][k % len(SPECIALS[name])]
    on = x["mask"] != 0  # (the assumptions: see the module docstring)
    assume(not bool((on & (x["logps"] == INF)).any()))
    beyond = on & (x["logps"] - x["old"] > 600)
    adv = x["adv"] if per_token else x["adv"][:, None].expand_as(on)
    assume(not bool((beyond & (((x["ref"] - x["logps"]).abs() > 600) | adv.isinf())).any()))
    assume(not (bool(beyond.any()) and bool(x["mask"].isinf().any())))
    loss_type = draw(st.sampled_from(TOKEN_TYPES))
    kw = dict(loss_type=loss_type, beta=draw(st.sampled_from([0.0, 0.04])), delta=draw(st.sampled_from([None, 1.5])),
              use_bias_correction_kl=draw(st.booleans()), epsilon_high=0.28,
              sampler_is_mode=draw(st.sampled_from([None, "token_truncate", "token_mask"])))  # fmt: skip
    assume(kw["beta"] == 0.0 or not bool(x["mask"].isinf().any()))
    if loss_type in ("dapo", "cispo"):
        kw["num_items_in_batch"] = draw(st.sampled_from([None, 13.0, "tensor"]))
    return x, lengths, kw, dict(packed=draw(st.booleans()), on_policy=draw(st.booleans()))


def run_backend(impl, x, lengths, kw, layout):
    """(loss, grad [B, L] fp64 (0 past the packed rows), metrics) of grpo_kernels.grpo_loss on fp32 inputs."""
    f32 = {k: v.float() for k, v in x.items()}
    inside = torch.arange(x["logps"].shape[1])[None, :] < lengths[:, None]
    pick = (lambda v: v[inside]) if layout["packed"] else (lambda v: v)  # noqa: E731
    args = dict(mask=pick(f32["mask"]), ref_logps=pick(f32["ref"]), **kw)
    if kw.get("num_items_in_batch") == "tensor":
        args["num_items_in_batch"] = torch.tensor(13.0)
    if kw["sampler_is_mode"]:
        args["sampler_logps"] = pick(f32["sampler"])
    if layout["packed"]:
        args["cu_seqlens"] = torch.cat([lengths.new_zeros(1), lengths.cumsum(0)])
    adv = f32["adv"]
    if layout["packed"] and (adv.dim() == 2 or adv.shape[0] == int(lengths.sum())):  # ([B] = [T] reads per token)
        adv = (adv if adv.dim() == 2 else adv[:, None].expand_as(f32["logps"]))[inside]
    lp = pick(f32["logps"]).requires_grad_()
    loss, metrics = gk.grpo_loss(lp, None if layout["on_policy"] else pick(f32["old"]), adv, impl=impl, **args)
    (grad,) = torch.autograd.grad(loss, lp)
    full = torch.zeros_like(x["logps"])
    full[inside if layout["packed"] else slice(None)] = grad.double()
    return loss, full, metrics


def _beyond_fp64(x, on):
    """Old and sampler log-probs of the tokens whose log-ratio passes 600 (here: w = inf in fp64 too) shifted
    together so that it is 600: fp64 then computes the exact arithmetic the rules ask for (module docstring)."""
    big = on & (x["logps"] - x["old"] > 600) & (x["logps"] < INF)
    old = torch.where(big, x["logps"] - 600, x["old"])
    return dict(x, old=old, sampler=torch.where(big, x["sampler"] + (old - x["old"]), x["sampler"]))


def _token_terms(x, on, kw):
    """Per token (policy term l, dl/dlogp) of the reference, one token at a time (its own sequence, m = 1), no KL
    and no sampler weight; 0 for tokens with m = 0."""
    terms, derivs = torch.zeros_like(x["logps"]), torch.zeros_like(x["logps"])
    adv = x["adv"] if x["adv"].dim() == 2 else x["adv"][:, None].expand_as(x["logps"])
    opts = {k: v for k, v in kw.items() if k in ("loss_type", "delta", "epsilon_high")}
    for s, t in on.nonzero().tolist():
        lp = x["logps"][s, t].view(1, 1).clone().requires_grad_()
        loss, _ = reference.grpo_loss(lp, x["old"][s, t].view(1, 1), adv[s, t].view(1), **opts)
        terms[s, t], derivs[s, t] = loss.detach(), torch.autograd.grad(loss, lp)[0][0, 0]
    return terms, derivs


def _kl(x, w, kw):
    """(beta k3 (times w), its derivative in logp, the magnitudes of both one's parts) in closed form, one exp for
    beta exp(dr) (w)."""
    beta, dr = kw["beta"], x["ref"] - x["logps"]
    if kw["use_bias_correction_kl"]:
        bew, linear = torch.exp(dr + x["logps"] - x["old"] + math.log(beta)), beta * (dr + 1) * w
        return bew - linear, -beta * dr * w, bew.abs() + linear.abs(), (beta * dr * w).abs()
    be = beta * torch.exp(dr)
    return be - beta * (dr + 1), beta - be, be + (beta * (dr + 1)).abs(), be + beta


def oracle(x, lengths, kw, layout):
    """(loss, grad [B, L'], metrics) under the rules of the module docstring, in fp64 (L' = L padded, the longest
    row packed)."""
    x = {k: v.clone() for k, v in x.items()}
    if layout["on_policy"]:
        x["old"] = x["logps"].clone()
    width = int(lengths.max()) if layout["packed"] else x["logps"].shape[1]  # dr_grpo's default constant
    if layout["packed"]:  # the same tokens padded to the longest row
        x["mask"] = torch.where(torch.arange(x["logps"].shape[1])[None, :] < lengths[:, None], x["mask"], 0.0)
    # At least two columns: the reference takes a [B, 1] metric for one value per sequence (a plain mean).
    x = {k: torch.nn.functional.pad(v[:, :width], (0, max(2 - width, 0))) if v.dim() == 2 else v
         for k, v in x.items()}  # fmt: skip
    on = x["mask"] != 0
    x = {k: torch.where(on, v, 0.0) if v.dim() == 2 and k != "mask" else v for k, v in x.items()}
    seen = x
    x = _beyond_fp64(x, on)
    terms, derivs = _token_terms(x, on, kw)
    if kw["sampler_is_mode"]:
        r = reference._sampler_weight(x["old"], x["sampler"], x["mask"], kw["sampler_is_mode"], 3.0)
        terms = torch.where((r == 0) & ~terms.isnan(), 0.0, terms * r)
        derivs = derivs * r
    w = torch.exp(x["logps"] - x["old"])
    kl = torch.zeros_like(terms)
    size, dsize = terms.abs(), derivs.abs()  # the parts' magnitudes: fp32 rounds each (see `check`)
    if kw["beta"] != 0.0:
        kl, dkl, parts, dparts = (torch.where(on, v, 0.0) for v in _kl(x, w, kw))
        terms, derivs, size, dsize = terms + kl, derivs + dkl, size + parts, dsize + dparts
    derivs = torch.where(terms.isnan(), NAN, derivs)
    leaf = terms.clone().requires_grad_()
    items = 13.0 if kw.get("num_items_in_batch") == "tensor" else kw.get("num_items_in_batch")
    loss = reference._aggregate(leaf, x["mask"], kw["loss_type"], width, items)
    (factor,) = torch.autograd.grad(loss, leaf)  # (d loss / d sum m l) m, as IEEE products
    finite = lambda v: v.nan_to_num(nan=0.0, posinf=0.0)  # noqa: E731
    scales = (reference._aggregate(finite(size), x["mask"].abs(), kw["loss_type"], width, items).detach(),
              finite(factor.abs() * dsize))  # fmt: skip
    return loss.detach(), factor * derivs, _metrics(x, seen, w, kl, kw), scales


def _metrics(x, seen, w, kl, kw):
    """The reference's clip and ratio metrics (beta 0: its own KL would not take the one exp), the KL and sampler
    diff means of the rules (`seen`: the log-probs before _beyond_fp64)."""
    opts = {k: v for k, v in kw.items() if k in ("loss_type", "delta", "epsilon_high")}
    _, metrics = reference.grpo_loss(x["logps"], x["old"], x["adv"], mask=x["mask"], **opts)
    count = x["mask"].sum().clamp(min=1.0)
    if not bool(x["mask"].isfinite().all()):  # the clip fractions sum m over the flagged tokens: a select
        for key, flag in _clip_flags(w, x["adv"], kw).items():
            metrics[key] = torch.where(flag, x["mask"], 0.0).sum() / count
    if kw["beta"] != 0.0:
        metrics["kl"] = (kl / kw["beta"] * x["mask"]).sum() / count
    if kw["sampler_is_mode"]:
        diff = (seen["logps"].float() - seen["sampler"].float()).abs()  # NaN adds 0 (a select), inf -> FLT_MAX
        terms = torch.where(diff.isnan(), 0.0, diff.clamp(max=FLT_MAX).double() * x["mask"])
        metrics["sampler_logp_abs_diff"] = terms.sum() / count
        if bool((terms.abs() > FLT_MAX).any()):  # m FLT_MAX: fp32 in Triton, (m / 8) FLT_MAX in AVX-512 C++
            del metrics["sampler_logp_abs_diff"]
    return metrics


def _clip_flags(w, adv, kw):
    """The reference's clip flags per token (an unflagged token with m = inf adds 0 to the kernels' fractions, NaN
    to the reference's flag * m)."""
    adv = adv if adv.dim() == 2 else adv[:, None]
    if kw["loss_type"] == "cispo":
        return {"cispo_clip_ratio": (w > kw["epsilon_high"]) & (adv > 0)}
    if kw["delta"] is not None and kw["loss_type"] != "sapo":
        w = w.clamp(max=kw["delta"])
    low, high = (w < 0.8) & (adv < 0), (w > 1.28) & (adv > 0)
    return {"clip_ratio/low_mean": low, "clip_ratio/high_mean": high, "clip_ratio/region_mean": low | high}


def check(impl, case):
    """One backend's loss, gradient and metrics against the oracle."""
    x, lengths, kw, layout = case
    loss, grad, metrics = run_backend(impl, x, lengths, kw, layout)
    e_loss, e_grad, e_metrics, (loss_size, grad_size) = oracle(x, lengths, kw, layout)
    tag = f"[{impl} {layout} {kw}]"
    # fp32's error bound: 2e-5 of the sum of the magnitudes of the parts (a term and the KL's two parts cancel)
    assert_close(loss, e_loss.float(), name=f"loss {tag}", atol=2e-5 * (1 + float(loss_size)))
    length = min(e_grad.shape[1], x["logps"].shape[1])
    region = torch.arange(length)[None, :] < lengths[:, None] if layout["packed"] else slice(None)
    assert_close(grad[:, :length][region], e_grad[:, :length].float()[region], name=f"grad {tag}",
                 atol=2e-5 * (1 + grad_size[:, :length][region]))  # fmt: skip
    assert set(e_metrics) <= set(metrics) and set(metrics) - set(e_metrics) <= {"sampler_logp_abs_diff"}, tag
    for key, value in e_metrics.items():
        assert_close(metrics[key], value.float(), name=f"metric {key} {tag}")


@fuzz(150)
@given(loss_cases())
def test_one_launch_triton_loss_follows_the_reference_and_the_non_finite_rules(triton_device, case):
    check("triton", case)


@fuzz(300)
@given(loss_cases())
def test_cpp_loss_follows_the_reference_and_the_non_finite_rules(case):
    check("cpp", case)


# ------------------------------------------------------------------------------------------------- group_advantages
REWARD_SPECIALS = [NAN, INF, -INF, 1e30, -1e30, 3e38, -3e38]


@st.composite
def reward_cases(draw):
    """(rewards [N, K] fp32, reward_weights or None, keyword arguments of group_advantages)."""
    sizes = draw(st.lists(st.integers(1, 6), min_size=1, max_size=4))
    uniform = draw(st.booleans())
    if uniform:
        sizes = [sizes[0]] * len(sizes)
    k = draw(st.integers(1, 2))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
    binary = draw(st.booleans())  # verifiable rewards: all-0 / all-1 groups are invalid
    rewards = _grid(torch.randn(sum(sizes), k, generator=g))
    if binary:
        rewards = torch.randint(0, 2, (sum(sizes), k), generator=g).float()
    for i, j in draw(st.lists(st.tuples(st.integers(0, rewards.numel() - 1), st.integers(0, 6)), max_size=4)):
        rewards.view(-1)[i] = REWARD_SPECIALS[j]
    kw = dict(scale=draw(st.sampled_from(["group", "batch", "none"])),
              std=draw(st.sampled_from(["unbiased", "biased"])), eps=draw(st.sampled_from([1e-6, 0.0])),
              min_std=draw(st.sampled_from([1e-4, 0.0])), nan="invalid")  # fmt: skip
    if uniform:
        kw["group_size"] = sizes[0]
    else:
        kw["group_offsets"] = torch.tensor([0, *torch.tensor(sizes).cumsum(0).tolist()])
    weights = draw(st.sampled_from([None, [1.0, 0.5], [2.0, 1.0]])) if k == 2 else None
    return rewards if k == 2 else rewards[:, 0], weights, kw


def advantages_oracle(rewards, weights, kw):
    """(the fp64 reference, its combined rewards [N]), a row whose weighted sum overflows fp32 made non-finite: the
    kernels combine the rewards in fp32 (its group is invalid)."""
    cols = rewards if rewards.dim() == 2 else rewards[:, None]
    w = torch.ones(cols.shape[1]) if weights is None else torch.tensor(weights)
    combined = torch.zeros(cols.shape[0])
    for j in range(cols.shape[1]):
        combined = combined + w[j] * cols[:, j]  # fp32, in the kernels' order
    wide = torch.where(combined.isfinite()[:, None], cols.double(), INF)
    ref = reference.group_advantages(wide if rewards.dim() == 2 else wide[:, 0],
                                     reward_weights=None if weights is None else w.double(), **kw)  # fmt: skip
    return ref, (wide * w.double()).sum(1)


def check_advantages(impl, case):
    rewards, weights, kw = case
    ref, combined = advantages_oracle(rewards, weights, kw)
    seg = torch.repeat_interleave(torch.arange(ref.valid.shape[0]), torch.tensor(_sizes(kw, rewards.shape[0])))
    if kw["scale"] == "batch":  # (see below)
        dev = (combined - ref.group_mean.double()[seg]).abs().nan_to_num()
        assume(bool((ref.group_std.nan_to_num() < FLT_MAX).all()) and bool((dev < FLT_MAX).all()))
    out = gk.group_advantages(rewards, reward_weights=weights, impl=impl, **kw)
    tag = f"[{impl} {kw} weights={weights}]"
    assert_close(out.valid, ref.valid, name=f"valid {tag}")
    assert_close(out.invalid_fraction, ref.invalid_fraction.float(), name=f"invalid_fraction {tag}")
    # fp32 statistics of a group are exact to ~2^-24 of its largest |reward| (its mean of 1e30, -1e30 and 5 too)
    finite_abs = torch.where(combined.isfinite(), combined.abs(), 0.0)
    scale = torch.zeros(ref.valid.shape[0], dtype=torch.float64).scatter_reduce(0, seg, finite_abs, "amax")
    scale = scale.clamp(min=1.0)
    for field in ("group_mean", "group_std"):
        assert_close(getattr(out, field), getattr(ref, field).float(), name=f"{field} {tag}", atol=2e-5 * scale)
    atol = 2e-5 * scale[seg] if kw["scale"] == "none" else 2e-5
    assert_close(out.advantages, ref.advantages.float(), name=f"advantages {tag}", atol=atol)


def _sizes(kw, n):
    if "group_size" in kw:
        return [kw["group_size"]] * (n // kw["group_size"])
    return kw["group_offsets"].diff().tolist()


@fuzz(100)
@given(reward_cases())
def test_one_launch_triton_group_advantages_follows_the_reference_with_non_finite_rewards(triton_device, case):
    check_advantages("triton", case)


@fuzz(100)
@given(reward_cases())
def test_cpp_group_advantages_follows_the_reference_with_non_finite_rewards(case):
    check_advantages("cpp", case)

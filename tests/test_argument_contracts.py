"""Arguments that used to be accepted silently (or failed late, or without naming themselves) now either follow
one documented contract or raise ValueError naming the argument."""

import numpy as np
import pytest
import torch
from helpers import assert_close

import grpo_kernels as gk
from grpo_kernels.packing import pack_sequences
from grpo_kernels.train.config.io import load_config


def packed_batch(lengths=(5, 1, 9, 4)):
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    t = int(cu[-1])
    logps = (-torch.rand(t)).requires_grad_()
    return logps, logps.detach() - 0.1 * torch.randn(t), torch.randn(len(lengths)), cu


@pytest.mark.parametrize("impl", ["cpp", "triton", "reference-padded"])
def test_dr_grpo_packed_normaliser_is_the_longest_sequence_whatever_max_seqlen_says(impl, triton_device):
    logps, old, adv, cu = packed_batch()
    if impl == "reference-padded":  # the spec on the padded layout: L = the longest sequence (9)
        rows = [logps[s:e] for s, e in zip(cu[:-1].tolist(), cu[1:].tolist(), strict=True)]
        olds = [old[s:e] for s, e in zip(cu[:-1].tolist(), cu[1:].tolist(), strict=True)]
        pad = lambda xs: torch.nn.utils.rnn.pad_sequence(xs, batch_first=True)  # noqa: E731
        mask = pad([torch.ones_like(x) for x in rows])
        want, _ = gk.reference.grpo_loss(pad(rows), pad(olds), adv, mask=mask, loss_type="dr_grpo")
    else:
        dev = triton_device if impl == "triton" else "cpu"
        logps, old, adv, cu = (x.detach().to(dev) for x in (logps, old, adv, cu))
        want, _ = gk.grpo_loss(logps, old, adv, cu_seqlens=cu, loss_type="dr_grpo", impl=impl)
    for bound in (None, 9, 10, 200):
        got, _ = gk.grpo_loss(logps.detach().to(want.device), old.to(want.device), adv.to(want.device),
                              cu_seqlens=cu.to(want.device), max_seqlen=bound, loss_type="dr_grpo",
                              impl="triton" if impl == "triton" else "cpp")  # fmt: skip
        assert_close(got, want.float(), name=f"dr_grpo loss, max_seqlen={bound}")
    with pytest.raises(ValueError, match="max_seqlen=8 is shorter"):
        gk.grpo_loss(logps.detach(), old, adv, cu_seqlens=cu, max_seqlen=8, loss_type="dr_grpo")
    explicit, _ = gk.grpo_loss(logps.detach(), old, adv, cu_seqlens=cu, max_seqlen=200, loss_type="dr_grpo",
                               max_completion_length=32)  # fmt: skip
    assert_close(explicit * 32, want.float().cpu() * 9, name="max_completion_length is the constant when given")


def test_fused_linear_dr_grpo_ignores_max_seqlen_too():
    hidden, weight = torch.randn(19, 16), torch.randn(23, 16)
    ids, cu = torch.randint(0, 23, (19,)), torch.tensor([0, 5, 6, 15, 19])
    adv = torch.randn(4)
    losses = [gk.fused_linear_grpo_loss(hidden, weight, ids, adv, cu_seqlens=cu, max_seqlen=m, loss_type="dr_grpo")[0]
              for m in (None, 9, 100)]  # fmt: skip
    assert_close(torch.stack(losses), losses[0].expand(3), name="fused dr_grpo loss for max_seqlen None, 9, 100")


@pytest.mark.parametrize("value", [0, -5, float("nan"), float("inf")])
def test_num_items_in_batch_tensor_must_be_positive_and_finite(value):
    logps, old, adv, cu = packed_batch()
    with pytest.raises(ValueError, match="num_items_in_batch"):
        gk.grpo_loss(logps, old, adv, cu_seqlens=cu, loss_type="dapo", num_items_in_batch=torch.tensor(value))
    ok, _ = gk.grpo_loss(logps, old, adv, cu_seqlens=cu, loss_type="dapo", num_items_in_batch=torch.tensor(7))
    assert torch.isfinite(ok)


def test_ref_logps_of_the_wrong_shape_is_refused_even_with_beta_zero():
    logps, old, adv, cu = packed_batch()
    with pytest.raises(ValueError, match="ref_logps must have the shape"):
        gk.grpo_loss(logps, old, adv, cu_seqlens=cu, ref_logps=torch.zeros(3), beta=0.0)
    hidden, weight, ids = torch.randn(19, 8), torch.randn(11, 8), torch.randint(0, 11, (19,))
    with pytest.raises(ValueError, match="ref_logps must have the shape"):
        gk.fused_linear_grpo_loss(hidden, weight, ids, adv, cu_seqlens=cu, ref_logps=torch.zeros(3), beta=0.0)


def test_reward_weights_string_is_refused():
    with pytest.raises(ValueError, match="reward_weights"):
        gk.group_advantages(torch.randn(8), group_size=4, reward_weights="1")


@pytest.mark.parametrize("prompts, completions", [([[1.5, 2.0]], [[3]]), ([[1, 2]], [[3.7]]),
                                                  ([[True, False]], [[3]]), ([torch.tensor([1.0, 2.0])], [[3]])])
def test_pack_sequences_refuses_non_integer_token_ids(prompts, completions):
    with pytest.raises(ValueError, match="integer token ids"):
        pack_sequences(prompts, completions)


@pytest.mark.parametrize("ids", [[0.5, 0.7], [0.0, 1.0], ["a", "a"], [torch.tensor(0.5), torch.tensor(0.5)]])
def test_pack_sequences_refuses_non_integer_group_ids(ids):
    with pytest.raises(ValueError, match=r"group_ids\[0\] must be an integer"):
        pack_sequences([[1], [1]], [[3], [4]], shared_prefix=True, group_ids=ids)
    ok = pack_sequences([[1], [1]], [[3], [4]], shared_prefix=True, group_ids=[torch.tensor(3), 3])
    assert ok.cu_seqlens.tolist() == [0, 3]


@pytest.mark.parametrize("which", ["prompts", "completions"])
def test_pack_sequences_refuses_negative_token_ids(which):
    good = dict(prompts=[[1, 2], [3]], completions=[[4], [5, 6]])
    bad = dict(good, **{which: [[1, 2], [3, -7]] if which == "prompts" else [[4], [5, -1]]})
    with pytest.raises(ValueError, match=rf"{which}\[1\]\[1\] is -\d: token ids are >= 0"):
        pack_sequences(bad["prompts"], bad["completions"])
    with pytest.raises(ValueError, match="token ids are >= 0"):
        pack_sequences([torch.tensor([1, 2])] * 2, [torch.tensor([-3]), torch.tensor([4])], shared_prefix=True,
                       group_ids=[0, 0])  # fmt: skip
    assert pack_sequences(good["prompts"], good["completions"]).input_ids.numel() == 6


@pytest.mark.parametrize("impl", ["cpp", "triton"])
def test_inplace_backward_on_rows_sharing_memory_is_refused(impl, triton_device):
    dev = triton_device if impl == "triton" else "cpu"
    row = torch.randn(1, 7, device=dev, requires_grad=True)
    ids = torch.tensor([0, 3, 6, 3], device=dev)
    with pytest.raises(ValueError, match="inplace_backward"):
        gk.selective_logprobs(row.expand(4, 7), ids, inplace_backward=True, impl=impl)
    out = gk.selective_logprobs(row.expand(4, 7), ids, impl=impl)  # without it: the right gradient
    (grad,) = torch.autograd.grad(out.sum(), row)
    want = torch.zeros(1, 7, device=dev)
    for i in ids.tolist():
        want[0, i] += 1.0
    want -= 4 * torch.softmax(row.detach(), -1)
    assert_close(grad, want, name="d row through expand")


@pytest.mark.parametrize("impl", ["cpp", "triton"])
def test_inplace_backward_on_a_transposed_tensor_is_accepted_and_exact(impl, triton_device):
    """A transpose has no two elements at one address: inplace_backward writes over a contiguous copy (before: it
    was refused as "rows share memory"). Same log-probs and gradient as without inplace_backward."""
    dev = triton_device if impl == "triton" else "cpu"
    base = torch.randn(7, 5, device=dev)
    ids = torch.tensor([0, 3, 6, 3, 1], device=dev)
    got = []
    for inplace in (True, False):
        x = base.clone().requires_grad_()
        out = gk.selective_logprobs(x.t(), ids, inplace_backward=inplace, impl=impl)
        got.append((out, *torch.autograd.grad((out * torch.arange(1.0, 6.0, device=dev)).sum(), x)))
    assert torch.equal(got[0][0], got[1][0]) and torch.equal(got[0][1], got[1][1])
    assert_close(got[0][0], torch.log_softmax(base.t().double(), -1)[torch.arange(5), ids.cpu()], name="logps")


def test_meta_tensors_raise_value_error_naming_the_device():
    meta = torch.device("meta")
    cases = [
        lambda: gk.selective_logprobs(torch.randn(4, 7, device=meta), torch.zeros(4, dtype=torch.long, device=meta)),
        lambda: gk.grpo_loss(torch.randn(3, device=meta), None, torch.zeros(1, device=meta),
                             cu_seqlens=torch.tensor([0, 3], device=meta)),
        lambda: gk.fused_linear_grpo_loss(torch.randn(4, 8, device=meta), torch.randn(7, 8, device=meta),
                                          torch.zeros(4, dtype=torch.long, device=meta), torch.zeros(4, device=meta)),
        lambda: gk.group_advantages(torch.randn(8, device=meta), group_size=4),
    ]  # fmt: skip
    for case in cases:
        with pytest.raises(ValueError, match="meta"):
            case()


@pytest.mark.parametrize("impl", ["auto", "cpp", "triton", "reference"])
def test_non_tensor_inputs_raise_the_value_error_naming_them_whatever_impl(impl):
    """The type check of the tensor a public function reads its device from comes before the backend's device
    check (before: grpo_loss raised AttributeError: 'list' object has no attribute 'device' for impl="cpp")."""
    hidden, weight, ids = torch.randn(4, 8), torch.randn(7, 8), torch.randint(0, 7, (4,))
    cases = {
        "logps": lambda: gk.grpo_loss([[-1.0, -2.0]], None, torch.tensor([1.0]), impl=impl),
        "logits": lambda: gk.selective_logprobs([[0.5, 1.0]], torch.zeros(1, dtype=torch.long), impl=impl),
        "rewards": lambda: gk.group_advantages([1.0, 0.0], group_size=2, impl=impl),
        "hidden": lambda: gk.fused_linear_grpo_loss(hidden.tolist(), weight, ids, torch.zeros(4), impl=impl),
        "hidden ": lambda: gk.fused_linear_logprobs(hidden.tolist(), weight, ids, impl=impl),
    }  # fmt: skip
    for name, call in cases.items():
        with pytest.raises(ValueError, match=f"^{name.strip()} must be"):
            call()


@pytest.mark.parametrize("impl", [None, 1, ["cpp"], np.array("cpp"), torch.tensor(0), b"cpp", "CPP"])
def test_impl_other_than_a_backend_name_raises_value_error_naming_impl(impl):
    """Every public function refuses an impl that is not one of the names as a str, before reading any tensor (a
    0-d numpy string array compared equal to "cpp" and was taken)."""
    hidden, weight, ids = torch.randn(4, 8), torch.randn(7, 8), torch.randint(0, 7, (4,))
    logps, old, adv, cu = packed_batch()
    calls = [
        lambda: gk.grpo_loss(logps, old, adv, cu_seqlens=cu, impl=impl),
        lambda: gk.grpo_loss([[-1.0]], None, adv, impl=impl),
        lambda: gk.selective_logprobs(hidden @ weight.T, ids, impl=impl),
        lambda: gk.group_advantages(torch.randn(8), group_size=4, impl=impl),
        lambda: gk.fused_linear_grpo_loss(hidden, weight, ids, torch.zeros(4), impl=impl),
        lambda: gk.fused_linear_logprobs(hidden.double(), weight.double(), ids, impl=impl),
    ]
    for call in calls:
        with pytest.raises(ValueError, match="impl must be one of"):
            call()


@pytest.mark.parametrize("fn", ["fused_linear_logprobs", "fused_linear_grpo_loss", "selective_logprobs"])
def test_return_entropy_must_be_a_bool(fn):
    hidden, weight, ids = torch.randn(4, 8), torch.randn(7, 8), torch.randint(0, 7, (4,))
    call = {"fused_linear_logprobs": lambda: gk.fused_linear_logprobs(hidden, weight, ids, return_entropy="yes"),
            "fused_linear_grpo_loss": lambda: gk.fused_linear_grpo_loss(hidden, weight, ids, torch.zeros(4),
                                                                        return_entropy="yes"),
            "selective_logprobs": lambda: gk.selective_logprobs(hidden @ weight.T, ids,
                                                                return_entropy="yes")}[fn]  # fmt: skip
    with pytest.raises(ValueError, match="return_entropy must be a bool"):
        call()


def test_a_group_size_beyond_the_step_budget_is_refused_at_load():
    with pytest.raises(ValueError, match="sampling.max_step_tokens"):
        load_config("examples/train_tiny_cpu.toml", ["sampling.group_size=1000000"])
    with pytest.raises(ValueError, match="group_size.max_group_size"):
        load_config("examples/train_tiny_cpu.toml", ["group_size.adaptive=true", "group_size.max_group_size=10000000"])
    config = load_config("examples/train_tiny_cpu.toml", ["sampling.group_size=1000000",
                                                          "sampling.max_step_tokens=100000000"])  # fmt: skip
    assert config.sampling.group_size == 1000000


def test_every_loss_entry_takes_the_loss_options_names_and_defaults():
    import dataclasses
    import inspect

    from grpo_kernels.train.config import LossConfig

    defaults = {f.name: f.default for f in dataclasses.fields(gk.LossOptions)}
    for fn in (gk.grpo_loss, gk.reference.grpo_loss):
        params = inspect.signature(fn).parameters
        assert {k: params[k].default for k in defaults} == defaults, fn.__qualname__
    assert {f.name: f.default for f in dataclasses.fields(LossConfig)} == defaults
    assert LossConfig(loss_type="grpo", beta=0.04).options() == gk.LossOptions(loss_type="grpo", beta=0.04)


def test_loss_options_are_frozen_checked_and_name_the_op_scalars():
    import dataclasses

    with pytest.raises(ValueError, match="epsilon_low must be < 1.0"):
        gk.LossOptions(epsilon_low=1.0)
    with pytest.raises(ValueError, match="sampler_is_mode must be one of"):
        gk.LossOptions(sampler_is_mode="tok")
    options = gk.LossOptions(loss_type="cispo", beta=0.04)
    with pytest.raises(dataclasses.FrozenInstanceError):
        options.beta = 0.0
    schema = [a.name for a in torch.ops.grpo_kernels.grpo_loss_fwd.default._schema.arguments]
    scalars = options.kernel_scalars()
    assert schema[-len(scalars) :] == list(scalars._fields)
    assert options.metric_names(sampler=True) == ("cispo_clip_ratio", "ratio_mean", "kl", "sampler_logp_abs_diff")


def test_cached_loss_options_still_check_every_value():
    """grpo_loss caches its LossOptions: a cached valid value must not let an equal-but-wrong one through."""
    from grpo_kernels.options import LossOptions, loss_options

    assert loss_options(use_bias_correction_kl=True) is loss_options(use_bias_correction_kl=True)
    assert loss_options(beta=0.04) == LossOptions(beta=0.04)
    with pytest.raises(ValueError, match="use_bias_correction_kl must be a bool"):
        loss_options(use_bias_correction_kl=1)
    with pytest.raises(ValueError, match="epsilon_low"):
        loss_options(epsilon_low=[0.2])  # unhashable: built uncached, still checked
    with pytest.raises(TypeError, match="unexpected keyword"):
        loss_options(epsilonlow=0.2)
    logps, old, adv, cu = packed_batch()
    gk.grpo_loss(logps, old, adv, cu_seqlens=cu, use_bias_correction_kl=True, beta=0.04, ref_logps=old)
    with pytest.raises(ValueError, match="use_bias_correction_kl"):
        gk.grpo_loss(logps, old, adv, cu_seqlens=cu, use_bias_correction_kl=1, beta=0.04, ref_logps=old)

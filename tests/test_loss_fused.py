"""The token-level loss in one launch each way (ops/loss_fused): what the call launches, inputs read in their own
dtypes, the in-kernel normalizers (num_items_in_batch on the device), and the ticket counter. Its values against
the reference for every loss type and option are in test_loss.py (the Triton rows take this path). Every test here
runs the Triton backend: on CUDA where there is a GPU (the marker puts them in the GPU stage's `-k triton`), else
under the interpreter."""

import contextlib

import pytest
import torch
from helpers import assert_close
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

import grpo_kernels as gk
from grpo_kernels import reference
from grpo_kernels.ops import loss_fused

TOKEN_TYPES = ["grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo"]
# What a call may ask of aten besides the kernels: allocations and views (no arithmetic, copy or fill kernel).
HOST_ONLY = {"empty.memory_format", "view.default", "detach.default", "unbind.int", "alias.default"}
pytestmark = pytest.mark.triton


@pytest.fixture(autouse=True)
def _small_tiles(monkeypatch):
    monkeypatch.setattr(loss_fused, "BLOCK", 8)
    monkeypatch.setattr(loss_fused, "CHUNK", 16)


def batch(b=5, length=19, seed=0, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    logps = -torch.rand(b, length, generator=g) * 3
    x = dict(
        logps=logps, old=logps + 0.3 * torch.randn(b, length, generator=g),
        ref=logps + 0.2 * torch.randn(b, length, generator=g),
        mask=torch.rand(b, length, generator=g) > 0.25, adv=torch.randn(b, generator=g),
    )  # fmt: skip
    return {k: v.to(device) for k, v in x.items()}


class _Record(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func.overloadpacket.__name__) + "." + func._overloadname)
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def count_launches(monkeypatch):
    """{kernel name: launches}, the interpreter's own tensor traffic kept out of any recording dispatch mode."""
    launches = {}
    for kernel in (loss_fused.grpo_loss_fwd_kernel, loss_fused.grpo_loss_bwd_kernel):
        original = kernel.run

        def run(*args, _original=original, _name=kernel.fn.__name__, **kwargs):
            launches[_name] = launches.get(_name, 0) + 1
            with _disable_current_modes():
                return _original(*args, **kwargs)

        monkeypatch.setattr(kernel, "run", run)
    yield launches


@pytest.mark.parametrize("loss_type", ["dapo", "grpo", "dr_grpo"])
def test_forward_and_backward_launch_one_kernel_each_and_no_aten_arithmetic(monkeypatch, loss_type, triton_device):
    x = batch(device=triton_device)
    lp = x["logps"].clone().requires_grad_()
    grad_out = torch.ones((), device=triton_device)
    loss_fused._counter(lp.device)  # (allocated zeroed once per device and stream, before the first call)
    with count_launches(monkeypatch) as launches:
        with _Record() as fwd:
            loss, metrics = gk.grpo_loss(lp, x["old"], x["adv"], ref_logps=x["ref"], mask=x["mask"], beta=0.04,
                                         loss_type=loss_type, impl="triton")  # fmt: skip
        assert launches == {"grpo_loss_fwd_kernel": 1}
        with _Record() as bwd:
            (grad,) = torch.autograd.grad(loss, lp, grad_out)
        assert launches == {"grpo_loss_fwd_kernel": 1, "grpo_loss_bwd_kernel": 1}
    assert set(fwd.ops) <= HOST_ONLY, sorted(set(fwd.ops) - HOST_ONLY)
    assert set(bwd.ops) <= HOST_ONLY, sorted(set(bwd.ops) - HOST_ONLY)
    want, _ = reference.grpo_loss(lp.double(), x["old"].double(), x["adv"].double(), ref_logps=x["ref"].double(),
                                  mask=x["mask"].double(), beta=0.04, loss_type=loss_type)  # fmt: skip
    assert_close(loss, want, name="loss")
    assert_close(grad, torch.autograd.grad(want, lp)[0], name="grad")


def test_sequence_level_and_vespo_take_the_registered_op_path(monkeypatch, triton_device):
    """The loss types that need whole-sequence sums first are not routed to the one-launch kernel."""
    x = batch(device=triton_device)
    with count_launches(monkeypatch) as launches:
        for kw in (dict(importance_sampling_level="sequence"), dict(loss_type="vespo"),
                   dict(sampler_is_mode="sequence_truncate")):  # fmt: skip
            sampler = x["old"] if "sampler_is_mode" in kw else None
            gk.grpo_loss(x["logps"], x["old"], x["adv"], mask=x["mask"], sampler_logps=sampler, impl="triton", **kw)
    assert launches.get("grpo_loss_fwd_kernel", 0) == 3  # (the unpatched seq-stats kernel ran before each)


@pytest.mark.parametrize("loss_type", TOKEN_TYPES)
def test_inputs_read_in_their_own_dtypes_equal_the_fp32_cast(loss_type, triton_device):
    """bf16 old / ref / sampler log-probs and advantages, a bool mask: the kernel's fp32 reading of each equals the
    result of casting it first (what the call did before, with one cast kernel per input)."""
    x = batch(seed=1, device=triton_device)
    low = {k: x[k].bfloat16() for k in ("old", "ref", "adv")}
    sampler = (x["old"] + 0.4).bfloat16()
    kw = dict(loss_type=loss_type, beta=0.04, sampler_is_mode="token_truncate", impl="triton")
    lp = x["logps"].clone().requires_grad_()
    loss, metrics = gk.grpo_loss(lp, low["old"], low["adv"], ref_logps=low["ref"], mask=x["mask"],
                                 sampler_logps=sampler, **kw)  # fmt: skip
    (grad,) = torch.autograd.grad(loss, lp)
    lp2 = x["logps"].clone().requires_grad_()
    loss2, metrics2 = gk.grpo_loss(lp2, low["old"].float(), low["adv"].float(), ref_logps=low["ref"].float(),
                                   mask=x["mask"].float(), sampler_logps=sampler.float(), **kw)  # fmt: skip
    (grad2,) = torch.autograd.grad(loss2, lp2)
    assert torch.equal(loss, loss2) and torch.equal(grad, grad2)
    assert all(torch.equal(metrics[k], metrics2[k]) for k in metrics)


@pytest.mark.parametrize("packed", [False, True])
def test_num_items_tensor_is_read_by_the_kernel(packed, triton_device):
    """A num_items_in_batch tensor divides the loss in the kernel (dapo, cispo); a value <= 0, which a CUDA tensor
    never shows the host, makes the loss and the gradient NaN instead of passing silently."""
    dev = triton_device
    x = batch(seed=2, device=dev)
    lp = x["logps"].clone().requires_grad_()
    cu = None
    args = dict(ref_logps=x["ref"], mask=x["mask"].float())
    if packed:
        cu = torch.arange(x["logps"].shape[0] + 1, device=dev) * x["logps"].shape[1]
        args = {k: v.reshape(-1) for k, v in args.items()}
    logps = lp.reshape(-1) if packed else lp
    old = x["old"].reshape(-1) if packed else x["old"]
    for loss_type in ("dapo", "cispo"):
        loss, _ = gk.grpo_loss(logps, old, x["adv"], cu_seqlens=cu, beta=0.04, loss_type=loss_type,
                               num_items_in_batch=torch.tensor(37, device=dev), impl="triton", **args)  # fmt: skip
        want, _ = reference.grpo_loss(logps.double(), old.double(), x["adv"].double(), cu_seqlens=cu, beta=0.04,
                                      loss_type=loss_type, num_items_in_batch=37.0,
                                      **{k: v.double() for k, v in args.items()})  # fmt: skip
        assert_close(loss, want, name=f"{loss_type} / num_items")
    options = gk.loss.loss_options(loss_type="dapo")
    flat = lambda t: t.reshape(-1).contiguous()  # noqa: E731
    for bad in (0.0, -3.0):
        loss, _, coef, scale = loss_fused.token_loss(
            flat(x["logps"]), flat(x["old"]), None, None, x["adv"], False, flat(x["mask"]), None, 5, 19,
            options.kernel_scalars(), loss_fused.divisor_of(options, 5, torch.tensor(bad, device=dev)),
        )  # fmt: skip
        assert torch.isnan(loss) and torch.isnan(scale).all(), bad


def test_ticket_counter_is_back_at_zero_after_every_call(triton_device):
    x = batch(b=7, length=45, device=triton_device)  # 7 x 3 programs of 16 tokens
    counter = loss_fused._counter(torch.device(triton_device))
    for loss_type in TOKEN_TYPES:
        gk.grpo_loss(x["logps"], x["old"], x["adv"], mask=x["mask"], loss_type=loss_type, impl="triton")
        assert counter.item() == 0, loss_type


def test_padded_rows_of_length_zero_and_one(triton_device):
    """Rows of length 1 (Triton specializes an int argument equal to 1) and of length 0 (no token at all)."""
    for length in (1, 0):
        x = batch(b=4, length=length, seed=3, device=triton_device)
        lp = x["logps"].clone().requires_grad_()
        for loss_type in ("dr_grpo", "grpo", "dapo"):
            loss, _ = gk.grpo_loss(lp, x["old"], x["adv"], mask=x["mask"], loss_type=loss_type, impl="triton")
            want, _ = reference.grpo_loss(lp.double(), x["old"].double(), x["adv"].double(), mask=x["mask"].double(),
                                          loss_type=loss_type)  # fmt: skip
            assert_close(loss, want, name=f"{loss_type} L={length}")
            if length:
                assert_close(torch.autograd.grad(loss, lp)[0], torch.autograd.grad(want, lp)[0], name="grad")

"""What a group_advantages call on the Triton backend asks of the device: one kernel launch and no aten arithmetic
(invalid_fraction and the count of groups with a non-finite reward are finished inside the kernel), one host read
with nan="error" and none otherwise, and the kernel's counters back at zero after every call. Its values against the
reference are in test_advantages.py. Every test here runs the Triton backend: on CUDA where there is a GPU (the marker
puts them in the GPU stage's `-k triton`), else under the interpreter."""

import pytest
import torch
from helpers import assert_close
from test_loss_fused import _Record
from torch.utils._python_dispatch import _disable_current_modes

import grpo_kernels as gk
from grpo_kernels import reference
from grpo_kernels.ops import advantages as ops

HOST_ONLY = {"empty.memory_format", "unsqueeze.default", "detach.default", "alias.default"}
pytestmark = pytest.mark.triton


@pytest.fixture
def launches(monkeypatch):
    count = []
    original = ops._group_advantages_kernel.run

    def run(*args, **kwargs):
        count.append(1)
        with _disable_current_modes():
            return original(*args, **kwargs)

    monkeypatch.setattr(ops._group_advantages_kernel, "run", run)
    return count


def test_variable_sizes_launch_once_too(launches, triton_device):
    """(group_offsets' values are checked on a host copy before the launch: one read of num_groups + 1 ints.)"""
    offsets = torch.tensor([0, 3, 40, 41, 300, 301, 2400], device=triton_device)
    gk.group_advantages(torch.rand(2400, device=triton_device), group_offsets=offsets, nan="invalid", impl="triton")
    assert len(launches) == 1


def test_one_launch_and_no_aten_arithmetic_without_host_reads(launches, monkeypatch, triton_device):
    rewards = torch.randint(0, 2, (4096,)).float().to(triton_device)
    kw = dict(group_size=16)
    gk.group_advantages(rewards, nan="invalid", impl="triton", **kw)  # (the counters and unit weights, made once)
    launches.clear()
    reads = []
    monkeypatch.setattr(torch.Tensor, "item", lambda self: reads.append(self) or 0)
    monkeypatch.setattr(torch.Tensor, "__bool__", lambda self: reads.append(self) or False)
    with _Record() as rec:
        out = gk.group_advantages(rewards, nan="invalid", impl="triton", **kw)
    assert len(launches) == 1 and not reads
    assert set(rec.ops) <= HOST_ONLY, sorted(set(rec.ops) - HOST_ONLY)
    with _Record() as rec:
        gk.group_advantages(rewards, nan="error", impl="triton", **kw)
    assert len(launches) == 2 and len(reads) == 1 and reads[0].dtype == torch.int32  # the kernel's bad-group count
    monkeypatch.undo()
    want = reference.group_advantages(rewards.double(), group_size=16)
    assert_close(out.advantages, want.advantages, name="advantages")
    assert_close(out.invalid_fraction, want.invalid_fraction, name="invalid_fraction")


def test_invalid_fraction_and_bad_count_are_exact_and_counters_return_to_zero(triton_device):
    g = torch.Generator().manual_seed(0)
    counters = ops._counters(torch.device(triton_device))
    for n_groups, size in [(1, 5), (37, 16), (300, 3), (3, 2000)]:  # one program, many, and the chunked walk
        rewards = torch.randint(0, 2, (n_groups * size,), generator=g).float()
        rewards[torch.randint(0, rewards.numel(), (3,), generator=g)] = float("nan")
        adv, valid, mean, std, frac, num_bad = ops.group_advantages_triton(
            rewards[:, None].to(triton_device), torch.ones(1, device=triton_device), None, size, "group", 1e-6, True,
            1e-4,
        )  # fmt: skip
        assert frac.item() == pytest.approx(1.0 - valid.float().mean().item(), abs=1e-7)
        assert num_bad.item() == int(torch.isnan(mean).sum())
        assert counters.tolist() == [0, 0, 0]


def test_nan_error_raises_from_the_kernels_count_naming_the_index(triton_device):
    rewards = torch.rand(64, device=triton_device)
    rewards[37] = float("inf")
    with pytest.raises(ValueError, match=r"rewards\[37\] = inf"):
        gk.group_advantages(rewards, group_size=8, impl="triton")

"""Argument checks shared by the public functions (each raises ValueError naming the argument)."""

import math

import torch

IMPLS = ("auto", "triton", "cpp", "reference")


def check_impl(impl: str, device: torch.device, what: str) -> None:
    """impl is a known backend that can run tensors on `device` (`what` names the tensor in the message)."""
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {', '.join(map(repr, IMPLS))}, got {impl!r}")
    if impl == "cpp" and device.type != "cpu":
        raise ValueError(f"impl='cpp' runs CPU tensors only; {what} are on {device}")
    if impl == "triton" and device.type not in ("cpu", "cuda"):
        raise ValueError(f"impl='triton' runs CUDA tensors (or CPU under TRITON_INTERPRET=1), not {device}")
    if impl == "auto" and device.type not in ("cpu", "cuda"):
        raise ValueError(f"no grpo_kernels backend for {device} tensors (CPU and CUDA only)")


def check_cu_seqlens(cu_seqlens, total: int, device: torch.device, *, max_seqlen: int | None = None) -> int:
    """cu_seqlens is an int tensor [num_seqs + 1] rising from 0 to `total`; returns the longest sequence.

    The values are checked on a host copy (skipped under torch.compile, where `max_seqlen`, when not given,
    falls back to `total`).
    """
    if not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.dtype not in (torch.int32, torch.int64):
        raise ValueError("cu_seqlens must be an int32 or int64 tensor")
    if cu_seqlens.dim() != 1 or cu_seqlens.shape[0] < 2:
        raise ValueError(f"cu_seqlens must be a 1-D tensor [num_sequences + 1], got shape {tuple(cu_seqlens.shape)}")
    if cu_seqlens.device != device:
        raise ValueError(f"cu_seqlens is on {cu_seqlens.device} but the data are on {device}")
    check_device(device, "cu_seqlens")
    if max_seqlen is not None and (isinstance(max_seqlen, bool) or not isinstance(max_seqlen, int) or max_seqlen < 0):
        raise ValueError(f"max_seqlen must be an int >= 0, got {max_seqlen!r}")
    if torch.compiler.is_compiling():
        return total if max_seqlen is None else max_seqlen
    c = cu_seqlens.cpu()
    steps = c.diff()
    if c[0] != 0 or c[-1] != total or bool((steps < 0).any()):
        raise ValueError(f"cu_seqlens must rise from 0 to T={total} without decreasing, got {c.tolist()[:8]}...")
    longest = int(steps.max())
    if max_seqlen is not None and max_seqlen < longest:
        raise ValueError(f"max_seqlen={max_seqlen} is shorter than the longest sequence ({longest})")
    return longest if max_seqlen is None else max_seqlen


def check_device(device: torch.device, what: str) -> None:
    """A device grpo_kernels runs on (checked before anything reads values: meta tensors have none)."""
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"{what} are on {device}: grpo_kernels runs CPU and CUDA tensors only")


def check_flag(name: str, value) -> None:
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be a bool, got {value!r}")


def check_temperature(temperature) -> None:
    if (
        isinstance(temperature, bool)
        or not isinstance(temperature, (int, float))
        or not (math.isfinite(temperature) and temperature > 0)
    ):
        raise ValueError(f"temperature must be a finite number > 0, got {temperature!r}")


def check_ids(ids, shape, device: torch.device, vocab: int, source: str) -> None:
    """ids: int32/int64 token ids of the given shape on device, in [0, vocab) (range checked outside compile).
    `source` names what the shape comes from in the message, e.g. "logits without V"."""
    if not isinstance(ids, torch.Tensor) or ids.dtype not in (torch.int32, torch.int64):
        raise ValueError("ids must be an int32 or int64 tensor")
    if tuple(ids.shape) != tuple(shape):
        raise ValueError(f"ids must have shape {tuple(shape)} ({source}), got {tuple(ids.shape)}")
    if ids.device != device:
        raise ValueError(f"ids are on {ids.device} but the {source.split()[0]} are on {device}")
    check_device(device, "ids")
    if ids.numel() and not torch.compiler.is_compiling():
        lo, hi = int(ids.min()), int(ids.max())
        if lo < 0 or hi >= vocab:
            raise ValueError(f"ids must lie in [0, V={vocab}), found {lo if lo < 0 else hi}")

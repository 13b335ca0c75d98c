"""Argument checks shared by the public functions (each raises ValueError naming the argument)."""

import math
from collections.abc import Sequence

import torch

IMPLS = ("auto", "triton", "cpp", "reference")


def check_impl(impl: str) -> None:
    """impl names a backend: one of IMPLS, as a str (a numpy string array compares equal to one). It reads no tensor,
    so public functions check it first; `check_impl_device` then, after the type check of the tensor it reads."""
    if not isinstance(impl, str) or impl not in IMPLS:
        raise ValueError(f"impl must be one of {', '.join(map(repr, IMPLS))}, got {impl!r}")


def check_impl_device(impl: str, device: torch.device, what: str) -> None:
    """The backend `impl` (checked by check_impl) can run tensors on `device` (`what` names them in the message)."""
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


def check_softcap(softcap) -> None:
    """Final-logit soft-capping (c tanh(z / c)): None, or a finite float > 0."""
    if softcap is not None and (isinstance(softcap, bool) or not isinstance(softcap, (int, float))
                                or not 0 < softcap < math.inf):  # fmt: skip
        raise ValueError(f"softcap must be None or a finite number > 0, got {softcap!r}")


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
        lo, hi = torch.stack([ids.min(), ids.max()]).tolist()  # one device-to-host copy, not two
        if lo < 0 or hi >= vocab:
            raise ValueError(f"ids must lie in [0, V={vocab}), found {lo if lo < 0 else hi}")


def check_number(name, value, *, low=None, high=None, low_open=False, allow_none=False) -> float | None:
    """A finite real (not a bool) within [low, high) ((low, high) with low_open); None passes with allow_none."""
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value!r}")
    if low is not None and (value <= low if low_open else value < low):
        raise ValueError(f"{name} must be {'>' if low_open else '>='} {low}, got {value!r}")
    if high is not None and value >= high:
        raise ValueError(f"{name} must be < {high}, got {value!r}")
    return float(value)


# ---------------------------------------------------------------------------------------------------------------
# The loss's per-call arguments (its options are checked by options.LossOptions).

_FLOATS = (torch.float16, torch.bfloat16, torch.float32)


def check_loss_inputs(options, *, num_items_in_batch, ref_logps, sampler_logps) -> None:
    """The per-call arguments that go with the options: num_items_in_batch > 0 (a number or a one-element tensor),
    sampler_logps exactly with a sampler_is_mode, ref_logps when beta > 0."""
    if isinstance(num_items_in_batch, torch.Tensor):
        if num_items_in_batch.numel() != 1:
            raise ValueError(f"num_items_in_batch must be a scalar, got shape {tuple(num_items_in_batch.shape)}")
        if num_items_in_batch.device.type == "meta":
            raise ValueError("num_items_in_batch is a meta tensor: it has no value")
        # A CPU tensor's value is checked here; a CUDA tensor's is not read on the host (that read would be the
        # call's only host sync): the loss is NaN where it is <= 0.
        if num_items_in_batch.device.type == "cpu" and not torch.compiler.is_compiling():
            check_number("num_items_in_batch", num_items_in_batch.item(), low=0.0, low_open=True)
    else:
        check_number("num_items_in_batch", num_items_in_batch, low=0.0, low_open=True, allow_none=True)
    if (sampler_logps is None) != (options.sampler_is_mode is None):
        raise ValueError("sampler_logps and sampler_is_mode go together: give both or neither")
    if options.beta != 0.0 and ref_logps is None:
        raise ValueError("beta > 0 needs ref_logps (the reference model's per-token log-probs)")


def check_like(name, x, logps, *, float_only=True) -> None:
    """x is a tensor of the shape and device of logps (and, float_only, floating point and not requiring grad)."""
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"{name} must be a tensor, got {type(x).__name__}")
    if x.shape != logps.shape:
        raise ValueError(f"{name} must have the shape of logps {tuple(logps.shape)}, got {tuple(x.shape)}")
    if x.device != logps.device:
        raise ValueError(f"{name} is on {x.device} but logps are on {logps.device}")
    if float_only and not x.is_floating_point():
        raise ValueError(f"{name} must be a floating-point tensor, got {x.dtype}")
    if float_only and x.requires_grad:
        raise ValueError(f"{name} requires grad, but grpo_loss differentiates w.r.t. logps only: detach it")


def padded_cu_seqlens(num_seqs: int, length: int, device: torch.device) -> torch.Tensor:
    """The cu_seqlens of padded [num_seqs, length] rows: the row starts s length, int64."""
    return torch.arange(num_seqs + 1, device=device, dtype=torch.int64) * length


def check_loss_layout(logps, advantages, mask, cu_seqlens, max_seqlen, *, padded_cu=True):
    """-> (num_seqs, cu_seqlens int64 on the device, max_seqlen, advantages per token?). For padded logps the
    cu_seqlens are built (padded_cu_seqlens), or None with padded_cu=False. The one check of logps' type: it comes
    before anything reads logps' attributes."""
    if not isinstance(logps, torch.Tensor) or logps.dtype not in _FLOATS:
        got = logps.dtype if isinstance(logps, torch.Tensor) else type(logps).__name__
        raise ValueError(f"logps must be a float32/bfloat16/float16 tensor, got {got}")
    if cu_seqlens is None:
        if logps.dim() != 2:
            raise ValueError(
                f"logps must be padded [B, L] (with mask) or packed [T] with cu_seqlens, got {tuple(logps.shape)}"
            )
        b, length = logps.shape
        cu = padded_cu_seqlens(b, length, logps.device) if padded_cu else None
        max_len = length
    else:
        if logps.dim() != 1:
            raise ValueError(f"cu_seqlens goes with packed logps [T], got logps of shape {tuple(logps.shape)}")
        max_len = check_cu_seqlens(cu_seqlens, logps.shape[0], logps.device, max_seqlen=max_seqlen)
        b, cu = cu_seqlens.shape[0] - 1, cu_seqlens.to(torch.int64).contiguous()
    if b == 0:
        raise ValueError("empty batch: logps hold no sequence")
    if not isinstance(advantages, torch.Tensor) or not advantages.is_floating_point():
        raise ValueError("advantages must be a floating-point tensor")
    if advantages.device != logps.device:
        raise ValueError(f"advantages are on {advantages.device} but logps are on {logps.device}")
    if advantages.requires_grad:
        raise ValueError("advantages require grad, but grpo_loss differentiates w.r.t. logps only: detach them")
    if advantages.shape == logps.shape:
        per_token = True
    elif advantages.shape == (b,):
        per_token = False
    else:
        raise ValueError(
            f"advantages must be per sequence [{b}] or per token {tuple(logps.shape)}, got {tuple(advantages.shape)}"
        )
    if mask is not None:
        check_like("mask", mask, logps, float_only=False)
        if mask.dtype.is_complex:
            raise ValueError("mask must be bool, integer or floating point")
    return b, cu, max_len, per_token


# ---------------------------------------------------------------------------------------------------------------
# The fused LM head (fused_linear).


def check_chunk_tokens(chunk_tokens) -> None:
    """chunk_tokens is "auto" or a positive int."""
    if chunk_tokens == "auto":
        return
    if isinstance(chunk_tokens, bool) or not isinstance(chunk_tokens, int) or chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be 'auto' or a positive int, got {chunk_tokens!r}")


def check_linear_head(hidden, weight, bias, ids, temperature, impl) -> None:
    """The LM-head inputs of the fused loss: hidden [B, L, H] or [T, H], weight [V, H] and bias [V] of its dtype and
    device, ids in [0, V) of the shape of hidden without H, a positive temperature (float64 only for the reference)."""
    floats = (torch.float32, torch.bfloat16, torch.float16) + ((torch.float64,) if impl == "reference" else ())
    if not isinstance(hidden, torch.Tensor) or hidden.dtype not in floats:
        raise ValueError("hidden must be a float32/bfloat16/float16 tensor [B, L, H] or packed [T, H]")
    if hidden.dim() not in (2, 3):
        raise ValueError(f"hidden must be [B, L, H] or packed [T, H], got shape {tuple(hidden.shape)}")
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2 or weight.shape[1] != hidden.shape[-1]:
        got = tuple(weight.shape) if isinstance(weight, torch.Tensor) else type(weight).__name__
        raise ValueError(f"weight must be [V, H={hidden.shape[-1]}] (the LM head), got {got}")
    if weight.dtype != hidden.dtype or weight.device != hidden.device:
        raise ValueError(
            f"weight ({weight.dtype}, {weight.device}) must match hidden ({hidden.dtype}, {hidden.device})"
        )
    if bias is not None and (not isinstance(bias, torch.Tensor) or bias.shape != (weight.shape[0],)):
        raise ValueError(f"bias must be a tensor [V={weight.shape[0]}]")
    if bias is not None and (bias.dtype != hidden.dtype or bias.device != hidden.device):
        raise ValueError("bias must have the dtype and device of hidden")
    check_ids(ids, hidden.shape[:-1], hidden.device, weight.shape[0], "hidden without H")
    check_temperature(temperature)


# ----------------------------------------------------------------------------------------- group_advantages
def check_choice(name: str, value, allowed) -> None:
    if value not in allowed:
        raise ValueError(f"{name} must be one of {', '.join(map(repr, allowed))}, got {value!r}")


def check_nonnegative(name: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")
    return float(value)


def check_group_offsets(group_offsets: torch.Tensor, n: int, device: torch.device, *, values: bool = True) -> None:
    if not isinstance(group_offsets, torch.Tensor) or group_offsets.dtype not in (torch.int32, torch.int64):
        raise ValueError("group_offsets must be an int32 or int64 tensor")
    if group_offsets.dim() != 1 or group_offsets.shape[0] < 2:
        shape = tuple(group_offsets.shape)
        raise ValueError(f"group_offsets must be 1-D with num_groups + 1 >= 2 entries, got {shape}")
    if group_offsets.device != device:
        raise ValueError(f"group_offsets is on {group_offsets.device} but rewards are on {device}")
    if not values or torch.compiler.is_compiling():
        return
    offsets = group_offsets.cpu()
    if offsets[0] != 0 or offsets[-1] != n:
        raise ValueError(f"group_offsets must start at 0 and end at N={n}, got {offsets[0]} ... {offsets[-1]}")
    steps = offsets.diff()
    if bool((steps <= 0).any()):
        g = int((steps <= 0).nonzero()[0])
        raise ValueError(f"group_offsets must be strictly increasing: group {g} is [{offsets[g]}, {offsets[g + 1]})")


_UNIT_WEIGHTS: dict = {}


def check_reward_weights(reward_weights, k: int, one_dim: bool, device) -> torch.Tensor:
    """The weights as fp32 [k] on device; None -> ones (one tensor per device and k, made once: no fill kernel
    per call)."""
    if reward_weights is None:
        key = (torch.device(device), k)
        if key not in _UNIT_WEIGHTS:
            _UNIT_WEIGHTS[key] = torch.ones(k, dtype=torch.float32, device=device)
        return _UNIT_WEIGHTS[key]
    if isinstance(reward_weights, torch.Tensor):
        w = reward_weights.to(device=device, dtype=torch.float32)
    elif isinstance(reward_weights, Sequence) and not isinstance(reward_weights, (str, bytes)):
        w = torch.tensor([float(x) for x in reward_weights], dtype=torch.float32, device=device)
    else:
        raise ValueError(f"reward_weights must be a tensor or a sequence of numbers, got {type(reward_weights)}")
    if w.shape != (k,):
        what = "1-D rewards take no reward_weights (or exactly one)" if one_dim else f"rewards have K={k} columns"
        raise ValueError(f"reward_weights must have shape ({k},), got {tuple(w.shape)}: {what}")
    if not torch.compiler.is_compiling() and not bool(torch.isfinite(w).all()):
        raise ValueError("reward_weights hold a non-finite value")
    return w.contiguous()


# --------------------------------------------------------------------------------------- selective_logprobs
_LOGIT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def check_logprobs_args(logits, ids, temperature, cu_seqlens, impl, flags):
    if not isinstance(logits, torch.Tensor) or logits.dtype not in _LOGIT_DTYPES:
        got = logits.dtype if isinstance(logits, torch.Tensor) else type(logits)
        raise ValueError(f"logits must be a float16/bfloat16/float32 tensor, got {got}")
    if logits.dim() not in (2, 3) or logits.shape[-1] == 0:
        raise ValueError(f"logits must be [B, L, V] or packed [T, V] with V >= 1, got {tuple(logits.shape)}")
    check_ids(ids, logits.shape[:-1], logits.device, logits.shape[-1], "logits without V")
    check_temperature(temperature)
    for name, value in flags.items():
        check_flag(name, value)
    check_impl(impl)
    check_impl_device(impl, logits.device, "logits")
    if cu_seqlens is not None:
        if logits.dim() != 2:
            raise ValueError("cu_seqlens goes with packed logits [T, V]")
        check_cu_seqlens(cu_seqlens, logits.shape[0], logits.device)

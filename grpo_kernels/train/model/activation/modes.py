"""The activation-checkpointing modes of decoder blocks: what the backward keeps and what it recomputes.

Activation checkpointing (`model.activation_checkpointing = "blocks"`, or what "auto" picks): every decoder block's
forward runs under torch.utils.checkpoint (non-reentrant), applied before sharding, so the backward recomputes a
block's activations instead of keeping them; the parameters and their names are untouched (checkpoints and weight
sync unchanged).
"selective" keeps the matmuls' and attention's outputs and recomputes only the cheap ops between them.
"offload" also moves each block's checkpointed input, the one tensor per block that the forward keeps, to pinned
host memory (copied on a side stream while the forward goes on) and back when the backward recomputes the block:
saved-tensor hooks (torch.autograd.graph.saved_tensors_hooks) around the non-reentrant checkpoint, which saves its
inputs under the caller's hooks and its ops' tensors under its own.
"""

import functools

import torch

__all__ = ["CHECKPOINT_MODES", "checkpoint_blocks"]

CHECKPOINT_MODES = ("blocks", "offload", "selective")


def checkpoint_blocks(blocks, mode: str = "blocks") -> None:
    """Activation checkpointing: each block's forward runs under torch.utils.checkpoint (non-reentrant) when
    gradients are being recorded (no-grad passes, such as generation, run it plainly). mode "blocks": the backward
    recomputes the whole block; "offload": the same, and the checkpoint's saved input (the block's hidden states)
    goes to host memory after the forward and comes back when the backward recomputes the block (see `_to_host`);
    "selective": the outputs of the matmuls and of attention are kept and only the cheap ops between them
    (norms, activations, rotary embeddings, additions) are recomputed (torch's selective checkpoint contexts with the
    policy `_keep_matmuls`). Idempotent for one mode; the module tree, parameter names and state dict are unchanged.
    Apply before sharding."""
    if mode not in CHECKPOINT_MODES:
        raise ValueError(f"mode must be one of {', '.join(CHECKPOINT_MODES)}, got {mode!r}")
    for block in blocks:
        done = getattr(block, "_grpo_checkpointed", False)
        if done:
            if done != mode:
                raise ValueError(f'the blocks are already checkpointed in mode "{done}", not "{mode}"')
            continue
        block.forward = functools.partial(_checkpointed, block.forward, mode)
        block._grpo_checkpointed = mode


def _checkpointed(forward, mode, *args, **kwargs):
    if not torch.is_grad_enabled():
        return forward(*args, **kwargs)
    from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts

    if mode == "selective":
        contexts = functools.partial(create_selective_checkpoint_contexts, _keep_matmuls)
        return checkpoint(forward, *args, use_reentrant=False, context_fn=contexts, **kwargs)
    if mode == "blocks":
        return checkpoint(forward, *args, use_reentrant=False, **kwargs)
    # the checkpoint saves its positional tensor inputs (the hidden states; HF passes the rest by keyword) under the
    # hooks active when it is called, its ops' tensors under its own: only the block input passes through these
    with torch.autograd.graph.saved_tensors_hooks(_to_host, _from_host):
        return checkpoint(forward, *args, use_reentrant=False, **kwargs)


def _matmul_ops() -> frozenset:
    aten = torch.ops.aten
    names = ("mm", "addmm", "bmm", "baddbmm", "_scaled_dot_product_flash_attention",
             "_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_efficient_attention",
             "_scaled_dot_product_cudnn_attention", "_flash_attention_forward",
             "_efficient_attention_forward")  # fmt: skip
    return frozenset(getattr(aten, n).default for n in names if hasattr(aten, n))


_KEPT = None


def _keep_matmuls(ctx, op, *args, **kwargs):
    """Selective checkpointing's policy: keep what a matmul or attention kernel computed, recompute the rest."""
    global _KEPT
    from torch.utils.checkpoint import CheckpointPolicy

    if _KEPT is None:
        _KEPT = _matmul_ops()
    return CheckpointPolicy.MUST_SAVE if op in _KEPT else CheckpointPolicy.PREFER_RECOMPUTE


_SIDE_STREAMS = {}


def _to_host(t: torch.Tensor):
    """A saved block input to host memory: on CUDA a pinned buffer filled on a side stream (the forward goes on;
    the device memory is reused once the copy is done); on CPU a copy (the same path, testable without a GPU)."""
    if t.device.type != "cuda":
        return t.device, t.clone(), None
    stream = _SIDE_STREAMS.get(t.device)
    if stream is None:
        stream = _SIDE_STREAMS[t.device] = torch.cuda.Stream(t.device)
    host = torch.empty(t.size(), dtype=t.dtype, pin_memory=True)
    stream.wait_stream(torch.cuda.current_stream(t.device))  # t is computed
    with torch.cuda.stream(stream):
        host.copy_(t, non_blocking=True)
    t.record_stream(stream)
    done = torch.cuda.Event()
    done.record(stream)
    return t.device, host, done


def _from_host(packed) -> torch.Tensor:
    """The block input back on its device when the backward recomputes the block (the copy is issued then, on the
    compute stream: no prefetch)."""
    device, host, done = packed
    if done is None:
        return host
    torch.cuda.current_stream(device).wait_event(done)
    return host.to(device, non_blocking=True)

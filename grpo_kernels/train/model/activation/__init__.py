"""Activation memory, in one home: how a run's decoder blocks keep (or recompute) what the backward needs.

    from grpo_kernels.train.model import activation
    mode, blocks, line = activation.apply(model, mode="auto", tokens=16384, completion_tokens=1024, dtype_bytes=2)

One knob, `model.activation_checkpointing` ("none", "selective", "blocks", "offload" or "auto"), plus
`model.mlp_tile_tokens` and `model.activation_memory_gb`, all applied here by `apply`, which the trainer and the
long-chain benchmark both call:
  - modes.py: the mechanism (torch.utils.checkpoint around each block; selective's policy; offload's host copies);
  - auto.py: the "auto" chooser (the fastest mode whose estimated activations fit a budget) and that estimate;
  - tiled_mlp.py: the sequence-tiled MLP.
Apply before sharding; the module tree, parameter names and state dict are unchanged in every mode.
"""

import torch

from ..converters import converters_of
from ..fsdp import SINGLE, Dist, all_gather_objects
from .auto import AUTO_ORDER, activation_budget, activation_bytes, choose_checkpointing
from .modes import CHECKPOINT_MODES, checkpoint_blocks
from .tiled_mlp import tile_mlps

__all__ = ["AUTO_ORDER", "CHECKPOINT_MODES", "activation_budget", "activation_bytes", "apply", "checkpoint_blocks",
           "choose_checkpointing", "decoder_blocks", "tile_mlps"]  # fmt: skip


def decoder_blocks(model) -> torch.nn.ModuleList:
    """The decoder blocks of an HF causal LM (model.base_model.layers), or those the model's last converter that
    knows them gives (its `decoder_blocks(model)`); a ValueError naming the model without."""
    for converter in reversed(converters_of(model)):
        if hasattr(converter, "decoder_blocks"):
            return converter.decoder_blocks(model)
    layers = getattr(model.base_model, "layers", None)
    if not isinstance(layers, torch.nn.ModuleList):
        raise ValueError(f"cannot shard {type(model).__name__}: no decoder block list at model.base_model.layers")
    return layers


def apply(model, *, mode: str, tokens: int, completion_tokens: int, dtype_bytes: int, mlp_tile_tokens: int = 0,
          budget_gb: float | None = None, device: torch.device | None = None, dist: Dist = SINGLE,
          log=None) -> tuple[str, int, str]:  # fmt: skip
    """Checkpoint model's decoder blocks as `mode` says and tile their MLPs (mlp_tile_tokens > 0); returns (the mode
    applied, on how many of the first blocks, the line "auto" logs ("" otherwise)).

    "auto": `choose_checkpointing` for micro-batches of `tokens` tokens (completions up to completion_tokens) at
    dtype_bytes per value, within budget_gb GiB (None: what `activation_budget` derives for `device`); under
    torchrun every rank takes the most frugal choice of any rank (a collective), and rank 0 logs the line."""
    modes = ("none", "auto", *CHECKPOINT_MODES)
    if mode not in modes:
        raise ValueError(f"mode (model.activation_checkpointing) must be one of {', '.join(map(repr, modes))}, "
                         f"got {mode!r}")  # fmt: skip
    blocks = decoder_blocks(model)
    chosen, count, line = mode, len(blocks), ""
    if mode == "auto":
        budget = activation_budget(model, device or torch.device("cpu"), budget_gb)
        chosen, count, line = choose_checkpointing(model.config, budget=budget, tokens=tokens,
                                                   completion_tokens=completion_tokens, dtype_bytes=dtype_bytes,
                                                   mlp_tile_tokens=mlp_tile_tokens)  # fmt: skip
        if dist.distributed:  # every rank the same choice: the most frugal any rank needs
            choices = all_gather_objects((chosen, count), dist)
            chosen, count = max(choices, key=lambda c: (AUTO_ORDER.index(c[0]), c[1]))
            if len(set(choices)) > 1:
                line += (f'; "{chosen}" on {count} blocks on every rank (the ranks chose '
                         f"{', '.join(f'{m} on {n}' for m, n in choices)})")  # fmt: skip
        if log is not None and dist.rank == 0:
            log(line)
    if chosen != "none":
        checkpoint_blocks(blocks[:count], chosen)
    if mlp_tile_tokens:
        tile_mlps(blocks, mlp_tile_tokens)
    return chosen, (0 if chosen == "none" else count), line

"""Sequence-tiled MLP: a decoder block's MLP run over tiles of the sequence, each tile under its own checkpoint.

The MLP of a decoder block acts on every token separately, so it can run over tiles of T tokens of the (packed) row
with the same result. Each tile runs under torch.utils.checkpoint (non-reentrant): the forward keeps only the tile's
input (a view of the block's normed hidden states, no copy), and the backward recomputes one tile's intermediates
(gate, up, activation and their product: 4 x intermediate_size floats per token for a SwiGLU MLP) at a time. So
the MLP's working memory is one tile's instead of the whole row's, with or without block checkpointing (nested
checkpoints are supported by torch's non-reentrant implementation); the cost is one more MLP forward per block.
Gradients are exact (the same math per token; matmuls over a tile may round differently in the last bit).

`tile_mlps(blocks, tile_tokens)` patches each block's `mlp.forward`; passes without gradients (generation,
evaluation) and rows of at most tile_tokens run the MLP plainly. Module tree, parameter names and state dict are
unchanged, so checkpoints and weight sync are unaffected. Apply before sharding.
"""

import functools

import torch

__all__ = ["tile_mlps"]


def tile_mlps(blocks, tile_tokens: int) -> None:
    """Run every block's `mlp` over tiles of tile_tokens tokens of the sequence (dim -2). Idempotent for one tile
    size; a block without an `mlp` submodule is refused with its type."""
    if isinstance(tile_tokens, bool) or not isinstance(tile_tokens, int) or tile_tokens < 1:
        raise ValueError(f"tile_tokens must be an integer >= 1, got {tile_tokens!r}")
    for block in blocks:
        mlp = getattr(block, "mlp", None)
        if not isinstance(mlp, torch.nn.Module):
            raise ValueError(f"cannot tile the MLP of {type(block).__name__}: it has no `mlp` submodule")
        tiled = getattr(mlp, "_grpo_tile_tokens", None)
        if tiled == tile_tokens:
            continue
        if tiled is not None:
            raise ValueError(f"the MLPs are already tiled at {tiled} tokens, not {tile_tokens}")
        mlp.forward = functools.partial(_tiled, mlp.forward, tile_tokens)
        mlp._grpo_tile_tokens = tile_tokens


def _tiled(forward, tile_tokens: int, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    if not torch.is_grad_enabled() or x.dim() < 2 or x.shape[-2] <= tile_tokens:
        return forward(x, *args, **kwargs)
    from torch.utils.checkpoint import checkpoint

    # split (not slicing): its backward concatenates the tiles' gradients once instead of one row-sized zero tensor
    # per tile
    tiles = [checkpoint(forward, part, *args, use_reentrant=False, **kwargs) for part in x.split(tile_tokens, dim=-2)]
    return torch.cat(tiles, dim=-2)

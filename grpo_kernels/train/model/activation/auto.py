"""`model.activation_checkpointing = "auto"`: the fastest checkpointing mode whose activations fit a budget.

The estimate is per token of a micro-batch (packing.token_budget tokens at most), from the model's sizes, with
coefficients fitted on SmolLM2-135M's measured steps with block checkpointing, with and without the tiled MLP
(benchmarks/results/long_chains/memory_model.md, rows of at least 8,000 tokens; "selective" and "none" were not in
the fit: their estimates are 5 % below and 23 % above their measured slopes). One decoder block's working set while
its backward runs is about `BLOCK_HIDDEN x hidden + BLOCK_MLP x intermediate` values per token (the MLP part drops
to a tile with model.mlp_tile_tokens); "none" keeps that for every block, "selective" keeps the matmuls' and
attention's outputs (4 x hidden + 2 x KV width + 2 x intermediate values per token and block) plus one block's
working set, "blocks" keeps each block's input (hidden values per token and block) plus one block's working set.
The modes in order of speed: none, selective, blocks; "auto" takes the first that fits, never "offload" (set it
explicitly). Where selective does not fit and a few blocks' full activations do, "auto" checkpoints only as many
blocks as it must: "blocks" on the first n of the L decoder blocks, the last L - n keeping every activation, so the
backward recomputes n blocks instead of L (the backward reaches the last blocks first and frees their activations
before it recomputes a checkpointed one, so the peak is n block inputs plus L - n blocks' working sets; counted
with one more working set, the recompute's).

The budget (`model.activation_memory_gb`, unset: derived): on CUDA, 90 % of the device memory free once the model is
loaded, less the gradients and AdamW's two moments still to be allocated (12 bytes per parameter); on CPU, half of
the memory available (MemAvailable) shared by the ranks on this host (LOCAL_WORLD_SIZE), less the same. A budget
that does not hold one completion with "blocks" is refused before the first step, naming the option.
"""

import torch

from ..fsdp import rank_memory_bytes

__all__ = ["AUTO_ORDER", "BLOCK_HIDDEN", "BLOCK_MLP", "activation_bytes", "activation_budget", "choose_checkpointing"]

BLOCK_HIDDEN, BLOCK_MLP = 10.7, 5.5  # one block's working set per token, in hidden- and intermediate-size values
AUTO_ORDER = ("none", "selective", "blocks")


def _sizes(model_config) -> dict:
    c = model_config
    heads = c.num_attention_heads
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // heads
    return dict(layers=c.num_hidden_layers, hidden=c.hidden_size, intermediate=c.intermediate_size,
                kv=2 * getattr(c, "num_key_value_heads", heads) * head_dim)  # fmt: skip


def activation_bytes(mode: str, model_config, *, dtype_bytes: int, tokens: int, mlp_tile_tokens: int = 0,
                     checkpointed: int | None = None) -> float:
    """Estimated activation bytes of one micro-batch of `tokens` tokens under a checkpointing mode applied to the
    first `checkpointed` decoder blocks (None: all; the others keep every activation, as under "none")."""
    s = _sizes(model_config)
    mlp = BLOCK_MLP * s["intermediate"] * (min(1.0, mlp_tile_tokens / tokens) if mlp_tile_tokens else 1.0)
    block = (BLOCK_HIDDEN * s["hidden"] + mlp) * dtype_bytes * tokens  # one block's working set
    per_layer = {"none": block / tokens,
                 "selective": (4 * s["hidden"] + s["kv"] + 2 * s["intermediate"]) * dtype_bytes,
                 "blocks": s["hidden"] * dtype_bytes, "offload": 0.0}[mode]  # fmt: skip
    if mode == "none":
        return block * s["layers"]
    n = s["layers"] if checkpointed is None else checkpointed
    if not 0 <= n <= s["layers"]:
        raise ValueError(f"checkpointed must be in [0, {s['layers']}] (the decoder blocks), got {n}")
    # each block that keeps its activations counted whole, even the last (whose are consumed first): the loss head's
    # working memory meets them at the end of the forward
    return block + tokens * per_layer * n + block * (s["layers"] - n)


def activation_budget(model, device: torch.device, gb: float | None) -> float:
    """The activation budget in bytes: `gb` when set, else what the device (CPU: half the available memory) has
    free for them once the gradients and AdamW's moments exist."""
    if gb is not None:
        return gb * 2**30
    params = sum(p.numel() for p in model.parameters())
    later = 12 * params  # fp32 gradients and two moments, allocated at the first step
    share = rank_memory_bytes(device)  # a GPU's free memory, or this rank's share of the host's
    return (0.9 if device.type == "cuda" else 0.5) * share - later


def choose_checkpointing(model_config, *, budget: float, tokens: int, completion_tokens: int, dtype_bytes: int,
                         mlp_tile_tokens: int = 0) -> tuple[str, int, str]:
    """(mode, how many of the first decoder blocks it applies to, the line that says why) for "auto": the first of
    none, selective, blocks on as few blocks as fit, blocks on all, whose micro-batch of `tokens` tokens fits `budget`
    bytes. Raises ValueError when even "blocks" cannot hold one completion of completion_tokens tokens; returns
    "blocks" on all with a warning line when it holds one but not a full micro-batch."""
    layers = _sizes(model_config)["layers"]
    est = {m: activation_bytes(m, model_config, dtype_bytes=dtype_bytes, tokens=tokens,
                               mlp_tile_tokens=mlp_tile_tokens) for m in AUTO_ORDER}  # fmt: skip
    gib = 2**30
    table = ", ".join(f"{m} {b / gib:.2f}" for m, b in est.items())
    why = f"(estimated activation GiB for a micro-batch of {tokens} tokens: {table}; budget {budget / gib:.2f})"
    for mode in AUTO_ORDER[:-1]:
        if est[mode] <= budget:
            return mode, (0 if mode == "none" else layers), f'model.activation_checkpointing = "auto": "{mode}" {why}'
    for n in range(1, layers):  # a few blocks' full activations fit: checkpoint only as many as needed
        part = activation_bytes("blocks", model_config, dtype_bytes=dtype_bytes, tokens=tokens,
                                mlp_tile_tokens=mlp_tile_tokens, checkpointed=n)  # fmt: skip
        if part <= budget:
            return "blocks", n, (f'model.activation_checkpointing = "auto": "blocks" on the first {n} of {layers} '
                                 f"decoder blocks, the last {layers - n} keeping their activations: "
                                 f"{part / gib:.2f} GiB {why}")  # fmt: skip
    if est["blocks"] <= budget:
        return "blocks", layers, f'model.activation_checkpointing = "auto": "blocks" {why}'
    one = activation_bytes("blocks", model_config, dtype_bytes=dtype_bytes, tokens=completion_tokens,
                           mlp_tile_tokens=mlp_tile_tokens)  # fmt: skip
    if one > budget:
        raise ValueError(f"model.activation_memory_gb: an activation budget of {budget / gib:.2f} GiB cannot hold "
                         f"one completion of {completion_tokens} tokens even with block checkpointing (estimated "
                         f'{one / gib:.2f} GiB): raise it, shorten sampling.max_new_tokens or use "offload"')
    return "blocks", layers, (f'model.activation_checkpointing = "auto": "blocks", but a full micro-batch of {tokens} '
                              f"tokens may not fit (estimated {est['blocks'] / gib:.2f} GiB, budget "
                              f"{budget / gib:.2f}): lower packing.token_budget if it runs out of memory")  # fmt: skip

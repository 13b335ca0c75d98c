"""Sequence parallelism (Ulysses) over packed rows: N ranks share one packed micro-batch, each holding a
contiguous 1/N of its tokens through the whole decoder.

    shard = shard_packed(packed, group=sp_group)            # this rank's contiguous shard of the row
    h = model.base_model(**shard.model_kwargs()).last_hidden_state[0]     # [T / N, H], attention all-to-all inside
    logps = shard.gather(fused_linear_logprobs(h[shard.logit_rows], W, shard.completion_ids))   # [N] on every rank

Why Ulysses: everything in a decoder block but attention is per token, so it runs on the shard as is (RoPE takes the
packed position ids of the shard). Attention needs whole sequences, so around every attention call
(`grpo_kernels.attention`, attn_implementation "grpo_varlen", reading the `sequence_parallel` keyword) an all-to-all
turns [T / N tokens, all heads] into [T tokens, heads / N], the packed varlen attention runs on the whole row with
its own cu_seqlens / shared-prefix layout, and a second all-to-all returns [T / N, all heads]. Both all-to-alls
are autograd-aware (torch's functional collectives: NCCL on GPUs, gloo on CPU), so the backward is the forward's
mirror. Query heads must divide by N; key/value heads that do not (grouped-query attention with fewer KV heads
than N, or a count N does not divide) are replicated to one per query head before the exchange, which is what
attention computes anyway.

The row is padded to a multiple of N with one extra attention segment of pad tokens (its own causal sequence: it
attends to nothing real and nothing real attends to it), and no completion token is predicted from a pad row.

The loss: each rank computes the log-probs of the completion tokens predicted from its shard (the fused LM head,
no logits), and `gather` sums the N partial vectors into the whole row's [N] log-probs on every rank; the loss is
then computed from them identically on every rank, so every normalizer (token counts, sequence means, GSPO's
sequence-level weights across shard boundaries) is the unsharded one. The gather's backward hands each rank the
gradient of its own tokens only: the loss is replicated, not summed, over the group.
"""

from dataclasses import dataclass

import torch
import torch.distributed as dist

from .packing import PackedBatch

__all__ = ["SequenceShard", "shard_packed", "ulysses_attention"]


@dataclass(frozen=True, slots=True, kw_only=True)
class SequenceShard:
    """This rank's shard of one packed row, and what attention needs of the whole row."""

    group: object
    """The process group of the N ranks sharing the row."""
    size: int
    """N."""
    rank: int
    """This rank's place in the group: it holds tokens [rank * shard_len, (rank + 1) * shard_len) of the padded row."""
    shard_len: int
    """Tokens per shard (the padded row has N * shard_len)."""
    input_ids: torch.Tensor
    """[1, shard_len] this shard's tokens."""
    position_ids: torch.Tensor
    """[1, shard_len] their packed position ids."""
    cu_seqlens: torch.Tensor
    """The whole padded row's attention segments (the pad segment last, when there is padding)."""
    max_seqlen: int
    prefix_groups: tuple | None
    """The whole padded row's shared-prefix segments (grpo_kernels.packing), or None."""
    logit_rows: torch.Tensor
    """[n] rows of this shard (local indices) that predict completion tokens."""
    token_index: torch.Tensor
    """[n] the index, in the row's completion-token vector, of each of those tokens."""
    completion_ids: torch.Tensor
    """[n] the completion tokens this shard predicts."""
    num_completion_tokens: int
    """N_c, the row's completion tokens (the length of the gathered vector)."""

    def model_kwargs(self) -> dict:
        """Keyword arguments for an HF decoder (attn_implementation "grpo_varlen") run on this shard."""
        return {"input_ids": self.input_ids, "position_ids": self.position_ids, "use_cache": False,
                "sequence_parallel": self}  # fmt: skip

    def gather(self, values: torch.Tensor) -> torch.Tensor:
        """Per-token values of this shard's completion tokens [n] -> the whole row's [N_c], on every rank of the
        group. Differentiable: the backward returns the incoming gradient at this shard's tokens (every rank must
        compute the same function of the result, as the replicated loss does)."""
        return _GatherTokens.apply(values, self.token_index, self.num_completion_tokens, self.group)


def shard_packed(packed: PackedBatch, *, group, pad_id: int = 0) -> SequenceShard:
    """This rank's contiguous shard of `packed` (one row), padded to a multiple of the group's size."""
    n, rank = dist.get_world_size(group), dist.get_rank(group)
    total = packed.num_tokens
    shard_len = -(-total // n)
    pad = shard_len * n - total
    device = packed.input_ids.device
    ids, pos, cu = packed.input_ids, packed.position_ids, packed.cu_seqlens
    prefix, max_seqlen = packed.prefix_groups, packed.max_seqlen
    if pad:
        ids = torch.cat([ids, ids.new_full((1, pad), pad_id)], dim=1)
        pos = torch.cat([pos, torch.arange(pad, device=device, dtype=pos.dtype)[None]], dim=1)
        cu = torch.cat([cu, cu.new_tensor([total + pad])])
        max_seqlen = max(max_seqlen, pad)
        if prefix is not None:
            prefix = (*prefix, (total, total + pad, ()))
    lo, hi = rank * shard_len, (rank + 1) * shard_len
    rows = packed.logit_rows
    mine = ((rows >= lo) & (rows < hi)).nonzero().flatten()
    return SequenceShard(group=group, size=n, rank=rank, shard_len=shard_len, input_ids=ids[:, lo:hi],
                         position_ids=pos[:, lo:hi], cu_seqlens=cu, max_seqlen=max_seqlen, prefix_groups=prefix,
                         logit_rows=rows[mine] - lo, token_index=mine, completion_ids=packed.completion_ids[mine],
                         num_completion_tokens=packed.completion_ids.shape[0])  # fmt: skip


class _GatherTokens(torch.autograd.Function):
    @staticmethod
    def forward(ctx, values, index, total, group):
        out = values.new_zeros((total, *values.shape[1:]))
        out[index] = values
        dist.all_reduce(out, group=group)  # every token lives on exactly one shard: the sum is a gather
        ctx.save_for_backward(index)
        return out

    @staticmethod
    def backward(ctx, grad):
        (index,) = ctx.saved_tensors
        return grad[index], None, None, None


def _all_to_all(send: torch.Tensor, group) -> torch.Tensor:
    """Block i of send ([N, ...]) goes to rank i; block j of the result came from rank j. Differentiable."""
    from torch.distributed import _functional_collectives as fc

    return fc.all_to_all_single_autograd(send, None, None, group)


def _seq_to_heads(x: torch.Tensor, n: int, group) -> torch.Tensor:
    """[heads, T / N, D] (this rank's tokens, every head) -> [heads / N, T, D] (every token, this rank's heads)."""
    h, length, d = x.shape
    recv = _all_to_all(x.reshape(n, h // n, length, d).contiguous(), group)  # block i: rank i's tokens, my heads
    return recv.transpose(0, 1).reshape(h // n, n * length, d)


def _heads_to_seq(x: torch.Tensor, n: int, group) -> torch.Tensor:
    """[T, heads / N, D] (every token, this rank's heads) -> [T / N, heads, D] (this rank's tokens, every head)."""
    t, h, d = x.shape
    recv = _all_to_all(x.reshape(n, t // n, h, d).contiguous(), group)  # block j: my tokens, rank j's heads
    return recv.transpose(0, 1).reshape(t // n, n * h, d)


def ulysses_attention(attention, query, key, value, shard: SequenceShard, *, sinks=None, **options):
    """Attention over a sequence-sharded row: query [1, H, T / N, D], key/value [1, H_kv, T / N, D] ->
    [1, T / N, H, D]. `attention(q, k, v, cu_seqlens, max_seqlen, prefix_groups=, sinks=, **options)` is the packed
    varlen attention on the whole row ([T, heads, D] tensors); sinks: per-head [H] or None (sliced per rank)."""
    n = shard.size
    heads, kv_heads = query.shape[1], key.shape[1]
    if query.shape[0] != 1 or query.shape[2] != shard.shard_len:
        raise ValueError(f"sequence-parallel attention expects query [1, H, {shard.shard_len}, D] (one packed row "
                         f"shard), got {tuple(query.shape)}")  # fmt: skip
    if heads % n:
        raise ValueError(f"sequence parallelism over {n} ranks needs the query heads ({heads}) to be a multiple of {n}")
    if kv_heads % n:  # replicate: query head h reads KV head h // (heads / kv_heads) either way
        key, value = (x.repeat_interleave(heads // kv_heads, dim=1) for x in (key, value))
    q, k, v = (_seq_to_heads(x[0], n, shard.group).transpose(0, 1) for x in (query, key, value))
    if sinks is not None:
        local = heads // n
        sinks = sinks[shard.rank * local : (shard.rank + 1) * local]
    out = attention(q, k, v, shard.cu_seqlens, shard.max_seqlen, prefix_groups=shard.prefix_groups, sinks=sinks,
                    **options)  # fmt: skip
    return _heads_to_seq(out, n, shard.group)[None]

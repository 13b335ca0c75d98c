"""Padding-free batches: pack prompt + completion pairs into one row, and map per-token values back.

A packed batch is one row `[1, T]` holding every sample's prompt followed by its completion; `position_ids`
restart at 0 per sample and `cu_seqlens` delimit the attention segments, so a decoder run with the varlen
attention of `grpo_kernels.attention` computes exactly what it computes per sample. With `shared_prefix=True`
the G samples of a group share one copy of their prompt ([prompt, c_1, ..., c_G], Prefix Grouper style).
Each completion token t is predicted by row `logit_rows[t]` of the packed output (its previous token, or the
prompt's last token for the first one), so with the last hidden states `h` [T, H] of the packed row:

    h = model.model(**packed.model_kwargs()).last_hidden_state[0]
    loss, _ = fused_linear_grpo_loss(h[packed.logit_rows], model.lm_head.weight, packed.completion_ids, adv,
                                     cu_seqlens=packed.completion_cu_seqlens, old_logps=old, ...)

`packed.completions(x)` turns per-completion-token values into TRL's padded `[B, max_completion_length]` layout.
Token-budget micro-batches across ranks come from `grpo_kernels.planner.plan_micro_batches`.
"""

import operator
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .planner import Plan, plan_micro_batches

__all__ = ["PackedBatch", "Plan", "pack_sequences", "plan_micro_batches"]


@dataclass(frozen=True, slots=True, kw_only=True)
class PackedBatch:
    """One packed row of B samples, T tokens in all, N completion tokens."""

    input_ids: torch.Tensor
    """[1, T] int64: plain: prompt_0, completion_0, prompt_1, ...; shared prefix: prompt_g, completions of g, ..."""
    position_ids: torch.Tensor
    """[1, T] int64: a token's position in its own sample (a completion continues from its prompt's length)."""
    cu_seqlens: torch.Tensor
    """[S + 1] int32: the attention segments (a sample; with a shared prefix, a whole group)."""
    max_seqlen: int
    """The longest segment."""
    seq_index: torch.Tensor
    """[T] int64: the attention segment of every token (the sample; with a shared prefix, the group)."""
    completion_mask: torch.Tensor
    """[T] float32: 1 where input_ids holds a completion token."""
    sample_rows: torch.Tensor
    """[B, max prompt + completion length] int64: sample b's tokens as rows of the packed batch, in order (a
    shared prompt appears in every sample of its group); -1 pads. The index map back to (sample, position)."""
    logit_rows: torch.Tensor
    """[N] int64: for each completion token, the row of the packed logits / hidden states that predicts it."""
    completion_ids: torch.Tensor
    """[N] int64: the completion tokens, sample after sample."""
    completion_cu_seqlens: torch.Tensor
    """[B + 1] int32: sample b's completion tokens are completion_ids[cu[b]:cu[b + 1]] (the loss's cu_seqlens)."""
    prompt_lengths: torch.Tensor
    """[B] int64."""
    completion_lengths: torch.Tensor
    """[B] int64."""
    prefix_groups: tuple | None = None
    """Shared prefix only: per segment (prompt start, prompt end, completion bounds (absolute token indices))."""

    @property
    def num_tokens(self) -> int:
        return self.input_ids.shape[1]

    def model_kwargs(self) -> dict:
        """Keyword arguments for an HF decoder run packed (no cache; no attention mask)."""
        cu = self.cu_seqlens
        kw = {"input_ids": self.input_ids, "position_ids": self.position_ids, "cu_seq_lens_q": cu,
              "cu_seq_lens_k": cu, "max_length_q": self.max_seqlen, "max_length_k": self.max_seqlen,
              "use_cache": False}  # fmt: skip
        if self.prefix_groups is not None:
            kw["prefix_groups"] = self.prefix_groups
        return kw

    def unpack(self, values: torch.Tensor, pad: float = 0.0) -> torch.Tensor:
        """Per-token values [T, ...] -> [B, L, ...]: each sample's prompt + completion, right-padded with pad."""
        if values.shape[0] != self.num_tokens:
            raise ValueError(f"values must have T={self.num_tokens} rows, got {tuple(values.shape)}")
        rows = self.sample_rows.to(values.device)
        out = values[rows.clamp(min=0)]
        return out.masked_fill((rows < 0).reshape(*rows.shape, *([1] * (values.dim() - 1))), pad)

    def completions(self, values: torch.Tensor, pad: float = 0.0) -> torch.Tensor:
        """Per-completion-token values [N, ...] -> [B, max completion length, ...] (TRL's padded layout)."""
        n = self.completion_ids.shape[0]
        if values.shape[0] != n:
            raise ValueError(f"values must have N={n} rows (one per completion token), got {tuple(values.shape)}")
        lengths = self.completion_lengths
        out = values.new_full((lengths.shape[0], int(lengths.max()) if n else 0, *values.shape[1:]), pad)
        row = torch.repeat_interleave(torch.arange(lengths.shape[0], device=values.device), lengths)
        col = torch.arange(n, device=values.device) - self.completion_cu_seqlens.long()[row]
        out[row, col] = values
        return out


def _as_ids(x, what: str, i: int) -> torch.Tensor:
    t = x if isinstance(x, torch.Tensor) else torch.as_tensor(list(x))
    if t.dim() != 1 or (t.numel() and (t.is_floating_point() or t.is_complex() or t.dtype == torch.bool)):
        raise ValueError(f"{what}[{i}] must be a 1-D sequence of integer token ids, got shape {tuple(t.shape)} "
                         f"{t.dtype}")  # fmt: skip
    t = t.to(torch.int64).cpu()
    if t.numel() and int(t.min()) < 0:
        j = int((t < 0).nonzero()[0])
        raise ValueError(f"{what}[{i}][{j}] is {int(t[j])}: token ids are >= 0")
    return t


def _group_id(g, i: int) -> int:
    if isinstance(g, bool) or (isinstance(g, torch.Tensor) and (g.is_floating_point() or g.dtype == torch.bool)):
        raise ValueError(f"group_ids[{i}] must be an integer, got {g!r}")
    try:
        return operator.index(g)
    except TypeError:
        raise ValueError(f"group_ids[{i}] must be an integer, got {g!r}") from None


def _groups(group_ids, prompts) -> list[list[int]]:
    if group_ids is None or len(group_ids) != len(prompts):
        raise ValueError("shared_prefix=True needs group_ids, one per sample")
    order: dict = {}
    for i, g in enumerate(group_ids):
        order.setdefault(_group_id(g, i), []).append(i)
    for members in order.values():
        if any(not torch.equal(prompts[i], prompts[members[0]]) for i in members):
            raise ValueError(f"samples {members} share a group id but not their prompt")
    return list(order.values())


def pack_sequences(prompts: Sequence, completions: Sequence, *, shared_prefix: bool = False, group_ids=None,
                   device=None) -> PackedBatch:  # fmt: skip
    """Pack B (prompt, completion) pairs of token ids (lists or 1-D tensors) into one row.

    A prompt must have at least one token (the first completion token is predicted from the prompt's last); a
    completion may be empty (no loss token). With shared_prefix=True, the samples of a group (`group_ids`, equal
    prompts) are laid out once as [prompt, completion_1, ..., completion_G]: each completion's positions continue
    from the prompt's length and (with grpo_kernels.attention) it attends to the prompt and to itself only, so
    outputs and gradients equal plain packing while the prompt is encoded once.
    """
    if len(prompts) != len(completions):
        raise ValueError(f"prompts ({len(prompts)}) and completions ({len(completions)}) must pair up")
    if not prompts:
        raise ValueError("empty batch: no prompts")
    p = [_as_ids(x, "prompts", i) for i, x in enumerate(prompts)]
    c = [_as_ids(x, "completions", i) for i, x in enumerate(completions)]
    if any(x.numel() == 0 for x in p):
        raise ValueError(f"prompts[{next(i for i, x in enumerate(p) if x.numel() == 0)}] is empty")
    groups = _groups(group_ids, p) if shared_prefix else [[i] for i in range(len(p))]
    ids, pos, rows, cu, prefix, is_completion = [], [], [None] * len(p), [0], [], []
    sample_rows = [None] * len(p)
    t = 0
    for members in groups:
        prompt = p[members[0]]
        ids.append(prompt)
        pos.append(torch.arange(prompt.numel()))
        is_completion.append(torch.zeros(prompt.numel()))
        prompt_rows, t0 = torch.arange(t, t + prompt.numel()), t
        t += prompt.numel()
        bounds = []
        for i in members:
            n = c[i].numel()
            ids.append(c[i])
            pos.append(torch.arange(prompt.numel(), prompt.numel() + n))
            is_completion.append(torch.ones(n))
            rows[i] = torch.cat([prompt_rows[-1:], torch.arange(t, t + max(n - 1, 0))])[:n]
            sample_rows[i] = torch.cat([prompt_rows, torch.arange(t, t + n)])
            bounds.append((t, t + n))
            t += n
            if not shared_prefix:
                cu.append(t)
                prefix.append(None)
        if shared_prefix:
            cu.append(t)
            prefix.append((t0, t0 + prompt.numel(), tuple(bounds)))
    p_len = torch.tensor([x.numel() for x in p], dtype=torch.int64)
    c_len = torch.tensor([x.numel() for x in c], dtype=torch.int64)
    cu_t = torch.tensor(cu, dtype=torch.int32)
    seq_index = torch.repeat_interleave(torch.arange(len(cu) - 1), cu_t.diff().long())
    padded_rows = torch.nn.utils.rnn.pad_sequence(sample_rows, batch_first=True, padding_value=-1)
    to = lambda x: x.to(device) if device is not None else x  # noqa: E731
    return PackedBatch(
        input_ids=to(torch.cat(ids)[None]), position_ids=to(torch.cat(pos)[None]), cu_seqlens=to(cu_t),
        max_seqlen=int(cu_t.diff().max()), seq_index=to(seq_index), completion_mask=to(torch.cat(is_completion)),
        sample_rows=to(padded_rows), logit_rows=to(torch.cat(rows)), completion_ids=to(torch.cat(c)),
        completion_cu_seqlens=to(torch.cat([torch.zeros(1, dtype=torch.int64), c_len.cumsum(0)]).to(torch.int32)),
        prompt_lengths=to(p_len), completion_lengths=to(c_len), prefix_groups=tuple(prefix) if shared_prefix else None,
    )  # fmt: skip

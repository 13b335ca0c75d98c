"""The attention paths of grpo_kernels.attention that run on any device: SDPA per sequence (once per sequence length
for plain attention), the math path (sinks, soft-capping, windows as an explicit mask), and shared-prefix attention
(a group's completions attend to one copy of their prompt). `varlen_attention` picks them; they take its packed
`[T, heads, head_dim]` layout."""

import torch


class Cuts:
    """`x[s:e]` of each tensor for ranges whose ends are among `points`, from one split per tensor: a slice per
    range would cost a zero-filled [T, H, D] gradient per slice in the backward (per sequence, per layer: most of
    a CPU step at 64 sequences), a split's backward is one cat."""

    def __init__(self, tensors, points):
        total = tensors[0].shape[0]
        self.points = sorted({0, total, *map(int, points)})
        if self.points[0] < 0 or self.points[-1] > total:
            raise ValueError(f"sequence bounds must lie in [0, {total}] (the packed length), got {self.points[0]} "
                             f"and {self.points[-1]}")  # fmt: skip
        self.index = {p: i for i, p in enumerate(self.points)}
        sizes = [b - a for a, b in zip(self.points[:-1], self.points[1:], strict=True)]
        self.tensors, self.parts = tensors, [t.split(sizes) for t in tensors]

    def __call__(self, s, e):
        i, j = self.index[s], self.index[e]
        if j <= i:  # an empty range (an empty prompt): an empty slice, as x[s:e] gives
            return tuple(t[s:s] for t in self.tensors)
        return tuple(parts[i] if j == i + 1 else torch.cat(parts[i:j]) for parts in self.parts)


def assemble(pieces, q):
    """The [T, H, D] output from (start, rows) pieces: one cat in token order, zeros where no piece is (an
    `out[s:e] = rows` per piece would cost a zero-filled [T, H, D] gradient per piece in the backward)."""
    parts, at = [], 0
    for start, rows in sorted(pieces, key=lambda x: x[0]):
        if start > at:
            parts.append(q.new_zeros((start - at, *q.shape[1:])))
        parts.append(rows)
        at = start + rows.shape[0]
    if at < q.shape[0]:
        parts.append(q.new_zeros((q.shape[0] - at, *q.shape[1:])))
    return torch.cat(parts) if len(parts) > 1 else parts[0]


def sdpa_window(window, causal):
    """flash-attn's (left, right) window for `window`; (-1, -1) is unlimited."""
    if window is None:
        return (-1, 0) if causal else (-1, -1)
    return (window - 1, 0) if causal else (window, window)


def attend(q, k, v, q_pos, k_pos, *, causal, scale, window, sinks, softcap, math=False):
    """Attention of q over k/v ([L, H, D]) given the positions of each query and key in their sequence."""
    plain_causal = causal and window is None and q_pos is k_pos
    mask = None
    if not plain_causal:
        dist = q_pos[:, None] - k_pos[None, :]
        mask = (dist >= 0) if causal else torch.ones_like(dist, dtype=torch.bool)
        if window is not None:
            mask &= (dist < window) if causal else (dist.abs() <= window)
    if not math and sinks is None and softcap is None:
        return _sdpa(q, k, v, scale, causal=plain_causal, mask=mask)
    return _math(q, k, v, scale, causal=plain_causal, mask=mask, sinks=sinks, softcap=softcap)


def _sdpa(q, k, v, scale, *, causal=False, mask=None):
    """SDPA on [L, H, D] tensors (grouped-query heads allowed)."""
    t = lambda x: x.transpose(0, 1)[None]  # noqa: E731
    out = torch.nn.functional.scaled_dot_product_attention(
        t(q), t(k), t(v), attn_mask=mask, is_causal=causal, scale=scale, enable_gqa=q.shape[1] != k.shape[1]
    )
    return out[0].transpose(0, 1)


def sdpa_by_length(calls, scale, *, causal):
    """SDPA of each (q, k, v) of calls ([L, H, D] each, q and k of one length), returned in order: the calls of one
    length stacked into one batched SDPA. A packed GRPO batch holds many sequences of few distinct lengths (a group's
    prompt is one length, short completions few), and on CPU one SDPA per sequence cost more in per-call overhead
    than in arithmetic (the tiny model's attention took 2x as long). Each batch row is computed as it would be
    alone: the outputs and gradients equal one call per sequence bit for bit on CPU (tests/test_attention.py)."""
    by_length = {}
    for i, (cq, ck, _) in enumerate(calls):
        by_length.setdefault((cq.shape[0], ck.shape[0]), []).append(i)
    outs = [None] * len(calls)
    for index in by_length.values():
        if len(index) == 1:
            outs[index[0]] = _sdpa(*calls[index[0]], scale, causal=causal)
            continue
        qb, kb, vb = (torch.stack([calls[i][j] for i in index]).transpose(1, 2) for j in range(3))  # [B, H, L, D]
        out = torch.nn.functional.scaled_dot_product_attention(qb, kb, vb, is_causal=causal, scale=scale,
                                                               enable_gqa=qb.shape[1] != kb.shape[1])  # fmt: skip
        for i, rows in zip(index, out.transpose(1, 2).unbind(0), strict=True):  # unbind: one stack in the backward
            outs[i] = rows
    return outs


def _math(q, k, v, scale, *, causal, mask, sinks, softcap):
    """Explicit scores in fp32 (transformers' eager attention): scale, soft-cap, mask, softmax with sinks, @ v."""
    heads, rep = q.shape[1], q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.float(), k.float()) * (scale if scale is not None else q.shape[2] ** -0.5)
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    if causal:
        mask = torch.ones(q.shape[0], k.shape[0], dtype=torch.bool, device=q.device).tril()
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    if sinks is not None:
        scores = torch.cat([scores, sinks.float().view(heads, 1, 1).expand(heads, q.shape[0], 1)], dim=-1)
    probs = torch.softmax(scores, dim=-1)
    if sinks is not None:
        probs = probs[..., :-1]
    return torch.einsum("hqk,khd->qhd", probs, v.float()).to(q.dtype)


def shared_prefix_attention(q, k, v, prefix_groups, *, causal, math, **opts):
    """Per segment: the prompt causally, each completion over [prompt; itself]. Plain causal attention (no window,
    sinks or soft-cap, not "math") runs every completion as one causal call over [prompt; completion] with the
    prompt's queries in front: no mask is built, the prompt's rows of the first call are the prompt's own output
    (a prompt query sees only the prompt), and the other calls' prompt rows (about P^2 / 2 extra scores against
    the completion's L (P + L / 2)) are dropped."""
    plain = not math and all(opts[name] is None for name in ("window", "sinks", "softcap"))
    pieces = []
    cut = Cuts((q, k, v), [x for p0, p1, cs in prefix_groups for x in (p0, p1, *(b for c in cs for b in c))])
    if plain:  # every completion's call, batched by length
        calls, owners = [], []
        for g, (p0, p1, completions) in enumerate(prefix_groups):
            pq, pk, pv = cut(p0, p1)
            for s, e in completions:
                if e > s:
                    cq, ck, cv = cut(s, e)
                    calls.append((torch.cat([pq, cq]), torch.cat([pk, ck]), torch.cat([pv, cv])))
                    owners.append((g, s))
        done = set()
        for (g, s), both in zip(owners, sdpa_by_length(calls, opts["scale"], causal=True), strict=True):
            p0, p1, _ = prefix_groups[g]
            if g not in done:  # the prompt's rows of its first completion's call are the prompt's own output
                done.add(g)
                if p1 > p0:
                    pieces.append((p0, both[: p1 - p0]))
            pieces.append((s, both[p1 - p0 :]))
        prefix_groups = [x for g, x in enumerate(prefix_groups) if g not in done]  # no completion: the prompt below
    for p0, p1, completions in prefix_groups:
        prompt_pos = torch.arange(p1 - p0, device=q.device)
        prompt_out = None
        pq, pk, pv = cut(p0, p1)
        for s, e in completions:
            if e == s or plain:
                continue
            cq, ck, cv = cut(s, e)
            kk, vv = torch.cat([pk, ck]), torch.cat([pv, cv])
            own_pos = torch.arange(p1 - p0, p1 - p0 + e - s, device=q.device)
            pieces.append((s, attend(cq, kk, vv, own_pos, torch.cat([prompt_pos, own_pos]), causal=True,
                                      math=math, **opts)))  # fmt: skip
        if prompt_out is None and p1 > p0:
            prompt_out = attend(pq, pk, pv, prompt_pos, prompt_pos, causal=True, math=math, **opts)
        if prompt_out is not None:
            pieces.append((p0, prompt_out))
    return assemble(pieces, q)

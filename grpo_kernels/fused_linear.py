"""Public API: the GRPO loss (and plain log-probs) from hidden states and the LM head, never building [T, V] logits.

Design. Tokens are processed in chunks of C rows. Per chunk: logits = h W^T (+ b) in a [C, V] buffer, the
selective log-prob row kernel (C++ on CPU, Triton on CUDA) reads it once (log-sum-exp, log-prob of the id,
entropy), the loss kernel turns the chunk's log-probs into the per-token gradient g_t = d loss / d logp_t,
the row kernel's backward overwrites the buffer with d logits, and the two gradient matmuls follow:
grad_h = dlogits W, grad_W += dlogits^T h (accumulated in fp32, cast once at the end), grad_b += sum dlogits.
So the three matmuls that cannot be avoided run once each and the [C, V] buffer is the only large temporary.

The gradients are computed in the forward (one pass) and the autograd backward only scales them by the
incoming gradient. That needs g_t while the chunk's logits exist: at token level g_t = a_s coef_t, where
coef_t depends on token t alone and a_s (the loss normalizer of sequence s) on the mask only, so a_s is known
before the first chunk. GSPO (importance_sampling_level="sequence"), the sequence-level sampler modes and vespo
weight every token by a whole-sequence statistic of the log-probs, so they take two passes instead: log-probs
first, then the loss and its g, then the logits are recomputed per chunk (four matmuls instead of three).
"""

from functools import partial

import torch

from . import reference
from ._checks import (
    check_chunk_tokens,
    check_flag,
    check_impl,
    check_impl_device,
    check_like,
    check_linear_head,
    check_loss_inputs,
    check_loss_layout,
    check_number,
    check_softcap,
)
from .loss import grpo_loss
from .ops import logprobs as _lp_ops
from .ops import loss as _loss_ops
from .options import OPTION_NAMES, LossOptions

__all__ = ["fused_linear_grpo_loss", "fused_linear_logprobs"]

# torch.addmm(..., out_dtype=torch.float32) (CUDA, torch >= 2.9): a bf16/fp16 product accumulated in an fp32 output.
_ADDMM_OUT_DTYPE = hasattr(torch.ops.aten.addmm, "dtype_out")
DEFAULT_CHUNK_BYTES = 256 * 2**20  # the logits chunk: large enough for efficient matmuls, far below the gradients


def _chunk_rows(chunk_tokens, v: int, itemsize: int, buffers: int = 1) -> int:
    """Rows per chunk: chunk_tokens, or "auto": `buffers` [C, V] buffers within DEFAULT_CHUNK_BYTES."""
    if chunk_tokens == "auto":
        return max(1, DEFAULT_CHUNK_BYTES // (buffers * v * itemsize))
    check_chunk_tokens(chunk_tokens)
    return chunk_tokens


class _Rows:
    """The row kernels (log-probs forward, in-place backward) of one backend ("triton" or "cpp")."""

    def __init__(self, backend: str, temperature: float, entropy: bool):
        self.backend, self.t, self.entropy = backend, float(temperature), entropy

    def logprobs(self, logits, ids):  # -> (logps, entropy, lse), fp32 [C]
        return _lp_ops.row_logprobs(self.backend, logits, ids, self.t, self.entropy)

    def dlogits_(self, g, logits, ids, lse, g_entropy=None, entropy=None):
        """Overwrite logits with d sum(g logps + g_entropy entropy) / d logits."""
        _lp_ops.row_dlogits_(self.backend, g, logits, ids, lse, self.t, g_entropy, entropy)


class _Chunks:
    """The chunk loop: logits of a chunk, and the gradients from a chunk's d logits.

    softcap c (Gemma 2's final_logit_softcapping): the logits are c tanh((h W^T + b) / c); their derivative
    1 - tanh^2 is kept in a second [C, V] buffer (the first is overwritten by the row backward), and the chunk's
    d logits are multiplied by it before the gradient matmuls."""

    def __init__(self, hidden, weight, bias, rows: int, needs, softcap=None):
        self.h, self.w, self.b, self.rows, self.cap = hidden, weight, bias, rows, softcap
        t, v = hidden.shape[0], weight.shape[0]
        self.buf = torch.empty(min(rows, max(t, 1)), v, dtype=hidden.dtype, device=hidden.device)
        self.dcap = torch.empty_like(self.buf) if softcap is not None and any(needs) else None
        self.grad_h = torch.empty_like(hidden) if needs[0] else None
        self.grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if needs[1] else None
        self.grad_b = torch.zeros(v, dtype=torch.float32, device=weight.device) if needs[2] else None

    def __iter__(self):
        for c0 in range(0, self.h.shape[0], self.rows):
            yield c0, min(c0 + self.rows, self.h.shape[0])

    def logits(self, c0, c1):
        out = self.buf[: c1 - c0]
        if self.b is None:
            torch.mm(self.h[c0:c1], self.w.t(), out=out)
        else:
            torch.addmm(self.b, self.h[c0:c1], self.w.t(), out=out)
        if self.cap is not None:
            out.div_(self.cap).tanh_()
            if self.dcap is not None:
                torch.addcmul(torch.ones((), dtype=out.dtype, device=out.device), out, out, value=-1.0,
                              out=self.dcap[: c1 - c0])  # fmt: skip
            out.mul_(self.cap)
        return out

    def backward(self, c0, c1, dlogits):
        if self.dcap is not None:
            dlogits.mul_(self.dcap[: c1 - c0])
        if self.grad_h is not None:
            torch.mm(dlogits, self.w, out=self.grad_h[c0:c1])
        if self.grad_w is not None:
            if dlogits.dtype == torch.float32:
                self.grad_w.addmm_(dlogits.t(), self.h[c0:c1])
            elif dlogits.is_cuda and _ADDMM_OUT_DTYPE:  # cuBLAS adds the product into the fp32 sum itself
                torch.addmm(self.grad_w, dlogits.t(), self.h[c0:c1], out_dtype=torch.float32, out=self.grad_w)
            else:  # one low-precision product per chunk, summed in fp32 (a [V, H] product, cast and add per chunk)
                self.grad_w += torch.mm(dlogits.t(), self.h[c0:c1]).float()
        if self.grad_b is not None:
            self.grad_b += dlogits.sum(0, dtype=torch.float32)

    def grads(self):
        cast = lambda x, like: None if x is None else x.to(like.dtype)  # noqa: E731
        return self.grad_h, cast(self.grad_w, self.w), None if self.b is None else cast(self.grad_b, self.b)


def _token_level_pass(chunks, rows, ids, flat, layout, finish, bonus):
    """One pass; returns per-sequence stats [B, NUM_STATS], the entropy sum and the entropy bonus's mean entropy.
    flat: the loss op's inputs; finish: the arguments of ops.loss.finish after the stats; bonus: None or
    (coef, w), the bonus -coef sum_t w_t H_t (w: [T] token weights summing to 1), whose gradient joins the row's."""
    b, cu_host, seq_of = layout
    old, ref, sampler, adv, adv_per_token, mask = flat
    stats = torch.zeros(b, _loss_ops.NUM_STATS, dtype=torch.float64, device=ids.device)
    counts = stats.clone()
    counts[:, 1] = _segment_sum(mask, layout, ids.device)
    counts.requires_grad_()
    with torch.enable_grad():
        a = torch.autograd.grad(_loss_ops.finish(counts, None, **finish)[0], counts)[0][:, 0].float().contiguous()
    entropy_sum = torch.zeros((), dtype=torch.float32, device=ids.device)
    bonus_h = torch.zeros((), dtype=torch.float32, device=ids.device)
    scalars = finish["options"].kernel_scalars()
    for (c0, c1), (frag_cu, cu_f, seq_f) in zip(chunks, _chunk_fragments(chunks, cu_host, ids.device), strict=True):
        logits = chunks.logits(c0, c1)
        lp, ent, lse = rows.logprobs(logits, ids[c0:c1])
        part = partial(_slice, c0=c0, c1=c1)
        adv_c = adv[c0:c1] if adv_per_token else adv[seq_f]
        stats_f, coef = _loss_ops.grpo_loss_fwd(
            rows.backend, lp, part(old), part(ref), part(sampler), adv_c, adv_per_token, part(mask), cu_f,
            max(e - s for s, e in zip(frag_cu, frag_cu[1:], strict=False)), scalars,
        )  # fmt: skip
        stats.index_add_(0, seq_f, stats_f)
        g_ent = None
        if bonus is not None:
            g_ent = bonus[1][c0:c1] * -bonus[0]
            bonus_h += ent.dot(bonus[1][c0:c1])
        rows.dlogits_(a[seq_of[c0:c1]] * coef, logits, ids[c0:c1], lse, g_ent, None if g_ent is None else ent)
        chunks.backward(c0, c1, logits)
        if rows.entropy:
            entropy_sum += ent.dot(mask[c0:c1]) if mask is not None else ent.sum()
    return stats, entropy_sum, bonus_h


def _slice(x, c0, c1):
    return None if x is None else x[c0:c1]


def _to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on the device without waiting for the GPU (a copy from pageable memory would: it synchronises
    the stream first, seen as one host sync per chunk on an H200)."""
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


def _chunk_fragments(chunks, cu_host, device):
    """[(local boundaries (list), the same on the device, each piece's sequence index on the device)] of every
    chunk (see _fragments), sent to the device in one copy."""
    frags = [_fragments(cu_host, c0, c1) for c0, c1 in chunks]
    flat = _to_device(torch.tensor([x for bounds, seqs in frags for x in (*bounds, *seqs)], dtype=torch.int64), device)
    out, i = [], 0
    for bounds, seqs in frags:
        j = i + len(bounds)
        out.append((bounds, flat[i:j], flat[j : j + len(seqs)]))
        i = j + len(seqs)
    return out


def _segment_sum(mask, layout, device):
    b, cu_host, seq_of = layout
    if mask is None:
        return _to_device(torch.tensor([e - s for s, e in zip(cu_host, cu_host[1:], strict=False)],
                                       dtype=torch.float32), device)  # fmt: skip
    return torch.zeros(b, dtype=torch.float32, device=device).index_add_(0, seq_of, mask)


def _fragments(cu_host, c0, c1):
    """The pieces of sequences inside tokens [c0, c1): local boundaries and each piece's sequence index."""
    import bisect

    s = bisect.bisect_right(cu_host, c0) - 1
    bounds, seqs = [0], []
    while s < len(cu_host) - 1 and cu_host[s] < c1:
        end = min(cu_host[s + 1], c1)
        if end > max(cu_host[s], c0):
            bounds.append(end - c0)
            seqs.append(s)
        s += 1
    return bounds, seqs


def fused_linear_logprobs(hidden, weight, ids, *, bias=None, temperature=1.0, return_entropy=False,
                          chunk_tokens="auto", impl="auto", softcap=None):  # fmt: skip
    """log softmax(z / temperature)[ids] per token, z = hidden W^T + bias (or softcap tanh(z / softcap)), and the
    entropy of that distribution when asked, without [T, V] logits.

    hidden `[B, L, H]` or `[T, H]`, weight `[V, H]`; returns float32 log-probs of the shape of ids (and the entropy,
    `(logps, entropy)`). Differentiable: when grad is enabled and hidden, weight or bias requires it, gradients of
    both outputs flow to them. The backward recomputes each chunk's logits (the forward keeps only the per-token
    log-sum-exp), so the [C, V] chunk (two with softcap) stays the only large temporary; one backward per forward.
    softcap: Gemma 2's `final_logit_softcapping` (> 0), applied before the temperature; None = plain logits.
    """
    check_impl(impl)
    check_linear_head(hidden, weight, bias, ids, temperature, impl)
    check_impl_device(impl, hidden.device, "hidden")
    check_flag("return_entropy", return_entropy)
    check_softcap(softcap)
    shape, h2, ids_flat = ids.shape, hidden.reshape(-1, hidden.shape[-1]), ids.reshape(-1).long()
    if impl == "reference":
        up = lambda x: x if x is None or x.dtype == torch.float64 else x.float()  # noqa: E731
        logits = _softcapped(torch.nn.functional.linear(up(h2), up(weight), up(bias)), softcap)
        out = reference.selective_logprobs(logits, ids_flat, temperature=temperature, return_entropy=True)
        out = tuple(x.float() if x.dtype != torch.float64 else x for x in out)
        return (out[0].reshape(shape), out[1].reshape(shape)) if return_entropy else out[0].reshape(shape)
    rows = _Rows("triton" if impl == "triton" or hidden.is_cuda else "cpp", temperature, return_entropy)
    per_chunk = _chunk_rows(chunk_tokens, weight.shape[0], hidden.itemsize, 1 if softcap is None else 2)
    tensors = (h2 if h2.is_contiguous() else h2.contiguous(), weight, bias)
    if torch.is_grad_enabled() and any(x is not None and x.requires_grad for x in tensors):
        logps, entropy = _FusedLinearLogprobs.apply(*tensors, ids_flat, rows, per_chunk, softcap)
    else:
        with torch.no_grad():
            logps, entropy, _ = _logprobs_pass(_Chunks(*tensors, per_chunk, (False,) * 3, softcap), rows, ids_flat)
    return (logps.reshape(shape), entropy.reshape(shape)) if return_entropy else logps.reshape(shape)


def _softcapped(logits, softcap):
    return logits if softcap is None else softcap * torch.tanh(logits / softcap)


def _logprobs_pass(chunks, rows, ids):
    """Per-token (logps, entropy or None, lse), fp32 [T], chunk by chunk."""
    logps = torch.empty(ids.shape[0], dtype=torch.float32, device=ids.device)
    lse = torch.empty_like(logps)
    entropy = torch.empty_like(logps) if rows.entropy else None
    for c0, c1 in chunks:
        lp, ent, ls = rows.logprobs(chunks.logits(c0, c1), ids[c0:c1])
        logps[c0:c1], lse[c0:c1] = lp, ls
        if rows.entropy:
            entropy[c0:c1] = ent
    return logps, entropy, lse


class _FusedLinearLogprobs(torch.autograd.Function):
    """(logps, entropy) of the fused head; the backward recomputes each chunk's logits and runs the row backward
    on them with both incoming gradients, then the two gradient matmuls."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, ids, rows, per_chunk, softcap):
        logps, entropy, lse = _logprobs_pass(_Chunks(hidden, weight, bias, per_chunk, (False,) * 3, softcap), rows,
                                             ids)  # fmt: skip
        ctx.save_for_backward(hidden, weight, bias, ids, lse, entropy)
        ctx.rows, ctx.per_chunk, ctx.softcap = rows, per_chunk, softcap
        ctx.set_materialize_grads(False)
        if entropy is None:
            entropy = logps.new_empty(0)
            ctx.mark_non_differentiable(entropy)
        return logps, entropy

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, g_logps, g_entropy):
        hidden, weight, bias, ids, lse, entropy = ctx.saved_tensors
        chunks = _Chunks(hidden, weight, bias, ctx.per_chunk, ctx.needs_input_grad[:3], ctx.softcap)
        if g_logps is None:
            g_logps = torch.zeros_like(lse)
        g_logps = g_logps.float().contiguous()
        if g_entropy is not None and entropy is not None:
            g_entropy = g_entropy.float().contiguous()
        else:
            g_entropy = entropy = None
        for c0, c1 in chunks:
            logits = chunks.logits(c0, c1)
            ctx.rows.dlogits_(g_logps[c0:c1], logits, ids[c0:c1], lse[c0:c1],
                              None if g_entropy is None else g_entropy[c0:c1],
                              None if entropy is None else entropy[c0:c1])  # fmt: skip
            chunks.backward(c0, c1, logits)
        return *chunks.grads(), None, None, None, None


class _FusedLinearGRPO(torch.autograd.Function):
    """forward computes the loss, the metrics and the gradients; backward scales the gradients."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, run, names):
        loss, metrics, grads = run(hidden, weight, bias, ctx.needs_input_grad[:3])
        ctx.save_for_backward(*[torch.empty(0) if g is None else g for g in grads])
        ctx.has = [g is not None for g in grads]
        values = [metrics[k] for k in names]
        ctx.mark_non_differentiable(*values)
        return loss, *values

    @staticmethod
    def backward(ctx, grad_loss, *_):
        if getattr(ctx, "done", False):
            raise RuntimeError("fused_linear_grpo_loss: one backward per forward (its gradients are computed in the "
                               "forward and scaled in place by the backward)")  # fmt: skip
        ctx.done = True
        saved = zip(ctx.saved_tensors, ctx.has, strict=True)
        return *[g.mul_(grad_loss.to(g.dtype)) if has else None for g, has in saved], None, None


def fused_linear_grpo_loss(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    ids: torch.Tensor,
    advantages: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    old_logps: torch.Tensor | None = None,
    temperature: float = 1.0,
    chunk_tokens: int | str = "auto",
    return_entropy: bool = False,
    entropy_coef: float = 0.0,
    entropy_mask: torch.Tensor | None = None,
    softcap: float | None = None,
    impl: str = "auto",
    **options,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The GRPO loss of `grpo_loss` from hidden states and the LM head: logits never exist beyond one chunk.

    Args:
        hidden: `[B, L, H]` (padded, with `mask`) or packed `[T, H]` (with `cu_seqlens`), float32/bf16/fp16.
        weight: the LM head `[V, H]` (may be tied to the embeddings); bias: `[V]` or None.
        ids: the sampled token ids, `[B, L]` or `[T]`. advantages: `[B]` or per token.
        old_logps: as in grpo_loss (None = on-policy).
        temperature: the sampling temperature (logits / temperature).
        chunk_tokens: tokens per chunk, or "auto" (a logits chunk of at most 256 MiB).
        return_entropy: also report the masked mean entropy as metrics["entropy"].
        entropy_coef: an entropy bonus: loss - entropy_coef * (mean entropy over entropy_mask), its gradient flowing
            through the same chunks (TRL's entropy_coef, before TRL's normalizers). 0 = none.
        entropy_mask: the tokens the bonus averages over, like ids (default: `mask`, else every token).
        softcap: Gemma 2's final_logit_softcapping c: logits c tanh(z / c) before the temperature; None = off.
        impl: "auto" (C++ row kernels on CPU, Triton on CUDA; matmuls by torch), "cpp", "triton", or
            "reference" (the naive eager path: full logits, log-softmax, the reference loss).
        options: every keyword argument of grpo_loss (ref_logps, mask, cu_seqlens, loss_type, epsilon_low,
            epsilon_high, delta, beta, importance_sampling_level, num_items_in_batch, sampler_logps, ...).

    Returns:
        (loss, metrics) as grpo_loss. Gradients flow to hidden, weight and bias; the weight's gradient is
        summed over chunks in fp32 and cast once to the weight's dtype.
    """
    check_impl(impl)
    check_linear_head(hidden, weight, bias, ids, temperature, impl)
    check_impl_device(impl, hidden.device, "hidden")
    check_flag("return_entropy", return_entropy)
    check_softcap(softcap)
    check_number("entropy_coef", entropy_coef)
    unknown = set(options) - _CALL_DEFAULTS.keys() - set(OPTION_NAMES)
    if unknown:
        raise TypeError(f"fused_linear_grpo_loss got unknown option(s) {sorted(unknown)}")
    bonus_mask = _bonus_mask(entropy_mask, options.get("mask"), ids, hidden.device) if entropy_coef else None
    if impl == "reference":
        up = lambda x: x if x is None or x.dtype == torch.float64 else x.float()  # noqa: E731
        logits = _softcapped(torch.nn.functional.linear(up(hidden), up(weight), up(bias)), softcap)
        logps, entropy = reference.selective_logprobs(logits, ids, temperature=temperature, return_entropy=True)
        loss, metrics = reference.grpo_loss(logps, old_logps, advantages, **options)
        if return_entropy:
            m = options.get("mask")
            m = torch.ones_like(entropy) if m is None else m.to(entropy.dtype)
            metrics["entropy"] = ((entropy * m).sum() / m.sum().clamp(min=1.0)).detach()
        if bonus_mask is not None:
            m = bonus_mask.to(entropy.dtype).reshape(entropy.shape)
            loss = loss - entropy_coef * (entropy * m).sum() / m.sum().clamp(min=1.0)
        return loss, metrics
    loss_options = LossOptions(**{k: v for k, v in options.items() if k in OPTION_NAMES})
    call = {**_CALL_DEFAULTS, **{k: v for k, v in options.items() if k in _CALL_DEFAULTS}}
    check_loss_inputs(loss_options, num_items_in_batch=call["num_items_in_batch"], ref_logps=call["ref_logps"],
                      sampler_logps=call["sampler_logps"])  # fmt: skip
    shape_ref = torch.empty((), dtype=torch.float32, device=hidden.device).expand(ids.shape)
    b, cu, max_len, adv_per_token = check_loss_layout(shape_ref, advantages, call["mask"], call["cu_seqlens"],
                                                      call["max_seqlen"])  # fmt: skip
    for name in ("old_logps", "ref_logps", "sampler_logps"):
        x = old_logps if name == "old_logps" else call[name]
        if x is not None:
            check_like(name, x, shape_ref)
    backend = "triton" if impl == "triton" or hidden.is_cuda else "cpp"
    rows_per_chunk = _chunk_rows(chunk_tokens, weight.shape[0], hidden.itemsize, 1 if softcap is None else 2)
    bonus = None
    if bonus_mask is not None:
        w = bonus_mask.reshape(-1).float()
        bonus = (float(entropy_coef), w / w.sum().clamp(min=1.0))
    run = partial(_run, ids=ids.reshape(-1).long(), ids_shape=ids.shape, advantages=advantages,
                  old_logps=old_logps, options=loss_options, call=call, layout=(b, cu, max_len, adv_per_token),
                  rows=_Rows(backend, temperature, return_entropy or bonus is not None), rows_per_chunk=rows_per_chunk,
                  softcap=softcap, bonus=bonus, report_entropy=return_entropy)  # fmt: skip
    h2 = hidden.reshape(-1, hidden.shape[-1])
    names = loss_options.metric_names(sampler=call["sampler_logps"] is not None, entropy=return_entropy)
    out = _FusedLinearGRPO.apply(h2 if h2.is_contiguous() else h2.contiguous(), weight, bias, run, names)
    return out[0], dict(zip(names, out[1:], strict=True))


def _bonus_mask(entropy_mask, mask, ids, device):
    """The entropy bonus's token mask: entropy_mask, else the loss mask, else every token."""
    m = entropy_mask if entropy_mask is not None else mask
    if m is None:
        return torch.ones(ids.shape, dtype=torch.float32, device=device)
    if not isinstance(m, torch.Tensor) or m.shape != ids.shape or m.device != device:
        raise ValueError(f"entropy_mask (default: mask) must be a tensor shaped like ids {tuple(ids.shape)} "
                         f"on {device}")
    return m


def _run(hidden, weight, bias, needs, *, ids, ids_shape, advantages, old_logps, options, call, layout, rows,
         rows_per_chunk, softcap, bonus, report_entropy):  # fmt: skip
    b, cu, max_len, adv_per_token = layout
    cu_host = cu.tolist()
    lengths = torch.tensor([e - s for s, e in zip(cu_host, cu_host[1:], strict=False)])
    seq_of = _to_device(torch.repeat_interleave(torch.arange(b), lengths), ids.device)
    mask = _loss_ops.flat_input(call["mask"])
    chunks = _Chunks(hidden, weight, bias, rows_per_chunk, needs, softcap)
    if options.whole_sequence:  # GSPO, a sequence-level sampler mode or vespo: every g_t needs its whole sequence
        metrics = _two_pass(chunks, rows, ids, ids_shape, advantages, old_logps, options, call, mask, bonus)
        loss = metrics.pop("loss")
        bonus_h = metrics.pop("bonus_h")
    else:
        flat = _loss_ops.flat_input
        inputs = (flat(old_logps), flat(call["ref_logps"] if options.beta != 0.0 else None),
                  flat(call["sampler_logps"]), flat(advantages), adv_per_token, mask)  # fmt: skip
        finish = dict(options=options, sampler=call["sampler_logps"] is not None, cu_seqlens=cu,
                      num_items_in_batch=call["num_items_in_batch"])  # fmt: skip
        stats, entropy_sum, bonus_h = _token_level_pass(chunks, rows, ids, inputs, (b, cu_host, seq_of), finish,
                                                        bonus)  # fmt: skip
        loss, metrics = _loss_ops.finish(stats, None if adv_per_token else advantages, **finish)
        if report_entropy:
            tokens = stats[:, 1].sum().clamp(min=1.0).float()
            metrics["entropy"] = entropy_sum / tokens
    if bonus is not None:
        loss = loss - bonus[0] * bonus_h
    if not report_entropy:
        metrics.pop("entropy", None)
    return loss, metrics, chunks.grads()


def _two_pass(chunks, rows, ids, ids_shape, advantages, old_logps, options, call, mask, bonus):
    """GSPO / sequence-level sampler weights / vespo: all log-probs first, then g, then the logits again."""
    logps, entropy, lse = _logprobs_pass(chunks, rows, ids)
    view = logps.view(ids_shape)
    with torch.enable_grad():
        leaf = view.detach().requires_grad_()
        loss, metrics = grpo_loss(leaf, old_logps, advantages, impl=rows.backend, **call, **options.kwargs())
        (g,) = torch.autograd.grad(loss, leaf)
    g = g.reshape(-1).float().contiguous()
    g_ent = None if bonus is None else bonus[1] * -bonus[0]
    for c0, c1 in chunks:
        logits = chunks.logits(c0, c1)
        rows.dlogits_(g[c0:c1], logits, ids[c0:c1], lse[c0:c1], None if g_ent is None else g_ent[c0:c1],
                      None if g_ent is None else entropy[c0:c1])  # fmt: skip
        chunks.backward(c0, c1, logits)
    if rows.entropy:
        m = torch.ones_like(entropy) if mask is None else mask
        metrics["entropy"] = (entropy * m).sum() / m.sum().clamp(min=1.0)
    bonus_h = torch.zeros((), device=ids.device) if bonus is None else entropy.dot(bonus[1])
    return {"loss": loss.detach(), "bonus_h": bonus_h, **{k: v.detach() for k, v in metrics.items()}}


# fused_linear_grpo_loss's per-call arguments of grpo_loss (beside the LossOptions).
_CALL_DEFAULTS = dict(ref_logps=None, mask=None, cu_seqlens=None, max_seqlen=None, num_items_in_batch=None,
                      sampler_logps=None)  # fmt: skip

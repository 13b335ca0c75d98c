"""Varlen (packed) causal attention, and its registration as an HF transformers attention function.

`varlen_attention(q, k, v, cu_seqlens, max_seqlen)` takes packed `[T, heads, head_dim]` tensors (flash-attn's
layout) whose sequences are delimited by `cu_seqlens`, and dispatches to the first available of:
    1. flash-attn's `flash_attn_varlen_func` (CUDA, if installed),
    2. `torch.nn.attention.varlen.varlen_attn` (CUDA, torch >= 2.10; its causal flag became
       `window_size=(-1, 0)` in 2.12: both signatures are handled),
    3. SDPA once per sequence (any device; the CPU path).
The choice depends only on the device and what is installed, never on a failure, and `backend=` forces one.

`register_hf_attention()` registers it with transformers' `AttentionInterface` (and a mask function that
builds no mask) under the name "grpo_varlen", so any HF decoder built on the attention interface (Llama,
Qwen2, Qwen3, Mistral, ...) runs packed with no per-model code:

    model = AutoModelForCausalLM.from_config(config, attn_implementation="grpo_varlen")
    model(**packed.model_kwargs())   # input_ids [1, T], position_ids reset per sequence, cu_seq_lens_*, no cache
"""

import inspect

import torch

__all__ = ["HF_ATTENTION_NAME", "register_hf_attention", "varlen_attention"]

HF_ATTENTION_NAME = "grpo_varlen"


def _flash_attn():
    try:
        from flash_attn import flash_attn_varlen_func
    except ImportError:
        return None
    return flash_attn_varlen_func


def _torch_varlen():
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return varlen_attn


def _pick_backend(device: torch.device) -> str:
    if device.type == "cuda":
        if _flash_attn() is not None:
            return "flash_attn"
        if _torch_varlen() is not None:
            return "torch_varlen"
    return "sdpa"


def varlen_attention(q, k, v, cu_seqlens, max_seqlen, *, causal=True, scale=None, prefix_groups=None, backend="auto"):
    """Attention within each packed sequence.

    Args:
        q: `[T, num_heads, head_dim]`; k, v: `[T, num_kv_heads, head_dim]` (num_heads a multiple of num_kv_heads:
            grouped-query attention).
        cu_seqlens: int32/int64 `[num_seqs + 1]`, rising from 0 to T. max_seqlen: the longest sequence.
        causal: each token attends to itself and earlier tokens of its own sequence only (else: its whole sequence).
        scale: softmax scale (default head_dim ** -0.5).
        prefix_groups: shared-prompt segments (grpo_kernels.packing, shared_prefix=True): per segment
            (prompt start, prompt end, ((completion start, end), ...)). The prompt attends causally to itself;
            each completion to the whole prompt and causally to itself, not to the other completions. Runs as
            two-part SDPA (prompt self-attention, then each completion over [prompt keys, own keys]).
        backend: "auto", "flash_attn", "torch_varlen" or "sdpa".

    Returns:
        `[T, num_heads, head_dim]`.
    """
    if q.dim() != 3 or k.dim() != 3 or v.shape != k.shape or q.shape[0] != k.shape[0] or q.shape[2] != k.shape[2]:
        raise ValueError(f"q [T, H, D], k and v [T, H_kv, D] expected, got {tuple(q.shape)}, {tuple(k.shape)}, "
                         f"{tuple(v.shape)}")  # fmt: skip
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"num_heads {q.shape[1]} must be a multiple of num_kv_heads {k.shape[1]}")
    if prefix_groups is not None:
        if not causal:
            raise ValueError("prefix_groups go with causal attention")
        return _shared_prefix_attention(q, k, v, prefix_groups, scale)
    if backend == "auto":
        backend = _pick_backend(q.device)
    if backend == "flash_attn":
        cu = cu_seqlens.to(torch.int32)
        return _flash_attn()(q, k, v, cu, cu, max_seqlen, max_seqlen, softmax_scale=scale, causal=causal)
    if backend == "torch_varlen":
        fn = _torch_varlen()
        cu = cu_seqlens.to(torch.int32)
        params = inspect.signature(fn).parameters
        extra = {"is_causal": causal} if "is_causal" in params else {"window_size": (-1, 0) if causal else (-1, -1)}
        if q.shape[1] != k.shape[1]:
            extra["enable_gqa"] = True
        return fn(q, k, v, cu, cu, max_seqlen, max_seqlen, scale=scale, **extra)
    if backend != "sdpa":
        raise ValueError(f"backend must be 'auto', 'flash_attn', 'torch_varlen' or 'sdpa', got {backend!r}")
    out = torch.empty_like(q)
    bounds = cu_seqlens.tolist()
    for s, e in zip(bounds[:-1], bounds[1:], strict=True):
        if e > s:
            out[s:e] = _sdpa(q[s:e], k[s:e], v[s:e], scale, causal=causal)
    return out


def _sdpa(q, k, v, scale, *, causal=False, mask=None):
    """SDPA on [L, H, D] tensors (grouped-query heads allowed)."""
    t = lambda x: x.transpose(0, 1)[None]  # noqa: E731
    out = torch.nn.functional.scaled_dot_product_attention(
        t(q), t(k), t(v), attn_mask=mask, is_causal=causal, scale=scale, enable_gqa=q.shape[1] != k.shape[1]
    )
    return out[0].transpose(0, 1)


def _shared_prefix_attention(q, k, v, prefix_groups, scale):
    out = torch.empty_like(q)
    for p0, p1, completions in prefix_groups:
        out[p0:p1] = _sdpa(q[p0:p1], k[p0:p1], v[p0:p1], scale, causal=True)
        for s, e in completions:
            if e == s:
                continue
            n, lp = e - s, p1 - p0
            mask = torch.ones(n, lp + n, dtype=torch.bool, device=q.device)
            mask[:, lp:] = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
            kk, vv = torch.cat([k[p0:p1], k[s:e]]), torch.cat([v[p0:p1], v[s:e]])
            out[s:e] = _sdpa(q[s:e], kk, vv, scale, mask=mask)
    return out


def _cu_from_position_ids(position_ids: torch.Tensor) -> torch.Tensor:
    flat = position_ids.reshape(-1)
    starts = torch.nonzero(flat == 0).reshape(-1)
    if starts.numel() == 0 or int(starts[0]) != 0:
        raise ValueError("position_ids of a packed batch must restart at 0 at every sequence start")
    return torch.cat([starts, starts.new_tensor([flat.numel()])])


def _hf_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None, **kwargs):
    """transformers' attention-function contract: q [B, H, L, D], k/v [B, H_kv, L, D] -> ([B, L, H, D], None)."""
    if attention_mask is not None:
        raise ValueError(
            f"attn_implementation={HF_ATTENTION_NAME!r} runs packed batches (input_ids [1, T] with position_ids reset "
            "per sequence, or cu_seq_lens_q), not padding masks: use 'sdpa' for padded batches"
        )
    if dropout:
        raise ValueError(f"attn_implementation={HF_ATTENTION_NAME!r} has no attention dropout")
    b, _, length, _ = query.shape
    cu = kwargs.get("cu_seq_lens_q")
    max_len = kwargs.get("max_length_q")
    if cu is None:
        if kwargs.get("position_ids") is not None and b == 1:
            cu = _cu_from_position_ids(kwargs["position_ids"])
        else:  # one causal sequence per row
            cu = torch.arange(b + 1, device=query.device) * length
    if b != 1 and kwargs.get("cu_seq_lens_q") is not None:
        raise ValueError("packed attention takes a batch of one row ([1, T]) with cu_seq_lens_q")
    if max_len is None:
        max_len = int((cu[1:] - cu[:-1]).max())
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    flat = lambda x: x.transpose(1, 2).reshape(b * length, x.shape[1], x.shape[3])  # noqa: E731
    out = varlen_attention(flat(query), flat(key), flat(value), cu, max_len, causal=causal, scale=scaling,
                           prefix_groups=kwargs.get("prefix_groups"))  # fmt: skip
    return out.reshape(b, length, query.shape[1], query.shape[3]), None


def register_hf_attention() -> str:
    """Register "grpo_varlen" with transformers' AttentionInterface and AttentionMaskInterface; returns the name."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(HF_ATTENTION_NAME, _hf_attention)
    AttentionMaskInterface.register(HF_ATTENTION_NAME, _no_mask)
    return HF_ATTENTION_NAME


def _no_mask(*args, attention_mask=None, **kwargs):
    """No mask is built (sequences are delimited by cu_seqlens); a padding mask is passed on, to be refused."""
    if attention_mask is not None and not bool(attention_mask.all()):
        return attention_mask
    return None

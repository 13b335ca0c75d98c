"""Varlen (packed) causal attention, and its registration as an HF transformers attention function.

`varlen_attention(q, k, v, cu_seqlens, max_seqlen)` takes packed `[T, heads, head_dim]` tensors (flash-attn's
layout) whose sequences are delimited by `cu_seqlens`, and dispatches to the first available of:
    1. flash-attn's `flash_attn_varlen_func` (CUDA, if installed),
    2. `torch.nn.attention.varlen.varlen_attn` (CUDA, torch >= 2.10; its causal flag became
       `window_size=(-1, 0)` in 2.12: both signatures are handled),
    3. SDPA once per sequence (any device; the CPU path).
The choice depends only on the device, the dtype (1 and 2 take fp16/bf16 only) and what is installed, never on a
failure, and `backend=` forces one.

`import grpo_kernels` registers it with transformers' `AttentionInterface` (and a mask function that builds no
mask) under the name "grpo_varlen" (`register_hf_attention()` does it explicitly), so any HF decoder built on the
attention interface (Llama, Qwen2, Qwen3, Mistral, ...) runs packed with no per-model code:

    model = AutoModelForCausalLM.from_config(config, attn_implementation="grpo_varlen")
    model(**packed.model_kwargs())   # input_ids [1, T], position_ids reset per sequence, cu_seq_lens_*, no cache
"""

import importlib.abc
import inspect
import sys

import torch

from .attention_sdpa import Cuts, assemble, attend, sdpa_by_length, sdpa_window, shared_prefix_attention

__all__ = ["HF_ATTENTION_NAME", "check_packed_attention", "check_packed_config", "register_hf_attention",
           "varlen_attention"]

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


# What each backend can honour besides plain (causal or full) attention; "auto" takes the first in this order
# that honours every feature a call asks for, and an explicit backend that cannot honour one raises.
_FEATURES = {
    "flash_attn": {"window", "softcap"},
    "torch_varlen": {"window"},  # window_size exists from torch 2.12 (see _torch_varlen_window)
    "sdpa": {"window"},
    "math": {"window", "sinks", "softcap"},
}


def _torch_varlen_window() -> bool:
    fn = _torch_varlen()
    return fn is not None and "window_size" in inspect.signature(fn).parameters


_FLASH_DTYPES = (torch.float16, torch.bfloat16)  # flash-attn and torch's varlen_attn (a flash kernel) take only these


def _pick_backend(device: torch.device, features: set, dtype: torch.dtype) -> str:
    order = ["flash_attn", "torch_varlen"] if device.type == "cuda" and dtype in _FLASH_DTYPES else []
    for name in [*order, "sdpa", "math"]:
        if name == "flash_attn" and _flash_attn() is None or name == "torch_varlen" and _torch_varlen() is None:
            continue
        if features <= _supported(name):
            return name
    raise AssertionError("unreachable: the math backend honours every feature")


def _supported(backend: str) -> set:
    if backend == "torch_varlen" and not _torch_varlen_window():
        return set()
    return _FEATURES[backend]


def varlen_attention(q, k, v, cu_seqlens, max_seqlen, *, causal=True, scale=None, window=None, sinks=None,
                     softcap=None, prefix_groups=None, backend="auto"):  # fmt: skip
    """Attention within each packed sequence.

    Args:
        q: `[T, num_heads, head_dim]`; k, v: `[T, num_kv_heads, head_dim]` (num_heads a multiple of num_kv_heads:
            grouped-query attention).
        cu_seqlens: int32/int64 `[num_seqs + 1]`, rising from 0 to T. max_seqlen: the longest sequence.
        causal: each token attends to itself and earlier tokens of its own sequence only (else: its whole sequence).
        scale: softmax scale (default head_dim ** -0.5).
        window: sliding-window attention, transformers' `sliding_window`: causal, a token attends to the `window`
            most recent positions of its sequence, itself included (`0 <= i - j < window`); not causal,
            to positions within distance `window` (`|i - j| <= window`). None: unlimited.
        sinks: `[num_heads]` attention-sink logits (GPT-OSS `s_aux`): one extra logit per head in every softmax
            denominator, attached to no value: `p_ij = exp(s_ij) / (exp(sink_h) + sum_j exp(s_ij))`.
        softcap: attention-logit soft-capping (Gemma 2 `attn_logit_softcapping`): `s -> softcap * tanh(s / softcap)`
            after scaling, before the mask.
        prefix_groups: shared-prompt segments (grpo_kernels.packing, shared_prefix=True): per segment
            (prompt start, prompt end, ((completion start, end), ...)). The prompt attends causally to itself;
            each completion to the whole prompt and causally to itself, not to the other completions; positions
            (for `window`) count a completion as following its prompt. Runs per segment on "sdpa" or "math".
        backend: "auto", "flash_attn", "torch_varlen", "sdpa" (SDPA once per sequence) or "math" (explicit
            scores per sequence, fp32: the only one honouring `sinks`). "auto" takes flash_attn, torch_varlen
            (CUDA, when installed), sdpa, math: the first that honours every feature asked for. An explicit backend
            that cannot honour one raises ValueError naming it: nothing is dropped silently.

    Returns:
        `[T, num_heads, head_dim]`.
    """
    if q.dim() != 3 or k.dim() != 3 or v.shape != k.shape or q.shape[0] != k.shape[0] or q.shape[2] != k.shape[2]:
        raise ValueError(f"q [T, H, D], k and v [T, H_kv, D] expected, got {tuple(q.shape)}, {tuple(k.shape)}, "
                         f"{tuple(v.shape)}")  # fmt: skip
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"num_heads {q.shape[1]} must be a multiple of num_kv_heads {k.shape[1]}")
    if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
        raise ValueError(f"window must be a positive int or None, got {window!r}")
    if softcap is not None and not softcap > 0:
        raise ValueError(f"softcap must be > 0 or None, got {softcap!r}")
    if sinks is not None and (sinks.shape != (q.shape[1],) or not sinks.is_floating_point()):
        raise ValueError(f"sinks must be a float [num_heads={q.shape[1]}] tensor, got {sinks.dtype} "
                         f"{tuple(sinks.shape)}")  # fmt: skip
    features = {name for name, x in (("window", window), ("sinks", sinks), ("softcap", softcap)) if x is not None}
    if backend != "auto" and backend not in _FEATURES:
        raise ValueError(f"backend must be 'auto', {', '.join(map(repr, _FEATURES))}, got {backend!r}")
    if prefix_groups is not None:
        if not causal:
            raise ValueError("prefix_groups go with causal attention")
        if backend not in ("auto", "sdpa", "math"):
            raise ValueError(f"prefix_groups run on the 'sdpa' or 'math' backend, not {backend!r}")
    elif backend == "auto":
        backend = _pick_backend(q.device, features, q.dtype)
    if backend in ("flash_attn", "torch_varlen") and q.dtype not in _FLASH_DTYPES:
        raise ValueError(f"backend {backend!r} takes float16 or bfloat16, got {q.dtype}: use backend='sdpa'")
    if backend != "auto" and not features <= _supported(backend):
        missing = ", ".join(sorted(features - _supported(backend)))
        raise ValueError(f"backend {backend!r} cannot honour {missing} (installed versions): use backend='math'")
    opts = dict(causal=causal, scale=scale, window=window, sinks=sinks, softcap=softcap)
    if prefix_groups is not None:
        return shared_prefix_attention(q, k, v, prefix_groups, math=backend == "math", **opts)
    if backend == "flash_attn":
        cu = cu_seqlens.to(torch.int32)
        extra = {"window_size": sdpa_window(window, causal)} if window is not None else {}
        if softcap is not None:
            extra["softcap"] = softcap
        return _flash_attn()(q, k, v, cu, cu, max_seqlen, max_seqlen, softmax_scale=scale, causal=causal, **extra)
    if backend == "torch_varlen":
        fn = _torch_varlen()
        cu = cu_seqlens.to(torch.int32)
        extra = {"is_causal": causal} if not _torch_varlen_window() else {"window_size": sdpa_window(window, causal)}
        if q.shape[1] != k.shape[1]:
            if "enable_gqa" in inspect.signature(fn).parameters:
                extra["enable_gqa"] = True
            else:  # torch 2.10/2.11 take equal head counts only: each K/V head repeated for its query heads
                k, v = (x.repeat_interleave(q.shape[1] // k.shape[1], dim=1) for x in (k, v))
        return fn(q, k, v, cu, cu, max_seqlen, max_seqlen, scale=scale, **extra)
    pieces = []
    bounds = cu_seqlens.tolist()
    cut = Cuts((q, k, v), bounds)
    spans = [(s, e) for s, e in zip(bounds[:-1], bounds[1:], strict=True) if e > s]
    if backend == "sdpa" and not features:  # plain attention: SDPA once per sequence length, not per sequence
        outs = sdpa_by_length([cut(s, e) for s, e in spans], scale, causal=causal)
        return assemble([(s, out) for (s, _), out in zip(spans, outs, strict=True)], q)
    for s, e in spans:
        pos = torch.arange(e - s, device=q.device)
        pieces.append((s, attend(*cut(s, e), pos, pos, math=backend == "math", **opts)))
    return assemble(pieces, q)


def _cu_from_position_ids(position_ids: torch.Tensor) -> torch.Tensor:
    flat = position_ids.reshape(-1)
    starts = torch.nonzero(flat == 0).reshape(-1)
    if starts.numel() == 0 or int(starts[0]) != 0:
        raise ValueError("position_ids of a packed batch must restart at 0 at every sequence start")
    return torch.cat([starts, starts.new_tensor([flat.numel()])])


# Keyword arguments transformers passes to attention functions that do not change the attention (the packing ones
# are read below); any other one with a value is refused rather than dropped.
_HF_PASSIVE_KWARGS = {"use_cache", "output_attentions", "output_hidden_states", "output_router_logits",
                      "num_items_in_batch", "seq_idx", "position_ids", "cu_seq_lens_k", "max_length_k"}  # fmt: skip
_HF_READ_KWARGS = {"cu_seq_lens_q", "max_length_q", "sliding_window", "s_aux", "softcap", "prefix_groups",
                   "sequence_parallel"}  # fmt: skip
# Config fields whose attention pattern reaches the attention function only through a mask, which packed attention
# does not build: refused (Llama 4's chunked attention).
_HF_MASK_ONLY_FIELDS = ("attention_chunk_size",)


def _check_hf_call(module, kwargs):
    config = getattr(module, "config", None)
    for name in _HF_MASK_ONLY_FIELDS:
        if getattr(config, name, None) is not None:
            raise NotImplementedError(
                f"the model config sets {name}={getattr(config, name)!r}: attn_implementation={HF_ATTENTION_NAME!r} "
                "cannot honour it (it lives in the attention mask, which packed attention does not build)"
            )
    if "sliding_window" not in kwargs and getattr(config, "sliding_window", None):
        raise NotImplementedError(
            f"{type(module).__name__} applies the config's sliding_window={config.sliding_window} only through its "
            f"attention mask, which attn_implementation={HF_ATTENTION_NAME!r} does not build: it cannot honour it"
        )
    unknown = sorted(k for k, v in kwargs.items() if v is not None and k not in _HF_PASSIVE_KWARGS | _HF_READ_KWARGS)
    if unknown:
        raise NotImplementedError(
            f"{type(module).__name__} passes {', '.join(unknown)} to its attention function: "
            f"attn_implementation={HF_ATTENTION_NAME!r} does not know what it changes, so it refuses to drop it"
        )
    cu_q, cu_k = kwargs.get("cu_seq_lens_q"), kwargs.get("cu_seq_lens_k")
    if cu_k is not None and (cu_q is None or not torch.equal(cu_q.to(cu_k.device), cu_k)):
        raise ValueError("packed attention needs cu_seq_lens_k equal to cu_seq_lens_q (self-attention)")


def _hf_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None, **kwargs):
    """transformers' attention-function contract: q [B, H, L, D], k/v [B, H_kv, L, D] -> ([B, L, H, D], None).

    With the keyword `sequence_parallel` (a grpo_kernels.sequence_parallel.SequenceShard) q/k/v are this rank's
    shard of a packed row, and the attention runs over the whole row through two all-to-alls. Honours the per-layer
    `sliding_window`, `s_aux` (attention sinks) and `softcap` that models pass; refuses anything else that would
    change the attention (see _check_hf_call)."""
    if attention_mask is not None:
        raise ValueError(
            f"attn_implementation={HF_ATTENTION_NAME!r} runs packed batches (input_ids [1, T] with position_ids reset "
            "per sequence, or cu_seq_lens_q), not padding masks: use 'sdpa' for padded batches"
        )
    if dropout:
        raise ValueError(f"attn_implementation={HF_ATTENTION_NAME!r} has no attention dropout")
    _check_hf_call(module, kwargs)
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    options = dict(causal=causal, scale=scaling, window=kwargs.get("sliding_window"), softcap=kwargs.get("softcap"))
    shard = kwargs.get("sequence_parallel")
    if shard is not None:  # a sequence-parallel shard of a packed row (grpo_kernels.sequence_parallel)
        from .sequence_parallel import ulysses_attention

        return ulysses_attention(varlen_attention, query, key, value, shard, sinks=kwargs.get("s_aux"), **options), None
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
    flat = lambda x: x.transpose(1, 2).reshape(b * length, x.shape[1], x.shape[3])  # noqa: E731
    out = varlen_attention(flat(query), flat(key), flat(value), cu, max_len, sinks=kwargs.get("s_aux"),
                           prefix_groups=kwargs.get("prefix_groups"), **options)  # fmt: skip
    return out.reshape(b, length, query.shape[1], query.shape[3]), None


def check_packed_attention(model) -> None:
    """Raise NotImplementedError now, not at the first training step, if `model` (an HF causal LM built with
    attn_implementation "grpo_varlen") has attention that packed attention cannot honour: runs its decoder body on
    two packed one-token sequences, without gradients."""
    ids = torch.zeros(1, 2, dtype=torch.long, device=model.device)
    with torch.no_grad():
        model.base_model(input_ids=ids, position_ids=torch.zeros_like(ids), use_cache=False)


def check_packed_config(config) -> None:
    """Raise NotImplementedError (one line naming the architecture and the attention feature) before a model is
    built with attn_implementation "grpo_varlen" from a transformers config whose attention it cannot run: a model
    class that picks its attention from its own table rather than transformers' attention interface (GPT-Neo, whose
    build otherwise fails with KeyError: 'grpo_varlen'), or an attention pattern that lives only in the mask
    (Llama 4's chunked attention)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    for name in _HF_MASK_ONLY_FIELDS:
        if getattr(config, name, None) is not None:
            raise NotImplementedError(
                f"the model config ({config.model_type}) sets {name}={getattr(config, name)!r}: "
                f"attn_implementation={HF_ATTENTION_NAME!r} cannot honour it (it lives in the attention mask, which "
                "packed attention does not build)"
            )
    cls = MODEL_FOR_CAUSAL_LM_MAPPING[type(config)] if type(config) in MODEL_FOR_CAUSAL_LM_MAPPING else None
    if cls is None or getattr(cls, "_supports_attention_backend", False):
        return
    layers = getattr(config, "attention_layers", None) or []
    feature = (f"local attention on {sum(x == 'local' for x in layers)} of its {len(layers)} layers (window_size="
               f"{getattr(config, 'window_size', None)}), " if "local" in layers else "")  # fmt: skip
    raise NotImplementedError(
        f"{cls.__name__} ({config.model_type}) has {feature}attention chosen from its own classes, not transformers' "
        f"attention interface: attn_implementation={HF_ATTENTION_NAME!r} cannot run it (load it with 'sdpa' or "
        "'eager')"
    )


def register_hf_attention() -> str:
    """Register "grpo_varlen" with transformers' AttentionInterface and AttentionMaskInterface; returns the name.

    `import grpo_kernels` already does this (at once if transformers is loaded, else when it loads): calling it
    again is harmless."""
    _register_attention_function()
    _register_mask_function()
    return HF_ATTENTION_NAME


def _register_attention_function() -> None:
    from transformers.modeling_utils import AttentionInterface

    AttentionInterface.register(HF_ATTENTION_NAME, _hf_attention)


def _register_mask_function() -> None:
    from transformers.masking_utils import AttentionMaskInterface

    AttentionMaskInterface.register(HF_ATTENTION_NAME, _no_mask)


_ON_IMPORT = {"transformers.modeling_utils": _register_attention_function,
              "transformers.masking_utils": _register_mask_function}  # fmt: skip


class _RegisterOnImport(importlib.abc.MetaPathFinder):
    """Registers "grpo_varlen" right after transformers' modules that hold the two registries are executed, so
    that importing grpo_kernels does not import transformers (seconds) and the order of the imports is free."""

    def find_spec(self, name, path, target=None):
        if name not in _ON_IMPORT:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None and spec.loader is not None:
                spec.loader = _RegisteringLoader(spec.loader, _ON_IMPORT[name])
                return spec
        return None


class _RegisteringLoader(importlib.abc.Loader):
    def __init__(self, loader, register):
        self.loader, self.register = loader, register

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module):
        self.loader.exec_module(module)
        self.register()


def register_on_import() -> None:
    """What `import grpo_kernels` calls: register now where transformers' registries are loaded, and hook the
    import of those that are not."""
    for name, register in _ON_IMPORT.items():
        if name in sys.modules:
            register()
    if not all(name in sys.modules for name in _ON_IMPORT) and not any(
        isinstance(f, _RegisterOnImport) for f in sys.meta_path
    ):
        sys.meta_path.insert(0, _RegisterOnImport())


def _no_mask(*args, attention_mask=None, **kwargs):
    """No mask is built (sequences are delimited by cu_seqlens); a padding mask is passed on, to be refused."""
    if attention_mask is not None and not bool(attention_mask.all()):
        return attention_mask
    return None

"""Completion lengths: the model-length check made when a run is built, the samplers' KV-cache arithmetic, and the
length metrics of a step.

    max_model_len = check_model_len(longest_prompt=60, max_new_tokens=8000, max_model_len=None,
                                    position_limit=8192, model="smollm2-135m")      # 8060 (8192 new: ValueError)
    kv_cache_gib(model.config, tokens=8 * 8060, dtype="float32")                  # SmolLM2: 2.77 GiB for G = 8
    metrics.update(step_metrics(rollout, token_budget=16384, micro_batches=4, world=1))

Lengths. A sequence is its prompt plus its completion; the longest the samplers must allow is the longest prompt
of the task (train and eval) plus sampling.max_new_tokens. That is vLLM's max_model_len (sampling.max_model_len
when set), which sizes its KV cache: left to vLLM it would be the model's whole context (32k-128k tokens for
recent models), whose cache may not even fit. The model's own limit is `max_position_embeddings` of its config.

KV cache. A token costs 2 (keys and values) x layers x kv_heads x head_dim x bytes of the cache dtype (the model
dtype). SmolLM2-135M (30 layers, 3 kv heads of 64, 8,192 positions) in float32: 45 KiB per token, so the default
VLLM_CPU_KVCACHE_SPACE=1 (GiB, vLLM on CPU) holds 23,301 tokens: enough to start with 8k-token sequences (vLLM
needs max_model_len tokens of cache), but only 2 of a group's 8 completions of 8,000 tokens (after a 60-token
prompt) run at once; the rest wait. Holding a group of G long completions at once takes
kv_cache_gib(config, G * max_model_len): 2.77 GiB for G = 8 (1.38 GiB in bfloat16), so VLLM_CPU_KVCACHE_SPACE=3; a
whole step at once, prompts_per_step times that. On a GPU the cache is what vllm_gpu_memory_utilization leaves
after the weights.

Metrics of a step (`step_metrics`): completion_length_min / _median / _max (tokens), truncated_fraction (the
completions that reached the token limit), and packing_efficiency: the tokens the packed forward passes really hold
over token_budget x micro-batches x ranks (every rank runs the same number of micro-batches; a rank without work
runs a one-sample stand-in, which counts as empty). Computed from the rollout and the micro-batch count, which are
the same on every rank, so the value is too.
"""

import math
import statistics

__all__ = [
    "check_model_len", "kv_cache_bytes_per_token", "kv_cache_gib", "kv_cache_shortfall", "length_metrics",
    "packed_tokens", "packing_efficiency", "position_limit", "step_metrics", "truncated_fraction",
]  # fmt: skip

_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def position_limit(model_config) -> int | None:
    """The longest sequence an HF model config allows (`max_position_embeddings` of its text config), or None."""
    text = model_config.get_text_config() if hasattr(model_config, "get_text_config") else model_config
    limit = getattr(text, "max_position_embeddings", None)
    return int(limit) if isinstance(limit, int) and not isinstance(limit, bool) and limit > 0 else None


def check_model_len(*, longest_prompt: int, max_new_tokens: int, max_model_len: int | None,
                    position_limit: int | None, model: str) -> int:  # fmt: skip
    """The samplers' max_model_len: `max_model_len`, or longest_prompt + max_new_tokens when None. ValueError (one
    line naming the options) when a completion of max_new_tokens after the longest prompt would not fit in it, or
    when it exceeds the model's position limit (None: no limit known)."""
    need = longest_prompt + max_new_tokens
    parts = f"the longest prompt ({longest_prompt} tokens) plus sampling.max_new_tokens ({max_new_tokens}) = {need}"
    if max_model_len is not None and need > max_model_len:
        raise ValueError(f"sampling.max_model_len ({max_model_len}) is smaller than {parts}: raise it (or set it to "
                         "none), or lower sampling.max_new_tokens")  # fmt: skip
    resolved = need if max_model_len is None else max_model_len
    if position_limit is not None and need > position_limit:
        raise ValueError(f"{parts} tokens exceeds the max_position_embeddings ({position_limit}) of model {model}: "
                         "lower sampling.max_new_tokens")  # fmt: skip
    if position_limit is not None and resolved > position_limit:
        raise ValueError(f"sampling.max_model_len ({max_model_len}) exceeds the max_position_embeddings "
                         f"({position_limit}) of model {model}: lower it, or set it to none ({need})")  # fmt: skip
    return resolved


def kv_cache_bytes_per_token(model_config, dtype: str = "float32") -> int:
    """Bytes of KV cache one token takes in a decoder with this HF config: 2 x layers x kv_heads x head_dim x the
    dtype's bytes ("float32", "bfloat16" or "float16")."""
    if dtype not in _DTYPE_BYTES:
        raise ValueError(f"dtype must be one of {', '.join(map(repr, _DTYPE_BYTES))}, got {dtype!r}")
    c = model_config.get_text_config() if hasattr(model_config, "get_text_config") else model_config
    heads = c.num_attention_heads
    kv_heads = getattr(c, "num_key_value_heads", None) or heads
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // heads
    return 2 * c.num_hidden_layers * kv_heads * head_dim * _DTYPE_BYTES[dtype]


def kv_cache_gib(model_config, tokens: int, dtype: str = "float32") -> float:
    """GiB of KV cache that `tokens` tokens (e.g. G x max_model_len: one group sampled at once) take."""
    return tokens * kv_cache_bytes_per_token(model_config, dtype) / 2**30


def kv_cache_shortfall(model_config, *, group_size: int, max_model_len: int, dtype: str, space_gib: float) -> str:
    """A one-line warning when `space_gib` GiB of KV cache (VLLM_CPU_KVCACHE_SPACE) cannot hold the group_size
    sequences of max_model_len tokens of one group ("" when it can): vLLM then samples them a few at a time."""
    need = kv_cache_gib(model_config, group_size * max_model_len, dtype)
    if need <= space_gib:
        return ""
    fits = space_gib * 2**30 / kv_cache_bytes_per_token(model_config, dtype) / max_model_len
    return (f"VLLM_CPU_KVCACHE_SPACE={space_gib:g} GiB of KV cache holds {fits:.1f} sequences of max_model_len "
            f"{max_model_len} tokens, fewer than a group's G = {group_size} ({need:.2f} GiB): vLLM samples them a few "
            f"at a time; set VLLM_CPU_KVCACHE_SPACE={math.ceil(need)} (or more) to sample a group at once")


def length_metrics(completion_lengths) -> dict:
    """{"completion_length_min", "completion_length_median", "completion_length_max"} in tokens (the median of an
    even count is the mean of the two middle lengths)."""
    lengths = [int(n) for n in completion_lengths]
    if not lengths:
        raise ValueError("length_metrics needs at least one completion")
    return {"completion_length_min": float(min(lengths)), "completion_length_median": float(statistics.median(lengths)),
            "completion_length_max": float(max(lengths))}  # fmt: skip


def truncated_fraction(truncated) -> float:
    """The fraction of completions flagged truncated (bools, one per completion)."""
    flags = [bool(t) for t in truncated]
    if not flags:
        raise ValueError("truncated_fraction needs at least one completion")
    return sum(flags) / len(flags)


def packed_tokens(prompt_lengths, completion_lengths, group_ids, *, shared_prefix: bool) -> int:
    """The tokens the packed micro-batches hold: every prompt + completion, or with shared_prefix (a group is never
    split over micro-batches) each group's prompt once plus its completions."""
    prompts, completions = [int(n) for n in prompt_lengths], [int(n) for n in completion_lengths]
    if len(prompts) != len(completions) or len(group_ids) != len(prompts):
        raise ValueError(f"one prompt length, completion length and group id per completion, got {len(prompts)}, "
                         f"{len(completions)} and {len(group_ids)}")  # fmt: skip
    if not shared_prefix:
        return sum(prompts) + sum(completions)
    first = {}
    for g, p in zip(group_ids, prompts, strict=True):
        first.setdefault(g, p)
    return sum(first.values()) + sum(completions)


def packing_efficiency(tokens: int, *, token_budget: int, micro_batches: int, world: int = 1) -> float:
    """tokens / (token_budget x micro_batches x world): how full the token-budget micro-batches of a step are (all
    ranks; each runs micro_batches). Above 1 only when an item alone exceeds the budget (a shared-prefix group)."""
    if token_budget < 1 or micro_batches < 1 or world < 1:
        raise ValueError(f"token_budget, micro_batches and world must be >= 1, got {token_budget}, {micro_batches} "
                         f"and {world}")  # fmt: skip
    return tokens / (token_budget * micro_batches * world)


def step_metrics(rollout, *, token_budget: int, micro_batches: int, world: int = 1,
                 shared_prefix: bool = False) -> dict:  # fmt: skip
    """The length metrics of a step on `rollout` (a `Rollout`): length_metrics, packing_efficiency and, when the
    sampler flagged them, truncated_fraction."""
    lengths = [len(c) for c in rollout.completion_ids]
    tokens = packed_tokens([len(p) for p in rollout.prompt_ids], lengths, rollout.group_ids,
                           shared_prefix=shared_prefix)  # fmt: skip
    out = length_metrics(lengths)
    if rollout.truncated is not None:
        out["truncated_fraction"] = truncated_fraction(rollout.truncated)
    out["packing_efficiency"] = packing_efficiency(tokens, token_budget=token_budget, micro_batches=micro_batches,
                                                   world=world)  # fmt: skip
    return out

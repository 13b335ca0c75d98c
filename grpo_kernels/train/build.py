"""Building a run: the task and its examples, the tokenizer and the model (checked against the token budget), the
sampler, and the policy with its activation memory, sharding, optimizer and learning-rate schedule."""

import copy
import math
import os
import tempfile
import warnings

import torch

from . import activation
from .activation import decoder_blocks
from .config import TrainConfig
from .fsdp import Dist, shard
from .lengths import check_model_len, kv_cache_shortfall, position_limit
from .rewards import Rewards, load_reward_function
from .sampler import HFSampler
from .step import Policy
from .tasks import CharTokenizer, make_task, tiny_model

__all__ = ["build", "build_policy", "make_sampler", "task_examples", "task_rewards"]


def task_examples(config: TrainConfig):
    """(task, training examples, held-out examples) of a run: what it trains on (in `PromptStream(train,
    config.seed)` order) and evaluates on; task.rewards are the reward functions it scores with (task.reward_funcs,
    or the task's own), loaded here: a spec that does not load is an error before any model loads."""
    t = config.task
    dataset = dict(source=t.dataset, split=t.split, eval_split=t.eval_split, prompt_column=t.prompt_column,
                   answer_column=t.answer_column) if t.name == "dataset" else None  # fmt: skip
    task = make_task(t.name, difficulty=t.difficulty, path=t.path, reward=t.reward, format_weight=t.format_weight,
                     dataset=dataset)  # fmt: skip
    task.rewards = task_rewards(config, task)
    if hasattr(task, "split_examples"):  # a dataset: held-out examples never trained on
        train_set, eval_set = task.split_examples(t.num_train_prompts, t.num_eval_prompts, t.seed)
        return task, train_set, eval_set
    return task, task.examples(t.num_train_prompts, seed=t.seed), task.examples(t.num_eval_prompts, seed=t.seed + 1)


def task_rewards(config: TrainConfig, task) -> Rewards:
    """The run's reward functions: task.reward_funcs with their weights, or the task's own."""
    t = config.task
    if t.reward_funcs:
        functions, weights = [load_reward_function(spec) for spec in t.reward_funcs], t.reward_weights
    else:
        functions, weights = [load_reward_function(name) for name in task.REWARDS], task.reward_weights()
    return Rewards(functions, weights, success=t.success_reward, timeout_s=t.reward_timeout_s,
                   processes=t.reward_processes, task_name=t.name)  # fmt: skip


def build(config: TrainConfig):
    """Tokenizer, task, train/eval examples and the model; checks the data against the budget. Writes nothing but
    the model cache (a known model such as "smollm2-135m" is converted there on first use)."""
    t, m = config.task, config.model
    task, train_set, eval_set = task_examples(config)
    if m.name == "tiny":
        tok = CharTokenizer()
        model = tiny_model(tok.vocab_size, hidden_size=m.hidden_size, num_layers=m.num_layers, num_heads=m.num_heads,
                           num_kv_heads=m.num_kv_heads, head_dim=m.head_dim,
                           attn_implementation=m.attn_implementation, seed=config.seed)  # fmt: skip
    else:
        from .hf_model import load_policy
        from .models import resolve_model

        path = resolve_model(m.name) or m.name
        model, tok = load_policy(path, dtype="float32", attn_implementation=m.attn_implementation)
    chat = {"on": True, "off": False, "auto": tok.has_chat_template}[t.chat_template]
    if chat and not tok.has_chat_template:
        raise ValueError(f'task.chat_template is "on" but the tokenizer of {m.name} has no chat template')
    if t.system_prompt is not None and not chat:
        raise ValueError(f"task.system_prompt needs the chat template, and the tokenizer of {m.name} has none")
    if chat:
        tok.set_prompt_format(chat_template=True, system_prompt=t.system_prompt)
    longest = max(len(tok.encode_prompt(e.prompt)) for e in train_set + eval_set)
    # What the samplers allow, prompt + completion (vLLM's max_model_len, the servers' --max-model-len), kept where
    # HF keeps that bound, the model's generation config, for `make_sampler` and the decoupled servers.
    model.generation_config.max_length = check_model_len(
        longest_prompt=longest, max_new_tokens=config.sampling.max_new_tokens,
        max_model_len=config.sampling.max_model_len, position_limit=position_limit(model.config), model=m.name,
    )  # fmt: skip
    need = longest + config.sampling.max_new_tokens
    sp = config.distributed.sequence_parallel
    if need > config.packing.token_budget * sp:
        shards = f" x distributed.sequence_parallel ({sp})" if sp > 1 else ""
        raise ValueError(f"packing.token_budget ({config.packing.token_budget}){shards} is smaller than the longest "
                         f"prompt ({longest} tokens) plus sampling.max_new_tokens ({config.sampling.max_new_tokens})")
    heads = getattr(model.config, "num_attention_heads", None)
    if sp > 1 and heads is not None and heads % sp:
        raise ValueError(f"distributed.sequence_parallel = {sp} must divide the attention heads of {m.name} "
                         f"({heads})")  # fmt: skip
    return tok, task, train_set, eval_set, model


def make_sampler(config: TrainConfig, model, tok, d: Dist):
    """The HF sampler (the training model itself, or a full copy when the model will be sharded) or vLLM."""
    s = config.sampling
    if s.sampler == "hf":
        return HFSampler(copy.deepcopy(model) if d.distributed else model, eos_id=tok.eos_id, pad_id=tok.pad_id,
                         stop_ids=tok.stop_ids,
                         max_new_tokens=s.max_new_tokens, temperature=s.temperature, top_p=s.top_p,
                         max_batch_rows=s.hf_max_batch_rows)  # fmt: skip
    from .vllm_sampler import VLLMSampler, save_hf_model

    dtype = "bfloat16" if config.model.dtype == "bfloat16" else "float32"
    if not torch.cuda.is_available():  # vLLM's CPU cache is VLLM_CPU_KVCACHE_SPACE GiB (VLLMSampler's default: 1)
        short = kv_cache_shortfall(model.config, group_size=s.group_size, dtype=dtype,
                                   max_model_len=model.generation_config.max_length,
                                   space_gib=float(os.environ.get("VLLM_CPU_KVCACHE_SPACE") or 1))  # fmt: skip
        if short:
            warnings.warn(short, stacklevel=2)
    with tempfile.TemporaryDirectory(prefix="grpo-sampler-") as directory:  # vLLM loads from a directory
        save_hf_model(model, directory)
        return VLLMSampler(directory, eos_id=tok.eos_id, stop_ids=tok.stop_ids, max_new_tokens=s.max_new_tokens,
                           temperature=s.temperature, max_model_len=model.generation_config.max_length,
                           top_p=s.top_p, gpu_memory_utilization=s.vllm_gpu_memory_utilization,
                           dtype=dtype, external_launcher=d.distributed)  # fmt: skip


def build_policy(config: TrainConfig, model, d: Dist, log):
    """(policy, reference policy or None, optimizer, scheduler) of the model: a frozen copy for the KL term when
    loss.beta > 0, the activation checkpointing mode applied, both sharded over the ranks when distributed."""
    bf16 = config.model.dtype == "bfloat16"
    ref_policy = None
    if config.loss.beta > 0:
        ref_policy = Policy(copy.deepcopy(model).requires_grad_(False), compute_dtype=torch.bfloat16 if bf16 else None)
    policy = Policy(model, compute_dtype=torch.bfloat16 if bf16 and not d.distributed else None)
    activation.apply(model, mode=config.model.activation_checkpointing, tokens=config.packing.token_budget,
                     completion_tokens=config.sampling.max_new_tokens, dtype_bytes=2 if bf16 else 4,
                     mlp_tile_tokens=config.model.mlp_tile_tokens, budget_gb=config.model.activation_memory_gb,
                     device=d.device, dist=d, log=log)  # fmt: skip
    if d.distributed:
        dtype = torch.bfloat16 if bf16 else torch.float32
        for p in [policy] + ([ref_policy] if ref_policy else []):
            shard(p, decoder_blocks(p.model), device=d.device, world=d.world, dtype=dtype)
    o = config.optim
    optimizer = torch.optim.AdamW(policy.parameters(), lr=o.lr, betas=o.betas, weight_decay=o.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, _schedule(config))
    return policy, ref_policy, optimizer, scheduler


def _schedule(config: TrainConfig):
    o = config.optim

    def factor(step: int) -> float:
        if step < o.warmup_steps:
            return (step + 1) / o.warmup_steps
        if o.schedule == "cosine":
            progress = (step - o.warmup_steps) / max(1, o.steps - o.warmup_steps)
            return 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))
        return 1.0

    return factor

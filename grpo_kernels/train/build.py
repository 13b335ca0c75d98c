"""Building a run, once, in order: `load` (the task and its examples, the reward functions, the tokenizer with its
prompt format and the model, checked against the token budget), then `build` (the SFT warm start, the rollouts and
the policy with its activation memory, sharding, optimizer and learning-rate schedule) into one `RunParts`.

    inputs = load(config)                  # no process started, nothing written but the model cache
    model, tok = load_model(config)        # the model and tokenizer alone, the prompt format set as the trainer does

Loading under torchrun (`sharded_loading`): an HF model is built on the meta device, converted, sharded, and then
each rank reads only its shard of the checkpoint (grpo_kernels.train.model.sharded_load), the reference policy
likewise; a rank never holds the whole model in fp32. The built-in tiny model (a seeded random init) and a new run
with an SFT warm start (it trains the whole model on every rank) load the whole model on every rank and shard it, as
a single process loads it.
"""

import contextlib
import copy
import dataclasses
import math

import torch

from .config import TrainConfig
from .config.task import TaskConfig
from .data.rewards import Rewards, load_reward_function
from .data.tasks import CharTokenizer, Example, Task, make_task, tiny_model
from .model import activation
from .model.activation import decoder_blocks
from .model.converters import apply_converters, make_converter, trainable_parameters
from .model.fsdp import Dist, shard
from .model.lengths import check_model_len, position_limit
from .model.policy import Policy
from .model.sharded_load import is_meta, load_shards, remember_unsharded
from .rollout.colocated import Colocated
from .step import sft_warmup

__all__ = ["Loaded", "RunParts", "build", "build_policy", "load", "load_model", "make_rollouts", "make_run_task",
           "sharded_loading", "task_examples", "task_rewards"]  # fmt: skip


@dataclasses.dataclass(frozen=True)
class Loaded:
    """A run's inputs as the trainer loads them, before any warm start, copy or sharding: the tokenizer (its prompt
    format set), the task, its training examples (trained on in `PromptStream(train_set, config.seed)` order) and
    held-out examples, the reward functions that score them, and the model (on the CPU, in fp32; its parameters on
    the meta device when loaded without weights, for sharded loading)."""

    tok: object
    task: Task
    train_set: list[Example]
    eval_set: list[Example]
    rewards: Rewards
    model: torch.nn.Module


@dataclasses.dataclass(frozen=True)
class RunParts:
    """Everything a run's loop uses, built once by `build`: the inputs, the policy (`policy.model` is the trained
    model), the frozen reference policy (None without a KL term), the optimizer and its learning-rate schedule, and
    the rollouts (a `RolloutSource`)."""

    tok: object
    task: Task
    train_set: list[Example]
    eval_set: list[Example]
    rewards: Rewards
    policy: Policy
    ref_policy: Policy | None
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    rollouts: object


def make_run_task(config: TrainConfig) -> Task:
    """The task of config.task (a dataset's is read here)."""
    t = config.task
    dataset = dict(source=t.dataset, split=t.split, eval_split=t.eval_split, prompt_column=t.prompt_column,
                   answer_column=t.answer_column,
                   download=t.dataset_download) if t.name == "dataset" else None  # fmt: skip
    return make_task(t.name, difficulty=t.difficulty, path=t.path, reward=t.reward, format_weight=t.format_weight,
                     dataset=dataset)  # fmt: skip


def task_examples(config: TrainConfig, task: Task | None = None):
    """(task, training examples, held-out examples) of a run: what it trains on (in `PromptStream(train,
    config.seed)` order) and evaluates on. task: the run's task if made already (`make_run_task`)."""
    t = config.task
    task = task if task is not None else make_run_task(config)
    if hasattr(task, "split_examples"):  # a dataset: held-out examples never trained on
        train_set, eval_set = task.split_examples(t.num_train_prompts, t.num_eval_prompts, t.seed)
        return task, train_set, eval_set
    return task, task.examples(t.num_train_prompts, seed=t.seed), task.examples(t.num_eval_prompts, seed=t.seed + 1)


def task_rewards(task: Task, settings: TaskConfig | None = None) -> Rewards:
    """The reward functions a run of the task scores with: settings.reward_funcs with their weights, or the task's
    own; with settings' success function, timeout and worker processes (None: the defaults). A spec that does not
    load is an error here, before any model loads."""
    if settings is None:  # the task's own functions with the defaults of every setting
        return Rewards([load_reward_function(name) for name in task.REWARDS], task.reward_weights(),
                       task_name=task.name)  # fmt: skip
    t = settings
    if t.reward_funcs:
        functions, weights = [load_reward_function(spec) for spec in t.reward_funcs], t.reward_weights
    else:
        functions, weights = [load_reward_function(name) for name in task.REWARDS], task.reward_weights()
    return Rewards(functions, weights, success=t.success_reward, timeout_s=t.reward_timeout_s,
                   processes=t.reward_processes, task_name=t.name)  # fmt: skip


def load_model(config: TrainConfig, *, attn_implementation: str | None = None, weights: bool = True):
    """(model, tokenizer) as a run loads them: the built-in tiny decoder (seeded by config.seed) or a model path /
    known name in fp32 on the CPU, the tokenizer's prompt format set by task.chat_template and task.system_prompt
    (an error where the tokenizer cannot honour them). attn_implementation: instead of model.attn_implementation.
    weights False: a model path's parameters on the meta device, its checkpoint checked (`load_policy`); the tiny
    model is made whole."""
    t, m = config.task, config.model
    attn = attn_implementation or m.attn_implementation
    if m.name == "tiny":
        tok = CharTokenizer()
        model = tiny_model(tok.vocab_size, hidden_size=m.hidden_size, num_layers=m.num_layers, num_heads=m.num_heads,
                           num_kv_heads=m.num_kv_heads, head_dim=m.head_dim,
                           attn_implementation=attn, seed=config.seed)  # fmt: skip
    else:
        from .model.hf import load_policy
        from .model.known import resolve_model

        path = resolve_model(m.name) or m.name
        model, tok = load_policy(path, dtype="float32", attn_implementation=attn, weights=weights)
    chat = t.prompt_format(tok.has_chat_template)  # "on", "off" or "conversational" (TRL's rule)
    if chat == "on" and not tok.has_chat_template:
        raise ValueError(f'task.chat_template is "on" but the tokenizer of {m.name} has no chat template')
    if t.system_prompt is not None and chat != "on":
        raise ValueError(f"task.system_prompt needs the chat template, and the tokenizer of {m.name} has none")
    if chat == "on":
        tok.set_prompt_format(chat_template=True, system_prompt=t.system_prompt)
    elif chat == "conversational" and not isinstance(tok, CharTokenizer):  # (the character tokenizer's text: bos +)
        tok.set_prompt_format(chat_template="conversational")
    return model, tok


def load(config: TrainConfig, *, weights: bool = True) -> Loaded:
    """The run's inputs (`Loaded`), the data checked against the token budget and the model's positions. Starts no
    process and writes nothing but the model cache (a known model such as "smollm2-135m" is converted there on first
    use). weights False: the model on the meta device (`load_model`)."""
    m = config.model
    task = make_run_task(config)
    rewards = task_rewards(task, config.task)  # (a spec that does not load: an error before the examples are drawn)
    task, train_set, eval_set = task_examples(config, task)
    model, tok = load_model(config, weights=weights)
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
    return Loaded(tok, task, train_set, eval_set, rewards, model)


def sharded_loading(config: TrainConfig, d: Dist, *, resuming: bool) -> tuple[bool, str]:
    """(whether `build` loads the model sharded, why not where it could): under torchrun an HF model is, unless a
    new run warm-starts it (task.sft_warmup_steps trains the whole model on every rank, before sharding). The tiny
    model (a seeded random init, no files) never."""
    if not d.distributed or config.model.name == "tiny":
        return False, ""
    if config.task.sft_warmup_steps and not resuming:
        return False, "task.sft_warmup_steps trains the whole model on every rank before it is sharded"
    return True, ""


def build(config: TrainConfig, d: Dist, *, resources: contextlib.ExitStack, run_dir, resuming: bool, log) -> RunParts:
    """The run's parts, in order: its inputs (`load`), the SFT warm start (a new run's: a resumed one loads its
    weights), the model converters (model.converters), then either the model on its device, the rollouts made from
    it (before it is sharded) and the policy (`build_policy`), or, with sharded loading (`sharded_loading`), the
    policy (sharded, each rank reading its shard) and the rollouts made from it. What holds a process or a thread
    (the reward functions' workers, the rollouts) goes on resources as it is made."""
    converters = [make_converter(spec) for spec in config.model.converters]  # (a spec that does not load: now)
    sharded, whole = sharded_loading(config, d, resuming=resuming)
    if whole:
        log(f"loading: the whole model on every rank, then sharded ({whole})")
    inputs = load(config, weights=not sharded)
    resources.callback(inputs.rewards.close)  # the reward functions' worker processes, if any
    model, tok, task = inputs.model, inputs.tok, inputs.task
    if config.task.sft_warmup_steps and not resuming:
        losses = sft_warmup(model, tok, task, steps=config.task.sft_warmup_steps, seed=config.seed)
        log(f"SFT warm start: {config.task.sft_warmup_steps} steps, loss {losses[0]:.3f} -> {losses[-1]:.3f}")
    model = apply_converters(model, config, converters)  # (on the meta device with sharded loading)
    if sharded:
        policy, ref_policy, optimizer, scheduler = build_policy(config, model, d, log)
        rollouts = make_rollouts(config, policy.model, inputs, d, run_dir, log)
        resources.callback(rollouts.close)
    else:
        model.to(d.device)
        rollouts = make_rollouts(config, model, inputs, d, run_dir, log)
        resources.callback(rollouts.close)
        policy, ref_policy, optimizer, scheduler = build_policy(config, model, d, log)
    return RunParts(tok, task, inputs.train_set, inputs.eval_set, inputs.rewards, policy, ref_policy, optimizer,
                    scheduler, rollouts)  # fmt: skip


def make_rollouts(config: TrainConfig, model, inputs: Loaded, d: Dist, run_dir, log):
    """The run's `RolloutSource`, made from the model before it is sharded (after, with sharded loading): rollout
    servers (decoupled; started by rank 0) or the trainer's own sampler (colocated)."""
    if config.sampling.placement == "decoupled":
        from .rollout.decoupled import Decoupled  # imports vLLM (its weight-transfer API): only here

        return Decoupled.open(config, model, inputs, d, run_dir, log)
    rollouts = Colocated(config, model, inputs, d)
    from .rollout.vllm_sampler import VLLMSampler  # (no vLLM import: the engine's own module, loaded when used)

    if isinstance(rollouts.sampler, VLLMSampler):
        engine = rollouts.sampler
        what = ("its config.json alone; the weights are the trainer's, handed over in memory, no copy written"
                if engine.load_format == "dummy" else "its weights")  # fmt: skip
        log(f"vLLM sampler: the engine opened {engine.model_dir} ({what})")
    return rollouts


def build_policy(config: TrainConfig, model, d: Dist, log):
    """(policy, reference policy or None, optimizer, scheduler) of the model: a frozen copy for the KL term when
    loss.beta > 0, the activation checkpointing mode applied, both sharded over the ranks when distributed. A model
    on the meta device (sharded loading) is copied there, sharded, and then each rank reads its shard of both."""
    bf16 = config.model.dtype == "bfloat16"
    meta = is_meta(model)
    if meta:
        remember_unsharded(model)  # (a sampler's full copy is made from it: sharded_load.unsharded_copy)
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
    if meta:
        load_shards([policy] + ([ref_policy] if ref_policy else []), d)
    o = config.optim
    optimizer = torch.optim.AdamW(trainable_parameters(policy), lr=o.lr, betas=o.betas, weight_decay=o.weight_decay)
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

"""The GRPO training loop: sample G completions per prompt -> rewards -> `grpo_step` (advantages, packed
micro-batches, the fused LM-head loss) -> push the new weights to the sampler -> metrics and checkpoints.

    grpo-kernels train [--config FILE] [--section.field=value ...]
    torchrun --nproc_per_node=N -m grpo_kernels.cli train [...]      # FSDP2 data parallel (gloo on CPU)
    grpo-kernels train --resume RUN_DIR                                # continue from its latest checkpoint
    grpo-kernels train --resume RUN_DIR --checkpoint.resume_step=N     # ... from checkpoints/step_N instead

Data parallelism: see grpo_kernels.train.fsdp (every rank samples its share of the groups, then all ranks hold
the whole rollout). Group size control: `group_size.adaptive` raises G (grpo_kernels.train.group_size) when the
invalid-group rate of the last steps exceeds the threshold; `group_size.dynamic_sampling` drops invalid groups and
samples more prompts (at most `max_resample_rounds` more rounds) to fill the batch.

Everything that can fail on the configuration or the data (task, model, token budget, TensorBoard) is checked
before the run directory is written. So is the checkpoint a run resumes: verified against its manifest (a damaged
one is an error naming the file, with `checkpoint.resume_step` as the explicit fallback), and its config compared
with the run's (a field that changes the run is an error unless `checkpoint.allow_config_change`).
"""

import contextlib
import copy
import dataclasses
import json
import math
import os
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch

from . import activation, preflight
from .activation import decoder_blocks
from .checkpoint import (
    CheckpointError,
    config_changes,
    latest_checkpoint,
    list_checkpoints,
    load_checkpoint,
    save_checkpoint,
    verify_checkpoint,
)
from .config import TrainConfig
from .config_io import save_config, to_dict
from .fsdp import SINGLE, Dist, all_gather_objects, full_state_dict, init_distributed, shard
from .group_size import AdaptiveGroupSize
from .lengths import check_model_len, kv_cache_shortfall, position_limit
from .rollout import Rollout
from .sampler import HFSampler
from .step import Policy, grpo_step, sft_warmup
from .tasks import CharTokenizer, PromptStream, make_task, tiny_model
from .tracking import Trackers

__all__ = ["build", "collect", "evaluate", "make_sampler", "sample_scored", "seed_for", "task_examples", "train"]


def seed_for(*parts: int) -> int:
    """A sampling seed for (run seed, step, round, prompt index); distinct for distinct inputs in range."""
    out = 0
    for p in parts:
        out = out * 1_000_003 + p
    return out % 2**63


def sample_scored(sampler, tok, task, examples, g: int, seeds: list, d: Dist, *, score=None) -> Rollout:
    """The scored rollout of G samples of every example, group k for examples[k]: rank r samples and scores the
    examples r, r + world, ... and every rank receives the whole result. score(completion, example): task.reward
    unless given."""
    score = score or task.reward
    mine = list(range(d.rank, len(examples), d.world))
    r = sampler.sample([tok.encode_prompt(examples[k].prompt) for k in mine], g, seeds=[seeds[k] for k in mine])
    part = r.with_rewards([score(tok.decode(c), examples[mine[k]]) for k, c in zip(r.group_ids, r.completion_ids,
                                                                                   strict=True)])  # fmt: skip
    gathered = all_gather_objects((mine, part), d)
    position = {k: i for i, k in enumerate(k for ks, _ in gathered for k in ks)}
    return Rollout.concat([p for _, p in gathered]).select([position[k] for k in range(len(examples))])


def _log_file(path: Path, kept: list):
    """path opened for appending after its content is replaced by the kept lines (those of the steps before the
    checkpoint a run resumes from; none for a new run). The replacement is one rename: a run killed at any point
    after it keeps them (a plain rewrite held them in a write buffer until the next step's flush)."""
    partial = path.with_name(f".{path.name}.partial")
    with partial.open("w") as f:
        f.writelines(line + "\n" for line in kept)
    os.replace(partial, path)
    return path.open("a")


def _write_completions(file, step: int, rollout: Rollout, tok) -> None:
    """One completions.jsonl line per completion of the step's rollout."""
    truncated = rollout.truncated or [None] * len(rollout.completion_ids)
    for i, (p, c) in enumerate(zip(rollout.prompt_ids, rollout.completion_ids, strict=True)):
        file.write(json.dumps({"step": step, "group": int(rollout.group_ids[i]),
                               "prompt": tok.tokenizer.decode(list(map(int, p))) if hasattr(tok, "tokenizer")
                               else tok.decode(p), "completion": tok.decode(c),
                               "reward": float(rollout.rewards.flatten()[i]), "tokens": len(c),
                               "truncated": truncated[i]}) + "\n")  # fmt: skip
    file.flush()


def evaluate(sampler, tok, task, examples, *, seed: int, d: Dist = SINGLE) -> float:
    """Success rate (`task.correct`) of one sampled answer per held-out prompt."""
    if not examples:
        return float("nan")
    rates = sample_scored(sampler, tok, task, examples, 1, [seed_for(seed, k) for k in range(len(examples))], d,
                    score=task.correct).pass_rates()  # fmt: skip
    return sum(rates) / len(rates)


def collect(config: TrainConfig, sampler, tok, task, next_prompts, step: int, g: int, d: Dist):
    """The step's (scored rollout, prompts sampled, extra rounds, completion tokens sampled). With dynamic
    sampling, groups without a gradient signal are dropped and more prompts sampled, for at most
    max_resample_rounds more rounds; the rollout is None when no group survived. With
    sampling.mask_truncated_completions its truncated completions are masked out of the loss (their rewards still
    count in the group advantages)."""
    s, gs = config.sampling, config.group_size
    parts, sampled, rounds, tokens = [], 0, 0, 0
    while True:
        batch = next_prompts(s.prompts_per_step - sum(r.num_groups for r in parts))
        seeds = [seed_for(config.seed, step, rounds, k) for k in range(len(batch))]
        rollout = sample_scored(sampler, tok, task, batch, g, seeds, d)
        sampled, tokens = sampled + len(batch), tokens + sum(len(c) for c in rollout.completion_ids)
        if gs.dynamic_sampling:  # keep the groups with a gradient signal: the advantage kernel's own verdict
            rollout = rollout.select(rollout.advantages.valid.nonzero().flatten().tolist())
        if rollout.num_groups:
            parts.append(rollout)
        full = sum(r.num_groups for r in parts) >= s.prompts_per_step
        if not gs.dynamic_sampling or full or rounds >= gs.max_resample_rounds:
            break
        rounds += 1
    rollout = Rollout.concat(parts) if parts else None
    if rollout is not None and s.mask_truncated_completions:
        rollout = rollout.mask_truncated()
    return rollout, sampled, rounds, tokens


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


def task_examples(config: TrainConfig):
    """(task, training examples, held-out examples) of a run: what it trains on (in `PromptStream(train,
    config.seed)` order) and evaluates on."""
    t = config.task
    task = make_task(t.name, difficulty=t.difficulty, path=t.path, reward=t.reward, format_weight=t.format_weight)
    return task, task.examples(t.num_train_prompts, seed=t.seed), task.examples(t.num_eval_prompts, seed=t.seed + 1)


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


def _check_run_dir(run_dir: Path, option: str, d: Dist) -> None:
    """ValueError (one line naming the option, on every rank) when run_dir is a file, lies under a file, or cannot
    be created or written; leaves nothing behind. Rank 0 tries: it creates the missing directories and a temporary
    file, then removes them (a permission check alone passes for root, and /proc or a read-only mount refuse
    anyway)."""
    problem = None
    if d.is_main:
        if run_dir.exists() and not run_dir.is_dir():
            problem = f"{option} {run_dir} is a file, not a directory"
        else:
            existing, missing = run_dir, []
            while not existing.exists():
                existing, missing = existing.parent, [existing, *missing]
            if not existing.is_dir():
                problem = f"{option} {run_dir} cannot be created: {existing} is a file"
            elif not os.access(existing, os.W_OK | os.X_OK):
                problem = f"{option} {run_dir} cannot be written: no write permission on {existing}"
            else:
                problem = _try_writing(run_dir, missing, option)
    problem = all_gather_objects(problem, d)[0]
    if problem is not None:
        raise ValueError(problem)


def _try_writing(run_dir: Path, missing: list[Path], option: str) -> str | None:
    created = []
    try:
        for path in missing:
            path.mkdir()
            created.append(path)
        with tempfile.TemporaryFile(dir=run_dir):
            pass
    except OSError as exc:
        return f"{option} {run_dir} cannot be created or written: {exc.strerror or exc}"
    finally:
        for path in reversed(created):
            with contextlib.suppress(OSError):
                path.rmdir()
    return None


def _verified_checkpoint(config: TrainConfig, run_dir: Path, d: Dist, log) -> Path:
    """The checkpoint to resume (the latest, or checkpoint.resume_step), verified against its manifest on rank 0,
    and its config compared with this one: CheckpointError/ValueError (one line, on every rank) when it is damaged
    or the config changes the run without checkpoint.allow_config_change (then a warning line lists the fields)."""
    c = config.checkpoint
    found = list_checkpoints(run_dir)
    checkpoint = found[-1]
    if c.resume_step is not None:
        checkpoint = run_dir / "checkpoints" / f"step_{c.resume_step}"
        if checkpoint not in found:
            raise ValueError(f"checkpoint.resume_step: no checkpoint step_{c.resume_step} in {run_dir}/checkpoints "
                             f"(there are: {', '.join(p.name for p in found)})")  # fmt: skip
    result = None
    if d.is_main:
        try:
            result = verify_checkpoint(checkpoint)["config"]
        except CheckpointError as exc:
            result = exc
    result = all_gather_objects(result, d)[0]
    if isinstance(result, CheckpointError):
        raise CheckpointError(str(result))
    changes = config_changes(result or {}, to_dict(config))
    if changes and not c.allow_config_change:
        raise ValueError(f"checkpoint.resume: the config differs from the one {checkpoint.name} was saved with, in "
                         f"{'; '.join(changes)}: undo the change, or add --checkpoint.allow_config_change=true to "
                         "resume with it")  # fmt: skip
    if changes and d.is_main:
        log(f"warning: resuming {checkpoint.name} with a changed config (checkpoint.allow_config_change): "
            f"{'; '.join(changes)}")  # fmt: skip
    return checkpoint


def train(config: TrainConfig, *, log=print) -> dict:
    """Run config (on every rank under torchrun); returns the summary also written to <run_dir>/summary.json."""
    d = init_distributed(config.distributed.backend, sequence_parallel=config.distributed.sequence_parallel)
    config = preflight.check(config, d.device.type)  # this host's checks; "auto" dtype and trackers resolved
    resume = config.checkpoint.resume
    run_dir = Path(resume or config.logging.run_dir)
    _check_run_dir(run_dir, "checkpoint.resume" if resume else "logging.run_dir", d)
    checkpoint = latest_checkpoint(run_dir)
    if resume and checkpoint is None:
        raise ValueError(f"checkpoint.resume: no checkpoint in {run_dir}/checkpoints")
    if not resume and checkpoint is not None:
        raise ValueError(f"logging.run_dir {run_dir} holds checkpoints of an earlier run: resume it (--resume "
                         f"{run_dir}) or choose another run_dir")  # fmt: skip
    if resume:
        checkpoint = _verified_checkpoint(config, run_dir, d, log)
    torch.manual_seed(config.seed)
    tok, task, train_set, eval_set, model = build(config)
    if not d.is_main:
        log = lambda *a, **k: None  # noqa: E731
    if config.task.sft_warmup_steps and checkpoint is None:
        losses = sft_warmup(model, tok, task, steps=config.task.sft_warmup_steps, seed=config.seed)
        log(f"SFT warm start: {config.task.sft_warmup_steps} steps, loss {losses[0]:.3f} -> {losses[-1]:.3f}")
    model.to(d.device)
    rollouts = None
    if config.sampling.placement == "decoupled":  # rollout servers, started by rank 0; the sampler is rank 0's
        from .decoupled import Decoupled  # imports vLLM (its weight-transfer API): only here

        rollouts = Decoupled.start(config, model, tok, d, run_dir, log)
        sampler = rollouts.sampler
    else:
        sampler = make_sampler(config, model, tok, d)
    try:
        return _train(config, d, run_dir, checkpoint, tok, task, train_set, eval_set, model, sampler, rollouts, log)
    finally:
        if rollouts is not None:
            rollouts.close()


def _train(config, d, run_dir, checkpoint, tok, task, train_set, eval_set, model, sampler, rollouts, log) -> dict:
    """The run after its build; every log file, tracker, progress bar and rollout pipeline it opens is registered
    with one ExitStack as it opens, so an exception on any path closes them (a W&B run finished, files flushed)."""
    with contextlib.ExitStack() as resources:
        return _run(config, d, run_dir, checkpoint, tok, task, train_set, eval_set, model, sampler, rollouts, log,
                    resources)  # fmt: skip


def _run(config, d, run_dir, checkpoint, tok, task, train_set, eval_set, model, sampler, rollouts, log,
         resources: contextlib.ExitStack) -> dict:  # fmt: skip
    bf16, s = config.model.dtype == "bfloat16", config.sampling
    decoupled, pipeline = rollouts is not None, None
    ref_policy = None
    if config.loss.beta > 0:
        ref_policy = Policy(copy.deepcopy(model).requires_grad_(False), compute_dtype=torch.bfloat16 if bf16 else None)
    policy = Policy(model, compute_dtype=torch.bfloat16 if bf16 and not d.distributed else None)
    activation.apply(model, mode=config.model.activation_checkpointing, tokens=config.packing.token_budget,
                     completion_tokens=s.max_new_tokens, dtype_bytes=2 if bf16 else 4,
                     mlp_tile_tokens=config.model.mlp_tile_tokens, budget_gb=config.model.activation_memory_gb,
                     device=d.device, dist=d, log=log)  # fmt: skip
    if d.distributed:
        dtype = torch.bfloat16 if bf16 else torch.float32
        for p in [policy] + ([ref_policy] if ref_policy else []):
            shard(p, decoder_blocks(p.model), device=d.device, world=d.world, dtype=dtype)
    o = config.optim
    optimizer = torch.optim.AdamW(policy.parameters(), lr=o.lr, betas=o.betas, weight_decay=o.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, _schedule(config))
    gs = config.group_size
    adaptive = AdaptiveGroupSize(s.group_size, maximum=gs.max_group_size, threshold=gs.invalid_rate_threshold,
                                 window=gs.window) if gs.adaptive else None  # fmt: skip
    stream, first, elapsed = PromptStream(train_set, config.seed), 0, 0.0
    loss_options = config.loss.kwargs()
    if d.sp == 1:  # the fused head's mean entropy of the completion tokens, a metric (TRL's "entropy")
        loss_options["return_entropy"] = True
    if decoupled:
        example = train_set[0]
        rollouts.connect(policy.model, (tok.encode_prompt(example.prompt), tok.encode(example.answer, eos=True)))
        if s.max_staleness and loss_options.get("sampler_is_mode") is None:
            loss_options["sampler_is_mode"] = "token_truncate"
            log(f"sampling.max_staleness = {s.max_staleness}: the loss corrects with the sampler's log-probs "
                '(loss.sampler_is_mode "token_truncate")')  # fmt: skip

    def sync_sampler(version: int, *, changed: bool = True) -> dict:
        """The new weights to the sampler (the shared-model HF sampler needs nothing); version: steps done."""
        if decoupled:
            if pipeline is None:
                return rollouts.send(policy, version)
            return rollouts.update(pipeline, policy, version, weights=changed)
        if changed and (d.distributed or s.sampler == "vllm"):
            start = time.perf_counter()
            sampler.load_weights(full_state_dict(policy.model))
            return {"weight_sync_s": time.perf_counter() - start}
        return {}

    def evaluate_policy() -> float:
        if not decoupled:
            return evaluate(sampler, tok, task, eval_set, seed=config.seed + 7, d=d)
        rate = evaluate(sampler, tok, task, eval_set, seed=config.seed + 7) if d.is_main else None
        return all_gather_objects(rate, d)[0]

    # cumulative over the run (eval.jsonl reports them at every evaluation): completions and their tokens sampled
    # (dynamic sampling's dropped groups and steps without an update included), seconds sampling, training, syncing;
    # num_tokens: prompt + completion tokens of every row trained on (TRL's num_tokens, its num_input_tokens_seen)
    totals = {"completions_sampled": 0, "sampled_tokens": 0, "generate_s": 0.0, "train_s": 0.0, "sync_s": 0.0,
              "num_tokens": 0}  # fmt: skip
    if checkpoint is not None:
        state = load_checkpoint(checkpoint, policy=policy, optimizer=optimizer, ref_policy=ref_policy, verify=False)
        first, elapsed = state["step"], state["elapsed_s"]
        stream.load_state_dict(state)
        scheduler.load_state_dict(state["scheduler"])
        if adaptive:
            adaptive.load_state_dict(state["adaptive"])
        start_eval, eval_total = state["eval_success_start"], state.get("eval_s_total", 0.0)
        totals.update(state.get("totals", {}))
    if checkpoint is not None or decoupled:
        synced = sync_sampler(first)
        if decoupled and d.is_main:
            log(f"weights sent to the rollout servers: {synced['weight_sync_bytes'] / 2**20:.1f} MiB in "
                f"{synced['weight_sync_s']:.2f} s, log-prob check {synced.get('weight_sync_logp_max_diff', 0):.2e}")
    if checkpoint is not None:
        log(f"resumed from {checkpoint} at step {first}")
    else:
        start_eval, eval_total = evaluate_policy(), 0.0
        log(f"held-out success before RL: {_with_se(start_eval, len(eval_set))}")
    if d.is_main:
        run_dir.mkdir(parents=True, exist_ok=True)
        once = dataclasses.replace(config.checkpoint, resume_step=None, allow_config_change=False)
        save_config(dataclasses.replace(config, checkpoint=once), run_dir / "config.toml")
    metrics_path, eval_path = run_dir / "metrics.jsonl", run_dir / "eval.jsonl"
    texts_path = run_dir / "completions.jsonl"
    kept, kept_evals, kept_texts = [], [], []
    if checkpoint is not None:  # drop the steps after the checkpoint
        if metrics_path.exists():
            kept = [line for line in metrics_path.read_text().splitlines() if json.loads(line)["step"] < first]
        if eval_path.exists():
            kept_evals = [line for line in eval_path.read_text().splitlines() if json.loads(line)["step"] < first]
        if texts_path.exists():
            kept_texts = [line for line in texts_path.read_text().splitlines() if json.loads(line)["step"] < first]
    trackers = Trackers.start(config, run_dir, resume=checkpoint is not None) if d.is_main else None
    if trackers is not None:
        resources.callback(trackers.close)
    if trackers is not None and checkpoint is None and len(eval_set):
        trackers.log_eval({"eval_success": start_eval, "eval_success_se": _se(start_eval, len(eval_set))}, -1)
    bar = _progress(o.steps, first, enabled=d.is_main)
    if bar is not None:
        resources.callback(bar.close)
    say = bar.write if bar is not None else log
    started = time.perf_counter() - elapsed

    next_prompts, prompt_state = stream.take, stream.state_dict  # identical on every rank

    def produce(step):  # decoupled, rank 0, the sampling thread: the batch of `step`
        g = adaptive.group_size if adaptive else s.group_size
        sampler.versions.clear()
        rollout, sampled, rounds, tokens = collect(config, sampler, tok, task, next_prompts, step, g, SINGLE)
        item = {"rollout": rollout, "sampled": sampled, "rounds": rounds, "tokens": tokens, "group_size": g,
                "prompt_state": prompt_state()}  # fmt: skip
        if sampler.versions:  # the weight version the servers report for the batch's tokens
            item["version"] = min(sampler.versions)
        return item

    out = resources.enter_context(_log_file(metrics_path, kept)) if d.is_main else None
    evals = resources.enter_context(_log_file(eval_path, kept_evals)) if d.is_main and config.task.eval_every else None
    texts = (resources.enter_context(_log_file(texts_path, kept_texts))
             if d.is_main and config.logging.completions_every else None)  # fmt: skip
    reached = None  # the step after which a held-out evaluation reached task.target_success
    evaluated = (None, None)  # (step, success) of the latest evaluation in the loop
    compute_old = loss_options.get("sampler_is_mode") is not None or s.sampler == "vllm"  # the mismatch metric
    if decoupled:
        pipeline = rollouts.pipeline(produce, first=first, last=o.steps)  # None on ranks other than 0
        if pipeline is not None:
            resources.callback(pipeline.close)
    for step in range(first, o.steps):
        timing = {}
        if decoupled:
            item = rollouts.get(pipeline, step)
            rollout, sampled, rounds, tokens, g, where = (item[k] for k in ("rollout", "sampled", "rounds", "tokens",
                                                                           "group_size", "prompt_state"))  # fmt: skip
            timing = {"rollout_staleness": step - item["version"], "rollout_generate_s": item["generate_s"],
                      "rollout_wait_s": item["wait_s"]}  # fmt: skip
        else:
            g = adaptive.group_size if adaptive else s.group_size
            start = time.perf_counter()
            rollout, sampled, rounds, tokens = collect(config, sampler, tok, task, next_prompts, step, g, d)
            timing, where = {"rollout_generate_s": time.perf_counter() - start}, prompt_state()
        totals["completions_sampled"] += sampled * g
        totals["sampled_tokens"] += tokens
        totals["generate_s"] += timing["rollout_generate_s"]
        def log_metrics(metrics: dict) -> None:  # metrics.jsonl and the trackers, one line per step
            if out is not None:
                out.write(json.dumps(metrics) + "\n")
                out.flush()
            if trackers is not None:
                trackers.log(metrics, metrics["step"])

        if rollout is None:  # a line that says so (no loss, reward or throughput: nothing was trained)
            metrics = {**timing, **(sync_sampler(step + 1, changed=False) or {})}
            metrics.update(step=step, no_update=1, invalid_group_rate=1.0, lr=scheduler.get_last_lr()[0],
                           elapsed_s=time.perf_counter() - started, group_size=g, prompts_sampled=sampled,
                           resample_rounds=rounds, completions_sampled=sampled * g, sampled_tokens=tokens,
                           num_tokens=totals["num_tokens"])  # fmt: skip
            log_metrics(metrics)
            say(f"step {step:4d}  every sampled group was invalid: no update")
        else:
            metrics = grpo_step(policy, optimizer, rollout, loss_options=loss_options,
                                temperature=s.temperature, token_budget=config.packing.token_budget,
                                shared_prefix=config.packing.shared_prefix, num_iterations=o.num_iterations,
                                grad_clip=o.grad_clip, ref_policy=ref_policy, compute_old_logps=compute_old,
                                algorithm=config.packing.algorithm, dist=d,
                                autocast_dtype=torch.bfloat16 if bf16 and not d.distributed else None)  # fmt: skip
            scheduler.step()
            metrics.update(timing, **sync_sampler(step + 1), invalid_all_zero_rate=rollout.all_zero_fraction())
            totals["train_s"] += metrics["train_step_s"]
            totals["sync_s"] += metrics.get("weight_sync_s", 0.0)
            totals["num_tokens"] += sum(len(p) + len(c) for p, c in zip(rollout.prompt_ids, rollout.completion_ids,
                                                                        strict=True))  # fmt: skip
            if adaptive:
                adaptive.update(metrics["invalid_group_rate"], rollout.pass_rates())
            metrics.update(step=step, lr=scheduler.get_last_lr()[0], elapsed_s=time.perf_counter() - started,
                           group_size=g, prompts_sampled=sampled, resample_rounds=rounds,
                           completions_sampled=sampled * g, sampled_tokens=tokens,
                           num_tokens=totals["num_tokens"])  # fmt: skip
            log_metrics(metrics)
            if texts is not None and step % config.logging.completions_every == 0:
                _write_completions(texts, step, rollout, tok)
            if bar is not None:
                bar.set_postfix(reward=f"{metrics['reward']:.3f}", invalid=f"{metrics['invalid_group_rate']:.2f}",
                                tok_s=f"{metrics['train_tokens_per_s']:.0f}")  # fmt: skip
            if step % config.logging.log_every == 0 or step == o.steps - 1:
                say(f"step {step:4d}  reward {metrics['reward']:.3f}  invalid {metrics['invalid_group_rate']:.2f}"
                    f"  loss {metrics['loss']:+.4f}  {metrics['train_tokens_per_s']:.0f} tok/s")  # fmt: skip
        if bar is not None:
            bar.update(1)
        t = config.task
        if t.eval_every and ((step + 1) % t.eval_every == 0 or step + 1 == o.steps):
            start = time.perf_counter()
            success = evaluate_policy()
            eval_s = time.perf_counter() - start
            eval_total += eval_s
            if evals is not None:
                row = {"step": step, "eval_success": success, "eval_success_se": _se(success, len(eval_set)),
                       "eval_s": eval_s, "eval_s_total": eval_total, **totals,
                       "elapsed_s": time.perf_counter() - started}  # fmt: skip
                evals.write(json.dumps(row) + "\n")
                evals.flush()
                if trackers is not None:
                    trackers.log_eval(row, step)
            say(f"step {step:4d}  held-out success {_with_se(success, len(eval_set))}")
            evaluated = (step, success)
            if t.target_success is not None and success >= t.target_success:
                reached = step
        every = config.checkpoint.every
        last = step + 1 == o.steps or reached is not None
        if every and ((step + 1) % every == 0 or last):
            state = {"step": step + 1, **where,
                     "scheduler": scheduler.state_dict(), "adaptive": adaptive.state_dict() if adaptive else None,
                     "eval_success_start": start_eval, "eval_s_total": eval_total, "totals": dict(totals),
                     "elapsed_s": time.perf_counter() - started}  # fmt: skip
            save_checkpoint(run_dir, step + 1, policy=policy, optimizer=optimizer, ref_policy=ref_policy,
                            trainer_state=state, d=d, config=to_dict(config),
                            keep=config.checkpoint.keep_last)  # fmt: skip
        if reached is not None:
            say(f"held-out success {_with_se(success, len(eval_set))} reached task.target_success = "
                f"{t.target_success} after step {step}: training stops")
            break
    resources.close()  # the pipeline, log files, bar and trackers, last opened first (every exit path: _train)
    steps = o.steps if reached is None else reached + 1
    # the loop's evaluation after the last step is the final one (the weights have not changed since)
    final_eval = evaluated[1] if evaluated[0] == steps - 1 else evaluate_policy()
    summary = {"eval_success_start": start_eval, "eval_success_end": final_eval, "eval_prompts": len(eval_set),
               "eval_success_se_start": _se(start_eval, len(eval_set)),
               "eval_success_se_end": _se(final_eval, len(eval_set)), "steps": steps,
               "group_size": s.group_size, "world_size": d.world, "seconds": time.perf_counter() - started,
               "eval_s_total": eval_total, **totals, "target_success": config.task.target_success,
               "reached_target": reached is not None}  # fmt: skip
    if d.is_main:
        (run_dir / "summary.json").write_text(json.dumps(summary, indent=1))
    log(f"held-out success after {steps} steps: {_with_se(final_eval, len(eval_set))} "
        f"(was {_with_se(start_eval, len(eval_set))}; ± one binomial standard error)")
    if d.distributed:
        torch.distributed.barrier()
    if s.sampler == "vllm" and not decoupled:
        sampler.close()  # vLLM's shutdown also destroys the default process group
    if d.distributed and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    return summary


def _se(rate: float, n: int) -> float:
    """Binomial standard error of a success rate measured on n prompts (nan without prompts)."""
    return math.sqrt(rate * (1 - rate) / n) if n else float("nan")


def _with_se(rate: float, n: int) -> str:
    return f"{rate:.3f} ± {_se(rate, n):.3f}" if n else "n/a (no held-out prompts)"


def _progress(total: int, done: int, *, enabled: bool):
    """A tqdm bar on an interactive terminal (rank 0); None otherwise (the log lines carry the metrics)."""
    if not enabled or not sys.stderr.isatty():
        return None
    from tqdm.auto import tqdm

    return tqdm(total=total, initial=done, desc="grpo", unit="step")

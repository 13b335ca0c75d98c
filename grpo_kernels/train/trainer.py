"""The GRPO training loop, single process for now: sample G completions per prompt -> rewards -> `grpo_step`
(advantages, packed micro-batches, the fused LM-head loss) -> metrics to `<run_dir>/metrics.jsonl`.

    grpo-kernels train [--config FILE] [--section.field=value ...]

Group size control: `group_size.adaptive` raises G (grpo_kernels.train.group_size) when the invalid-group rate of
the last steps exceeds the threshold; `group_size.dynamic_sampling` drops invalid groups and samples more prompts
(at most `max_resample_rounds` more rounds) to fill the batch.

Not yet here (issue 6 continues): FSDP2 across processes, DCP checkpoints and --resume, the vLLM sampler, real
models from a local HF path.
"""

import json
import math
import random
import time
from pathlib import Path

import torch

from .config import TrainConfig, save_config
from .group_size import AdaptiveGroupSize
from .sampler import HFSampler, Rollout
from .step import grpo_step, sft_warmup
from .tasks import CharTokenizer, make_task, tiny_model

__all__ = ["evaluate", "train"]


def _unsupported(config: TrainConfig) -> None:
    """Options the config accepts but this loop does not run yet: a clear error, never a silent ignore."""
    todo = {
        "model.name": config.model.name != "tiny",
        "sampling.sampler": config.sampling.sampler != "hf",
        "checkpoint.every": config.checkpoint.every != 0,
        "checkpoint.resume": config.checkpoint.resume is not None,
        "logging.tensorboard": config.logging.tensorboard,
        "loss.beta": config.loss.beta != 0.0,
        "model.dtype": config.model.dtype != "float32",
    }
    missing = [name for name, used in todo.items() if used]
    if missing:
        raise NotImplementedError(f"not implemented in the trainer yet: {', '.join(missing)}")


def evaluate(sampler, tokenizer, task, examples, *, seed: int) -> float:
    """Success rate of one sampled answer per held-out prompt."""
    rollout = sampler.sample([tokenizer.encode(e.prompt, bos=True) for e in examples], 1, seed=seed)
    rewards = [task.reward(tokenizer.decode(c), e) for c, e in zip(rollout.completion_ids, examples, strict=True)]
    return sum(rewards) / len(rewards)


def _groups_of(rollout, rewards, keep):
    """The rollout and rewards restricted to the groups whose index is in keep."""
    g = rollout.group_size
    idx = [i for k in keep for i in range(k * g, (k + 1) * g)]
    pick = lambda xs: [xs[i] for i in idx]  # noqa: E731
    return Rollout(prompt_ids=pick(rollout.prompt_ids), completion_ids=pick(rollout.completion_ids),
                   sampler_logps=pick(rollout.sampler_logps), group_size=g), pick(rewards)  # fmt: skip


def _concat(parts):
    rollouts = [r for r, _ in parts]
    cat = lambda name: [x for r in rollouts for x in getattr(r, name)]  # noqa: E731
    rollout = Rollout(prompt_ids=cat("prompt_ids"), completion_ids=cat("completion_ids"),
                      sampler_logps=cat("sampler_logps"), group_size=rollouts[0].group_size)  # fmt: skip
    return rollout, [x for _, rewards in parts for x in rewards]


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


def train(config: TrainConfig, *, log=print) -> dict:
    """Run config; returns the summary also written to <run_dir>/summary.json."""
    _unsupported(config)
    run_dir = Path(config.logging.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    save_config(config, run_dir / "config.toml")
    torch.manual_seed(config.seed)
    tok = CharTokenizer()
    task = make_task(config.task.name, difficulty=config.task.difficulty, path=config.task.path)
    train_set = task.examples(config.task.num_train_prompts, seed=config.task.seed)
    eval_set = task.examples(config.task.num_eval_prompts, seed=config.task.seed + 1)
    m = config.model
    model = tiny_model(tok.vocab_size, hidden_size=m.hidden_size, num_layers=m.num_layers, num_heads=m.num_heads,
                       num_kv_heads=m.num_kv_heads, head_dim=m.head_dim, attn_implementation=m.attn_implementation,
                       seed=config.seed)  # fmt: skip
    if config.task.sft_warmup_steps:
        losses = sft_warmup(model, tok, task, steps=config.task.sft_warmup_steps, seed=config.seed)
        log(f"SFT warm start: {config.task.sft_warmup_steps} steps, loss {losses[0]:.3f} -> {losses[-1]:.3f}")
    s = config.sampling
    sampler = HFSampler(model, eos_id=tok.eos_id, pad_id=tok.pad_id, max_new_tokens=s.max_new_tokens,
                        temperature=s.temperature, top_p=s.top_p)  # fmt: skip
    o = config.optim
    optimizer = torch.optim.AdamW(model.parameters(), lr=o.lr, betas=o.betas, weight_decay=o.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, _schedule(config))
    start_eval = evaluate(sampler, tok, task, eval_set, seed=config.seed + 7)
    log(f"held-out success before RL: {start_eval:.3f}")
    order = list(range(len(train_set)))
    rng = random.Random(config.seed)
    cursor = 0
    gs = config.group_size
    adaptive = AdaptiveGroupSize(s.group_size, maximum=gs.max_group_size, threshold=gs.invalid_rate_threshold,
                                 window=gs.window) if gs.adaptive else None  # fmt: skip
    started = time.perf_counter()

    def next_prompts(n):  # the training prompts in a reshuffled order every epoch
        nonlocal cursor
        out = []
        for _ in range(n):
            if cursor % len(order) == 0:
                rng.shuffle(order)
            out.append(train_set[order[cursor % len(order)]])
            cursor += 1
        return out

    with (run_dir / "metrics.jsonl").open("w") as out:
        for step in range(o.steps):
            g = adaptive.group_size if adaptive else s.group_size
            parts, sampled, rounds = [], 0, 0
            while True:
                batch = next_prompts(s.prompts_per_step - sum(len(r.completion_ids) // g for r, _ in parts))
                rollout = sampler.sample([tok.encode(e.prompt, bos=True) for e in batch], g,
                                         seed=config.seed * 1_000_003 + step + rounds * 1_000_000_007)  # fmt: skip
                rewards = [task.reward(tok.decode(c), batch[i // g]) for i, c in enumerate(rollout.completion_ids)]
                sampled += len(batch)
                if gs.dynamic_sampling:  # keep the groups with a gradient signal
                    keep = [k for k in range(len(batch)) if len(set(rewards[k * g : (k + 1) * g])) > 1]
                    rollout, rewards = _groups_of(rollout, rewards, keep)
                if rewards:
                    parts.append((rollout, rewards))
                full = sum(len(r.completion_ids) // g for r, _ in parts) >= s.prompts_per_step
                if not gs.dynamic_sampling or full or rounds >= gs.max_resample_rounds:
                    break
                rounds += 1
            if not parts:
                log(f"step {step:4d}  every sampled group was invalid: no update")
                continue
            rollout, rewards = _concat(parts)
            metrics = grpo_step(model, optimizer, rollout, rewards, loss_options=config.loss.kwargs(),
                                temperature=s.temperature, token_budget=config.packing.token_budget,
                                shared_prefix=config.packing.shared_prefix, num_iterations=o.num_iterations,
                                grad_clip=o.grad_clip)  # fmt: skip
            scheduler.step()
            pass_rates = [sum(rewards[k * g : (k + 1) * g]) / g for k in range(len(rewards) // g)]
            if adaptive:
                adaptive.update(metrics["invalid_group_rate"], pass_rates)
            metrics.update(step=step, lr=scheduler.get_last_lr()[0], elapsed_s=time.perf_counter() - started,
                           group_size=g, prompts_sampled=sampled, resample_rounds=rounds)  # fmt: skip
            out.write(json.dumps(metrics) + "\n")
            out.flush()
            if step % config.logging.log_every == 0 or step == o.steps - 1:
                log(f"step {step:4d}  reward {metrics['reward']:.3f}  invalid {metrics['invalid_group_rate']:.2f}"
                    f"  loss {metrics['loss']:+.4f}  {metrics['train_tokens_per_s']:.0f} tok/s")  # fmt: skip
    final_eval = evaluate(sampler, tok, task, eval_set, seed=config.seed + 7)
    summary = {"eval_success_start": start_eval, "eval_success_end": final_eval, "steps": o.steps,
               "group_size": s.group_size, "seconds": time.perf_counter() - started}  # fmt: skip
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=1))
    log(f"held-out success after {o.steps} steps: {final_eval:.3f} (was {start_eval:.3f})")
    return summary

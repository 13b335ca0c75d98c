"""The GRPO training loop, single process for now: sample G completions per prompt -> rewards -> `grpo_step`
(advantages, packed micro-batches, the fused LM-head loss) -> metrics to `<run_dir>/metrics.jsonl`.

    grpo-kernels train [--config FILE] [--section.field=value ...]

Not yet here (issue 6 continues): FSDP2 across processes, DCP checkpoints and --resume, the vLLM sampler,
adaptive group size and dynamic sampling, real models from a local HF path, plots.
"""

import json
import math
import random
import time
from pathlib import Path

import torch

from .config import TrainConfig, save_config
from .sampler import HFSampler
from .step import grpo_step, sft_warmup
from .tasks import CharTokenizer, make_task, tiny_model

__all__ = ["evaluate", "train"]


def _unsupported(config: TrainConfig) -> None:
    """Options the config accepts but this loop does not run yet: a clear error, never a silent ignore."""
    todo = {
        "model.name": config.model.name != "tiny",
        "sampling.sampler": config.sampling.sampler != "hf",
        "group_size.adaptive": config.group_size.adaptive,
        "group_size.dynamic_sampling": config.group_size.dynamic_sampling,
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
    started = time.perf_counter()
    with (run_dir / "metrics.jsonl").open("w") as out:
        for step in range(o.steps):
            first = (step * s.prompts_per_step) % len(order)
            if first < s.prompts_per_step:
                rng.shuffle(order)
            batch = [train_set[order[(first + k) % len(order)]] for k in range(s.prompts_per_step)]
            rollout = sampler.sample([tok.encode(e.prompt, bos=True) for e in batch], s.group_size,
                                     seed=config.seed * 1_000_003 + step)  # fmt: skip
            rewards = [
                task.reward(tok.decode(c), batch[i // s.group_size]) for i, c in enumerate(rollout.completion_ids)
            ]
            metrics = grpo_step(model, optimizer, rollout, rewards, loss_options=config.loss.kwargs(),
                                temperature=s.temperature, token_budget=config.packing.token_budget,
                                shared_prefix=config.packing.shared_prefix, num_iterations=o.num_iterations,
                                grad_clip=o.grad_clip)  # fmt: skip
            scheduler.step()
            metrics.update(step=step, lr=scheduler.get_last_lr()[0], elapsed_s=time.perf_counter() - started)
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

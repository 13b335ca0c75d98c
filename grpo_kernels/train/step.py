"""One GRPO optimizer step on a rollout, single process: rewards -> advantages -> packed micro-batches -> the fused
LM-head loss -> gradient accumulation -> clip -> optimizer step (repeated num_iterations times on the same rollout).

The loss of the whole step equals grpo_loss on the whole batch: dapo/cispo divide by the step's completion tokens
(num_items_in_batch), grpo/sapo weight each micro-batch by its share of the sequences, bnpo/dr_grpo average the
micro-batches (TRL's gradient-accumulation convention).
"""

import time

import torch

from ..advantages import group_advantages
from ..fused_linear import fused_linear_grpo_loss, fused_linear_logprobs
from ..packing import pack_sequences
from ..planner import plan_micro_batches

__all__ = ["completion_logprobs", "grpo_step"]


def _hidden(model, packed):
    out = model.base_model(**packed.model_kwargs())
    return out.last_hidden_state[0][packed.logit_rows]


def completion_logprobs(model, packed, *, temperature: float) -> torch.Tensor:
    """Per-completion-token log-probs of a packed batch under model (no grad, no logits)."""
    with torch.no_grad():
        h = _hidden(model, packed)
        return fused_linear_logprobs(h, model.get_output_embeddings().weight, packed.completion_ids,
                                     temperature=temperature)  # fmt: skip


def grpo_step(model, optimizer, rollout, rewards, *, loss_options: dict, temperature: float, token_budget: int,
              shared_prefix: bool = False, num_iterations: int = 1, grad_clip: float | None = 1.0,
              use_sampler_logps: bool = False) -> dict:  # fmt: skip
    """Train on one rollout; returns float metrics (reward, invalid-group rate, loss, tokens/s, ...)."""
    start = time.perf_counter()
    g = rollout.group_size
    rewards = torch.as_tensor(rewards, dtype=torch.float32)
    adv = group_advantages(rewards, group_size=g)
    n = len(rollout.completion_ids)
    groups = [i // g for i in range(n)]
    lengths = [len(p) + len(c) for p, c in zip(rollout.prompt_ids, rollout.completion_ids, strict=True)]
    plan = plan_micro_batches(lengths, token_budget=token_budget, group_ids=groups, keep_groups=shared_prefix)
    micro = []
    for samples in plan.micro_batches[0]:
        if not samples:
            continue
        packed = pack_sequences([rollout.prompt_ids[i] for i in samples], [rollout.completion_ids[i] for i in samples],
                                shared_prefix=shared_prefix, group_ids=[groups[i] for i in samples])  # fmt: skip
        sampler = torch.cat([rollout.sampler_logps[i] for i in samples]).float()
        micro.append((samples, packed, sampler))
    total_tokens = sum(int(p.completion_ids.shape[0]) for _, p, _ in micro)
    loss_type = loss_options.get("loss_type", "dapo")
    old = [completion_logprobs(model, p, temperature=temperature) for _, p, _ in micro] if num_iterations > 1 else None
    head = model.get_output_embeddings().weight
    model.train()
    metrics = {}
    for iteration in range(num_iterations):
        optimizer.zero_grad(set_to_none=True)
        step_loss = 0.0
        for k, (samples, packed, sampler) in enumerate(micro):
            kwargs = dict(loss_options)
            if loss_type in ("dapo", "cispo"):
                kwargs["num_items_in_batch"] = total_tokens
            if use_sampler_logps:
                kwargs.update(sampler_logps=sampler, sampler_is_mode=kwargs.get("sampler_is_mode") or "token_truncate")
            else:
                kwargs.pop("sampler_is_mode", None)
            loss, m = fused_linear_grpo_loss(
                _hidden(model, packed), head, packed.completion_ids, adv.advantages[samples],
                old_logps=None if old is None else old[k], cu_seqlens=packed.completion_cu_seqlens,
                temperature=temperature, **kwargs,
            )  # fmt: skip
            weight = {"grpo": len(samples) / n, "sapo": len(samples) / n, "dapo": 1.0, "cispo": 1.0}.get(
                loss_type, 1.0 / len(micro)
            )
            (loss * weight).backward()
            step_loss += loss.detach().item() * weight
            for key, value in m.items():
                metrics[key] = metrics.get(key, 0.0) + float(value) * len(samples) / n / num_iterations
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip or float("inf"))
        optimizer.step()
        metrics["loss" if iteration == 0 else f"loss_iter{iteration}"] = step_loss
    elapsed = time.perf_counter() - start
    metrics.update(
        reward=float(rewards.mean()), invalid_group_rate=float(adv.invalid_fraction), grad_norm=float(norm),
        completion_tokens=total_tokens, micro_batches=len(micro), train_tokens_per_s=sum(lengths) / elapsed,
        completion_length=total_tokens / n,
    )  # fmt: skip
    return metrics


def sft_warmup(model, tokenizer, task, *, steps: int, batch_size: int = 32, lr: float = 3e-3, seed: int = 0) -> list:
    """A short supervised warm start (cross-entropy on prompt -> answer <eos>), so that RL starts from a policy
    that is sometimes right, as real RL does. Returns the loss per step."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    model.train()
    losses = []
    for step in range(steps):
        examples = task.examples(batch_size, seed=seed * 1_000_003 + step)
        prompts = [tokenizer.encode(e.prompt, bos=True) for e in examples]
        answers = [tokenizer.encode(e.answer, eos=True) for e in examples]
        packed = pack_sequences(prompts, answers)
        h = _hidden(model, packed)
        logits = model.get_output_embeddings()(h).float()
        loss = torch.nn.functional.cross_entropy(logits, packed.completion_ids)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        losses.append(loss.detach().item())
    return losses

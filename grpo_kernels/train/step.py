"""One GRPO optimizer step on a rollout: rewards -> advantages -> packed micro-batches -> the fused LM-head loss ->
gradient accumulation -> clip -> optimizer step (repeated num_iterations times on the same rollout).

The loss of the whole step equals grpo_loss on the whole (global) batch: dapo/cispo divide by the step's
completion tokens (num_items_in_batch), grpo/sapo weight each micro-batch by its share of the sequences,
bnpo/dr_grpo average the micro-batches (TRL's gradient-accumulation convention). Under data parallelism every
rank holds the whole rollout (grpo_kernels.train.model.fsdp), so these normalizers are global; each rank runs its own
micro-batches of `plan_micro_batches(..., num_ranks=world)` and an all-zero stand-in where its plan is empty, so
every rank makes the same number of forward/backward calls. Under sequence parallelism (dist.sp = N) the plan is
per data-parallel group with N x token_budget tokens per micro-batch, and each rank of a group runs its contiguous
shard of every packed row (grpo_kernels.sequence_parallel); the loss is the unsharded one on every rank.
"""

import contextlib
import time

import torch

from ..packing import pack_sequences
from ..planner import plan_micro_batches
from .model.fsdp import SINGLE, Dist, all_reduce_max, all_reduce_sum
from .model.lengths import step_metrics
from .model.policy import Policy, completion_logprobs, run_policy
from .rollout.batch import Rollout

__all__ = ["Policy", "completion_logprobs", "grpo_step", "sft_warmup"]


def _micro_batches(rollout, lengths, *, token_budget, shared_prefix, algorithm, dist):
    """[(sample indices, PackedBatch, sampler log-probs)] of this rank; a one-sample stand-in (empty indices)
    where the plan gives this rank nothing. Under sequence parallelism the plan is per data-parallel group, with
    token_budget tokens per rank: token_budget x N per micro-batch, shared by the group's N ranks."""
    groups = rollout.group_ids
    plan = plan_micro_batches(lengths, token_budget=token_budget * dist.sp, group_ids=groups,
                              keep_groups=shared_prefix, num_ranks=dist.dp_world, algorithm=algorithm)  # fmt: skip
    micro = []
    for samples in plan.micro_batches[dist.dp_rank]:
        picked = samples or [0]
        packed = pack_sequences([rollout.prompt_ids[i] for i in picked], [rollout.completion_ids[i] for i in picked],
                                shared_prefix=shared_prefix, group_ids=[groups[i] for i in picked],
                                device=dist.device)  # fmt: skip
        sampler = torch.cat([rollout.sampler_logps[i] for i in picked]).float().to(dist.device)
        micro.append((list(samples), packed, sampler))
    return micro


def grpo_step(policy, optimizer, rollout: Rollout, *, loss_options: dict, temperature: float, token_budget: int,
              shared_prefix: bool = False, num_iterations: int = 1, grad_clip: float | None = 1.0,
              ref_policy=None, compute_old_logps: bool = False, algorithm: str = "karmarkar_karp",
              dist: Dist = SINGLE, autocast_dtype: torch.dtype | None = None) -> dict:  # fmt: skip
    """Train on one scored rollout (the whole batch, identical on every rank; its advantages are the rollout's
    own); returns float metrics (reward, invalid-group rate, loss, tokens/s, ...), identical on every rank.

    The loss and metrics of the micro-batches are summed as (fp64) tensors and read back to the host once, after
    the last optimizer step, so the micro-batch loop never waits for the device.

    policy: a `Policy` (FSDP2-sharded or not) or a bare HF model. ref_policy: the frozen reference when
    loss_options["beta"] > 0. compute_old_logps: also compute the policy's log-probs before the update when
    num_iterations is 1 (for the sampler mismatch metric "sampler_logp_abs_diff"); they are computed anyway for
    num_iterations > 1. loss_options["sampler_is_mode"] turns on the importance-sampling correction with the
    rollout's sampler log-probs. The completions in `rollout.masked` (`Rollout.mask_truncated`: TRL's
    mask_truncated_completions) get a loss mask of 0. The metrics include the length statistics of
    grpo_kernels.train.model.lengths.step_metrics (completion_length_min/median/max, truncated_fraction,
    packing_efficiency)."""
    if not isinstance(policy, Policy):
        policy = Policy(policy)
    if rollout.rewards is None:
        raise ValueError("grpo_step needs a scored rollout: rollout.with_rewards(rewards)")
    start = time.perf_counter()
    adv = rollout.advantages
    n = len(rollout.completion_ids)
    lengths = [len(p) + len(c) for p, c in zip(rollout.prompt_ids, rollout.completion_ids, strict=True)]
    micro = _micro_batches(rollout, lengths, token_budget=token_budget, shared_prefix=shared_prefix,
                           algorithm=algorithm, dist=dist)  # fmt: skip
    total_tokens = sum(len(c) for c in rollout.completion_ids)
    loss_type = loss_options.get("loss_type", "dapo")
    autocast = (torch.autocast(dist.device.type, dtype=autocast_dtype) if autocast_dtype is not None
                else contextlib.nullcontext())  # fmt: skip
    with autocast:
        options = dict(loss_options)
        old = ref = None
        if num_iterations > 1 or compute_old_logps:
            old = [completion_logprobs(policy, p, temperature=temperature, dist=dist) for _, p, _ in micro]
        if options.get("beta", 0.0):
            if ref_policy is None:
                raise ValueError("loss.beta > 0 needs a reference policy")
            ref = [completion_logprobs(ref_policy, p, temperature=temperature, dist=dist) for _, p, _ in micro]
        # Completions masked out of the loss (rollout.masked, e.g. truncated ones): a per-token mask of 0 over them
        # (the stand-in's is all 0), and dapo/cispo/vespo divide by the unmasked tokens (at least 1), as TRL does.
        masked = rollout.masked if rollout.masked is not None and any(rollout.masked) else None
        masks = [None] * len(micro)
        if masked is not None:
            masks = [torch.cat([torch.full((len(rollout.completion_ids[i]),), float(bool(samples) and not masked[i]))
                                for i in samples or [0]]).to(dist.device) for samples, _, _ in micro]  # fmt: skip
        if loss_type in ("dapo", "cispo", "vespo"):
            options["num_items_in_batch"] = total_tokens if masked is None else max(
                1, sum(len(c) for c, out in zip(rollout.completion_ids, masked, strict=True) if not out))
        is_mode = options.pop("sampler_is_mode", None)
        policy.train()
        local = {}  # name -> fp64 tensor on the loss's device, the same sums in the same order as Python floats
        for iteration in range(num_iterations):
            optimizer.zero_grad(set_to_none=True)
            step_loss = None
            for k, (samples, packed, sampler) in enumerate(micro):
                extra = dict(sampler_logps=sampler, sampler_is_mode=is_mode) if is_mode else {}
                if masks[k] is not None:
                    extra["mask"] = masks[k]
                advantages = (adv.advantages[samples] if samples else torch.zeros(1)).to(dist.device)
                loss, m = run_policy(policy, packed, advantages, temperature=temperature, dist=dist,
                               cu_seqlens=packed.completion_cu_seqlens, old_logps=None if old is None else old[k],
                               ref_logps=None if ref is None else ref[k], **options, **extra)  # fmt: skip
                share = len(samples) / n
                weight = {"grpo": share, "sapo": share, "luspo": share, "dapo": 1.0, "cispo": 1.0, "vespo": 1.0}.get(
                    loss_type, 1.0 / (len(micro) * dist.dp_world)
                ) if samples else 0.0  # fmt: skip
                # FSDP2 averages gradients over all ranks; the ranks of a sequence-parallel group each hold a part
                (loss * (weight * dist.world)).backward()
                step_loss = _add(step_loss, loss.detach().double() * weight)
                for key, value in m.items():
                    local[key] = _add(local.get(key), value.detach().double() * share / num_iterations)
            norm = torch.nn.utils.clip_grad_norm_(policy.parameters(), grad_clip or float("inf"))
            optimizer.step()
            local["loss" if iteration == 0 else f"loss_iter{iteration}"] = step_loss
    device = local["loss"].device
    extremes = None
    if old is not None:
        diff = torch.zeros((), dtype=torch.float64, device=device)  # stays 0 when this rank trained on nothing
        ratio_sum = torch.zeros((), dtype=torch.float64, device=device)
        extremes = torch.full((2,), -float("inf"), dtype=torch.float64, device=device)  # max ratio, -min ratio
        for (samples, _, s), o in zip(micro, old, strict=True):
            if samples:
                diff = diff + (o - s).abs().sum().double()
                ratio = torch.exp((o.double() - s.to(o.device).double()).clamp(max=80.0))
                ratio_sum = ratio_sum + ratio.sum()
                if ratio.numel():
                    extremes = torch.maximum(extremes, torch.stack([ratio.max(), -ratio.min()]))
        local["sampler_logp_abs_diff"] = diff / total_tokens
        local["is_ratio_mean"] = ratio_sum / total_tokens  # the trainer's over the sampler's probability per token
        extremes = all_reduce_max(extremes, dist)
    keys = sorted(local)
    tokens = torch.tensor(float(sum(lengths[i] for s, _, _ in micro for i in s)), dtype=torch.float64)
    owner = 1.0 if dist.sp_rank == 0 else 0.0  # a sequence-parallel group's ranks hold the same values: count once
    summed = all_reduce_sum(torch.stack([local[k] for k in keys] + [tokens.to(device)]) * owner, dist)
    norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm
    rewards = rollout.rewards.float().flatten()  # on the host: NaN (unscorable) left out as TRL leaves it out
    rewards = rewards[~rewards.isnan()]
    mean = rewards.mean() if rewards.numel() else rewards.new_tensor(float("nan"))
    reward_std = rewards.std() if rewards.numel() > 1 else rewards.new_tensor(float("nan"))  # unbiased, as TRL's
    same = [norm, mean, reward_std, adv.invalid_fraction]  # identical on every rank
    tail = [] if extremes is None else [extremes]
    host = torch.cat([summed, torch.stack([t.detach().double().to(device) for t in same]), *tail]).tolist()  # 1 sync
    metrics = dict(zip(keys, host[: len(keys)], strict=True))
    tokens, grad_norm, reward, reward_std, invalid_rate = host[len(keys) : len(keys) + 5]
    if extremes is not None:
        metrics.update(is_ratio_max=host[-2], is_ratio_min=-host[-1])
    elapsed = time.perf_counter() - start
    metrics.update(
        reward=reward, reward_std=reward_std, invalid_group_rate=invalid_rate, grad_norm=grad_norm,
        completion_tokens=total_tokens, micro_batches=len(micro), train_tokens_per_s=tokens / elapsed,
        train_step_s=elapsed, completion_length=total_tokens / n, **step_metrics(rollout, token_budget=token_budget,
                                                           micro_batches=len(micro), world=dist.world,
                                                           shared_prefix=shared_prefix),
    )  # fmt: skip
    return metrics


def _add(total: torch.Tensor | None, value: torch.Tensor) -> torch.Tensor:
    """total + value (fp64 tensors), None standing for Python's 0.0 start: the same float64 roundings as the sum of
    Python floats (-0.0 included)."""
    return (value.new_zeros(()) if total is None else total) + value


def sft_warmup(model, tokenizer, task, *, steps: int, batch_size: int = 32, lr: float = 3e-3, seed: int = 0) -> list:
    """A short supervised warm start (cross-entropy on prompt -> answer <eos>), so that RL starts from a policy
    that is sometimes right, as real RL does. Runs before sharding (deterministic, so every rank gets the same
    weights). Returns the loss per step."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    model.train()
    losses = []
    for step in range(steps):
        examples = task.examples(batch_size, seed=seed * 1_000_003 + step)
        prompts = [tokenizer.encode_prompt(e.prompt) for e in examples]
        answers = [tokenizer.encode(e.answer, eos=True) for e in examples]
        packed = pack_sequences(prompts, answers)
        h = model.base_model(**packed.model_kwargs()).last_hidden_state[0][packed.logit_rows]
        logits = model.get_output_embeddings()(h).float()
        loss = torch.nn.functional.cross_entropy(logits, packed.completion_ids)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        losses.append(loss.detach().item())
    return losses

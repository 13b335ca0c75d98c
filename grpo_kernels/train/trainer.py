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
import json
import sys
import time

import torch

from . import preflight
from .build import build, build_policy, make_sampler
from .checkpoint import load_checkpoint, save_checkpoint
from .config import TrainConfig
from .config_io import to_dict
from .fsdp import SINGLE, all_gather_objects, full_state_dict, init_distributed
from .group_size import AdaptiveGroupSize
from .run_files import RunLog, resume_point
from .sampling import HeldOut, collect, held_out, standard_error, with_standard_error
from .step import grpo_step, sft_warmup
from .tasks import PromptStream

__all__ = ["TIMING_METRICS", "train"]

# The metrics that are wall-clock times (a replayed run has every other metric of its steps bit for bit)
TIMING_METRICS = ("elapsed_s", "train_tokens_per_s", "train_step_s", "rollout_generate_s", "weight_sync_s", "reward_s")


def train(config: TrainConfig, *, log=print) -> dict:
    """Run config (on every rank under torchrun); returns the summary also written to <run_dir>/summary.json."""
    d = init_distributed(config.distributed.backend, sequence_parallel=config.distributed.sequence_parallel)
    config = preflight.check(config, d.device.type)  # this host's checks; "auto" dtype and trackers resolved
    run_dir, checkpoint = resume_point(config, d, log)
    torch.manual_seed(config.seed)
    tok, task, train_set, eval_set, model = build(config)
    if not d.is_main:
        log = lambda *a, **k: None  # noqa: E731
    if config.task.sft_warmup_steps and checkpoint is None:
        losses = sft_warmup(model, tok, task, steps=config.task.sft_warmup_steps, seed=config.seed)
        log(f"SFT warm start: {config.task.sft_warmup_steps} steps, loss {losses[0]:.3f} -> {losses[-1]:.3f}")
    model.to(d.device)
    with contextlib.ExitStack() as servers:  # the rollout servers stop on every exit path, the run's files first
        rollouts = None
        if config.sampling.placement == "decoupled":  # rollout servers, started by rank 0; the sampler is rank 0's
            from .decoupled import Decoupled  # imports vLLM (its weight-transfer API): only here

            rollouts = Decoupled.start(config, model, tok, d, run_dir, log)
            servers.callback(rollouts.close)
            sampler = rollouts.sampler
        else:
            sampler = make_sampler(config, model, tok, d)
        servers.callback(task.rewards.close)  # the reward functions' worker processes, if any
        t = config.task
        if rollouts is not None and t.reward_timeout_s and not t.reward_processes:
            log(f"warning: task.reward_timeout_s = {t.reward_timeout_s} bounds no plain reward function here: "
                "decoupled sampling scores in its own thread, where a hung call cannot be stopped (set "
                "task.reward_processes to run them in processes that can)")  # fmt: skip
        run = _Run(config, d, run_dir, tok, task, train_set, eval_set, model, sampler, rollouts, log)
        return run.run(checkpoint)


class _Run:
    """One run after its build: the policy and its optimizer, the prompt stream, the sampler (or the decoupled
    rollouts), and what accumulates between steps. `run` is the loop; each step is a method of its own."""

    def __init__(self, config, d, run_dir, tok, task, train_set, eval_set, model, sampler, rollouts, log):
        self.config, self.d, self.run_dir, self.log, self.say = config, d, run_dir, log, log
        self.tok, self.task, self.eval_set, self.sampler, self.rollouts = tok, task, eval_set, sampler, rollouts
        self.s, self.decoupled, self.pipeline = config.sampling, rollouts is not None, None
        self.policy, self.ref_policy, self.optimizer, self.scheduler = build_policy(config, model, d, log)
        gs = config.group_size
        self.adaptive = AdaptiveGroupSize(self.s.group_size, maximum=gs.max_group_size,
                                          threshold=gs.invalid_rate_threshold,
                                          window=gs.window) if gs.adaptive else None  # fmt: skip
        self.stream, self.first, self.elapsed = PromptStream(train_set, config.seed), 0, 0.0
        if self.decoupled:  # the servers connected, the weight stream checked on the first training example
            example = train_set[0]
            check = (tok.encode_prompt(example.prompt), tok.encode(example.answer, eos=True))
            rollouts.connect(self.policy.model, check)
        self.loss_options = self._loss_options()
        # the mismatch metric needs the old log-probs recomputed
        self.compute_old = self.loss_options.get("sampler_is_mode") is not None or self.s.sampler == "vllm"
        # cumulative over the run (eval.jsonl reports them at every evaluation): completions and their tokens
        # sampled (dynamic sampling's dropped groups and steps without an update included), seconds sampling,
        # training, syncing; num_tokens: prompt + completion tokens of every row trained on (TRL's num_tokens)
        self.totals = {"completions_sampled": 0, "sampled_tokens": 0, "generate_s": 0.0, "train_s": 0.0,
                       "sync_s": 0.0, "num_tokens": 0}  # fmt: skip
        self.start_eval, self.eval_total, self.start_means = float("nan"), 0.0, {}
        self.evaluated = (None, None)  # (step, success) of the latest evaluation in the loop
        self.files = self.bar = None
        self.started = 0.0

    def _loss_options(self) -> dict:
        """The loss's options, plus the entropy metric, and (decoupled, stale rollouts) the sampler correction unless
        loss.sampler_is_mode is set."""
        options = self.config.loss.kwargs()
        if self.d.sp == 1:  # the fused head's mean entropy of the completion tokens, a metric (TRL's "entropy")
            options["return_entropy"] = True
        if self.decoupled:
            if self.s.max_staleness and options.get("sampler_is_mode") is None:
                options["sampler_is_mode"] = "token_truncate"
                self.log(f"sampling.max_staleness = {self.s.max_staleness}: the loss corrects with the sampler's "
                         'log-probs (loss.sampler_is_mode "token_truncate")')  # fmt: skip
        return options

    def run(self, checkpoint) -> dict:
        """The loop from the checkpoint (None: a new run) to optim.steps or task.target_success; the summary."""
        self._resume_or_begin(checkpoint)
        steps, reached = self.config.optim.steps, False
        with contextlib.ExitStack() as resources:  # log files, trackers, bar, pipeline: closed on every exit path
            self._open(resources, resumed=checkpoint is not None)
            for step in range(self.first, steps):
                batch = self._rollout(step)
                metrics = self._update(step, batch)
                self._report(step, metrics, batch["rollout"])
                reached = self._evaluate_if_due(step)
                self._checkpoint_if_due(step, batch["prompt_state"], last=reached)
                if reached:
                    steps = step + 1
                    break
        return self._finish(steps, reached_target=reached)

    def _resume_or_begin(self, checkpoint) -> None:
        """The state saved with the checkpoint, the sampler's weights where they differ from the model's, and the
        held-out success before training (of a new run; a resumed one kept it)."""
        if checkpoint is not None:
            state = load_checkpoint(checkpoint, policy=self.policy, optimizer=self.optimizer,
                                    ref_policy=self.ref_policy, verify=False)  # fmt: skip
            self.first, self.elapsed = state["step"], state["elapsed_s"]
            self.stream.load_state_dict(state)
            self.scheduler.load_state_dict(state["scheduler"])
            if self.adaptive:
                self.adaptive.load_state_dict(state["adaptive"])
            self.start_eval, self.eval_total = state["eval_success_start"], state.get("eval_s_total", 0.0)
            self.totals.update(state.get("totals", {}))
        if checkpoint is not None or self.decoupled:
            synced = self._sync_sampler(self.first)
            if self.decoupled and self.d.is_main:
                self.log(f"weights sent to the rollout servers: {synced['weight_sync_bytes'] / 2**20:.1f} MiB in "
                         f"{synced['weight_sync_s']:.2f} s, log-prob check "
                         f"{synced.get('weight_sync_logp_max_diff', 0):.2e}")  # fmt: skip
        if checkpoint is not None:
            self.log(f"resumed from {checkpoint} at step {self.first}")
        else:
            start = self._evaluate()
            self.start_eval, self.start_means = start.success, start.means
            self.log(f"held-out success before RL: {with_standard_error(self.start_eval, len(self.eval_set))}")

    def _open(self, resources: contextlib.ExitStack, *, resumed: bool) -> None:
        """The run's files and trackers, the progress bar and (decoupled) the rollout pipeline."""
        self.files = RunLog.open(self.config, self.run_dir, self.tok, first=self.first, resumed=resumed, d=self.d,
                                 resources=resources)  # fmt: skip
        if not resumed and len(self.eval_set):
            self.files.before_training({"eval_success": self.start_eval,
                                        "eval_success_se": standard_error(self.start_eval, len(self.eval_set)),
                                        **_eval_means(self.start_means)})  # fmt: skip
        self.bar = _progress(self.config.optim.steps, self.first, enabled=self.d.is_main)
        if self.bar is not None:
            resources.callback(self.bar.close)
            self.say = self.bar.write
        self.started = time.perf_counter() - self.elapsed
        if self.decoupled:  # None on ranks other than 0
            self.pipeline = self.rollouts.pipeline(self._produce, first=self.first, last=self.config.optim.steps)
            if self.pipeline is not None:
                resources.callback(self.pipeline.close)

    def _sync_sampler(self, version: int, *, changed: bool = True) -> dict:
        """The new weights to the sampler (the shared-model HF sampler needs nothing); version: steps done."""
        if self.decoupled:
            if self.pipeline is None:
                return self.rollouts.send(self.policy, version)
            return self.rollouts.update(self.pipeline, self.policy, version, weights=changed)
        if changed and (self.d.distributed or self.s.sampler == "vllm"):
            start = time.perf_counter()
            self.sampler.load_weights(full_state_dict(self.policy.model))
            return {"weight_sync_s": time.perf_counter() - start}
        return {}

    def _evaluate(self) -> HeldOut:
        seed, args = self.config.seed + 7, (self.sampler, self.tok, self.task, self.eval_set)
        if not self.decoupled:
            return held_out(*args, seed=seed, d=self.d)
        result = held_out(*args, seed=seed) if self.d.is_main else None
        return all_gather_objects(result, self.d)[0]

    def _group_size(self) -> int:
        return self.adaptive.group_size if self.adaptive else self.s.group_size

    def _produce(self, step: int) -> dict:
        """Decoupled, rank 0, the sampling thread: the batch of `step`."""
        g = self._group_size()
        self.sampler.versions.clear()
        rollout, sampled, rounds, tokens = collect(self.config, self.sampler, self.tok, self.task, self.stream.take,
                                                   step, g, SINGLE)  # fmt: skip
        item = {"rollout": rollout, "sampled": sampled, "rounds": rounds, "tokens": tokens, "group_size": g,
                "prompt_state": self.stream.state_dict(), "reward_logged": self.task.rewards.take_logged()}  # fmt: skip
        if self.sampler.versions:  # the weight version the servers report for the batch's tokens
            item["version"] = min(self.sampler.versions)
        return item

    def _rollout(self, step: int) -> dict:
        """The step's batch: rollout (None: no group survived), sampled, rounds, tokens, group_size, prompt_state
        (the stream's state after it) and timing."""
        if self.decoupled:
            batch = self.rollouts.get(self.pipeline, step)
            batch["timing"] = {"rollout_staleness": step - batch["version"], "rollout_generate_s": batch["generate_s"],
                               "rollout_wait_s": batch["wait_s"]}  # fmt: skip
        else:
            g, start = self._group_size(), time.perf_counter()
            rollout, sampled, rounds, tokens = collect(self.config, self.sampler, self.tok, self.task,
                                                       self.stream.take, step, g, self.d)  # fmt: skip
            batch = {"rollout": rollout, "sampled": sampled, "rounds": rounds, "tokens": tokens, "group_size": g,
                     "timing": {"rollout_generate_s": time.perf_counter() - start},
                     "prompt_state": self.stream.state_dict(), "reward_logged": self.task.rewards.take_logged()}
        self.totals["completions_sampled"] += batch["sampled"] * batch["group_size"]
        self.totals["sampled_tokens"] += batch["tokens"]
        self.totals["generate_s"] += batch["timing"]["rollout_generate_s"]
        return batch

    def _update(self, step: int, batch: dict) -> dict:
        """The optimizer step on the batch (none when no group survived) and the new weights to the sampler; the
        step's metrics line."""
        rollout, g, sampled = batch["rollout"], batch["group_size"], batch["sampled"]
        if rollout is None:  # a line that says so (no loss, reward or throughput: nothing was trained)
            metrics = {**batch["timing"], **(self._sync_sampler(step + 1, changed=False) or {})}
            metrics.update(no_update=1, invalid_group_rate=1.0)
        else:
            bf16, s, o = self.config.model.dtype == "bfloat16", self.s, self.config.optim
            metrics = grpo_step(self.policy, self.optimizer, rollout, loss_options=self.loss_options,
                                temperature=s.temperature, token_budget=self.config.packing.token_budget,
                                shared_prefix=self.config.packing.shared_prefix, num_iterations=o.num_iterations,
                                grad_clip=o.grad_clip, ref_policy=self.ref_policy, compute_old_logps=self.compute_old,
                                algorithm=self.config.packing.algorithm, dist=self.d,
                                autocast_dtype=torch.bfloat16 if bf16 and not self.d.distributed else None)  # fmt: skip
            self.scheduler.step()
            metrics.update(batch["timing"], **self._sync_sampler(step + 1),
                           invalid_all_zero_rate=rollout.all_zero_fraction())  # fmt: skip
            self.totals["train_s"] += metrics["train_step_s"]
            self.totals["sync_s"] += metrics.get("weight_sync_s", 0.0)
            pairs = zip(rollout.prompt_ids, rollout.completion_ids, strict=True)
            self.totals["num_tokens"] += sum(len(p) + len(c) for p, c in pairs)
            metrics.update(self.task.rewards.metrics(rollout.rewards_per_func),
                           reward_unscorable_fraction=rollout.unscorable_fraction())  # fmt: skip
            if self.adaptive:  # the pass rates of the groups with a scored completion
                self.adaptive.update(metrics["invalid_group_rate"], [p for p in rollout.pass_rates() if p == p])
        metrics.update(batch["reward_logged"])  # reward_s (the scoring's share of rollout_generate_s), log_metric's
        metrics.update(step=step, lr=self.scheduler.get_last_lr()[0], elapsed_s=time.perf_counter() - self.started,
                       group_size=g, prompts_sampled=sampled, resample_rounds=batch["rounds"],
                       completions_sampled=sampled * g, sampled_tokens=batch["tokens"],
                       num_tokens=self.totals["num_tokens"])  # fmt: skip
        return metrics

    def _report(self, step: int, metrics: dict, rollout) -> None:
        """The metrics line, the step's completions (every logging.completions_every steps), the bar, the log."""
        self.files.step(metrics)
        if rollout is None:
            self.say(f"step {step:4d}  every sampled group was invalid: no update")
        else:
            every = self.config.logging.completions_every
            if every and step % every == 0:
                self.files.completions(step, rollout)
            if self.bar is not None:
                self.bar.set_postfix(reward=f"{metrics['reward']:.3f}",
                                     invalid=f"{metrics['invalid_group_rate']:.2f}",
                                     tok_s=f"{metrics['train_tokens_per_s']:.0f}")  # fmt: skip
            if step % self.config.logging.log_every == 0 or step == self.config.optim.steps - 1:
                self.say(f"step {step:4d}  reward {metrics['reward']:.3f}  invalid "
                         f"{metrics['invalid_group_rate']:.2f}  loss {metrics['loss']:+.4f}  "
                         f"{metrics['train_tokens_per_s']:.0f} tok/s")  # fmt: skip
        if self.bar is not None:
            self.bar.update(1)

    def _evaluate_if_due(self, step: int) -> bool:
        """The held-out evaluation every task.eval_every steps and after the last; True when it reached
        task.target_success (training stops)."""
        t, n = self.config.task, len(self.eval_set)
        if not t.eval_every or ((step + 1) % t.eval_every and step + 1 != self.config.optim.steps):
            return False
        start = time.perf_counter()
        result = self._evaluate()
        success, eval_s = result.success, time.perf_counter() - start
        self.eval_total += eval_s
        self.files.evaluation({"step": step, "eval_success": success, "eval_success_se": standard_error(success, n),
                               **_eval_means(result.means), "eval_s": eval_s, "eval_s_total": self.eval_total,
                               **self.totals, "elapsed_s": time.perf_counter() - self.started}, step)  # fmt: skip
        self.say(f"step {step:4d}  held-out success {with_standard_error(success, n)}")
        self.evaluated = (step, success)
        reached = t.target_success is not None and success >= t.target_success
        if reached:
            self.say(f"held-out success {with_standard_error(success, n)} reached task.target_success = "
                     f"{t.target_success} after step {step}: training stops")
        return reached

    def _checkpoint_if_due(self, step: int, prompt_state: dict, *, last: bool) -> None:
        every = self.config.checkpoint.every
        if not every or ((step + 1) % every and step + 1 != self.config.optim.steps and not last):
            return
        state = {"step": step + 1, **prompt_state, "scheduler": self.scheduler.state_dict(),
                 "adaptive": self.adaptive.state_dict() if self.adaptive else None,
                 "eval_success_start": self.start_eval, "eval_s_total": self.eval_total, "totals": dict(self.totals),
                 "elapsed_s": time.perf_counter() - self.started}  # fmt: skip
        save_checkpoint(self.run_dir, step + 1, policy=self.policy, optimizer=self.optimizer,
                        ref_policy=self.ref_policy, trainer_state=state, d=self.d, config=to_dict(self.config),
                        keep=self.config.checkpoint.keep_last)  # fmt: skip

    def _finish(self, steps: int, *, reached_target: bool) -> dict:
        """The final held-out evaluation (the loop's own when it ran after the last step: the weights have not
        changed since), summary.json, and the process group's end."""
        n, s, d = len(self.eval_set), self.s, self.d
        final_eval = self.evaluated[1] if self.evaluated[0] == steps - 1 else self._evaluate().success
        summary = {"eval_success_start": self.start_eval, "eval_success_end": final_eval, "eval_prompts": n,
                   "eval_success_se_start": standard_error(self.start_eval, n),
                   "eval_success_se_end": standard_error(final_eval, n), "steps": steps,
                   "group_size": s.group_size, "world_size": d.world, "seconds": time.perf_counter() - self.started,
                   "eval_s_total": self.eval_total, **self.totals, "target_success": self.config.task.target_success,
                   "reached_target": reached_target}  # fmt: skip
        if d.is_main:
            (self.run_dir / "summary.json").write_text(json.dumps(summary, indent=1))
        self.log(f"held-out success after {steps} steps: {with_standard_error(final_eval, n)} "
                 f"(was {with_standard_error(self.start_eval, n)}; ± one binomial standard error)")
        if d.distributed:
            torch.distributed.barrier()
        if s.sampler == "vllm" and not self.decoupled:
            self.sampler.close()  # vLLM's shutdown also destroys the default process group
        if d.distributed and torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
        return summary


def _eval_means(means: dict) -> dict:
    """Each reward function's held-out mean under TRL's eval name (eval/rewards/<name>/mean in the trackers)."""
    return {f"eval_rewards/{name}/mean": value for name, value in means.items()}


def _progress(total: int, done: int, *, enabled: bool):
    """A tqdm bar on an interactive terminal (rank 0); None otherwise (the log lines carry the metrics)."""
    if not enabled or not sys.stderr.isatty():
        return None
    from tqdm.auto import tqdm

    return tqdm(total=total, initial=done, desc="grpo", unit="step")

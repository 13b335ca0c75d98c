"""The GRPO training loop: sample G completions per prompt -> rewards -> `grpo_step` (advantages, packed
micro-batches, the fused LM-head loss) -> push the new weights to the sampler -> metrics and checkpoints.

    grpo-kernels train [--config FILE] [--section.field=value ...]
    torchrun --nproc_per_node=N -m grpo_kernels.cli train [...]      # FSDP2 data parallel (gloo on CPU)
    grpo-kernels train --resume RUN_DIR                                # continue from its latest checkpoint
    grpo-kernels train --resume RUN_DIR --checkpoint.resume_step=N     # ... from checkpoints/step_N instead

Data parallelism: see grpo_kernels.train.model.fsdp (every rank samples its share of the groups, then all ranks hold
the whole rollout). Group size control: `group_size.adaptive` raises G (grpo_kernels.train.group_size) when the
invalid-group rate of the last steps exceeds the threshold; `group_size.dynamic_sampling` drops invalid groups and
samples more prompts (at most `max_resample_rounds` more rounds) to fill the batch.

Everything that can fail on the configuration or the data (task, model, token budget, TensorBoard) is checked
before the run directory is written. So is the checkpoint a run resumes: verified against its manifest (a damaged
one is an error naming the file, with `checkpoint.resume_step` as the explicit fallback), and its config compared
with the run's (a field that changes the run is an error unless `checkpoint.allow_config_change`).
"""

import contextlib
import dataclasses
import json
import shlex
import sys
import time
from pathlib import Path

import torch

from ..files import write_atomic
from . import preflight
from .build import RunParts, build
from .checkpoint import load_checkpoint, save_checkpoint
from .config import TrainConfig
from .config.io import to_dict
from .config.run import parse_size
from .data.reward_loading import HELD_OUT, RewardError
from .group_size import AdaptiveGroupSize
from .model.export import export_dtype, export_model, model_card
from .model.fsdp import Dist, init_distributed
from .rollout.sampling import HeldOut, standard_error, with_standard_error
from .run_files import RunLog, resume_point
from .step import grpo_step

__all__ = ["TIMING_METRICS", "train"]

# The metrics that are wall-clock times (a replayed run has every other metric of its steps bit for bit)
TIMING_METRICS = ("elapsed_s", "train_tokens_per_s", "train_step_s", "rollout_generate_s", "weight_sync_s", "reward_s")


def train(config: TrainConfig, *, log=print) -> dict:
    """Run config (on every rank under torchrun); returns the summary also written to <run_dir>/summary.json."""
    d = init_distributed(config.distributed.backend, sequence_parallel=config.distributed.sequence_parallel)
    # Every resource of the run on one stack, closed on every exit path in reverse order: the progress bar, the
    # run's files and trackers, then the rollouts (the sampling thread, the vLLM engine, the rollout servers), the
    # reward functions' worker processes, and last the process group.
    with contextlib.ExitStack() as stack:
        stack.callback(_end_process_group, d)
        config = preflight.check(config, d.device.type)  # this host's checks; "auto" dtype and trackers resolved
        run_dir, checkpoint = resume_point(config, d, log)
        torch.manual_seed(config.seed)
        if not d.is_main:
            log = lambda *a, **k: None  # noqa: E731
        parts = build(config, d, resources=stack, run_dir=run_dir, resuming=checkpoint is not None, log=log)
        return _Run(config, d, run_dir, parts, log).run(checkpoint, stack)


def _end_process_group(d: Dist) -> None:
    if d.distributed and torch.distributed.is_initialized():  # (a vLLM engine's shutdown may have ended it)
        torch.distributed.destroy_process_group()


@dataclasses.dataclass(slots=True)
class _HeldOutRecord:
    """The run's held-out evaluations: the one before RL, their seconds in all, the latest one in the loop."""

    start: HeldOut = dataclasses.field(default_factory=lambda: HeldOut(float("nan"), {}))
    seconds: float = 0.0
    latest: tuple = (None, None)  # (step, HeldOut)


class _Run:
    """One run after its build: its parts (`RunParts`: the policy and its optimizer, the rollouts, ...), and what
    accumulates between steps. `run` is the loop; each step is a method of its own."""

    def __init__(self, config, d, run_dir, parts: RunParts, log):
        self.config, self.d, self.run_dir, self.parts, self.log = config, d, run_dir, parts, log
        gs = config.group_size
        self.adaptive = AdaptiveGroupSize(config.sampling.group_size, maximum=gs.max_group_size,
                                          threshold=gs.invalid_rate_threshold,
                                          window=gs.window) if gs.adaptive else None  # fmt: skip
        self.step_options = self._step_options(parts.ref_policy)
        # cumulative over the run (eval.jsonl reports them at every evaluation): completions and their tokens
        # sampled (dynamic sampling's dropped groups and steps without an update included), seconds sampling,
        # training, syncing; num_tokens: prompt + completion tokens of every row trained on (TRL's num_tokens)
        self.totals = {"completions_sampled": 0, "sampled_tokens": 0, "generate_s": 0.0, "train_s": 0.0,
                       "sync_s": 0.0, "num_tokens": 0}  # fmt: skip
        self.held = _HeldOutRecord()
        self.files = self.bar = None
        self.started = 0.0

    def _step_options(self, ref_policy) -> dict:
        """grpo_step's options, the same at every step: the loss's, plus the entropy metric, and (stale rollouts)
        the sampler correction unless loss.sampler_is_mode is set; the reference policy."""
        c, s, options = self.config, self.config.sampling, self.config.loss.kwargs()
        if self.d.sp == 1:  # the fused head's mean entropy of the completion tokens, a metric (TRL's "entropy")
            options["return_entropy"] = True
        if s.max_staleness and options.get("sampler_is_mode") is None:  # (decoupled rollouts only)
            options["sampler_is_mode"] = "token_truncate"
            self.log(f"sampling.max_staleness = {s.max_staleness}: the loss corrects with the sampler's "
                     'log-probs (loss.sampler_is_mode "token_truncate")')  # fmt: skip
        bf16 = c.model.dtype == "bfloat16"
        return {"loss_options": options, "temperature": s.temperature, "token_budget": c.packing.token_budget,
                "shared_prefix": c.packing.shared_prefix, "num_iterations": c.optim.num_iterations,
                "grad_clip": c.optim.grad_clip, "ref_policy": ref_policy,
                # the mismatch metric needs the old log-probs recomputed
                "compute_old_logps": options.get("sampler_is_mode") is not None or s.sampler == "vllm",
                "algorithm": c.packing.algorithm, "dist": self.d,
                "autocast_dtype": torch.bfloat16 if bf16 and not self.d.distributed else None}  # fmt: skip

    def run(self, checkpoint, stack: contextlib.ExitStack) -> dict:
        """The loop from the checkpoint (None: a new run) to optim.steps or task.target_success; the summary.
        What the loop opens (log files, trackers, bar) goes on stack, train()'s."""
        first, elapsed = self._resume_or_begin(checkpoint)
        steps, reached = self.config.optim.steps, False
        self._open(stack, first=first, elapsed=elapsed, resumed=checkpoint is not None)
        for step in range(first, steps):
            batch = self._rollout(step)
            metrics = self._update(step, batch)
            self._report(step, metrics, batch["rollout"])
            reached = self._evaluate_if_due(step)
            self._checkpoint_if_due(step, batch["prompt_state"], last=reached)
            self._export_if_due(step, last=reached)
            if reached:
                steps = step + 1
                break
        if self.bar is not None:
            self.bar.close()  # before the summary's lines (closing it again on the stack does nothing)
        return self._finish(steps, reached_target=reached)

    def _resume_or_begin(self, checkpoint) -> tuple[int, float]:
        """The state saved with the checkpoint, the sampler's weights where they differ from the model's, and the
        held-out success before training (of a new run; a resumed one kept it); (first step, seconds so far)."""
        first, elapsed = 0, 0.0
        if checkpoint is not None:
            state = load_checkpoint(checkpoint, policy=self.parts.policy, optimizer=self.parts.optimizer,
                                    ref_policy=self.step_options["ref_policy"], verify=False)  # fmt: skip
            first, elapsed = state["step"], state["elapsed_s"]
            self.parts.rollouts.stream.load_state_dict(state)
            self.parts.scheduler.load_state_dict(state["scheduler"])
            if self.adaptive:
                self.adaptive.load_state_dict(state["adaptive"])
            n = len(self.parts.eval_set)  # (a checkpoint from before 2026-12 counted every answer, kept no means)
            self.held.start = HeldOut(state["eval_success_start"], state.get("eval_means_start", {}),
                                      state.get("eval_scored_start", n), state.get("eval_unscorable_start", 0))
            self.held.seconds = state.get("eval_s_total", 0.0)
            self.totals.update(state.get("totals", {}))
        self.parts.rollouts.begin(self.parts.policy, version=first, resumed=checkpoint is not None)
        if checkpoint is not None:
            self.log(f"resumed from {checkpoint} at step {first}")
        else:
            self.held.start = self._evaluate("in the held-out evaluation before training")
            self.log(f"held-out success before RL: {_shown(self.held.start)}")
        return first, elapsed

    def _evaluate(self, phase: str) -> HeldOut:
        """A held-out evaluation; a reward function's error in it says which one (phase)."""
        try:
            return self.parts.rollouts.evaluate()
        except RewardError as exc:
            if exc.phase != HELD_OUT:
                raise
            raise exc.in_phase(phase) from exc.__cause__

    def _open(self, stack: contextlib.ExitStack, *, first: int, elapsed: float, resumed: bool) -> None:
        """The run's files and trackers, the progress bar, the rollouts' start."""
        self.files = RunLog.open(self.config, self.run_dir, self.parts.tok, first=first, resumed=resumed, d=self.d,
                                 resources=stack)  # fmt: skip
        start, n = self.held.start, len(self.parts.eval_set)
        if not resumed and n:
            self.files.before_training(_eval_row(start))
        self.bar = _progress(self.config.optim.steps, first, enabled=self.d.is_main)
        if self.bar is not None:
            stack.callback(self.bar.close)
        self.started = time.perf_counter() - elapsed
        self.parts.rollouts.start(first=first, last=self.config.optim.steps, group_size=self._group_size)

    def _say(self, text: str) -> None:
        """A line on the terminal (above the progress bar when there is one)."""
        (self.bar.write if self.bar is not None else self.log)(text)

    def _group_size(self) -> int:
        return self.adaptive.group_size if self.adaptive else self.config.sampling.group_size

    def _rollout(self, step: int) -> dict:
        """The step's batch (see RolloutSource.batch), counted in the totals."""
        batch = self.parts.rollouts.batch(step)
        self.totals["completions_sampled"] += batch["sampled"] * batch["group_size"]
        self.totals["sampled_tokens"] += batch["tokens"]
        self.totals["generate_s"] += batch["timing"]["rollout_generate_s"]
        return batch

    def _update(self, step: int, batch: dict) -> dict:
        """The optimizer step on the batch (none when no group survived) and the new weights to the sampler; the
        step's metrics line."""
        parts, rollout, g, sampled = self.parts, batch["rollout"], batch["group_size"], batch["sampled"]
        if rollout is None:  # a line that says so (no loss, reward or throughput: nothing was trained)
            metrics = {**batch["timing"], **(parts.rollouts.sync(parts.policy, step + 1, changed=False) or {})}
            metrics.update(no_update=1, invalid_group_rate=1.0)
        else:
            metrics = grpo_step(parts.policy, parts.optimizer, rollout, **self.step_options)
            parts.scheduler.step()
            metrics.update(batch["timing"], **parts.rollouts.sync(parts.policy, step + 1),
                           invalid_all_zero_rate=rollout.all_zero_fraction())  # fmt: skip
            self.totals["train_s"] += metrics["train_step_s"]
            self.totals["sync_s"] += metrics.get("weight_sync_s", 0.0)
            pairs = zip(rollout.prompt_ids, rollout.completion_ids, strict=True)
            self.totals["num_tokens"] += sum(len(p) + len(c) for p, c in pairs)
            metrics.update(parts.rewards.metrics(rollout.rewards_per_func),
                           reward_unscorable_fraction=rollout.unscorable_fraction())  # fmt: skip
            if self.adaptive:  # the pass rates of the groups with a scored completion
                self.adaptive.update(metrics["invalid_group_rate"], [p for p in rollout.pass_rates() if p == p])
        metrics.update(batch["reward_logged"])  # reward_s (the scoring's share of rollout_generate_s), log_metric's
        metrics.update(step=step, lr=parts.scheduler.get_last_lr()[0], elapsed_s=time.perf_counter() - self.started,
                       group_size=g, prompts_sampled=sampled, resample_rounds=batch["rounds"],
                       completions_sampled=sampled * g, sampled_tokens=batch["tokens"],
                       num_tokens=self.totals["num_tokens"])  # fmt: skip
        return metrics

    def _report(self, step: int, metrics: dict, rollout) -> None:
        """The metrics line, the step's completions (every logging.completions_every steps), the bar, the log."""
        self.files.step(metrics)
        if rollout is None:
            self._say(f"step {step:4d}  every sampled group was invalid: no update")
        else:
            every = self.config.logging.completions_every
            if every and step % every == 0:
                self.files.completions(step, rollout)
            if self.bar is not None:
                self.bar.set_postfix(reward=f"{metrics['reward']:.3f}",
                                     invalid=f"{metrics['invalid_group_rate']:.2f}",
                                     tok_s=f"{metrics['train_tokens_per_s']:.0f}")  # fmt: skip
            if step % self.config.logging.log_every == 0 or step == self.config.optim.steps - 1:
                self._say(f"step {step:4d}  reward {metrics['reward']:.3f}  invalid "
                          f"{metrics['invalid_group_rate']:.2f}  loss {metrics['loss']:+.4f}  "
                          f"{metrics['train_tokens_per_s']:.0f} tok/s")  # fmt: skip
        if self.bar is not None:
            self.bar.update(1)

    def _evaluate_if_due(self, step: int) -> bool:
        """The held-out evaluation every task.eval_every steps and after the last; True when it reached
        task.target_success (training stops)."""
        t = self.config.task
        if not t.eval_every or ((step + 1) % t.eval_every and step + 1 != self.config.optim.steps):
            return False
        start = time.perf_counter()
        last = step + 1 == self.config.optim.steps
        result = self._evaluate("in the final held-out evaluation" if last else
                                f"in the held-out evaluation after training step {step}")  # fmt: skip
        success, eval_s = result.success, time.perf_counter() - start
        self.held.seconds += eval_s
        self.files.evaluation({"step": step, **_eval_row(result), "eval_s": eval_s, "eval_s_total": self.held.seconds,
                               **self.totals, "elapsed_s": time.perf_counter() - self.started}, step)  # fmt: skip
        self._say(f"step {step:4d}  held-out success {_shown(result)}")
        self.held.latest = (step, result)
        reached = t.target_success is not None and success >= t.target_success
        if reached:
            self._say(f"held-out success {_shown(result)} reached task.target_success = {t.target_success} after "
                      f"step {step}: training stops")  # fmt: skip
        return reached

    def _checkpoint_if_due(self, step: int, prompt_state: dict, *, last: bool) -> None:
        every = self.config.checkpoint.every
        if not every or ((step + 1) % every and step + 1 != self.config.optim.steps and not last):
            return
        state = {"step": step + 1, **prompt_state, "scheduler": self.parts.scheduler.state_dict(),
                 "adaptive": self.adaptive.state_dict() if self.adaptive else None,
                 "eval_success_start": self.held.start.success, "eval_scored_start": self.held.start.scored,
                 "eval_unscorable_start": self.held.start.unscorable, "eval_means_start": self.held.start.means,
                 "eval_s_total": self.held.seconds,
                 "totals": dict(self.totals),
                 "elapsed_s": time.perf_counter() - self.started}  # fmt: skip
        save_checkpoint(self.run_dir, step + 1, policy=self.parts.policy, optimizer=self.parts.optimizer,
                        ref_policy=self.step_options["ref_policy"], trainer_state=state, d=self.d,
                        config=to_dict(self.config), keep=self.config.checkpoint.keep_last)  # fmt: skip

    def _export_if_due(self, step: int, *, last: bool) -> None:
        """<run_dir>/model/ every export.every steps (the end's export writes the last)."""
        every = self.config.export.every
        if every and (step + 1) % every == 0 and step + 1 != self.config.optim.steps and not last:
            self._export()

    def _export(self, summary: dict | None = None) -> Path:
        """The policy as a Hugging Face directory, <run_dir>/model/ (every rank: the shards are gathered)."""
        e, parts = self.config.export, self.parts
        card = model_card(self.config, summary or {}, rewards=parts.rewards, tok=parts.tok,
                          command=_command())  # fmt: skip
        return export_model(parts.policy.model, parts.tok, self.run_dir / "model", dtype=export_dtype(self.config),
                            max_shard_bytes=parse_size(e.max_shard_size), card=card, stop_ids=parts.tok.stop_ids,
                            d=self.d)  # fmt: skip

    def _finish(self, steps: int, *, reached_target: bool) -> dict:
        """The final held-out evaluation (the loop's own when it ran after the last step: the weights have not
        changed since) and summary.json; then every rank waits for the others (train()'s stack closes the rest:
        a vLLM engine's shutdown ends the process group)."""
        n, d, start = len(self.parts.eval_set), self.d, self.held.start
        latest_step, latest = self.held.latest
        end = latest if latest_step == steps - 1 else self._evaluate("in the final held-out evaluation")
        summary = {"eval_success_start": start.success, "eval_success_end": end.success, "eval_prompts": n,
                   "eval_success_se_start": standard_error(start.success, start.scored),
                   "eval_success_se_end": standard_error(end.success, end.scored),
                   "eval_scored_start": start.scored, "eval_scored_end": end.scored,
                   "eval_unscorable_start": start.unscorable, "eval_unscorable_end": end.unscorable,
                   "eval_rewards_start": start.means, "eval_rewards_end": end.means, "steps": steps,
                   "group_size": self.config.sampling.group_size, "world_size": d.world,
                   "seconds": time.perf_counter() - self.started, "eval_s_total": self.held.seconds, **self.totals,
                   "target_success": self.config.task.target_success, "reached_target": reached_target}  # fmt: skip
        if self.config.export.at_end:
            self.log(f"model: {self._export(summary)}")
        if d.is_main:
            write_atomic(self.run_dir / "summary.json", json.dumps(summary, indent=1))
        self.log(f"held-out success after {steps} steps: {_shown(end)} (was {_shown(start)}; ± one binomial "
                 "standard error)")
        if d.distributed:
            torch.distributed.barrier()
        return summary


def _command() -> str:
    """The command line that started this process, as a user would type it."""
    name = Path(sys.argv[0]).name
    return shlex.join(["grpo-kernels" if name in ("cli.py", "__main__.py") else name, *sys.argv[1:]])


def _eval_row(result: HeldOut) -> dict:
    """A held-out evaluation's line (eval.jsonl, the trackers): success with its standard error over the answers
    scored, how many were scored and left out (unscorable), and each reward function's mean under TRL's eval name
    (eval/rewards/<name>/mean in the trackers)."""
    return {"eval_success": result.success, "eval_success_se": standard_error(result.success, result.scored),
            "eval_scored": result.scored, "eval_unscorable": result.unscorable,
            **{f"eval_rewards/{name}/mean": value for name, value in result.means.items()}}  # fmt: skip


def _shown(result: HeldOut) -> str:
    """A held-out success as the log shows it: ± its standard error, and the unscorable answers left out."""
    return with_standard_error(result.success, result.scored, unscorable=result.unscorable)


def _progress(total: int, done: int, *, enabled: bool):
    """A tqdm bar on an interactive terminal (rank 0); None otherwise (the log lines carry the metrics)."""
    if not enabled or not sys.stderr.isatty():
        return None
    from tqdm.auto import tqdm

    return tqdm(total=total, initial=done, desc="grpo", unit="step")

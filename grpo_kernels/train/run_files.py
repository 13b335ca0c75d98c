"""A run's directory: checked writable before anything is written, the checkpoint a run resumes (verified, its
config compared), and what the main rank writes beside the checkpoints: config.toml, metrics.jsonl (a line per
step), eval.jsonl (a line per held-out evaluation), completions.jsonl, and the trackers.

A resumed run keeps the lines of the steps before its checkpoint and drops the rest."""

import contextlib
import dataclasses
import json
import os
import tempfile
from pathlib import Path

from .checkpoint import CheckpointError, config_changes, latest_checkpoint, list_checkpoints, verify_checkpoint
from .config import TrainConfig
from .config.io import save_config, to_dict
from .model.fsdp import Dist, all_gather_objects
from .rollout.batch import Rollout
from .tracking import Trackers

__all__ = ["RunLog", "check_run_dir", "log_file", "resume_point"]


def resume_point(config: TrainConfig, d: Dist, log) -> tuple[Path, Path | None]:
    """(run directory, checkpoint to resume or None). The directory is checked writable (logging.run_dir, or
    checkpoint.resume's); a new run refuses one that holds checkpoints, a resumed run one without."""
    resume = config.checkpoint.resume
    run_dir = Path(resume or config.logging.run_dir)
    check_run_dir(run_dir, "checkpoint.resume" if resume else "logging.run_dir", d)
    checkpoint = latest_checkpoint(run_dir)
    if resume and checkpoint is None:
        raise ValueError(f"checkpoint.resume: no checkpoint in {run_dir}/checkpoints")
    if not resume and checkpoint is not None:
        raise ValueError(f"logging.run_dir {run_dir} holds checkpoints of an earlier run: resume it (--resume "
                         f"{run_dir}) or choose another run_dir")  # fmt: skip
    if resume:
        checkpoint = _verified_checkpoint(config, run_dir, d, log)
    return run_dir, checkpoint


def check_run_dir(run_dir: Path, option: str, d: Dist) -> None:
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


def log_file(path: Path, kept: list):
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


class RunLog:
    """The run's log files and trackers (the main rank's; every method does nothing on the others)."""

    def __init__(self, tok, metrics=None, evals=None, texts=None, trackers=None):
        self.tok, self.metrics, self.evals, self.texts, self.trackers = tok, metrics, evals, texts, trackers

    @classmethod
    def open(cls, config: TrainConfig, run_dir: Path, tok, *, first: int, resumed: bool, d: Dist,
             resources: contextlib.ExitStack) -> "RunLog":  # fmt: skip
        """Writes config.toml (resumable as it is: without the resume step or the one-off permission to change
        the config) and opens the rest, each registered with resources as it opens."""
        if not d.is_main:
            return cls(tok)
        run_dir.mkdir(parents=True, exist_ok=True)
        once = dataclasses.replace(config.checkpoint, resume_step=None, allow_config_change=False)
        save_config(dataclasses.replace(config, checkpoint=once), run_dir / "config.toml")
        lg = config.logging
        trackers = Trackers.start(run_dir, lg.report_to, settings=to_dict(config), project=lg.project,
                                  run_name=lg.run_name, resume=resumed)  # fmt: skip
        if trackers is not None:
            resources.callback(trackers.close)

        def opened(name: str, wanted: bool):
            if not wanted:
                return None
            path = run_dir / name
            kept = [line for line in path.read_text().splitlines() if json.loads(line)["step"] < first] \
                if resumed and path.exists() else []  # fmt: skip
            return resources.enter_context(log_file(path, kept))

        return cls(tok, opened("metrics.jsonl", True), opened("eval.jsonl", bool(config.task.eval_every)),
                   opened("completions.jsonl", bool(lg.completions_every)), trackers)  # fmt: skip

    def step(self, metrics: dict) -> None:
        """One metrics.jsonl line, and the trackers'."""
        _write_line(self.metrics, metrics)
        if self.trackers is not None:
            self.trackers.log(metrics, metrics["step"])

    def before_training(self, row: dict) -> None:
        """The held-out evaluation before the first step: the trackers' (at global step 0), not eval.jsonl's."""
        if self.trackers is not None:
            self.trackers.log_eval(row, -1)

    def evaluation(self, row: dict, step: int) -> None:
        """One eval.jsonl line, and the trackers'."""
        _write_line(self.evals, row)
        if self.trackers is not None:
            self.trackers.log_eval(row, step)

    def completions(self, step: int, rollout: Rollout) -> None:
        if self.texts is not None:
            _write_completions(self.texts, step, rollout, self.tok)


def _write_line(file, row: dict) -> None:
    if file is not None:
        file.write(json.dumps(row) + "\n")
        file.flush()

"""Checkpoints of a run: `<run_dir>/checkpoints/step_<N>/`, N = the number of finished steps.

The model, the optimizer and (beta > 0) the reference model go through torch.distributed.checkpoint (DCP): each
rank writes its own shards, and a run can be resumed on another number of ranks. The trainer's own state (data
order, the prompt RNG, the LR schedule, the adaptive group size, the starting evaluation) is a JSON file beside
them. A checkpoint is written to a hidden temporary directory and renamed when complete, so a run killed while
saving leaves the previous checkpoint as the latest.
"""

import contextlib
import json
import shutil
import warnings
from pathlib import Path

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)

from .fsdp import Dist

__all__ = ["latest_checkpoint", "load_checkpoint", "save_checkpoint"]

STATE_FILE = "trainer_state.json"


@contextlib.contextmanager
def _quiet():
    """DCP warns that it runs in a single process when there is no process group: that is intended here."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def _barrier(d: Dist) -> None:
    if d.distributed:
        dist.barrier()


def _states(policy, optimizer, ref_policy):
    model, optim = get_state_dict(policy, optimizer)
    states = {"model": model, "optim": optim}
    if ref_policy is not None:
        states["ref"] = get_model_state_dict(ref_policy)
    return states


def save_checkpoint(run_dir, step: int, *, policy, optimizer, ref_policy, trainer_state: dict, d: Dist) -> Path:
    """Write checkpoints/step_<step> (a collective: every rank calls it); returns its path."""
    root = Path(run_dir) / "checkpoints"
    final, tmp = root / f"step_{step}", root / f".step_{step}.tmp"
    if d.is_main:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    _barrier(d)
    with _quiet():
        dcp.save(_states(policy, optimizer, ref_policy), checkpoint_id=str(tmp), no_dist=not d.distributed)
    if d.is_main:
        (tmp / STATE_FILE).write_text(json.dumps(trainer_state))
        shutil.rmtree(final, ignore_errors=True)
        tmp.rename(final)
    _barrier(d)
    return final


def latest_checkpoint(run_dir) -> Path | None:
    """The complete checkpoint with the most steps in run_dir, or None."""
    root = Path(run_dir) / "checkpoints"
    done = [p for p in root.glob("step_*") if (p / STATE_FILE).exists()] if root.is_dir() else []
    return max(done, key=lambda p: int(p.name.split("_")[1]), default=None)


def load_checkpoint(path, *, policy, optimizer, ref_policy) -> dict:
    """Load a checkpoint into the (already sharded) policy, optimizer and reference; returns the trainer state."""
    path = Path(path)
    states = _states(policy, optimizer, ref_policy)
    with _quiet():
        dcp.load(states, checkpoint_id=str(path), no_dist=not dist.is_initialized())
    set_state_dict(policy, optimizer, model_state_dict=states["model"], optim_state_dict=states["optim"])
    if ref_policy is not None:
        set_model_state_dict(ref_policy, states["ref"])
    return json.loads((path / STATE_FILE).read_text())

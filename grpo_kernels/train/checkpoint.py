"""Checkpoints of a run: `<run_dir>/checkpoints/step_<N>/`, N = the number of finished steps.

The model, the optimizer and (beta > 0) the reference model go through torch.distributed.checkpoint (DCP): each
rank writes its own shards, and a run can be resumed on another number of ranks. The trainer's own state (data
order, the prompt RNG, the LR schedule, the adaptive group size, the starting evaluation) is a JSON file beside
them. Last comes `manifest.json`: the step, the size and sha256 of every other file, the run's config, and a
sha256 of the manifest itself. A checkpoint is written to a hidden temporary directory and renamed when complete
(files fsynced first), so a run killed while saving leaves the previous checkpoint as the latest.

Resuming verifies the checkpoint against its manifest first (`verify_checkpoint`): a missing, truncated or altered
file, a damaged manifest or a trainer state of another step is a `CheckpointError`, one line naming the file and the
explicit fallback (`checkpoint.resume_step`, the previous checkpoint); nothing falls back on its own.
`config_changes` lists the fields in which a config differs from the one a checkpoint was saved with, except the
ones in `RUN_NEUTRAL_FIELDS`, which do not change the run.
"""

import contextlib
import hashlib
import json
import os
import shutil
import warnings
from pathlib import Path

import torch.distributed as dist

from ..files import write_atomic
from .model.fsdp import Dist

# torch.distributed.checkpoint is imported where a checkpoint is saved or loaded, not with this module: it pulls in
# DTensor and sympy (~1.7 s of CPU), which every `grpo-kernels train` process paid at start-up, checkpointing or not.

__all__ = [
    "RUN_NEUTRAL_FIELDS", "CheckpointError", "config_changes", "list_checkpoints", "latest_checkpoint",
    "load_checkpoint", "load_policy_weights", "save_checkpoint", "verify_checkpoint",
]  # fmt: skip

STATE_FILE = "trainer_state.json"
MANIFEST = "manifest.json"
FORMAT = 1

RUN_NEUTRAL_FIELDS = (
    "logging.run_dir", "logging.log_every", "logging.tensorboard", "logging.report_to", "logging.project",
    "logging.run_name", "checkpoint.every", "checkpoint.keep_last", "export.at_end", "export.every", "export.dtype",
    "export.max_shard_size",
    "checkpoint.resume",
    "checkpoint.resume_step", "checkpoint.allow_config_change", "distributed.backend", "distributed.sequence_parallel",
    "model.activation_checkpointing", "model.activation_memory_gb", "model.mlp_tile_tokens",
)  # fmt: skip
"""Config fields that may change on resume without changing the run: where it lives, what it logs, how often it
checkpoints, how it resumes, the collective backend and the sequence-parallel layout (like the number of ranks,
which is not in the config), and activation checkpointing and MLP tiling (the same values, recomputed instead of
kept)."""


class CheckpointError(ValueError):
    """A checkpoint that cannot be resumed: missing, damaged or inconsistent (a one-line message)."""


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
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict

    model, optim = get_state_dict(policy, optimizer)
    states = {"model": model, "optim": optim}
    if ref_policy is not None:
        states["ref"] = get_model_state_dict(ref_policy)
    return states


def _sha256(path: Path, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _manifest_digest(manifest: dict) -> str:
    body = {k: v for k, v in manifest.items() if k != "sha256"}
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


def _write_manifest(directory: Path, step: int, config: dict | None) -> None:
    """directory/manifest.json for the files now in directory (fsynced first), written atomically."""
    files = {}
    for f in sorted(p for p in directory.rglob("*") if p.is_file() and p.name not in (MANIFEST, MANIFEST + ".tmp")):
        with open(f, "rb") as fh:  # DCP syncs its own files; this also covers the trainer state
            os.fsync(fh.fileno())
        files[f.relative_to(directory).as_posix()] = {"size": f.stat().st_size, "sha256": _sha256(f)}
    manifest = {"format": FORMAT, "step": step, "files": files, "config": config}
    manifest["sha256"] = _manifest_digest(manifest)
    write_atomic(directory / MANIFEST, json.dumps(manifest, indent=1))


def save_checkpoint(run_dir, step: int, *, policy, optimizer, ref_policy, trainer_state: dict, d: Dist,
                    config: dict | None = None, keep: int = 0) -> Path:  # fmt: skip
    """Write checkpoints/step_<step> (a collective: every rank calls it); returns its path. config (the run's
    `to_dict(config)`) goes into the manifest, for `config_changes` on resume. keep >= 1: afterwards only the keep
    newest checkpoints up to this step remain (this one included; later steps, left by a resume from an earlier
    checkpoint, are not touched); 0 keeps every checkpoint."""
    root = Path(run_dir) / "checkpoints"
    final, tmp, old = root / f"step_{step}", root / f".step_{step}.tmp", root / f".step_{step}.old"
    if d.is_main:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    _barrier(d)
    import torch.distributed.checkpoint as dcp

    with _quiet():
        dcp.save(_states(policy, optimizer, ref_policy), checkpoint_id=str(tmp), no_dist=not d.distributed)
    if d.is_main:
        (tmp / STATE_FILE).write_text(json.dumps(trainer_state))
        _write_manifest(tmp, step, config)  # the last file: a checkpoint without a valid manifest is incomplete
        if final.exists():  # a step saved again (after resuming from an earlier checkpoint): rename, then delete
            shutil.rmtree(old, ignore_errors=True)
            final.rename(old)
        tmp.rename(final)
        _fsync_dir(root)
        shutil.rmtree(old, ignore_errors=True)
        if keep:
            for path in [p for p in list_checkpoints(run_dir) if _step_of(p) <= step][:-keep]:
                shutil.rmtree(path)
    _barrier(d)
    return final


def _step_of(path: Path) -> int | None:
    name = path.name
    return int(name[5:]) if name.startswith("step_") and name[5:].isdigit() else None


def list_checkpoints(run_dir) -> list[Path]:
    """The checkpoint directories (`checkpoints/step_<N>`) of run_dir, by step; not verified."""
    root = Path(run_dir) / "checkpoints"
    found = [p for p in root.iterdir() if p.is_dir() and _step_of(p) is not None] if root.is_dir() else []
    return sorted(found, key=_step_of)


def latest_checkpoint(run_dir) -> Path | None:
    """The checkpoint of run_dir with the most steps, or None. A checkpoint directory appears complete (renamed
    from its temporary directory); `verify_checkpoint` tells whether it is still intact."""
    found = list_checkpoints(run_dir)
    return found[-1] if found else None


def _fallback(path: Path) -> str:
    step = _step_of(path)
    earlier = [_step_of(p) for p in list_checkpoints(path.parent.parent) if step is not None and _step_of(p) < step]
    if earlier:
        return f"to resume from the previous checkpoint instead, add --checkpoint.resume_step={earlier[-1]}"
    return "there is no earlier checkpoint to fall back to"


def verify_checkpoint(path) -> dict:
    """The manifest of the checkpoint directory `path` after checking every file against it (size, sha256) and the
    step of the directory, the manifest and the trainer state; CheckpointError (one line naming the damaged file
    and the fallback) otherwise."""
    path = Path(path)

    def damaged(file: Path, problem: str):
        return CheckpointError(f"damaged checkpoint: {file} {problem}; {_fallback(path)}")

    where = path / MANIFEST
    try:
        manifest = json.loads(where.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise damaged(where, "is missing (an incomplete checkpoint, or one written without checksums)") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise damaged(where, f"cannot be read ({exc})") from None
    if not isinstance(manifest, dict) or manifest.get("sha256") != _manifest_digest(manifest):
        raise damaged(where, "does not match its own sha256")
    if manifest.get("format") != FORMAT:
        raise damaged(where, f"has format {manifest.get('format')!r}, expected {FORMAT}")
    step, files = manifest.get("step"), manifest.get("files")
    if not isinstance(step, int) or not isinstance(files, dict) or STATE_FILE not in files:
        raise damaged(where, f"lacks the step or the list of files (with {STATE_FILE})")
    if _step_of(path) not in (None, step):
        raise damaged(where, f"was written for step {step}, but the directory is {path.name}")
    for name, entry in files.items():
        file = path / name
        if not file.is_file():
            raise damaged(file, "is missing")
        size = file.stat().st_size
        if size != entry["size"]:
            how = "is truncated" if size < entry["size"] else "is too long"
            raise damaged(file, f"{how} ({size} bytes, the manifest says {entry['size']})")
        if _sha256(file) != entry["sha256"]:
            raise damaged(file, "does not match its sha256 in the manifest (altered bytes)")
    state_file = path / STATE_FILE
    try:
        state_step = json.loads(state_file.read_text(encoding="utf-8")).get("step")
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, AttributeError) as exc:
        raise damaged(state_file, f"cannot be read ({exc})") from None
    if state_step != step:
        raise damaged(state_file, f"names step {state_step!r}, but the checkpoint is of step {step}")
    return manifest


def _flat(config: dict) -> dict:
    out = {}
    for key, value in config.items():
        if isinstance(value, dict):
            out.update({f"{key}.{k}": v for k, v in value.items()})
        else:
            out[key] = value
    return out


def config_changes(saved: dict, current: dict) -> list[str]:
    """["section.field old -> new", ...]: the fields (present in both `to_dict` configs) in which current differs
    from saved, except RUN_NEUTRAL_FIELDS."""
    a, b = _flat(saved), _flat(current)
    return [f"{k} {a[k]!r} -> {b[k]!r}" for k in a if k in b and a[k] != b[k] and k not in RUN_NEUTRAL_FIELDS]


def load_policy_weights(path, policy) -> None:
    """Load only the policy's weights of a checkpoint into `policy` (sharded or not: DCP reshards what the ranks of
    the run that saved it wrote); the caller verifies the checkpoint."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

    state = {"model": get_model_state_dict(policy)}
    with _quiet():
        dcp.load(state, checkpoint_id=str(Path(path)), no_dist=not dist.is_initialized())
    set_model_state_dict(policy, state["model"])


def load_checkpoint(path, *, policy, optimizer, ref_policy, verify: bool = True) -> dict:
    """Load a checkpoint into the (already sharded) policy, optimizer and reference; returns the trainer state.
    verify: check it with `verify_checkpoint` first (on every rank; the trainer verifies once, on rank 0)."""
    path = Path(path)
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_state_dict

    if verify:
        verify_checkpoint(path)
    states = _states(policy, optimizer, ref_policy)
    with _quiet():
        dcp.load(states, checkpoint_id=str(path), no_dist=not dist.is_initialized())
    set_state_dict(policy, optimizer, model_state_dict=states["model"], optim_state_dict=states["optim"])
    if ref_policy is not None:
        set_model_state_dict(ref_policy, states["ref"])
    return json.loads((path / STATE_FILE).read_text())

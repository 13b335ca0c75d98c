"""Any checkpoint of a run as a Hugging Face directory, on one process, whatever the world size and sequence-parallel
degree of the run that wrote it:

    grpo-kernels export RUN_DIR OUT [--step N]        # the latest checkpoint, or checkpoints/step_N
    grpo-kernels export RUN_DIR/checkpoints/step_N OUT

The checkpoint is verified against its manifest first (the messages of `--resume`); the model is built from the
config it was saved with (the converters applied, as the run built it), its policy weights loaded (DCP reshards
them to one process), and written as the run's own `export` section says (dtype, shards) with the model card.
--base-model PATH replaces the base model the config names (moved, or on another machine).
"""

import json
import os
import warnings
from pathlib import Path

from .build import load
from .checkpoint import MANIFEST, STATE_FILE, list_checkpoints, load_policy_weights, verify_checkpoint
from .config.io import load_config
from .config.run import parse_size
from .model.converters import apply_converters, make_converter
from .model.export import export_dtype, export_model, model_card
from .model.known import KNOWN_MODELS
from .model.policy import Policy
from .rollout.sampling import standard_error

__all__ = ["check_target", "export_checkpoint", "find_checkpoint"]


def find_checkpoint(source, step: int | None = None) -> tuple[Path, Path]:
    """(run directory, checkpoint directory) of a run directory (its latest checkpoint, or step_<step>) or of a
    checkpoint directory; ValueError naming what is missing."""
    source = Path(source)
    if (source / MANIFEST).is_file():
        if step is not None:
            raise ValueError(f"{source} is a checkpoint already: --step picks one of a run directory's")
        return source.parent.parent, source
    found = list_checkpoints(source)
    if not found:
        raise ValueError(f"{source} is neither a checkpoint nor a run directory with checkpoints "
                         "(checkpoint.every writes them)")  # fmt: skip
    if step is None:
        return source, found[-1]
    chosen = source / "checkpoints" / f"step_{step}"
    if chosen not in found:
        raise ValueError(f"--step: no checkpoint step_{step} in {source}/checkpoints (there are: "
                         f"{', '.join(p.name for p in found)})")  # fmt: skip
    return source, chosen


def check_target(out: Path, checkpoint: Path, *, overwrite: bool) -> None:
    """ValueError (one line) for an export target inside the run's checkpoints, not empty (without overwrite), or
    not writable."""
    out = out.resolve()
    checkpoints = checkpoint.resolve().parent
    if out == checkpoints or checkpoints in out.parents:
        raise ValueError(f"{out} is inside the run's checkpoints ({checkpoints}): export elsewhere")
    if out.exists() and (not out.is_dir() or any(out.iterdir())) and not overwrite:
        raise ValueError(f"{out} exists and is not empty: choose another directory or add --overwrite")
    existing = out
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir() or not os.access(existing, os.W_OK | os.X_OK):
        raise ValueError(f"{out} cannot be written: no write permission on {existing}")


def export_checkpoint(source, out, *, step: int | None = None, command: str = "", overwrite: bool = False,
                      base_model: str | None = None) -> Path:  # fmt: skip
    """Write the checkpoint's policy as a Hugging Face directory at `out` (see the module); returns `out`.
    base_model: the base model's directory instead of the one the checkpoint's config names (moved, or written on
    another machine): it gives the architecture and the tokenizer, the checkpoint the weights."""
    run_dir, checkpoint = find_checkpoint(source, step)
    check_target(Path(out), checkpoint, overwrite=overwrite)
    saved = verify_checkpoint(checkpoint)["config"]
    if not saved:
        raise ValueError(f"{checkpoint}/{MANIFEST} holds no config: export needs the config the run saved it with")
    if base_model is not None:
        saved = {**saved, "model": {**saved.get("model", {}), "name": str(base_model)}}
    _check_base_model(saved.get("model", {}).get("name", "tiny"), checkpoint, given=base_model is not None)
    with warnings.catch_warnings():  # (the run's own warnings, given when it started)
        warnings.simplefilter("ignore")
        config = load_config(None, saved)
    inputs = load(config)
    model = apply_converters(inputs.model, config, [make_converter(spec) for spec in config.model.converters])
    _load_weights(checkpoint, Policy(model), config.model.name)
    state = json.loads((checkpoint / STATE_FILE).read_text())
    summary = _held_out(run_dir, state, len(inputs.eval_set))
    card = model_card(config, summary, rewards=inputs.rewards, tok=inputs.tok, command=command,
                      source=str(checkpoint))  # fmt: skip
    return export_model(model, inputs.tok, out, dtype=export_dtype(config),
                        max_shard_bytes=parse_size(config.export.max_shard_size), card=card,
                        stop_ids=inputs.tok.stop_ids)  # fmt: skip


def _load_weights(checkpoint: Path, policy: Policy, base: str) -> None:
    """load_policy_weights, with a checkpoint that does not fit the base model's architecture as one line."""
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        load_policy_weights(checkpoint, policy)
    except CheckpointException as exc:  # (a BaseException: DCP's wrapper of each rank's error)
        causes = [failure[0] if isinstance(failure, tuple) else failure for failure in exc.failures.values()]
        first = str(causes[0]).strip().splitlines()[0] if causes else str(exc)
        raise ValueError(f"the weights of {checkpoint} do not fit the base model {base}: {first}") from None


def _check_base_model(name: str, checkpoint: Path, *, given: bool) -> None:
    """ValueError (one line) when the base model is neither the built-in tiny one, a known name nor a directory."""
    if name == "tiny" or name in KNOWN_MODELS or Path(name).is_dir():
        return
    if given:
        raise ValueError(f"--base-model {name}: no such directory")
    raise ValueError(f"the base model {name}, named in the config of {checkpoint}, cannot be found (the checkpoint "
                     "holds the trained weights, the base model's directory the architecture and the tokenizer): "
                     "point to it with --base-model PATH")  # fmt: skip


def _held_out(run_dir: Path, state: dict, n: int) -> dict:
    """The card's numbers for a checkpoint after state["step"] steps: held-out success before RL (the trainer state
    keeps it) and, when the run evaluated after that step (eval.jsonl), after it; each with its standard error over
    the answers scored and how many were left out, unscorable (a run from before 2026-12 scored all n)."""
    steps, start = state["step"], state.get("eval_success_start", float("nan"))
    scored = state.get("eval_scored_start", n)
    out = {"steps": steps, "eval_prompts": n, "eval_success_start": start,
           "eval_success_se_start": standard_error(start, scored), "eval_scored_start": scored,
           "eval_unscorable_start": state.get("eval_unscorable_start", 0)}  # fmt: skip
    evals = run_dir / "eval.jsonl"
    rows = [json.loads(line) for line in evals.read_text().splitlines() if line.strip()] if evals.is_file() else []
    at = [r for r in rows if r.get("step") == steps - 1]
    if at:
        end, scored = at[-1]["eval_success"], at[-1].get("eval_scored", n)
        out.update(eval_success_end=end, eval_success_se_end=standard_error(end, scored), eval_scored_end=scored,
                   eval_unscorable_end=at[-1].get("eval_unscorable", 0))  # fmt: skip
    return out

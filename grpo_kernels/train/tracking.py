"""Experiment tracking as TRL users know it: `logging.report_to = ["tensorboard", "wandb", "trackio"]` (or "all":
those installed).

    trackers = Trackers.start(run_dir, report_to, settings=to_dict(config), project="grpo-kernels")  # None: none named
    trackers.log(step_metrics, step)       # every metrics line (main rank)
    trackers.log_eval(eval_row, step)      # every held-out evaluation
    trackers.close()

What a TRL user sees in TensorBoard, W&B or Trackio after `GRPOTrainer(..., report_to=...)` is what transformers'
callbacks write: every scalar of a log under "train/<name>" (evaluations under "eval/<name>"), against
"train/global_step", the number of optimizer steps done (1 after the first step). Here the same: a metrics line of
step k (0-based, as metrics.jsonl counts) is logged at global step k + 1, and the quantities that TRL's
GRPOTrainer also logs carry its names (`TRL_NAMES`): reward, reward_std (the unbiased std of the step's rewards),
frac_reward_zero_std (the invalid-group rate: groups whose rewards are all equal), kl, entropy (the mean over the
completion tokens, when the run computes it), clip_ratio/*, completions/mean_length, min_length, max_length and
clipped_ratio (the truncated fraction), loss, grad_norm, learning_rate, num_tokens (cumulative prompt + completion
tokens of the rows trained on). Every other metric keeps this package's name
(metrics.jsonl's). The run's configuration is logged as the run config (W&B, Trackio) or as text (TensorBoard).

Offline: W&B writes under `<run_dir>/wandb` and syncs later when WANDB_MODE=offline (`wandb sync`); Trackio writes
its local database (TRACKIO_DIR, default ~/.cache/huggingface/trackio; `trackio show` reads it); TensorBoard writes
`<run_dir>/tensorboard`. A resumed run continues the same W&B / Trackio run (its id is kept in
`<run_dir>/tracking.json`).
"""

import json
import math
from pathlib import Path

from ..files import write_atomic
from .config import REPORT_TO

__all__ = ["REPORT_TO", "TRL_NAMES", "Trackers", "check_installed", "installed_trackers", "trl_names"]

TRL_NAMES = {  # this package's metric name -> TRL GRPOTrainer's, where the quantity is the same
    "reward": "reward",
    "reward_std": "reward_std",
    "invalid_group_rate": "frac_reward_zero_std",
    "kl": "kl",
    "entropy": "entropy",
    "clip_ratio/low_mean": "clip_ratio/low_mean",
    "clip_ratio/high_mean": "clip_ratio/high_mean",
    "clip_ratio/region_mean": "clip_ratio/region_mean",
    "cispo_clip_ratio": "cispo_clip_ratio",
    "completion_length": "completions/mean_length",
    "completion_length_min": "completions/min_length",
    "completion_length_max": "completions/max_length",
    "truncated_fraction": "completions/clipped_ratio",
    "loss": "loss",
    "grad_norm": "grad_norm",
    "lr": "learning_rate",
    "num_tokens": "num_tokens",
}
_NOT_LOGGED = ("step",)  # the x axis, logged as train/global_step


def installed_trackers() -> tuple:
    """logging.report_to = "all": every tracker whose package is installed (a warning when none is)."""
    names = tuple(n for n in REPORT_TO if _installed(n))
    if not names:
        import warnings

        warnings.warn('logging.report_to = "all": none of tensorboard, wandb, trackio is installed, nothing will '
                      "be tracked (pip install 'grpo-kernels[tensorboard]', or [wandb], [trackio])",
                      stacklevel=3)  # fmt: skip
    return names


def _installed(name: str) -> bool:
    import importlib.util

    try:
        return importlib.util.find_spec(name) is not None and (
            name != "tensorboard" or importlib.util.find_spec("torch.utils.tensorboard") is not None)
    except ImportError:
        return False


def check_installed(report_to) -> None:
    """Each tracker of report_to importable, else a ValueError naming the extra to install."""
    for name in report_to:
        if not _installed(name):
            raise ValueError(f'logging.report_to names "{name}", which needs the {name} package: '
                             f"pip install 'grpo-kernels[{name}]'")  # fmt: skip


def trl_names(metrics: dict, prefix: str = "train/") -> dict:
    """The scalars of a metrics line under TRL's names (where the quantity is the same) and the prefix."""
    out = {}
    for key, value in metrics.items():
        if key in _NOT_LOGGED or isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        if isinstance(value, float) and not math.isfinite(value):
            continue  # TensorBoard and W&B take NaN, Trackio refuses it: a missing point reads the same everywhere
        out[prefix + TRL_NAMES.get(key, key)] = value
    return out


class Trackers:
    """The trackers of one run (main rank only)."""

    def __init__(self, run_dir: Path):
        self.run_dir = Path(run_dir)
        self.writer = self.wandb_run = self.trackio = None

    @classmethod
    def start(cls, run_dir, report_to, *, settings: dict, project: str, run_name: str | None = None,
              resume: bool = False) -> "Trackers | None":  # fmt: skip
        """The trackers report_to names (None when it is empty), logging settings (a plain dict: the run's config)
        as the run config, under project and run_name (default: the run directory's name). resume: continue the
        W&B / Trackio run whose id <run_dir>/tracking.json kept."""
        names = report_to
        if not names:
            return None
        self = cls(run_dir)
        state_path = self.run_dir / "tracking.json"
        state = _tracking_state(state_path) if resume and state_path.exists() else {}
        run_name = run_name or self.run_dir.resolve().name
        if "tensorboard" in names:
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(str(self.run_dir / "tensorboard"))
            self.writer.add_text("config", "```\n" + json.dumps(settings, indent=2) + "\n```")
        if "wandb" in names:
            import wandb

            self.wandb_run = wandb.init(project=project, name=run_name, dir=str(self.run_dir), config=settings,
                                        id=state.get("wandb_id"), resume="allow" if state.get("wandb_id") else None)
            self.wandb_run.define_metric("train/global_step")
            self.wandb_run.define_metric("*", step_metric="train/global_step", step_sync=True)
            state["wandb_id"] = self.wandb_run.id
        if "trackio" in names:
            import trackio

            self.trackio = trackio
            resume_trackio = "trackio_name" in state
            trackio.init(project=project, name=state.setdefault("trackio_name", run_name), config=settings,
                         resume="allow" if resume_trackio else "never")  # fmt: skip
        write_atomic(state_path, json.dumps(state) + "\n")
        return self

    def _write(self, values: dict, global_step: int) -> None:
        if self.writer is not None:
            for key, value in values.items():
                self.writer.add_scalar(key, value, global_step)
            self.writer.flush()
        if self.wandb_run is not None:
            self.wandb_run.log({**values, "train/global_step": global_step})
        if self.trackio is not None:
            self.trackio.log({**values, "train/global_step": global_step}, step=global_step)

    def log(self, metrics: dict, step: int) -> None:
        """One metrics line of step `step` (0-based), at global step step + 1."""
        self._write(trl_names(metrics), step + 1)

    def log_eval(self, row: dict, step: int) -> None:
        """One held-out evaluation after step `step`: eval/success, eval/success_se, ... (the eval_ prefix dropped)."""
        values = {k.removeprefix("eval_"): v for k, v in row.items() if k.startswith("eval_")}
        self._write(trl_names(values, prefix="eval/"), step + 1)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
        if self.wandb_run is not None:
            self.wandb_run.finish()
        if self.trackio is not None:
            self.trackio.finish()
        self.writer = self.wandb_run = self.trackio = None


def _tracking_state(path: Path) -> dict:
    """The tracker run ids a resumed run continues (tracking.json); a ValueError naming the file when it is damaged."""
    try:
        state = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        state = exc
    if not isinstance(state, dict):
        raise ValueError(f"{path} is damaged ({state}): it keeps the W&B and Trackio run ids a resumed run continues; "
                         "restore it, or delete it to start new tracker runs")  # fmt: skip
    return state


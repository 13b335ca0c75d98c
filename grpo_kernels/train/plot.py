"""`grpo-kernels plot RUN_DIR`: PNGs of a run from its metrics.jsonl (reward, invalid groups vs theory, G, completion
lengths, speed)."""

import json
from pathlib import Path

from ..theory import invalid_group_rate

__all__ = ["plot_run"]


def _smooth(values, k=10):
    out, acc = [], []
    for v in values:
        acc.append(v)
        acc = acc[-k:]
        out.append(sum(acc) / len(acc))
    return out


def plot_run(run_dir) -> list[Path]:
    """Write reward.png, invalid_groups.png, group_size.png and lengths.png (when logged) and throughput.png; returns
    the paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    run = Path(run_dir)
    path = run / "metrics.jsonl"
    if not path.exists():
        raise ValueError(f"{run} has no metrics.jsonl (not a training run directory)")
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    rows = [r for r in rows if not r.get("no_update")]  # steps where every group was invalid: nothing to plot
    if not rows:
        raise ValueError(f"{path} has no step with an update")
    steps = [r["step"] for r in rows]
    group_size = (
        json.loads((run / "summary.json").read_text()).get("group_size") if (run / "summary.json").exists() else None
    )
    written = []

    def save(fig, name):
        fig.tight_layout()
        fig.savefig(run / name, dpi=110)
        plt.close(fig)
        written.append(run / name)

    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot(steps, [r["reward"] for r in rows], alpha=0.3, label="batch reward")
    ax.plot(steps, _smooth([r["reward"] for r in rows]), label="moving mean (10 steps)")
    ax.set(xlabel="step", ylabel="reward (pass rate)", ylim=(0, 1.02), title="reward")
    ax.legend()
    save(fig, "reward.png")

    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot(steps, _smooth([r["invalid_group_rate"] for r in rows]), label="measured (moving mean)")
    if group_size:
        theory = [invalid_group_rate(group_size, min(max(r["reward"], 0.0), 1.0)) for r in rows]
        ax.plot(steps, _smooth(theory), "--", label=f"p^G + (1-p)^G at the batch pass rate, G={group_size}")
    ax.set(xlabel="step", ylabel="invalid-group rate", ylim=(0, 1.02), title="groups with no gradient signal")
    ax.legend(fontsize=8)
    save(fig, "invalid_groups.png")

    if "group_size" in rows[0]:
        fig, ax = plt.subplots(figsize=(6, 3.5))
        ax.step(steps, [r["group_size"] for r in rows], where="post")
        ax.set(xlabel="step", ylabel="G", title="group size")
        save(fig, "group_size.png")

    if "completion_length_max" in rows[0]:
        fig, ax = plt.subplots(figsize=(6, 3.5))
        for key in ("max", "median", "min"):
            ax.plot(steps, [r[f"completion_length_{key}"] for r in rows], label=key)
        ax.set(xlabel="step", ylabel="completion tokens", title="completion lengths")
        if "truncated_fraction" in rows[0]:
            twin = ax.twinx()
            twin.plot(steps, [r["truncated_fraction"] for r in rows], "k:", label="truncated (right)")
            twin.set(ylabel="truncated fraction", ylim=(0, 1.02))
            twin.legend(fontsize=8, loc="upper right")
        ax.legend(fontsize=8, loc="upper left")
        save(fig, "lengths.png")

    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot(steps, [r["train_tokens_per_s"] for r in rows])
    ax.set(xlabel="step", ylabel="train tokens/s", title="training throughput (packed forward + backward)")
    save(fig, "throughput.png")
    return written

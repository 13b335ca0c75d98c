"""Learning held to a reference: the same GRPO run in TRL's GRPOTrainer and in `grpo-kernels train`, over seeds and
loss types, held-out success every few steps evaluated by the same code.

    python -m benchmarks.learning.vs_trl [--trainers trl,grpo_kernels] [--loss-types dapo,grpo] [--seeds 0,1,2]
        [--format-weight W] [--steps 40] [--eval-every 4] [--eval-prompts 256] [--lr 2e-5] [--cpus 0,1]
        [--trl-micro-rows N] [--workdir DIR]
    python -m benchmarks.learning.vs_trl --plot-only        # the report from the per-run files alone
    python -m benchmarks.learning.vs_trl --quick            # the smoke test: a tiny chat model, 2 steps

The run (defaults): SmolLM2-135M-Instruct (`grpo-kernels prepare-model smollm2-135m`, done on first use), the built-in
"arith" task at difficulty 2 (base held-out success ~0.17 at temperature 0.7) with its chat template and reward, the
bare-integer bonus at 0.2 (--format-weight; ARITH_FORMAT_WEIGHT_COMMITTED; the task's own default is 0), G = 8,
8 prompts per step, temperature 0.7, 24 new tokens, AdamW lr 2e-5 (betas 0.9 / 0.95, no weight decay), grad clip 1,
constant lr, no warm-up, beta 0, epsilon 0.2 / 0.28, fp32, HF `generate` as the sampler of both (the "grpo_kernels_vllm"
trainer samples with vLLM instead, an extra row; "trl_ourdraw" is TRL drawing its rollouts from our random stream, the
seeds our trainer gives each row; "grpo_kernels_hfdraw" is ours drawing its rollouts as HF's do_sample does, from the
global RNG: swaps of the random streams alone). One `TrainConfig` describes the run: ours gets it as `grpo-kernels
train` overrides, TRL's worker (benchmarks/learning/trl_worker.py) turns the same overrides into the same TrainConfig
and reads every TRL option from it; a setting TRL cannot run the same way is refused with one line. Prompts: the same
stream, in the same order, for both (the trainer's `PromptStream` of the run's seed). Held-out success:
`grpo_kernels.train.rollout.sampling.evaluate` (one answer per held-out prompt, sampled at the training temperature
with fixed seeds; `correct`, without the format bonus) on --eval-prompts prompts, before the first step and every
--eval-every steps, for both.

Every (trainer, loss type, seed) is one process, in --workdir (default ~/.cache/grpo-kernels/learning_vs_trl); with
--cpus, as many run at once as CPUs are named, each pinned to its CPU with one thread, so both trainers are timed
alike (mind the memory: a TRL run of the defaults reached ~12 GB of RSS, ours ~5 GB; two TRL runs at once were
killed for memory on a 24 GB machine; with --trl-micro-rows 8 a whole TRL run peaked at 4.7 GB, the same update;
process.json keeps each finished run's peak). Runs checkpoint every 8 steps
and resume from there; a finished run (its files copied to the results) is not run again, nor one that another
invocation is running (a lock file per run: several invocations, on other CPUs, may share the work); a run that dies
is recorded (failed.txt with its log's tail) and the others go on.
Results (benchmarks/results/learning_vs_trl/): runs/<trainer>_<loss>_seed<k>/ (metrics.jsonl, eval.jsonl,
summary.json), curves.csv (one row per evaluation), summary.md (per evaluation: mean and 95 % t-interval over the
seeds, and whether ours lies within TRL's interval or above it) and success_<loss>.png (held-out success vs step, vs
completions sampled and vs wall seconds of training + sampling, evaluations left out).
"""

import argparse
import fcntl
import json
import math
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # importable from a plain checkout too

from benchmarks.common import (
    ARITH_FORMAT_WEIGHT_COMMITTED,
    ROOT,
    cpu_numbers,
    number_list,
    run_logged,
    run_pinned,
    write_csv,
)
from benchmarks.learning.intervals import clopper_pearson, fisher_exact, mean_ci, welch_difference

OUT = ROOT / "benchmarks" / "results" / "learning_vs_trl"
TRAINERS = ("trl", "grpo_kernels", "grpo_kernels_vllm", "trl_ourdraw", "grpo_kernels_hfdraw")  # last two: draws swapped
RUN_FILES = ("metrics.jsonl", "eval.jsonl", "summary.json")
COLLAPSE_TOKENS = 7  # a run whose rollouts average fewer tokens at some step answers bare guesses (endpoints.md)
CURVE_COLUMNS = ["trainer", "loss_type", "seed", "step", "completions", "sampled_tokens", "generate_s", "train_s",
                 "wall_s", "eval_success"]  # fmt: skip
# The study's recipe, fixed in endpoints.md: arith with its bare-integer bonus at 0.2 (the task's default until the
# study's decision moved it to 0), explicit so that a change of the task's default does not change the study.
DEFAULTS = dict(model="smollm2-135m", task="arith", difficulty=2, group_size=8, prompts_per_step=8, steps=40,
                eval_every=4, eval_prompts=256, temperature=0.7, max_new_tokens=24, lr=2e-5, epsilon_high=0.28,
                format_weight=ARITH_FORMAT_WEIGHT_COMMITTED)  # fmt: skip
QUICK = dict(DEFAULTS, model=None, task="add", difficulty=1, group_size=4, prompts_per_step=2, steps=2, eval_every=2,
             eval_prompts=8, temperature=1.0, max_new_tokens=4, lr=1e-3, seeds="0", loss_types="dapo",
             format_weight=None)  # fmt: skip


def overrides(args, trainer: str, loss_type: str, seed: int, run_dir: Path) -> list[str]:
    """The run as `grpo-kernels train` overrides: what both trainers are given."""
    return [f"--seed={seed}", f"--model.name={args.model}", f"--task.name={args.task}",
            f"--task.difficulty={args.difficulty}", f"--task.num_eval_prompts={args.eval_prompts}",
            f"--task.eval_every={args.eval_every}", "--task.sft_warmup_steps=0", "--task.chat_template=on",
            f"--sampling.sampler={'vllm' if trainer == 'grpo_kernels_vllm' else 'hf'}",
            f"--sampling.group_size={args.group_size}", f"--sampling.prompts_per_step={args.prompts_per_step}",
            f"--sampling.max_new_tokens={args.max_new_tokens}", f"--sampling.temperature={args.temperature}",
            f"--optim.steps={args.steps}", f"--optim.lr={args.lr}", "--optim.betas=[0.9, 0.95]",
            "--optim.weight_decay=0.0", "--optim.grad_clip=1.0", "--optim.warmup_steps=0",
            f"--loss.loss_type={loss_type}", "--loss.epsilon_low=0.2", f"--loss.epsilon_high={args.epsilon_high}",
            "--loss.beta=0.0", "--packing.shared_prefix=true", "--model.activation_checkpointing=none",
            f"--logging.run_dir={run_dir}", "--logging.log_every=1", "--checkpoint.every=8",
            "--checkpoint.keep_last=1",
            *([f"--task.format_weight={args.format_weight}"] if args.format_weight is not None else [])]  # fmt: skip


def command(args, trainer: str, loss_type: str, seed: int, run_dir: Path) -> list[str]:
    """The process of one run: a fresh one, or the resumption of a run cut short."""
    extra = overrides(args, trainer, loss_type, seed, run_dir)
    if trainer in ("trl", "trl_ourdraw"):
        return [sys.executable, "-m", "benchmarks.learning.trl_worker", "--run-dir", str(run_dir), "--draw",
                "ours" if trainer == "trl_ourdraw" else "hf",
                *(["--micro-rows", str(args.trl_micro_rows)] if args.trl_micro_rows else []), "--", *extra]  # fmt: skip
    module = "benchmarks.learning.hfdraw_worker" if trainer == "grpo_kernels_hfdraw" else "grpo_kernels.cli"
    cli = [sys.executable, "-m", module, "train"]
    if any((run_dir / "checkpoints").glob("step_*")):
        return [*cli, "--resume", str(run_dir)]
    shutil.rmtree(run_dir, ignore_errors=True)
    return [*cli, *extra]


def run_one(args, job: tuple, workdir: Path, results: Path, cpu: int | None) -> str:
    trainer, loss_type, seed = job
    name = f"{trainer}_{loss_type}_seed{seed}"
    run_dir, kept = workdir / name, results / "runs" / name
    if (kept / "summary.json").exists():
        return "done before"
    workdir.mkdir(parents=True, exist_ok=True)
    with (workdir / f"{name}.lock").open("w") as lock:  # another runner (another --cpus) may be running it
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return "running in another process: left to it"
        return _run_locked(args, trainer, loss_type, seed, run_dir, kept, workdir / f"{name}.log", cpu)


def _run_locked(args, trainer, loss_type, seed, run_dir: Path, kept: Path, log: Path, cpu: int | None) -> str:
    if (kept / "summary.json").exists():  # finished by another runner between the check and the lock
        return "done before"
    (kept / "failed.txt").unlink(missing_ok=True)
    cmd = command(args, trainer, loss_type, seed, run_dir)
    code, peak = run_logged(cmd, log, cpu)  # peak: this process's peak RSS, MiB
    kept.mkdir(parents=True, exist_ok=True)
    if code != 0:
        tail = log.read_text().strip().splitlines()[-20:]
        (kept / "failed.txt").write_text(f"exit code {code} (peak RSS {peak} MiB); the log's last lines:\n" +
                                         "\n".join(tail))  # fmt: skip
        return f"FAILED (exit {code}): {tail[-1] if tail else '(no output)'}"
    for file in RUN_FILES:
        shutil.copy2(run_dir / file, kept / file)
    (kept / "process.json").write_text(json.dumps({"peak_rss_mib": peak, "cpu": cpu}))
    shutil.rmtree(run_dir / "checkpoints", ignore_errors=True)
    shutil.rmtree(run_dir / "trl", ignore_errors=True)
    shutil.rmtree(run_dir / "model", ignore_errors=True)  # (the exported model: hundreds of MB a run, not compared)
    return "finished"


def run_all(args, jobs: list, workdir: Path, results: Path) -> None:
    """The jobs in order, as many at once as --cpus names CPUs (one each), else one at a time."""

    def done(job, what, seconds):
        print(f"{'_'.join(map(str, job)):>32s}: {what} ({seconds:.0f} s)", flush=True)
        if what != "done before":
            report(results, args)

    run_pinned(jobs, cpu_numbers(args.cpus, "learning-vs-trl") if args.cpus else [],
               lambda job, cpu: run_one(args, job, workdir, results, cpu), done)


def _jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def curves(results: Path) -> list[dict]:
    rows = []
    for summary in sorted((results / "runs").glob("*/summary.json")):
        trainer, loss_type, seed = _name(summary.parent.name)
        start = json.loads(summary.read_text())["eval_success_start"]
        rows.append({"trainer": trainer, "loss_type": loss_type, "seed": seed, "step": -1, "completions": 0,
                     "sampled_tokens": 0, "generate_s": 0.0, "train_s": 0.0, "wall_s": 0.0, "eval_success": start})
        for e in _jsonl(summary.parent / "eval.jsonl"):
            # TRL's: its steps' own clock (sampling, loss, backward, clip, optimizer); its train_s leaves the
            # optimizer step out. Ours: grpo_step (optimizer included) + sampling + weight syncs.
            wall = e["wall_s"] if "wall_s" in e else e["generate_s"] + e["train_s"] + e.get("sync_s", 0.0)
            rows.append({"trainer": trainer, "loss_type": loss_type, "seed": seed, "step": e["step"],
                         "completions": e["completions_sampled"], "sampled_tokens": e["sampled_tokens"],
                         "generate_s": round(e["generate_s"], 2), "train_s": round(e["train_s"], 2),
                         "wall_s": round(wall, 2), "eval_success": e["eval_success"]})  # fmt: skip
    return rows


def _name(run: str) -> tuple:
    head, seed = run.rsplit("_seed", 1)
    trainer, loss_type = head.rsplit("_", 1)
    return trainer, loss_type, int(seed)


def summary_lines(rows: list[dict]) -> list[str]:
    lines = []
    for loss_type in dict.fromkeys(r["loss_type"] for r in rows):
        mine = [r for r in rows if r["loss_type"] == loss_type]
        trainers = [t for t in TRAINERS if any(r["trainer"] == t for r in mine)]
        steps = sorted({r["step"] for r in mine})
        at, values = {}, {}
        for t in trainers:
            for s in steps:
                values[t, s] = [r["eval_success"] for r in mine if r["trainer"] == t and r["step"] == s]
                at[t, s] = (mean_ci(values[t, s]), len(values[t, s])) if values[t, s] else None
        both = "trl" in trainers and "grpo_kernels" in trainers
        lines += [f"## loss {loss_type}", "", "Held-out success, mean ± 95 % t-interval over the seeds (n seeds); "
                  "`ok`: ours within TRL's interval or above it" + ("; ours - TRL: the difference of the means with "
                  "its 95 % Welch interval (a difference whose interval excludes 0 is resolved); paired: ours - TRL "
                  "seed by seed over the seeds both ran (same prompts, same start), mean ± 95 % t-interval"
                  if both else "") + ".", "",
                  "| after step | " + " | ".join(trainers) + " | verdict |" + (" ours - TRL | paired |" if both
                  else ""), "|---:|" + "---|" * (len(trainers) + 1) + ("---:|---:|" if both else "")]  # fmt: skip
        for s in steps:
            cells, verdict = [], ""
            for t in trainers:
                cell = at[t, s]
                cells.append("-" if cell is None else f"{cell[0][0]:.3f} ± {cell[0][1]:.3f} ({cell[1]})")
            trl, ours = at.get(("trl", s)), at.get(("grpo_kernels", s))
            if trl and ours and trl[1] > 1:
                verdict = "ok" if ours[0][0] >= trl[0][0] - trl[0][1] else "**below**"
            line = f"| {s + 1 if s >= 0 else 'start'} | " + " | ".join(cells) + f" | {verdict} |"
            if both:
                diff = (welch_difference(values["grpo_kernels", s], values["trl", s]) if trl and ours
                        else (float("nan"), float("nan")))  # fmt: skip
                line += " - |" if math.isnan(diff[0]) else f" {diff[0]:+.3f} ± {diff[1]:.3f} |"
                by_seed = {t: {r["seed"]: r["eval_success"] for r in mine if r["trainer"] == t and r["step"] == s}
                           for t in ("trl", "grpo_kernels")}  # fmt: skip
                common = sorted(set(by_seed["trl"]) & set(by_seed["grpo_kernels"]))
                paired = mean_ci([by_seed["grpo_kernels"][k] - by_seed["trl"][k] for k in common]) if common else None
                line += " - |" if paired is None else f" {paired[0]:+.3f} ± {paired[1]:.3f} ({len(common)}) |"
            lines.append(line)
        lines.append("")
    return lines


def plot(results: Path, rows: list[dict]) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colour = {"trl": "tab:orange", "grpo_kernels": "tab:blue", "grpo_kernels_vllm": "tab:green",
              "trl_ourdraw": "tab:red", "grpo_kernels_hfdraw": "tab:purple"}
    paths = []
    for loss_type in dict.fromkeys(r["loss_type"] for r in rows):
        mine = [r for r in rows if r["loss_type"] == loss_type]
        fig, axes = plt.subplots(1, 3, figsize=(15, 4.2), sharey=True)
        for ax, x, label in ((axes[0], "step", "steps"), (axes[1], "completions", "completions sampled"),
                             (axes[2], "wall_s", "seconds training + sampling (one CPU each)")):  # fmt: skip
            for t in dict.fromkeys(r["trainer"] for r in mine):
                runs = {}
                for r in mine:
                    if r["trainer"] == t:
                        runs.setdefault(r["seed"], []).append(r)
                for seed_rows in runs.values():
                    ax.plot([r[x] + (1 if x == "step" else 0) for r in seed_rows],
                            [r["eval_success"] for r in seed_rows], "-", color=colour[t], alpha=0.25, lw=1)
                steps = sorted({r["step"] for r in mine if r["trainer"] == t})
                pts = []
                for s in steps:
                    at = [r for r in mine if r["trainer"] == t and r["step"] == s]
                    m, h = mean_ci([r["eval_success"] for r in at])
                    pts.append((sum(r[x] for r in at) / len(at) + (1 if x == "step" else 0), m, h))
                xs, ms, hs = zip(*pts, strict=True)
                ax.plot(xs, ms, "-o", ms=3, color=colour[t], label=f"{t} (mean of {len(runs)} seeds)")
                if len(runs) > 1:
                    ax.fill_between(xs, [max(0.0, m - h) for m, h in zip(ms, hs, strict=True)],
                                    [min(1.0, m + h) for m, h in zip(ms, hs, strict=True)], color=colour[t],
                                    alpha=0.15)  # a success rate: the interval cut to [0, 1]
            ax.set(xlabel=label)
        axes[0].set(ylabel="held-out success", ylim=(0, 1))
        axes[0].legend(fontsize=8)
        fig.suptitle(f"loss {loss_type}: held-out success, each seed (thin), mean and 95 % interval", fontsize=10)
        fig.tight_layout()
        path = results / f"success_{loss_type}.png"
        fig.savefig(path, dpi=100)
        plt.close(fig)
        paths.append(path)
    return paths


def report(results: Path, args) -> list[Path]:
    rows = curves(results)
    write_csv(rows, results / "curves.csv", CURVE_COLUMNS)
    failed = sorted(p.parent.name for p in (results / "runs").glob("*/failed.txt"))
    lines = ["# Learning vs TRL: the same GRPO run in trl.GRPOTrainer and grpo-kernels train", "",
             f"Command: `{command_line(args, rows)}`", "", *seed_lines(rows), *micro_batch_lines(results),
             *endpoint_lines(results, rows), *summary_lines(rows), *run_lines(results, rows)]  # fmt: skip
    if failed:
        lines += ["## Runs that died", "", *[f"- {name}: see runs/{name}/failed.txt" for name in failed], ""]
    (results / "summary.md").write_text("\n".join(lines))
    return [results / "summary.md", results / "curves.csv", *(plot(results, rows) if rows else [])]


def run_lines(results: Path, rows: list[dict]) -> list[str]:
    """One line per finished run: held-out success at the start, after the first evaluation, at the end and at its
    best; the shortest mean completion of any step (a collapse into bare answers shows there); seconds; peak RSS."""
    out = []
    for summary in sorted((results / "runs").glob("*/summary.json")):
        trainer, loss_type, seed = _name(summary.parent.name)
        mine = [r["eval_success"] for r in rows if (r["trainer"], r["loss_type"], r["seed"]) == (trainer, loss_type,
                                                                                                seed)]  # fmt: skip
        lengths = completion_lengths(summary.parent, trainer)
        process = summary.parent / "process.json"
        peak = json.loads(process.read_text())["peak_rss_mib"] if process.exists() else ""
        wall = next((r["wall_s"] for r in reversed(rows) if (r["trainer"], r["loss_type"], r["seed"]) ==
                     (trainer, loss_type, seed)), "")  # fmt: skip
        out.append(f"| {trainer} | {loss_type} | {seed} | {mine[0]:.3f} | {mine[1] if len(mine) > 1 else mine[0]:.3f} "
                   f"| {mine[-1]:.3f} | {max(mine):.3f} | {min(lengths) if lengths else float('nan'):.1f} | "
                   f"{wall:.0f} | {peak} |")  # fmt: skip
    if not out:
        return []
    return ["## Each run", "", "_Held-out success at the start, after the first evaluation, at the end and at its "
            "best; the shortest mean completion (tokens) of any step; seconds of sampling and training; peak RSS "
            "(MiB)._", "",
            "| trainer | loss | seed | start | first eval | end | best | shortest mean completion | s | peak MiB |",
            "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|", *out, ""]  # fmt: skip


def completion_lengths(run: Path, trainer: str) -> list[float]:
    """The mean completion length of each step's rollouts, in tokens."""
    key = "completions/mean_length" if trainer.startswith("trl") else "completion_length"
    return [float(m[key]) for m in _jsonl(run / "metrics.jsonl") if key in m]


def endpoint_lines(results: Path, rows: list[dict]) -> list[str]:
    """The endpoints fixed before the default recipe's seeds 5-9 ran (endpoints.md): per loss type, held-out success
    after the last step (ours - TRL, Welch and paired) and the collapse rate per trainer (a run whose rollouts average
    under COLLAPSE_TOKENS tokens at any step) with exact intervals and Fisher's exact test."""
    lines = []
    for loss_type in dict.fromkeys(r["loss_type"] for r in rows):
        last = max(r["step"] for r in rows if r["loss_type"] == loss_type)
        end = {t: {r["seed"]: r["eval_success"] for r in rows
                   if (r["trainer"], r["loss_type"], r["step"]) == (t, loss_type, last)}
               for t in ("trl", "grpo_kernels")}  # fmt: skip
        if not end["trl"] or not end["grpo_kernels"]:
            continue
        welch = welch_difference(list(end["grpo_kernels"].values()), list(end["trl"].values()))
        common = sorted(set(end["trl"]) & set(end["grpo_kernels"]))
        resolved = lambda d: "resolved" if abs(d[0]) > d[1] else "not resolved"  # noqa: E731 (nan: not resolved)
        if common:
            paired = mean_ci([end["grpo_kernels"][k] - end["trl"][k] for k in common])
            by_seed = f"{paired[0]:+.3f} ± {paired[1]:.3f} ({len(common)} seeds: {resolved(paired)})"
        else:  # (a study part-way, each trainer's seeds not yet the other's)
            by_seed = "none yet (no seed has run in both)"
        lines += [f"## Endpoints, loss {loss_type}", "",
                  f"- Held-out success after step {last + 1}, ours - TRL: {welch[0]:+.3f} ± {welch[1]:.3f} (Welch, "
                  f"{len(end['grpo_kernels'])} against {len(end['trl'])} seeds: {resolved(welch)}); paired by seed "
                  f"{by_seed}."]  # fmt: skip
        counts = {}
        for t in ("trl", "grpo_kernels"):
            runs = {seed: results / "runs" / f"{t}_{loss_type}_seed{seed}" for seed in sorted(end[t])}
            collapsed = [k for k, run in runs.items() if min(completion_lengths(run, t), default=math.inf)
                         < COLLAPSE_TOKENS]  # fmt: skip
            counts[t] = len(collapsed), len(end[t])
            low, high = clopper_pearson(*counts[t])
            lines.append(f"- Collapsed (rollouts under {COLLAPSE_TOKENS} tokens on average at some step), {t}: "
                         f"{counts[t][0]} of {counts[t][1]}, exact 95 % interval {low:.2f}-{high:.2f}"
                         + (f" (seeds {', '.join(map(str, collapsed))})." if collapsed else "."))  # fmt: skip
        p = fisher_exact(*counts["grpo_kernels"], *counts["trl"])
        lines += [f"- The collapse rates compared (Fisher's exact test, two-sided): p = {p:.3f}.", ""]
    return lines


def seed_lines(rows: list[dict]) -> list[str]:
    """The seeds each trainer ran, per loss type (they need not be the same)."""
    ran = {}
    for r in rows:
        ran.setdefault((r["trainer"], r["loss_type"]), set()).add(r["seed"])
    return ["Seeds that ran: " + "; ".join(f"{t} {loss}: {', '.join(map(str, sorted(seeds)))}"
                                           for (t, loss), seeds in ran.items()) + ".", ""]  # fmt: skip


def micro_batch_lines(results: Path) -> list[str]:
    """Which TRL runs ran their step in micro-batches (--trl-micro-rows), when any did: the same update (tested),
    other float summation order and memory."""
    by_rows = {}
    for path in sorted((results / "runs").glob("trl*_seed*/summary.json")):
        by_rows.setdefault(json.loads(path.read_text()).get("trl_micro_rows"), []).append(path.parent.name)
    if not any(rows is not None for rows in by_rows):
        return []
    parts = [f"{', '.join(names)}: {'the whole step in one' if rows is None else f'{rows} rows'}"
             for rows, names in by_rows.items()]  # fmt: skip
    return ["_TRL's micro-batches (per_device_train_batch_size; gradient accumulation over the step, which TRL "
            "generates and normalizes as a whole: the same update): " + "; ".join(parts) + "._", ""]


def command_line(args, rows: list[dict]) -> str:
    """The command that makes every run in the results (the trainers, loss types and seeds found there: several
    invocations, on other CPUs, may have shared the work)."""
    if args.quick:
        return "python -m benchmarks.learning.vs_trl --quick"
    found = lambda key: ",".join(str(v) for v in dict.fromkeys(r[key] for r in rows))  # noqa: E731
    return (f"python -m benchmarks.learning.vs_trl --trainers {found('trainer')} --loss-types {found('loss_type')} "
            f"--seeds {found('seed')} --steps {args.steps} --eval-every {args.eval_every} --eval-prompts "
            f"{args.eval_prompts} --lr {args.lr}"
            + (f" --format-weight {args.format_weight}" if args.format_weight is not None else "")
            + " --cpus <one CPU per run>")  # fmt: skip


def quick_model(workdir: Path) -> Path:
    """The tiny checkpoint with a chat template (the prompt as is), so TRL and ours encode the same ids."""
    from grpo_kernels.train.model.hf import write_tiny_checkpoint

    directory = workdir / "tiny_chat"
    if not (directory / "config.json").exists():
        write_tiny_checkpoint(directory)
        config = json.loads((directory / "tokenizer_config.json").read_text())
        config["chat_template"] = "{{ bos_token }}{% for m in messages %}{{ m['content'] }}{% endfor %}"
        (directory / "tokenizer_config.json").write_text(json.dumps(config))
    return directory


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trainers", default="trl,grpo_kernels", help=f"of {', '.join(TRAINERS)}")
    parser.add_argument("--loss-types", default="dapo,grpo")
    parser.add_argument("--seeds", default="0,1,2", help='"0,1,2" or "0-4"')
    for key in ("model", "task", "difficulty", "group_size", "prompts_per_step", "steps", "eval_every",
                "eval_prompts", "temperature", "max_new_tokens", "lr", "epsilon_high"):  # fmt: skip
        parser.add_argument("--" + key.replace("_", "-"), type=type(DEFAULTS[key]), default=DEFAULTS[key])
    parser.add_argument("--format-weight", type=float,
                        help="arith's bare-integer bonus (task.format_weight; default: this study's 0.2 for arith, the "
                             "task's own is 0); give another --workdir and --results: the run names do not say it")
    parser.add_argument("--trl-micro-rows", type=int, help="TRL's per_device_train_batch_size, gradient accumulation "
                        "over the step's rest (default: the whole step in one; the same update, TRL generates and "
                        "normalizes over the whole step: less memory, so two TRL runs fit at once)")
    parser.add_argument("--cpus", help="run this many at once, each pinned to one of these CPUs (e.g. 0,1)")
    parser.add_argument("--workdir", type=Path, help="default ~/.cache/grpo-kernels/learning_vs_trl")
    parser.add_argument("--results", type=Path, default=OUT)
    parser.add_argument("--plot-only", action="store_true", help="the report from the runs' files alone")
    parser.add_argument("--quick", action="store_true", help="the smoke test: a tiny chat model, 2 steps, 1 seed")
    args = parser.parse_args(argv)
    if args.format_weight is None and args.task == "arith":  # the study's recipe, whatever the task's default
        args.format_weight = DEFAULTS["format_weight"]
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    workdir = args.workdir or Path.home() / ".cache" / "grpo-kernels" / "learning_vs_trl"
    if args.quick:
        for key, value in QUICK.items():
            setattr(args, key, value)
        workdir.mkdir(parents=True, exist_ok=True)
        args.model = str(quick_model(workdir))
    results = args.results
    if not args.plot_only:
        trainers = args.trainers.split(",")
        bad = [t for t in trainers if t not in TRAINERS]
        if bad:
            raise SystemExit(f"learning-vs-trl: unknown --trainers {', '.join(bad)} (known: {', '.join(TRAINERS)})")
        if any(t.startswith("trl") for t in trainers):
            try:
                import trl  # noqa: F401
            except ImportError:
                raise SystemExit("learning-vs-trl: the trl trainer needs TRL: pip install "
                                 "'grpo-kernels[trl]'") from None
        try:
            seeds = number_list(args.seeds)
        except ValueError:
            raise SystemExit(f"learning-vs-trl: --seeds {args.seeds!r}: e.g. 0,1,2 or 0-4") from None
        if args.cpus:
            cpu_numbers(args.cpus, "learning-vs-trl")  # before any run
        from benchmarks.learning.trl_worker import checked_micro_rows, trl_refusal
        from grpo_kernels.train.config.io import load_config

        jobs = [(t, loss, seed) for seed in seeds for loss in args.loss_types.split(",")
                for t in trainers]  # fmt: skip
        for t, loss, seed in jobs[: len(trainers) * len(args.loss_types.split(","))]:
            config = load_config(None, overrides(args, t, loss, seed, workdir / "check"))  # a bad setting: here
            refusal = trl_refusal(config) if t.startswith("trl") else None
            if t.startswith("trl") and not refusal:
                checked_micro_rows(config, args.trl_micro_rows)
            if refusal:
                raise SystemExit(f"learning-vs-trl: TRL cannot run {refusal}")
        workdir.mkdir(parents=True, exist_ok=True)
        (results / "runs").mkdir(parents=True, exist_ok=True)
        run_all(args, jobs, workdir, results)
    if not list((results / "runs").glob("*/summary.json")):
        raise SystemExit(f"learning-vs-trl: no finished run under {results / 'runs'}")
    for path in report(results, args):
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

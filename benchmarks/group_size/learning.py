"""Group size vs learning on a real model: time to a held-out target for fixed G, the adaptive schedule (8 -> 16)
and dynamic sampling at G = 8, the same prompts per step in every run.

    grpo-kernels group-size-study --model smollm2-135m --learning --target 0.6 [--settings 2,4,8,16,32,adaptive,dynamic]
        [--seeds 0,1] [--max-steps 60] [--eval-every 4] [--eval-prompts 128] [--prompts-per-step 8]
        [--task arith --difficulty 2 --temperature 0.7 --max-new-tokens 24 --lr 2e-5] [--workdir DIR]
    grpo-kernels group-size-study --model smollm2-135m --learning --plot-only   # the report from the CSVs alone
    grpo-kernels group-size-study --learning --quick                            # tiny model, G in {2, 8}, 4 steps

Every (setting, seed) is one `grpo-kernels train` run in its own process (vLLM sampler by default), with a held-out
evaluation every --eval-every steps (task.eval_every: one sampled answer per held-out prompt at the training
temperature) that stops it once the success reaches --target (task.target_success), or at --max-steps. Runs live in
--workdir (default ~/.cache/grpo-kernels/group_size_learning/<model>); a run that was cut short resumes from its
latest checkpoint (every 5 steps, only the latest kept), a finished one (summary.json) is not run again: the study is
resumable, and meant to run in the background for hours. When a run finishes its metrics.jsonl, eval.jsonl,
summary.json and config.toml are copied into the results directory and its checkpoints deleted.

Results (benchmarks/results/group_size_learning/<model>/): runs/<setting>_seed<k>/ (the per-run files), curves.csv
(one row per evaluation: completions and tokens sampled so far, seconds training / sampling / in weight syncs, the
wall time without the evaluations, the held-out success), runs.csv (one row per run: steps, completions, tokens and
seconds to the target, or "not reached"), summary.md (the table, mean and spread over seeds) and the plots:
success_vs_samples.png, success_vs_time.png (one line per run, one colour per setting) and time_to_target.png (per
setting, mean and min..max over the seeds; a run that did not reach the target is drawn at its total, hollow).
--plot-only rebuilds every other file: the CSVs from the runs (where runs/ is there), the report from the CSVs.

Time to target is reported as measured on this machine (train + generate + weight sync seconds, evaluations left
out) and, labelled as a model, as the time on a GPU where the step time is set by the measured work of the step:
train seconds = tokens trained / --gpu-train-tokens-per-s, generate seconds = decode steps (the longest completion
of the step, as vLLM decodes the batch together) x --gpu-decode-step-s + tokens sampled / --gpu-sample-tokens-per-s.
(decode steps: the longest trained completion of each sampling round; max_new_tokens for a step without an update.)
Its three parameters are inputs, not measurements (no GPU run of this study exists).
"""

import csv
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.common import cpu_numbers, number_list, t975, write_csv

REPO = Path(__file__).resolve().parents[2]
OUT = REPO / "benchmarks" / "results" / "group_size_learning"
SETTINGS = ("2", "4", "8", "16", "32", "adaptive", "dynamic")
RUN_FILES = ("metrics.jsonl", "eval.jsonl", "summary.json", "config.toml")
CURVE_COLUMNS = ["setting", "seed", "step", "group_size", "completions", "sampled_tokens", "trained_tokens",
                 "decode_steps", "generate_s", "train_s", "sync_s", "wall_s", "model_gpu_s", "eval_success",
                 "eval_success_se"]  # fmt: skip
RUN_COLUMNS = ["setting", "seed", "reached", "target", "steps", "completions", "sampled_tokens", "trained_tokens",
               "wall_s", "generate_s", "train_s", "model_gpu_s", "start_success", "end_success", "mean_group_size",
               "invalid_rate", "all_zero_rate"]  # fmt: skip


def setting_overrides(setting: str, *, adaptive_threshold: float) -> list[str]:
    """The train overrides of a setting: a fixed G, "adaptive" (8 -> at most 16) or "dynamic" (G = 8)."""
    if setting == "adaptive":
        return ["--sampling.group_size=8", "--group_size.adaptive=true", "--group_size.max_group_size=16",
                f"--group_size.invalid_rate_threshold={adaptive_threshold}"]  # fmt: skip
    if setting == "dynamic":
        return ["--sampling.group_size=8", "--group_size.dynamic_sampling=true"]
    return [f"--sampling.group_size={int(setting)}"]


def run_overrides(args, setting: str, seed: int, run_dir: Path) -> list[str]:
    return [f"--seed={seed}", f"--model.name={args.model}", f"--task.name={args.task}",
            f"--task.difficulty={args.difficulty}", f"--task.num_eval_prompts={args.eval_prompts}",
            f"--task.eval_every={args.eval_every}", f"--task.target_success={args.target}",
            f"--task.sft_warmup_steps={args.sft_steps}", f"--sampling.sampler={args.sampler}",
            f"--sampling.prompts_per_step={args.prompts_per_step}", f"--sampling.max_new_tokens={args.max_new_tokens}",
            f"--sampling.temperature={args.temperature}", f"--optim.steps={args.max_steps}", f"--optim.lr={args.lr}",
            "--optim.grad_clip=1.0", "--loss.loss_type=dapo", "--loss.epsilon_high=0.28",
            "--packing.shared_prefix=true", "--model.activation_checkpointing=none",  # short completions
            f"--logging.run_dir={run_dir}", "--checkpoint.every=5",
            "--checkpoint.keep_last=1",
            *([f"--task.format_weight={args.format_weight}"] if getattr(args, "format_weight", None) is not None
              else []),
            *setting_overrides(setting, adaptive_threshold=args.adaptive_threshold)]  # fmt: skip


def run_env(cpus: str | None) -> dict:
    """A run's environment: with --cpus, that many torch threads and vLLM's OpenMP threads bound to those CPUs (a
    run that shares its cores with other work, or 2 threads spinning for one core, measures that work instead)."""
    env = {**os.environ, "TQDM_DISABLE": "1"}
    if cpus:
        mine = number_list(cpus)
        env.update(OMP_NUM_THREADS=str(len(mine)), VLLM_CPU_OMP_THREADS_BIND=",".join(map(str, mine)))
    return env


def train_run(args, setting: str, seed: int, workdir: Path, results: Path) -> str:
    """Run (or resume, or skip) one (setting, seed); returns what it did."""
    name = f"{setting}_seed{seed}"
    run_dir, kept = workdir / name, results / "runs" / name
    if (kept / "summary.json").exists():
        return "done before"
    cli = [sys.executable, "-m", "grpo_kernels.cli", "train"]
    if (run_dir / "checkpoints").is_dir() and any((run_dir / "checkpoints").glob("step_*")):
        command, what = [*cli, "--resume", str(run_dir)], "resumed"
    else:
        shutil.rmtree(run_dir, ignore_errors=True)
        command, what = [*cli, *run_overrides(args, setting, seed, run_dir)], "ran"
    log = workdir / f"{name}.log"
    with log.open("a") as f:
        f.write(f"$ {' '.join(command)}\n")
        f.flush()
        pin = (lambda: os.sched_setaffinity(0, number_list(args.cpus))) if args.cpus else None
        done = subprocess.run(command, stdout=f, stderr=subprocess.STDOUT, cwd=REPO, env=run_env(args.cpus),
                              preexec_fn=pin)
    if done.returncode != 0:
        tail = log.read_text().strip().splitlines()[-1:] or ["(no output)"]
        raise SystemExit(f"group-size-study: run {name} failed ({log}): {tail[0]}")
    kept.mkdir(parents=True, exist_ok=True)
    for file in RUN_FILES:
        shutil.copy2(run_dir / file, kept / file)
    shutil.rmtree(run_dir / "checkpoints", ignore_errors=True)
    return what


def _jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def curves_of(run: Path, setting: str, seed: int, gpu: dict) -> list[dict]:
    """One row per evaluation of a finished run (and one for the start: nothing sampled yet)."""
    summary, evals, steps = (json.loads((run / "summary.json").read_text()), _jsonl(run / "eval.jsonl"),
                             _jsonl(run / "metrics.jsonl"))  # fmt: skip
    by_step = {m["step"]: m for m in steps if not m.get("no_update")}
    skipped = {m["step"]: m for m in steps if m.get("no_update")}  # every group invalid: a line without lengths
    rows = [{"setting": setting, "seed": seed, "step": -1, "group_size": "", "completions": 0, "sampled_tokens": 0,
             "trained_tokens": 0, "decode_steps": 0, "generate_s": 0.0, "train_s": 0.0, "sync_s": 0.0, "wall_s": 0.0,
             "model_gpu_s": 0.0, "eval_success": summary["eval_success_start"],
             "eval_success_se": summary["eval_success_se_start"]}]  # fmt: skip
    for e in evals:
        done = [by_step[s] for s in range(e["step"] + 1) if s in by_step]
        trained = sum(m["completion_tokens"] for m in done)
        # decode steps: the longest trained completion per sampling round (dynamic sampling's extra rounds too);
        # a step without an update (every group invalid) logs no lengths: max_new_tokens per round, the bound
        decode = sum(m["completion_length_max"] * (1 + m["resample_rounds"]) for m in done)
        decode += sum(gpu["max_new_tokens"] * (1 + (skipped[s]["resample_rounds"] if s in skipped else 0))
                      for s in range(e["step"] + 1) if s not in by_step)  # fmt: skip
        model = (trained / gpu["train_tokens_per_s"] + decode * gpu["decode_step_s"]
                 + e["sampled_tokens"] / gpu["sample_tokens_per_s"])  # fmt: skip
        rows.append({"setting": setting, "seed": seed, "step": e["step"], "group_size": done[-1]["group_size"] if done
                     else "", "completions": e["completions_sampled"], "sampled_tokens": e["sampled_tokens"],
                     "trained_tokens": trained, "decode_steps": decode, "generate_s": round(e["generate_s"], 3),
                     "train_s": round(e["train_s"], 3), "sync_s": round(e["sync_s"], 3),
                     "wall_s": round(e["generate_s"] + e["train_s"] + e["sync_s"], 3), "model_gpu_s": round(model, 4),
                     "eval_success": e["eval_success"], "eval_success_se": e["eval_success_se"]})  # fmt: skip
    return rows


def run_row(curve: list[dict], steps: list[dict], target: float) -> dict:
    """The run's summary: at the first evaluation that reached the target, or at its end (reached = False)."""
    hit = next((r for r in curve if r["step"] >= 0 and r["eval_success"] >= target), None)
    at = hit or curve[-1]
    upto = [m for m in steps if m["step"] <= at["step"]]
    invalid = sum(m["invalid_group_rate"] for m in upto) / len(upto) if upto else float("nan")
    mean_g = sum(m["group_size"] for m in upto) / len(upto) if upto else float("nan")
    return {"setting": at["setting"], "seed": at["seed"], "reached": hit is not None, "target": target,
            "steps": at["step"] + 1, **{k: at[k] for k in ("completions", "sampled_tokens", "trained_tokens",
                                                            "wall_s", "generate_s", "train_s", "model_gpu_s")},
            "start_success": curve[0]["eval_success"], "end_success": at["eval_success"],
            "mean_group_size": round(mean_g, 2), "invalid_rate": round(invalid, 4),
            "all_zero_rate": _mean_of(upto, "invalid_all_zero_rate")}  # fmt: skip


def _mean_of(rows: list[dict], key: str):
    """Mean of rows[key] over the rows that have it, rounded ('' if none: a run from before the key was logged)."""
    xs = [r[key] for r in rows if key in r]
    return round(sum(xs) / len(xs), 4) if xs else ""


def collect(results: Path, gpu: dict) -> tuple[list[dict], list[dict]]:
    """(curves, runs) of every finished run under results/runs, in setting then seed order."""
    curves, runs = [], []
    order = {s: i for i, s in enumerate(SETTINGS)}
    found = sorted((results / "runs").glob("*_seed*/summary.json"),
                   key=lambda p: (order.get(p.parent.name.rsplit("_seed", 1)[0], 99), p.parent.name))  # fmt: skip
    for path in found:
        setting, seed = path.parent.name.rsplit("_seed", 1)
        summary = json.loads(path.read_text())
        curve = curves_of(path.parent, setting, int(seed), gpu)
        curves += curve
        runs.append(run_row(curve, _jsonl(path.parent / "metrics.jsonl"), summary["target_success"]))
    return curves, runs


def _read_csv(path: Path) -> list[dict]:
    with path.open(newline="") as f:
        rows = list(csv.DictReader(f))
    for r in rows:
        for k, v in r.items():
            if k in ("setting", "run"):  # names, even when they look like numbers ("16")
                continue
            if v in ("True", "False"):
                r[k] = v == "True"
            elif v != "":
                r[k] = float(v) if any(c in v for c in ".enia") else int(v)
    return rows


def _stats(values: list[float]) -> str:
    if not values:
        return "-"
    mean = sum(values) / len(values)
    return f"{mean:.4g} ({min(values):.4g}..{max(values):.4g})" if len(values) > 1 else f"{mean:.4g}"


def summary_table(runs: list[dict]) -> list[str]:
    lines = ["| setting | runs reached / total | steps | completions | completion tokens | wall s (measured) | "
             "generate s | train s | GPU s (model) | mean G | invalid-group rate | all-zero groups |",
             "|---" * 12 + "|"]  # fmt: skip
    for setting in dict.fromkeys(r["setting"] for r in runs):
        mine = [r for r in runs if r["setting"] == setting]
        hit = [r for r in mine if r["reached"]]
        cols = [_stats([r[k] for r in hit]) for k in ("steps", "completions", "sampled_tokens", "wall_s",
                                                       "generate_s", "train_s", "model_gpu_s")]  # fmt: skip
        lines.append(f"| {setting} | {len(hit)} / {len(mine)} | " + " | ".join(cols) +
                     f" | {_stats([r['mean_group_size'] for r in mine])} | "
                     f"{_stats([r['invalid_rate'] for r in mine])} | "
                     f"{_stats([r['all_zero_rate'] for r in mine if r.get('all_zero_rate', '') != ''])} |")  # fmt: skip
    return lines


INTERVAL_KEYS = (("steps", "steps", "{:.1f}"), ("completions", "completions", "{:,.0f}"),
                 ("model_gpu_s", "GPU s (model)", "{:.2f}"))  # fmt: skip


def _interval(values: list[float], form: str) -> str:
    """mean ± the 95 % Student-t half-width (the mean alone for one value)."""
    mean = sum(values) / len(values)
    if len(values) < 2:
        return form.format(mean)
    sd = (sum((v - mean) ** 2 for v in values) / (len(values) - 1)) ** 0.5
    return f"{form.format(mean)} ± {form.format(t975(len(values) - 1) * sd / len(values) ** 0.5)}"


def interval_tables(runs: list[dict]) -> list[str]:
    """Per setting, mean ± 95 % over the seeds, to the target; then every pair of settings paired by seed (a seed is
    the same SFT start, prompt stream and held-out set in every setting): the mean difference ± 95 % and whether the
    interval excludes 0. Only runs that reached the target count (how many did is in the first column)."""
    settings = list(dict.fromkeys(r["setting"] for r in runs))
    reached = {(r["setting"], r["seed"]): r for r in runs if r["reached"]}
    lines = ["| setting | seeds reached | " + " | ".join(name for _, name, _ in INTERVAL_KEYS) + " |",
             "|---|---:|" + "---:|" * len(INTERVAL_KEYS)]  # fmt: skip
    for setting in settings:
        hit = [r for (s, _), r in reached.items() if s == setting]
        total = sum(r["setting"] == setting for r in runs)
        cols = [_interval([r[k] for r in hit], form) if hit else "-" for k, _, form in INTERVAL_KEYS]
        lines.append(f"| {setting} | {len(hit)} / {total} | " + " | ".join(cols) + " |")
    lines += ["", "_Paired by seed, the first setting minus the second (mean difference ± 95 %; **bold**: the "
              "interval excludes 0, a resolved difference):_", ""]  # fmt: skip
    lines += ["| pair | seeds | " + " | ".join(name for _, name, _ in INTERVAL_KEYS) + " |",
              "|---|---:|" + "---:|" * len(INTERVAL_KEYS)]  # fmt: skip
    for i, a in enumerate(settings):
        for b in settings[i + 1 :]:
            seeds = sorted(seed for s, seed in reached if s == a and (b, seed) in reached)
            if len(seeds) < 2:
                continue
            cols = []
            for key, _, form in INTERVAL_KEYS:
                diffs = [reached[a, seed][key] - reached[b, seed][key] for seed in seeds]
                mean = sum(diffs) / len(diffs)
                sd = (sum((d - mean) ** 2 for d in diffs) / (len(diffs) - 1)) ** 0.5
                half = t975(len(diffs) - 1) * sd / len(diffs) ** 0.5
                text = f"{form.format(mean)} ± {form.format(half)}"
                cols.append(f"**{text}**" if abs(mean) > half else text)
            lines.append(f"| {a} - {b} | {len(seeds)} | " + " | ".join(cols) + " |")
    return lines


ADAPTIVE_COLUMNS = ["run", "step", "g_before", "g_after", "invalid_before", "invalid_after", "all_zero_before",
                    "all_zero_after"]  # fmt: skip
WINDOW = 5  # steps averaged before and from a change of G (group_size.window's default)


def adaptive_changes(results: Path) -> list[dict]:
    """What group_size.adaptive did in each adaptive run: every step where G changed, with the mean invalid-group
    rate of the WINDOW steps before it and from it (a step without an update counts as 1.0: every group invalid); a
    run whose G never changed gets one row with step -1 and its whole-run rate as invalid_before."""
    out = []
    mean = lambda xs: round(sum(xs) / len(xs), 4) if xs else ""  # noqa: E731
    for path in sorted((results / "runs").glob("adaptive_seed*/metrics.jsonl")):
        rows, run = _jsonl(path), path.parent.name
        changes = [(prev, cur) for prev, cur in zip(rows, rows[1:], strict=False)
                   if cur["group_size"] != prev["group_size"]]  # fmt: skip
        rate = {r["step"]: r["invalid_group_rate"] for r in rows}
        for prev, cur in changes:
            step = cur["step"]
            before = [r for r in rows if step - WINDOW <= r["step"] < step]
            after = [r for r in rows if step <= r["step"] < step + WINDOW]
            out.append({"run": run, "step": step, "g_before": prev["group_size"], "g_after": cur["group_size"],
                        "invalid_before": mean([rate[r["step"]] for r in before]),
                        "invalid_after": mean([rate[r["step"]] for r in after]),
                        "all_zero_before": _mean_of(before, "invalid_all_zero_rate"),
                        "all_zero_after": _mean_of(after, "invalid_all_zero_rate")})  # fmt: skip
        if not changes and rows:
            g = rows[0]["group_size"]
            out.append({"run": run, "step": -1, "g_before": g, "g_after": g,
                        "invalid_before": mean(list(rate.values())), "invalid_after": "",
                        "all_zero_before": _mean_of(rows, "invalid_all_zero_rate"), "all_zero_after": ""})  # fmt: skip
    return out


def adaptive_table(changes: list[dict]) -> list[str]:
    if not changes:
        return []
    lines = ["## What the adaptive schedule did", "",
             f"| run | step | G | invalid-group rate, {WINDOW} steps before | {WINDOW} steps from it | all-zero groups "
             f"before | from it |", "|---|---:|---|---:|---:|---:|---:|"]  # fmt: skip
    for c in changes:
        zero_before, zero_after = ("-" if c.get(k, "") == "" else c[k] for k in ("all_zero_before", "all_zero_after"))
        if int(c["step"]) < 0:
            lines.append(f"| {c['run']} | - | {c['g_before']} throughout | {c['invalid_before']} (whole run) | - | "
                         f"{zero_before} (whole run) | - |")  # fmt: skip
        else:
            lines.append(f"| {c['run']} | {c['step']} | {c['g_before']} -> {c['g_after']} | {c['invalid_before']} | "
                         f"{c['invalid_after']} | {zero_before} | {zero_after} |")  # fmt: skip
    return lines


def plots(results: Path, curves: list[dict], runs: list[dict]) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    settings = list(dict.fromkeys(r["setting"] for r in curves))
    colour = {s: plt.cm.viridis(i / max(1, len(settings) - 1)) for i, s in enumerate(settings)}
    target = runs[0]["target"] if runs else None
    paths = []
    for x, label, name in (("completions", "completions sampled", "success_vs_samples.png"),
                           ("wall_s", "seconds training + sampling (measured, this CPU)", "success_vs_time.png")):
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for (setting, seed) in dict.fromkeys((r["setting"], r["seed"]) for r in curves):
            mine = [r for r in curves if r["setting"] == setting and r["seed"] == seed]
            ax.plot([r[x] for r in mine], [r["eval_success"] for r in mine], "-o", ms=2, color=colour[setting],
                    alpha=0.8, label=f"G = {setting}" if setting.isdigit() else setting)  # fmt: skip
        if target is not None:
            ax.axhline(target, ls=":", color="gray", label=f"target {target:g}")
        handles, labels = ax.get_legend_handles_labels()
        unique = dict(zip(labels, handles, strict=True))
        ax.legend(unique.values(), unique.keys(), fontsize=8)
        ax.set(xlabel=label, ylabel="held-out success")
        fig.tight_layout()
        fig.savefig(results / name, dpi=110)
        plt.close(fig)
        paths.append(results / name)
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, key, label in ((axes[0], "wall_s", "seconds to target (measured, this CPU)"),
                           (axes[1], "model_gpu_s", "seconds to target (GPU model, not measured)")):
        for i, setting in enumerate(settings):
            mine = [r for r in runs if r["setting"] == setting]
            for r in mine:
                ax.plot(i, r[key], "o", color=colour[setting], mfc=colour[setting] if r["reached"] else "none")
            hit = [r[key] for r in mine if r["reached"]]
            if hit:
                mean = sum(hit) / len(hit)
                ax.errorbar(i, mean, yerr=[[mean - min(hit)], [max(hit) - mean]], fmt="_", ms=18, color="k",
                            capsize=4)  # fmt: skip
        ax.set_xticks(range(len(settings)), [f"G={s}" if s.isdigit() else s for s in settings], fontsize=8)
        ax.set(ylabel=label)
    fig.suptitle("time to target: mean and min..max of the runs that reached it (hollow: did not, at its total)",
                 fontsize=9)  # fmt: skip
    fig.tight_layout()
    fig.savefig(results / "time_to_target.png", dpi=110)
    plt.close(fig)
    return [*paths, results / "time_to_target.png"]


def first_eval_table(curves: list[dict]) -> list[str]:
    """The held-out success at every setting's first evaluation (the same number of steps for all): how far a
    step gets with each G, whatever the target; mean (min..max) over the seeds."""
    first = {}
    for r in curves:
        if r["step"] >= 0 and (r["setting"], r["seed"]) not in first:
            first[r["setting"], r["seed"]] = r
    if not first:
        return []
    lines = ["## Held-out success at the first evaluation", "",
             "| setting | after steps | completions | GPU s (model) | held-out success |", "|---|---:|---|---|---|"]
    for setting in dict.fromkeys(s for s, _ in first):
        mine = [r for (s, _), r in first.items() if s == setting]
        lines.append(f"| {setting} | {int(mine[0]['step']) + 1} | {_stats([r['completions'] for r in mine])} | "
                     f"{_stats([r['model_gpu_s'] for r in mine])} | {_stats([r['eval_success'] for r in mine])} |")
    return lines


def report(results: Path, curves: list[dict], runs: list[dict], *, command: str, gpu: dict, cpus: str | None = None,
           planned: int | None = None) -> list[Path]:
    where = f"CPU {cpus} of this machine, one thread each (--cpus)" if cpus else "this machine's CPUs"
    done = [] if planned is None or len(runs) >= planned else [
        f"**In progress: {len(runs)} of the {planned} runs asked for are finished** (the study resumes where it "
        "stopped; the table and plots hold the finished runs only).", ""]  # fmt: skip
    lines = ["# Group size vs learning (time to a held-out target)", "", f"Command: `{command}`", "", *done,
             f"Per setting, over the seeds that reached the target: mean (min..max). Wall seconds are the train + "
             f"generate + weight-sync time on {where} (evaluations left out); GPU seconds are a model, not a "
             f"measurement: tokens trained / {gpu['train_tokens_per_s']:g} tokens/s + decode steps x "
             f"{gpu['decode_step_s']:g} s + tokens sampled / {gpu['sample_tokens_per_s']:g} tokens/s.", "",
             *summary_table(runs), "", "## To the target, mean ± 95 % over seeds", "", *interval_tables(runs), "",
             *first_eval_table(curves), ""]  # fmt: skip
    adaptive = adaptive_table(_read_csv(results / "adaptive.csv") if (results / "adaptive.csv").exists() else [])
    lines += [*adaptive, ""] if adaptive else []
    (results / "summary.md").write_text("\n".join(lines))
    return [results / "summary.md", *plots(results, curves, runs)]


def gpu_model(args) -> dict:
    return {"train_tokens_per_s": args.gpu_train_tokens_per_s, "decode_step_s": args.gpu_decode_step_s,
            "sample_tokens_per_s": args.gpu_sample_tokens_per_s, "max_new_tokens": args.max_new_tokens}  # fmt: skip


def run(args, out_root: Path | None = None) -> int:
    name = "tiny" if args.quick else Path(args.model).name
    if getattr(args, "format_weight", None) is not None:  # another study: its own results and runs
        if not 0.0 <= args.format_weight <= 1.0:
            raise SystemExit(f"group-size-study: --format-weight {args.format_weight} is not in [0, 1]")
        name += f"_format_weight{args.format_weight:g}"
    results = (out_root or OUT) / name
    gpu = gpu_model(args)
    if not args.plot_only:
        settings = args.settings.split(",")
        bad = [s for s in settings if s not in SETTINGS]
        if bad:
            raise SystemExit(f"group-size-study: unknown --settings {', '.join(bad)} (known: {', '.join(SETTINGS)})")
        seeds = [int(s) for s in args.seeds.split(",")]
        if args.cpus:
            cpu_numbers(args.cpus, "group-size-study")
        workdir = Path(args.workdir or Path.home() / ".cache" / "grpo-kernels" / "group_size_learning" / name)
        workdir.mkdir(parents=True, exist_ok=True)
        results.mkdir(parents=True, exist_ok=True)
        for seed in seeds:  # every setting once before the second seed: a study cut short is balanced
            for setting in settings:
                start = time.perf_counter()
                what = train_run(args, setting, seed, workdir, results)
                print(f"{setting:>8s} seed {seed}: {what} ({time.perf_counter() - start:.0f} s)", flush=True)
                if what != "done before":  # the CSVs and report so far: a study stopped between runs has them
                    _collect_csvs(results, gpu)
                    report(results, _read_csv(results / "curves.csv"), _read_csv(results / "runs.csv"),
                           command=command_of(args), gpu=gpu, cpus=args.cpus, planned=planned(args))  # fmt: skip
        _collect_csvs(results, gpu)
    elif list((results / "runs").glob("*_seed*/summary.json")):  # the CSVs again from the runs' own files
        _collect_csvs(results, gpu)
    if not (results / "curves.csv").exists():
        raise SystemExit(f"group-size-study: no {results / 'curves.csv'} to plot (run the study first)")
    curves, runs = _read_csv(results / "curves.csv"), _read_csv(results / "runs.csv")
    for path in report(results, curves, runs, command=command_of(args), gpu=gpu, cpus=args.cpus,
                       planned=planned(args)):  # fmt: skip
        print(f"wrote {path}")
    return 0


def planned(args) -> int:
    """Runs the command asks for: settings x seeds."""
    return len(args.settings.split(",")) * len(args.seeds.split(","))


def _collect_csvs(results: Path, gpu: dict) -> None:
    curves, runs = collect(results, gpu)
    write_csv(curves, results / "curves.csv", CURVE_COLUMNS)
    write_csv(runs, results / "runs.csv", RUN_COLUMNS)
    if list((results / "runs").glob("adaptive_seed*/metrics.jsonl")):
        write_csv(adaptive_changes(results), results / "adaptive.csv", ADAPTIVE_COLUMNS)


def command_of(args) -> str:
    if args.quick:
        return "grpo-kernels group-size-study --learning --quick"
    return (f"grpo-kernels group-size-study --model {args.model} --learning --target {args.target} "
            f"--settings {args.settings} --seeds {args.seeds} --max-steps {args.max_steps} --eval-every "
            f"{args.eval_every} --eval-prompts {args.eval_prompts} --prompts-per-step {args.prompts_per_step} --task "
            f"{args.task} --difficulty {args.difficulty} --temperature {args.temperature} --max-new-tokens "
            f"{args.max_new_tokens} --lr {args.lr} --sampler {args.sampler} --adaptive-threshold "
            f"{args.adaptive_threshold}"
            + (f" --format-weight {args.format_weight:g}" if getattr(args, "format_weight", None) is not None else "")
            + (f" --cpus {args.cpus}" if args.cpus else ""))  # fmt: skip


QUICK = {"model": "tiny", "task": "add", "difficulty": 1, "settings": "2,8", "seeds": "0", "max_steps": 4,
         "eval_every": 2, "eval_prompts": 8, "prompts_per_step": 4, "max_new_tokens": 4, "temperature": 1.0,
         "lr": 1e-3, "sampler": "hf", "sft_steps": 40, "target": 1.0}  # fmt: skip


def add_arguments(parser) -> None:
    parser.add_argument("--learning", action="store_true",
                        help="time to a held-out target vs G, adaptive G and dynamic sampling (learning.py)")
    parser.add_argument("--target", type=float, help="--learning: the held-out success that ends a run, in (0, 1]")
    parser.add_argument("--settings", default=",".join(SETTINGS), help="--learning: G values, adaptive, dynamic")
    parser.add_argument("--seeds", default="0,1", help="--learning: run seeds")
    parser.add_argument("--max-steps", type=int, default=60, help="--learning: steps of a run that misses the target")
    parser.add_argument("--eval-every", type=int, default=4, help="--learning: steps between held-out evaluations")
    parser.add_argument("--eval-prompts", type=int, default=128, help="--learning: held-out prompts")
    parser.add_argument("--lr", type=float, default=2e-5, help="--learning: learning rate")
    parser.add_argument("--format-weight", type=float,
                        help="--learning: arith's bare-integer bonus (task.format_weight; default: the task's own, 0); "
                             "its own results directory, <model>_format_weight<W>")
    parser.add_argument("--adaptive-threshold", type=float, default=0.5,
                        help="--learning: group_size.invalid_rate_threshold of the adaptive setting")
    parser.add_argument("--workdir", help="--learning: where the runs and their checkpoints live")
    parser.add_argument("--cpus", help="--learning: run the trainings on these CPUs only, one thread each (e.g. 0 or "
                        "0-1): wall times that other work on the machine does not disturb")  # fmt: skip
    parser.add_argument("--gpu-train-tokens-per-s", type=float, default=50_000.0,
                        help="--learning, GPU model: training throughput (an input, not a measurement)")
    parser.add_argument("--gpu-decode-step-s", type=float, default=0.01,
                        help="--learning, GPU model: seconds per decode step of a batch (an input)")
    parser.add_argument("--gpu-sample-tokens-per-s", type=float, default=20_000.0,
                        help="--learning, GPU model: sampling throughput on top of the decode steps (an input)")

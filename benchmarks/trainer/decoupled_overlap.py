"""Step time of colocated vs decoupled rollouts (max_staleness 0 and 1), measured side by side, and a model of the
gain that overlapping generation with training gives where the two really run on separate devices.

Usage (from the repository root; needs vllm, `make setup-vllm`):
    .venv/bin/python benchmarks/trainer/decoupled_overlap.py                    # tiny task, 60 steps per mode (~5 min)
    .venv/bin/python benchmarks/trainer/decoupled_overlap.py --model smollm2-135m --steps 8   # the real LLM (~20 min)
    .venv/bin/python benchmarks/trainer/decoupled_overlap.py --predict RUN_DIR  # the model only, from any run's metrics

Three `grpo-kernels train` runs with the same seeds and sizes (vLLM sampler in all three): "colocated" (an
in-process engine; sampling and training take turns on all cores), "decoupled_k0" (a `vllm serve` process on its own
cores, synchronous) and "decoupled_k1" (max_staleness 1: the batch of step t + 1 is sampled while step t trains).
On a CPU the decoupled runs split the cores: the server gets half of them, the trainer the other half.

Reported per mode, medians over the steps after the first 2: step_s (wall time between consecutive steps' ends),
generate_s (sampling + rewards of the step's batch, in the sampling thread when decoupled), wait_s (how long the
trainer waited for that batch), train_s (grpo_step), sync_s (the weight transfer itself, weight_sync_s: without the
pause/resume of the servers and the log-prob check after it).

The overlap model: a synchronous step costs generate + train + sync + the rest (pause, check, bookkeeping); with
max_staleness >= 1 the next batch is generated during training, and the weight update waits for it, so a step costs
min(generate, train) less. From the decoupled_k0 run's own times it predicts the k = 1 step time and the gain (k0
step / k1 step), printed next to the measured k = 1 step. It holds when sampler and trainer do not compete for
anything: separate GPUs. On a shared CPU they compete (memory bandwidth, the server's processes on one core), so the
measured gain falls short of the prediction; `--predict RUN_DIR` applies the model to a GPU run's metrics instead.
Rows are appended to benchmarks/results/decoupled_<device>.csv.
"""

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # importable from a plain checkout too

from benchmarks.common import append_csv  # noqa: E402

TINY = ["--task.name=add", "--task.difficulty=1", "--task.sft_warmup_steps=120", "--task.num_eval_prompts=16",
        "--sampling.group_size=8", "--sampling.prompts_per_step=16", "--sampling.max_new_tokens=4",
        "--packing.token_budget=256", "--optim.lr=5e-4"]  # fmt: skip
SMOLLM2 = ["--config", str(ROOT / "examples" / "train_smollm2_cpu.toml"), "--task.num_eval_prompts=8"]
MODES = {"colocated": [], "decoupled_k0": ["--sampling.placement=decoupled"],
         "decoupled_k1": ["--sampling.placement=decoupled", "--sampling.max_staleness=1"]}  # fmt: skip


def _median(rows, key, skip=2):
    values = [r[key] for r in rows[skip:] if key in r]
    return statistics.median(values) if values else float("nan")


def summarize(rows: list[dict]) -> dict:
    """Median per-step times of a run's metrics.jsonl rows (the first 2 steps skipped)."""
    ends = [r["elapsed_s"] for r in rows]
    steps = [b - a for a, b in zip(ends[:-1], ends[1:], strict=True)][1:]
    return {"step_s": statistics.median(steps) if steps else float("nan"),
            "generate_s": _median(rows, "rollout_generate_s"), "wait_s": _median(rows, "rollout_wait_s"),
            "train_s": _median(rows, "train_step_s"), "sync_s": _median(rows, "weight_sync_s"),
            "staleness": max((r.get("rollout_staleness", 0) for r in rows), default=0)}  # fmt: skip


def predict(times: dict) -> dict:
    """The overlap model on a synchronous run's times: {sync_step_s, overlap_step_s, gain}. The synchronous step
    is the measured one (generate + train + sync + the rest: the sync check, bookkeeping); overlapping saves
    min(generate, train) of it."""
    g, t = times["generate_s"], times["train_s"]
    sync_step = times["step_s"]
    overlap_step = sync_step - min(g, t)
    return {"sync_step_s": sync_step, "overlap_step_s": overlap_step, "gain": sync_step / overlap_step}


def _run(mode: str, base: list, steps: int, work: Path) -> list[dict]:
    run = work / mode
    cmd = [sys.executable, "-m", "grpo_kernels.cli", "train", *base, *MODES[mode], f"--optim.steps={steps}",
           f"--logging.run_dir={run}", "--sampling.sampler=vllm", "--logging.log_every=1000"]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK")}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT)
    if proc.returncode != 0:
        raise SystemExit(f"{mode} failed:\n{proc.stderr[-3000:]}")
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", help="a known model or HF directory (default: the built-in tiny decoder)")
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--predict", metavar="RUN_DIR", help="only apply the overlap model to RUN_DIR/metrics.jsonl")
    p.add_argument("--csv", help="append rows here (default benchmarks/results/decoupled_<device>.csv)")
    args = p.parse_args(argv)
    if args.predict:
        rows = [json.loads(line) for line in (Path(args.predict) / "metrics.jsonl").read_text().splitlines()]
        times = summarize(rows)
        model = predict(times)
        print(f"{args.predict}: step {times['step_s']:.4f} s, generate {times['generate_s']:.4f} s, train "
              f"{times['train_s']:.4f} s, sync {times['sync_s']:.4f} s (medians) -> overlapped "
              f"{model['overlap_step_s']:.4f} s: predicted gain {model['gain']:.2f}x")  # fmt: skip
        if times["staleness"]:
            print("(this run already overlaps: the model is meant for a synchronous one, max_staleness 0)")
        return
    base = SMOLLM2 if args.model == "smollm2-135m" else TINY
    if args.model and args.model != "smollm2-135m":
        base = [*SMOLLM2, f"--model.name={args.model}"]
    name = args.model or "tiny"
    with tempfile.TemporaryDirectory(prefix="grpo-decoupled-bench-") as work:
        results = {mode: summarize(_run(mode, base, args.steps, Path(work))) for mode in MODES}
    model = predict(results["decoupled_k0"])
    base_step = results["colocated"]["step_s"]
    print(f"| {name} | step_s | vs colocated | generate_s | wait_s | train_s | sync_s |")
    print("|---|---|---|---|---|---|---|")
    for mode, r in results.items():
        print(f"| {mode} | {r['step_s']:.4f} | {r['step_s'] / base_step:.2f} | {r['generate_s']:.4f} | "
              f"{r['wait_s']:.4f} | {r['train_s']:.4f} | {r['sync_s']:.4f} |")  # fmt: skip
    measured_gain = results["decoupled_k0"]["step_s"] / results["decoupled_k1"]["step_s"]
    print(f"\noverlap model from decoupled_k0's times: k1 step {model['overlap_step_s']:.4f} s predicted, "
          f"{results['decoupled_k1']['step_s']:.4f} s measured; gain over k0 {model['gain']:.2f}x predicted, "
          f"{measured_gain:.2f}x measured")  # fmt: skip
    device = "cpu"
    out = Path(args.csv) if args.csv else ROOT / "benchmarks" / "results" / f"decoupled_{device}.csv"
    sha = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT).stdout
    stamp = datetime.datetime.now().isoformat(timespec="seconds")
    fields = ["timestamp", "machine", "git_sha", "model", "mode", "steps", "step_s", "step_vs_colocated",
              "generate_s", "wait_s", "train_s", "sync_s", "predicted_step_s"]  # fmt: skip
    rows = [{"timestamp": stamp, "machine": platform.processor() or platform.machine(), "git_sha": sha.strip(),
             "model": name, "mode": mode, "steps": args.steps, "step_s": round(r["step_s"], 5),
             "step_vs_colocated": round(r["step_s"] / base_step, 3), "generate_s": round(r["generate_s"], 5),
             "wait_s": round(r["wait_s"], 5), "train_s": round(r["train_s"], 5), "sync_s": round(r["sync_s"], 5),
             "predicted_step_s": round(model["overlap_step_s"], 5) if mode == "decoupled_k1" else ""}
            for mode, r in results.items()]  # fmt: skip
    append_csv(rows, out, fields)
    print(f"rows appended to {out}")


if __name__ == "__main__":
    main()

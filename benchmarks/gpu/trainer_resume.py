"""The trainer resumes on CUDA: a DCP checkpoint of CUDA state, and a resume that continues with the same losses.

    torchrun --standalone --nproc_per_node=1 -m benchmarks.gpu.trainer_resume --out DIR            # GPU, < 2 min
    torchrun --standalone --nproc_per_node=1 -m benchmarks.gpu.trainer_resume --dry-run --out DIR  # CPU, gloo

Run A trains the tiny decoder on addition for 4 steps, checkpointing (torch.distributed.checkpoint, FSDP2-sharded
state under torchrun) every 2. Run B is a copy of A's directory resumed from its step-2 checkpoint
(checkpoint.resume_step = 2): it replays steps 3 and 4. Rows of DIR/trainer_resume.csv: per replayed step, every
metric of B against A (the largest relative difference; timings left out), and the step-4 weights of B against A
(the largest absolute difference). On the CPU both are exact (tests/test_checkpoint_resume.py); on a GPU a kernel
whose reductions are ordered by atomics (flash attention's backward) may differ in the last bits, which the rows
show rather than hide. The verdict row: "exact" or the largest differences.
"""

import json
import shutil
import sys
from pathlib import Path

import torch

from benchmarks.common import write_csv
from benchmarks.gpu import stage_args
from grpo_kernels.train import checkpoint as run_checkpoints
from grpo_kernels.train.config.io import load_config
from grpo_kernels.train.data.tasks import CharTokenizer, tiny_model
from grpo_kernels.train.model.policy import Policy
from grpo_kernels.train.trainer import TIMING_METRICS, train

ARGS = ["--optim.steps=4", "--optim.lr=1e-2", "--sampling.group_size=8", "--sampling.prompts_per_step=2",
        "--sampling.max_new_tokens=4", "--sampling.sampler=hf", "--task.name=add", "--task.sft_warmup_steps=40",
        "--task.num_eval_prompts=2", "--task.num_train_prompts=16", "--model.name=tiny", "--model.hidden_size=32",
        "--model.num_layers=1", "--packing.token_budget=48", "--checkpoint.every=2",
        "--logging.log_every=1"]  # fmt: skip
# (the CSV's step is metrics.jsonl's, counted from 0: the replayed steps 3 and 4 are its 2 and 3)
TIMINGS = TIMING_METRICS
FIELDS = ["step", "quantity", "largest_difference", "unit", "verdict"]


def metrics(run: Path) -> list[dict]:
    lines = (run / "metrics.jsonl").read_text().splitlines()
    return [{k: v for k, v in json.loads(line).items() if k not in TIMINGS} for line in lines]


def weights(checkpoint: Path) -> dict:
    policy = Policy(tiny_model(CharTokenizer().vocab_size, hidden_size=32, num_layers=1))
    run_checkpoints.load_checkpoint(checkpoint, policy=policy, optimizer=torch.optim.AdamW(policy.parameters()),
                                    ref_policy=None)  # fmt: skip
    return {k: v.detach().float().cpu() for k, v in policy.state_dict().items()}


def compare(a: Path, b: Path) -> list[dict]:
    rows = []
    for line_a, line_b in zip(metrics(a), metrics(b), strict=True):
        if line_a.get("step", 0) < 2:
            continue
        worst = 0.0
        for key, value in line_a.items():
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                other = line_b[key]
                worst = max(worst, abs(other - value) / max(abs(value), 1e-12))
        rows.append(dict(step=line_a.get("step"), quantity="every metric", largest_difference=f"{worst:.3g}",
                         unit="relative"))  # fmt: skip
    wa, wb = weights(a / "checkpoints" / "step_4"), weights(b / "checkpoints" / "step_4")
    worst = max(float((wa[k] - wb[k]).abs().max()) for k in wa)
    rows.append(dict(step=4, quantity="weights", largest_difference=f"{worst:.3g}", unit="absolute"))
    return rows


def main(argv=None) -> int:
    _, out = stage_args("trainer_resume", __doc__, "CPU (gloo)", argv)
    run_a, run_b = out / "resume_a", out / "resume_b"
    shutil.rmtree(run_a, ignore_errors=True)
    shutil.rmtree(run_b, ignore_errors=True)
    train(load_config(None, [*ARGS, f"--logging.run_dir={run_a}"]), log=lambda *a, **k: None)
    shutil.copytree(run_a, run_b)
    train(load_config(None, [*ARGS, f"--logging.run_dir={run_b}", f"--checkpoint.resume={run_b}",
                             "--checkpoint.resume_step=2"]), log=lambda *a, **k: None)  # fmt: skip
    rows = compare(run_a, run_b)
    # B's step-4 checkpoint was written again by the replay (the copy kept A's file times): the resume did run.
    written = [max(p.stat().st_mtime_ns for p in (run / "checkpoints" / "step_4").iterdir()) for run in (run_a, run_b)]
    rows.append(dict(step=3, quantity="replayed", verdict="yes" if written[1] > written[0] else "NO: nothing ran"))
    diffs = [float(r["largest_difference"]) for r in rows if "largest_difference" in r]
    exact, worst = all(d == 0.0 for d in diffs), max(diffs)
    rows.append(dict(step="all", quantity="verdict", verdict="exact" if exact else f"largest difference {worst:.3g}"))
    write_csv(rows, out / "trainer_resume.csv", FIELDS)
    for r in rows:
        print(r, flush=True)
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())

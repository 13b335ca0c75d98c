"""The trainer learns on CUDA: the CI learning check's configuration and seeds under torchrun (one process, NCCL).

    torchrun --standalone --nproc_per_node=1 -m benchmarks.gpu.trainer_learns --out DIR            # GPU, < 5 min
    torchrun --standalone --nproc_per_node=1 -m benchmarks.gpu.trainer_learns --dry-run --out DIR  # CPU, gloo, ~30 s

Each seed is tests/learning_check.py's run (the tiny decoder on single-digit addition: one shared SFT warm start,
then DAPO with G = 8, 16 prompts per step, two optimizer iterations per rollout, 256 held-out prompts before and after
RL), here on the GPU: the HF sampler on CUDA, packed attention and the fused LM-head loss inside the trainer, the
process group over NCCL, in fp32 (model.dtype = "float32"; the CSV names it). fp32 because the threshold
(learning_check.MIN_MEAN_GAIN) was calibrated in fp32 (60 seeds on the CPU, where a float path with another summation
order gained the same): a CUDA fp32 run differs from it only in rounding order, so the check's failure rates carry
over. The trainer's default on CUDA, bf16 compute ("auto"), learns in other arithmetic, whose gain was never
calibrated; a verdict on it against this threshold would mean nothing. The bf16 path is timed by the speed and trl
stages (the trl stage checks its loss against TRL's). The stage passes when the mean held-out gain over the seeds
reaches the threshold. Writes DIR/trainer_learns.csv (a row per seed and one verdict row) and, per seed,
DIR/learns_seed<N>/ (the run directory as on the CPU: config.toml, metrics.jsonl, summary.json). The dry run takes one
seed through a few steps on the CPU (gloo) to check the stage end to end; its gain means nothing.
"""

import sys
import time
from pathlib import Path

import torch

from benchmarks.common import write_csv
from benchmarks.gpu import stage_args

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))  # learning_check: the CI check's configuration, not a copy of it

import learning_check  # noqa: E402

from grpo_kernels.train.config.io import load_config  # noqa: E402

FIELDS = ["seed", "device", "backend", "dtype", "eval_start", "eval_end", "gain", "seconds", "verdict"]
FP32 = ("--model.dtype=float32",)  # the dtype the threshold was calibrated in (the CUDA default "auto" is bf16)
DRY_RUN = ("--task.sft_warmup_steps=4", "--optim.steps=2", "--task.num_eval_prompts=16",
           "--sampling.prompts_per_step=4", "--logging.log_every=1")  # fmt: skip


def run_seed(seed: int, out: Path, dry: bool) -> dict:
    run_dir = out / f"learns_seed{seed}"
    start = time.perf_counter()
    summary = learning_check.run(seed, run_dir, (*FP32, *(DRY_RUN if dry else ())))  # the check's shared warm start
    dtype = load_config(run_dir / "config.toml").model.dtype
    return dict(seed=seed, dtype=dtype, eval_start=summary["eval_success_start"], eval_end=summary["eval_success_end"],
                gain=summary["eval_success_end"] - summary["eval_success_start"],
                seconds=round(time.perf_counter() - start, 1))  # fmt: skip


def main(argv=None) -> int:
    args, out = stage_args("trainer_learns", __doc__, "CPU (gloo), one seed, a few steps", argv)
    seeds = learning_check.SEEDS[:1] if args.dry_run else learning_check.SEEDS
    device = "cpu" if args.dry_run else torch.cuda.get_device_name()
    backend = "gloo" if args.dry_run else "nccl"
    rows = []
    for seed in seeds:
        rows.append(dict(run_seed(seed, out, args.dry_run), device=device, backend=backend))
        print(f"seed {seed}: gain {rows[-1]['gain']:+.3f} ({rows[-1]['seconds']} s)", flush=True)
    passed, line = learning_check.verdict([r["gain"] for r in rows])
    rows.append(dict(seed="all", device=device, backend=backend, verdict=f"{'pass' if passed else 'FAIL'}: {line}"))
    write_csv(rows, out / "trainer_learns.csv", FIELDS)
    print(rows[-1]["verdict"])
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    return 0 if passed or args.dry_run else 1


if __name__ == "__main__":
    sys.exit(main())

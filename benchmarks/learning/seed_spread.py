"""The spread of a training recipe over seeds: one `grpo-kernels train` run per seed, and what a user should expect.

    python -m benchmarks.learning.seed_spread --config examples/train_tiny_cpu.toml --seeds 0-4 [--cpus 0,1] [--out DIR]
        [--no-simd] [--override=--optim.lr=3e-4 ...]
    python -m benchmarks.learning.seed_spread --config ... --out DIR --plot-only  # the report from the runs' files

One held-out evaluation (the trainer's own, at its end) per seed. The report says, per run, the held-out success
before and after and the machine it ran on (CPU model, torch's CPU capability, whether this package's AVX-512 paths
ran), and over the seeds the mean with its 95 % t-interval and min..max: `held-out 0.89 (0.84..0.93 over 5 seeds)`.
That spread, not the `±` the trainer prints (one evaluation's binomial error), is how reproducible the recipe is.
--no-simd turns this package's AVX-512 C++ paths off in every run (`grpo_kernels.cpu.simd(False)`);
ATEN_CPU_CAPABILITY=avx2 in the environment sends torch's own kernels down their AVX2 paths.
With --cpus, as many runs at once as CPUs are named, each pinned to its CPU with one thread.

Writes into --out (default benchmarks/results/seed_spread/<config name>): runs/seed<k>/ (eval.jsonl,
summary.json, config.toml, machine.json), seeds.csv (a row per seed) and summary.md. A finished seed is not run again.
"""

import argparse
import json
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # importable from a plain checkout too

from benchmarks.common import ROOT, cpu_numbers, number_list, run_logged, run_pinned, write_csv

COLUMNS = ["seed", "eval_start", "eval_end", "steps", "seconds", "cpu_model", "torch_capability", "package_simd"]
RUN_FILES = ("eval.jsonl", "summary.json", "config.toml", "machine.json")  # metrics.jsonl (~0.6 MB) stays in --workdir
# The train CLI in a child process, after recording the machine and (--no-simd) turning this package's SIMD off.
CHILD = """import json, sys, torch
from grpo_kernels import cpu
from benchmarks.common import device_name
run_dir, simd, argv = sys.argv[1], sys.argv[2] == "on", sys.argv[3:]
cpu.simd(simd)
from pathlib import Path
Path(run_dir).mkdir(parents=True, exist_ok=True)
(Path(run_dir) / "machine.json").write_text(json.dumps({"cpu_model": device_name("cpu"),
    "torch_capability": torch.backends.cpu.get_cpu_capability(),
    "package_simd": cpu.simd_enabled()}))
from grpo_kernels.cli import main
main(["train", *argv])
"""


def run_seed(args, seed: int, workdir: Path, out: Path, cpu: int | None) -> str:
    kept = out / "runs" / f"seed{seed}"
    if (kept / "summary.json").exists():
        return "done before"
    run_dir = workdir / f"seed{seed}"
    shutil.rmtree(run_dir, ignore_errors=True)
    argv = ["--config", str(args.config), f"--seed={seed}", f"--logging.run_dir={run_dir}", "--checkpoint.every=0",
            *args.override]  # fmt: skip
    workdir.mkdir(parents=True, exist_ok=True)
    code, _ = run_logged([sys.executable, "-c", CHILD, str(run_dir), "off" if args.no_simd else "on", *argv],
                         workdir / f"seed{seed}.log", cpu)  # fmt: skip
    if code != 0:
        tail = (workdir / f"seed{seed}.log").read_text().strip().splitlines()[-1:] or ["(no output)"]
        return f"FAILED (exit {code}): {tail[0]}"
    kept.mkdir(parents=True, exist_ok=True)
    for name in RUN_FILES:
        if (run_dir / name).exists():
            shutil.copy2(run_dir / name, kept / name)
    return "finished"


def rows_of(out: Path) -> list[dict]:
    rows = []
    for path in sorted((out / "runs").glob("seed*/summary.json"), key=lambda p: int(p.parent.name[4:])):
        summary = json.loads(path.read_text())
        machine = json.loads((path.parent / "machine.json").read_text())
        rows.append({"seed": int(path.parent.name[4:]), "eval_start": summary["eval_success_start"],
                     "eval_end": summary["eval_success_end"], "steps": summary["steps"],
                     "seconds": round(summary["seconds"], 1), **machine})  # fmt: skip
    return rows


def spread(values: list[float]) -> str:
    """`0.89 (0.84..0.93 over 5 seeds; mean ± 95 % t-interval 0.89 ± 0.04)`."""
    from benchmarks.learning.intervals import mean_ci

    mean, half = mean_ci(values)
    if len(values) == 1:
        return f"{mean:.3f} (1 seed)"
    return (f"{mean:.3f} ({min(values):.3f}..{max(values):.3f} over {len(values)} seeds; mean ± 95 % t-interval "
            f"{mean:.3f} ± {half:.3f})")  # fmt: skip


def report(out: Path, command: str) -> str:
    rows = rows_of(out)
    write_csv(rows, out / "seeds.csv", COLUMNS)
    line = f"held-out {spread([r['eval_end'] for r in rows])}, from {spread([r['eval_start'] for r in rows])}"
    machines = sorted({f"{r['cpu_model']}, torch {r['torch_capability']}, package AVX-512 "
                       f"{'on' if r['package_simd'] else 'off'}" for r in rows})  # fmt: skip
    lines = ["# Seed spread", "", f"Command: `{command}`", "", f"**{line}**", "", f"Machine: {'; '.join(machines)}",
             "", "| seed | held-out before | after | steps | seconds |", "|---:|---:|---:|---:|---:|",
             *[f"| {r['seed']} | {r['eval_start']:.3f} | {r['eval_end']:.3f} | {r['steps']} | {r['seconds']} |"
               for r in rows], ""]  # fmt: skip
    (out / "summary.md").write_text("\n".join(lines))
    return line


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", type=Path, required=True, help="a `grpo-kernels train` TOML")
    parser.add_argument("--seeds", default="0-4", help='"0-4" or "0,3,7"')
    parser.add_argument("--cpus", help="run this many at once, each pinned to one of these CPUs (e.g. 0,1)")
    parser.add_argument("--out", type=Path, help="default benchmarks/results/seed_spread/<config name>")
    parser.add_argument("--workdir", type=Path, help="where the runs train (default ~/.cache/grpo-kernels/...)")
    parser.add_argument("--no-simd", action="store_true", help="this package's AVX-512 C++ paths off in every run")
    parser.add_argument("--override", action="append", default=[], help="a train override, e.g. --override="
                        "--optim.lr=3e-4 (repeatable)")  # fmt: skip
    parser.add_argument("--plot-only", action="store_true", help="the report from the runs' files alone")
    args = parser.parse_args(argv)
    if not args.config.is_file():
        raise SystemExit(f"seed-spread: --config {args.config} is not a file")
    try:
        seeds = number_list(args.seeds)
    except ValueError:
        raise SystemExit(f"seed-spread: --seeds {args.seeds!r}: e.g. 0-4 or 0,3,7") from None
    from grpo_kernels.train.config.io import load_config

    try:
        load_config(args.config, args.override)  # a bad config or override: here, before any run
    except ValueError as exc:
        raise SystemExit(f"seed-spread: {exc}") from None
    cpus = cpu_numbers(args.cpus, "seed-spread") if args.cpus else []
    out = args.out or ROOT / "benchmarks" / "results" / "seed_spread" / args.config.stem
    workdir = args.workdir or Path.home() / ".cache" / "grpo-kernels" / "seed_spread" / args.config.stem
    command = " ".join(["python -m benchmarks.learning.seed_spread", f"--config {args.config}", f"--seeds {args.seeds}",
                        *(["--no-simd"] if args.no_simd else []), *[f"--override={o}" for o in args.override]])
    if not args.plot_only:
        out.mkdir(parents=True, exist_ok=True)

        def done(seed, what, seconds):
            print(f"seed {seed}: {what} ({seconds:.0f} s)", flush=True)

        run_pinned(seeds, cpus,
                   lambda seed, cpu: run_seed(args, seed, workdir, out, cpu), done)  # fmt: skip
    if not list((out / "runs").glob("seed*/summary.json")):
        raise SystemExit(f"seed-spread: no finished run under {out / 'runs'}")
    print(report(out, command))
    return 0


if __name__ == "__main__":
    sys.exit(main())

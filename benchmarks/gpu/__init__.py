"""Stages for a lent H100/H200 machine, each one call with its own time limit, each with a CPU dry run tested in CI
(tests/test_gpu_stages.py): ops_limits (the ops against the hardware's limits), trainer_learns, trainer_speed,
trl_side_by_side, trainer_resume. benchmarks/gpu/run.sh runs them."""

import argparse
from pathlib import Path

__all__ = ["stage_args"]


def stage_args(name: str, doc: str, dry_help: str, argv=None, setup=None) -> tuple[argparse.Namespace, Path]:
    """(arguments, the output directory, made) of a stage's command line: --dry-run (dry_help) and --out, plus what
    setup(parser) adds; without --dry-run and without CUDA, exits with one line naming the stage."""
    import torch

    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true", help=dry_help)
    parser.add_argument("--out", default="benchmarks/results/gpu_run", help="directory of the stage's CSV")
    if setup is not None:
        setup(parser)
    args = parser.parse_args(argv)
    if not args.dry_run and not torch.cuda.is_available():
        raise SystemExit(f"{name}: no CUDA device (use --dry-run on a machine without a GPU)")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    return args, out

"""Where a long-chain step's time goes: one GRPO step (G completions of L tokens, default 8 x 2,000, SmolLM2-135M
fp32, one micro-batch) per provider under torch's profiler (CPU ops), as a table by phase and by kind of op.

Usage (from the repository root):
    .venv/bin/python -m benchmarks.long_chains.profile_step          # trl_ckpt, gk_blocks, gk_tiled, 8 x 2000 (~20 min)
    .venv/bin/python -m benchmarks.long_chains.profile_step --quick  # the tiny model, 4 x 128 (the smoke test)
    .venv/bin/python -m benchmarks.long_chains.profile_step --table-only

Each measurement is long_chains.py's (a fresh process, the same synthetic prompt and completions, one warm-up step,
then the step), with the step under torch.profiler and each decoder block's forward labelled, so the backward's
recompute of the blocks is told from the forward. Phases are spans of time: "forward and loss" runs until the
backward's first autograd node (grpo-kernels' fused head computes its gradient there), "backward" until the
optimizer's step. Kinds of op are self CPU times (each microsecond once) grouped by op name
(CATEGORIES below). System CPU time is the kernel's: with the 1 MiB mmap threshold long_chains.py sets, mostly
the page faults of mapping fresh blocks (the allocator's cost on CPU). The profiler adds time of its own, so a
profiled step is slower than a timed one; the shares are what the table is for. Written to
benchmarks/results/long_chains/profile_<model>.json and .md (the .md is on the performance page).
"""

import argparse
import json
import sys
import tempfile
from pathlib import Path

import torch

from benchmarks.common import git_sha
from benchmarks.long_chains import sweep as lc
from benchmarks.long_chains.profiler_hooks import CATEGORIES, OTHER, RANGES, label_blocks, profile_summary, profiled

__all__ = ["CATEGORIES", "OTHER", "RANGES", "label_blocks", "profile_summary", "profiled", "table"]


PROVIDERS = ("trl_ckpt", "fused_trl_packed", "gk_blocks", "gk_tiled", "gk_selective", "gk_none")
DEFAULT = "trl_ckpt,gk_blocks,gk_tiled"
PROVIDER_NAMES = {"trl_ckpt": "TRL (gradient checkpointing)", "fused_trl_packed": "FusedGRPOTrainer, packed",
          "gk_blocks": "grpo-kernels, block checkpoints", "gk_tiled": "grpo-kernels, blocks + tiled MLP",
          "gk_selective": "grpo-kernels, selective", "gk_none": "grpo-kernels, no checkpoints"}  # fmt: skip


def table(results: dict) -> str:
    """The markdown table of {provider: summary} (summary: long_chains.profile_summary plus the run's fields)."""
    names = list(results)
    if not names:
        return "no profiles\n"
    first = results[names[0]]
    lines = [f"# Where the step's time goes: G = {first['group_size']} x {first['length']} tokens, {first['model']}, "
             "fp32, one micro-batch", "",
             "Command: `python -m benchmarks.long_chains.profile_step` (the module's docstring says what is measured). "
             "Seconds of the profiled step; share: of the summed self CPU time of its ops. One run each; load: "
             "the 1-minute load average before it.", "",
             "| | " + " | ".join(PROVIDER_NAMES.get(n, n) for n in names) + " |",
             "|---|" + "---:|" * len(names)]  # fmt: skip

    def row(label, cells):
        lines.append(f"| {label} | " + " | ".join(cells) + " |")

    row("step s (profiled)", [f"{results[n]['step_ms'] / 1000:.1f}" for n in names])
    row("load before", [f"{results[n]['load_before']:.2f}" for n in names])
    row("tokens computed", [f"{results[n]['computed_tokens']:,}" for n in names])
    phases = [p for p in first["phases_ms"]]
    for p in phases:
        row(f"phase: {p} s", [f"{results[n]['phases_ms'].get(p, 0) / 1000:.1f}" for n in names])
    cats = sorted({c for n in names for c in results[n]["categories_ms"]},
                  key=lambda c: -max(results[n]["categories_ms"].get(c, 0) for n in names))  # fmt: skip
    for c in cats:
        cells = []
        for n in names:
            total = sum(results[n]["categories_ms"].values())
            v = results[n]["categories_ms"].get(c, 0.0)
            cells.append(f"{v / 1000:.1f} ({100 * v / total:.0f} %)")
        row(f"ops: {c} s", cells)
    row("system CPU s (page faults, mapping)", [f"{results[n]['system_cpu_s']:.1f}" for n in names])
    row("user CPU s (2 threads)", [f"{results[n]['user_cpu_s']:.1f}" for n in names])
    lines += ["", "Top ops by self time (s):", ""]
    for n in names:
        top = ", ".join(f"{k} {v / 1000:.1f}" for k, v in list(results[n]["top_ops_ms"].items())[:8])
        lines.append(f"- {PROVIDER_NAMES.get(n, n)}: {top}")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="the tiny model, 4 x 128 tokens (the smoke test)")
    parser.add_argument("--model", default="smollm2-135m", help="a known model name or an HF directory")
    parser.add_argument("--providers", default=DEFAULT, help="a subset of " + ", ".join(PROVIDERS))
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--length", type=int, default=2000, help="tokens per completion")
    parser.add_argument("--cap-gb", type=float, default=12.0, help="memory cap per process (GB)")
    parser.add_argument("--timeout", type=float, default=3600.0, help="seconds one measurement may take")
    parser.add_argument("--out", type=Path, help="the .json to write (default: under benchmarks/results/)")
    parser.add_argument("--table-only", action="store_true", help="rebuild the .md from the .json")
    args = parser.parse_args(argv)
    providers = args.providers.split(",")
    unknown = set(providers) - set(PROVIDERS)
    if unknown:
        parser.error(f"unknown provider: {', '.join(sorted(unknown))} (known: {', '.join(PROVIDERS)})")
    if args.group_size < 2 or args.length < 1:
        parser.error(f"need --group-size >= 2 and --length >= 1, got {args.group_size} and {args.length}")
    group, length = (4, 128) if args.quick else (args.group_size, args.length)
    name = "tiny" if args.quick else Path(args.model).name
    out = args.out or lc.OUT / f"profile_{name}.json"
    results = json.loads(out.read_text()) if out.exists() else {}
    if not args.table_only:
        model_dir, name, scratch = lc.model_and_scratch(args.quick, args.model)
        point = dict(sweep="length", group_size=group, prompts=1, min_len=length, max_len=length)
        for provider in providers:
            with tempfile.TemporaryDirectory() as tmp:
                path = Path(tmp) / "profile.json"
                load = round(lc.settled_load(wait_s=0 if args.quick else 180), 2)
                print(f"{provider}: {group} x {length} (load {load})", flush=True)
                row = lc.measure(provider, point, model_dir=model_dir, cap_mb=args.cap_gb * 1024, scratch=scratch,
                                 timeout=args.timeout, mmap_threshold=2**20, extra={"profile": str(path)})  # fmt: skip
                if row["status"] != "ok":
                    print(f"  -> {row['status']}", flush=True)
                    continue
                summary = json.loads(path.read_text())
            results[provider] = dict(summary, model=name, group_size=group, length=length, load_before=load,
                                     computed_tokens=row["computed_tokens"], peak_rss_mb=round(row["peak_rss_mb"]),
                                     git_sha=git_sha(), torch=torch.__version__)  # fmt: skip
            print(f"  -> {summary['step_ms'] / 1000:.1f} s profiled", flush=True)
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(json.dumps(results, indent=1))  # after each provider: a cut-short run keeps its rows
        if args.quick:
            import shutil

            shutil.rmtree(scratch, ignore_errors=True)
    if not results:
        print("no profile measured", file=sys.stderr)
        return 1
    out.with_suffix(".md").write_text(table(results))
    print(table(results))
    print(f"wrote {out.with_suffix('.md')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

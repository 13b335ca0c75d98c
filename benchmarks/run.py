"""Run every per-op benchmark, collect their rows into one CSV, and render a markdown report with a plot per op.

Usage (from the repository root):
    .venv/bin/python -m benchmarks.run                         # full sweeps on the CPU (long: tens of minutes)
    .venv/bin/python -m benchmarks.run --quick                 # every script's quick mode, into a temporary dir
    .venv/bin/python -m benchmarks.run --device cuda           # the GPU sweeps (CPU-only scripts are skipped)
    .venv/bin/python -m benchmarks.run --only loss planner     # a subset
    .venv/bin/python -m benchmarks.run --quick --out /tmp/b    # quick mode, outputs kept in /tmp/b

Design: each benchmark script runs as a subprocess (a fresh process each, as the scripts' own memory runs assume)
with --csv pointing at its per-op CSV under the output directory, --device where the script takes one and --quick in
quick mode; its output goes to <out>/logs/<name>.log (in a full run: a temporary dir) and one progress line per
benchmark is printed (under a tqdm bar on a terminal). The rows it appended are read back and mapped onto one column
set (COLUMNS: op, case, shape, provider, median_ms, peak_mb where the script measures it, vs_best_baseline, torch,
threads), appended to <out>/<device>.csv, and this run's rows are rendered as <out>/<device>.md (a table per op) and
<out>/<device>_<op>.png (benchmarks.common.plot_bars).
The output directory is benchmarks/results/ in a full run (the per-op CSVs there get this run's rows, as when the
scripts run alone) and a fresh temporary directory in quick mode (unless --out), so smoke runs leave the committed
results alone. vs_best_baseline = the provider's median ms / the fastest baseline's of the same op, case and shape,
where the baselines are every provider that is not ours (benchmarks.common.OURS) except fused_linear's "floor", which
is a lower bound (the unavoidable matmuls), not an implementation. Below 1 is faster than every baseline. A full run
into benchmarks/results/ then rewrites docs/performance.md (benchmarks.readme).
"""

import argparse
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # importable from a plain checkout too

import torch

from benchmarks import readme
from benchmarks.common import NOT_BASELINES, RESULTS, ROOT, append_csv, git_sha, plot_bars, read_csv

COLUMNS = ["timestamp", "device", "git_sha", "benchmark", "op", "case", "shape", "provider", "median_ms", "peak_mb",
           "vs_best_baseline", "torch", "threads"]  # fmt: skip


@dataclass(frozen=True)
class Benchmark:
    """A per-op script and how its CSV rows map onto (op, case, shape, provider, peak_mb)."""

    name: str
    takes_device: bool  # False: a CPU-only script (no --device option), skipped on CUDA
    package: str = "ops"  # the benchmarks/ package that holds it

    @property
    def script(self) -> Path:
        return ROOT / "benchmarks" / self.package / f"{self.name}.py"

    def common(self, r: dict) -> dict:
        """One of this script's rows in the combined columns."""
        op, peak = self.name, r.get("peak_mb", "")
        if self.name == "advantages":
            case, shape = r["sweep"], f"N={r['N']} G={r['G']}"
        elif self.name == "logprobs":
            case, shape = f"{r['mode']} {r['dtype']}", f"{r['T']}x{r['V']}"
        elif self.name == "loss":
            op = "loss" if r["op"] == "loss" else "loss_from_logits"
            case, shape = f"{r['config']} {r['mode']}", r["T"] + (f"x{r['V']}" if r["V"] != "0" else "")
        elif self.name == "fused_linear":
            case, shape, peak = r["dtype"], f"{r['T']}x{r['H']}x{r['V']}", r["peak_extra_mb"]
        elif self.name == "packing":
            case, shape = r["case"], f"{r['samples']} samples, {r['real_tokens']} tokens"
        elif self.name == "planner":
            case, shape = r["algorithm"], f"N={r['N']}"
        else:  # trl_dropin
            case, shape, peak = "loss step", f"V={r['V']} B={r['B']} C={r['C']}", r["peak_extra_mb"]
        provider = r["layout"] if self.name == "packing" else r["provider"]
        return {"timestamp": r["timestamp"], "device": r["device"], "git_sha": r["git_sha"], "benchmark": self.name,
                "op": op, "case": case, "shape": shape, "provider": provider, "median_ms": float(r["median_ms"]),
                "peak_mb": peak, "torch": r["torch"], "threads": torch.get_num_threads()}  # fmt: skip


BENCHMARKS = [Benchmark("advantages", True), Benchmark("logprobs", True), Benchmark("loss", True),
              Benchmark("fused_linear", True), Benchmark("packing", False), Benchmark("planner", False),
              Benchmark("trl_dropin", False, "dropins")]  # fmt: skip


def run_benchmark(bench: Benchmark, *, device: str, quick: bool, out: Path, logs: Path) -> tuple:
    """Run one script (its output to <logs>/<name>.log); returns (its new rows in the combined columns, exit code)."""
    csv_path = out / f"{bench.name}_{device}.csv"
    before = len(read_csv(csv_path))
    cmd = [sys.executable, str(bench.script), "--csv", str(csv_path)]
    cmd += (["--device", device] if bench.takes_device else []) + (["--quick"] if quick else [])
    log = logs / f"{bench.name}.log"
    with log.open("w") as f:
        rc = subprocess.run(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT).returncode
    if rc != 0:
        print("".join(log.read_text().splitlines(keepends=True)[-15:]), end="")
        return [], rc
    return [bench.common(r) for r in read_csv(csv_path)[before:]], rc


def add_ratios(rows: list) -> None:
    """Set vs_best_baseline on every row: its median ms / the fastest baseline's (empty without a baseline)."""
    best = {}
    for r in rows:
        if r["provider"] not in NOT_BASELINES:
            key = (r["op"], r["case"], r["shape"])
            best[key] = min(best.get(key, float("inf")), r["median_ms"])
    for r in rows:
        base = best.get((r["op"], r["case"], r["shape"]))
        r["vs_best_baseline"] = round(r["median_ms"] / base, 3) if base else ""


def render(rows: list, out: Path, device: str) -> Path:
    """Write <out>/<device>.md (a table per op) and a PNG per op; returns the markdown's path."""
    ops = {}
    for r in rows:
        ops.setdefault(r["op"], []).append(r)
    meta = rows[0]
    lines = [f"# Benchmarks: {meta['device']}", "",
             f"{meta['timestamp']}, commit {meta['git_sha']}. vs best baseline = median ms / the fastest non-ours "
             "provider's (below 1: faster than every baseline); peak MB where the script measures it.", ""]  # fmt: skip
    for op, op_rows in ops.items():
        png = out / f"{device}_{op}.png"
        plot_bars(op_rows, png, panel=lambda r: r["case"], shape=lambda r: r["shape"], xlabel="shape")
        lines += [f"## {op}", "", "| case | shape | provider | median ms | peak MB | vs best baseline |",
                  "|---|---|---|---:|---:|---:|"]  # fmt: skip
        lines += [f"| {r['case']} | {r['shape']} | {r['provider']} | {r['median_ms']:.4g} | {r['peak_mb']} "
                  f"| {r['vs_best_baseline']} |" for r in op_rows]  # fmt: skip
        lines += ["", f"![{op}]({png.name})", ""]
    path = out / f"{device}.md"
    path.write_text("\n".join(lines))
    return path


def progress_bar(total: int):
    """A tqdm bar over the benchmarks on an interactive terminal; None otherwise (a line per benchmark instead)."""
    if not sys.stderr.isatty():
        return None
    from tqdm.auto import tqdm

    return tqdm(total=total, unit="benchmark")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="every script's quick mode, into a temporary dir")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--only", nargs="+", choices=[b.name for b in BENCHMARKS], help="run these benchmarks only")
    parser.add_argument("--out", type=Path, help="output dir (default: benchmarks/results, or a temporary dir with "
                                                   "--quick)")  # fmt: skip
    args = parser.parse_args()
    out = args.out or (Path(tempfile.mkdtemp(prefix="grpo_bench_")) if args.quick else RESULTS)
    out.mkdir(parents=True, exist_ok=True)
    logs = Path(tempfile.mkdtemp(prefix="grpo_bench_logs_")) if out == RESULTS else out / "logs"
    logs.mkdir(exist_ok=True)
    todo = [b for b in BENCHMARKS if not args.only or b.name in args.only]
    if args.device == "cuda":
        for b in todo:
            if not b.takes_device:
                print(f"{b.name} skipped (a CPU-only benchmark)")
        todo = [b for b in todo if b.takes_device]
    print(f"{len(todo)} benchmarks, {'quick' if args.quick else 'full'} mode, commit {git_sha()}, output in {out}")
    rows, failed, started = [], [], time.perf_counter()
    bar = progress_bar(len(todo))
    for i, bench in enumerate(todo, 1):
        if bar is not None:
            bar.set_description(bench.name)
        else:
            print(f"[{i}/{len(todo)}] {bench.name} ...", flush=True)
        t0 = time.perf_counter()
        new, rc = run_benchmark(bench, device=args.device, quick=args.quick, out=out, logs=logs)
        rows += new
        if rc != 0:
            failed.append(bench.name)
        status = f"{len(new)} rows" if rc == 0 else f"FAILED (exit {rc}, log {logs / bench.name}.log)"
        line = f"[{i}/{len(todo)}] {bench.name}: {status} in {time.perf_counter() - t0:.0f} s"
        (bar.write if bar is not None else print)(f"{line} (elapsed {time.perf_counter() - started:.0f} s)")
        if bar is not None:
            bar.update()
    if bar is not None:
        bar.close()
    if rows:
        add_ratios(rows)
        append_csv(rows, out / f"{args.device}.csv", COLUMNS)
        print(f"appended {len(rows)} rows to {out / f'{args.device}.csv'}; wrote {render(rows, out, args.device)}")
    if failed:
        raise SystemExit(f"failed: {', '.join(failed)}")
    if out == RESULTS:
        changed = readme.update()
        print("docs/performance.md " + ("rewritten from the results" if changed else "unchanged"))


if __name__ == "__main__":
    main()

"""Shared benchmark helpers: timing, run metadata, CSV appending and a panel-grid plot."""

import csv
import datetime
import math
import os
import platform
import statistics
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path

import torch
import triton

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
OURS = {"ours", "ours_inplace", "fused", "cpp", "packed", "shared_prefix"}  # grpo-kernels' providers in every benchmark
NOT_BASELINES = OURS | {"floor"}  # fused_linear's "floor" is a lower bound (the unavoidable matmuls), not a baseline
# arith's bare-integer bonus (task.format_weight) that the committed arith results ran with: the task's default until
# the learning-vs-TRL study moved it to 0. The benchmarks behind those results pass it: their commands reproduce them.
ARITH_FORMAT_WEIGHT_COMMITTED = 0.2


def median_ms(fn, device: str, min_time: float, min_repeats: int = 5) -> float:
    """Median time of one call in ms: do_bench on CUDA; on CPU >= min_repeats timed repeats after a warmup call."""
    if device == "cuda":
        return triton.testing.do_bench(fn, return_mode="median")
    fn()
    start = time.perf_counter()
    fn()
    once = time.perf_counter() - start
    number = max(1, int(2e-3 / max(once, 1e-9)))  # calls per repeat, so a repeat lasts >= ~2 ms
    times = []
    while len(times) < min_repeats or sum(times) * number < min_time:
        start = time.perf_counter()
        for _ in range(number):
            fn()
        times.append((time.perf_counter() - start) / number)
    return statistics.median(times) * 1e3


def compile_checked(fn, probe: Callable) -> tuple:
    """torch.compile fn (static shapes) and run probe(compiled_fn), which checks it against ours.

    Returns (compiled_fn, None), or (None, reason) when compiling or the check fails.
    """
    torch._dynamo.reset()  # a fresh cache per shape: dynamic=False recompiles would hit the recompile limit
    try:
        compiled_fn = torch.compile(fn, dynamic=False)
        probe(compiled_fn)
        return compiled_fn, None
    except Exception as exc:  # any compiler failure: reported as a skip
        return None, f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:200]


def device_name(device: str) -> str:
    """The GPU's name, or the CPU model from /proc/cpuinfo."""
    if device == "cuda":
        return torch.cuda.get_device_name()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "cpu"


def git_sha() -> str:
    """Short hash of the checked-out commit, or "unknown"."""
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
        return out.stdout.strip() or "unknown"
    except OSError:
        return "unknown"


def run_meta(device: str) -> dict:
    """The leading CSV columns shared by every row of a run: timestamp, device, torch, triton, git_sha."""
    return {"timestamp": datetime.datetime.now().isoformat(timespec="seconds"), "device": device_name(device),
            "torch": torch.__version__, "triton": triton.__version__, "git_sha": git_sha()}  # fmt: skip


def print_environment(meta: dict) -> None:
    """One line: device, versions, threads and the load average."""
    load = os.getloadavg()[0]  # other busy processes make CPU timings noisy: run on an idle machine
    print(
        f"{meta['device']} | torch {meta['torch']} | triton {meta['triton']} | threads {torch.get_num_threads()}"
        f" | load average {load:.1f} on {os.cpu_count()} cores"
    )


def status_kb(field: str) -> int:
    """A field of /proc/self/status in kB (VmRSS, VmHWM, ...); Linux only."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")


def read_csv(path: Path) -> list:
    """The rows of a CSV file as dicts; [] if the file does not exist."""
    if not path.exists():
        return []
    with path.open(newline="") as f:
        return list(csv.DictReader(f))


def write_csv(rows: list, path: Path, columns: list, *, extra: str = "raise") -> None:
    """Write rows (dicts; missing columns empty) to the CSV at path, replacing it (a stage's whole table, rewritten
    after each row, so that a run stopped at its time limit keeps what it measured). extra="ignore": a row's keys
    outside columns are left out (by default they are an error)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=columns, extrasaction=extra)
        writer.writeheader()
        writer.writerows(rows)


def append_csv(rows: list, path: Path, columns: list, *, extra: str = "raise") -> None:
    """Append rows to the CSV at path, writing the header first if the file is new or empty (extra: as write_csv)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    new = not path.exists() or path.stat().st_size == 0
    with path.open("a", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=columns, extrasaction=extra)
        if new:
            writer.writeheader()
        writer.writerows(rows)


def plot_panels(panels: dict, path: Path, draw: Callable, max_cols: int = 4) -> None:
    """One subplot per panels item (title -> rows), drawn by draw(ax, rows); saved as a PNG at path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ncols = min(max_cols, len(panels))
    nrows = math.ceil(len(panels) / ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(4 * ncols, 3.3 * nrows), squeeze=False)
    for ax, (title, rows) in zip(axes.flat, panels.items(), strict=False):
        draw(ax, rows)
        ax.set_title(title)
    for ax in list(axes.flat)[len(panels) :]:
        ax.set_visible(False)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


def plot_bars(rows: list, path: Path, *, panel: Callable, shape: Callable, xlabel: str) -> None:
    """Median ms (log y) as grouped bars: one subplot per panel(row), one group per shape(row), a bar per provider."""
    panels = {}
    for r in rows:
        panels.setdefault(panel(r), []).append(r)
    # one colour per provider, the same in every panel
    color = {name: f"C{i % 10}" for i, name in enumerate(dict.fromkeys(r["provider"] for r in rows))}

    def draw(ax, panel_rows):
        shapes = list(dict.fromkeys(shape(r) for r in panel_rows))
        names = [name for name in color if any(r["provider"] == name for r in panel_rows)]
        width = 0.8 / len(names)
        for k, name in enumerate(names):
            ms = {shape(r): r["median_ms"] for r in panel_rows if r["provider"] == name}
            xs = [i + (k - (len(names) - 1) / 2) * width for i, s in enumerate(shapes) if s in ms]
            ax.bar(xs, [ms[s] for s in shapes if s in ms], width, label=name, color=color[name])
        ax.set_xticks(range(len(shapes)), shapes, fontsize=7)
        ax.set_yscale("log")
        ax.set(xlabel=xlabel, ylabel="median ms")
        ax.legend(fontsize=7)

    plot_panels(panels, path, draw)


# two-sided 95 % quantiles of Student's t by degrees of freedom 1..30
_T975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145, 2.131,
         2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042)


def t975(dof: int) -> float:
    """The two-sided 95 % quantile of Student's t with dof degrees of freedom (beyond 30: the normal quantile with
    the first two terms of its Cornish-Fisher expansion, within 1e-4)."""
    if dof < 1:
        raise ValueError(f"degrees of freedom must be >= 1, got {dof}")
    if dof <= len(_T975):
        return _T975[dof - 1]
    z = 1.959964
    return z + (z**3 + z) / (4 * dof) + (5 * z**5 + 16 * z**3 + 3 * z) / (96 * dof**2)


def number_list(text: str) -> list[int]:
    """"0-4" or "0,3,7" or "0,2-3" -> the numbers (ValueError on anything else)."""
    out = []
    for part in text.split(","):
        a, _, b = part.partition("-")
        out += range(int(a), int(b or a) + 1)
    return out


def cpu_numbers(text: str, prog: str) -> list[int]:
    """--cpus TEXT -> the CPU numbers, or SystemExit with one line when they are not numbers or not this process's."""
    try:
        cpus = number_list(text)
    except ValueError:
        raise SystemExit(f"{prog}: --cpus {text!r}: CPU numbers expected, e.g. 0 or 0-1 or 0,2") from None
    if not set(cpus) <= os.sched_getaffinity(0):
        raise SystemExit(f"{prog}: --cpus {text}: this process may use CPUs {sorted(os.sched_getaffinity(0))} only")
    return cpus


def run_pinned(jobs: list, cpus: list, run: Callable, done: Callable | None = None) -> None:
    """run(job, cpu) for every job, in order, as many at once as there are cpus (one thread per cpu; None: one job
    at a time, unpinned); done(job, result, seconds) after each, one at a time."""
    todo, lock = list(jobs), threading.Lock()

    def work(cpu):
        while True:
            with lock:
                if not todo:
                    return
                job = todo.pop(0)
            start = time.perf_counter()
            result = run(job, cpu)
            with lock:
                if done is not None:
                    done(job, result, time.perf_counter() - start)

    threads = [threading.Thread(target=work, args=(cpu,)) for cpu in cpus or [None]]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def pinned_env(cpu: int | None) -> dict:
    """A child process's environment for one pinned cpu: one torch / OpenMP thread (vLLM's bound to that cpu)."""
    env = {**os.environ, "TQDM_DISABLE": "1"}
    if cpu is not None:
        env.update(OMP_NUM_THREADS="1", VLLM_CPU_OMP_THREADS_BIND=str(cpu))
    return env


def run_logged(cmd: list, log: Path, cpu: int | None) -> tuple[int, int]:
    """Run cmd (pinned to cpu) appending its output to log; (exit code, peak RSS in MiB of that process)."""
    with log.open("a") as f:
        f.write(f"$ {' '.join(cmd)}\n")
        f.flush()
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=ROOT, env=pinned_env(cpu),
                                preexec_fn=(lambda: os.sched_setaffinity(0, [cpu])) if cpu is not None else None)
        _, status, usage = os.wait4(proc.pid, 0)
    return os.waitstatus_to_exitcode(status), round(usage.ru_maxrss / 1024)



def trl_prepare_for_steps(trainer, name: str) -> None:
    """What transformers' Trainer.train() does to the model before its first step, for a benchmark that calls
    compute_loss itself: gradient checkpointing as trainer.args asks, and accelerate's preparation of the model (with
    bf16 / fp16 that wraps its forward in autocast). Raises RuntimeError naming `name` when gradient checkpointing is
    not what args ask once done."""
    args, model = trainer.args, trainer.model
    if args.gradient_checkpointing:
        kwargs = dict(args.gradient_checkpointing_kwargs or {})
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs or None)
    if model.is_gradient_checkpointing != args.gradient_checkpointing:
        raise RuntimeError(f"{name}: gradient checkpointing is {model.is_gradient_checkpointing}, "
                           f"asked {args.gradient_checkpointing}")  # fmt: skip
    trainer.model_wrapped = trainer.accelerator.prepare_model(model)
    model.train()


class BlockProbe:
    """What a decoder block's submodule saw while it was hooked: how many of its calls ran in the forward and how many
    in the backward (recomputation: activation checkpointing), and the autocast dtype of each call (None: no
    autocast). Usage: `with BlockProbe(model.model.layers[0].mlp, "cuda") as probe: step()`, then `probe.summary()`."""

    def __init__(self, module: torch.nn.Module, device_type: str):
        self.module, self.device_type = module, device_type
        self.forward = self.recomputed = 0
        self.autocast: set = set()

    def _hook(self, module, args) -> None:
        if not torch.is_grad_enabled():
            return
        if torch._C._current_graph_task_id() == -1:  # -1: outside any backward pass
            self.forward += 1
        else:
            self.recomputed += 1
        on = torch.is_autocast_enabled(self.device_type)
        self.autocast.add(torch.get_autocast_dtype(self.device_type) if on else None)

    def __enter__(self):
        self._handle = self.module.register_forward_pre_hook(self._hook)
        return self

    def __exit__(self, *exc) -> None:
        self._handle.remove()

    @property
    def checkpointed(self) -> bool:
        return self.forward > 0 and self.recomputed == self.forward

    def summary(self) -> str:
        dtypes = "/".join(sorted(str(d).replace("torch.", "") if d else "none" for d in self.autocast))
        return f"block calls: {self.forward} forward, {self.recomputed} recomputed; autocast {dtypes or '-'}"

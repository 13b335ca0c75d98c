"""What happened to a failed measurement of benchmarks/long_chains/sweep.py, told from the driver's output alone.

In each worker process, `watch()` runs first (before torch starts any thread): faulthandler on (a crash prints every
thread's Python stack), and SIGTERM blocked in every thread and taken by one thread of its own (sigwaitinfo), which
prints who sent it (pid, command line, whether that is the process's parent: torchrun's agent for a rank; else who
started the sender), the phase the process was in and its RSS, then every thread's innermost Python frames, and then
lets the signal end the process as it would have (exit status -15). `phase(name)` prints one line per phase (setup,
warm-up, step) with the time since the start and the RSS. Every such line starts with PREFIX and names the rank.

In the driver, `launch()` runs one measurement: the worker, or torchrun with each rank's stdout and stderr in files
of their own (--redirects 3), so that a rank's output is told from the other's; past the timeout the process gets
SIGTERM first (torchrun stops its ranks, each rank prints its stacks), then SIGKILL. `report()` is the account of a
failed run: wall time, exit status, torchrun's root cause, each rank's own lines and stderr tail, torchrun's tail,
the kernel's OOM kills during the run, the load and the free memory.
"""

import faulthandler
import os
import signal
import subprocess
import sys
import threading
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

PREFIX = "[long-chains]"  # the lines a worker prints about itself
HEADING = "=== a failed measurement: "  # report()'s first line
_START = time.monotonic()
_state = {"rank": 0, "phase": "start"}


def _rss_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def _say(text: str) -> None:
    line = f"{PREFIX} rank {_state['rank']} pid {os.getpid()} +{time.monotonic() - _START:.1f} s: {text}\n"
    os.write(2, line.encode(errors="replace"))  # one write: a line of its own even beside other threads' output


def describe_pid(pid: int) -> str:
    """'pid N (its command line)' and its parent's, saying when that is this process's parent or itself."""
    if pid == 0:
        return "pid 0 (the kernel)"

    def cmdline(p: int) -> str:
        try:
            return Path(f"/proc/{p}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()[:200]
        except OSError:
            return "exited before it could be looked up"

    who = ", this process's parent" if pid == os.getppid() else ", this process itself" if pid == os.getpid() else ""
    out = f"pid {pid}{who} ({cmdline(pid)})"
    if not who:
        try:
            parent = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
            out += f", started by pid {parent} ({cmdline(parent)})"
        except (OSError, IndexError, ValueError):
            pass
    return out


def stacks(depth: int = 8) -> list[str]:
    """Every other thread's innermost `depth` Python frames, most recent first, one line each."""
    names = {t.ident: t.name for t in threading.enumerate()}
    out = []
    for ident, frame in sys._current_frames().items():
        if ident == threading.get_ident():
            continue
        frames = traceback.extract_stack(frame)[::-1]
        out.append(f"thread {names.get(ident, ident)} (most recent call first):")
        out += [f"  {Path(f.filename).name}:{f.lineno} {f.name}" for f in frames[:depth]]
        if len(frames) > depth:
            out.append(f"  ... {len(frames) - depth} outer frames")
    return out


def _take_sigterm() -> None:
    info = signal.sigwaitinfo({signal.SIGTERM})
    _say(f"SIGTERM from {describe_pid(info.si_pid)} during {_state['phase']}, RSS {_rss_mb():.0f} MB")
    for line in stacks():
        _say(line)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})
    os.kill(os.getpid(), signal.SIGTERM)  # the signal's own effect, now that one thread takes it


def watch(rank: int = 0) -> None:
    """Call first in a worker process, before any other thread starts (threads inherit the blocked SIGTERM; so
    does a child that `subprocess` starts: the workers start none that has to be stopped)."""
    _state["rank"] = rank
    faulthandler.enable()
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
    threading.Thread(target=_take_sigterm, name="sigterm-watch", daemon=True).start()


def phase(name: str) -> None:
    """Print that the process enters phase `name` (with the time since its start and its RSS)."""
    _state["phase"] = name
    _say(f"{name} (RSS {_rss_mb():.0f} MB)")


# ------------------------------------------------------------------------------------------------------------------
# The driver.


def _oom_kills() -> int | None:
    """The kernel's count of OOM kills since boot (/proc/vmstat), None where it is not there."""
    try:
        return next(int(x.split()[1]) for x in Path("/proc/vmstat").read_text().splitlines()
                    if x.startswith("oom_kill "))  # fmt: skip
    except (OSError, StopIteration):
        return None


@dataclass(slots=True)
class Run:
    """One measurement process (or torchrun and its ranks) after it ended."""

    command: list
    returncode: int  # torchrun's or the worker's; after a timeout, what the stopped process returned
    stdout: str  # torchrun's (or the worker's) stdout, then each rank's
    stderr: str  # each rank's stderr, then torchrun's (or the worker's): its summary of failed ranks comes last
    own_stderr: str  # torchrun's (or the worker's) alone
    seconds: float
    timed_out: bool = False
    ranks: dict = field(default_factory=dict)  # rank -> its stderr (torchrun only)
    oom_kills: int | None = None  # the kernel's OOM kills while it ran (None: not known)
    started: str = ""


def _rank_logs(log_dir: Path, ranks: int) -> dict:
    """{rank: (stdout, stderr)} from torchrun's --log-dir (<dir>/<run id>/attempt_<n>/<rank>/std*.log, last attempt)."""
    out = {}
    for rank in range(ranks):
        found = {name: sorted(log_dir.glob(f"*/attempt_*/{rank}/{name}.log")) for name in ("stdout", "stderr")}
        out[rank] = tuple(found[n][-1].read_text(errors="replace") if found[n] else "" for n in ("stdout", "stderr"))
    return out


def launch(script: list, *, ranks: int, env: dict, timeout: float, log_dir: Path) -> Run:
    """Run `python script...` (ranks 1) or torchrun with `ranks` processes of it on this machine."""
    cmd = [sys.executable, *script]
    if ranks > 1:
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={ranks}", "--standalone",
               f"--log-dir={log_dir}", "--redirects=3", *script]  # fmt: skip
    kills, started, start = _oom_kills(), time.strftime("%H:%M:%S"), time.monotonic()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    timed_out = False
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        timed_out = True
        proc.terminate()  # torchrun stops its ranks (30 s, then SIGKILL): each prints its stacks first
        try:
            out, err = proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate()
    seconds = time.monotonic() - start
    after = _oom_kills()
    logs = _rank_logs(Path(log_dir), ranks) if ranks > 1 else {}
    return Run(command=cmd, returncode=proc.returncode, stdout=out + "".join(o for o, _ in logs.values()),
               stderr="".join(e for _, e in logs.values()) + err, own_stderr=err, seconds=seconds, timed_out=timed_out,
               ranks={r: e for r, (_, e) in logs.items()}, started=started,
               oom_kills=None if kills is None or after is None else after - kills)  # fmt: skip


def root_cause(stderr: str) -> dict:
    """torchrun's root cause (its first observed failure) as {"rank", "exitcode", "pid", "signal"} (strings; signal
    only for a rank a signal ended), or {} without torchrun's summary of failed ranks."""
    lines = [x.strip() for x in stderr.splitlines()]
    at = max((i for i, x in enumerate(lines) if x.startswith("Root Cause")), default=None)
    if at is None:
        return {}
    out = {}
    for x in lines[at:]:
        value = x.split(":", 1)[1].strip() if ":" in x else ""
        if x.startswith("rank      :"):
            out.setdefault("rank", value.split("(")[0].strip())
        elif x.startswith("exitcode  :"):
            out.setdefault("exitcode", value.split("(")[0].strip())
            out.setdefault("pid", value.split("pid:")[1].split(")")[0].strip() if "pid:" in value else "?")
        elif x.startswith("traceback :") and value.startswith("Signal"):
            out.setdefault("signal", value.split(" received")[0])
        if x.startswith("=") and "exitcode" in out:  # the summary's end
            break
    return out


def sigterm_sender(run: Run, rank: int) -> str | None:
    """The line in which `rank` said who sent it SIGTERM (diagnose.watch), without its prefix; None if none."""
    text = run.ranks.get(rank, run.stderr if not run.ranks else "")
    said = [x for x in text.splitlines() if x.startswith(PREFIX) and ": SIGTERM from " in x]
    return said[-1].split(": SIGTERM from ", 1)[1].rsplit(" during ", 1)[0].strip() if said else None


def _tail(text: str, n: int) -> list[str]:
    lines = [x for x in text.rstrip().splitlines() if x.strip()]
    return (["  (none)"] if not lines else []) + [f"  {x[:300]}" for x in lines[-n:]]


def report(run: Run, title: str, tail: int = 25) -> str:
    """The account of a failed run, several lines (sweep.py prints it to its stderr)."""
    status = f"exit code {run.returncode}" if run.returncode >= 0 else f"killed by signal {-run.returncode}"
    stopped = "over its timeout, then stopped; " if run.timed_out else ""
    head = [f"{HEADING}{title}: {stopped}{status} after {run.seconds:.1f} s (started {run.started})",
            "  command: " + " ".join(map(str, run.command))[:400]]  # fmt: skip
    cause = root_cause(run.stderr)
    if cause:  # "first observed": by whole seconds, ranks seen failed in one poll listed by rank
        head.append(f"  torchrun's root cause (its first observed failure): rank {cause.get('rank', '?')} (pid "
                    f"{cause.get('pid', '?')}), exit code {cause.get('exitcode', '?')}"
                    + (f" ({cause['signal']})" if "signal" in cause else ""))  # fmt: skip
    if run.oom_kills is not None:
        head.append(f"  the kernel's OOM killer killed {run.oom_kills} process(es) on this machine while it ran")
    body = []
    for rank, text in sorted(run.ranks.items()):
        own = [x for x in text.splitlines() if x.startswith(PREFIX)]
        rest = "\n".join(x for x in text.splitlines() if not x.startswith(PREFIX))
        body += [f"--- rank {rank}: its phases, and who stopped it (diagnose.watch) ---", *_tail("\n".join(own), 60)]
        body += [f"--- rank {rank}: the rest of its stderr, last {tail} lines ---", *_tail(rest, tail)]
    name = "torchrun" if run.ranks else "the worker"
    body += [f"--- {name}: stderr, last {tail} lines ---", *_tail(run.own_stderr, tail)]
    load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    mem = {x.split(":")[0]: int(x.split()[1]) / 2**20 for x in Path("/proc/meminfo").read_text().splitlines()
           if x.startswith(("MemTotal:", "MemAvailable:"))}  # fmt: skip
    body.append(f"--- machine now: load {load}; MemAvailable {mem.get('MemAvailable', 0):.1f} of "
                f"{mem.get('MemTotal', 0):.1f} GiB ---")  # fmt: skip
    return "\n".join(head + body)

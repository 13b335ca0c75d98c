"""How a long-chain measurement under torchrun fails, and the failure CI once saw: real torchrun runs of two ranks.

CI once reported gk_sp's measurement as "exit code -15" (SIGTERM). Its cause: a rank whose gloo threads still hold a
tensor as the interpreter finalizes aborts ("terminate called without an active exception", SIGABRT), and torchrun
stops the other rank with SIGTERM and lists it first, which the failure's one line then named (GLOO_END below does
so in most runs when it ends through that teardown). The worker now ends without it (worker.end_process);
a failed measurement prints an account of each rank (benchmarks/long_chains/diagnose.py) that says who sent a signal
and where every rank was."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

GLOO_END = """import os, sys
sys.path.insert(0, {root!r})
import torch
import torch.distributed as dist
from benchmarks.long_chains import worker
dist.init_process_group("gloo")
group = dist.new_group([0, 1])  # as gk_sp's sequence-parallel group
dist.barrier(group=group)  # both ranks connected: one that ends early cannot cut the other's set-up short
works = [dist.all_reduce(torch.ones(1 << 14), group=group, async_op=True) for _ in range(200)]
del works  # gloo's threads hold the only references to these tensors
os.write(1, f"rank {{os.environ['RANK']}} ends\\n".encode())  # one write: the ranks share the pipe
if os.environ["END"] == "end_process":
    worker.end_process()
"""


def _torchrun(script: Path, env: dict) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--standalone",
                           str(script)], capture_output=True, text=True, env=env, timeout=120)  # fmt: skip


def test_a_rank_whose_gloo_threads_still_hold_tensors_ends_cleanly_as_the_worker_ends(tmp_path):
    # CI's "exit code -15": ending through the interpreter's teardown (END=teardown), this script failed here in 7
    # of 10 runs, and in 10 of 10 after destroy_process_group() (a new_group's gloo threads keep running): one rank
    # SIGABRT ("terminate called without an active exception"), the other SIGTERM from torchrun, listed first in its
    # summary. worker.end_process skips the teardown (0 of 30 failed): every run here must end cleanly
    script = tmp_path / "rank.py"
    script.write_text(GLOO_END.format(root=str(ROOT)))
    for _ in range(3):
        proc = _torchrun(script, {**os.environ, "OMP_NUM_THREADS": "1", "END": "end_process"})
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert "rank 0 ends" in proc.stdout and "rank 1 ends" in proc.stdout


RANK_SCRIPT = """import os, subprocess, sys, time
sys.path.insert(0, {root!r})
from benchmarks.long_chains import diagnose
diagnose.watch(int(os.environ["RANK"]))
diagnose.phase("waiting")
print("rank", os.environ["RANK"], "stderr line", file=sys.stderr, flush=True)
if os.environ["RANK"] == "1" and os.environ["HOW"] == "outside":  # another process, which stays a while
    subprocess.Popen([sys.executable, "-c", "import os, signal, time; time.sleep(0.5); os.kill(%d, signal.SIGTERM); "
                      "time.sleep(5)" % os.getpid()], start_new_session=True)
if os.environ["RANK"] == "1" and os.environ["HOW"] == "abort":  # as gloo's threads did to a rank's teardown
    os.abort()
time.sleep(60)
"""
SLEEP_LINE = RANK_SCRIPT.splitlines().index("time.sleep(60)") + 1


@pytest.mark.parametrize("how", ["abort", "outside", "timeout"])
def test_a_failed_run_says_which_rank_failed_how_who_sent_a_sigterm_and_where_each_rank_was(tmp_path, how):
    # a real torchrun of two ranks under diagnose.watch: "abort", rank 1 aborts (SIGABRT, as in CI) and torchrun
    # stops rank 0; "outside", rank 1 gets SIGTERM from a process that is not torchrun, and torchrun then stops rank
    # 0; "timeout", the run passes launch()'s timeout and torchrun stops both. The account names the rank, the signal
    # and a SIGTERM's sender, and holds each rank's phases, innermost frames (of a stopped rank) and stderr
    from benchmarks.long_chains import diagnose
    from benchmarks.long_chains.sweep import _failure

    script = tmp_path / "rank.py"
    script.write_text(RANK_SCRIPT.format(root=str(ROOT)))
    env = {**os.environ, "HOW": how}
    run = diagnose.launch([str(script)], ranks=2, env=env, timeout=60 if how != "timeout" else 20,
                          log_dir=tmp_path / "logs")  # fmt: skip
    assert run.returncode != 0 and run.timed_out == (how == "timeout") and run.seconds < 50
    account = diagnose.report(run, "gk_sp point")
    assert account.startswith(diagnose.HEADING + "gk_sp point: ")
    for rank in (0, 1):
        assert f"rank {rank} stderr line" in run.ranks[rank]
        assert f"--- rank {rank}: its phases" in account and f"rank {rank} stderr line" in account
        if rank == 0 or how != "abort":  # a stopped rank's main thread, in time.sleep(60)
            assert f"rank.py:{SLEEP_LINE} <module>" in run.ranks[rank], account
    agent = diagnose.sigterm_sender(run, 0)
    assert "this process's parent" in agent and "torch.distributed.run" in agent, account
    if how == "abort":  # the -15 of rank 0 is torchrun's doing; the line names rank 1's abort
        assert diagnose.root_cause(run.stderr)["signal"] == "Signal 6 (SIGABRT)", account
        assert "Fatal Python error: Aborted" in run.ranks[1] and f"line {SLEEP_LINE - 1}" in run.ranks[1]
        assert _failure(run) == "Fatal Python error: Aborted; a rank's exit code -6 (Signal 6 (SIGABRT))", _failure(run)
    elif how == "outside":
        cause = diagnose.root_cause(run.stderr)
        assert (cause["rank"], cause["exitcode"], cause["signal"]) == ("1", "-15", "Signal 15 (SIGTERM)"), account
        assert "os.kill(" in diagnose.sigterm_sender(run, 1) and "started by pid" in diagnose.sigterm_sender(run, 1)
        assert "rank 1 (pid " in account and "exit code -15 (Signal 15 (SIGTERM))" in account
        assert _failure(run).startswith("a rank's exit code -15 (Signal 15 (SIGTERM)), sent by pid "), _failure(run)
    else:
        assert "over its timeout, then stopped" in account
        assert "this process's parent" in diagnose.sigterm_sender(run, 1)

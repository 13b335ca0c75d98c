"""How a long-chain measurement under torchrun fails: real torchrun runs of two ranks under diagnose.watch.

CI once reported gk_sp's measurement as "exit code -15" (SIGTERM), which torchrun sends to the ranks left when one
fails. A failed measurement now prints an account of each rank (benchmarks/long_chains/diagnose.py): which rank
failed and how, who sent a SIGTERM, each rank's phases, innermost frames and stderr."""

import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

RANK_SCRIPT = """import os, subprocess, sys, time
sys.path.insert(0, {root!r})
from benchmarks.long_chains import diagnose
diagnose.watch(int(os.environ["RANK"]))
diagnose.phase("waiting")
print("rank", os.environ["RANK"], "stderr line", file=sys.stderr, flush=True)
if os.environ["RANK"] == "1" and os.environ["HOW"] == "outside":  # another process, which stays a while
    subprocess.Popen([sys.executable, "-c", "import os, signal, time; os.kill(%d, signal.SIGTERM); time.sleep(5)"
                      % os.getpid()], start_new_session=True)
if os.environ["RANK"] == "1" and os.environ["HOW"] == "abort":
    os.abort()
time.sleep(60)
"""
SLEEP_LINE = RANK_SCRIPT.splitlines().index("time.sleep(60)") + 1


@pytest.mark.parametrize("how", ["abort", "outside", "timeout"])
def test_a_failed_run_says_which_rank_failed_how_who_sent_a_sigterm_and_where_each_rank_was(tmp_path, how):
    # a real torchrun of two ranks under diagnose.watch: "abort", rank 1 aborts (SIGABRT) and torchrun
    # stops rank 0; "outside", rank 1 gets SIGTERM from a process that is not torchrun, and torchrun then stops rank
    # 0; "timeout", the run passes launch()'s timeout and torchrun stops both. The account names the rank, the signal
    # and a SIGTERM's sender, and holds each rank's phases, innermost frames (of a stopped rank) and stderr
    from benchmarks.long_chains import diagnose
    from benchmarks.long_chains.sweep import _failure

    script = tmp_path / "rank.py"
    script.write_text(RANK_SCRIPT.format(root=str(ROOT)))
    env = {**os.environ, "HOW": how}
    run = diagnose.launch([str(script)], ranks=2, env=env, timeout=60 if how == "outside" else 8,
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

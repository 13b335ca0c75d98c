"""Decoupled rollouts on one `grpo-kernels serve-rollout` started by hand and shared by the module's tests: the
multi-node recipe (the trainer starts no server) with one trainer rank and with two FSDP ranks, the server's key
(what it refuses, what a trainer with a wrong key is told). The faults and the servers the trainer starts itself are
in tests/test_decoupled.py."""

import json
import os
import re
import secrets
import signal
import subprocess
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from test_decoupled import _command, _env, _require_vllm, _serve_by_hand, _train

pytestmark = pytest.mark.slow

KEY_VAR = "ROLLOUT_TEST_KEY"  # the trainer's variable (sampling.server_api_key_env)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """One `grpo-kernels serve-rollout --api-key-file` for the tests that only sample from a server and sync it
    (each run sends its weights first): (config, url, key, server process). The same key is vLLM's own
    (VLLM_API_KEY, which serve-rollout passes on): a real `vllm serve --api-key` with the grpo-kernels guard on every
    route besides, both satisfied by the trainer's one `Authorization: Bearer` header. A server start costs ~35 s of
    CPU; this module's tests run on one pytest-xdist worker (tests/conftest.py, XDIST_GROUPS), so it starts once."""
    _require_vllm()
    root = tmp_path_factory.mktemp("served")
    config = root / "run.toml"
    config.write_text('[task]\nname = "add"\ndifficulty = 1\n')
    key, key_file = secrets.token_urlsafe(24), root / "key"
    key_file.write_text(key + "\n")
    key_file.chmod(0o600)
    server, url = _serve_by_hand(config, root / "model", extra=["--api-key-file", str(key_file)],
                                 env={"VLLM_API_KEY": key, "GRPO_KERNELS_API_KEY": ""})  # fmt: skip
    yield config, url, key, server
    os.killpg(server.pid, signal.SIGTERM)
    try:
        server.wait(60)
    except subprocess.TimeoutExpired:  # do not leave it to the rest of the suite
        os.killpg(server.pid, signal.SIGKILL)
        server.wait(30)


def test_decoupled_k0_on_a_server_started_by_hand_samples_and_trains_exactly_as_the_colocated_sampler(
        tmp_path, served, monkeypatch):  # fmt: skip
    """The multi-node recipe on one node: `grpo-kernels serve-rollout --config` (the trainer's model, written and
    served), then `train --sampling.server_urls=...`. The trainer starts no server and sends its weights first (the
    server's initial weights do not matter), and with the same seeds the server samples the same completions as
    the in-process engine (per-request seeds): rewards, lengths and losses agree; after every sync the server's
    log-probs of a fixed sequence are the trainer's."""
    config, url, key, _ = served
    monkeypatch.setenv(KEY_VAR, key)
    common = ["--config", str(config), "--optim.steps=4", "--optim.lr=1e-3", "--sampling.group_size=8",
              "--sampling.prompts_per_step=8", "--sampling.temperature=0.8", "--task.num_eval_prompts=16"]  # fmt: skip
    colocated, _ = _train(tmp_path / "colocated", common)
    decoupled, proc = _train(tmp_path / "decoupled", [*common, "--sampling.placement=decoupled",
                                                      f"--sampling.server_urls={url}",
                                                      f"--sampling.server_api_key_env={KEY_VAR}"])  # fmt: skip
    assert not re.search(r"rollout servers: \d+ started", proc.stdout)  # the trainer started none
    # The key: in no file of the run (config.toml holds the variable's name), in nothing the trainer printed.
    assert f'server_api_key_env = "{KEY_VAR}"' in (tmp_path / "decoupled" / "config.toml").read_text()
    for path in (tmp_path / "decoupled").rglob("*"):
        assert not path.is_file() or key.encode() not in path.read_bytes(), path
    assert key not in proc.stdout + proc.stderr
    assert any(r["grad_norm"] > 0 for r in colocated[:3]), "no update: the weight stream would be untested"
    for c, d in zip(colocated, decoupled, strict=True):
        assert (d["reward"], d["completion_tokens"], d["invalid_group_rate"]) == \
            (c["reward"], c["completion_tokens"], c["invalid_group_rate"])  # fmt: skip
        assert d["loss"] == pytest.approx(c["loss"], rel=1e-5, abs=1e-7)
        assert d["rollout_staleness"] == 0
        assert d["weight_sync_logp_max_diff"] <= 1e-4
        assert d["weight_sync_bytes"] > 0 and d["weight_sync_s"] > 0
    # A missed sync would leave the server one update behind: sampler and trainer log-probs would differ by ~1e-2.
    assert all(r["sampler_logp_abs_diff"] < 1e-4 for r in decoupled)
    summary = json.loads((tmp_path / "decoupled" / "summary.json").read_text())
    assert summary["eval_success_end"] == json.loads((tmp_path / "colocated" / "summary.json").read_text())[
        "eval_success_end"]  # fmt: skip


@pytest.mark.distributed
def test_decoupled_with_two_fsdp_trainer_ranks_and_one_server(tmp_path, served, monkeypatch):
    """Two trainer ranks (FSDP2, gloo): every rank takes part in the gathers of the weight stream, rank 0 sends;
    the server's log-probs after every sync are the (sharded) trainer's. The server is the module's, which an
    earlier run may have synced: the run's first sync replaces whatever weights it holds."""
    config, url, key, _ = served
    monkeypatch.setenv(KEY_VAR, key)
    rows, proc = _train(tmp_path / "run", ["--config", str(config), "--optim.steps=4", "--optim.lr=1e-3",
                                           "--sampling.group_size=8", "--sampling.prompts_per_step=8",
                                           "--task.num_eval_prompts=8", "--sampling.placement=decoupled",
                                           "--sampling.max_staleness=1", f"--sampling.server_urls={url}",
                                           f"--sampling.server_api_key_env={KEY_VAR}"], ranks=2)  # fmt: skip
    assert not re.search(r"rollout servers: \d+ started", proc.stdout)
    assert [r["rollout_staleness"] for r in rows] == [0, 1, 1, 1]
    assert any(r["grad_norm"] > 0 for r in rows[:3])
    assert all(r["weight_sync_logp_max_diff"] <= 1e-4 for r in rows), [r["weight_sync_logp_max_diff"] for r in rows]
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["world_size"] == 2


def _status(url, method, path, key=None, body=None):
    """The HTTP status of one request (no key unless given)."""
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
    data = None if method == "GET" else json.dumps(body or {}).encode()
    request = urllib.request.Request(f"{url}/{path}", data=data, headers=headers, method=method)
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status
    except urllib.error.HTTPError as exc:
        return exc.code


def test_the_served_server_refuses_its_routes_without_the_key_and_a_trainer_with_a_wrong_key_is_told_in_one_line(
        tmp_path, served, monkeypatch):  # fmt: skip
    """The served server (its key from --api-key-file): the weight-transfer and development routes, /metrics and
    /v1 answer 401 without the key or with a wrong one (the requests would otherwise act: a 4 TiB update, a
    rendezvous with a stranger's store, a sleep); /health answers anyone. vLLM's own check is on too (its
    VLLM_API_KEY, passed on by serve-rollout). A trainer sent to it with a wrong key ends with one line naming the
    server."""
    config, url, key, server = served
    routes = [("update_weights", {"update_info": {"names": ["x"], "dtype_names": ["float32"], "shapes": [[2**40]],
                                                  "bucket_bytes": 1 << 20}}),
              ("init_weight_transfer_engine", {"init_info": {"master_address": "203.0.113.9", "master_port": 1,
                                                             "rank_offset": 1, "world_size": 2}}),
              ("collective_rpc", {"method": "grpo_set_temperature", "args": ["1e-9"]}),
              ("sleep", None), ("pause", None), ("v1/completions", {"prompt": [1], "max_tokens": 1})]  # fmt: skip
    for wrong in (None, "wrong-" + key):
        for path, body in routes:
            assert _status(url, "POST", path, wrong, body) == 401, (path, wrong)
        assert _status(url, "GET", "metrics", wrong) == 401
    assert _status(url, "GET", "health") == 200
    assert _status(url, "GET", "is_paused", key) == 200 and _status(url, "GET", "metrics", key) == 200
    environ = dict(v.split(b"=", 1) for v in Path(f"/proc/{server.pid}/environ").read_bytes().split(b"\0") if v)
    assert environ[b"VLLM_API_KEY"] == environ[b"GRPO_KERNELS_API_KEY"] == key.encode()  # both checks, one key

    monkeypatch.setenv(KEY_VAR, "wrong-" + key)
    command = _command(tmp_path / "run", ["--config", str(config), "--optim.steps=2", "--sampling.placement=decoupled",
                                          f"--sampling.server_urls={url}", f"--sampling.server_api_key_env={KEY_VAR}"])
    command.append("--task.sft_warmup_steps=0")  # (after the module's TASK options: the run ends before training)
    proc = subprocess.run(command, capture_output=True, text=True, timeout=300, env=_env())
    assert proc.returncode != 0
    lines = [line for line in proc.stderr.splitlines() if line.startswith("grpo-kernels train: error:")]
    assert len(lines) == 1 and lines[0].startswith(f"grpo-kernels train: error: rollout server {url} refused the "
                                                   "API key"), proc.stderr[-3000:]  # fmt: skip
    assert "Traceback" not in proc.stderr and key not in proc.stderr + proc.stdout

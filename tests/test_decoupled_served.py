"""Decoupled rollouts on one `grpo-kernels serve-rollout` started by hand and shared by the module's tests: the
multi-node recipe (the trainer starts no server) with one trainer rank and with two FSDP ranks. The faults and the
servers the trainer starts itself are in tests/test_decoupled.py."""

import json
import os
import re
import signal
import subprocess

import pytest
from test_decoupled import _require_vllm, _serve_by_hand, _train

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """One `grpo-kernels serve-rollout` for the tests that only sample from a server and sync it (each run sends
    its weights first): (config, url). A server start costs ~35 s of CPU; this module's tests run on one pytest-xdist
    worker (tests/conftest.py, XDIST_GROUPS), so it starts once."""
    _require_vllm()
    root = tmp_path_factory.mktemp("served")
    config = root / "run.toml"
    config.write_text('[task]\nname = "add"\ndifficulty = 1\n')
    server, url = _serve_by_hand(config, root / "model")
    yield config, url
    os.killpg(server.pid, signal.SIGTERM)
    try:
        server.wait(60)
    except subprocess.TimeoutExpired:  # do not leave it to the rest of the suite
        os.killpg(server.pid, signal.SIGKILL)
        server.wait(30)


def test_decoupled_k0_on_a_server_started_by_hand_samples_and_trains_exactly_as_the_colocated_sampler(
        tmp_path, served):  # fmt: skip
    """The multi-node recipe on one node: `grpo-kernels serve-rollout --config` (the trainer's model, written and
    served), then `train --sampling.server_urls=...`. The trainer starts no server and sends its weights first (the
    server's initial weights do not matter), and with the same seeds the server samples the same completions as
    the in-process engine (per-request seeds): rewards, lengths and losses agree; after every sync the server's
    log-probs of a fixed sequence are the trainer's."""
    config, url = served
    common = ["--config", str(config), "--optim.steps=4", "--optim.lr=1e-3", "--sampling.group_size=8",
              "--sampling.prompts_per_step=8", "--sampling.temperature=0.8", "--task.num_eval_prompts=16"]  # fmt: skip
    colocated, _ = _train(tmp_path / "colocated", common)
    decoupled, proc = _train(tmp_path / "decoupled", [*common, "--sampling.placement=decoupled",
                                                      f"--sampling.server_urls={url}"])  # fmt: skip
    assert not re.search(r"rollout servers: \d+ started", proc.stdout)  # the trainer started none
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
def test_decoupled_with_two_fsdp_trainer_ranks_and_one_server(tmp_path, served):
    """Two trainer ranks (FSDP2, gloo): every rank takes part in the gathers of the weight stream, rank 0 sends;
    the server's log-probs after every sync are the (sharded) trainer's. The server is the module's, which an
    earlier run may have synced: the run's first sync replaces whatever weights it holds."""
    config, url = served
    rows, proc = _train(tmp_path / "run", ["--config", str(config), "--optim.steps=4", "--optim.lr=1e-3",
                                           "--sampling.group_size=8", "--sampling.prompts_per_step=8",
                                           "--task.num_eval_prompts=8", "--sampling.placement=decoupled",
                                           "--sampling.max_staleness=1", f"--sampling.server_urls={url}"],
                        ranks=2)  # fmt: skip
    assert not re.search(r"rollout servers: \d+ started", proc.stdout)
    assert [r["rollout_staleness"] for r in rows] == [0, 1, 1, 1]
    assert any(r["grad_norm"] > 0 for r in rows[:3])
    assert all(r["weight_sync_logp_max_diff"] <= 1e-4 for r in rows), [r["weight_sync_logp_max_diff"] for r in rows]
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["world_size"] == 2

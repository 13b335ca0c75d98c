"""The multi-node recipe across real network interfaces: three network namespaces joined by veth pairs to a bridge
(a fourth namespace) stand for three hosts. A rollout server (`grpo-kernels serve-rollout`) runs in one, two trainer
ranks (torchrun --nnodes=2, c10d rendezvous on the first trainer host's address) in the other two, and the weights
stream from trainer rank 0 to the server after every step over the bridge. The run checks what the loopback run
(test_decoupled.test_servers_started_by_hand_with_serve_rollout_and_reached_by_url) checks.

Needs root and iproute2 (CI runs as root); where namespaces cannot be made the test is skipped and says why."""

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

SERVER, NODE0, NODE1 = "10.77.0.1", "10.77.0.2", "10.77.0.3"
PORT, RDZV_PORT = 8000, 29400


def _ip(*args):
    proc = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if proc.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {proc.stderr.strip()}")


class Hosts:
    """Namespaces <name><tag> with an eth0 each on one bridge; `exec(name, ...)` runs a command inside one."""

    def __init__(self, tag: str, hosts: dict):
        self.tag, self.hosts, self.made = tag, hosts, []
        try:
            self._build(hosts)
        except Exception:
            self.close()  # what was made before the failure goes too
            raise

    def _build(self, hosts: dict):
        tag = self.tag
        switch = f"gksw{tag}"
        self._ns(switch)
        _ip("-n", switch, "link", "add", "br0", "type", "bridge")
        _ip("-n", switch, "link", "set", "br0", "up")
        for i, (name, address) in enumerate(hosts.items()):
            ns = self._ns(f"{name}{tag}")
            a, b = f"gkv{tag}h{i}", f"gkv{tag}b{i}"  # root-namespace names (<= 15 characters), moved at once
            _ip("link", "add", a, "type", "veth", "peer", "name", b)
            _ip("link", "set", a, "netns", ns)
            _ip("link", "set", b, "netns", switch)
            _ip("-n", ns, "link", "set", a, "name", "eth0")
            _ip("-n", ns, "addr", "add", f"{address}/24", "dev", "eth0")
            _ip("-n", ns, "link", "set", "eth0", "up")
            _ip("-n", ns, "link", "set", "lo", "up")
            _ip("-n", switch, "link", "set", b, "master", "br0")
            _ip("-n", switch, "link", "set", b, "up")

    def _ns(self, name):
        _ip("netns", "add", name)
        self.made.append(name)
        return name

    def command(self, name, *args):
        return ["ip", "netns", "exec", f"{name}{self.tag}", *args]

    def close(self):
        for ns in reversed(self.made):  # a namespace's veth ends go with it
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)


@pytest.fixture
def hosts():
    if os.geteuid() != 0 or shutil.which("ip") is None:
        pytest.skip("network namespaces need root and iproute2 (ip)")
    tag = str(os.getpid() % 100000)
    try:
        made = Hosts(tag, {"gks": SERVER, "gk0": NODE0, "gk1": NODE1})
    except RuntimeError as exc:
        pytest.skip(f"cannot make network namespaces here: {exc}")
    try:
        yield made
    finally:
        made.close()


KEY = "multihost-test-key"  # the server's (GRPO_KERNELS_API_KEY: a non-loopback --host needs one) and the trainers'


def _env():
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR")}
    return {**env, "GLOO_SOCKET_IFNAME": "eth0", "NO_PROXY": "*", "no_proxy": "*", "GRPO_KERNELS_API_KEY": KEY}


def test_decoupled_run_across_three_network_namespaces(hosts, tmp_path):
    from test_decoupled import _require_vllm

    _require_vllm()
    config = tmp_path / "run.toml"
    config.write_text('[task]\nname = "add"\ndifficulty = 1\n')
    server = subprocess.Popen(hosts.command("gks", sys.executable, "-m", "grpo_kernels.cli", "serve-rollout",
                                            "--config", str(config), "--model-dir", str(tmp_path / "served"),
                                            "--host", SERVER, "--port", str(PORT)),
                              stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT, env=_env(),
                              start_new_session=True)  # fmt: skip
    trainers = []
    try:
        wait = textwrap.dedent(f"""
            import time
            from grpo_kernels.train.rollout.server import RolloutServerError, ServerClient
            client, deadline = ServerClient("http://{SERVER}:{PORT}", timeout_s=5), time.monotonic() + 300
            while True:
                try:
                    client.get("health")
                    break
                except RolloutServerError:
                    assert time.monotonic() < deadline, "no answer from the server host within 300 s"
                    time.sleep(1)
        """)  # from a trainer host: the server is reachable over the bridge only
        subprocess.run(hosts.command("gk0", sys.executable, "-c", wait), check=True, timeout=360, env=_env())
        run = tmp_path / "run"
        for name, address in (("gk0", NODE0), ("gk1", NODE1)):
            # is_host: the first trainer host serves the rendezvous store (torchrun recognises its own endpoint by
            # the machine's host name, which here resolves outside the namespaces)
            launch = [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc_per_node=1",
                      "--rdzv_backend=c10d", f"--rdzv_endpoint={NODE0}:{RDZV_PORT}", "--rdzv_id=gk-multihost",
                      f"--rdzv_conf=is_host={int(address == NODE0)}", f"--local_addr={address}", "-m",
                      "grpo_kernels.cli", "train", "--config", str(config),
                      f"--logging.run_dir={run}", "--optim.steps=3", "--optim.lr=1e-3", "--sampling.group_size=4",
                      "--sampling.prompts_per_step=4", "--task.num_eval_prompts=8", "--sampling.sampler=vllm",
                      "--sampling.placement=decoupled", f"--sampling.server_urls=http://{SERVER}:{PORT}",
                      "--sampling.server_api_key_env=GRPO_KERNELS_API_KEY", "--sampling.max_new_tokens=4",
                      "--packing.token_budget=256"]  # fmt: skip
            trainers.append(subprocess.Popen(hosts.command(name, *launch), stdout=subprocess.PIPE,
                                             stderr=subprocess.PIPE, text=True, env=_env()))  # fmt: skip
        outs = [t.communicate(timeout=900) for t in trainers]
        for t, (_, err) in zip(trainers, outs, strict=True):
            assert t.returncode == 0, err[-4000:]
        assert "rollout servers: 1 started" not in outs[0][0]  # the trainer started none
        # weight_transfer_address unset: rank 0's host's address on the route to the server (not the host name)
        said = [(address, out) for address, (out, _) in zip((NODE0, NODE1), outs, strict=True)
                if "weight stream:" in out]  # fmt: skip
        assert len(said) == 1 and f"join trainer rank 0 at {said[0][0]}:" in said[0][1], said
        assert "(this host's on their route)" in said[0][1]
        rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
        assert [r["step"] for r in rows] == [0, 1, 2]
        assert all(r["weight_sync_logp_max_diff"] <= 1e-4 for r in rows)  # the weights crossed the bridge
        assert all(r["sampler_logp_abs_diff"] < 1e-4 for r in rows)
        assert not (run / "rollout-model").exists()
    finally:
        for t in trainers:
            if t.poll() is None:
                t.kill()
        os.killpg(server.pid, signal.SIGTERM)
        try:
            server.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
        time.sleep(0.5)

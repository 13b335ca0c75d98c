"""Where the "gloo" weight stream listens: the trainer's rendezvous store and gloo listener on the configured
address only (a connection through another address of the host is refused), a worker's on one address too, and a
configured address that is not this host's refused in one line before any server is asked to join. The trainer's
and a worker's real engines in one process, no vLLM server."""

import importlib.util
import os
import socket
from types import SimpleNamespace

import pytest
import torch


def _require_vllm():
    if importlib.util.find_spec("vllm") is None:
        if os.environ.get("GRPO_REQUIRE_VLLM") == "1":
            pytest.fail("vllm is not importable (GRPO_REQUIRE_VLLM=1)")
        pytest.skip("vllm is not importable")


class _Worker:
    """A server of one worker: its init route answered by an in-process GlooWeightTransferEngine."""

    world_size = 1

    def __init__(self):
        from grpo_kernels.train.rollout.weight_transfer import GlooWeightTransferEngine, register_vllm_plugin

        register_vllm_plugin()
        vllm_config = SimpleNamespace(parallel_config=SimpleNamespace(data_parallel_index=0, world_size=1, rank=0),
                                      model_config=None)  # fmt: skip
        self.engine = GlooWeightTransferEngine(SimpleNamespace(backend="gloo"), vllm_config, torch.device("cpu"),
                                               SimpleNamespace())  # fmt: skip
        self.calls = []

    def post(self, path, body=None):
        self.calls.append(path)
        if path == "init_weight_transfer_engine":
            self.engine.init_transfer_engine(self.engine.parse_init_info(body["init_info"]))


def _model():
    from grpo_kernels.train.data.tasks import CharTokenizer, tiny_model

    return tiny_model(CharTokenizer().vocab_size, attn_implementation="sdpa", seed=3)


def _listening() -> set:
    """(ip, port) of every TCP socket this process listens on."""
    import psutil  # (vLLM's dependency: these tests need vLLM anyway)

    return {(c.laddr.ip, c.laddr.port) for c in psutil.Process().net_connections(kind="tcp")
            if c.status == psutil.CONN_LISTEN}  # fmt: skip


def _refused(address: str, port: int) -> bool:
    with socket.socket() as probe:
        probe.settimeout(5)
        try:
            probe.connect((address, port))
        except ConnectionRefusedError:
            return True
    return False


@pytest.mark.parametrize("address,other", [("127.0.0.1", "127.0.0.2"), ("127.0.0.2", "127.0.0.1")])
def test_the_rendezvous_and_the_trainers_gloo_listener_accept_on_the_configured_address_only(address, other):
    _require_vllm()
    from grpo_kernels.train.rollout.server import free_port
    from grpo_kernels.train.rollout.weight_transfer import WeightSync

    model = _model()
    names = {n for n, _ in model.named_parameters()}
    before, port = _listening(), free_port()
    sync = WeightSync(model, servers=[_Worker()], rank=0, backend="gloo", names=names, wire_dtype=torch.float32,
                      address=address, port=port, timeout_s=30)  # fmt: skip
    try:
        opened = _listening() - before
        assert not [ip for ip, _ in opened if ip in ("0.0.0.0", "::")], f"listening on every interface: {opened}"
        assert (address, port) in opened, f"the rendezvous store is not on {address}:{port}: {opened}"
        assert [p for ip, p in opened if ip == address and p != port], f"no gloo listener on {address}: {opened}"
        assert _refused(other, port), f"the rendezvous store on {address} accepted a connection through {other}"
    finally:
        sync.close()


def test_an_address_that_is_not_this_hosts_is_refused_before_the_servers_are_asked_to_join():
    _require_vllm()
    from grpo_kernels.train.rollout.weight_transfer import WeightSync

    model = _model()
    worker = _Worker()
    with pytest.raises(ValueError, match=r"sampling.weight_transfer_address '198.51.100.7': cannot listen on "
                                         r"198.51.100.7 port \d+ \(.*\); the address must be one of this host's"):
        WeightSync(model, servers=[worker], rank=0, backend="gloo", names={n for n, _ in model.named_parameters()},
                   wire_dtype=torch.float32, address="198.51.100.7", port=29471, timeout_s=2)  # fmt: skip
    assert worker.calls == []

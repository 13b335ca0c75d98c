"""The weight stream to rollout servers, without servers: the "gloo" engines' wire format (bucket_plan), a full
round trip through vLLM's own trainer factory into two in-process worker engines (each a rank of a real gloo
group), the name check, and the staleness pipeline. The same engines behind real `vllm serve` processes:
tests/test_decoupled.py."""

import importlib.util
import os
import threading
import time
from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from grpo_kernels.train.rollout.decoupled import RolloutPipeline
from grpo_kernels.train.rollout.weight_transfer import ALIGN, bucket_plan, bucket_size

DTYPES = ["float32", "bfloat16", "float16", "int64", "uint8"]


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(DTYPES), st.lists(st.integers(0, 40), min_size=0, max_size=3)),
                min_size=1, max_size=30), st.integers(1, 5000))  # fmt: skip
def test_bucket_plan_covers_every_tensor_once_in_order_aligned_and_within_the_bound(params, bucket_bytes):
    dtypes, shapes = [d for d, _ in params], [s for _, s in params]
    plan = bucket_plan(dtypes, shapes, bucket_bytes)
    assert [i for bucket in plan for i, _, _ in bucket] == list(range(len(params)))
    for bucket in plan:
        assert bucket, "an empty bucket"
        end = 0
        for i, offset, size in bucket:
            item = getattr(torch, dtypes[i]).itemsize
            assert size == torch.Size(shapes[i]).numel() * item
            assert offset % ALIGN == 0 and offset >= end  # aligned, no overlap
            end = offset + size
        assert bucket_size(bucket) == end
        assert end <= bucket_bytes or len(bucket) == 1  # only a lone tensor may exceed the bound


def _require_vllm():
    if importlib.util.find_spec("vllm") is None:
        if os.environ.get("GRPO_REQUIRE_VLLM") == "1":
            pytest.fail("vllm is not importable (GRPO_REQUIRE_VLLM=1)")
        pytest.skip("vllm is not importable")


class _FakeModel:
    """What the worker engine needs of a vLLM model: load_weights (copies, as vLLM's do)."""

    def __init__(self):
        self.loaded = {}

    def load_weights(self, weights):
        for name, tensor in weights:
            assert name not in self.loaded, f"{name} loaded twice"
            self.loaded[name] = tensor.clone()


class _FakeServer:
    """A server's HTTP routes, answered by an in-process GlooWeightTransferEngine (the worker side)."""

    world_size = 1

    def __init__(self):
        from grpo_kernels.train.rollout.weight_transfer import GlooWeightTransferEngine, register_vllm_plugin

        register_vllm_plugin()
        vllm_config = SimpleNamespace(parallel_config=SimpleNamespace(data_parallel_index=0, world_size=1, rank=0),
                                      model_config=None)  # fmt: skip
        self.model = _FakeModel()
        self.engine = GlooWeightTransferEngine(SimpleNamespace(backend="gloo"), vllm_config, torch.device("cpu"),
                                               self.model)  # fmt: skip
        self.calls = []

    def post(self, path, body=None):
        self.calls.append(path)
        if path == "init_weight_transfer_engine":
            self.engine.init_transfer_engine(self.engine.parse_init_info(body["init_info"]))
        elif path == "update_weights":
            self.engine.receive_weights(self.engine.parse_update_info(body["update_info"]))


def _model():
    from grpo_kernels.train.data.tasks import CharTokenizer, tiny_model

    return tiny_model(CharTokenizer().vocab_size, attn_implementation="sdpa", seed=3)


@pytest.mark.parametrize("wire", [torch.float32, torch.bfloat16])
def test_gloo_stream_delivers_every_weight_to_every_server(wire):
    _require_vllm()
    from grpo_kernels.train.rollout.server import free_port
    from grpo_kernels.train.rollout.weight_transfer import WeightSync

    model = _model()
    names = {n for n, _ in model.named_parameters()}
    tied = model.config.tie_word_embeddings
    servers = [_FakeServer(), _FakeServer()]
    sync = WeightSync(model, servers=servers, rank=0, backend="gloo", names=names, wire_dtype=wire,
                      address="127.0.0.1", port=free_port(), bucket_bytes=3000, timeout_s=30)  # fmt: skip
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p))  # fresh values: what arrives must be these, not the initial ones
    stats = sync.send()
    expected = dict(model.named_parameters())
    if tied:
        expected["lm_head.weight"] = model.get_output_embeddings().weight
    assert stats["weight_sync_bytes"] == sum(p.numel() for p in expected.values()) * wire.itemsize
    for server in servers:
        assert server.calls == ["init_weight_transfer_engine", "start_weight_update", "update_weights",
                                "finish_weight_update"]  # fmt: skip
        assert set(server.model.loaded) == set(expected)
        for name, p in expected.items():
            got = server.model.loaded[name]
            assert got.dtype == wire and got.shape == p.shape
            assert torch.equal(got, p.detach().to(wire)), name
    sync.close()


def test_weight_sync_refuses_names_the_servers_checkpoint_does_not_have():
    _require_vllm()
    from grpo_kernels.train.rollout.weight_transfer import WeightSync

    model = _model()
    names = {n for n, _ in model.named_parameters()}
    dropped = sorted(names)[3]
    with pytest.raises(ValueError, match="do not match the servers' checkpoint.*missing"):
        WeightSync(model, servers=None, rank=1, backend="gloo", names=names | {"model.extra.weight"},
                   wire_dtype=torch.float32, address="127.0.0.1", port=1)  # fmt: skip
    with pytest.raises(ValueError, match=f"unexpected \\['{dropped}'\\]"):
        WeightSync(model, servers=None, rank=1, backend="gloo", names=names - {dropped}, wire_dtype=torch.float32,
                   address="127.0.0.1", port=1)  # fmt: skip


def _drive(k, steps=6, train_s=0.0, produce_s=0.0):
    """The trainer's use of a RolloutPipeline: get(step), train, update(version = step + 1); returns the version
    each batch was produced with."""
    holder = []

    def produce(step):
        while not holder:  # the thread may start before the constructor returns
            time.sleep(0.001)
        version = holder[0].version
        time.sleep(produce_s)
        return {"version": version}

    pipeline = RolloutPipeline(produce, first=0, last=steps, max_staleness=k, version=0)
    holder.append(pipeline)
    versions = []
    for step in range(steps):
        versions.append(pipeline.get(step)["version"])
        time.sleep(train_s)
        pipeline.update(lambda: None, step + 1)
    pipeline.close()
    return versions


@pytest.mark.parametrize("k", [0, 1, 2])
@pytest.mark.parametrize("train_s,produce_s", [(0.0, 0.0), (0.02, 0.0), (0.0, 0.02)])
def test_pipeline_samples_step_s_with_the_weights_of_step_s_minus_k_whatever_the_timing(k, train_s, produce_s):
    versions = _drive(k, train_s=train_s, produce_s=produce_s)
    assert [s - v for s, v in enumerate(versions)] == [min(s, k) for s in range(6)]


def test_pipeline_raises_the_sampling_threads_error_in_the_trainer():
    def produce(step):
        if step == 2:
            raise RuntimeError("server gone")
        return {}

    pipeline = RolloutPipeline(produce, first=0, last=5, max_staleness=1, version=0)
    pipeline.get(0)
    pipeline.update(lambda: None, 1)
    pipeline.get(1)
    with pytest.raises(RuntimeError, match="server gone"):
        pipeline.update(lambda: None, 2)  # waits for step 2 to start, which fails
    with pytest.raises(RuntimeError, match="server gone"):
        pipeline.get(2)


def test_pipeline_update_waits_for_the_batch_being_sampled():
    started, release = threading.Event(), threading.Event()
    log = []

    def produce(step):
        if step == 1:
            started.set()
            release.wait(5)
        log.append(f"produced {step}")
        return {}

    pipeline = RolloutPipeline(produce, first=0, last=2, max_staleness=1, version=0)
    pipeline.get(0)
    started.wait(5)
    threading.Timer(0.2, release.set).start()
    pipeline.update(lambda: log.append("update"), 1)
    assert log == ["produced 0", "produced 1", "update"]
    pipeline.close()


@pytest.mark.parametrize("overrides,message", [
    (["--sampling.placement=decoupled"], 'needs sampling.sampler "vllm"'),
    (["--sampling.max_staleness=1"], 'sampling.max_staleness needs sampling.placement "decoupled"'),
    (["--sampling.server_urls=http://h:1"], 'sampling.server_urls needs sampling.placement "decoupled"'),
    (["--sampling.sampler=vllm", "--sampling.placement=decoupled", "--sampling.max_staleness=-1"],
     "sampling.max_staleness must be >= 0"),
    (["--sampling.sampler=vllm", "--sampling.placement=decoupled", "--sampling.servers=2",
      "--sampling.server_devices=0,1"], "devices of each of the 2 servers"),
    (["--sampling.sampler=vllm", "--sampling.placement=decoupled", "--sampling.server_urls=http://h:1",
      "--sampling.server_devices=0"], "already running"),
    (["--sampling.sampler=vllm", "--sampling.placement=decoupled", "--sampling.weight_transfer=tcp"],
     "sampling.weight_transfer must be one of"),
    (["--sampling.placement=elsewhere"], "sampling.placement must be one of"),
])  # fmt: skip
def test_decoupled_options_are_checked_when_the_config_loads(overrides, message):
    from grpo_kernels.train.config.io import load_config

    with pytest.raises(ValueError, match=message):
        load_config(None, overrides)


DEC = ["--sampling.sampler=vllm", "--sampling.placement=decoupled"]


@pytest.mark.parametrize("overrides,message", [
    (["--sampling.server_urls=not a url"], r"sampling.server_urls: 'not a url' is not a server URL like http://"),
    (["--sampling.server_urls=,,"], r"sampling.server_urls: item 0 of ',,' is empty"),
    (["--sampling.server_urls=http://h:1,"], r"sampling.server_urls: item 1 of 'http://h:1,' is empty"),
    (["--sampling.server_urls=http://h"], r"'http://h' is not a server URL .*\(scheme, host and port\)"),
    (["--sampling.server_urls=ftp://h:21"], r"'ftp://h:21' is not a server URL"),
    (["--sampling.server_urls=http://h:99999"], r"'http://h:99999' is not a server URL"),
    (["--sampling.weight_transfer_address=999.1.1.1"],
     r"sampling.weight_transfer_address '999.1.1.1' does not resolve to an address"),
    (["--sampling.weight_transfer_address= "], r"sampling.weight_transfer_address is blank"),
    (["--sampling.servers=1000"], r"sampling.servers = 1000 vLLM CPU servers need about \d+\.\d GiB .* this host has"),
    (["--sampling.group_size=2", "--sampling.prompts_per_step=1", "--group_size.dynamic_sampling=true",
      "--group_size.max_resample_rounds=1000000000"],
     r"with dynamic sampling a step may sample .* = 1000000001 \* 1 \* 2 \* \d+ tokens, more than"),
])  # fmt: skip
def test_decoupled_start_up_that_cannot_work_is_refused_before_the_run(overrides, message, monkeypatch):
    """Each was accepted and failed later: 1000 servers ate the machine, 1e9 resample rounds hung, a bad URL or
    transfer address died with a traceback (87 s later for the address) and left rollout-model/ behind. The config's
    own rules refuse at load; what depends on this host (the address, the servers' memory) preflight.check."""
    from grpo_kernels.train import preflight
    from grpo_kernels.train.config.io import load_config

    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    with pytest.raises(ValueError, match=message):
        preflight.check(load_config(None, (DEC if "group_size" not in overrides[-1] else []) + overrides), "cpu")
    ok = load_config(None, [*DEC, "--sampling.server_urls=http://127.0.0.1:8000, https://h.example:1"])
    assert ok.sampling.urls() == ["http://127.0.0.1:8000", "https://h.example:1"]


@pytest.mark.parametrize("urls,item", [
    ("http://user:s3cret-key@h:1", 0), ("http://h:1,https://:s3cret-key@h:2/", 1), ("http://s3cret-key@h:99999", 0),
    ("user:s3cret-key@h:1", 0), (",http://u:s3cret-key@h:1", 1),
], ids=["user-and-key", "second-url", "key-bad-port", "no-scheme", "after-empty"])  # fmt: skip
def test_a_key_in_a_server_url_is_refused_at_load_without_echoing_it(urls, item):
    """http://user:KEY@host passed the check, then failed; the key was echoed in errors and saved in config.toml."""
    from grpo_kernels.train.config.io import load_config

    with pytest.raises(ValueError) as info:
        load_config(None, [*DEC, f"--sampling.server_urls={urls}"])
    message = str(info.value)
    assert message.startswith(f"sampling.server_urls: item {item} has a user name or password in it"), message
    assert "sampling.server_api_key_env" in message and "s3cret" not in message and "\n" not in message


def test_the_servers_key_option_holds_a_variable_name_and_only_the_name_is_saved(tmp_path, monkeypatch):
    from grpo_kernels.train.config.io import load_config, save_config

    with pytest.raises(ValueError, match='sampling.server_api_key_env needs sampling.placement "decoupled"'):
        load_config(None, ["--sampling.server_api_key_env=ROLLOUT_KEY"])
    with pytest.raises(ValueError) as info:
        load_config(None, [*DEC, "--sampling.server_api_key_env=sk-s3cret/key"])
    assert "must be the NAME of an environment variable" in str(info.value) and "s3cret" not in str(info.value)
    monkeypatch.setenv("ROLLOUT_KEY", "s3cret-key")
    config = load_config(None, [*DEC, "--sampling.server_urls=http://h:1", "--sampling.server_api_key_env=ROLLOUT_KEY"])
    save_config(config, tmp_path / "config.toml")
    text = (tmp_path / "config.toml").read_text()
    assert 'server_api_key_env = "ROLLOUT_KEY"' in text and "s3cret" not in text
    assert load_config(tmp_path / "config.toml").sampling.server_api_key_env == "ROLLOUT_KEY"


@pytest.mark.skipif(torch.cuda.is_available(), reason="nccl is a valid choice with CUDA")
def test_nccl_weight_transfer_without_cuda_is_refused_before_the_run():
    from grpo_kernels.train import preflight
    from grpo_kernels.train.config.io import load_config

    with pytest.raises(ValueError, match=r'sampling.weight_transfer = "nccl" needs CUDA'):
        preflight.check(load_config(None, [*DEC, "--sampling.weight_transfer=nccl"]), "cpu")


def test_servers_start_in_bounded_waves():
    """At most `at_once` servers are starting (launched, not yet healthy) at any time; all end up ready."""
    from grpo_kernels.train.rollout.decoupled import _launch

    events, starting, peak = [], set(), [0]

    class Server:
        def __init__(self, i):
            self.i = i

        def launch(self):
            starting.add(self.i)
            peak[0] = max(peak[0], len(starting))
            events.append(("launch", self.i))

        def wait_ready(self):
            starting.discard(self.i)
            events.append(("ready", self.i))

    _launch([Server(i) for i in range(7)], at_once=3)
    assert peak[0] == 3 and sorted(i for e, i in events if e == "ready") == list(range(7)) and not starting


def test_serve_rollout_on_a_port_in_use_is_one_line_and_writes_nothing(tmp_path, monkeypatch):
    import socket

    from grpo_kernels.cli import main

    monkeypatch.chdir(tmp_path)
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        with pytest.raises(SystemExit) as info:
            main(["serve-rollout", "--config", "none.toml", "--host", "127.0.0.1", "--port", str(port)])
    message = str(info.value)
    assert f"--port {port}: cannot listen on 127.0.0.1:{port}" in message and "\n" not in message, message
    assert list(tmp_path.iterdir()) == []


def test_server_cores_are_split_from_the_trainers(monkeypatch):
    from grpo_kernels.train.config.io import load_config
    from grpo_kernels.train.rollout.decoupled import _split_cores

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3, 4})  # the config checks the cores too
    s = load_config(None, ["--sampling.sampler=vllm", "--sampling.placement=decoupled", "--sampling.servers=2",
                           "--sampling.server_devices=0-1;2"]).sampling  # fmt: skip
    affinity = {}
    monkeypatch.setattr(os, "sched_setaffinity", lambda pid, cores: affinity.update(mine=sorted(cores)))
    monkeypatch.setattr(torch, "set_num_threads", lambda n: affinity.update(threads=n))
    assert _split_cores(s, print) == [[0, 1], [2]]
    assert affinity["mine"] == [3, 4] and affinity["threads"] <= 2
    with pytest.raises(ValueError, match="leaves the trainer no CPU core"):
        _split_cores(load_config(None, ["--sampling.sampler=vllm", "--sampling.placement=decoupled",
                                        "--sampling.server_devices=0-4"]).sampling, print)  # fmt: skip
    with pytest.raises(ValueError, match="not this process's"):
        _split_cores(load_config(None, ["--sampling.sampler=vllm", "--sampling.placement=decoupled",
                                        "--sampling.server_devices=7"]).sampling, print)  # fmt: skip


def test_the_example_decoupled_config_loads_and_the_overlap_model_adds_up():
    from benchmarks.trainer.decoupled_overlap import predict, summarize
    from grpo_kernels.train.config.io import load_config

    s = load_config(os.path.join(os.path.dirname(__file__), "..", "examples", "train_tiny_decoupled_cpu.toml")).sampling
    assert (s.placement, s.sampler, s.max_staleness, s.servers) == ("decoupled", "vllm", 1, 2)
    rows = [{"elapsed_s": 1.5 * i, "rollout_generate_s": 1.0, "rollout_wait_s": 0.0, "train_step_s": 0.5,
             "weight_sync_s": 0.1, "rollout_staleness": 1} for i in range(1, 8)]  # fmt: skip
    times = summarize(rows)
    assert times["step_s"] == pytest.approx(1.5) and times["staleness"] == 1
    model = predict(times)
    assert model["sync_step_s"] == pytest.approx(1.5) and model["overlap_step_s"] == pytest.approx(1.0)
    assert model["gain"] == pytest.approx(1.5)


def test_rollout_server_command_carries_what_the_trainer_relies_on(monkeypatch):
    from grpo_kernels.train.rollout.server import RolloutServer

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    server = RolloutServer("/m", port=1234, cpus=[0, 1, 2], tensor_parallel_size=2, backend="gloo")
    cmd = server.command()
    for flag in ("--skip-tokenizer-init", "--enable-scale-out", "--enforce-eager", "--no-enable-chunked-prefill"):
        assert flag in cmd  # token ids in and out; /inference/v1/generate; seeded prefills never split on CPU
    assert cmd[cmd.index("--weight-transfer-config") + 1] == '{"backend": "gloo"}'
    assert cmd[cmd.index("--logprobs-mode") + 1] == "raw_logprobs"
    assert cmd[cmd.index("--generation-config") + 1] == "vllm"
    monkeypatch.setenv("LOCAL_RANK", "3")
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    env = server.environment()
    assert env["VLLM_SERVER_DEV_MODE"] == "1" and "LOCAL_RANK" not in env
    assert "VLLM_ENABLE_V1_MULTIPROCESSING" not in env
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "0|1,2"  # one core list per tensor-parallel rank


def test_the_default_transfer_address_is_this_hosts_on_the_route_to_the_servers(monkeypatch):
    """sampling.weight_transfer_address unset: 127.0.0.1 for local servers; else the source address of the route to
    them (127.0.0.2 routes from 127.0.0.1 on Linux; the host name, which may map to 127.0.1.1 or "localhost", is
    never asked). Servers behind different addresses of this host, or none reachable: one line naming the option.
    (Across real interfaces: tests/test_multihost.py, which leaves the option unset.)"""
    from grpo_kernels.train.rollout import decoupled

    monkeypatch.setattr("socket.getfqdn", lambda *a: pytest.fail("the host name was asked"))
    assert decoupled._default_address(["http://127.0.0.1:8000", "http://localhost:9"]) == "127.0.0.1"
    assert decoupled._default_address(["http://127.0.0.2:8000"]) == "127.0.0.1"
    with pytest.raises(ValueError, match=r"no route from this host to the rollout server '999.1.1.1' .*set "
                                         r"sampling.weight_transfer_address"):  # fmt: skip
        decoupled._default_address(["http://999.1.1.1:8000"])
    monkeypatch.setattr(decoupled, "route_address", lambda host, port: {"a": "10.0.0.2", "b": "10.1.0.2"}[host])
    assert decoupled._default_address(["http://a:1", "http://a:2"]) == "10.0.0.2"
    with pytest.raises(ValueError, match=r"different addresses of this host \(10.0.0.2 for http://a:1; 10.1.0.2 for "
                                         r"http://b:2\): set sampling.weight_transfer_address"):  # fmt: skip
        decoupled._default_address(["http://a:1", "http://b:2"])

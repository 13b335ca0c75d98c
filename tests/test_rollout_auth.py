"""Rollout servers closed by default (grpo_kernels.train.rollout.auth): the key guard in front of every route of
vLLM's real API server, `serve-rollout`'s host and key options, the key of the servers the trainer starts, and the
client's `Authorization: Bearer` header, its refused-key line and its response limit.

The guard is checked on vLLM's own FastAPI app, built in this process from the very command serve-rollout runs, with a
stub engine behind it (an answer with the key shows the route is live; without it the engine is never reached): no
model, no engine start. A real served model with a key is in tests/test_decoupled_served.py."""

import asyncio
import contextlib
import http.server
import json
import shlex
import threading
import time
from types import SimpleNamespace

import pytest
import torch

KEY = "test-key-3f9a"
KEY_ENV = "GRPO_KERNELS_API_KEY"  # (spelled out: the module that defines it is new)


# ------------------------------------------------------------------------------------------- vLLM's app, in process
class StubEngine:
    """vLLM's engine client as the API routes call it: records every call; update_weights does what a server's
    worker does with the request (the gloo engine's receive: buffers sized from the request's shapes)."""

    def __init__(self):
        self.calls = []

    def __getattr__(self, name):
        async def call(*args, **kwargs):
            self.calls.append(name)
            if name == "update_weights":
                from grpo_kernels.train.rollout.weight_transfer import GlooWeightTransferEngine

                worker = object.__new__(GlooWeightTransferEngine)  # (no model, no group: the allocation comes first)
                worker.group, worker.device, worker.model = object(), torch.device("cpu"), None
                worker.update_weights(kwargs["request"].update_info)
            return {"ok": True} if name == "check_health" else None

        return call


def _vllm_app(command: list[str], monkeypatch):
    """vLLM's FastAPI app as `command` (a rollout server's `python -m vllm.entrypoints.openai.api_server ...`) would
    build it, its RL routes on (VLLM_SERVER_DEV_MODE, as the server's environment has it), a StubEngine behind."""
    pytest.importorskip("vllm")
    import vllm.envs
    from vllm.entrypoints.launchers.app import build_app
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    monkeypatch.setenv("VLLM_SERVER_DEV_MODE", "1")
    if hasattr(vllm.envs, "disable_envs_cache"):  # (an engine started earlier in this process caches them)
        vllm.envs.disable_envs_cache()
    args = make_arg_parser(FlexibleArgumentParser()).parse_args(command[command.index("-m") + 2 :])
    app = build_app(args, ("generate",))
    app.state.engine_client = StubEngine()
    return app


@contextlib.contextmanager
def _uvicorn(app):
    """`app` served on a free loopback port in a thread (lifespan off: no engine to start); yields the URL."""
    import uvicorn

    from grpo_kernels.train.rollout.server import free_port

    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="error", lifespan="off"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(10)


def _post(url, path, body=None, key=None):
    """(status, body text) of a POST without the client under test (no key unless given)."""
    import urllib.error
    import urllib.request

    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
    request = urllib.request.Request(f"{url}/{path}", data=json.dumps(body or {}).encode(), headers=headers,
                                     method="POST")  # fmt: skip
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


HUGE = {"update_info": {"names": ["model.embed_tokens.weight"], "dtype_names": ["float32"], "shapes": [[2**40]],
                        "bucket_bytes": 1 << 20}}  # fmt: skip  4 TiB, as a stranger could ask
DEV_ROUTES = [("update_weights", HUGE),
              ("init_weight_transfer_engine", {"init_info": {"master_address": "203.0.113.9", "master_port": 1,
                                                             "rank_offset": 1, "world_size": 2}}),
              ("collective_rpc", {"method": "grpo_set_temperature", "args": ["1e-9"]}),
              ("sleep", None), ("pause", None), ("start_weight_update", None), ("metrics", None)]  # fmt: skip


@pytest.mark.slow
def test_serve_rollout_guards_every_route_an_unauthenticated_weight_update_never_reaches_allocation(
        tmp_path, monkeypatch, capsys):  # fmt: skip
    """The command `serve-rollout --host 0.0.0.0` runs (key in GRPO_KERNELS_API_KEY), as vLLM builds its app: the
    weight-transfer and development routes answer 401 without the key or with a wrong one, and the engine is never
    reached; `torch.empty`, patched to record the request instead of allocating, sees no 4 TiB buffer. With the key
    the same request does reach the allocation (the route is live: the 401 is the guard's)."""
    from grpo_kernels.cli import main

    monkeypatch.setenv(KEY_ENV, KEY)
    main(["serve-rollout", str(tmp_path / "model"), "--host", "0.0.0.0", "--print-command"])
    command = shlex.split(capsys.readouterr().out)
    assert KEY not in " ".join(command)  # the key never on the command line
    app = _vllm_app(command, monkeypatch)
    from starlette.testclient import TestClient

    asked = []

    def empty(*size, **kwargs):  # the worker's allocation, recorded instead of made
        asked.append(size)
        raise MemoryError(f"asked for {size}")

    client = TestClient(app, raise_server_exceptions=False)
    with monkeypatch.context() as patch:
        patch.setattr(torch, "empty", empty)
        for headers in ({}, {"Authorization": "Bearer wrong-key"}, {"Authorization": f"Basic {KEY}"}):
            for route, body in DEV_ROUTES:
                answer = client.post(f"/{route}", json=body, headers=headers)
                assert answer.status_code == 401, (route, headers, answer.status_code, answer.text[:200])
        assert client.get("/metrics").status_code == 401 and client.get("/v1/models").status_code == 401
        assert app.state.engine_client.calls == [] and asked == [], (app.state.engine_client.calls, asked)
        assert client.get("/health").status_code == 200  # the liveness probe stays open
        assert client.post("/update_weights", json=HUGE, headers={"Authorization": f"Bearer {KEY}"}).status_code \
            == 500  # fmt: skip
    assert asked == [(2**40 * 4,)], asked  # with the key the request is the worker's: the guard is what stopped it


@pytest.mark.slow
def test_client_key_passes_vllms_own_api_key_check_which_leaves_the_weight_routes_open(monkeypatch):
    """vLLM's own --api-key (VLLM_API_KEY; what serve-rollout passes on) guards /v1 and /inference, the route
    rollouts are sampled from: ServerClient's Bearer header passes it (a real request over HTTP to vLLM's app and
    its own AuthenticationMiddleware), no key or a wrong one is one line naming the server. It does not guard
    /update_weights: that is why the servers carry the grpo-kernels guard."""
    from grpo_kernels.train.rollout.server import RolloutServer, RolloutServerError, ServerClient

    monkeypatch.setenv("VLLM_API_KEY", KEY)
    monkeypatch.delenv(KEY_ENV, raising=False)
    app = _vllm_app(RolloutServer("/m", port=1).command(), monkeypatch)  # no grpo-kernels key: vLLM's check alone
    from vllm.entrypoints.scale_out.token_in_token_out.protocol import GenerateTokensResponse

    served = []

    async def serve_tokens(request, raw_request):
        served.append(list(request.token_ids))
        return GenerateTokensResponse(choices=[{"index": 0, "token_ids": [7, 8], "finish_reason": "stop"}])

    app.state.serving_tokens = SimpleNamespace(serve_tokens=serve_tokens)
    body = {"token_ids": [1, 2, 3], "sampling_params": {"max_tokens": 2}}
    with _uvicorn(app) as url:
        out = ServerClient(url, api_key=KEY).post("inference/v1/generate", body)
        assert out["choices"][0]["token_ids"] == [7, 8] and served == [[1, 2, 3]]
        for key, says in ((None, "wants an API key"), ("wrong-key", "refused the API key")):
            with pytest.raises(RolloutServerError) as info:
                ServerClient(url, api_key=key).post("inference/v1/generate", body)
            message = str(info.value)
            assert message.startswith(f"rollout server {url} {says}") and "\n" not in message, message
            assert "wrong-key" not in message
        assert served == [[1, 2, 3]]
        assert _post(url, "start_weight_update")[0] == 200  # vLLM's own key leaves the weight routes open
    assert app.state.engine_client.calls == ["start_weight_update"]


# ---------------------------------------------------------------------------------------------- the guard itself
def _asgi(guard, scope):
    """The messages the guard (over an app that answers 200 "inner") sends for one request scope."""
    sent = []

    async def send(message):
        sent.append(message)

    async def receive():
        return {"type": "http.request", "body": b"", "more_body": False}

    asyncio.run(guard(scope, receive, send))
    return sent


def _http(path, authorization=None, kind="http"):
    headers = [(b"host", b"x")] + ([(b"authorization", authorization.encode())] if authorization else [])
    return {"type": kind, "path": path, "root_path": "", "method": "POST", "headers": headers}


def test_key_guard_answers_401_before_any_route_and_compares_in_constant_time(monkeypatch):
    from grpo_kernels.train.rollout import auth

    async def inner(scope, receive, send):
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"inner"})

    monkeypatch.delenv(KEY_ENV, raising=False)
    with pytest.raises(RuntimeError, match=f"{KEY_ENV}; it is not set"):  # a guard without a key: no start
        auth.KeyGuard(inner)
    monkeypatch.setenv(KEY_ENV, KEY)
    guard = auth.KeyGuard(inner)
    compared = []
    real = auth.hmac.compare_digest
    monkeypatch.setattr(auth.hmac, "compare_digest", lambda a, b: compared.append((a, b)) or real(a, b))
    for authorization in (None, "Bearer", "Bearer wrong", f"Basic {KEY}", f"Bearer {KEY}x", f"Bearer {KEY[:-1]}"):
        sent = _asgi(guard, _http("/update_weights", authorization))
        assert sent[0]["status"] == 401 and (b"www-authenticate", b"Bearer") in sent[0]["headers"], authorization
        assert b"inner" not in sent[1]["body"] and KEY.encode() not in sent[1]["body"]
    assert compared and all(len(a) == len(b) == 32 for a, b in compared)  # digests: equal lengths whatever the key
    for authorization in (f"Bearer {KEY}", f"bearer  {KEY} "):
        assert _asgi(guard, _http("/update_weights", authorization))[0]["status"] == 200
    assert _asgi(guard, _http("/health"))[0]["status"] == 200  # the one open route
    assert _asgi(guard, _http("/health/"))[0]["status"] == 401
    assert _asgi(guard, {**_http("/x/health"), "root_path": "/x"})[0]["status"] == 200
    assert _asgi(guard, _http("/stream", kind="websocket")) == [{"type": "websocket.close", "code": 1008}]
    assert _asgi(guard, {"type": "lifespan"})[0]["status"] == 200  # (start-up events pass)


# --------------------------------------------------------------------------------------------- serve-rollout's options
def _serve(argv, monkeypatch, capsys, key=None):
    """(printed command or None, one-line error or None, stderr) of `serve-rollout ... --print-command`."""
    from grpo_kernels.cli import main

    if key is None:
        monkeypatch.delenv(KEY_ENV, raising=False)
    else:
        monkeypatch.setenv(KEY_ENV, key)
    try:
        main(["serve-rollout", "/m", *argv, "--print-command"])
    except SystemExit as exc:
        return None, str(exc), capsys.readouterr().err
    captured = capsys.readouterr()
    return captured.out, None, captured.err


def test_serve_rollout_listens_on_loopback_by_default_and_refuses_a_public_host_without_a_key(
        tmp_path, monkeypatch, capsys):  # fmt: skip
    out, error, err = _serve([], monkeypatch, capsys)
    assert error is None and "--host 127.0.0.1" in out, (out, error)
    assert "--middleware" not in out and "every user of this machine can drive the server" in err  # open: said
    for host in ("0.0.0.0", "10.1.2.3", "::", "node7.example"):
        out, error, _ = _serve(["--host", host], monkeypatch, capsys)
        assert out is None and error.startswith(f"grpo-kernels serve-rollout: error: --host {host} is not a "
                                                "loopback address and no key is given"), error  # fmt: skip
        assert "\n" not in error and "--api-key-file" in error
    out, error, _ = _serve(["--host", "0.0.0.0"], monkeypatch, capsys, key=KEY)
    assert error is None and "--middleware grpo_kernels.train.rollout.auth.KeyGuard" in out and KEY not in out
    assert out.startswith(f"{KEY_ENV}=${KEY_ENV} ")


def test_serve_rollout_key_file_missing_empty_or_readable_by_others(tmp_path, monkeypatch, capsys):
    missing, empty, shared, private = (tmp_path / n for n in ("missing", "empty", "shared", "private"))
    empty.write_text(" \n")
    for path, text in ((missing, f"--api-key-file {missing}: no such file"),
                       (empty, f"--api-key-file {empty} is empty: write the server's key in it")):  # fmt: skip
        out, error, _ = _serve(["--host", "0.0.0.0", "--api-key-file", str(path)], monkeypatch, capsys)
        assert out is None and error == f"grpo-kernels serve-rollout: error: {text}", error
    shared.write_text(KEY + "\n")
    shared.chmod(0o644)
    out, error, err = _serve(["--host", "0.0.0.0", "--api-key-file", str(shared)], monkeypatch, capsys)
    assert error is None and f"--api-key-file {shared} is accessible by group or others (mode 0644)" in err
    assert len(err.strip().splitlines()) == 1 and KEY not in out + err
    assert f'{KEY_ENV}="$(cat {shared})" ' in out and "--middleware" in out
    private.write_text(KEY)
    private.chmod(0o600)
    out, error, err = _serve(["--host", "0.0.0.0", "--api-key-file", str(private)], monkeypatch, capsys)
    assert error is None and err == ""
    out, error, _ = _serve(["--api-key-file", str(private)], monkeypatch, capsys, key="other")
    assert error.endswith(f"--api-key-file and {KEY_ENV} are both set: give the key one way")
    private.write_text("clé\n", encoding="utf-8")
    out, error, _ = _serve(["--api-key-file", str(private)], monkeypatch, capsys)
    assert error.endswith(f"--api-key-file {private}: the key must be printable ASCII (it travels in an HTTP header)")


def test_the_server_environment_carries_the_key_and_drops_a_stray_vllm_api_key(monkeypatch):
    from grpo_kernels.train.rollout.server import RolloutServer

    monkeypatch.setenv("VLLM_API_KEY", "stray")
    monkeypatch.setenv(KEY_ENV, "the-trainer-users-own")
    server = RolloutServer("/m", port=1, api_key=KEY)
    env, command = server.environment(), server.command()
    assert "VLLM_API_KEY" not in env  # it would refuse the trainer's every generate (it sends its own key)
    assert env[KEY_ENV] == KEY and KEY not in " ".join(command)
    assert command[command.index("--middleware") + 1] == "grpo_kernels.train.rollout.auth.KeyGuard"
    assert RolloutServer("/m", port=1, api_key=KEY, inherit_vllm_api_key=True).environment()["VLLM_API_KEY"] == "stray"
    unkeyed = RolloutServer("/m", port=1)
    assert KEY_ENV not in unkeyed.environment() and "--middleware" not in unkeyed.command()


# ------------------------------------------------------------------------------- the servers the trainer starts
def _open_decoupled(monkeypatch, overrides):
    """Decoupled.open on rank 0 with the servers built but not launched: (started servers, clients)."""
    from grpo_kernels.train.config.io import load_config
    from grpo_kernels.train.rollout import decoupled

    config = load_config(None, ["--sampling.sampler=vllm", "--sampling.placement=decoupled", *overrides])
    monkeypatch.setattr(decoupled, "hf_weight_names", lambda model: set())  # (a stand-in model)
    monkeypatch.setattr(decoupled, "write_engine_config", lambda model, path: path)
    monkeypatch.setattr(decoupled, "_launch", lambda servers, at_once: None)
    monkeypatch.setattr(decoupled, "_split_cores", lambda s, log: [[0]] * s.servers)
    monkeypatch.setattr(decoupled, "ServerSampler", lambda clients, **kwargs: SimpleNamespace(clients=clients))
    example = SimpleNamespace(prompt="1+1", answer="2")
    tok = SimpleNamespace(eos_id=0, stop_ids=(), encode_prompt=lambda p: [1], encode=lambda a, eos: [2])
    inputs = SimpleNamespace(tok=tok, train_set=[example], rewards=None, eval_set=[])
    model = SimpleNamespace(generation_config=SimpleNamespace(max_length=32), config=SimpleNamespace(vocab_size=64))
    d = SimpleNamespace(is_main=True, rank=0, world=1, distributed=False)
    opened = decoupled.Decoupled.open(config, model, inputs, d, "/nonexistent-run", lambda line: None)
    return opened.started, opened.clients


def test_servers_the_trainer_starts_get_a_fresh_key_per_run_and_never_the_trainers_vllm_api_key(monkeypatch):
    monkeypatch.setenv("VLLM_API_KEY", "stray")
    monkeypatch.setenv(KEY_ENV, "the-users-serve-rollout-key")
    keys = []
    for _ in range(2):
        started, clients = _open_decoupled(monkeypatch, ["--sampling.servers=2"])
        envs = [s.environment() for s in started]
        assert all("VLLM_API_KEY" not in e for e in envs)
        key = envs[0][KEY_ENV]
        assert len(key) >= 32 and key != "the-users-serve-rollout-key" and envs[1][KEY_ENV] == key
        assert all("--middleware" in s.command() and key not in " ".join(s.command()) for s in started)
        assert [c._headers["Authorization"] for c in clients] == [f"Bearer {key}"] * 2
        keys.append(key)
    assert keys[0] != keys[1]  # per run
    # Asked: the key in the variable sampling.server_api_key_env names; VLLM_API_KEY passes when it is that one.
    started, clients = _open_decoupled(monkeypatch, ["--sampling.server_api_key_env=VLLM_API_KEY"])
    env = started[0].environment()
    assert env[KEY_ENV] == env["VLLM_API_KEY"] == "stray" and clients[0]._headers["Authorization"] == "Bearer stray"


def test_the_key_of_server_urls_comes_from_the_variable_the_config_names(monkeypatch):
    from grpo_kernels.train import preflight
    from grpo_kernels.train.config.io import load_config

    monkeypatch.setenv("ROLLOUT_KEY", KEY)
    started, clients = _open_decoupled(monkeypatch, ["--sampling.server_urls=http://127.0.0.1:9,http://h.example:9",
                                                     "--sampling.server_api_key_env=ROLLOUT_KEY"])  # fmt: skip
    assert started == [] and [c._headers["Authorization"] for c in clients] == [f"Bearer {KEY}"] * 2
    assert all(c.max_response_bytes >= 64 << 20 for c in clients)
    assert KEY not in repr(clients)
    _, clients = _open_decoupled(monkeypatch, ["--sampling.server_urls=http://127.0.0.1:9"])
    assert "Authorization" not in clients[0]._headers  # no option: no key sent
    monkeypatch.delenv("ROLLOUT_KEY")
    config = load_config(None, ["--sampling.sampler=vllm", "--sampling.placement=decoupled",
                                "--sampling.server_urls=http://127.0.0.1:9",
                                "--sampling.server_api_key_env=ROLLOUT_KEY"])  # fmt: skip
    with pytest.raises(ValueError) as info:
        preflight.check(config, "cpu")
    assert str(info.value) == ("sampling.server_api_key_env: the environment variable ROLLOUT_KEY is not set (or "
                               "empty): export the rollout servers' key in it before the run starts")  # fmt: skip


# ------------------------------------------------------------------------------------------------------ the client
class _Stub(http.server.BaseHTTPRequestHandler):
    """/ok: 200 {"ok": true}; /deny: 401; /big: 200 with 2,000 bytes; /redirect: 307 to the `other` server."""

    seen, other = [], None

    def _answer(self):
        self.seen.append((self.server.server_port, self.path, self.headers.get("Authorization")))
        if self.path == "/redirect":
            self.send_response(307)
            self.send_header("Location", f"{self.other}/ok")
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        status, body = {"/deny": (401, b'{"error": "Unauthorized"}'), "/big": (200, b'"' + b"x" * 2000 + b'"')}.get(
            self.path, (200, b'{"ok": true}'))  # fmt: skip
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    do_GET = do_POST = _answer

    def log_message(self, *args):
        pass


@contextlib.contextmanager
def _stub_servers(n=2):
    servers = [http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Stub) for _ in range(n)]
    threads = [threading.Thread(target=s.serve_forever, args=(0.05,), daemon=True) for s in servers]
    for t in threads:
        t.start()
    _Stub.seen.clear()
    _Stub.other = f"http://127.0.0.1:{servers[1].server_port}"
    try:
        yield [f"http://127.0.0.1:{s.server_port}" for s in servers]
    finally:
        for s in servers:
            s.shutdown()
            s.server_close()


def test_server_client_sends_the_key_on_every_request_and_a_refused_key_is_one_line_naming_the_server():
    from grpo_kernels.train.rollout.server import RolloutServerError, ServerClient

    with _stub_servers() as (url, other):
        client = ServerClient(url, api_key=KEY, timeout_s=10)
        assert client.get("health") == {"ok": True} and client.post("ok", {"a": 1}) == {"ok": True}
        assert [auth for _, _, auth in _Stub.seen] == [f"Bearer {KEY}"] * 2
        with pytest.raises(RolloutServerError) as info:
            client.post("deny")
        message = str(info.value)
        assert message.startswith(f"rollout server {url} refused the API key (POST /deny answered 401)"), message
        assert "sampling.server_api_key_env" in message and KEY not in message and "\n" not in message
        with pytest.raises(RolloutServerError, match=f"rollout server {url} wants an API key .* none was sent"):
            ServerClient(url, timeout_s=10).get("deny")
        _Stub.seen.clear()
        with pytest.raises(RolloutServerError, match=f"rollout server {url}: GET /redirect answered 307"):
            client.get("redirect")  # not followed: the key would go wherever a server points
        assert [port for port, _, _ in _Stub.seen] == [int(url.rsplit(":", 1)[1])]


def test_a_server_answer_over_the_size_limit_is_refused_naming_the_server():
    from grpo_kernels.train.rollout.server import MIN_RESPONSE_BYTES, RolloutServerError, ServerClient, response_limit

    with _stub_servers() as (url, _):
        assert ServerClient(url, max_response_bytes=2002).get("big") == "x" * 2000  # at the limit: read
        with pytest.raises(RolloutServerError) as info:
            ServerClient(url, max_response_bytes=2001).get("big")
        assert str(info.value).startswith(f"rollout server {url}: GET /big answered more than"), str(info.value)
    assert ServerClient("http://h:1").max_response_bytes == MIN_RESPONSE_BYTES == 64 << 20
    assert response_limit(10) == MIN_RESPONSE_BYTES and response_limit(64 * 9000) > 512 << 20  # grows with requests


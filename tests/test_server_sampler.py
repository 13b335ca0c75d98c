"""ServerSampler against stub rollout servers (http.server in a thread, answering vLLM's routes with vLLM-shaped JSON):
a server paused or put to sleep by someone else, a wedged one, and answers the trainer cannot use, each named in one
line within seconds. No vLLM: the real servers are in tests/test_decoupled.py and tests/test_decoupled_served.py."""

import json
import math
import random
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch

from grpo_kernels.train.rollout.server import RolloutServerError, ServerClient
from grpo_kernels.train.rollout.server_sampler import ServerSampler

VOCAB, EOS, MAX_NEW, G = 50, 2, 6, 4
PROMPTS = [[5, 6, 7], [8, 9], [10, 11, 12, 13], [14]]
SEEDS = [11, 22, 33, 44]


def _completions(body: dict) -> dict:
    """A generate answer that depends on the request alone (its prompt, n, max_tokens and seed), as a seeded vLLM
    request's does: any server answers a request with the same completions."""
    prompt, p = body["token_ids"], body["sampling_params"]
    if p.get("prompt_logprobs") is not None:  # sequence_logprobs: score the prompt
        rng = random.Random(str(prompt))
        scored = [None] + [{str(t): {"logprob": -rng.random(), "rank": 1, "decoded_token": None}} for t in prompt[1:]]
        return {"choices": [{"index": 0, "token_ids": [3], "finish_reason": "length"}], "prompt_logprobs": scored}
    choices = []
    for j in range(p["n"]):
        rng = random.Random(f"{p['seed']}/{j}/{prompt}")
        ids = [rng.randrange(3, VOCAB) for _ in range(rng.randint(1, p["max_tokens"]))]
        stop = len(ids) < p["max_tokens"]
        if stop:
            ids[-1] = p["stop_token_ids"][0]
        content = [{"token_id": t, "logprob": -4 * rng.random(), "rank": 1, "top_logprobs": []} for t in ids]
        choices.append({"index": j, "token_ids": ids, "finish_reason": "stop" if stop else "length",
                        "logprobs": {"content": content},
                        "weight_versions": [{"version": "3", "start": 0, "end": len(ids)}]})  # fmt: skip
    return {"request_id": "stub", "choices": choices}


class Stub:
    """One rollout server: /health, /is_paused, /is_sleeping, /pause, /resume, /reset_prefix_cache, /collective_rpc
    and /inference/v1/generate. A generate request waits while the server is paused, asleep or wedged (as vLLM's
    does while paused), until that ends or the stub closes; `edit` rewrites an answer before it is sent."""

    def __init__(self):
        self.paused = self.sleeping = self.wedged = False
        self.edit, self.generated, self.closing = None, [], threading.Event()
        stub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def _send(self, answer):
                data = b"" if answer is None else json.dumps(answer).encode()  # (NaN as JSON's NaN, as Python reads)
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):
                route = self.path.strip("/")
                states = {"is_paused": stub.paused, "is_sleeping": stub.sleeping}
                self._send({route: states[route]} if route in states else None)  # (/health: an empty 200)

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)) or b"null")
                route = self.path.strip("/").split("?")[0]
                if route == "collective_rpc":
                    return self._send({"results": [True]})
                if route in ("pause", "resume"):
                    stub.paused = route == "pause"
                    return self._send({"status": route})
                if route != "inference/v1/generate":
                    return self._send({})
                stub.generated.append(body)
                while (stub.paused or stub.sleeping or stub.wedged) and not stub.closing.wait(0.02):
                    pass
                answer = _completions(body)
                self._send(stub.edit(answer) if stub.edit else answer)

        self.http = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.http.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.http.server_address[1]}"
        threading.Thread(target=self.http.serve_forever, args=(0.05,), daemon=True).start()

    def close(self):
        self.closing.set()
        self.http.shutdown()
        self.http.server_close()


@pytest.fixture
def stubs():
    made = []

    def make(n):
        made.extend(Stub() for _ in range(n))
        return made[-n:]

    yield make
    for stub in made:
        stub.close()


def _sampler(servers, **kwargs):
    kwargs = {"health_every_s": 0.3, "min_tokens_per_s": 1000.0, "allowance_s": 1.0, "vocab_size": VOCAB, **kwargs}
    return ServerSampler([ServerClient(s.url, timeout_s=5) for s in servers], eos_id=EOS, max_new_tokens=MAX_NEW,
                         **kwargs)  # fmt: skip


def _sample(sampler):
    r = sampler.sample(PROMPTS, G, seeds=SEEDS)
    return ([p.tolist() for p in r.prompt_ids], [c.tolist() for c in r.completion_ids],
            [x.tolist() for x in r.sampler_logps], r.truncated)  # fmt: skip


def _in_thread(call, timeout_s: float):
    """call() in a daemon thread: (its result or exception, seconds taken); fails when it has not returned within
    timeout_s (a hung sampler must fail the test, not hang it)."""
    out, start = {}, time.monotonic()

    def run():
        try:
            out["value"] = call()
        except BaseException as exc:  # noqa: BLE001
            out["value"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(timeout_s)
    assert not thread.is_alive(), f"the sampler did not return within {timeout_s:.0f} s"
    return out["value"], time.monotonic() - start


def _one_line_naming(error, url: str, *words):
    assert isinstance(error, RolloutServerError), repr(error)
    text = str(error)
    assert "\n" not in text and url in text and all(w in text for w in words), text


@pytest.mark.parametrize("state", ["paused", "sleeping"])
def test_a_server_paused_or_asleep_by_someone_else_stops_the_sampler_within_seconds_naming_it(stubs, state):
    """A paused engine answers /health and holds every generate request until /resume: the sampler used to wait
    24 h. Now a server with requests in flight is asked /is_paused and /is_sleeping every
    health_every_s (0.3 s here): one line naming it and its state, within seconds. The trainer's own pause (around a
    weight sync) is not flagged: a call made while it holds lasts until `resume`, then returns its completions."""
    (stub,) = stubs(1)
    sampler = _sampler([stub], allowance_s=60.0)  # the deadline is not what stops it
    healthy = _sample(sampler)
    sampler.pause()
    threading.Timer(1.5, sampler.resume).start()
    during_own_pause, seconds = _in_thread(lambda: _sample(sampler), 10)
    assert during_own_pause == healthy and seconds >= 1.4
    assert not stub.paused
    setattr(stub, state, True)  # someone else's POST /pause (mode "keep") or /sleep
    error, seconds = _in_thread(lambda: _sample(sampler), 10)
    _one_line_naming(error, stub.url, f"is {state}", "/resume" if state == "paused" else "/wake_up")
    assert seconds < 5


def test_a_wedged_server_of_two_has_its_groups_sampled_again_on_the_other_with_the_same_completions(stubs):
    """Server 0 answers /health but never a generate request: past the deadline (allowance 1 s + its tokens at
    1000 tokens/s) its groups go to server 1 with the same bodies, seeds included, so the rollout equals the
    all-healthy one; its late answers (after it is released) do not reach the results."""
    a, b = stubs(2)
    sampler = _sampler([a, b])
    healthy = _sample(sampler)
    assert len(a.generated) == len(b.generated) == 2
    a.wedged = True
    retried, seconds = _in_thread(lambda: _sample(sampler), 15)
    assert retried == healthy, retried
    assert 1.0 <= seconds < 6
    seeds_on_a = sorted(r["sampling_params"]["seed"] for r in a.generated[2:])
    moved = b.generated[4:]  # (after its two of the first call and its own two of this one)
    assert sorted(r["sampling_params"]["seed"] for r in moved) == seeds_on_a  # the seeds moved with their groups
    a.wedged = False  # its held requests answer now, to a call that gave them up
    time.sleep(0.3)
    assert _sample(sampler) == healthy


@pytest.mark.parametrize("servers", [1, 2])
def test_a_wedged_server_with_no_other_to_take_its_groups_stops_the_sampler_at_its_deadline_naming_it(stubs, servers):
    """One server, or every server wedged: one line naming a wedged server, at the deadline, not 24 h later. The
    deadline is the allowance (1 s) + the tokens the server was given (prompt + max_tokens x n of each request: 106
    for the four groups on one server) at 1000 tokens/s; a retry gets its own on the server it moves to."""
    made = stubs(servers)
    sampler = _sampler(made)
    for stub in made:
        stub.wedged = True
    error, seconds = _in_thread(lambda: _sample(sampler), 15)
    if servers == 1:
        tokens = sum(len(p) for p in PROMPTS) + len(PROMPTS) * MAX_NEW * G
        _one_line_naming(error, made[0].url, "wedged", f"deadline of 1.1 s (1 s + {tokens} tokens at 1000 tokens/s",
                         "server_min_tokens_per_s")  # fmt: skip
        assert 1.1 <= seconds < 5
    else:
        _one_line_naming(error, "rollout server http://127.0.0.1:", "wedged", "the other servers are wedged too")
        assert 1.0 <= seconds < 6


def _nan_logprob(answer):
    answer["choices"][1]["logprobs"]["content"][0]["logprob"] = math.nan
    return answer


def _inf_logprob(answer):
    answer["choices"][0]["logprobs"]["content"][-1]["logprob"] = -math.inf
    return answer


def _too_long(answer):
    choice = answer["choices"][0]
    choice["token_ids"] += [4] * MAX_NEW
    choice["logprobs"]["content"] += [{"token_id": 4, "logprob": -1.0}] * MAX_NEW
    return answer


def _logprob_missing(answer):
    answer["choices"][2]["logprobs"]["content"].pop()
    return answer


def _out_of_vocab(answer):
    answer["choices"][0]["token_ids"][0] = answer["choices"][0]["logprobs"]["content"][0]["token_id"] = VOCAB
    return answer


def _version(value):
    def edit(answer):
        answer["choices"][0]["weight_versions"][0]["version"] = value
        return answer

    return edit


def _choices_missing(answer):
    answer["choices"].pop()
    return answer


def _aborted(answer):
    answer["choices"][0]["finish_reason"] = "abort"
    return answer


def _not_vllm(answer):
    del answer["choices"][0]["token_ids"]
    return answer


@pytest.mark.parametrize("edit, words", [
    (_nan_logprob, ["nan", "not finite"]), (_inf_logprob, ["-inf", "not finite"]),
    (_too_long, ["more than the 6 asked for"]), (_logprob_missing, ["log-probs for a completion of"]),
    (_out_of_vocab, [f"token id {VOCAB}", f"[0, {VOCAB})"]), (_version("1.5"), ["'1.5'", "integer"]),
    (_version(2.0), ["2.0", "integer"]), (_version("latest"), ["'latest'"]), (_choices_missing, ["4 completions"]),
    (_aborted, ["'abort'"]), (_not_vllm, ["not a vLLM generate answer", "token_ids"]),
], ids=["nan", "inf", "too_long", "logprob_missing", "out_of_vocab", "version_1.5", "version_float", "version_word",
        "choice_missing", "aborted", "not_vllm"])  # fmt: skip
def test_answers_the_trainer_cannot_use_are_refused_in_one_line_naming_the_server(stubs, edit, words):
    """NaN or infinite log-probs, a completion longer than max_new_tokens, log-probs of another count than the
    tokens, an id outside the vocabulary, a weight version that is not an integer (nor "default"), missing
    completions, an aborted one, a field missing: refused naming the server (the sampler used to take the first
    three, an aborted completion and a float version as they came)."""
    a, b = stubs(2)
    sampler = _sampler([a, b])
    b.edit = edit
    with pytest.raises(RolloutServerError) as caught:
        sampler.sample(PROMPTS, G, seeds=SEEDS)
    _one_line_naming(caught.value, b.url, *words)


def test_default_is_vllms_initial_version_and_non_finite_prompt_logprobs_are_refused(stubs):
    """vLLM's "default" (weights as loaded, before the first sync) is version -1; sequence_logprobs refuses a NaN
    prompt log-prob naming the server, and is never moved to another server (it checks that server's weights)."""
    a, b = stubs(2)
    sampler = _sampler([a, b])
    b.edit = _version("default")
    sampler.sample(PROMPTS, G, seeds=SEEDS)
    assert sampler.versions == {-1, 3}
    b.edit = None
    logps = sampler.sequence_logprobs([5, 6], [7, 8, 9], server=1)
    assert logps.shape == (3,) and bool(torch.isfinite(logps).all())

    def nan_prompt(answer):
        answer["prompt_logprobs"][-1]["9"]["logprob"] = math.nan
        return answer

    b.edit = nan_prompt
    with pytest.raises(RolloutServerError) as caught:
        sampler.sequence_logprobs([5, 6], [7, 8, 9], server=1)
    _one_line_naming(caught.value, b.url, "prompt token", "not finite")
    b.edit, b.wedged = None, True
    error, _ = _in_thread(lambda: sampler.sequence_logprobs([5, 6], [7, 8, 9], server=1), 10)
    _one_line_naming(error, b.url, "wedged")


def test_the_trainer_builds_its_sampler_with_the_floor_rate_its_timeout_and_the_models_vocabulary(monkeypatch):
    """sampling.server_min_tokens_per_s (refused at load unless > 0) and server_timeout_s (the allowance) reach the
    trainer's ServerSampler, with the model's vocab_size for the token-id check."""
    from types import SimpleNamespace

    from grpo_kernels.train.config.io import load_config
    from grpo_kernels.train.rollout import decoupled

    with pytest.raises(ValueError, match=r"sampling.server_min_tokens_per_s must be > 0, got 0.0"):
        load_config(None, ["--sampling.server_min_tokens_per_s=0"])
    config = load_config(None, ["--sampling.sampler=vllm", "--sampling.placement=decoupled",
                                "--sampling.server_urls=http://127.0.0.1:9", "--sampling.server_min_tokens_per_s=123",
                                "--sampling.server_timeout_s=7"])  # fmt: skip
    built = {}
    monkeypatch.setattr(decoupled, "hf_weight_names", lambda model: set())  # (a stand-in model)
    monkeypatch.setattr(decoupled, "write_engine_config", lambda model, path: path)
    monkeypatch.setattr(decoupled, "ServerSampler", lambda clients, **kwargs: built.update(kwargs))
    tok = SimpleNamespace(eos_id=0, stop_ids=(), encode_prompt=lambda p: [1], encode=lambda a, eos: [2])
    inputs = SimpleNamespace(tok=tok, train_set=[SimpleNamespace(prompt="1+1", answer="2")], rewards=None,
                             eval_set=[])  # fmt: skip
    model = SimpleNamespace(generation_config=SimpleNamespace(max_length=32), config=SimpleNamespace(vocab_size=64))
    d = SimpleNamespace(is_main=True, rank=0, world=1, distributed=False)
    decoupled.Decoupled.open(config, model, inputs, d, "/nonexistent-run", lambda line: None)
    assert (built["min_tokens_per_s"], built["allowance_s"], built["vocab_size"]) == (123.0, 7.0, 64)


STUB_SERVER = """
import subprocess, sys
from http.server import BaseHTTPRequestHandler, HTTPServer

class Health(BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200); self.end_headers()

    def log_message(self, *args):
        pass

engine = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])  # in the group, as vLLM's engine
HTTPServer(("127.0.0.1", int(sys.argv[1])), Health).serve_forever()
"""


def test_a_started_server_stopped_by_sigstop_goes_down_at_once_and_a_dead_one_is_named_with_its_code(tmp_path):
    """The trainer's RolloutServer around a stand-in process group (an HTTP /health and one engine child; the real
    servers are in tests/test_decoupled.py). SIGSTOP'd, the group leaves within seconds of stop(), not at the
    SIGKILL after its timeout: a stopped process acts on SIGTERM only once continued. SIGKILL'd, the next request
    names the server and its exit code."""
    import os
    import signal
    import sys

    from grpo_kernels.train.rollout.server import RolloutServer, _group_alive, free_port

    class StandIn(RolloutServer):
        def command(self):
            return [sys.executable, "-c", STUB_SERVER, str(self.port)]

    stopped = StandIn(tmp_path, port=free_port(), start_timeout_s=60).start()
    os.killpg(stopped.process.pid, signal.SIGSTOP)
    t = time.monotonic()
    stopped.stop(timeout_s=30)
    assert time.monotonic() - t < 10 and not _group_alive(stopped.process.pid)

    dead = StandIn(tmp_path, port=free_port(), start_timeout_s=60).start()
    try:
        dead.process.kill()
        dead.process.wait(10)
        with pytest.raises(RolloutServerError) as caught:
            ServerClient(dead.url, process=dead, timeout_s=5).get("health")
        assert str(caught.value).startswith(f"rollout server {dead.url} exited (code -9)"), caught.value
    finally:
        dead.stop(timeout_s=5)  # its engine child
    assert not _group_alive(dead.process.pid)

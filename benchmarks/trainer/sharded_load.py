"""Sharded loading of a model whose full fp32 copy does not fit one rank's share of the host: each rank's peak
resident memory and time while it reads its shard (grpo_kernels.train.model.sharded_load), on CPU with gloo.

Usage (from the repository root; not part of `make test`):
    .venv/bin/python benchmarks/trainer/sharded_load.py write /tmp/big-model           # random bf16 weights, once
    .venv/bin/torchrun --standalone --nproc_per_node=2 benchmarks/trainer/sharded_load.py load /tmp/big-model
    rm -r /tmp/big-model

`write` makes a Qwen2-shaped config of about --params parameters (default 3.5e9: 14 GB in fp32, 7 GB on disk in
bf16, tied embeddings) and writes random N(0, 0.02) weights in bf16 as safetensors files of at most 2 GB with an
index; it refuses when the disk has less room than that plus 1 GB. `load`: every rank builds the model on the meta
device, wraps it in the trainer's `Policy`, shards it with FSDP2 (`fsdp.shard`, fp32 parameters as the trainer keeps
them) and reads its shard (`load_shards`, which first refuses a shard that does not fit); then checks the first and
last rows it holds of the embedding against the file (read with the safetensors library). Each rank prints one JSON
line: its shard and the full model in GiB, its share of the host's memory (MemTotal / ranks), its resident memory
before loading and its peak while loading (/proc/self/status VmHWM, reset through /proc/self/clear_refs), seconds.
"""

import argparse
import json
import math
import os
import shutil
import sys
import time
from pathlib import Path

import torch


def qwen2_config(params: float):
    """A Qwen2 config of about `params` parameters: Qwen2.5's vocabulary and proportions, layers chosen to fit."""
    from transformers import Qwen2Config

    vocab, hidden, inter, heads, kv = 151936, 2560, 9728, 20, 4
    head_dim = hidden // heads
    per_layer = hidden * (hidden + 2 * kv * head_dim) + (hidden + 2 * kv * head_dim) + hidden * hidden
    per_layer += 3 * hidden * inter + 2 * hidden
    layers = max(1, round((params - vocab * hidden) / per_layer))
    return Qwen2Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
                       num_attention_heads=heads, num_key_value_heads=kv, max_position_embeddings=4096,
                       tie_word_embeddings=True, architectures=["Qwen2ForCausalLM"], dtype="bfloat16")  # fmt: skip


def write(directory: Path, params: float) -> None:
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    from grpo_kernels.train.model.sharded_load import parameters_on_meta

    config = qwen2_config(params)
    with parameters_on_meta():
        model = AutoModelForCausalLM.from_config(config)
    shapes = {name: tuple(p.shape) for name, p in model.named_parameters()}  # (the tied head once)
    total = sum(math.prod(s) for s in shapes.values()) * 2
    directory.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(directory).free
    if free < total + 2**30:
        sys.exit(f"{directory}: {total / 2**30:.1f} GiB to write but {free / 2**30:.1f} GiB free")
    config.save_pretrained(directory)
    generator = torch.Generator().manual_seed(0)
    files, shard, size, weight_map = [], {}, 0, {}

    def flush():
        nonlocal shard, size
        if shard:
            name = f"model-{len(files) + 1:05d}.safetensors"
            save_file(shard, str(directory / name), metadata={"format": "pt"})
            files.append(name)
            weight_map.update(dict.fromkeys(shard, name))
        shard, size = {}, 0

    for name, shape in shapes.items():
        nbytes = math.prod(shape) * 2
        if size and size + nbytes > 2 << 30:
            flush()
        shard[name] = torch.randn(shape, generator=generator).mul_(0.02).to(torch.bfloat16)
        size += nbytes
    flush()
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index, indent=1))
    print(json.dumps({"written": str(directory), "params": total // 2, "bf16_gib": total / 2**30,
                      "fp32_gib": 2 * total / 2**30, "layers": config.num_hidden_layers}))  # fmt: skip


def status_mib(field: str) -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    raise KeyError(field)


def load(directory: Path) -> None:
    from safetensors import safe_open
    from transformers import AutoConfig

    from grpo_kernels.train.model.activation import decoder_blocks
    from grpo_kernels.train.model.fsdp import init_distributed, shard
    from grpo_kernels.train.model.policy import Policy
    from grpo_kernels.train.model.sharded_load import checkpoint_entries, load_shards, meta_model

    d = init_distributed("gloo")
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
    before, start = status_mib("VmRSS"), time.perf_counter()
    config = AutoConfig.from_pretrained(directory, local_files_only=True)
    model = meta_model(directory, config, dtype=torch.float32, attn_implementation="sdpa",
                       dtype_kwarg={"dtype": torch.float32})  # fmt: skip (transformers >= 4.56)
    policy = Policy(model)
    shard(policy, decoder_blocks(model), device=d.device, world=d.world, dtype=torch.float32)
    load_shards([policy], d)
    seconds, peak = time.perf_counter() - start, status_mib("VmHWM")
    embed = model.get_input_embeddings().weight
    local = embed.to_local()
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    _, offset = compute_local_shape_and_global_offset(embed.shape, embed.device_mesh, embed.placements)
    entry = checkpoint_entries(directory)["model.embed_tokens.weight"]
    with safe_open(str(entry.file), framework="pt") as f:
        rows = f.get_slice("model.embed_tokens.weight")
        first, last = rows[offset[0] : offset[0] + 1], rows[offset[0] + local.shape[0] - 1 : offset[0] + local.shape[0]]
    same = torch.equal(local[:1], first.float()) and torch.equal(local[-1:], last.float())
    shard_bytes = sum(p.to_local().numel() * 4 for p in policy.parameters())
    full_bytes = sum(p.numel() * 4 for p in policy.parameters())
    with open("/proc/meminfo") as f:
        total = int(next(line for line in f if line.startswith("MemTotal:")).split()[1]) * 1024
    print(json.dumps({"rank": d.rank, "world": d.world, "shard_gib": round(shard_bytes / 2**30, 2),
                      "full_fp32_gib": round(full_bytes / 2**30, 2),
                      "host_share_gib": round(total / d.world / 2**30, 2), "rss_before_gib": round(before / 1024, 2),
                      "peak_gib": round(peak / 1024, 2), "grown_gib": round((peak - before) / 1024, 2),
                      "load_s": round(seconds, 1), "rows_match_file": same}), flush=True)  # fmt: skip
    torch.distributed.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("action", choices=["write", "load"])
    parser.add_argument("directory", type=Path)
    parser.add_argument("--params", type=float, default=3.5e9, help="write: about how many parameters")
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    write(args.directory, args.params) if args.action == "write" else load(args.directory)


if __name__ == "__main__":
    main()

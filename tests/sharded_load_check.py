"""Sharded loading under torchrun, for tests/test_sharded_load.py, which launches it (every rank writes its results to
OUT/rank<R>.json).

    torchrun --nproc_per_node=N tests/sharded_load_check.py losses OUT -- TRAIN_ARGS...
        # the run twice in one process group: the model loaded whole on every rank then sharded (the loading of a
        # single process), then loaded sharded (each rank reads its shard); run dirs OUT/whole and OUT/sharded;
        # then the sharded run resumed from its step-1 checkpoint in a copy, OUT/resumed (--checkpoint.every=1)
    torchrun --nproc_per_node=N tests/sharded_load_check.py memory OUT -- TRAIN_ARGS...
        # `build` alone, sharded loading: the resident memory when the model starts loading (the tokenizer loaded),
        # its peak once each rank has read its shards (before the packed-attention check's forward) and when build
        # ends (with the HF sampler's full copy); /proc/self/status VmHWM, reset through /proc/self/clear_refs
    torchrun ... memory-whole OUT -- ...   # the same with the whole model loaded on every rank (`from_pretrained`),
        # its peak when the rollouts are made (the model whole on every rank, before the copies and sharding)

A converter that renames the decoder blocks' linear layers ("sharded_check_wrap", as tests/test_model_converters.py's)
is registered here (the embeddings left trainable), so a run may name it.
"""

import contextlib
import json
import shutil
import sys
from pathlib import Path

import torch
from test_model_converters import WrapLinears as ModelConvertersWrap  # (this script's folder is on sys.path)

from grpo_kernels.train import build as build_module
from grpo_kernels.train import trainer
from grpo_kernels.train.config.io import load_config
from grpo_kernels.train.model import converters, hf, sharded_load
from grpo_kernels.train.model.fsdp import init_distributed


class WrapLinears(ModelConvertersWrap):
    freeze_embeddings = False


converters.register_converter("sharded_check_wrap", WrapLinears)


def status_mib(field: str) -> float:
    """A memory line of /proc/self/status (VmRSS, VmHWM) in MiB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    raise KeyError(field)


def reset_peak() -> None:
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS


def main(mode: str, out: Path, args: list[str]) -> None:
    calls = {"load_shards": 0}
    original_load_shards = build_module.load_shards

    def counted(*a, **k):
        calls["load_shards"] += 1
        return original_load_shards(*a, **k)

    build_module.load_shards = counted
    d = init_distributed("gloo")
    result = {"rank": d.rank, "world": d.world}
    if mode == "losses":
        trainer._end_process_group = lambda d: None  # both runs in this process group
        original = build_module.sharded_loading
        for name in ("whole", "sharded"):
            build_module.sharded_loading = original if name == "sharded" else (lambda *a, **k: (False, ""))
            calls["load_shards"] = 0
            config = load_config(None, [*args, f"--logging.run_dir={out / name}"])
            trainer.train(config, log=lambda *a, **k: None)
            result[f"{name}_load_shards_calls"] = calls["load_shards"]
        if "--checkpoint.every=1" in args:
            if d.is_main:
                shutil.copytree(out / "sharded", out / "resumed")
            torch.distributed.barrier()
            resume = [f"--logging.run_dir={out / 'resumed'}", f"--checkpoint.resume={out / 'resumed'}",
                      "--checkpoint.resume_step=1"]  # fmt: skip
            trainer.train(load_config(None, [*args, *resume]), log=lambda *a, **k: None)
    else:
        if mode == "memory-whole":
            build_module.sharded_loading = lambda *a, **k: (False, "")
        marks = {}

        def wrap(module, name, before):
            original = getattr(module, name)

            def wrapped(*a, **k):
                before()
                return original(*a, **k)

            setattr(module, name, wrapped)

        def start():
            reset_peak()
            marks["start_mib"] = status_mib("VmRSS")

        def loaded():
            marks.setdefault("loaded_mib", status_mib("VmHWM"))

        wrap(sharded_load, "meta_model", start)
        wrap(hf, "_from_pretrained", start)
        wrap(sharded_load, "_check_packed", loaded)
        wrap(build_module, "make_rollouts", loaded)
        config = load_config(None, [*args, f"--logging.run_dir={out / 'run'}"])
        torch.manual_seed(config.seed)
        with contextlib.ExitStack() as stack:
            parts = build_module.build(config, d, resources=stack, run_dir=out / "run", resuming=False,
                                       log=lambda *a, **k: None)  # fmt: skip
            marks["built_mib"] = status_mib("VmHWM")
            full = sum(p.numel() * p.element_size() for p in parts.policy.parameters())  # (a DTensor's: global)
            result.update(marks, full_model_mib=full / 2**20, load_shards_calls=calls["load_shards"])
        torch.distributed.destroy_process_group()
    (out / f"rank{d.rank}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    split = sys.argv.index("--")
    main(sys.argv[1], Path(sys.argv[2]), sys.argv[split + 1 :])

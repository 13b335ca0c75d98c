"""Ahead-of-time Hopper compile report: every Triton kernel of the package, with example signatures.

Without a GPU, `triton.compile` still lowers a kernel to PTX and a cubin for sm_90a; ptxas, run the way
Triton runs it, then reports registers, spills and shared memory. The test suite runs this module in a fresh
process (the Triton interpreter, used by the other tests, replaces kernels at import time), and
`make aot-compat` runs it under an older Triton too:

    python -m grpo_kernels.ops.aot_report            # table and a summary line
    python -m grpo_kernels.ops.aot_report --json     # one JSON object per compiled variant
    python -m grpo_kernels.ops.aot_report --check    # exit status 1 on any compile error or spill

Convention: a launched kernel's name ends in `_kernel`; `@triton.jit` helpers it calls do not.
"""

import argparse
import json
import os
import re
import subprocess
import sys
from dataclasses import dataclass, field

from . import advantages, logprobs, loss, loss_fused

# The oldest Triton whose compile CI checks (`make aot-compat`, the Triton of the torch 2.10/2.11 images);
# pyproject.toml's `triton>=` is the same version (a test checks). The report refuses older ones. Measured:
# every kernel also compiles without spills on 3.4.0, and on 3.3.1 and 3.5.1 but for fp64 rewards, which spill
# 8 bytes in two tile shapes there; Triton 3.2's ASTSource takes no constexprs=.
MIN_TRITON = (3, 6, 0)


def triton_version(version: str | None = None) -> tuple[int, int, int]:
    """(major, minor, patch) of the installed Triton, or of `version` ("3.6.0", "3.5.1+git1234", "3.4")."""
    if version is None:
        import triton

        version = triton.__version__
    m = re.match(r"(\d+)\.(\d+)(?:\.(\d+))?", version)
    if m is None:
        raise ValueError(f"cannot parse the Triton version {version!r}")
    return int(m.group(1)), int(m.group(2)), int(m.group(3) or 0)


def ptxas_log(ptx: str, options: dict, arch: int = 90) -> tuple[list[str], str]:
    """Assemble `ptx` for `sm_{arch}a` with ptxas run exactly as Triton's own compile runs it; return (command, log).

    Triton picks the ptxas binary and its flags itself, and both differ between versions: the binary is found
    through `get_ptxas`, whose signature changed in 3.4 and again in 3.6, and 3.9 adds `--regAllocOptLevel=2`,
    which changes register allocation and spills. So the report does not call ptxas on its own: it calls
    the backend's `make_cubin` (same signature from 3.3 to 3.9) and keeps the `-v` log that it writes to its
    stderr file, by standing in for `subprocess` inside Triton's NVIDIA compiler module for that one call.
    """
    import triton.backends.nvidia.compiler as nvidia
    from triton.backends.compiler import GPUTarget

    backend = nvidia.CUDABackend(GPUTarget("cuda", arch, 32))
    runs: list[tuple[list[str], str]] = []

    class _Recorder:
        """`subprocess` as Triton's NVIDIA backend sees it, with `run` also keeping ptxas's -v log."""

        def __getattr__(self, name):
            return getattr(subprocess, name)

        @staticmethod
        def run(cmd, *args, **kwargs):
            result = subprocess.run(cmd, *args, **kwargs)
            stderr = kwargs.get("stderr")
            if "-v" in cmd and hasattr(stderr, "name"):
                with open(stderr.name) as f:
                    runs.append(([str(c) for c in cmd], f.read()))
            return result

    nvidia.subprocess = _Recorder()
    try:
        backend.make_cubin(ptx, {}, backend.parse_options(options), arch)
    finally:
        nvidia.subprocess = subprocess
    if len(runs) != 1:
        raise RuntimeError(f"expected one ptxas -v run in Triton's make_cubin, saw {len(runs)}")
    return runs[0]


@dataclass(frozen=True, slots=True, kw_only=True)
class KernelVariant:
    """One compile of a kernel: argument types (Triton signature strings) and constexpr values."""

    kernel: object
    label: str
    signature: dict[str, str]
    constexprs: dict[str, object]
    num_warps: int = 4
    options: dict[str, object] = field(default_factory=dict)

    @property
    def name(self) -> str:
        return f"{self.kernel.fn.__name__ if hasattr(self.kernel, 'fn') else self.kernel.__name__}[{self.label}]"


def _advantages_variants() -> list[KernelVariant]:
    def sig(rewards: str, offsets: str) -> dict[str, str]:
        return {
            "r_ptr": f"*{rewards}", "stride_n": "i64", "stride_k": "i64", "w_ptr": "*fp32", "K": "i32",
            "offsets_ptr": f"*{offsets}", "group_size": "i32", "num_groups": "i32",
            "adv_ptr": "*fp32", "mean_ptr": "*fp32", "std_ptr": "*fp32", "valid_ptr": "*i1", "counts_ptr": "*i32",
            "frac_ptr": "*fp32", "nbad_ptr": "*i32",
            "eps": "fp32", "correction": "fp32", "min_std": "fp32", "scale_mode": "i32",
            "HAS_OFFSETS": "constexpr", "BLOCK_G": "constexpr", "BLOCK_M": "constexpr",
        }  # fmt: skip

    # Every tile shape the launcher can pick (BLOCK_M: each power of two up to MAX_BLOCK_M), each with the three
    # ways groups are given; the reward width (16, 32 or 64-bit loads) rotates so every pairing comes up.
    widths = ["fp32", "16-bit", "fp64"]
    k = advantages._group_advantages_kernel
    variants = []
    for i in range(advantages.MAX_BLOCK_M.bit_length() - 1):
        block_g, block_m = advantages._block_shape(2 << i, 1, 2 << i, False)
        for j, offsets in enumerate([None, "i32", "i64"]):
            rewards = widths[(i + j) % 3].replace("16-bit", "bf16" if i % 2 else "fp16")
            label = f"{rewards},{'offsets ' + offsets if offsets else 'uniform'},G{block_g}xM{block_m}"
            consts = {"HAS_OFFSETS": offsets is not None, "BLOCK_G": block_g, "BLOCK_M": block_m}
            variants.append(KernelVariant(kernel=k, label=label, signature=sig(rewards, offsets or "fp32"),
                                          constexprs=consts, num_warps=advantages.NUM_WARPS))  # fmt: skip
    return variants


def _logprobs_variants() -> list[KernelVariant]:
    variants = []
    for dtype, entropy, block in [("fp32", True, logprobs.MAX_BLOCK_V), ("bf16", True, 1024), ("bf16", False, 256)]:
        fwd = {
            "logits_ptr": f"*{dtype}", "stride_t": "i64", "ids_ptr": "*i64", "logps_ptr": "*fp32",
            "entropy_ptr": "*fp32", "lse_ptr": "*fp32", "V": "i32", "inv_temperature": "fp32",
            "RETURN_ENTROPY": "constexpr", "BLOCK_V": "constexpr",
        }  # fmt: skip
        bwd = {
            "grad_ptr": "*fp32", "grad_entropy_ptr": "*fp32", "logits_ptr": f"*{dtype}", "stride_t": "i64",
            "ids_ptr": "*i64", "lse_ptr": "*fp32", "entropy_ptr": "*fp32", "dlogits_ptr": f"*{dtype}",
            "stride_dt": "i64", "V": "i32", "inv_temperature": "fp32",
            "HAS_GRAD_ENTROPY": "constexpr", "BLOCK_V": "constexpr",
        }  # fmt: skip
        label = f"{dtype},{'entropy' if entropy else 'no entropy'},V{block}"
        warps = logprobs._num_warps(block)
        for kernel, signature, flag in ((logprobs._logprobs_fwd_kernel, fwd, "RETURN_ENTROPY"),
                                        (logprobs._logprobs_bwd_kernel, bwd, "HAS_GRAD_ENTROPY")):  # fmt: skip
            variants.append(KernelVariant(kernel=kernel, label=label, signature=signature,
                                          constexprs={flag: entropy, "BLOCK_V": block}, num_warps=warps))  # fmt: skip
    return variants


def _loss_variants() -> list[KernelVariant]:
    tiles = {"BLOCK": loss.BLOCK, "CHUNK": loss.CHUNK}
    variants = []
    for dtype, has_old, has_sampler, has_mask, vespo in [("fp32", True, True, True, False),
                                                         ("bf16", False, False, False, False),
                                                         ("fp32", True, True, True, True)]:  # fmt: skip
        sig = {
            "logp_ptr": f"*{dtype}", "old_ptr": "*fp32", "sampler_ptr": "*fp32", "mask_ptr": "*fp32",
            "cu_ptr": "*i64", "partial_ptr": "*fp32", "num_chunks": "i32", "sampler_cap": "fp32",
            "sampler_truncate": "i32", "HAS_OLD": "constexpr", "HAS_SAMPLER": "constexpr", "HAS_MASK": "constexpr",
            "VESPO": "constexpr", "BLOCK": "constexpr", "CHUNK": "constexpr",
        }  # fmt: skip
        flags = {"HAS_OLD": has_old, "HAS_SAMPLER": has_sampler, "HAS_MASK": has_mask, "VESPO": vespo}
        label = f"{dtype},old={has_old},sampler={has_sampler},mask={has_mask},vespo={vespo}"
        variants.append(KernelVariant(kernel=loss.grpo_seq_stats_kernel, label=label, signature=sig,
                                      constexprs={**flags, **tiles}, num_warps=loss.NUM_WARPS))  # fmt: skip
    # The registered op's variants (sequence level, vespo, CHUNK = 4 blocks), then the fused token-level ones of
    # ops/loss_fused (FINISH: the last program's reduction; inputs in their own dtypes; padded rows or cu_seqlens).
    fused_tiles = {"BLOCK": loss_fused.BLOCK, "CHUNK": loss_fused.CHUNK}
    for dtype, family, seq, old, kl, sampler, mask, per_token, finish in [
        ("fp32", "dapo", False, True, True, False, "fp32", False, False),
        ("bf16", "grpo", True, True, True, True, "fp32", True, False),
        ("fp32", "cispo", False, True, True, True, "fp32", False, False),
        ("bf16", "sapo", False, False, False, True, None, False, False),
        ("fp32", "vespo", False, True, True, True, "fp32", False, False),
        ("bf16", "vespo", True, True, True, True, "fp32", True, False),
        ("fp32", "dapo", False, True, True, False, "fp32", False, "padded"),
        ("bf16", "grpo", False, True, True, True, "i1", True, "packed"),
        ("bf16", "cispo", False, True, True, True, "bf16", False, "packed"),
        ("fp32", "sapo", False, False, False, False, None, False, "padded"),
    ]:
        inputs = "bf16" if finish and dtype == "bf16" else "fp32"  # the fused path reads old / ref / adv as given
        sig = {
            "logp_ptr": f"*{dtype}", "old_ptr": f"*{inputs}", "ref_ptr": f"*{inputs}", "sampler_ptr": f"*{inputs}",
            "adv_ptr": f"*{inputs}", "mask_ptr": f"*{mask or 'fp32'}", "cu_ptr": "*i64", "seq_logw_ptr": "*fp32",
            "seq_is_ptr": "*fp32", "seq_phi_ptr": "*fp32", "coef_ptr": "*fp32",
            "partial_ptr": "*fp64", "num_chunks": "i32", "eps_low": "fp32", "eps_high": "fp32", "delta": "fp32",
            "beta": "fp32", "bias_kl": "i32", "sampler_cap": "fp32", "sampler_truncate": "i32",
            "sampler_per_seq": "i32", "tau_pos": "fp32", "tau_neg": "fp32", "row_len": "i64", "counter_ptr": "*i32",
            "loss_ptr": "*fp32", "metrics_ptr": "*fp32", "scale_ptr": "*fp32", "num_items_ptr": "*i64",
            "num_seqs": "i32", "div_kind": "i32", "div_value": "fp32",
            **dict.fromkeys(("LOSS", "SEQ_LEVEL", "HAS_OLD", "HAS_KL", "HAS_SAMPLER", "HAS_MASK", "ADV_PER_TOKEN",
                             "PADDED", "FINISH", "BLOCK", "CHUNK"), "constexpr"),
        }  # fmt: skip
        flags = {"LOSS": loss.LOSS_FAMILIES[family], "SEQ_LEVEL": seq, "HAS_OLD": old, "HAS_KL": kl,
                 "HAS_SAMPLER": sampler, "HAS_MASK": mask is not None, "ADV_PER_TOKEN": per_token,
                 "PADDED": finish == "padded", "FINISH": bool(finish)}  # fmt: skip
        label = f"{dtype},{family},{'sequence' if seq else 'token'},old={old},kl={kl},sampler={sampler}"
        label += f",fused {finish}, mask {mask}" if finish else ""
        variants.append(KernelVariant(kernel=loss.grpo_loss_fwd_kernel, label=label, signature=sig,
                                      constexprs={**flags, **(fused_tiles if finish else tiles)},
                                      num_warps=loss.NUM_WARPS))  # fmt: skip
    for dtype, seq, mask, fused in [("fp32", True, True, False), ("bf16", False, False, False),
                                    ("bf16", False, False, "padded"), ("fp32", False, False, "packed")]:  # fmt: skip
        sig = {
            "a_ptr": "*fp32", "b_ptr": "*fp32", "coef_ptr": "*fp32", "mask_ptr": "*fp32", "cu_ptr": "*i64",
            "grad_ptr": f"*{dtype}", "num_chunks": "i32", "a_stride": "i32", "g_ptr": "*fp32", "row_len": "i64",
            **dict.fromkeys(("SEQ_LEVEL", "HAS_MASK", "HAS_G", "PADDED", "BLOCK", "CHUNK"), "constexpr"),
        }  # fmt: skip
        consts = {"SEQ_LEVEL": seq, "HAS_MASK": mask, "HAS_G": bool(fused), "PADDED": fused == "padded",
                  **(fused_tiles if fused else tiles)}  # fmt: skip
        variants.append(KernelVariant(kernel=loss.grpo_loss_bwd_kernel,
                                      label=f"{dtype},seq={seq},mask={mask}" + (f",fused {fused}" if fused else ""),
                                      signature=sig, constexprs=consts, num_warps=loss.NUM_WARPS))  # fmt: skip
    return variants


def kernel_variants() -> list[KernelVariant]:
    """All compile variants of all launched kernels."""
    return _advantages_variants() + _logprobs_variants() + _loss_variants()


def uncovered_kernels() -> list[str]:
    """Names of launched kernels (`*_kernel` jit functions in grpo_kernels.ops modules) without a variant."""
    import importlib
    import pkgutil

    from triton.runtime.jit import KernelInterface

    from .. import ops

    covered = {id(v.kernel) for v in kernel_variants()}
    missing = []
    for info in pkgutil.iter_modules(ops.__path__):
        module = importlib.import_module(f"{ops.__name__}.{info.name}")
        for attr, value in vars(module).items():
            if isinstance(value, KernelInterface) and attr.endswith("_kernel") and id(value) not in covered:
                missing.append(f"{module.__name__}.{attr}")
    return missing


def compile_hopper(variant: KernelVariant) -> dict:
    """Compile one variant for sm_90a and return its resource usage as reported by ptxas."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    src = ASTSource(variant.kernel, variant.signature, constexprs=variant.constexprs)
    options = {"num_warps": variant.num_warps, **variant.options}
    compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)
    ptx = compiled.asm["ptx"]
    cmd, report = ptxas_log(ptx if isinstance(ptx, str) else ptx.decode(), options)

    def number(pattern: str) -> int:
        m = re.search(pattern, report)
        return int(m.group(1)) if m else 0

    return {
        "kernel": variant.name,
        "registers": number(r"Used (\d+) registers"),
        "spill_stores": number(r"(\d+) bytes spill stores"),
        "spill_loads": number(r"(\d+) bytes spill loads"),
        "stack_frame": number(r"(\d+) bytes stack frame"),
        "shared_bytes": int(compiled.metadata.shared),
        "cubin_bytes": len(compiled.asm["cubin"]),
        "num_warps": variant.num_warps,
        "ptxas": " ".join([cmd[0], *(c for c in cmd[1:] if c.startswith("-") and c != "-o")]),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", action="store_true", help="print one JSON object per variant")
    parser.add_argument("--check", action="store_true", help="exit with status 1 on any compile error or spill")
    args = parser.parse_args()
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        raise SystemExit("unset TRITON_INTERPRET: the interpreter replaces kernels and they cannot be compiled")
    import triton

    if triton_version() < MIN_TRITON:
        oldest = ".".join(map(str, MIN_TRITON))
        raise SystemExit(f"triton {triton.__version__} is older than {oldest}, the oldest this report supports")
    rows = []
    for variant in kernel_variants():
        try:
            rows.append(compile_hopper(variant))
        except Exception as exc:  # report every failing variant, not only the first
            rows.append({"kernel": variant.name, "error": f"{type(exc).__name__}: {exc}"})
    if args.json:
        for row in rows:
            print(json.dumps(row))
    else:
        print(f"{'kernel':<70} {'regs':>5} {'spill':>6} {'smem':>7} {'warps':>5}")
        for row in rows:
            if "error" in row:
                print(f"{row['kernel']:<70} ERROR {row['error']}")
            else:
                spill = row["spill_stores"] + row["spill_loads"]
                regs, smem, warps = row["registers"], row["shared_bytes"], row["num_warps"]
                print(f"{row['kernel']:<70} {regs:>5} {spill:>6} {smem:>7} {warps:>5}")
    ok = [row for row in rows if "error" not in row]
    errors = len(rows) - len(ok)
    spilling = [row["kernel"] for row in ok if row["spill_stores"] or row["spill_loads"]]
    max_regs = max((row["registers"] for row in ok), default=0)
    ptxas = ok[0]["ptxas"] if ok else "ptxas not run"
    summary = (
        f"triton {triton.__version__} ({ptxas}): {len(ok)}/{len(rows)} variants compiled for sm_90a, "
        f"max {max_regs} registers, {len(spilling)} spilling{': ' + ', '.join(spilling) if spilling else ''}"
    )
    print(summary, file=sys.stderr if args.json else sys.stdout)
    if args.check and (errors or spilling):
        raise SystemExit(1)


if __name__ == "__main__":
    main()

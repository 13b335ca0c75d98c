"""Every Triton kernel of the package, with example signatures, and their ahead-of-time Hopper compile.

Without a GPU, `triton.compile` still lowers a kernel to PTX and a cubin for sm_90a; Triton's bundled
ptxas then reports registers, spills and shared memory. The test suite runs this module in a fresh process
(the Triton interpreter, used by the other tests, replaces kernels at import time):

    python -m grpo_kernels.ops.registry            # table
    python -m grpo_kernels.ops.registry --json     # one JSON object per compiled variant

Convention: a launched kernel's name ends in `_kernel`; `@triton.jit` helpers it calls do not.
"""

import argparse
import json
import os
import re
import subprocess
import tempfile
from dataclasses import dataclass, field

from . import advantages, logprobs, loss


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
            "adv_ptr": "*fp32", "mean_ptr": "*fp32", "std_ptr": "*fp32", "valid_ptr": "*i1",
            "eps": "fp32", "correction": "fp32", "min_std": "fp32", "scale_mode": "i32",
            "HAS_OFFSETS": "constexpr", "BLOCK_G": "constexpr", "BLOCK_M": "constexpr",
        }  # fmt: skip

    k = advantages._group_advantages_kernel
    variants = []
    for rewards, offsets, has_offsets, block_m in [
        ("fp32", "fp32", False, 2),
        ("fp32", "fp32", False, 16),
        ("bf16", "fp32", False, 64),
        ("fp32", "i64", True, 16),
        ("bf16", "i32", True, advantages.MAX_BLOCK_M),
    ]:
        block_g = max(advantages.TILE // block_m, 1)
        label = f"{rewards},{'offsets ' + offsets if has_offsets else 'uniform'},G{block_g}xM{block_m}"
        consts = {"HAS_OFFSETS": has_offsets, "BLOCK_G": block_g, "BLOCK_M": block_m}
        variants.append(KernelVariant(kernel=k, label=label, signature=sig(rewards, offsets), constexprs=consts))
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
        variants.append(
            KernelVariant(
                kernel=logprobs._logprobs_fwd_kernel,
                label=label,
                signature=fwd,
                constexprs={"RETURN_ENTROPY": entropy, "BLOCK_V": block},
                num_warps=warps,
            )
        )
        variants.append(
            KernelVariant(
                kernel=logprobs._logprobs_bwd_kernel,
                label=label,
                signature=bwd,
                constexprs={"HAS_GRAD_ENTROPY": entropy, "BLOCK_V": block},
                num_warps=warps,
            )
        )
    return variants


def _loss_variants() -> list[KernelVariant]:
    tiles = {"BLOCK": loss.BLOCK, "CHUNK": loss.CHUNK}
    variants = []
    for dtype, has_old, has_sampler, has_mask in [("fp32", True, True, True), ("bf16", False, False, False)]:
        sig = {
            "logp_ptr": f"*{dtype}", "old_ptr": "*fp32", "sampler_ptr": "*fp32", "mask_ptr": "*fp32",
            "cu_ptr": "*i64", "partial_ptr": "*fp32", "num_chunks": "i32",
            "HAS_OLD": "constexpr", "HAS_SAMPLER": "constexpr", "HAS_MASK": "constexpr", "BLOCK": "constexpr",
            "CHUNK": "constexpr",
        }  # fmt: skip
        flags = {"HAS_OLD": has_old, "HAS_SAMPLER": has_sampler, "HAS_MASK": has_mask}
        label = f"{dtype},old={has_old},sampler={has_sampler},mask={has_mask}"
        variants.append(KernelVariant(kernel=loss._grpo_seq_stats_kernel, label=label, signature=sig,
                                      constexprs={**flags, **tiles}, num_warps=loss.NUM_WARPS))  # fmt: skip
    for dtype, family, seq, old, kl, sampler, mask, per_token in [
        ("fp32", "dapo", False, True, True, False, True, False),
        ("bf16", "grpo", True, True, True, True, True, True),
        ("fp32", "cispo", False, True, True, True, True, False),
        ("bf16", "sapo", False, False, False, True, False, False),
    ]:
        sig = {
            "logp_ptr": f"*{dtype}", "old_ptr": "*fp32", "ref_ptr": "*fp32", "sampler_ptr": "*fp32", "adv_ptr": "*fp32",
            "mask_ptr": "*fp32", "cu_ptr": "*i64", "seq_logw_ptr": "*fp32", "seq_is_ptr": "*fp32", "coef_ptr": "*fp32",
            "partial_ptr": "*fp32", "num_chunks": "i32", "eps_low": "fp32", "eps_high": "fp32", "delta": "fp32",
            "beta": "fp32", "bias_kl": "i32", "sampler_cap": "fp32", "sampler_truncate": "i32",
            "sampler_per_seq": "i32", "tau_pos": "fp32", "tau_neg": "fp32",
            **dict.fromkeys(("LOSS", "SEQ_LEVEL", "HAS_OLD", "HAS_KL", "HAS_SAMPLER", "HAS_MASK", "ADV_PER_TOKEN",
                             "BLOCK", "CHUNK"), "constexpr"),
        }  # fmt: skip
        flags = {"LOSS": loss.LOSS_FAMILIES[family], "SEQ_LEVEL": seq, "HAS_OLD": old, "HAS_KL": kl,
                 "HAS_SAMPLER": sampler, "HAS_MASK": mask, "ADV_PER_TOKEN": per_token}  # fmt: skip
        label = f"{dtype},{family},{'sequence' if seq else 'token'},old={old},kl={kl},sampler={sampler}"
        variants.append(KernelVariant(kernel=loss._grpo_loss_fwd_kernel, label=label, signature=sig,
                                      constexprs={**flags, **tiles}, num_warps=loss.NUM_WARPS))  # fmt: skip
    for dtype, seq, mask in [("fp32", True, True), ("bf16", False, False)]:
        sig = {
            "a_ptr": "*fp32", "b_ptr": "*fp32", "coef_ptr": "*fp32", "mask_ptr": "*fp32", "cu_ptr": "*i64",
            "grad_ptr": f"*{dtype}", "num_chunks": "i32", "SEQ_LEVEL": "constexpr", "HAS_MASK": "constexpr",
            "BLOCK": "constexpr", "CHUNK": "constexpr",
        }  # fmt: skip
        variants.append(KernelVariant(kernel=loss._grpo_loss_bwd_kernel, label=f"{dtype},seq={seq},mask={mask}",
                                      signature=sig, constexprs={"SEQ_LEVEL": seq, "HAS_MASK": mask, **tiles},
                                      num_warps=loss.NUM_WARPS))  # fmt: skip
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
    from triton.backends.nvidia.compiler import get_ptxas
    from triton.compiler import ASTSource

    src = ASTSource(variant.kernel, variant.signature, constexprs=variant.constexprs)
    options = {"num_warps": variant.num_warps, **variant.options}
    compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)
    ptx = compiled.asm["ptx"]
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "k.ptx")
        with open(path, "w") as f:
            f.write(ptx if isinstance(ptx, str) else ptx.decode())
        proc = subprocess.run(
            [get_ptxas(90).path, "-arch=sm_90a", "-v", path, "-o", os.path.join(tmp, "k.cubin")],
            capture_output=True,
            text=True,
        )
    if proc.returncode != 0:
        raise RuntimeError(f"ptxas failed on {variant.name}:\n{proc.stderr}")
    report = proc.stdout + proc.stderr

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
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", action="store_true", help="print one JSON object per variant")
    args = parser.parse_args()
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        raise SystemExit("unset TRITON_INTERPRET: the interpreter replaces kernels and they cannot be compiled")
    rows = []
    for variant in kernel_variants():
        try:
            rows.append(compile_hopper(variant))
        except Exception as exc:  # report every failing variant, not only the first
            rows.append({"kernel": variant.name, "error": f"{type(exc).__name__}: {exc}"})
    if args.json:
        for row in rows:
            print(json.dumps(row))
        return
    print(f"{'kernel':<70} {'regs':>5} {'spill':>6} {'smem':>7} {'warps':>5}")
    for row in rows:
        if "error" in row:
            print(f"{row['kernel']:<70} ERROR {row['error']}")
        else:
            spill = row["spill_stores"] + row["spill_loads"]
            regs, smem, warps = row["registers"], row["shared_bytes"], row["num_warps"]
            print(f"{row['kernel']:<70} {regs:>5} {spill:>6} {smem:>7} {warps:>5}")


if __name__ == "__main__":
    main()

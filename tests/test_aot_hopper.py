"""Every Triton kernel compiles ahead of time for Hopper (sm_90a) without register spills.

The compile runs in a fresh process without TRITON_INTERPRET (the interpreter, active in this one,
replaces kernels when they are defined). The table of registers and shared memory is printed (pytest -s).
"""

import json
import os
import subprocess
import sys

import pytest

from grpo_kernels.ops import registry


def test_every_launched_kernel_has_a_compile_variant():
    assert registry.kernel_variants(), "the registry lists no kernel"
    assert registry.uncovered_kernels() == []


@pytest.mark.slow
def test_all_kernels_compile_for_sm90a_without_spills():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    proc = subprocess.run(
        [sys.executable, "-m", "grpo_kernels.ops.registry", "--json"],
        capture_output=True, text=True, env=env, timeout=900,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert len(rows) == len(registry.kernel_variants())
    print(f"\n{'kernel':<70} {'regs':>5} {'spill':>6} {'smem':>7}")
    for row in rows:
        if "error" not in row:
            spill = row["spill_stores"] + row["spill_loads"]
            print(f"{row['kernel']:<70} {row['registers']:>5} {spill:>6} {row['shared_bytes']:>7}")
    errors = [f"{r['kernel']}: {r['error']}" for r in rows if "error" in r]
    assert not errors, "\n".join(errors)
    for row in rows:
        assert row["cubin_bytes"] > 0 and 0 < row["registers"] <= 255, row
        assert row["spill_stores"] == 0 and row["spill_loads"] == 0, f"{row['kernel']} spills: {row}"

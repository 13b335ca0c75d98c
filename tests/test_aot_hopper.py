"""Every Triton kernel compiles ahead of time for Hopper (sm_90a) without register spills.

The compile runs in a fresh process without TRITON_INTERPRET (the interpreter, active in this one,
replaces kernels when they are defined). The table of registers and shared memory is printed (pytest -s).
`make aot-compat` runs the same report under the oldest Triton the package allows.
"""

import json
import os
import pathlib
import re
import subprocess
import sys

import pytest

from grpo_kernels.ops import aot_report

ROOT = pathlib.Path(__file__).resolve().parents[1]

# A kernel that stores 1.0 through its pointer argument, in PTX any ptxas from CUDA 12 on accepts.
STORE_ONE_PTX = """
.version 8.0
.target sm_90a
.address_size 64

.visible .entry store_one(.param .u64 out)
{
    .reg .b64 %rd<3>;
    .reg .f32 %f<2>;
    ld.param.u64 %rd1, [out];
    cvta.to.global.u64 %rd2, %rd1;
    mov.f32 %f1, 0f3F800000;
    st.global.f32 [%rd2], %f1;
    ret;
}
"""


def test_every_launched_kernel_has_a_compile_variant():
    assert aot_report.kernel_variants(), "the report lists no kernel"
    assert aot_report.uncovered_kernels() == []


def test_every_advantages_tile_shape_is_compiled():
    from grpo_kernels.ops import advantages

    shapes = {(v.constexprs["BLOCK_G"], v.constexprs["BLOCK_M"]) for v in aot_report._advantages_variants()}
    launchable = {advantages._block_shape(m, 1, m, False) for m in range(1, 4 * advantages.MAX_BLOCK_M)}
    assert shapes == launchable


def test_ptxas_log_runs_ptxas_as_tritons_own_compile_does():
    import triton.backends.nvidia.compiler as nvidia

    cmd, log = aot_report.ptxas_log(STORE_ONE_PTX, {"num_warps": 4})
    assert os.path.basename(cmd[0]).startswith("ptxas") and "-v" in cmd and "-lineinfo" in cmd, cmd
    assert any("sm_90a" in arg for arg in cmd), cmd
    assert re.search(r"Used \d+ registers", log) and "0 bytes spill stores" in log, log
    assert nvidia.subprocess is subprocess, "the stand-in for subprocess was left in Triton's module"


def test_ptxas_log_puts_subprocess_back_when_ptxas_fails():
    import triton.backends.nvidia.compiler as nvidia

    with pytest.raises(Exception, match="ptxas"):  # triton.runtime.errors.PTXASError
        aot_report.ptxas_log(STORE_ONE_PTX.replace("st.global.f32", "st.nowhere.f32"), {"num_warps": 4})
    assert nvidia.subprocess is subprocess


@pytest.mark.parametrize(
    "text,expected", [("3.6.0", (3, 6, 0)), ("3.5.1+git0a1b2c", (3, 5, 1)), ("3.4", (3, 4, 0)), ("3.10.2", (3, 10, 2))]
)
def test_triton_version_parses_release_and_dev_strings(text, expected):
    assert aot_report.triton_version(text) == expected


def test_min_triton_is_the_pyproject_lower_bound_and_the_one_make_aot_compat_checks():
    pins = re.findall(r'"triton>=([0-9.]+)', (ROOT / "pyproject.toml").read_text())
    assert len(pins) == 1, pins
    assert aot_report.triton_version(pins[0]) == aot_report.MIN_TRITON
    compat = re.findall(r"^TRITON_COMPAT \?= triton==([0-9.]+)$", (ROOT / "Makefile").read_text(), flags=re.M)
    assert len(compat) == 1, compat
    assert aot_report.triton_version(compat[0]) == aot_report.MIN_TRITON


def test_report_refuses_a_triton_older_than_min_triton(monkeypatch, capsys):
    import triton

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(triton, "__version__", "3.5.1")
    monkeypatch.setattr(sys, "argv", ["aot_report", "--check"])
    with pytest.raises(SystemExit, match=r"triton 3\.5\.1 is older than 3\.6\.0"):
        aot_report.main()
    assert capsys.readouterr().out == "", "nothing may be compiled on a refused Triton"


@pytest.mark.slow
def test_all_kernels_compile_for_sm90a_without_spills():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    proc = subprocess.run(
        [sys.executable, "-m", "grpo_kernels.ops.aot_report", "--json"],
        capture_output=True, text=True, env=env, timeout=900,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert len(rows) == len(aot_report.kernel_variants())
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

"""The package as users install it: an sdist that carries what the build needs, and a wheel (built from this tree,
not editable) that installs into a clean venv and works from any directory: one op per backend and the CLI.

The clean venv reads torch and the other dependencies from the development venv through a .pth path line (no
network, no second torch); nothing of the source tree is importable in it, so `import grpo_kernels` is the wheel's."""

import subprocess
import sys
import sysconfig
import tarfile
import zipfile
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[1]


def _run(*args, cwd, timeout=900, env=None):
    proc = subprocess.run([str(a) for a in args], cwd=cwd, capture_output=True, text=True, timeout=timeout, env=env)
    assert proc.returncode == 0, (args, proc.stdout[-2000:], proc.stderr[-4000:])
    return proc.stdout


@pytest.fixture(scope="module")
def dist(tmp_path_factory):
    out = tmp_path_factory.mktemp("dist")
    _run(sys.executable, "-m", "build", "--sdist", "--no-isolation", "--outdir", out, ROOT, cwd=out)
    # In-tree build (the extension's objects from `make build` are reused), no dependencies resolved.
    _run(sys.executable, "-m", "pip", "wheel", "--no-build-isolation", "--no-deps", "-q", "-w", out, ROOT, cwd=out)
    return out


def test_sdist_carries_the_sources_headers_license_and_changelog(dist):
    (sdist,) = dist.glob("grpo_kernels-*.tar.gz")
    with tarfile.open(sdist) as tar:
        names = {n.split("/", 1)[1] for n in tar.getnames() if "/" in n}
    cpp = {p.relative_to(ROOT).as_posix() for p in (ROOT / "csrc").glob("*.[ch]*")}
    assert cpp <= names, sorted(cpp - names)
    assert {"setup.py", "pyproject.toml", "LICENSE", "CHANGELOG.md", "README.md",
            "grpo_kernels/ops/loss_kernels.py", "grpo_kernels/train/preflight.py"} <= names  # fmt: skip


def test_wheel_installs_into_a_clean_venv_and_works_from_any_directory(dist, tmp_path):
    (wheel,) = dist.glob("grpo_kernels-*.whl")
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
        meta = z.read(next(n for n in names if n.endswith(".dist-info/METADATA"))).decode()
    assert any(n.startswith("grpo_kernels/_C.") and n.endswith(".so") for n in names), "no compiled extension"
    assert "License-Expression: Apache-2.0" in meta and "Provides-Extra: trl" in meta and "Provides-Extra: vllm" in meta
    venv = tmp_path / "venv"
    _run(sys.executable, "-m", "venv", "--without-pip", venv, cwd=tmp_path)
    py = venv / "bin" / "python"
    purelib = Path(_run(py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])", cwd=tmp_path).strip())
    (purelib / "dev-venv-deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    _run(sys.executable, "-m", "pip", "--python", py, "install", "--no-deps", "-q", wheel, cwd=tmp_path)
    where = tmp_path / "elsewhere"
    where.mkdir()
    script = (
        "import os, torch, grpo_kernels as gk\n"
        f"assert gk.__file__.startswith({str(purelib)!r}), gk.__file__\n"
        "r = torch.tensor([1.0, 0.0, 1.0, 1.0, 0.5, 0.5])\n"
        "want = gk.group_advantages(r, group_size=2, impl='reference').advantages\n"
        "for impl in ('cpp', 'triton'):\n"
        "    got = gk.group_advantages(r, group_size=2, impl=impl).advantages\n"
        "    assert torch.allclose(got, want, atol=1e-6), (impl, got, want)\n"
        "lp = gk.selective_logprobs(torch.randn(5, 11), torch.randint(0, 11, (5,)), impl='cpp')\n"
        "assert lp.shape == (5,) and bool((lp <= 0).all())\n"
        "print('ok', gk.__file__)\n"
    )  # fmt: skip
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "TRITON_INTERPRET": "1"}
    out = _run(py, "-c", script, cwd=where, env=env)
    assert out.startswith("ok " + str(purelib)), out
    help_text = _run(venv / "bin" / "grpo-kernels", "--help", cwd=where, env=env)
    assert "train" in help_text and "prepare-model" in help_text


@pytest.mark.parametrize("mode", ["inplace", "editable_mode", None])
def test_in_place_builds_keep_their_objects_in_the_tree(mode):
    """An editable install is given a fresh temporary build directory; setup.py's build_ext puts the objects of
    every in-place build in ./build instead, so `make setup`'s editable installs and `make build` compile the
    extension once (ninja reuses the objects) rather than three times. A wheel build keeps setuptools' default."""
    import importlib.util

    from setuptools import Distribution

    spec = importlib.util.spec_from_file_location("grpo_setup", ROOT / "setup.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # defines the command; setup() runs only as __main__
    attrs = {"name": "x", "ext_modules": [module.extension()], "cmdclass": {"build_ext": module.BuildInTree}}
    dist = Distribution(attrs)
    cmd = dist.get_command_obj("build_ext")
    build = dist.get_command_obj("build")
    build.build_temp = "/elsewhere/tmp"  # what editable_wheel sets
    if mode:
        setattr(cmd, mode, True)
    cmd.ensure_finalized()
    plat = f"temp.{sysconfig.get_platform()}-{sys.implementation.cache_tag}"
    if mode:
        assert Path(cmd.build_temp) == ROOT / "build" / plat
    else:
        assert cmd.build_temp == "/elsewhere/tmp"


def test_cpu_simd_turns_all_three_ops_avx512_paths_off_and_back_on():
    import grpo_kernels
    from grpo_kernels import cpu

    switches = (grpo_kernels._C.cpu_simd, grpo_kernels._C.logprobs_simd, grpo_kernels._C.loss_simd)
    has_avx512 = cpu.simd_enabled()  # the suite leaves the paths on: this is whether the CPU has them
    try:
        cpu.simd(False)
        assert not cpu.simd_enabled() and not any(s() for s in switches)
        cpu.simd(True)
        assert cpu.simd_enabled() == has_avx512 and all(s() == has_avx512 for s in switches)
    finally:
        cpu.simd(True)
    with pytest.raises(ValueError, match="enabled must be a bool, got 'no'"):
        cpu.simd("no")

"""The documentation site builds without a warning (mkdocs --strict: broken links and anchors, unreadable docstrings,
a snippet of the README that no longer exists), and its pages say what the README promises."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_site_builds_strict_with_every_page(tmp_path):
    pytest.importorskip("mkdocs", reason="the docs tools: pip install -e '.[dev]'")
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    proc = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(tmp_path / "site")],
                          cwd=ROOT, capture_output=True, text=True, timeout=600, env=env)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    site = tmp_path / "site"
    for page in ("training", "integrations", "api", "reference", "performance", "testing", "layout", "security"):
        assert (site / page / "index.html").is_file(), page
    home = (site / "index.html").read_text()
    assert "group_advantages" in home and "Fused kernels for GRPO" in home  # the README's snippets came in
    assert "grpo_kernels.fused_linear_grpo_loss" in (site / "reference" / "index.html").read_text()


def test_readme_links_point_at_existing_files():
    import re

    text = (ROOT / "README.md").read_text()
    targets = {t.split("#")[0] for t in re.findall(r"\]\(\s*([^)\s]+)\)", text) if "://" not in t}
    assert targets, "the README links no page"
    missing = sorted(t for t in targets if not (ROOT / t).exists())
    assert not missing, missing


def _install_block() -> list[str]:
    """The README's GPU install sequence (between its gpu-install snippet markers), one command a line."""
    text = (ROOT / "README.md").read_text()
    block = text.split("<!-- --8<-- [start:gpu-install] -->", 1)[1].split("<!-- --8<-- [end:gpu-install] -->", 1)[0]
    return [line.strip() for line in block.strip().strip("`").strip().splitlines()]


def test_the_gpu_examples_install_with_the_readmes_one_sequence():
    """Every GPU example's install comment is the README's sequence, line for line: vLLM first (it pins its torch),
    then the build tools, then this package without build isolation (built against that torch). The examples'
    old `pip install -e . vllm ...` built in an isolated environment against another torch."""
    readme = _install_block()
    commands = [line.split("#", 1)[0].split() for line in readme]
    assert commands[0][:3] == ["pip", "install", "vllm"], readme
    assert "--no-build-isolation" in commands[-1], readme
    assert not any("--no-build-isolation" in c for c in commands[:-1]) and not any("vllm" in c for c in commands[1:])
    for name in ("train_qwen_gsm8k_h100.toml", "long_chains_h100.toml"):
        lines = [line.lstrip("#").strip() for line in (ROOT / "examples" / name).read_text().splitlines()
                 if line.startswith("#") and "pip install" in line]  # fmt: skip
        assert lines == readme, (name, lines)
    assert '--8<-- "README.md:gpu-install"' in (ROOT / "docs" / "training.md").read_text()

"""The README's API example runs as written and prints what it claims."""

import pathlib
import re

import pytest

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"


def test_readme_python_example_runs():
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    assert blocks, "README has no python example"
    scope: dict = {}
    exec(compile(blocks[0], "README.md", "exec"), scope)
    out = scope["out"]
    assert out.valid.tolist() == [True, True]
    assert out.advantages.tolist() == pytest.approx([0.7071, -0.7071, -0.7071, 0.7071], abs=1e-4)
    loss, metrics = scope["loss"], scope["metrics"]
    assert loss.dim() == 0 and bool(loss.isfinite())
    assert {"clip_ratio/region_mean", "ratio_mean"} <= set(metrics)
    assert scope["old"].shape == (2, 5) and not scope["old"].requires_grad

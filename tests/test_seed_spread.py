"""benchmarks/learning/seed_spread.py: a recipe over seeds, the spread reported with the machine each run saw, bad input
refused before anything runs."""

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.learning import seed_spread  # noqa: E402

TINY = """seed = 0
[task]
name = "add"
difficulty = 1
sft_warmup_steps = 10
num_eval_prompts = 16
[sampling]
group_size = 4
prompts_per_step = 2
max_new_tokens = 4
[optim]
steps = 3
[logging]
run_dir = "runs/not-used"
"""


@pytest.mark.slow
def test_two_seeds_with_the_package_simd_off_report_their_spread(tmp_path, capsys):
    config = tmp_path / "tiny.toml"
    config.write_text(TINY)
    argv = ["--config", str(config), "--seeds", "3,5", "--out", str(tmp_path / "out"), "--workdir",
            str(tmp_path / "work"), "--no-simd", "--override=--optim.lr=2e-3"]  # fmt: skip
    assert seed_spread.main(argv) == 0
    rows = seed_spread.rows_of(tmp_path / "out")
    assert [r["seed"] for r in rows] == [3, 5] and all(r["package_simd"] is False for r in rows)
    for r in rows:
        run = tmp_path / "out" / "runs" / f"seed{r['seed']}"
        assert f"seed = {r['seed']}" in (run / "config.toml").read_text()
        assert "lr = 0.002" in (run / "config.toml").read_text()  # the override reached the run
        summary = json.loads((run / "summary.json").read_text())
        assert r["eval_end"] == summary["eval_success_end"] and r["steps"] == 3
    mean = sum(r["eval_end"] for r in rows) / 2
    assert f"held-out {mean:.3f} (" in capsys.readouterr().out
    text = (tmp_path / "out" / "summary.md").read_text()
    assert "over 2 seeds" in text and "package AVX-512 off" in text and "| 5 |" in text
    assert seed_spread.main(argv) == 0  # finished seeds are not run again
    assert capsys.readouterr().out.count("done before") == 2


def test_bad_input_is_refused_in_one_line_before_running(tmp_path):
    config = tmp_path / "tiny.toml"
    config.write_text(TINY)
    out = ["--out", str(tmp_path / "out"), "--workdir", str(tmp_path / "work")]
    with pytest.raises(SystemExit, match="--config .* is not a file"):
        seed_spread.main(["--config", str(tmp_path / "none.toml"), *out])
    with pytest.raises(SystemExit, match="--seeds 'a-b'"):
        seed_spread.main(["--config", str(config), "--seeds", "a-b", *out])
    with pytest.raises(SystemExit, match="seed-spread: .*optim.lr"):
        seed_spread.main(["--config", str(config), "--override=--optim.lr=-1", *out])
    with pytest.raises(SystemExit, match="seed-spread: --cpus 'one': CPU numbers expected"):
        seed_spread.main(["--config", str(config), "--cpus", "one", *out])
    with pytest.raises(SystemExit, match="seed-spread: --cpus 4096: this process may use CPUs"):
        seed_spread.main(["--config", str(config), "--cpus", "4096", *out])
    assert not (tmp_path / "out").exists() and not (tmp_path / "work").exists()

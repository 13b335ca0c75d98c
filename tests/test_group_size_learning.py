"""benchmarks/group_size/learning.py (group-size-study --learning): the quick path end to end through the CLI, its
accounting against the runs' own files, the report rebuilt from the CSVs alone, resuming, and bad input."""

import csv
import json
import os
import shutil
from pathlib import Path

import pytest

from benchmarks.group_size import learning as gl
from grpo_kernels import cli


def _rows(path):
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def _jsonl(path):
    return [json.loads(line) for line in Path(path).read_text().splitlines()]


@pytest.fixture(scope="module")
def study(tmp_path_factory):
    root = tmp_path_factory.mktemp("learning")
    argv = ["group-size-study", "--learning", "--quick", "--out", str(root / "out"), "--workdir", str(root / "work"),
            "--cpus", str(min(os.sched_getaffinity(0)))]
    cli.main(argv)
    return root, argv


def test_quick_study_writes_every_file_and_counts_what_the_runs_did(study):
    root, _ = study
    out = root / "out" / "tiny"
    for name in ("curves.csv", "runs.csv", "summary.md", "success_vs_samples.png", "success_vs_time.png",
                 "time_to_target.png"):  # fmt: skip
        assert (out / name).stat().st_size > 0, name
    runs = {r["setting"]: r for r in _rows(out / "runs.csv")}
    assert set(runs) == {"2", "8"}
    for g in (2, 8):
        run = out / "runs" / f"{g}_seed0"
        steps, evals = _jsonl(run / "metrics.jsonl"), _jsonl(run / "eval.jsonl")
        assert [e["step"] for e in evals] == [1, 3]  # every 2 steps of 4
        curve = [r for r in _rows(out / "curves.csv") if r["setting"] == str(g)]
        assert [int(r["step"]) for r in curve] == [-1, 1, 3]
        assert [int(r["completions"]) for r in curve] == [0, 2 * 4 * g, 4 * 4 * g]  # 4 prompts x G per step
        assert int(curve[-1]["trained_tokens"]) == sum(m["completion_tokens"] for m in steps)
        assert int(curve[-1]["sampled_tokens"]) == evals[-1]["sampled_tokens"] >= int(curve[-1]["trained_tokens"])
        assert float(curve[-1]["eval_success"]) == evals[-1]["eval_success"]
        r = runs[str(g)]
        # the tiny model does not reach the target 1.0 in 4 steps: the row is the run's end
        assert r["reached"] == str(evals[-1]["eval_success"] >= 1.0) and int(r["steps"]) == 4
        assert float(r["invalid_rate"]) == pytest.approx(sum(m["invalid_group_rate"] for m in steps) / len(steps),
                                                         abs=1e-4)  # fmt: skip
        trained = [m for m in steps if not m.get("no_update")]
        assert float(r["all_zero_rate"]) == pytest.approx(
            sum(m["invalid_all_zero_rate"] for m in trained) / len(trained), abs=1e-4)  # fmt: skip
        assert all(m["invalid_all_zero_rate"] <= m["invalid_group_rate"] for m in trained)
    assert not list((root / "work").glob("*/checkpoints"))  # deleted once a run is done
    summary = (out / "summary.md").read_text()
    assert "## Held-out success at the first evaluation" in summary
    for g in (2, 8):
        first = next(r for r in _rows(out / "curves.csv") if r["setting"] == str(g) and int(r["step"]) >= 0)
        assert f"| {g} | 2 | {8 * g} | " in summary and f"| {float(first['eval_success']):.4g} |" in summary


def test_cpus_give_the_runs_one_thread_per_cpu_and_vllms_threads_bound_there():
    assert gl.number_list("0,2-3") == [0, 2, 3]
    env = gl.run_env("0-1")
    assert env["OMP_NUM_THREADS"] == "2" and env["VLLM_CPU_OMP_THREADS_BIND"] == "0,1"
    assert gl.run_env(None).get("OMP_NUM_THREADS") == os.environ.get("OMP_NUM_THREADS")  # untouched without


def test_plot_only_rebuilds_the_report_from_the_csvs_alone(study, tmp_path):
    root, argv = study
    copy = tmp_path / "tiny"
    shutil.copytree(root / "out" / "tiny", copy)
    shutil.rmtree(copy / "runs")
    for png in copy.glob("*.png"):
        png.unlink()
    (copy / "summary.md").unlink()
    # the same command (its --cpus too) gives the same report
    cli.main(["group-size-study", "--learning", "--quick", "--plot-only", "--out", str(tmp_path), *argv[-2:]])
    assert (copy / "summary.md").read_text() == (root / "out" / "tiny" / "summary.md").read_text()
    assert all((copy / p).stat().st_size > 0 for p in ("success_vs_samples.png", "time_to_target.png"))


def test_a_finished_run_is_not_run_again_and_a_cut_short_one_resumes(study, capsys):
    root, argv = study
    out = root / "out" / "tiny"
    before = (out / "curves.csv").read_text()
    capsys.readouterr()
    cli.main(argv)
    assert capsys.readouterr().out.count("done before") == 2 and (out / "curves.csv").read_text() == before
    # a run cut short: its checkpoint is in the workdir, its results are not
    kept = out / "runs" / "8_seed0"
    shutil.rmtree(kept)
    args = type("A", (), dict(gl.QUICK, adaptive_threshold=0.5, cpus=None))()
    work = root / "work" / "8_seed0"
    shutil.rmtree(work)
    cli.main(["train", *gl.run_overrides(args, "8", 0, work), "--optim.steps=4"])  # checkpoint at step 4
    (work / "summary.json").unlink()
    assert gl.train_run(args, "8", 0, root / "work", out) == "resumed"
    assert _jsonl(kept / "eval.jsonl")[-1]["step"] == 3 and not (work / "checkpoints").exists()


@pytest.mark.parametrize("extra, message", [
    (["--model", "tiny"], "--learning needs --target in (0, 1], got None"),
    (["--model", "tiny", "--target", "1.5"], "--learning needs --target in (0, 1], got 1.5"),
    ([], "--learning needs --model (or --quick)"),
    (["--model", "tiny", "--target", "0.5", "--max-steps", "0"], "--max-steps must be >= 1, got 0"),
    (["--quick", "--gradients"], "--learning and --gradients are separate studies"),
    (["--quick", "--cpus", "first"], "--cpus 'first': CPU numbers expected"),
    (["--quick", "--cpus", "4096"], "--cpus 4096: this process may use CPUs"),
    (["--quick", "--format-weight", "1.5"], "--format-weight 1.5 is not in [0, 1]"),
])  # fmt: skip
def test_bad_arguments_are_one_error_line(extra, message, capsys, tmp_path):
    with pytest.raises(SystemExit) as exc:
        cli.main(["group-size-study", "--learning", *extra, "--out", str(tmp_path), "--workdir", str(tmp_path / "w")])
    assert message in capsys.readouterr().err + str(exc.value.code)
    assert not (tmp_path / "w").exists()


def test_format_weight_reaches_the_runs_and_names_its_own_study(tmp_path):
    from grpo_kernels.train.config.io import load_config

    args = type("A", (), dict(gl.QUICK, adaptive_threshold=0.5, cpus=None, model="smollm2-135m", task="arith",
                              format_weight=0.0))()  # fmt: skip
    assert load_config(None, gl.run_overrides(args, "8", 0, tmp_path)).task.format_weight == 0.0
    args.format_weight = None  # the task's own bonus
    assert load_config(None, gl.run_overrides(args, "8", 0, tmp_path)).task.format_weight is None
    args.quick, args.format_weight = False, 0.0
    assert gl.command_of(args).endswith(" --format-weight 0")


def test_unknown_setting_is_an_error_before_anything_runs(tmp_path):
    with pytest.raises(SystemExit, match="unknown --settings 12x"):
        cli.main(["group-size-study", "--learning", "--model", "tiny", "--target", "0.5", "--settings", "8,12x",
                  "--out", str(tmp_path), "--workdir", str(tmp_path / "work")])  # fmt: skip
    assert not (tmp_path / "work").exists()


def test_adaptive_changes_report_when_g_grew_and_the_invalid_rate_around_it(tmp_path):
    """Every change of G in an adaptive run, with the mean invalid-group rate of the 5 steps before and from it (a
    step without an update counts as all invalid); a run whose G never changed gets its whole-run rate."""
    grew = tmp_path / "runs" / "adaptive_seed0"
    grew.mkdir(parents=True)
    rows = [{"step": i, "group_size": 8 if i < 6 else 16, "invalid_group_rate": 0.6 if i < 6 else 0.3,
             "invalid_all_zero_rate": 0.5 if i < 6 else 0.0} for i in range(12)]
    rows[3] = {"step": 3, "no_update": 1, "group_size": 8, "invalid_group_rate": 1.0}  # no split: nothing trained
    (grew / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    flat = tmp_path / "runs" / "adaptive_seed1"
    flat.mkdir()
    (flat / "metrics.jsonl").write_text("\n".join(json.dumps({"step": i, "group_size": 8, "invalid_group_rate": 0.2})
                                                  for i in range(4)))  # fmt: skip
    changes = gl.adaptive_changes(tmp_path)
    assert changes == [
        dict(run="adaptive_seed0", step=6, g_before=8, g_after=16, invalid_before=0.68, invalid_after=0.3,
             all_zero_before=0.5, all_zero_after=0.0),
        dict(run="adaptive_seed1", step=-1, g_before=8, g_after=8, invalid_before=0.2, invalid_after="",
             all_zero_before="", all_zero_after=""),  # a run from before the split was logged
    ]  # fmt: skip
    gl.write_csv(changes, tmp_path / "adaptive.csv", gl.ADAPTIVE_COLUMNS)  # the report reads them back from it
    table = "\n".join(gl.adaptive_table(gl._read_csv(tmp_path / "adaptive.csv")))
    assert "| adaptive_seed0 | 6 | 8 -> 16 | 0.68 | 0.3 | 0.5 | 0.0 |" in table
    assert "| adaptive_seed1 | - | 8 throughout | 0.2 (whole run) | - | - (whole run) | - |" in table


def test_interval_tables_pair_by_seed_and_mark_only_resolved_differences():
    from benchmarks.group_size.learning import interval_tables

    def run(setting, seed, steps, reached=True):
        return {"setting": setting, "seed": seed, "reached": reached, "steps": steps, "completions": 8 * steps,
                "model_gpu_s": steps / 10}  # fmt: skip

    # A is B + 4 steps on every seed (resolved however large the spread between seeds); C is B +- 1.
    runs = [run("A", s, 8 * s + 4) for s in range(1, 6)] + [run("B", s, 8 * s) for s in range(1, 6)]
    runs += [run("C", s, 8 * s + (-1) ** s) for s in range(1, 6)] + [run("D", 1, 4), run("D", 2, 60, reached=False)]
    lines = interval_tables(runs)
    rows = {line.split(" | ")[0].strip("| "): line for line in lines if line.startswith("| ")}
    assert "| 5 / 5 | 28.0 ± 15.7 |" in rows["A"]  # steps 12..44: sd 12.65, t(4) 2.776, / sqrt 5
    assert "| 1 / 2 | 4.0 |" in rows["D"]  # one seed reached: a mean, no interval
    assert "| 5 | **4.0 ± 0.0** |" in rows["A - B"]
    assert "**" not in rows["B - C"] and "| 5 | 0.2 ± 1.4 |" in rows["B - C"]  # +-1 alternating: not resolved
    assert not any(k.startswith("D") or k.endswith("D") for k in rows if " - " in k)  # D pairs with < 2 seeds

"""logging.report_to: a run writes its metrics to TensorBoard, W&B (offline) and Trackio (local) with the real
packages, under TRL GRPOTrainer's names against train/global_step, read back from what each package wrote; a resumed
run continues the same W&B / Trackio run; the names are TRL's own (read from trl's source)."""

import glob
import inspect
import json
import os
import re
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from grpo_kernels.train.config.io import load_config
from grpo_kernels.train.tracking import TRL_NAMES, check_installed, trl_names

STEPS = ["--optim.steps=3", "--task.eval_every=2", "--task.num_eval_prompts=16", "--sampling.group_size=4",
         "--sampling.prompts_per_step=4", "--model.num_layers=1", "--task.name=add", "--task.difficulty=1",
         "--task.sft_warmup_steps=60", "--sampling.max_new_tokens=4", "--checkpoint.every=2"]  # fmt: skip


def _train(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK")}
    env.update(WANDB_MODE="offline", WANDB_CONFIG_DIR=str(tmp_path / "wandb-config"),
               WANDB_CACHE_DIR=str(tmp_path / "wandb-cache"), WANDB_DATA_DIR=str(tmp_path / "wandb-data"),
               TRACKIO_DIR=str(tmp_path / "trackio"), HF_HUB_OFFLINE="1")  # fmt: skip
    proc = subprocess.run([sys.executable, "-m", "grpo_kernels.cli", "train", *args], capture_output=True, text=True,
                          timeout=600, env=env, cwd=tmp_path)  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def _wandb_records(path: Path):
    """The protobuf records of an offline W&B run file (.wandb: a 7-byte header, then LevelDB-log framed records in
    32 KiB blocks: crc32c, length, type FULL/FIRST/MIDDLE/LAST)."""
    from wandb.proto import wandb_internal_pb2

    raw, pos, parts = path.read_bytes(), 7, b""
    assert raw[:4] == b":W&B"
    while pos + 7 <= len(raw):
        if 32768 - pos % 32768 < 7:  # a block's tail too short for a header is padding
            pos += 32768 - pos % 32768
            continue
        _, length, kind = struct.unpack("<IHB", raw[pos : pos + 7])
        data, pos = raw[pos + 7 : pos + 7 + length], pos + 7 + length
        parts = data if kind in (1, 2) else parts + data
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(parts)
            yield record


def _wandb_run(run_file: Path) -> tuple[str, list[dict], dict]:
    """(run id, history rows, config) of an offline W&B run file."""
    run_id, history, config = None, [], {}
    for record in _wandb_records(run_file):
        kind = record.WhichOneof("record_type")
        if kind == "history":
            history.append({item.key or "/".join(item.nested_key): json.loads(item.value_json)
                            for item in record.history.item})  # fmt: skip
        elif kind == "run":
            run_id = record.run.run_id
            config.update({item.key: json.loads(item.value_json) for item in record.run.config.update})
        elif kind == "config":
            config.update({item.key: json.loads(item.value_json) for item in record.config.update})
    return run_id, history, config


def _trackio(tmp_path: Path, project: str, run: str) -> dict:
    """What Trackio stored locally (read in a process of its own: trackio fixes its directory when imported)."""
    code = ("import json; from trackio.sqlite_storage import SQLiteStorage as S; "
            f"print(json.dumps({{'logs': S.get_logs({project!r}, {run!r}), 'runs': S.get_runs({project!r}), "
            f"'config': S.get_run_config({project!r}, {run!r})}}, default=str))")  # fmt: skip
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True,
                         env={**os.environ, "TRACKIO_DIR": str(tmp_path / "trackio")})  # fmt: skip
    return json.loads(out.stdout.splitlines()[-1])


def _series(rows: list[dict], key: str) -> dict:
    """{global step: value} of one metric over logged rows."""
    return {row["train/global_step"]: row[key] for row in rows if key in row}


EXPECTED = {"reward": "train/reward", "reward_std": "train/reward_std", "invalid_group_rate":
            "train/frac_reward_zero_std", "entropy": "train/entropy", "completion_length":
            "train/completions/mean_length", "truncated_fraction": "train/completions/clipped_ratio", "lr":
            "train/learning_rate", "loss": "train/loss", "grad_norm": "train/grad_norm", "clip_ratio/region_mean":
            "train/clip_ratio/region_mean", "packing_efficiency": "train/packing_efficiency", "num_tokens":
            "train/num_tokens"}  # fmt: skip


def test_report_to_logs_trl_names_to_tensorboard_wandb_and_trackio_offline_and_resumes_the_same_run(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run = tmp_path / "run"
    _train(tmp_path, f"--logging.run_dir={run}", "--logging.report_to=tensorboard,wandb,trackio",
           "--logging.project=gk-test", *STEPS)  # fmt: skip
    lines = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    evals = [json.loads(line) for line in (run / "eval.jsonl").read_text().splitlines()]
    assert [m["step"] for m in lines] == [0, 1, 2] and min(m["reward_std"] for m in lines) > 0  # rewards vary
    # num_tokens, cumulative as TRL's: each step adds its 16 rows' prompt ids ("a+b=", one length at difficulty 1)
    # and its completion tokens
    added = [m["num_tokens"] - before for m, before in zip(lines, [0] + [m["num_tokens"] for m in lines], strict=False)]
    assert all(a > m["completion_tokens"] and (a - m["completion_tokens"]) % 16 == 0 for a, m in zip(added, lines,
                                                                                                    strict=True))
    expected = {trl: {m["step"] + 1: m[ours] for m in lines} for ours, trl in EXPECTED.items()}
    expected_eval = {0: json.loads((run / "summary.json").read_text())["eval_success_start"],
                     **{e["step"] + 1: e["eval_success"] for e in evals}}  # fmt: skip
    assert sorted(expected_eval) == [0, 2, 3]

    # TensorBoard (float32 scalars)
    events = EventAccumulator(str(run / "tensorboard"))
    events.Reload()
    for key, want in expected.items():
        got = {e.step: e.value for e in events.Scalars(key)}
        assert got == pytest.approx(want, rel=1e-6), key
    assert {e.step: e.value for e in events.Scalars("eval/success")} == pytest.approx(expected_eval)
    assert "config" in "".join(events.Tags()["tensors"])

    # W&B, offline: the run file it wrote
    (first,) = glob.glob(str(run / "wandb" / "offline-run-*" / "run-*.wandb"))
    run_id, history, config = _wandb_run(Path(first))
    for key, want in expected.items():
        assert _series(history, key) == pytest.approx(want, rel=1e-12), key
    assert _series(history, "eval/success") == pytest.approx(expected_eval)
    assert config["sampling"]["group_size"] == 4 and config["logging"]["report_to"] == ["tensorboard", "wandb",
                                                                                         "trackio"]  # fmt: skip

    # Trackio, local database
    stored = _trackio(tmp_path, "gk-test", "run")
    for key, want in expected.items():
        assert {row["step"]: row[key] for row in stored["logs"] if key in row} == pytest.approx(want, rel=1e-12), key
    assert stored["config"]["task"]["name"] == "add"

    # Resumed from step 2's checkpoint: the third step is logged again, to the same W&B id and Trackio run
    _train(tmp_path, "--resume", str(run), "--checkpoint.resume_step=2")
    runs = sorted(glob.glob(str(run / "wandb" / "offline-run-*" / "run-*.wandb")))
    assert len(runs) == 2 and {_wandb_run(Path(r))[0] for r in runs} == {run_id}
    again = _wandb_run(Path(next(r for r in runs if r != first)))[1]
    assert _series(again, "train/reward") == pytest.approx({3: expected["train/reward"][3]})
    resumed = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [m["num_tokens"] for m in resumed] == [m["num_tokens"] for m in lines]  # the count is checkpointed
    stored = _trackio(tmp_path, "gk-test", "run")
    assert stored["runs"] == ["run"]
    assert [row["step"] for row in stored["logs"] if "train/reward" in row] == [1, 2, 3, 3]


def test_the_names_are_trl_grpo_trainers_own():
    from trl.trainer import grpo_trainer

    logged = set(re.findall(r'_metrics\[mode\]\["([^"]+)"\]', inspect.getsource(grpo_trainer)))
    from_trainer = {"loss", "grad_norm", "learning_rate"}  # transformers' Trainer logs these
    assert set(TRL_NAMES.values()) - from_trainer <= logged, set(TRL_NAMES.values()) - from_trainer - logged
    assert {"reward", "reward_std", "frac_reward_zero_std", "entropy", "completions/clipped_ratio"} <= logged


def test_trl_names_renames_and_keeps_only_finite_numbers():
    line = {"step": 4, "reward": 0.5, "invalid_group_rate": 0.25, "lr": 1e-5, "micro_batches": 2, "no_update": 1,
            "grad_norm": float("nan"), "note": "x", "flag": True}  # fmt: skip
    assert trl_names(line) == {"train/reward": 0.5, "train/frac_reward_zero_std": 0.25, "train/learning_rate": 1e-5,
                               "train/micro_batches": 2, "train/no_update": 1}  # fmt: skip


@pytest.mark.parametrize("overrides, message", [
    (["--logging.report_to=mlflow"], "'mlflow' is not a tracker here; one of 'tensorboard', 'wandb', 'trackio'"),
    (["--logging.report_to=wandb,wandb"], "names a tracker twice"),
    (["--logging.report_to=none,wandb"], 'names a tracker twice or with "none"'),
    (["--logging.project= "], "logging.project must be a non-empty name"),
])  # fmt: skip
def test_report_to_refusals(overrides, message):
    with pytest.raises(ValueError, match=message):
        load_config(overrides=overrides)


def test_report_to_forms_and_the_tensorboard_alias(tmp_path):
    assert load_config(overrides=["--logging.report_to=none"]).logging.report_to == ()
    assert load_config(overrides=["--logging.report_to=wandb, trackio"]).logging.report_to == ("wandb", "trackio")
    assert load_config(overrides=["--logging.tensorboard=true"]).logging.report_to == ("tensorboard",)
    toml = tmp_path / "run.toml"
    toml.write_text('[logging]\nreport_to = "wandb"\n')  # TRL takes one name as a string too
    assert load_config(toml).logging.report_to == ("wandb",)
    toml.write_text('[logging]\nreport_to = ["tensorboard", "wandb"]\ntensorboard = true\n')
    assert load_config(toml).logging.report_to == ("tensorboard", "wandb")


def test_a_missing_tracker_package_names_its_extra(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    with pytest.raises(ValueError, match=r"needs the wandb package: pip install 'grpo-kernels\[wandb\]'"):
        check_installed(("tensorboard", "wandb"))
    check_installed(("tensorboard",))


def test_report_to_all_is_every_installed_tracker_resolved_before_the_run(monkeypatch):
    """ "all" is checked at load (it stands alone) and resolved by preflight.check, which asks what is installed."""
    from grpo_kernels.train import preflight, tracking

    def resolved():
        return preflight.check(load_config(overrides=["--logging.report_to=all"]), "cpu").logging.report_to

    assert load_config(overrides=["--logging.report_to=all"]).logging.report_to == ("all",)
    assert resolved() == ("tensorboard", "wandb", "trackio")
    with pytest.raises(ValueError, match='"all" stands alone'):
        load_config(overrides=["--logging.report_to=all,wandb"])
    monkeypatch.setattr(tracking, "_installed", lambda name: name == "wandb")
    assert resolved() == ("wandb",)
    monkeypatch.setattr(tracking, "_installed", lambda name: False)
    with pytest.warns(UserWarning, match="none of tensorboard, wandb, trackio is installed"):
        assert resolved() == ()

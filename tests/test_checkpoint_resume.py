"""Resuming from a damaged checkpoint: every file is checked against the checkpoint's manifest (size, sha256), a
damaged one is one error line naming it and the explicit fallback (checkpoint.resume_step), a trainer state of
another step is refused, and a config that changes the run is refused unless checkpoint.allow_config_change; a
kill at any point of a checkpoint write still leaves an intact latest checkpoint."""

import json
import shutil
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint import CheckpointException

from grpo_kernels.cli import main
from grpo_kernels.train import checkpoint as ckpt
from grpo_kernels.train import trainer
from grpo_kernels.train.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint, verify_checkpoint
from grpo_kernels.train.config.io import load_config
from grpo_kernels.train.data.tasks import CharTokenizer, tiny_model
from grpo_kernels.train.model.fsdp import SINGLE
from grpo_kernels.train.model.policy import Policy
from grpo_kernels.train.rollout import colocated

ARGS = ["--optim.steps=2", "--optim.lr=1e-2", "--sampling.group_size=8", "--sampling.prompts_per_step=2",
        "--sampling.max_new_tokens=4", "--task.name=add", "--task.sft_warmup_steps=40", "--task.num_eval_prompts=2",
        "--task.num_train_prompts=16", "--model.hidden_size=32", "--model.num_layers=1", "--packing.token_budget=48",
        "--checkpoint.every=1", "--logging.completions_every=1"]  # fmt: skip
SHARD = "__0_0.distcp"
DROP = trainer.TIMING_METRICS


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A finished 2-step run with checkpoints step_1 and step_2 (never modified: tests copy it)."""
    run = tmp_path_factory.mktemp("trained") / "run"
    trainer.train(load_config(None, [*ARGS, f"--logging.run_dir={run}"]), log=lambda *a: None)
    return run


@pytest.fixture
def run(trained, tmp_path):
    out = tmp_path / "run"
    shutil.copytree(trained, out)
    return out


def _resume_error(run, *extra) -> str:
    with pytest.raises(SystemExit) as info:
        main(["train", "--resume", str(run), *extra])
    message = str(info.value.code)
    assert message.startswith("grpo-kernels train: error: ") and "\n" not in message, message
    return message


def _metrics(run):
    return [{k: v for k, v in json.loads(line).items() if k not in DROP}
            for line in (run / "metrics.jsonl").read_text().splitlines()]  # fmt: skip


def _weights(checkpoint):
    policy = Policy(tiny_model(CharTokenizer().vocab_size, hidden_size=32, num_layers=1))
    load_checkpoint(checkpoint, policy=policy, optimizer=torch.optim.AdamW(policy.parameters()), ref_policy=None)
    return {k: v.detach().clone() for k, v in policy.state_dict().items()}


def _truncate(path: Path, keep: int) -> None:
    path.write_bytes(path.read_bytes()[:keep])


def _flip_4k(path: Path) -> None:
    data = bytearray(path.read_bytes())
    start = len(data) // 2
    data[start : start + 4096] = bytes(b ^ 0xFF for b in data[start : start + 4096])
    path.write_bytes(bytes(data))


DAMAGES = {
    "deleted_shard": (SHARD, lambda p: p.unlink(), "is missing"),
    "truncated_shard": (SHARD, lambda p: _truncate(p, 1000), "is truncated (1000 bytes"),
    "truncated_metadata": (".metadata", lambda p: _truncate(p, 100), "is truncated (100 bytes"),
    "deleted_metadata": (".metadata", lambda p: p.unlink(), "is missing"),
    "flipped_4k_in_shard": (SHARD, _flip_4k, "does not match its sha256"),
    "deleted_manifest": ("manifest.json", lambda p: p.unlink(), "is missing"),
    "truncated_manifest": ("manifest.json", lambda p: _truncate(p, 50), "cannot be read"),
}


@pytest.mark.parametrize("damage", list(DAMAGES))
def test_a_damaged_checkpoint_file_is_one_error_line_naming_it_and_the_fallback(run, damage):
    name, hurt, problem = DAMAGES[damage]
    hurt(run / "checkpoints" / "step_2" / name)
    message = _resume_error(run)
    assert f"damaged checkpoint: {run / 'checkpoints' / 'step_2' / name} {problem}" in message, message
    assert message.endswith("add --checkpoint.resume_step=1"), message


def test_an_edited_trainer_state_step_is_refused(run):
    state_file = run / "checkpoints" / "step_2" / "trainer_state.json"
    state = json.loads(state_file.read_text())
    state_file.write_text(json.dumps({**state, "step": 1}))
    message = _resume_error(run)
    assert f"{state_file} does not match its sha256" in message, message
    ckpt._write_manifest(state_file.parent, 2, None)  # a consistent manifest of a wrong trainer state
    message = _resume_error(run)
    assert f"{state_file} names step 1, but the checkpoint is of step 2" in message, message


def test_a_checkpoint_under_another_step_directory_is_refused(run):
    root = run / "checkpoints"
    shutil.rmtree(root / "step_2")
    (root / "step_1").rename(root / "step_2")
    message = _resume_error(run)
    assert f"{root / 'step_2' / 'manifest.json'} was written for step 1, but the directory is step_2" in message
    assert "there is no earlier checkpoint to fall back to" in message


def test_resuming_with_a_changed_group_size_is_refused_naming_the_field(run):
    message = _resume_error(run, "--sampling.group_size=4")
    assert "the config differs from the one step_2 was saved with, in sampling.group_size 8 -> 4:" in message
    assert "--checkpoint.allow_config_change=true" in message
    assert "group_size = 8" in (run / "config.toml").read_text()  # nothing written


def test_allow_config_change_resumes_with_a_warning_line(run, capsys):
    main(["train", "--resume", str(run), "--sampling.group_size=4", "--optim.steps=3",
          "--checkpoint.allow_config_change=true"])  # fmt: skip
    out = capsys.readouterr().out
    warning = [line for line in out.splitlines() if line.startswith("warning:")]
    assert warning == ["warning: resuming step_2 with a changed config (checkpoint.allow_config_change): "
                       "sampling.group_size 8 -> 4; optim.steps 2 -> 3"], out  # fmt: skip
    assert [r["group_size"] for r in _metrics(run)] == [8, 8, 4]
    text = (run / "config.toml").read_text()
    assert "group_size = 4" in text and "allow_config_change = false" in text  # the override is used once
    message = _resume_error(run, "--sampling.group_size=8")  # step_3 was saved with the new config
    assert "sampling.group_size 4 -> 8" in message, message


def test_run_neutral_fields_may_change_on_resume(run, capsys):
    main(["train", "--resume", str(run), "--logging.log_every=5", "--checkpoint.every=2"])
    assert "warning" not in capsys.readouterr().out


def test_resume_step_falls_back_to_the_previous_checkpoint_and_replays_exactly(run, trained):
    _flip_4k(run / "checkpoints" / "step_2" / SHARD)
    main(["train", "--resume", str(run), "--checkpoint.resume_step=1"])
    assert _metrics(run) == _metrics(trained)
    texts = (run / "completions.jsonl").read_text()  # the replayed step's lines replace the dropped ones
    assert texts == (trained / "completions.jsonl").read_text() and len(texts.splitlines()) == 2 * 16
    verify_checkpoint(run / "checkpoints" / "step_2")  # the damaged checkpoint was written again
    before, after = _weights(trained / "checkpoints" / "step_1"), _weights(run / "checkpoints" / "step_2")
    assert any(not torch.equal(before[k], after[k]) for k in after), "the replayed step changed nothing"
    expected = _weights(trained / "checkpoints" / "step_2")
    assert all(torch.equal(expected[k], after[k]) for k in expected)
    assert "resume_step =" not in (run / "config.toml").read_text()  # used once: a later resume takes the latest


def test_resume_step_without_that_checkpoint_is_an_error(run):
    message = _resume_error(run, "--checkpoint.resume_step=7")
    assert "checkpoint.resume_step: no checkpoint step_7 in" in message and "step_1, step_2" in message


def test_resume_step_needs_resume():
    with pytest.raises(ValueError, match="checkpoint.resume_step must be none unless checkpoint.resume is set"):
        load_config(None, ["--checkpoint.resume_step=1"])


class Killed(BaseException):
    pass


@pytest.mark.parametrize("again", [False, True], ids=["new_step", "step_saved_again"])
def test_a_kill_at_any_point_of_a_checkpoint_write_leaves_an_intact_latest_checkpoint(tmp_path, monkeypatch, again):
    """Every file-system call of save_checkpoint (write, fsync, rename, delete) is in turn the point of a kill."""
    policy = Policy(tiny_model(CharTokenizer().vocab_size, hidden_size=32, num_layers=1))
    optimizer = torch.optim.AdamW(policy.parameters())

    def save(run, step):
        save_checkpoint(run, step, policy=policy, optimizer=optimizer, ref_policy=None,
                        trainer_state={"step": step}, d=SINGLE, config=None)  # fmt: skip

    calls = {"n": 0, "kill_at": None}

    def dies(fn):
        def wrapper(*a, **k):
            calls["n"] += 1
            if calls["n"] == calls["kill_at"]:
                raise Killed
            return fn(*a, **k)

        return wrapper

    import torch.distributed.checkpoint as dcp  # what save_checkpoint imports when it saves

    for module, name in [(dcp, "save"), (ckpt.os, "replace"), (ckpt.os, "fsync"), (Path, "rename"),
                         (Path, "write_text"), (ckpt.shutil, "rmtree"), (ckpt, "_sha256")]:  # fmt: skip
        monkeypatch.setattr(module, name, dies(getattr(module, name)))
    kill_at, finished = 1, False
    while not finished:
        run = tmp_path / f"kill_{kill_at}"
        calls["kill_at"] = None
        save(run, 1)
        if again:
            save(run, 2)
        calls["n"], calls["kill_at"] = 0, kill_at
        try:
            save(run, 2)
            finished = True
        except (Killed, CheckpointException):  # DCP wraps what kills its own writes
            pass
        calls["kill_at"] = None
        latest = latest_checkpoint(run)
        assert latest.name in ("step_1", "step_2"), kill_at
        assert verify_checkpoint(latest)["step"] == int(latest.name[5:]), kill_at
        kill_at += 1
    assert kill_at > 10, kill_at  # the kills covered the whole write


def test_keep_last_deletes_the_older_checkpoints_after_each_save(tmp_path):
    run = tmp_path / "run"
    trainer.train(load_config(None, [*ARGS, "--optim.steps=3", "--checkpoint.keep_last=2", f"--logging.run_dir={run}"]),
                  log=lambda *a: None)  # fmt: skip
    assert [p.name for p in ckpt.list_checkpoints(run)] == ["step_2", "step_3"]
    verify_checkpoint(run / "checkpoints" / "step_3")
    # a resume from step 2 saves step 3 again; keep_last = 1 then leaves only it (and never a later step)
    main(["train", "--resume", str(run), "--checkpoint.resume_step=2", "--checkpoint.keep_last=1"])
    assert [p.name for p in ckpt.list_checkpoints(run)] == ["step_3"]


def test_keep_last_does_not_touch_checkpoints_of_later_steps(tmp_path):
    run = tmp_path / "run"
    trainer.train(load_config(None, [*ARGS, "--optim.steps=3", f"--logging.run_dir={run}"]), log=lambda *a: None)
    shutil.rmtree(run / "checkpoints" / "step_3")
    (run / "checkpoints" / "step_9").mkdir()  # a later step (as left by an abandoned branch of the run)
    main(["train", "--resume", str(run), "--checkpoint.resume_step=1", "--checkpoint.keep_last=1"])
    assert [p.name for p in ckpt.list_checkpoints(run)] == ["step_3", "step_9"]


def test_a_resumed_run_keeps_the_earlier_steps_lines_on_disk_before_its_first_step(run, trained, monkeypatch):
    """A resume drops the log lines of the steps after its checkpoint. The ones before it must be on disk before
    the first new step runs: a run killed during that step (here: it fails there) keeps its history."""
    on_disk = {}

    def killed(*args, **kwargs):
        on_disk.update({name: (run / name).read_text() for name in ("metrics.jsonl", "completions.jsonl")})
        raise KeyboardInterrupt

    monkeypatch.setattr(colocated, "collect", killed)
    with pytest.raises(KeyboardInterrupt):
        main(["train", "--resume", str(run), "--checkpoint.resume_step=1"])
    for name in ("metrics.jsonl", "completions.jsonl"):
        want = [line for line in (trained / name).read_text().splitlines() if json.loads(line)["step"] < 1]
        assert want and on_disk[name].splitlines() == want, name

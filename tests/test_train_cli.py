"""`grpo-kernels train` end to end on the tiny model (a few steps), and its one-line errors."""

import json
import subprocess
import sys

import pytest

from grpo_kernels.cli import main


def test_a_few_training_steps_write_metrics_and_summary(tmp_path):
    run = tmp_path / "run"
    main(["train", f"--logging.run_dir={run}", "--optim.steps=3", "--sampling.group_size=4",
          "--sampling.prompts_per_step=3", "--sampling.max_new_tokens=4", "--task.name=add",
          "--task.sft_warmup_steps=5", "--task.num_eval_prompts=8", "--packing.token_budget=64"])  # fmt: skip
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert all(r["loss"] == r["loss"] and 0 <= r["reward"] <= 1 and r["micro_batches"] >= 1 for r in rows)
    summary = json.loads((run / "summary.json").read_text())
    assert set(summary) >= {"eval_success_start", "eval_success_end"}
    assert (run / "config.toml").exists()


@pytest.mark.parametrize(
    "args,message",
    [
        (["--sampling.group_size=1"], "sampling.group_size"),
        (["--loss.loss_type=ppo"], "loss.loss_type"),
        (["--optim.lr=-1"], "optim.lr"),
        (["--packing.token_budget=8"], "packing.token_budget (8) is smaller than the longest prompt"),
        (["--model.name=/no/such/model"], "/no/such/model"),
        (["--task.name=jsonl", "--task.path=BAD_JSONL"], "missing"),
        (["--task.name=jsonl", "--task.path=/no/such.jsonl"], "cannot read /no/such.jsonl"),
        (["--task.reward=numeric"], "task.reward"),
    ],
)
def test_bad_config_or_data_is_one_error_line_and_nothing_written(tmp_path, args, message):
    run = tmp_path / "run"
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "1+1=", "answer": "2"}\n{"prompt": "2+2="}\n')
    args = [a.replace("BAD_JSONL", str(bad)) for a in args]
    proc = subprocess.run([sys.executable, "-m", "grpo_kernels.cli", "train", f"--logging.run_dir={run}", *args],
                          capture_output=True, text=True)  # fmt: skip
    assert proc.returncode != 0
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("grpo-kernels train: error:") and message in lines[0], lines
    assert not run.exists()


def test_plot_writes_the_pngs_and_refuses_a_non_run(tmp_path):
    rows = [{"step": i, "reward": i / 10, "invalid_group_rate": 0.1, "train_tokens_per_s": 1000.0} for i in range(10)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "summary.json").write_text(json.dumps({"group_size": 8}))
    main(["plot", str(tmp_path)])
    assert all((tmp_path / name).stat().st_size > 0 for name in ("reward.png", "invalid_groups.png", "throughput.png"))
    with pytest.raises(SystemExit, match="no metrics.jsonl"):
        main(["plot", str(tmp_path / "nothing")])


def test_the_h100_example_loads_and_its_launch_script_runs_that_config():
    import importlib.util
    from pathlib import Path

    from grpo_kernels.train.config.io import load_config

    examples = Path(__file__).resolve().parents[1] / "examples"
    config = load_config(examples / "train_qwen_gsm8k_h100.toml")
    assert (config.sampling.sampler, config.model.dtype, config.distributed.backend) == ("vllm", "bfloat16", "nccl")
    script = (examples / "launch_qwen_gsm8k_h100.sh").read_text()
    assert "--config examples/train_qwen_gsm8k_h100.toml" in script
    assert subprocess.run(["bash", "-n", str(examples / "launch_qwen_gsm8k_h100.sh")]).returncode == 0
    spec = importlib.util.spec_from_file_location("prepare_gsm8k", examples / "prepare_gsm8k.py")
    prepare = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(prepare)
    row = prepare.to_row({"question": "Tom has 2 apples... ", "answer": "2 + 1,000 = <<2+1000=1002>>1002\n#### 1,002"})
    assert row["answer"] == "1002" and row["prompt"].startswith("Tom has 2 apples...\n")


def test_the_demo_config_loads():
    from pathlib import Path

    from grpo_kernels.train.config.io import load_config

    config = load_config(Path(__file__).resolve().parents[1] / "examples" / "train_tiny_cpu.toml")
    assert config.task.name == "add" and config.optim.steps == 800


def _short_run(run, *extra):
    main(["train", f"--logging.run_dir={run}", "--optim.steps=2", "--sampling.group_size=4",
          "--sampling.prompts_per_step=4", "--sampling.max_new_tokens=4", "--task.sft_warmup_steps=60",
          "--task.num_eval_prompts=4", "--packing.token_budget=64", "--optim.lr=1e-2", *extra])  # fmt: skip
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def test_a_local_hf_model_directory_trains_on_jsonl_data(tmp_path):
    from grpo_kernels.train.model.hf import write_tiny_checkpoint

    model = write_tiny_checkpoint(tmp_path / "model")
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"{a}+{b}=", "answer": str(a + b)}) + "\n"
                            for a in range(10) for b in range(10)))  # fmt: skip
    rows = _short_run(tmp_path / "run", f"--model.name={model}", "--task.name=jsonl", f"--task.path={data}",
                      "--task.reward=numeric", "--task.num_train_prompts=50")  # fmt: skip
    assert [r["step"] for r in rows] == [0, 1] and all(r["loss"] == r["loss"] for r in rows)


def test_beta_trains_against_a_frozen_reference(tmp_path):
    rows = _short_run(tmp_path / "run", "--task.name=add", "--loss.beta=0.5", "--optim.steps=3")
    # model.dtype "auto" (the default) trains in fp32 on the CPU, and config.toml says so
    assert 'dtype = "float32"' in (tmp_path / "run" / "config.toml").read_text()
    assert abs(rows[0]["kl"]) < 1e-6  # the policy is the reference before the first update
    assert rows[2]["kl"] > 1e-6  # and moves away from it, which the KL term sees


def test_bfloat16_compute_keeps_fp32_master_weights(tmp_path):
    rows = _short_run(tmp_path / "run", "--task.name=add", "--model.dtype=bfloat16", "--checkpoint.every=2")
    assert all(r["loss"] == r["loss"] for r in rows)
    learning = [r for r in rows if r["invalid_group_rate"] < 1]  # a step whose groups are all invalid has no gradient
    assert learning and all(r["grad_norm"] > 0 for r in learning)
    assert 'dtype = "bfloat16"' in (tmp_path / "run" / "config.toml").read_text()
    from torch.distributed.checkpoint import FileSystemReader

    meta = FileSystemReader(str(tmp_path / "run" / "checkpoints" / "step_2")).read_metadata()
    dtypes = {str(v.properties.dtype) for k, v in meta.state_dict_metadata.items() if k.startswith("model.")}
    assert dtypes == {"torch.float32"}


def test_tensorboard_gets_every_metric_of_every_step(tmp_path):
    """logging.tensorboard = true (report_to's alias): every metric of every line, under train/ and TRL's names
    (grpo_kernels.train.tracking), at global step = step + 1."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from grpo_kernels.train.tracking import trl_names

    rows = _short_run(tmp_path / "run", "--task.name=add", "--logging.tensorboard=true")
    events = EventAccumulator(str(tmp_path / "run" / "tensorboard"))
    events.Reload()
    evals = {"eval/success", "eval/success_se", "eval/scored", "eval/unscorable",
             "eval/rewards/numeric/mean"}  # add's reward function: "numeric"
    assert set(events.Tags()["scalars"]) == set(trl_names(rows[0])) | evals
    assert {"train/reward", "train/frac_reward_zero_std", "train/entropy"} <= set(events.Tags()["scalars"])
    assert [(e.step, e.value) for e in events.Scalars("train/reward")] == pytest.approx(
        [(r["step"] + 1, r["reward"]) for r in rows])  # fmt: skip


def test_completions_every_writes_each_completion_of_those_steps_with_its_reward(tmp_path):
    rows = _short_run(tmp_path / "run", "--task.name=add", "--optim.steps=3", "--logging.completions_every=2")
    texts = [json.loads(line) for line in (tmp_path / "run" / "completions.jsonl").read_text().splitlines()]
    assert [t["step"] for t in texts] == [0] * 16 + [2] * 16  # G = 4 x 4 prompts, steps 0 and 2
    for step in (0, 2):
        mine = [t for t in texts if t["step"] == step]
        assert [t["group"] for t in mine] == [k for k in range(4) for _ in range(4)]
        assert all(t["prompt"].endswith("=") and len(t["completion"]) <= t["tokens"] <= 4 for t in mine)
        assert sum(t["reward"] for t in mine) / 16 == pytest.approx(rows[step]["reward"])


@pytest.mark.parametrize("where", ["a file", "under a file"])
def test_a_run_dir_that_cannot_be_a_directory_is_one_error_line(tmp_path, where):
    (tmp_path / "file").write_text("")
    run = tmp_path / "file" if where == "a file" else tmp_path / "file" / "run"
    with pytest.raises(SystemExit) as info:
        main(["train", f"--logging.run_dir={run}", "--optim.steps=1"])
    message = str(info.value)
    blocked = tmp_path / "file"
    expected = "is a file, not a directory" if where == "a file" else f"cannot be created: {blocked} is a file"
    assert message.startswith("grpo-kernels train: error: logging.run_dir ") and expected in message, message
    assert "\n" not in message and (tmp_path / "file").read_text() == ""


@pytest.mark.parametrize("run_dir", ["/proc/grpo-kernels-run", "/proc/grpo-kernels-a/b"])
def test_a_run_dir_the_system_refuses_is_one_error_line_even_for_root(run_dir):
    """/proc passes a permission check (as root) but refuses mkdir: one line at start-up (before: a traceback from
    the first write, after the model was built)."""
    with pytest.raises(SystemExit) as info:
        main(["train", f"--logging.run_dir={run_dir}", "--optim.steps=1"])
    message = str(info.value)
    assert message.startswith(f"grpo-kernels train: error: logging.run_dir {run_dir} cannot be created or written: ")
    assert "\n" not in message


def test_a_missing_run_dir_is_probed_and_left_as_it_was(tmp_path, monkeypatch):
    """The start-up probe creates the missing directories and removes them again (here the run then fails)."""
    from grpo_kernels.train import run_files

    probed, real = [], run_files._try_writing
    monkeypatch.setattr(run_files, "_try_writing", lambda *a: probed.append(a[0]) or real(*a))
    with pytest.raises(SystemExit, match="model path /nonexistent/m does not exist"):
        main(["train", f"--logging.run_dir={tmp_path / 'a' / 'b'}", "--optim.steps=1", "--model.name=/nonexistent/m"])
    assert probed == [tmp_path / "a" / "b"] and list(tmp_path.iterdir()) == []


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="nccl is a valid choice with CUDA")
def test_nccl_backend_without_cuda_is_refused_in_a_single_process_too(tmp_path):
    """Without torchrun no backend is used, so distributed.backend = nccl on a CPU ran silently; it is an error."""
    with pytest.raises(SystemExit) as info:
        main(["train", f"--logging.run_dir={tmp_path / 'run'}", "--optim.steps=1", "--distributed.backend=nccl"])
    message = "grpo-kernels train: error: distributed.backend = nccl needs CUDA; use gloo (or auto) on CPU"
    assert str(info.value) == message
    assert not (tmp_path / "run").exists()


def test_an_error_mid_run_closes_every_log_file_and_tracker(tmp_path, monkeypatch):
    """The run's resources are closed on every exit path: a step that raises leaves no log file open and the
    trackers closed (a W&B run finished), with the first step's metrics line on disk."""
    from grpo_kernels.train import run_files, tracking, trainer

    opened, closed, steps = [], [], []
    log_file = run_files.log_file
    monkeypatch.setattr(run_files, "log_file", lambda path, kept: opened.append(log_file(path, kept)) or opened[-1])

    class FakeTrackers:
        def log(self, *a, **k):
            pass

        def log_eval(self, *a, **k):
            pass

        def close(self):
            closed.append("trackers")

    monkeypatch.setattr(tracking.Trackers, "start", staticmethod(lambda *a, **k: FakeTrackers()))
    step = trainer.grpo_step

    def failing_step(*args, **kwargs):
        steps.append(1)
        if len(steps) == 2:
            raise RuntimeError("the second step fails")
        return step(*args, **kwargs)

    monkeypatch.setattr(trainer, "grpo_step", failing_step)
    with pytest.raises(RuntimeError, match="the second step fails"):
        _short_run(tmp_path / "run", "--task.name=add", "--logging.completions_every=1", "--task.eval_every=1")
    assert len(opened) == 3 and all(f.closed for f in opened) and closed == ["trackers"]
    assert [json.loads(line)["step"] for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()] == [0]


def test_an_error_in_the_final_evaluation_closes_the_vllm_engine_and_the_process_group(tmp_path, monkeypatch):
    """Every resource is on train()'s one stack: when the final held-out evaluation raises, the colocated vLLM
    sampler is still shut down, and after it the process group is ended (both used to run after that evaluation,
    on the success path only). A one-rank gloo group in this process; the engine is the HF sampler with a recording
    close(), standing in for vLLM's."""
    import dataclasses

    import torch.distributed as dist

    from grpo_kernels.train import run_files
    from grpo_kernels.train.rollout import colocated
    from grpo_kernels.train.rollout import server as rollout_server

    closed, opened, evaluations = [], [], []

    class RecordingSampler:
        def __init__(self, sampler):
            self.sampler = sampler

        def sample(self, *args, **kwargs):
            return self.sampler.sample(*args, **kwargs)

        def load_weights(self, state_dict):
            self.sampler.load_weights(state_dict)

        def close(self):
            closed.append(("sampler", dist.is_initialized()))

    real_make_sampler = colocated.make_sampler

    def make_sampler(config, model, tok, d):
        hf = dataclasses.replace(config, sampling=dataclasses.replace(config.sampling, sampler="hf"))
        return RecordingSampler(real_make_sampler(hf, model, tok, d))

    held_out = colocated.held_out

    def failing_held_out(*args, **kwargs):
        evaluations.append(1)
        if len(evaluations) == 2:  # the first is the one before RL, the second the final one
            raise RuntimeError("the final evaluation fails")
        return held_out(*args, **kwargs)

    log_file = run_files.log_file
    monkeypatch.setattr(run_files, "log_file", lambda path, kept: opened.append(log_file(path, kept)) or opened[-1])
    monkeypatch.setattr(colocated, "make_sampler", make_sampler)
    monkeypatch.setattr(colocated, "held_out", failing_held_out)
    for name, value in {"WORLD_SIZE": "1", "RANK": "0", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
                        "MASTER_PORT": str(rollout_server.free_port())}.items():  # fmt: skip
        monkeypatch.setenv(name, value)
    try:
        with pytest.raises(RuntimeError, match="the final evaluation fails"):
            _short_run(tmp_path / "run", "--task.name=add", "--sampling.sampler=vllm", "--task.eval_every=0",
                       "--distributed.backend=gloo")  # fmt: skip
        assert len(evaluations) == 2 and closed == [("sampler", True)]
        assert not dist.is_initialized()
        assert opened and all(f.closed for f in opened)
        assert not (tmp_path / "run" / "summary.json").exists()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def test_run_files_are_replaced_whole_never_written_through_a_planted_symlink(tmp_path):
    """config.toml, summary.json and (checkpoints') manifests go through a temporary file and one rename: a symlink
    someone planted at their names is replaced, the file it pointed to left alone."""
    run, victim = tmp_path / "run", tmp_path / "victim.txt"
    run.mkdir()
    victim.write_text("not yours")
    for name in ("config.toml", "summary.json"):
        (run / name).symlink_to(victim)
    _short_run(run, "--checkpoint.every=2")
    assert victim.read_text() == "not yours"
    for name in ("config.toml", "summary.json"):
        assert not (run / name).is_symlink() and (run / name).stat().st_mode & 0o777 == 0o644
    assert json.loads((run / "summary.json").read_text())["steps"] == 2
    assert not [p.name for p in run.iterdir() if p.name.endswith(".tmp")]


def test_a_damaged_tracking_file_is_one_line_at_resume(tmp_path):
    run = tmp_path / "run"
    _short_run(run, "--checkpoint.every=1", "--logging.report_to=tensorboard")
    (run / "tracking.json").write_text('{"wandb_id": ')  # truncated
    with pytest.raises(SystemExit, match=r"tracking.json is damaged .*restore it, or delete it"):
        main(["train", "--resume", str(run), "--checkpoint.resume_step=1"])

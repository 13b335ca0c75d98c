"""benchmarks/learning/vs_trl.py: the same run in TRL and in `grpo-kernels train`. The quick path end to end (both
trainers, TRL's own prompt tokenization checked against ours inside the worker), the prompt stream both get, and the
settings TRL cannot run, refused in one line."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.learning.intervals import mean_ci
from grpo_kernels.train import build as build_module
from grpo_kernels.train import trainer as trainer_module
from grpo_kernels.train.config.io import load_config
from grpo_kernels.train.data.tasks import PromptStream
from grpo_kernels.train.rollout import sampling as sampling_module

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.learning import vs_trl as learning_vs_trl  # noqa: E402
from benchmarks.learning.trl_worker import trl_refusal  # noqa: E402


@pytest.mark.slow
def test_quick_run_trains_both_and_evaluates_them_with_the_same_code(tmp_path):
    cmd = [sys.executable, "-m", "benchmarks.learning.vs_trl", "--quick", "--workdir", str(tmp_path / "work"),
           "--results", str(tmp_path / "out")]  # fmt: skip
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    runs = tmp_path / "out" / "runs"
    summaries = {name: json.loads((runs / f"{name}_dapo_seed0" / "summary.json").read_text())
                 for name in ("trl", "grpo_kernels")}  # fmt: skip
    # the same weights before the first step, evaluated by the same code with the same seeds: the same success
    assert summaries["trl"]["eval_success_start"] == summaries["grpo_kernels"]["eval_success_start"]
    assert summaries["trl"]["reward_text_mismatch"] == 0  # TRL's completion text is our decoding of its ids
    curves = (tmp_path / "out" / "curves.csv").read_text().splitlines()
    assert curves[0].startswith("trainer,loss_type,seed,step,completions")
    assert sum(line.startswith("trl,dapo,0,1,16,") for line in curves) == 1  # 2 steps x 2 prompts x G = 4
    assert sum(line.startswith("grpo_kernels,dapo,0,1,16,") for line in curves) == 1
    assert "| after step | trl | grpo_kernels | verdict |" in (tmp_path / "out" / "summary.md").read_text()
    assert (tmp_path / "out" / "success_dapo.png").stat().st_size > 0
    assert json.loads((runs / "trl_dapo_seed0" / "process.json").read_text())["peak_rss_mib"] > 100
    again = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert again.returncode == 0 and again.stdout.count("done before") == 2, again.stdout[-2000:]


def test_the_prompts_given_to_trl_are_the_ones_the_trainer_trains_on(tmp_path, monkeypatch):
    seen, sample = [], sampling_module.sample_scored

    def recording(sampler, tok, task, examples, g, seeds, d, **kwargs):
        if not kwargs.get("evaluation"):  # a training batch
            seen.extend(examples)
        return sample(sampler, tok, task, examples, g, seeds, d, **kwargs)

    monkeypatch.setattr(sampling_module, "sample_scored", recording)
    config = load_config(None, ["--seed=3", "--task.name=add", "--task.num_train_prompts=10",
                                "--sampling.prompts_per_step=4", "--sampling.group_size=2", "--optim.steps=4",
                                "--task.num_eval_prompts=0", "--checkpoint.every=0",
                                f"--logging.run_dir={tmp_path}"])  # fmt: skip
    trainer_module.train(config, log=lambda *a, **k: None)
    _, train_set, _ = build_module.task_examples(config)
    assert len(seen) == 16  # 4 steps x 4 prompts: more than one epoch of 10, so the reshuffle counts too
    assert seen == PromptStream(train_set, 3).take(16)


def test_a_prompt_stream_refuses_no_examples_and_a_negative_count():
    with pytest.raises(ValueError, match="examples is empty"):
        PromptStream([], 0)
    with pytest.raises(ValueError, match="n must be >= 0, got -1"):
        PromptStream(["a"], 0).take(-1)


@pytest.mark.parametrize("override, named", [
    ("--task.sft_warmup_steps=10", "task.sft_warmup_steps"),
    ("--group_size.dynamic_sampling=true", "group_size.dynamic_sampling"),
    ("--group_size.adaptive=true", "group_size.adaptive"),
    ("--sampling.sampler=vllm", "sampling.sampler"),
    ("--optim.schedule=cosine", "optim.schedule"),
    ("--optim.warmup_steps=3", "optim.warmup_steps"),
    ("--loss.loss_type=cispo", "loss.loss_type"),
    ("--task.chat_template=off", "task.chat_template"),
])  # fmt: skip
def test_settings_trl_cannot_run_alike_are_refused_in_one_line(override, named):
    base = ["--model.name=/some/hf/dir", "--task.sft_warmup_steps=0"]
    assert trl_refusal(load_config(None, base)) is None
    why = trl_refusal(load_config(None, [*base, override]))
    assert why is not None and why.startswith(named) and "\n" not in why


def test_the_benchmark_refuses_bad_input_before_running(tmp_path):
    common = ["--workdir", str(tmp_path / "w"), "--results", str(tmp_path / "r")]
    with pytest.raises(SystemExit, match="unknown --trainers verl"):
        learning_vs_trl.main(["--trainers", "trl,verl", *common])
    with pytest.raises(SystemExit, match=r"TRL cannot run loss.loss_type = 'cispo'"):
        learning_vs_trl.main(["--loss-types", "cispo", *common])
    with pytest.raises(SystemExit, match="--trl-micro-rows 12 does not split a step's 64 rows into micro-batches of "
                       "whole groups of 8"):  # fmt: skip
        learning_vs_trl.main(["--trainers", "trl", "--loss-types", "dapo", "--trl-micro-rows", "12", *common])
    assert not (tmp_path / "r").exists()  # nothing ran, nothing written


def test_a_run_another_invocation_holds_is_left_to_it(tmp_path):
    import fcntl

    work, results = tmp_path / "work", tmp_path / "results"
    work.mkdir()
    with (work / "trl_dapo_seed0.lock").open("w") as held:
        fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
        what = learning_vs_trl.run_one(None, ("trl", "dapo", 0), work, results, None)
    assert what == "running in another process: left to it"
    assert not (results / "runs").exists() and not (work / "trl_dapo_seed0.log").exists()


def test_trl_with_our_draw_samples_the_completions_our_trainer_samples(tmp_path, monkeypatch):
    """`--draw ours` (the trl_ourdraw rows): TRL's first rollout is the one `grpo-kernels train` samples from the same
    weights, prompts and seed, token for token; its held-out evaluation is left to the usual sampler."""
    import types

    from benchmarks.learning import trl_worker as learning_trl_worker

    args = types.SimpleNamespace(**{**learning_vs_trl.QUICK, "steps": 1, "format_weight": None})
    args.model = str(learning_vs_trl.quick_model(tmp_path))
    theirs, ours = [], []
    seeded_draw = learning_trl_worker.seeded_draw

    def recording_draw(trainer, config):
        seeded_draw(trainer, config)
        single_turn = trainer._generate_single_turn

        def recorded(*a, **k):
            completion_ids, logprobs = single_turn(*a, **k)
            theirs.extend(completion_ids)  # in the generate batch's order (TRL shuffles it before its loss)
            return completion_ids, logprobs

        trainer._generate_single_turn = recorded

    monkeypatch.setattr(learning_trl_worker, "seeded_draw", recording_draw)
    learning_trl_worker.run(tmp_path / "trl", learning_vs_trl.overrides(args, "trl_ourdraw", "dapo", 0,
                                                                        tmp_path / "trl"), draw="ours")  # fmt: skip
    sample = sampling_module.sample_scored

    def recording(sampler, tok, task, examples, g, seeds, d, **kwargs):
        rollout = sample(sampler, tok, task, examples, g, seeds, d, **kwargs)
        if not kwargs.get("evaluation"):  # the training batch
            ours.extend([c.tolist() for c in rollout.completion_ids])
        return rollout

    monkeypatch.setattr(sampling_module, "sample_scored", recording)
    config = load_config(None, learning_vs_trl.overrides(args, "grpo_kernels", "dapo", 0, tmp_path / "ours"))
    trainer_module.train(config, log=lambda *a, **k: None)
    assert len(ours) == 8 and len({tuple(c) for c in ours}) > 1  # 2 prompts x G = 4, not all alike
    assert theirs == ours
    both = json.loads((tmp_path / "trl" / "summary.json").read_text())["eval_success_start"]
    assert both == json.loads((tmp_path / "ours" / "summary.json").read_text())["eval_success_start"]


def test_our_trainer_with_hfs_draw_changes_the_training_draw_alone(tmp_path, monkeypatch):
    """`grpo_kernels_hfdraw`: the training rollouts are drawn by torch.multinomial from the seeded global RNG (the
    same run twice: the same completions; not the per-row seeded draw's), the held-out evaluation is untouched."""
    import types

    from benchmarks.learning import hfdraw_worker as learning_hfdraw_worker
    from grpo_kernels.train.rollout import hf_sampler as sampler_module

    args = types.SimpleNamespace(**{**learning_vs_trl.QUICK, "steps": 1, "format_weight": None})
    args.model = str(learning_vs_trl.quick_model(tmp_path))
    monkeypatch.setattr(sampler_module, "SeededSampling", sampler_module.SeededSampling)  # restored afterwards
    monkeypatch.setattr(sampling_module, "sample_scored", sampling_module.sample_scored)

    def run(name, patched):
        if patched:
            learning_hfdraw_worker.patch()
        seen, held_out, sample = [], [], sampling_module.sample_scored

        def recording(sampler, tok, task, examples, g, seeds, d, **kwargs):
            rollout = sample(sampler, tok, task, examples, g, seeds, d, **kwargs)
            (held_out if kwargs.get("evaluation") else seen).extend(c.tolist() for c in rollout.completion_ids)
            return rollout

        monkeypatch.setattr(sampling_module, "sample_scored", recording)
        config = load_config(None, learning_vs_trl.overrides(args, "grpo_kernels", "dapo", 0, tmp_path / name))
        trainer_module.train(config, log=lambda *a, **k: None)
        monkeypatch.setattr(sampling_module, "sample_scored", sample)
        return seen, held_out

    seeded, seeded_eval = run("seeded", False)
    hf, hf_eval = run("hf", True)
    again, _ = run("hf_again", False)  # still patched
    assert len(hf) == len(seeded) == 8 and hf != seeded
    assert again == hf
    assert hf_eval[:8] == seeded_eval[:8]  # the evaluation before the first step: same weights, same draw


@pytest.mark.slow
def test_trl_in_micro_batches_makes_the_whole_steps_update(tmp_path, monkeypatch):
    """--trl-micro-rows (TRL's per_device_train_batch_size with gradient accumulation over the step): TRL generates
    the step at once and normalizes over all of it, so the first update is the one-micro-batch run's: the same loss
    and gradient norm (float summation order apart). Loss dapo, the one whose normalizer spans the micro-batches
    (grpo's is a plain mean over them). The reward is the completion's length mod 3 (the untrained
    tiny model earns none of the task's), so that the groups carry a gradient."""
    import types

    from benchmarks.learning import trl_worker as learning_trl_worker
    from grpo_kernels.train.data.rewards import RewardFunction, Rewards

    def length_mod_3(completions, **kwargs):
        return [(len(c) % 3) / 2 for c in completions]

    def graded(task, settings=None):
        return Rewards([RewardFunction("length_mod_3", length_mod_3, "test")])

    monkeypatch.setattr(build_module, "task_rewards", graded)

    args = types.SimpleNamespace(**{**learning_vs_trl.QUICK, "steps": 1, "format_weight": None})
    args.model = str(learning_vs_trl.quick_model(tmp_path))
    logged = {}
    for micro in (None, 4):  # 2 prompts x G = 4: one micro-batch of 8 rows, or two of 4
        run_dir = tmp_path / f"micro{micro}"
        summary = learning_trl_worker.run(run_dir, learning_vs_trl.overrides(args, "trl", "dapo", 0, run_dir),
                                          micro_rows=micro)  # fmt: skip
        assert summary["trl_micro_rows"] == (micro or 8)
        logged[micro] = json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[0])
    whole, split = logged[None], logged[4]
    assert whole["grad_norm"] > 0 and abs(whole["loss"]) > 0
    assert split["grad_norm"] == pytest.approx(whole["grad_norm"], rel=1e-5)
    assert split["loss"] == pytest.approx(whole["loss"], rel=1e-5, abs=1e-7)
    assert split["reward"] == whole["reward"]  # the same rollouts: generated once per step, before the split


def test_the_report_says_which_trl_runs_ran_in_micro_batches(tmp_path):
    for name, summary in (("trl_dapo_seed3", {}), ("trl_dapo_seed4", {"trl_micro_rows": 8}),
                          ("trl_dapo_seed0", {"trl_micro_rows": 8}), ("grpo_kernels_dapo_seed0", {})):  # fmt: skip
        (tmp_path / "runs" / name).mkdir(parents=True)
        (tmp_path / "runs" / name / "summary.json").write_text(json.dumps(summary))
    line = learning_vs_trl.micro_batch_lines(tmp_path)[0]
    assert line.startswith("_TRL's micro-batches")  # a paragraph the performance page carries
    assert line.endswith("): trl_dapo_seed0, trl_dapo_seed4: 8 rows; trl_dapo_seed3: the whole step in one._")
    (tmp_path / "runs" / "trl_dapo_seed4" / "summary.json").write_text("{}")
    (tmp_path / "runs" / "trl_dapo_seed0" / "summary.json").write_text("{}")
    assert learning_vs_trl.micro_batch_lines(tmp_path) == []  # all whole-step runs: nothing to say


def test_the_report_pairs_seeds_both_trainers_ran_and_lists_each_run(tmp_path):
    rows = [{"trainer": t, "loss_type": "dapo", "seed": seed, "step": step, "eval_success": value, "wall_s": 10.0}
            for t, seed, values in (("trl", 0, (0.2, 0.4)), ("trl", 1, (0.2, 0.6)), ("grpo_kernels", 0, (0.2, 0.5)),
                                    ("grpo_kernels", 1, (0.2, 0.6)), ("grpo_kernels", 2, (0.2, 0.1)))
            for step, value in zip((-1, 3), values, strict=True)]  # fmt: skip
    text = "\n".join(learning_vs_trl.summary_lines(rows))
    # after step 4: seeds 0 and 1 in both, differences +0.1 and 0.0 (seed 2, ours alone, is not paired)
    paired = mean_ci([0.1, 0.0])
    assert "| 4 | 0.500 ± 1.271 (2) | 0.400 ± " in text and f"+{paired[0]:.3f} ± {paired[1]:.3f} (2) |" in text
    for name, lengths in (("trl_dapo_seed0", '{"completions/mean_length": 9.5}\n{"completions/mean_length": 4.0}\n'),
                          ("grpo_kernels_dapo_seed0", '{"completion_length": 7.0}\n')):  # fmt: skip
        (tmp_path / "runs" / name).mkdir(parents=True)
        (tmp_path / "runs" / name / "summary.json").write_text("{}")
        (tmp_path / "runs" / name / "metrics.jsonl").write_text(lengths)
    (tmp_path / "runs" / "trl_dapo_seed0" / "process.json").write_text('{"peak_rss_mib": 4700}')
    lines = learning_vs_trl.run_lines(tmp_path, rows)
    assert "| trl | dapo | 0 | 0.200 | 0.400 | 0.400 | 0.400 | 4.0 | 10 | 4700 |" in lines
    assert "| grpo_kernels | dapo | 0 | 0.200 | 0.500 | 0.500 | 0.500 | 7.0 | 10 |  |" in lines


def test_the_endpoints_read_the_last_evaluation_and_count_collapses_at_any_step(tmp_path):
    """endpoints.md: held-out success after the last step (Welch and paired) and the runs whose rollouts average
    under 7 tokens at some step (not only the last), with exact intervals and Fisher's test."""
    ends = {("trl", 0): 0.5, ("trl", 1): 0.6, ("trl", 2): 0.4, ("grpo_kernels", 0): 0.2, ("grpo_kernels", 1): 0.1,
            ("grpo_kernels", 2): 0.15}  # fmt: skip
    lengths = {("trl", 0): (9, 10), ("trl", 1): (9, 9), ("trl", 2): (9, 8), ("grpo_kernels", 0): (9, 3, 9),
               ("grpo_kernels", 1): (3, 4), ("grpo_kernels", 2): (7.0, 7.5)}  # 7.0 is not under 7  # fmt: skip
    rows = [{"trainer": t, "loss_type": "dapo", "seed": k, "step": step, "eval_success": value}
            for (t, k), end in ends.items() for step, value in ((-1, 0.2), (3, 0.3), (7, end))]  # fmt: skip
    for (t, k), values in lengths.items():
        run = tmp_path / "runs" / f"{t}_dapo_seed{k}"
        run.mkdir(parents=True)
        key = "completions/mean_length" if t == "trl" else "completion_length"
        run.joinpath("metrics.jsonl").write_text("".join(json.dumps({key: v}) + "\n" for v in values))
    text = "\n".join(learning_vs_trl.endpoint_lines(tmp_path, rows))
    welch = learning_vs_trl.welch_difference([0.2, 0.1, 0.15], [0.5, 0.6, 0.4])
    paired = mean_ci([-0.3, -0.5, -0.25])
    assert f"after step 8, ours - TRL: {welch[0]:+.3f} ± {welch[1]:.3f} (Welch, 3 against 3 seeds: resolved)" in text
    assert f"paired by seed {paired[0]:+.3f} ± {paired[1]:.3f} (3 seeds: resolved)" in text
    assert "trl: 0 of 3, exact 95 % interval 0.00-0.71." in text
    assert "grpo_kernels: 2 of 3, exact 95 % interval 0.09-0.99 (seeds 0, 1)." in text
    assert "p = 0.400" in text  # 2 of 3 against 0 of 3


def test_the_endpoints_of_a_study_part_way_with_no_seed_in_both_trainers_yet(tmp_path):
    """A study that runs seed by seed has, after its first runs, seeds of one trainer that the other has not run:
    the report (written after every run) says so instead of failing (it raised ZeroDivisionError and stopped the
    study's worker)."""
    rows = [{"trainer": t, "loss_type": "dapo", "seed": k, "step": step, "eval_success": value}
            for t, k in (("trl", 20), ("grpo_kernels", 21)) for step, value in ((-1, 0.2), (3, 0.3))]  # fmt: skip
    for t, k in (("trl", 20), ("grpo_kernels", 21)):
        run = tmp_path / "runs" / f"{t}_dapo_seed{k}"
        run.mkdir(parents=True)
        run.joinpath("metrics.jsonl").write_text("")
    text = "\n".join(learning_vs_trl.endpoint_lines(tmp_path, rows))
    assert "1 against 1 seeds: not resolved); paired by seed none yet (no seed has run in both)." in text


def test_the_study_runs_its_recipe_bonus_whatever_the_tasks_default(tmp_path):
    """The default recipe (endpoints.md) is arith with the bare-integer bonus at 0.2: both trainers get it explicitly,
    and the summary's command says it, now that the task's own default is 0."""
    from grpo_kernels.train.config.io import load_config
    from grpo_kernels.train.data.tasks import make_task

    assert make_task("arith").FORMAT_WEIGHT == 0.0
    args = learning_vs_trl.parse_args([])
    for trainer in ("grpo_kernels", "trl"):
        config = load_config(None, learning_vs_trl.overrides(args, trainer, "dapo", 0, tmp_path))
        assert config.task.name == "arith" and config.task.format_weight == 0.2
    rows = [dict(trainer="trl", loss_type="dapo", seed=0)]
    assert " --format-weight 0.2 " in learning_vs_trl.command_line(args, rows)
    assert learning_vs_trl.parse_args(["--format-weight", "0"]).format_weight == 0.0
    assert learning_vs_trl.parse_args(["--task", "add"]).format_weight is None  # no bonus to give

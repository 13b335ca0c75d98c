"""Adaptive group size and dynamic sampling."""

import json

import pytest

from grpo_kernels.cli import main
from grpo_kernels.theory import invalid_group_rate
from grpo_kernels.train.group_size import AdaptiveGroupSize, expected_invalid_rate, group_size_for


def test_group_size_for_reaches_the_target_rate():
    rates = [0.2, 0.5, 0.9]
    g = group_size_for(rates, target=0.1, minimum=2, maximum=64)
    assert expected_invalid_rate(g, rates) <= 0.1 < expected_invalid_rate(g - 1, rates)
    assert group_size_for([0.0, 1.0], target=0.1, minimum=4, maximum=16) == 16  # unreachable: the maximum
    assert expected_invalid_rate(8, [0.2]) == pytest.approx(invalid_group_rate(8, 0.2))
    with pytest.raises(ValueError):
        group_size_for(rates, target=0.1, minimum=1, maximum=8)


def test_controller_raises_g_only_after_a_window_above_threshold():
    c = AdaptiveGroupSize(8, maximum=16, threshold=0.3, window=2)
    assert c.update(0.5, [0.9] * 4) == 8  # window not full yet
    assert c.update(0.5, [0.9] * 4) == 12  # the smallest G with 0.9^G + 0.1^G <= 0.3
    assert invalid_group_rate(12, 0.9) <= 0.3 < invalid_group_rate(11, 0.9)
    assert c.update(0.9, [1.0] * 4) == 12  # the window restarted after the change
    assert c.update(0.9, [1.0] * 4) == 16 and c.update(0.9, [1.0] * 4) == 16  # never above the maximum
    low = AdaptiveGroupSize(4, maximum=32, threshold=0.5, window=1)
    assert low.update(0.1, [0.5]) == 4  # below the threshold: unchanged


def test_training_with_adaptive_g_and_dynamic_sampling(tmp_path):
    run = tmp_path / "run"
    main(["train", f"--logging.run_dir={run}", "--optim.steps=3", "--sampling.group_size=2",
          "--sampling.prompts_per_step=3", "--sampling.max_new_tokens=3", "--task.name=add",
          "--task.num_eval_prompts=4", "--group_size.adaptive=true", "--group_size.max_group_size=6",
          "--group_size.window=1", "--group_size.invalid_rate_threshold=0.01", "--group_size.dynamic_sampling=true",
          "--group_size.max_resample_rounds=1"])  # fmt: skip
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2]
    for r in rows:  # only groups with a signal were trained on; more prompts were drawn to replace the others
        if r.get("no_update"):  # every group of both rounds was invalid: no update, a line that says so
            assert r["invalid_group_rate"] == 1.0 and r["resample_rounds"] == 1 and r["prompts_sampled"] >= 3
            continue
        assert r["invalid_group_rate"] == 0.0 and r["prompts_sampled"] >= 3 and r["resample_rounds"] <= 1
        assert r["invalid_all_zero_rate"] == 0.0  # the trained groups: valid ones only
    if len(rows) >= 2:
        assert rows[-1]["group_size"] >= rows[0]["group_size"]


def test_dynamic_sampling_drops_exactly_the_groups_the_advantage_kernel_marks_invalid():
    """A group with rewards 1.0 and 1.0 + 1e-7 has no gradient (std <= min_std): dynamic sampling must drop it, as the
    advantage kernel zeroes it, rather than keep it because its rewards are not all identical."""
    import torch

    from grpo_kernels.advantages import group_advantages
    from grpo_kernels.train.config.io import load_config
    from grpo_kernels.train.data.rewards import RewardFunction, Rewards
    from grpo_kernels.train.data.tasks import Example
    from grpo_kernels.train.model.fsdp import SINGLE
    from grpo_kernels.train.rollout.batch import Rollout
    from grpo_kernels.train.rollout.sampling import collect

    group_rewards = {"tiny": [1.0, 1.0 + 1e-7], "signal": [0.0, 1.0], "equal": [0.5, 0.5], "near": [0.2, 0.2 + 1e-6]}
    names = list(group_rewards)

    class Tok:
        def encode_prompt(self, prompt):
            return [names.index(prompt)]

        def decode(self, ids):
            return ",".join(str(int(i)) for i in ids)

    class Sampler:
        def sample(self, prompts, g, *, seeds):
            ids = [torch.tensor([p[0], j]) for p in prompts for j in range(g)]
            return Rollout(prompt_ids=[torch.tensor(p) for p in prompts for _ in range(g)], completion_ids=ids,
                           sampler_logps=[torch.zeros(2) for _ in ids], group_size=g)  # fmt: skip

    def table(completions, **kwargs):
        out = []
        for completion in completions:
            k, j = (int(x) for x in completion.split(","))
            out.append(group_rewards[names[k]][j])
        return out

    rewards = Rewards([RewardFunction("table", table, "test")])

    examples = [Example(prompt=name, answer="") for name in names]
    config = load_config(None, ["--sampling.prompts_per_step=4", "--group_size.dynamic_sampling=true",
                                "--group_size.max_resample_rounds=0"])  # fmt: skip
    rollout, sampled, rounds, tokens = collect(config, Sampler(), Tok(), rewards, lambda n: examples[:n], 0, 2,
                                                SINGLE)  # fmt: skip
    valid = group_advantages(torch.tensor([r for n in names for r in group_rewards[n]]), group_size=2).valid
    assert valid.tolist() == [False, True, False, False]  # the kernel's verdict on these four groups
    assert rollout.rewards.tolist() == [group_rewards["signal"]] and sampled == 4 and rounds == 0
    assert tokens == 4 * 2 * 2  # every sampled completion (2 tokens each) counts, the dropped groups' too
    assert [int(p[0]) for p in rollout.prompt_ids] == [names.index("signal")] * 2


def _jsonl(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


EVAL_ARGS = ["--sampling.group_size=4", "--sampling.prompts_per_step=2", "--sampling.max_new_tokens=3",
             "--task.name=add", "--task.num_eval_prompts=6", "--task.num_train_prompts=16", "--model.hidden_size=32",
             "--model.num_layers=1", "--optim.lr=1e-2"]  # fmt: skip


def test_held_out_evaluations_every_n_steps_and_at_the_end(tmp_path):
    run = tmp_path / "run"
    main(["train", f"--logging.run_dir={run}", "--optim.steps=5", "--task.eval_every=2", *EVAL_ARGS])
    evals, summary = _jsonl(run / "eval.jsonl"), json.loads((run / "summary.json").read_text())
    assert [e["step"] for e in evals] == [1, 3, 4]  # every 2 steps, and after the last one
    assert all(0 <= e["eval_success"] <= 1 and e["eval_s"] > 0 for e in evals)
    assert [e["eval_s_total"] for e in evals] == pytest.approx([sum(x["eval_s"] for x in evals[: i + 1])
                                                                for i in range(3)])  # fmt: skip
    assert summary["eval_success_end"] == evals[-1]["eval_success"] and summary["steps"] == 5
    rows = _jsonl(run / "metrics.jsonl")
    for e in evals:  # the run's totals so far: 2 prompts x G = 4 completions a step, their tokens, the seconds
        done = rows[: e["step"] + 1]
        assert e["completions_sampled"] == 8 * (e["step"] + 1) == sum(r["completions_sampled"] for r in done)
        assert e["sampled_tokens"] == sum(r["sampled_tokens"] for r in done) > 0
        assert e["generate_s"] == pytest.approx(sum(r["rollout_generate_s"] for r in done))
        assert e["train_s"] == pytest.approx(sum(r["train_step_s"] for r in done))
    assert summary["completions_sampled"] == 40 and summary["sampled_tokens"] == evals[-1]["sampled_tokens"]
    assert not summary["reached_target"] and summary["eval_s_total"] == pytest.approx(evals[-1]["eval_s_total"])


def test_training_stops_at_the_target_success_and_a_resumed_run_replays_its_evaluations(tmp_path):
    full, stop = tmp_path / "full", tmp_path / "stop"
    warm = ["--task.sft_warmup_steps=60", "--task.eval_every=1", "--checkpoint.every=2", *EVAL_ARGS[:-3],
            "--optim.lr=1e-3"]  # fmt: skip
    main(["train", f"--logging.run_dir={full}", "--optim.steps=6", *warm])
    evals = _jsonl(full / "eval.jsonl")
    assert [e["step"] for e in evals] == list(range(6))
    hit = max(evals, key=lambda e: e["eval_success"])
    assert hit["eval_success"] > 0  # the SFT warm start solves some sums
    main(["train", f"--logging.run_dir={stop}", "--optim.steps=6", f"--task.target_success={hit['eval_success']}",
          *warm])  # fmt: skip
    summary, stopped = json.loads((stop / "summary.json").read_text()), _jsonl(stop / "eval.jsonl")
    first = next(e for e in evals if e["eval_success"] >= hit["eval_success"])
    assert summary["reached_target"] and summary["steps"] == first["step"] + 1
    assert summary["eval_success_end"] == first["eval_success"]
    assert len(_jsonl(stop / "metrics.jsonl")) == first["step"] + 1  # no step after the target
    assert [e["eval_success"] for e in stopped] == [e["eval_success"] for e in evals[: first["step"] + 1]]
    # resumed from step 2 the run replays steps 2.. and their evaluations; those before come from the file
    main(["train", "--resume", str(full), "--checkpoint.resume_step=2"])
    again = _jsonl(full / "eval.jsonl")
    assert [(e["step"], e["eval_success"]) for e in again] == [(e["step"], e["eval_success"]) for e in evals]
    assert again[:2] == evals[:2]  # kept verbatim
    # the totals continue from the checkpoint's (tokens and counts exactly; seconds are the replay's own)
    assert [(e["completions_sampled"], e["sampled_tokens"]) for e in again] == [
        (e["completions_sampled"], e["sampled_tokens"]) for e in evals]  # fmt: skip


def test_a_step_where_every_group_is_invalid_writes_a_metrics_line_that_says_so(tmp_path):
    """Dynamic sampling on an untrained model: every sampled group scores 0, no update is made; each step still
    writes its metrics line (before: none), marked no_update, with what was sampled."""
    run = tmp_path / "run"
    main(["train", f"--logging.run_dir={run}", "--optim.steps=2", "--group_size.dynamic_sampling=true",
          "--group_size.max_resample_rounds=1", *EVAL_ARGS])  # fmt: skip
    rows = _jsonl(run / "metrics.jsonl")
    assert [r["step"] for r in rows] == [0, 1]
    for r in rows:
        assert r["no_update"] == 1 and r["invalid_group_rate"] == 1.0 and r["resample_rounds"] == 1, r
        assert r["prompts_sampled"] == 4 and r["completions_sampled"] == 16 and r["sampled_tokens"] > 0
        assert "loss" not in r and "reward" not in r
    summary = json.loads((run / "summary.json").read_text())
    assert summary["completions_sampled"] == 32
    # without dynamic sampling the same groups are trained on (advantages 0) and the step says they are all wrong
    main(["train", f"--logging.run_dir={tmp_path / 'plain'}", "--optim.steps=1", *EVAL_ARGS])
    (row,) = _jsonl(tmp_path / "plain" / "metrics.jsonl")
    assert row["reward"] == 0.0 and row["invalid_group_rate"] == 1.0 and row["invalid_all_zero_rate"] == 1.0

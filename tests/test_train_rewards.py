"""`grpo-kernels train` with the user's own reward functions (task.reward_funcs): TRL's per-function metrics, the
held-out means, a bad spec refused before the model loads, and a reward error that stops a run with the step and
the row and leaves its checkpoint to resume from once the file is fixed."""

import json

import pytest

from grpo_kernels.cli import main

REWARDS = '''
import numpy as np

def same_number(completions, answer, **kwargs):
    """np.isclose's numpy.bool_ (TRL takes it as 1.0 or 0.0), 0.0 where the completion is no number."""
    out = []
    for c, a in zip(completions, answer):
        try:
            out.append(np.isclose(float(c), float(a)))
        except ValueError:
            out.append(0.0)
    return out

def short(completions, trainer_state, log_metric, **kwargs):
    """None for an empty completion; counts the steps it saw."""
    log_metric("short/step", trainer_state.global_step)
    return [None if not c else 1.0 / len(c) for c in completions]
'''

FAILING = '''
def same_number(completions, answer, trainer_state, **kwargs):
    if trainer_state.global_step == 3:
        raise RuntimeError("the reward server is down")
    return [float(c == a) for c, a in zip(completions, answer)]
'''


def _run(run, *extra, steps=2):
    main(["train", f"--logging.run_dir={run}", f"--optim.steps={steps}", "--sampling.group_size=4",
          "--sampling.prompts_per_step=4", "--sampling.max_new_tokens=4", "--task.sft_warmup_steps=60",
          "--task.num_eval_prompts=4", "--packing.token_budget=64", "--optim.lr=1e-2", "--task.name=add",
          *extra])  # fmt: skip
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def test_a_run_scores_with_the_users_functions_and_logs_trls_names(tmp_path):
    (tmp_path / "my_rewards.py").write_text(REWARDS)
    rows = _run(tmp_path / "run", f"--task.reward_funcs={tmp_path}/my_rewards.py:same_number,"
                f"{tmp_path}/my_rewards.py:short", "--task.reward_weights=1,0.5", "--task.eval_every=1")  # fmt: skip
    for i, row in enumerate(rows):
        assert {"rewards/same_number/mean", "rewards/same_number/std", "rewards/short/mean", "rewards/short/std",
                "reward_unscorable_fraction", "reward_s"} <= set(row)  # fmt: skip
        assert row["short/step"] == i and 0 <= row["reward_s"] < row["rollout_generate_s"]
        assert 0.0 <= row["rewards/same_number/mean"] <= 1.0
    evals = [json.loads(line) for line in (tmp_path / "run" / "eval.jsonl").read_text().splitlines()]
    assert all("eval_rewards/same_number/mean" in e and "eval_rewards/short/mean" in e for e in evals)
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["eval_success_end"] == evals[-1]["eval_success"] == evals[-1]["eval_rewards/same_number/mean"]


def test_a_spec_that_does_not_load_stops_the_run_before_the_model_loads(tmp_path):
    with pytest.raises(SystemExit, match=r"task.reward_funcs: '.*nope.py:f': no file .*nope.py"):
        _run(tmp_path / "run", f"--task.reward_funcs={tmp_path}/nope.py:f")
    assert not (tmp_path / "run").exists()


def test_a_reward_error_stops_the_run_with_the_step_and_the_run_resumes_once_the_file_is_fixed(tmp_path):
    path, run = tmp_path / "flaky.py", tmp_path / "run"
    path.write_text(FAILING)
    spec = f"--task.reward_funcs={path}:same_number"
    with pytest.raises(SystemExit, match=r"reward function 'same_number' \(.*flaky.py:4\) raised RuntimeError: the "
                                         r"reward server is down in training step 3\n"):  # fmt: skip
        _run(run, spec, "--checkpoint.every=2", steps=5)
    assert [r["step"] for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())] == [0, 1, 2]
    assert (run / "checkpoints" / "step_2").is_dir()
    path.write_text(FAILING.replace("== 3", "== -1"))  # fixed
    main(["train", "--resume", str(run)])
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2, 3, 4]

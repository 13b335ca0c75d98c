"""The "your own task" example: the dataset script, the config (its reward files found from the config's folder) and
the reward functions on completions a model could write, without loading the model."""

import subprocess
import sys
from pathlib import Path

import pytest

from grpo_kernels.train.build import task_examples, task_rewards
from grpo_kernels.train.config.io import load_config

ROOT = Path(__file__).resolve().parents[1]
pytest.importorskip("math_verify")


def test_the_example_dataset_config_and_rewards_fit_together(tmp_path):
    data = tmp_path / "arith.jsonl"
    out = subprocess.run([sys.executable, "examples/make_arith_dataset.py", str(data), "--rows", "50"], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)  # fmt: skip
    assert out.returncode == 0 and "wrote 50 rows" in out.stdout, out.stderr
    config = load_config(ROOT / "examples" / "train_smollm2_dataset_cpu.toml",
                         [f"task.dataset={data}", "task.num_eval_prompts=10"])  # fmt: skip
    assert config.task.reward_funcs[0] == f"{ROOT}/examples/rewards/math_rewards.py:correct"
    task, train, held = task_examples(config)
    rewards = task_rewards(task, config.task)
    assert len(train) == 40 and len(held) == 10 and rewards.names == ["correct", "bare_number", "length_penalty"]
    e = train[0]
    answer = e.columns["solution"]
    completions = [answer, f"The sum is {answer}.", "I think 100", answer]
    ids = [[1] * 3, [1] * 8, [1] * 4, [1] * 20]  # the last one past MAX_TOKENS - BUFFER (16): penalized
    values = rewards.score([e] * 4, completions, ids, step=0)
    assert values.tolist() == [[1.0, 1.0, 0.0], [1.0, 0.0, 0.0], [0.0, 0.0, 0.0], [1.0, 1.0, -0.5]]
    assert rewards.combine(values).tolist() == [1.2, 1.0, 0.0, 0.95]
    assert rewards.take_logged()["length_penalty/penalized"] == 0.25
    assert rewards.correct(answer, e) == 1.0  # held-out success: task.success_reward = "correct"

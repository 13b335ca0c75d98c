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
    for r in rows:  # only groups with a signal were trained on; more prompts were drawn to replace the others
        assert r["invalid_group_rate"] == 0.0 and r["prompts_sampled"] >= 3 and r["resample_rounds"] <= 1
    if len(rows) >= 2:
        assert rows[-1]["group_size"] >= rows[0]["group_size"]

"""`grpo-kernels eval` (grpo_kernels.train.evaluate): a run's model/ scores exactly as the run's final held-out
evaluation did; pass@k is the unbiased estimator; the completions and summary files."""

import itertools
import json

import pytest

from grpo_kernels.cli import main
from grpo_kernels.train.config.io import load_config
from grpo_kernels.train.evaluate import pass_at_k
from grpo_kernels.train.trainer import train

RUN = ["--model.name=tiny", "--task.name=add", "--task.num_eval_prompts=48", "--sampling.group_size=4",
       "--sampling.prompts_per_step=8", "--sampling.max_new_tokens=3", "--task.sft_warmup_steps=60",
       "--optim.steps=3", "--optim.lr=5e-4"]  # fmt: skip


def test_pass_at_k_is_the_mean_over_every_k_subset():
    for n in range(1, 7):
        for c in range(n + 1):
            answers = [1] * c + [0] * (n - c)
            for k in range(1, n + 1):
                subsets = list(itertools.combinations(answers, k))
                assert pass_at_k(n, c, k) == pytest.approx(sum(max(s) for s in subsets) / len(subsets))
    with pytest.raises(ValueError, match="1 <= k <= n"):
        pass_at_k(3, 1, 4)


def test_a_runs_model_scores_as_its_final_evaluation_did(tmp_path, capsys):
    run = tmp_path / "run"
    summary = train(load_config(None, [*RUN, f"--logging.run_dir={run}"]), log=lambda *a, **k: None)
    assert 0 < summary["eval_success_end"] < 1  # a success rate the comparison can get wrong
    capsys.readouterr()
    main(["eval", str(run / "model"), "--run", str(run), "--out", str(tmp_path / "one")])
    printed = json.loads(capsys.readouterr().out)
    assert printed["success"] == summary["eval_success_end"] and printed["prompts"] == 48
    assert json.loads((tmp_path / "one" / "summary.json").read_text()) == printed
    main(["eval", str(run / "model"), "--run", str(run), "--samples", "4", "--out", str(tmp_path / "four")])
    four = json.loads(capsys.readouterr().out)
    assert [four[f"pass@{k}"] for k in (1, 2, 4)] == sorted(four[f"pass@{k}"] for k in (1, 2, 4))
    assert four["pass@1"] == pytest.approx(four["success"])
    lines = [json.loads(line) for line in (tmp_path / "four" / "completions.jsonl").read_text().splitlines()]
    assert len(lines) == 48 * 4 and {line["sample"] for line in lines} == {0, 1, 2, 3}
    rate = sum(line["rewards"]["numeric"] == 1.0 for line in lines) / len(lines)
    assert rate == pytest.approx(four["success"])
    with pytest.raises(SystemExit, match="no held-out prompts"):
        main(["eval", str(run / "model"), "--run", str(run), "--task.num_eval_prompts=0"])
    with pytest.raises(SystemExit, match="--samples must be >= 1, got 0"):
        main(["eval", str(run / "model"), "--run", str(run), "--samples", "0"])
    with pytest.raises(SystemExit, match="no config.json in .*: not an HF model directory"):
        main(["eval", str(tmp_path / "one"), "--run", str(run)])
    with pytest.raises(SystemExit, match='task.chat_template is "on" but the tokenizer of .* has no chat template'):
        main(["eval", str(run / "model"), "--run", str(run), "--task.chat_template=on"])

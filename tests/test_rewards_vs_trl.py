"""One reward file and one dataset given to trl.GRPOTrainer and to this package's trainer: TRL's own pipeline
(`_generate_and_score_completions`, with scripted completions) against `task.reward_funcs` on a dataset read by
task.name = "dataset". The functions are called with the same keywords, give the same per-function rewards (None
and numpy.bool_ values included), and the advantages agree: TRL divides by std + 1e-4 where group_advantages divides
by std + 1e-6, so ours x (std + 1e-6) / (std + 1e-4) must equal TRL's."""

import json

import pytest
import torch

trl = pytest.importorskip("trl")
datasets = pytest.importorskip("datasets")

from helpers import assert_close  # noqa: E402
from test_trl_dropin import scripted_generate, tiny_config, tokenizer  # noqa: E402

from grpo_kernels.train.build import task_examples, task_rewards  # noqa: E402
from grpo_kernels.train.config.io import load_config  # noqa: E402
from grpo_kernels.train.rollout.batch import Rollout  # noqa: E402

REWARD_FILE = '''
import asyncio

calls = {}

def token_share(completions, completion_ids, solution, level, **kwargs):
    calls.setdefault("token_share", []).append(dict(completions=list(completions),
                                                    ids=[list(c) for c in completion_ids],
                                                    solution=list(solution), level=list(level)))
    return [sum(t % int(s) == 0 for t in ids) / len(ids) + 0.1 * lv
            for ids, s, lv in zip(completion_ids, solution, level)]

def odd_only(completion_ids, **kwargs):
    """None (does not apply) for a completion of even length."""
    return [None if len(ids) % 2 == 0 else float(ids[0] % 5) for ids in completion_ids]

async def length(completions, **kwargs):
    await asyncio.sleep(0)
    return [len(c.split()) / 8 for c in completions]

def starts_even(completion_ids, **kwargs):
    """numpy.bool_ values (numpy's comparisons give them), which TRL takes as 1.0 and 0.0."""
    import numpy as np
    return [np.int64(ids[0]) % 2 == 0 for ids in completion_ids]
'''

ROWS = [{"prompt": "t5 t6 t7", "solution": "3", "level": 1}, {"prompt": "t8 t9", "solution": "4", "level": 2}]
NAMES = ("token_share", "odd_only", "length", "starts_even")
WEIGHTS = [1.0, 0.5, 2.0, 0.25]


def test_the_same_reward_file_and_dataset_score_as_in_trl(tmp_path):
    import importlib.util

    import transformers

    (tmp_path / "my_rewards.py").write_text(REWARD_FILE)
    spec = importlib.util.spec_from_file_location("my_rewards_for_trl", tmp_path / "my_rewards.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(tiny_config())
    args = trl.GRPOConfig(output_dir=str(tmp_path / "trl"), per_device_train_batch_size=8, num_generations=4,
                          max_completion_length=8, report_to="none", use_cpu=True, seed=0, bf16=False,
                          reward_weights=WEIGHTS)  # fmt: skip
    trainer = trl.GRPOTrainer(model=model, reward_funcs=[getattr(module, name) for name in NAMES],
                              args=args, train_dataset=datasets.Dataset.from_list(ROWS),
                              processing_class=tokenizer())  # fmt: skip
    trainer._generate_single_turn = scripted_generate.__get__(trainer)
    out = trainer._generate_and_score_completions([dict(r) for r in ROWS for _ in range(4)])
    theirs = torch.tensor([trainer._logs["rewards"][name] for name in NAMES]).T
    trl_call = module.calls["token_share"][-1]

    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    specs = ",".join(f"{tmp_path}/my_rewards.py:{name}" for name in NAMES)
    config = load_config(None, ["task.name=dataset", f"task.dataset={data}", "task.num_eval_prompts=0",
                                f"task.reward_funcs={specs}", "task.reward_weights=1,0.5,2,0.25"])  # fmt: skip
    task, train, _ = task_examples(config)
    rewards = task_rewards(task, config.task)
    by_prompt = {e.prompt: e for e in train}
    examples = [by_prompt[r["prompt"]] for r in ROWS for _ in range(4)]
    ours = rewards.score(examples, trl_call["completions"], trl_call["ids"], step=0)
    our_call = rewards.functions[0].func.__globals__["calls"]["token_share"][-1]
    assert our_call == trl_call  # the same keywords and columns, the dataset's values
    assert ours[:, 1].isnan().tolist() == theirs[:, 1].isnan().tolist() and ours[:, 1].isnan().any()
    assert_close(ours.nan_to_num(-7).float(), theirs.nan_to_num(-7), name="per-function rewards", rtol=1e-6,
                 atol=1e-7)  # fmt: skip
    assert set(ours[:, 3].tolist()) == {0.0, 1.0}  # the numpy.bool_ function, both values among the completions

    n = len(examples)
    rollout = Rollout(prompt_ids=[torch.tensor([1])] * n, completion_ids=[torch.tensor(c) for c in trl_call["ids"]],
                      sampler_logps=[torch.zeros(len(c)) for c in trl_call["ids"]], group_size=4)  # fmt: skip
    scored = rollout.with_rewards(rewards.combine(ours), per_func=ours)
    std = scored.advantages.group_std.repeat_interleave(4)
    adjusted = scored.advantages.advantages * (std + 1e-6) / (std + 1e-4)
    assert_close(adjusted, out["advantages"].float(), name="advantages", rtol=1e-5, atol=1e-6)
    metrics = rewards.metrics(scored.rewards_per_func)
    for k, name in enumerate(NAMES):
        values = theirs[:, k][~theirs[:, k].isnan()]
        assert metrics[f"rewards/{name}/mean"] == pytest.approx(values.mean().item(), rel=1e-6)

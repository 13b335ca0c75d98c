"""What a TRL user's files meet here, with TRL's own code as the oracle where it has one: a dataset's prompts become
the ids trl.GRPOTrainer feeds (plain text raw, a conversation through the chat template: `maybe_apply_chat_template`
and TRL's prompt tokenization), while the built-in tasks keep their template; a reward function that raises is shown
with the user's file, line and traceback, and when (which training step, which held-out evaluation), from a worker
process too; an answer whose reference cannot be scored (None) is left out of held-out success as TRL's mean leaves
it out, and counted, in the log, eval.jsonl, summary.json, the model card and `grpo-kernels eval`."""

import json
import math
import re
from types import SimpleNamespace

import pytest
import torch

trl = pytest.importorskip("trl")
datasets = pytest.importorskip("datasets")

from test_trl_dropin import scripted_generate, tiny_config, tokenizer  # noqa: E402

from grpo_kernels.cli import main  # noqa: E402
from grpo_kernels.train.build import load, task_examples, task_rewards  # noqa: E402
from grpo_kernels.train.config.io import load_config  # noqa: E402
from grpo_kernels.train.data.rewards import RewardError, Rewards, load_reward_function  # noqa: E402
from grpo_kernels.train.data.tasks import CharTokenizer  # noqa: E402
from grpo_kernels.train.rollout.batch import Rollout  # noqa: E402
from grpo_kernels.train.rollout.sampling import held_out_result, standard_error, with_standard_error  # noqa: E402

# ---- prompts -----------------------------------------------------------------------------------------------------

# A chat template that, as SmolLM2's does, adds a default system message when the messages bring none
TEMPLATE = ("{% if messages[0]['role'] != 'system' %}<bos>system:you are a tiny model.<eos>{% endif %}"
            "{% for m in messages %}<bos>{{ m['role'] }}:{{ m['content'] }}<eos>{% endfor %}"
            "{% if add_generation_prompt %}<bos>assistant:{% endif %}")  # fmt: skip
ROWS = [{"prompt": "what is 2+3?", "solution": "5"}, {"prompt": [{"role": "user", "content": "what is 4+4?"}],
        "solution": "8"}, {"prompt": "7+1=", "solution": "8"},
        {"prompt": [{"role": "system", "content": "be brief."}, {"role": "user", "content": "what is 1+6?"}],
         "solution": "7"}]  # fmt: skip


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """The tiny model with a character tokenizer that has a chat template (and a bos it does not add to text)."""
    from grpo_kernels.train.model.hf import char_tokenizer, write_tiny_checkpoint

    path = write_tiny_checkpoint(tmp_path_factory.mktemp("tiny_chat"))
    hf = char_tokenizer(CharTokenizer())
    hf.chat_template = TEMPLATE
    hf.save_pretrained(path)
    return path


def _load(model, task, tmp_path, *extra, rows=ROWS):
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    if task == "dataset":
        task = ["task.name=dataset", f"task.dataset={data}", "task.answer_column=solution"]
    elif task == "jsonl":
        data.write_text("".join(json.dumps({"prompt": r["prompt"], "answer": r["solution"]}) + "\n" for r in rows))
        task = ["task.name=jsonl", f"task.path={data}"]
    else:
        task = [f"task.name={task}"]
    return load(load_config(None, [f"model.name={model}", *task, "task.num_eval_prompts=1", "task.num_train_prompts=3",
                                   "packing.token_budget=512", *extra]))  # fmt: skip


def _trl_prompt(hf, prompt):
    """(text, ids) of a prompt as trl.GRPOTrainer renders and tokenizes it (its own functions, called as it calls
    them: `maybe_apply_chat_template` for the text, `_tokenize_prompts` for the ids it generates from)."""
    from trl.data_utils import maybe_apply_chat_template

    trainer = SimpleNamespace(processing_class=hf, _is_vlm=False, environment_factories=None, tools=None,
                              chat_template=None, chat_template_kwargs={})  # fmt: skip
    ids = trl.GRPOTrainer._tokenize_prompts(trainer, [prompt])[0][0]
    return maybe_apply_chat_template({"prompt": prompt}, hf)["prompt"], [int(i) for i in ids]


def test_a_datasets_prompts_are_the_ids_trl_feeds_plain_text_raw_and_conversations_through_the_template(
        model_dir, tmp_path):  # fmt: skip
    inputs = _load(model_dir, "dataset", tmp_path)  # task.chat_template = "auto"
    hf = inputs.tok.tokenizer
    seen = set()
    for e in inputs.train_set + inputs.eval_set:
        prompt = e.prompt if isinstance(e.prompt, str) else list(e.prompt)
        text, ids = _trl_prompt(hf, prompt)
        ours = inputs.tok.encode_prompt(e.prompt)
        assert ours == ids, f"{prompt!r}: ours {hf.decode(ours)!r}, TRL's {text!r}"
        assert hf.decode(ours) == text
        seen.add(isinstance(e.prompt, str))
        if isinstance(e.prompt, str):  # raw: no template, no default system message, no bos the tokenizer does not add
            assert text == e.prompt and ours == hf(e.prompt)["input_ids"] and ours[0] != hf.bos_token_id
        else:
            assert text.endswith("<bos>assistant:") and ("you are a tiny model." in text) == (len(e.prompt) == 1)
    assert seen == {True, False}  # both kinds of prompt were checked


@pytest.mark.parametrize("model, task, extra, wrapped", [
    ("dir", "add", [], True),                                  # the built-in tasks keep the template
    ("dir", "jsonl", [], True),                                # and so does the JSONL task
    ("dir", "dataset", ["task.chat_template=on"], True),       # a dataset's plain text as a user message, when asked
    ("dir", "jsonl", ["task.chat_template=conversational"], False),  # TRL's rule, when asked
    ("tiny", "dataset", [], False),                            # the character tokenizer: its text, after its bos
])  # fmt: skip
def test_the_built_in_tasks_keep_their_template_and_the_other_formats_are_asked_for(model_dir, tmp_path, model,
                                                                                     task, extra, wrapped):
    rows = ROWS if model == "dir" else [{"prompt": f"{i}+{i}=", "solution": str(2 * i)} for i in range(4)]
    inputs = _load(model_dir if model == "dir" else "tiny", task, tmp_path, *extra, rows=rows)
    plain = [e.prompt for e in inputs.train_set + inputs.eval_set if isinstance(e.prompt, str)]
    assert plain
    for prompt in plain:
        ours = inputs.tok.encode_prompt(prompt)
        if model == "tiny":
            assert ours == CharTokenizer().encode(prompt, bos=True)
            continue
        hf = inputs.tok.tokenizer
        messages = [{"role": "user", "content": prompt}]
        expected = hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=False) if wrapped else prompt
        assert hf.decode(ours) == expected


def test_a_system_prompt_where_plain_text_goes_in_raw_is_refused_in_one_line(tmp_path):
    base = ["task.name=dataset", f"task.dataset={tmp_path}/d.jsonl", "task.answer_column=a", "task.system_prompt=hi."]
    with pytest.raises(ValueError) as caught:
        load_config(None, base)
    assert str(caught.value) == ('task.system_prompt must be none when plain-text prompts go in raw, as with task.'
                                 'chat_template "conversational" (task.name "dataset"\'s "auto"; "on" puts every '
                                 "prompt and the system message through the template), got 'hi.'")  # fmt: skip
    with pytest.raises(ValueError, match="task.system_prompt must be none when plain-text prompts go in raw"):
        load_config(None, ["task.name=add", "task.chat_template=conversational", "task.system_prompt=hi."])
    assert load_config(None, ["task.name=add", "task.system_prompt=hi."]).task.system_prompt == "hi."  # as before
    assert load_config(None, [*base, "task.chat_template=on"]).task.system_prompt == "hi."


# ---- a reward function that raises -------------------------------------------------------------------------------

RAISING = '''
import asyncio


def share(c, a):
    return len(c) / (len(a) - 1)


def ratio(completions, answer, **kwargs):
    return [share(c, a) for c, a in zip(completions, answer)]


async def ratio_async(completions, answer, **kwargs):
    await asyncio.sleep(0)
    return [share(x, y) for x, y in zip(completions, answer)]


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    return share(solution_str, ground_truth)
'''


def _examples(answers):
    from grpo_kernels.train.data.tasks import Example

    return [Example(prompt=f"q{i}", answer=a) for i, a in enumerate(answers)]


def _line(text: str, source: str) -> int:
    return next(i for i, line in enumerate(text.splitlines(), 1) if line.strip() == source)


@pytest.mark.parametrize("name, processes", [("ratio", 0), ("ratio", 1), ("ratio_async", 0), ("compute_score", 0)])
def test_a_reward_function_that_raises_is_shown_with_the_users_file_line_and_traceback(tmp_path, name, processes):
    path = tmp_path / "my_rewards.py"
    path.write_text(RAISING)
    rewards = Rewards([load_reward_function(f"{path}:{name}")], processes=processes)
    share = _line(RAISING, "return len(c) / (len(a) - 1)")
    try:
        with pytest.raises(RewardError) as caught:
            rewards.score(_examples(["12", "3", "1"]), ["12", "3", "1"], [[1]] * 3, step=3)
        with pytest.raises(RewardError, match=r"^reward function .* raised ZeroDivisionError: division by zero in a "
                                              r"held-out evaluation\n"):  # fmt: skip
            rewards.score(_examples(["1"]), ["1"], [[1]], step=0, record=False)
    finally:
        rewards.close()
    lines = str(caught.value).splitlines()
    assert lines[0] == (f"reward function {name!r} ({path}:{share}) raised ZeroDivisionError: division by zero in "
                        "training step 3")  # the deepest line of the user's file, then when
    assert lines[1] == "  Traceback of the reward function (most recent call last):"
    called = {"ratio": "return [share(c, a) for c, a in zip(completions, answer)]",
              "ratio_async": "return [share(x, y) for x, y in zip(completions, answer)]",
              "compute_score": "return share(solution_str, ground_truth)"}[name]  # fmt: skip
    assert lines[2:4] == [f'    File "{path}", line {_line(RAISING, called)}, in {name}', f"      {called}"]
    assert lines[-2:] == [f'    File "{path}", line {share}, in share', "      return len(c) / (len(a) - 1)"]
    assert "grpo_kernels" not in str(caught.value) and "asyncio" not in str(caught.value)  # the user's frames only


def test_a_multi_line_message_keeps_its_first_line_on_the_first_line_and_all_of_it_below(tmp_path):
    path = tmp_path / "r.py"
    path.write_text("def f(completions, **kw):\n    raise ValueError('bad row\\nsecond line')\n")
    with pytest.raises(RewardError) as caught:
        Rewards([load_reward_function(f"{path}:f")]).score(_examples(["1"]), ["1"], [[1]], step=1)
    lines = str(caught.value).splitlines()
    assert lines[0] == f"reward function 'f' ({path}:2) raised ValueError: bad row ... in training step 1"
    assert lines[-2:] == ["  ValueError: bad row", "  second line"]


FAILS_AT = '''
CALLS = []


def fails(completions, **kwargs):
    CALLS.append(len(completions))
    if len(CALLS) == {call}:
        return [1 / 0 for c in completions]
    return [0.0] * len(completions)
'''


def _train(run, *extra):
    main(["train", f"--logging.run_dir={run}", "--optim.steps=2", "--sampling.group_size=2",
          "--sampling.prompts_per_step=2", "--sampling.max_new_tokens=2", "--task.num_eval_prompts=6",
          "--packing.token_budget=64", "--task.name=add", *extra])  # fmt: skip


@pytest.mark.parametrize("call, when", [
    (1, "in the held-out evaluation before training"),   # scoring calls: the evaluation, steps 0 and 1, the final one
    (3, "in training step 1"),
    (4, "in the final held-out evaluation"),
])  # fmt: skip
def test_the_trainer_says_in_which_step_or_evaluation_a_reward_function_raised(tmp_path, call, when):
    path = tmp_path / f"fails_{call}.py"
    path.write_text(FAILS_AT.format(call=call))
    with pytest.raises(SystemExit) as caught:
        _train(tmp_path / "run", f"--task.reward_funcs={path}:fails", "--export.at_end=false")
    line = _line(FAILS_AT, "return [1 / 0 for c in completions]")
    assert str(caught.value).splitlines()[:4] == [
        f"grpo-kernels train: error: reward function 'fails' ({path}:{line}) raised ZeroDivisionError: division by "
        f"zero {when}", "  Traceback of the reward function (most recent call last):",
        f'    File "{path}", line {line}, in fails', "      return [1 / 0 for c in completions]"]  # fmt: skip


# ---- unscorable answers in held-out success ----------------------------------------------------------------------

SOLVED = '''
def solved(completion_ids, solution, **kwargs):
    """1.0 when the completion's first token is a multiple of the solution; None where the row has no solution."""
    return [None if s == "none" else float(ids[0] % int(s) == 0) for ids, s in zip(completion_ids, solution)]
'''
SOLVED_ROWS = [{"prompt": "t5 t6 t7", "solution": "3"}, {"prompt": "t8 t9", "solution": "none"},
               {"prompt": "t10 t11", "solution": "2"}]  # fmt: skip


def test_held_out_success_leaves_unscorable_answers_out_as_trls_mean_does_and_counts_them(tmp_path):
    import importlib.util

    import transformers

    (tmp_path / "my_rewards.py").write_text(SOLVED)
    spec = importlib.util.spec_from_file_location("solved_for_trl", tmp_path / "my_rewards.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    calls = []
    solved = lambda **kw: calls.append(kw) or module.solved(**kw)  # noqa: E731
    solved.__name__ = "solved"
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(tiny_config())
    args = trl.GRPOConfig(output_dir=str(tmp_path / "trl"), per_device_train_batch_size=12, num_generations=4,
                          max_completion_length=8, report_to="none", use_cpu=True, seed=0, bf16=False)  # fmt: skip
    trainer = trl.GRPOTrainer(model=model, reward_funcs=[solved], args=args,
                              train_dataset=datasets.Dataset.from_list(SOLVED_ROWS),
                              processing_class=tokenizer())  # fmt: skip
    trainer._generate_single_turn = scripted_generate.__get__(trainer)
    trainer.model.eval()  # TRL's evaluation: its metrics go to "eval"
    trainer._generate_and_score_completions([dict(r) for r in SOLVED_ROWS for _ in range(4)])
    theirs = trainer._metrics["eval"]["rewards/solved/mean"][-1]

    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in SOLVED_ROWS))
    config = load_config(None, ["task.name=dataset", f"task.dataset={data}", "task.num_eval_prompts=0",
                                "task.num_train_prompts=3", f"task.reward_funcs={tmp_path}/my_rewards.py:solved"])
    task, train, _ = task_examples(config)
    rewards = task_rewards(task, config.task)
    by_prompt = {e.prompt: e for e in train}
    ids = calls[-1]["completion_ids"]
    examples = [by_prompt[r["prompt"]] for r in SOLVED_ROWS for _ in range(4)]
    per_func = rewards.score(examples, ["x"] * len(ids), ids, step=0, record=False)
    rollout = Rollout(prompt_ids=[torch.tensor([1])] * len(ids), completion_ids=[torch.tensor(c) for c in ids],
                      sampler_logps=[torch.zeros(len(c)) for c in ids], group_size=4)  # fmt: skip
    result = held_out_result(rollout.with_rewards(rewards.combine(per_func), per_func=per_func), rewards)
    assert result.success == pytest.approx(theirs, rel=1e-6), "held-out success is TRL's mean of the function"
    assert 0 < result.success < 1 and (result.scored, result.unscorable) == (8, 4)
    assert result.means == {"solved": pytest.approx(theirs, rel=1e-6)}
    assert with_standard_error(result.success, result.scored, unscorable=result.unscorable) == (
        f"{result.success:.3f} ± {standard_error(result.success, 8):.3f} (4 unscorable, left out)")


def test_when_no_answer_can_be_scored_success_is_na_and_says_so():
    rewards = Rewards([load_reward_function("exact")])
    per_func = torch.full((4, 1), float("nan"), dtype=torch.float64)
    rollout = Rollout(prompt_ids=[torch.tensor([1])] * 4, completion_ids=[torch.tensor([2])] * 4,
                      sampler_logps=[torch.zeros(1)] * 4, group_size=1)  # fmt: skip
    with pytest.warns(UserWarning, match=r"the success function 'exact' returned None for every one of the 4 answers: "
                                         r"none could be scored, success is n/a"):  # fmt: skip
        result = held_out_result(rollout.with_rewards(rewards.combine(per_func), per_func=per_func), rewards)
    assert math.isnan(result.success) and (result.scored, result.unscorable) == (0, 4)
    assert with_standard_error(result.success, result.scored, unscorable=4) == "n/a (none of the 4 answers could be " \
                                                                               "scored)"


def test_grpo_kernels_eval_counts_success_and_pass_at_k_over_the_scored_answers():
    from grpo_kernels.train.evaluate import _summary

    rewards = Rewards([load_reward_function("exact")])
    values = [[1.0, None], [None, None], [0.0, 1.0]]  # 3 prompts x 2 answers: 3 scored (2 succeed), 3 left out
    per_func = torch.tensor([[float("nan") if v is None else v for v in row] for row in values]).reshape(6, 1)
    rollout = Rollout(prompt_ids=[torch.tensor([1])] * 6, completion_ids=[torch.tensor([2])] * 6,
                      sampler_logps=[torch.zeros(1)] * 6, group_size=2)  # fmt: skip
    rollout = rollout.with_rewards(rewards.combine(per_func), per_func=per_func.double())
    inputs = SimpleNamespace(rewards=rewards, eval_set=[None] * 3)
    summary = _summary(rollout, inputs, 2, "m")
    assert summary["success"] == pytest.approx(2 / 3) and (summary["scored"], summary["unscorable"]) == (3, 3)
    assert summary["pass@1"] == pytest.approx((1.0 + 0.5) / 2)  # prompt 1 (no answer scored) left out
    assert summary["pass@2"] == pytest.approx(1.0)  # prompt 2 alone has 2 scored answers: one succeeds


HALF = '''
def half(completions, answer, **kwargs):
    """None where the reference is even (it cannot be scored, say), else whether the completion is the answer."""
    return [None if int(a) % 2 == 0 else float(c.strip() == a) for c, a in zip(completions, answer)]
'''


def test_a_runs_log_eval_rows_summary_and_card_count_the_unscorable_answers(tmp_path, capsys):
    from grpo_kernels.train.checkpoint_export import _held_out

    path, run = tmp_path / "half.py", tmp_path / "run"
    path.write_text(HALF)
    _train(run, f"--task.reward_funcs={path}:half", "--task.eval_every=1", "--checkpoint.every=2")
    config = load_config(run / "config.toml")
    held = task_examples(config)[2]
    left = sum(int(e.answer) % 2 == 0 for e in held)
    assert 0 < left < len(held) == 6
    summary = json.loads((run / "summary.json").read_text())
    evals = [json.loads(line) for line in (run / "eval.jsonl").read_text().splitlines()]
    for when, row in (("start", None), ("end", evals[-1])):
        success, scored = summary[f"eval_success_{when}"], summary[f"eval_scored_{when}"]
        assert (scored, summary[f"eval_unscorable_{when}"], summary["eval_prompts"]) == (6 - left, left, 6)
        assert summary[f"eval_success_se_{when}"] == pytest.approx(standard_error(success, scored))
        assert summary[f"eval_rewards_{when}"] == {"half": pytest.approx(success)}
        if row is not None:
            assert (row["eval_success"], row["eval_scored"], row["eval_unscorable"]) == (success, scored, left)
    out = capsys.readouterr().out
    assert f"held-out success before RL: {summary['eval_success_start']:.3f} ± " in out
    assert f"({left} unscorable, left out)" in out
    card = (run / "model" / "README.md").read_text()
    assert re.search(rf"{summary['eval_success_end']:.3f} ± {summary['eval_success_se_end']:.3f} \({left} unscorable "
                     rf"answers left out, {6 - left} scored\) after", card), card
    state = json.loads((run / "checkpoints" / "step_2" / "trainer_state.json").read_text())
    card_numbers = _held_out(run, state, 6)  # what `grpo-kernels export` of the checkpoint puts on its card
    assert {k: card_numbers[k] for k in card_numbers if k != "steps"} == pytest.approx(
        {k: summary[k] for k in card_numbers if k != "steps"})  # fmt: skip

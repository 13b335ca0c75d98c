"""Reward functions as TRL and verl users write them (grpo_kernels.train.data.rewards): the calling conventions, None as
"does not apply" (skipped in the weighted sum; an all-None completion left out of its group with advantage 0),
timeouts, worker processes, and a clear error for every bad input."""

import asyncio
import math
import time
from pathlib import Path

import pytest
import torch

from grpo_kernels import group_advantages
from grpo_kernels.train.config.io import load_config
from grpo_kernels.train.data.rewards import RewardError, RewardFunction, Rewards, load_reward_function
from grpo_kernels.train.data.tasks import Example
from grpo_kernels.train.rollout.batch import Rollout

TRL_FILE = '''
import asyncio

calls = []

def correct(prompts, completions, completion_ids, answer, trainer_state, log_metric, **kwargs):
    calls.append(dict(prompts=prompts, completions=completions, completion_ids=completion_ids, answer=answer,
                      step=trainer_state.global_step, extra=sorted(kwargs)))
    log_metric("correct/seen", len(completions))
    return [1.0 if c.strip() == a else 0.0 for c, a in zip(completions, answer)]

def only_long(completions, **kwargs):
    """None for a completion of one character: the function does not apply to it."""
    return [None if len(c) < 2 else len(c) / 10 for c in completions]

def chat_correct(prompts, completions, answer, **kwargs):
    calls.append(dict(prompts=prompts, completions=completions))
    return [float(c[0]["content"] == a) for c, a in zip(completions, answer)]

async def slow_async(completions, **kwargs):
    await asyncio.sleep(0.01)
    return [0.5] * len(completions)

def hangs(completions, **kwargs):
    while True:
        pass

async def hangs_async(completions, **kwargs):
    await asyncio.sleep(60)

def sleeps(completions, **kwargs):
    import time
    time.sleep(60)

def numpy_matches(completions, answer, **kwargs):
    """np.isclose's numpy.bool_ per completion (None where the completion is not a number)."""
    import numpy as np
    return [np.isclose(float(c), float(a)) if c.isdigit() else None for c, a in zip(completions, answer)]

def numpy_kinds(answer, **kwargs):
    """A numpy integer or float, or a Python bool, by the answer (1 to 5)."""
    import numpy as np
    kinds = [np.int64(2), np.float32(0.5), True, np.float16(0.25), np.uint8(3)]
    return [kinds[int(a) - 1] for a in answer]

def numpy_date(completions, **kwargs):
    import numpy as np
    return [np.float64(1.0)] + [np.datetime64("2026-12-06")] * (len(completions) - 1)
'''

VERL_FILE = '''
seen = []

def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    seen.append((data_source, solution_str, ground_truth, extra_info))
    return {"score": float(solution_str == ground_truth), "acc": True}
'''


def _examples(answers, **columns):
    """Examples q0, q1, ... with these answers and, when given, more columns (one value per example)."""
    out = []
    for i, a in enumerate(answers):
        extra = {k: v[i] for k, v in columns.items()}
        out.append(Example(prompt=f"q{i}", answer=a, columns={"answer": a, **extra} if extra else {}))
    return out


@pytest.fixture
def trl_file(tmp_path):
    path = tmp_path / "my_rewards.py"
    path.write_text(TRL_FILE)
    return path


def test_a_trl_reward_file_gets_trls_keywords_and_its_values_come_back_per_function(trl_file):
    correct = load_reward_function(f"{trl_file}:correct")
    rewards = Rewards([correct, load_reward_function(f"{trl_file}:only_long")], [1.0, 0.5])
    examples = _examples(["12", "7", "x"], level=[1, 2, 3])
    completions = ["12", "8", "xyz"]
    per_func = rewards.score(examples, completions, [[5, 2], [6, 2], [7, 8, 9]], step=4, max_steps=10)
    call = correct.func.__globals__["calls"][-1]
    assert call == dict(prompts=["q0", "q1", "q2"], completions=completions, completion_ids=[[5, 2], [6, 2], [7, 8, 9]],
                        answer=["12", "7", "x"], step=4, extra=["level"])  # fmt: skip
    assert per_func[:, 0].tolist() == [1.0, 0.0, 0.0]
    assert per_func[0, 1] == 0.2 and math.isnan(per_func[1, 1]) and per_func[2, 1] == 0.3
    assert rewards.combine(per_func).tolist() == pytest.approx([1.1, 0.0, 0.15])  # None skipped in the sum
    assert rewards.take_logged()["correct/seen"] == 3.0 and rewards.take_logged() == {"reward_s": 0.0}


def test_async_functions_run_and_conversational_prompts_pass_as_messages(trl_file):
    chat = load_reward_function(f"{trl_file}:chat_correct")
    rewards = Rewards([load_reward_function(f"{trl_file}:slow_async"), chat])
    example = Example(prompt=({"role": "user", "content": "say 1"},), answer="1")
    per_func = rewards.score([example], [[{"role": "assistant", "content": "1"}]], [[3]], step=0)
    assert per_func.tolist() == [[0.5, 1.0]]
    assert chat.func.__globals__["calls"][-1] == dict(prompts=[[{"role": "user", "content": "say 1"}]],
                                                      completions=[[{"role": "assistant", "content": "1"}]])


def test_a_completion_no_function_scores_is_left_out_of_its_group_with_advantage_0():
    n = 8
    rollout = Rollout(prompt_ids=[torch.tensor([1])] * n, completion_ids=[torch.tensor([2])] * n,
                      sampler_logps=[torch.zeros(1)] * n, group_size=4)  # fmt: skip
    g = torch.Generator().manual_seed(0)
    rewards = torch.rand(n, generator=g, dtype=torch.float64)
    rewards[1] = rewards[5] = rewards[6] = float("nan")
    scored = rollout.with_rewards(rewards)
    kept = rewards[~rewards.isnan()].float()
    expected = group_advantages(kept, group_offsets=torch.tensor([0, 3, 5]))
    adv = scored.advantages.advantages
    assert adv[1] == 0 and adv[5] == 0 and adv[6] == 0
    torch.testing.assert_close(adv[~rewards.isnan()], expected.advantages)
    assert scored.advantages.valid.tolist() == expected.valid.tolist()
    assert scored.unscorable_fraction() == 3 / 8
    assert scored.pass_rates()[0] == pytest.approx(kept[:3].double().mean().item())
    everything = rollout.with_rewards([float("nan")] * 4 + [1.0, 0.0, 1.0, 0.0])
    assert everything.advantages.valid.tolist() == [False, True] and everything.advantages.advantages[:4].eq(0).all()


def test_verl_compute_score_is_called_per_completion(tmp_path):
    path = tmp_path / "verl_reward.py"
    path.write_text(VERL_FILE)
    f = load_reward_function(str(path))  # a file alone: verl's default name, compute_score
    assert f.verl and f.name == "compute_score"
    examples = [Example(prompt="p", answer=None, columns={"data_source": "gsm8k", "reward_model":
                                                          {"ground_truth": "4"}, "extra_info": {"i": 0}}),
                Example(prompt="p", answer="5")]  # fmt: skip
    per_func = Rewards([f], task_name="mytask").score(examples, ["4", "5"], [[1], [2]], step=0)
    assert per_func[:, 0].tolist() == [1.0, 1.0]
    assert f.func.__globals__["seen"] == [("gsm8k", "4", "4", {"i": 0}), ("mytask", "5", "5", None)]


def test_worker_processes_give_the_same_values_and_log_metric(trl_file):
    functions = [load_reward_function(f"{trl_file}:correct"), load_reward_function(f"{trl_file}:only_long")]
    examples = _examples([str(i) for i in range(7)])
    completions = [str(i) if i % 2 else "no" for i in range(7)]
    ids = [[i] for i in range(7)]
    here = Rewards(functions).score(examples, completions, ids, step=1)
    pooled = Rewards(functions, processes=2)
    try:
        there = pooled.score(examples, completions, ids, step=1)
        assert torch.equal(here.nan_to_num(-1), there.nan_to_num(-1))
        assert pooled.take_logged()["correct/seen"] == 3.5  # two workers: slices of 4 and 3 rows
    finally:
        pooled.close()


@pytest.mark.parametrize("processes", [0, 2])
def test_numpy_bools_integers_floats_and_python_bools_are_rewards_as_trl_converts_them(trl_file, processes):
    # TRL takes a function's values as torch.tensor(values, dtype=torch.float32) (None as NaN): np.isclose's
    # numpy.bool_ is a reward there, so it is here, in this process and from worker processes (pickled back)
    import numpy as np

    functions = [load_reward_function(f"{trl_file}:{name}") for name in ("numpy_matches", "numpy_kinds")]
    examples, completions = _examples(["1", "2", "3", "4", "5"]), ["1", "7", "x", "4", "05"]
    rewards = Rewards(functions, processes=processes)
    try:
        ours = rewards.score(examples, completions, [[1]] * 5, step=0)
    finally:
        rewards.close()
    answers = [e.answer for e in examples]
    theirs = [torch.tensor([torch.nan if v is None else v for v in f.func(completions=completions, answer=answers)],
                           dtype=torch.float32) for f in functions]  # fmt: skip
    assert isinstance(functions[0].func(completions=["1"], answer=["1"])[0], np.bool_)
    torch.testing.assert_close(ours.float(), torch.stack(theirs, dim=1), equal_nan=True)
    assert ours[:, 0].nan_to_num(-1).tolist() == [1.0, 0.0, -1.0, 1.0, 1.0]
    assert ours[:, 1].tolist() == [2.0, 0.5, 1.0, 0.25, 3.0]
    # what is not a number is still refused, naming the function and the row
    rewards = Rewards([load_reward_function(f"{trl_file}:numpy_date")], processes=min(processes, 1))
    try:
        with pytest.raises(RewardError, match=r"reward function 'numpy_date' .* in training step 0, row 1 \(prompt "
                                              r"'q1'\) returned datetime64 .*2026-12-06.*: a reward is a number"):
            rewards.score(examples[:2], completions[:2], [[1]] * 2, step=0)
    finally:
        rewards.close()


@pytest.mark.parametrize("name, processes", [("hangs", 0), ("sleeps", 0), ("hangs_async", 0), ("sleeps", 1)])
def test_a_hung_reward_function_is_stopped_at_the_timeout(trl_file, name, processes):
    rewards = Rewards([load_reward_function(f"{trl_file}:{name}")], timeout_s=0.5, processes=processes)
    start = time.perf_counter()
    try:
        with pytest.raises(RewardError, match=rf"reward function '{name}' .* did not return within "
                                              r"task.reward_timeout_s = 0.5 s in training step 3"):  # fmt: skip
            rewards.score(_examples(["1"]), ["1"], [[1]], step=3)
    finally:
        rewards.close()
    assert time.perf_counter() - start < 30  # the pool's start-up (spawn) included


BAD_FILE = '''
NOT_CALLABLE = 3

def raises(completions, **kwargs):
    raise KeyError("no such column")

def too_few(completions, **kwargs):
    return [1.0] * (len(completions) - 1)

def a_string(completions, **kwargs):
    return [1.0, "high"]

def infinite(completions, **kwargs):
    return [1.0, float("inf")]

def nan(completions, **kwargs):
    return [float("nan"), 1.0]

def not_a_list(completions, **kwargs):
    return 1.0

def a_numpy_string(completions, **kwargs):
    import numpy as np
    return [np.float32(1.0), np.str_("high")]

def a_complex(completions, **kwargs):
    return [True, 1j]
'''


@pytest.mark.parametrize("name, message", [
    ("raises", r"reward function 'raises' \(.*bad.py:5\) raised KeyError: 'no such column' in training step 2"),
    ("too_few", r"'too_few' .* in training step 2 returned 1 values for 2 completions"),
    ("a_string", r"'a_string' .* in training step 2, row 1 \(prompt 'q1'\) returned str 'high': a reward is a number"),
    ("infinite", r"'infinite' .* in training step 2, row 1 \(prompt 'q1'\) returned inf: a reward is finite"),
    ("not_a_list", r"'not_a_list' .* in training step 2 returned float, not one value per completion \(2\)"),
    ("a_numpy_string", r"'a_numpy_string' .* row 1 \(prompt 'q1'\) returned str_ .*'high'.*: a reward is a number "),
    ("a_complex", r"'a_complex' .* in training step 2, row 1 \(prompt 'q1'\) returned complex 1j: a reward is a "),
])  # fmt: skip
def test_a_reward_function_that_misbehaves_is_named_with_the_step_and_the_row(tmp_path, name, message):
    path = tmp_path / "bad.py"
    path.write_text(BAD_FILE)
    with pytest.raises(RewardError, match=message):
        Rewards([load_reward_function(f"{path}:{name}")]).score(_examples(["1", "2"]), ["1", "2"], [[1], [2]], step=2)


def test_a_nan_reward_is_taken_as_none_as_trl_takes_it_with_one_warning(tmp_path):
    import warnings

    path = tmp_path / "bad.py"
    path.write_text(BAD_FILE)
    function = load_reward_function(f"{path}:nan")
    rewards = Rewards([function, load_reward_function("exact")])
    with pytest.warns(UserWarning, match=r"'nan' .* in training step 2, row 0 \(prompt 'q0'\) returned NaN: taken as"):
        ours = rewards.score(_examples(["1", "2"]), ["1", "x"], [[1], [2]], step=2)
    theirs = torch.tensor([torch.nan if v is None else v for v in function.func(completions=["1", "x"])])  # TRL's
    torch.testing.assert_close(ours[:, 0].float(), theirs, equal_nan=True)
    assert rewards.combine(ours).tolist() == [1.0, 1.0]  # the NaN skipped in the weighted sum, as TRL's nansum does
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once per function: the second batch is quiet
        rewards.score(_examples(["1", "2"]), ["1", "x"], [[1], [2]], step=3)


@pytest.mark.parametrize("spec, message", [
    ("no_such_module_xyz:f", r"'no_such_module_xyz:f': importing no_such_module_xyz failed: ModuleNotFoundError"),
    ("{dir}/missing.py:f", r"no file .*missing.py"),
    ("{dir}/broken.py:f", r"running .*broken.py failed: ZeroDivisionError"),
    ("{dir}/bad.py:nothing", r"nothing in /.*/bad\.py is nothing \(its functions: a_complex, .*raises, too_few\)"),
    ("{dir}/bad.py:NOT_CALLABLE", r"NOT_CALLABLE in /.*/bad\.py is a int, not a function \(its functions: a_complex"),
    ("just_a_word", r"'just_a_word' is neither a built-in reward"),
])  # fmt: skip
def test_a_spec_that_does_not_load_is_an_error_naming_it(tmp_path, spec, message):
    (tmp_path / "bad.py").write_text(BAD_FILE)
    (tmp_path / "broken.py").write_text("1 / 0\n")
    with pytest.raises(RewardError, match=message):
        load_reward_function(spec.format(dir=tmp_path))


def test_rewards_refuse_duplicate_names_wrong_weights_and_an_unknown_success(trl_file):
    f = load_reward_function(f"{trl_file}:correct")
    with pytest.raises(RewardError, match="two functions are named 'correct'"):
        Rewards([f, f])
    with pytest.raises(RewardError, match="2 weights for 1 reward functions"):
        Rewards([f], [1.0, 2.0])
    with pytest.raises(RewardError, match=r"task.success_reward: 'other' is none of the reward functions \(correct\)"):
        Rewards([f], success="other")


def test_relative_reward_files_resolve_against_the_config_folder_or_the_working_directory(tmp_path, monkeypatch):
    folder = tmp_path / "configs"
    folder.mkdir()
    (folder / "run.toml").write_text('[task]\nreward_funcs = ["rewards/mine.py:f", "pkg.mod:g", "exact"]\n')
    config = load_config(folder / "run.toml")
    assert config.task.reward_funcs == (f"{folder}/rewards/mine.py:f", "pkg.mod:g", "exact")
    monkeypatch.chdir(tmp_path)
    config = load_config(None, ["task.reward_funcs=mine.py:f,other.py", "task.reward_weights=1,0.5"])
    assert config.task.reward_funcs == (f"{tmp_path}/mine.py:f", f"{tmp_path}/other.py")
    assert config.task.reward_weights == (1.0, 0.5)


def test_the_built_in_tasks_score_through_the_same_functions():
    from grpo_kernels.train.build import task_rewards
    from grpo_kernels.train.data.tasks import make_task

    arith = task_rewards(make_task("arith", format_weight=0.5))
    assert arith.names == ["arith_correct", "arith_format"] and arith.weights == [1.0, 0.5]
    e = Example(prompt="What is 2 + 2?", answer="4")
    per_func = arith.score([e, e, e], ["4", "It is 4.", "5"], [[], [], []], step=0)
    assert per_func.tolist() == [[1.0, 1.0], [1.0, 0.0], [0.0, 1.0]]
    assert arith.combine(per_func).tolist() == [arith.reward(c, e) for c in ("4", "It is 4.", "5")]
    assert [arith.correct(c, e) for c in ("4", "It is 4.", "5")] == [1.0, 1.0, 0.0]


def test_an_async_function_that_never_awaits_again_is_still_stopped():
    async def busy(completions, **kwargs):
        await asyncio.sleep(0)
        await asyncio.sleep(30)
        return [1.0]

    rewards = Rewards([RewardFunction("busy", busy, "test")], timeout_s=0.2)
    with pytest.raises(RewardError, match="did not return within"):
        rewards.score(_examples(["1"]), ["1"], [[1]], step=0)


def test_a_function_that_returns_before_the_deadline_leaves_no_interrupt_behind():
    def quick(completions, **kwargs):
        return [1.0]

    rewards = Rewards([RewardFunction("quick", quick, "test")], timeout_s=0.05)
    for _ in range(20):
        assert rewards.score(_examples(["1"]), ["1"], [[1]], step=0).tolist() == [[1.0]]
        time.sleep(0.06)  # past the deadline of a call that has already returned: the timer was cancelled


def test_the_built_in_tasks_import_neither_datasets_nor_math_verify():
    import subprocess
    import sys

    code = ("import sys\nfrom grpo_kernels.train.build import task_examples, task_rewards\n"
            "from grpo_kernels.train.config.io import load_config\n"
            "for name in ('reverse', 'add', 'arith'):\n"
            "    task, train, _ = task_examples(load_config(None, [f'task.name={name}']))\n"
            "    task_rewards(task).score(train[:2], ['1', '2'], [[1], [2]], step=0)\n"
            "print(sorted(m for m in ('datasets', 'math_verify') if m in sys.modules))\n")  # fmt: skip
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip() == "[]", out.stderr[-2000:]


def test_the_math_verify_reward_compares_the_final_answers():
    pytest.importorskip("math_verify")
    f = load_reward_function("math_verify")
    values = Rewards([f]).score(_examples(["1/2", "3"]), ["The answer is $\\frac{1}{2}$", "It is 4"], [[1], [2]],
                                step=0)  # fmt: skip
    assert values[:, 0].tolist() == [1.0, 0.0]


def test_bad_arguments_to_rewards_are_refused_naming_them(trl_file):
    f = load_reward_function(f"{trl_file}:correct")
    for kwargs, message in ((dict(weights=[float("nan")]), "task.reward_weights: finite numbers"),
                            (dict(weights=["1"]), "task.reward_weights: finite numbers"),
                            (dict(timeout_s=0), "task.reward_timeout_s: a number > 0"),
                            (dict(processes=-1), "task.reward_processes: an int >= 0")):  # fmt: skip
        with pytest.raises(RewardError, match=message):
            Rewards([f], **kwargs)
    with pytest.raises(ValueError, match=r"one example and one completion_ids entry per completion \(2\), got 1"):
        Rewards([f]).score(_examples(["1"]), ["1", "2"], [[1], [2]], step=0)


def test_more_reward_processes_than_cores_is_refused_before_the_run():
    import os

    from grpo_kernels.train import preflight

    cores = len(os.sched_getaffinity(0))
    config = load_config(None, [f"task.reward_processes={cores + 1}"])
    with pytest.raises(ValueError, match=rf"task.reward_processes = {cores + 1} is more worker processes than the "
                                         rf"{cores} CPU cores"):  # fmt: skip
        preflight.check(config, "cpu")
    assert preflight.check(load_config(None, [f"task.reward_processes={cores}"]), "cpu").task.reward_processes == cores


def test_the_timeout_stops_a_hung_function_where_sigint_is_ignored(trl_file, tmp_path):
    """A process started in the background by a shell inherits SIGINT ignored; the timeout still stops a hung call
    there (it hung the run before), and SIGINT is ignored again after the call."""
    import signal
    import subprocess
    import sys

    script = tmp_path / "run.py"
    script.write_text(
        "import signal\n"
        "from grpo_kernels.train.data.rewards import RewardError, Rewards, load_reward_function\n"
        "from grpo_kernels.train.data.tasks import Example\n"
        f"rewards = Rewards([load_reward_function({str(trl_file) + ':hangs'!r})], timeout_s=0.5)\n"
        "try:\n"
        "    rewards.score([Example(prompt='q0', answer='1')], ['1'], [[1]], step=3)\n"
        "except RewardError as e:\n"
        "    print('stopped:', e)\n"
        "print('ignored after:', signal.getsignal(signal.SIGINT) is signal.SIG_IGN)\n"
    )  # fmt: skip
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60,
                         preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))  # fmt: skip
    assert "stopped: reward function 'hangs'" in out.stdout, out.stdout + out.stderr
    assert "ignored after: True" in out.stdout


HYGIENE_FILE = '''
import os, subprocess, time

import neighbour_helper  # a top-level import of a file beside this one

def swallows(completions, **kwargs):
    """A grader whose bare except swallows an interrupt: one slow check per completion."""
    out = []
    for c in completions:
        try:
            time.sleep(5)
        except:  # noqa: E722
            pass
        out.append(neighbour_helper.ZERO)
    return out

def slow_by_answer(completions, answer, **kwargs):
    time.sleep(float(answer[0]))
    return [1.0] * len(completions)

def starts_a_child(completions, answer, **kwargs):
    child = subprocess.Popen(["sleep", "60"])
    with open(answer[0], "w") as f:
        f.write(str(child.pid))
    time.sleep(60)
'''


@pytest.fixture
def hygiene_file(tmp_path):
    (tmp_path / "neighbour_helper.py").write_text("ZERO = 0.0\n")
    (tmp_path / "colorsys.py").write_text("SHADOW = True\n")  # a neighbour named like a standard module
    path = tmp_path / "hygiene.py"
    path.write_text(HYGIENE_FILE)
    return path


def test_a_reward_files_folder_is_on_sys_path_only_while_it_is_imported(hygiene_file):
    import importlib
    import sys

    load_reward_function(f"{hygiene_file}:swallows")  # its top-level import of its neighbour works
    assert str(hygiene_file.parent) not in sys.path
    saved = sys.modules.pop("colorsys", None)
    try:
        assert not hasattr(importlib.import_module("colorsys"), "SHADOW")  # the standard module, not the neighbour
    finally:
        sys.modules.pop("colorsys", None)
        if saved is not None:
            sys.modules["colorsys"] = saved


def test_a_timeout_is_an_error_even_when_the_function_swallows_the_interrupt(hygiene_file):
    rewards = Rewards([load_reward_function(f"{hygiene_file}:swallows")], timeout_s=0.5)
    start = time.perf_counter()
    with pytest.raises(RewardError, match=r"'swallows' .* did not return within task.reward_timeout_s = 0.5 s in "
                                          r"training step 2 \(it caught the interrupt and returned after"):  # fmt: skip
        rewards.score(_examples(["1", "2", "3"]), ["1", "2", "3"], [[1]] * 3, step=2)
    assert time.perf_counter() - start < 3  # each swallowed interrupt is followed by another (not 3 x 5 s)


def test_the_worker_pool_has_one_deadline_per_batch_and_stops_what_the_workers_started(hygiene_file, tmp_path):
    import os

    rewards = Rewards([load_reward_function(f"{hygiene_file}:slow_by_answer")], timeout_s=1.0, processes=2)
    try:  # the two halves take 0.7 s and 1.4 s, in parallel: each within 1 s of its own wait, the batch not
        with pytest.raises(RewardError, match=r"'slow_by_answer' .* did not return within task.reward_timeout_s"):
            rewards.score(_examples(["0.7", "1.4"]), ["a", "b"], [[1]] * 2, step=0)
    finally:
        rewards.close()
    pid_file = tmp_path / "child.pid"
    rewards = Rewards([load_reward_function(f"{hygiene_file}:starts_a_child")], timeout_s=1.0, processes=1)
    try:
        with pytest.raises(RewardError, match="did not return within"):
            rewards.score(_examples([str(pid_file)]), ["a"], [[1]], step=0)
    finally:
        rewards.close()
    child = int(pid_file.read_text())
    for _ in range(50):  # the worker's own child (a grader's subprocess) is stopped with it
        stat = Path(f"/proc/{child}/stat")
        if not stat.exists() or stat.read_text().split(")")[-1].split()[0] == "Z":
            break
        time.sleep(0.1)
    else:
        os.kill(child, 9)
        pytest.fail(f"the reward worker's child {child} is still running")


def test_a_killed_trainer_takes_its_reward_workers_and_what_they_started_down(hygiene_file, tmp_path):
    """The workers lead sessions of their own, so the trainer's group no longer reaches them: when the trainer is
    killed (it never closes the pool), each worker ends its own group."""
    import os
    import signal
    import subprocess
    import sys

    pid_file = tmp_path / "child.pid"
    script = tmp_path / "trainer.py"
    script.write_text(
        "from grpo_kernels.train.data.rewards import Rewards, load_reward_function\n"
        "from grpo_kernels.train.data.tasks import Example\n"
        "if __name__ == '__main__':\n"
        f"    rewards = Rewards([load_reward_function({str(hygiene_file) + ':starts_a_child'!r})], processes=1)\n"
        f"    rewards.score([Example(prompt='q0', answer={str(pid_file)!r})], ['a'], [[1]], step=0)\n"
    )  # fmt: skip
    trainer = subprocess.Popen([sys.executable, str(script)])
    try:
        for _ in range(600):  # the worker's start (spawn, imports) and the function's child
            if pid_file.exists() and pid_file.read_text():
                break
            time.sleep(0.1)
        else:
            pytest.fail("the reward function never started its child")
    finally:
        trainer.kill()
        trainer.wait()
    child = int(pid_file.read_text())
    for _ in range(100):
        stat = Path(f"/proc/{child}/stat")
        if not stat.exists() or stat.read_text().split(")")[-1].split()[0] == "Z":
            break
        time.sleep(0.1)
    else:
        os.killpg(os.getpgid(child), signal.SIGKILL)  # the orphaned worker's group: the worker and its child
        pytest.fail(f"the reward worker's child {child} outlived the killed trainer")

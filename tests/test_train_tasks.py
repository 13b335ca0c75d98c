"""Built-in tasks, rewards, the character tokenizer, the JSONL loader and the tiny decoder."""

import json
import re

import pytest
import torch

from grpo_kernels.train.build import task_rewards
from grpo_kernels.train.data.tasks import CharTokenizer, exact_match, load_jsonl, make_task, numeric_match, tiny_model


def test_tokenizer_round_trip_and_specials():
    tok = CharTokenizer()
    text = "reverse:abc=cba"
    ids = tok.encode(text, bos=True, eos=True)
    assert ids[0] == tok.bos_id and ids[-1] == tok.eos_id and len(ids) == len(text) + 2
    assert tok.decode(ids) == text
    assert tok.decode(tok.encode("12+3=") + [tok.eos_id] + tok.encode("junk")) == "12+3="
    assert max(ids) < tok.vocab_size
    with pytest.raises(ValueError, match="alphabet"):
        tok.encode("ABC")


@pytest.mark.parametrize("name", ["reverse", "add"])
def test_tasks_are_deterministic_and_rewards_are_binary(name):
    task = make_task(name, difficulty=3)
    rewards = task_rewards(task)
    a, b = task.examples(20, seed=7), task.examples(20, seed=7)
    assert a == b and a != task.examples(20, seed=8)
    tok = CharTokenizer()
    for ex in a:
        tok.encode(ex.prompt + ex.answer)  # in the alphabet
        assert rewards.reward(ex.answer, ex) == 1.0
        assert rewards.reward(ex.answer + "1", ex) == 0.0
        assert rewards.reward("", ex) == 0.0


def test_difficulty_controls_answer_length():
    short = [len(e.answer) for e in make_task("reverse", difficulty=1).examples(200, seed=0)]
    long = [len(e.answer) for e in make_task("reverse", difficulty=6).examples(200, seed=0)]
    assert max(short) <= 3 and min(long) >= 7
    sums = make_task("add", difficulty=4).examples(200, seed=0)
    assert all(str(int(e.prompt.split("+")[0]) + int(e.prompt[:-1].split("+")[1])) == e.answer for e in sums)
    with pytest.raises(ValueError, match="difficulty"):
        make_task("add", difficulty=0)
    with pytest.raises(ValueError, match="unknown task"):
        make_task("sort")


def test_reward_functions():
    assert exact_match(" abc ", "abc") == 1.0 and exact_match("abd", "abc") == 0.0
    assert numeric_match("42", "42.0") == 1.0 and numeric_match("4 2", "42") == 0.0 and numeric_match("x", "1") == 0.0


def test_jsonl_loader_and_its_errors(tmp_path):
    good = tmp_path / "good.jsonl"
    good.write_text(json.dumps({"prompt": "1+1=", "answer": 2}) + "\n\n" + json.dumps({"prompt": "p", "answer": "a"}))
    examples = load_jsonl(good)
    assert [e.answer for e in examples] == ["2", "a"]
    task = make_task("jsonl", path=good, reward="numeric")
    assert task_rewards(task).reward("2.0", examples[0]) == 1.0
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"prompt": "x"}) + "\n")
    with pytest.raises(ValueError, match=r"bad.jsonl:1: missing key\(s\) \['answer'\]"):
        load_jsonl(bad)
    bad.write_text("{not json\n")
    with pytest.raises(ValueError, match="not JSON"):
        load_jsonl(bad)
    with pytest.raises(ValueError, match="cannot read"):
        load_jsonl(tmp_path / "missing.jsonl")
    bad.write_bytes(b'{"prompt": "caf\xe9", "answer": "1"}\n')  # Latin-1, not UTF-8
    with pytest.raises(ValueError, match=r"bad\.jsonl is not UTF-8 text \(byte 15: invalid continuation byte\)"):
        load_jsonl(bad)
    with pytest.raises(ValueError, match="needs a path"):
        make_task("jsonl")


def test_jsonl_held_out_prompts_are_never_trained_on(tmp_path):
    import random

    from grpo_kernels.train.build import task_examples
    from grpo_kernels.train.config.io import load_config

    path = tmp_path / "sums.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"{i}+{i}=", "answer": 2 * i}) + "\n" for i in range(20)))
    config = load_config(None, ["task.name=jsonl", f"task.path={path}", "task.num_train_prompts=12",
                                "task.num_eval_prompts=5"])  # fmt: skip
    task, train, held = task_examples(config)
    assert len(train) == 12 and len(held) == 5 and len({e.prompt for e in train + held}) == 17  # no repeats, no overlap
    rng = random.Random(0)
    assert {task.example(rng).prompt for _ in range(200)} == {e.prompt for e in train}  # the warm start's draw too
    with pytest.warns(UserWarning, match=r"num_train_prompts = 512, but .*sums.jsonl has 15 examples to train on "
                                         r"after holding out 5: training on 15"):  # fmt: skip
        _, train, held = task_examples(load_config(None, ["task.name=jsonl", f"task.path={path}",
                                                          "task.num_eval_prompts=5"]))  # fmt: skip
    assert len(train) == 15 and not {e.prompt for e in train} & {e.prompt for e in held}
    with pytest.raises(ValueError, match="holds out every one of the 20 examples of .*sums.jsonl"):
        task_examples(load_config(None, ["task.name=jsonl", f"task.path={path}", "task.num_eval_prompts=20"]))


def test_jsonl_accepts_trl_conversational_prompts(tmp_path):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "1+1?"}]
    path = tmp_path / "chat.jsonl"
    path.write_text(json.dumps({"prompt": messages, "answer": 2}) + "\n")
    (example,) = load_jsonl(path)
    assert example.prompt == tuple(messages) and example.answer == "2"
    for bad in ([], [{"role": "user"}], [{"role": "user", "content": 3}], {"role": "user", "content": "x"}, 7):
        path.write_text(json.dumps({"prompt": bad, "answer": "2"}) + "\n")
        with pytest.raises(ValueError, match=r"chat.jsonl:1: \"prompt\" must be a string or a non-empty list of"):
            load_jsonl(path)
    with pytest.raises(ValueError, match="needs a tokenizer with a chat template"):
        CharTokenizer().encode_prompt(tuple(messages))


@pytest.mark.parametrize(
    "answer,shown",
    [("null", "null"), ("[4]", "[4]"), ('{"x": 1}', '{"x": 1}'), ("true", "true"), ("NaN", "NaN"),
     ("Infinity", "Infinity"), ("-Infinity", "-Infinity")],
)  # fmt: skip
def test_jsonl_answers_that_are_not_text_or_a_finite_number_are_refused(tmp_path, answer, shown):
    path = tmp_path / "data.jsonl"
    path.write_text('{"prompt": "p", "answer": "1"}\n' + '{"prompt": "q", "answer": ' + answer + "}\n")
    with pytest.raises(ValueError, match=r"data\.jsonl:2: \"answer\" must be a string or a finite number, got "
                                         + re.escape(shown) + "$"):  # fmt: skip
        load_jsonl(path)
    path.write_text('{"prompt": "p", "answer": 4}\n{"prompt": "p", "answer": 0.5}\n')
    assert [e.answer for e in load_jsonl(path)] == ["4", "0.5"]


USER = {"role": "user", "content": "1+1?"}


@pytest.mark.parametrize("row, message", [
    ({"prompt": "", "answer": "1"}, '"prompt" is empty$'),
    ({"prompt": " \n\t", "answer": "1"}, r'"prompt" is empty \(only whitespace\)'),
    ({"prompt": "p", "answer": ""}, '"answer" is empty$'),
    ({"prompt": "p", "answer": "  "}, r'"answer" is empty \(only whitespace\)'),
    ({"prompt": [{"role": "system", "content": "Be brief."}], "answer": "1"},
     r'"prompt" has no user message \(roles: system\)'),
    ({"prompt": [USER, {"role": "assistant", "content": "2"}], "answer": "2"},
     '"prompt" ends with an assistant message'),
    ({"prompt": [{"role": "user", "content": ""}], "answer": "1"}, "\"prompt\" message 0's content is empty"),
    ({"prompt": "a\u0000b", "answer": "1"}, r'"prompt" contains a NUL character'),
    ({"prompt": "p", "answer": "a\ud800"}, r'"answer" contains a lone surrogate \(\\ud800\)'),
])  # fmt: skip
def test_jsonl_rows_that_cannot_train_are_refused_with_the_line(tmp_path, row, message):
    path = tmp_path / "data.jsonl"
    path.write_text('{"prompt": "p", "answer": "1"}\n' + json.dumps(row) + "\n")
    with pytest.raises(ValueError, match=r"data\.jsonl:2: " + message):
        load_jsonl(path)


def test_jsonl_duplicate_keys_are_refused_not_last_one_wins(tmp_path):
    path = tmp_path / "data.jsonl"
    path.write_text('{"prompt": "p", "answer": "1", "answer": "2"}\n')
    with pytest.raises(ValueError, match=r'data\.jsonl:1: key "answer" appears twice in the row'):
        load_jsonl(path)
    path.write_text('{"prompt": [{"role": "user", "content": "a", "content": "b"}], "answer": "1"}\n')
    with pytest.raises(ValueError, match='key "content" appears twice'):
        load_jsonl(path)


@pytest.mark.parametrize("role", ["robot", "", "User", "tool"])
def test_jsonl_chat_roles_outside_system_user_assistant_are_refused(tmp_path, role):
    messages = [{"role": "system", "content": "Be brief."}, {"role": role, "content": "1+1?"}]
    path = tmp_path / "chat.jsonl"
    path.write_text(json.dumps({"prompt": messages, "answer": 2}) + "\n")
    with pytest.raises(ValueError, match=r"chat\.jsonl:1: \"prompt\" message 1 has role " + re.escape(json.dumps(role))
                                         + "; a role is one of system, user, assistant"):  # fmt: skip
        load_jsonl(path)


def test_jsonl_deeply_nested_line_is_one_error_not_a_recursion_traceback(tmp_path):
    path = tmp_path / "deep.jsonl"
    path.write_text('{"prompt": "p", "answer": "1"}\n' + "[" * 100_000 + "]" * 100_000 + "\n")
    with pytest.raises(ValueError, match=r"deep\.jsonl:2: not JSON this reader accepts \(nested too deeply\)"):
        load_jsonl(path)
    assert CharTokenizer().encode_prompt("1+1=") == CharTokenizer().encode("1+1=", bos=True)


def test_arith_task_rewards_correctness_plus_a_format_bonus_when_asked():
    task = make_task("arith", difficulty=1, format_weight=0.2)
    examples = task.examples(300, seed=3)
    assert examples == task.examples(300, seed=3)
    for e in examples:
        expr = e.prompt.removeprefix("What is ").removesuffix("? Reply with only the number.")
        a, op, b = expr.split(" ")
        assert op == "+" and 0 <= int(a) <= 9 and 0 <= int(b) <= 9 and int(a) + int(b) == int(e.answer)
    e = examples[0]
    bonus, r = task.FORMAT_WEIGHT, task_rewards(task)
    assert r.reward(e.answer, e) == 1.0 + bonus and r.reward(f" {e.answer}.\n", e) == 1.0 + bonus
    assert r.reward(f"The answer is {e.answer}.", e) == 1.0 and r.correct(f"= {e.answer}", e) == 1.0
    assert r.reward(f"{e.answer} or {int(e.answer) + 1}", e) == 0.0  # the last number counts
    assert r.reward(str(int(e.answer) + 1), e) == bonus and r.correct(str(int(e.answer) + 1), e) == 0.0
    assert r.reward("", e) == 0.0 and r.reward("I do not know", e) == 0.0
    for plain in (make_task("arith", difficulty=1), make_task("arith", format_weight=0.0)):  # default: no bonus
        p = task_rewards(plain)
        assert p.reward(e.answer, e) == 1.0 and p.reward(str(int(e.answer) + 1), e) == 0.0
        assert p.weights == [1.0, 0.0]
    assert task_rewards(make_task("arith", format_weight=0.5)).reward(e.answer, e) == 1.5
    for bad in (-0.1, 1.5, True, "0.2"):
        with pytest.raises(ValueError, match="format_weight must be a number in"):
            make_task("arith", format_weight=bad)
    with pytest.raises(ValueError, match="task 'add' has none"):
        make_task("add", format_weight=0.0)
    harder = make_task("arith", difficulty=4).examples(300, seed=0)
    assert any(" - " in e.prompt for e in harder) and all(e.prompt.count(" ") >= 8 for e in harder)
    assert all(int(e.answer) >= 0 for e in harder) and max(len(e.answer) for e in harder) >= 4
    for e in harder:
        expr = e.prompt.removeprefix("What is ").removesuffix("? Reply with only the number.")
        tokens = expr.split(" ")
        total = int(tokens[0])
        for op, t in zip(tokens[1::2], tokens[2::2], strict=True):
            total = total + int(t) if op == "+" else total - int(t)
        assert str(total) == e.answer


def test_tiny_model_runs_packed_and_rejects_small_heads():
    tok = CharTokenizer()
    model = tiny_model(tok.vocab_size)
    ids = torch.tensor([tok.encode("ab", bos=True) + tok.encode("12", bos=True)])
    out = model(input_ids=ids, position_ids=torch.tensor([[0, 1, 2, 0, 1, 2]]), use_cache=False)
    assert out.logits.shape == (1, 6, tok.vocab_size) and bool(torch.isfinite(out.logits).all())
    with pytest.raises(ValueError, match="head_dim"):
        tiny_model(tok.vocab_size, head_dim=16)

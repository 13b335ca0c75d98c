"""task.name = "dataset": JSONL, JSON, CSV and Parquet files and folders of splits through one loader, the columns
that reach the reward functions, a held-out split that is never trained on, and an error naming the row or the
option for every bad input."""

import json

import pytest

from grpo_kernels.train.build import task_examples, task_rewards
from grpo_kernels.train.config.io import load_config
from grpo_kernels.train.data.datasets import examples_from_rows, load_rows

ROWS = [{"question": f"What is {i} + {i}?", "solution": str(2 * i), "level": i % 3} for i in range(10)]


def _write(path, rows):
    import datasets

    if path.suffix == ".jsonl":
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    elif path.suffix == ".json":
        path.write_text(json.dumps(rows))
    elif path.suffix == ".csv":
        datasets.Dataset.from_list(rows).to_csv(str(path), index=False)
    else:
        datasets.Dataset.from_list(rows).to_parquet(str(path))
    return path


def _config(source, *extra):
    return load_config(None, ["task.name=dataset", f"task.dataset={source}", "task.prompt_column=question",
                              "task.answer_column=solution", "task.num_eval_prompts=3", "task.num_train_prompts=100",
                              *extra])  # fmt: skip


@pytest.mark.parametrize("suffix", [".jsonl", ".json", ".csv", ".parquet"])
def test_every_file_format_gives_the_same_examples_split_without_overlap(tmp_path, suffix):
    path = _write(tmp_path / f"data{suffix}", ROWS)
    with pytest.warns(UserWarning, match=r"task.num_train_prompts = 100, but .*data.* has 7 examples to train on after "
                                         r"holding out 3: training on 7"):  # fmt: skip
        task, train, held = task_examples(_config(path))
    assert len(train) == 7 and len(held) == 3
    assert not {e.prompt for e in train} & {e.prompt for e in held}
    for e in train + held:
        i = int(e.answer) // 2
        assert e.prompt == ROWS[i]["question"]
        # the columns as the dataset gives them (a CSV's "10" comes back as the number 10, as TRL would pass it)
        assert e.columns == {"solution": 2 * i if suffix == ".csv" else str(2 * i), "level": i % 3}
    again = task_examples(_config(path))
    assert [e.prompt for e in again[1]] == [e.prompt for e in train]  # the split is the seed's
    other = task_examples(_config(path, "task.seed=1"))
    assert [e.prompt for e in other[2]] != [e.prompt for e in held]


def test_a_folder_of_splits_and_conversational_prompts(tmp_path):
    folder = tmp_path / "gsm"
    folder.mkdir()
    chat = [{"prompt": [{"role": "user", "content": r["question"]}], "answer": r["solution"]} for r in ROWS]
    _write(folder / "train.jsonl", chat[:8])
    _write(folder / "test.jsonl", chat[8:])
    config = load_config(None, ["task.name=dataset", f"task.dataset={folder}", "task.answer_column=answer",
                                "task.eval_split=test", "task.num_eval_prompts=5"])  # fmt: skip
    with pytest.warns(UserWarning, match=r"num_eval_prompts = 5, but the held-out split of .*gsm has 2 examples"):
        task, train, held = task_examples(config)
    assert len(train) == 8 and sorted(e.answer for e in held) == ["16", "18"]
    assert train[0].prompt[0]["role"] == "user" and isinstance(train[0].prompt, tuple)
    assert task_rewards(task, config.task).names == ["exact"]


def test_the_columns_reach_the_reward_functions_under_their_names(tmp_path):
    path = _write(tmp_path / "data.parquet", ROWS)
    (tmp_path / "r.py").write_text("seen = []\n\ndef level_reward(completions, solution, level, **kw):\n"
                                   "    seen.append((list(solution), list(level)))\n"
                                   "    return [float(c == s) + l for c, s, l in zip(completions, solution, level)]\n")
    config = _config(path, f"task.reward_funcs={tmp_path}/r.py:level_reward")
    task, train, _ = task_examples(config)
    values = task_rewards(task, config.task).score(train[:2], [train[0].answer, "x"], [[1], [2]], step=0)
    assert values[:, 0].tolist() == [1.0 + train[0].columns["level"], float(train[1].columns["level"])]


@pytest.mark.parametrize("make, overrides, message", [
    (None, ["task.dataset=/no/such/data.csv"], r"task.dataset /no/such/data.csv: no such file or folder"),
    ("data.txt", [], r"unknown file format '.txt'"),
    ("data.csv", ["task.prompt_column=prompt"], r"row 0: missing key\(s\) \['prompt'\] \(columns: question, solution"),
    ("data.csv", ["task.split=test"], r"task.split / task.eval_split 'test': the file .* is one split, \"train\""),
    ("folder", ["task.eval_split=validation"], r"no split 'validation'"),
    ("empty.jsonl", [], r"no examples"),
    ("empty.csv", [], r"task.dataset .*empty.csv: no examples \(the file holds no rows\)$"),
    ("header.csv", [], r"task.dataset .*header.csv: no examples \(no rows in split 'train'\)$"),
    ("empty.parquet", [], r"task.dataset .*empty.parquet: no examples \(the file holds no rows\)$"),
    ("ints.jsonl", [], r"row|:1: \"question\" must be a string or a non-empty list"),
    ("data.csv", ["task.num_eval_prompts=10"], r"holds out every one of the 10 examples"),
])  # fmt: skip
def test_bad_datasets_are_refused_naming_the_row_or_the_option(tmp_path, make, overrides, message):
    source = tmp_path / (make or "unused")
    if make == "data.txt":
        source.write_text("hello\n")
    elif make == "data.csv":
        _write(source, ROWS)
    elif make == "folder":
        source.mkdir()
        _write(source / "train.jsonl", ROWS)
    elif make == "empty.jsonl":
        source.write_text("\n")
    elif make in ("empty.csv", "header.csv"):
        source.write_text("question,solution\n" if make == "header.csv" else "")
    elif make == "empty.parquet":
        import datasets

        datasets.Dataset.from_dict({"question": [], "solution": []}).to_parquet(str(source))
    elif make == "ints.jsonl":
        _write(source, [{"question": 3, "solution": "3"}])
    with pytest.raises(ValueError, match=message):
        task_examples(_config(source, *overrides))


@pytest.mark.parametrize("overrides, message", [
    (["task.name=dataset"], "task.dataset must be a file, folder or dataset name"),
    (["task.name=dataset", "task.dataset=x.csv"], "task.answer_column must be a column name unless"),
    (["task.dataset=x.csv"], 'task.dataset must be none unless task.name is "dataset"'),
    (["task.name=dataset", "task.dataset=x.csv", "task.reward_funcs=r.py:f", "task.sft_warmup_steps=5"],
     "task.sft_warmup_steps must be 0 unless task.answer_column"),
])  # fmt: skip
def test_the_dataset_options_are_checked_when_the_config_loads(overrides, message):
    with pytest.raises(ValueError, match=message):
        load_config(None, overrides)


def test_rows_of_the_wrong_shape_name_their_place():
    with pytest.raises(ValueError, match=r"src row 1: missing key\(s\) \['prompt'\] \(a row is an object"):
        examples_from_rows([("src row 0", {"prompt": "a"}), ("src row 1", ["a"])], source="src")
    with pytest.raises(ValueError, match=r'src row 0: "prompt" is empty'):
        examples_from_rows([("src row 0", {"prompt": "  "})], source="src")


def test_a_jsonl_file_is_read_by_the_strict_reader_with_line_numbers(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text('{"prompt": "a", "answer": "1"}\n{"prompt": "b", "prompt": "c"}\n')
    with pytest.raises(ValueError, match=r'd.jsonl:2: key "prompt" appears twice'):
        load_rows(str(path), "train")

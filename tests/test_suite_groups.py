"""The suite's own layout: every module named in conftest's XDIST_GROUPS exists (a renamed one would silently run
beside a vLLM test under `make test`'s two workers), and the collected tests carry their group's mark."""

from pathlib import Path

import conftest

TESTS = Path(__file__).resolve().parent


def test_every_grouped_module_exists_and_is_in_one_group():
    named = [m for modules in conftest.XDIST_GROUPS.values() for m in modules]
    assert len(named) == len(set(named))
    missing = [m for m in named if not (TESTS / f"{m}.py").is_file()]
    assert not missing, missing


def test_collected_tests_carry_their_modules_group(request):
    group_of = {m: g for g, modules in conftest.XDIST_GROUPS.items() for m in modules}
    for item in request.session.items:  # whatever this session collected
        marks = [mark.args[0] for mark in item.iter_markers("xdist_group")]
        assert marks == ([group_of[item.path.stem]] if item.path.stem in group_of else []), item.nodeid

    class Item:  # and the hook itself, on a module of each group and one of none
        def __init__(self, stem):
            self.path, self.marks = TESTS / f"{stem}.py", []

        def add_marker(self, mark):
            self.marks.append(mark)

    items = [Item("test_decoupled"), Item("test_train_distributed"), Item("test_loss")]
    conftest.pytest_collection_modifyitems(None, items)
    assert [[m.args for m in i.marks] for i in items] == [[("vllm",)], [("processes",)], []]

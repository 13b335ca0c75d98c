"""The suite's own layout: every module named in conftest's XDIST_GROUPS exists (a renamed one would silently be
spread over `make test`'s two workers: its processes beside another group's, its module fixture built twice), the
collected tests carry their group's mark, and conftest's speed-up of Triton's interpreter holds."""

from pathlib import Path

import conftest
import pytest
import torch
import triton
import triton.language as tl

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

    if getattr(request.config.option, "loadgroup", False):  # a pytest-xdist worker under --dist loadgroup
        for item in request.session.items:  # xdist schedules by the "@group" suffix it puts on the node id
            group = group_of.get(item.path.stem)
            assert ("@" in item.nodeid) == (group is not None), item.nodeid
            assert group is None or item.nodeid.endswith(f"@{group}"), item.nodeid

    items = [Item("test_smollm2"), Item("test_train_distributed"), Item("test_loss"), Item("test_decoupled")]
    conftest.pytest_collection_modifyitems(None, items)
    assert [[m.args for m in i.marks] for i in items] == [[("smollm2",)], [("processes",)], [], []]


def test_the_suite_timeline_reads_what_the_hook_writes_and_reports_each_workers_idle_tail(tmp_path):
    import suite_timeline  # (tests/, beside this file: the suite's own tooling)

    path = tmp_path / "timeline.tsv"
    path.write_text("gw0\t100.0\t110.0\ttests/test_a.py::t1\n"
                    "gw1\t100.5\t130.0\ttests/test_b.py::t2@processes\n"
                    "gw0\t110.0\t112.5\ttests/test_b.py::t3@processes\n")  # fmt: skip
    text = suite_timeline.summary(suite_timeline.read(path))
    assert "3 tests, 30 s from the first start to the last end" in text
    assert "| gw0 | 2 | 12 | 0 | 12 | 18 |" in text  # idle for the last 17.5 s while gw1 ran
    assert "| gw1 | 1 | 30 | 0 | 30 | 0 |" in text
    assert "processes: 2 tests, 32 s, from 0 s to 30 s" in text
    assert text.index("29.5 s") < text.index("10.0 s")  # slowest first
    assert "CPU seconds" not in text  # a file without the CPU column: no CPU table

    path.write_text("gw0\t100.0\t110.0\ttests/test_a.py::t1\t9.50\n"
                    "gw1\t100.5\t130.0\ttests/test_b.py::t2@processes\t40.00\n"
                    "gw0\t110.0\t112.5\ttests/test_b.py::t3@processes\t0.50\n")  # fmt: skip
    text = suite_timeline.summary(suite_timeline.read(path))
    assert "29.5 s  gw1  starts at      0 s  tests/test_b.py::t2@processes  (40.0 s CPU)" in text
    assert "Test files by CPU seconds (all: 50 s; top 15):" in text
    assert text.index("| tests/test_b.py | 2 | 40 | 81% | 32 |") < text.index("| tests/test_a.py | 1 | 10 | 19% | 10 |")


@triton.jit
def _twice(x):
    return x * 2.0


@triton.jit
def _doubling_kernel(x_ptr, out_ptr, BLOCK: tl.constexpr, STEPS: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    acc = tl.load(x_ptr + offsets)
    for _ in tl.static_range(STEPS):
        acc = _twice(acc)
    tl.store(out_ptr + offsets, acc)


def test_the_interpreter_patches_triton_language_once_per_launch_and_helpers_still_compute(triton_device):
    """conftest's speed-up of Triton's interpreter: one patch of triton.language per launch however many helper
    calls the kernel makes (it was one per helper call), and a kernel calling a helper in a loop still computes."""
    if triton_device != "cpu":
        pytest.skip("the interpreter runs only without a GPU")
    assert conftest.TRITON_INTERPRETER_PATCHED_ONCE, "Triton's interpreter internals changed: see conftest"
    calls, original = [], conftest.INTERPRETER_PATCH["original"]

    def counting(fn):
        calls.append(fn.__name__)
        return original(fn)

    conftest.INTERPRETER_PATCH["original"] = counting
    try:
        x = torch.randn(3 * 16)
        out = torch.empty_like(x)
        _doubling_kernel[(3,)](x, out, BLOCK=16, STEPS=5)
    finally:
        conftest.INTERPRETER_PATCH["original"] = original
    assert torch.equal(out, x * 32.0)
    assert calls == ["_doubling_kernel"], calls  # without the speed-up: the kernel's, then 15 of '_twice'

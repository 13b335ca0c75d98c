"""Test setup shared by every test module.

Without CUDA, Triton kernels run on CPU tensors in the Triton interpreter. The interpreter replaces
`@triton.jit` functions when they are defined, so TRITON_INTERPRET must be set before grpo_kernels is
imported: that is why it is set here, at the top of the first file pytest loads.
"""

import importlib.util
import os
import zlib

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Under pytest-xdist (`make test` runs two workers on the 2-core CI machine) every process gets one torch thread
# unless told otherwise: two OpenMP threads in a process whose second core the other worker holds spin on each
# barrier (a 2-layer model's step took 18x longer). Subprocesses (trainers, servers) inherit it.
if os.environ.get("PYTEST_XDIST_WORKER") and "OMP_NUM_THREADS" not in os.environ:
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)

import pytest  # noqa: E402

INTERPRETER_PATCH = {}  # "original": Triton's own patch function, which the wrapper below calls (tests may count)


def _patch_once_per_launch() -> bool:
    """Make Triton's interpreter patch triton.language once per kernel launch instead of once per device-function
    call as well. The interpreter (triton 3.x, runtime/interpreter.py) swaps every builtin of triton.language for an
    interpreted one when a kernel is launched (GridExecutor), and again, through `inspect.getmembers` of the whole
    module, on every call of a @triton.jit helper from inside the kernel (InterpretedFunction.__call__): a no-op
    the second time (the builtins are already swapped; the launch restores them all at its end), ~2 ms each, and
    our kernels call their helpers per element block. Measured on one core: the NaN-propagation loss test spent 54 s
    of its 94 s there (28,056 calls of the patch for 120 launches). A helper whose module sees a triton.language
    module the launch has not patched still gets the patch (as before). Returns False, leaving Triton as it is,
    where its internals are not the ones this was written against."""
    try:
        import triton.language as tl
        from triton.runtime import interpreter
    except ImportError:
        return False
    needed = ("_patch_lang", "GridExecutor", "InterpretedFunction", "_LangPatchScope")
    if not all(hasattr(interpreter, name) for name in needed) or getattr(interpreter, "_grpo_once", False):
        return False
    INTERPRETER_PATCH["original"], original_launch = interpreter._patch_lang, interpreter.GridExecutor.__call__
    launches: list[set] = []  # per running launch: the ids of the triton.language modules it has patched

    def langs_of(fn) -> set:
        return {id(v) for v in fn.__globals__.values() if v is tl or v is tl.core}

    def patch_lang(fn):
        langs = langs_of(fn)
        if launches and langs and langs <= launches[-1]:
            return interpreter._LangPatchScope()  # already patched by this launch: nothing to do or undo
        scope = INTERPRETER_PATCH["original"](fn)
        if launches:
            launches[-1] |= langs
        return scope

    def launch(self, *args, **kwargs):
        launches.append(set())
        try:
            return original_launch(self, *args, **kwargs)
        finally:
            launches.pop()

    interpreter._patch_lang, interpreter.GridExecutor.__call__ = patch_lang, launch
    interpreter._grpo_once = True
    return True


TRITON_INTERPRETER_PATCHED_ONCE = (
    os.environ.get("TRITON_INTERPRET", "0") not in ("", "0") and _patch_once_per_launch()
)

# Modules whose tests run on one worker, one at a time (pytest-xdist's --dist loadgroup): those that start several
# processes of their own (torchrun ranks, spawned workers, the benchmark runners), the vLLM modules whose
# module-scoped fixture (a converted model, an engine, a rollout server) would otherwise be built once per worker,
# and the learning check, whose runs share one SFT warm start within a process (tests/learning_check.py).
# The other vLLM tests are spread over both workers (at most two engines or servers at once, a few GiB each): as one
# group they were the suite's critical path (~980 s of CPU on one worker, each `vllm serve` start ~35-50 s of CPU).
XDIST_GROUPS = {
    "processes": ("test_bench_run", "test_long_chains_bench", "test_long_chains_failures", "test_sequence_parallel",
                  "test_train_distributed", "test_train_sequence_parallel"),
    "decoupled_served": ("test_decoupled_served",),
    "learning_check": ("test_learning_check",),
    "smollm2": ("test_smollm2",),
    "vllm_sampler": ("test_vllm_sampler",),
}  # fmt: skip


@pytest.hookimpl(tryfirst=True)  # before xdist reads the marks
def pytest_collection_modifyitems(config, items):
    group_of = {module: group for group, modules in XDIST_GROUPS.items() for module in modules}
    for item in items:
        group = group_of.get(item.path.stem)
        if group is not None:
            item.add_marker(pytest.mark.xdist_group(group))

# tests/trainers checks the verl and OpenRLHF drop-ins against those packages, which live in their own venv
# (`make setup-trainers`; `make test` runs that directory there): elsewhere the directory is not collected.
collect_ignore = [] if importlib.util.find_spec("verl") and importlib.util.find_spec("openrlhf") else ["trainers"]


def triton_interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


@pytest.fixture
def triton_device() -> str:
    """Where the Triton backend runs in this session: 'cuda' on a GPU, else 'cpu' under the interpreter."""
    if torch.cuda.is_available():
        return "cuda"
    if not triton_interpreting():
        pytest.fail("no CUDA and TRITON_INTERPRET is not set: Triton kernels cannot run")
    return "cpu"


@pytest.fixture(autouse=True)
def _seed(request):
    """Random inputs per test, reproducible: the seed is a hash of the test id (plus GRPO_TEST_SEED if set)."""
    seed = zlib.crc32(request.node.nodeid.encode()) + int(os.environ.get("GRPO_TEST_SEED", "0"))
    torch.manual_seed(seed)
    yield


# GRPO_TEST_TIMELINE=<file>: one line per test appended to <file> (worker, start and end on the wall clock, setup and
# teardown included, node id, CPU seconds), to see how `make test`'s workers spend the suite: `python
# tests/suite_timeline.py <file>`. CPU seconds: user + system of the worker and of the processes it waited for
# (theirs include their own waited-for children) during the test; on a busy machine they move far less than the wall
# clock does.
_TIMELINE = os.environ.get("GRPO_TEST_TIMELINE")


def _cpu_seconds() -> float:
    import resource

    return sum(u.ru_utime + u.ru_stime for u in (resource.getrusage(resource.RUSAGE_SELF),
                                                 resource.getrusage(resource.RUSAGE_CHILDREN)))  # fmt: skip


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    if not _TIMELINE:
        yield
        return
    import time

    start, cpu = time.time(), _cpu_seconds()
    yield
    with open(_TIMELINE, "a") as f:
        f.write(f"{os.environ.get('PYTEST_XDIST_WORKER', 'main')}\t{start:.3f}\t{time.time():.3f}\t{item.nodeid}"
                f"\t{_cpu_seconds() - cpu:.2f}\n")  # fmt: skip

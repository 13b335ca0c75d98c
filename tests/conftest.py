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

import pytest  # noqa: E402

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

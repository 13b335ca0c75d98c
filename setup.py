"""Build `grpo_kernels._C`: the C++ CPU kernels of csrc/ (the CUDA kernels are Triton, compiled at run time).

Install without build isolation so the extension compiles against the torch already in the environment:
    pip install --no-build-isolation -e .
GRPO_KERNELS_SKIP_EXT=1 leaves the extension out of that install (the Makefile's set-up compiles it in place with
`setup.py build_ext --inplace` while pip installs the dependencies, on the second core).
"""

import glob
import os
import sys
import sysconfig

from setuptools import setup
from torch.utils.cpp_extension import BuildExtension, CppExtension


def extension():
    cpp = sorted(glob.glob(os.path.join("csrc", "*.cpp")))
    return CppExtension("grpo_kernels._C", cpp, extra_compile_args={"cxx": ["-O3", "-std=c++17", "-fopenmp"]},
                        extra_link_args=["-fopenmp"])  # fmt: skip


class BuildInTree(BuildExtension.with_options(use_ninja=True)):
    """An in-place build (an editable install, `setup.py build_ext --inplace`) keeps its objects and ninja file in
    ./build, not in the fresh temporary directory an editable install is given: the next in-place build, or
    editable reinstall (another extra), recompiles only what changed instead of every file (~5 CPU-minutes)."""

    def finalize_options(self):
        super().finalize_options()
        if self.inplace or getattr(self, "editable_mode", False):
            here = os.path.dirname(os.path.abspath(__file__))
            plat = f"temp.{sysconfig.get_platform()}-{sys.implementation.cache_tag}"
            self.build_temp = os.path.join(here, "build", plat)


if __name__ == "__main__":  # as pip and `python setup.py` run it; a test imports BuildInTree
    skip = os.environ.get("GRPO_KERNELS_SKIP_EXT") == "1"
    setup(ext_modules=[] if skip else [extension()], cmdclass={"build_ext": BuildInTree})

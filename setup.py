"""Build `grpo_kernels._C`: the C++ CPU kernels of csrc/ (the CUDA kernels are Triton, compiled at run time).

Install without build isolation so the extension compiles against the torch already in the environment:
    pip install --no-build-isolation -e .
"""

import glob
import os

from setuptools import setup
from torch.utils.cpp_extension import BuildExtension, CppExtension


def extension():
    cpp = sorted(glob.glob(os.path.join("csrc", "*.cpp")))
    return CppExtension("grpo_kernels._C", cpp, extra_compile_args={"cxx": ["-O3", "-std=c++17", "-fopenmp"]},
                        extra_link_args=["-fopenmp"])  # fmt: skip


setup(ext_modules=[extension()], cmdclass={"build_ext": BuildExtension.with_options(use_ninja=True)})

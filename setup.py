"""Build `grpo_kernels._C`: the C++ CPU kernels always, CUDA sources only when torch and nvcc both have CUDA.

Install without build isolation so the extension compiles against the torch already in the environment:
    pip install --no-build-isolation -e .
"""

import glob
import os

import torch
from setuptools import setup
from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CppExtension, CUDAExtension

ROOT = os.path.dirname(os.path.abspath(__file__))


def extension():
    cpp = sorted(glob.glob(os.path.join("csrc", "*.cpp")))
    cuda = sorted(glob.glob(os.path.join("csrc", "cuda", "*.cu")))
    cxx = ["-O3", "-std=c++17", "-fopenmp"]
    if cuda and torch.version.cuda is not None and CUDA_HOME is not None:
        return CUDAExtension(
            "grpo_kernels._C",
            cpp + cuda,
            extra_compile_args={"cxx": cxx + ["-DGRPO_WITH_CUDA"], "nvcc": ["-O3", "-std=c++17"]},
            extra_link_args=["-fopenmp"],
        )
    return CppExtension("grpo_kernels._C", cpp, extra_compile_args={"cxx": cxx}, extra_link_args=["-fopenmp"])


setup(ext_modules=[extension()], cmdclass={"build_ext": BuildExtension.with_options(use_ninja=True)})

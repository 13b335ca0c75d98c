// Registration hooks of the C++ sources that grpo_ops.cpp's PYBIND11_MODULE calls (one extension, one module).
#pragma once

#include <torch/extension.h>

// csrc/logprobs.cpp: selective_logprobs, selective_logprobs_backward, set_logprobs_simd, logprobs_simd.
void init_logprobs(pybind11::module_& m);

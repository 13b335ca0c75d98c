// Registration hooks of the C++ sources; grpo_ops.cpp's PYBIND11_MODULE calls each (one extension, one module).
#pragma once

#include <torch/extension.h>

// csrc/advantages.cpp: group_advantages, set_cpu_simd, cpu_simd.
void init_advantages(pybind11::module_& m);

// csrc/logprobs.cpp: selective_logprobs, selective_logprobs_backward, set_logprobs_simd, logprobs_simd.
void init_logprobs(pybind11::module_& m);

// csrc/loss.cpp: grpo_loss_fwd, grpo_loss_bwd, set_loss_simd, loss_simd.
void init_loss(pybind11::module_& m);

// csrc/planner.cpp: plan_micro_batches (host-side micro-batch planning, no tensor op).
void init_packing(pybind11::module_& m);

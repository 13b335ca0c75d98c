// grpo_kernels._C: the C++ CPU kernels of grpo_kernels, one source file per op family (declared in grpo_ops.h),
// bound here. The spec of every op is grpo_kernels/reference.py; the Python side registers these functions as the
// CPU kernels of the torch.ops.grpo_kernels ops.

#include <pybind11/pybind11.h>
#include <pybind11/stl.h>
#include <torch/python.h>  // the Tensor <-> Python casters (not torch/extension.h: the whole C++ frontend)

#include "grpo_ops.h"

namespace py = pybind11;

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  const auto nogil = py::call_guard<py::gil_scoped_release>();

  m.def("group_advantages", &group_advantages,
        "Group-relative advantages (CPU). rewards [N, K] (fp16/bf16/fp32/fp64, any strides), weights [K] fp32,\n"
        "group_offsets [G+1] int32/int64 or None (then contiguous groups of group_size), scale in\n"
        "{'group', 'batch', 'none'}. Returns (advantages [N] f32, valid [G] bool, group_mean [G] f32,\n"
        "group_std [G] f32, invalid_fraction [] f32). Spec: grpo_kernels.reference.group_advantages.",
        py::arg("rewards"), py::arg("weights"), py::arg("group_offsets"), py::arg("group_size"), py::arg("scale"),
        py::arg("eps"), py::arg("unbiased"), py::arg("min_std"), nogil);
  m.def("set_cpu_simd", &grpo::set_advantages_simd,
        "Allow (default) or forbid the AVX-512 paths; returns nothing. For testing the portable code.", py::arg("on"));
  m.def("cpu_simd", &grpo::advantages_simd,
        "True when the AVX-512 paths run: the CPU has them and set_cpu_simd did not turn them off.");

  m.def("selective_logprobs", &grpo::logprobs::selective_logprobs,
        "log softmax(logits / temperature)[ids] (CPU, one pass per row). logits [T, V] fp32/bf16/fp16 (last-dim\n"
        "stride 1), ids [T] int64. Returns (logps [T] f32, entropy [T] f32 or [0], lse [T] f32).",
        py::arg("logits"), py::arg("ids"), py::arg("temperature"), py::arg("return_entropy"), nogil);
  m.def("selective_logprobs_backward", &grpo::logprobs::selective_logprobs_backward,
        "d logits of selective_logprobs (CPU): (g (onehot - p) - gH p (z - lse + H)) / temperature, with logits'\n"
        "shape and dtype (contiguous), or written into logits when inplace.",
        py::arg("grad_logps"), py::arg("grad_entropy"), py::arg("logits"), py::arg("ids"), py::arg("lse"),
        py::arg("entropy"), py::arg("temperature"), py::arg("inplace"), nogil);
  m.def("set_logprobs_simd", &grpo::set_logprobs_simd,
        "Allow (default) or forbid the AVX-512 logprobs path; returns nothing. For testing the portable code.",
        py::arg("on"));
  m.def("logprobs_simd", &grpo::logprobs_simd, "True when the AVX-512 logprobs path runs.");

  m.def("grpo_loss_fwd", &grpo::loss::grpo_loss_fwd,
        "GRPO policy loss forward (CPU): flat [T] logps (f32/bf16/f16), old/ref/sampler/mask f32 [T] or None,\n"
        "advantages f32 [B] or [T] (adv_per_token), cu_seqlens int64 [B + 1]. Returns (stats [B, 11] f64, coef [T]\n"
        "f32); see grpo_kernels/ops/loss.py.",
        py::arg("logps"), py::arg("old_logps"), py::arg("ref_logps"), py::arg("sampler_logps"), py::arg("advantages"),
        py::arg("adv_per_token"), py::arg("mask"), py::arg("cu_seqlens"), py::arg("loss_family"), py::arg("seq_level"),
        py::arg("sampler_mode"), py::arg("eps_low"), py::arg("eps_high"), py::arg("delta"), py::arg("beta"),
        py::arg("bias_kl"), py::arg("sampler_cap"), py::arg("tau_pos"), py::arg("tau_neg"), py::arg("vespo_k_pos"),
        py::arg("vespo_lambda_pos"), py::arg("vespo_k_neg"), py::arg("vespo_lambda_neg"), nogil);
  m.def("grpo_loss_bwd", &grpo::loss::grpo_loss_bwd,
        "GRPO policy loss backward (CPU): grad [T] f32 = a[s] coef (+ b[s] mask, 1 without one, when seq_level).",
        py::arg("a"), py::arg("b"), py::arg("coef"), py::arg("mask"), py::arg("cu_seqlens"), py::arg("seq_level"),
        nogil);
  m.def("set_loss_simd", &grpo::set_loss_simd,
        "Allow (default) or forbid the AVX-512 grpo_loss path; returns nothing. For testing the portable code.",
        py::arg("on"));
  m.def("loss_simd", &grpo::loss_simd, "True when the AVX-512 grpo_loss path runs.");

  m.def("plan_micro_batches", &grpo::packing::plan_micro_batches,
        "Token-budget micro-batch plan (CPU, host-side): item weights int64 [n] (>= 0), token_budget, num_ranks,\n"
        "algorithm (0 = karmarkar_karp, 1 = greedy). Returns rank -> micro-batch -> item indices (nested lists);\n"
        "see grpo_kernels/planner.py.",
        py::arg("weights"), py::arg("token_budget"), py::arg("num_ranks"), py::arg("algorithm"), nogil);
}

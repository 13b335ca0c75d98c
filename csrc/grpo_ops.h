// The C++ CPU kernels of grpo_kernels, as grpo_ops.cpp binds them. The kernel sources include only the Tensor class
// and the few ATen functions they call (the per-operator headers), not <ATen/ATen.h>, which declares every operator
// and was most of each file's compile time; grpo_ops.cpp alone includes pybind11 and holds every binding.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/full.h>

#include <cstdint>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

// csrc/advantages.cpp
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> group_advantages(
    const at::Tensor& rewards, const at::Tensor& weights, const std::optional<at::Tensor>& group_offsets,
    int64_t group_size, const std::string& scale, double eps, bool unbiased, double min_std);

// csrc/logprobs.cpp
namespace grpo::logprobs {
std::tuple<at::Tensor, at::Tensor, at::Tensor> selective_logprobs(const at::Tensor& logits, const at::Tensor& ids,
                                                                  double temperature, bool return_entropy);
at::Tensor selective_logprobs_backward(const at::Tensor& grad_logps, const std::optional<at::Tensor>& grad_entropy,
                                       const at::Tensor& logits, const at::Tensor& ids, const at::Tensor& lse,
                                       const std::optional<at::Tensor>& entropy, double temperature, bool inplace);
}  // namespace grpo::logprobs

// csrc/loss.cpp
namespace grpo::loss {
std::tuple<at::Tensor, at::Tensor> grpo_loss_fwd(
    const at::Tensor& logps, const std::optional<at::Tensor>& old_logps, const std::optional<at::Tensor>& ref_logps,
    const std::optional<at::Tensor>& sampler_logps, const at::Tensor& advantages, bool adv_per_token,
    const std::optional<at::Tensor>& mask, const at::Tensor& cu_seqlens, int64_t loss_family, bool seq_level,
    int64_t sampler_mode, double eps_low, double eps_high, double delta, double beta, bool bias_kl, double sampler_cap,
    double tau_pos, double tau_neg, double vespo_k_pos, double vespo_lambda_pos, double vespo_k_neg,
    double vespo_lambda_neg);
at::Tensor grpo_loss_bwd(const at::Tensor& a, const at::Tensor& b, const at::Tensor& coef,
                         const std::optional<at::Tensor>& mask, const at::Tensor& cu_seqlens, bool seq_level);
}  // namespace grpo::loss

// csrc/planner.cpp: rank -> micro-batch -> item indices.
namespace grpo::packing {
std::vector<std::vector<std::vector<int64_t>>> plan_micro_batches(const at::Tensor& weights, int64_t token_budget,
                                                                  int64_t num_ranks, int64_t algorithm);
}  // namespace grpo::packing

// The AVX-512 switches (on by default; off runs the portable code, for tests) and whether each path runs.
namespace grpo {
void set_advantages_simd(bool on);
bool advantages_simd();
void set_logprobs_simd(bool on);
bool logprobs_simd();
void set_loss_simd(bool on);
bool loss_simd();
}  // namespace grpo

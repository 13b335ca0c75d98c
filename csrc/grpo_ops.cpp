// grpo_kernels._C: C++ CPU kernels of grpo_kernels. The spec of every op is grpo_kernels/reference.py.
//
// group_advantages(rewards [N,K], weights [K], group_offsets | group_size, scale, eps, unbiased, min_std)
//
// Design
//   * Parallel over groups with at::parallel_for (ATen's OpenMP pool). The grain is ~2048 rewards' worth of
//     groups, so tiny groups are batched and small inputs run inline on the calling thread.
//   * One group is processed while its rows sit in L1: pass 1 sums r_i (and detects non-finite values),
//     pass 2 sums (r_i - mean)^2 (two-pass variance, no E[x^2]-E[x]^2 cancellation), pass 3 writes A_i.
//     For K == 1, r_i = w_0 R_i0 is re-read from the input on each pass. For other layouts with an fp32 r_i,
//     r_i is computed once into the group's slice of the advantages output and the passes read it there
//     (exact: fp32 is r_i's precision). fp64 inputs recompute r_i. No per-group heap allocation.
//   * Precision: r_i in at::opmath_type of the input (fp32 for fp16/bf16/fp32, fp64 for fp64); the
//     per-group sums, mean, M2, std and the scale factor in fp64; outputs rounded once to fp32.
//   * Fast path: K == 1 with unit row stride reads a raw pointer in loops `omp simd` vectorizes (SSE2 at the
//     build's default -march). Everything else (K > 1, any strides) goes through a strided loader.
//   * scale == "batch": pass over groups (parallel) writes the unscaled A_i = r_i - mean_g of valid groups
//     and keeps (mean_g, M2_g) in fp64; a serial Chan combination over the non-bad groups gives S; a second
//     parallel pass multiplies the valid groups by 1/(S + eps). Serial reduction = deterministic result.
//   * Offsets are checked inside the parallel loop (0 <= start < end <= N) and reported afterwards, so bad
//     offsets raise an error instead of reading out of bounds, at no extra pass over them.

#include <torch/extension.h>

#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <limits>
#include <string>
#include <tuple>
#include <type_traits>
#include <vector>

namespace grpo::advantages {

enum class Scale { Group, Batch, None };

inline Scale parse_scale(const std::string& s) {
  if (s == "group") return Scale::Group;
  if (s == "batch") return Scale::Batch;
  if (s == "none") return Scale::None;
  TORCH_CHECK(false, "group_advantages: unknown scale '", s, "' (expected 'group', 'batch' or 'none')");
  return Scale::Group;  // unreachable
}

// ---- where the rewards come from: r(i) = sum_k w_k R[i, k] in opmath_t -------------------------------
// Loaders are tiny and taken by value: with a local copy (not a reference) GCC vectorizes `omp simd` loops.
template <typename scalar_t>
struct ContiguousK1 {  // K == 1, R[i, 0] at p[i]
  using opmath_t = at::opmath_type<scalar_t>;
  static constexpr bool kStash = false;
  const scalar_t* p;
  opmath_t w0;
  opmath_t operator()(int64_t i) const { return static_cast<opmath_t>(p[i]) * w0; }
};

template <typename scalar_t>
struct Strided {  // any K, any strides
  using opmath_t = at::opmath_type<scalar_t>;
  // r_i costs K strided loads: when it is an fp32 value, compute it once per group and keep it in the output.
  static constexpr bool kStash = std::is_same_v<opmath_t, float>;
  const scalar_t* p;
  const float* w;
  int64_t k, s0, s1;
  opmath_t operator()(int64_t i) const {
    const scalar_t* row = p + i * s0;
    opmath_t r = 0;
    for (int64_t j = 0; j < k; ++j) r += static_cast<opmath_t>(w[j]) * static_cast<opmath_t>(row[j * s1]);
    return r;
  }
};

// ---- where the groups are: [start(g), end(g)) ------------------------------------------------------------
struct Uniform {
  int64_t size;
  int64_t start(int64_t g) const { return g * size; }
  int64_t end(int64_t g) const { return (g + 1) * size; }
};

template <typename index_t>
struct Offsets {
  const index_t* o;
  int64_t start(int64_t g) const { return static_cast<int64_t>(o[g]); }
  int64_t end(int64_t g) const { return static_cast<int64_t>(o[g + 1]); }
};

struct Params {
  Scale scale;
  double eps, c, min_std;
};

struct Outputs {
  float* adv;
  bool* valid;
  float* mean;
  float* std;
  double* batch_stats;  // [2 * num_groups] (mean_g, M2_g) for scale == "batch" (mean_g NaN: bad group), else null
};

// Statistics of one group [b, e) and its advantages, written to out. The three `omp simd` loops are the hot path.
template <typename Load>
C10_ALWAYS_INLINE void group_kernel(const Load load, int64_t g, int64_t b, int64_t e, const Params& p,
                                    const Outputs& out) {
  constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();
  float* const adv = out.adv;
  const double n = static_cast<double>(e - b);
  double sum = 0;
#pragma omp simd reduction(+ : sum)
  for (int64_t i = b; i < e; ++i) sum += static_cast<double>(load(i));

  bool bad = false;
  if (!std::isfinite(sum)) {  // a NaN/inf reward, or (fp64 only) a finite sum that overflowed
    for (int64_t i = b; i < e && !bad; ++i) bad = !std::isfinite(load(i));
  }
  if (bad) {
    out.valid[g] = false;
    out.mean[g] = out.std[g] = static_cast<float>(kNaN);
    if (out.batch_stats) out.batch_stats[2 * g] = kNaN, out.batch_stats[2 * g + 1] = 0;
    std::fill(adv + b, adv + e, 0.f);
    return;
  }

  const double mean = sum / n;
  double m2 = 0;
#pragma omp simd reduction(+ : m2)
  for (int64_t i = b; i < e; ++i) {
    const double d = static_cast<double>(load(i)) - mean;
    m2 += d * d;
  }
  const double dof = n - p.c;
  const double sd = dof > 0 ? std::sqrt(m2 / dof) : 0.0;
  const bool valid = sd > p.min_std;
  out.valid[g] = valid;
  out.mean[g] = static_cast<float>(mean);
  out.std[g] = static_cast<float>(sd);
  if (out.batch_stats) out.batch_stats[2 * g] = mean, out.batch_stats[2 * g + 1] = m2;

  if (!valid) {
    std::fill(adv + b, adv + e, 0.f);
    return;
  }
  const double inv = p.scale == Scale::Group ? 1.0 / (sd + p.eps) : 1.0;  // batch: scaled later
  // In place when load reads the stash in adv: same index, so no loop-carried dependence for `omp simd`.
#pragma omp simd
  for (int64_t i = b; i < e; ++i) adv[i] = static_cast<float>((static_cast<double>(load(i)) - mean) * inv);
}

template <typename Load>
inline void process_group(const Load load, int64_t g, int64_t b, int64_t e, const Params& p, const Outputs& out) {
  if constexpr (Load::kStash) {
    for (int64_t i = b; i < e; ++i) out.adv[i] = load(i);
    group_kernel(ContiguousK1<float>{out.adv, 1.f}, g, b, e, p, out);
  } else {
    group_kernel(load, g, b, e, p, out);
  }
}

template <typename Load, typename Groups>
void run(const Load& load, const Groups& groups, int64_t n_total, int64_t num_groups, const Params& p,
         const Outputs& out) {
  const int64_t avg = num_groups > 0 ? std::max<int64_t>(1, n_total / num_groups) : 1;
  const int64_t grain = std::max<int64_t>(1, 2048 / avg);
  std::atomic<bool> bad_offsets{false};

  at::parallel_for(0, num_groups, grain, [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g) {
      const int64_t b = groups.start(g), e = groups.end(g);
      if (b < 0 || e <= b || e > n_total) {
        bad_offsets.store(true, std::memory_order_relaxed);
        return;
      }
      process_group(load, g, b, e, p, out);
    }
  });
  TORCH_CHECK(!bad_offsets.load(), "group_advantages: group_offsets must be strictly increasing within [0, N]");

  if (p.scale != Scale::Batch) return;
  // S: Chan's combination of (n_g, mean_g, M2_g) over the non-bad groups (mean_g not NaN), serial, in fp64.
  auto for_good_groups = [&](auto&& f) {
    for (int64_t g = 0; g < num_groups; ++g) {
      const double m = out.batch_stats[2 * g];
      if (!std::isnan(m)) f(static_cast<double>(groups.end(g) - groups.start(g)), m, out.batch_stats[2 * g + 1]);
    }
  };
  double count = 0, total = 0, m2 = 0;
  for_good_groups([&](double n, double m, double) { count += n, total += n * m; });
  const double gmean = count > 0 ? total / count : 0.0;
  for_good_groups([&](double n, double m, double m2_g) { m2 += m2_g + n * (m - gmean) * (m - gmean); });
  const double S = count - p.c > 0 ? std::sqrt(m2 / (count - p.c)) : 0.0;
  const float inv = static_cast<float>(1.0 / (S + p.eps));
  at::parallel_for(0, num_groups, grain, [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g) {
      if (!out.valid[g]) continue;
      float* a = out.adv;
#pragma omp simd
      for (int64_t i = groups.start(g); i < groups.end(g); ++i) a[i] *= inv;
    }
  });
}

template <typename Load>
void run_with_groups(const Load& load, const std::optional<at::Tensor>& offsets, int64_t group_size, int64_t n_total,
                     int64_t num_groups, const Params& p, const Outputs& out) {
  if (!offsets.has_value()) return run(load, Uniform{group_size}, n_total, num_groups, p, out);
  if (offsets->scalar_type() == at::kInt) {
    return run(load, Offsets<int32_t>{offsets->data_ptr<int32_t>()}, n_total, num_groups, p, out);
  }
  return run(load, Offsets<int64_t>{offsets->data_ptr<int64_t>()}, n_total, num_groups, p, out);
}

}  // namespace grpo::advantages

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> group_advantages(
    const at::Tensor& rewards, const at::Tensor& weights, const std::optional<at::Tensor>& group_offsets,
    int64_t group_size, const std::string& scale, double eps, bool unbiased, double min_std) {
  namespace ga = grpo::advantages;
  TORCH_CHECK(rewards.dim() == 2, "group_advantages: rewards must be [N, K], got ", rewards.dim(), " dims");
  TORCH_CHECK(rewards.device().is_cpu(), "group_advantages (C++): rewards must be on the CPU");
  const int64_t n_total = rewards.size(0), k = rewards.size(1);
  TORCH_CHECK(weights.dim() == 1 && weights.size(0) == k, "group_advantages: weights must be [K] = [", k, "]");
  TORCH_CHECK(weights.device().is_cpu() && weights.scalar_type() == at::kFloat && weights.is_contiguous(),
              "group_advantages: weights must be a contiguous float32 CPU tensor");
  int64_t num_groups;
  if (group_offsets.has_value()) {
    const at::Tensor& o = *group_offsets;
    TORCH_CHECK(o.dim() == 1 && o.size(0) >= 1, "group_advantages: group_offsets must be [num_groups + 1]");
    const bool int_type = o.scalar_type() == at::kInt || o.scalar_type() == at::kLong;
    TORCH_CHECK(o.device().is_cpu() && o.is_contiguous() && int_type,
                "group_advantages: group_offsets must be a contiguous int32/int64 CPU tensor");
    num_groups = o.size(0) - 1;
  } else {
    TORCH_CHECK(group_size > 0 && n_total % group_size == 0, "group_advantages: group_size must be > 0 and divide N");
    num_groups = n_total / group_size;
  }
  const ga::Params p{ga::parse_scale(scale), eps, unbiased ? 1.0 : 0.0, min_std};

  const auto f32 = rewards.options().dtype(at::kFloat);
  at::Tensor adv = at::empty({n_total}, f32), mean = at::empty({num_groups}, f32), sd = at::empty({num_groups}, f32);
  at::Tensor valid = at::empty({num_groups}, rewards.options().dtype(at::kBool));
  std::vector<double> batch_stats(p.scale == ga::Scale::Batch ? 2 * num_groups : 0);
  const ga::Outputs out{adv.data_ptr<float>(), valid.data_ptr<bool>(), mean.data_ptr<float>(), sd.data_ptr<float>(),
                        batch_stats.empty() ? nullptr : batch_stats.data()};

  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, rewards.scalar_type(), "group_advantages", [&] {
    const scalar_t* r = rewards.data_ptr<scalar_t>();
    const float* w = weights.data_ptr<float>();
    if (k == 1 && (rewards.stride(0) == 1 || n_total <= 1)) {
      ga::run_with_groups(ga::ContiguousK1<scalar_t>{r, w[0]}, group_offsets, group_size, n_total, num_groups, p, out);
    } else {
      ga::run_with_groups(ga::Strided<scalar_t>{r, w, k, rewards.stride(0), rewards.stride(1)}, group_offsets,
                          group_size, n_total, num_groups, p, out);
    }
  });

  int64_t n_invalid = 0;
  const bool* v = out.valid;
  for (int64_t g = 0; g < num_groups; ++g) n_invalid += !v[g];
  const float frac = num_groups > 0 ? static_cast<float>(static_cast<double>(n_invalid) / num_groups)
                                    : std::numeric_limits<float>::quiet_NaN();
  return {adv, valid, mean, sd, at::full({}, frac, f32)};
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("group_advantages", &group_advantages,
        "Group-relative advantages (CPU). rewards [N, K] (fp16/bf16/fp32/fp64, any strides), weights [K] fp32,\n"
        "group_offsets [G+1] int32/int64 or None (then contiguous groups of group_size), scale in\n"
        "{'group', 'batch', 'none'}. Returns (advantages [N] f32, valid [G] bool, group_mean [G] f32,\n"
        "group_std [G] f32, invalid_fraction [] f32). Spec: grpo_kernels.reference.group_advantages.",
        py::arg("rewards"), py::arg("weights"), py::arg("group_offsets"), py::arg("group_size"), py::arg("scale"),
        py::arg("eps"), py::arg("unbiased"), py::arg("min_std"), py::call_guard<py::gil_scoped_release>());
}

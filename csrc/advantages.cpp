// group_advantages on the CPU. Spec: grpo_kernels.reference.group_advantages.
//
// group_advantages(rewards [N,K], weights [K], group_offsets | group_size, scale, eps, unbiased, min_std)
//
// Design
//   * Parallel over groups (at::parallel_for, ATen's OpenMP pool) with a grain of ~2048 rewards' worth of
//     groups: tiny groups are batched and small inputs run inline on the calling thread.
//   * Per group, in L1: pass 1 sums r_i (and detects non-finite values), pass 2 sums (r_i - mean)^2 (two-pass
//     variance, no E[x^2]-E[x]^2 cancellation), pass 3 writes A_i. Blocks of 64 groups run passes 1-2 for all
//     of them, then pass 3 for all: the sqrt/divide latency that ends one group's statistics then overlaps
//     the next group's loads instead of stalling its writes.
//   * Where r_i comes from: fp32/fp64 K == 1 with unit stride is the fast path, a raw pointer read by each pass
//     in loops that `omp simd` vectorizes. Other inputs (fp16/bf16, any K, any strides) use a strided loader;
//     an fp32 r_i is then computed once per block into the advantages output (exact) and re-read there.
//   * Precision: r_i in at::opmath_type of the input (fp32, or fp64 for fp64 input); sums, mean, M2, std and
//     scale factors in fp64; outputs rounded once to fp32 (twice for "batch").
//   * "batch": pass 3 writes r_i - mean_g; a serial (so deterministic) Chan combination of the fp64 per-group
//     (n, mean, M2) over non-bad groups gives S; a parallel sweep multiplies the valid groups by 1/(S + eps).
//   * AVX-512 path (fp32 K == 1 contiguous rewards, uniform or offset groups; picked at run time with
//     __builtin_cpu_supports, the functions carry __attribute__((target)), so no global -m flags and the code
//     above stays the path for other CPUs and inputs): vectorized ACROSS groups, 8 groups per batch, one fp64
//     lane each. Group l's rewards are read as "octets" of 8; the mask of each (group, octet) is a byte of a
//     per-batch bit table (bit j: reward j exists), so masked loads cost no mask arithmetic and touch nothing
//     past a group's end. Statistics, one pass, octets outer and the 8 groups inner (8 independent accumulator
//     chains per step), all groups walking max_l ceil(n_l / 8) octets (1, 2, 4 compile-time, else a run-time
//     count): d_i = r_i - r_first (exact in fp64), S1 = sum d, S2 = sum d^2 per lane; a transpose-and-add tree
//     turns 8 lane vectors into one vector of 8 sums; then mean = r_first + S1/n, M2 = S2 - S1^2/n (an
//     all-equal group has d = 0: M2 = 0, std = 0 exactly), dof, sqrt, valid and 1/(std + eps) for 8 groups at
//     once. Statistics of a block of 8 batches are computed before any of their advantages (A = r * inv -
//     mean * inv by an fma), so the div/sqrt latency overlaps the next batches' loads. Advantages: batches of
//     groups up to 32 walk the same masked octets as the statistics (no branches); larger ones go group by
//     group over each group's own octets with unmasked loads/stores (a partial last octet is written whole
//     when that stays inside the batch: the excess lands on the next groups, rewritten after), so a batch of
//     mixed sizes does not pay max-size work per group there. Batches are fixed (groups 8i..8i+7) and
//     parallel_for splits batches, so the result does not depend on the thread count; a batch with a group
//     over 128 rewards or bad offsets runs through the per-group path below (which reports the bad offsets).
//   * Offsets are checked inside the parallel loop (0 <= start < end <= N) and reported after it: bad offsets
//     raise instead of reading out of bounds, without an extra pass. No per-group heap allocation.

#include "grpo_ops.h"

#include <ATen/Dispatch.h>
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

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#endif

namespace grpo::advantages {

enum class Scale { Group, Batch, None };

inline Scale parse_scale(const std::string& s) {
  if (s == "group") return Scale::Group;
  if (s == "batch") return Scale::Batch;
  TORCH_CHECK(s == "none", "group_advantages: unknown scale '", s, "' (expected 'group', 'batch' or 'none')");
  return Scale::None;
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
  // r_i costs K strided loads: when it is an fp32 value, compute it once per block and keep it in the output.
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
  // r[i] = operator()(i) for i in [b, e) (same order of the sum), one column at a time: no per-row K loop.
  void stash(int64_t b, int64_t e, opmath_t* __restrict r) const {
    std::fill(r + b, r + e, opmath_t(0));
    for (int64_t j = 0; j < k; ++j) {
      const opmath_t wj = static_cast<opmath_t>(w[j]);
      const scalar_t* __restrict col = p + j * s1;
      for (int64_t i = b; i < e; ++i) r[i] += wj * static_cast<opmath_t>(col[i * s0]);
    }
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
  double eps, c, min_std;  // c: 1 for the unbiased std, 0 for the biased one
};

struct Outputs {
  float *adv, *mean, *std;
  bool* valid;
  double* batch_stats;  // [2 * num_groups] (mean_g, M2_g) for scale == "batch" (mean_g NaN: bad group), else null
};

struct GroupStats {  // what pass 3 needs: A_i = (r_i - mean) * inv in a valid group, 0 elsewhere
  bool valid;
  double mean, inv;
};

// Passes 1 and 2 over group g = [b, e): writes valid/mean/std (and batch_stats) and returns what pass 3 needs.
template <typename Load>
C10_ALWAYS_INLINE GroupStats group_stats(const Load load, int64_t g, int64_t b, int64_t e, const Params& p,
                                         const Outputs& out) {
  constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();
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
    return {false, 0.0, 0.0};
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
  return {valid, mean, p.scale == Scale::Group ? 1.0 / (sd + p.eps) : 1.0};  // batch: scaled later
}

// Pass 3: the advantages of group [b, e). In place when load reads the stash in adv: same index, so no
// loop-carried dependence for `omp simd`.
template <typename Load>
C10_ALWAYS_INLINE void write_advantages(const Load load, int64_t b, int64_t e, const GroupStats& s, float* adv) {
  if (!s.valid) {
    std::fill(adv + b, adv + e, 0.f);
    return;
  }
#pragma omp simd
  for (int64_t i = b; i < e; ++i) adv[i] = static_cast<float>((static_cast<double>(load(i)) - s.mean) * s.inv);
}

// What passes 1-3 read: the input itself, or the stash of r_i in the advantages output.
template <typename Load>
auto reader_of(const Load& load, float* adv) {
  if constexpr (Load::kStash) {
    return ContiguousK1<float>{adv, 1.f};
  } else {
    return load;
  }
}

// ---- AVX-512 path: fp32 K == 1 contiguous rewards, groups of up to 128, 8 groups at a time ----------------
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define GRPO_HAVE_AVX512_PATH 1
#define GRPO_AVX512 __attribute__((target("avx512f,avx512vl,avx512bw,avx512dq,bmi,bmi2")))

namespace avx512 {

constexpr int64_t kLanes = 8;      // groups per batch: one fp64 lane each
constexpr int64_t kMaxSize = 128;  // larger groups go to the per-group path
constexpr int64_t kBlock = 8;      // batches whose statistics are computed before any of their advantages

// Off by set_cpu_simd(False), so tests can run the portable path on machines that have AVX-512.
inline std::atomic<bool> enabled{true};

inline bool supported() {
  static const bool ok = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512vl") &&
                         __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512dq") &&
                         __builtin_cpu_supports("bmi2");
  return ok && enabled.load(std::memory_order_relaxed);
}

// Lane l of the result: the sum of the 8 lanes of v[l] (a transpose-and-add tree: 7 adds, 14 shuffles).
GRPO_AVX512 inline __m512d hsum8(const __m512d v[8]) {
  __m512d t[4], u[2];
  for (int i = 0; i < 4; ++i)  // 128-bit chunk c of t[i]: (partial of v[2i], partial of v[2i+1])
    t[i] = _mm512_add_pd(_mm512_unpacklo_pd(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_pd(v[2 * i], v[2 * i + 1]));
  for (int i = 0; i < 2; ++i)  // chunks of u[i]: groups (4i, 4i+1) twice, then (4i+2, 4i+3) twice
    u[i] = _mm512_add_pd(_mm512_shuffle_f64x2(t[2 * i], t[2 * i + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f64x2(t[2 * i], t[2 * i + 1], _MM_SHUFFLE(3, 1, 3, 1)));
  return _mm512_add_pd(_mm512_shuffle_f64x2(u[0], u[1], _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_f64x2(u[0], u[1], _MM_SHUFFLE(3, 1, 3, 1)));
}

// r_i of an octet in fp64; the masked-out ones read as 0 and are never loaded (no fault past the end).
// kW: the weight w0 is not 1 (with w0 == 1 the multiply is skipped: same r_i).
template <bool kW>
GRPO_AVX512 inline __m512d load_octet(const float* x, __mmask8 m, __m256 w0) {
  const __m256 v = _mm256_maskz_loadu_ps(m, x);
  return _mm512_cvtps_pd(kW ? _mm256_mul_ps(v, w0) : v);
}
template <bool kW>
GRPO_AVX512 inline __m512d load_octet(const float* x, __m256 w0) {  // all 8 rewards
  const __m256 v = _mm256_loadu_ps(x);
  return _mm512_cvtps_pd(kW ? _mm256_mul_ps(v, w0) : v);
}

// r_i of the first reward of each group (b: where the groups start), in fp64.
GRPO_AVX512 inline __m512d gather_first(const float* r, __m256 w0, __mmask8 lanes, __m512i b) {
  return _mm512_cvtps_pd(_mm256_mul_ps(_mm512_mask_i64gather_ps(_mm256_setzero_ps(), lanes, b, r, 4), w0));
}

struct Batch {  // groups g .. g + 7 (lanes past num_groups: n = 0) and what their advantages need
  alignas(64) int64_t b[kLanes], n[kLanes];
  alignas(64) double s[kLanes], c[kLanes];  // A_i = r_i * s + c  (s = inv, c = -mean * inv)
  // Bit j of bits[h][l]: reward 64 h + j of group l exists, so byte o of it is the mask of octet 8 h + o.
  alignas(64) uint64_t bits[2][kLanes];
  int64_t g, count, octets, end;  // end: one past the batch's last reward
  __mmask8 lanes, valid;
  __mmask8 octet_mask(int64_t l, int64_t o) const {  // one byte load (a kmovb), no arithmetic
    return reinterpret_cast<const unsigned char*>(&bits[o >> 3][l])[o & 7];
  }
};

// Statistics of one batch whose groups all fit in H octets (H == 0: bt.octets, known at run time), one pass:
// d_i = r_i - r_first (exact in fp64), S1 = sum d_i, S2 = sum d_i^2, mean = r_first + S1 / n,
// M2 = S2 - S1^2 / n. An all-equal group has d_i = 0 exactly, so M2 = 0 and mean = r_first exactly.
// Octets outer, groups inner: 8 independent accumulator chains per step instead of one group's chain at a time.
template <int64_t H, bool kW>
GRPO_AVX512 inline void batch_stats(const float* r, __m256 w0, Batch& bt, const __m512i b, const Params& p,
                                    const Outputs& out) {
  const int64_t octets = H > 0 ? H : bt.octets;
  const __m512d zero = _mm512_setzero_pd(), nan = _mm512_set1_pd(std::numeric_limits<double>::quiet_NaN());
  // r_first of each group: broadcast from memory by the octets after the first. Gathered up front for them,
  // after the sums when there are none (its latency then overlaps the sums).
  alignas(64) double f[kLanes];
  if constexpr (H != 1) _mm512_store_pd(f, gather_first(r, w0, bt.lanes, b));
  __m512d a1[kLanes], a2[kLanes];
#pragma GCC unroll 8
  for (int64_t l = 0; l < kLanes; ++l) {  // octet 0: r_first from the loaded octet, no memory round trip
    const __mmask8 k = bt.octet_mask(l, 0);
    const __m512d v = load_octet<kW>(r + bt.b[l], k, w0);
    const __m512d d = _mm512_maskz_sub_pd(k, v, _mm512_broadcastsd_pd(_mm512_castpd512_pd128(v)));
    a1[l] = d;
    a2[l] = _mm512_mul_pd(d, d);
  }
  for (int64_t o = 1; o < octets; ++o) {
#pragma GCC unroll 8
    for (int64_t l = 0; l < kLanes; ++l) {
      const __mmask8 k = bt.octet_mask(l, o);
      const __m512d d = _mm512_maskz_sub_pd(k, load_octet<kW>(r + bt.b[l] + 8 * o, k, w0), _mm512_set1_pd(f[l]));
      a1[l] = _mm512_add_pd(a1[l], d);
      a2[l] = _mm512_fmadd_pd(d, d, a2[l]);
    }
  }
  const __m512d s1 = hsum8(a1), s2 = hsum8(a2);
  const __m512d first = H != 1 ? _mm512_load_pd(f) : gather_first(r, w0, bt.lanes, b);
  const __m512d nd = _mm512_cvtepi64_pd(_mm512_load_si512(bt.n));
  const __mmask8 finite = _mm512_cmp_pd_mask(_mm512_sub_pd(s1, s1), zero, _CMP_EQ_OQ) & bt.lanes;
  const __m512d md = _mm512_maskz_div_pd(bt.lanes, s1, nd);
  const __m512d mean = _mm512_add_pd(first, md);
  const __m512d m2 = _mm512_max_pd(_mm512_fnmadd_pd(s1, md, s2), zero);
  const __m512d dof = _mm512_sub_pd(nd, _mm512_set1_pd(p.c));
  const __mmask8 pos = _mm512_cmp_pd_mask(dof, zero, _CMP_GT_OQ) & bt.lanes;
  const __m512d sd = _mm512_maskz_sqrt_pd(pos, _mm512_maskz_div_pd(pos, m2, dof));
  bt.valid = _mm512_cmp_pd_mask(sd, _mm512_set1_pd(p.min_std), _CMP_GT_OQ) & finite;
  const __m512d inv = p.scale == Scale::Group
                          ? _mm512_div_pd(_mm512_set1_pd(1.0), _mm512_add_pd(sd, _mm512_set1_pd(p.eps)))
                          : _mm512_set1_pd(1.0);
  _mm512_store_pd(bt.s, inv);
  _mm512_store_pd(bt.c, _mm512_mul_pd(_mm512_sub_pd(zero, mean), inv));
  _mm256_mask_storeu_ps(out.mean + bt.g, bt.lanes, _mm512_cvtpd_ps(_mm512_mask_blend_pd(finite, nan, mean)));
  _mm256_mask_storeu_ps(out.std + bt.g, bt.lanes, _mm512_cvtpd_ps(_mm512_mask_blend_pd(finite, nan, sd)));
  _mm_mask_storeu_epi8(out.valid + bt.g, bt.lanes, _mm_maskz_mov_epi8(bt.valid, _mm_set1_epi8(1)));
  if (out.batch_stats) {  // (mean_g, M2_g) interleaved; (NaN, 0) for a group with a non-finite reward
    alignas(64) double ms[kLanes], m2s[kLanes];
    _mm512_store_pd(ms, _mm512_mask_blend_pd(finite, nan, mean));
    _mm512_store_pd(m2s, _mm512_maskz_mov_pd(finite, m2));
    for (int64_t l = 0; l < bt.count; ++l)
      out.batch_stats[2 * (bt.g + l)] = ms[l], out.batch_stats[2 * (bt.g + l) + 1] = m2s[l];
  }
}

// Advantages of one batch: A_i = r_i * s + c in a valid group, +0 in the others (also where r_i is not finite).
// H > 0: like the statistics, all groups walk H masked octets. H == 0 (a group over 32): group by group, each
// over its own octets only, unmasked. A group's last, partial octet is read and written whole when that stays
// inside the batch: what it writes past the group belongs to the next groups of the batch (groups are
// contiguous), which are written after it; only a last octet that would pass the batch's end is masked.
template <int64_t H, bool kW>
GRPO_AVX512 inline void batch_write(const float* r, __m256 w0, const Batch& bt, float* adv) {
  if constexpr (H > 0) {  // groups of up to 32: every group walks H masked octets, no branches
#pragma GCC unroll 8
    for (int64_t l = 0; l < kLanes; ++l) {
      const __m512d s = _mm512_set1_pd(bt.s[l]), c = _mm512_set1_pd(bt.c[l]);
      const __mmask8 v = static_cast<__mmask8>(0u - ((bt.valid >> l) & 1u));
      for (int64_t o = 0; o < H; ++o) {
        const __mmask8 k = bt.octet_mask(l, o);
        const __m512d x = load_octet<kW>(r + bt.b[l] + 8 * o, k, w0);
        _mm256_mask_storeu_ps(adv + bt.b[l] + 8 * o, k, _mm512_cvtpd_ps(_mm512_maskz_fmadd_pd(v, x, s, c)));
      }
    }
    return;
  }
  for (int64_t l = 0; l < bt.count; ++l) {
    const __m512d s = _mm512_set1_pd(bt.s[l]), c = _mm512_set1_pd(bt.c[l]);
    const __mmask8 v = static_cast<__mmask8>(0u - ((bt.valid >> l) & 1u));
    const int64_t b = bt.b[l], e = b + bt.n[l];
    int64_t i = b;
    for (; i + 8 <= e; i += 8)
      _mm256_storeu_ps(adv + i, _mm512_cvtpd_ps(_mm512_maskz_fmadd_pd(v, load_octet<kW>(r + i, w0), s, c)));
    if (i == e) continue;
    if (i + 8 <= bt.end) {
      _mm256_storeu_ps(adv + i, _mm512_cvtpd_ps(_mm512_maskz_fmadd_pd(v, load_octet<kW>(r + i, w0), s, c)));
    } else {
      const __mmask8 k = static_cast<__mmask8>(_bzhi_u32(0xFFu, static_cast<unsigned>(e - i)));
      _mm256_mask_storeu_ps(adv + i, k, _mm512_cvtpd_ps(_mm512_maskz_fmadd_pd(v, load_octet<kW>(r + i, k, w0), s, c)));
    }
  }
}

// Batches [i0, i1) of groups [8 i, 8 i + 8) (cut at num_groups). Returns the first batch it cannot run (bad
// offsets or a group over kMaxSize: the caller runs that one per group, then calls again) or i1.
template <bool kW, typename Groups>
GRPO_AVX512 int64_t run_batches(const float* r, float w0f, const Groups& groups, int64_t n_total,
                                int64_t num_groups, int64_t i0, int64_t i1, const Params& p, const Outputs& out) {
  const __m256 w0 = _mm256_set1_ps(w0f);
  const __m512i iota = _mm512_set_epi64(7, 6, 5, 4, 3, 2, 1, 0);
  Batch block[kBlock];
  for (int64_t ib = i0; ib < i1; ib += kBlock) {
    const int64_t ie = std::min(i1, ib + kBlock);
    int64_t i = ib;
    for (; i < ie; ++i) {
      Batch& bt = block[i - ib];
      bt.g = i * kLanes;
      bt.count = std::min(kLanes, num_groups - bt.g);
      bt.lanes = static_cast<__mmask8>(_bzhi_u32(0xFFu, static_cast<unsigned>(bt.count)));
      __m512i b, e;
      if constexpr (std::is_same_v<Groups, Uniform>) {
        const __m512i size = _mm512_set1_epi64(groups.size);
        b = _mm512_maskz_add_epi64(bt.lanes, _mm512_set1_epi64(bt.g * groups.size), _mm512_mullo_epi64(iota, size));
        e = _mm512_add_epi64(b, size);
      } else if constexpr (std::is_same_v<Groups, Offsets<int64_t>>) {
        b = _mm512_maskz_loadu_epi64(bt.lanes, groups.o + bt.g);
        e = _mm512_maskz_loadu_epi64(bt.lanes, groups.o + bt.g + 1);
      } else {
        b = _mm512_cvtepi32_epi64(_mm256_maskz_loadu_epi32(bt.lanes, groups.o + bt.g));
        e = _mm512_cvtepi32_epi64(_mm256_maskz_loadu_epi32(bt.lanes, groups.o + bt.g + 1));
      }
      const __m512i n = _mm512_maskz_sub_epi64(bt.lanes, e, b);
      const __mmask8 ok = _mm512_cmpge_epi64_mask(b, _mm512_setzero_si512()) &
                          _mm512_cmpgt_epi64_mask(n, _mm512_setzero_si512()) &
                          _mm512_cmple_epi64_mask(e, _mm512_set1_epi64(n_total)) &
                          _mm512_cmple_epi64_mask(n, _mm512_set1_epi64(kMaxSize));
      if ((ok & bt.lanes) != bt.lanes) break;
      _mm512_store_si512(bt.b, b);
      _mm512_store_si512(bt.n, n);
      const __m512i ones = _mm512_set1_epi64(-1);  // reward j of a group of n exists: bit j of ~(~0 << n)
      _mm512_store_si512(bt.bits[0], _mm512_andnot_si512(_mm512_sllv_epi64(ones, n), ones));
      _mm512_store_si512(bt.bits[1], _mm512_andnot_si512(
          _mm512_sllv_epi64(ones, _mm512_max_epi64(_mm512_sub_epi64(n, _mm512_set1_epi64(64)), _mm512_setzero_si512())),
          ones));
      bt.end = bt.b[bt.count - 1] + bt.n[bt.count - 1];
      bt.octets = (_mm512_reduce_max_epi64(n) + 7) >> 3;
      if (bt.octets == 1) batch_stats<1, kW>(r, w0, bt, b, p, out);
      else if (bt.octets == 2) batch_stats<2, kW>(r, w0, bt, b, p, out);
      else if (bt.octets <= 4) bt.octets = 4, batch_stats<4, kW>(r, w0, bt, b, p, out);
      else batch_stats<0, kW>(r, w0, bt, b, p, out);
    }
    for (int64_t j = ib; j < i; ++j) {
      const Batch& bt = block[j - ib];
      if (bt.octets == 1) batch_write<1, kW>(r, w0, bt, out.adv);
      else if (bt.octets == 2) batch_write<2, kW>(r, w0, bt, out.adv);
      else if (bt.octets == 4) batch_write<4, kW>(r, w0, bt, out.adv);
      else batch_write<0, kW>(r, w0, bt, out.adv);
    }
    if (i < ie) return i;
  }
  return i1;
}

}  // namespace avx512
#endif

template <typename Load, typename Groups>
void run(const Load& load, const Groups& groups, int64_t n_total, int64_t num_groups, const Params& p,
         const Outputs& out) {
  const int64_t avg = num_groups > 0 ? std::max<int64_t>(1, n_total / num_groups) : 1;
  const int64_t grain = std::max<int64_t>(1, 2048 / avg);
  constexpr int64_t kBlock = 64;  // groups whose statistics are computed before any of their advantages
  std::atomic<bool> bad_offsets{false};

  auto per_group = [&](int64_t g0, int64_t g1) {
    const auto read = reader_of(load, out.adv);
    GroupStats stats[kBlock];
    for (int64_t gb = g0; gb < g1; gb += kBlock) {
      const int64_t ge = std::min(g1, gb + kBlock);
      for (int64_t g = gb; g < ge; ++g) {
        const int64_t b = groups.start(g), e = groups.end(g);
        if (b < 0 || e <= b || e > n_total) {
          bad_offsets.store(true, std::memory_order_relaxed);
          return;
        }
      }
      if constexpr (Load::kStash) load.stash(groups.start(gb), groups.end(ge - 1), out.adv);
      for (int64_t g = gb; g < ge; ++g) stats[g - gb] = group_stats(read, g, groups.start(g), groups.end(g), p, out);
      for (int64_t g = gb; g < ge; ++g) write_advantages(read, groups.start(g), groups.end(g), stats[g - gb], out.adv);
    }
  };
  bool done = false;
#ifdef GRPO_HAVE_AVX512_PATH
  if constexpr (std::is_same_v<Load, ContiguousK1<float>>) {
    bool fits = true;
    if constexpr (std::is_same_v<Groups, Uniform>) fits = groups.size <= avx512::kMaxSize;
    if (fits && avx512::supported()) {
      // Batches of 8 groups at fixed global positions: the result does not depend on the thread count.
      const int64_t num_batches = (num_groups + avx512::kLanes - 1) / avx512::kLanes;
      at::parallel_for(0, num_batches, std::max<int64_t>(1, grain / avx512::kLanes), [&](int64_t i0, int64_t i1) {
        for (int64_t i = i0; i < i1; ++i) {
          i = load.w0 == 1.f ? avx512::run_batches<false>(load.p, load.w0, groups, n_total, num_groups, i, i1, p, out)
                             : avx512::run_batches<true>(load.p, load.w0, groups, n_total, num_groups, i, i1, p, out);
          if (i < i1) per_group(i * avx512::kLanes, std::min(num_groups, (i + 1) * avx512::kLanes));
        }
      });
      done = true;
    }
  }
#endif
  if (!done) at::parallel_for(0, num_groups, grain, per_group);
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
    const bool i32 = o.scalar_type() == at::kInt;
    auto at_ = [&](int64_t i) { return i32 ? int64_t{o.data_ptr<int32_t>()[i]} : o.data_ptr<int64_t>()[i]; };
    TORCH_CHECK(at_(0) == 0 && at_(num_groups) == n_total, "group_advantages: group_offsets must run from 0 to N");
  } else {
    TORCH_CHECK(group_size > 0 && n_total % group_size == 0, "group_advantages: group_size must be > 0 and divide N");
    num_groups = n_total / group_size;
  }
  const ga::Params p{ga::parse_scale(scale), eps, unbiased ? 1.0 : 0.0, min_std};

  const auto f32 = rewards.options().dtype(at::kFloat);
  at::Tensor adv = at::empty({n_total}, f32), mean = at::empty({num_groups}, f32), sd = at::empty({num_groups}, f32);
  at::Tensor valid = at::empty({num_groups}, rewards.options().dtype(at::kBool));
  std::vector<double> batch_stats(p.scale == ga::Scale::Batch ? 2 * num_groups : 0);
  const ga::Outputs out{adv.data_ptr<float>(), mean.data_ptr<float>(), sd.data_ptr<float>(), valid.data_ptr<bool>(),
                        batch_stats.empty() ? nullptr : batch_stats.data()};

  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, rewards.scalar_type(), "group_advantages", [&] {
    const scalar_t* r = rewards.data_ptr<scalar_t>();
    const float* w = weights.data_ptr<float>();
    // fp16/bf16 take the strided path too: its stash converts each reward to fp32 once instead of per pass.
    if constexpr (std::is_same_v<scalar_t, at::opmath_type<scalar_t>>) {
      if (k == 1 && (rewards.stride(0) == 1 || n_total <= 1)) {
        return ga::run_with_groups(ga::ContiguousK1<scalar_t>{r, w[0]}, group_offsets, group_size, n_total,
                                   num_groups, p, out);
      }
    }
    ga::run_with_groups(ga::Strided<scalar_t>{r, w, k, rewards.stride(0), rewards.stride(1)}, group_offsets,
                        group_size, n_total, num_groups, p, out);
  });

  int64_t n_invalid = 0;
  const bool* v = out.valid;
  for (int64_t g = 0; g < num_groups; ++g) n_invalid += !v[g];
  const float frac = num_groups > 0 ? static_cast<float>(static_cast<double>(n_invalid) / num_groups)
                                    : std::numeric_limits<float>::quiet_NaN();
  return {adv, valid, mean, sd, at::full({}, frac, f32)};
}

namespace grpo {
void set_advantages_simd(bool on) { advantages::avx512::enabled.store(on); }
bool advantages_simd() { return advantages::avx512::supported(); }
}  // namespace grpo

// selective_logprobs (forward and backward) on the CPU. Spec: grpo_kernels.reference.selective_logprobs.
//
//   z_tv = x_tv / T,  lse_t = logsumexp_v z_tv,  p_tv = exp(z_tv - lse_t)
//   logps_t = z_t,ids_t - lse_t,  entropy_t = lse_t - sum_v p_tv z_tv
//   dlogits_tv = [ g_t (1[v = ids_t] - p_tv) - gH_t p_tv (z_tv - lse_t + H_t) ] / T
//
// Design
//   * Parallel over rows (at::parallel_for). Rows may have any stride >= V (last-dim stride 1); ids are
//     range-checked inside the row loop (a bad row is skipped and flagged) and reported after the loop.
//   * Forward: ONE pass over each row, an online log-sum-exp in the units of the raw logits x: a running max
//     m (of x, so huge logits lose no bits to x / T), s = sum exp(d) and, for the entropy, u = sum exp(d) d,
//     with d = (x - m) / T <= 0. When m grows to m', d shifts by D = (m - m') / T and
//     s' = e^D s,  u' = e^D (u + D s).
//     Then lse = M / T + log S, logps = (x_id - M) / T - log S and entropy = log S - U / S: a sum of two
//     non-negative terms, so no cancellation between lse and sum p z when the logits are large.
//     d is clamped below at -120 (exp = 0 in fp32, and exp(d) d = 0 even for -inf logits).
//   * Backward: one read and one write per element, p = exp(d), d = (x - c) / T + k (c ~ lse T, see below),
//     dlogits = p (a + b d) with a = -(g + gH H) / T, b = -gH / T; the id element is then rewritten from
//     its logit read before the row (so inplace = true can overwrite the logits) as that value + g / T.
//     An fp32 lse is only good to half its spacing, and every p of the row inherits that error (p relative
//     error = lse error): 1e-4 at |lse| ~ 3e3 (T = 1e-3 on logits ~ 3), 1.5 % at 3e5 (T = 1e-5). So a row whose
//     |lse| >= kExactLse first recomputes the forward's (M, S) (one more read of the row, no entropy sums) and
//     uses c = M, k = -log S: d is then as exact as the forward's, at any temperature.
//   * AVX-512 path (fp32/bf16/fp16 rows; bf16/fp16 widened to fp32 in registers; chosen at run time with
//     __builtin_cpu_supports, functions carry __attribute__((target)), no global -m flags): 16 lanes, each
//     with its own running max. Chunks of 8 vectors (128 logits) are loaded into registers, their max
//     updates m (the rescale, one vector exp, only runs when some lane's max grew), then exp of all 8.
//     exp (exp16 in simd_avx512.h, shared with loss.cpp): x = n ln2 + r (two-constant Cody-Waite,
//     |r| <= ln2/2), degree-6 polynomial (fitted for relative error, ~1 ulp), 2^n by _mm512_scalef_ps
//     (exact underflow to 0 / denormals).
//     The tail of a row uses masked loads (filler -FLT_MAX) and masked accumulation.
//   * Precision: exps and per-chunk sums (8 terms per lane) in fp32; per-lane running s and u in fp64
//     (the chunk sums are widened and added: a few ops per 128 logits); the lane combination and the final
//     log / divide in fp64; outputs rounded once to fp32. The backward is exact up to fp32 exp, and up to the
//     fp32 lse it is given below |lse| = kExactLse (there its half spacing, <= 2^-20 ~ 1e-6, is the error of d).
//   * Portable path (other CPUs, or set_logprobs_simd(False)): the same algorithm with scalar std::exp in
//     blocks of 64 and fp64 accumulators.

#include "grpo_ops.h"
#include "simd_avx512.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cfloat>
#include <cmath>
#include <limits>
#include <optional>
#include <tuple>


namespace grpo::logprobs {

constexpr float kMinArg = -120.f;  // exp(-120) underflows to 0 in fp32
constexpr float kExactLse = 32.f;  // from |lse| = 32 up (fp32 spacing >= 2^-18) the backward recomputes (M, S)

inline std::atomic<bool> simd_enabled{true};

inline bool simd() {
#ifdef GRPO_HAVE_AVX512
  return simd::cpu_has_avx512() && simd_enabled.load(std::memory_order_relaxed);
#else
  return false;
#endif
}

// Online log-sum-exp state of one row: max M of the raw logits, S = sum exp(d), U = sum exp(d) d.
struct RowStats {
  float m;
  double s, u;
};

inline float clamp_lo(float d) { return d < kMinArg ? kMinArg : d; }  // NaN stays NaN

// ---- portable path -------------------------------------------------------------------------------------
template <typename T, bool kEnt>
RowStats forward_row_portable(const T* x, int64_t V, float inv_t) {
  constexpr int64_t kBlock = 64;
  float m = -FLT_MAX;
  double s = 0, u = 0;
  for (int64_t b = 0; b < V; b += kBlock) {
    const int64_t e = std::min(V, b + kBlock);
    float bm = m;
    for (int64_t j = b; j < e; ++j) bm = std::max(bm, static_cast<float>(x[j]));
    if (bm > m) {
      const double D = std::max<double>(kMinArg, (static_cast<double>(m) - bm) * inv_t), w = std::exp(D);
      if (kEnt) u = w * (u + D * s);
      s *= w;
      m = bm;
    }
    for (int64_t j = b; j < e; ++j) {
      const float d = clamp_lo((static_cast<float>(x[j]) - m) * inv_t), ex = std::exp(d);
      s += ex;
      if (kEnt) u += static_cast<double>(ex) * d;
    }
  }
  return {m, s, u};
}

// d = z - lse = (x - c) / T + k, c = float(lse T), k = c / T - lse: x - c is exact near the top of the row
// (Sterbenz), so an fp32 1/T costs no bits there even for |x| ~ 1e4 (x / T - lse would lose ~|x| 2^-24).
template <typename T>
void backward_row_portable(const T* x, T* out, int64_t V, float inv_t, float c, float k, float a, float b) {
  for (int64_t j = 0; j < V; ++j) {
    const float d = clamp_lo(std::fma(static_cast<float>(x[j]) - c, inv_t, k));
    out[j] = static_cast<T>(std::exp(d) * std::fma(b, d, a));
  }
}

// ---- AVX-512 path --------------------------------------------------------------------------------------
#ifdef GRPO_HAVE_AVX512
using namespace grpo::simd;  // exp16, tail_mask, Io, add_wide (simd_avx512.h)

struct Acc {  // per lane: running max m (raw logits), s and u in fp64 (lanes 0-7 in [0], 8-15 in [1])
  __m512 m;
  __m512d s[2], u[2];
};

// One chunk of 8 vectors (128 logits; with kTail only the first n exist).
template <typename T, bool kEnt, bool kTail>
GRPO_AVX512 inline void forward_chunk(const T* x, int64_t n, __m512 inv_t, Acc& a) {
  constexpr int kU = 8;
  const __m512 lowest = _mm512_set1_ps(-FLT_MAX), lo = _mm512_set1_ps(kMinArg);
  __m512 v[kU];
  __mmask16 k[kU];
  for (int i = 0; i < kU; ++i) {
    k[i] = kTail ? tail_mask(n - 16 * i) : 0xFFFF;
    v[i] = kTail ? Io<T>::load(x + 16 * i, k[i], lowest) : Io<T>::load(x + 16 * i);
  }
  __m512 cm = a.m;
  for (int i = 0; i < kU; ++i) cm = _mm512_max_ps(cm, v[i]);
  if (_mm512_cmp_ps_mask(cm, a.m, _CMP_GT_OQ)) {  // some lane's max grew: shift its s and u
    const __m512 D = _mm512_max_ps(lo, _mm512_mul_ps(_mm512_sub_ps(a.m, cm), inv_t)), w = exp16(D);
    const __m512d wd[2] = {_mm512_cvtps_pd(_mm512_castps512_ps256(w)), _mm512_cvtps_pd(_mm512_extractf32x8_ps(w, 1))};
    const __m512d Dd[2] = {_mm512_cvtps_pd(_mm512_castps512_ps256(D)), _mm512_cvtps_pd(_mm512_extractf32x8_ps(D, 1))};
    for (int h = 0; h < 2; ++h) {
      if (kEnt) a.u[h] = _mm512_mul_pd(wd[h], _mm512_fmadd_pd(Dd[h], a.s[h], a.u[h]));
      a.s[h] = _mm512_mul_pd(wd[h], a.s[h]);
    }
    a.m = cm;
  }
  __m512 cs = _mm512_setzero_ps(), cu = _mm512_setzero_ps();
  for (int i = 0; i < kU; ++i) {
    const __m512 d = _mm512_max_ps(lo, _mm512_mul_ps(_mm512_sub_ps(v[i], a.m), inv_t)), e = exp16(d);
    cs = _mm512_mask_add_ps(cs, k[i], cs, e);
    if (kEnt) cu = _mm512_mask3_fmadd_ps(e, d, cu, k[i]);
  }
  add_wide(a.s, cs);
  if (kEnt) add_wide(a.u, cu);
}

template <typename T, bool kEnt>
GRPO_AVX512 RowStats forward_row_avx512(const T* x, int64_t V, float inv_t_f) {
  const __m512 inv_t = _mm512_set1_ps(inv_t_f);
  Acc a{_mm512_set1_ps(-FLT_MAX), {_mm512_setzero_pd(), _mm512_setzero_pd()}, {_mm512_setzero_pd(), _mm512_setzero_pd()}};
  int64_t j = 0;
  for (; j + 128 <= V; j += 128) forward_chunk<T, kEnt, false>(x + j, 128, inv_t, a);
  if (j < V) forward_chunk<T, kEnt, true>(x + j, V - j, inv_t, a);
  alignas(64) float m[16];
  alignas(64) double s[16], u[16];
  _mm512_store_ps(m, a.m);
  for (int h = 0; h < 2; ++h) _mm512_store_pd(s + 8 * h, a.s[h]), _mm512_store_pd(u + 8 * h, a.u[h]);
  float M = m[0];
  for (int l = 1; l < 16; ++l) M = std::max(M, m[l]);
  double S = 0, U = 0;
  for (int l = 0; l < 16; ++l) {
    if (s[l] == 0) continue;  // a lane that saw nothing (or only exp = 0)
    const double D = std::max<double>(kMinArg, (static_cast<double>(m[l]) - M) * inv_t_f), w = std::exp(D);
    S += w * s[l];
    U += w * (u[l] + D * s[l]);
  }
  return {M, S, U};
}

template <typename T>
GRPO_AVX512 void backward_row_avx512(const T* x, T* out, int64_t V, float inv_t_f, float c_f, float k_f,
                                        float a_f, float b_f) {
  const __m512 inv_t = _mm512_set1_ps(inv_t_f), c = _mm512_set1_ps(c_f), k_ = _mm512_set1_ps(k_f),
               a = _mm512_set1_ps(a_f),
               b = _mm512_set1_ps(b_f), lo = _mm512_set1_ps(kMinArg);
  for (int64_t j = 0; j < V; j += 16) {
    const __mmask16 k = tail_mask(V - j);
    const __m512 v = k == 0xFFFF ? Io<T>::load(x + j) : Io<T>::load(x + j, k, _mm512_setzero_ps());
    const __m512 d = _mm512_max_ps(lo, _mm512_fmadd_ps(_mm512_sub_ps(v, c), inv_t, k_));
    Io<T>::store(out + j, _mm512_mul_ps(exp16(d), _mm512_fmadd_ps(b, d, a)), k);
  }
}
#endif  // GRPO_HAVE_AVX512

// ---- ops -----------------------------------------------------------------------------------------------
template <typename F>
void dispatch(const at::Tensor& logits, const char* op, F&& f) {
  switch (logits.scalar_type()) {
    case at::kFloat: return f(float{});
    case at::kBFloat16: return f(c10::BFloat16{});
    case at::kHalf: return f(c10::Half{});
    default: TORCH_CHECK(false, op, ": logits must be float32, bfloat16 or float16, got ", logits.scalar_type());
  }
}

void check_inputs(const char* op, const at::Tensor& logits, const at::Tensor& ids, double temperature) {
  TORCH_CHECK(logits.device().is_cpu() && ids.device().is_cpu(), op, ": CPU tensors only");
  TORCH_CHECK(logits.dim() == 2 && logits.size(1) >= 1, op, ": logits must be [T, V] with V >= 1");
  TORCH_CHECK(logits.stride(1) == 1 || logits.size(1) == 1, op, ": logits' last dim must have stride 1");
  TORCH_CHECK(logits.size(0) <= 1 || logits.stride(0) >= logits.size(1), op, ": logits' row stride must be >= V");
  TORCH_CHECK(ids.dim() == 1 && ids.size(0) == logits.size(0) && ids.scalar_type() == at::kLong, op,
              ": ids must be int64 [T]");
  TORCH_CHECK(temperature > 0 && std::isfinite(temperature), op, ": temperature must be finite and > 0");
}

// Runs f(t, id_t) for every row in parallel; rows with an id outside [0, V) are skipped (nothing is read
// out of bounds) and reported after the loop.
template <typename F>
void for_each_row(const char* op, int64_t T, int64_t V, const int64_t* id, const F& f) {
  std::atomic<bool> bad{false};
  at::parallel_for(0, T, std::max<int64_t>(1, 16384 / V), [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t k = id[t];
      if (k < 0 || k >= V) {
        bad.store(true, std::memory_order_relaxed);
        continue;
      }
      f(t, k);
    }
  });
  TORCH_CHECK(!bad.load(), op, ": ids must lie in [0, V=", V, ")");
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> selective_logprobs(const at::Tensor& logits, const at::Tensor& ids,
                                                                  double temperature, bool return_entropy) {
  check_inputs("selective_logprobs", logits, ids, temperature);
  const int64_t T = logits.size(0), V = logits.size(1), ld = logits.stride(0);
  const auto f32 = logits.options().dtype(at::kFloat);
  at::Tensor logps = at::empty({T}, f32), lse = at::empty({T}, f32);
  at::Tensor entropy = at::empty({return_entropy ? T : 0}, f32);
  const at::Tensor idc = ids.contiguous();
  const int64_t* id = idc.data_ptr<int64_t>();
  float *lp = logps.data_ptr<float>(), *ls = lse.data_ptr<float>(), *H = entropy.data_ptr<float>();
  const double inv_t = 1.0 / temperature;
  const bool vec = simd();
  dispatch(logits, "selective_logprobs", [&](auto tag) {
    using T_ = decltype(tag);
    const T_* base = logits.data_ptr<T_>();
    for_each_row("selective_logprobs", T, V, id, [&](int64_t t, int64_t k) {
      const T_* x = base + t * ld;
      RowStats r;
#ifdef GRPO_HAVE_AVX512
      if (vec)
        r = return_entropy ? forward_row_avx512<T_, true>(x, V, float(inv_t)) : forward_row_avx512<T_, false>(x, V, float(inv_t));
      else
#endif
        r = return_entropy ? forward_row_portable<T_, true>(x, V, float(inv_t)) : forward_row_portable<T_, false>(x, V, float(inv_t));
      const double log_s = std::log(r.s);
      ls[t] = static_cast<float>(r.m * inv_t + log_s);
      lp[t] = static_cast<float>((static_cast<double>(static_cast<float>(x[k])) - r.m) * inv_t - log_s);
      if (return_entropy) H[t] = static_cast<float>(log_s - r.u / r.s);
    });
  });
  (void)vec;
  return {logps, entropy, lse};
}

at::Tensor selective_logprobs_backward(const at::Tensor& grad_logps, const std::optional<at::Tensor>& grad_entropy,
                                       const at::Tensor& logits, const at::Tensor& ids, const at::Tensor& lse,
                                       const std::optional<at::Tensor>& entropy, double temperature, bool inplace) {
  check_inputs("selective_logprobs_backward", logits, ids, temperature);
  const int64_t T = logits.size(0), V = logits.size(1), ld = logits.stride(0);
  auto vec1 = [&](const at::Tensor& v, const char* name) {
    TORCH_CHECK(v.dim() == 1 && v.size(0) == T, "selective_logprobs_backward: ", name, " must be [T]");
    return v.to(at::kFloat).contiguous();
  };
  const bool has_h = grad_entropy.has_value() && grad_entropy->defined();
  TORCH_CHECK(!has_h || (entropy.has_value() && entropy->defined()),
              "selective_logprobs_backward: grad_entropy needs entropy");
  const at::Tensor g = vec1(grad_logps, "grad_logps"), L = vec1(lse, "lse");
  const at::Tensor gH = has_h ? vec1(*grad_entropy, "grad_entropy") : at::Tensor(),
                   Hs = has_h ? vec1(*entropy, "entropy") : at::Tensor();
  at::Tensor out = inplace ? logits : at::empty({T, V}, logits.options());
  const int64_t ldo = inplace ? ld : V;
  const at::Tensor idc = ids.contiguous();
  const int64_t* id = idc.data_ptr<int64_t>();
  const float *gp = g.data_ptr<float>(), *lp = L.data_ptr<float>();
  const float *ghp = has_h ? gH.data_ptr<float>() : nullptr, *hp = has_h ? Hs.data_ptr<float>() : nullptr;
  const double inv_t = 1.0 / temperature;
  const bool vec = simd();
  dispatch(logits, "selective_logprobs_backward", [&](auto tag) {
    using T_ = decltype(tag);
    const T_* base = logits.data_ptr<T_>();
    T_* obase = out.data_ptr<T_>();
    for_each_row("selective_logprobs_backward", T, V, id, [&](int64_t t, int64_t k) {
      const T_* x = base + t * ld;
      T_* o = obase + t * ldo;
      const double gt = gp[t], ght = has_h ? ghp[t] : 0.0;
      const double a = -(gt + (has_h ? ght * hp[t] : 0.0)) * inv_t, b = -ght * inv_t;
      const double xk = static_cast<float>(x[k]);  // read before an inplace row overwrites it
      float c, kk;  // d = (x - c) / T + kk
      double dk;    // d of the id element, in fp64
      if (std::fabs(lp[t]) >= kExactLse) {  // the fp32 lse is too coarse: the row's (M, S) again, as the forward
        RowStats r;
#ifdef GRPO_HAVE_AVX512
        if (vec)
          r = forward_row_avx512<T_, false>(x, V, float(inv_t));
        else
#endif
          r = forward_row_portable<T_, false>(x, V, float(inv_t));
        const double log_s = std::log(r.s);
        c = r.m, kk = static_cast<float>(-log_s);
        dk = std::max<double>(kMinArg, (xk - r.m) * inv_t - log_s);
      } else {
        c = static_cast<float>(lp[t] * temperature), kk = static_cast<float>(c * inv_t - lp[t]);
        dk = std::max<double>(kMinArg, xk * inv_t - lp[t]);
      }
#ifdef GRPO_HAVE_AVX512
      if (vec)
        backward_row_avx512<T_>(x, o, V, float(inv_t), c, kk, float(a), float(b));
      else
#endif
        backward_row_portable<T_>(x, o, V, float(inv_t), c, kk, float(a), float(b));
      o[k] = static_cast<T_>(static_cast<float>(std::exp(dk) * (a + b * dk) + gt * inv_t));
    });
  });
  (void)vec;
  return out;
}

}  // namespace grpo::logprobs

namespace grpo {
void set_logprobs_simd(bool on) { logprobs::simd_enabled.store(on); }
bool logprobs_simd() { return logprobs::simd(); }
}  // namespace grpo

// The per-sequence loss kernels of grpo_loss_fwd on the CPU (the portable path and the AVX-512 path) and what
// they share: the call's Params, a sequence's Seq, the scalar helpers. Design and spec: csrc/loss.cpp (top).
#pragma once

#include "simd_avx512.h"

#include <algorithm>
#include <atomic>
#include <cfloat>
#include <cmath>
#include <cstdint>

namespace grpo::loss {

constexpr int kKernelStats = 9, kStats = 11, kSeqSums = 5;
// the kernel columns that sum values (loss, dl/dw, ratio, KL, sampler diff) rather than mask weights
constexpr bool kValueColumn[kKernelStats] = {true, false, true, false, false, false, true, true, true};
constexpr float kLog1e8 = -18.420680743952367f;  // VESPO's floor on log ratios (TRL: log(1e-8))

inline std::atomic<bool> simd_enabled{true};

inline bool simd() { return simd::cpu_has_avx512() && simd_enabled.load(std::memory_order_relaxed); }

// Inputs and options of one call (null pointer = input absent). Hyperparameters in fp32, as the kernels use them.
struct Params {
  const float *old, *ref, *sampler, *adv, *mask;
  bool adv_per_token, bias_kl, sampler_truncate, sampler_per_seq, vespo;
  float lo, hi, delta, eps_high, beta, log_beta, cap, log_cap, tau_pos, tau_neg;
};

// Per-sequence scalars of phase 2.
struct Seq {
  float adv;  // the sequence's advantage (when not per token)
  float w;    // GSPO ratio exp(log_w)
  float is;   // sequence-level sampler weight
  float log_w;  // GSPO log ratio
  float phi_pos, phi_neg;  // vespo's gamma weights for A >= 0 and A < 0
};

// exp(nan_to_num(d)), truncated at cap or zeroed above it (nan_to_num: NaN -> 0, +-inf -> +-FLT_MAX).
inline double sampler_weight(double d, double cap, bool truncate) {
  d = d != d ? 0.0 : std::clamp<double>(d, -FLT_MAX, FLT_MAX);
  const double r = std::exp(d);
  return truncate ? std::min(r, cap) : (r > cap ? 0.0 : r);
}

inline float nan_to_num(float d) { return d != d ? 0.f : std::clamp(d, -FLT_MAX, FLT_MAX); }

// min / max returning NaN when either operand is NaN, as torch.min / clamp do.
inline float nan_min(float a, float b) { return (a < b || a != a) ? a : b; }
inline float nan_max(float a, float b) { return (a > b || a != a) ? a : b; }

// x w, and 0 where x == 0 even for w = inf (a ratio beyond fp32 times an exact zero is 0, not NaN).
inline float times_w(float x, float w) { return x == 0.f ? 0.f : x * w; }

// vespo: log of the token sampler weight f(d) (d = nan_to_num'ed difference), floored at log 1e-8, capped at 20.
inline float vespo_log_r(float d, const Params& p) {
  const float lr = p.sampler_truncate ? std::min(d, p.log_cap) : (std::exp(d) > p.cap ? kLog1e8 : d);
  return std::clamp(lr, kLog1e8, 20.f);
}

// vespo's gamma weight exp(lam + k log v - lam v), log v = clamp(S, log 1e-8, 20), in fp64; NaN / inf -> 0.
inline float vespo_phi(double S, double k, double lam) {
  const double lv = std::clamp(S, static_cast<double>(kLog1e8), 20.0);  // NaN stays NaN
  const double phi = std::exp(lam + k * lv - lam * std::exp(lv));
  return std::isfinite(phi) ? static_cast<float>(phi) : 0.f;
}

// ---- portable path -------------------------------------------------------------------------------------
template <typename T>
void seq_sums_portable(const T* x, const Params& p, int64_t t0, int64_t t1, double out[kSeqSums]) {
  double lr = 0, n = 0, is = 0, v = 0, vis = 0;
  for (int64_t t = t0; t < t1; ++t) {
    const float m = p.mask ? p.mask[t] : 1.f;
    if (m == 0.f) {
      if (p.vespo && p.sampler) vis += vespo_log_r(0.f, p);  // every position counts: d = 0 here
      continue;
    }
    const float lp = static_cast<float>(x[t]), old = p.old ? p.old[t] : lp;
    lr += (lp - old) * m;
    n += m;
    if (p.sampler) {
      const float d = nan_to_num((old - p.sampler[t]) * m);
      is += d;
      if (p.vespo) vis += vespo_log_r(d, p);
    }
    if (p.vespo) v += nan_min(nan_max(lp - old, -20.f), 20.f) * m;
  }
  out[0] = lr, out[1] = n, out[2] = is, out[3] = v, out[4] = vis;
}

template <typename T, int kLoss, bool kSeq>
void seq_portable(const T* x, const Params& p, const Seq& q, int64_t t0, int64_t t1, float* coef, double out[9]) {
  double acc[kKernelStats] = {};
  for (int64_t t = t0; t < t1; ++t) {
    const float m = p.mask ? p.mask[t] : 1.f;
    if (m == 0.f) {
      coef[t] = 0.f;
      continue;
    }
    const float lp = static_cast<float>(x[t]), old = p.old ? p.old[t] : lp;
    const float adv = p.adv_per_token ? p.adv[t] : q.adv;
    const float log_w = kSeq ? q.log_w : lp - old, w = kSeq ? q.w : std::exp(log_w);
    float pol, dpol = 0.f, direct = 0.f, phi = 0.f;
    bool low, high = false;
    if constexpr (kLoss == 0) {
      const float wm = nan_min(w, p.delta), clipped = nan_min(nan_max(w, p.lo), p.hi);
      const float a1 = times_w(adv, wm), a2 = clipped * adv;
      pol = -nan_min(a1, a2);
      const float g1 = w <= p.delta ? -adv : 0.f, g2 = (w >= p.lo && w <= p.hi) ? -adv : 0.f;
      dpol = a1 < a2 ? g1 : a1 > a2 ? g2 : 0.5f * (g1 + g2);  // torch.min splits a tie's gradient
      low = wm < p.lo && adv < 0.f;
      high = wm > p.hi && adv > 0.f;
    } else if constexpr (kLoss == 1) {
      const float cw = nan_min(w, p.eps_high);
      pol = -cw * adv * lp;
      direct = -cw * adv;
      low = w > p.eps_high && adv > 0.f;
    } else if constexpr (kLoss == 2) {
      const float tau = adv > 0.f ? p.tau_pos : p.tau_neg, z = tau * (w - 1.f);
      // sigmoid(z) and sigmoid(-z) from one exp(-|z|): sg (1 - sg) keeps its precision when sg rounds to 1
      const float e = std::exp(-std::fabs(z)), inv = 1.f / (1.f + e);
      const float sg = z >= 0.f ? inv : e * inv, sg_c = z >= 0.f ? e * inv : inv;
      pol = -sg * 4.f / tau * adv;
      dpol = -4.f * adv * sg * sg_c;
      low = w < p.lo && adv < 0.f;
      high = w > p.hi && adv > 0.f;
    } else {
      phi = adv >= 0.f ? q.phi_pos : q.phi_neg;  // a NaN advantage takes the A < 0 pair, as TRL's where
      direct = -phi * adv;
      pol = direct * lp;
      low = false;
    }
    if (p.sampler) {
      const float s = p.sampler[t];
      if constexpr (kLoss != 3) {  // vespo's sampler weights are in phi
        const float r =
            p.sampler_per_seq ? q.is : static_cast<float>(sampler_weight((old - s) * m, p.cap, p.sampler_truncate));
        pol = r == 0.f && pol == pol ? 0.f : pol * r;  // a zeroed token adds 0, even if pol = inf
        dpol *= r, direct *= r;
      }
      const float diff = std::min(std::fabs(lp - s), FLT_MAX);  // nan_to_num: inf -> FLT_MAX
      if (diff == diff) acc[8] += m * diff;
    }
    bool kl_nan = false;
    if (p.ref) {
      const float dr = p.ref[t] - lp;
      float term;  // beta k3 k
      if (p.bias_kl) {
        const float bew = std::exp(dr + log_w + p.log_beta);  // beta exp(dr) w
        const bool fin = w != INFINITY;  // w = inf: inf (k3 > 0) or 0 (dr = 0); a NaN w: NaN, as the reference
        term = fin ? bew - p.beta * (dr + 1.f) * w : times_w(dr * dr, w);
        if constexpr (kSeq) {
          const float be = std::exp(dr + p.log_beta);
          direct += fin ? p.beta * w - bew : times_w(p.beta - be, w);
          dpol += be - p.beta * (dr + 1.f);
        } else {  // the whole d(beta k3 w)/dlogp, -beta dr w (without exp(dr) cancelling), joins dl/dw before the
                  // one product with w: for w = inf, -A and -beta dr of opposite signs give their sum's sign, not NaN
          dpol -= p.beta * dr;
        }
      } else {
        const float be = std::exp(dr + p.log_beta);
        term = be - p.beta * (dr + 1.f);
        direct += p.beta - be;
      }
      pol += term;
      kl_nan = term != term;
      acc[7] += m * (term / p.beta);
    }
    float c;
    if constexpr (kSeq) {
      c = m * direct;
      acc[2] += m * dpol;
    } else {
      c = m * (times_w(dpol, w) + direct);
    }
    // a NaN loss term has a NaN gradient (vespo: -phi A, unless its KL term is NaN)
    coef[t] = pol != pol && (kLoss != 3 || kl_nan) ? pol : c;
    acc[0] += m * pol;
    acc[1] += m;
    if constexpr (kLoss == 3) acc[3] += m * phi;
    if (low) acc[3] += m;
    if (high) acc[4] += m;
    if (low || high) acc[5] += m;
    acc[6] += m * w;
  }
  std::copy(acc, acc + kKernelStats, out);
}

// ---- AVX-512 path --------------------------------------------------------------------------------------
#ifdef GRPO_HAVE_AVX512
using namespace grpo::simd;

// exp16 on [-120, 89]: exp is 0 below, inf above (as expf); NaN stays NaN (max/min return their 2nd operand).
GRPO_AVX512 inline __m512 exp_clamped(__m512 x) {
  return exp16(_mm512_min_ps(_mm512_set1_ps(89.f), _mm512_max_ps(_mm512_set1_ps(-120.f), x)));
}

GRPO_AVX512 inline __m512 times_w(__m512 x, __m512 w) {  // x w, 0 where x == 0 (even for w = inf)
  return _mm512_maskz_mul_ps(_mm512_cmp_ps_mask(x, _mm512_setzero_ps(), _CMP_NEQ_UQ), x, w);
}

GRPO_AVX512 inline double lane_sum(const __m512d* a) {  // lanes 0..15 of a[0], a[1], in order
  alignas(64) double v[16];
  _mm512_store_pd(v, a[0]), _mm512_store_pd(v + 8, a[1]);
  double s = 0;
  for (double x : v) s += x;
  return s;
}

template <typename T>
GRPO_AVX512 void seq_sums_avx512(const T* x, const Params& p, int64_t t0, int64_t t1, double out[kSeqSums]) {
  const __m512 zero = _mm512_setzero_ps(), one = _mm512_set1_ps(1.f), big = _mm512_set1_ps(FLT_MAX);
  const __m512 floor = _mm512_set1_ps(kLog1e8), twenty = _mm512_set1_ps(20.f), cap = _mm512_set1_ps(p.cap);
  const __m512 log_cap = _mm512_set1_ps(p.log_cap);
  __m512d acc[kSeqSums][2];
  for (auto& a : acc) a[0] = a[1] = _mm512_setzero_pd();
  for (int64_t j = t0; j < t1; j += 16) {
    const __mmask16 k = tail_mask(t1 - j);
    const __m512 m = p.mask ? _mm512_maskz_loadu_ps(k, p.mask + j) : _mm512_maskz_mov_ps(k, one);
    const __mmask16 on = _mm512_cmp_ps_mask(m, zero, _CMP_NEQ_UQ);
    const __m512 lp = Io<T>::load(x + j, k, zero), old = p.old ? _mm512_maskz_loadu_ps(k, p.old + j) : lp;
    add_wide(acc[0], _mm512_maskz_mul_ps(on, _mm512_sub_ps(lp, old), m));
    add_wide(acc[1], m);
    if (p.sampler) {
      const __m512 d = _mm512_mul_ps(_mm512_sub_ps(old, _mm512_maskz_loadu_ps(k, p.sampler + j)), m);
      const __mmask16 ok = _mm512_mask_cmp_ps_mask(on, d, d, _CMP_ORD_Q);  // NaN -> 0, +-inf -> +-FLT_MAX
      const __m512 dc = _mm512_maskz_min_ps(ok, big, _mm512_max_ps(_mm512_sub_ps(zero, big), d));
      add_wide(acc[2], dc);
      if (p.vespo) {  // every position of the sequence (masked ones: d = 0); see vespo_log_r
        __m512 lr;
        if (p.sampler_truncate)
          lr = _mm512_min_ps(dc, log_cap);
        else
          lr = _mm512_mask_mov_ps(dc, _mm512_cmp_ps_mask(exp_clamped(dc), cap, _CMP_GT_OQ), floor);
        add_wide(acc[4], _mm512_maskz_mov_ps(k, _mm512_min_ps(twenty, _mm512_max_ps(floor, lr))));
      }
    }
    if (p.vespo) {  // m clamp(logp - old, -20, 20), NaN kept (the possibly-NaN operand 2nd)
      const __m512 c = _mm512_min_ps(twenty, _mm512_max_ps(_mm512_sub_ps(zero, twenty), _mm512_sub_ps(lp, old)));
      add_wide(acc[3], _mm512_maskz_mul_ps(on, c, m));
    }
  }
  for (int i = 0; i < kSeqSums; ++i) out[i] = lane_sum(acc[i]);
}

template <typename T, int kLoss, bool kSeq>
GRPO_AVX512 void seq_avx512(const T* x, const Params& p, const Seq& q, int64_t t0, int64_t t1, float* coef,
                            double out[9]) {
  const __m512 zero = _mm512_setzero_ps(), one = _mm512_set1_ps(1.f), half = _mm512_set1_ps(0.5f);
  const __m512 big = _mm512_set1_ps(FLT_MAX), lo = _mm512_set1_ps(p.lo), hi = _mm512_set1_ps(p.hi);
  const __m512 delta = _mm512_set1_ps(p.delta), eps_high = _mm512_set1_ps(p.eps_high), beta = _mm512_set1_ps(p.beta);
  const __m512 cap = _mm512_set1_ps(p.cap), tau_pos = _mm512_set1_ps(p.tau_pos), tau_neg = _mm512_set1_ps(p.tau_neg);
  const __m512 adv_s = _mm512_set1_ps(q.adv), w_s = _mm512_set1_ps(q.w), is_s = _mm512_set1_ps(q.is);
  const __m512 lw_s = _mm512_set1_ps(q.log_w), log_beta = _mm512_set1_ps(p.log_beta);
  const __m512 phi_pos = _mm512_set1_ps(q.phi_pos), phi_neg = _mm512_set1_ps(q.phi_neg);
  const __m512 inf = _mm512_set1_ps(INFINITY);
  const __m512 neg0 = _mm512_set1_ps(-0.f);
  __m512d wide[kKernelStats][2];
  for (auto& a : wide) a[0] = a[1] = _mm512_setzero_pd();
  // The value columns (loss, dl/dw, ratio, KL, sampler diff) take each term times 1/8 into their fp32 block
  // partials, times 8 again in fp64: 8 terms of up to FLT_MAX per lane cannot overflow (a power of two: exact).
  const __m512 eighth = _mm512_set1_ps(0.125f);
  for (int64_t b = t0; b < t1; b += 128) {  // blocks of 8 vectors: fp32 partial sums, then widened
    __m512 acc[kKernelStats];
    for (auto& a : acc) a = zero;
    for (int64_t j = b; j < std::min(t1, b + 128); j += 16) {
      const __mmask16 k = tail_mask(t1 - j);
      const __m512 m = p.mask ? _mm512_maskz_loadu_ps(k, p.mask + j) : _mm512_maskz_mov_ps(k, one);
      const __mmask16 on = _mm512_cmp_ps_mask(m, zero, _CMP_NEQ_UQ);
      const __m512 m8 = _mm512_mul_ps(m, eighth);  // the weight of a value column's term (see above)
      const __m512 lp = Io<T>::load(x + j, k, zero), old = p.old ? _mm512_maskz_loadu_ps(k, p.old + j) : lp;
      const __m512 adv = p.adv_per_token ? _mm512_maskz_loadu_ps(k, p.adv + j) : adv_s;
      const __m512 nadv = _mm512_xor_ps(adv, neg0);
      const __mmask16 pos = _mm512_cmp_ps_mask(adv, zero, _CMP_GT_OQ), neg = _mm512_cmp_ps_mask(adv, zero, _CMP_LT_OQ);
      const __m512 lw = kSeq ? lw_s : _mm512_sub_ps(lp, old), w = kSeq ? w_s : exp_clamped(lw);
      __m512 pol, dpol = zero, direct = zero, phi = zero;
      __mmask16 low = 0, high = 0;
      // min_ps / max_ps return their 2nd operand when either is NaN: the operand that may be NaN goes 2nd, so
      // NaN propagates as in torch. a1 and a2 may each be NaN alone (A = inf and w = 0: a1 = inf 0, a2 = inf):
      // their min takes a NaN a1 back.
      if constexpr (kLoss == 0) {
        const __m512 wm = _mm512_min_ps(delta, w), clipped = _mm512_min_ps(hi, _mm512_max_ps(lo, w));
        const __m512 a1 = times_w(adv, wm), a2 = _mm512_mul_ps(clipped, adv);
        const __m512 lesser = _mm512_mask_mov_ps(_mm512_min_ps(a1, a2), _mm512_cmp_ps_mask(a1, a1, _CMP_UNORD_Q), a1);
        pol = _mm512_xor_ps(lesser, neg0);
        const __m512 g1 = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(w, delta, _CMP_LE_OQ), nadv);
        const __mmask16 in = _mm512_mask_cmp_ps_mask(_mm512_cmp_ps_mask(w, lo, _CMP_GE_OQ), w, hi, _CMP_LE_OQ);
        const __m512 g2 = _mm512_maskz_mov_ps(in, nadv);
        dpol = _mm512_mul_ps(half, _mm512_add_ps(g1, g2));  // a tie (or NaN): the mean, as torch.min
        dpol = _mm512_mask_mov_ps(dpol, _mm512_cmp_ps_mask(a1, a2, _CMP_LT_OQ), g1);
        dpol = _mm512_mask_mov_ps(dpol, _mm512_cmp_ps_mask(a1, a2, _CMP_GT_OQ), g2);
        low = _mm512_mask_cmp_ps_mask(neg, wm, lo, _CMP_LT_OQ);
        high = _mm512_mask_cmp_ps_mask(pos, wm, hi, _CMP_GT_OQ);
      } else if constexpr (kLoss == 1) {
        const __m512 cw = _mm512_min_ps(eps_high, w);
        direct = _mm512_mul_ps(cw, nadv);
        pol = _mm512_mul_ps(direct, lp);
        low = _mm512_mask_cmp_ps_mask(pos, w, eps_high, _CMP_GT_OQ);
      } else if constexpr (kLoss == 2) {
        const __m512 tau = _mm512_mask_blend_ps(pos, tau_neg, tau_pos);
        const __m512 z = _mm512_mul_ps(tau, _mm512_sub_ps(w, one));
        // sigmoid(z) and sigmoid(-z) from one exp(-|z|) (see seq_portable)
        const __m512 e = exp_clamped(_mm512_or_ps(_mm512_abs_ps(z), neg0)), inv = _mm512_div_ps(one, _mm512_add_ps(one, e));
        const __mmask16 ge = _mm512_cmp_ps_mask(z, zero, _CMP_GE_OQ);
        const __m512 sg = _mm512_mask_blend_ps(ge, _mm512_mul_ps(e, inv), inv);
        const __m512 sg_c = _mm512_mask_blend_ps(ge, inv, _mm512_mul_ps(e, inv));
        pol = _mm512_mul_ps(_mm512_div_ps(_mm512_mul_ps(sg, _mm512_set1_ps(-4.f)), tau), adv);
        dpol = _mm512_mul_ps(_mm512_mul_ps(_mm512_mul_ps(_mm512_set1_ps(-4.f), adv), sg), sg_c);
        low = _mm512_mask_cmp_ps_mask(neg, w, lo, _CMP_LT_OQ);
        high = _mm512_mask_cmp_ps_mask(pos, w, hi, _CMP_GT_OQ);
      } else {  // vespo: -phi A logp; a NaN advantage takes the A < 0 weight (GE_OQ is false for NaN)
        phi = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(adv, zero, _CMP_GE_OQ), phi_neg, phi_pos);
        direct = _mm512_mul_ps(phi, nadv);
        pol = _mm512_mul_ps(direct, lp);
      }
      if (p.sampler) {
        const __m512 s = _mm512_maskz_loadu_ps(k, p.sampler + j);
        if constexpr (kLoss != 3) {  // vespo's sampler weights are in phi
          __m512 r = is_s;
          if (!p.sampler_per_seq) {
            const __m512 d = _mm512_mul_ps(_mm512_sub_ps(old, s), m);
            const __mmask16 ok = _mm512_cmp_ps_mask(d, d, _CMP_ORD_Q);  // nan_to_num
            r = exp_clamped(_mm512_maskz_min_ps(ok, big, _mm512_max_ps(_mm512_sub_ps(zero, big), d)));
            r = p.sampler_truncate ? _mm512_min_ps(r, cap)
                                   : _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(r, cap, _CMP_LE_OQ), r);
          }
          const __mmask16 zeroed =  // r == 0 zeroes the term, even pol = inf (NaN stays NaN)
              _mm512_mask_cmp_ps_mask(_mm512_cmp_ps_mask(r, zero, _CMP_EQ_OQ), pol, pol, _CMP_ORD_Q);
          pol = _mm512_mask_mov_ps(_mm512_mul_ps(pol, r), zeroed, zero);
          dpol = _mm512_mul_ps(dpol, r), direct = _mm512_mul_ps(direct, r);
        }
        const __m512 raw = _mm512_abs_ps(_mm512_sub_ps(lp, s));
        const __mmask16 ok = _mm512_mask_cmp_ps_mask(on, raw, raw, _CMP_ORD_Q);  // NaN terms skipped
        const __m512 diff = _mm512_min_ps(raw, big);                              // inf -> FLT_MAX
        acc[8] = _mm512_mask_add_ps(acc[8], ok, acc[8], _mm512_mul_ps(m8, diff));
      }
      __mmask16 kl_nan = 0;
      if (p.ref) {
        const __m512 dr = _mm512_sub_ps(_mm512_maskz_loadu_ps(k, p.ref + j), lp);
        const __m512 bdr1 = _mm512_mul_ps(beta, _mm512_add_ps(dr, one));  // beta (dr + 1)
        __m512 term;                                                      // beta k3 k (see seq_portable)
        if (p.bias_kl) {
          const __m512 bew = exp_clamped(_mm512_add_ps(_mm512_add_ps(dr, lw), log_beta));
          const __mmask16 fin = _mm512_cmp_ps_mask(w, inf, _CMP_NEQ_UQ);  // (NaN: the finite branch, NaN)
          term = _mm512_mask_blend_ps(fin, times_w(_mm512_mul_ps(dr, dr), w), _mm512_fnmadd_ps(bdr1, w, bew));
          if constexpr (kSeq) {
            const __m512 be = exp_clamped(_mm512_add_ps(dr, log_beta));
            direct = _mm512_add_ps(direct, _mm512_mask_blend_ps(fin, times_w(_mm512_sub_ps(beta, be), w),
                                                                _mm512_sub_ps(_mm512_mul_ps(beta, w), bew)));
            dpol = _mm512_add_ps(dpol, _mm512_sub_ps(be, bdr1));
          } else {  // -beta dr joins dl/dw (see seq_portable)
            dpol = _mm512_sub_ps(dpol, _mm512_mul_ps(beta, dr));
          }
        } else {
          const __m512 be = exp_clamped(_mm512_add_ps(dr, log_beta));
          term = _mm512_sub_ps(be, bdr1);
          direct = _mm512_add_ps(direct, _mm512_sub_ps(beta, be));
        }
        pol = _mm512_add_ps(pol, term);
        kl_nan = _mm512_cmp_ps_mask(term, term, _CMP_UNORD_Q);
        acc[7] = _mm512_mask_add_ps(acc[7], on, acc[7], _mm512_mul_ps(m8, _mm512_div_ps(term, beta)));
      }
      __m512 c;
      if constexpr (kSeq) {
        c = _mm512_maskz_mul_ps(on, m, direct);
        acc[2] = _mm512_mask_add_ps(acc[2], on, acc[2], _mm512_mul_ps(m8, dpol));
      } else {
        c = _mm512_maskz_mul_ps(on, m, _mm512_add_ps(times_w(dpol, w), direct));
      }
      // NaN term: NaN grad (vespo: -phi A, unless its KL term is NaN)
      c = _mm512_mask_mov_ps(c, _mm512_mask_cmp_ps_mask(kLoss != 3 ? on : on & kl_nan, pol, pol, _CMP_UNORD_Q), pol);
      _mm512_mask_storeu_ps(coef + j, k, c);
      acc[0] = _mm512_mask_add_ps(acc[0], on, acc[0], _mm512_mul_ps(m8, pol));
      acc[1] = _mm512_add_ps(acc[1], m);
      if constexpr (kLoss == 3) acc[3] = _mm512_mask_add_ps(acc[3], on, acc[3], _mm512_mul_ps(m, phi));
      acc[3] = _mm512_mask_add_ps(acc[3], on & low, acc[3], m);
      acc[4] = _mm512_mask_add_ps(acc[4], on & high, acc[4], m);
      acc[5] = _mm512_mask_add_ps(acc[5], on & (low | high), acc[5], m);
      acc[6] = _mm512_mask_add_ps(acc[6], on, acc[6], _mm512_mul_ps(m8, w));
    }
    for (int i = 0; i < kKernelStats; ++i) add_wide(wide[i], acc[i]);
  }
  for (int i = 0; i < kKernelStats; ++i) out[i] = lane_sum(wide[i]) * (kValueColumn[i] ? 8.0 : 1.0);
}
#endif  // GRPO_HAVE_AVX512

}  // namespace grpo::loss

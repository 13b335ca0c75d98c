// AVX-512 helpers shared by the CPU kernels (logprobs.cpp, loss.cpp): a vector exp, tail masks, fp32/bf16/fp16
// loads and stores widened to / narrowed from fp32 registers, fp64 widening accumulation.
//
// Every function carries __attribute__((target)) (GRPO_AVX512), so no global -m flags: a source file keeps its
// portable path for other CPUs and picks these at run time when cpu_has_avx512() (and its own toggle) allow.
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cstdint>

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#define GRPO_HAVE_AVX512 1
#define GRPO_AVX512 __attribute__((target("avx512f,avx512vl,avx512bw,avx512dq")))
#endif

namespace grpo::simd {

// True when this CPU runs the GRPO_AVX512 functions (checked once).
inline bool cpu_has_avx512() {
#ifdef GRPO_HAVE_AVX512
  static const bool ok = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512vl") &&
                         __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512dq");
  return ok;
#else
  return false;
#endif
}

#ifdef GRPO_HAVE_AVX512
// exp of 16 fp32 lanes: x = n ln2 + r (two-constant Cody-Waite, |r| <= ln2/2), degree-6 polynomial (fitted for
// relative error, ~1 ulp), 2^n by _mm512_scalef_ps (exact underflow to 0 / denormals, overflow to inf).
// NaN stays NaN; callers keep x finite and not huge (+-inf, or |x| > ~1e37, give NaN).
GRPO_AVX512 inline __m512 exp16(__m512 x) {
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.442695041f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(6.931471825e-01f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-1.904654212e-09f), r);
  __m512 p = _mm512_set1_ps(1.381459995e-03f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.368710056e-03f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.166838899e-02f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.666652113e-01f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.999999404e-01f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
  return _mm512_scalef_ps(p, n);
}

inline __mmask16 tail_mask(int64_t n) { return n >= 16 ? 0xFFFF : n <= 0 ? 0 : static_cast<__mmask16>((1u << n) - 1); }

// 16 values of T <-> fp32 registers. load(p, k, fill): lanes outside k read as fill and are never touched.
template <typename T>
struct Io;
template <>
struct Io<float> {
  GRPO_AVX512 static __m512 load(const float* p) { return _mm512_loadu_ps(p); }
  GRPO_AVX512 static __m512 load(const float* p, __mmask16 k, __m512 fill) { return _mm512_mask_loadu_ps(fill, k, p); }
  GRPO_AVX512 static void store(float* p, __m512 v, __mmask16 k) { _mm512_mask_storeu_ps(p, k, v); }
};
template <>
struct Io<c10::BFloat16> {
  GRPO_AVX512 static __m512 widen(__m256i h) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  }
  GRPO_AVX512 static __m512 load(const c10::BFloat16* p) { return widen(_mm256_loadu_si256((const __m256i*)p)); }
  GRPO_AVX512 static __m512 load(const c10::BFloat16* p, __mmask16 k, __m512 fill) {
    return _mm512_mask_blend_ps(k, fill, widen(_mm256_maskz_loadu_epi16(k, p)));
  }
  GRPO_AVX512 static void store(c10::BFloat16* p, __m512 v, __mmask16 k) {  // round to nearest even
    const __m512i x = _mm512_castps_si512(v), one = _mm512_set1_epi32(1);
    __m512i r = _mm512_add_epi32(x, _mm512_add_epi32(_mm512_set1_epi32(0x7FFF),
                                                     _mm512_and_si512(_mm512_srli_epi32(x, 16), one)));
    r = _mm512_mask_mov_epi32(_mm512_srli_epi32(r, 16), _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q),
                              _mm512_set1_epi32(0x7FC0));
    _mm256_mask_storeu_epi16(p, k, _mm512_cvtepi32_epi16(r));
  }
};
template <>
struct Io<c10::Half> {
  GRPO_AVX512 static __m512 load(const c10::Half* p) { return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)p)); }
  GRPO_AVX512 static __m512 load(const c10::Half* p, __mmask16 k, __m512 fill) {
    return _mm512_mask_blend_ps(k, fill, _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(k, p)));
  }
  GRPO_AVX512 static void store(c10::Half* p, __m512 v, __mmask16 k) {
    _mm256_mask_storeu_epi16(p, k, _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  }
};

// acc[0] += lanes 0-7 of v, acc[1] += lanes 8-15, widened to fp64.
GRPO_AVX512 inline void add_wide(__m512d* acc, __m512 v) {
  acc[0] = _mm512_add_pd(acc[0], _mm512_cvtps_pd(_mm512_castps512_ps256(v)));
  acc[1] = _mm512_add_pd(acc[1], _mm512_cvtps_pd(_mm512_extractf32x8_ps(v, 1)));
}
#endif  // GRPO_HAVE_AVX512

}  // namespace grpo::simd

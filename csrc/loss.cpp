// grpo_loss_fwd / grpo_loss_bwd on the CPU. Spec: the Triton kernels of grpo_kernels/ops/loss.py (module
// docstring, _grpo_seq_stats_kernel, _grpo_loss_fwd_kernel, _grpo_loss_bwd_kernel, grpo_loss_fwd_triton).
//
//   Per token t of sequence s, mask m (1 without one), A = adv_s or adv_t, old = logp without old_logps:
//   w = exp(logp - old)  (GSPO: w_s = exp(log_w_s), log_w_s = sum m (logp - old) / max(sum m, 1))
//   family 0 (grpo/bnpo/dr_grpo/dapo): l = -min(min(w, delta) A, clip(w, 1 - eps_low, 1 + eps_high) A),
//       dl/dw = -A [w <= delta] or -A [1 - eps_low <= w <= 1 + eps_high] for the smaller term, their mean on a tie
//   family 1 (cispo): l = -min(w, eps_high) A logp,  dl/dlogp (direct) = -min(w, eps_high) A
//   family 2 (sapo):  l = -(4 / tau) sigmoid(tau (w - 1)) A, tau = tau_pos if A > 0 else tau_neg
//   family 3 (vespo): l = -phi A logp, direct = -phi A, phi = phi_s(A >= 0) or phi_s(A < 0), the sequence's
//       detached gamma weights exp(lam + k log v - lam v) (NaN / inf -> 0), log v = clamp(S, log 1e-8, 20),
//       S = sum m clamp(logp - old, -20, 20) + sum over the sequence's positions of clamp(log r, log 1e-8, 20)
//       (token sampler weight r; log r = min(d, log cap) or d / -inf above the cap); no sampler factor on l
//   sampler (families 0-2): l, dl/dw, direct *= r; r = f(nan_to_num(m (old - sampler))) per token, or f(sum of it over the
//       sequence) (modes >= 2); f(d) = min(exp d, cap) (truncate: modes 0, 2) or exp d [exp d <= cap] (mask)
//   KL: k3 = exp(ref - logp) - (ref - logp) - 1, l += beta k3 k, k = w with bias_kl, else 1;
//       direct += beta (1 - exp(ref - logp)) (no bias_kl), -beta (ref - logp) w (bias_kl, token level: the whole
//       derivative), beta (1 - exp(ref - logp)) w (bias_kl, GSPO, then also dl/dw += beta k3)
//   coef_t = m (dl/dw w + direct) (token level) or m direct (GSPO: the w_s part goes through b_s)
//   stats_s (fp64) = [sum m l, sum m, sum m dl/dw (GSPO), sum m [low], sum m [high], sum m [low or high], sum m w,
//              sum m k3 k, sum m |logp - sampler| (NaN terms skipped), log_w_s (0 at token level), phi_s of
//              adv_s (vespo with per-sequence advantages, else 0)]; vespo: sum m phi in the low column, no flags
//   low/high: family 0: min(w, delta) < 1 - eps_low, A < 0 / > 1 + eps_high, A > 0; cispo: low = w > eps_high,
//   A > 0, high never; sapo: as family 0 with w. Tokens with m == 0 write coef 0 and add exactly nothing
//   (their inputs may be NaN/inf garbage). vespo's coef is -phi A (+ the KL part) even where l is NaN: TRL's
//   phi is 0 for a NaN sequence ratio, and its gradient -phi A.
//   Non-finite values (as grpo_kernels.grpo_loss documents): a NaN in logp, old, A or (KL on) ref of a token with
//   m != 0 makes its l and coef NaN (min / clamp propagate NaN, as torch's do). A ratio beyond fp32 (w = inf
//   for log w > 88.72) times an exact zero (a clipped branch, A = 0, a zero dl/dw or sampler weight) is 0, as in
//   exact arithmetic, not NaN (times_w): a clipped token's gradient is 0. beta exp(ref - logp) (times w with
//   bias_kl) is one exp, exp(ref - logp + log w + log beta), finite wherever the product is.
//   grpo_loss_bwd: grad_t = a_s coef_t (+ b_s m_t with GSPO; 0 for m_t = 0, even for b_s = NaN).
//
// Design
//   * Parallel over sequences (at::parallel_for, grain ~16k tokens). Each sequence is handled whole by one
//     thread, its sums taken in a fixed order, so the result does not depend on the thread count (but a
//     batch of one long packed sequence runs on one thread). Phase 1 (GSPO, a sequence-level sampler mode, or
//     vespo) sums m (logp - old), m, nan_to_num(m (old - sampler)) and vespo's two sums; phase 2 is the token
//     loop writing coef and the nine sums. The per-sequence scalars (w_s, the sampler weight, log_w, phi) are
//     computed in fp64 from
//     the fp64 sums; log_w is rounded to fp32 first (it is stored, and the backward uses exp of the stored
//     value), w_s = exp of that.
//   * Per token in fp32 (logps widened from bf16/fp16), as the Triton kernels; sums in fp64.
//   * AVX-512 path (chosen at run time, cpu_has_avx512() and set_loss_simd; functions carry
//     __attribute__((target)), no global -m flags; helpers in simd_avx512.h): 16 tokens per vector, masked
//     loads / stores for the tail of a sequence (no reads past its end), branch-free selects for min / clamp
//     gradients / ties. exp16 arguments are clamped to [-120, 89] (exp16 needs finite input; exp is 0 or inf
//     there, like expf). Phase-2 sums: fp32 per lane over blocks of 8 vectors (<= 8 terms), then widened and
//     added into fp64 lanes, combined in lane order at the end (the value columns' terms weighted by 1/8 in
//     fp32 and by 8 in fp64, so no fp32 partial overflows where the fp64 sum does not). Phase 1 widens every
//     vector to fp64 at once (clamped sampler differences of +-FLT_MAX must not overflow an fp32 partial).
//   * Portable path (other CPUs, or set_loss_simd(False)): the same maths, scalar std::exp, fp64 sums.
//     (GCC does not vectorize it: the expf calls.) Padded B=64, L=2048 fp32 dapo with old_logps and a mask,
//     2 threads (Zen 4): forward 0.09 ms (0.11 with the KL term) with AVX-512, 0.56 (0.95) portable;
//     backward 0.013 ms.
//   * Templates on the logps dtype, the loss family and the level; the other options (old / mask / KL /
//     sampler present, per-token advantages, bias_kl, sampler mode) are loop-invariant runtime branches.

#include "grpo_ops.h"
#include "loss_kernels.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cfloat>
#include <cmath>
#include <optional>
#include <string>
#include <tuple>
#include <type_traits>

namespace grpo::loss {

// ---- ops -----------------------------------------------------------------------------------------------
// f(T{}, integral_constant<kLoss>, bool_constant<kSeq>) for the logps dtype, loss family and level.
template <typename F>
void dispatch(const at::Tensor& logps, int64_t family, bool seq_level, F&& f) {
  auto level = [&](auto tag, auto loss) {
    if (seq_level) return f(tag, loss, std::true_type{});
    return f(tag, loss, std::false_type{});
  };
  auto fam = [&](auto tag) {
    switch (family) {
      case 0: return level(tag, std::integral_constant<int, 0>{});
      case 1: return level(tag, std::integral_constant<int, 1>{});
      case 2: return level(tag, std::integral_constant<int, 2>{});
      default: return level(tag, std::integral_constant<int, 3>{});
    }
  };
  switch (logps.scalar_type()) {
    case at::kFloat: return fam(float{});
    case at::kBFloat16: return fam(c10::BFloat16{});
    case at::kHalf: return fam(c10::Half{});
    default: TORCH_CHECK(false, "grpo_loss_fwd: logps must be float32, bfloat16 or float16, got ", logps.scalar_type());
  }
}

// cu_seqlens: int64 [B + 1] on the CPU, rising from 0 to T. Returns B.
int64_t check_cu(const char* op, const at::Tensor& cu, int64_t T) {
  TORCH_CHECK(cu.device().is_cpu() && cu.scalar_type() == at::kLong && cu.dim() == 1 && cu.size(0) >= 1 &&
                  cu.is_contiguous(),
              op, ": cu_seqlens must be a contiguous int64 CPU tensor [B + 1]");
  const int64_t B = cu.size(0) - 1, *c = cu.data_ptr<int64_t>();
  bool ok = c[0] == 0 && c[B] == T;
  for (int64_t s = 0; s < B && ok; ++s) ok = c[s] <= c[s + 1];
  TORCH_CHECK(ok, op, ": cu_seqlens must rise monotonically from 0 to T=", T);
  return B;
}

// A float32 contiguous 1-D CPU tensor of one of the sizes n1, n2 (or absent); its data or nullptr.
const float* vec_f32(const char* op, const char* name, const std::optional<at::Tensor>& x, int64_t n1, int64_t n2) {
  if (!x.has_value() || !x->defined()) return nullptr;
  TORCH_CHECK(x->device().is_cpu() && x->scalar_type() == at::kFloat && x->dim() == 1 && x->is_contiguous(), op, ": ",
              name, " must be a contiguous float32 1-D CPU tensor, got ", x->scalar_type(), " ", x->sizes());
  TORCH_CHECK(x->size(0) == n1 || x->size(0) == n2, op, ": ", name, " has ", x->size(0), " elements, expected ", n1,
              n1 == n2 ? "" : " or ", n1 == n2 ? "" : std::to_string(n2));
  return x->data_ptr<float>();
}

// parallel_for grain in sequences: ~`tokens` tokens per task at the mean sequence length.
int64_t grain(int64_t B, int64_t T, int64_t tokens) {
  return std::max<int64_t>(1, tokens / std::max<int64_t>(1, T / std::max<int64_t>(B, 1)));
}

std::tuple<at::Tensor, at::Tensor> grpo_loss_fwd(
    const at::Tensor& logps, const std::optional<at::Tensor>& old_logps, const std::optional<at::Tensor>& ref_logps,
    const std::optional<at::Tensor>& sampler_logps, const at::Tensor& advantages, bool adv_per_token,
    const std::optional<at::Tensor>& mask, const at::Tensor& cu_seqlens, int64_t loss_family, bool seq_level, int64_t sampler_mode, double eps_low,
    double eps_high, double delta, double beta, bool bias_kl, double sampler_cap, double tau_pos, double tau_neg,
    double vespo_k_pos, double vespo_lambda_pos, double vespo_k_neg, double vespo_lambda_neg) {
  constexpr const char* op = "grpo_loss_fwd";
  TORCH_CHECK(logps.device().is_cpu() && logps.dim() == 1 && logps.is_contiguous(), op,
              ": logps must be a contiguous 1-D CPU tensor [T], got ", logps.sizes());
  TORCH_CHECK(loss_family >= 0 && loss_family <= 3, op, ": loss_family must be in 0..3, got ", loss_family);
  TORCH_CHECK(sampler_mode >= 0 && sampler_mode <= 3, op, ": sampler_mode must be in 0..3, got ", sampler_mode);
  const int64_t T = logps.size(0), B = check_cu(op, cu_seqlens, T);
  Params p{};
  p.old = vec_f32(op, "old_logps", old_logps, T, T);
  p.ref = vec_f32(op, "ref_logps", ref_logps, T, T);
  p.sampler = vec_f32(op, "sampler_logps", sampler_logps, T, T);
  p.mask = vec_f32(op, "mask", mask, T, T);
  p.adv_per_token = adv_per_token;
  p.adv = vec_f32(op, "advantages", advantages, adv_per_token ? T : B, adv_per_token ? T : B);
  p.bias_kl = bias_kl;
  p.sampler_truncate = sampler_mode == 0 || sampler_mode == 2;
  p.sampler_per_seq = p.sampler && sampler_mode >= 2;
  // 1 - eps_low and 1 + eps_high in fp32 from the fp32 epsilons, as the kernel computes them
  p.lo = 1.f - static_cast<float>(eps_low), p.hi = 1.f + static_cast<float>(eps_high);
  p.delta = static_cast<float>(delta), p.eps_high = static_cast<float>(eps_high), p.beta = static_cast<float>(beta);
  p.log_beta = std::log(p.beta);  // -inf for beta = 0: the KL term is then 0 (ref_logps goes with beta > 0)
  p.cap = static_cast<float>(sampler_cap), p.log_cap = std::log(p.cap);
  p.vespo = loss_family == 3;
  p.tau_pos = static_cast<float>(tau_pos), p.tau_neg = static_cast<float>(tau_neg);
  const bool pre = seq_level || p.sampler_per_seq || p.vespo, vec = simd();
  const auto f32 = logps.options().dtype(at::kFloat);
  // stats in fp64: a sequence's sum of finite fp32 terms may pass FLT_MAX while its mean does not
  at::Tensor stats = at::empty({B, kStats}, f32.dtype(at::kDouble)), coef = at::empty({T}, f32);
  double* st = stats.data_ptr<double>();
  float* cf = coef.data_ptr<float>();
  const int64_t* cu = cu_seqlens.data_ptr<int64_t>();
  dispatch(logps, loss_family, seq_level, [&](auto tag, auto loss, auto level) {
    using T_ = decltype(tag);
    constexpr int kLoss = decltype(loss)::value;
    constexpr bool kSeq = decltype(level)::value;
    const T_* x = logps.data_ptr<T_>();
    at::parallel_for(0, B, grain(B, T, 16384), [&](int64_t s0, int64_t s1) {
      for (int64_t s = s0; s < s1; ++s) {
        const int64_t t0 = cu[s], t1 = cu[s + 1];
        Seq q{p.adv_per_token ? 0.f : p.adv[s], 1.f, 1.f, 0.f, 1.f, 1.f};
        float log_w = 0.f;
        if (pre) {
          double sums[kSeqSums];
#ifdef GRPO_HAVE_AVX512
          if (vec)
            seq_sums_avx512<T_>(x, p, t0, t1, sums);
          else
#endif
            seq_sums_portable<T_>(x, p, t0, t1, sums);
          if (kSeq) {
            log_w = static_cast<float>(sums[0] / std::max(sums[1], 1.0));
            q.w = static_cast<float>(std::exp(static_cast<double>(log_w)));
            q.log_w = log_w;
          }
          if (p.sampler_per_seq) q.is = static_cast<float>(sampler_weight(sums[2], sampler_cap, p.sampler_truncate));
          if (p.vespo) {
            q.phi_pos = vespo_phi(sums[3] + sums[4], vespo_k_pos, vespo_lambda_pos);
            q.phi_neg = vespo_phi(sums[3] + sums[4], vespo_k_neg, vespo_lambda_neg);
          }
        }
        double acc[kKernelStats];
#ifdef GRPO_HAVE_AVX512
        if (vec)
          seq_avx512<T_, kLoss, kSeq>(x, p, q, t0, t1, cf, acc);
        else
#endif
          seq_portable<T_, kLoss, kSeq>(x, p, q, t0, t1, cf, acc);
        double* row = st + s * kStats;
        for (int i = 0; i < kKernelStats; ++i) row[i] = acc[i];
        row[kKernelStats] = log_w;
        row[kKernelStats + 1] = p.vespo && !p.adv_per_token ? (q.adv >= 0.f ? q.phi_pos : q.phi_neg) : 0.f;
      }
    });
  });
  (void)vec;
  return {stats, coef};
}

at::Tensor grpo_loss_bwd(const at::Tensor& a, const at::Tensor& b, const at::Tensor& coef,
                         const std::optional<at::Tensor>& mask, const at::Tensor& cu_seqlens, bool seq_level) {
  constexpr const char* op = "grpo_loss_bwd";
  TORCH_CHECK(coef.dim() == 1, op, ": coef must be 1-D [T], got ", coef.sizes());
  const int64_t T = coef.size(0), B = check_cu(op, cu_seqlens, T);
  const float* cf = vec_f32(op, "coef", coef, T, T);
  const float* pa = vec_f32(op, "a", a, B, B);
  const float* pb = vec_f32(op, "b", b, B, B);
  const float* m = vec_f32(op, "mask", mask, T, T);
  at::Tensor grad = at::empty({T}, coef.options());
  float* g = grad.data_ptr<float>();
  const int64_t* cu = cu_seqlens.data_ptr<int64_t>();
  at::parallel_for(0, B, grain(B, T, 65536), [&](int64_t s0, int64_t s1) {
    for (int64_t s = s0; s < s1; ++s) {
      const int64_t t0 = cu[s], t1 = cu[s + 1];
      const float as = pa[s], bs = pb[s];
      if (!seq_level)
        for (int64_t t = t0; t < t1; ++t) g[t] = as * cf[t];
      else if (m)  // a masked token's gradient is 0 even where b_s is NaN (a NaN sequence)
        for (int64_t t = t0; t < t1; ++t) g[t] = as * cf[t] + (m[t] != 0.f ? bs * m[t] : 0.f);
      else
        for (int64_t t = t0; t < t1; ++t) g[t] = as * cf[t] + bs;
    }
  });
  return grad;
}

}  // namespace grpo::loss

namespace grpo {
void set_loss_simd(bool on) { loss::simd_enabled.store(on); }
bool loss_simd() { return loss::simd(); }
}  // namespace grpo

// Muon element and per-matrix math, written once for every backend.
//
// The GEMM-based Polar-Express iterations live with each backend (cuBLAS on
// CUDA, FP32 at::mm on CPU); what is here is the arithmetic around them:
// momentum, the input scaling, the NorMuon normalization and the cautious
// update.  As for AdamW, compile without FMA contraction so that the CPU
// scalar code and the CUDA kernels evaluate identical expressions.
#pragma once

#include <cmath>
#include <cstdint>

#include "bits.h"
#include "macros.h"

namespace muon_ext {

// Polar-Express coefficients (a, b, c), one tuple per iteration.
constexpr int kPolarExpressDefaultSteps = 5;
constexpr double kPolarExpressCoefficients[kPolarExpressDefaultSteps][3] = {
    {8.156554524902461, -22.48329292557795, 15.878769915207462},
    {4.042929935166739, -2.808917465908714, 0.5000178451051316},
    {3.8916678022926607, -2.772484153217685, 0.5060648178503393},
    {3.285753657755655, -2.3681294933425376, 0.46449024233003106},
    {2.3465413258596377, -1.7097828382687081, 0.42323551169305323},
};

// Hyper-parameters of one Muon step on one bucket.
struct MuonHyper {
  float momentum;      // mu
  bool nesterov;
  bool normuon;        // beta2 given
  float beta2;
  float weight_decay;
};

// The rules that the CPU also runs on 16-lane vectors (NorMuon in
// polar_small_kernel.cpp) are templates on the arithmetic type T, written
// once: T supplies + - * / (with float operands too), Ops (MuonMathOps<T>
// unless given: the vector one is per instruction set) sqrt and at_least.
template <typename T>
struct MuonMathOps;

template <>
struct MuonMathOps<float> {
  MUON_HD static float sqrt(float x) { return ::sqrtf(x); }
  // x > floor ? x : floor (floor for NaN).
  MUON_HD static float at_least(float x, float floor) { return x > floor ? x : floor; }
};

// torch.lerp's formula: the small-weight form below 0.5, the other above, so
// that both ends are reproduced exactly.
MUON_HD bool lerp_uses_small_form(float weight) { return ::fabsf(weight) < 0.5f; }

// One of lerp_of's forms, for a loop over elements with one weight that
// picks it once: vectorized, lerp_of computes both forms under masks.
template <bool kSmallForm, typename T>
MUON_HD_ALWAYS_INLINE T lerp_in_form(T start, T end, float weight) {
  if constexpr (kSmallForm) {
    return start + weight * (end - start);
  } else {
    return end - (end - start) * (1.0f - weight);
  }
}

template <typename T>
MUON_HD T lerp_of(T start, T end, float weight) {
  return lerp_uses_small_form(weight) ? lerp_in_form<true>(start, end, weight)
                                      : lerp_in_form<false>(start, end, weight);
}

MUON_HD float lerp(float start, float end, float weight) { return lerp_of(start, end, weight); }

// Momentum EMA (in place) and the Nesterov blend; returns the direction u.
//   mom = lerp(mom, g, 1 - mu);  u = lerp(g, mom, mu) if nesterov else mom
MUON_HD float muon_momentum(float& mom, float grad, float mu, bool nesterov) {
  mom = lerp(mom, grad, 1.0f - mu);
  return nesterov ? lerp(grad, mom, mu) : mom;
}

// muon_momentum with lerp's forms (kMomentumForm: lerp_uses_small_form(1 - mu),
// kNesterovForm: lerp_uses_small_form(mu)) and nesterov fixed: the same
// operations, for loops that decide them once (cpu/muon_elementwise.h).
template <bool kMomentumForm, bool kNesterovForm, bool kNesterov>
MUON_HD_ALWAYS_INLINE float muon_momentum_in_form(float& mom, float grad, float mu) {
  mom = lerp_in_form<kMomentumForm>(mom, grad, 1.0f - mu);
  if constexpr (kNesterov) {
    return lerp_in_form<kNesterovForm>(grad, mom, mu);
  } else {
    return mom;
  }
}

// X = u / (||u||_F * 1.02 + 1e-6): the factor, from the sum of squares of u.
template <typename T, typename Ops = MuonMathOps<T>>
MUON_HD T polar_input_scale_of(T sum_of_squares) {
  return 1.0f / (Ops::sqrt(sum_of_squares) * 1.02f + 1e-6f);
}

MUON_HD float polar_input_scale(float sum_of_squares) { return polar_input_scale_of(sum_of_squares); }

// NorMuon's per-row (rows >= cols) or per-column statistics of one matrix.
// `reduced` is the length of the reduced dimension (cols or rows).
MUON_HD float normuon_mean_square(float sum_of_squares, int64_t reduced) {
  return sum_of_squares / float(reduced);
}

// s_i = rsqrt(max(smb_i, 1e-10)), as 1 / sqrt for identical rounding everywhere.
template <typename T, typename Ops = MuonMathOps<T>>
MUON_HD T normuon_step_size_of(T second_moment) {
  return 1.0f / Ops::sqrt(Ops::at_least(second_moment, 1e-10f));
}

MUON_HD float normuon_step_size(float second_moment) { return normuon_step_size_of(second_moment); }

// The norm-preserving factor n0 / max(n1, 1e-10), from
//   n0^2 = sum(vm) * red   and   n1^2 = sum(vm * red * s^2).
template <typename T, typename Ops = MuonMathOps<T>>
MUON_HD T normuon_norm_ratio_of(T sum_vm, T sum_scaled, int64_t reduced) {
  const T n0 = Ops::sqrt(sum_vm * float(reduced));
  const T n1 = Ops::sqrt(sum_scaled);
  return n0 / Ops::at_least(n1, 1e-10f);
}

MUON_HD float normuon_norm_ratio(float sum_vm, float sum_scaled, int64_t reduced) {
  return normuon_norm_ratio_of(sum_vm, sum_scaled, reduced);
}

// Cautious weight decay and the update on one FP32 master element:
//   p -= lr * x + lr * wd * p * (x * p >= 0)
MUON_HD float muon_apply(float p, float x, float lr, float lr_wd) {
  // (x * p >= 0) ? lr_wd * p : +0, as a bit mask: the condition is a coin flip
  // per element, and compilers turn the plain select into a mispredicted branch.
  const uint32_t keep = 0u - uint32_t(x * p >= 0.0f);
  const float decay = bits_to_float(float_to_bits(lr_wd * p) & keep);
  return p - (lr * x + decay);
}

// lr' = lr * factor by the group's lr_scale mode.
enum class MuonLrScale : int { kNone = 0, kOriginal = 1, kMatchRmsAdamW = 2 };

inline double muon_lr_factor(MuonLrScale mode, int64_t rows, int64_t cols) {
  switch (mode) {
    case MuonLrScale::kOriginal: {
      const double ratio = double(rows) / double(cols);
      return std::sqrt(ratio > 1.0 ? ratio : 1.0);
    }
    case MuonLrScale::kMatchRmsAdamW: return 0.2 * std::sqrt(double(rows > cols ? rows : cols));
    case MuonLrScale::kNone: return 1.0;
  }
  return 1.0;
}

}  // namespace muon_ext

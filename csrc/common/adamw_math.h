// AdamW / Adam-L2 element math, written once for every backend.
//
// `adamw_element` is templated on the arithmetic type: `float` on the CUDA
// path and in scalar CPU tails, `at::vec::Vectorized<float>` in the CPU vector
// body.  A backend supplies `MathOps<T>::sqrt`; everything else is + - * /.
// Compilers must not contract a*b+c into FMA (CPU: -ffp-contract=off, CUDA:
// --fmad=false) so that scalar tail, vector body and GPU give the same bits.
#pragma once

#include <cmath>
#include <cstdint>

#include "macros.h"

namespace muon_ext {

template <typename T>
struct MathOps;

template <>
struct MathOps<float> {
  MUON_HD static float sqrt(float x) { return ::sqrtf(x); }
};

// How the FP32 master of a parameter is stored: the master mode (Python: the
// MasterMode strings "none", "fp32", "remainder" of muon_ext/_types.py).
enum class MasterMode : int {
  kNone = 0,       // the param is its own master (FP32 param, or master_weights=False)
  kFP32 = 1,       // separate FP32 master tensor
  kRemainder = 2,  // BF16 param + int16 remainder (see remainder.h)
};

// Per-tensor coefficients, already broadcast to the arithmetic type T.
template <typename T>
struct AdamWCoeffs {
  T lr;
  T beta1, one_minus_beta1;
  T beta2, one_minus_beta2;
  T eps;
  T weight_decay;
  T inv_bias_correction1, inv_bias_correction2;  // 1 / (1 - beta^t), or 1
  T inv_scale;
  bool adam_w_mode;
};

// Scalar hyper-parameters of one step (the learning rate is passed on its
// own: a host float or a device tensor).
struct AdamWHyper {
  float beta1;
  float beta2;
  float eps;
  float weight_decay;
  bool adam_w_mode;
  bool bias_correction;
};

// beta^n for a whole-number step n, by binary exponentiation in double.  Only
// IEEE multiplications are involved (no library pow, whose last bit differs
// between glibc and CUDA), so every backend -- and the Python reference, which
// runs the same loop -- gets the same bits.  Counts are capped at 2^62 (a
// float-to-integer conversion beyond 2^64 is undefined): for every beta < 1
// the power is already 0 there, so the cap changes no result.
constexpr float kMaxPowStep = 4.611686018427387904e18f;  // 2^62
MUON_HD double pow_by_squaring(double base, float step) {
  unsigned long long n =
      step > 0.0f ? (step < kMaxPowStep ? static_cast<unsigned long long>(step) : (1ull << 62)) : 0ull;
  double result = 1.0;
  while (n != 0ull) {
    if (n & 1ull) result = result * base;
    base = base * base;
    n >>= 1;
  }
  return result;
}

// 1 / bias_correction_k = 1 / (1 - beta_k^step) (1 when disabled), in double,
// rounded once to FP32: the kernels multiply by it instead of dividing.
MUON_HD float inverse_bias_correction(float beta, float step, bool enabled) {
  return enabled ? float(1.0 / (1.0 - pow_by_squaring(double(beta), step))) : 1.0f;
}

MUON_HD AdamWCoeffs<float> make_adamw_coeffs(const AdamWHyper& h, float lr, float step, float inv_scale) {
  AdamWCoeffs<float> c;
  c.lr = lr;
  c.beta1 = h.beta1;
  c.one_minus_beta1 = 1.0f - h.beta1;
  c.beta2 = h.beta2;
  c.one_minus_beta2 = 1.0f - h.beta2;
  c.eps = h.eps;
  c.weight_decay = h.weight_decay;
  c.inv_bias_correction1 = inverse_bias_correction(h.beta1, step, h.bias_correction);
  c.inv_bias_correction2 = inverse_bias_correction(h.beta2, step, h.bias_correction);
  c.inv_scale = inv_scale;
  c.adam_w_mode = h.adam_w_mode;
  return c;
}

// One AdamW step on one element (or one vector of elements).
//   g  = grad * inv_scale           (+ wd * p in L2 mode)
//   m  = b1 m + (1 - b1) g ;  v = b2 v + (1 - b2) g^2
//   p -= lr * ((m / bc1) / (sqrt(v / bc2) + eps) + wd * p)   (AdamW mode)
// evaluated with the reciprocals of bc1 and bc2 (one division and one square
// root per element, as in torch's fused kernels).
// p is the FP32 master; m and v are FP32 moments.
template <typename T>
MUON_HD void adamw_element(T& p, T& m, T& v, T grad, const AdamWCoeffs<T>& c) {
  T g = grad * c.inv_scale;
  if (!c.adam_w_mode) g = g + c.weight_decay * p;
  m = c.beta1 * m + c.one_minus_beta1 * g;
  v = c.beta2 * v + c.one_minus_beta2 * (g * g);
  T update = (m * c.inv_bias_correction1) / (MathOps<T>::sqrt(v * c.inv_bias_correction2) + c.eps);
  if (c.adam_w_mode) update = update + c.weight_decay * p;
  p = p - c.lr * update;
}

}  // namespace muon_ext

// Small-matrix Polar-Express: see polar_small.h.
#include "polar_small.h"

#include <ATen/Parallel.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <vector>

#include "../common/bits.h"
#include "../common/polar_plan.h"

namespace muon_ext {
namespace cpu {
namespace {

constexpr int kLanes = 8;
typedef float Lanes __attribute__((vector_size(kLanes * sizeof(float))));
typedef uint32_t LaneBits __attribute__((vector_size(kLanes * sizeof(uint32_t))));
typedef int32_t LaneMask __attribute__((vector_size(kLanes * sizeof(int32_t))));

__attribute__((always_inline)) inline Lanes splat(float v) { return Lanes{v, v, v, v, v, v, v, v}; }

inline LaneBits to_bits(Lanes x) {
  LaneBits u;
  std::memcpy(&u, &x, sizeof(u));
  return u;
}

inline Lanes from_bits(LaneBits u) {
  Lanes x;
  std::memcpy(&x, &u, sizeof(x));
  return x;
}

// bf16_bits_to_float(float_to_bf16_bits_rne(x)) per lane (csrc/common/bits.h).
__attribute__((always_inline)) inline Lanes round_bf16(Lanes x) {
  const LaneBits u = to_bits(x);
  const LaneMask nan = (u & 0x7FFFFFFFu) > 0x7F800000u;
  const LaneBits rounded = (u + (0x7FFFu + ((u >> 16) & 1u))) & 0xFFFF0000u;
  return from_bits(nan ? LaneBits{} + 0x7FC00000u : rounded);
}

// half_bits_to_float(float_to_half_bits_rne(x)) per lane: values in FP16's
// normal range [2^-14, 65520) and zeros by dropping 13 mantissa bits; the
// other lanes (subnormal, overflow, NaN: rare, inputs have norm < 1) by bits.h.
__attribute__((always_inline)) inline Lanes round_fp16(Lanes x) {
  const LaneBits u = to_bits(x);
  const LaneBits magnitude = u & 0x7FFFFFFFu;
  const LaneMask easy = ((magnitude >= 0x38800000u) & (magnitude < 0x477FF000u)) | (magnitude == 0u);
  Lanes out = from_bits((u + (0xFFFu + ((u >> 13) & 1u))) & 0xFFFFE000u);
  for (int l = 0; l < kLanes; ++l) {
    if (__builtin_expect(easy[l] == 0, 0)) out[l] = half_bits_to_float(float_to_half_bits_rne(x[l]));
  }
  return out;
}

__attribute__((always_inline)) inline Lanes round_output(Lanes x, PolarRounding rounding) {
  switch (rounding) {
    case PolarRounding::kBFloat16: return round_bf16(x);
    case PolarRounding::kFloat16: return round_fp16(x);
    case PolarRounding::kNone: break;
  }
  return x;
}

// out[t] = sum over k ascending of A(k) * B(k, t), t < width <= 4, with
// A(k) = a[k * a_step] and B(k, t) = b[k * b_step + t * b_pitch]: up to four
// independent accumulators in registers, so the additions do not wait on
// one another. Each sum is 0 + a0 b0 + a1 b1 + ..., in that order.
inline void dot_block(const Lanes* a, int64_t a_step, const Lanes* b, int64_t b_step, int64_t b_pitch, int64_t k_count,
                      int64_t width, Lanes* out) {
  Lanes acc0 = splat(0.0f), acc1 = acc0, acc2 = acc0, acc3 = acc0;
  if (width == 4) {
    for (int64_t k = 0; k < k_count; ++k) {
      const Lanes ak = a[k * a_step];
      const Lanes* bk = b + k * b_step;
      acc0 = acc0 + ak * bk[0];
      acc1 = acc1 + ak * bk[b_pitch];
      acc2 = acc2 + ak * bk[2 * b_pitch];
      acc3 = acc3 + ak * bk[3 * b_pitch];
    }
    out[0] = acc0, out[1] = acc1, out[2] = acc2, out[3] = acc3;
    return;
  }
  for (int64_t t = 0; t < width; ++t) {
    Lanes acc = splat(0.0f);
    for (int64_t k = 0; k < k_count; ++k) acc = acc + a[k * a_step] * b[k * b_step + t * b_pitch];
    out[t] = acc;
  }
}

// out(i, j) = round(alpha * sum_k lhs(i, k) rhs(k, j) + beta * src(i, j)) on
// and right of the diagonal of [side, side] matrices, mirrored below: a
// product that is symmetric in exact arithmetic (polar_plan.h's
// symmetric_product). `out` aliases neither lhs nor rhs; it may be src.
// The helpers here are inlined into each clone of iterate_group(_gram): a call
// between the AVX2 clone and a default-ISA function would pass vectors under
// another ABI (and run unvectorized).
__attribute__((always_inline)) inline void symmetric_product(Lanes* out, const Lanes* lhs, const Lanes* rhs,
                                                             const Lanes* src, int64_t side, float alpha_value,
                                                             float beta_value, PolarRounding rounding) {
  const Lanes alpha = splat(alpha_value), beta = splat(beta_value);
  Lanes block[4];
  for (int64_t i = 0; i < side; ++i) {
    for (int64_t j = i; j < side; j += 4) {
      const int64_t width = std::min<int64_t>(4, side - j);
      dot_block(lhs + i * side, 1, rhs + j, side, 1, side, width, block);
      for (int64_t t = 0; t < width; ++t) {
        out[i * side + j + t] = out[(j + t) * side + i] =
            round_output(alpha * block[t] + beta * src[i * side + j + t], rounding);
      }
    }
  }
}

// gram = V V^T (V = X wide, X^T tall: V(i, k) = x[i * v_row + k * v_col]), upper triangle mirrored.
__attribute__((always_inline)) inline void gram_of(const Lanes* x, Lanes* gram, int64_t side, int64_t length, int64_t v_row, int64_t v_col,
                    PolarRounding rounding) {
  Lanes block[4];
  for (int64_t i = 0; i < side; ++i) {
    for (int64_t j = i; j < side; j += 4) {
      const int64_t width = std::min<int64_t>(4, side - j);
      dot_block(x + i * v_row, v_col, x + j * v_row, v_col, v_row, length, width, block);
      for (int64_t t = 0; t < width; ++t) gram[i * side + j + t] = gram[(j + t) * side + i] = round_output(block[t], rounding);
    }
  }
}

// X = Q X (wide) or X Q (tall), Q [side, side], through x_operand; with
// `add_a`, X = Q X + a X (the standard iteration's update).
__attribute__((always_inline)) inline void multiply_x(Lanes* x, Lanes* x_operand, const Lanes* q, int64_t rows,
                                                      int64_t cols, bool add_a, float a_value,
                                                      PolarRounding rounding) {
  const int64_t side = std::min(rows, cols);
  const bool wide = rows <= cols;
  const Lanes a = splat(a_value);
  Lanes block[4];
  std::copy(x, x + rows * cols, x_operand);
  for (int64_t i = 0; i < rows; ++i) {
    for (int64_t j = 0; j < cols; j += 4) {
      const int64_t width = std::min<int64_t>(4, cols - j);
      if (wide) {
        dot_block(q + i * side, 1, x_operand + j, cols, 1, side, width, block);
      } else {
        dot_block(x_operand + i * cols, 1, q + j, side, 1, side, width, block);
      }
      for (int64_t t = 0; t < width; ++t) {
        x[i * cols + j + t] = round_output(add_a ? block[t] + a * x_operand[i * cols + j + t] : block[t], rounding);
      }
    }
  }
}

// The iterations on one group of matrices in lanes: x [rows * cols], its
// operand copy, gram and poly [side * side]. Every product entry is a sum over
// k ascending (dot_block), so the bits do not depend on the blocking.
__attribute__((target_clones("avx2", "default"))) void iterate_group(Lanes* x, Lanes* x_operand, Lanes* gram,
                                                                     Lanes* poly, int64_t rows, int64_t cols,
                                                                     const float* abc_list, int64_t steps,
                                                                     PolarRounding rounding) {
  const int64_t side = std::min(rows, cols), length = std::max(rows, cols);
  const bool wide = rows <= cols;
  // V = X (wide) or X^T (tall): V(i, k) = x[i * v_row + k * v_col].
  const int64_t v_row = wide ? cols : 1, v_col = wide ? 1 : cols;
  for (int64_t e = 0; e < rows * cols; ++e) x[e] = round_output(x[e], rounding);
  for (int64_t step = 0; step < steps; ++step) {
    const float a = abc_list[3 * step], b = abc_list[3 * step + 1], c = abc_list[3 * step + 2];
    gram_of(x, gram, side, length, v_row, v_col, rounding);            // gram = V V^T
    symmetric_product(poly, gram, gram, gram, side, c, b, rounding);   // poly = c (gram gram) + b gram
    multiply_x(x, x_operand, poly, rows, cols, true, a, rounding);     // X = poly X + a X (or X poly + a X)
  }
}

// Gram Newton-Schulz on one group in lanes, op for op polar_gram_plan's (the
// buffer copies there are pointer swaps here): x and x_operand [rows * cols],
// r, z, q, spare [side * side].
__attribute__((target_clones("avx2", "default"))) void iterate_group_gram(Lanes* x, Lanes* x_operand, Lanes* r,
                                                                          Lanes* z, Lanes* q, Lanes* spare,
                                                                          int64_t rows, int64_t cols,
                                                                          const float* abc_list, int64_t steps,
                                                                          PolarRounding rounding) {
  const int64_t side = std::min(rows, cols), length = std::max(rows, cols);
  const bool wide = rows <= cols;
  const int64_t v_row = wide ? cols : 1, v_col = wide ? 1 : cols;
  for (int64_t e = 0; e < rows * cols; ++e) x[e] = round_output(x[e], rounding);
  if (steps <= 0) return;
  gram_of(x, r, side, length, v_row, v_col, rounding);
  const int restart_period = polar_gram_restart_period(rounding != PolarRounding::kNone);
  bool fresh = true;
  for (int64_t k = 0; k < steps; ++k) {
    if (polar_gram_restarts_before(static_cast<int>(k), restart_period)) {
      multiply_x(x, x_operand, q, rows, cols, false, 0.0f, rounding);
      gram_of(x, r, side, length, v_row, v_col, rounding);
      fresh = true;
    }
    const float a = abc_list[3 * k], b = abc_list[3 * k + 1], c = abc_list[3 * k + 2];
    symmetric_product(z, r, r, r, side, c, b, rounding);  // Z = c R R + b R
    if (fresh) {  // Q = Z + a I
      std::copy(z, z + side * side, q);
      for (int64_t i = 0; i < side; ++i) q[i * (side + 1)] = round_output(q[i * (side + 1)] + splat(a), rounding);
      fresh = false;
    } else {  // Q = Q Z + a Q
      symmetric_product(spare, q, z, q, side, 1.0f, a, rounding);
      std::swap(q, spare);
    }
    if (k + 1 < steps && !polar_gram_restarts_before(static_cast<int>(k + 1), restart_period)) {  // R = Z (R Z + a R) + a (R Z + a R)
      symmetric_product(spare, r, z, r, side, 1.0f, a, rounding);
      symmetric_product(r, z, spare, spare, side, 1.0f, a, rounding);
    }
  }
  multiply_x(x, x_operand, q, rows, cols, false, 0.0f, rounding);
}

}  // namespace

void polar_express_small(float* xs, int64_t count, int64_t rows, int64_t cols,
                         const std::vector<std::array<float, 3>>& coefficients, PolarRounding rounding, bool gram) {
  std::vector<float> abc;
  for (const auto& t : coefficients) abc.insert(abc.end(), t.begin(), t.end());
  const int64_t n = rows * cols, side = std::min(rows, cols);
  const int64_t groups = (count + kLanes - 1) / kLanes;
  // Tasks of about 32k lane-elements, at least one group each.
  const int64_t grain = std::max<int64_t>(1, 32768 / std::max<int64_t>(n * kLanes, 1));
  at::parallel_for(0, groups, grain, [&](int64_t first, int64_t last) {
    // 64-byte aligned by hand: the AVX2 clone loads Lanes with aligned moves,
    // and std::vector does not over-align them here.
    const size_t bytes = (sizeof(Lanes) * (2 * n + (gram ? 4 : 2) * side * side) + 63) / 64 * 64;
    const std::unique_ptr<void, decltype(&std::free)> buffers(std::aligned_alloc(64, bytes), &std::free);
    TORCH_CHECK(buffers != nullptr, "muon: out of memory for the small-matrix Polar-Express scratch");
    Lanes* x = static_cast<Lanes*>(buffers.get());
    for (int64_t g = first; g < last; ++g) {
      const int64_t members = std::min<int64_t>(kLanes, count - g * kLanes);
      float* base = xs + g * kLanes * n;
      for (int64_t e = 0; e < n; ++e) {
        Lanes v = splat(0.0f);  // missing members: zero matrices, never read back
        for (int64_t m = 0; m < members; ++m) v[m] = base[m * n + e];
        x[e] = v;
      }
      const int64_t steps = static_cast<int64_t>(coefficients.size());
      Lanes* squares = x + 2 * n;
      if (gram) {
        iterate_group_gram(x, x + n, squares, squares + side * side, squares + 2 * side * side,
                           squares + 3 * side * side, rows, cols, abc.data(), steps, rounding);
      } else {
        iterate_group(x, x + n, squares, squares + side * side, rows, cols, abc.data(), steps, rounding);
      }
      for (int64_t e = 0; e < n; ++e) {
        for (int64_t m = 0; m < members; ++m) base[m * n + e] = x[e][m];
      }
    }
  });
}

}  // namespace cpu
}  // namespace muon_ext

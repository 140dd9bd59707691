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

namespace muon_ext {
namespace cpu {
namespace {

constexpr int kLanes = 8;
typedef float Lanes __attribute__((vector_size(kLanes * sizeof(float))));
typedef uint32_t LaneBits __attribute__((vector_size(kLanes * sizeof(uint32_t))));
typedef int32_t LaneMask __attribute__((vector_size(kLanes * sizeof(int32_t))));

inline Lanes splat(float v) { return Lanes{v, v, v, v, v, v, v, v}; }

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
inline Lanes round_bf16(Lanes x) {
  const LaneBits u = to_bits(x);
  const LaneMask nan = (u & 0x7FFFFFFFu) > 0x7F800000u;
  const LaneBits rounded = (u + (0x7FFFu + ((u >> 16) & 1u))) & 0xFFFF0000u;
  return from_bits(nan ? LaneBits{} + 0x7FC00000u : rounded);
}

// half_bits_to_float(float_to_half_bits_rne(x)) per lane: values in FP16's
// normal range [2^-14, 65520) and zeros by dropping 13 mantissa bits; the
// other lanes (subnormal, overflow, NaN: rare, inputs have norm < 1) by bits.h.
inline Lanes round_fp16(Lanes x) {
  const LaneBits u = to_bits(x);
  const LaneBits magnitude = u & 0x7FFFFFFFu;
  const LaneMask easy = ((magnitude >= 0x38800000u) & (magnitude < 0x477FF000u)) | (magnitude == 0u);
  Lanes out = from_bits((u + (0xFFFu + ((u >> 13) & 1u))) & 0xFFFFE000u);
  for (int l = 0; l < kLanes; ++l) {
    if (__builtin_expect(easy[l] == 0, 0)) out[l] = half_bits_to_float(float_to_half_bits_rne(x[l]));
  }
  return out;
}

inline Lanes round_output(Lanes x, PolarRounding rounding) {
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

// The iterations on one group of matrices in lanes: x [rows * cols], its
// operand copy, gram and poly [side * side]. Every product entry is a sum over
// k ascending (dot_block), so the bits do not depend on the blocking.
__attribute__((target_clones("avx2", "default"))) void iterate_group(Lanes* x, Lanes* x_operand, Lanes* gram,
                                                                     Lanes* poly, int64_t rows, int64_t cols,
                                                                     const float* abc_list, int64_t steps,
                                                                     PolarRounding rounding) {
  const int64_t side = std::min(rows, cols), length = std::max(rows, cols);
  const bool wide = rows <= cols;
  const int64_t n = rows * cols;
  // V = X (wide) or X^T (tall): V(i, k) = x[i * v_row + k * v_col].
  const int64_t v_row = wide ? cols : 1, v_col = wide ? 1 : cols;
  Lanes block[4];
  for (int64_t e = 0; e < n; ++e) x[e] = round_output(x[e], rounding);
  for (int64_t step = 0; step < steps; ++step) {
    const Lanes a = splat(abc_list[3 * step]), b = splat(abc_list[3 * step + 1]), c = splat(abc_list[3 * step + 2]);
    // gram = V V^T, symmetric: the upper triangle, mirrored (the same
    // products in the same order give the same bits).
    for (int64_t i = 0; i < side; ++i) {
      for (int64_t j = i; j < side; j += 4) {
        const int64_t width = std::min<int64_t>(4, side - j);
        dot_block(x + i * v_row, v_col, x + j * v_row, v_col, v_row, length, width, block);
        for (int64_t t = 0; t < width; ++t) gram[i * side + j + t] = gram[(j + t) * side + i] = round_output(block[t], rounding);
      }
    }
    // poly = c (gram gram) + b gram; gram gram is symmetric as well.
    for (int64_t i = 0; i < side; ++i) {
      for (int64_t j = i; j < side; j += 4) {
        const int64_t width = std::min<int64_t>(4, side - j);
        dot_block(gram + i * side, 1, gram + j, side, 1, side, width, block);
        for (int64_t t = 0; t < width; ++t) {
          poly[i * side + j + t] = poly[(j + t) * side + i] =
              round_output(c * block[t] + b * gram[i * side + j + t], rounding);
        }
      }
    }
    // X = poly X + a X (wide) or X poly + a X (tall).
    std::copy(x, x + n, x_operand);
    for (int64_t i = 0; i < rows; ++i) {
      for (int64_t j = 0; j < cols; j += 4) {
        const int64_t width = std::min<int64_t>(4, cols - j);
        if (wide) {
          dot_block(poly + i * side, 1, x_operand + j, cols, 1, side, width, block);
        } else {
          dot_block(x_operand + i * cols, 1, poly + j, side, 1, side, width, block);
        }
        for (int64_t t = 0; t < width; ++t) {
          x[i * cols + j + t] = round_output(block[t] + a * x_operand[i * cols + j + t], rounding);
        }
      }
    }
  }
}

}  // namespace

void polar_express_small(float* xs, int64_t count, int64_t rows, int64_t cols,
                         const std::vector<std::array<float, 3>>& coefficients, PolarRounding rounding) {
  std::vector<float> abc;
  for (const auto& t : coefficients) abc.insert(abc.end(), t.begin(), t.end());
  const int64_t n = rows * cols, side = std::min(rows, cols);
  const int64_t groups = (count + kLanes - 1) / kLanes;
  // Tasks of about 32k lane-elements, at least one group each.
  const int64_t grain = std::max<int64_t>(1, 32768 / std::max<int64_t>(n * kLanes, 1));
  at::parallel_for(0, groups, grain, [&](int64_t first, int64_t last) {
    // 64-byte aligned by hand: the AVX2 clone loads Lanes with aligned moves,
    // and std::vector does not over-align them here.
    const size_t bytes = (sizeof(Lanes) * (2 * n + 2 * side * side) + 63) / 64 * 64;
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
      iterate_group(x, x + n, x + 2 * n, x + 2 * n + side * side, rows, cols, abc.data(),
                    static_cast<int64_t>(coefficients.size()), rounding);
      for (int64_t e = 0; e < n; ++e) {
        for (int64_t m = 0; m < members; ++m) base[m * n + e] = x[e][m];
      }
    }
  });
}

}  // namespace cpu
}  // namespace muon_ext

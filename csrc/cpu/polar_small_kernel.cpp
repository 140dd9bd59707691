// The small-matrix Polar-Express kernel (polar_small.h) for one instruction
// set. Built once per ISA with CPU_CAPABILITY set to DEFAULT, AVX2 or AVX512
// (flags: csrc/build_flags.json); polar_small.cpp picks one at run time from
// ATen's CPU capability, as for the AdamW kernels, so tests can run each.
#include <algorithm>
#include <cstring>
#include <type_traits>

#if defined(__AVX__)
#include <immintrin.h>
#endif

#include "../common/bits.h"
#include "../common/muon_math.h"
#include "../common/polar_plan.h"
#include "../common/shapes.h"
#include "polar_small.h"

#ifndef CPU_CAPABILITY
#error "CPU_CAPABILITY must be defined (DEFAULT, AVX2 or AVX512)"
#endif

// The 16-wide vectors pass between functions of this file only, all inlined
// into polar_small_groups: their ABI (AVX-512's or not) is never seen outside.
#pragma GCC diagnostic ignored "-Wpsabi"

namespace muon_ext {
namespace cpu {
namespace CPU_CAPABILITY {
namespace {

constexpr int kLanes = kPolarSmallLanes;
typedef float Lanes __attribute__((vector_size(kLanes * sizeof(float))));
typedef uint32_t LaneBits __attribute__((vector_size(kLanes * sizeof(uint32_t))));
typedef int32_t LaneMask __attribute__((vector_size(kLanes * sizeof(int32_t))));
typedef double LaneDoubles __attribute__((vector_size(kLanes * sizeof(double))));

// v in every lane: the scalar operand of a vector operation is broadcast, and
// v - 0 is v exactly (-0 included). (A loop over the lanes compiled to
// masked partial broadcasts through the stack.)
__attribute__((always_inline)) inline Lanes splat(float v) { return v - Lanes{}; }

// acc + a * b per lane with one rounding (a fused multiply-add). Where a and
// b are BF16 or FP16 values their product is exact in FP32 (at most 16 or 22
// significant bits; below 2^-126 BF16 products aside), so this equals the
// separate multiply and add, in fewer instructions. Every build computes it:
// AVX-512 and AVX2 with FMA instructions, the baseline in double (the product
// is exact there, and the sum of a product of two 16-bit values and an FP32
// value rounded to double and then to FP32 is the once-rounded sum).
__attribute__((always_inline)) inline Lanes multiply_add(Lanes a, Lanes b, Lanes acc) {
#if defined(__AVX512F__)
  return (Lanes)_mm512_fmadd_ps((__m512)a, (__m512)b, (__m512)acc);
#elif defined(__FMA__)
  __m256 a2[2], b2[2], acc2[2];
  std::memcpy(a2, &a, sizeof(a2));
  std::memcpy(b2, &b, sizeof(b2));
  std::memcpy(acc2, &acc, sizeof(acc2));
  for (int h = 0; h < 2; ++h) acc2[h] = _mm256_fmadd_ps(a2[h], b2[h], acc2[h]);
  std::memcpy(&acc, acc2, sizeof(acc));
  return acc;
#else
  return __builtin_convertvector(__builtin_convertvector(a, LaneDoubles) * __builtin_convertvector(b, LaneDoubles) +
                                     __builtin_convertvector(acc, LaneDoubles),
                                 Lanes);
#endif
}

// a * b + acc per lane with one rounding, for any FP32 a, b (the product need
// not be exact): the fused epilogues of the 16-bit iterations. The baseline
// build has no FMA instruction on x86 and calls fmaf, correctly rounded.
__attribute__((always_inline)) inline Lanes fused_multiply_add(Lanes a, Lanes b, Lanes acc) {
#if defined(__AVX512F__) || defined(__FMA__)
  return multiply_add(a, b, acc);
#else
  for (int l = 0; l < kLanes; ++l) acc[l] = __builtin_fmaf(a[l], b[l], acc[l]);
  return acc;
#endif
}

// How a group's products are formed and rounded: `fused`, with multiply_add
// (the 16-bit polar_dtypes, whose operands are 16-bit values); `finite_bf16`,
// BF16 rounding without the NaN case, for a group whose values are all
// finite (see iterate_groups).
struct Arithmetic {
  bool fused;
  bool finite_bf16;
};

__attribute__((always_inline)) inline LaneBits to_bits(Lanes x) {
  LaneBits u;
  std::memcpy(&u, &x, sizeof(u));
  return u;
}

__attribute__((always_inline)) inline Lanes from_bits(LaneBits u) {
  Lanes x;
  std::memcpy(&x, &u, sizeof(x));
  return x;
}

// All ones in the lanes where magnitude < bound, else zero, for magnitudes and
// bounds in [0, 2^31): the sign of magnitude - bound, spread by an arithmetic
// shift. Plain vector arithmetic: GCC 12 lowers comparisons of 16-wide
// generic vectors lane by lane.
__attribute__((always_inline)) inline LaneBits below(LaneMask magnitude, int32_t bound) {
  return (LaneBits)((magnitude - bound) >> 31);
}

// Whether any lane of mask is set.
__attribute__((always_inline)) inline bool any_lane(LaneBits mask) {
  uint64_t words[sizeof(LaneBits) / sizeof(uint64_t)];
  std::memcpy(words, &mask, sizeof(words));
  uint64_t any = 0;
  for (uint64_t w : words) any |= w;
  return any != 0;
}

// bf16_rne_high_bits (csrc/common/bits.h) per lane. AVX-512 adds 0x7FFF or,
// where bit 16 is set, 0x8000 under a mask: the same sums in four
// instructions instead of five (shift, and, two adds, and).
__attribute__((always_inline)) inline LaneBits lane_bf16_rne_high_bits(LaneBits u) {
#if defined(__AVX512F__)
  const __m512i bits = (__m512i)u;
  const __mmask16 odd = _mm512_test_epi32_mask(bits, _mm512_set1_epi32(0x10000));
  const __m512i sum = _mm512_mask_add_epi32(_mm512_add_epi32(bits, _mm512_set1_epi32(0x7FFF)), odd, bits,
                                            _mm512_set1_epi32(0x8000));
  return (LaneBits)_mm512_and_si512(sum, _mm512_set1_epi32(int32_t(0xFFFF0000u)));
#else
  return bf16_rne_high_bits(u);
#endif
}

// bf16_bits_to_float(float_to_bf16_bits_rne(x)) per lane (csrc/common/bits.h).
__attribute__((always_inline)) inline Lanes round_bf16(Lanes x) {
  const LaneBits u = to_bits(x);
  const LaneBits nan = ~below((LaneMask)(u & 0x7FFFFFFFu), 0x7F800001);
  return from_bits((lane_bf16_rne_high_bits(u) & ~nan) | (nan & 0x7FC00000u));
}

// half_bits_to_float(float_to_half_bits_rne(x)) per lane: values in FP16's
// normal range [2^-14, 65520) and zeros by dropping 13 mantissa bits; the
// other lanes (subnormal, overflow, NaN: rare, inputs have norm < 1) by bits.h.
__attribute__((always_inline)) inline Lanes round_fp16(Lanes x) {
  const LaneBits u = to_bits(x);
  const LaneMask magnitude = (LaneMask)(u & 0x7FFFFFFFu);
  const LaneBits easy = (~below(magnitude, 0x38800000) & below(magnitude, 0x477FF000)) | below(magnitude, 1);
  const LaneBits hard = ~easy;
  Lanes out = from_bits((u + (0xFFFu + ((u >> 13) & 1u))) & 0xFFFFE000u);
  if (__builtin_expect(any_lane(hard), 0)) {
    for (int l = 0; l < kLanes; ++l) {
      if (hard[l] != 0) out[l] = half_bits_to_float(float_to_half_bits_rne(x[l]));
    }
  }
  return out;
}

// round_bf16 for finite x: the same bits, and x86's default NaN (the only
// NaN arithmetic on finite values makes) and infinities stay non-finite.
__attribute__((always_inline)) inline Lanes round_finite_bf16(Lanes x) {
  return from_bits(lane_bf16_rne_high_bits(to_bits(x)));
}

template <Arithmetic kArithmetic>
__attribute__((always_inline)) inline Lanes round_output(Lanes x, PolarRounding rounding) {
  switch (rounding) {
    case PolarRounding::kBFloat16: return kArithmetic.finite_bf16 ? round_finite_bf16(x) : round_bf16(x);
    case PolarRounding::kFloat16: return round_fp16(x);
    case PolarRounding::kNone: break;
  }
  return x;
}

// out[t] = sum over k ascending of A(k) * B(k, t), t < width <= kDotWidth,
// with A(k) = a[k * a_step] and B(k, t) = b[k * b_step + t * b_pitch]: one
// accumulator per output in registers, so the additions do not wait on one
// another (a fused multiply-add takes four cycles and two issue each cycle:
// eight chains keep both units busy; AVX2's sixteen registers hold four of
// these two-register vectors and their operands). Each sum is
// 0 + a0 b0 + a1 b1 + ..., in that order, whatever the width.
#if defined(__AVX512F__)
constexpr int64_t kDotWidth = 8;
#else
constexpr int64_t kDotWidth = 4;
#endif

template <bool kFused>
__attribute__((always_inline)) inline Lanes multiply_accumulate(Lanes acc, Lanes a, Lanes b) {
  if constexpr (kFused) return multiply_add(a, b, acc);
  return acc + a * b;
}

template <bool kFused, int kWidth>
__attribute__((always_inline)) inline void dot_block_of(const Lanes* a, int64_t a_step, const Lanes* b,
                                                        int64_t b_step, int64_t b_pitch, int64_t k_count,
                                                        Lanes* out) {
  Lanes acc[kWidth];
  for (int t = 0; t < kWidth; ++t) acc[t] = splat(0.0f);
  for (int64_t k = 0; k < k_count; ++k) {
    const Lanes ak = a[k * a_step];
    const Lanes* bk = b + k * b_step;
    for (int t = 0; t < kWidth; ++t) acc[t] = multiply_accumulate<kFused>(acc[t], ak, bk[t * b_pitch]);
  }
  for (int t = 0; t < kWidth; ++t) out[t] = acc[t];
}

template <bool kFused>
__attribute__((always_inline)) inline void dot_block(const Lanes* a, int64_t a_step, const Lanes* b,
                                                     int64_t b_step, int64_t b_pitch, int64_t k_count, int64_t width,
                                                     Lanes* out) {
  static_assert(kDotWidth <= 8, "one case per width");
  switch (width) {
    case 8: if constexpr (kDotWidth >= 8) return dot_block_of<kFused, 8>(a, a_step, b, b_step, b_pitch, k_count, out);
    [[fallthrough]];
    case 7: if constexpr (kDotWidth >= 7) return dot_block_of<kFused, 7>(a, a_step, b, b_step, b_pitch, k_count, out);
    [[fallthrough]];
    case 6: if constexpr (kDotWidth >= 6) return dot_block_of<kFused, 6>(a, a_step, b, b_step, b_pitch, k_count, out);
    [[fallthrough]];
    case 5: if constexpr (kDotWidth >= 5) return dot_block_of<kFused, 5>(a, a_step, b, b_step, b_pitch, k_count, out);
    [[fallthrough]];
    case 4: return dot_block_of<kFused, 4>(a, a_step, b, b_step, b_pitch, k_count, out);
    case 3: return dot_block_of<kFused, 3>(a, a_step, b, b_step, b_pitch, k_count, out);
    case 2: return dot_block_of<kFused, 2>(a, a_step, b, b_step, b_pitch, k_count, out);
    default: return dot_block_of<kFused, 1>(a, a_step, b, b_step, b_pitch, k_count, out);
  }
}

// out(i, j) = round(alpha * sum_k lhs(i, k) rhs(k, j) + beta * src(i, j)) on
// and right of the diagonal of [side, side] matrices, mirrored below: a
// product that is symmetric in exact arithmetic (polar_plan.h's
// symmetric_product). `out` aliases neither lhs nor rhs; it may be src.
// The helpers here are inlined into each clone of iterate_group(_gram): a call
// between the AVX2 clone and a default-ISA function would pass vectors under
// another ABI (and run unvectorized).
template <Arithmetic kArithmetic>
__attribute__((always_inline)) inline void symmetric_product(Lanes* out, const Lanes* lhs, const Lanes* rhs,
                                                             const Lanes* src, int64_t side, float alpha_value,
                                                             float beta_value, PolarRounding rounding) {
  const Lanes alpha = splat(alpha_value), beta = splat(beta_value);
  Lanes block[kDotWidth];
  for (int64_t i = 0; i < side; ++i) {
    for (int64_t j = i; j < side; j += kDotWidth) {
      const int64_t width = std::min<int64_t>(kDotWidth, side - j);
      dot_block<kArithmetic.fused>(lhs + i * side, 1, rhs + j, side, 1, side, width, block);
      for (int64_t t = 0; t < width; ++t) {
        // The 16-bit iterations scale the sum with one rounding (alpha * sum + (beta * src)).
        const Lanes scaled = kArithmetic.fused ? fused_multiply_add(alpha, block[t], beta * src[i * side + j + t])
                                               : alpha * block[t] + beta * src[i * side + j + t];
        out[i * side + j + t] = out[(j + t) * side + i] = round_output<kArithmetic>(scaled, rounding);
      }
    }
  }
}

// gram = V V^T (V = X wide, X^T tall: V(i, k) = x[i * v_row + k * v_col]), upper triangle mirrored.
template <Arithmetic kArithmetic>
__attribute__((always_inline)) inline void gram_of(const Lanes* x, Lanes* gram, int64_t side, int64_t length, int64_t v_row, int64_t v_col,
                    PolarRounding rounding) {
  Lanes block[kDotWidth];
  for (int64_t i = 0; i < side; ++i) {
    for (int64_t j = i; j < side; j += kDotWidth) {
      const int64_t width = std::min<int64_t>(kDotWidth, side - j);
      dot_block<kArithmetic.fused>(x + i * v_row, v_col, x + j * v_row, v_col, v_row, length, width, block);
      for (int64_t t = 0; t < width; ++t) gram[i * side + j + t] = gram[(j + t) * side + i] = round_output<kArithmetic>(block[t], rounding);
    }
  }
}

// x = Q X (wide) or X Q (tall) for X = x_operand [rows, cols] and Q
// [side, side]; with `add_a`, x = Q X + a X (the standard iteration's
// update). x and x_operand are distinct buffers.
template <Arithmetic kArithmetic>
__attribute__((always_inline)) inline void multiply_x(Lanes* x, const Lanes* x_operand, const Lanes* q, int64_t rows,
                                                      int64_t cols, bool add_a, float a_value,
                                                      PolarRounding rounding) {
  const int64_t side = std::min(rows, cols);
  const bool wide = rows <= cols;
  const Lanes a = splat(a_value);
  Lanes block[kDotWidth];
  for (int64_t i = 0; i < rows; ++i) {
    for (int64_t j = 0; j < cols; j += kDotWidth) {
      const int64_t width = std::min<int64_t>(kDotWidth, cols - j);
      if (wide) {
        dot_block<kArithmetic.fused>(q + i * side, 1, x_operand + j, cols, 1, side, width, block);
      } else {
        dot_block<kArithmetic.fused>(x_operand + i * cols, 1, q + j, side, 1, side, width, block);
      }
      for (int64_t t = 0; t < width; ++t) {
        // The 16-bit iterations add a X with one rounding (a X + sum).
        const Lanes sum = !add_a ? block[t]
                          : kArithmetic.fused ? fused_multiply_add(a, x_operand[i * cols + j + t], block[t])
                                              : block[t] + a * x_operand[i * cols + j + t];
        x[i * cols + j + t] = round_output<kArithmetic>(sum, rounding);
      }
    }
  }
}

// The lines of a SmallPrefetch issued in step with the iterations: after
// each of `total` paces (kPacesPerStandardStep per standard iteration step,
// one per Gram iteration step), up to its share of them, so the loads overlap
// the arithmetic instead of queueing at once. Into L2 (prefetcht1): into L1,
// a run's next lines (about 40 KB for 8x8) evicted the iterations' own
// buffers; L2 and three paces per step together took the 70,000 8x8 step
// from 1 to 0.91-0.94 (1 thread) and 0.96-0.97 (2 threads), where L2 alone
// or the paces alone gave 0.96-0.99 (docs/design.md "CPU kernels").
constexpr int64_t kPacesPerStandardStep = 3;

class PrefetchPacer {
 public:
  PrefetchPacer(const SmallPrefetch* prefetch, int64_t total)
      : ranges_(prefetch != nullptr ? prefetch->ranges : nullptr), total_(std::max<int64_t>(total, 1)) {
    for (int64_t r = 0; prefetch != nullptr && r < prefetch->count; ++r) count_ += ranges_[r].lines;
  }
  __attribute__((always_inline)) void step() { issue_up_to(count_ * std::min(++done_, total_) / total_); }
  __attribute__((always_inline)) void finish() { issue_up_to(count_); }

 private:
  __attribute__((always_inline)) void issue_up_to(int64_t end) {
    for (; issued_ < end; ++issued_) {
      const PrefetchRange& range = ranges_[range_];
      const char* line = reinterpret_cast<const char*>(range.first_line + uintptr_t(64 * line_));
      __builtin_prefetch(line, 0, 2);
      if (++line_ == range.lines) ++range_, line_ = 0;
    }
  }
  const PrefetchRange* ranges_;
  int64_t total_, count_ = 0, done_ = 0, issued_ = 0, range_ = 0, line_ = 0;
};

// The iterations on one group of matrices in lanes: x [rows * cols], its
// operand copy, gram and poly [side * side]. Every product entry is a sum over
// k ascending (dot_block), so the bits do not depend on the blocking. With
// kRows, kCols > 0 the shape is a compile-time constant (the loops unroll);
// the operations and their order are the same.
template <int64_t kRows, int64_t kCols, Arithmetic kArithmetic>
__attribute__((always_inline)) inline void standard_iterations(Lanes* x, Lanes* x_operand, Lanes* gram, Lanes* poly,
                                                               int64_t rows_value, int64_t cols_value,
                                                               const float* abc_list, int64_t steps,
                                                               PolarRounding rounding, PrefetchPacer& pacer) {
  const int64_t rows = kRows > 0 ? kRows : rows_value, cols = kCols > 0 ? kCols : cols_value;
  const int64_t side = std::min(rows, cols), length = std::max(rows, cols);
  const bool wide = rows <= cols;
  // V = X (wide) or X^T (tall): V(i, k) = x[i * v_row + k * v_col].
  const int64_t v_row = wide ? cols : 1, v_col = wide ? 1 : cols;
  for (int64_t e = 0; e < rows * cols; ++e) x[e] = round_output<kArithmetic>(x[e], rounding);
  // X moves between the two buffers each step (no operand copy), and back into x at the end.
  Lanes *current = x, *next = x_operand;
  for (int64_t step = 0; step < steps; ++step) {
    const float a = abc_list[3 * step], b = abc_list[3 * step + 1], c = abc_list[3 * step + 2];
    gram_of<kArithmetic>(current, gram, side, length, v_row, v_col, rounding);       // gram = V V^T
    pacer.step();
    symmetric_product<kArithmetic>(poly, gram, gram, gram, side, c, b, rounding);    // poly = c (gram gram) + b gram
    pacer.step();
    multiply_x<kArithmetic>(next, current, poly, rows, cols, true, a, rounding);     // X = poly X + a X (or X poly + a X)
    std::swap(current, next);
    pacer.step();
  }
  if (current != x) std::copy(current, current + rows * cols, x);
}

// The shapes of many-matrix stacks (per-head blocks, MoE-like (n, 1, 1)
// params) get an unrolled instance for the default polar_dtype (BF16 rounding).
template <Arithmetic kArithmetic>
__attribute__((always_inline)) inline void iterate_group(
    Lanes* x, Lanes* x_operand, Lanes* gram, Lanes* poly, int64_t rows, int64_t cols, const float* abc_list,
    int64_t steps, PolarRounding rounding, PrefetchPacer& pacer) {
  if constexpr (kArithmetic.fused) {
    if (rows == 8 && cols == 8 && rounding == PolarRounding::kBFloat16) {
      return standard_iterations<8, 8, kArithmetic>(x, x_operand, gram, poly, 8, 8, abc_list, steps,
                                                    PolarRounding::kBFloat16, pacer);
    }
    if (rows == 1 && cols == 1 && rounding == PolarRounding::kBFloat16) {
      return standard_iterations<1, 1, kArithmetic>(x, x_operand, gram, poly, 1, 1, abc_list, steps,
                                                    PolarRounding::kBFloat16, pacer);
    }
  }
  standard_iterations<0, 0, kArithmetic>(x, x_operand, gram, poly, rows, cols, abc_list, steps, rounding, pacer);
}

// Gram Newton-Schulz on one group in lanes, op for op polar_gram_plan's (the
// buffer copies there are pointer swaps here): x and x_operand [rows * cols],
// r, z, q, spare [side * side].
template <Arithmetic kArithmetic>
__attribute__((always_inline)) inline void iterate_group_gram(
    Lanes* x, Lanes* x_operand, Lanes* r, Lanes* z, Lanes* q, Lanes* spare, int64_t rows, int64_t cols,
    const float* abc_list, int64_t steps, PolarRounding rounding, PrefetchPacer& pacer) {
  const int64_t side = std::min(rows, cols), length = std::max(rows, cols);
  const bool wide = rows <= cols;
  const int64_t v_row = wide ? cols : 1, v_col = wide ? 1 : cols;
  for (int64_t e = 0; e < rows * cols; ++e) x[e] = round_output<kArithmetic>(x[e], rounding);
  if (steps <= 0) return;
  gram_of<kArithmetic>(x, r, side, length, v_row, v_col, rounding);
  const int restart_period = polar_gram_restart_period(rounding != PolarRounding::kNone);
  bool fresh = true;
  for (int64_t k = 0; k < steps; ++k) {
    if (polar_gram_restarts_before(static_cast<int>(k), restart_period)) {
      std::copy(x, x + rows * cols, x_operand);
      multiply_x<kArithmetic>(x, x_operand, q, rows, cols, false, 0.0f, rounding);
      gram_of<kArithmetic>(x, r, side, length, v_row, v_col, rounding);
      fresh = true;
    }
    const float a = abc_list[3 * k], b = abc_list[3 * k + 1], c = abc_list[3 * k + 2];
    symmetric_product<kArithmetic>(z, r, r, r, side, c, b, rounding);  // Z = c R R + b R
    if (fresh) {  // Q = Z + a I
      std::copy(z, z + side * side, q);
      for (int64_t i = 0; i < side; ++i) q[i * (side + 1)] = round_output<kArithmetic>(q[i * (side + 1)] + splat(a), rounding);
      fresh = false;
    } else {  // Q = Q Z + a Q
      symmetric_product<kArithmetic>(spare, q, z, q, side, 1.0f, a, rounding);
      std::swap(q, spare);
    }
    if (k + 1 < steps && !polar_gram_restarts_before(static_cast<int>(k + 1), restart_period)) {  // R = Z (R Z + a R) + a (R Z + a R)
      symmetric_product<kArithmetic>(spare, r, z, r, side, 1.0f, a, rounding);
      symmetric_product<kArithmetic>(r, z, spare, spare, side, 1.0f, a, rounding);
    }
    pacer.step();
  }
  std::copy(x, x + rows * cols, x_operand);
  multiply_x<kArithmetic>(x, x_operand, q, rows, cols, false, 0.0f, rounding);
}

// Sum of squares of x[0], x[stride], ... (count of them) per lane, in double:
// muon_elementwise.h's sum_of_squares lane by lane (eight interleaved accumulators,
// the tail into the first, combined in the same fixed order), so the same bits.
__attribute__((always_inline)) inline LaneDoubles lane_sum_of_squares(const Lanes* x, int64_t stride,
                                                                      int64_t count) {
  LaneDoubles acc[8];
  for (LaneDoubles& a : acc) a = LaneDoubles{};
  int64_t k = 0;
  if (count >= 8) {  // 0 + v * v is v * v, bit for bit (a square is +0, positive or a quiet NaN): no add
    for (int l = 0; l < 8; ++l) {
      const LaneDoubles v = __builtin_convertvector(x[l * stride], LaneDoubles);
      acc[l] = v * v;
    }
    k = 8;
  }
  for (; k + 8 <= count; k += 8) {
    for (int l = 0; l < 8; ++l) {
      const LaneDoubles v = __builtin_convertvector(x[(k + l) * stride], LaneDoubles);
      acc[l] = acc[l] + v * v;
    }
  }
  for (; k < count; ++k) {
    const LaneDoubles v = __builtin_convertvector(x[k * stride], LaneDoubles);
    acc[0] = acc[0] + v * v;
  }
  return ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
}

// muon_math.h's operations on lanes, in this build's instruction set: IEEE
// square roots and comparisons, so every lane gets the scalar rule's bits.
struct LaneMath {
  __attribute__((always_inline)) static Lanes sqrt(Lanes x) {
#if defined(__AVX512F__)
    return (Lanes)_mm512_sqrt_ps((__m512)x);
#elif defined(__AVX__)
    __m256 halves[2];
    std::memcpy(halves, &x, sizeof(halves));
    for (__m256& h : halves) h = _mm256_sqrt_ps(h);
    std::memcpy(&x, halves, sizeof(x));
    return x;
#else
    for (int l = 0; l < kLanes; ++l) x[l] = __builtin_sqrtf(x[l]);
    return x;
#endif
  }
  // x > floor ? x : floor per lane (floor for NaN).
  __attribute__((always_inline)) static Lanes at_least(Lanes x, float floor) {
    const LaneBits above = (LaneBits)(x > splat(floor));
    return from_bits((to_bits(x) & above) | (to_bits(splat(floor)) & ~above));
  }
};

// NorMuon on a group in lanes, then x times each lane's multipliers:
// muon_elementwise.h's normuon_matrix_multipliers and fold, lane by lane, the
// per-element rules from csrc/common/muon_math.h. Lane m's second moments are
// at second_moments[m] (members lanes). Scratch: sums [len] doubles (then
// the second moments in lanes), vm and mult [len] Lanes.
__attribute__((always_inline)) inline void lane_normuon(Lanes* x, int64_t rows, int64_t cols, int64_t members,
                                                        float* const* second_moments, float beta2,
                                                        LaneDoubles* sums, Lanes* vm, Lanes* mult) {
  const int64_t len = shapes::stat_length(rows, cols), red = shapes::reduced_length(rows, cols);
  const bool per_row = shapes::stats_per_row(rows, cols);
  if (per_row) {
    for (int64_t r = 0; r < rows; ++r) sums[r] = lane_sum_of_squares(x + r * cols, 1, cols);
  } else {
    for (int64_t c = 0; c < cols; ++c) sums[c] = LaneDoubles{};
    for (int64_t r = 0; r < rows; ++r) {
      for (int64_t c = 0; c < cols; ++c) {
        const LaneDoubles v = __builtin_convertvector(x[r * cols + c], LaneDoubles);
        sums[c] = sums[c] + v * v;
      }
    }
  }
  const Lanes reduced = splat(float(red));
  // normuon_mean_square. Dividing by a power of two is multiplying by its
  // reciprocal, bit for bit (both round the same exact quotient), without
  // the divider's ten cycles per vector.
  if (red > 0 && (red & (red - 1)) == 0) {
    const Lanes reciprocal = splat(1.0f / float(red));
    for (int64_t i = 0; i < len; ++i) vm[i] = __builtin_convertvector(sums[i], Lanes) * reciprocal;
  } else {
    for (int64_t i = 0; i < len; ++i) vm[i] = __builtin_convertvector(sums[i], Lanes) / reduced;
  }
  // The second moments into lanes (where the spent sums were; zeros in lanes
  // without a matrix, never read back), updated, and back.
  Lanes* smb = reinterpret_cast<Lanes*>(sums);
  // A full group whose matrices' moments lie one after another (the fused
  // step's) moves them with one gather and one scatter per statistic: lane
  // by lane through memory, each vector would wait for its sixteen stores.
  bool strided = members == kLanes;
  for (int64_t m = 1; strided && m < members; ++m) strided = second_moments[m] == second_moments[0] + m * len;
#if defined(__AVX512F__)
  const __m512i offsets = _mm512_mullo_epi32(
      _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15), _mm512_set1_epi32(int32_t(len)));
#else
  strided = false;
#endif
  if (strided) {
#if defined(__AVX512F__)
    for (int64_t i = 0; i < len; ++i) smb[i] = (Lanes)_mm512_i32gather_ps(offsets, second_moments[0] + i, 4);
#endif
  } else {
    for (int64_t i = 0; i < len; ++i) smb[i] = splat(0.0f);
    for (int64_t m = 0; m < members; ++m) {
      for (int64_t i = 0; i < len; ++i) smb[i][m] = second_moments[m][i];
    }
  }
  for (int64_t i = 0; i < len; ++i) {
    smb[i] = lerp_of(smb[i], vm[i], 1.0f - beta2);
    mult[i] = normuon_step_size_of<Lanes, LaneMath>(smb[i]);
  }
  if (strided) {
#if defined(__AVX512F__)
    for (int64_t i = 0; i < len; ++i) _mm512_i32scatter_ps(second_moments[0] + i, offsets, (__m512)smb[i], 4);
#endif
  } else {
    for (int64_t m = 0; m < members; ++m) {
      for (int64_t i = 0; i < len; ++i) second_moments[m][i] = smb[i][m];
    }
  }
  Lanes sum_vm = splat(0.0f), sum_scaled = splat(0.0f);
  for (int64_t i = 0; i < len; ++i) {
    sum_vm = sum_vm + vm[i];
    sum_scaled = sum_scaled + ((vm[i] * reduced) * mult[i]) * mult[i];
  }
  const Lanes ratio = normuon_norm_ratio_of<Lanes, LaneMath>(sum_vm, sum_scaled, red);
  for (int64_t i = 0; i < len; ++i) mult[i] = mult[i] * ratio;
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < cols; ++c) x[r * cols + c] = x[r * cols + c] * mult[per_row ? r : c];
  }
}

// rows[0..16) transposed in registers: after the stages with h = 8, 4, 2, 1
// (each swapping the off-diagonal h x h blocks of every 2h x 2h block, two
// two-source shuffles per row pair) rows[j][i] holds the old rows[i][j].
__attribute__((always_inline)) inline void transpose_16x16(Lanes* rows) {
  static_assert(kLanes == 16, "the shuffle masks are written for 16 lanes");
  const LaneMask low[4] = {{0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23},
                           {0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27},
                           {0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29},
                           {0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30}};
  const LaneMask high[4] = {{8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31},
                            {4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31},
                            {2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31},
                            {1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29, 15, 31}};
  // Unrolled, so that the rows stay in registers (GCC keeps the stage loop otherwise, through the stack).
#pragma GCC unroll 4
  for (int stage = 0, h = 8; stage < 4; ++stage, h /= 2) {
#pragma GCC unroll 16
    for (int i = 0; i < kLanes; ++i) {
      if ((i & h) != 0) continue;
      const Lanes a = rows[i], b = rows[i + h];
      rows[i] = __builtin_shuffle(a, b, low[stage]);
      rows[i + h] = __builtin_shuffle(a, b, high[stage]);
    }
  }
}

// Whether every lane of x[0..count) holds a finite value: x - x is 0 for
// finite x and NaN otherwise, and a NaN survives the sums (eight of them,
// so the additions do not wait on one another).
__attribute__((always_inline)) inline bool all_finite(const Lanes* x, int64_t count) {
  Lanes sums[8];
  for (Lanes& s : sums) s = splat(0.0f);
  int64_t e = 0;
  for (; e + 8 <= count; e += 8) {  // unrolled, so the sums stay in registers
    for (int l = 0; l < 8; ++l) sums[l] = sums[l] + (x[e + l] - x[e + l]);
  }
  for (; e < count; ++e) sums[e % 8] = sums[e % 8] + (x[e] - x[e]);
  const Lanes sum = ((sums[0] + sums[1]) + (sums[2] + sums[3])) + ((sums[4] + sums[5]) + (sums[6] + sums[7]));
  return !any_lane(~below((LaneMask)(to_bits(sum) & 0x7FFFFFFFu), 0x7F800000));
}

// The iterations on one group in the arithmetic of its polar_dtype: the
// 16-bit ones with fused multiply-adds (exact products), and BF16 rounding
// without its NaN case where the group's values are finite.
__attribute__((always_inline)) inline void iterate_group_in(Lanes* x, Lanes* squares, int64_t rows, int64_t cols,
                                                            const float* abc, int64_t steps, PolarRounding rounding,
                                                            bool gram, bool finite, PrefetchPacer& pacer) {
  const int64_t n = rows * cols, side = std::min(rows, cols);
  auto run = [&](auto arithmetic) {
    constexpr Arithmetic kArithmetic = decltype(arithmetic)::value;
    if (gram) {
      iterate_group_gram<kArithmetic>(x, x + n, squares, squares + side * side, squares + 2 * side * side,
                                      squares + 3 * side * side, rows, cols, abc, steps, rounding, pacer);
    } else {
      iterate_group<kArithmetic>(x, x + n, squares, squares + side * side, rows, cols, abc, steps, rounding, pacer);
    }
  };
  switch (rounding) {
    case PolarRounding::kBFloat16:
      if (finite) return run(std::integral_constant<Arithmetic, Arithmetic{true, true}>{});
      return run(std::integral_constant<Arithmetic, Arithmetic{true, false}>{});
    case PolarRounding::kFloat16: return run(std::integral_constant<Arithmetic, Arithmetic{true, false}>{});
    case PolarRounding::kNone: return run(std::integral_constant<Arithmetic, Arithmetic{false, false}>{});
  }
}

// The groups of `count` matrices at xs: each transposed into the lanes
// (scaled on the way in), iterated, and transposed back. Everything above is
// inlined into it (compiled for this build's instruction set).
void iterate_groups(
    float* xs, bool scale_by_input_norm, int64_t count, int64_t rows, int64_t cols, const float* abc,
    int64_t steps, PolarRounding rounding, bool gram, const SmallNorMuon* normuon, const SmallPrefetch* prefetch,
    Lanes* x) {
  const int64_t n = rows * cols, side = std::min(rows, cols), len = shapes::stat_length(rows, cols);
  Lanes* squares = x + 2 * n;
  // NorMuon scratch after the iteration buffers: sums (2 Lanes each), vm, mult.
  Lanes* stats = squares + (gram ? 4 : 2) * side * side;
  float* lanes = reinterpret_cast<float*>(x);  // lane m of vector e at lanes[e * kLanes + m]
  PrefetchPacer pacer(prefetch, (count + kLanes - 1) / kLanes * steps * (gram ? 1 : kPacesPerStandardStep));
  for (int64_t first = 0; first < count; first += kLanes) {
    const int64_t members = std::min<int64_t>(kLanes, count - first);
    float* base = xs + first * n;
    // A full group of matrices with n a multiple of 16: 16 x 16 blocks
    // transposed in registers; else element by element.
    const bool blocks = members == kLanes && n % kLanes == 0;
    Lanes block[kLanes];
    auto load_group = [&] {
    if (members == kLanes && n == 1) {  // (n, 1, 1) stacks: the lanes are the matrices, in order
      std::memcpy(x, base, sizeof(Lanes));
    } else if (blocks) {
      for (int64_t e = 0; e < n; e += kLanes) {
        for (int m = 0; m < kLanes; ++m) std::memcpy(&block[m], base + m * n + e, sizeof(Lanes));
        transpose_16x16(block);
        for (int j = 0; j < kLanes; ++j) x[e + j] = block[j];
      }
    } else {
      for (int64_t m = 0; m < members; ++m) {
        for (int64_t e = 0; e < n; ++e) lanes[e * kLanes + m] = base[m * n + e];
      }
      for (int64_t m = members; m < kLanes; ++m) {  // missing members: zero matrices, never read back
        for (int64_t e = 0; e < n; ++e) lanes[e * kLanes + m] = 0.0f;
      }
    }
    if (scale_by_input_norm) {
      // u * polar_input_scale(float(sum of squares of u)) per lane, as the unfused path.
      const Lanes sums = __builtin_convertvector(lane_sum_of_squares(x, 1, n), Lanes);
      const Lanes scale = polar_input_scale_of<Lanes, LaneMath>(sums);
      for (int64_t e = 0; e < n; ++e) x[e] = x[e] * scale;
    }
    };
    load_group();
    if (rounding == PolarRounding::kBFloat16 && all_finite(x, n)) {
      // From finite values, the iterations make a NaN or an infinity only by
      // overflow, and it reaches X; then the group runs again with the NaN
      // case, for round_bf16's bits.
      iterate_group_in(x, squares, rows, cols, abc, steps, rounding, gram, true, pacer);
      if (!all_finite(x, n)) {
        load_group();
        iterate_group_in(x, squares, rows, cols, abc, steps, rounding, gram, false, pacer);
      }
    } else {
      iterate_group_in(x, squares, rows, cols, abc, steps, rounding, gram, false, pacer);
    }
    if (normuon != nullptr) {
      lane_normuon(x, rows, cols, members, normuon->second_moments + first, normuon->beta2,
                   reinterpret_cast<LaneDoubles*>(stats), stats + 2 * len, stats + 3 * len);
    }
    if (members == kLanes && n == 1) {
      std::memcpy(base, x, sizeof(Lanes));
    } else if (blocks) {
      for (int64_t e = 0; e < n; e += kLanes) {
        for (int j = 0; j < kLanes; ++j) block[j] = x[e + j];
        transpose_16x16(block);
        for (int m = 0; m < kLanes; ++m) std::memcpy(base + m * n + e, &block[m], sizeof(Lanes));
      }
    } else {
      for (int64_t m = 0; m < members; ++m) {
        for (int64_t e = 0; e < n; ++e) base[m * n + e] = lanes[e * kLanes + m];
      }
    }
  }
  pacer.finish();
}

}  // namespace

void polar_small_groups(float* xs, bool scale_by_input_norm, int64_t count, int64_t rows, int64_t cols,
                        const float* abc, int64_t steps, PolarRounding rounding, bool gram,
                        const SmallNorMuon* normuon, const SmallPrefetch* prefetch, float* scratch) {
  iterate_groups(xs, scale_by_input_norm, count, rows, cols, abc, steps, rounding, gram, normuon, prefetch,
                 reinterpret_cast<Lanes*>(scratch));
}

}  // namespace CPU_CAPABILITY
}  // namespace cpu
}  // namespace muon_ext

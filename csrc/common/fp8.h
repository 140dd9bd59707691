// FP32 -> float8 e4m3fn (1 sign, 4 exponent bits with bias 7, 3 mantissa
// bits, no infinities, NaN = S.1111.111) and the block scaling rule of
// quantize_fp8 (docs/design.md, "FP8 quantization").
//
// Bit math (integer, plus one exact-by-IEEE float addition) written once for
// host and device, so the CPU and CUDA kernels give the same bits (as
// common/remainder.h does for BF16):
//   * round to nearest even, saturating: |x| >= 448 (inf included) gives
//     +-448 (0x7E / 0xFE), as CUDA's __NV_SATFINITE and torch's own
//     conversion do; values below 2^-10 (half the smallest subnormal, 2^-9)
//     round to a signed zero;
//   * NaN gives NaN with the input's sign (0x7F / 0xFF);
//   * the scale of a block comes from the largest magnitude of its *finite*
//     elements (NaN and +-inf are left out, so one bad element does not turn
//     its whole block into NaN or zeros): scale_inv = amax / 448 in FP32,
//     and 1 where that is zero (an all-zero block, or amax < 448 * 2^-150
//     where the division underflows), then q = fp8(x / scale_inv).
#pragma once

#include <cstdint>

#include "bits.h"
#include "macros.h"

namespace muon_ext {

constexpr float kFp8E4M3Max = 448.0f;

// a where c, else b, as a mask: GCC turns ternaries here into branches and
// then leaves the CPU loops scalar; masks keep them vectorizable.
MUON_HD uint32_t fp8_select(bool c, uint32_t a, uint32_t b) {
  const uint32_t mask = 0u - uint32_t(c);
  return (a & mask) | (b & ~mask);
}

// |x|'s bit pattern when x is finite, else 0.  For non-negative floats the
// bit patterns order like the values, so the block amax is an integer max:
// exact, and the same in any reduction order.  Below 2^31, so it also
// compares as int32 (SSE2 has signed 32-bit compares only).
MUON_HD uint32_t fp8_amax_bits(float x) {
  const uint32_t magnitude = float_to_bits(x) & 0x7FFFFFFFu;
  return fp8_select(int32_t(magnitude) < 0x7F800000, magnitude, 0u);
}

// scale_inv of a block whose fp8_amax_bits maximum is `amax_bits`.
MUON_HD float fp8_scale_inv(uint32_t amax_bits) {
  const float scale_inv = bits_to_float(amax_bits) / kFp8E4M3Max;
  return scale_inv == 0.0f ? 1.0f : scale_inv;
}

// Round-to-nearest-even FP32 -> e4m3fn bits, saturating at +-448.  Written
// without branches (every case computed, then selected) so the CPU loops
// vectorize; each case is exact integer or IEEE arithmetic.  Magnitudes are
// below 2^31: compared as int32.
MUON_HD uint8_t float_to_fp8_e4m3_bits(float x) {
  const uint32_t u = float_to_bits(x);
  const uint32_t sign = (u >> 24) & 0x80u;
  const uint32_t magnitude = u & 0x7FFFFFFFu;
  const int32_t m = int32_t(magnitude);
  // Normal e4m3 (|x| >= 2^-6): keep 3 of the 23 mantissa bits, ties to even;
  // a carry moves into the exponent, and below 448 never reaches the NaN
  // code.  Rebias the exponent from 127 to 7: subtract 120 << 3 from
  // (exponent << 3 | mantissa).
  const uint32_t rounded = magnitude + 0x7FFFFu + ((magnitude >> 20) & 1u);
  const uint32_t normal = (rounded >> 20) - (120u << 3);
  // Subnormal e4m3 (steps of 2^-9, |x| < 2^-6): adding 2^14, whose FP32 ulp
  // is 2^-9, rounds |x| to a multiple of 2^-9 (nearest even, by IEEE
  // addition); the low bits of the sum count those steps (0..8, where 8 is
  // 2^-6's code).  The sum is never subnormal, and an FP32-subnormal |x|
  // gives 0 with or without flush-to-zero.
  const uint32_t subnormal = float_to_bits(bits_to_float(magnitude) + 16384.0f) - 0x46800000u;
  uint32_t code = fp8_select(m >= 0x3C800000, normal, subnormal);
  code = fp8_select(m >= 0x43E00000, 0x7Eu, code);  // >= 448, inf: saturate
  code = fp8_select(m > 0x7F800000, 0x7Fu, code);   // NaN
  return uint8_t(sign | code);
}

// e4m3fn bits -> FP32 (exact); for the C++ tests (Python dequantizes with torch).
MUON_HD float fp8_e4m3_bits_to_float(uint8_t q) {
  const uint32_t sign = uint32_t(q & 0x80u) << 24;
  const uint32_t exponent = (q >> 3) & 0xFu;
  const uint32_t mantissa = q & 0x7u;
  if (exponent == 0xFu && mantissa == 0x7u) return bits_to_float(sign | 0x7FC00000u);
  if (exponent != 0) return bits_to_float(sign | ((exponent + 120u) << 23) | (mantissa << 20));
  // Subnormal: mantissa * 2^-9, exact in FP32.
  return bits_to_float(sign | float_to_bits(float(mantissa) * (1.0f / 512.0f)));
}

// One element of quantize_fp8: q = fp8(x / scale_inv).  A NaN's sign is taken
// from x, not from the quotient: a GPU's division returns a canonical NaN.
MUON_HD uint8_t quantize_fp8_element(float x, float scale_inv) {
  const uint32_t u = float_to_bits(x);
  const uint32_t nan = ((u >> 24) & 0x80u) | 0x7Fu;
  return uint8_t(fp8_select(int32_t(u & 0x7FFFFFFFu) > 0x7F800000, nan, float_to_fp8_e4m3_bits(x / scale_inv)));
}

}  // namespace muon_ext

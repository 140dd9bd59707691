// Bit-level conversions between FP32 and the 16-bit float formats.
//
// Written once for host and device so CPU and CUDA kernels round identically:
// the BF16 and FP16 writers below are IEEE round-to-nearest-even, matching
// torch's `.to(bfloat16)` / `.to(float16)` (NaN becomes a canonical quiet NaN).
#pragma once

#include <cstdint>
#include <cstring>

#include "macros.h"

namespace muon_ext {

MUON_HD uint32_t float_to_bits(float x) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(x);
#else
  uint32_t u;
  std::memcpy(&u, &x, sizeof(u));
  return u;
#endif
}

MUON_HD float bits_to_float(uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  float x;
  std::memcpy(&x, &u, sizeof(x));
  return x;
#endif
}

MUON_HD float bf16_bits_to_float(uint16_t h) { return bits_to_float(uint32_t(h) << 16); }

// The round-to-nearest-even step of FP32 -> BF16 on the bits u of a non-NaN
// FP32: the BF16 in the high half, the low half zero (a carry out of the
// mantissa rounds up the exponent; the largest finite values round to inf).
// A template so that the vector kernels (GCC vectors of uint32_t:
// cpu/polar_small_kernel.cpp, cpu/bf16_tile_gemm.cpp) share this one line;
// always inlined, so the vector ABI warning does not apply.
#if !defined(__CUDACC__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wpsabi"
#endif
template <class Bits>
MUON_HD_ALWAYS_INLINE Bits bf16_rne_high_bits(Bits u) {
  return (u + (0x7FFFu + ((u >> 16) & 1u))) & 0xFFFF0000u;
}
#if !defined(__CUDACC__)
#pragma GCC diagnostic pop
#endif

// Round-to-nearest-even FP32 -> BF16, as c10::BFloat16 does.
MUON_HD uint16_t float_to_bf16_bits_rne(float x) {
  const uint32_t u = float_to_bits(x);
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) return uint16_t(0x7FC0);
  return uint16_t(bf16_rne_high_bits(u) >> 16);
}

// IEEE binary16 -> FP32 (exact).
MUON_HD float half_bits_to_float(uint16_t h) {
  const uint32_t sign = uint32_t(h & 0x8000u) << 16;
  const uint32_t exponent = (h >> 10) & 0x1Fu;
  uint32_t mantissa = h & 0x3FFu;
  if (exponent == 0x1Fu) {  // inf / NaN
    return bits_to_float(sign | 0x7F800000u | (mantissa << 13));
  }
  if (exponent != 0) {
    return bits_to_float(sign | ((exponent + 112u) << 23) | (mantissa << 13));
  }
  if (mantissa == 0) return bits_to_float(sign);
  // Subnormal half: normalize.
  uint32_t e = 113;
  while ((mantissa & 0x400u) == 0) {
    mantissa <<= 1;
    --e;
  }
  mantissa &= 0x3FFu;
  return bits_to_float(sign | (e << 23) | (mantissa << 13));
}

// FP32 -> IEEE binary16 with round-to-nearest-even; overflow gives inf.
MUON_HD uint16_t float_to_half_bits_rne(float x) {
  const uint32_t u = float_to_bits(x);
  const uint16_t sign = uint16_t((u >> 16) & 0x8000u);
  const uint32_t abs_u = u & 0x7FFFFFFFu;
  if (abs_u > 0x7F800000u) return uint16_t(sign | 0x7E00u);  // NaN
  if (abs_u >= 0x47800000u) return uint16_t(sign | 0x7C00u);  // >= 65536: inf
  if (abs_u >= 0x38800000u) {  // normal half range
    const uint32_t rounded = abs_u + 0xFFFu + ((abs_u >> 13) & 1u);
    const uint32_t h = (rounded >> 13) - (112u << 10);
    return uint16_t(sign | (h >= 0x7C00u ? 0x7C00u : h));
  }
  if (abs_u < 0x33000000u) return sign;  // below half the smallest subnormal: +-0
  // Subnormal half: shift the implicit-one mantissa into place, round to nearest even.
  const uint32_t exponent = abs_u >> 23;
  const uint32_t mantissa = (abs_u & 0x7FFFFFu) | 0x800000u;
  const uint32_t shift = 126u - exponent;  // 14..24
  const uint32_t halfway = 1u << (shift - 1);
  const uint32_t remainder = mantissa & ((1u << shift) - 1u);
  uint32_t h = mantissa >> shift;
  if (remainder > halfway || (remainder == halfway && (h & 1u))) ++h;
  return uint16_t(sign | h);
}

}  // namespace muon_ext

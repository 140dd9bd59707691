// BF16 + int16 remainder representation of an FP32 master weight.
//
// Convention of TransformerEngine's AdamFunctorMasterParamRemainder: the FP32
// bit pattern b splits into hi = b >> 16 and lo = b & 0xFFFF; the remainder is
// lo reinterpreted as int16 and the stored BF16 is hi rounded half-up on the
// bit pattern, (hi + (lo >= 0x8000)) mod 2^16.  This is not round-to-nearest-
// even: ties with an even hi and NaN patterns differ.  The pair reconstructs b
// exactly for every one of the 2^32 patterns:
//   b == (bf16_bits << 16) + sign_extend(rem)   (mod 2^32)
#pragma once

#include <cstdint>

#include "bits.h"
#include "macros.h"

namespace muon_ext {

struct RemainderSplit {
  uint16_t bf16_bits;
  int16_t remainder;
};

MUON_HD RemainderSplit split_master_bits(uint32_t bits) {
  const uint32_t lo = bits & 0xFFFFu;
  const uint32_t hi = bits >> 16;
  RemainderSplit out;
  out.remainder = int16_t(uint16_t(lo));
  out.bf16_bits = uint16_t(hi + (lo >= 0x8000u ? 1u : 0u));
  return out;
}

MUON_HD uint32_t merge_master_bits(uint16_t bf16_bits, int16_t remainder) {
  return (uint32_t(bf16_bits) << 16) + uint32_t(int32_t(remainder));
}

MUON_HD RemainderSplit split_master(float master) { return split_master_bits(float_to_bits(master)); }

MUON_HD float merge_master(uint16_t bf16_bits, int16_t remainder) {
  return bits_to_float(merge_master_bits(bf16_bits, remainder));
}

}  // namespace muon_ext

// BF16 + int16 remainder representation of an FP32 master weight.
//
// Convention of TransformerEngine's AdamFunctorMasterParamRemainder: the FP32
// bit pattern b splits into hi = b >> 16 and lo = b & 0xFFFF; the remainder is
// lo reinterpreted as int16 and the stored BF16 is hi rounded half-up on the
// bit pattern, (hi + (lo >= 0x8000)) mod 2^16.  This is not round-to-nearest-
// even: ties with an even hi differ.  Merge: b = (bf16_bits << 16) +
// sign_extend(rem) mod 2^32.
//
// One departure (docs/design.md, "Master weights and remainders"): on a NaN
// master that rule can give a non-NaN BF16 (the carry wraps 0x7FFF to -0.0,
// or no carry leaves 0x7F80 = inf), hiding the NaN from the model.  For NaN
// masters the BF16 stays in the NaN range 0x7F81..0x7FFF (sign kept): the
// high half moves by one where the rule would leave it; the remainder stays
// lo.  So the pair round-trips exactly on
// every pattern except those 2^17 - 2 NaNs, which merge to a NaN with the same
// sign and low half, the high half moved by one.
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
  const int32_t magnitude = int32_t(bits & 0x7FFFFFFFu);
  // TransformerEngine's hi + carry, corrected on the two NaN ranges it would
  // hide: a high half 0x7F80 without a carry (BF16 inf) takes one, and 0x7FFF
  // with a carry (wrapping into the sign bit, BF16 zero) drops it. Compares
  // and adds, no branch: this runs per element in every remainder kernel.
  const uint32_t up = uint32_t((magnitude > 0x7F800000) & (magnitude < 0x7F808000));
  const uint32_t down = uint32_t(magnitude >= 0x7FFF8000);
  RemainderSplit out;
  out.remainder = int16_t(uint16_t(lo));
  out.bf16_bits = uint16_t((bits >> 16) + (lo >> 15) + up - down);
  return out;
}

// TransformerEngine's merge, unchanged: a NaN BF16 (magnitude 0x7F81..0x7FFF)
// merges to a NaN for every remainder (a negative one lowers the high half by
// one, at worst to 0x7F80, and then leaves a low half >= 0x8000), so the
// split's NaN rule needs no counterpart here.
MUON_HD uint32_t merge_master_bits(uint16_t bf16_bits, int16_t remainder) {
  return (uint32_t(bf16_bits) << 16) + uint32_t(int32_t(remainder));
}

MUON_HD RemainderSplit split_master(float master) { return split_master_bits(float_to_bits(master)); }

MUON_HD float merge_master(uint16_t bf16_bits, int16_t remainder) {
  return bits_to_float(merge_master_bits(bf16_bits, remainder));
}

}  // namespace muon_ext

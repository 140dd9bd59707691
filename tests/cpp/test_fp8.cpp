// FP32 -> float8 e4m3fn bit math (csrc/common/fp8.h): every e4m3 value round-
// trips, midpoints round to even, and over a sweep of FP32 patterns the
// result equals torch's own saturating conversion (c10::Float8_e4m3fn).
#include <gtest/gtest.h>

#include <c10/util/Float8_e4m3fn.h>

#include <cmath>
#include <cstdint>
#include <limits>

#include "csrc/common/bits.h"
#include "csrc/common/fp8.h"

namespace muon_ext {
namespace {

bool is_nan_code(uint32_t code) { return (code & 0x7Fu) == 0x7Fu; }

TEST(Fp8, EveryFiniteCodeRoundTrips) {
  for (uint32_t code = 0; code < 256; ++code) {
    if (is_nan_code(code)) continue;
    const float value = fp8_e4m3_bits_to_float(uint8_t(code));
    const float torch_value = static_cast<float>(c10::Float8_e4m3fn(uint8_t(code), c10::Float8_e4m3fn::from_bits()));
    EXPECT_EQ(float_to_bits(value), float_to_bits(torch_value)) << "code " << code;
    EXPECT_EQ(float_to_fp8_e4m3_bits(value), code) << "value " << value;
  }
  EXPECT_EQ(fp8_e4m3_bits_to_float(0x7E), 448.0f);
  EXPECT_TRUE(std::isnan(fp8_e4m3_bits_to_float(0x7F)));
  EXPECT_EQ(fp8_e4m3_bits_to_float(0x01), std::ldexp(1.0f, -9));
}

TEST(Fp8, MidpointsRoundToEvenAndNeighboursToNearest) {
  for (uint32_t code = 0; code < 0x7E; ++code) {
    const float low = fp8_e4m3_bits_to_float(uint8_t(code)), high = fp8_e4m3_bits_to_float(uint8_t(code + 1));
    const float mid = (low + high) / 2;  // exact: one more significant bit
    for (const float sign : {1.0f, -1.0f}) {
      const uint32_t s = sign < 0 ? 0x80u : 0u;
      EXPECT_EQ(float_to_fp8_e4m3_bits(sign * mid), s | (code + (code & 1u))) << "midpoint above code " << code;
      EXPECT_EQ(float_to_fp8_e4m3_bits(sign * std::nextafter(mid, 0.0f)), s | code) << code;
      EXPECT_EQ(float_to_fp8_e4m3_bits(sign * std::nextafter(mid, 1000.0f)), s | (code + 1)) << code;
    }
  }
}

TEST(Fp8, SaturatesNaNKeepsSign) {
  const float inf = std::numeric_limits<float>::infinity(), nan = std::numeric_limits<float>::quiet_NaN();
  EXPECT_EQ(float_to_fp8_e4m3_bits(448.0f), 0x7Eu);
  EXPECT_EQ(float_to_fp8_e4m3_bits(std::nextafter(448.0f, inf)), 0x7Eu);
  EXPECT_EQ(float_to_fp8_e4m3_bits(464.0f), 0x7Eu);
  EXPECT_EQ(float_to_fp8_e4m3_bits(-inf), 0xFEu);
  EXPECT_EQ(float_to_fp8_e4m3_bits(std::numeric_limits<float>::max()), 0x7Eu);
  EXPECT_EQ(float_to_fp8_e4m3_bits(nan), 0x7Fu);
  EXPECT_EQ(float_to_fp8_e4m3_bits(-nan), 0xFFu);
  EXPECT_EQ(float_to_fp8_e4m3_bits(-0.0f), 0x80u);
  EXPECT_EQ(float_to_fp8_e4m3_bits(std::ldexp(1.0f, -10)), 0x00u);  // tie between 0 and 2^-9
  EXPECT_EQ(float_to_fp8_e4m3_bits(std::nextafter(std::ldexp(1.0f, -10), 1.0f)), 0x01u);
}

// Every sign / exponent / top-8-mantissa-bit combination with the low 12
// bits at the patterns that decide rounding (0, 1, just below, at and just
// above the half, all ones): torch's saturating conversion gives the same code.
TEST(Fp8, MatchesTorchConversionOnASweep) {
  const uint32_t lows[] = {0x000u, 0x001u, 0x7FFu, 0x800u, 0x801u, 0xFFFu};
  uint64_t failures = 0;
  for (uint32_t high = 0; high < (1u << 20); ++high) {
    for (const uint32_t low : lows) {
      const uint32_t bits = (high << 12) | low;
      const float x = bits_to_float(bits);
      const uint8_t ours = float_to_fp8_e4m3_bits(x);
      const uint8_t torch = c10::detail::fp8e4m3fn_from_fp32_value(x);
      if (ours != torch && failures++ < 5) ADD_FAILURE() << "pattern 0x" << std::hex << bits;
    }
  }
  EXPECT_EQ(failures, 0u);
}

TEST(Fp8, ScaleRule) {
  EXPECT_EQ(fp8_scale_inv(0), 1.0f);
  EXPECT_EQ(fp8_scale_inv(1), 1.0f);  // 2^-149 / 448 underflows: scale 1
  EXPECT_EQ(fp8_scale_inv(float_to_bits(448.0f)), 1.0f);
  EXPECT_EQ(fp8_scale_inv(float_to_bits(3.0f)), 3.0f / 448.0f);
  EXPECT_EQ(fp8_amax_bits(-2.0f), float_to_bits(2.0f));
  EXPECT_EQ(fp8_amax_bits(std::numeric_limits<float>::infinity()), 0u);
  EXPECT_EQ(fp8_amax_bits(-std::numeric_limits<float>::quiet_NaN()), 0u);
}

}  // namespace
}  // namespace muon_ext

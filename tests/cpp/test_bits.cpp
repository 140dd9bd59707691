// FP32 <-> BF16 / FP16 bit conversions (csrc/common/bits.h) against c10's
// BFloat16 and Half, which define what torch's `.to(dtype)` produces.
#include <gtest/gtest.h>

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <random>
#include <string>
#include <vector>

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#define MUON_TEST_HAVE_F16C_ORACLE 1
#endif

#include "csrc/common/bits.h"

namespace muon_ext {
namespace {

std::string hex(uint32_t x) {
  char buf[16];
  std::snprintf(buf, sizeof(buf), "0x%08X", x);
  return buf;
}

bool is_nan_bf16(uint16_t h) { return (h & 0x7FFFu) > 0x7F80u; }
bool is_nan_half(uint16_t h) { return (h & 0x7FFFu) > 0x7C00u; }

// FP32 patterns for the float -> 16-bit writers: every sign/exponent class with
// the mantissas where rounding can go wrong, plus a strided and a random sample.
std::vector<uint32_t> float_patterns() {
  std::vector<uint32_t> out;
  std::mt19937 rng(12345);
  std::uniform_int_distribution<uint32_t> mant(0, 0x7FFFFFu);
  for (uint32_t sign_exp = 0; sign_exp < 512; ++sign_exp) {
    const uint32_t top = sign_exp << 23;
    for (uint32_t m : {0x0u, 0x1u, 0x7FFFFFu, 0x400000u, 0x3FFFFFu}) out.push_back(top | m);
    // Ties and their neighbours at every rounding position a half subnormal
    // (shift 14..24) or normal (13) and BF16 (16) can use, with even/odd kept bits.
    for (uint32_t shift = 13; shift <= 24; ++shift) {
      const uint32_t half_ulp = 1u << (shift - 1);
      for (uint32_t kept : {0u, 1u, 2u, 3u, 0x3FEu, 0x3FFu}) {
        const uint32_t base = (kept << shift) & 0x7FFFFFu;
        for (int d = -1; d <= 1; ++d) out.push_back(top | ((base + half_ulp + uint32_t(d)) & 0x7FFFFFu));
      }
    }
    for (int i = 0; i < 2048; ++i) out.push_back(top | mant(rng));
  }
  // Around the largest half (65504) and the first value rounding to inf (65520).
  for (uint32_t b = 0x477FD000u; b <= 0x47801000u; ++b) {
    out.push_back(b);
    out.push_back(b | 0x80000000u);
  }
  for (uint64_t b = 7; b < (uint64_t(1) << 32); b += 257) out.push_back(uint32_t(b));
  std::uniform_int_distribution<uint32_t> any;
  for (int i = 0; i < (1 << 20); ++i) out.push_back(any(rng));
  return out;
}

const std::vector<uint32_t>& patterns() {
  static const std::vector<uint32_t> p = float_patterns();
  return p;
}

TEST(Bits, Bf16UpcastAllPatterns) {
  for (uint32_t h = 0; h <= 0xFFFFu; ++h) {
    const float ours = bf16_bits_to_float(uint16_t(h));
    const float ref = static_cast<float>(c10::BFloat16(uint16_t(h), c10::BFloat16::from_bits()));
    ASSERT_EQ(float_to_bits(ours), float_to_bits(ref)) << "bf16 " << hex(h);
  }
}

// Half -> float is exact, so outside NaN every bit must match c10.
TEST(Bits, HalfToFloatAllPatterns) {
  for (uint32_t h = 0; h <= 0xFFFFu; ++h) {
    const float ours = half_bits_to_float(uint16_t(h));
    const float ref = static_cast<float>(c10::Half(uint16_t(h), c10::Half::from_bits()));
    SCOPED_TRACE("half " + hex(h));
    if (is_nan_half(uint16_t(h))) {
      ASSERT_TRUE(std::isnan(ours));
      ASSERT_EQ(std::signbit(ours), std::signbit(ref));
      continue;
    }
    ASSERT_EQ(float_to_bits(ours), float_to_bits(ref));
    // Exact upcast, so converting back is the identity.
    ASSERT_EQ(float_to_half_bits_rne(ours), uint16_t(h));
  }
}

TEST(Bits, FloatToBf16MatchesC10) {
  uint64_t failures = 0;
  uint32_t first = 0;
  for (uint32_t b : patterns()) {
    const float x = bits_to_float(b);
    const uint16_t ours = float_to_bf16_bits_rne(x);
    const uint16_t ref = c10::BFloat16(x).x;
    const bool ok = std::isnan(x) ? is_nan_bf16(ours) : ours == ref;
    if (!ok && failures++ == 0) first = b;
  }
  EXPECT_EQ(failures, 0u) << "of " << patterns().size() << " patterns; first " << hex(first) << " -> ours "
                          << hex(float_to_bf16_bits_rne(bits_to_float(first))) << " c10 "
                          << hex(c10::BFloat16(bits_to_float(first)).x);
}

TEST(Bits, FloatToHalfMatchesC10) {
  uint64_t failures = 0;
  uint32_t first = 0;
  for (uint32_t b : patterns()) {
    const float x = bits_to_float(b);
    const uint16_t ours = float_to_half_bits_rne(x);
    const uint16_t ref = c10::Half(x).x;
    const bool ok = std::isnan(x) ? is_nan_half(ours) : ours == ref;
    if (!ok && failures++ == 0) first = b;
  }
  EXPECT_EQ(failures, 0u) << "of " << patterns().size() << " patterns; first " << hex(first) << " -> ours "
                          << hex(float_to_half_bits_rne(bits_to_float(first))) << " c10 "
                          << hex(c10::Half(bits_to_float(first)).x);
}

#if defined(MUON_TEST_HAVE_F16C_ORACLE)
// The hardware converter is a second, independent oracle for RNE to binary16
// (c10's software path is what this translation unit compiles to).
__attribute__((target("f16c"))) uint16_t f16c_float_to_half(float x) {
  return uint16_t(_cvtss_sh(x, _MM_FROUND_TO_NEAREST_INT));
}

TEST(Bits, FloatToHalfMatchesF16C) {
  if (!__builtin_cpu_supports("f16c")) GTEST_SKIP() << "CPU has no F16C";
  uint64_t failures = 0;
  uint32_t first = 0;
  for (uint32_t b : patterns()) {
    const float x = bits_to_float(b);
    const uint16_t ours = float_to_half_bits_rne(x);
    const bool ok = std::isnan(x) ? is_nan_half(ours) : ours == f16c_float_to_half(x);
    if (!ok && failures++ == 0) first = b;
  }
  EXPECT_EQ(failures, 0u) << "first " << hex(first);
}
#endif

// Hand-picked classes, so a failure names the class rather than a pattern.
TEST(Bits, NamedEdgeCases) {
  struct Case {
    uint32_t f32;
    uint16_t bf16, half;
    const char* what;
  };
  const Case cases[] = {
      {0x00000000u, 0x0000, 0x0000, "+0"},
      {0x80000000u, 0x8000, 0x8000, "-0"},
      {0x00000001u, 0x0000, 0x0000, "smallest fp32 subnormal"},
      {0x007FFFFFu, 0x0080, 0x0000, "largest fp32 subnormal (BF16 rounds up to min normal)"},
      {0x33000000u, 0x3300, 0x0000, "2^-25: half-way to the smallest half subnormal, ties to 0"},
      {0x33000001u, 0x3300, 0x0001, "just above 2^-25 rounds to the smallest half subnormal"},
      {0x33C00000u, 0x33C0, 0x0002, "1.5 * 2^-24 ties to even (2)"},
      {0x387FE000u, 0x3880, 0x0400, "largest half subnormal + half ulp rounds to min normal"},
      {0x3F808000u, 0x3F80, 0x3C04, "BF16 tie with even hi stays"},
      {0x3F818000u, 0x3F82, 0x3C0C, "BF16 tie with odd hi goes up"},
      {0x3F801000u, 0x3F80, 0x3C00, "half tie with even kept bits stays"},
      {0x3F803000u, 0x3F80, 0x3C02, "half tie with odd kept bits goes up"},
      {0x477FE000u, 0x4780, 0x7BFF, "65504, the largest half"},
      {0x477FEFFFu, 0x4780, 0x7BFF, "just below the overflow tie"},
      {0x477FF000u, 0x4780, 0x7C00, "65520 ties to even -> half inf"},
      {0x47800000u, 0x4780, 0x7C00, "65536 -> half inf"},
      {0xC7800000u, 0xC780, 0xFC00, "-65536 -> half -inf"},
      {0x7F7FFFFFu, 0x7F80, 0x7C00, "max fp32 overflows BF16 to inf"},
      {0x7F800000u, 0x7F80, 0x7C00, "+inf"},
      {0xFF800000u, 0xFF80, 0xFC00, "-inf"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(std::string(c.what) + " " + hex(c.f32));
    EXPECT_EQ(float_to_bf16_bits_rne(bits_to_float(c.f32)), c.bf16);
    EXPECT_EQ(float_to_half_bits_rne(bits_to_float(c.f32)), c.half);
  }
  // NaN stays NaN whatever the payload; a payload in the dropped bits only
  // must not turn into inf.
  for (uint32_t nan : {0x7FC00000u, 0x7F800001u, 0xFF800001u, 0x7FFFFFFFu, 0x7F8000FFu}) {
    SCOPED_TRACE("NaN " + hex(nan));
    EXPECT_TRUE(is_nan_bf16(float_to_bf16_bits_rne(bits_to_float(nan))));
    EXPECT_TRUE(is_nan_half(float_to_half_bits_rne(bits_to_float(nan))));
  }
}

}  // namespace
}  // namespace muon_ext

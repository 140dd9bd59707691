// BF16 + int16 remainder split/merge (csrc/common/remainder.h) against the
// rule in docs/design.md ("Master weights and remainders").
#include <gtest/gtest.h>

#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <string>
#include <thread>
#include <vector>

#include "csrc/common/bits.h"
#include "csrc/common/remainder.h"

namespace muon_ext {
namespace {

// Result of a sweep: how many patterns failed and the smallest one that did.
struct SweepResult {
  uint64_t failures = 0;
  uint32_t first = 0;
};

// Runs `check` on every 32-bit pattern, spread over the machine's cores; the
// exhaustive sweep is what makes "bijection on all 2^32 patterns" a fact.
template <typename Check>
SweepResult sweep_all_patterns(const Check& check) {
  const unsigned threads = std::max(1u, std::min(16u, std::thread::hardware_concurrency()));
  const uint64_t total = uint64_t(1) << 32;
  std::vector<SweepResult> results(threads);
  std::vector<std::thread> pool;
  for (unsigned t = 0; t < threads; ++t) {
    pool.emplace_back([&, t] {
      const uint64_t begin = total * t / threads;
      const uint64_t end = total * (t + 1) / threads;
      SweepResult r;
      for (uint64_t b = begin; b < end; ++b) {
        if (!check(uint32_t(b))) {
          if (r.failures == 0) r.first = uint32_t(b);
          ++r.failures;
        }
      }
      results[t] = r;
    });
  }
  for (auto& th : pool) th.join();
  SweepResult all;
  for (const SweepResult& r : results) {  // threads cover increasing ranges
    if (r.failures != 0 && all.failures == 0) all.first = r.first;
    all.failures += r.failures;
  }
  return all;
}

std::string hex32(uint32_t x) {
  char buf[16];
  std::snprintf(buf, sizeof(buf), "0x%08X", x);
  return buf;
}

// The rule, written from docs/design.md ("Master weights and remainders") rather
// than from the header.
uint16_t rule_bf16_bits(uint32_t b) { return uint16_t(((b >> 16) + ((b & 0xFFFFu) >= 0x8000u)) & 0xFFFFu); }
int16_t rule_remainder(uint32_t b) { return int16_t(uint16_t(b & 0xFFFFu)); }

// The design's reconstruction: hi = bf16 - (rem < 0), b = (hi << 16) | (uint16) rem.
uint32_t design_reconstruct(uint16_t bf16_bits, int16_t rem) {
  const uint32_t hi = uint32_t(uint16_t(bf16_bits - (rem < 0 ? 1 : 0)));
  return (hi << 16) | uint32_t(uint16_t(rem));
}

TEST(Remainder, RoundTripAllPatterns) {
  const SweepResult r = sweep_all_patterns([](uint32_t b) {
    const RemainderSplit s = split_master_bits(b);
    return merge_master_bits(s.bf16_bits, s.remainder) == b && design_reconstruct(s.bf16_bits, s.remainder) == b;
  });
  EXPECT_EQ(r.failures, 0u) << "first pattern that does not round-trip: " << hex32(r.first);
}

TEST(Remainder, SplitFollowsRuleAllPatterns) {
  const SweepResult r = sweep_all_patterns([](uint32_t b) {
    const RemainderSplit s = split_master_bits(b);
    return s.bf16_bits == rule_bf16_bits(b) && s.remainder == rule_remainder(b);
  });
  EXPECT_EQ(r.failures, 0u) << "first pattern split against the rule: " << hex32(r.first);
}

struct EdgeCase {
  uint32_t bits;
  uint16_t bf16_bits;
  int16_t remainder;
  const char* what;
};

TEST(Remainder, EdgePatterns) {
  const EdgeCase cases[] = {
      {0x3F808000u, 0x3F81, -32768, "tie, even hi: rounds up (RNE would keep 0x3F80)"},
      {0x3F818000u, 0x3F82, -32768, "tie, odd hi: rounds up like RNE"},
      {0xBF808000u, 0xBF81, -32768, "negative tie, even hi: bit pattern goes up, magnitude grows"},
      {0x3F807FFFu, 0x3F80, 32767, "just below the tie"},
      {0x3F808001u, 0x3F81, -32767, "just above the tie"},
      {0x00000000u, 0x0000, 0, "+0"},
      {0x80000000u, 0x8000, 0, "-0"},
      {0x00000001u, 0x0000, 1, "smallest positive subnormal"},
      {0x7F800000u, 0x7F80, 0, "+inf"},
      {0xFF800000u, 0xFF80, 0, "-inf"},
      {0x7FC00000u, 0x7FC0, 0, "canonical quiet NaN"},
      {0x7F800001u, 0x7F80, 1, "signalling NaN: stored BF16 reads as +inf"},
      {0x7FFF8000u, 0x8000, -32768, "NaN payload: BF16 -0.0 (docs/design.md example)"},
      {0x7FFFFFFFu, 0x8000, -1, "largest +NaN pattern carries into the sign bit"},
      {0x7F7FFFFFu, 0x7F80, -1, "max finite: carry to BF16 inf bits"},
      {0x7F7F8000u, 0x7F80, -32768, "max-finite tie: carry to BF16 inf bits"},
      {0xFFFF8000u, 0x0000, -32768, "hi 0xFFFF + 1 wraps to 0x0000"},
      {0xFFFFFFFFu, 0x0000, -1, "all ones wraps to +0 bits"},
  };
  for (const EdgeCase& c : cases) {
    SCOPED_TRACE(std::string(c.what) + " " + hex32(c.bits));
    const RemainderSplit s = split_master_bits(c.bits);
    EXPECT_EQ(s.bf16_bits, c.bf16_bits);
    EXPECT_EQ(s.remainder, c.remainder);
    EXPECT_EQ(merge_master_bits(s.bf16_bits, s.remainder), c.bits);
    // The float-typed API must not quieten or canonicalise NaN patterns.
    const RemainderSplit sf = split_master(bits_to_float(c.bits));
    EXPECT_EQ(sf.bf16_bits, c.bf16_bits);
    EXPECT_EQ(sf.remainder, c.remainder);
    EXPECT_EQ(float_to_bits(merge_master(sf.bf16_bits, sf.remainder)), c.bits);
  }
}

// A fresh remainder is zero, so the first master must equal the BF16 param.
TEST(Remainder, FreshRemainderIsBf16Upcast) {
  for (uint32_t h = 0; h <= 0xFFFFu; ++h) {
    const uint16_t bf = uint16_t(h);
    const uint32_t upcast = float_to_bits(bf16_bits_to_float(bf));
    ASSERT_EQ(upcast, h << 16);
    ASSERT_EQ(merge_master_bits(bf, 0), upcast) << "bf16 " << hex32(h);
    ASSERT_EQ(float_to_bits(merge_master(bf, 0)), upcast) << "bf16 " << hex32(h);
    const RemainderSplit s = split_master_bits(upcast);
    ASSERT_EQ(s.bf16_bits, bf);
    ASSERT_EQ(s.remainder, 0);
  }
}

// For finite values the stored BF16 differs from torch's round-to-nearest-even
// exactly at ties with an even hi; elsewhere the two writers agree.
TEST(Remainder, DiffersFromRneOnlyAtEvenTies) {
  const SweepResult r = sweep_all_patterns([](uint32_t b) {
    if ((b & 0x7F800000u) == 0x7F800000u) return true;  // inf / NaN: not finite
    const uint16_t rne = c10::BFloat16(bits_to_float(b)).x;
    const bool differs = split_master_bits(b).bf16_bits != rne;
    const bool even_tie = (b & 0xFFFFu) == 0x8000u && ((b >> 16) & 1u) == 0;
    return differs == even_tie;
  });
  EXPECT_EQ(r.failures, 0u) << "first finite pattern breaking the rule: " << hex32(r.first);
}

}  // namespace
}  // namespace muon_ext

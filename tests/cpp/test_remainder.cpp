// BF16 + int16 remainder split/merge (csrc/common/remainder.h) against the
// rule in docs/design.md ("Master weights and remainders"): a bijection on
// every non-NaN pattern, and a NaN param for every NaN master.
#include <gtest/gtest.h>

#include <c10/util/BFloat16.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <string>
#include <thread>
#include <vector>

#include "csrc/common/bits.h"
#include "csrc/common/remainder.h"
#include "csrc/cpu/adamw_cpu.h"

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
// than from the header: TransformerEngine's bit rule, except that a NaN master
// whose rule BF16 is not a NaN gets the nearest NaN high half instead.
bool is_nan32(uint32_t b) { return (b & 0x7FFFFFFFu) > 0x7F800000u; }
bool is_nan16(uint16_t h) { return (h & 0x7FFFu) > 0x7F80u; }
uint16_t te_bf16_bits(uint32_t b) { return uint16_t(((b >> 16) + ((b & 0xFFFFu) >= 0x8000u)) & 0xFFFFu); }
// NaN masters whose TransformerEngine BF16 is not a NaN: high half 0x7F80
// without carry (BF16 inf) or 0x7FFF with carry (wraps to the other sign's zero).
bool te_hides_nan(uint32_t b) { return is_nan32(b) && !is_nan16(te_bf16_bits(b)); }
uint16_t rule_bf16_bits(uint32_t b) {
  if (!te_hides_nan(b)) return te_bf16_bits(b);
  const uint16_t sign = uint16_t((b >> 16) & 0x8000u);
  return ((b >> 16) & 0x7FFFu) == 0x7F80u ? uint16_t(sign | 0x7F81u) : uint16_t(sign | 0x7FFFu);
}
int16_t rule_remainder(uint32_t b) { return int16_t(uint16_t(b & 0xFFFFu)); }

// The design's reconstruction: hi = bf16 - (rem < 0), b = (hi << 16) | (uint16) rem.
uint32_t design_reconstruct(uint16_t bf16_bits, int16_t rem) {
  const uint32_t hi = uint32_t(uint16_t(bf16_bits - (rem < 0 ? 1 : 0)));
  return (hi << 16) | uint32_t(uint16_t(rem));
}

// The split/merge round trip is the identity on every pattern but the NaNs
// TransformerEngine's rule would hide; those come back as a NaN with the same
// sign and low half, the high half one step into the NaN range (+0x10000 from
// 0x7F80, -0x10000 from 0x7FFF).
TEST(Remainder, RoundTripAllPatterns) {
  std::atomic<uint64_t> moved{0};
  const SweepResult r = sweep_all_patterns([&](uint32_t b) {
    const RemainderSplit s = split_master_bits(b);
    const uint32_t merged = merge_master_bits(s.bf16_bits, s.remainder);
    if (design_reconstruct(s.bf16_bits, s.remainder) != merged) return false;
    if (!te_hides_nan(b)) return merged == b;
    moved.fetch_add(1, std::memory_order_relaxed);
    const uint32_t expected = ((b >> 16) & 0x7FFFu) == 0x7F80u ? b + 0x10000u : b - 0x10000u;
    return merged == expected && is_nan32(merged) && (merged & 0x8000FFFFu) == (b & 0x8000FFFFu);
  });
  EXPECT_EQ(r.failures, 0u) << "first pattern that does not round-trip: " << hex32(r.first);
  // Per sign: 0x7F80 with a low half in 1..0x7FFF, 0x7FFF with one in 0x8000..0xFFFF.
  EXPECT_EQ(moved.load(), 2u * (0x7FFFu + 0x8000u));
}

TEST(Remainder, SplitFollowsRuleAllPatterns) {
  const SweepResult r = sweep_all_patterns([](uint32_t b) {
    const RemainderSplit s = split_master_bits(b);
    return s.bf16_bits == rule_bf16_bits(b) && s.remainder == rule_remainder(b);
  });
  EXPECT_EQ(r.failures, 0u) << "first pattern split against the rule: " << hex32(r.first);
}

// The NaN contract (docs/design.md, "Master weights and remainders"): the
// BF16 param the model computes with is a NaN exactly when the FP32 master is
// (every payload, both signs), and the float API gives the same bits (no
// quieting or canonicalisation on the way).
TEST(Remainder, ParamIsNanExactlyWhenMasterIsAllPatterns) {
  const SweepResult r = sweep_all_patterns([](uint32_t b) {
    const RemainderSplit s = split_master_bits(b);
    const RemainderSplit sf = split_master(bits_to_float(b));
    return is_nan16(s.bf16_bits) == is_nan32(b) && sf.bf16_bits == s.bf16_bits && sf.remainder == s.remainder;
  });
  EXPECT_EQ(r.failures, 0u) << "first pattern whose param hides or invents a NaN: " << hex32(r.first);
}

// Every (BF16, remainder) pair whose BF16 is a NaN merges to a NaN master, so
// a NaN param never turns back into a number, whatever remainder is stored.
TEST(Remainder, NanParamMergesToNanAllPairs) {
  const SweepResult r = sweep_all_patterns([](uint32_t pair) {
    const uint16_t bf16 = uint16_t(pair >> 16);
    const int16_t rem = int16_t(uint16_t(pair & 0xFFFFu));
    return !is_nan16(bf16) || (is_nan32(merge_master_bits(bf16, rem)) && std::isnan(merge_master(bf16, rem)));
  });
  EXPECT_EQ(r.failures, 0u) << "first (bf16 << 16 | rem) pair merging a NaN param to a number: " << hex32(r.first);
}

// The vectorized block functions (csrc/cpu/remainder_simd.h, one build per
// instruction set) against the scalar rule on all 2^32 master patterns and all
// 2^32 (BF16, remainder) pairs.  Blocks of an odd length at odd offsets, so
// every pattern also passes through the scalar tails and unaligned loads.
TEST(RemainderBlocks, EveryInstructionSetMatchesScalarAllPatterns) {
  constexpr int64_t kChunk = 4093;
  for (cpu::CpuCapability cap : cpu::available_capabilities()) {
    SCOPED_TRACE(cpu::capability_name(cap));
    const unsigned threads = std::max(1u, std::min(16u, std::thread::hardware_concurrency()));
    const uint64_t total = uint64_t(1) << 32;
    std::atomic<uint64_t> split_failures{0}, merge_failures{0};
    std::atomic<uint32_t> first_split{0xFFFFFFFFu}, first_merge{0xFFFFFFFFu};
    std::vector<std::thread> pool;
    for (unsigned t = 0; t < threads; ++t) {
      pool.emplace_back([&, t] {
        std::vector<uint32_t> in(kChunk + 1), out(kChunk + 1);
        std::vector<uint16_t> hi(kChunk + 1);
        std::vector<int16_t> rem(kChunk + 1);
        const uint64_t begin = total * t / threads, end = total * (t + 1) / threads;
        for (uint64_t base = begin; base < end; base += kChunk) {
          const int64_t n = int64_t(std::min<uint64_t>(kChunk, end - base));
          for (int64_t i = 0; i < n; ++i) in[i + 1] = uint32_t(base + uint64_t(i));
          cpu::split_master_block(reinterpret_cast<const float*>(in.data() + 1), hi.data() + 1, rem.data() + 1, n, cap);
          for (int64_t i = 0; i < n; ++i) {
            const RemainderSplit s = split_master_bits(in[i + 1]);
            if (s.bf16_bits != hi[i + 1] || s.remainder != rem[i + 1]) {
              if (split_failures.fetch_add(1) == 0) first_split = in[i + 1];
            }
          }
          // The same patterns read as (BF16 << 16 | remainder) pairs.
          for (int64_t i = 0; i < n; ++i) {
            hi[i + 1] = uint16_t(in[i + 1] >> 16);
            rem[i + 1] = int16_t(uint16_t(in[i + 1] & 0xFFFFu));
          }
          cpu::merge_master_block(hi.data() + 1, rem.data() + 1, reinterpret_cast<float*>(out.data() + 1), n, cap);
          for (int64_t i = 0; i < n; ++i) {
            if (out[i + 1] != merge_master_bits(hi[i + 1], rem[i + 1])) {
              if (merge_failures.fetch_add(1) == 0) first_merge = in[i + 1];
            }
          }
        }
      });
    }
    for (auto& th : pool) th.join();
    EXPECT_EQ(split_failures.load(), 0u) << "a split pattern differs from the scalar rule, e.g. " << hex32(first_split);
    EXPECT_EQ(merge_failures.load(), 0u) << "a merged pair differs from the scalar rule, e.g. " << hex32(first_merge);
  }
}

struct EdgeCase {
  uint32_t bits;
  uint16_t bf16_bits;
  int16_t remainder;
  uint32_t merged;
  const char* what;
};

TEST(Remainder, EdgePatterns) {
  const EdgeCase cases[] = {
      {0x3F808000u, 0x3F81, -32768, 0x3F808000u, "tie, even hi: rounds up (RNE would keep 0x3F80)"},
      {0x3F818000u, 0x3F82, -32768, 0x3F818000u, "tie, odd hi: rounds up like RNE"},
      {0xBF808000u, 0xBF81, -32768, 0xBF808000u, "negative tie, even hi: bit pattern goes up, magnitude grows"},
      {0x3F807FFFu, 0x3F80, 32767, 0x3F807FFFu, "just below the tie"},
      {0x3F808001u, 0x3F81, -32767, 0x3F808001u, "just above the tie"},
      {0x00000000u, 0x0000, 0, 0x00000000u, "+0"},
      {0x80000000u, 0x8000, 0, 0x80000000u, "-0"},
      {0x00000001u, 0x0000, 1, 0x00000001u, "smallest positive subnormal"},
      {0x7F800000u, 0x7F80, 0, 0x7F800000u, "+inf"},
      {0xFF800000u, 0xFF80, 0, 0xFF800000u, "-inf"},
      {0x7F7FFFFFu, 0x7F80, -1, 0x7F7FFFFFu, "max finite: carry to BF16 inf bits (a number, not hidden)"},
      {0x7F7F8000u, 0x7F80, -32768, 0x7F7F8000u, "max-finite tie: carry to BF16 inf bits"},
      {0x7FC00000u, 0x7FC0, 0, 0x7FC00000u, "canonical quiet NaN"},
      {0xFFC00000u, 0xFFC0, 0, 0xFFC00000u, "x86 default NaN"},
      {0x7FBFFFFFu, 0x7FC0, -1, 0x7FBFFFFFu, "NaN carrying inside the NaN range: exact"},
      {0x7F808000u, 0x7F81, -32768, 0x7F808000u, "NaN with high half 0x7F80 and a carry: exact"},
      {0x7F800001u, 0x7F81, 1, 0x7F810001u, "signalling NaN: TE's BF16 would be +inf; high half raised"},
      {0xFF807FFFu, 0xFF81, 32767, 0xFF817FFFu, "negative NaN: TE's BF16 would be -inf"},
      {0x7FFF8000u, 0x7FFF, -32768, 0x7FFE8000u, "NaN: TE's carry would wrap to -0.0 (docs/design.md example)"},
      {0x7FFFFFFFu, 0x7FFF, -1, 0x7FFEFFFFu, "CUDA's canonical NaN: TE's carry would wrap to -0.0"},
      {0x7FFF7FFFu, 0x7FFF, 32767, 0x7FFF7FFFu, "largest NaN without a carry: exact"},
      {0xFFFF8000u, 0xFFFF, -32768, 0xFFFE8000u, "negative NaN: TE's carry would wrap to +0"},
      {0xFFFFFFFFu, 0xFFFF, -1, 0xFFFEFFFFu, "all ones: TE's carry would wrap to +0"},
  };
  for (const EdgeCase& c : cases) {
    SCOPED_TRACE(std::string(c.what) + " " + hex32(c.bits));
    const RemainderSplit s = split_master_bits(c.bits);
    EXPECT_EQ(s.bf16_bits, c.bf16_bits);
    EXPECT_EQ(s.remainder, c.remainder);
    EXPECT_EQ(merge_master_bits(s.bf16_bits, s.remainder), c.merged);
    // The float-typed API must not quieten or canonicalise NaN patterns.
    const RemainderSplit sf = split_master(bits_to_float(c.bits));
    EXPECT_EQ(sf.bf16_bits, c.bf16_bits);
    EXPECT_EQ(sf.remainder, c.remainder);
    EXPECT_EQ(float_to_bits(merge_master(sf.bf16_bits, sf.remainder)), c.merged);
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

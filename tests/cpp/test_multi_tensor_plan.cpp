// Host-side multi-tensor launch planning (csrc/common/multi_tensor_plan.h).
// The CUDA kernels trust this plan blindly, so every invariant the header
// promises is checked here on host arithmetic alone.
#include <gtest/gtest.h>

#include <cstdint>
#include <random>
#include <set>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "csrc/common/multi_tensor_plan.h"

namespace muon_ext {
namespace {

std::string describe(const std::vector<int64_t>& numels, int64_t chunk, int max_tensors, int max_blocks) {
  std::ostringstream os;
  os << "chunk=" << chunk << " max_tensors=" << max_tensors << " max_blocks=" << max_blocks << " numels={";
  for (size_t i = 0; i < numels.size() && i < 32; ++i) os << (i ? "," : "") << numels[i];
  if (numels.size() > 32) os << ",... (" << numels.size() << ")";
  os << "}";
  return os.str();
}

// Checks every promise of plan_multi_tensor_launches and returns the plan.
std::vector<MultiTensorLaunch> check_plan(const std::vector<int64_t>& numels, int64_t chunk, int max_tensors,
                                          int max_blocks) {
  SCOPED_TRACE(describe(numels, chunk, max_tensors, max_blocks));
  const std::vector<MultiTensorLaunch> plan = plan_multi_tensor_launches(numels, chunk, max_tensors, max_blocks);

  // The (tensor, chunk) sequence the kernels will visit, in launch order.
  std::vector<std::pair<int, int64_t>> visited;
  for (size_t l = 0; l < plan.size(); ++l) {
    const MultiTensorLaunch& launch = plan[l];
    SCOPED_TRACE("launch " + std::to_string(l));
    EXPECT_GE(launch.tensors.size(), 1u);
    EXPECT_LE(launch.tensors.size(), size_t(max_tensors));
    EXPECT_GE(launch.blocks.size(), 1u);  // an empty grid is a CUDA launch error
    EXPECT_LE(launch.blocks.size(), size_t(max_blocks));
    std::vector<int64_t> blocks_per_slot(launch.tensors.size(), 0);
    std::set<int> distinct(launch.tensors.begin(), launch.tensors.end());
    EXPECT_EQ(distinct.size(), launch.tensors.size()) << "a tensor holds two slots of one launch";
    for (const MultiTensorBlock& b : launch.blocks) {
      if (b.slot < 0 || b.slot >= static_cast<int>(launch.tensors.size())) {
        ADD_FAILURE() << "block slot " << b.slot << " out of range";
        return plan;
      }
      ++blocks_per_slot[b.slot];
      visited.emplace_back(launch.tensors[b.slot], b.chunk);
    }
    for (size_t s = 0; s < blocks_per_slot.size(); ++s) {
      EXPECT_GE(blocks_per_slot[s], 1) << "slot " << s << " (tensor " << launch.tensors[s] << ") owns no block";
      EXPECT_GT(numels[launch.tensors[s]], 0) << "empty tensor " << launch.tensors[s] << " got a slot";
    }
    // Only a carried-over tensor may appear in two launches: last slot of one,
    // first slot of the next.
    if (l > 0) {
      const MultiTensorLaunch& prev = plan[l - 1];
      for (size_t s = 0; s < launch.tensors.size(); ++s) {
        for (size_t q = 0; q < prev.tensors.size(); ++q) {
          if (prev.tensors[q] == launch.tensors[s]) {
            EXPECT_TRUE(s == 0 && q + 1 == prev.tensors.size())
                << "tensor " << launch.tensors[s] << " shared by launches but not carried over";
          }
        }
      }
    }
  }

  std::vector<std::pair<int, int64_t>> expected;
  for (int t = 0; t < static_cast<int>(numels.size()); ++t) {
    for (int64_t c = 0; c < ceil_div(numels[t], chunk); ++c) expected.emplace_back(t, c);
  }
  EXPECT_EQ(visited.size(), expected.size());
  EXPECT_TRUE(visited == expected) << "chunks are not each covered exactly once in order";

  // The chunk ranges of each tensor tile [0, numel) without gap or overlap.
  std::vector<int64_t> covered(numels.size(), 0);
  for (const auto& [t, c] : visited) {
    int64_t begin = -1, end = -1;
    chunk_range(numels[t], chunk, c, &begin, &end);
    EXPECT_EQ(begin, covered[t]) << "tensor " << t << " chunk " << c;
    EXPECT_GT(end, begin);
    EXPECT_LE(end - begin, chunk);
    covered[t] = end;
  }
  for (size_t t = 0; t < numels.size(); ++t) EXPECT_EQ(covered[t], numels[t]) << "tensor " << t;
  return plan;
}

TEST(MultiTensorPlan, NoTensorsOrOnlyEmptyOnes) {
  EXPECT_TRUE(check_plan({}, 1024, 4, 8).empty());
  EXPECT_TRUE(check_plan({0, 0, 0}, 1024, 4, 8).empty());
}

TEST(MultiTensorPlan, EmptyTensorsGetNoSlot) {
  const auto plan = check_plan({0, 5, 0, 0, 3000, 0}, 1024, 4, 8);
  ASSERT_EQ(plan.size(), 1u);
  EXPECT_EQ(plan[0].tensors, (std::vector<int>{1, 4}));
  EXPECT_EQ(plan[0].blocks.size(), 1u + 3u);
}

TEST(MultiTensorPlan, ChunkBoundaries) {
  const int64_t chunk = 4096;
  for (int64_t k : {1, 2, 7}) {
    for (int64_t numel : {k * chunk - 1, k * chunk, k * chunk + 1}) {
      const auto plan = check_plan({numel}, chunk, 4, 64);
      ASSERT_EQ(plan.size(), 1u);
      EXPECT_EQ(int64_t(plan[0].blocks.size()), ceil_div(numel, chunk)) << numel;
    }
  }
  int64_t begin = 0, end = 0;
  chunk_range(2 * chunk + 1, chunk, 2, &begin, &end);
  EXPECT_EQ(begin, 2 * chunk);
  EXPECT_EQ(end, 2 * chunk + 1);
  chunk_range(2 * chunk, chunk, 1, &begin, &end);
  EXPECT_EQ(begin, chunk);
  EXPECT_EQ(end, 2 * chunk);
}

TEST(MultiTensorPlan, TensorSlotLimitStartsNewLaunch) {
  const auto plan = check_plan({1, 1, 1, 1, 1, 1, 1}, 16, 3, 100);
  ASSERT_EQ(plan.size(), 3u);
  EXPECT_EQ(plan[0].tensors, (std::vector<int>{0, 1, 2}));
  EXPECT_EQ(plan[2].tensors, (std::vector<int>{6}));
}

TEST(MultiTensorPlan, CarryOverSplitsOneTensorAcrossLaunches) {
  // 10 chunks, 3 blocks per launch: the tensor spans 4 launches.
  const auto plan = check_plan({10 * 64 - 3}, 64, 8, 3);
  ASSERT_EQ(plan.size(), 4u);
  for (const auto& launch : plan) EXPECT_EQ(launch.tensors, (std::vector<int>{0}));
  EXPECT_EQ(plan[3].blocks.size(), 1u);
  EXPECT_EQ(plan[3].blocks[0].chunk, 9);

  // Carried tensor shares a launch with its neighbours on both sides.
  const auto mixed = check_plan({100, 5 * 64, 60}, 64, 8, 4);
  ASSERT_EQ(mixed.size(), 2u);
  EXPECT_EQ(mixed[0].tensors, (std::vector<int>{0, 1}));
  EXPECT_EQ(mixed[1].tensors, (std::vector<int>{1, 2}));
  EXPECT_EQ(mixed[1].blocks[0].chunk, 2);
}

TEST(MultiTensorPlan, BlocksFillExactlyAtTensorEnd) {
  // A launch full exactly when a tensor ends must not carry anything over.
  const auto plan = check_plan({4 * 32, 32, 0, 32}, 32, 8, 4);
  ASSERT_EQ(plan.size(), 2u);
  EXPECT_EQ(plan[0].tensors, (std::vector<int>{0}));
  EXPECT_EQ(plan[1].tensors, (std::vector<int>{1, 3}));
}

TEST(MultiTensorPlan, SingleSlotSingleBlock) {
  const auto plan = check_plan({3, 0, 130, 1}, 64, 1, 1);
  EXPECT_EQ(plan.size(), 1u + 3u + 1u);
}

TEST(MultiTensorPlan, RandomConfigurations) {
  std::mt19937_64 rng(2024);
  for (int trial = 0; trial < 2000; ++trial) {
    const int64_t chunk = int64_t(1) << std::uniform_int_distribution<int>(0, 12)(rng);
    const int max_tensors = std::uniform_int_distribution<int>(1, 40)(rng);
    const int max_blocks = std::uniform_int_distribution<int>(1, 320)(rng);
    std::vector<int64_t> numels(std::uniform_int_distribution<int>(0, 60)(rng));
    for (auto& n : numels) {
      switch (rng() % 4) {
        case 0: n = 0; break;
        case 1: n = int64_t(rng() % 4 + 1) * chunk + int64_t(rng() % 3) - 1; break;  // around boundaries
        default: n = int64_t(rng() % (chunk * 50 + 1)); break;
      }
    }
    check_plan(numels, chunk, max_tensors, max_blocks);
    if (HasFailure()) return;  // one described failure is enough
  }
}

// Offsets beyond 2^31 elements: the chunk index times chunk_size must not wrap.
TEST(MultiTensorPlan, SixtyFourBitOffsets) {
  const int64_t chunk = 65536;
  const int64_t numel = 3 * (int64_t(1) << 31) + 5;
  const auto plan = check_plan({7, numel, 0, 11}, chunk, 110, 320);
  const int64_t chunks = ceil_div(numel, chunk);
  EXPECT_EQ(chunks, 3 * 32768 + 1);
  int64_t begin = 0, end = 0;
  chunk_range(numel, chunk, chunks - 1, &begin, &end);
  EXPECT_EQ(begin, 3 * (int64_t(1) << 31));
  EXPECT_GT(begin, int64_t(1) << 31);
  EXPECT_EQ(end, numel);
  int64_t sum = 0;
  for (int64_t c = 0; c < chunks; ++c) {
    chunk_range(numel, chunk, c, &begin, &end);
    sum += end - begin;
  }
  EXPECT_EQ(sum, numel);
  int64_t blocks = 0;
  for (const auto& launch : plan) blocks += int64_t(launch.blocks.size());
  EXPECT_EQ(blocks, 1 + chunks + 1);
}

}  // namespace
}  // namespace muon_ext

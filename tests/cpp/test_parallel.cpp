// The CPU kernels' at::parallel_for really runs on torch's threads in this
// build (csrc/build_flags.json "openmp"): compiled without the OpenMP flags it
// takes ATen's serial branch and every kernel runs on one thread.
#include <gtest/gtest.h>

#include <ATen/Parallel.h>

#include "csrc/cpu/parallel_probe.h"

namespace muon_ext {
namespace {

class ThreadCount : public ::testing::Test {
 protected:
  void SetUp() override { before_ = at::get_num_threads(); }
  void TearDown() override { at::set_num_threads(before_); }
  int before_ = 1;
};

TEST_F(ThreadCount, ParallelForUsesEveryThread) {
  for (int threads : {1, 2, 3}) {
    at::set_num_threads(threads);
    EXPECT_EQ(cpu::threads_used_by_parallel_for(256, 1), threads) << "with " << threads << " threads";
  }
}

TEST_F(ThreadCount, SmallWorkStaysOnOneThread) {
  at::set_num_threads(2);
  EXPECT_EQ(cpu::threads_used_by_parallel_for(8, 16), 1);
}

}  // namespace
}  // namespace muon_ext

// The run queues of the CPU kernels' balanced parallel loops
// (csrc/cpu/balanced_runs.h): every run taken exactly once, owners in order
// from the front, and an idle thread taking a slow thread's runs.
#include <gtest/gtest.h>

#include <ATen/Parallel.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <mutex>
#include <thread>
#include <vector>

#include "csrc/cpu/balanced_runs.h"

namespace muon_ext {
namespace {

TEST(RunQueues, OwnersTakeTheirRunsInOrderAndThievesTheLongestQueuesBack) {
  cpu::RunQueues queues(10, 3);  // [0, 3), [3, 6), [6, 10)
  EXPECT_EQ(queues.take_front(0), 0);
  EXPECT_EQ(queues.take_front(0), 1);
  EXPECT_EQ(queues.take_back(), 9);  // the longest queue is the third
  EXPECT_EQ(queues.take_back(), 5);  // then a tie of three: the first of them
  EXPECT_EQ(queues.take_front(2), 6);
  EXPECT_EQ(queues.take_front(0), 2);
  EXPECT_EQ(queues.take_front(0), -1);
  EXPECT_EQ(queues.take_back(), 4);  // a tie of two
  EXPECT_EQ(queues.take_front(1), 3);
  EXPECT_EQ(queues.take_back(), 8);
  EXPECT_EQ(queues.take_back(), 7);
  EXPECT_EQ(queues.take_back(), -1);
  EXPECT_EQ(queues.take_front(1), -1);
  EXPECT_EQ(queues.take_front(2), -1);
}

TEST(RunQueues, MoreQueuesThanRunsAndNoRuns) {
  cpu::RunQueues few(2, 4);  // [0, 0), [0, 1), [1, 1), [1, 2)
  EXPECT_EQ(few.take_front(0), -1);
  EXPECT_EQ(few.take_front(1), 0);
  EXPECT_EQ(few.take_back(), 1);
  EXPECT_EQ(few.take_back(), -1);
  cpu::RunQueues none(0, 2);
  EXPECT_EQ(none.take_front(0), -1);
  EXPECT_EQ(none.take_back(), -1);
}

TEST(RunQueues, ConcurrentOwnersAndThievesTakeEveryRunOnce) {
  for (int round = 0; round < 20; ++round) {
    const int64_t runs = 5000, threads = 4;
    cpu::RunQueues queues(runs, threads);
    std::vector<std::atomic<int>> taken(runs);
    std::vector<std::thread> pool;
    for (int64_t t = 0; t < threads; ++t) {
      pool.emplace_back([&, t] {
        int64_t last = -1;
        for (int64_t run = queues.take_front(t); run >= 0; run = queues.take_front(t)) {
          EXPECT_GT(run, last) << "an owner takes its runs in order";
          last = run;
          taken[run].fetch_add(1);
        }
        for (int64_t run = queues.take_back(); run >= 0; run = queues.take_back()) taken[run].fetch_add(1);
      });
    }
    for (std::thread& t : pool) t.join();
    for (int64_t run = 0; run < runs; ++run) ASSERT_EQ(taken[run].load(), 1) << "run " << run << ", round " << round;
  }
}

TEST(BalancedRuns, AnIdleThreadTakesTheRunsOfASlowOne) {
  const int before = at::get_num_threads();
  at::set_num_threads(2);
  const int64_t runs = 20;
  std::vector<std::atomic<int>> taken(runs);
  std::atomic<int64_t> by_second{0};
  int states = 0;
  std::mutex mutex;
  cpu::for_each_run_balanced(
      runs,
      [&] {
        std::lock_guard<std::mutex> lock(mutex);
        return states++;
      },
      [&](int64_t run, int) {
        taken[run].fetch_add(1);
        if (at::get_thread_num() == 0) {
          std::this_thread::sleep_for(std::chrono::milliseconds(20));
        } else {
          by_second.fetch_add(1);
        }
      });
  at::set_num_threads(before);
  for (int64_t run = 0; run < runs; ++run) EXPECT_EQ(taken[run].load(), 1) << "run " << run;
  EXPECT_EQ(states, 2) << "one state per thread";
  // Its own queue holds 10 runs; it takes most of the sleeping thread's too.
  EXPECT_GT(by_second.load(), 12);
}

}  // namespace
}  // namespace muon_ext

// Runs of consecutive work items spread over the intra-op threads so that a
// thread on a slower core does not hold up the rest (docs/design.md, "CPU
// kernels", small matrices). Each thread owns one contiguous queue of runs and
// takes them from the front, in order, so its memory streams stay sequential
// (the hardware prefetchers and a kernel's own next-run prefetch keep up); a
// thread whose queue is empty takes single runs from the back of the longest
// queue left. A static split waits for the slowest thread; handing every run
// out from one shared counter breaks the streams (both measured: bench/RESULTS.md).
// Which thread runs a run must never change what it computes.
#pragma once

#include <ATen/Parallel.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <vector>

namespace muon_ext {
namespace cpu {
// In a file compiled once per instruction set (csrc/build_flags.json), each
// build gets its own copy: the linker must not hand one build's inline
// functions, compiled for AVX-512, to another.
#ifdef CPU_CAPABILITY
namespace CPU_CAPABILITY {
#endif

// The runs [0, runs) split into `queues` contiguous queues of near-equal length.
class RunQueues {
 public:
  RunQueues(int64_t runs, int64_t queues) : queues_(static_cast<size_t>(std::max<int64_t>(queues, 1))) {
    // Both ends of a queue live in one 64-bit word (one compare-and-swap takes a run).
    TORCH_INTERNAL_ASSERT(runs >= 0 && runs < (int64_t(1) << 31), "RunQueues: ", runs, " runs");
    const int64_t count = static_cast<int64_t>(queues_.size());
    for (int64_t q = 0; q < count; ++q) {
      queues_[q].ends.store(pack(runs * q / count, runs * (q + 1) / count), std::memory_order_relaxed);
    }
  }

  int64_t queue_count() const { return static_cast<int64_t>(queues_.size()); }

  // The first run left in queue q, taken; -1 when it is empty.
  int64_t take_front(int64_t q) {
    std::atomic<uint64_t>& ends = queues_[q].ends;
    uint64_t v = ends.load(std::memory_order_relaxed);
    while (front(v) < back(v)) {
      if (ends.compare_exchange_weak(v, pack(front(v) + 1, back(v)), std::memory_order_relaxed)) return front(v);
    }
    return -1;
  }

  // The last run of the queue with the most runs left (the first such queue
  // on a tie), taken; -1 when every queue is empty.
  int64_t take_back() {
    for (;;) {
      Queue* longest = nullptr;
      uint64_t seen = 0;
      for (Queue& queue : queues_) {
        const uint64_t v = queue.ends.load(std::memory_order_relaxed);
        if (back(v) - front(v) > back(seen) - front(seen)) longest = &queue, seen = v;
      }
      if (longest == nullptr) return -1;
      // Fails when the owner (or another thief) moved either end meanwhile: look again.
      if (longest->ends.compare_exchange_weak(seen, pack(front(seen), back(seen) - 1), std::memory_order_relaxed)) {
        return back(seen) - 1;
      }
    }
  }

 private:
  static uint64_t pack(int64_t front, int64_t back) { return uint64_t(front) << 32 | uint64_t(back); }
  static int64_t front(uint64_t v) { return int64_t(v >> 32); }
  static int64_t back(uint64_t v) { return int64_t(v & 0xFFFFFFFFu); }
  // One cache line per queue: the owners' compare-and-swaps do not contend.
  struct alignas(64) Queue {
    std::atomic<uint64_t> ends{0};
  };
  std::vector<Queue> queues_;
};

// fn(run, state) for every run in [0, runs), once each, on the intra-op
// threads; `state` is make_state()'s, one per thread (its scratch buffers).
// Each run's work is the same whichever thread takes it.
template <typename MakeState, typename Fn>
void for_each_run_balanced(int64_t runs, const MakeState& make_state, const Fn& fn) {
  if (runs <= 0) return;
  const int64_t workers = std::min<int64_t>(runs, at::get_num_threads());
  if (workers <= 1 || at::in_parallel_region()) {  // one thread: in order, no queues
    auto state = make_state();
    for (int64_t run = 0; run < runs; ++run) fn(run, state);
    return;
  }
  RunQueues queues(runs, workers);
  at::parallel_for(0, queues.queue_count(), 1, [&](int64_t first, int64_t last) {
    auto state = make_state();
    for (int64_t q = first; q < last; ++q) {
      for (int64_t run = queues.take_front(q); run >= 0; run = queues.take_front(q)) fn(run, state);
    }
    for (int64_t run = queues.take_back(); run >= 0; run = queues.take_back()) fn(run, state);
  });
}

// fn(begin, end) over [0, n) in ranges of `grain` items (the last shorter),
// spread as for_each_run_balanced's runs.
template <typename Fn>
void for_each_range_balanced(int64_t n, int64_t grain, const Fn& fn) {
  for_each_run_balanced(
      (n + grain - 1) / grain, [] { return 0; },
      [&](int64_t run, int) { fn(run * grain, std::min(n, (run + 1) * grain)); });
}

#ifdef CPU_CAPABILITY
}  // namespace CPU_CAPABILITY
#endif
}  // namespace cpu
}  // namespace muon_ext

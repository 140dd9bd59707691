#include "parallel_probe.h"

#include <ATen/Parallel.h>

#include <atomic>
#include <mutex>
#include <set>
#include <thread>

namespace muon_ext {
namespace cpu {

int64_t threads_used_by_parallel_for(int64_t items, int64_t grain) {
  std::mutex mutex;
  std::set<std::thread::id> seen;
  std::atomic<uint64_t> sink{0};
  at::parallel_for(0, items, grain, [&](int64_t begin, int64_t end) {
    {
      std::lock_guard<std::mutex> lock(mutex);
      seen.insert(std::this_thread::get_id());
    }
    // A little work per item, so one thread cannot finish every range before
    // the others start (a real kernel's ranges take far longer).
    uint64_t acc = 0;
    for (int64_t i = begin; i < end; ++i) {
      for (int k = 0; k < 2000; ++k) acc += static_cast<uint64_t>(i * k) ^ acc;
    }
    sink.fetch_add(acc, std::memory_order_relaxed);
  });
  return static_cast<int64_t>(seen.size());
}

}  // namespace cpu
}  // namespace muon_ext

// A probe of how the CPU kernels' at::parallel_for runs in this build: a test
// hook, so a build that silently compiles it serial (no OpenMP flags) fails
// the tests instead of running every kernel on one thread.
#pragma once

#include <cstdint>

namespace muon_ext {
namespace cpu {

// Runs at::parallel_for over [0, items) with `grain` and returns how many
// distinct threads ran work items (each item spins briefly, so every thread
// of the pool gets some when items >> threads).
int64_t threads_used_by_parallel_for(int64_t items, int64_t grain);

}  // namespace cpu
}  // namespace muon_ext

// Small-matrix Polar-Express: see polar_small.h.
#include "polar_small.h"

#include <ATen/Parallel.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <vector>

#include "../common/shapes.h"
#include "adamw_cpu.h"
#include "balanced_runs.h"

namespace muon_ext {
namespace cpu {
namespace {

// The kernel of the best instruction set built in and allowed here (ATen's
// CPU capability, which ATEN_CPU_CAPABILITY caps).
using GroupsKernel = void (*)(float*, bool, int64_t, int64_t, int64_t, const float*, int64_t, PolarRounding,
                              bool, const SmallNorMuon*, const SmallPrefetch*, float*);

GroupsKernel groups_kernel() {
  static const GroupsKernel kernel = [] {
    switch (best_capability()) {
#if defined(MUON_EXT_HAVE_AVX512)
      case CpuCapability::kAVX512: return &AVX512::polar_small_groups;
#endif
#if defined(MUON_EXT_HAVE_AVX2)
      case CpuCapability::kAVX2: return &AVX2::polar_small_groups;
#endif
      default: return &DEFAULT::polar_small_groups;
    }
  }();
  return kernel;
}

}  // namespace

int64_t polar_small_scratch_floats(int64_t rows, int64_t cols, bool gram, bool normuon) {
  const int64_t n = rows * cols, side = std::min(rows, cols);
  const int64_t stats = normuon ? 4 * shapes::stat_length(rows, cols) : 0;
  // Whole 16-float vectors, so 64-byte aligned: the AVX2 / AVX-512 kernels load them with aligned moves.
  return int64_t(kPolarSmallLanes) * (2 * n + (gram ? 4 : 2) * side * side + stats);
}

void polar_express_small_matrices(float* xs, bool scale_by_input_norm, int64_t count, int64_t rows, int64_t cols,
                                  const float* abc, int64_t steps, PolarRounding rounding, bool gram,
                                  const SmallNorMuon* normuon, const SmallPrefetch* prefetch, float* scratch) {
  TORCH_INTERNAL_ASSERT(reinterpret_cast<uintptr_t>(scratch) % 64 == 0);
  groups_kernel()(xs, scale_by_input_norm, count, rows, cols, abc, steps, rounding, gram, normuon, prefetch, scratch);
}

PolarSmallScratch::PolarSmallScratch(int64_t floats)
    : memory_(std::aligned_alloc(64, static_cast<size_t>(std::max<int64_t>(floats, 16)) * sizeof(float)), &std::free) {
  TORCH_CHECK(memory_ != nullptr, "muon: out of memory for the small-matrix scratch");
}

void polar_express_small(float* xs, int64_t count, int64_t rows, int64_t cols,
                         const std::vector<std::array<float, 3>>& coefficients, PolarRounding rounding, bool gram) {
  std::vector<float> abc;
  for (const auto& t : coefficients) abc.insert(abc.end(), t.begin(), t.end());
  const int64_t n = rows * cols;
  const int64_t groups = (count + kPolarSmallLanes - 1) / kPolarSmallLanes;
  // Tasks of about 32k lane-elements, at least one group each.
  const int64_t grain = std::max<int64_t>(1, 32768 / std::max<int64_t>(n * kPolarSmallLanes, 1));
  auto run_groups = [&](int64_t first, int64_t last, PolarSmallScratch& scratch) {
    const int64_t begin = first * kPolarSmallLanes, end = std::min(count, last * kPolarSmallLanes);
    polar_express_small_matrices(xs + begin * n, false, end - begin, rows, cols, abc.data(),
                                 static_cast<int64_t>(coefficients.size()), rounding, gram, nullptr, nullptr,
                                 scratch.data());
  };
  const int64_t scratch_floats = polar_small_scratch_floats(rows, cols, gram, false);
  for_each_run_balanced(
      (groups + grain - 1) / grain, [&] { return PolarSmallScratch(scratch_floats); },
      [&](int64_t run, PolarSmallScratch& scratch) { run_groups(run * grain, std::min(groups, (run + 1) * grain), scratch); });
}

}  // namespace cpu
}  // namespace muon_ext

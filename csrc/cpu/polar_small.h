// Polar-Express for small matrices, sixteen at a time, one per SIMD lane.
//
// Thousands of tiny matrices (per-head blocks, expert stacks, (n, 1, 1)
// parameters) lose everything to per-GEMM call overhead on the BLAS path: at
// 8x8 each GEMM is a few hundred flops behind microseconds of dispatch. Here a
// group of sixteen matrices is transposed into lanes (element e of matrix m at
// lane m of vector e), and the iteration is written out with plain loops on
// 16-wide vectors (one AVX-512 register, two AVX2 ones): every vector operation is the scalar one per lane, in a
// fixed order (fused multiply-adds only where their product is exact, and
// computed by every ISA build), so a matrix gets the same bits in any lane,
// any group, on any ISA, on any thread count and at any address
// (docs/design.md, "CPU kernels", small matrices).
#pragma once

#include <array>
#include <cstdint>
#include <cstdlib>
#include <memory>
#include <vector>

namespace muon_ext {
namespace cpu {

// Rounding of every GEMM output (and of X on entry), as in the BLAS path.
enum class PolarRounding { kNone, kBFloat16, kFloat16 };

// Shapes this kernel takes: min(rows, cols)^2 * max(rows, cols) at most this
// many multiply-adds per product (measured crossover with the BLAS path on
// 2 Zen3 cores: docs/design.md, "CPU kernels").
constexpr int64_t kSmallPolarMaxWork = int64_t(1) << 20;

inline bool polar_small_shape(int64_t rows, int64_t cols) {
  const int64_t side = rows < cols ? rows : cols, length = rows < cols ? cols : rows;
  return side * side * length <= kSmallPolarMaxWork;
}

// Runs the iterations on `count` contiguous FP32 [rows, cols] matrices at xs,
// in place, on the intra-op threads: standard iterations, or with `gram` the
// Gram Newton-Schulz plan of csrc/common/polar_plan.h (polar_gram_plan: the
// same products, restarts and rounding points).
// Matrices per group: one per lane of a SIMD vector.
constexpr int kPolarSmallLanes = 16;

// NorMuon done in the lanes after the iterations (the fused step): matrix j's
// second moments at second_moments[j], updated; x leaves times its multipliers.
struct SmallNorMuon {
  float* const* second_moments;
  float beta2;
};

// NorMuon in the lanes up to this many statistics per matrix (its scratch grows with them).
constexpr int64_t kSmallNorMuonMaxStats = 128;

// Memory to prefetch into L2 while the groups iterate (the fused step's next
// loads), issued a share after each product of an iteration step so that the
// loads overlap the arithmetic instead of queueing at once: `lines` cache
// lines from `first_line` (64-byte aligned).
struct PrefetchRange {
  uintptr_t first_line;
  int64_t lines;
};
struct SmallPrefetch {
  const PrefetchRange* ranges;
  int64_t count;
};

// Scratch floats polar_express_small_matrices needs (one group in lanes).
int64_t polar_small_scratch_floats(int64_t rows, int64_t cols, bool gram, bool normuon);

// A 64-byte aligned scratch of `floats` floats, one per thread.
class PolarSmallScratch {
 public:
  explicit PolarSmallScratch(int64_t floats);
  float* data() { return static_cast<float*>(memory_.get()); }

 private:
  std::unique_ptr<void, decltype(&std::free)> memory_;
};

// The iterations on `count` contiguous FP32 [rows, cols] matrices at xs, in
// place, on the calling thread, group by group. With scale_by_input_norm,
// each matrix enters as x * polar_input_scale(its sum of squares), computed
// in the lanes (muon_elementwise.h's sum_of_squares, lane by lane: the same bits); abc
// holds `steps` (a, b, c) triples; with normuon (stat_length <=
// kSmallNorMuonMaxStats), NorMuon follows in the lanes; prefetch may be
// null; scratch has polar_small_scratch_floats().
void polar_express_small_matrices(float* xs, bool scale_by_input_norm, int64_t count, int64_t rows, int64_t cols,
                                  const float* abc, int64_t steps, PolarRounding rounding, bool gram,
                                  const SmallNorMuon* normuon, const SmallPrefetch* prefetch, float* scratch);

// The kernel of polar_express_small_matrices, built once per instruction set
// (polar_small_kernel.cpp); scratch is 64-byte aligned.
#define MUON_EXT_DECLARE_POLAR_SMALL_KERNEL(ISA)                                                                     \
  namespace ISA {                                                                                                   \
  void polar_small_groups(float* xs, bool scale_by_input_norm, int64_t count, int64_t rows, int64_t cols,          \
                          const float* abc, int64_t steps, PolarRounding rounding, bool gram,                       \
                          const SmallNorMuon* normuon, const SmallPrefetch* prefetch, float* scratch);              \
  }
MUON_EXT_DECLARE_POLAR_SMALL_KERNEL(DEFAULT)
MUON_EXT_DECLARE_POLAR_SMALL_KERNEL(AVX2)
MUON_EXT_DECLARE_POLAR_SMALL_KERNEL(AVX512)
#undef MUON_EXT_DECLARE_POLAR_SMALL_KERNEL

void polar_express_small(float* xs, int64_t count, int64_t rows, int64_t cols,
                         const std::vector<std::array<float, 3>>& coefficients, PolarRounding rounding, bool gram);

}  // namespace cpu
}  // namespace muon_ext

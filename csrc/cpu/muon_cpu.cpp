// CPU Muon step: momentum pre-pass into a stacked FP32 workspace, Polar-Express
// with FP32 GEMMs, NorMuon statistics, cautious apply into params and masters.
//
// The element math is csrc/common/muon_math.h, shared with the CUDA kernels.
// GEMMs run per matrix in fixed row panels, one single-threaded at::addmm_out
// each, so a matrix gets the same bits whether it is stepped alone, in a
// bucket, in any chunk of one, or on any number of threads. The symmetric
// products X X^T and A A compute only their upper block triangle
// (csrc/common/polar_plan.h, the plan the CUDA kernel runs too).
#include "muon_cpu.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/Utils.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <string>
#include <type_traits>
#include <vector>

#ifdef _OPENMP
#include <omp.h>
#endif

#include "../common/bits.h"
#include "../common/polar_plan.h"
#include "../common/remainder.h"
#include "../common/shapes.h"
#include "adamw_cpu.h"
#include "balanced_runs.h"
#include "bf16_tile_gemm.h"
#include "polar_small.h"
#include "scratch_pool.h"
#include "scalar_io.h"
#include "scalar_kind.h"

namespace muon_ext {
namespace cpu {
namespace {

// Elements per parallel work item in the elementwise passes.
constexpr int64_t kWorkItem = 16384;

// Where matrix j of the bucket lives: its param and the matrix's index in it.
struct MatrixRef {
  int64_t param;
  int64_t index;
};

// Calls fn(std::integral_constant<ScalarKind, K>) for the format of a float tensor.
template <typename Fn>
void dispatch_storage(ScalarKind kind, const Fn& fn) {
  switch (kind) {
    case ScalarKind::kFloat32: return fn(std::integral_constant<ScalarKind, ScalarKind::kFloat32>{});
    case ScalarKind::kBFloat16: return fn(std::integral_constant<ScalarKind, ScalarKind::kBFloat16>{});
    case ScalarKind::kFloat16: return fn(std::integral_constant<ScalarKind, ScalarKind::kFloat16>{});
  }
}

// Sum of squares in double with eight interleaved accumulators combined in a
// fixed order: fast, and the same bits for the same data on every call.
__attribute__((always_inline)) inline double sum_of_squares(const float* x, int64_t n) {
  double acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int64_t k = 0;
  for (; k + 8 <= n; k += 8) {
    for (int l = 0; l < 8; ++l) acc[l] += double(x[k + l]) * double(x[k + l]);
  }
  for (; k < n; ++k) acc[0] += double(x[k]) * double(x[k]);
  return ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
}

// Runs fn(matrix, begin, end) over element ranges of every matrix of a chunk,
// in parallel (balanced_runs.h).
template <typename Fn>
void for_each_matrix_range(int64_t matrices, int64_t matrix_numel, const Fn& fn) {
  const int64_t items_per_matrix = (matrix_numel + kWorkItem - 1) / kWorkItem;
  auto run_items = [&](int64_t first, int64_t last) {
    for (int64_t item = first; item < last; ++item) {
      const int64_t j = item / items_per_matrix;
      const int64_t begin = (item % items_per_matrix) * kWorkItem;
      fn(j, begin, std::min(begin + kWorkItem, matrix_numel));
    }
  };
  for_each_range_balanced(matrices * items_per_matrix, 1, run_items);
}

int64_t items_per_matrix(int64_t matrix_numel) { return (matrix_numel + kWorkItem - 1) / kWorkItem; }

// Each tensor's data pointer, taken once per step: with thousands of tiny
// matrices, data_ptr()'s checks per matrix cost more than the matrix's math.
template <typename T = void>
std::vector<T*> data_pointers(const std::vector<at::Tensor>& tensors) {
  std::vector<T*> out;
  out.reserve(tensors.size());
  for (const at::Tensor& t : tensors) out.push_back(static_cast<T*>(t.data_ptr()));
  return out;
}

std::vector<const void*> const_data_pointers(const std::vector<at::Tensor>& tensors) {
  std::vector<const void*> out;
  out.reserve(tensors.size());
  for (const at::Tensor& t : tensors) out.push_back(t.const_data_ptr());
  return out;
}

// X = u / (||u||_F * 1.02 + 1e-6) in place on `count` contiguous matrices of n
// elements, from per-work-item partial sums of u^2 (partial[j * items + item],
// each the sum_of_squares of one kWorkItem range), combined in item order:
// deterministic for any thread count, and the same whether the partials were
// taken while computing u (fused step) or from a stored u (phase 2).
void scale_by_input_norm(float* xs, int64_t count, int64_t n, const std::vector<double>& partial) {
  const int64_t items = items_per_matrix(n);
  for_each_matrix_range(count, n, [&](int64_t j, int64_t begin, int64_t end) {
    double sum = 0.0;
    for (int64_t i = 0; i < items; ++i) sum += partial[j * items + i];
    const float scale = polar_input_scale(static_cast<float>(sum));
    float* out = xs + j * n;
    for (int64_t k = begin; k < end; ++k) out[k] = out[k] * scale;
  });
}

// The instruction sets Muon's elementwise passes are cloned for (GCC picks
// one at load time). AVX-512 with BW, not F alone: the BF16 grad loads and
// the remainder split and merge are 16-bit lane operations, which AVX-512F
// has only at 256 bits, so an "avx512f" clone ran them on half-width vectors.
#define MUON_EXT_ISA_CLONES __attribute__((target_clones("arch=x86-64-v4", "avx2", "default")))

// out[k] = muon_momentum(mom[k], grad[grad_offset + k] * inv_scale, mu,
// nesterov) for k < count, with lerp's forms and nesterov decided once
// (muon_momentum_in_form): the same operations, and the vectorized loop no
// longer computes both forms under masks. Inlined into the callers' ISA clones.
template <ScalarKind G, bool kMomentumForm, bool kNesterovForm, bool kNesterov>
__attribute__((always_inline)) inline void momentum_loop(const void* grad, int64_t grad_offset, float* mom, float* out,
                                                         int64_t count, float inv_scale, float mu) {
  for (int64_t k = 0; k < count; ++k) {
    out[k] = muon_ext::muon_momentum_in_form<kMomentumForm, kNesterovForm, kNesterov>(
        mom[k], load_scalar<G>(grad, grad_offset + k) * inv_scale, mu);
  }
}

template <ScalarKind G>
__attribute__((always_inline)) inline void momentum_elements(const void* grad, int64_t grad_offset, float* mom,
                                                             float* out, int64_t count, float inv_scale, float mu,
                                                             bool nesterov) {
  const bool momentum_small = muon_ext::lerp_uses_small_form(1.0f - mu);
  const bool nesterov_small = muon_ext::lerp_uses_small_form(mu);
  if (!nesterov) {
    return momentum_small ? momentum_loop<G, true, false, false>(grad, grad_offset, mom, out, count, inv_scale, mu)
                          : momentum_loop<G, false, false, false>(grad, grad_offset, mom, out, count, inv_scale, mu);
  }
  if (momentum_small) {
    return nesterov_small ? momentum_loop<G, true, true, true>(grad, grad_offset, mom, out, count, inv_scale, mu)
                          : momentum_loop<G, true, false, true>(grad, grad_offset, mom, out, count, inv_scale, mu);
  }
  return nesterov_small ? momentum_loop<G, false, true, true>(grad, grad_offset, mom, out, count, inv_scale, mu)
                        : momentum_loop<G, false, false, true>(grad, grad_offset, mom, out, count, inv_scale, mu);
}

// Momentum and Nesterov over elements [begin, end) of one matrix (grad and
// mom at `offset`), into out; returns the sum of squares of what it wrote.
// Cloned per instruction set, as torch's kernels are: the baseline build
// would run it one scalar at a time; the same IEEE operations in every clone
// (no contraction, sum_of_squares' eight fixed chains), so the same bits.
template <ScalarKind G>
MUON_EXT_ISA_CLONES double momentum_range(
    const void* grad, float* mom, float* out, int64_t offset, int64_t begin, int64_t end, float inv_scale, float mu,
    bool nesterov) {
  momentum_elements<G>(grad, offset + begin, mom + begin, out + begin, end - begin, inv_scale, mu, nesterov);
  return sum_of_squares(out + begin, end - begin);
}

// Pre-pass of the fused step: momentum + Nesterov into the workspace, then the input scale.
void momentum_and_scale(const MuonBucket& b, const MuonStepOptions& o, const std::vector<MatrixRef>& mats,
                        float inv_scale, at::Tensor& x) {
  const int64_t n = b.matrix_numel();
  const int64_t items = items_per_matrix(n);
  const int64_t count = static_cast<int64_t>(mats.size());
  std::vector<double> partial(count * items, 0.0);
  float* xs = x.data_ptr<float>();
  const float mu = o.hyper.momentum;
  const bool nesterov = o.hyper.nesterov;
  dispatch_storage(scalar_kind(b.grads[0].scalar_type()), [&](auto grad_storage) {
    constexpr ScalarKind G = decltype(grad_storage)::value;
    const std::vector<const void*> grads = const_data_pointers(b.grads);
    const std::vector<float*> moms = data_pointers<float>(b.momentum_buffers);
    for_each_matrix_range(count, n, [&](int64_t j, int64_t begin, int64_t end) {
      const int64_t offset = mats[j].index * n;
      const void* grad = grads[mats[j].param];
      float* mom = moms[mats[j].param] + offset;
      float* out = xs + j * n;
      partial[j * items + begin / kWorkItem] =
          momentum_range<G>(grad, mom, out, offset, begin, end, inv_scale, mu, nesterov);
    });
  });
  scale_by_input_norm(xs, count, n, partial);
}

// MKL's thread-local thread count, exported by MKL-linked torch builds; weak,
// so a torch with another BLAS still loads this library (and runs unguarded).
extern "C" int MKL_Set_Num_Threads_Local(int) __attribute__((weak));

// The BLAS's FP32 GEMM (Fortran interface, 32-bit sizes), as torch calls it;
// weak, so a torch without one exported runs at::addmm_out instead.
extern "C" void sgemm_(const char* trans_a, const char* trans_b, const int* m, const int* n, const int* k,
                       const float* alpha, const float* a, const int* lda, const float* b, const int* ldb,
                       const float* beta, float* c, const int* ldc) __attribute__((weak));

// While alive, GEMMs called from this thread run on this thread alone. MKL's
// threaded GEMM splits the work by its thread count, and the split changes
// the bits (with beta != 0 at 2 threads, even with beta = 0 at 4); oneDNN
// (BF16 GEMMs) threads over OpenMP. Single-threaded calls on fixed panels
// make the bits independent of the thread count (docs/design.md, "Rounding
// contract"). On exit the thread's settings are restored.
class SequentialBlas {
 public:
  SequentialBlas() {
    // torch sets a thread's MKL and OpenMP thread counts at its first
    // parallel call (at::init_num_threads, once per thread; after an explicit
    // torch.set_num_threads, to that count). In a fresh worker thread (a new
    // caller's team) that came after the settings below and undid them: MKL
    // split that call's GEMM and changed its bits. So it runs first, through
    // the flag this library inlines and the one in libtorch.
    at::internal::lazy_init_num_threads();
    (void)at::get_num_threads();
    if (MKL_Set_Num_Threads_Local != nullptr) MKL_Set_Num_Threads_Local(1);
#ifdef _OPENMP
    omp_threads_ = omp_get_max_threads();
    omp_set_num_threads(1);
#endif
  }
  ~SequentialBlas() {
    if (MKL_Set_Num_Threads_Local != nullptr) MKL_Set_Num_Threads_Local(0);
#ifdef _OPENMP
    omp_set_num_threads(omp_threads_);
#endif
  }
  SequentialBlas(const SequentialBlas&) = delete;
  SequentialBlas& operator=(const SequentialBlas&) = delete;

 private:
  int omp_threads_ = 1;
};

// Runs fn(task) for every task in [0, n) on the intra-op threads, handed out
// one at a time (they differ in size), with single-threaded BLAS. Which thread
// runs a task never changes what it computes.
template <typename Fn>
void run_tasks(int64_t n, const Fn& fn) {
  if (n <= 0) return;
  std::atomic<int64_t> next{0};
  const int64_t workers = std::min<int64_t>(n, at::get_num_threads());
  at::parallel_for(0, workers, 1, [&](int64_t, int64_t) {
    SequentialBlas sequential;
    for (int64_t t = next.fetch_add(1); t < n; t = next.fetch_add(1)) fn(t);
  });
}

// A PolarView of one matrix's buffer slot (a flat contiguous tensor) as a tensor.
at::Tensor view_of(const at::Tensor& slot, const PolarView& v) {
  const int64_t base = slot.storage_offset() + v.offset;
  return v.transposed ? slot.as_strided({v.rows, v.cols}, {1, v.ld}, base)
                      : slot.as_strided({v.rows, v.cols}, {v.ld, 1}, base);
}

// Copies the strictly upper block triangle of the [side, side] slot onto the lower one.
void mirror_upper_blocks(const at::Tensor& slot, int64_t side, const std::vector<int64_t>& bounds) {
  const at::Tensor m = slot.view({side, side});
  for (size_t i = 0; i + 2 < bounds.size(); ++i) {
    const int64_t r0 = bounds[i], r1 = bounds[i + 1], h = r1 - r0;
    m.narrow(0, r1, side - r1).narrow(1, r0, h).copy_(m.narrow(0, r0, h).narrow(1, r1, side - r1).t());
  }
}

// Every Polar-Express buffer starts on a 64-byte boundary. The GEMM library
// picks its code path (and so its rounding) by the operands' alignment, so a
// buffer at an arbitrary offset (a matrix inside a bucket, a user's update
// tensor) would change the bits (docs/design.md, "CPU kernels").
constexpr int64_t kAlignBytes = 64;

int64_t align_up(int64_t n, int64_t element_size) {
  const int64_t per_line = kAlignBytes / element_size;
  return (n + per_line - 1) / per_line * per_line;
}

// Rounds n FP32 values to BF16 (nearest even) in place: the output rounding
// of a BF16 GEMM, applied after an FP32 GEMM of BF16 values.
void round_to_bf16(float* values, int64_t n) {
  for (int64_t k = 0; k < n; ++k) values[k] = bf16_bits_to_float(float_to_bf16_bits_rne(values[k]));
}

// Rounds n FP32 values to FP16 (nearest even) in place, as a FP16 GEMM's output.
void round_to_fp16(float* values, int64_t n) {
  for (int64_t k = 0; k < n; ++k) values[k] = half_bits_to_float(float_to_half_bits_rne(values[k]));
}

// Rounds values to the precision of `rounding` (kNone: unchanged).
void round_to(PolarRounding rounding, float* values, int64_t n) {
  if (rounding == PolarRounding::kBFloat16) round_to_bf16(values, n);
  if (rounding == PolarRounding::kFloat16) round_to_fp16(values, n);
}

// The same on a row-major view (a GEMM's output panel).
void round_to(PolarRounding rounding, const at::Tensor& view) {
  if (rounding == PolarRounding::kNone) return;
  TORCH_INTERNAL_ASSERT(view.dim() == 2 && view.stride(1) == 1);
  float* base = view.data_ptr<float>();
  for (int64_t r = 0; r < view.size(0); ++r) round_to(rounding, base + r * view.stride(0), view.size(1));
}

// slot(i, i) += value for the [side, side] slot, each sum rounded to the
// slot's format (BF16 buffers) or by `rounding` (FP32 buffers): the Gram plan's
// Q = Z + a I, an output like a GEMM's.
void add_to_diagonal(const at::Tensor& slot, int64_t side, float value, PolarRounding rounding) {
  if (slot.scalar_type() == at::kBFloat16) {
    uint16_t* bits = static_cast<uint16_t*>(slot.data_ptr());
    for (int64_t i = 0; i < side; ++i) {
      uint16_t& e = bits[i * (side + 1)];
      e = float_to_bf16_bits_rne(bf16_bits_to_float(e) + value);
    }
    return;
  }
  float* values = slot.data_ptr<float>();
  for (int64_t i = 0; i < side; ++i) {
    float& e = values[i * (side + 1)];
    e = e + value;
    round_to(rounding, &e, 1);
  }
}

// The rounding of each GEMM output for a polar_dtype (FP32 GEMMs on the CPU).
PolarRounding rounding_of(PolarDtype precision) {
  switch (precision) {
    case PolarDtype::kBFloat16: return PolarRounding::kBFloat16;
    case PolarDtype::kFloat16: return PolarRounding::kFloat16;
    case PolarDtype::kFloat32: break;
  }
  return PolarRounding::kNone;
}

// On the micro-kernel, a GEMM packs its whole right operand column chunk
// before writing that chunk of its output (bf16_tile_gemm.h), so "copy B to
// T, then one call B = A T (+ beta B)" may read T's values from B itself: the
// copy (X into XOperand before X = Poly X + a X, and before the Gram plan's
// last Q X) is skipped. One call only: a second row panel would read rows the
// first had overwritten.
// Whether an op of stages[first..] may read `buffer` before a copy overwrites
// all of it (a GEMM writing it counts as a read: it may write only a part).
bool read_before_overwritten(const std::vector<PolarStage>& stages, size_t first, PolarBuffer buffer) {
  for (size_t j = first; j < stages.size(); ++j) {
    for (const PolarOp& op : stages[j].ops) {
      if (op.kind == PolarOp::Kind::kGemm) {
        if (op.lhs.buffer == buffer || op.rhs.buffer == buffer || op.out.buffer == buffer) return true;
      } else if (op.from == buffer || (op.kind != PolarOp::Kind::kCopy && op.to == buffer)) {
        return true;
      } else if (op.to == buffer) {
        return false;  // a whole-slot copy
      }
    }
  }
  return false;
}

std::vector<PolarStage> read_operands_in_place(const std::vector<PolarStage>& stages) {
  std::vector<PolarStage> out;
  for (size_t i = 0; i < stages.size(); ++i) {
    if (i + 1 < stages.size() && stages[i].ops.size() == 1 && stages[i + 1].ops.size() == 1) {
      const PolarOp& copy = stages[i].ops[0];
      const PolarOp& gemm = stages[i + 1].ops[0];
      if (copy.kind == PolarOp::Kind::kCopy && gemm.kind == PolarOp::Kind::kGemm && gemm.out.buffer == copy.from &&
          gemm.rhs.buffer == copy.to && gemm.lhs.buffer != copy.to && !read_before_overwritten(stages, i + 2, copy.to)) {
        out.push_back(stages[i + 1]);
        out.back().ops[0].rhs.buffer = copy.from;
        ++i;
        continue;
      }
    }
    out.push_back(stages[i]);
  }
  return out;
}

}  // namespace

PolarGemm polar_bf16_gemm() {
  static const PolarGemm chosen = [] {
    const char* forced = std::getenv("MUON_EXT_CPU_BF16_GEMM");
    if (forced != nullptr && std::string(forced) == "native") return PolarGemm::kNativeBf16;
    if (forced != nullptr && std::string(forced) == "rounded") return PolarGemm::kRoundedFp32;
    TORCH_CHECK(forced == nullptr || *forced == '\0', "MUON_EXT_CPU_BF16_GEMM must be 'native' or 'rounded', got '",
                forced, "'");
    const auto caps = at::cpu::get_cpu_capabilities();
    auto has = [&](const char* key) {
      const auto it = caps.find(key);
      return it != caps.end() && it->second.isBool() && it->second.toBool();
    };
    return has("avx512_bf16") || has("amx_bf16") ? PolarGemm::kNativeBf16 : PolarGemm::kRoundedFp32;
  }();
  return chosen;
}

namespace {

// The native BF16 GEMM (oneDNN on AVX-512 BF16 / AMX) wants big calls: on a
// Sapphire Rapids core, 1024x4096 X X^T ran at 340 GFLOP/s in 128-row panels,
// 450 in 256-row, 500 in 512-row and 700 as one call (A A: 640 .. 1240; the
// update P X: 290 .. 780). So on that path each GEMM is one call up to 1024
// output rows. The block triangle (strided outputs, smaller calls) paid only
// where X X^T dominates: polar_express on one thread, row blocks 1 / 2 / 4
// (ms, loaded host): 1024x4096 127 / 118 / 121, 4096x1024 151 / 139 / 129,
// but 1024x1024 34 / 36 / 39, 2048x2048 351 / 394 / 353, 512x2048 18.5 / 19
// / 21, and 4 x 256x1024 14 / 17 / 24. Both choices are functions of the
// shape only.
constexpr int64_t kNativeBf16PanelRows = 1024;

inline int64_t native_bf16_row_blocks(int64_t rows, int64_t cols) {
  const int64_t side = std::min(rows, cols), length = std::max(rows, cols);
  return length >= 4 * side ? std::clamp<int64_t>(side / 512, 1, 8) : 1;
}

// Polar-Express iterations executing csrc/common/polar_plan.h's stages; the
// result lands in `x` ([count, rows, cols], FP32). Every GEMM is a fixed row
// panel computed by one single-threaded BLAS call on 64-byte aligned buffers
// (X is copied into the aligned scratch and back), so each matrix gets the
// same bits for any thread count, any address, alone, batched or in any chunk.
// Threads share the panels of up to `group` matrices at a time, each with its
// own scratch (group <= threads, and within `max_scratch_bytes` beyond one).
//
// Precision (docs/design.md, "Rounding contract"): kFloat32 runs FP32 GEMMs.
// kBFloat16 follows the CUDA path's rounding: X enters as BF16, every GEMM
// takes BF16 operands, accumulates in FP32 and rounds its output to BF16 once.
// With a BF16 GEMM in the CPU (polar_bf16_gemm() == kNativeBf16) the buffers
// are BF16 and oneDNN multiplies them; otherwise the buffers are FP32 holding
// BF16 values, the GEMM is FP32 (products of BF16 values are exact in FP32)
// and its output is rounded after it: the same rounding points, another
// accumulation order, and never the slow emulated BF16 GEMM.
//
// `method` picks the plan (polar_method_for: the standard iteration or Gram
// Newton-Schulz, docs/design.md "Gram Newton-Schulz"); both run on the same
// panels and scratch, with the same rounding points per GEMM output.
void polar_express(at::Tensor& x, const std::vector<std::array<float, 3>>& coefficients, int64_t rows,
                   int64_t cols, int64_t row_blocks, int64_t max_scratch_bytes, PolarDtype precision,
                   PolarMethod method) {
  const int64_t count = x.size(0);
  const PolarMethod iteration = polar_method_for(method, rows, cols);
  const bool bf16 = precision == PolarDtype::kBFloat16;
  const PolarRounding rounding = rounding_of(precision);
  if (count == 0) return;
  if (coefficients.empty()) {
    // X still enters in BF16 / FP16, as on CUDA (the workspace there is 16-bit).
    if (rounding == PolarRounding::kNone) return;
    float* xs = x.data_ptr<float>();
    const int64_t n = rows * cols;
    for_each_matrix_range(count, n, [&](int64_t j, int64_t begin, int64_t end) {
      round_to(rounding, xs + j * n + begin, end - begin);
    });
    return;
  }
  if (polar_small_shape(rows, cols)) {
    // Sixteen matrices per SIMD vector, no BLAS calls (polar_small.h).
    polar_express_small(x.data_ptr<float>(), count, rows, cols, coefficients, rounding,
                        iteration == PolarMethod::kGram);
    return;
  }
  const bool native = bf16 && polar_bf16_gemm() == PolarGemm::kNativeBf16;
  const PolarRounding output_rounding = native ? PolarRounding::kNone : rounding;
  const int64_t side = std::min(rows, cols), length = std::max(rows, cols);
  // On the micro-kernel (bf16_tile_gemm.h) a tall matrix runs as its
  // transpose: polar(X) = polar(X^T)^T, and the wide plan's operands are all
  // row-major but X^T, which packing reads transposed for free. The
  // micro-kernel's own triangle (symmetric tiles) replaces row blocks.
  const bool tiles = native && bf16_tile_gemm_available() && side % 16 == 0 && length % 16 == 0;
  const bool transposed = tiles && rows > cols;
  const int64_t plan_rows = transposed ? cols : rows, plan_cols = transposed ? rows : cols;
  const int64_t default_row_blocks =
      tiles ? 1 : native ? native_bf16_row_blocks(rows, cols) : polar_row_blocks_cpu(side);
  const std::vector<int64_t> bounds = polar_block_bounds(side, row_blocks > 0 ? row_blocks : default_row_blocks);
  const std::vector<PolarOp> plan =
      polar_plan(iteration, plan_rows, plan_cols, bounds, static_cast<int>(coefficients.size()),
                 polar_gram_restart_period(precision != PolarDtype::kFloat32));
  std::vector<PolarStage> stages = polar_fold_copies(
      polar_stages(plan, native ? kNativeBf16PanelRows : kPolarPanelRowsCpu), plan_rows, plan_cols, bounds);
  if (tiles) stages = read_operands_in_place(stages);

  // Scratch of one matrix: its four buffers back to back, each 64-byte aligned
  // (at::empty's CPU allocations are).
  const at::ScalarType scratch_dtype = native ? at::kBFloat16 : at::kFloat;
  const int64_t element_size = static_cast<int64_t>(c10::elementSize(scratch_dtype));
  std::array<int64_t, kPolarBufferCount> slot_offset{};
  int64_t scratch_numel = 0;
  for (int k = 0; k < kPolarBufferCount; ++k) {
    const PolarBuffer b = static_cast<PolarBuffer>(k);
    slot_offset[k] = scratch_numel;
    if (polar_plan_uses(plan, b)) scratch_numel += align_up(polar_buffer_numel(b, rows, cols), element_size);
  }
  const int64_t scratch_bytes = scratch_numel * element_size;
  const int64_t group = std::max<int64_t>(
      1, std::min({count, int64_t(at::get_num_threads()), max_scratch_bytes / std::max<int64_t>(scratch_bytes, 1)}));
  const ScratchLease scratch_lease(ScratchSlot::kPolarScratch, {group, scratch_numel}, scratch_dtype);
  const at::Tensor& scratch = scratch_lease.tensor();
  TORCH_INTERNAL_ASSERT(reinterpret_cast<uintptr_t>(scratch.const_data_ptr()) % kAlignBytes == 0);
  const at::Tensor flat_x = x.view({count, rows * cols});
  // Each member's buffers as tensors, made once: a select and narrow per GEMM
  // call cost about a tenth of a 256x1024 matrix's time on the native path.
  std::vector<std::array<at::Tensor, kPolarBufferCount>> slots(group);
  for (int64_t member = 0; member < group; ++member) {
    for (int k = 0; k < kPolarBufferCount; ++k) {
      const PolarBuffer b = static_cast<PolarBuffer>(k);
      if (polar_plan_uses(plan, b)) {
        slots[member][k] = scratch[member].narrow(0, slot_offset[k], polar_buffer_numel(b, rows, cols));
      }
    }
  }
  auto slot = [&](int64_t member, PolarBuffer b) -> const at::Tensor& { return slots[member][static_cast<int>(b)]; };

  for (int64_t first = 0; first < count; first += group) {
    const int64_t members = std::min(group, count - first);
    const bool whole_matrix_stages =
        std::all_of(stages.begin(), stages.end(), [](const PolarStage& stage) { return stage.ops.size() == 1; });
    // A matrix per thread, or (fewer matrices than threads) the threads sharing each stage.
    const bool matrix_per_thread =
        members > 1 && (whole_matrix_stages || (members == group && group == at::get_num_threads()));
    // Copies in the shared mode run one at a time from here, where torch's
    // copy_ splits each among the threads (inside a task it would run on one).
    auto for_each_member = [&](const auto& fn) {
      if (matrix_per_thread || transposed) {
        run_tasks(members, fn);
      } else {
        for (int64_t member = 0; member < members; ++member) fn(member);
      }
    };
    for_each_member([&](int64_t member) {
      at::Tensor into = slot(member, PolarBuffer::kX);
      // To BF16 (nearest even) when the scratch is BF16.
      if (transposed) {
        transpose_to_bf16(flat_x[first + member].const_data_ptr<float>(), rows, cols,
                          static_cast<uint16_t*>(into.data_ptr()));
      } else {
        into.copy_(flat_x[first + member]);
      }
      round_to(output_rounding, into.view({rows, cols}));
    });
    // A kGemm on the micro-kernel: its views as pointers into the member's BF16 slots.
    auto tile_gemm = [&](int64_t member, const PolarOp& op, PolarBuffer addend, const std::array<float, 3>& abc,
                         bool spread) {
      auto data = [&](PolarBuffer b, int64_t offset) {
        return static_cast<uint16_t*>(slot(member, b).data_ptr()) + offset;
      };
      TORCH_INTERNAL_ASSERT(!op.lhs.transposed && !op.out.transposed);
      const float beta = static_cast<float>(polar_scalar_value(op.beta, abc[0], abc[1], abc[2]));
      // The square buffers hold polynomials in one symmetric matrix (polar_plan.h).
      const bool symmetric = op.out.buffer != PolarBuffer::kX && op.out.buffer != PolarBuffer::kXOperand &&
                             op.out.offset == 0 && op.out.rows == side && op.out.cols == side;
      bf16_tile_gemm(op.out.rows, op.out.cols, op.lhs.cols,
                     static_cast<float>(polar_scalar_value(op.alpha, abc[0], abc[1], abc[2])),
                     data(op.lhs.buffer, op.lhs.offset), op.lhs.ld,
                     Bf16Matrix{data(op.rhs.buffer, op.rhs.offset), op.rhs.ld, op.rhs.transposed}, beta,
                     beta == 0.0f ? nullptr : data(addend, op.out.offset), op.out.ld,
                     data(op.out.buffer, op.out.offset), op.out.ld, symmetric, spread);
    };
    // A kGemm as one BLAS call on the member's FP32 slots (polar_plan.h's
    // column-major form). Not at::addmm_out: a strided output (a block
    // triangle's panel) made it compute into a fresh buffer and copy back.
    auto fp32_gemm = [&](int64_t member, const PolarOp& op, PolarBuffer addend, const std::array<float, 3>& abc) {
      const float beta = static_cast<float>(polar_scalar_value(op.beta, abc[0], abc[1], abc[2]));
      at::Tensor out = view_of(slot(member, op.out.buffer), op.out);
      if (beta != 0.0f && addend != op.out.buffer) out.copy_(view_of(slot(member, addend), op.out));
      const float alpha = static_cast<float>(polar_scalar_value(op.alpha, abc[0], abc[1], abc[2]));
      if (sgemm_ == nullptr) {
        at::addmm_out(out, out, view_of(slot(member, op.lhs.buffer), op.lhs),
                      view_of(slot(member, op.rhs.buffer), op.rhs), beta, alpha);
      } else {
        const ColumnMajorGemm g = to_column_major(op);
        auto data = [&](PolarBuffer b, int64_t offset) { return slot(member, b).data_ptr<float>() + offset; };
        const char trans_a = g.trans_a ? 'T' : 'N', trans_b = g.trans_b ? 'T' : 'N';
        const int m = static_cast<int>(g.m), n = static_cast<int>(g.n), k = static_cast<int>(g.k);
        const int lda = static_cast<int>(g.lda), ldb = static_cast<int>(g.ldb), ldc = static_cast<int>(g.ldc);
        sgemm_(&trans_a, &trans_b, &m, &n, &k, &alpha, data(g.a, g.a_offset), &lda, data(g.b, g.b_offset), &ldb,
               &beta, data(g.c, g.c_offset), &ldc);
      }
      round_to(output_rounding, out);
    };
    // `spread`: called outside the threads' tasks, a GEMM shares its tiles among them.
    auto execute = [&](int64_t member, const PolarOp& op, PolarBuffer addend, bool spread = false) {
      const std::array<float, 3>& abc = coefficients[op.step];
      switch (op.kind) {
        case PolarOp::Kind::kGemm: {
          if (tiles) {
            tile_gemm(member, op, addend, abc, spread);
            break;
          }
          if (!native) {
            fp32_gemm(member, op, addend, abc);
            break;
          }
          // BF16 slots off the micro-kernel: oneDNN through at::addmm_out.
          at::Tensor out = view_of(slot(member, op.out.buffer), op.out);
          const at::Tensor self = addend == op.out.buffer ? out : view_of(slot(member, addend), op.out);
          at::addmm_out(out, self, view_of(slot(member, op.lhs.buffer), op.lhs),
                        view_of(slot(member, op.rhs.buffer), op.rhs), polar_scalar_value(op.beta, abc[0], abc[1], abc[2]),
                        polar_scalar_value(op.alpha, abc[0], abc[1], abc[2]));
          break;
        }
        case PolarOp::Kind::kCopy:
          slot(member, op.to).copy_(slot(member, op.from));
          break;
        case PolarOp::Kind::kMirror:
          mirror_upper_blocks(slot(member, op.to), side, bounds);
          break;
        case PolarOp::Kind::kAddIdentity:
          add_to_diagonal(slot(member, op.to), side,
                          static_cast<float>(polar_scalar_value(op.alpha, abc[0], abc[1], abc[2])), output_rounding);
          break;
      }
    };
    if (matrix_per_thread) {
      // A matrix per thread, start to end (every thread has one, or each
      // stage is one call that no thread could share): no barrier between
      // stages, and a matrix's scratch stays in its thread's cache. The same calls on the
      // same panels as below, so the same bits.
      run_tasks(members, [&](int64_t member) {
        for (const PolarStage& stage : stages) {
          for (const PolarOp& op : stage.ops) execute(member, op, stage.addend);
        }
        if (tiles) bf16_tile_gemm_release();
      });
    } else {
      // Fewer matrices than threads: the threads share each stage's panels,
      // or on the micro-kernel, with fewer panels than threads, each GEMM's tiles.
      for (const PolarStage& stage : stages) {
        const int64_t ops = static_cast<int64_t>(stage.ops.size());
        if (stage.ops.front().kind != PolarOp::Kind::kGemm) {
          // A copy, mirror or identity add (a stage alone): see for_each_member.
          for (int64_t member = 0; member < members; ++member) execute(member, stage.ops.front(), stage.addend);
          continue;
        }
        if (tiles && members * ops < at::get_num_threads()) {
          for (int64_t task = 0; task < members * ops; ++task) {
            execute(task / ops, stage.ops[task % ops], stage.addend, /*spread=*/true);
          }
          continue;
        }
        run_tasks(members * ops, [&](int64_t task) {
          execute(task / ops, stage.ops[task % ops], stage.addend);
          if (tiles) bf16_tile_gemm_release();
        });
      }
    }
    for_each_member([&](int64_t member) {
      if (transposed) {
        transpose_from_bf16(static_cast<const uint16_t*>(slot(member, PolarBuffer::kX).const_data_ptr()), cols, rows,
                            flat_x[first + member].data_ptr<float>());
      } else {
        flat_x[first + member].copy_(slot(member, PolarBuffer::kX));
      }
    });
  }
}

// NorMuon on one matrix xm: its per-row (rows >= cols) or per-column
// multipliers into out[stat_length], updating its second moments smb; `sums`
// is scratch of stat_length doubles.
__attribute__((always_inline)) inline void normuon_matrix_multipliers(int64_t rows, int64_t cols, float beta2,
                                                                     const float* xm, float* smb, float* out,
                                                                     double* sums) {
  const int64_t len = shapes::stat_length(rows, cols), red = shapes::reduced_length(rows, cols);
  if (shapes::stats_per_row(rows, cols)) {
    for (int64_t r = 0; r < rows; ++r) sums[r] = sum_of_squares(xm + r * cols, cols);
  } else {
    std::fill(sums, sums + len, 0.0);
    for (int64_t r = 0; r < rows; ++r) {
      const float* row = xm + r * cols;
      for (int64_t c = 0; c < cols; ++c) sums[c] += double(row[c]) * double(row[c]);
    }
  }
  // Two loops: the first vectorizes (no carried sum), the second adds in order.
  for (int64_t i = 0; i < len; ++i) {
    const float vm = normuon_mean_square(static_cast<float>(sums[i]), red);
    smb[i] = lerp(smb[i], vm, 1.0f - beta2);
    out[i] = normuon_step_size(smb[i]);
    sums[i] = vm;  // kept for the sums below (exact in double)
  }
  float sum_vm = 0.0f, sum_scaled = 0.0f;
  for (int64_t i = 0; i < len; ++i) {
    const float vm = static_cast<float>(sums[i]);
    sum_vm += vm;
    sum_scaled += ((vm * float(red)) * out[i]) * out[i];
  }
  const float ratio = normuon_norm_ratio(sum_vm, sum_scaled, red);
  for (int64_t i = 0; i < len; ++i) out[i] = out[i] * ratio;
}

// normuon_matrix_multipliers cloned per instruction set (its sums are fixed
// chains in double, its per-element math IEEE without contraction: same bits).
MUON_EXT_ISA_CLONES void normuon_matrix_multipliers_simd(
    int64_t rows, int64_t cols, float beta2, const float* xm, float* smb, float* out, double* sums) {
  normuon_matrix_multipliers(rows, cols, beta2, xm, smb, out, sums);
}

// NorMuon: the multipliers of `count` contiguous matrices at xs, updating the
// second-moment state of matrix j at second_moment(j).  mult is [count, stat_length].
template <typename SecondMoment>
void normuon_multipliers(int64_t rows, int64_t cols, float beta2, int64_t count, const float* xs,
                         const SecondMoment& second_moment, std::vector<float>& mult) {
  const int64_t len = shapes::stat_length(rows, cols);
  mult.assign(count * len, 0.0f);
  auto run_matrix = [&](int64_t j, std::vector<double>& sums) {
    normuon_matrix_multipliers_simd(rows, cols, beta2, xs + j * rows * cols, second_moment(j), mult.data() + j * len,
                                    sums.data());
  };
  for_each_run_balanced(count, [&] { return std::vector<double>(len); }, run_matrix);
}

// Apply: x (times its NorMuon multiplier) into the FP32 master, cautious
// weight decay, then the param (and master / remainder) written back.  Runs
// row by row so the inner loop is branch-free and vectorizes; without NorMuon
// the multiplier is 1, and x * 1 == x exactly.
template <ScalarKind P, MasterMode M>
__attribute__((always_inline)) inline void apply_range(void* param, void* master, const float* x, const float* mult,
                                                       bool per_row, int64_t cols, int64_t offset, int64_t begin,
                                                       int64_t end, float lr, float lr_wd) {
  for (int64_t row_start = begin - begin % cols; row_start < end; row_start += cols) {
    const int64_t first = std::max(begin, row_start), last = std::min(end, row_start + cols);
    const int64_t row = row_start / cols;
    // Two loops, each with a fixed multiplier pattern (one per row, or one
    // per column read in order), so both vectorize.
    auto apply_row = [&](auto scale_of) {
      for (int64_t k = first; k < last; ++k) {
        const float update = x[k] * scale_of(k - row_start);
        const int64_t i = offset + k;
        float p;
        if constexpr (M == MasterMode::kFP32) {
          p = static_cast<const float*>(master)[i];
        } else if constexpr (M == MasterMode::kRemainder) {
          p = merge_master(static_cast<const uint16_t*>(param)[i], static_cast<const int16_t*>(master)[i]);
        } else {
          p = load_scalar<P>(param, i);
        }
        p = muon_ext::muon_apply(p, update, lr, lr_wd);
        if constexpr (M == MasterMode::kRemainder) {
          const RemainderSplit s = split_master(p);
          static_cast<uint16_t*>(param)[i] = s.bf16_bits;
          static_cast<int16_t*>(master)[i] = s.remainder;
        } else {
          if constexpr (M == MasterMode::kFP32) static_cast<float*>(master)[i] = p;
          store_rne<P>(param, i, p);
        }
      }
    };
    if (mult != nullptr && !per_row) {
      apply_row([mult](int64_t c) { return mult[c]; });
    } else {
      const float scale = mult == nullptr ? 1.0f : mult[row];
      apply_row([scale](int64_t) { return scale; });
    }
  }
}

// apply_range cloned per instruction set (as momentum_range): same bits.
template <ScalarKind P, MasterMode M>
MUON_EXT_ISA_CLONES void apply_range_simd(
    void* param, void* master, const float* x, const float* mult, bool per_row, int64_t cols, int64_t offset,
    int64_t begin, int64_t end, float lr, float lr_wd) {
  apply_range<P, M>(param, master, x, mult, per_row, cols, offset, begin, end, lr, lr_wd);
}

// Calls fn(std::integral_constant<ScalarKind, P>, std::integral_constant<MasterMode, M>)
// for a param dtype and master kind the checks admitted.
template <typename Fn>
void dispatch_param(at::ScalarType param_dtype, MasterMode master_mode, const Fn& fn) {
  dispatch_storage(scalar_kind(param_dtype), [&](auto param_storage) {
    constexpr ScalarKind P = decltype(param_storage)::value;
    switch (master_mode) {
      case MasterMode::kNone: return fn(param_storage, std::integral_constant<MasterMode, MasterMode::kNone>{});
      case MasterMode::kFP32:
        if constexpr (P != ScalarKind::kFloat32) {
          return fn(param_storage, std::integral_constant<MasterMode, MasterMode::kFP32>{});
        }
        break;
      case MasterMode::kRemainder:
        if constexpr (P == ScalarKind::kBFloat16) {
          return fn(param_storage, std::integral_constant<MasterMode, MasterMode::kRemainder>{});
        }
        break;
    }
    TORCH_CHECK(false, "muon: unsupported master kind for this param dtype");
  });
}

void apply_update(const MuonBucket& b, const std::vector<MatrixRef>& mats, const at::Tensor& x,
                  const std::vector<float>* mult, float lr, float lr_wd) {
  const int64_t n = b.matrix_numel(), len = b.stat_length();
  const bool per_row = b.rows >= b.cols;
  const float* xs = x.const_data_ptr<float>();
  dispatch_param(b.params[0].scalar_type(), b.master_mode, [&](auto param_storage, auto master_mode) {
    constexpr ScalarKind P = decltype(param_storage)::value;
    constexpr MasterMode M = decltype(master_mode)::value;
    const std::vector<void*> params = data_pointers(b.params);
    const std::vector<void*> masters = data_pointers(b.masters);
    for_each_matrix_range(static_cast<int64_t>(mats.size()), n, [&](int64_t j, int64_t begin, int64_t end) {
      const int64_t p = mats[j].param;
      void* master = masters.empty() ? nullptr : masters[p];
      apply_range_simd<P, M>(params[p], master, xs + j * n, mult != nullptr ? mult->data() + j * len : nullptr,
                             per_row, b.cols, mats[j].index * n, begin, end, lr, lr_wd);
    });
  });
}

// NorMuon's multipliers m of one matrix x folded into elements [begin, end):
// x = x * m[row or col], the product the fused apply forms, so the apply
// reads the same update values.
__attribute__((always_inline)) inline void fold_matrix_multipliers(float* x, const float* m, int64_t cols,
                                                                   bool per_row, int64_t begin, int64_t end) {
  for (int64_t k = begin; k < end; ++k) x[k] = x[k] * m[per_row ? k / cols : k % cols];
}

void fold_multipliers(float* xs, int64_t count, int64_t rows, int64_t cols, const std::vector<float>& mult) {
  const int64_t n = rows * cols, len = shapes::stat_length(rows, cols);
  const bool per_row = shapes::stats_per_row(rows, cols);
  for_each_matrix_range(count, n, [&](int64_t j, int64_t begin, int64_t end) {
    fold_matrix_multipliers(xs + j * n, mult.data() + j * len, cols, per_row, begin, end);
  });
}

// The fused small-matrix step (docs/design.md, "CPU kernels", small matrices):
// where Polar-Express runs on the SIMD kernel, each task takes a run of
// consecutive matrices of the bucket (whole lane groups, about
// kSmallTaskElements elements, so its buffers stay in the core's cache)
// through the whole step in one pass: momentum and Nesterov, the input scale,
// the iterations, NorMuon, and the apply into param and master. Every matrix
// sees the same operations on the same values as in the unfused passes above,
// so the bits are theirs, for any run, thread count or address.
constexpr int64_t kSmallTaskElements = 4096;

bool fused_small_step(const MuonBucket& b) {
  return polar_small_shape(b.rows, b.cols) && b.matrix_numel() <= kWorkItem;
}

// Element types of the stored formats, for byte sizes.
template <ScalarKind K>
using ParamStorage = std::conditional_t<K == ScalarKind::kFloat32, float, uint16_t>;
template <MasterMode M>
using MasterStorage = std::conditional_t<M == MasterMode::kFP32, float, int16_t>;

constexpr int64_t kCacheLine = 64;

// The lines of [p, p + bytes) appended to a SmallPrefetch's ranges.
__attribute__((always_inline)) inline void add_prefetch_range(std::vector<PrefetchRange>& ranges, const void* p,
                                                              int64_t bytes) {
  const uintptr_t first = reinterpret_cast<uintptr_t>(p) & ~uintptr_t(kCacheLine - 1);
  const uintptr_t end = reinterpret_cast<uintptr_t>(p) + uintptr_t(bytes);
  if (end > first) ranges.push_back({first, int64_t((end - first + kCacheLine - 1) / kCacheLine)});
}

// apply_range for BF16 params with remainders and no multiplier, in two
// passes: the updated masters over the spent updates x, then split by the
// AdamW kernel's split_master_block for `capability` (a vector without a NaN
// by the NaN-free form: the full rule's NaN corrections per element were a
// third of the apply). Same bits as apply_range.
__attribute__((always_inline)) inline void apply_remainder_in_two_passes(uint16_t* hi, int16_t* rem, float* x,
                                                                         int64_t numel, float lr, float lr_wd,
                                                                         CpuCapability capability) {
  for (int64_t k = 0; k < numel; ++k) x[k] = muon_ext::muon_apply(merge_master(hi[k], rem[k]), x[k], lr, lr_wd);
  split_master_block(x, hi, rem, numel, capability);
}

// What every run of one step shares.
struct SmallStep {
  int64_t rows, cols, n, len;
  bool per_row, nesterov, normuon, gram;
  float mu, beta2, inv_scale, lr, lr_wd;
  PolarRounding rounding;
  CpuCapability capability;  // of the remainder split in the apply
  const float* abc;
  int64_t steps;
  std::vector<int64_t> starts;  // each param's first matrix number, and the total
  std::vector<const void*> grads;
  std::vector<float*> moms, second_moments;
  std::vector<void*> params, masters;
};

// One thread's buffers for a run of up to `matrices` matrices.
struct SmallBuffers {
  SmallBuffers(int64_t matrices, int64_t n, int64_t len, int64_t polar_floats)
      : polar(polar_floats), x(matrices * n), mult(len), sums(len), smb_of(matrices) {}
  PolarSmallScratch polar;
  std::vector<float> x, mult;
  std::vector<double> sums;
  std::vector<float*> smb_of;  // each matrix's second moments, for NorMuon in the lanes
  std::vector<PrefetchRange> prefetch_ranges;
};

// The matrices [begin, end) of the bucket through the whole step. Cloned per
// instruction set: the elementwise loops (momentum, norms, apply) vectorize
// with the widest the CPU has; the same IEEE operations, so the same bits.
template <ScalarKind G, ScalarKind P, MasterMode M>
MUON_EXT_ISA_CLONES void small_step_run(const SmallStep& s, int64_t begin, int64_t end, SmallBuffers& buf) {
  const int64_t n = s.n, len = s.len, first_param = std::upper_bound(s.starts.begin(), s.starts.end(), begin) -
                                                        s.starts.begin() - 1;
  float* const u = buf.x.data();
  // Prefetch what the apply of this run and the momentum of the next will
  // read, paced by the iterations, so those loads overlap their arithmetic.
  buf.prefetch_ranges.clear();
  const int64_t ahead = std::min(end + (end - begin), s.starts.back());
  for (int64_t at = begin, p = first_param; at < ahead; ++p) {
    const int64_t stop = std::min(ahead, s.starts[p + 1]), own_end = std::min(stop, end), next = std::max(at, end);
    if (at < own_end) {
      const int64_t offset = (at - s.starts[p]) * n, numel = (own_end - at) * n;
      add_prefetch_range(buf.prefetch_ranges, static_cast<char*>(s.params[p]) + offset * int64_t(sizeof(ParamStorage<P>)),
                         numel * int64_t(sizeof(ParamStorage<P>)));
      if constexpr (M != MasterMode::kNone) {
        add_prefetch_range(buf.prefetch_ranges,
                           static_cast<char*>(s.masters[p]) + offset * int64_t(sizeof(MasterStorage<M>)),
                           numel * int64_t(sizeof(MasterStorage<M>)));
      }
    }
    if (next < stop) {
      const int64_t offset = (next - s.starts[p]) * n, numel = (stop - next) * n;
      add_prefetch_range(buf.prefetch_ranges, s.moms[p] + offset, numel * int64_t(sizeof(float)));
      add_prefetch_range(buf.prefetch_ranges,
                         static_cast<const char*>(s.grads[p]) + offset * int64_t(sizeof(ParamStorage<G>)),
                         numel * int64_t(sizeof(ParamStorage<G>)));
    }
    at = stop;
  }
  // Momentum and Nesterov, param part by param part (a run may cross params).
  for (int64_t at = begin, p = first_param; at < end; ++p) {
    const int64_t count = std::min(end, s.starts[p + 1]) - at, offset = (at - s.starts[p]) * n;
    const void* grad = s.grads[p];
    float* mom = s.moms[p] + offset;
    float* out = u + (at - begin) * n;
    momentum_elements<G>(grad, offset, mom, out, count * n, s.inv_scale, s.mu, s.nesterov);
    at += count;
  }
  // NorMuon in the lanes where its statistics fit the scratch, else per matrix below.
  const bool lane_normuon = s.normuon && len <= kSmallNorMuonMaxStats;
  SmallNorMuon normuon{buf.smb_of.data(), s.beta2};
  if (lane_normuon) {
    for (int64_t at = begin, p = first_param; at < end; ++p) {
      const int64_t stop = std::min(end, s.starts[p + 1]);
      for (int64_t j = at; j < stop; ++j) buf.smb_of[j - begin] = s.second_moments[p] + (j - s.starts[p]) * len;
      at = stop;
    }
  }
  const SmallPrefetch prefetch{buf.prefetch_ranges.data(), static_cast<int64_t>(buf.prefetch_ranges.size())};
  polar_express_small_matrices(u, true, end - begin, s.rows, s.cols, s.abc, s.steps, s.rounding,
                               s.gram, lane_normuon ? &normuon : nullptr, &prefetch, buf.polar.data());
  for (int64_t at = begin, p = first_param; at < end; ++p) {
    const int64_t count = std::min(end, s.starts[p + 1]) - at, first = at - s.starts[p];
    float* xs = u + (at - begin) * n;
    if (s.normuon && !lane_normuon) {
      float* smb = s.second_moments[p] + first * len;
      for (int64_t j = 0; j < count; ++j) {
        float* xm = xs + j * n;
        normuon_matrix_multipliers(s.rows, s.cols, s.beta2, xm, smb + j * len, buf.mult.data(), buf.sums.data());
        // apply_range's x * multiplier, formed here; then x * 1 == x there.
        fold_matrix_multipliers(xm, buf.mult.data(), s.cols, s.per_row, 0, n);
      }
    }
    if (count > 0) {
      if constexpr (P == ScalarKind::kBFloat16 && M == MasterMode::kRemainder) {
        apply_remainder_in_two_passes(static_cast<uint16_t*>(s.params[p]) + first * n,
                                      static_cast<int16_t*>(s.masters[p]) + first * n, xs, count * n, s.lr, s.lr_wd,
                                      s.capability);
      } else {
        void* master = s.masters.empty() ? nullptr : s.masters[p];
        apply_range<P, M>(s.params[p], master, xs, nullptr, true, count * n, first * n, 0, count * n, s.lr, s.lr_wd);
      }
    }
    at += count;
  }
}

void small_step(const MuonBucket& b, const MuonStepOptions& o, float inv_scale, float lr, float lr_wd) {
  SmallStep s;
  s.rows = b.rows, s.cols = b.cols, s.n = b.matrix_numel(), s.len = b.stat_length();
  s.per_row = shapes::stats_per_row(b.rows, b.cols);
  s.nesterov = o.hyper.nesterov, s.normuon = o.hyper.normuon;
  s.gram = polar_method_for(o.polar_method, b.rows, b.cols) == PolarMethod::kGram;
  s.mu = o.hyper.momentum, s.beta2 = o.hyper.beta2, s.inv_scale = inv_scale, s.lr = lr, s.lr_wd = lr_wd;
  s.rounding = rounding_of(o.polar_dtype);
  s.capability = best_capability();
  std::vector<float> abc;
  for (const auto& t : o.coefficients) abc.insert(abc.end(), t.begin(), t.end());
  s.abc = abc.data();
  s.steps = static_cast<int64_t>(o.coefficients.size());
  s.starts = {0};
  for (const at::Tensor& p : b.params) s.starts.push_back(s.starts.back() + p.numel() / s.n);
  s.grads = const_data_pointers(b.grads);
  s.moms = data_pointers<float>(b.momentum_buffers);
  s.second_moments = data_pointers<float>(b.second_momentum_buffers);
  s.params = data_pointers(b.params);
  s.masters = data_pointers(b.masters);
  const int64_t run_matrices =
      std::max<int64_t>(kPolarSmallLanes, kSmallTaskElements / s.n / kPolarSmallLanes * kPolarSmallLanes);
  const int64_t total = s.starts.back(), runs = (total + run_matrices - 1) / run_matrices;
  const int64_t polar_floats =
      polar_small_scratch_floats(b.rows, b.cols, s.gram, s.normuon && s.len <= kSmallNorMuonMaxStats);
  dispatch_storage(scalar_kind(b.grads[0].scalar_type()), [&](auto grad_storage) {
    dispatch_param(b.params[0].scalar_type(), b.master_mode, [&](auto param_storage, auto master_mode) {
      constexpr ScalarKind G = decltype(grad_storage)::value, P = decltype(param_storage)::value;
      constexpr MasterMode M = decltype(master_mode)::value;
      for_each_run_balanced(
          runs, [&] { return SmallBuffers(run_matrices, s.n, s.len, polar_floats); },
          [&](int64_t run, SmallBuffers& buffers) {
            small_step_run<G, P, M>(s, run * run_matrices, std::min(total, (run + 1) * run_matrices), buffers);
          });
    });
  });
}

// The BF16 path decided and its settings (MUON_EXT_CPU_BF16_GEMM,
// MUON_EXT_CPU_TILE_GEMM) checked, before anything is written.
void check_bf16_settings(PolarDtype precision) {
  if (precision != PolarDtype::kBFloat16) return;
  polar_bf16_gemm();
  bf16_tile_gemm_enabled();
}

}  // namespace

void muon_step(const MuonBucket& b, const MuonStepOptions& o) {
  check_bf16_settings(o.polar_dtype);
  const int64_t n = b.matrix_numel();
  if (n == 0) return;
  const float inv_scale = o.inv_scale.has_value() ? o.inv_scale->item<float>() : 1.0f;
  // The op read a tensor lr on the host once (ops.cpp, host_lr) and passes its value.
  TORCH_INTERNAL_ASSERT(!o.lr_tensor.has_value(), "cpu::muon_step takes the lr as a value");
  const float lr = static_cast<float>(o.lr) * o.lr_factor;
  const float lr_wd = lr * o.hyper.weight_decay;
  if (fused_small_step(b)) return small_step(b, o, inv_scale, lr, lr_wd);

  std::vector<MatrixRef> all;
  for (size_t i = 0; i < b.params.size(); ++i) {
    const int64_t count = b.params[i].numel() / n;
    for (int64_t e = 0; e < count; ++e) all.push_back({static_cast<int64_t>(i), e});
  }
  if (all.empty()) return;

  // Scratch per matrix: X, and for Polar-Express A, B (side^2) plus the next X
  // (shared by the chunk), and the NorMuon multipliers.
  const int64_t per_matrix_bytes = int64_t(sizeof(float)) * (n + b.stat_length());
  const int64_t chunk = std::max<int64_t>(1, o.max_workspace_bytes / std::max<int64_t>(per_matrix_bytes, 1));
  const int64_t total = static_cast<int64_t>(all.size());
  const ScratchLease workspace_lease(ScratchSlot::kMuonWorkspace, {std::min(chunk, total), b.rows, b.cols}, at::kFloat);
  const at::Tensor& workspace = workspace_lease.tensor();
  std::vector<float> mult;
  for (int64_t first = 0; first < total; first += chunk) {
    const std::vector<MatrixRef> mats(all.begin() + first, all.begin() + std::min(first + chunk, total));
    at::Tensor x = workspace.narrow(0, 0, static_cast<int64_t>(mats.size()));
    momentum_and_scale(b, o, mats, inv_scale, x);
    polar_express(x, o.coefficients, b.rows, b.cols, o.polar_row_blocks, o.max_workspace_bytes, o.polar_dtype,
                  o.polar_method);
    if (o.hyper.normuon) {
      const int64_t len = b.stat_length();
      const std::vector<float*> second_moments = data_pointers<float>(b.second_momentum_buffers);
      normuon_multipliers(b.rows, b.cols, o.hyper.beta2, static_cast<int64_t>(mats.size()), x.const_data_ptr<float>(),
                          [&](int64_t j) { return second_moments[mats[j].param] + mats[j].index * len; }, mult);
    }
    apply_update(b, mats, x, o.hyper.normuon ? &mult : nullptr, lr, lr_wd);
  }
}

void muon_momentum(const MuonMomentumArgs& args, float inv_scale) {
  const float mu = args.momentum;
  const bool nesterov = args.nesterov;
  dispatch_storage(scalar_kind(args.grads[0].scalar_type()), [&](auto grad_storage) {
    constexpr ScalarKind G = decltype(grad_storage)::value;
    for (size_t i = 0; i < args.updates.size(); ++i) {
      const void* grad = args.grads[i].const_data_ptr();
      float* mom = args.momentum_buffers[i].data_ptr<float>();
      float* out = args.updates[i].data_ptr<float>();
      for_each_range_balanced(args.updates[i].numel(), kWorkItem, [&](int64_t begin, int64_t end) {
        momentum_elements<G>(grad, begin, mom + begin, out + begin, end - begin, inv_scale, mu, nesterov);
      });
    }
  });
}

void muon_orthogonalize(const MuonOrthogonalizeArgs& args) {
  check_bf16_settings(args.polar_dtype);
  const int64_t rows = args.rows, cols = args.cols, n = args.matrix_numel(), len = args.stat_length();
  const int64_t items = items_per_matrix(n);
  std::vector<double> partial;
  std::vector<float> mult;
  for (size_t i = 0; i < args.updates.size(); ++i) {
    const at::Tensor x = args.updates[i].view({-1, rows, cols});
    const int64_t count = x.size(0);
    float* xs = x.data_ptr<float>();
    partial.assign(count * items, 0.0);
    for_each_matrix_range(count, n, [&](int64_t j, int64_t begin, int64_t end) {
      partial[j * items + begin / kWorkItem] = sum_of_squares(xs + j * n + begin, end - begin);
    });
    scale_by_input_norm(xs, count, n, partial);
    at::Tensor matrices = x;
    polar_express(matrices, args.coefficients, rows, cols, args.polar_row_blocks, args.max_workspace_bytes,
                  args.polar_dtype, args.polar_method);
    if (!args.normuon) continue;
    float* smb = args.second_momentum_buffers[i].data_ptr<float>();
    normuon_multipliers(rows, cols, args.beta2, count, xs, [&](int64_t j) { return smb + j * len; }, mult);
    fold_multipliers(xs, count, rows, cols, mult);
  }
}

void muon_apply(const MuonApplyArgs& args, float lr) {
  const float lr_wd = lr * args.weight_decay;
  dispatch_param(args.params[0].scalar_type(), args.master_mode, [&](auto param_storage, auto master_mode) {
    constexpr ScalarKind P = decltype(param_storage)::value;
    constexpr MasterMode M = decltype(master_mode)::value;
    for (size_t i = 0; i < args.params.size(); ++i) {
      const int64_t numel = args.params[i].numel();
      if (numel == 0) continue;
      void* param = args.params[i].data_ptr();
      void* master = args.masters.empty() ? nullptr : args.masters[i].data_ptr();
      const float* update = args.updates[i].const_data_ptr<float>();
      for_each_range_balanced(numel, kWorkItem, [&](int64_t begin, int64_t end) {
        // One "row" spanning the tensor: without multipliers rows play no part.
        apply_range<P, M>(param, master, update, nullptr, true, numel, 0, begin, end, lr, lr_wd);
      });
    }
  });
}

}  // namespace cpu
}  // namespace muon_ext

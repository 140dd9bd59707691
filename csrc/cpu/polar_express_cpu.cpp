// CPU Polar-Express: csrc/common/polar_plan.h's stages executed on fixed row
// panels, one single-threaded BLAS call each, on 64-byte aligned per-matrix
// scratch, so a matrix gets the same bits for any thread count, any address,
// alone, batched or in any chunk (docs/design.md, "CPU kernels", "Rounding
// contract"). The symmetric products X X^T and A A compute only their upper
// block triangle (the plan the CUDA kernel runs too). The small shapes go to
// the SIMD kernel of polar_small.h. The CPU twin of cuda/polar_express_cuda.cu.
#include "polar_express_cpu.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/Utils.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <string>
#include <vector>

#ifdef _OPENMP
#include <omp.h>
#endif

#include "../common/bits.h"
#include "../common/polar_plan.h"
#include "bf16_tile_gemm.h"
#include "muon_elementwise.h"
#include "polar_small.h"
#include "scratch_pool.h"

namespace muon_ext {
namespace cpu {
namespace {

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

// The rounding of each GEMM output for a polar_dtype (FP32 GEMMs on the CPU).
PolarRounding rounding_of(PolarDtype precision) {
  switch (precision) {
    case PolarDtype::kBFloat16: return PolarRounding::kBFloat16;
    case PolarDtype::kFloat16: return PolarRounding::kFloat16;
    case PolarDtype::kFloat32: break;
  }
  return PolarRounding::kNone;
}

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

// What one polar_express call on the BLAS path runs, decided from the shape,
// the precision and the CPU before any matrix is touched: the GEMM kind
// (FP32 on rounded values, oneDNN on BF16 buffers, or the BF16 micro-kernel),
// the row blocks and the plan's stages.
struct PolarCall {
  const std::vector<std::array<float, 3>>& coefficients;
  int64_t rows, cols, side;
  bool native, tiles, transposed;
  PolarRounding output_rounding;
  std::vector<int64_t> bounds;
  std::vector<PolarOp> plan;
  std::vector<PolarStage> stages;
  bool whole_matrix_stages;  // every stage a single call
};

PolarCall plan_polar_call(const std::vector<std::array<float, 3>>& coefficients, int64_t rows, int64_t cols,
                          int64_t row_blocks, PolarDtype precision, PolarMethod iteration) {
  const bool bf16 = precision == PolarDtype::kBFloat16;
  const PolarRounding rounding = rounding_of(precision);
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
  std::vector<int64_t> bounds = polar_block_bounds(side, row_blocks > 0 ? row_blocks : default_row_blocks);
  std::vector<PolarOp> plan =
      polar_plan(iteration, plan_rows, plan_cols, bounds, static_cast<int>(coefficients.size()),
                 polar_gram_restart_period(precision != PolarDtype::kFloat32));
  std::vector<PolarStage> stages = polar_fold_copies(
      polar_stages(plan, native ? kNativeBf16PanelRows : kPolarPanelRowsCpu), plan_rows, plan_cols, bounds);
  if (tiles) stages = read_operands_in_place(stages);
  const bool whole_matrix_stages =
      std::all_of(stages.begin(), stages.end(), [](const PolarStage& stage) { return stage.ops.size() == 1; });
  return PolarCall{coefficients, rows, cols, side, native, tiles, transposed, output_rounding,
                   std::move(bounds), std::move(plan), std::move(stages), whole_matrix_stages};
}

using MemberSlots = std::vector<std::array<at::Tensor, kPolarBufferCount>>;

// Runs a PolarCall's stages on groups of matrices, each member of a group on
// its own scratch slots (one tensor per buffer the plan uses).
class PolarExecutor {
 public:
  PolarExecutor(const PolarCall& call, const MemberSlots& slots) : c_(call), slots_(slots) {}

  // Matrices [first, first + members) of flat_x ([count, rows * cols]) through the whole plan.
  void run_group(const at::Tensor& flat_x, int64_t first, int64_t members, int64_t group) const {
    // A matrix per thread, or (fewer matrices than threads) the threads sharing each stage.
    const bool matrix_per_thread =
        members > 1 && (c_.whole_matrix_stages || (members == group && group == at::get_num_threads()));
    // Copies in the shared mode run one at a time from here, where torch's
    // copy_ splits each among the threads (inside a task it would run on one).
    auto for_each_member = [&](const auto& fn) {
      if (matrix_per_thread || c_.transposed) {
        run_tasks(members, fn);
      } else {
        for (int64_t member = 0; member < members; ++member) fn(member);
      }
    };
    for_each_member([&](int64_t member) {
      at::Tensor into = slot(member, PolarBuffer::kX);
      // To BF16 (nearest even) when the scratch is BF16.
      if (c_.transposed) {
        transpose_to_bf16(flat_x[first + member].const_data_ptr<float>(), c_.rows, c_.cols,
                          static_cast<uint16_t*>(into.data_ptr()));
      } else {
        into.copy_(flat_x[first + member]);
      }
      round_to(c_.output_rounding, into.view({c_.rows, c_.cols}));
    });
    if (matrix_per_thread) {
      // A matrix per thread, start to end (every thread has one, or each
      // stage is one call that no thread could share): no barrier between
      // stages, and a matrix's scratch stays in its thread's cache. The same calls on the
      // same panels as below, so the same bits.
      run_tasks(members, [&](int64_t member) {
        for (const PolarStage& stage : c_.stages) {
          for (const PolarOp& op : stage.ops) execute(member, op, stage.addend);
        }
        if (c_.tiles) bf16_tile_gemm_release();
      });
    } else {
      run_stages_shared(members);
    }
    for_each_member([&](int64_t member) {
      if (c_.transposed) {
        transpose_from_bf16(static_cast<const uint16_t*>(slot(member, PolarBuffer::kX).const_data_ptr()), c_.cols,
                            c_.rows, flat_x[first + member].data_ptr<float>());
      } else {
        flat_x[first + member].copy_(slot(member, PolarBuffer::kX));
      }
    });
  }

 private:
  const at::Tensor& slot(int64_t member, PolarBuffer b) const { return slots_[member][static_cast<int>(b)]; }

  // Fewer matrices than threads: the threads share each stage's panels,
  // or on the micro-kernel, with fewer panels than threads, each GEMM's tiles.
  void run_stages_shared(int64_t members) const {
    for (const PolarStage& stage : c_.stages) {
      const int64_t ops = static_cast<int64_t>(stage.ops.size());
      if (stage.ops.front().kind != PolarOp::Kind::kGemm) {
        // A copy, mirror or identity add (a stage alone): see for_each_member.
        for (int64_t member = 0; member < members; ++member) execute(member, stage.ops.front(), stage.addend);
        continue;
      }
      if (c_.tiles && members * ops < at::get_num_threads()) {
        for (int64_t task = 0; task < members * ops; ++task) {
          execute(task / ops, stage.ops[task % ops], stage.addend, /*spread=*/true);
        }
        continue;
      }
      run_tasks(members * ops, [&](int64_t task) {
        execute(task / ops, stage.ops[task % ops], stage.addend);
        if (c_.tiles) bf16_tile_gemm_release();
      });
    }
  }

  // `spread`: called outside the threads' tasks, a GEMM shares its tiles among them.
  void execute(int64_t member, const PolarOp& op, PolarBuffer addend, bool spread = false) const {
    const std::array<float, 3>& abc = c_.coefficients[op.step];
    switch (op.kind) {
      case PolarOp::Kind::kGemm: {
        if (c_.tiles) {
          tile_gemm(member, op, addend, abc, spread);
          break;
        }
        if (!c_.native) {
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
        mirror_upper_blocks(slot(member, op.to), c_.side, c_.bounds);
        break;
      case PolarOp::Kind::kAddIdentity:
        add_to_diagonal(slot(member, op.to), c_.side,
                        static_cast<float>(polar_scalar_value(op.alpha, abc[0], abc[1], abc[2])), c_.output_rounding);
        break;
    }
  }

  // A kGemm on the micro-kernel: its views as pointers into the member's BF16 slots.
  void tile_gemm(int64_t member, const PolarOp& op, PolarBuffer addend, const std::array<float, 3>& abc,
                 bool spread) const {
    auto data = [&](PolarBuffer b, int64_t offset) {
      return static_cast<uint16_t*>(slot(member, b).data_ptr()) + offset;
    };
    TORCH_INTERNAL_ASSERT(!op.lhs.transposed && !op.out.transposed);
    const float beta = static_cast<float>(polar_scalar_value(op.beta, abc[0], abc[1], abc[2]));
    // The square buffers hold polynomials in one symmetric matrix (polar_plan.h).
    const bool symmetric = op.out.buffer != PolarBuffer::kX && op.out.buffer != PolarBuffer::kXOperand &&
                           op.out.offset == 0 && op.out.rows == c_.side && op.out.cols == c_.side;
    bf16_tile_gemm(op.out.rows, op.out.cols, op.lhs.cols,
                   static_cast<float>(polar_scalar_value(op.alpha, abc[0], abc[1], abc[2])),
                   data(op.lhs.buffer, op.lhs.offset), op.lhs.ld,
                   Bf16Matrix{data(op.rhs.buffer, op.rhs.offset), op.rhs.ld, op.rhs.transposed}, beta,
                   beta == 0.0f ? nullptr : data(addend, op.out.offset), op.out.ld,
                   data(op.out.buffer, op.out.offset), op.out.ld, symmetric, spread);
  }

  // A kGemm as one BLAS call on the member's FP32 slots (polar_plan.h's
  // column-major form). Not at::addmm_out: a strided output (a block
  // triangle's panel) made it compute into a fresh buffer and copy back.
  void fp32_gemm(int64_t member, const PolarOp& op, PolarBuffer addend, const std::array<float, 3>& abc) const {
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
    round_to(c_.output_rounding, out);
  }

  const PolarCall& c_;
  const MemberSlots& slots_;
};

}  // namespace

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
  const PolarCall call = plan_polar_call(coefficients, rows, cols, row_blocks, precision, iteration);

  // Scratch of one matrix: its four buffers back to back, each 64-byte aligned
  // (at::empty's CPU allocations are).
  const at::ScalarType scratch_dtype = call.native ? at::kBFloat16 : at::kFloat;
  const int64_t element_size = static_cast<int64_t>(c10::elementSize(scratch_dtype));
  std::array<int64_t, kPolarBufferCount> slot_offset{};
  int64_t scratch_numel = 0;
  for (int k = 0; k < kPolarBufferCount; ++k) {
    const PolarBuffer b = static_cast<PolarBuffer>(k);
    slot_offset[k] = scratch_numel;
    if (polar_plan_uses(call.plan, b)) scratch_numel += align_up(polar_buffer_numel(b, rows, cols), element_size);
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
  MemberSlots slots(group);
  for (int64_t member = 0; member < group; ++member) {
    for (int k = 0; k < kPolarBufferCount; ++k) {
      const PolarBuffer b = static_cast<PolarBuffer>(k);
      if (polar_plan_uses(call.plan, b)) {
        slots[member][k] = scratch[member].narrow(0, slot_offset[k], polar_buffer_numel(b, rows, cols));
      }
    }
  }
  const PolarExecutor executor(call, slots);
  for (int64_t first = 0; first < count; first += group) {
    executor.run_group(flat_x, first, std::min(group, count - first), group);
  }
}

}  // namespace cpu
}  // namespace muon_ext

// The elementwise pieces of the CPU Muon step, inline: the work split over
// matrices, momentum and Nesterov, the sum of squares, NorMuon's multipliers
// of one matrix and the apply. The chunked step and the three phases
// (muon_cpu.cpp) and the fused small-matrix step (muon_small_step_cpu.cpp)
// both run them, so each matrix sees the same operations on the same values
// on either path (docs/design.md, "CPU kernels").
#pragma once

#include <ATen/ATen.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "../common/adamw_math.h"
#include "../common/muon_math.h"
#include "../common/remainder.h"
#include "../common/shapes.h"
#include "balanced_runs.h"
#include "scalar_io.h"
#include "scalar_kind.h"

namespace muon_ext {
namespace cpu {
// Internal linkage, as scalar_io.h: each file that includes this compiles its
// own copy, into its own instruction-set clones.
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

inline int64_t items_per_matrix(int64_t matrix_numel) { return (matrix_numel + kWorkItem - 1) / kWorkItem; }

// Each tensor's data pointer, taken once per step: with thousands of tiny
// matrices, data_ptr()'s checks per matrix cost more than the matrix's math.
template <typename T = void>
std::vector<T*> data_pointers(const std::vector<at::Tensor>& tensors) {
  std::vector<T*> out;
  out.reserve(tensors.size());
  for (const at::Tensor& t : tensors) out.push_back(static_cast<T*>(t.data_ptr()));
  return out;
}

inline std::vector<const void*> const_data_pointers(const std::vector<at::Tensor>& tensors) {
  std::vector<const void*> out;
  out.reserve(tensors.size());
  for (const at::Tensor& t : tensors) out.push_back(t.const_data_ptr());
  return out;
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

// NorMuon's multipliers m of one matrix x folded into elements [begin, end):
// x = x * m[row or col], the product the fused apply forms, so the apply
// reads the same update values.
__attribute__((always_inline)) inline void fold_matrix_multipliers(float* x, const float* m, int64_t cols,
                                                                   bool per_row, int64_t begin, int64_t end) {
  for (int64_t k = begin; k < end; ++k) x[k] = x[k] * m[per_row ? k / cols : k % cols];
}

}  // namespace
}  // namespace cpu
}  // namespace muon_ext

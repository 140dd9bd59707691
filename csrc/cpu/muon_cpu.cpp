// CPU Muon step: momentum pre-pass into a stacked FP32 workspace, Polar-Express
// (polar_express_cpu.cpp), NorMuon statistics, cautious apply into params and
// masters; and the three phases, which reuse these passes.
// Small shapes take the fused step of muon_small_step_cpu.cpp.
//
// The element math is csrc/common/muon_math.h, shared with the CUDA kernels,
// through muon_elementwise.h, shared with the fused small-matrix step.
#include "muon_cpu.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "../common/shapes.h"
#include "balanced_runs.h"
#include "bf16_tile_gemm.h"
#include "muon_elementwise.h"
#include "muon_small_step_cpu.h"
#include "polar_express_cpu.h"
#include "scratch_pool.h"

namespace muon_ext {
namespace cpu {
namespace {

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

// apply_range cloned per instruction set (as momentum_range): same bits.
template <ScalarKind P, MasterMode M>
MUON_EXT_ISA_CLONES void apply_range_simd(
    void* param, void* master, const float* x, const float* mult, bool per_row, int64_t cols, int64_t offset,
    int64_t begin, int64_t end, float lr, float lr_wd) {
  apply_range<P, M>(param, master, x, mult, per_row, cols, offset, begin, end, lr, lr_wd);
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

void fold_multipliers(float* xs, int64_t count, int64_t rows, int64_t cols, const std::vector<float>& mult) {
  const int64_t n = rows * cols, len = shapes::stat_length(rows, cols);
  const bool per_row = shapes::stats_per_row(rows, cols);
  for_each_matrix_range(count, n, [&](int64_t j, int64_t begin, int64_t end) {
    fold_matrix_multipliers(xs + j * n, mult.data() + j * len, cols, per_row, begin, end);
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

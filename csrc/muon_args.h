// Arguments of the Muon kernels, as the op layer (csrc/ops.cpp) hands them to
// the CPU or CUDA implementation after checking them.  Two forms share one
// math (csrc/common/muon_math.h), see docs/design.md "Muon in three phases":
//   * the fused step on a bucket of same-shape matrices (MuonBucket +
//     MuonStepOptions), the fastest single-device path;
//   * three phases, each an op, whose composition gives the fused step's bits:
//       1. momentum   (MuonMomentumArgs):    elementwise, on params or shards;
//       2. orthogonalize (MuonOrthogonalizeArgs): whole matrices: input scale,
//          Polar-Express, NorMuon statistics, the multiplier folded into X;
//       3. apply      (MuonApplyArgs):       elementwise: cautious weight decay
//          and the write to param and master.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Optional.h>

#include <array>
#include <cstdint>
#include <vector>

#include "common/adamw_math.h"
#include "common/muon_math.h"
#include "common/polar_plan.h"
#include "common/shapes.h"

namespace muon_ext {

// Operand precision of the Polar-Express GEMMs (docs/design.md, "Rounding
// contract"). kBFloat16: operands BF16, FP32 accumulation, each GEMM's output
// (A, B and X) rounded to BF16 once, on every device. kFloat32: FP32 GEMMs
// (on CUDA without TF32 unless torch allows it). kFloat16: as kBFloat16 with
// IEEE FP16 (3 more mantissa bits); on the CPU always FP32 GEMMs on FP16 values.
enum class PolarDtype { kBFloat16, kFloat32, kFloat16 };

struct MuonBucket {
  // params[i] has shape [..., rows, cols] (leading dims index matrices) and is
  // contiguous; grads[i] and momentum_buffers[i] (FP32) have its shape;
  // second_momentum_buffers[i] (FP32) has shape [..., rows, 1] if rows >= cols
  // else [..., 1, cols], and the list is empty when NorMuon is off; masters is
  // empty (kNone), FP32 (kFP32) or int16 remainders (kRemainder), param-shaped.
  std::vector<at::Tensor> params, grads, momentum_buffers, second_momentum_buffers, masters;
  MasterMode master_mode = MasterMode::kNone;
  int64_t rows = 0, cols = 0;

  int64_t matrix_numel() const { return rows * cols; }
  // Length of NorMuon's statistics per matrix: one per row (rows >= cols) or per column.
  int64_t stat_length() const { return shapes::stat_length(rows, cols); }
  // Length of the dimension NorMuon averages over.
  int64_t reduced_length() const { return shapes::reduced_length(rows, cols); }
};

struct MuonStepOptions {
  MuonHyper hyper{};
  std::vector<std::array<float, 3>> coefficients;  // (a, b, c) per Polar-Express iteration
  double lr = 0.0;                                 // used when lr_tensor is absent
  c10::optional<at::Tensor> lr_tensor;             // one FP32 element on the params' device
  float lr_factor = 1.0f;                          // lr' = lr * lr_factor (lr_scale mode)
  c10::optional<at::Tensor> inv_scale;             // grads are multiplied by it
  c10::optional<at::Tensor> found_inf;             // nonzero: the step is a no-op
  int64_t max_workspace_bytes = int64_t(1) << 30;  // scratch bound per chunk of matrices
  int64_t polar_row_blocks = 0;  // row blocks of the symmetric Polar-Express products; 0: the device's choice
  PolarDtype polar_dtype = PolarDtype::kBFloat16;
  PolarMethod polar_method = PolarMethod::kStandard;  // resolved per shape by polar_method_for
};

// Phase 1.  grads[i] (FP32/BF16/FP16, one dtype), momentum_buffers[i] and
// updates[i] (FP32) have one shape each, contiguous, one device; any shape
// (whole params or local shards, empty ones included).  Writes
//   momentum = lerp(momentum, g * inv_scale, 1 - mu)
//   update   = nesterov ? lerp(g * inv_scale, momentum, mu) : momentum
struct MuonMomentumArgs {
  std::vector<at::Tensor> grads, momentum_buffers, updates;
  float momentum = 0.95f;
  bool nesterov = true;
  c10::optional<at::Tensor> inv_scale;
  c10::optional<at::Tensor> found_inf;
};

// Phase 2.  updates[i] are FP32 [..., rows, cols] (whole matrices), contiguous,
// one device; second_momentum_buffers as in MuonBucket (empty: NorMuon off).
// Per matrix: X = u / (||u||_F * 1.02 + 1e-6), Polar-Express in `polar_dtype`
// as in the fused step, then NorMuon (second moment updated) and
//   updates = X * multiplier   (1 without NorMuon; exact then)
// On CUDA the bits equal the fused step's when phase 2 sees the same matrices
// in the same order with the same max_workspace_bytes (same cuBLAS batches).
struct MuonOrthogonalizeArgs {
  std::vector<at::Tensor> updates, second_momentum_buffers;
  int64_t rows = 0, cols = 0;
  bool normuon = true;
  float beta2 = 0.95f;
  std::vector<std::array<float, 3>> coefficients;
  int64_t max_workspace_bytes = int64_t(1) << 30;
  int64_t polar_row_blocks = 0;
  PolarDtype polar_dtype = PolarDtype::kBFloat16;
  PolarMethod polar_method = PolarMethod::kStandard;
  c10::optional<at::Tensor> found_inf;

  int64_t matrix_numel() const { return rows * cols; }
  int64_t stat_length() const { return shapes::stat_length(rows, cols); }
  int64_t reduced_length() const { return shapes::reduced_length(rows, cols); }
};

// Phase 3.  params (one float dtype), updates (FP32) and masters (as in
// MuonBucket) share a shape per index; any shape, elementwise:
//   p = master;  p -= lr' * u + lr' * wd * p * (u * p >= 0);  write p back
// with lr' = (lr_tensor ? *lr_tensor : lr) * lr_factor, rounded to FP32 first.
struct MuonApplyArgs {
  std::vector<at::Tensor> params, updates, masters;
  MasterMode master_mode = MasterMode::kNone;
  double lr = 0.0;
  c10::optional<at::Tensor> lr_tensor;
  float lr_factor = 1.0f;
  float weight_decay = 0.0f;
  c10::optional<at::Tensor> found_inf;
};

}  // namespace muon_ext

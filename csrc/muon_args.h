// Arguments of one Muon step on one bucket of same-shape matrices, as the
// binding layer hands them to the CPU or CUDA implementation after checking
// them (see check_muon_args in bindings.cpp).
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Optional.h>

#include <array>
#include <cstdint>
#include <vector>

#include "common/adamw_math.h"
#include "common/muon_math.h"

namespace muon_ext {

struct MuonBucket {
  // params[i] has shape [..., rows, cols] (leading dims index matrices) and is
  // contiguous; grads[i] and momentum_buffers[i] (FP32) have its shape;
  // second_momentum_buffers[i] (FP32) has shape [..., rows, 1] if rows >= cols
  // else [..., 1, cols], and the list is empty when NorMuon is off; masters is
  // empty (kNone), FP32 (kFP32) or int16 remainders (kRemainder), param-shaped.
  std::vector<at::Tensor> params, grads, momentum_buffers, second_momentum_buffers, masters;
  MasterKind master_kind = MasterKind::kNone;
  int64_t rows = 0, cols = 0;

  int64_t matrix_numel() const { return rows * cols; }
  // Length of NorMuon's statistics per matrix: one per row (rows >= cols) or per column.
  int64_t stat_length() const { return rows >= cols ? rows : cols; }
  // Length of the dimension NorMuon averages over.
  int64_t reduced_length() const { return rows >= cols ? cols : rows; }
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
};

}  // namespace muon_ext

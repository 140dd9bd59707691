// Batched Polar-Express iterations on a BF16 or FP32 workspace, with cuBLAS.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/TensorOptions.h>

#include <array>
#include <cstdint>
#include <vector>

#include "../common/polar_plan.h"

namespace muon_ext {
namespace cuda {

// Scratch of polar_express for up to `capacity` matrices, allocated once per
// step and reused by every chunk, in x's dtype.  s = min(rows, cols).
struct PolarExpressWorkspace {
  at::Tensor x_operand;  // [capacity, rows, cols]: copy of X read by the X GEMM
  at::Tensor gram;       // [capacity, s, s]: A (Gram plan: R)
  at::Tensor poly;       // [capacity, s, s]: B = b*A + c*A@A (Gram plan: Z)
  at::Tensor q;          // [capacity, s, s] for the Gram plan (else [0, s, s]): Q
  at::Tensor scratch;    // as q: the Gram plan's spare square
  PolarMethod method = PolarMethod::kStandard;  // the plan it was sized for (polar_method_for's answer)
  // Copies folded into out-of-place cublasLt GEMMs (polar_fold_copies,
  // polar_swap_copied_operands), or every copy run (MUON_EXT_CUDA_POLAR_FOLD=0,
  // csrc/cuda/settings.h).
  bool fold_copies = true;
  at::Tensor lt_workspace;  // bytes for cublasLt's split-K partial sums, when folding
};

// Bytes of PolarExpressWorkspace per matrix (X itself not included) for the
// plan `method` (kStandard or kGram).
int64_t polar_express_workspace_bytes(int64_t rows, int64_t cols, at::ScalarType dtype, PolarMethod method);

// fold_copies: CudaSettings::polar_fold_copies (csrc/cuda/settings.h).
PolarExpressWorkspace make_polar_express_workspace(int64_t capacity, int64_t rows, int64_t cols,
                                                   const at::TensorOptions& options, PolarMethod method,
                                                   bool fold_copies);

// Runs one iteration per (a, b, c) of `coefficients` on x ([B, rows, cols]
// BF16 or FP32, contiguous, B <= capacity; the workspace in x's dtype), in
// place, on the current stream:
//   wide (rows <= cols):  A = X X^T ;  B = b*A + c*A@A ;  X = a*X + B@X
//   tall (rows >  cols):  A = X^T X ;  B = b*A + c*A@A ;  X = a*X + X@B
// BF16: each GEMM multiplies BF16 operands with FP32 accumulation and rounds
// its output (including the alpha/beta combination) to BF16 once. FP32: FP32
// GEMMs (TF32 only where torch allows it for its own FP32 GEMMs). `row_blocks`
// (>= 1; 0 for the default) splits A and A@A into block rows of which only the
// upper block triangle is multiplied (csrc/common/polar_plan.h). The
// workspace's method picks the plan: the standard iteration above, or Gram
// Newton-Schulz (polar_gram_plan; docs/design.md "Gram Newton-Schulz").
void polar_express(const at::Tensor& x, const std::vector<std::array<float, 3>>& coefficients,
                   const PolarExpressWorkspace& workspace, int64_t row_blocks = 0);

}  // namespace cuda
}  // namespace muon_ext

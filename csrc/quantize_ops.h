// quantize_fp8: FP32 master -> float8 e4m3fn + FP32 scale_inv per block or per
// tensor (common/fp8.h has the element rule; docs/design.md, "FP8 quantization").
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/OptionalArrayRef.h>

#include <cstdint>
#include <optional>

namespace muon_ext {

// A checked call: master FP32, out float8_e4m3fn of master's shape, scale_inv
// FP32 (one per block, row-major, or one element), all contiguous on one
// device; found_inf a one-element FP32 tensor there or undefined.
// block_rows == 0: one scale for the whole tensor (any shape); otherwise
// master is 2-D and cut into block_rows x block_cols blocks, edge blocks partial.
struct QuantizeFp8Args {
  at::Tensor master, out, scale_inv, found_inf;
  int64_t block_rows = 0, block_cols = 0;
};

namespace op {
// The op behind torch.ops.muon_ext.quantize_fp8: checks, then CPU or CUDA kernel.
void quantize_fp8(const at::Tensor& master, at::OptionalIntArrayRef block, const at::Tensor& out,
                  const at::Tensor& out_scale_inv, const std::optional<at::Tensor>& found_inf);
}  // namespace op

// Kernels; a nonzero found_inf makes them write nothing.  The CUDA one runs on
// the current stream without a host sync: one launch per call with blocks, two
// per call for a per-tensor scale (amax partials, then scale + quantize).
namespace cpu {
void quantize_fp8(const QuantizeFp8Args& args);
}  // namespace cpu
namespace cuda {
void quantize_fp8(const QuantizeFp8Args& args);
}  // namespace cuda

}  // namespace muon_ext

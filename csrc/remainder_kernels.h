// Elementwise conversions between FP32 masters and BF16 + int16 remainders
// (csrc/common/remainder.h), for loading weights and checkpoints.
#pragma once

#include <ATen/core/Tensor.h>

namespace muon_ext {

// param (bf16) and remainder (int16) <- split(master (fp32)); same shapes, contiguous, one device.
namespace cpu {
void split_master(const at::Tensor& master, const at::Tensor& param, const at::Tensor& remainder);
void merge_master(const at::Tensor& param, const at::Tensor& remainder, const at::Tensor& master);
}  // namespace cpu

namespace cuda {
void split_master(const at::Tensor& master, const at::Tensor& param, const at::Tensor& remainder);
void merge_master(const at::Tensor& param, const at::Tensor& remainder, const at::Tensor& master);
}  // namespace cuda

}  // namespace muon_ext

// CUDA split / merge of FP32 masters into BF16 + int16 remainders: one
// grid-stride elementwise kernel each, on the current stream.
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>

#include <algorithm>

#include "../common/remainder.h"
#include "../remainder_kernels.h"

namespace muon_ext {
namespace cuda {
namespace {

constexpr int kThreads = 256;

__global__ void split_kernel(const uint32_t* bits, uint16_t* hi, int16_t* rem, int64_t n) {
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    const RemainderSplit s = split_master_bits(bits[i]);
    hi[i] = s.bf16_bits;
    rem[i] = s.remainder;
  }
}

__global__ void merge_kernel(const uint16_t* hi, const int16_t* rem, uint32_t* bits, int64_t n) {
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    bits[i] = merge_master_bits(hi[i], rem[i]);
  }
}

unsigned grid_for(int64_t n) {
  const int64_t blocks = (n + kThreads - 1) / kThreads;
  const int64_t cap = int64_t(at::cuda::getCurrentDeviceProperties()->multiProcessorCount) * 32;
  return static_cast<unsigned>(std::min(blocks, cap));
}

}  // namespace

void split_master(const at::Tensor& master, const at::Tensor& param, const at::Tensor& remainder) {
  const int64_t n = master.numel();
  if (n == 0) return;
  const c10::cuda::CUDAGuard guard(master.device());
  split_kernel<<<grid_for(n), kThreads, 0, at::cuda::getCurrentCUDAStream()>>>(
      static_cast<const uint32_t*>(master.const_data_ptr()), static_cast<uint16_t*>(param.data_ptr()),
      static_cast<int16_t*>(remainder.data_ptr()), n);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

void merge_master(const at::Tensor& param, const at::Tensor& remainder, const at::Tensor& master) {
  const int64_t n = master.numel();
  if (n == 0) return;
  const c10::cuda::CUDAGuard guard(master.device());
  merge_kernel<<<grid_for(n), kThreads, 0, at::cuda::getCurrentCUDAStream()>>>(
      static_cast<const uint16_t*>(param.const_data_ptr()), static_cast<const int16_t*>(remainder.const_data_ptr()),
      static_cast<uint32_t*>(master.data_ptr()), n);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace cuda
}  // namespace muon_ext

// CPU split / merge of FP32 masters into BF16 + int16 remainders.
#include <ATen/Parallel.h>

#include "../remainder_kernels.h"
#include "adamw_cpu.h"

namespace muon_ext {
namespace cpu {

constexpr int64_t kGrain = 32768;

void split_master(const at::Tensor& master, const at::Tensor& param, const at::Tensor& remainder) {
  const float* values = master.const_data_ptr<float>();
  uint16_t* hi = static_cast<uint16_t*>(param.data_ptr());
  int16_t* rem = static_cast<int16_t*>(remainder.data_ptr());
  const CpuCapability capability = best_capability();
  at::parallel_for(0, master.numel(), kGrain, [&](int64_t begin, int64_t end) {
    split_master_block(values + begin, hi + begin, rem + begin, end - begin, capability);
  });
}

void merge_master(const at::Tensor& param, const at::Tensor& remainder, const at::Tensor& master) {
  const uint16_t* hi = static_cast<const uint16_t*>(param.const_data_ptr());
  const int16_t* rem = static_cast<const int16_t*>(remainder.const_data_ptr());
  float* values = master.data_ptr<float>();
  const CpuCapability capability = best_capability();
  at::parallel_for(0, master.numel(), kGrain, [&](int64_t begin, int64_t end) {
    merge_master_block(hi + begin, rem + begin, values + begin, end - begin, capability);
  });
}

}  // namespace cpu
}  // namespace muon_ext

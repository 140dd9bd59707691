// CPU split / merge of FP32 masters into BF16 + int16 remainders.
#include <ATen/Parallel.h>

#include "../common/remainder.h"
#include "../remainder_ops.h"

namespace muon_ext {
namespace cpu {

constexpr int64_t kGrain = 32768;

void split_master(const at::Tensor& master, const at::Tensor& param, const at::Tensor& remainder) {
  const uint32_t* bits = static_cast<const uint32_t*>(master.const_data_ptr());
  uint16_t* hi = static_cast<uint16_t*>(param.data_ptr());
  int16_t* rem = static_cast<int16_t*>(remainder.data_ptr());
  at::parallel_for(0, master.numel(), kGrain, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const RemainderSplit s = split_master_bits(bits[i]);
      hi[i] = s.bf16_bits;
      rem[i] = s.remainder;
    }
  });
}

void merge_master(const at::Tensor& param, const at::Tensor& remainder, const at::Tensor& master) {
  const uint16_t* hi = static_cast<const uint16_t*>(param.const_data_ptr());
  const int16_t* rem = static_cast<const int16_t*>(remainder.const_data_ptr());
  uint32_t* bits = static_cast<uint32_t*>(master.data_ptr());
  at::parallel_for(0, master.numel(), kGrain, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) bits[i] = merge_master_bits(hi[i], rem[i]);
  });
}

}  // namespace cpu
}  // namespace muon_ext

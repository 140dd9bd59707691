// Storage formats of params, grads and masters on the GPU, shared by the
// AdamW and Muon kernels: BF16 and FP16 travel as raw uint16_t so that every
// conversion goes through the bit helpers of csrc/common, exactly as on the CPU.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include <cstdint>
#include <type_traits>

#include "../common/adamw_math.h"
#include "../common/bits.h"
#include "../common/remainder.h"

namespace muon_ext {
namespace cuda {

struct Float32 {
  using storage = float;
  MUON_HD static float load(float x) { return x; }
  MUON_HD static float store_rne(float x) { return x; }
};
struct BFloat16 {
  using storage = uint16_t;
  MUON_HD static float load(uint16_t x) { return bf16_bits_to_float(x); }
  MUON_HD static uint16_t store_rne(float x) { return float_to_bf16_bits_rne(x); }
};
struct Float16 {
  using storage = uint16_t;
  MUON_HD static float load(uint16_t x) { return half_bits_to_float(x); }
  MUON_HD static uint16_t store_rne(float x) { return float_to_half_bits_rne(x); }
};

// The FP32 master of an element in each MasterMode: the param itself, an FP32
// master, or BF16 param bits + int16 remainder (remainder.h).  Written back
// as the split for remainders, else rounded to nearest even into the param.
template <MasterMode M>
using master_storage_t = std::conditional_t<M == MasterMode::kRemainder, int16_t, float>;

template <typename P, MasterMode M>
MUON_HD float load_master(typename P::storage param, master_storage_t<M> master) {
  if constexpr (M == MasterMode::kFP32) {
    return master;
  } else if constexpr (M == MasterMode::kRemainder) {
    return merge_master(param, master);
  } else {
    return P::load(param);
  }
}

template <typename P, MasterMode M>
MUON_HD void store_master(float p, typename P::storage& param, master_storage_t<M>& master) {
  if constexpr (M == MasterMode::kRemainder) {
    const RemainderSplit split = split_master(p);
    param = split.bf16_bits;
    master = split.remainder;
  } else {
    if constexpr (M == MasterMode::kFP32) master = p;
    param = P::store_rne(p);
  }
}

// Calls fn(Float32{} | BFloat16{} | Float16{}) for a param or grad dtype.
template <typename Fn>
void dispatch_storage(at::ScalarType dtype, const char* role, Fn&& fn) {
  switch (dtype) {
    case at::kFloat: return fn(Float32{});
    case at::kBFloat16: return fn(BFloat16{});
    case at::kHalf: return fn(Float16{});
    default: TORCH_CHECK(false, "unsupported ", role, " dtype ", dtype);
  }
}

// Calls fn(param format, master kind constant) for the supported combinations:
// FP32 params are their own master; only BF16 params store remainders.
template <typename Fn>
void dispatch_param(at::ScalarType dtype, MasterMode master_mode, Fn&& fn) {
  dispatch_storage(dtype, "param", [&](auto format) {
    using P = decltype(format);
    switch (master_mode) {
      case MasterMode::kNone: return fn(format, std::integral_constant<MasterMode, MasterMode::kNone>{});
      case MasterMode::kFP32:
        if constexpr (!std::is_same_v<P, Float32>) {
          return fn(format, std::integral_constant<MasterMode, MasterMode::kFP32>{});
        }
        break;
      case MasterMode::kRemainder:
        if constexpr (std::is_same_v<P, BFloat16>) {
          return fn(format, std::integral_constant<MasterMode, MasterMode::kRemainder>{});
        }
        break;
    }
    TORCH_CHECK(false, "master kind ", static_cast<int>(master_mode), " is not supported for ", dtype, " params");
  });
}

}  // namespace cuda
}  // namespace muon_ext

// Element loads and round-to-nearest-even stores of the param / grad formats
// on the CPU, through the bit helpers shared with the CUDA kernels.
#pragma once

#include <cstdint>

#include "../common/bits.h"

namespace muon_ext {
namespace cpu {

enum class ScalarKind : int { kFloat32 = 0, kBFloat16 = 1, kFloat16 = 2 };

// Internal linkage on purpose: these are compiled into per-ISA translation
// units, and one shared inline definition could let the linker keep an AVX512
// copy for the DEFAULT kernel.
namespace {

template <ScalarKind K>
inline float load_scalar(const void* base, int64_t i) {
  if constexpr (K == ScalarKind::kFloat32) {
    return static_cast<const float*>(base)[i];
  } else if constexpr (K == ScalarKind::kBFloat16) {
    return bf16_bits_to_float(static_cast<const uint16_t*>(base)[i]);
  } else {
    return half_bits_to_float(static_cast<const uint16_t*>(base)[i]);
  }
}

template <ScalarKind K>
inline void store_rne(void* base, int64_t i, float x) {
  if constexpr (K == ScalarKind::kFloat32) {
    static_cast<float*>(base)[i] = x;
  } else if constexpr (K == ScalarKind::kBFloat16) {
    static_cast<uint16_t*>(base)[i] = float_to_bf16_bits_rne(x);
  } else {
    static_cast<uint16_t*>(base)[i] = float_to_half_bits_rne(x);
  }
}

}  // namespace
}  // namespace cpu
}  // namespace muon_ext

// The CPU kernels' ScalarKind of an ATen float dtype (one of the three the
// argument checks admit).
#pragma once

#include <c10/core/ScalarType.h>

#include "scalar_io.h"

namespace muon_ext {
namespace cpu {

inline ScalarKind scalar_kind(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return ScalarKind::kFloat32;
    case at::kBFloat16: return ScalarKind::kBFloat16;
    default: return ScalarKind::kFloat16;
  }
}

}  // namespace cpu
}  // namespace muon_ext

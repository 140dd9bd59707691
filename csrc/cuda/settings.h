// Environment settings of the CUDA kernels: read at every call (so that a
// benchmark can compare them in one process), and all checked at the start of
// every CUDA optimizer entry point, so that a bad value raises before any state
// of any param group moves, whichever kernel reads it.
#pragma once

#include "../checks.h"
#include "multi_tensor_apply.cuh"

namespace muon_ext {
namespace cuda {

// MUON_EXT_CUDA_POLAR_FOLD: unset, "" or "1" fold Polar-Express's copies into
// out-of-place cublasLt GEMMs, "0" runs every copy (polar_express_cuda.cu).
inline bool polar_fold_copies_setting() { return checks::on_off_setting("MUON_EXT_CUDA_POLAR_FOLD"); }

// MUON_EXT_CUDA_BLOCKS_PER_LAUNCH (blocks_per_launch, multi_tensor_apply.cuh)
// and MUON_EXT_CUDA_POLAR_FOLD.
inline void check_cuda_settings() {
  blocks_per_launch();
  polar_fold_copies_setting();
}

}  // namespace cuda
}  // namespace muon_ext

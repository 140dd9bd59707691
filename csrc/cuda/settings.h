// Environment settings of the CUDA kernels: read at every call (so that a
// benchmark can compare them in one process), all of them once at the start of
// every CUDA optimizer entry point (read_cuda_settings), so that a bad value
// raises before any state of any param group moves, whichever kernel uses it,
// and one call runs with one value of each.
#pragma once

#include "../checks.h"
#include "multi_tensor_apply.cuh"

namespace muon_ext {
namespace cuda {

// MUON_EXT_CUDA_POLAR_FOLD: unset, "" or "1" fold Polar-Express's copies into
// out-of-place cublasLt GEMMs, "0" runs every copy (polar_express_cuda.cu).
inline bool polar_fold_copies_setting() { return checks::on_off_setting("MUON_EXT_CUDA_POLAR_FOLD"); }

// The settings one entry point runs with, read once at its start.
struct CudaSettings {
  int blocks_per_launch;   // MUON_EXT_CUDA_BLOCKS_PER_LAUNCH (multi_tensor_apply.cuh)
  bool polar_fold_copies;  // MUON_EXT_CUDA_POLAR_FOLD
};

inline CudaSettings read_cuda_settings() { return {blocks_per_launch(), polar_fold_copies_setting()}; }

}  // namespace cuda
}  // namespace muon_ext

// CPU Muon step on one bucket of same-shape matrices: the same passes as the
// CUDA path, with the Polar-Express GEMMs in FP32.
#pragma once

#include "../muon_args.h"

namespace muon_ext {
namespace cpu {

// One Muon step on a validated bucket of CPU tensors.  A nonzero found_inf
// must be handled by the caller (it must not call).
void muon_step(const MuonBucket& bucket, const MuonStepOptions& options);

}  // namespace cpu
}  // namespace muon_ext

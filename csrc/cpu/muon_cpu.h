// CPU Muon kernels: the same passes as the CUDA path; the Polar-Express GEMMs
// in BF16 (the CUDA rounding) or FP32, by the op's polar_dtype
// (polar_express_cpu.h).
#pragma once

#include "../muon_args.h"

namespace muon_ext {
namespace cpu {

// One Muon step on a validated bucket of CPU tensors.  A nonzero found_inf
// must be handled by the caller (it must not call).
void muon_step(const MuonBucket& bucket, const MuonStepOptions& options);

// The three phases on validated CPU arguments (found_inf handled by the
// caller, as above).  Composed, they give muon_step's bits.
void muon_momentum(const MuonMomentumArgs& args, float inv_scale);
void muon_orthogonalize(const MuonOrthogonalizeArgs& args);
void muon_apply(const MuonApplyArgs& args, float lr);

}  // namespace cpu
}  // namespace muon_ext

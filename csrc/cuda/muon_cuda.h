// CUDA Muon kernels: the fused step on one bucket of same-shape matrices and
// the three phases (see csrc/muon_args.h and docs/design.md, "Muon in three phases").
#pragma once

#include "../muon_args.h"

namespace muon_ext {
namespace cuda {

// One Muon step on a validated bucket whose tensors all live on one CUDA
// device.  Never synchronizes the host; a nonzero *found_inf leaves every
// tensor unchanged.
void muon_step(const MuonBucket& bucket, const MuonStepOptions& options);

// The three phases, on validated arguments (one CUDA device each); never
// synchronize the host; a nonzero *found_inf leaves every tensor unchanged.
// Composed, they give the fused step's bits.
void muon_momentum(const MuonMomentumArgs& args);
void muon_orthogonalize(const MuonOrthogonalizeArgs& args);
void muon_apply(const MuonApplyArgs& args);

}  // namespace cuda
}  // namespace muon_ext

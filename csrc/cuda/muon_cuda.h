// CUDA Muon step on one bucket of same-shape matrices.
#pragma once

#include "../muon_args.h"

namespace muon_ext {
namespace cuda {

// One Muon step (see DESIGN.md "Muon" and "Data flow of one step") on a
// validated bucket whose tensors all live on one CUDA device.  Never
// synchronizes the host; a nonzero *found_inf leaves every tensor unchanged.
void muon_step(const MuonBucket& bucket, const MuonStepOptions& options);

}  // namespace cuda
}  // namespace muon_ext

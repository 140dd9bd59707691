// The fused small-matrix Muon step on the CPU: momentum, input scale,
// Polar-Express on the SIMD kernel, NorMuon and the apply in one pass per run
// of matrices (docs/design.md, "CPU kernels", fused small-matrix step).
#pragma once

#include "../muon_args.h"

namespace muon_ext {
namespace cpu {

// Whether muon_step takes the fused path for this bucket's shape.
bool fused_small_step(const MuonBucket& b);

// The whole step on a validated bucket for which fused_small_step holds; the
// bits are the unfused passes'.
void small_step(const MuonBucket& b, const MuonStepOptions& o, float inv_scale, float lr, float lr_wd);

}  // namespace cpu
}  // namespace muon_ext

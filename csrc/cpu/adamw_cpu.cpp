// Step-counter handling and instruction-set dispatch for the CPU AdamW kernel.
#include "adamw_cpu.h"

#include <ATen/Version.h>
#include <c10/util/Exception.h>

#include <string>

namespace muon_ext {
namespace cpu {

std::vector<CpuCapability> available_capabilities() {
  std::vector<CpuCapability> out{CpuCapability::kDefault};
#if defined(MUON_EXT_HAVE_AVX2)
  // ATen's choice (CPU features, capped by ATEN_CPU_CAPABILITY): "DEFAULT", "AVX2" or "AVX512".
  const std::string best = at::get_cpu_capability();
  if (best == "AVX2" || best == "AVX512") out.push_back(CpuCapability::kAVX2);
#if defined(MUON_EXT_HAVE_AVX512)
  if (best == "AVX512") out.push_back(CpuCapability::kAVX512);
#endif
#endif
  return out;
}

CpuCapability best_capability() { return available_capabilities().back(); }

const char* capability_name(CpuCapability capability) {
  switch (capability) {
    case CpuCapability::kDefault: return "DEFAULT";
    case CpuCapability::kAVX2: return "AVX2";
    case CpuCapability::kAVX512: return "AVX512";
  }
  return "unknown";
}

void adamw_step(const AdamWBatch& batch, const AdamWHyper& hyper, float lr, float inv_scale,
                CpuCapability capability) {
  std::vector<AdamWCoeffs<float>> coeffs;
  coeffs.reserve(batch.tensors.size());
  for (const AdamWTensor& t : batch.tensors) {
    *t.step += 1.0f;
    coeffs.push_back(make_adamw_coeffs(hyper, lr, *t.step, inv_scale));
  }
  switch (capability) {
#if defined(MUON_EXT_HAVE_AVX512)
    case CpuCapability::kAVX512: AVX512::adamw_apply(batch, coeffs); return;
#endif
#if defined(MUON_EXT_HAVE_AVX2)
    case CpuCapability::kAVX2: AVX2::adamw_apply(batch, coeffs); return;
#endif
    case CpuCapability::kDefault: DEFAULT::adamw_apply(batch, coeffs); return;
    default: break;
  }
  TORCH_CHECK(false, "adamw_step: CPU capability ", capability_name(capability), " is not built in");
}

void adamw_step(const AdamWBatch& batch, const AdamWHyper& hyper, float lr, float inv_scale) {
  adamw_step(batch, hyper, lr, inv_scale, best_capability());
}

}  // namespace cpu
}  // namespace muon_ext

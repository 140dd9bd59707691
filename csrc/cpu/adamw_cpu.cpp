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

namespace {

using ApplyFn = void (*)(const AdamWBatch&, const std::vector<AdamWCoeffs<float>>&);

ApplyFn kernel_for(CpuCapability capability) {
  switch (capability) {
#if defined(MUON_EXT_HAVE_AVX512)
    case CpuCapability::kAVX512: return &AVX512::adamw_apply;
#endif
#if defined(MUON_EXT_HAVE_AVX2)
    case CpuCapability::kAVX2: return &AVX2::adamw_apply;
#endif
    case CpuCapability::kDefault: return &DEFAULT::adamw_apply;
    default: return nullptr;
  }
}

// FP32 params are their own master; only BF16 params carry remainders.
bool is_supported(ScalarKind param, MasterKind master) {
  switch (master) {
    case MasterKind::kNone: return true;
    case MasterKind::kFP32: return param != ScalarKind::kFloat32;
    case MasterKind::kRemainder: return param == ScalarKind::kBFloat16;
  }
  return false;
}

}  // namespace

void adamw_step(const AdamWBatch& batch, const AdamWHyper& hyper, float lr, float inv_scale,
                CpuCapability capability) {
  // Everything that can be refused is refused before a step counter moves.
  const ApplyFn apply = kernel_for(capability);
  TORCH_CHECK(apply != nullptr, "adamw_step: CPU capability ", capability_name(capability), " is not built in");
  TORCH_CHECK(is_supported(batch.param_kind, batch.master_kind), "adamw_step: master kind ",
              static_cast<int>(batch.master_kind), " is not supported for this param dtype");
  std::vector<AdamWCoeffs<float>> coeffs;
  coeffs.reserve(batch.tensors.size());
  for (const AdamWTensor& t : batch.tensors) {
    *t.step += 1.0f;
    coeffs.push_back(make_adamw_coeffs(hyper, lr, *t.step, inv_scale));
  }
  apply(batch, coeffs);
}

void adamw_step(const AdamWBatch& batch, const AdamWHyper& hyper, float lr, float inv_scale) {
  adamw_step(batch, hyper, lr, inv_scale, best_capability());
}

}  // namespace cpu
}  // namespace muon_ext

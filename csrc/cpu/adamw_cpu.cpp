// Step-counter handling and instruction-set dispatch for the per-ISA CPU
// kernels (AdamW and the remainder blocks).
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

// The entry points of one instruction set's kernel build.
struct IsaKernels {
  void (*apply)(const AdamWBatch&, const std::vector<AdamWCoeffs<float>>&);
  void (*split)(const float*, uint16_t*, int16_t*, int64_t);
  void (*merge)(const uint16_t*, const int16_t*, float*, int64_t);
};

#define MUON_EXT_ISA_KERNELS(ISA) \
  IsaKernels { &ISA::adamw_apply, &ISA::split_master_block, &ISA::merge_master_block }

// nullptr when the capability is not built in.
const IsaKernels* kernels_for(CpuCapability capability) {
  static const IsaKernels default_kernels = MUON_EXT_ISA_KERNELS(DEFAULT);
  switch (capability) {
#if defined(MUON_EXT_HAVE_AVX512)
    case CpuCapability::kAVX512: {
      static const IsaKernels avx512_kernels = MUON_EXT_ISA_KERNELS(AVX512);
      return &avx512_kernels;
    }
#endif
#if defined(MUON_EXT_HAVE_AVX2)
    case CpuCapability::kAVX2: {
      static const IsaKernels avx2_kernels = MUON_EXT_ISA_KERNELS(AVX2);
      return &avx2_kernels;
    }
#endif
    case CpuCapability::kDefault: return &default_kernels;
    default: return nullptr;
  }
}

#undef MUON_EXT_ISA_KERNELS

const IsaKernels& checked_kernels(const char* op, CpuCapability capability) {
  const IsaKernels* kernels = kernels_for(capability);
  TORCH_CHECK(kernels != nullptr, op, ": CPU capability ", capability_name(capability), " is not built in");
  return *kernels;
}

// FP32 params are their own master; only BF16 params carry remainders.
bool is_supported(ScalarKind param, MasterMode master) {
  switch (master) {
    case MasterMode::kNone: return true;
    case MasterMode::kFP32: return param != ScalarKind::kFloat32;
    case MasterMode::kRemainder: return param == ScalarKind::kBFloat16;
  }
  return false;
}

}  // namespace

void adamw_step(const AdamWBatch& batch, const AdamWHyper& hyper, float lr, float inv_scale,
                CpuCapability capability) {
  // Everything that can be refused is refused before a step counter moves.
  const IsaKernels& kernels = checked_kernels("adamw_step", capability);
  TORCH_CHECK(is_supported(batch.param_kind, batch.master_mode), "adamw_step: master mode ",
              static_cast<int>(batch.master_mode), " is not supported for this param dtype");
  std::vector<AdamWCoeffs<float>> coeffs;
  coeffs.reserve(batch.tensors.size());
  for (const AdamWTensor& t : batch.tensors) {
    *t.step += 1.0f;
    // The tensors of a group usually share their step count: the powers are
    // computed once per run of equal counts (the same inputs, the same bits).
    if (!coeffs.empty() && *t.step == *(&t - 1)->step) {
      coeffs.push_back(coeffs.back());
    } else {
      coeffs.push_back(make_adamw_coeffs(hyper, lr, *t.step, inv_scale));
    }
  }
  kernels.apply(batch, coeffs);
}

void split_master_block(const float* master, uint16_t* hi, int16_t* rem, int64_t n, CpuCapability capability) {
  checked_kernels("split_master_block", capability).split(master, hi, rem, n);
}

void merge_master_block(const uint16_t* hi, const int16_t* rem, float* master, int64_t n, CpuCapability capability) {
  checked_kernels("merge_master_block", capability).merge(hi, rem, master, n);
}

}  // namespace cpu
}  // namespace muon_ext

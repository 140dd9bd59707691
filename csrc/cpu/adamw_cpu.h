// CPU multi-tensor AdamW: a framework-free interface over raw buffers.
//
// The binding layer validates tensors and fills an AdamWBatch; the kernel is
// compiled once per instruction set (DEFAULT, AVX2, AVX512) and picked at run
// time from ATen's CPU capability, as PyTorch does for its own kernels.
#pragma once

#include <cstdint>
#include <vector>

#include "../common/adamw_math.h"
#include "scalar_io.h"

namespace muon_ext {
namespace cpu {

enum class CpuCapability : int { kDefault = 0, kAVX2 = 1, kAVX512 = 2 };

struct AdamWTensor {
  void* param;        // ScalarKind param_kind, numel elements
  const void* grad;   // ScalarKind grad_kind, numel elements
  float* exp_avg;     // numel FP32
  float* exp_avg_sq;  // numel FP32
  void* master;       // FP32 (kFP32), int16 (kRemainder) or nullptr (kNone)
  float* step;        // one FP32 step counter
  int64_t numel;
};

struct AdamWBatch {
  ScalarKind param_kind;
  ScalarKind grad_kind;
  MasterMode master_mode;
  std::vector<AdamWTensor> tensors;
};

// Advances each tensor's step counter by one, then applies one AdamW step to
// every element with the kernels of `capability` (the op passes
// best_capability(), tests each one), which must be supported by this build
// and this machine.  Skipping on a found-inf flag is the caller's decision
// (it must not call).
void adamw_step(const AdamWBatch& batch, const AdamWHyper& hyper, float lr, float inv_scale,
                CpuCapability capability);

// Instruction sets compiled into this build and usable on this machine.
std::vector<CpuCapability> available_capabilities();
CpuCapability best_capability();
const char* capability_name(CpuCapability capability);

// Remainder split / merge (common/remainder.h) of n contiguous elements,
// vectorized with the given (or best) instruction set; every one gives the
// scalar rule's bits.  Serial: callers split large inputs over threads.
void split_master_block(const float* master, uint16_t* hi, int16_t* rem, int64_t n, CpuCapability capability);
void merge_master_block(const uint16_t* hi, const int16_t* rem, float* master, int64_t n, CpuCapability capability);

// The per-ISA kernels: the element update with per-tensor coefficients (the
// step counters are not touched here), and the remainder blocks.
#define MUON_EXT_DECLARE_ADAMW_KERNEL(ISA)                                                   \
  namespace ISA {                                                                           \
  void adamw_apply(const AdamWBatch& batch, const std::vector<AdamWCoeffs<float>>& coeffs); \
  void split_master_block(const float* master, uint16_t* hi, int16_t* rem, int64_t n);      \
  void merge_master_block(const uint16_t* hi, const int16_t* rem, float* master, int64_t n); \
  }
MUON_EXT_DECLARE_ADAMW_KERNEL(DEFAULT)
MUON_EXT_DECLARE_ADAMW_KERNEL(AVX2)
MUON_EXT_DECLARE_ADAMW_KERNEL(AVX512)
#undef MUON_EXT_DECLARE_ADAMW_KERNEL

}  // namespace cpu
}  // namespace muon_ext

// CPU Polar-Express (the CPU twin of cuda/polar_express_cuda.h): the
// iterations of csrc/common/polar_plan.h on a stacked FP32 workspace, with
// the GEMM kind and rounding of the op's polar_dtype.
#pragma once

#include <ATen/ATen.h>

#include <array>
#include <cstdint>
#include <vector>

#include "../common/polar_plan.h"
#include "../muon_args.h"
#include "polar_small.h"

namespace muon_ext {
namespace cpu {

// How BF16 Polar-Express GEMMs run on this CPU, decided once per process:
// kNativeBf16 where the CPU has a BF16 GEMM (AVX-512 BF16 or AMX: oneDNN on BF16
// buffers), else kRoundedFp32 (FP32 GEMMs on BF16 values, outputs rounded).
// MUON_EXT_CPU_BF16_GEMM=native|rounded forces one (tests).
enum class PolarGemm { kNativeBf16, kRoundedFp32 };
PolarGemm polar_bf16_gemm();

// The rounding of each GEMM output for a polar_dtype (FP32 GEMMs on the CPU).
PolarRounding rounding_of(PolarDtype precision);

// The iterations on x ([count, rows, cols], FP32, contiguous), in place; the
// matrices' bits do not depend on the thread count, their position or address.
// row_blocks 0: the shape's default. Scratch beyond one matrix's stays within
// max_scratch_bytes.
void polar_express(at::Tensor& x, const std::vector<std::array<float, 3>>& coefficients, int64_t rows,
                   int64_t cols, int64_t row_blocks, int64_t max_scratch_bytes, PolarDtype precision,
                   PolarMethod method);

}  // namespace cpu
}  // namespace muon_ext

// CPU quantize_fp8: blocks in parallel (at::parallel_for), or a parallel amax
// and then a parallel quantize for one scale per tensor.  The element math is
// common/fp8.h, shared with the CUDA kernel.
#include <ATen/Parallel.h>

#include <algorithm>

#include "../common/fp8.h"
#include "../quantize_ops.h"

namespace muon_ext {
namespace cpu {
namespace {

constexpr int64_t kGrain = 32768;

void quantize_span(const float* __restrict x, uint8_t* __restrict q, int64_t n, float scale_inv) {
  for (int64_t i = 0; i < n; ++i) q[i] = quantize_fp8_element(x[i], scale_inv);
}

// int32: the bits are below 2^31, and SSE2 has no unsigned 32-bit max.
uint32_t amax_span(const float* x, int64_t n) {
  int32_t amax = 0;
  for (int64_t i = 0; i < n; ++i) amax = std::max(amax, int32_t(fp8_amax_bits(x[i])));
  return uint32_t(amax);
}

void quantize_tensor(const float* x, uint8_t* q, float* scale_inv, int64_t n) {
  const uint32_t amax = at::parallel_reduce(
      0, n, kGrain, uint32_t{0},
      [&](int64_t begin, int64_t end, uint32_t init) { return std::max(init, amax_span(x + begin, end - begin)); },
      [](uint32_t a, uint32_t b) { return std::max(a, b); });
  const float scale = fp8_scale_inv(amax);
  at::parallel_for(0, n, kGrain, [&](int64_t begin, int64_t end) { quantize_span(x + begin, q + begin, end - begin, scale); });
  *scale_inv = scale;
}

void quantize_blocks(const float* x, uint8_t* q, float* scale_inv, int64_t rows, int64_t cols, int64_t br,
                     int64_t bc) {
  const int64_t blocks_per_row = (cols + bc - 1) / bc;
  const int64_t blocks = (rows + br - 1) / br * blocks_per_row;
  // About kGrain elements per task, at least one block.
  const int64_t grain = std::max<int64_t>(1, kGrain / (br * bc));
  at::parallel_for(0, blocks, grain, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      const int64_t r0 = b / blocks_per_row * br, c0 = b % blocks_per_row * bc;
      const int64_t r1 = std::min(rows, r0 + br), width = std::min(cols, c0 + bc) - c0;
      uint32_t amax = 0;
      for (int64_t r = r0; r < r1; ++r) amax = std::max(amax, amax_span(x + r * cols + c0, width));
      const float scale = fp8_scale_inv(amax);
      for (int64_t r = r0; r < r1; ++r) quantize_span(x + r * cols + c0, q + r * cols + c0, width, scale);
      scale_inv[b] = scale;
    }
  });
}

}  // namespace

void quantize_fp8(const QuantizeFp8Args& args) {
  if (args.found_inf.defined() && args.found_inf.item<float>() != 0.0f) return;
  const float* x = args.master.const_data_ptr<float>();
  uint8_t* q = static_cast<uint8_t*>(args.out.data_ptr());
  float* scale_inv = args.scale_inv.data_ptr<float>();
  if (args.block_rows == 0) return quantize_tensor(x, q, scale_inv, args.master.numel());
  if (args.master.numel() == 0) return;
  quantize_blocks(x, q, scale_inv, args.master.size(0), args.master.size(1), args.block_rows, args.block_cols);
}

}  // namespace cpu
}  // namespace muon_ext

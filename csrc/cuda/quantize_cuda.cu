// CUDA quantize_fp8 (common/fp8.h element math, shared with the CPU kernel;
// --fmad=false and IEEE division keep the bits identical).
//
// Blocks: one launch; each CTA takes whole blocks (grid-stride), reads a block
// once for its amax (an integer max of magnitude bits: exact, so the result
// does not depend on the reduction order), then again (mostly from L2) to
// quantize it.  Per tensor: two launches, since every element needs the
// amax of all of them: per-CTA amax partials, then every CTA reduces the
// partials itself and quantizes its share.  A nonzero found_inf makes every
// CTA return before writing; nothing syncs the host.
#include <ATen/cuda/CUDAContext.h>
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cstdint>
#include <limits>

#include "../common/fp8.h"
#include "../quantize_ops.h"

namespace muon_ext {
namespace cuda {
namespace {

// Threads of a CTA: 32 lanes across a block's columns x 8 rows.
constexpr int kLanes = 32;
constexpr int kRows = 8;
constexpr int kThreads = kLanes * kRows;
// Per-tensor amax: at most this many partials (CTAs of the first launch).
constexpr int kMaxPartials = 1024;

template <int W>
struct alignas(4 * W) FloatPack {
  float v[W];
};

template <int W>
struct alignas(W) BytePack {
  uint8_t v[W];
};

template <int W>
__device__ __forceinline__ uint32_t pack_amax(const float* x, int64_t i, uint32_t amax) {
  const FloatPack<W> p = *reinterpret_cast<const FloatPack<W>*>(x + i);
#pragma unroll
  for (int k = 0; k < W; ++k) amax = max(amax, fp8_amax_bits(p.v[k]));
  return amax;
}

template <int W>
__device__ __forceinline__ void pack_quantize(const float* x, uint8_t* q, int64_t i, float scale_inv) {
  const FloatPack<W> p = *reinterpret_cast<const FloatPack<W>*>(x + i);
  BytePack<W> out;
#pragma unroll
  for (int k = 0; k < W; ++k) out.v[k] = quantize_fp8_element(p.v[k], scale_inv);
  *reinterpret_cast<BytePack<W>*>(q + i) = out;
}

// The CTA-wide max of every thread's `value`, returned to all threads.
__device__ uint32_t cta_max(uint32_t value) {
  __shared__ uint32_t warp_max[kThreads / 32];
  for (int offset = 16; offset > 0; offset >>= 1) value = max(value, __shfl_xor_sync(0xFFFFFFFFu, value, offset));
  const int tid = threadIdx.y * kLanes + threadIdx.x;
  if (tid % 32 == 0) warp_max[tid / 32] = value;
  __syncthreads();
  uint32_t all = 0;
#pragma unroll
  for (int w = 0; w < kThreads / 32; ++w) all = max(all, warp_max[w]);
  __syncthreads();  // warp_max is reused by the next call
  return all;
}

__device__ __forceinline__ bool skipped(const float* found_inf) { return found_inf != nullptr && *found_inf != 0.0f; }

// W: elements per load; W > 1 needs cols and block_cols multiples of W and aligned pointers.
template <int W>
__global__ void __launch_bounds__(kThreads) quantize_blocks_kernel(const float* x, uint8_t* q, float* scale_inv,
                                                                   int64_t rows, int64_t cols, int64_t block_rows,
                                                                   int64_t block_cols, int64_t blocks_per_row,
                                                                   int64_t blocks, const float* found_inf) {
  if (skipped(found_inf)) return;
  for (int64_t b = blockIdx.x; b < blocks; b += gridDim.x) {
    const int64_t r0 = b / blocks_per_row * block_rows, c0 = b % blocks_per_row * block_cols;
    const int64_t r1 = min(rows, r0 + block_rows), c1 = min(cols, c0 + block_cols);
    uint32_t amax = 0;
    // Unrolled over rows: several loads in flight per thread (a 128x128 block is 16 rows per thread).
#pragma unroll 4
    for (int64_t r = r0 + threadIdx.y; r < r1; r += kRows) {
      for (int64_t c = c0 + int64_t(threadIdx.x) * W; c < c1; c += kLanes * W) amax = pack_amax<W>(x, r * cols + c, amax);
    }
    const float scale = fp8_scale_inv(cta_max(amax));
#pragma unroll 4
    for (int64_t r = r0 + threadIdx.y; r < r1; r += kRows) {
      for (int64_t c = c0 + int64_t(threadIdx.x) * W; c < c1; c += kLanes * W) pack_quantize<W>(x, q, r * cols + c, scale);
    }
    if (threadIdx.x == 0 && threadIdx.y == 0) scale_inv[b] = scale;
  }
}

__device__ __forceinline__ int64_t global_thread() {
  return int64_t(blockIdx.x) * kThreads + threadIdx.y * kLanes + threadIdx.x;
}

// Per tensor, launch 1: partials[blockIdx.x] = amax of this CTA's grid-stride share.
template <int W>
__global__ void __launch_bounds__(kThreads) tensor_amax_kernel(const float* x, int64_t n, uint32_t* partials,
                                                               const float* found_inf) {
  if (skipped(found_inf)) return;
  const int64_t stride = int64_t(gridDim.x) * kThreads;
  uint32_t amax = 0;
  for (int64_t i = global_thread() * W; i + W <= n; i += stride * W) amax = pack_amax<W>(x, i, amax);
  for (int64_t i = n / W * W + global_thread(); i < n; i += stride) amax = max(amax, fp8_amax_bits(x[i]));
  amax = cta_max(amax);
  if (threadIdx.x == 0 && threadIdx.y == 0) partials[blockIdx.x] = amax;
}

// Per tensor, launch 2: every CTA reduces the partials, then quantizes its share.
template <int W>
__global__ void __launch_bounds__(kThreads) tensor_quantize_kernel(const float* x, uint8_t* q, int64_t n,
                                                                   const uint32_t* partials, int num_partials,
                                                                   float* scale_inv, const float* found_inf) {
  if (skipped(found_inf)) return;
  uint32_t amax = 0;
  for (int i = threadIdx.y * kLanes + threadIdx.x; i < num_partials; i += kThreads) amax = max(amax, partials[i]);
  const float scale = fp8_scale_inv(cta_max(amax));
  const int64_t stride = int64_t(gridDim.x) * kThreads;
  for (int64_t i = global_thread() * W; i + W <= n; i += stride * W) pack_quantize<W>(x, q, i, scale);
  for (int64_t i = n / W * W + global_thread(); i < n; i += stride) q[i] = quantize_fp8_element(x[i], scale);
  if (blockIdx.x == 0 && threadIdx.x == 0 && threadIdx.y == 0) *scale_inv = scale;
}

bool aligned(const void* p, size_t bytes) { return reinterpret_cast<uintptr_t>(p) % bytes == 0; }

unsigned grid_cap() {
  return static_cast<unsigned>(at::cuda::getCurrentDeviceProperties()->multiProcessorCount) * 8u;
}

void quantize_blocks(const QuantizeFp8Args& args, const float* found_inf, cudaStream_t stream) {
  const float* x = args.master.const_data_ptr<float>();
  uint8_t* q = static_cast<uint8_t*>(args.out.data_ptr());
  float* scale_inv = args.scale_inv.data_ptr<float>();
  const int64_t rows = args.master.size(0), cols = args.master.size(1);
  const int64_t blocks_per_row = (cols + args.block_cols - 1) / args.block_cols;
  const int64_t blocks = (rows + args.block_rows - 1) / args.block_rows * blocks_per_row;
  const unsigned grid = static_cast<unsigned>(std::min<int64_t>(blocks, std::numeric_limits<int32_t>::max()));
  const dim3 threads(kLanes, kRows);
  if (cols % 4 == 0 && args.block_cols % 4 == 0 && aligned(x, 16) && aligned(q, 4)) {
    quantize_blocks_kernel<4><<<grid, threads, 0, stream>>>(x, q, scale_inv, rows, cols, args.block_rows,
                                                            args.block_cols, blocks_per_row, blocks, found_inf);
  } else {
    quantize_blocks_kernel<1><<<grid, threads, 0, stream>>>(x, q, scale_inv, rows, cols, args.block_rows,
                                                            args.block_cols, blocks_per_row, blocks, found_inf);
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

void quantize_tensor(const QuantizeFp8Args& args, const float* found_inf, cudaStream_t stream) {
  const float* x = args.master.const_data_ptr<float>();
  uint8_t* q = static_cast<uint8_t*>(args.out.data_ptr());
  float* scale_inv = args.scale_inv.data_ptr<float>();
  const int64_t n = args.master.numel();
  const bool vec = aligned(x, 16) && aligned(q, 4);
  const int64_t per_cta = int64_t(kThreads) * (vec ? 4 : 1);
  const int partials_count =
      static_cast<int>(std::min<int64_t>({(n + per_cta - 1) / per_cta, int64_t(kMaxPartials), int64_t(grid_cap())}));
  // Stream-ordered scratch from the caching allocator: no sync, and freed
  // only after the kernels queued on this stream have read it.
  const at::Tensor partials = at::empty({std::max(partials_count, 1)}, args.master.options().dtype(at::kInt));
  uint32_t* partials_ptr = reinterpret_cast<uint32_t*>(partials.data_ptr<int32_t>());
  const dim3 threads(kLanes, kRows);
  // An empty tensor still gets its scale (1): the second launch alone.
  if (partials_count > 0) {
    if (vec) {
      tensor_amax_kernel<4><<<partials_count, threads, 0, stream>>>(x, n, partials_ptr, found_inf);
    } else {
      tensor_amax_kernel<1><<<partials_count, threads, 0, stream>>>(x, n, partials_ptr, found_inf);
    }
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
  const unsigned grid = static_cast<unsigned>(std::max<int64_t>(1, std::min<int64_t>((n + per_cta - 1) / per_cta, grid_cap())));
  if (vec) {
    tensor_quantize_kernel<4><<<grid, threads, 0, stream>>>(x, q, n, partials_ptr, partials_count, scale_inv, found_inf);
  } else {
    tensor_quantize_kernel<1><<<grid, threads, 0, stream>>>(x, q, n, partials_ptr, partials_count, scale_inv, found_inf);
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace

void quantize_fp8(const QuantizeFp8Args& args) {
  const c10::cuda::CUDAGuard guard(args.master.device());
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  const float* found_inf = args.found_inf.defined() ? args.found_inf.const_data_ptr<float>() : nullptr;
  if (args.block_rows == 0) return quantize_tensor(args, found_inf, stream);
  if (args.master.numel() == 0) return;
  quantize_blocks(args, found_inf, stream);
}

}  // namespace cuda
}  // namespace muon_ext

// CUDA Muon step on one bucket of same-shape matrices.
//
// The GPU twin of cpu/muon_cpu.cpp: the math of common/muon_math.h compiled
// with --fmad=false; only the Polar-Express GEMMs differ (BF16 operands).  Per
// chunk of matrices, on the current stream, without a host synchronization:
//   1. momentum EMA in place and per-block sums of u^2, then the input scale
//      1 / (||u||_F * 1.02 + 1e-6) per matrix;
//   2. u again from grad and the new momentum, X = bf16(u * scale) into the
//      [chunk, rows, cols] workspace (recomputing u keeps the workspace at
//      BF16 size for the same memory traffic);
//   3. polar_express_bf16 on the workspace;
//   4. NorMuon: sums of X^2 per row or column, second moments, multipliers;
//   5. NorMuon scaling, cautious weight decay and the update on the FP32
//      master, written back to the param and its master or remainder.
// Reductions have a fixed shape and order (no atomics): two runs give the same
// bits.  A set found_inf makes every kernel return at once; the GEMMs then
// work on stale scratch that nothing reads back.
#include "muon_cuda.h"

#include <ATen/cuda/CUDAContext.h>
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <limits>

#include "../common/muon_math.h"
#include "muon_pointers.cuh"
#include "polar_express_cuda.h"

namespace muon_ext {
namespace cuda {
namespace {

// Elements per block of the elementwise passes: 8 iterations of kBlockSize x
// kILP.  Small enough that a chunk of small matrices still fills the GPU.
constexpr int64_t kElementsPerBlock = int64_t(kBlockSize) * kILP * 8;
constexpr int64_t kElementStride = int64_t(kBlockSize) * kILP;
// Threads of the per-matrix reductions (input scale, NorMuon statistics).
constexpr int kReduceThreads = 256;
// NorMuon sums: blocks of kWarpSize x kSumRows threads.
constexpr int kWarpSize = 32;
constexpr int kSumRows = 16;

template <typename T>
__device__ __forceinline__ T warp_sum(T value) {
#pragma unroll
  for (int offset = kWarpSize / 2; offset > 0; offset /= 2) value += __shfl_down_sync(0xffffffffu, value, offset);
  return value;  // valid in lane 0
}

// Sum over a 1-D block (a multiple of 32 threads) in a fixed order: a shuffle
// tree per warp, then one over the warp sums.  The total lands in thread 0.
template <typename T>
__device__ T block_sum(T value) {
  __shared__ T warp_sums[kWarpSize];
  const int lane = threadIdx.x % kWarpSize, warp = threadIdx.x / kWarpSize;
  value = warp_sum(value);
  if (lane == 0) warp_sums[warp] = value;
  __syncthreads();
  value = T(0);
  if (warp == 0) value = warp_sum(lane < int(blockDim.x / kWarpSize) ? warp_sums[lane] : T(0));
  __syncthreads();  // warp_sums is free for the next call
  return value;
}

__device__ __forceinline__ bool skip_step(const float* found_inf) {
  return found_inf != nullptr && *found_inf != 0.0f;
}

// ---------------------------------------------------------------- passes 1, 2

enum class MomentumPass { kNormSquares, kWorkspace };

struct MomentumArgs {
  float mu;
  bool nesterov;
  const float* inv_scale;  // null: 1
  const float* found_inf;  // null: never set
  int64_t matrix_numel;
  double* partials;    // [chunk, blocks per matrix]: written by kNormSquares
  const float* scale;  // [chunk]: read by kWorkspace
  uint16_t* x;         // [chunk, rows, cols] BF16: written by kWorkspace
};
static_assert(sizeof(MatrixList<2>) + sizeof(MomentumArgs) <= kKernelArgBytes, "kernel arguments exceed 4 KiB");

// Block (b, m) covers elements [b, b + 1) * kElementsPerBlock of matrix m of
// `list` (operands grad, momentum); thread t owns elements t * kILP + [0, kILP)
// of every kElementStride-long stretch, in that order.
template <typename G, MomentumPass kPass>
__global__ void __launch_bounds__(kBlockSize) momentum_kernel(const MatrixList<2> list, const MomentumArgs args) {
  if (skip_step(args.found_inf)) return;
  using grad_t = typename G::storage;
  constexpr bool kFirstPass = kPass == MomentumPass::kNormSquares;
  const grad_t* grad = static_cast<const grad_t*>(list.addresses[0][blockIdx.y]);
  float* momentum = static_cast<float*>(list.addresses[1][blockIdx.y]);
  const int64_t matrix = list.first + blockIdx.y;
  const bool needs_grad = kFirstPass || args.nesterov;
  const float inv_scale = args.inv_scale != nullptr ? *args.inv_scale : 1.0f;
  const float scale = kFirstPass ? 0.0f : args.scale[matrix];
  const int64_t begin = int64_t(blockIdx.x) * kElementsPerBlock;
  const int64_t end = min(begin + kElementsPerBlock, args.matrix_numel);

  // In double, as the CPU twin: the scale then rounds to the same FP32 bits.
  double sum_squares = 0.0;
  for (int64_t i = begin + int64_t(threadIdx.x) * kILP; i < end; i += kElementStride) {
    const int count = int(min(int64_t(kILP), end - i));
    Pack<grad_t> g_pack{};
    if (needs_grad) g_pack = load_pack(grad, i, count, list.vectorized);
    Pack<float> m_pack = load_pack(momentum, i, count, list.vectorized);
    Pack<uint16_t> x_pack{};
#pragma unroll
    for (int j = 0; j < kILP; ++j) {
      if (j >= count) continue;
      const float g = G::load(g_pack.val[j]) * inv_scale;
      if constexpr (kFirstPass) {
        const float u = muon_momentum(m_pack.val[j], g, args.mu, args.nesterov);
        sum_squares += double(u) * double(u);
      } else {
        // What muon_momentum returned in pass 1, from the momentum it stored.
        const float u = args.nesterov ? lerp(g, m_pack.val[j], args.mu) : m_pack.val[j];
        x_pack.val[j] = float_to_bf16_bits_rne(u * scale);
      }
    }
    if constexpr (kFirstPass) {
      store_pack(momentum, i, count, list.vectorized, m_pack);
    } else {
      store_pack(args.x + matrix * args.matrix_numel, i, count, list.vectorized, x_pack);
    }
  }
  if constexpr (kFirstPass) {
    const double total = block_sum(sum_squares);
    if (threadIdx.x == 0) args.partials[matrix * gridDim.x + blockIdx.x] = total;
  }
}

// One block per matrix of the chunk: its partial sums, in order, to the scale.
__global__ void __launch_bounds__(kReduceThreads)
    input_scale_kernel(const double* partials, int64_t blocks_per_matrix, float* scale, const float* found_inf) {
  if (skip_step(found_inf)) return;
  const double* matrix_partials = partials + int64_t(blockIdx.x) * blocks_per_matrix;
  double sum = 0.0;
  for (int64_t b = threadIdx.x; b < blocks_per_matrix; b += blockDim.x) sum += matrix_partials[b];
  sum = block_sum(sum);
  if (threadIdx.x == 0) scale[blockIdx.x] = polar_input_scale(static_cast<float>(sum));
}

// -------------------------------------------------------------------- NorMuon

// Sums of X^2 per row (rows >= cols): one warp per row, lanes striding the
// contiguous columns.  Block (kWarpSize, kSumRows); blockIdx.x = matrix *
// groups + group of kSumRows rows.
__global__ void __launch_bounds__(kWarpSize * kSumRows)
    normuon_row_sums_kernel(const uint16_t* x, int64_t rows, int64_t cols, int64_t groups, float* sums,
                            const float* found_inf) {
  if (skip_step(found_inf)) return;
  const int64_t matrix = blockIdx.x / groups;
  const int64_t row = (blockIdx.x % groups) * kSumRows + threadIdx.y;
  if (row >= rows) return;  // the whole warp: only warp-level sync below
  const uint16_t* values = x + (matrix * rows + row) * cols;
  double sum = 0.0;  // in double, rounded to float once, as on the CPU
  for (int64_t c = threadIdx.x; c < cols; c += kWarpSize) {
    const double v = bf16_bits_to_float(values[c]);
    sum += v * v;
  }
  sum = warp_sum(sum);
  if (threadIdx.x == 0) sums[matrix * rows + row] = static_cast<float>(sum);
}

// Sums of X^2 per column (rows < cols): thread (c, y) adds rows y, y +
// kSumRows, ... of column c (coalesced across c), then the kSumRows partials
// of each column are added in order.  blockIdx.x = matrix * groups + group of
// kWarpSize columns.
__global__ void __launch_bounds__(kWarpSize * kSumRows)
    normuon_col_sums_kernel(const uint16_t* x, int64_t rows, int64_t cols, int64_t groups, float* sums,
                            const float* found_inf) {
  if (skip_step(found_inf)) return;
  __shared__ double partials[kSumRows][kWarpSize];
  const int64_t matrix = blockIdx.x / groups;
  const int64_t col = (blockIdx.x % groups) * kWarpSize + threadIdx.x;
  double sum = 0.0;  // in double, rounded to float once, as on the CPU
  if (col < cols) {
    for (int64_t r = threadIdx.y; r < rows; r += kSumRows) {
      const double v = bf16_bits_to_float(x[(matrix * rows + r) * cols + col]);
      sum += v * v;
    }
  }
  partials[threadIdx.y][threadIdx.x] = sum;
  __syncthreads();
  if (threadIdx.y != 0 || col >= cols) return;
  double total = 0.0;
  for (int y = 0; y < kSumRows; ++y) total += partials[y][threadIdx.x];
  sums[matrix * cols + col] = static_cast<float>(total);
}

struct NorMuonArgs {
  float one_minus_beta2;
  int64_t stat_length;
  int64_t reduced_length;
  float* stats;  // [chunk, stat_length]: sums of X^2 in, multipliers out
  const float* found_inf;
};
static_assert(sizeof(MatrixList<1>) + sizeof(NorMuonArgs) <= kKernelArgBytes, "kernel arguments exceed 4 KiB");

// One block per matrix of `list` (operand: its second-moment buffer):
//   vm = sum / red; smb = lerp(smb, vm, 1 - beta2); s = rsqrt(max(smb, 1e-10))
//   multiplier = s * n0 / max(n1, 1e-10)
__global__ void __launch_bounds__(kReduceThreads) normuon_kernel(const MatrixList<1> list, const NorMuonArgs args) {
  if (skip_step(args.found_inf)) return;
  float* second_moment = static_cast<float*>(list.addresses[0][blockIdx.x]);
  float* stats = args.stats + (list.first + blockIdx.x) * args.stat_length;
  const float reduced = float(args.reduced_length);
  float sum_vm = 0.0f, sum_scaled = 0.0f;
  for (int64_t i = threadIdx.x; i < args.stat_length; i += blockDim.x) {
    const float vm = normuon_mean_square(stats[i], args.reduced_length);
    const float smb = lerp(second_moment[i], vm, args.one_minus_beta2);
    second_moment[i] = smb;
    const float s = normuon_step_size(smb);
    stats[i] = s;
    sum_vm += vm;
    sum_scaled += ((vm * reduced) * s) * s;
  }
  sum_vm = block_sum(sum_vm);
  sum_scaled = block_sum(sum_scaled);
  __shared__ float ratio;
  if (threadIdx.x == 0) ratio = normuon_norm_ratio(sum_vm, sum_scaled, args.reduced_length);
  __syncthreads();
  // Each thread rescales the step sizes it wrote above.
  for (int64_t i = threadIdx.x; i < args.stat_length; i += blockDim.x) stats[i] = stats[i] * ratio;
}

// ---------------------------------------------------------------------- apply

struct ApplyArgs {
  float lr;              // used when lr_ptr is null
  const float* lr_ptr;   // device learning rate, or null
  float lr_factor;       // lr' = lr * lr_factor
  float weight_decay;
  const float* found_inf;
  const uint16_t* x;     // [chunk, rows, cols] BF16: the orthogonalized update
  const float* mult;     // [chunk, stat_length]: NorMuon multipliers
  int64_t rows, cols;
};

template <MasterKind M>
constexpr int kApplyDepth = M == MasterKind::kNone ? 1 : 2;  // param[, master]
static_assert(sizeof(MatrixList<2>) + sizeof(ApplyArgs) <= kKernelArgBytes, "kernel arguments exceed 4 KiB");

// Blocks as in momentum_kernel; operands param and, with a master, master.
template <typename P, MasterKind M, bool kNorMuon>
__global__ void __launch_bounds__(kBlockSize)
    apply_kernel(const MatrixList<kApplyDepth<M>> list, const ApplyArgs args) {
  if (skip_step(args.found_inf)) return;
  using param_t = typename P::storage;
  using master_t = master_storage_t<M>;
  param_t* param = static_cast<param_t*>(list.addresses[0][blockIdx.y]);
  master_t* master = nullptr;
  if constexpr (M != MasterKind::kNone) master = static_cast<master_t*>(list.addresses[1][blockIdx.y]);
  const int64_t matrix = list.first + blockIdx.y;
  const int64_t matrix_numel = args.rows * args.cols;
  const uint16_t* x = args.x + matrix * matrix_numel;
  const bool per_row = args.rows >= args.cols;
  const float* mult = kNorMuon ? args.mult + matrix * (per_row ? args.rows : args.cols) : nullptr;
  const float lr = (args.lr_ptr != nullptr ? *args.lr_ptr : args.lr) * args.lr_factor;
  const float lr_wd = lr * args.weight_decay;
  const int64_t begin = int64_t(blockIdx.x) * kElementsPerBlock;
  const int64_t end = min(begin + kElementsPerBlock, matrix_numel);

  const int64_t first = begin + int64_t(threadIdx.x) * kILP;
  MatrixCursor cursor{first / args.cols, first % args.cols};  // at element i + j below
  const int64_t skip = kElementStride - kILP;  // from the end of one pack to the next
  const int64_t skip_rows = skip / args.cols, skip_cols = skip % args.cols;
  for (int64_t i = first; i < end; i += kElementStride) {
    const int count = int(min(int64_t(kILP), end - i));
    Pack<param_t> p_pack = load_pack(param, i, count, list.vectorized);
    Pack<master_t> m_pack{};
    if constexpr (M != MasterKind::kNone) m_pack = load_pack(master, i, count, list.vectorized);
    const Pack<uint16_t> x_pack = load_pack(x, i, count, list.vectorized);
#pragma unroll
    for (int j = 0; j < kILP; ++j) {
      if (j >= count) continue;
      float update = bf16_bits_to_float(x_pack.val[j]);
      if constexpr (kNorMuon) update = update * mult[per_row ? cursor.row : cursor.col];
      const float p = muon_apply(load_master<P, M>(p_pack.val[j], m_pack.val[j]), update, lr, lr_wd);
      store_master<P, M>(p, p_pack.val[j], m_pack.val[j]);
      cursor.advance(0, 1, args.cols);
    }
    cursor.advance(skip_rows, skip_cols, args.cols);
    store_pack(param, i, count, list.vectorized, p_pack);
    if constexpr (M != MasterKind::kNone) store_pack(master, i, count, list.vectorized, m_pack);
  }
}

// ----------------------------------------------------------------------- host

unsigned grid_size(int64_t blocks) {
  TORCH_CHECK(blocks <= std::numeric_limits<int32_t>::max(), "muon_step: too many blocks for one launch");
  return static_cast<unsigned>(blocks);
}

template <typename G, typename P, MasterKind M>
void run_muon_step(const MuonBucket& bucket, const MuonStepOptions& options) {
  const int64_t rows = bucket.rows, cols = bucket.cols, numel = bucket.matrix_numel();
  const std::vector<MatrixRef> matrices = list_matrices(bucket.params, numel);
  const int64_t total = int64_t(matrices.size());
  if (total == 0) return;
  const MuonHyper& hyper = options.hyper;
  const int64_t stat_length = bucket.stat_length();
  const int64_t blocks_per_matrix = ceil_div(numel, kElementsPerBlock);

  // All scratch of one matrix: X, the Polar-Express buffers, the partial sums
  // (FP64) and scale, and the NorMuon statistics.
  const int64_t fp32_scratch = 1 + (hyper.normuon ? stat_length : 0);
  const bool orthogonalize = !options.coefficients.empty();
  const int64_t per_matrix_workspace_bytes = numel * int64_t(sizeof(uint16_t)) +
                                             (orthogonalize ? polar_express_workspace_bytes(rows, cols) : 0) +
                                             blocks_per_matrix * int64_t(sizeof(double)) +
                                             fp32_scratch * int64_t(sizeof(float));
  const int64_t capacity =
      std::min(total, std::max<int64_t>(1, options.max_workspace_bytes / per_matrix_workspace_bytes));

  // Grid sizes are checked before anything is allocated or enqueued.
  const unsigned element_blocks = grid_size(blocks_per_matrix);
  const int64_t sum_groups = rows >= cols ? ceil_div(rows, kSumRows) : ceil_div(cols, kWarpSize);
  grid_size(capacity * sum_groups);  // the largest NorMuon sums grid

  const at::TensorOptions f32 = bucket.params.front().options().dtype(at::kFloat);
  const at::Tensor x = at::empty({capacity, rows, cols}, f32.dtype(at::kBFloat16));
  const PolarExpressWorkspace polar =
      make_polar_express_workspace(orthogonalize ? capacity : 0, rows, cols, f32);
  const at::Tensor partials = at::empty({capacity, blocks_per_matrix}, f32.dtype(at::kDouble));
  const at::Tensor scale = at::empty({capacity}, f32);
  const at::Tensor stats = hyper.normuon ? at::empty({capacity, stat_length}, f32) : at::Tensor();

  const float* found_inf = options.found_inf.has_value() ? options.found_inf->const_data_ptr<float>() : nullptr;
  const MomentumArgs momentum{
      .mu = hyper.momentum, .nesterov = hyper.nesterov,
      .inv_scale = options.inv_scale.has_value() ? options.inv_scale->const_data_ptr<float>() : nullptr,
      .found_inf = found_inf, .matrix_numel = numel, .partials = partials.mutable_data_ptr<double>(),
      .scale = scale.const_data_ptr<float>(), .x = static_cast<uint16_t*>(x.data_ptr())};
  const ApplyArgs apply{
      .lr = static_cast<float>(options.lr),
      .lr_ptr = options.lr_tensor.has_value() ? options.lr_tensor->const_data_ptr<float>() : nullptr,
      .lr_factor = options.lr_factor, .weight_decay = hyper.weight_decay, .found_inf = found_inf,
      .x = static_cast<const uint16_t*>(x.const_data_ptr()),
      .mult = hyper.normuon ? stats.const_data_ptr<float>() : nullptr, .rows = rows, .cols = cols};
  std::array<const std::vector<at::Tensor>*, kApplyDepth<M>> apply_operands{&bucket.params};
  if constexpr (M != MasterKind::kNone) apply_operands[1] = &bucket.masters;


  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  for (int64_t begin = 0; begin < total; begin += capacity) {
    const int64_t end = std::min(total, begin + capacity), count = end - begin;
    auto momentum_pass = [&](auto pass) {
      for_each_matrix_group<2>(matrices, begin, end, {&bucket.grads, &bucket.momentum_buffers}, numel,
                               [&](const MatrixList<2>& list, int n) {
                                 momentum_kernel<G, decltype(pass)::value>
                                     <<<dim3(element_blocks, n), kBlockSize, 0, stream>>>(list, momentum);
                                 C10_CUDA_KERNEL_LAUNCH_CHECK();
                               });
    };
    momentum_pass(std::integral_constant<MomentumPass, MomentumPass::kNormSquares>{});
    input_scale_kernel<<<unsigned(count), kReduceThreads, 0, stream>>>(
        partials.const_data_ptr<double>(), blocks_per_matrix, scale.mutable_data_ptr<float>(), found_inf);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    momentum_pass(std::integral_constant<MomentumPass, MomentumPass::kWorkspace>{});

    if (orthogonalize) polar_express_bf16(x.narrow(0, 0, count), options.coefficients, polar, options.polar_row_blocks);

    if (hyper.normuon) {
      const auto* x_bits = static_cast<const uint16_t*>(x.const_data_ptr());
      const dim3 sum_grid(unsigned(count * sum_groups)), sum_block(kWarpSize, kSumRows);
      if (rows >= cols) {
        normuon_row_sums_kernel<<<sum_grid, sum_block, 0, stream>>>(x_bits, rows, cols, sum_groups,
                                                                     stats.mutable_data_ptr<float>(), found_inf);
      } else {
        normuon_col_sums_kernel<<<sum_grid, sum_block, 0, stream>>>(x_bits, rows, cols, sum_groups,
                                                                     stats.mutable_data_ptr<float>(), found_inf);
      }
      C10_CUDA_KERNEL_LAUNCH_CHECK();
      const NorMuonArgs normuon{.one_minus_beta2 = 1.0f - hyper.beta2, .stat_length = stat_length,
                                .reduced_length = bucket.reduced_length(),
                                .stats = stats.mutable_data_ptr<float>(), .found_inf = found_inf};
      for_each_matrix_group<1>(matrices, begin, end, {&bucket.second_momentum_buffers}, stat_length,
                               [&](const MatrixList<1>& list, int n) {
                                 normuon_kernel<<<n, kReduceThreads, 0, stream>>>(list, normuon);
                                 C10_CUDA_KERNEL_LAUNCH_CHECK();
                               });
    }

    for_each_matrix_group<kApplyDepth<M>>(matrices, begin, end, apply_operands, numel, [&](const auto& list, int n) {
      const dim3 grid(element_blocks, n);
      if (hyper.normuon) {
        apply_kernel<P, M, true><<<grid, kBlockSize, 0, stream>>>(list, apply);
      } else {
        apply_kernel<P, M, false><<<grid, kBlockSize, 0, stream>>>(list, apply);
      }
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    });
  }
}

}  // namespace

void muon_step(const MuonBucket& bucket, const MuonStepOptions& options) {
  if (bucket.params.empty()) return;
  const size_t count = bucket.params.size();
  TORCH_CHECK(bucket.grads.size() == count && bucket.momentum_buffers.size() == count &&
                  (!options.hyper.normuon || bucket.second_momentum_buffers.size() == count) &&
                  (bucket.master_kind == MasterKind::kNone || bucket.masters.size() == count),
              "muon_step: every tensor list needs one entry per param");
  const c10::cuda::CUDAGuard device_guard(bucket.params.front().device());
  // Unsupported combinations fail here, before anything is enqueued.
  dispatch_storage(bucket.grads.front().scalar_type(), "grad", [&](auto grad_format) {
    dispatch_param(bucket.params.front().scalar_type(), bucket.master_kind, [&](auto param_format, auto master) {
      run_muon_step<decltype(grad_format), decltype(param_format), decltype(master)::value>(bucket, options);
    });
  });
}

}  // namespace cuda
}  // namespace muon_ext

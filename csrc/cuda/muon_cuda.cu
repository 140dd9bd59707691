// CUDA Muon: the fused step on one bucket of same-shape matrices, and the same
// step cut into three phases (csrc/muon_args.h; docs/design.md, "Muon in three
// phases") whose composition must give the fused step's bits.
//
// The GPU twin of cpu/muon_cpu.cpp: the math of common/muon_math.h compiled
// with --fmad=false; only the Polar-Express GEMMs differ (BF16 operands).  Per
// chunk of matrices, on the current stream, without a host synchronization:
//   1. per-block sums of u^2, then the input scale 1 / (||u||_F * 1.02 + 1e-6)
//      per matrix;
//   2. u again, X = u * scale into the [chunk, rows, cols] workspace, rounded
//      to BF16 / FP16 (polar_dtype "bfloat16" / "float16") or kept FP32; reading u
//      twice keeps the workspace at X's size for the same memory traffic;
//   3. polar_express on the workspace (its dtype: BF16, FP16 or FP32 GEMMs);
//   4. NorMuon: sums of X^2 per row or column, second moments, multipliers;
//   5. the update X * multiplier: through cautious weight decay into the param
//      and its master (fused step), or into the FP32 updates (phase 2).
// The fused step takes u from the momentum (its pass 1 steps the EMA, pass 2
// recomputes u from the stored momentum); phase 2 reads the u that phase 1
// stored.  Everything else (chunks, scratch, kernels, grids) is one code path,
// MatrixChunks, and the per-element code is shared with the elementwise phases
// 1 and 3: the phases cannot drift from the fused bits.
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
#include <array>
#include <limits>
#include <vector>

#include "../common/muon_math.h"
#include "../common/shapes.h"
#include "multi_tensor_apply.cuh"
#include "muon_pointers.cuh"
#include "polar_express_cuda.h"
#include "settings.h"

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

// Calls fn(i, count) for the packs of [begin, end) that this thread owns:
// elements i + [0, count), i = begin + threadIdx.x * kILP + k * kElementStride,
// k ascending.  Every elementwise pass walks its elements this way, so a
// thread's sum of squares has the same order whatever u is read from.
// Assumes blockDim.x == kBlockSize.
template <typename Fn>
__device__ __forceinline__ void for_each_pack(int64_t begin, int64_t end, Fn&& fn) {
  for (int64_t i = begin + int64_t(threadIdx.x) * kILP; i < end; i += kElementStride) {
    fn(i, int(min(int64_t(kILP), end - i)));
  }
}

// The operand addresses of matrix blockIdx.y of a MatrixList, in the layout
// of ChunkTask::addresses, so sources and sinks take either.
template <int DEPTH>
struct Addresses {
  void* at[DEPTH];
};

template <int DEPTH>
__device__ __forceinline__ Addresses<DEPTH> matrix_addresses(const MatrixList<DEPTH>& list) {
  Addresses<DEPTH> a;
#pragma unroll
  for (int d = 0; d < DEPTH; ++d) a.at[d] = list.addresses[d][blockIdx.y];
  return a;
}

// ----------------------------------------------------------------- sources of u
//
// A source yields u (or an update) for the pack at element i of its operands:
// `Pack<float> operator()(int64_t i, int count)`, entries >= count unspecified.

struct MomentumArgs {
  float mu;
  bool nesterov;
  const float* inv_scale;  // null: 1
};

// One momentum step: the EMA stored back, u returned (fused pass 1, phase 1).
template <typename G>
struct SteppedMomentum {
  static constexpr int kDepth = 2;  // grad, momentum
  using grad_t = typename G::storage;
  const grad_t* grad;
  float* momentum;
  bool vectorized;
  float mu;
  bool nesterov;
  float inv_scale;

  __device__ __forceinline__ static SteppedMomentum make(void* const* address, bool vectorized,
                                                         const MomentumArgs& args) {
    return {static_cast<const grad_t*>(address[0]), static_cast<float*>(address[1]), vectorized, args.mu,
            args.nesterov, args.inv_scale != nullptr ? *args.inv_scale : 1.0f};
  }

  __device__ __forceinline__ Pack<float> operator()(int64_t i, int count) const {
    const Pack<grad_t> g_pack = load_pack(grad, i, count, vectorized);
    Pack<float> m_pack = load_pack(momentum, i, count, vectorized);
    Pack<float> u{};
#pragma unroll
    for (int j = 0; j < kILP; ++j) {
      if (j >= count) continue;
      // Qualified: cuda::muon_momentum (the phase) hides the element function.
      u.val[j] = muon_ext::muon_momentum(m_pack.val[j], G::load(g_pack.val[j]) * inv_scale, mu, nesterov);
    }
    store_pack(momentum, i, count, vectorized, m_pack);
    return u;
  }
};

// What SteppedMomentum returned, from the momentum it stored (fused pass 2).
template <typename G>
struct StoredMomentum {
  static constexpr int kDepth = 2;  // grad, momentum
  using grad_t = typename G::storage;
  const grad_t* grad;
  const float* momentum;
  bool vectorized;
  float mu;
  bool nesterov;
  float inv_scale;

  __device__ __forceinline__ static StoredMomentum make(void* const* address, bool vectorized,
                                                        const MomentumArgs& args) {
    return {static_cast<const grad_t*>(address[0]), static_cast<const float*>(address[1]), vectorized, args.mu,
            args.nesterov, args.inv_scale != nullptr ? *args.inv_scale : 1.0f};
  }

  __device__ __forceinline__ Pack<float> operator()(int64_t i, int count) const {
    Pack<grad_t> g_pack{};
    if (nesterov) g_pack = load_pack(grad, i, count, vectorized);
    const Pack<float> m_pack = load_pack(momentum, i, count, vectorized);
    Pack<float> u{};
#pragma unroll
    for (int j = 0; j < kILP; ++j) {
      if (j >= count) continue;
      const float g = G::load(g_pack.val[j]) * inv_scale;
      u.val[j] = nesterov ? lerp(g, m_pack.val[j], mu) : m_pack.val[j];
    }
    return u;
  }
};

// An FP32 updates tensor: u for phase 2, the final update for phase 3.
struct BufferedUpdates {
  static constexpr int kDepth = 1;
  const float* update;
  bool vectorized;

  __device__ __forceinline__ static BufferedUpdates make(void* const* address, bool vectorized,
                                                         const MomentumArgs& = {}) {
    return {static_cast<const float*>(address[0]), vectorized};
  }

  __device__ __forceinline__ Pack<float> operator()(int64_t i, int count) const {
    return load_pack(update, i, count, vectorized);
  }
};

// ------------------------------------------------------------- passes 1 and 2

enum class MomentumPass { kNormSquares, kWorkspace };

struct WorkspaceArgs {
  const float* found_inf;  // null: never set
  int64_t matrix_numel;
  double* partials;    // [chunk, blocks per matrix]: written by kNormSquares
  const float* scale;  // [chunk]: read by kWorkspace
  void* x;             // [chunk, rows, cols] in the workspace format: written by kWorkspace
};
static_assert(sizeof(MatrixList<2>) + sizeof(MomentumArgs) + sizeof(WorkspaceArgs) <= kKernelArgBytes,
              "kernel arguments exceed CUDA's parameter limit");

// Block (b, m) covers elements [b, b + 1) * kElementsPerBlock of matrix m of
// `list` (Source's operands), in for_each_pack's order.
// W: the workspace format (BFloat16 or Float32, storage.cuh).
template <typename Source, MomentumPass kPass, typename W>
__global__ void __launch_bounds__(kBlockSize)
    momentum_kernel(const MatrixList<Source::kDepth> list, const MomentumArgs momentum, const WorkspaceArgs args) {
  if (skip_step(args.found_inf)) return;
  const Source source = Source::make(matrix_addresses(list).at, list.vectorized, momentum);
  const int64_t matrix = list.first + blockIdx.y;
  const int64_t begin = int64_t(blockIdx.x) * kElementsPerBlock;
  const int64_t end = min(begin + kElementsPerBlock, args.matrix_numel);

  if constexpr (kPass == MomentumPass::kNormSquares) {
    // In double, as the CPU twin: the scale then rounds to the same FP32 bits.
    double sum_squares = 0.0;
    for_each_pack(begin, end, [&](int64_t i, int count) {
      const Pack<float> u = source(i, count);
#pragma unroll
      for (int j = 0; j < kILP; ++j) {
        if (j < count) sum_squares += double(u.val[j]) * double(u.val[j]);
      }
    });
    const double total = block_sum(sum_squares);
    if (threadIdx.x == 0) args.partials[matrix * gridDim.x + blockIdx.x] = total;
  } else {
    const float scale = args.scale[matrix];
    using X = typename W::storage;
    X* x = static_cast<X*>(args.x) + matrix * args.matrix_numel;
    for_each_pack(begin, end, [&](int64_t i, int count) {
      const Pack<float> u = source(i, count);
      Pack<X> x_pack{};
#pragma unroll
      for (int j = 0; j < kILP; ++j) {
        if (j < count) x_pack.val[j] = W::store_rne(u.val[j] * scale);
      }
      store_pack(x, i, count, list.vectorized, x_pack);
    });
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
template <typename W>
__global__ void __launch_bounds__(kWarpSize * kSumRows)
    normuon_row_sums_kernel(const typename W::storage* x, int64_t rows, int64_t cols, int64_t groups, float* sums,
                            const float* found_inf) {
  if (skip_step(found_inf)) return;
  const int64_t matrix = blockIdx.x / groups;
  const int64_t row = (blockIdx.x % groups) * kSumRows + threadIdx.y;
  if (row >= rows) return;  // the whole warp: only warp-level sync below
  const typename W::storage* values = x + (matrix * rows + row) * cols;
  double sum = 0.0;  // in double, rounded to float once, as on the CPU
  for (int64_t c = threadIdx.x; c < cols; c += kWarpSize) {
    const double v = W::load(values[c]);
    sum += v * v;
  }
  sum = warp_sum(sum);
  if (threadIdx.x == 0) sums[matrix * rows + row] = static_cast<float>(sum);
}

// Sums of X^2 per column (rows < cols): thread (c, y) adds rows y, y +
// kSumRows, ... of column c (coalesced across c), then the kSumRows partials
// of each column are added in order.  blockIdx.x = matrix * groups + group of
// kWarpSize columns.
template <typename W>
__global__ void __launch_bounds__(kWarpSize * kSumRows)
    normuon_col_sums_kernel(const typename W::storage* x, int64_t rows, int64_t cols, int64_t groups, float* sums,
                            const float* found_inf) {
  if (skip_step(found_inf)) return;
  __shared__ double partials[kSumRows][kWarpSize];
  const int64_t matrix = blockIdx.x / groups;
  const int64_t col = (blockIdx.x % groups) * kWarpSize + threadIdx.x;
  double sum = 0.0;  // in double, rounded to float once, as on the CPU
  if (col < cols) {
    for (int64_t r = threadIdx.y; r < rows; r += kSumRows) {
      const double v = W::load(x[(matrix * rows + r) * cols + col]);
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
static_assert(sizeof(MatrixList<1>) + sizeof(NorMuonArgs) <= kKernelArgBytes,
              "kernel arguments exceed CUDA's parameter limit");

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

// ---------------------------------------------------------------------- sinks
//
// A sink consumes the update of the pack at element i of its operands:
// `void operator()(int64_t i, int count, const Pack<float>& update)`.

struct LrArgs {
  float lr;             // used when lr_ptr is null
  const float* lr_ptr;  // device learning rate, or null
  float lr_factor;      // lr' = lr * lr_factor
  float weight_decay;
};

// Cautious weight decay and the update on the FP32 master, written back to
// the param and its master or remainder (fused step, phase 3).
template <typename P, MasterMode M>
struct ParamSink {
  static constexpr int kDepth = M == MasterMode::kNone ? 1 : 2;  // param[, master]
  using param_t = typename P::storage;
  using master_t = master_storage_t<M>;
  param_t* param;
  master_t* master;
  bool vectorized;
  float lr, lr_wd;

  __device__ __forceinline__ static ParamSink make(void* const* address, bool vectorized, const LrArgs& args) {
    const float lr = (args.lr_ptr != nullptr ? *args.lr_ptr : args.lr) * args.lr_factor;
    master_t* master = nullptr;
    if constexpr (M != MasterMode::kNone) master = static_cast<master_t*>(address[1]);
    return {static_cast<param_t*>(address[0]), master, vectorized, lr, lr * args.weight_decay};
  }

  __device__ __forceinline__ void operator()(int64_t i, int count, const Pack<float>& update) const {
    Pack<param_t> p_pack = load_pack(param, i, count, vectorized);
    Pack<master_t> m_pack{};
    if constexpr (M != MasterMode::kNone) m_pack = load_pack(master, i, count, vectorized);
#pragma unroll
    for (int j = 0; j < kILP; ++j) {
      if (j >= count) continue;
      // Qualified: cuda::muon_apply (the phase) hides the element function.
      const float p = muon_ext::muon_apply(load_master<P, M>(p_pack.val[j], m_pack.val[j]), update.val[j], lr, lr_wd);
      store_master<P, M>(p, p_pack.val[j], m_pack.val[j]);
    }
    store_pack(param, i, count, vectorized, p_pack);
    if constexpr (M != MasterMode::kNone) store_pack(master, i, count, vectorized, m_pack);
  }
};

// The FP32 updates tensor (phase 2's output, phase 3's input).
struct UpdateSink {
  static constexpr int kDepth = 1;
  float* update;
  bool vectorized;

  __device__ __forceinline__ static UpdateSink make(void* const* address, bool vectorized, const LrArgs&) {
    return {static_cast<float*>(address[0]), vectorized};
  }

  __device__ __forceinline__ void operator()(int64_t i, int count, const Pack<float>& value) const {
    store_pack(update, i, count, vectorized, value);
  }
};

// ------------------------------------------------------------------- step 5

// The update of one matrix: X, times NorMuon's multiplier of the element's
// row (rows >= cols) or column; without NorMuon, X itself.  The cursor keeps
// the row and column without a division per element, so packs must come in
// for_each_pack's order.
template <bool kNorMuon, typename W>
struct WorkspaceUpdates {
  const typename W::storage* x;
  const float* mult;
  bool per_row;
  int64_t cols;
  bool vectorized;
  MatrixCursor cursor;         // at element i + j below
  int64_t skip_rows, skip_cols;  // from the end of one pack to the next

  __device__ __forceinline__ Pack<float> operator()(int64_t i, int count) {
    const Pack<typename W::storage> x_pack = load_pack(x, i, count, vectorized);
    Pack<float> update{};
#pragma unroll
    for (int j = 0; j < kILP; ++j) {
      if (j >= count) continue;
      update.val[j] = W::load(x_pack.val[j]);
      if constexpr (kNorMuon) {
        update.val[j] = update.val[j] * mult[per_row ? cursor.row : cursor.col];
        cursor.advance(0, 1, cols);
      }
    }
    if constexpr (kNorMuon) cursor.advance(skip_rows, skip_cols, cols);
    return update;
  }
};

struct ApplyArgs {
  LrArgs lr;  // read by ParamSink only
  const float* found_inf;
  const void* x;      // [chunk, rows, cols] in the workspace format: the orthogonalized update
  const float* mult;  // [chunk, stat_length]: NorMuon multipliers
  int64_t rows, cols;
};
static_assert(sizeof(MatrixList<2>) + sizeof(ApplyArgs) <= kKernelArgBytes,
              "kernel arguments exceed CUDA's parameter limit");

// Blocks as in momentum_kernel; operands: Sink's.
template <typename Sink, bool kNorMuon, typename W>
__global__ void __launch_bounds__(kBlockSize) apply_kernel(const MatrixList<Sink::kDepth> list, const ApplyArgs args) {
  if (skip_step(args.found_inf)) return;
  const Sink sink = Sink::make(matrix_addresses(list).at, list.vectorized, args.lr);
  const int64_t matrix = list.first + blockIdx.y;
  const int64_t matrix_numel = args.rows * args.cols;
  const bool per_row = args.rows >= args.cols;
  const int64_t begin = int64_t(blockIdx.x) * kElementsPerBlock;
  const int64_t end = min(begin + kElementsPerBlock, matrix_numel);
  const int64_t first = begin + int64_t(threadIdx.x) * kILP;
  const int64_t skip = kElementStride - kILP;
  WorkspaceUpdates<kNorMuon, W> updates{static_cast<const typename W::storage*>(args.x) + matrix * matrix_numel,
                                     kNorMuon ? args.mult + matrix * (per_row ? args.rows : args.cols) : nullptr,
                                     per_row,
                                     args.cols,
                                     list.vectorized,
                                     MatrixCursor{first / args.cols, first % args.cols},
                                     skip / args.cols,
                                     skip % args.cols};
  for_each_pack(begin, end, [&](int64_t i, int count) { sink(i, count, updates(i, count)); });
}

// ------------------------------------------------- phases 1 and 3 (any shape)

// Phase 1, through multi_tensor_apply; operands grad, momentum, update.
template <typename G>
struct MomentumFunctor {
  MomentumArgs args;
  const float* found_inf;

  __device__ __forceinline__ void operator()(const ChunkTask<3>& task) const {
    if (skip_step(found_inf)) return;
    const SteppedMomentum<G> source = SteppedMomentum<G>::make(task.addresses, task.vectorized, args);
    float* update = static_cast<float*>(task.addresses[2]);
    for_each_pack(task.begin, task.end, [&](int64_t i, int count) {
      store_pack(update, i, count, task.vectorized, source(i, count));
    });
  }
};

// Phase 3, through multi_tensor_apply; operands param[, master], update.
template <typename P, MasterMode M>
struct ApplyFunctor {
  using Sink = ParamSink<P, M>;
  static constexpr int kDepth = Sink::kDepth + 1;
  LrArgs lr;
  const float* found_inf;

  __device__ __forceinline__ void operator()(const ChunkTask<kDepth>& task) const {
    if (skip_step(found_inf)) return;
    const Sink sink = Sink::make(task.addresses, task.vectorized, lr);
    const BufferedUpdates updates = BufferedUpdates::make(task.addresses + Sink::kDepth, task.vectorized);
    for_each_pack(task.begin, task.end, [&](int64_t i, int count) { sink(i, count, updates(i, count)); });
  }
};

// ----------------------------------------------------------------------- host

unsigned grid_size(int64_t blocks, const char* op) {
  TORCH_CHECK(blocks <= std::numeric_limits<int32_t>::max(), op, ": too many blocks for one launch");
  return static_cast<unsigned>(blocks);
}

template <int DEPTH>
using OperandLists = std::array<const std::vector<at::Tensor>*, DEPTH>;

// What orthogonalizing a bucket's matrices needs, from a fused step or phase 2.
struct OrthogonalizeSpec {
  int64_t rows, cols;
  bool normuon;
  float beta2;
  const std::vector<std::array<float, 3>>* coefficients;
  int64_t max_workspace_bytes;
  int64_t polar_row_blocks;
  PolarDtype polar_dtype;
  PolarMethod polar_method;  // as given: resolved per shape by polar_method_for
  bool polar_fold_copies;    // CudaSettings's, read at the entry point
  const std::vector<at::Tensor>* second_moments;  // per bucket tensor; read when normuon
  const float* found_inf;
  const char* op;  // for error messages
};

// A bucket's matrices cut into chunks whose scratch stays under
// max_workspace_bytes, that scratch, and steps 1-5 of the file comment on one
// chunk.  muon_step and muon_orthogonalize both go through it, so they cut the
// same chunks: cuBLAS may pick another GEMM kernel (other bits) for another
// batch count.
class MatrixChunks {
 public:
  static constexpr int64_t kMaxChunkMatrices = 65535;

  // `tensors`: the bucket tensors whose matrices are processed (params or updates).
  MatrixChunks(const std::vector<at::Tensor>& tensors, const OrthogonalizeSpec& spec)
      : spec_(spec), numel_(spec.rows * spec.cols) {
    TORCH_CHECK(numel_ > 0, spec.op, ": zero-sized matrices");
    matrices_ = list_matrices(tensors, numel_);
    total_ = int64_t(matrices_.size());
    if (total_ == 0) return;
    stat_length_ = shapes::stat_length(spec.rows, spec.cols);
    blocks_per_matrix_ = ceil_div(numel_, kElementsPerBlock);

    // All scratch of one matrix: X, the Polar-Express buffers, the partial sums
    // (FP64) and scale, and the NorMuon statistics.
    const int64_t fp32_scratch = 1 + (spec.normuon ? stat_length_ : 0);
    const bool orthogonalize = !spec.coefficients->empty();
    workspace_dtype_ = spec.polar_dtype;
    const PolarMethod method = polar_method_for(spec.polar_method, spec.rows, spec.cols);
    const at::ScalarType x_dtype = spec.polar_dtype == PolarDtype::kFloat32   ? at::kFloat
                                   : spec.polar_dtype == PolarDtype::kFloat16 ? at::kHalf
                                                                              : at::kBFloat16;
    const int64_t per_matrix_workspace_bytes =
        numel_ * int64_t(c10::elementSize(x_dtype)) +
        (orthogonalize ? polar_express_workspace_bytes(spec.rows, spec.cols, x_dtype, method) : 0) +
        blocks_per_matrix_ * int64_t(sizeof(double)) + fp32_scratch * int64_t(sizeof(float));
    // At most 65535 matrices per chunk: some cuBLAS versions mishandle larger
    // batch counts (torch works around it on sm_7x), and capping here, not in
    // polar_express, keeps the fused step and phase 2 cutting the same chunks.
    capacity_ = std::min({total_, kMaxChunkMatrices,
                          std::max<int64_t>(1, spec.max_workspace_bytes / per_matrix_workspace_bytes)});

    // Grid sizes are checked before anything is allocated or enqueued.
    element_blocks_ = grid_size(blocks_per_matrix_, spec.op);
    sum_groups_ = spec.rows >= spec.cols ? ceil_div(spec.rows, kSumRows) : ceil_div(spec.cols, kWarpSize);
    grid_size(capacity_ * sum_groups_, spec.op);  // the largest NorMuon sums grid

    const at::TensorOptions f32 = tensors.front().options().dtype(at::kFloat);
    x_ = at::empty({capacity_, spec.rows, spec.cols}, f32.dtype(x_dtype));
    polar_ = make_polar_express_workspace(orthogonalize ? capacity_ : 0, spec.rows, spec.cols, f32.dtype(x_dtype),
                                          method, spec.polar_fold_copies);
    partials_ = at::empty({capacity_, blocks_per_matrix_}, f32.dtype(at::kDouble));
    scale_ = at::empty({capacity_}, f32);
    if (spec.normuon) stats_ = at::empty({capacity_, stat_length_}, f32);
  }

  // Calls fn(begin, end) for each chunk [begin, end) of the matrices, in order.
  template <typename Fn>
  void for_each_chunk(Fn&& fn) const {
    for (int64_t begin = 0; begin < total_; begin += capacity_) fn(begin, std::min(total_, begin + capacity_));
  }

  // Steps 1-4 on chunk [begin, end), u from First in pass 1 and from Second
  // in pass 2, both over `operands` (bucket-tensor lists, matrix-strided).
  template <typename First, typename Second>
  void orthogonalize(int64_t begin, int64_t end, const OperandLists<First::kDepth>& operands,
                     const MomentumArgs& momentum) const {
    static_assert(int(First::kDepth) == int(Second::kDepth), "both passes read u through the same operands");
    switch (workspace_dtype_) {
      case PolarDtype::kFloat32: return orthogonalize_in<First, Second, Float32>(begin, end, operands, momentum);
      case PolarDtype::kFloat16: return orthogonalize_in<First, Second, Float16>(begin, end, operands, momentum);
      case PolarDtype::kBFloat16: return orthogonalize_in<First, Second, BFloat16>(begin, end, operands, momentum);
    }
  }

  // Step 5 on chunk [begin, end): each update into Sink's `operands`.
  template <typename Sink>
  void write(int64_t begin, int64_t end, const OperandLists<Sink::kDepth>& operands, const LrArgs& lr) const {
    switch (workspace_dtype_) {
      case PolarDtype::kFloat32: return write_in<Sink, Float32>(begin, end, operands, lr);
      case PolarDtype::kFloat16: return write_in<Sink, Float16>(begin, end, operands, lr);
      case PolarDtype::kBFloat16: return write_in<Sink, BFloat16>(begin, end, operands, lr);
    }
  }

 private:
  // orthogonalize with the workspace in format W.
  template <typename First, typename Second, typename W>
  void orthogonalize_in(int64_t begin, int64_t end, const OperandLists<First::kDepth>& operands,
                        const MomentumArgs& momentum) const {
    constexpr int kDepth = First::kDepth;
    const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
    const int64_t count = end - begin;
    const WorkspaceArgs workspace{.found_inf = spec_.found_inf,
                                  .matrix_numel = numel_,
                                  .partials = partials_.mutable_data_ptr<double>(),
                                  .scale = scale_.const_data_ptr<float>(),
                                  .x = x_.data_ptr()};
    auto momentum_pass = [&](auto kernel) {
      for_each_matrix_group<kDepth>(matrices_, begin, end, operands, numel_,
                                    [&](const MatrixList<kDepth>& list, int n) {
                                      kernel<<<dim3(element_blocks_, n), kBlockSize, 0, stream>>>(list, momentum,
                                                                                                  workspace);
                                      C10_CUDA_KERNEL_LAUNCH_CHECK();
                                    });
    };
    momentum_pass(momentum_kernel<First, MomentumPass::kNormSquares, W>);
    input_scale_kernel<<<unsigned(count), kReduceThreads, 0, stream>>>(
        partials_.const_data_ptr<double>(), blocks_per_matrix_, scale_.mutable_data_ptr<float>(), spec_.found_inf);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    momentum_pass(momentum_kernel<Second, MomentumPass::kWorkspace, W>);

    if (!spec_.coefficients->empty()) {
      polar_express(x_.narrow(0, 0, count), *spec_.coefficients, polar_, spec_.polar_row_blocks);
    }

    if (spec_.normuon) {
      const auto* x_bits = static_cast<const typename W::storage*>(x_.const_data_ptr());
      const int64_t rows = spec_.rows, cols = spec_.cols;
      const dim3 sum_grid(unsigned(count * sum_groups_)), sum_block(kWarpSize, kSumRows);
      if (shapes::stats_per_row(rows, cols)) {
        normuon_row_sums_kernel<W><<<sum_grid, sum_block, 0, stream>>>(x_bits, rows, cols, sum_groups_,
                                                                     stats_.mutable_data_ptr<float>(), spec_.found_inf);
      } else {
        normuon_col_sums_kernel<W><<<sum_grid, sum_block, 0, stream>>>(x_bits, rows, cols, sum_groups_,
                                                                     stats_.mutable_data_ptr<float>(), spec_.found_inf);
      }
      C10_CUDA_KERNEL_LAUNCH_CHECK();
      const NorMuonArgs normuon{.one_minus_beta2 = 1.0f - spec_.beta2,
                                .stat_length = stat_length_,
                                .reduced_length = shapes::reduced_length(rows, cols),
                                .stats = stats_.mutable_data_ptr<float>(),
                                .found_inf = spec_.found_inf};
      for_each_matrix_group<1>(matrices_, begin, end, {spec_.second_moments}, stat_length_,
                               [&](const MatrixList<1>& list, int n) {
                                 normuon_kernel<<<n, kReduceThreads, 0, stream>>>(list, normuon);
                                 C10_CUDA_KERNEL_LAUNCH_CHECK();
                               });
    }
  }

  // write with the workspace in format W.
  template <typename Sink, typename W>
  void write_in(int64_t begin, int64_t end, const OperandLists<Sink::kDepth>& operands, const LrArgs& lr) const {
    const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
    const ApplyArgs apply{.lr = lr,
                          .found_inf = spec_.found_inf,
                          .x = x_.const_data_ptr(),
                          .mult = spec_.normuon ? stats_.const_data_ptr<float>() : nullptr,
                          .rows = spec_.rows,
                          .cols = spec_.cols};
    for_each_matrix_group<Sink::kDepth>(matrices_, begin, end, operands, numel_,
                                        [&](const MatrixList<Sink::kDepth>& list, int n) {
                                          const dim3 grid(element_blocks_, n);
                                          if (spec_.normuon) {
                                            apply_kernel<Sink, true, W><<<grid, kBlockSize, 0, stream>>>(list, apply);
                                          } else {
                                            apply_kernel<Sink, false, W><<<grid, kBlockSize, 0, stream>>>(list, apply);
                                          }
                                          C10_CUDA_KERNEL_LAUNCH_CHECK();
                                        });
  }

  OrthogonalizeSpec spec_;
  int64_t numel_;
  std::vector<MatrixRef> matrices_;
  int64_t total_ = 0, capacity_ = 0, stat_length_ = 0, blocks_per_matrix_ = 0, sum_groups_ = 0;
  unsigned element_blocks_ = 0;
  // The workspace format: FP32, FP16 or BF16, by polar_dtype.
  PolarDtype workspace_dtype_ = PolarDtype::kBFloat16;
  at::Tensor x_, partials_, scale_, stats_;
  PolarExpressWorkspace polar_;
};

const float* optional_ptr(const c10::optional<at::Tensor>& t) {
  return t.has_value() ? t->const_data_ptr<float>() : nullptr;
}

LrArgs lr_args(double lr, const c10::optional<at::Tensor>& lr_tensor, float lr_factor, float weight_decay) {
  return {.lr = static_cast<float>(lr), .lr_ptr = optional_ptr(lr_tensor), .lr_factor = lr_factor,
          .weight_decay = weight_decay};
}

template <typename G, typename P, MasterMode M>
void run_muon_step(const MuonBucket& bucket, const MuonStepOptions& options, const CudaSettings& settings) {
  const MuonHyper& hyper = options.hyper;
  const MatrixChunks chunks(bucket.params, {.rows = bucket.rows,
                                            .cols = bucket.cols,
                                            .normuon = hyper.normuon,
                                            .beta2 = hyper.beta2,
                                            .coefficients = &options.coefficients,
                                            .max_workspace_bytes = options.max_workspace_bytes,
                                            .polar_row_blocks = options.polar_row_blocks,
                                            .polar_dtype = options.polar_dtype,
                                            .polar_method = options.polar_method,
                                            .polar_fold_copies = settings.polar_fold_copies,
                                            .second_moments = &bucket.second_momentum_buffers,
                                            .found_inf = optional_ptr(options.found_inf),
                                            .op = "muon_step"});
  const MomentumArgs momentum{.mu = hyper.momentum, .nesterov = hyper.nesterov,
                              .inv_scale = optional_ptr(options.inv_scale)};
  const LrArgs lr = lr_args(options.lr, options.lr_tensor, options.lr_factor, hyper.weight_decay);
  using Sink = ParamSink<P, M>;
  OperandLists<Sink::kDepth> sink_operands{&bucket.params};
  if constexpr (M != MasterMode::kNone) sink_operands[1] = &bucket.masters;

  chunks.for_each_chunk([&](int64_t begin, int64_t end) {
    chunks.orthogonalize<SteppedMomentum<G>, StoredMomentum<G>>(begin, end, {&bucket.grads, &bucket.momentum_buffers},
                                                                momentum);
    chunks.write<Sink>(begin, end, sink_operands, lr);
  });
}

}  // namespace

void muon_step(const MuonBucket& bucket, const MuonStepOptions& options) {
  const CudaSettings settings = read_cuda_settings();  // before anything is enqueued
  if (bucket.params.empty()) return;
  const size_t count = bucket.params.size();
  TORCH_CHECK(bucket.grads.size() == count && bucket.momentum_buffers.size() == count &&
                  (!options.hyper.normuon || bucket.second_momentum_buffers.size() == count) &&
                  (bucket.master_mode == MasterMode::kNone || bucket.masters.size() == count),
              "muon_step: every tensor list needs one entry per param");
  const c10::cuda::CUDAGuard device_guard(bucket.params.front().device());
  // Unsupported combinations fail here, before anything is enqueued.
  dispatch_storage(bucket.grads.front().scalar_type(), "grad", [&](auto grad_format) {
    dispatch_param(bucket.params.front().scalar_type(), bucket.master_mode, [&](auto param_format, auto master) {
      run_muon_step<decltype(grad_format), decltype(param_format), decltype(master)::value>(bucket, options, settings);
    });
  });
}

void muon_momentum(const MuonMomentumArgs& args) {
  const CudaSettings settings = read_cuda_settings();  // before anything is enqueued
  if (args.grads.empty()) return;
  const size_t count = args.grads.size();
  TORCH_CHECK(args.momentum_buffers.size() == count && args.updates.size() == count,
              "muon_momentum: every tensor list needs one entry per grad");
  const c10::cuda::CUDAGuard device_guard(args.grads.front().device());
  const MomentumArgs momentum{.mu = args.momentum, .nesterov = args.nesterov,
                              .inv_scale = optional_ptr(args.inv_scale)};
  dispatch_storage(args.grads.front().scalar_type(), "grad", [&](auto grad_format) {
    const MomentumFunctor<decltype(grad_format)> functor{momentum, optional_ptr(args.found_inf)};
    multi_tensor_apply<3>({&args.grads, &args.momentum_buffers, &args.updates}, nullptr, kElementsPerBlock,
                          settings.blocks_per_launch, functor);
  });
}

void muon_orthogonalize(const MuonOrthogonalizeArgs& args) {
  const CudaSettings settings = read_cuda_settings();  // before anything is enqueued
  if (args.updates.empty()) return;
  TORCH_CHECK(!args.normuon || args.second_momentum_buffers.size() == args.updates.size(),
              "muon_orthogonalize: every tensor list needs one entry per update");
  const c10::cuda::CUDAGuard device_guard(args.updates.front().device());
  const MatrixChunks chunks(args.updates, {.rows = args.rows,
                                           .cols = args.cols,
                                           .normuon = args.normuon,
                                           .beta2 = args.beta2,
                                           .coefficients = &args.coefficients,
                                           .max_workspace_bytes = args.max_workspace_bytes,
                                           .polar_row_blocks = args.polar_row_blocks,
                                           .polar_dtype = args.polar_dtype,
                                           .polar_method = args.polar_method,
                                           .polar_fold_copies = settings.polar_fold_copies,
                                           .second_moments = &args.second_momentum_buffers,
                                           .found_inf = optional_ptr(args.found_inf),
                                           .op = "muon_orthogonalize"});
  // u in, the update out, in place: pass 1 and 2 read every u of the chunk
  // before step 5 overwrites them (one stream).
  chunks.for_each_chunk([&](int64_t begin, int64_t end) {
    chunks.orthogonalize<BufferedUpdates, BufferedUpdates>(begin, end, {&args.updates}, MomentumArgs{});
    chunks.write<UpdateSink>(begin, end, {&args.updates}, LrArgs{});
  });
}

void muon_apply(const MuonApplyArgs& args) {
  const CudaSettings settings = read_cuda_settings();  // before anything is enqueued
  if (args.params.empty()) return;
  const size_t count = args.params.size();
  TORCH_CHECK(args.updates.size() == count && (args.master_mode == MasterMode::kNone || args.masters.size() == count),
              "muon_apply: every tensor list needs one entry per param");
  const c10::cuda::CUDAGuard device_guard(args.params.front().device());
  const LrArgs lr = lr_args(args.lr, args.lr_tensor, args.lr_factor, args.weight_decay);
  const float* found_inf = optional_ptr(args.found_inf);
  dispatch_param(args.params.front().scalar_type(), args.master_mode, [&](auto param_format, auto master) {
    constexpr MasterMode M = decltype(master)::value;
    const ApplyFunctor<decltype(param_format), M> functor{lr, found_inf};
    if constexpr (M == MasterMode::kNone) {
      multi_tensor_apply<2>({&args.params, &args.updates}, nullptr, kElementsPerBlock, settings.blocks_per_launch,
                            functor);
    } else {
      multi_tensor_apply<3>({&args.params, &args.masters, &args.updates}, nullptr, kElementsPerBlock,
                            settings.blocks_per_launch, functor);
    }
  });
}

}  // namespace cuda
}  // namespace muon_ext

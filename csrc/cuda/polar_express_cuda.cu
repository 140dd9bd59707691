// Batched Polar-Express iterations with cuBLAS strided-batched GEMMs (BF16
// operands, or FP32 for polar_dtype="float32"), executing the plan of csrc/common/polar_plan.h (tested against a
// column-major GEMM emulation in tests/cpp/test_polar_plan.cpp).
//
// Transposes are expressed through cuBLAS op flags only (to_column_major). A
// GEMM that accumulates into C with beta needs C outside its operands, so the
// plan copies A into the B buffer and X into a second buffer first.
#include "polar_express_cuda.h"

#include <ATen/Context.h>
#include <ATen/cuda/CUDABlas.h>
#include <ATen/cuda/CUDAContext.h>
#include <ATen/cuda/Exceptions.h>
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/util/Exception.h>
#include <cublasLt.h>
#include <cublas_v2.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <deque>
#include <limits>
#include <mutex>
#include <optional>
#include <unordered_map>

#include "../common/polar_plan.h"

namespace muon_ext {
namespace cuda {
namespace {

// Lower block triangle := transposed upper, per matrix, through 32x32 tiles in
// shared memory so both the reads and the writes are coalesced. Bit copies.
constexpr int kTile = 32;

struct BlockBounds {
  int64_t value[kMaxPolarRowBlocks + 1];
  int count;  // number of blocks
};

__device__ __forceinline__ int block_of(const BlockBounds& bounds, int64_t i) {
  int block = 0;
  while (block + 1 < bounds.count && bounds.value[block + 1] <= i) ++block;
  return block;
}

// blockIdx.x = tile_row * tiles + tile_col (one grid dimension: no 65535 cap).
template <typename T>
__global__ void mirror_upper_blocks_kernel(T* data, int64_t batch, int64_t side, int64_t tiles, BlockBounds bounds) {
  __shared__ T tile[kTile][kTile + 1];
  const int64_t tile_row = blockIdx.x / tiles, tile_col = blockIdx.x % tiles;
  if (tile_col > tile_row) return;  // tiles wholly above the diagonal receive nothing
  const int64_t row0 = tile_row * kTile, col0 = tile_col * kTile;
  for (int64_t m = blockIdx.z; m < batch; m += gridDim.z) {
    T* matrix = data + m * side * side;
    // Read the transposed tile: rows col0.., columns row0.. (the upper side).
    for (int r = threadIdx.y; r < kTile; r += blockDim.y) {
      const int64_t i = col0 + r, j = row0 + threadIdx.x;
      if (i < side && j < side) tile[r][threadIdx.x] = matrix[i * side + j];
    }
    __syncthreads();
    for (int r = threadIdx.y; r < kTile; r += blockDim.y) {
      const int64_t i = row0 + r, j = col0 + threadIdx.x;
      if (i < side && j < side && block_of(bounds, i) > block_of(bounds, j)) matrix[i * side + j] = tile[threadIdx.x][r];
    }
    __syncthreads();
  }
}

// m(i, i) += value for every [side, side] matrix m of the batch, in FP32,
// rounded once to T: the Gram plan's Q = Z + a I (kAddIdentity).
template <typename T>
__global__ void add_identity_kernel(T* data, int64_t batch, int64_t side, float value) {
  const int64_t total = batch * side;
  for (int64_t e = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; e < total; e += int64_t(gridDim.x) * blockDim.x) {
    const int64_t m = e / side, i = e % side;
    T& element = data[m * side * side + i * (side + 1)];
    element = T(static_cast<float>(element) + value);
  }
}

// Sets the handle's math mode for the scope, then restores it: the handle is
// PyTorch's, shared with every other GEMM on this stream.
class MathModeGuard {
 public:
  MathModeGuard(cublasHandle_t handle, cublasMath_t mode) : handle_(handle) {
    TORCH_CUDABLAS_CHECK(cublasGetMathMode(handle_, &previous_));
    TORCH_CUDABLAS_CHECK(cublasSetMathMode(handle_, mode));
  }
  ~MathModeGuard() { cublasSetMathMode(handle_, previous_); }
  MathModeGuard(const MathModeGuard&) = delete;
  MathModeGuard& operator=(const MathModeGuard&) = delete;

 private:
  cublasHandle_t handle_;
  cublasMath_t previous_{};
};

int to_int(int64_t value, const char* what) {
  TORCH_CHECK(value <= std::numeric_limits<int>::max(), "polar_express: ", what, " ", value,
              " exceeds cuBLAS's int range");
  return static_cast<int>(value);
}

// cublasLt's workspace for split-K partial sums (the size torch gives its own
// cublasLt calls on Hopper).
constexpr int64_t kLtWorkspaceBytes = int64_t(32) << 20;

// Largest power of two (at most 256) dividing the address of every column and
// every matrix of a batched operand: what cublasLt's heuristic may assume of
// it (it sees the first matrix's address only).
uint32_t alignment_of(const void* p, int64_t ld_bytes, int64_t stride_bytes) {
  const uintptr_t all = reinterpret_cast<uintptr_t>(p) | uintptr_t(ld_bytes) | uintptr_t(stride_bytes);
  uint32_t alignment = 256;
  while (alignment > 1 && all % alignment != 0) alignment /= 2;
  return alignment;
}

// cublasLt's answers, by everything its heuristic was asked (device, types,
// transposes, sizes, leading dimensions, batch, strides, alignments,
// workspace): the query costs host time at every GEMM of every step, and its
// answer depends on nothing else. Kept per process, emptied when it holds
// kMaxEntries (shapes and alignments that come and go cannot grow it without
// bound).
class LtAlgoCache {
 public:
  using Key = std::array<int64_t, 20>;
  struct Answer {
    bool found;
    cublasLtMatmulAlgo_t algo;
  };

  static LtAlgoCache& instance() {
    static LtAlgoCache cache;
    return cache;
  }

  // The cached answer for key, or ask()'s. ask() returns nullopt where the
  // query itself failed: that is answered "not found" and not kept, so a
  // transient failure does not pin the copy path for the rest of the process.
  template <typename Ask>
  Answer find_or_ask(const Key& key, Ask&& ask) {
    {
      const std::lock_guard<std::mutex> lock(mutex_);
      const auto found = answers_.find(key);
      if (found != answers_.end()) return found->second;
    }
    const std::optional<Answer> asked = ask();  // outside the lock: another thread may ask the same
    if (!asked.has_value()) return Answer{false, {}};
    const Answer answer = *asked;
    const std::lock_guard<std::mutex> lock(mutex_);
    if (answers_.size() >= kMaxEntries) answers_.clear();
    answers_.emplace(key, answer);
    return answer;
  }

 private:
  static constexpr size_t kMaxEntries = 4096;
  struct KeyHash {
    size_t operator()(const Key& key) const {
      uint64_t hash = 1469598103934665603ull;  // FNV-1a over the words
      for (const int64_t word : key) hash = (hash ^ uint64_t(word)) * 1099511628211ull;
      return size_t(hash);
    }
  };
  std::mutex mutex_;
  std::unordered_map<Key, Answer, KeyHash> answers_;
};

// One strided-batched GEMM with its output D apart from the addend C:
// D = alpha op_a(A) op_b(B) + beta C, the same single rounding of the FP32
// result as cublasGemmStridedBatchedEx with C == D. Split-K only with FP32
// partial sums (the math mode polar_express sets for cublasGemmEx). The
// algorithm is cublasLt's heuristic answer, asked once per description
// (LtAlgoCache).
class OutOfPlaceGemm {
 public:
  struct Operands {
    const void *a, *b, *c;
    void* d;
    int64_t stride_a, stride_b, stride_c;  // elements between matrices; D's is C's
  };

  OutOfPlaceGemm(const ColumnMajorGemm& g, const Operands& operands, int64_t batch, cudaDataType_t data_type,
                 cublasComputeType_t compute_type, cublasLtHandle_t handle, size_t workspace_bytes)
      : operands_(operands) {
    // The descriptors live in this object (cublasLt's opaque structs), so it stays where it was made.
    TORCH_CUDABLAS_CHECK(cublasLtMatmulDescInit(&desc_, compute_type, CUDA_R_32F));
    const cublasOperation_t trans_a = g.trans_a ? CUBLAS_OP_T : CUBLAS_OP_N;
    const cublasOperation_t trans_b = g.trans_b ? CUBLAS_OP_T : CUBLAS_OP_N;
    set(&desc_, CUBLASLT_MATMUL_DESC_TRANSA, trans_a);
    set(&desc_, CUBLASLT_MATMUL_DESC_TRANSB, trans_b);
    // Stored (column-major) shapes: A is m x k (k x m transposed), B k x n (n x k), C and D m x n.
    layout(&a_, data_type, g.trans_a ? g.k : g.m, g.trans_a ? g.m : g.k, g.lda, batch, operands.stride_a);
    layout(&b_, data_type, g.trans_b ? g.n : g.k, g.trans_b ? g.k : g.n, g.ldb, batch, operands.stride_b);
    layout(&c_, data_type, g.m, g.n, g.ldc, batch, operands.stride_c);

    cublasLtMatmulPreferenceOpaque_t preference;
    TORCH_CUDABLAS_CHECK(cublasLtMatmulPreferenceInit(&preference));
    const uint64_t max_workspace = workspace_bytes;
    set_preference(&preference, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, max_workspace);
    const uint32_t reduction = CUBLASLT_REDUCTION_SCHEME_COMPUTE_TYPE;  // "none" is always allowed
    set_preference(&preference, CUBLASLT_MATMUL_PREF_REDUCTION_SCHEME_MASK, reduction);
    const int64_t size = data_type == CUDA_R_32F ? 4 : 2;
    const std::array<uint32_t, 4> alignments = {alignment_of(operands.a, g.lda * size, operands.stride_a * size),
                                                alignment_of(operands.b, g.ldb * size, operands.stride_b * size),
                                                alignment_of(operands.c, g.ldc * size, operands.stride_c * size),
                                                alignment_of(operands.d, g.ldc * size, operands.stride_c * size)};
    set_preference(&preference, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, alignments[0]);
    set_preference(&preference, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, alignments[1]);
    set_preference(&preference, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, alignments[2]);
    set_preference(&preference, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, alignments[3]);
    const LtAlgoCache::Key key = {c10::cuda::current_device(), data_type, compute_type, g.trans_a, g.trans_b,
                                  g.m, g.n, g.k, g.lda, g.ldb, g.ldc, batch, operands.stride_a, operands.stride_b,
                                  operands.stride_c, alignments[0], alignments[1], alignments[2], alignments[3],
                                  int64_t(workspace_bytes)};
    const LtAlgoCache::Answer answer = LtAlgoCache::instance().find_or_ask(key, [&] {
      cublasLtMatmulHeuristicResult_t heuristic{};
      int found = 0;
      const cublasStatus_t status = cublasLtMatmulAlgoGetHeuristic(handle, &desc_, &a_, &b_, &c_, &c_, &preference,
                                                                   1, &heuristic, &found);
      if (status != CUBLAS_STATUS_SUCCESS) return std::optional<LtAlgoCache::Answer>();
      return std::optional<LtAlgoCache::Answer>(
          LtAlgoCache::Answer{found > 0 && heuristic.state == CUBLAS_STATUS_SUCCESS, heuristic.algo});
    });
    found_ = answer.found;
    algo_ = answer.algo;
  }

  OutOfPlaceGemm(const OutOfPlaceGemm&) = delete;
  OutOfPlaceGemm& operator=(const OutOfPlaceGemm&) = delete;

  // False where cublasLt offers no algorithm: the caller runs the copy instead.
  bool found() const { return found_; }

  void run(cublasLtHandle_t handle, float alpha, float beta, void* workspace, size_t workspace_bytes,
           cudaStream_t stream) {
    TORCH_CUDABLAS_CHECK(cublasLtMatmul(handle, &desc_, &alpha, operands_.a, &a_, operands_.b, &b_, &beta,
                                        operands_.c, &c_, operands_.d, &c_, &algo_, workspace,
                                        workspace_bytes, stream));
  }

 private:
  template <typename T>
  static void set(cublasLtMatmulDesc_t desc, cublasLtMatmulDescAttributes_t attribute, const T& value) {
    TORCH_CUDABLAS_CHECK(cublasLtMatmulDescSetAttribute(desc, attribute, &value, sizeof(value)));
  }
  template <typename T>
  static void set_preference(cublasLtMatmulPreference_t preference, cublasLtMatmulPreferenceAttributes_t attribute,
                             const T& value) {
    TORCH_CUDABLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(preference, attribute, &value, sizeof(value)));
  }
  static void layout(cublasLtMatrixLayoutOpaque_t* layout, cudaDataType_t type, int64_t rows, int64_t cols, int64_t ld,
                     int64_t batch, int64_t stride) {
    TORCH_CUDABLAS_CHECK(cublasLtMatrixLayoutInit(layout, type, uint64_t(rows), uint64_t(cols), ld));
    const int32_t count = to_int(batch, "batch");
    TORCH_CUDABLAS_CHECK(
        cublasLtMatrixLayoutSetAttribute(layout, CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT, &count, sizeof(count)));
    TORCH_CUDABLAS_CHECK(
        cublasLtMatrixLayoutSetAttribute(layout, CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET, &stride, sizeof(stride)));
  }

  Operands operands_;
  cublasLtMatmulDescOpaque_t desc_;
  cublasLtMatrixLayoutOpaque_t a_, b_, c_;  // D's layout is C's
  cublasLtMatmulAlgo_t algo_{};  // LtAlgoCache's answer
  bool found_ = false;
};

}  // namespace

int64_t polar_express_workspace_bytes(int64_t rows, int64_t cols, at::ScalarType dtype, PolarMethod method) {
  const int64_t s = std::min(rows, cols);
  const int64_t squares = method == PolarMethod::kGram ? 4 : 2;
  return (rows * cols + squares * s * s) * int64_t(c10::elementSize(dtype));
}

PolarExpressWorkspace make_polar_express_workspace(int64_t capacity, int64_t rows, int64_t cols,
                                                   const at::TensorOptions& options, PolarMethod method,
                                                   bool fold_copies) {
  // Checked here, before the caller enqueues anything: every GEMM size, leading
  // dimension and batch count of polar_express then fits cuBLAS's int.
  to_int(std::max(rows, cols), "matrix dimension");
  to_int(capacity, "batch");
  const int64_t s = std::min(rows, cols);
  const int64_t gram_capacity = method == PolarMethod::kGram ? capacity : 0;
  return {at::empty({capacity, rows, cols}, options),
          at::empty({capacity, s, s}, options),
          at::empty({capacity, s, s}, options),
          at::empty({gram_capacity, s, s}, options),
          at::empty({gram_capacity, s, s}, options),
          method,
          fold_copies,
          at::empty({fold_copies && capacity > 0 ? kLtWorkspaceBytes : 0}, options.dtype(at::kByte))};
}

void polar_express(const at::Tensor& x, const std::vector<std::array<float, 3>>& coefficients,
                   const PolarExpressWorkspace& workspace, int64_t row_blocks) {
  const at::ScalarType dtype = x.scalar_type();
  TORCH_CHECK((dtype == at::kBFloat16 || dtype == at::kHalf || dtype == at::kFloat) && x.dim() == 3 &&
                  x.is_contiguous(),
              "polar_express: x must be a contiguous [B, rows, cols] BF16, FP16 or FP32 tensor");
  const bool half_width = dtype != at::kFloat;
  const int64_t batch = x.size(0), rows = x.size(1), cols = x.size(2);
  const int64_t s = std::min(rows, cols);
  auto fits = [batch, dtype](const at::Tensor& buffer, int64_t r, int64_t c) {
    return buffer.scalar_type() == dtype && buffer.is_contiguous() && buffer.dim() == 3 && buffer.size(0) >= batch &&
           buffer.size(1) == r && buffer.size(2) == c;
  };
  const bool gram_plan = workspace.method == PolarMethod::kGram;
  TORCH_CHECK(fits(workspace.x_operand, rows, cols) && fits(workspace.gram, s, s) && fits(workspace.poly, s, s) &&
                  (!gram_plan || (fits(workspace.q, s, s) && fits(workspace.scratch, s, s))),
              "polar_express: the workspace does not fit x");
  if (batch == 0 || s == 0 || coefficients.empty()) return;

  TORCH_CHECK(row_blocks <= kMaxPolarRowBlocks, "polar_express: row_blocks ", row_blocks, " above ",
              kMaxPolarRowBlocks);
  const std::vector<int64_t> bounds = polar_block_bounds(s, row_blocks > 0 ? row_blocks : polar_row_blocks_cuda(s));
  const std::vector<PolarOp> plan =
      polar_plan(workspace.method, rows, cols, bounds, static_cast<int>(coefficients.size()),
                 polar_gram_restart_period(half_width));
  BlockBounds device_bounds{};
  device_bounds.count = static_cast<int>(bounds.size()) - 1;
  std::copy(bounds.begin(), bounds.end(), device_bounds.value);

  // Base address and batch stride (elements) of each buffer, by PolarBuffer.
  const std::array<void*, kPolarBufferCount> base = {x.data_ptr(),         workspace.x_operand.data_ptr(),
                                                     workspace.gram.data_ptr(), workspace.poly.data_ptr(),
                                                     workspace.q.data_ptr(),    workspace.scratch.data_ptr()};
  auto stride = [&](PolarBuffer b) { return polar_buffer_numel(b, rows, cols); };
  const int64_t element_size = int64_t(c10::elementSize(dtype));
  auto address = [&](PolarBuffer b, int64_t offset) {
    return static_cast<void*>(static_cast<char*>(base[static_cast<int>(b)]) + offset * element_size);
  };
  // BF16: operands and outputs BF16, FP32 accumulation. FP32: FP32 throughout,
  // with TF32 tensor cores only where the user allowed them in torch
  // (torch.backends.cuda.matmul.allow_tf32), as torch's own FP32 GEMMs.
  // FP16 as BF16, in IEEE half.
  const cudaDataType_t data_type = dtype == at::kBFloat16 ? CUDA_R_16BF : dtype == at::kHalf ? CUDA_R_16F : CUDA_R_32F;
  const cublasComputeType_t compute_type =
      !half_width && at::globalContext().allowTF32CuBLAS() ? CUBLAS_COMPUTE_32F_FAST_TF32 : CUBLAS_COMPUTE_32F;

  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  const cublasHandle_t handle = at::cuda::getCurrentCUDABlasHandle();  // bound to `stream`
  const at::cuda::blas::PointerModeGuard pointer_mode(handle, CUBLAS_POINTER_MODE_HOST);
  // No split-K partial sums in reduced precision: each GEMM output is rounded once.
  const MathModeGuard math_mode(
      handle, static_cast<cublasMath_t>(CUBLAS_DEFAULT_MATH | CUBLAS_MATH_DISALLOW_REDUCED_PRECISION_REDUCTION));
  const int64_t tiles = (s + kTile - 1) / kTile;
  TORCH_CHECK(tiles * tiles <= std::numeric_limits<int>::max(), "polar_express: side ", s, " too large");
  const dim3 mirror_threads(kTile, 8);
  const dim3 mirror_grid(static_cast<unsigned>(tiles * tiles), 1, static_cast<unsigned>(std::min<int64_t>(batch, 65535)));

  const int add_blocks = static_cast<int>(std::min<int64_t>((batch * s + 255) / 256, 4096));
  auto scalar = [&](PolarScalar which, int step) {
    const std::array<float, 3>& abc = coefficients[step];
    return static_cast<float>(polar_scalar_value(which, abc[0], abc[1], abc[2]));
  };
  auto copy_slot = [&](PolarBuffer from, PolarBuffer to) {
    C10_CUDA_CHECK(cudaMemcpyAsync(address(to, 0), address(from, 0), batch * stride(from) * element_size,
                                   cudaMemcpyDeviceToDevice, stream));
  };
  // One op of the plan as written: a GEMM's beta term reads its own output.
  auto run_in_place = [&](const PolarOp& op) {
    switch (op.kind) {
      case PolarOp::Kind::kGemm: {
        const ColumnMajorGemm g = to_column_major(op);
        const float alpha = scalar(op.alpha, op.step), beta = scalar(op.beta, op.step);
        TORCH_CUDABLAS_CHECK(cublasGemmStridedBatchedEx(
            handle, g.trans_a ? CUBLAS_OP_T : CUBLAS_OP_N, g.trans_b ? CUBLAS_OP_T : CUBLAS_OP_N, to_int(g.m, "m"),
            to_int(g.n, "n"), to_int(g.k, "k"), &alpha, address(g.a, g.a_offset), data_type,
            to_int(g.lda, "lda"), stride(g.a), address(g.b, g.b_offset), data_type, to_int(g.ldb, "ldb"),
            stride(g.b), &beta, address(g.c, g.c_offset), data_type, to_int(g.ldc, "ldc"), stride(g.c),
            to_int(batch, "batch"), compute_type, CUBLAS_GEMM_DEFAULT));
        break;
      }
      case PolarOp::Kind::kCopy:
        copy_slot(op.from, op.to);
        break;
      case PolarOp::Kind::kMirror:
        if (half_width) {  // a copy of 16-bit patterns: BF16 and FP16 alike
          mirror_upper_blocks_kernel<<<mirror_grid, mirror_threads, 0, stream>>>(
              static_cast<uint16_t*>(address(op.to, 0)), batch, s, tiles, device_bounds);
        } else {
          mirror_upper_blocks_kernel<<<mirror_grid, mirror_threads, 0, stream>>>(
              static_cast<float*>(address(op.to, 0)), batch, s, tiles, device_bounds);
        }
        C10_CUDA_KERNEL_LAUNCH_CHECK();
        break;
      case PolarOp::Kind::kAddIdentity: {
        const float value = scalar(op.alpha, op.step);
        if (dtype == at::kBFloat16) {
          add_identity_kernel<<<add_blocks, 256, 0, stream>>>(static_cast<at::BFloat16*>(address(op.to, 0)), batch,
                                                               s, value);
        } else if (dtype == at::kHalf) {
          add_identity_kernel<<<add_blocks, 256, 0, stream>>>(static_cast<at::Half*>(address(op.to, 0)), batch, s,
                                                               value);
        } else {
          add_identity_kernel<<<add_blocks, 256, 0, stream>>>(static_cast<float*>(address(op.to, 0)), batch, s,
                                                               value);
        }
        C10_CUDA_KERNEL_LAUNCH_CHECK();
        break;
      }
    }
  };

  // Stages: one per op, or with copies folded into out-of-place GEMMs (the
  // same values in every beta term, so the same bits; docs/design.md "CUDA
  // kernels"). Each GEMM is one batched call here, so stages take whole GEMMs.
  std::vector<PolarStage> stages;
  if (workspace.fold_copies) {
    stages = polar_swap_copied_operands(
        polar_fold_copies(polar_stages(plan, std::max(rows, cols)), rows, cols, bounds), rows, cols);
  } else {
    for (const PolarOp& op : plan) {
      stages.push_back({{op}, op.kind == PolarOp::Kind::kGemm ? op.out.buffer : PolarBuffer::kX});
    }
  }
  const cublasLtHandle_t lt_handle = workspace.fold_copies ? at::cuda::getCurrentCUDABlasLtHandle() : nullptr;
  const size_t lt_workspace_bytes = size_t(workspace.lt_workspace.numel());
  for (const PolarStage& stage : stages) {
    std::deque<OutOfPlaceGemm> out_of_place;  // made in place, never moved
    std::vector<bool> is_out_of_place;
    bool all_found = true;
    for (const PolarOp& op : stage.ops) {
      const bool apart =
          op.kind == PolarOp::Kind::kGemm && stage.addend != op.out.buffer && scalar(op.beta, op.step) != 0.0f;
      is_out_of_place.push_back(apart);
      if (!apart) continue;
      const ColumnMajorGemm g = to_column_major(op);
      out_of_place.emplace_back(g,
                                OutOfPlaceGemm::Operands{address(g.a, g.a_offset), address(g.b, g.b_offset),
                                                         address(stage.addend, g.c_offset), address(g.c, g.c_offset),
                                                         stride(g.a), stride(g.b), stride(g.c)},
                                batch, data_type, compute_type, lt_handle, lt_workspace_bytes);
      all_found = all_found && out_of_place.back().found();
    }
    if (!all_found) {
      // No cublasLt algorithm for one of them: the copy the fold removed, then in place.
      copy_slot(stage.addend, stage.ops.front().out.buffer);
      for (const PolarOp& op : stage.ops) run_in_place(op);
      continue;
    }
    size_t next = 0;
    for (size_t i = 0; i < stage.ops.size(); ++i) {
      const PolarOp& op = stage.ops[i];
      if (is_out_of_place[i]) {
        out_of_place[next++].run(lt_handle, scalar(op.alpha, op.step), scalar(op.beta, op.step),
                                 workspace.lt_workspace.data_ptr(), lt_workspace_bytes, stream);
      } else {
        run_in_place(op);
      }
    }
  }
}

}  // namespace cuda
}  // namespace muon_ext

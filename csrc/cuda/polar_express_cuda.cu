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
#include <c10/util/Exception.h>
#include <cublas_v2.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <limits>

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

}  // namespace

int64_t polar_express_workspace_bytes(int64_t rows, int64_t cols, at::ScalarType dtype, PolarMethod method) {
  const int64_t s = std::min(rows, cols);
  const int64_t squares = method == PolarMethod::kGram ? 4 : 2;
  return (rows * cols + squares * s * s) * int64_t(c10::elementSize(dtype));
}

PolarExpressWorkspace make_polar_express_workspace(int64_t capacity, int64_t rows, int64_t cols,
                                                   const at::TensorOptions& options, PolarMethod method) {
  // Checked here, before the caller enqueues anything: every GEMM size, leading
  // dimension and batch count of polar_express then fits cuBLAS's int.
  to_int(std::max(rows, cols), "matrix dimension");
  to_int(capacity, "batch");
  const int64_t s = std::min(rows, cols);
  const int64_t gram_capacity = method == PolarMethod::kGram ? capacity : 0;
  return {at::empty({capacity, rows, cols}, options), at::empty({capacity, s, s}, options),
          at::empty({capacity, s, s}, options),       at::empty({gram_capacity, s, s}, options),
          at::empty({gram_capacity, s, s}, options),  method};
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
  for (const PolarOp& op : plan) {
    const std::array<float, 3>& abc = coefficients[op.step];
    {
      switch (op.kind) {
        case PolarOp::Kind::kGemm: {
          const ColumnMajorGemm g = to_column_major(op);
          const float alpha = static_cast<float>(polar_scalar_value(op.alpha, abc[0], abc[1], abc[2]));
          const float beta = static_cast<float>(polar_scalar_value(op.beta, abc[0], abc[1], abc[2]));
          TORCH_CUDABLAS_CHECK(cublasGemmStridedBatchedEx(
              handle, g.trans_a ? CUBLAS_OP_T : CUBLAS_OP_N, g.trans_b ? CUBLAS_OP_T : CUBLAS_OP_N, to_int(g.m, "m"),
              to_int(g.n, "n"), to_int(g.k, "k"), &alpha, address(g.a, g.a_offset), data_type,
              to_int(g.lda, "lda"), stride(g.a), address(g.b, g.b_offset), data_type, to_int(g.ldb, "ldb"),
              stride(g.b), &beta, address(g.c, g.c_offset), data_type, to_int(g.ldc, "ldc"), stride(g.c),
              to_int(batch, "batch"), compute_type, CUBLAS_GEMM_DEFAULT));
          break;
        }
        case PolarOp::Kind::kCopy:
          C10_CUDA_CHECK(cudaMemcpyAsync(address(op.to, 0), address(op.from, 0),
                                         batch * stride(op.from) * element_size,
                                         cudaMemcpyDeviceToDevice, stream));
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
          const float value = static_cast<float>(polar_scalar_value(op.alpha, abc[0], abc[1], abc[2]));
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
    }
  }
}

}  // namespace cuda
}  // namespace muon_ext

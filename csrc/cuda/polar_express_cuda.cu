// Batched Polar-Express iterations with cuBLAS strided-batched BF16 GEMMs.
//
// Transposes are expressed through cuBLAS op flags only: a row-major [r, c]
// matrix M is, to column-major cuBLAS, M^T with leading dimension c.  So the
// row-major product P = L R is computed as the column-major P^T = R^T L^T:
// cuBLAS's A operand is R's storage, its B operand is L's storage, and an
// operand that appears transposed in P gets CUBLAS_OP_T.
//
// "b*A + c*A@A" and "a*X + B@X" are GEMMs accumulating into C with beta.  C is
// also the output and must not alias an operand, so A is first copied into
// the B buffer, and X into a second buffer that the X GEMM reads while it
// accumulates into (and overwrites) X itself; the result stays in x.
#include "polar_express_cuda.h"

#include <ATen/cuda/CUDABlas.h>
#include <ATen/cuda/CUDAContext.h>
#include <ATen/cuda/Exceptions.h>
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAException.h>
#include <c10/util/Exception.h>
#include <cublas_v2.h>

#include <algorithm>
#include <array>
#include <limits>

namespace muon_ext {
namespace cuda {
namespace {

enum class Buffer { kX, kXOperand, kGram, kPoly };

// C = alpha * op_a(A) op_b(B) + beta * C per matrix, in cuBLAS's column-major
// terms, with operands named by workspace buffer.
struct GemmSpec {
  cublasOperation_t op_a, op_b;
  int64_t m, n, k;
  Buffer a, b, c;
  int64_t lda, ldb, ldc;
};

// The GEMMs of one iteration on a row-major [rows, cols] X: A, then B, then X.
// S = X^T is X's storage seen by cuBLAS (column-major [cols, rows], ld cols);
// G and Q are the storages of A and B ([s, s], ld s).
std::array<GemmSpec, 3> iteration_gemms(int64_t rows, int64_t cols) {
  constexpr cublasOperation_t N = CUBLAS_OP_N, T = CUBLAS_OP_T;
  const int64_t s = std::min(rows, cols);
  // B = A@A:  B^T = A^T A^T = G G.
  const GemmSpec poly{N, N, s, s, s, Buffer::kGram, Buffer::kGram, Buffer::kPoly, s, s, s};
  if (rows <= cols) {
    return {{
        // A = X X^T:  A^T = X X^T = S^T S.
        {T, N, s, s, cols, Buffer::kX, Buffer::kX, Buffer::kGram, cols, cols, s},
        poly,
        // X' = B@X:  X'^T = X^T B^T = S Q, [cols, s].
        {N, N, cols, s, s, Buffer::kXOperand, Buffer::kPoly, Buffer::kX, cols, s, cols},
    }};
  }
  return {{
      // A = X^T X:  A^T = X^T X = S S^T.
      {N, T, s, s, rows, Buffer::kX, Buffer::kX, Buffer::kGram, cols, cols, s},
      poly,
      // X' = X@B:  X'^T = B^T X^T = Q S, [s, rows].
      {N, N, s, rows, s, Buffer::kPoly, Buffer::kXOperand, Buffer::kX, s, cols, cols},
  }};
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
  TORCH_CHECK(value <= std::numeric_limits<int>::max(), "polar_express_bf16: ", what, " ", value,
              " exceeds cuBLAS's int range");
  return static_cast<int>(value);
}

}  // namespace

int64_t polar_express_workspace_bytes(int64_t rows, int64_t cols) {
  const int64_t s = std::min(rows, cols);
  return (rows * cols + 2 * s * s) * int64_t(sizeof(uint16_t));
}

PolarExpressWorkspace make_polar_express_workspace(int64_t capacity, int64_t rows, int64_t cols,
                                                   const at::TensorOptions& options) {
  // Checked here, before the caller enqueues anything: every GEMM size, leading
  // dimension and batch count of polar_express_bf16 then fits cuBLAS's int.
  to_int(std::max(rows, cols), "matrix dimension");
  to_int(capacity, "batch");
  const int64_t s = std::min(rows, cols);
  const at::TensorOptions bf16 = options.dtype(at::kBFloat16);
  return {at::empty({capacity, rows, cols}, bf16), at::empty({capacity, s, s}, bf16),
          at::empty({capacity, s, s}, bf16)};
}

void polar_express_bf16(const at::Tensor& x, const std::vector<std::array<float, 3>>& coefficients,
                        const PolarExpressWorkspace& workspace) {
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && x.dim() == 3 && x.is_contiguous(),
              "polar_express_bf16: x must be a contiguous [B, rows, cols] BF16 tensor");
  const int64_t batch = x.size(0), rows = x.size(1), cols = x.size(2);
  const int64_t s = std::min(rows, cols);
  auto fits = [batch](const at::Tensor& buffer, int64_t r, int64_t c) {
    return buffer.scalar_type() == at::kBFloat16 && buffer.is_contiguous() && buffer.dim() == 3 &&
           buffer.size(0) >= batch && buffer.size(1) == r && buffer.size(2) == c;
  };
  TORCH_CHECK(fits(workspace.x_operand, rows, cols) && fits(workspace.gram, s, s) && fits(workspace.poly, s, s),
              "polar_express_bf16: the workspace does not fit x");
  if (batch == 0 || coefficients.empty()) return;

  // Base address and batch stride of each Buffer.
  struct Operand {
    void* data;
    int64_t stride;
  };
  const int64_t x_stride = rows * cols, gram_stride = s * s;
  const std::array<Operand, 4> operands = {{{x.data_ptr(), x_stride},
                                            {workspace.x_operand.data_ptr(), x_stride},
                                            {workspace.gram.data_ptr(), gram_stride},
                                            {workspace.poly.data_ptr(), gram_stride}}};
  auto operand = [&](Buffer buffer) { return operands[static_cast<size_t>(buffer)]; };

  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  const cublasHandle_t handle = at::cuda::getCurrentCUDABlasHandle();  // bound to `stream`
  const at::cuda::blas::PointerModeGuard pointer_mode(handle, CUBLAS_POINTER_MODE_HOST);
  // No split-K partial sums in BF16: each GEMM output is rounded to BF16 once.
  const MathModeGuard math_mode(
      handle, static_cast<cublasMath_t>(CUBLAS_DEFAULT_MATH | CUBLAS_MATH_DISALLOW_REDUCED_PRECISION_REDUCTION));

  const std::array<GemmSpec, 3> gemms = iteration_gemms(rows, cols);
  auto run = [&](const GemmSpec& spec, float alpha, float beta) {
    const Operand a = operand(spec.a), b = operand(spec.b), c = operand(spec.c);
    TORCH_CUDABLAS_CHECK(cublasGemmStridedBatchedEx(
        handle, spec.op_a, spec.op_b, to_int(spec.m, "m"), to_int(spec.n, "n"), to_int(spec.k, "k"), &alpha, a.data,
        CUDA_R_16BF, to_int(spec.lda, "lda"), a.stride, b.data, CUDA_R_16BF, to_int(spec.ldb, "ldb"), b.stride, &beta,
        c.data, CUDA_R_16BF, to_int(spec.ldc, "ldc"), c.stride, to_int(batch, "batch"), CUBLAS_COMPUTE_32F,
        CUBLAS_GEMM_DEFAULT));
  };
  auto copy = [&](Buffer from, Buffer to) {
    C10_CUDA_CHECK(cudaMemcpyAsync(operand(to).data, operand(from).data,
                                   batch * operand(from).stride * int64_t(sizeof(uint16_t)), cudaMemcpyDeviceToDevice,
                                   stream));
  };

  for (const std::array<float, 3>& abc : coefficients) {
    const float a = abc[0], b = abc[1], c = abc[2];
    run(gemms[0], 1.0f, 0.0f);  // A = X X^T (tall: X^T X)
    copy(Buffer::kGram, Buffer::kPoly);
    run(gemms[1], c, b);  // B = c*A@A + b*A
    copy(Buffer::kX, Buffer::kXOperand);
    run(gemms[2], 1.0f, a);  // X = B@X + a*X (tall: X@B + a*X)
  }
}

}  // namespace cuda
}  // namespace muon_ext

// One Polar-Express iteration as a plan of operations on four per-matrix
// buffers, executed by the CPU kernel (at::addmm_out on views, cut into row
// panels by polar_stages), the CUDA kernel (cuBLAS strided-batched GEMMs) and
// the C++ tests (a naive column-major GEMM), so the buffer layouts and the
// transposes are checked without a GPU.
//
// Buffers, per matrix, row-major: X and XOperand [rows, cols], Gram and Poly
// [side, side] with side = min(rows, cols). With V = X (wide) or X^T (tall):
//   Gram = V V^T;  Poly = b Gram + c Gram Gram;  X = a X + Poly X (wide) or X Poly (tall).
// Gram and Gram Gram are symmetric: with row blocks, only each block row's part
// on and right of the diagonal is multiplied and the rest mirrored from it.
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

namespace muon_ext {

enum class PolarBuffer : int { kX = 0, kXOperand = 1, kGram = 2, kPoly = 3 };
constexpr int kPolarBufferCount = 4;

// Scalars of a GEMM: constants or the iteration's (a, b, c).
enum class PolarScalar : int { kZero, kOne, kA, kB, kC };

inline double polar_scalar_value(PolarScalar s, double a, double b, double c) {
  switch (s) {
    case PolarScalar::kZero: return 0.0;
    case PolarScalar::kOne: return 1.0;
    case PolarScalar::kA: return a;
    case PolarScalar::kB: return b;
    case PolarScalar::kC: return c;
  }
  return 0.0;
}

// A [rows, cols] matrix inside one matrix's slot of `buffer`: element (i, j) is
// slot[offset + i * ld + j], or slot[offset + j * ld + i] when `transposed`.
struct PolarView {
  PolarBuffer buffer;
  int64_t offset, rows, cols, ld;
  bool transposed;

  PolarView t() const { return {buffer, offset, cols, rows, ld, !transposed}; }
  // Rows [r0, r0 + h) of this view.
  PolarView row_slice(int64_t r0, int64_t h) const {
    return {buffer, offset + r0 * (transposed ? 1 : ld), h, cols, ld, transposed};
  }
};

struct PolarOp {
  enum class Kind { kGemm, kCopy, kMirror };
  Kind kind;
  // kGemm: out = alpha * lhs rhs + beta * out (out never transposed, never
  // aliasing lhs or rhs).
  PolarView out, lhs, rhs;
  PolarScalar alpha, beta;
  // kCopy: whole slot `from` -> `to`. kMirror: in `to` ([side, side]), every
  // element (i, j) whose row block is below its column block := element (j, i).
  PolarBuffer from, to;
};

// Most row blocks a caller may ask for (more only add GEMM launches).
constexpr int64_t kMaxPolarRowBlocks = 64;

// Row-block boundaries 0 = b_0 < ... < b_n = side of `blocks` near-equal blocks
// (clamped to 1..side; {0, 0} for side 0).
inline std::vector<int64_t> polar_block_bounds(int64_t side, int64_t blocks) {
  const int64_t n = std::clamp<int64_t>(blocks, 1, std::max<int64_t>(side, 1));
  std::vector<int64_t> bounds(n + 1);
  for (int64_t i = 0; i <= n; ++i) bounds[i] = side * i / n;
  return bounds;
}

// CPU choice: blocks of at least 128 rows, at most 8 (measured with MKL on 2
// cores: 1.02-1.09x faster at side 256, 1.11-1.28x at 1024; smaller blocks
// lose more to GEMM overhead than the skipped triangle saves).
inline int64_t polar_row_blocks_cpu(int64_t side) { return std::clamp<int64_t>(side / 128, 1, 8); }

// CUDA choice: plain GEMMs until the block-triangular form is measured faster
// on a GPU (bench/muon.py --row-blocks).
inline int64_t polar_row_blocks_cuda(int64_t /*side*/) { return 1; }

inline std::vector<PolarOp> polar_iteration_plan(int64_t rows, int64_t cols, const std::vector<int64_t>& bounds) {
  const int64_t side = std::min(rows, cols);
  const bool wide = rows <= cols;
  const PolarScalar none = PolarScalar::kZero;
  // Rows [r0, r0 + h) of V, V = X (wide) or X^T (tall), as views of X.
  auto v_rows = [&](int64_t r0, int64_t h) -> PolarView {
    return wide ? PolarView{PolarBuffer::kX, r0 * cols, h, cols, cols, false}
                : PolarView{PolarBuffer::kX, r0, rows, h, cols, false}.t();
  };
  auto square = [&](PolarBuffer buffer, int64_t r0, int64_t h, int64_t c0, int64_t w) {
    return PolarView{buffer, r0 * side + c0, h, w, side, false};
  };
  auto gemm = [](PolarView out, PolarView lhs, PolarView rhs, PolarScalar alpha, PolarScalar beta) {
    return PolarOp{PolarOp::Kind::kGemm, out, lhs, rhs, alpha, beta, PolarBuffer::kX, PolarBuffer::kX};
  };
  auto copy = [&](PolarBuffer from, PolarBuffer to) {
    const PolarView unused{};
    return PolarOp{PolarOp::Kind::kCopy, unused, unused, unused, none, none, from, to};
  };
  auto mirror = [&](PolarBuffer buffer) {
    const PolarView unused{};
    return PolarOp{PolarOp::Kind::kMirror, unused, unused, unused, none, none, buffer, buffer};
  };

  std::vector<PolarOp> plan;
  const bool blocked = bounds.size() > 2;
  for (size_t i = 0; i + 1 < bounds.size(); ++i) {  // Gram = V V^T
    const int64_t r0 = bounds[i], h = bounds[i + 1] - r0;
    plan.push_back(gemm(square(PolarBuffer::kGram, r0, h, r0, side - r0), v_rows(r0, h), v_rows(r0, side - r0).t(),
                        PolarScalar::kOne, PolarScalar::kZero));
  }
  if (blocked) plan.push_back(mirror(PolarBuffer::kGram));
  plan.push_back(copy(PolarBuffer::kGram, PolarBuffer::kPoly));
  for (size_t i = 0; i + 1 < bounds.size(); ++i) {  // Poly = c Gram Gram + b Gram
    const int64_t r0 = bounds[i], h = bounds[i + 1] - r0;
    plan.push_back(gemm(square(PolarBuffer::kPoly, r0, h, r0, side - r0), square(PolarBuffer::kGram, r0, h, 0, side),
                        square(PolarBuffer::kGram, 0, side, r0, side - r0), PolarScalar::kC, PolarScalar::kB));
  }
  if (blocked) plan.push_back(mirror(PolarBuffer::kPoly));
  plan.push_back(copy(PolarBuffer::kX, PolarBuffer::kXOperand));
  const PolarView x{PolarBuffer::kX, 0, rows, cols, cols, false};
  const PolarView x_operand{PolarBuffer::kXOperand, 0, rows, cols, cols, false};
  const PolarView poly = square(PolarBuffer::kPoly, 0, side, 0, side);
  plan.push_back(wide ? gemm(x, poly, x_operand, PolarScalar::kOne, PolarScalar::kA)    // X = Poly X + a X
                      : gemm(x, x_operand, poly, PolarScalar::kOne, PolarScalar::kA));  // X = X Poly + a X
  return plan;
}

// CPU output panels: GEMMs are cut into row panels of about this many rows,
// a function of the shape only, so a matrix's GEMM calls (and their bits) do
// not depend on the thread count (docs/design.md, "CPU kernels").
constexpr int64_t kPolarPanelRowsCpu = 128;

// The plan as the CPU runs it: every GEMM cut into near-equal output row
// panels of at most `panel_rows` rows (the lhs rows with them), and each run of
// consecutive GEMMs made one stage: they write disjoint parts of one buffer and
// read only other buffers (and, through beta, their own part), so a stage's
// GEMMs may run in any order or concurrently. A copy or mirror is a stage alone.
inline std::vector<std::vector<PolarOp>> polar_stages(const std::vector<PolarOp>& plan, int64_t panel_rows) {
  std::vector<std::vector<PolarOp>> stages;
  bool in_gemm_stage = false;
  for (const PolarOp& op : plan) {
    if (op.kind != PolarOp::Kind::kGemm) {
      stages.push_back({op});
      in_gemm_stage = false;
      continue;
    }
    if (!in_gemm_stage) stages.emplace_back();
    in_gemm_stage = true;
    const int64_t rows = op.out.rows;
    const std::vector<int64_t> bounds =
        polar_block_bounds(rows, (rows + std::max<int64_t>(panel_rows, 1) - 1) / std::max<int64_t>(panel_rows, 1));
    for (size_t i = 0; i + 1 < bounds.size(); ++i) {
      const int64_t r0 = bounds[i], h = bounds[i + 1] - r0;
      if (h == 0) continue;
      PolarOp panel = op;
      panel.out = op.out.row_slice(r0, h);
      panel.lhs = op.lhs.row_slice(r0, h);
      stages.back().push_back(panel);
    }
  }
  return stages;
}

// A kGemm in cuBLAS's column-major terms: C = alpha op_a(A) op_b(B) + beta C,
// C of m x n. A row-major view is, read column-major with the same ld, its
// transpose; so the row-major out = lhs rhs is the column-major
// out^T = rhs^T lhs^T, and an operand stored transposed takes op T.
struct ColumnMajorGemm {
  bool trans_a, trans_b;
  int64_t m, n, k;
  PolarBuffer a, b, c;
  int64_t a_offset, b_offset, c_offset;
  int64_t lda, ldb, ldc;
};

inline ColumnMajorGemm to_column_major(const PolarOp& op) {
  return {op.rhs.transposed, op.lhs.transposed, op.out.cols,   op.out.rows,  op.lhs.cols,
          op.rhs.buffer,     op.lhs.buffer,     op.out.buffer, op.rhs.offset, op.lhs.offset,
          op.out.offset,     op.rhs.ld,         op.lhs.ld,     op.out.ld};
}

// Elements per matrix of each buffer.
inline int64_t polar_buffer_numel(PolarBuffer buffer, int64_t rows, int64_t cols) {
  const int64_t side = std::min(rows, cols);
  return buffer == PolarBuffer::kX || buffer == PolarBuffer::kXOperand ? rows * cols : side * side;
}

}  // namespace muon_ext

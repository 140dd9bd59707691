// One Polar-Express iteration as a plan of operations on four per-matrix
// buffers, executed by the CPU kernel (at::addmm_out on views, cut into row
// panels by polar_stages), the CUDA kernel (cuBLAS strided-batched GEMMs) and
// the C++ tests (a naive column-major GEMM), so the buffer layouts and the
// transposes are checked without a GPU.
//
// Buffers, per matrix, row-major: X and XOperand [rows, cols], the others
// [side, side] with side = min(rows, cols). With V = X (wide) or X^T (tall),
// the standard iteration (polar_iteration_plan):
//   Gram = V V^T;  Poly = b Gram + c Gram Gram;  X = a X + Poly X (wide) or X Poly (tall).
// Gram and Gram Gram are symmetric: with row blocks, only each block row's part
// on and right of the diagonal is multiplied and the rest mirrored from it.
// The Gram Newton-Schulz plan (polar_gram_plan, docs/design.md "Gram
// Newton-Schulz") iterates on the [side, side] matrices only and multiplies
// the wide X twice in all.
#pragma once

#include <algorithm>
#include <array>
#include <cstdint>
#include <vector>

namespace muon_ext {

// kQ and kScratch: the Gram plan's accumulated polynomial and its spare square.
enum class PolarBuffer : int { kX = 0, kXOperand = 1, kGram = 2, kPoly = 3, kQ = 4, kScratch = 5 };
constexpr int kPolarBufferCount = 6;

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
  enum class Kind { kGemm, kCopy, kMirror, kAddIdentity };
  Kind kind;
  // kGemm: out = alpha * lhs rhs + beta * out (out never transposed, never
  // aliasing lhs or rhs); beta = 0 ignores out's old contents, as BLAS does.
  PolarView out, lhs, rhs;
  PolarScalar alpha, beta;
  // kCopy: whole slot `from` -> `to`. kMirror: in `to` ([side, side]), every
  // element (i, j) whose row block is below its column block := element (j, i).
  // kAddIdentity: to(i, i) += alpha, every i (an output: rounded like a GEMM's).
  PolarBuffer from, to;
  // The Polar-Express iteration whose (a, b, c) the scalars take.
  int step = 0;
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

namespace polar_plan_detail {

inline PolarOp gemm(PolarView out, PolarView lhs, PolarView rhs, PolarScalar alpha, PolarScalar beta, int step) {
  PolarOp op{PolarOp::Kind::kGemm, out, lhs, rhs, alpha, beta, PolarBuffer::kX, PolarBuffer::kX};
  op.step = step;
  return op;
}

inline PolarOp slot_op(PolarOp::Kind kind, PolarBuffer from, PolarBuffer to, PolarScalar alpha, int step) {
  const PolarView unused{};
  PolarOp op{kind, unused, unused, unused, alpha, PolarScalar::kZero, from, to};
  op.step = step;
  return op;
}

inline PolarView square(PolarBuffer buffer, int64_t side, int64_t r0, int64_t h, int64_t c0, int64_t w) {
  return PolarView{buffer, r0 * side + c0, h, w, side, false};
}

// out = alpha lhs rhs + beta out for [side, side] lhs and rhs whose product is
// symmetric (polynomials in one symmetric matrix commute): with row blocks,
// each block row right of its diagonal, then the mirror.
inline void symmetric_product(std::vector<PolarOp>& plan, PolarBuffer out, PolarBuffer lhs, PolarBuffer rhs,
                              PolarScalar alpha, PolarScalar beta, int64_t side, const std::vector<int64_t>& bounds,
                              int step) {
  for (size_t i = 0; i + 1 < bounds.size(); ++i) {
    const int64_t r0 = bounds[i], h = bounds[i + 1] - r0;
    plan.push_back(gemm(square(out, side, r0, h, r0, side - r0), square(lhs, side, r0, h, 0, side),
                        square(rhs, side, 0, side, r0, side - r0), alpha, beta, step));
  }
  if (bounds.size() > 2) plan.push_back(slot_op(PolarOp::Kind::kMirror, out, out, PolarScalar::kZero, step));
}

// Gram = V V^T, V = x (wide) or x^T (tall) with x the [rows, cols] matrix in
// `source` (X or XOperand), symmetric as above.
inline void gram_of_x(std::vector<PolarOp>& plan, int64_t rows, int64_t cols, const std::vector<int64_t>& bounds,
                      int step, PolarBuffer source = PolarBuffer::kX) {
  const int64_t side = std::min(rows, cols);
  const bool wide = rows <= cols;
  auto v_rows = [&](int64_t r0, int64_t h) -> PolarView {
    return wide ? PolarView{source, r0 * cols, h, cols, cols, false}
                : PolarView{source, r0, rows, h, cols, false}.t();
  };
  for (size_t i = 0; i + 1 < bounds.size(); ++i) {
    const int64_t r0 = bounds[i], h = bounds[i + 1] - r0;
    plan.push_back(gemm(square(PolarBuffer::kGram, side, r0, h, r0, side - r0), v_rows(r0, h),
                        v_rows(r0, side - r0).t(), PolarScalar::kOne, PolarScalar::kZero, step));
  }
  if (bounds.size() > 2) {
    plan.push_back(slot_op(PolarOp::Kind::kMirror, PolarBuffer::kGram, PolarBuffer::kGram, PolarScalar::kZero, step));
  }
}

// to = Q from (wide) or from Q (tall) for the [rows, cols] matrices in
// buffers `from` and `to` (X and XOperand, either way round; the same one:
// through a copy into XOperand).
inline void apply_q(std::vector<PolarOp>& plan, int64_t rows, int64_t cols, int step, PolarBuffer from,
                    PolarBuffer to) {
  const int64_t side = std::min(rows, cols);
  if (from == to) {
    plan.push_back(slot_op(PolarOp::Kind::kCopy, from, PolarBuffer::kXOperand, PolarScalar::kZero, step));
    from = PolarBuffer::kXOperand;
  }
  const PolarView out{to, 0, rows, cols, cols, false};
  const PolarView operand{from, 0, rows, cols, cols, false};
  const PolarView q = square(PolarBuffer::kQ, side, 0, side, 0, side);
  plan.push_back(rows <= cols ? gemm(out, q, operand, PolarScalar::kOne, PolarScalar::kZero, step)
                              : gemm(out, operand, q, PolarScalar::kOne, PolarScalar::kZero, step));
}

}  // namespace polar_plan_detail

// One standard iteration (the same GEMMs for every (a, b, c); ops' step 0).
inline std::vector<PolarOp> polar_iteration_plan(int64_t rows, int64_t cols, const std::vector<int64_t>& bounds) {
  using namespace polar_plan_detail;
  const int64_t side = std::min(rows, cols);
  std::vector<PolarOp> plan;
  gram_of_x(plan, rows, cols, bounds, 0);  // Gram = V V^T
  plan.push_back(slot_op(PolarOp::Kind::kCopy, PolarBuffer::kGram, PolarBuffer::kPoly, PolarScalar::kZero, 0));
  symmetric_product(plan, PolarBuffer::kPoly, PolarBuffer::kGram, PolarBuffer::kGram, PolarScalar::kC,  // Poly = c Gram Gram + b Gram
                    PolarScalar::kB, side, bounds, 0);
  plan.push_back(slot_op(PolarOp::Kind::kCopy, PolarBuffer::kX, PolarBuffer::kXOperand, PolarScalar::kZero, 0));
  const PolarView x{PolarBuffer::kX, 0, rows, cols, cols, false};
  const PolarView x_operand{PolarBuffer::kXOperand, 0, rows, cols, cols, false};
  const PolarView poly = square(PolarBuffer::kPoly, side, 0, side, 0, side);
  plan.push_back(rows <= cols ? gemm(x, poly, x_operand, PolarScalar::kOne, PolarScalar::kA, 0)    // X = Poly X + a X
                              : gemm(x, x_operand, poly, PolarScalar::kOne, PolarScalar::kA, 0));  // X = X Poly + a X
  return plan;
}

// Which iteration a matrix runs, a group setting (polar_method).
enum class PolarMethod : int { kStandard = 0, kGram = 1, kAuto = 2 };

// "auto"'s rule, measured on the CPU (bench/polar_rate.py --stacks gram, figures in
// bench/RESULTS.md; docs/design.md "Gram Newton-Schulz"): Gram where the long
// side is at least kGramMinAspect times the short one and the short side is
// at least kGramMinSide. Measured at 2 threads, standard / Gram time: 1.2-1.5x
// at 512x2048, 1024x4096 and 4096x1024; 0.86-1.15x (noise around even) at
// 256x1024 and 1024x256; 0.7-1.2x at 1024x1024 and 1.05x at 512x1024 (aspect
// <= 2, where published ports keep the standard iteration too). The one rule
// for C++ and Python (muon_ext._C.polar_method_for).
constexpr int64_t kGramMinAspect = 4;
constexpr int64_t kGramMinSide = 512;

inline bool polar_gram_pays(int64_t rows, int64_t cols) {
  const int64_t side = std::min(rows, cols), length = std::max(rows, cols);
  return side >= kGramMinSide && length >= kGramMinAspect * side;
}

// The iteration a (rows, cols) matrix runs under `method`: kStandard or kGram.
inline PolarMethod polar_method_for(PolarMethod method, int64_t rows, int64_t cols) {
  if (method == PolarMethod::kAuto) return polar_gram_pays(rows, cols) ? PolarMethod::kGram : PolarMethod::kStandard;
  return method;
}

// Gram Newton-Schulz restarts (recomputes X from the accumulated polynomial
// and its Gram matrix afresh) before iteration 2 and then before every
// `period`-th after it. Rounding noise in R sits at eps * |R|, i.e. at
// singular values near sqrt(eps) of X; a negative noise eigenvalue -d of R
// grows like d * a^2 per iteration (a ~ 8 at first), and once near -1 the
// polynomial blows up; a restart discards it. The period is per precision
// (docs/design.md "Gram Newton-Schulz"):
// * BF16 and FP16 (eps 2^-8, 2^-11), every 2 (before 2 and 4 of five): BF16
//   with a restart before 3 only gave a rank-2 128x128 matrix largest
//   singular value 14.8 and examples/train_gpt.py (seed 1) a NaN at step 19;
//   before 2 only, errors up to 1.14x the standard path's (40x160, tiny
//   norm) and singular values up to 1.95 (condition 1e6). FP16 before 2 only:
//   1.105x on a rank-8 160x40 matrix (the SIMD kernel), above the 1.1x bound.
// * FP32 (eps 2^-24), every 3 (once, before 2 of five, as published ports):
//   within 1.001x of the standard path's error on every accuracy case and
//   rank 1-16 matrices, largest singular value 1.14.
constexpr int kGramRestartPeriodHalf = 2;
constexpr int kGramRestartPeriod = 3;
constexpr int kGramFirstRestart = 2;

// The period for a precision: 16-bit operands, BF16 or FP16 (true), or FP32 (false).
inline int polar_gram_restart_period(bool sixteen_bit) {
  return sixteen_bit ? kGramRestartPeriodHalf : kGramRestartPeriod;
}

inline bool polar_gram_restarts_before(int step, int period) {
  return step >= kGramFirstRestart && (step - kGramFirstRestart) % period == 0;
}

// Gram Newton-Schulz over `steps` iterations, in exact arithmetic the same
// polynomial as `steps` standard iterations. With R = V V^T and the iteration's
// P = a I + Z, Z = b R + c R R (so that the standard step is V <- P V):
//   Q = P_0,  then Q <- Q P_k = Q Z + a Q        (the polynomial so far)
//   R <- P R P = Z (R Z + a R) + a (R Z + a R)   (the Gram matrix of P V)
// and V <- Q V once at the end, or at a restart (polar_gram_restarts_before
// with `restart_period`), after which R = V V^T afresh. All square products
// are polynomials in one symmetric matrix, so symmetric: row blocks apply to each.
// A restart writes the new V into the other of X and XOperand (no copy of
// the long matrix); the end writes X, through a copy only when V is in X.
inline std::vector<PolarOp> polar_gram_plan(int64_t rows, int64_t cols, const std::vector<int64_t>& bounds, int steps,
                                            int restart_period) {
  using namespace polar_plan_detail;
  const int64_t side = std::min(rows, cols);
  const PolarScalar one = PolarScalar::kOne, a = PolarScalar::kA, none = PolarScalar::kZero;
  std::vector<PolarOp> plan;
  if (steps <= 0) return plan;
  gram_of_x(plan, rows, cols, bounds, 0);
  PolarBuffer v = PolarBuffer::kX;  // where the long matrix is
  bool fresh = true;  // no polynomial accumulated since the start or restart
  for (int k = 0; k < steps; ++k) {
    if (polar_gram_restarts_before(k, restart_period)) {
      const PolarBuffer other = v == PolarBuffer::kX ? PolarBuffer::kXOperand : PolarBuffer::kX;
      apply_q(plan, rows, cols, k, v, other);
      v = other;
      gram_of_x(plan, rows, cols, bounds, k, v);
      fresh = true;
    }
    // Z = c R R + b R
    plan.push_back(slot_op(PolarOp::Kind::kCopy, PolarBuffer::kGram, PolarBuffer::kPoly, none, k));
    symmetric_product(plan, PolarBuffer::kPoly, PolarBuffer::kGram, PolarBuffer::kGram, PolarScalar::kC,
                      PolarScalar::kB, side, bounds, k);
    if (fresh) {  // Q = Z + a I
      plan.push_back(slot_op(PolarOp::Kind::kCopy, PolarBuffer::kPoly, PolarBuffer::kQ, none, k));
      plan.push_back(slot_op(PolarOp::Kind::kAddIdentity, PolarBuffer::kQ, PolarBuffer::kQ, a, k));
      fresh = false;
    } else {  // Q = Q Z + a Q
      plan.push_back(slot_op(PolarOp::Kind::kCopy, PolarBuffer::kQ, PolarBuffer::kScratch, none, k));
      symmetric_product(plan, PolarBuffer::kQ, PolarBuffer::kScratch, PolarBuffer::kPoly, one, a, side, bounds, k);
    }
    if (k + 1 < steps && !polar_gram_restarts_before(k + 1, restart_period)) {  // R = P R P, wanted by the next iteration
      plan.push_back(slot_op(PolarOp::Kind::kCopy, PolarBuffer::kGram, PolarBuffer::kScratch, none, k));
      symmetric_product(plan, PolarBuffer::kScratch, PolarBuffer::kGram, PolarBuffer::kPoly, one, a, side, bounds, k);
      plan.push_back(slot_op(PolarOp::Kind::kCopy, PolarBuffer::kScratch, PolarBuffer::kGram, none, k));
      symmetric_product(plan, PolarBuffer::kGram, PolarBuffer::kPoly, PolarBuffer::kScratch, one, a, side, bounds, k);
    }
  }
  apply_q(plan, rows, cols, steps - 1, v, PolarBuffer::kX);
  return plan;
}

// Every iteration of `method` (kStandard or kGram, as polar_method_for gives)
// as one plan; each op's `step` says whose (a, b, c) it takes. Gram's restarts
// follow `gram_restart_period` (polar_gram_restart_period of the precision).
inline std::vector<PolarOp> polar_plan(PolarMethod method, int64_t rows, int64_t cols,
                                       const std::vector<int64_t>& bounds, int steps, int gram_restart_period) {
  if (method == PolarMethod::kGram) return polar_gram_plan(rows, cols, bounds, steps, gram_restart_period);
  std::vector<PolarOp> plan;
  const std::vector<PolarOp> iteration = polar_iteration_plan(rows, cols, bounds);
  for (int k = 0; k < steps; ++k) {
    for (PolarOp op : iteration) {
      op.step = k;
      plan.push_back(op);
    }
  }
  return plan;
}

// Whether any op of `plan` reads or writes `buffer` (scratch is allocated for those only).
inline bool polar_plan_uses(const std::vector<PolarOp>& plan, PolarBuffer buffer) {
  for (const PolarOp& op : plan) {
    if (op.kind == PolarOp::Kind::kGemm) {
      if (op.out.buffer == buffer || op.lhs.buffer == buffer || op.rhs.buffer == buffer) return true;
    } else if (op.from == buffer || op.to == buffer) {
      return true;
    }
  }
  return false;
}

// CPU output panels: GEMMs are cut into row panels of about this many rows,
// a function of the shape only, so a matrix's GEMM calls (and their bits) do
// not depend on the thread count (docs/design.md, "CPU kernels").
constexpr int64_t kPolarPanelRowsCpu = 128;

// The plan as the CPU runs it: every GEMM cut into near-equal output row
// panels of at most `panel_rows` rows (the lhs rows with them), and each run of
// consecutive GEMMs writing one buffer made one stage: they write disjoint
// parts of it and read only other buffers (and, through beta, their own part),
// so a stage's GEMMs may run in any order or concurrently. A GEMM writing
// another buffer starts a new stage (it may read what the stage wrote); a
// copy, mirror or identity add is a stage alone.
inline std::vector<std::vector<PolarOp>> polar_stages(const std::vector<PolarOp>& plan, int64_t panel_rows) {
  std::vector<std::vector<PolarOp>> stages;
  bool in_gemm_stage = false;
  PolarBuffer stage_buffer = PolarBuffer::kX;
  for (const PolarOp& op : plan) {
    if (op.kind != PolarOp::Kind::kGemm) {
      stages.push_back({op});
      in_gemm_stage = false;
      continue;
    }
    if (!in_gemm_stage || stage_buffer != op.out.buffer) stages.emplace_back();
    in_gemm_stage = true;
    stage_buffer = op.out.buffer;
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

// Elements per matrix of each buffer (the [side, side] ones: all but X and XOperand).
inline int64_t polar_buffer_numel(PolarBuffer buffer, int64_t rows, int64_t cols) {
  const int64_t side = std::min(rows, cols);
  return buffer == PolarBuffer::kX || buffer == PolarBuffer::kXOperand ? rows * cols : side * side;
}

// A stage as an executor runs it: the ops of one polar_stages stage and, for
// its GEMMs, the buffer their beta term reads (`addend`): their output's own
// buffer, or another one holding the same values at the same offsets (a copy
// folded away below). A GEMM whose addend is not its output's buffer is
// "out of place": out = alpha lhs rhs + beta addend (at::addmm_out with
// self != out on the CPU, cublasLt with C != D on CUDA), one rounding as ever.
struct PolarStage {
  std::vector<PolarOp> ops;
  PolarBuffer addend;
};

// The stages with each copy into a buffer T folded into the GEMM stage right
// after it, when that stage writes T and its outputs, with the mirror after
// it, cover all of T: every element of T the copy wrote is then read only
// through a GEMM's beta term, which reads the copy's source instead (same
// values, so the same bits), and the copy is skipped. That is every
// "Poly = c Gram Gram + b Gram" and Gram Newton-Schulz R update: a copy of a
// [side, side] matrix less per symmetric product. Used by the CPU and CUDA.
inline std::vector<PolarStage> polar_fold_copies(const std::vector<std::vector<PolarOp>>& stages, int64_t rows,
                                                 int64_t cols, const std::vector<int64_t>& bounds) {
  const int64_t side = std::min(rows, cols);
  int64_t mirrored = side * side;  // elements below the diagonal blocks
  for (size_t i = 0; i + 1 < bounds.size(); ++i) mirrored -= (bounds[i + 1] - bounds[i]) * (bounds[i + 1] - bounds[i]);
  mirrored /= 2;
  std::vector<PolarStage> out;
  for (size_t i = 0; i < stages.size(); ++i) {
    const PolarOp& first = stages[i].front();
    if (first.kind == PolarOp::Kind::kCopy && i + 1 < stages.size()) {
      const std::vector<PolarOp>& next = stages[i + 1];
      const PolarBuffer to = first.to;
      if (next.front().kind == PolarOp::Kind::kGemm && next.front().out.buffer == to) {
        int64_t covered = 0;
        for (const PolarOp& op : next) covered += op.out.rows * op.out.cols;
        if (i + 2 < stages.size() && stages[i + 2].front().kind == PolarOp::Kind::kMirror &&
            stages[i + 2].front().to == to) {
          covered += mirrored;
        }
        if (covered == polar_buffer_numel(to, rows, cols)) {
          out.push_back({next, first.from});
          ++i;
          continue;
        }
      }
    }
    out.push_back({stages[i], first.kind == PolarOp::Kind::kGemm ? first.out.buffer : PolarBuffer::kX});
  }
  return out;
}

// The X GEMM's copy removed by swapping buffers, for an executor with
// out-of-place GEMMs (CUDA): "copy F -> T, then F = alpha (lhs rhs, one of them
// T) + beta F", the GEMM writing all of F in one op, becomes "T = alpha (the
// same product reading F for T) + beta F", after which T holds what F would
// and F what T would (the copy): every later op has F and T exchanged. That
// is X = Poly X + a X (and the Gram plan's X = Q X) without the copy of the
// long matrix into XOperand. Where X's contents end up in XOperand, a last
// copy brings them back.
inline std::vector<PolarStage> polar_swap_copied_operands(const std::vector<PolarStage>& stages, int64_t rows,
                                                          int64_t cols) {
  std::array<PolarBuffer, kPolarBufferCount> holder{};  // holder[b]: the buffer now holding the plan's b
  for (int b = 0; b < kPolarBufferCount; ++b) holder[b] = static_cast<PolarBuffer>(b);
  auto rename = [&](PolarBuffer& b) { b = holder[static_cast<int>(b)]; };
  std::vector<PolarStage> out;
  for (size_t i = 0; i < stages.size(); ++i) {
    PolarStage stage = stages[i];
    for (PolarOp& op : stage.ops) {
      rename(op.out.buffer), rename(op.lhs.buffer), rename(op.rhs.buffer), rename(op.from), rename(op.to);
    }
    rename(stage.addend);
    const PolarOp& copy = stage.ops.front();
    if (copy.kind == PolarOp::Kind::kCopy && i + 1 < stages.size() && stages[i + 1].ops.size() == 1) {
      PolarStage next = stages[i + 1];
      PolarOp& gemm = next.ops.front();
      rename(gemm.out.buffer), rename(gemm.lhs.buffer), rename(gemm.rhs.buffer), rename(next.addend);
      const PolarBuffer from = copy.from, to = copy.to;
      const bool reads_copy_once = (gemm.lhs.buffer == to) != (gemm.rhs.buffer == to) && gemm.lhs.buffer != from &&
                                   gemm.rhs.buffer != from;
      if (gemm.kind == PolarOp::Kind::kGemm && gemm.out.buffer == from && next.addend == from && reads_copy_once &&
          gemm.out.rows * gemm.out.cols == polar_buffer_numel(from, rows, cols)) {
        gemm.out.buffer = to;
        (gemm.lhs.buffer == to ? gemm.lhs.buffer : gemm.rhs.buffer) = from;
        out.push_back(next);
        const PolarOp& named = stages[i].ops.front();  // the plan's own names for F and T
        std::swap(holder[static_cast<int>(named.from)], holder[static_cast<int>(named.to)]);
        ++i;
        continue;
      }
    }
    out.push_back(stage);
  }
  // Only whole-slot copies of X-shaped buffers swap, so X's contents are in X or XOperand.
  const PolarBuffer x_holder = holder[static_cast<int>(PolarBuffer::kX)];
  if (x_holder != PolarBuffer::kX) {
    PolarOp back{PolarOp::Kind::kCopy, {}, {}, {}, PolarScalar::kZero, PolarScalar::kZero, x_holder, PolarBuffer::kX};
    out.push_back({{back}, PolarBuffer::kX});
  }
  return out;
}

}  // namespace muon_ext

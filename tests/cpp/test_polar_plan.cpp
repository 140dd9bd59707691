// The Polar-Express iteration plan (csrc/common/polar_plan.h) executed with
// cuBLAS's column-major GEMM semantics, in double, against the iteration
// written out directly: checks every transpose, offset and leading dimension
// the CUDA kernel hands to cuBLAS, plain and block-triangular, without a GPU,
// and the CPU's row-panel stages (polar_stages) the same way.
#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <random>
#include <set>
#include <tuple>
#include <vector>

#include "csrc/common/polar_plan.h"

namespace muon_ext {
namespace {

using Matrix = std::vector<double>;  // row-major

// Row block of row i (bounds as from polar_block_bounds).
int64_t polar_block_of(const std::vector<int64_t>& bounds, int64_t i) {
  return static_cast<int64_t>(std::upper_bound(bounds.begin(), bounds.end(), i) - bounds.begin()) - 1;
}

struct Slots {
  std::array<Matrix, kPolarBufferCount> buffer;
  Matrix& operator[](PolarBuffer b) { return buffer[static_cast<int>(b)]; }
};

// cublasGemmEx on one matrix: C = alpha op_a(A) op_b(B) + beta C, column-major.
void column_major_gemm(const ColumnMajorGemm& g, double alpha, double beta, Slots& s) {
  const Matrix a = s[g.a], b = s[g.b];  // copies: C may share a buffer, never elements
  Matrix& c = s[g.c];
  for (int64_t j = 0; j < g.n; ++j) {
    for (int64_t i = 0; i < g.m; ++i) {
      double sum = 0.0;
      for (int64_t p = 0; p < g.k; ++p) {
        const double av = g.trans_a ? a.at(g.a_offset + p + i * g.lda) : a.at(g.a_offset + i + p * g.lda);
        const double bv = g.trans_b ? b.at(g.b_offset + j + p * g.ldb) : b.at(g.b_offset + p + j * g.ldb);
        sum += av * bv;
      }
      double& out = c.at(g.c_offset + i + j * g.ldc);
      out = alpha * sum + (beta == 0.0 ? 0.0 : beta * out);
    }
  }
}

using Coefficients = std::vector<std::array<double, 3>>;

void execute(const std::vector<PolarOp>& plan, const std::vector<int64_t>& bounds, const Coefficients& abc,
             int64_t side, Slots& s) {
  for (const PolarOp& op : plan) {
    const auto [a, b, c] = abc.at(op.step);
    switch (op.kind) {
      case PolarOp::Kind::kGemm:
        column_major_gemm(to_column_major(op), polar_scalar_value(op.alpha, a, b, c),
                          polar_scalar_value(op.beta, a, b, c), s);
        break;
      case PolarOp::Kind::kAddIdentity:
        for (int64_t i = 0; i < side; ++i) s[op.to].at(i * side + i) += polar_scalar_value(op.alpha, a, b, c);
        break;
      case PolarOp::Kind::kCopy:
        s[op.to] = s[op.from];
        break;
      case PolarOp::Kind::kMirror:
        for (int64_t i = 0; i < side; ++i)
          for (int64_t j = 0; j < side; ++j)
            if (polar_block_of(bounds, i) > polar_block_of(bounds, j)) s[op.to][i * side + j] = s[op.to][j * side + i];
        break;
    }
  }
}

Matrix matmul(const Matrix& l, const Matrix& r, int64_t n, int64_t k, int64_t m) {  // [n,k] x [k,m]
  Matrix out(n * m, 0.0);
  for (int64_t i = 0; i < n; ++i)
    for (int64_t p = 0; p < k; ++p)
      for (int64_t j = 0; j < m; ++j) out[i * m + j] += l[i * k + p] * r[p * m + j];
  return out;
}

Matrix transpose(const Matrix& x, int64_t rows, int64_t cols) {
  Matrix out(x.size());
  for (int64_t i = 0; i < rows; ++i)
    for (int64_t j = 0; j < cols; ++j) out[j * rows + i] = x[i * cols + j];
  return out;
}

// One iteration exactly as docs/design.md writes it ("Muon in three phases").
Matrix direct_iteration(const Matrix& x, int64_t rows, int64_t cols, double a, double b, double c) {
  const int64_t side = std::min(rows, cols);
  const bool wide = rows <= cols;
  const Matrix xt = transpose(x, rows, cols);
  const Matrix gram = wide ? matmul(x, xt, rows, cols, rows) : matmul(xt, x, cols, rows, cols);
  Matrix poly = matmul(gram, gram, side, side, side);
  for (size_t i = 0; i < poly.size(); ++i) poly[i] = b * gram[i] + c * poly[i];
  Matrix next = wide ? matmul(poly, x, rows, rows, cols) : matmul(x, poly, rows, cols, cols);
  for (size_t i = 0; i < next.size(); ++i) next[i] += a * x[i];
  return next;
}

class PolarPlanTest : public ::testing::TestWithParam<std::tuple<int64_t, int64_t, int64_t>> {};

TEST_P(PolarPlanTest, ExecutesOneIterationExactly) {
  const auto [rows, cols, blocks] = GetParam();
  const int64_t side = std::min(rows, cols);
  const std::vector<int64_t> bounds = polar_block_bounds(side, blocks);
  std::mt19937 gen(static_cast<unsigned>(rows * 1000 + cols * 10 + blocks));
  std::normal_distribution<double> normal;
  Slots s;
  for (int k = 0; k < kPolarBufferCount; ++k) {
    // Garbage in the scratch buffers: the plan must not read what it did not write.
    s.buffer[k].assign(polar_buffer_numel(static_cast<PolarBuffer>(k), rows, cols), std::nan(""));
  }
  for (double& v : s[PolarBuffer::kX]) v = normal(gen) * 0.1;
  const double a = 3.4, b = -2.7, c = 0.5;
  const Matrix expected = direct_iteration(s[PolarBuffer::kX], rows, cols, a, b, c);

  execute(polar_iteration_plan(rows, cols, bounds), bounds, {{a, b, c}}, side, s);
  const Matrix& got = s[PolarBuffer::kX];
  ASSERT_EQ(got.size(), expected.size());
  for (size_t i = 0; i < got.size(); ++i) {
    ASSERT_NEAR(got[i], expected[i], 1e-12 * (1.0 + std::abs(expected[i]))) << "element " << i;
  }
  // Gram and Poly come out exactly symmetric when blocked (mirrored).
  if (bounds.size() > 2) {
    for (PolarBuffer buf : {PolarBuffer::kGram, PolarBuffer::kPoly})
      for (int64_t i = 0; i < side; ++i)
        for (int64_t j = 0; j < side; ++j) ASSERT_EQ(s[buf][i * side + j], s[buf][j * side + i]);
  }
}

INSTANTIATE_TEST_SUITE_P(Shapes, PolarPlanTest,
                         ::testing::Combine(::testing::Values(1, 3, 8, 13), ::testing::Values(1, 5, 8, 21),
                                            ::testing::Values(1, 2, 3, 8)));

// Every element a view covers, as (buffer, index) keys.
std::set<std::pair<int, int64_t>> elements(const PolarView& v) {
  std::set<std::pair<int, int64_t>> out;
  for (int64_t i = 0; i < v.rows; ++i)
    for (int64_t j = 0; j < v.cols; ++j)
      out.insert({static_cast<int>(v.buffer), v.transposed ? v.offset + j * v.ld + i : v.offset + i * v.ld + j});
  return out;
}

// The CPU's staged plan (row panels, csrc/cpu/polar_express_cpu.cpp): run stage by
// stage, each GEMM stage's panels in the given order, it computes the
// iteration; its GEMM stages are independent (no panel writes what another
// panel of the stage reads or writes), which is what lets the CPU run them on
// any threads in any order with the same bits.
class PolarStagesTest : public ::testing::TestWithParam<std::tuple<int64_t, int64_t, int64_t, int64_t>> {};

TEST_P(PolarStagesTest, PanelsComputeTheIterationInAnyOrder) {
  const auto [rows, cols, blocks, panel_rows] = GetParam();
  const int64_t side = std::min(rows, cols);
  const std::vector<int64_t> bounds = polar_block_bounds(side, blocks);
  const std::vector<std::vector<PolarOp>> stages = polar_stages(polar_iteration_plan(rows, cols, bounds), panel_rows);
  std::mt19937 gen(static_cast<unsigned>(rows * 1000 + cols * 10 + blocks + 7 * panel_rows));
  std::normal_distribution<double> normal;
  Slots start;
  for (int k = 0; k < kPolarBufferCount; ++k) {
    start.buffer[k].assign(polar_buffer_numel(static_cast<PolarBuffer>(k), rows, cols), std::nan(""));
  }
  for (double& v : start[PolarBuffer::kX]) v = normal(gen) * 0.1;
  const double a = 3.4, b = -2.7, c = 0.5;
  const Matrix expected = direct_iteration(start[PolarBuffer::kX], rows, cols, a, b, c);

  for (const bool reversed : {false, true}) {
    SCOPED_TRACE(reversed ? "panels in reverse order" : "panels in order");
    Slots s = start;
    for (std::vector<PolarOp> stage : stages) {
      if (reversed) std::reverse(stage.begin(), stage.end());
      execute(stage, bounds, {{a, b, c}}, side, s);
    }
    const Matrix& got = s[PolarBuffer::kX];
    ASSERT_EQ(got.size(), expected.size());
    for (size_t i = 0; i < got.size(); ++i) {
      ASSERT_NEAR(got[i], expected[i], 1e-12 * (1.0 + std::abs(expected[i]))) << "element " << i;
    }
  }

  size_t gemms = 0;
  for (const std::vector<PolarOp>& stage : stages) {
    for (size_t i = 0; i < stage.size(); ++i) {
      const PolarOp& op = stage[i];
      if (op.kind != PolarOp::Kind::kGemm) {
        ASSERT_EQ(stage.size(), 1u) << "a copy or mirror shares its stage";
        continue;
      }
      ++gemms;
      ASSERT_LE(op.out.rows, panel_rows);
      const auto out = elements(op.out);
      for (size_t j = 0; j < stage.size(); ++j) {
        if (j == i) continue;
        for (const PolarView& other : {stage[j].out, stage[j].lhs, stage[j].rhs}) {
          for (const auto& e : elements(other)) ASSERT_EQ(out.count(e), 0u) << "panels " << i << " and " << j << " overlap";
        }
      }
    }
  }
  // The panels tile each GEMM's output: as many output elements as the plain plan's GEMMs.
  int64_t planned = 0, staged = 0;
  for (const PolarOp& op : polar_iteration_plan(rows, cols, bounds))
    if (op.kind == PolarOp::Kind::kGemm) planned += op.out.rows * op.out.cols;
  for (const std::vector<PolarOp>& stage : stages)
    for (const PolarOp& op : stage)
      if (op.kind == PolarOp::Kind::kGemm) staged += op.out.rows * op.out.cols;
  EXPECT_EQ(staged, planned);
  EXPECT_GT(gemms, 0u);
}

INSTANTIATE_TEST_SUITE_P(Shapes, PolarStagesTest,
                         ::testing::Combine(::testing::Values(1, 7, 13), ::testing::Values(1, 5, 21),
                                            ::testing::Values(1, 3), ::testing::Values(1, 2, 5, 128)));

TEST(PolarPlan, CpuPanelsOfLargeMatrices) {
  // A 1024-side matrix with 8 row blocks: the Gram and Poly stages keep one
  // panel per 128-row block, the update GEMM is cut into 8 panels.
  const std::vector<int64_t> bounds = polar_block_bounds(1024, polar_row_blocks_cpu(1024));
  const auto stages = polar_stages(polar_iteration_plan(1024, 1024, bounds), kPolarPanelRowsCpu);
  std::vector<size_t> gemm_stage_sizes;
  for (const auto& stage : stages)
    if (stage.front().kind == PolarOp::Kind::kGemm) gemm_stage_sizes.push_back(stage.size());
  EXPECT_EQ(gemm_stage_sizes, (std::vector<size_t>{8, 8, 8}));
  // Panels depend on the shape only: near-equal, at most kPolarPanelRowsCpu rows.
  const auto tall = polar_stages(polar_iteration_plan(300, 20, polar_block_bounds(20, 1)), kPolarPanelRowsCpu);
  EXPECT_EQ(tall.back().size(), 3u);
  EXPECT_EQ(tall.back()[0].out.rows, 100);
}

TEST(PolarPlan, PlainPlanIsTheThreeGemmsOfTheCudaKernel) {
  // The cuBLAS calls of the unblocked iteration, as derived by hand in
  // csrc/cuda/polar_express_cuda.cu's header comment (S = X^T's storage).
  for (const auto& [rows, cols] : {std::pair<int64_t, int64_t>{4, 6}, {6, 4}}) {
    const int64_t s = std::min(rows, cols);
    std::vector<ColumnMajorGemm> gemms;
    for (const PolarOp& op : polar_iteration_plan(rows, cols, polar_block_bounds(s, 1))) {
      ASSERT_NE(op.kind, PolarOp::Kind::kMirror);
      if (op.kind == PolarOp::Kind::kGemm) gemms.push_back(to_column_major(op));
    }
    ASSERT_EQ(gemms.size(), 3u);
    const ColumnMajorGemm& gram = gemms[0];
    const ColumnMajorGemm& update = gemms[2];
    if (rows <= cols) {
      EXPECT_TRUE(gram.trans_a && !gram.trans_b);
      EXPECT_EQ(std::make_tuple(gram.m, gram.n, gram.k, gram.lda, gram.ldb, gram.ldc),
                std::make_tuple(s, s, cols, cols, cols, s));
      EXPECT_EQ(std::make_tuple(update.a, update.b, update.m, update.n, update.k),
                std::make_tuple(PolarBuffer::kXOperand, PolarBuffer::kPoly, cols, s, s));
    } else {
      EXPECT_TRUE(!gram.trans_a && gram.trans_b);
      EXPECT_EQ(std::make_tuple(gram.m, gram.n, gram.k), std::make_tuple(s, s, rows));
      EXPECT_EQ(std::make_tuple(update.a, update.b, update.m, update.n, update.k),
                std::make_tuple(PolarBuffer::kPoly, PolarBuffer::kXOperand, s, rows, s));
    }
  }
}

// cuBLAS rejects (CUBLAS_STATUS_INVALID_VALUE) a leading dimension below the
// stored operand's row count; every operand must also stay inside its slot.
TEST(PolarPlan, EveryGemmMeetsCublasRules) {
  for (int64_t rows = 1; rows <= 24; ++rows) {
    for (int64_t cols = 1; cols <= 24; ++cols) {
      const int64_t side = std::min(rows, cols);
      for (int64_t blocks : {1, 2, 3, 5, 64}) {
        for (const PolarOp& op : polar_iteration_plan(rows, cols, polar_block_bounds(side, blocks))) {
          if (op.kind != PolarOp::Kind::kGemm) continue;
          const ColumnMajorGemm g = to_column_major(op);
          // Stored column-major shapes: A is m x k (k x m when transposed), B is k x n (n x k), C is m x n.
          const int64_t a_rows = g.trans_a ? g.k : g.m, a_cols = g.trans_a ? g.m : g.k;
          const int64_t b_rows = g.trans_b ? g.n : g.k, b_cols = g.trans_b ? g.k : g.n;
          ASSERT_GE(g.lda, std::max<int64_t>(1, a_rows));
          ASSERT_GE(g.ldb, std::max<int64_t>(1, b_rows));
          ASSERT_GE(g.ldc, std::max<int64_t>(1, g.m));
          auto last = [](int64_t offset, int64_t r, int64_t c, int64_t ld) { return offset + (c - 1) * ld + r - 1; };
          ASSERT_LT(last(g.a_offset, a_rows, a_cols, g.lda), polar_buffer_numel(g.a, rows, cols));
          ASSERT_LT(last(g.b_offset, b_rows, b_cols, g.ldb), polar_buffer_numel(g.b, rows, cols));
          ASSERT_LT(last(g.c_offset, g.m, g.n, g.ldc), polar_buffer_numel(g.c, rows, cols));
          ASSERT_NE(g.c, g.a);
          ASSERT_NE(g.c, g.b);
        }
      }
    }
  }
}

TEST(PolarPlan, BlocksSaveGemmWork) {
  auto gemm_work = [](int64_t rows, int64_t cols, int64_t blocks) {
    int64_t work = 0;
    for (const PolarOp& op : polar_iteration_plan(rows, cols, polar_block_bounds(std::min(rows, cols), blocks)))
      if (op.kind == PolarOp::Kind::kGemm) work += op.out.rows * op.out.cols * op.lhs.cols;
    return work;
  };
  const int64_t s = 1024, plain = gemm_work(s, s, 1);
  EXPECT_EQ(plain, 3 * s * s * s);
  // n blocks: the two symmetric products cost (n + 1) / 2n of a full one each.
  EXPECT_EQ(gemm_work(s, s, 2), s * s * s * (1 + 2 * 3 / 4.0));
  EXPECT_EQ(gemm_work(s, s, 8), s * s * s * (1 + 2 * 9 / 16.0));
}

TEST(PolarPlan, BlockBoundsAndRowBlocks) {
  EXPECT_EQ(polar_block_bounds(10, 3), (std::vector<int64_t>{0, 3, 6, 10}));
  EXPECT_EQ(polar_block_bounds(3, 8), (std::vector<int64_t>{0, 1, 2, 3}));
  EXPECT_EQ(polar_block_bounds(5, 0), (std::vector<int64_t>{0, 5}));
  EXPECT_EQ(polar_block_bounds(0, 4), (std::vector<int64_t>{0, 0}));
  const std::vector<int64_t> bounds = polar_block_bounds(10, 3);
  EXPECT_EQ(polar_block_of(bounds, 0), 0);
  EXPECT_EQ(polar_block_of(bounds, 2), 0);
  EXPECT_EQ(polar_block_of(bounds, 3), 1);
  EXPECT_EQ(polar_block_of(bounds, 9), 2);
  EXPECT_EQ(polar_row_blocks_cpu(100), 1);
  EXPECT_EQ(polar_row_blocks_cpu(256), 2);
  EXPECT_EQ(polar_row_blocks_cpu(1024), 8);
  EXPECT_EQ(polar_row_blocks_cpu(8192), 8);
}

// ---------------------------------------------------------------------------
// Gram Newton-Schulz (polar_gram_plan)
// ---------------------------------------------------------------------------

// Seven iterations' (a, b, c): three restarts (before 2, 4 and 6) fit in at
// BF16 / FP16's period, two (before 2 and 5) at FP32's.
const Coefficients kSteps = {{3.4, -4.7, 2.0}, {4.0, -2.8, 0.5}, {3.9, -2.8, 0.5}, {3.3, -2.4, 0.46},
                             {2.3, -1.7, 0.42}, {2.0, -1.4, 0.4}, {1.9, -1.3, 0.38}};

Slots random_slots(int64_t rows, int64_t cols, unsigned seed) {
  std::mt19937 gen(seed);
  std::normal_distribution<double> normal;
  Slots s;
  for (int k = 0; k < kPolarBufferCount; ++k) {
    s.buffer[k].assign(polar_buffer_numel(static_cast<PolarBuffer>(k), rows, cols), std::nan(""));
  }
  // Frobenius norm 0.9, below 1 as the iteration's input: the polynomials stay bounded.
  double sum = 0.0;
  for (double& v : s[PolarBuffer::kX]) {
    v = normal(gen);
    sum += v * v;
  }
  for (double& v : s[PolarBuffer::kX]) v *= 0.9 / std::sqrt(sum);
  return s;
}

// `steps` standard iterations written out directly.
Matrix direct_iterations(Matrix x, int64_t rows, int64_t cols, const Coefficients& abc, int steps) {
  for (int k = 0; k < steps; ++k) x = direct_iteration(x, rows, cols, abc[k][0], abc[k][1], abc[k][2]);
  return x;
}

class GramPlanTest : public ::testing::TestWithParam<std::tuple<int64_t, int64_t, int64_t, int, int>> {};

TEST_P(GramPlanTest, ComputesTheStandardPolynomial) {
  const auto [rows, cols, blocks, steps, period] = GetParam();
  const int64_t side = std::min(rows, cols);
  const std::vector<int64_t> bounds = polar_block_bounds(side, blocks);
  Slots s = random_slots(rows, cols, static_cast<unsigned>(rows * 7919 + cols * 31 + blocks * 7 + steps));
  const Matrix expected = direct_iterations(s[PolarBuffer::kX], rows, cols, kSteps, steps);
  const std::vector<PolarOp> plan = polar_plan(PolarMethod::kGram, rows, cols, bounds, steps, period);
  execute(plan, bounds, kSteps, side, s);
  for (size_t i = 0; i < expected.size(); ++i) {
    ASSERT_NEAR(s[PolarBuffer::kX][i], expected[i], 1e-11 * (1.0 + std::abs(expected[i]))) << "element " << i;
  }
  // The wide X is multiplied (V V^T or Q V) once at the start, twice per
  // restart and once at the end: every other GEMM is [side, side].
  int64_t long_gemms = 0;
  for (const PolarOp& op : plan) {
    if (op.kind != PolarOp::Kind::kGemm) continue;
    const bool touches_x = op.lhs.buffer == PolarBuffer::kX || op.lhs.buffer == PolarBuffer::kXOperand ||
                           op.rhs.buffer == PolarBuffer::kX || op.rhs.buffer == PolarBuffer::kXOperand;
    if (touches_x) ++long_gemms;
  }
  const int restarts = steps > kGramFirstRestart ? (steps - 1 - kGramFirstRestart) / period + 1 : 0;
  EXPECT_EQ(long_gemms, int64_t(bounds.size() - 1) * (1 + restarts) + 1 + restarts);
}

INSTANTIATE_TEST_SUITE_P(Shapes, GramPlanTest,
                         ::testing::Combine(::testing::Values(1, 4, 9), ::testing::Values(1, 6, 23),
                                            ::testing::Values(1, 3), ::testing::Values(1, 2, 3, 4, 7),
                                            ::testing::Values(kGramRestartPeriodHalf, kGramRestartPeriod)));

TEST(GramPlan, StagesComputeItWithPanelsInAnyOrderAndNoOverlap) {
  for (const auto& [rows, cols] : {std::pair<int64_t, int64_t>{13, 40}, {40, 13}}) {
    const int64_t side = std::min(rows, cols);
    const std::vector<int64_t> bounds = polar_block_bounds(side, 3);
    const std::vector<PolarOp> plan = polar_plan(PolarMethod::kGram, rows, cols, bounds, 5, kGramRestartPeriodHalf);
    const Slots start = random_slots(rows, cols, 11);
    const Matrix expected = direct_iterations(start.buffer[0], rows, cols, kSteps, 5);
    for (const int64_t panel_rows : {2, 5}) {
      const auto stages = polar_stages(plan, panel_rows);
      for (const bool reversed : {false, true}) {
        Slots s = start;
        for (std::vector<PolarOp> stage : stages) {
          if (reversed) std::reverse(stage.begin(), stage.end());
          execute(stage, bounds, kSteps, side, s);
        }
        for (size_t i = 0; i < expected.size(); ++i) {
          ASSERT_NEAR(s[PolarBuffer::kX][i], expected[i], 1e-11 * (1.0 + std::abs(expected[i])));
        }
      }
      for (const auto& stage : stages) {
        if (stage.front().kind != PolarOp::Kind::kGemm) {
          ASSERT_EQ(stage.size(), 1u);
          continue;
        }
        for (size_t i = 0; i < stage.size(); ++i) {
          ASSERT_EQ(stage[i].out.buffer, stage[0].out.buffer) << "a stage writes one buffer";
          const auto out = elements(stage[i].out);
          for (size_t j = 0; j < stage.size(); ++j) {
            for (const PolarView& other : {stage[j].lhs, stage[j].rhs}) {
              for (const auto& e : elements(other)) ASSERT_EQ(out.count(e), 0u) << "a panel reads what one writes";
            }
            if (j == i) continue;
            for (const auto& e : elements(stage[j].out)) ASSERT_EQ(out.count(e), 0u) << "panels overlap";
          }
        }
      }
    }
  }
}

TEST(GramPlan, EveryGemmMeetsCublasRules) {
  for (int64_t rows = 1; rows <= 12; ++rows) {
    for (int64_t cols = 1; cols <= 12; ++cols) {
      const int64_t side = std::min(rows, cols);
      for (int64_t blocks : {1, 2, 5}) {
        for (const PolarOp& op :
             polar_plan(PolarMethod::kGram, rows, cols, polar_block_bounds(side, blocks), 5, kGramRestartPeriodHalf)) {
          if (op.kind != PolarOp::Kind::kGemm) continue;
          const ColumnMajorGemm g = to_column_major(op);
          const int64_t a_rows = g.trans_a ? g.k : g.m, b_rows = g.trans_b ? g.n : g.k;
          ASSERT_GE(g.lda, std::max<int64_t>(1, a_rows));
          ASSERT_GE(g.ldb, std::max<int64_t>(1, b_rows));
          ASSERT_GE(g.ldc, std::max<int64_t>(1, g.m));
          ASSERT_NE(g.c, g.a);
          ASSERT_NE(g.c, g.b);
        }
      }
    }
  }
}

TEST(GramPlan, SavesGemmWorkAtAspectRatioFour) {
  // Multiply-adds of the plans on the CPU's blocks for 1024x4096, five steps.
  auto work = [](PolarMethod method, int64_t rows, int64_t cols, int period) {
    const std::vector<int64_t> bounds = polar_block_bounds(std::min(rows, cols), polar_row_blocks_cpu(std::min(rows, cols)));
    double total = 0;
    for (const PolarOp& op : polar_plan(method, rows, cols, bounds, 5, period))
      if (op.kind == PolarOp::Kind::kGemm) total += double(op.out.rows) * op.out.cols * op.lhs.cols;
    return total;
  };
  const double standard = work(PolarMethod::kStandard, 1024, 4096, kGramRestartPeriod);
  // BF16 / FP16, restarting before iterations 2 and 4: 34.1 s^3 against 24.9 s^3 multiply-adds.
  const double half_ratio = standard / work(PolarMethod::kGram, 1024, 4096, kGramRestartPeriodHalf);
  EXPECT_GT(half_ratio, 1.3);
  EXPECT_LT(half_ratio, 1.45);
  // FP32, restarting before iteration 2 only: 34.1 s^3 against 20.4 s^3.
  const double ratio = standard / work(PolarMethod::kGram, 1024, 4096, kGramRestartPeriod);
  EXPECT_GT(ratio, 1.6);
  EXPECT_LT(ratio, 1.75);
  EXPECT_EQ(work(PolarMethod::kGram, 4096, 1024, kGramRestartPeriod),
            work(PolarMethod::kGram, 1024, 4096, kGramRestartPeriod));
  // Square: Gram costs more than it saves.
  EXPECT_LT(work(PolarMethod::kStandard, 1024, 1024, kGramRestartPeriod),
            work(PolarMethod::kGram, 1024, 1024, kGramRestartPeriod));
}

TEST(GramPlan, StandardPlanRepeatsTheIteration) {
  const std::vector<int64_t> bounds = polar_block_bounds(5, 2);
  const std::vector<PolarOp> one = polar_iteration_plan(5, 9, bounds);
  const std::vector<PolarOp> all = polar_plan(PolarMethod::kStandard, 5, 9, bounds, 3, kGramRestartPeriod);
  ASSERT_EQ(all.size(), 3 * one.size());
  for (size_t i = 0; i < all.size(); ++i) EXPECT_EQ(all[i].step, int(i / one.size()));
  EXPECT_FALSE(polar_plan_uses(all, PolarBuffer::kQ));
  EXPECT_TRUE(polar_plan_uses(polar_plan(PolarMethod::kGram, 5, 9, bounds, 3, kGramRestartPeriod), PolarBuffer::kQ));
  EXPECT_TRUE(polar_plan(PolarMethod::kGram, 5, 9, bounds, 0, kGramRestartPeriod).empty());
}

TEST(GramPlan, AutoRule) {
  EXPECT_EQ(polar_method_for(PolarMethod::kStandard, 128, 4096), PolarMethod::kStandard);
  EXPECT_EQ(polar_method_for(PolarMethod::kGram, 8, 8), PolarMethod::kGram);
  EXPECT_EQ(polar_method_for(PolarMethod::kAuto, 1024, 4096), PolarMethod::kGram);
  EXPECT_EQ(polar_method_for(PolarMethod::kAuto, 4096, 1024), PolarMethod::kGram);
  EXPECT_EQ(polar_method_for(PolarMethod::kAuto, 1024, 4095), PolarMethod::kStandard);  // aspect below 4
  EXPECT_EQ(polar_method_for(PolarMethod::kAuto, 1024, 2048), PolarMethod::kStandard);
  EXPECT_EQ(polar_method_for(PolarMethod::kAuto, 256, 4096), PolarMethod::kStandard);  // short side below 512
  EXPECT_EQ(polar_method_for(PolarMethod::kAuto, 512, 2048), PolarMethod::kGram);
  const int half = polar_gram_restart_period(true), other = polar_gram_restart_period(false);
  for (int step : {2, 4, 6}) EXPECT_TRUE(polar_gram_restarts_before(step, half)) << step;
  for (int step : {0, 1, 3, 5}) EXPECT_FALSE(polar_gram_restarts_before(step, half)) << step;
  for (int step : {2, 5, 8}) EXPECT_TRUE(polar_gram_restarts_before(step, other)) << step;
  for (int step : {0, 1, 3, 4, 6}) EXPECT_FALSE(polar_gram_restarts_before(step, other)) << step;
}

// ---------------------------------------------------------------------------
// Executor stages: copies folded into out-of-place GEMMs (polar_fold_copies,
// CPU and CUDA) and the X copy swapped away (polar_swap_copied_operands, CUDA)
// ---------------------------------------------------------------------------

// Runs executor stages: a GEMM whose addend is another buffer reads its beta
// term there, at out's offsets (C != D in cublasLt's terms).
void execute_stages(const std::vector<PolarStage>& stages, const std::vector<int64_t>& bounds,
                    const Coefficients& abc, int64_t side, Slots& s) {
  for (const PolarStage& stage : stages) {
    for (const PolarOp& op : stage.ops) {
      if (op.kind == PolarOp::Kind::kGemm && stage.addend != op.out.buffer) {
        const auto [a, b, c] = abc.at(op.step);
        const double beta = polar_scalar_value(op.beta, a, b, c);
        // Out's elements get the addend's values first: the in-place GEMM then reads them through beta.
        const ColumnMajorGemm g = to_column_major(op);
        ASSERT_NE(g.c, g.a) << "an output aliases an operand";
        ASSERT_NE(g.c, g.b) << "an output aliases an operand";
        if (beta != 0.0) {
          for (int64_t j = 0; j < g.n; ++j)
            for (int64_t i = 0; i < g.m; ++i) {
              const int64_t e = g.c_offset + i + j * g.ldc;
              s[g.c].at(e) = s[stage.addend].at(e);
            }
        }
        column_major_gemm(g, polar_scalar_value(op.alpha, a, b, c), beta, s);
      } else {
        execute({op}, bounds, abc, side, s);
      }
    }
  }
}

// Copies of the long matrix (X, XOperand) and of the square buffers.
std::pair<int, int> count_copies(const std::vector<PolarStage>& stages) {
  int long_copies = 0, square_copies = 0;
  for (const PolarStage& stage : stages)
    for (const PolarOp& op : stage.ops)
      if (op.kind == PolarOp::Kind::kCopy) {
        ++(op.from == PolarBuffer::kX || op.from == PolarBuffer::kXOperand ? long_copies : square_copies);
      }
  return {long_copies, square_copies};
}

class PolarExecutorStagesTest
    : public ::testing::TestWithParam<std::tuple<PolarMethod, int64_t, int64_t, int64_t, int>> {};

TEST_P(PolarExecutorStagesTest, FoldedAndSwappedStagesGiveTheSameBits) {
  const auto [method, rows, cols, blocks, steps] = GetParam();
  const int64_t side = std::min(rows, cols);
  const std::vector<int64_t> bounds = polar_block_bounds(side, blocks);
  const std::vector<PolarOp> plan = polar_plan(method, rows, cols, bounds, steps, kGramRestartPeriodHalf);
  const Slots start = random_slots(rows, cols, static_cast<unsigned>(rows * 131 + cols * 17 + blocks + steps));
  Slots expected = start;
  execute(plan, bounds, kSteps, side, expected);

  // As CUDA runs it (one panel per GEMM), and as the CPU runs it (panels of 2 rows).
  for (const int64_t panel_rows : {std::max(rows, cols), int64_t(2)}) {
    const std::vector<PolarStage> folded = polar_fold_copies(polar_stages(plan, panel_rows), rows, cols, bounds);
    const std::vector<PolarStage> swapped = polar_swap_copied_operands(folded, rows, cols);
    for (const auto* stages : {&folded, &swapped}) {
      SCOPED_TRACE(stages == &folded ? "folded" : "swapped");
      Slots s = start;
      execute_stages(*stages, bounds, kSteps, side, s);
      // The same operations on the same values: exactly the same result.
      ASSERT_EQ(s[PolarBuffer::kX], expected[PolarBuffer::kX]);
    }
    if (panel_rows == 2) continue;  // the CPU's panels: several ops per X GEMM, nothing to swap
    // As CUDA runs it: folding leaves no copy of a square buffer into a GEMM's
    // output, swapping at most one copy of the long matrix (X back from XOperand).
    EXPECT_LE(count_copies(swapped).first, 1);
    if (method == PolarMethod::kStandard) {
      EXPECT_EQ(count_copies(folded), std::make_pair(steps, 0));
      EXPECT_EQ(count_copies(swapped), std::make_pair(steps % 2, 0));
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Shapes, PolarExecutorStagesTest,
                         ::testing::Combine(::testing::Values(PolarMethod::kStandard, PolarMethod::kGram),
                                            ::testing::Values(1, 4, 9), ::testing::Values(1, 6, 23),
                                            ::testing::Values(1, 3), ::testing::Values(1, 2, 5)));

}  // namespace
}  // namespace muon_ext

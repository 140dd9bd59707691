// The shape rules of Muon, written once (docs/design.md, "Data flow of one
// step"): how a param becomes matrices under its group's matrix_view, and the
// shape of NorMuon's statistics.  The planner's checks (step_checks.cpp), the
// ops' checks (ops.cpp), the CPU and CUDA kernels and, through _C, the Python
// side (muon_ext/_shapes.py) all use these.  Torch-free: sizes are plain
// int64_t arrays, so gtests and the CUDA sources can include it.
#pragma once

#include <cstdint>
#include <cstring>

#include "macros.h"

namespace muon_ext {
namespace shapes {

// A group's matrix_view for params of rank > 2 (common/schema.h lists the
// names); kNone: not a Muon param (AdamW), treated as "error".
enum class MatrixView : int { kNone = 0, kError = 1, kFlatten = 2, kBatch = 3 };

// "" is kNone; an unknown name is kError (the settings check refuses it first).
inline MatrixView parse_matrix_view(const char* view) {
  if (view[0] == '\0') return MatrixView::kNone;
  if (std::strcmp(view, "flatten") == 0) return MatrixView::kFlatten;
  if (std::strcmp(view, "batch") == 0) return MatrixView::kBatch;
  return MatrixView::kError;
}

// Whether a param is matrices under its view, and if not, why.
enum class MatrixRule : int {
  kMatrices = 0,      // (rows, cols) below
  kRankBelowTwo = 1,  // a vector or scalar: AdamW's
  kNeedsView = 2,     // rank > 2 under "error": the group must choose flatten or batch
};

struct Matrices {
  MatrixRule rule = MatrixRule::kMatrices;
  int64_t rows = 0, cols = 0;  // 0 unless rule is kMatrices
};

// The matrices of a param of shape sizes[0..dim): rank 2 is one matrix;
// "flatten" makes (sizes[0], prod(rest)); "batch" makes leading dims index
// matrices of (sizes[-2], sizes[-1]).  Not decided by rows: a Muon param may
// have matrices of 0 rows (shape (3, 0, 7) under "batch").
inline Matrices matrix_shape(const int64_t* sizes, int64_t dim, MatrixView view) {
  if (dim == 2) return {MatrixRule::kMatrices, sizes[0], sizes[1]};
  if (dim < 2) return {MatrixRule::kRankBelowTwo, 0, 0};
  if (view == MatrixView::kFlatten) {
    int64_t cols = 1;
    for (int64_t d = 1; d < dim; ++d) cols *= sizes[d];
    return {MatrixRule::kMatrices, sizes[0], cols};
  }
  if (view == MatrixView::kBatch) return {MatrixRule::kMatrices, sizes[dim - 2], sizes[dim - 1]};
  return {MatrixRule::kNeedsView, 0, 0};
}

// NorMuon keeps one statistic per row when rows >= cols, else one per column.
MUON_HD bool stats_per_row(int64_t rows, int64_t cols) { return rows >= cols; }
// Statistics per matrix.
MUON_HD int64_t stat_length(int64_t rows, int64_t cols) { return stats_per_row(rows, cols) ? rows : cols; }
// Length of the dimension the statistics average over.
MUON_HD int64_t reduced_length(int64_t rows, int64_t cols) { return stats_per_row(rows, cols) ? cols : rows; }

// Appends to `out` (push_back) the shape of the NorMuon statistics of a param
// of shape sizes[0..dim) whose matrices are rows x cols under `view`:
// [..., rows, 1] when stats_per_row else [..., 1, cols], the leading dims
// those of a "batch" param.  The ops see [..., rows, cols] tensors, for which
// "batch" gives the same rule.
template <typename Shape>
void second_moment_shape(const int64_t* sizes, int64_t dim, MatrixView view, int64_t rows, int64_t cols,
                         Shape& out) {
  if (dim > 2 && view == MatrixView::kBatch) {
    for (int64_t d = 0; d < dim - 2; ++d) out.push_back(sizes[d]);
  }
  const bool per_row = stats_per_row(rows, cols);
  out.push_back(per_row ? rows : 1);
  out.push_back(per_row ? 1 : cols);
}

}  // namespace shapes
}  // namespace muon_ext

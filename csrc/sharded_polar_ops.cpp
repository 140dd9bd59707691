// Polar-Express and NorMuon on a matrix split over a process group, between
// its collectives (docs/design.md, "Split matrices orthogonalized in place").
//
// A rank holds the shard X_r of each matrix X: a block of columns
// (shard_dim = 1, X = [X_0 | X_1 | ...]) or of rows (shard_dim = 0). Each
// Polar-Express iteration needs only the small Gram matrix, the sum over the
// ranks of the shards' products; the caller sums what these ops write
// (all_reduce) and hands it to the next op:
//
//   sharded_polar_norms    per-matrix sums of squares of the shards (FP64)
//   sharded_polar_scale    X_r *= 1 / (||X||_F * 1.02 + 1e-6), from the summed squares
//   sharded_polar_gram     shard_dim 1: X_r X_r^T (rows x rows); 0: X_r^T X_r (cols x cols)
//   sharded_polar_iterate  B = b A + c A A;  X_r = a X_r + B X_r  (shard_dim 1) or X_r B (0)
//   sharded_normuon_partial / sharded_normuon_finish: NorMuon with the whole
//                          matrix's statistics, one sum of a payload between them.
//
// Both Gram forms equal the whole-matrix iteration in exact arithmetic
// (X(aI + bX^TX + c(X^TX)^2) = (aI + bXX^T + c(XX^T)^2)X). Rounding follows
// polar_dtype as the whole-matrix kernels do: "bfloat16" / "float16" round
// X, A and B to that type at every product (products of rounded operands,
// FP32 accumulation), "float32" keeps FP32. The code is ATen calls on the
// inputs' device: the same arithmetic on the CPU and on CUDA (cuBLAS).
#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <cmath>
#include <optional>
#include <string>

#include "common/muon_math.h"
#include "common/shapes.h"

namespace muon_ext {

// The Muon formulas of common/muon_math.h, evaluated on tensors: the constants stay written once.
template <>
struct MuonMathOps<at::Tensor> {
  static at::Tensor sqrt(const at::Tensor& x) { return x.sqrt(); }
  static at::Tensor at_least(const at::Tensor& x, float floor) {  // floor for NaN, as the float form
    return at::where(x > floor, x, at::scalar_tensor(floor, x.options()));
  }
};

namespace {

using OptionalTensor = std::optional<at::Tensor>;

std::optional<at::ScalarType> rounding_of(c10::string_view polar_dtype, const char* op) {
  if (polar_dtype == "bfloat16") return at::kBFloat16;
  if (polar_dtype == "float16") return at::kHalf;
  TORCH_CHECK_VALUE(polar_dtype == "float32", op, ": polar_dtype must be 'bfloat16', 'float16' or 'float32', got '",
                    std::string(polar_dtype), "'");
  return std::nullopt;
}

// FP32 values rounded to the iteration's type (and back: FP32 storage).
at::Tensor rounded(const at::Tensor& t, std::optional<at::ScalarType> type) {
  return type ? t.to(*type).to(at::kFloat) : t;
}

void check_shards(const at::Tensor& x, const char* op) {
  TORCH_CHECK_TYPE(x.scalar_type() == at::kFloat, op, ": x must be float32, got ", x.scalar_type());
  TORCH_CHECK_VALUE(x.dim() == 3, op, ": x must be a batch of shards [n, rows, cols], got shape ", x.sizes());
  TORCH_CHECK_VALUE(x.is_contiguous(), op, ": x must be contiguous");
}

void check_shard_dim(int64_t shard_dim, const char* op) {
  TORCH_CHECK_VALUE(shard_dim == 0 || shard_dim == 1, op, ": shard_dim must be 0 (rows) or 1 (columns), got ",
                    shard_dim);
}

// The side of the Gram matrix: the dimension the shards do not split.
int64_t gram_side(const at::Tensor& x, int64_t shard_dim) { return shard_dim == 1 ? x.size(1) : x.size(2); }

void sharded_polar_norms(const at::Tensor& x, at::Tensor& sum_squares) {
  constexpr const char* op = "sharded_polar_norms";
  check_shards(x, op);
  TORCH_CHECK_VALUE(sum_squares.scalar_type() == at::kDouble && sum_squares.numel() == x.size(0), op,
                    ": sum_squares must be float64 with one entry per matrix (", x.size(0), "), got ",
                    sum_squares.scalar_type(), " ", sum_squares.sizes());
  sum_squares.copy_(x.to(at::kDouble).square().sum({1, 2}).view(sum_squares.sizes()));
}

void sharded_polar_scale(at::Tensor& x, const at::Tensor& sum_squares, c10::string_view polar_dtype) {
  constexpr const char* op = "sharded_polar_scale";
  check_shards(x, op);
  const auto type = rounding_of(polar_dtype, op);
  TORCH_CHECK_VALUE(sum_squares.numel() == x.size(0), op, ": sum_squares must have one entry per matrix");
  const at::Tensor scale = polar_input_scale_of<at::Tensor>(sum_squares.to(at::kFloat).to(x.device()));
  x.copy_(rounded(x * scale.view({-1, 1, 1}), type));
}

void sharded_polar_gram(const at::Tensor& x, at::Tensor& gram, int64_t shard_dim, c10::string_view polar_dtype) {
  constexpr const char* op = "sharded_polar_gram";
  check_shards(x, op);
  check_shard_dim(shard_dim, op);
  rounding_of(polar_dtype, op);  // x holds values of the iteration's type already
  const int64_t side = gram_side(x, shard_dim);
  TORCH_CHECK_VALUE(gram.scalar_type() == at::kFloat && gram.numel() == x.size(0) * side * side, op,
                    ": gram must be float32 with ", x.size(0) * side * side, " entries, got ", gram.scalar_type(),
                    " ", gram.sizes());
  const at::Tensor product = shard_dim == 1 ? at::bmm(x, x.transpose(1, 2)) : at::bmm(x.transpose(1, 2), x);
  gram.copy_(product.view(gram.sizes()));
}

void sharded_polar_iterate(at::Tensor& x, const at::Tensor& gram, double a, double b, double c, int64_t shard_dim,
                           c10::string_view polar_dtype) {
  constexpr const char* op = "sharded_polar_iterate";
  check_shards(x, op);
  check_shard_dim(shard_dim, op);
  const auto type = rounding_of(polar_dtype, op);
  const int64_t side = gram_side(x, shard_dim);
  TORCH_CHECK_VALUE(gram.scalar_type() == at::kFloat && gram.numel() == x.size(0) * side * side, op,
                    ": gram must be the summed float32 Gram matrices, ", x.size(0) * side * side, " entries");
  const at::Tensor A = rounded(gram.reshape({x.size(0), side, side}), type);
  const at::Tensor B = rounded(A * b + at::bmm(A, A) * c, type);
  const at::Tensor product = shard_dim == 1 ? at::bmm(B, x) : at::bmm(x, B);
  x.copy_(rounded(x * a + product, type));
}

// NorMuon on one shard x [local rows, local cols] of a rows x cols matrix split along shard_dim. Statistics
// are per row when rows >= cols (common/shapes.h), else per column. Three cases, one sum between the ops:
//   the reduced dim is split        payload: this shard's partial sums of squares per held entry (FP64)
//   statistics follow the split,    stats: this shard's own entries; the lerp happens here; payload: the
//     kept locally (stats_local)    two sums n0^2 / red and n1^2 (FP64)
//   statistics follow the split,    payload: the whole statistics vector, this shard's entries at `held`,
//     kept whole on every rank      zeros elsewhere (one owner per entry: the sum is exact)
struct NormuonCase {
  bool per_row;
  int64_t reduced;   // the length averaged over
  int64_t stat_dim;  // 0: one statistic per row
  bool split_reduced;
};

NormuonCase normuon_case(int64_t rows, int64_t cols, int64_t shard_dim) {
  const bool per_row = shapes::stats_per_row(rows, cols);
  const int64_t stat_dim = per_row ? 0 : 1;
  return {per_row, shapes::reduced_length(rows, cols), stat_dim, stat_dim != shard_dim};
}

// Mean squares along the reduced dim of the shard's own entries (FP32, as the kernels keep them).
at::Tensor shard_mean_squares(const at::Tensor& x, const NormuonCase& k) {
  return (x.to(at::kDouble).square().sum(1 - k.stat_dim).to(at::kFloat) / float(k.reduced));
}

at::Tensor step_sizes(const at::Tensor& smb) { return normuon_step_size_of<at::Tensor>(smb); }

void scale_along(at::Tensor& x, const at::Tensor& multiplier, int64_t stat_dim) {
  x.mul_(stat_dim == 0 ? multiplier.view({-1, 1}) : multiplier.view({1, -1}));
}

void check_normuon(const at::Tensor& x, const at::Tensor& stats, int64_t shard_dim, const char* op) {
  TORCH_CHECK_TYPE(x.scalar_type() == at::kFloat && x.dim() == 2, op, ": x must be a float32 matrix shard");
  TORCH_CHECK_TYPE(stats.scalar_type() == at::kFloat && stats.is_contiguous(), op,
                   ": stats must be contiguous float32");
  check_shard_dim(shard_dim, op);
}

void sharded_normuon_partial(const at::Tensor& x, at::Tensor& stats, at::Tensor& payload, int64_t rows, int64_t cols,
                             int64_t shard_dim, const OptionalTensor& held, double beta2, bool stats_local) {
  constexpr const char* op = "sharded_normuon_partial";
  check_normuon(x, stats, shard_dim, op);
  TORCH_CHECK_TYPE(payload.scalar_type() == at::kDouble, op, ": payload must be float64");
  const NormuonCase k = normuon_case(rows, cols, shard_dim);
  if (k.split_reduced) {
    payload.copy_(x.to(at::kDouble).square().sum(1 - k.stat_dim).view(payload.sizes()));
    return;
  }
  const at::Tensor vm = shard_mean_squares(x, k);
  if (stats_local) {
    at::Tensor smb = stats.view(-1);
    smb.copy_(at::lerp(smb, vm, 1.0 - beta2));
    const at::Tensor s = step_sizes(smb);
    payload.copy_(at::stack({vm.to(at::kDouble).sum(), (vm * float(k.reduced) * s * s).to(at::kDouble).sum()})
                      .view(payload.sizes()));
    return;
  }
  TORCH_CHECK_VALUE(held.has_value(), op, ": held (the positions this shard holds) is required");
  payload.zero_();
  payload.view(-1).index_copy_(0, *held, vm.to(at::kDouble));
}

void sharded_normuon_finish(at::Tensor& x, at::Tensor& stats, const at::Tensor& payload, int64_t rows, int64_t cols,
                            int64_t shard_dim, const OptionalTensor& held, double beta2, bool stats_local) {
  constexpr const char* op = "sharded_normuon_finish";
  check_normuon(x, stats, shard_dim, op);
  const NormuonCase k = normuon_case(rows, cols, shard_dim);
  at::Tensor smb = stats.view(-1);
  if (!k.split_reduced && stats_local) {  // normuon_norm_ratio from the summed n0^2 / red and n1^2
    const at::Tensor sums = payload.view(-1).to(at::kFloat);
    const at::Tensor ratio = normuon_norm_ratio_of<at::Tensor>(sums[0], sums[1], k.reduced);
    scale_along(x, step_sizes(smb) * ratio, k.stat_dim);
    return;
  }
  const at::Tensor vm = k.split_reduced ? payload.view(-1).to(at::kFloat) / float(k.reduced)
                                        : payload.view(-1).to(at::kFloat);
  smb.copy_(at::lerp(smb, vm, 1.0 - beta2));
  const at::Tensor s = step_sizes(smb);
  const at::Tensor multiplier = s * normuon_norm_ratio_of<at::Tensor>(vm.sum(), (vm * float(k.reduced) * s * s).sum(),
                                                                      k.reduced);
  if (k.split_reduced) {
    scale_along(x, multiplier, k.stat_dim);
  } else {
    TORCH_CHECK_VALUE(held.has_value(), op, ": held (the positions this shard holds) is required");
    scale_along(x, multiplier.index_select(0, *held), k.stat_dim);
  }
}

}  // namespace
}  // namespace muon_ext

// Schemas in csrc/ops.cpp; one implementation for both devices (ATen calls). The fake kernels, which write
// nothing and check nothing (symbolic shapes cannot be compared here), are muon_ext/ops.py's.
#define MUON_EXT_REGISTER_SHARDED_KERNELS(m)                          \
  m.impl("sharded_polar_norms", &muon_ext::sharded_polar_norms);         \
  m.impl("sharded_polar_scale", &muon_ext::sharded_polar_scale);         \
  m.impl("sharded_polar_gram", &muon_ext::sharded_polar_gram);           \
  m.impl("sharded_polar_iterate", &muon_ext::sharded_polar_iterate);     \
  m.impl("sharded_normuon_partial", &muon_ext::sharded_normuon_partial); \
  m.impl("sharded_normuon_finish", &muon_ext::sharded_normuon_finish)

TORCH_LIBRARY_IMPL(muon_ext, CPU, m) { MUON_EXT_REGISTER_SHARDED_KERNELS(m); }
TORCH_LIBRARY_IMPL(muon_ext, CUDA, m) { MUON_EXT_REGISTER_SHARDED_KERNELS(m); }

// The kernels as torch.library custom ops in the `muon_ext` namespace (see
// docs/design.md, "Ops (torch.library)").  Each op:
//   * has a schema that marks every mutated argument, so torch.compile,
//     functionalization and the profiler see what it reads and writes;
//   * checks every argument (checks.h, ranges from common/schema.h) before it
//     writes anything, naming op, argument and list index;
//   * is registered for CPU, CUDA and Meta.  One function serves all three:
//     it branches on the params' device after the checks.  The Meta kernel
//     runs the same checks and computes nothing (fake tensors trace through
//     it); a CPU-only build registers CUDA too, so that CUDA tensors get a
//     clear "no CUDA kernels" error instead of a dispatcher one.
#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <array>
#include <cmath>
#include <cstring>
#include <optional>
#include <string>
#include <vector>

#include "ops.h"

#include "checks.h"
#include "common/adamw_math.h"
#include "common/muon_math.h"
#include "common/polar_plan.h"
#include "common/schema.h"
#include "common/shapes.h"
#include "cpu/adamw_cpu.h"
#include "cpu/muon_cpu.h"
#include "cpu/scalar_kind.h"
#include "muon_args.h"
#include "quantize_ops.h"
#include "remainder_kernels.h"
#if defined(MUON_EXT_WITH_CUDA)
#include "cuda/adamw_cuda.h"
#include "cuda/muon_cuda.h"
#endif

namespace muon_ext {
namespace {

using checks::TensorList;
using checks::where;
using OptionalTensor = std::optional<at::Tensor>;

std::vector<at::Tensor> to_vector(at::TensorList list) { return list.vec(); }

bool found_inf_on_cpu(const OptionalTensor& found_inf) {
  return found_inf.has_value() && found_inf->item<float>() != 0.0f;
}

// The learning rate a CPU kernel uses: the tensor's value (checked here, since
// only now is it read) or the float.
float host_lr(const OptionalTensor& lr_tensor, double lr, const char* op) {
  const float value = lr_tensor.has_value() ? lr_tensor->item<float>() : static_cast<float>(lr);
  checks::in_range(op, "muon", "lr", value);
  return value;
}

// Which backend runs a checked call: nothing (no params, or meta tensors: the
// call was only checked), the CPU kernels or the CUDA kernels.
enum class Backend { kNone, kCpu, kCuda };

Backend backend_of(const TensorList& params) {
  if (params.empty() || params[0].is_meta()) return Backend::kNone;
  return params[0].is_cpu() ? Backend::kCpu : Backend::kCuda;
}

// ---------------------------------------------------------------------------
// AdamW
// ---------------------------------------------------------------------------

constexpr const char* kAdamW = "adamw_step";

// The role under which the step check recorded the lists an op takes as its
// params: the params themselves, or (params with a writer) their FP32 masters.
const char* params_role(const checks::CheckedBucket& checked) {
  return checked.has("params") ? "params" : "master_param";
}

// Validates every argument and returns the master mode they describe.
// `checked`: the step check's token; where it covers these lists, the
// per-entry and byte-range checks it made are not made again.
MasterMode check_adamw_args(const TensorList& params, const TensorList& grads, const TensorList& exp_avgs,
                            const TensorList& exp_avg_sqs, const TensorList& masters, const TensorList& steps,
                            const OptionalTensor& lr_tensor, const OptionalTensor& inv_scale,
                            const OptionalTensor& found_inf, checks::CheckedBucket* checked) {
  const size_t n = params.size();
  checks::same_lengths(kAdamW, n,
                       {{"grads", grads.size()}, {"exp_avgs", exp_avgs.size()}, {"exp_avg_sqs", exp_avg_sqs.size()}, {"steps", steps.size()}});
  checks::optional_list_length(kAdamW, masters, "masters", n);
  if (n == 0) return MasterMode::kNone;

  const bool proven = checked != nullptr &&
                      checked->covers({{params_role(*checked), params}, {"grads", grads}, {"exp_avg", exp_avgs},
                                       {"exp_avg_sq", exp_avg_sqs}, {"step", steps},
                                       {masters.empty() ? "" : "master_param", masters}});
  const at::Device device = proven ? params[0].device() : checks::params(kAdamW, params);
  if (proven) checks::device(kAdamW, device, "params");
  const at::ScalarType grad_dtype = checks::float_list_dtype(kAdamW, grads, "grads");
  const MasterMode master_mode = checks::master_mode(kAdamW, masters, params[0].scalar_type());
  const at::ScalarType master_dtype = master_mode == MasterMode::kRemainder ? at::kShort : at::kFloat;
  for (size_t i = 0; i < n && !proven; ++i) {
    const at::Tensor& p = params[i];
    checks::companion(kAdamW, grads[i], p, "grads", i, grad_dtype, p.sizes());
    checks::companion(kAdamW, exp_avgs[i], p, "exp_avgs", i, at::kFloat, p.sizes());
    checks::companion(kAdamW, exp_avg_sqs[i], p, "exp_avg_sqs", i, at::kFloat, p.sizes());
    if (!masters.empty()) checks::companion(kAdamW, masters[i], p, "masters", i, master_dtype, p.sizes());
    checks::scalar_tensor(kAdamW, steps[i], where("steps", i).c_str(), device);
  }
  if (!proven) {
    checks::distinct(kAdamW, steps, "steps");
    checks::disjoint(kAdamW, {{"params", params}, {"exp_avgs", exp_avgs}, {"exp_avg_sqs", exp_avg_sqs},
                              {"masters", masters}, {"steps", steps}});
  }
  checks::scalar_tensor(kAdamW, lr_tensor, "lr", device);
  checks::scalar_tensor(kAdamW, inv_scale, "inv_scale", device);
  checks::scalar_tensor(kAdamW, found_inf, "found_inf", device);
  return master_mode;
}

void adamw_step_cpu(const TensorList& params, const TensorList& grads, const TensorList& exp_avgs,
                    const TensorList& exp_avg_sqs, const TensorList& masters, const TensorList& steps,
                    MasterMode master_mode, const AdamWHyper& hyper, float lr, float inv_scale) {
  cpu::AdamWBatch batch;
  batch.param_kind = cpu::scalar_kind(params[0].scalar_type());
  batch.grad_kind = cpu::scalar_kind(grads[0].scalar_type());
  batch.master_mode = master_mode;
  batch.tensors.reserve(params.size());
  for (size_t i = 0; i < params.size(); ++i) {
    cpu::AdamWTensor t;
    t.param = params[i].data_ptr();
    t.grad = grads[i].const_data_ptr();
    t.exp_avg = exp_avgs[i].data_ptr<float>();
    t.exp_avg_sq = exp_avg_sqs[i].data_ptr<float>();
    t.master = masters.empty() ? nullptr : masters[i].data_ptr();
    t.step = steps[i].data_ptr<float>();
    t.numel = params[i].numel();
    batch.tensors.push_back(t);
  }
  cpu::adamw_step(batch, hyper, lr, inv_scale, cpu::best_capability());
}

}  // namespace

namespace op {

void adamw_step(at::TensorList params_in, at::TensorList grads_in, at::TensorList exp_avgs_in,
                at::TensorList exp_avg_sqs_in, at::TensorList masters_in, at::TensorList steps_in, double lr,
                const OptionalTensor& lr_tensor, double beta1, double beta2, double eps, double weight_decay,
                bool adam_w_mode, bool bias_correction, const OptionalTensor& inv_scale,
                const OptionalTensor& found_inf, checks::CheckedBucket* checked) {
  checks::in_range(kAdamW, "adamw", "lr", lr);
  checks::in_range(kAdamW, "adamw", "beta1", beta1);
  checks::in_range(kAdamW, "adamw", "beta2", beta2);
  checks::in_range(kAdamW, "adamw", "eps", eps);
  checks::in_range(kAdamW, "adamw", "weight_decay", weight_decay);
  AdamWHyper hyper;
  hyper.beta1 = static_cast<float>(beta1);
  hyper.beta2 = static_cast<float>(beta2);
  hyper.eps = static_cast<float>(eps);
  hyper.weight_decay = static_cast<float>(weight_decay);
  hyper.adam_w_mode = adam_w_mode;
  hyper.bias_correction = bias_correction;
  const TensorList params = params_in, grads = grads_in, exp_avgs = exp_avgs_in, exp_avg_sqs = exp_avg_sqs_in,
                   masters = masters_in, steps = steps_in;
  const MasterMode master_mode =
      check_adamw_args(params, grads, exp_avgs, exp_avg_sqs, masters, steps, lr_tensor, inv_scale, found_inf, checked);

  switch (backend_of(params)) {
    case Backend::kNone: return;
    case Backend::kCpu: {
      if (found_inf_on_cpu(found_inf)) return;
      const float lr_value = host_lr(lr_tensor, lr, kAdamW);
      const float inv_scale_value = inv_scale.has_value() ? inv_scale->item<float>() : 1.0f;
      adamw_step_cpu(params, grads, exp_avgs, exp_avg_sqs, masters, steps, master_mode, hyper, lr_value, inv_scale_value);
      return;
    }
    case Backend::kCuda:
#if defined(MUON_EXT_WITH_CUDA)
      cuda::adamw_step(params.vec(), grads.vec(), exp_avgs.vec(), exp_avg_sqs.vec(), masters.vec(), steps.vec(), master_mode,
                       hyper, lr, lr_tensor, inv_scale, found_inf);
#endif
      return;
  }
}

}  // namespace op

namespace {

// ---------------------------------------------------------------------------
// Muon: shared checks
// ---------------------------------------------------------------------------

// The accepted strings of a named mode (schema::kModes), as an error words them: 'a', 'b' or 'c'.
std::string mode_choices(const char* mode) {
  for (const schema::Mode& m : schema::kModes) {
    if (std::strcmp(m.name, mode) != 0) continue;
    std::string out;
    for (int i = 0; i < m.count; ++i) {
      out += (i == 0 ? "'" : i + 1 == m.count ? " or '" : ", '") + std::string(m.values[i]) + "'";
    }
    return out;
  }
  return "";
}

// The enum value of `given` among a named mode's strings; `values` lists the
// enum's values in the order of the mode's strings.
template <typename Enum, size_t N>
Enum parse_mode(const char* op, const char* mode, c10::string_view given, const std::array<Enum, N>& values) {
  const std::string value(given);
  const int index = schema::find_mode(mode, value.c_str());
  TORCH_CHECK_VALUE(index >= 0 && static_cast<size_t>(index) < N, op, ": ", mode, " must be ", mode_choices(mode),
                    ", got '", value, "'");
  return values[index];
}

MuonLrScale parse_lr_scale(const char* op, c10::string_view mode) {
  return parse_mode(op, "lr_scale", mode,
                    std::array{MuonLrScale::kOriginal, MuonLrScale::kMatchRmsAdamW, MuonLrScale::kNone});
}

PolarDtype parse_polar_dtype(const char* op, c10::string_view mode) {
  return parse_mode(op, "polar_dtype", mode, std::array{PolarDtype::kBFloat16, PolarDtype::kFloat32, PolarDtype::kFloat16});
}

PolarMethod parse_polar_method(const char* op, c10::string_view mode) {
  return parse_mode(op, "polar_method", mode, std::array{PolarMethod::kStandard, PolarMethod::kGram, PolarMethod::kAuto});
}

// The first ns_steps (a, b, c) triples of a flat list of coefficients.
std::vector<std::array<float, 3>> check_coefficients(const char* op, at::ArrayRef<double> flat, int64_t ns_steps) {
  checks::in_range(op, "muon", "ns_steps", static_cast<double>(ns_steps));
  TORCH_CHECK_VALUE(flat.size() % 3 == 0, op, ": ns_coefficients must hold (a, b, c) triples, got ", flat.size(),
                    " values");
  const int64_t available = static_cast<int64_t>(flat.size() / 3);
  TORCH_CHECK_VALUE(ns_steps <= available, op, ": ns_steps=", ns_steps, " but only ", available,
                    " coefficient tuples are given");
  std::vector<std::array<float, 3>> out;
  for (int64_t i = 0; i < ns_steps; ++i) {
    for (int k = 0; k < 3; ++k) {
      TORCH_CHECK_VALUE(std::isfinite(flat[3 * i + k]), op, ": ns_coefficients[", i, "] must be finite");
    }
    out.push_back({static_cast<float>(flat[3 * i]), static_cast<float>(flat[3 * i + 1]),
                   static_cast<float>(flat[3 * i + 2])});
  }
  return out;
}

void check_beta2(const char* op, const std::optional<double>& beta2) {
  if (beta2.has_value()) checks::in_range(op, "muon", "beta2", *beta2, /*nullable=*/true);
}

int64_t check_row_blocks(const char* op, const std::optional<int64_t>& polar_row_blocks) {
  if (!polar_row_blocks.has_value()) return 0;
  checks::in_range(op, "muon", "polar_row_blocks", static_cast<double>(*polar_row_blocks), /*nullable=*/true);
  return *polar_row_blocks;
}

// (rows, cols) of the matrices of `list`, all [..., rows, cols] with the
// first one's (rows, cols), nonzero.
std::pair<int64_t, int64_t> check_matrix_shapes(const char* op, const TensorList& list, const char* name) {
  const at::Tensor& first = list[0];
  const shapes::Matrices m = shapes::matrix_shape(first.sizes().data(), first.dim(), shapes::MatrixView::kBatch);
  TORCH_CHECK_VALUE(m.rule == shapes::MatrixRule::kMatrices, op, ": ", name,
                    "[0] must have at least 2 dimensions (rows, cols), got ", first.sizes());
  const int64_t rows = m.rows, cols = m.cols;
  TORCH_CHECK_VALUE(rows > 0 && cols > 0, op, ": ", name, "[0] has zero-sized matrices ", first.sizes(),
                    "; Muon needs rows >= 1 and cols >= 1");
  for (size_t i = 0; i < list.size(); ++i) {
    const at::Tensor& t = list[i];
    TORCH_CHECK_VALUE(t.dim() >= 2 && t.size(-2) == rows && t.size(-1) == cols, op, ": ", where(name, i),
                      " has shape ", t.sizes(), " but the bucket's matrices are ", rows, "x", cols,
                      " (one matrix shape per call)");
  }
  return {rows, cols};
}

// `proven`: the step check's token covers the buffers (only their count is checked).
void check_second_moments(const char* op, const TensorList& buffers, const TensorList& like, const char* like_name,
                          bool normuon, int64_t rows, int64_t cols, bool proven = false) {
  TORCH_CHECK_VALUE(buffers.size() == (normuon ? like.size() : 0), op, ": second_momentum_buffers must have one entry "
                    "per ", like_name == std::string("params") ? "param" : "update",
                    " when beta2 is set and be empty when beta2 is None, got ", buffers.size(), " for ", like.size(),
                    " ", like_name);
  if (!normuon || proven) return;
  c10::SmallVector<int64_t, 6> shape;
  for (size_t i = 0; i < like.size(); ++i) {
    // The ops see [..., rows, cols] tensors: "batch" is their matrix view.
    shape.clear();
    shapes::second_moment_shape(like[i].sizes().data(), like[i].dim(), shapes::MatrixView::kBatch, rows, cols, shape);
    checks::companion(op, buffers[i], like[i], "second_momentum_buffers", i, at::kFloat, shape, like_name);
  }
}

// ---------------------------------------------------------------------------
// Muon: the fused step
// ---------------------------------------------------------------------------

constexpr const char* kMuon = "muon_step";

// `checked`: as in check_adamw_args.
void check_muon_bucket(MuonBucket& bucket, const MuonStepOptions& options, checks::CheckedBucket* checked) {
  const TensorList& params = bucket.params;
  const size_t n = params.size();
  checks::same_lengths(kMuon, n, {{"grads", bucket.grads.size()}, {"momentum_buffers", bucket.momentum_buffers.size()}});
  if (n == 0) {
    check_second_moments(kMuon, bucket.second_momentum_buffers, params, "params", options.hyper.normuon, 0, 0);
  }
  checks::optional_list_length(kMuon, bucket.masters, "masters", n);
  if (n == 0) return;

  const bool proven =
      checked != nullptr &&
      checked->covers({{params_role(*checked), params}, {"grads", bucket.grads},
                       {"momentum_buffer", bucket.momentum_buffers},
                       {options.hyper.normuon ? "second_momentum_buffer" : "", bucket.second_momentum_buffers},
                       {bucket.masters.empty() ? "" : "master_param", bucket.masters}});
  const at::Device device = proven ? params[0].device() : checks::params(kMuon, params);
  if (proven) checks::device(kMuon, device, "params");
  const at::ScalarType grad_dtype = checks::float_list_dtype(kMuon, bucket.grads, "grads");
  bucket.master_mode = checks::master_mode(kMuon, bucket.masters, params[0].scalar_type());
  const at::ScalarType master_dtype = bucket.master_mode == MasterMode::kRemainder ? at::kShort : at::kFloat;
  std::tie(bucket.rows, bucket.cols) = check_matrix_shapes(kMuon, params, "params");
  check_second_moments(kMuon, bucket.second_momentum_buffers, params, "params", options.hyper.normuon, bucket.rows,
                       bucket.cols, proven);
  for (size_t i = 0; i < n && !proven; ++i) {
    const at::Tensor& p = params[i];
    checks::companion(kMuon, bucket.grads[i], p, "grads", i, grad_dtype, p.sizes());
    checks::companion(kMuon, bucket.momentum_buffers[i], p, "momentum_buffers", i, at::kFloat, p.sizes());
    if (!bucket.masters.empty()) checks::companion(kMuon, bucket.masters[i], p, "masters", i, master_dtype, p.sizes());
  }
  if (!proven) {
    checks::disjoint(kMuon, {{"params", params}, {"momentum_buffers", bucket.momentum_buffers},
                             {"second_momentum_buffers", bucket.second_momentum_buffers}, {"masters", bucket.masters}});
  }
  checks::scalar_tensor(kMuon, options.lr_tensor, "lr", device);
  checks::scalar_tensor(kMuon, options.inv_scale, "inv_scale", device);
  checks::scalar_tensor(kMuon, options.found_inf, "found_inf", device);
}

}  // namespace

namespace op {

void muon_step(at::TensorList params, at::TensorList grads, at::TensorList momentum_buffers,
               at::TensorList second_momentum_buffers, at::TensorList masters, double lr,
               const OptionalTensor& lr_tensor, double momentum, bool nesterov, std::optional<double> beta2,
               double weight_decay, int64_t ns_steps, at::ArrayRef<double> ns_coefficients,
               c10::string_view lr_scale, const OptionalTensor& inv_scale, const OptionalTensor& found_inf,
               int64_t max_workspace_bytes, std::optional<int64_t> polar_row_blocks,
               c10::string_view polar_dtype, c10::string_view polar_method, checks::CheckedBucket* checked) {
  checks::in_range(kMuon, "muon", "lr", lr);
  checks::in_range(kMuon, "muon", "momentum", momentum);
  check_beta2(kMuon, beta2);
  checks::in_range(kMuon, "muon", "weight_decay", weight_decay);
  checks::in_range(kMuon, "optimizer", "max_workspace_bytes", static_cast<double>(max_workspace_bytes));
  MuonStepOptions options;
  options.polar_row_blocks = check_row_blocks(kMuon, polar_row_blocks);
  options.polar_dtype = parse_polar_dtype(kMuon, polar_dtype);
  options.polar_method = parse_polar_method(kMuon, polar_method);
  const MuonLrScale scale_mode = parse_lr_scale(kMuon, lr_scale);
  options.coefficients = check_coefficients(kMuon, ns_coefficients, ns_steps);
  options.hyper.momentum = static_cast<float>(momentum);
  options.hyper.nesterov = nesterov;
  options.hyper.normuon = beta2.has_value();
  options.hyper.beta2 = beta2.has_value() ? static_cast<float>(*beta2) : 0.0f;
  options.hyper.weight_decay = static_cast<float>(weight_decay);
  options.lr = lr;
  options.lr_tensor = lr_tensor;
  options.inv_scale = inv_scale;
  options.found_inf = found_inf;
  options.max_workspace_bytes = max_workspace_bytes;

  MuonBucket bucket;
  bucket.params = to_vector(params);
  bucket.grads = to_vector(grads);
  bucket.momentum_buffers = to_vector(momentum_buffers);
  bucket.second_momentum_buffers = to_vector(second_momentum_buffers);
  bucket.masters = to_vector(masters);
  check_muon_bucket(bucket, options, checked);
  const Backend backend = backend_of(bucket.params);
  if (backend == Backend::kNone) return;
  options.lr_factor = static_cast<float>(muon_lr_factor(scale_mode, bucket.rows, bucket.cols));

  if (backend == Backend::kCpu) {
    if (found_inf_on_cpu(found_inf)) return;
    options.lr = host_lr(lr_tensor, lr, kMuon);  // read once: the kernel takes the value
    options.lr_tensor.reset();
    cpu::muon_step(bucket, options);
    return;
  }
#if defined(MUON_EXT_WITH_CUDA)
  cuda::muon_step(bucket, options);
#endif
}

}  // namespace op

namespace {

// ---------------------------------------------------------------------------
// Muon in three phases
// ---------------------------------------------------------------------------

constexpr const char* kMomentum = "muon_momentum";
constexpr const char* kOrthogonalize = "muon_orthogonalize";
constexpr const char* kApply = "muon_apply";

// Phase 1: elementwise; the "params" of the checks are the updates (FP32).
void muon_momentum_op(at::TensorList grads, at::TensorList momentum_buffers, at::TensorList updates, double momentum,
                   bool nesterov, const OptionalTensor& inv_scale, const OptionalTensor& found_inf) {
  checks::in_range(kMomentum, "muon", "momentum", momentum);
  MuonMomentumArgs args;
  args.grads = to_vector(grads);
  args.momentum_buffers = to_vector(momentum_buffers);
  args.updates = to_vector(updates);
  args.momentum = static_cast<float>(momentum);
  args.nesterov = nesterov;
  args.inv_scale = inv_scale;
  args.found_inf = found_inf;
  const size_t n = args.updates.size();
  checks::same_lengths(kMomentum, n, {{"grads", args.grads.size()}, {"momentum_buffers", args.momentum_buffers.size()}}, "updates");
  if (n == 0) return;
  const at::Device device = checks::params(kMomentum, args.updates, "updates");
  TORCH_CHECK_TYPE(args.updates[0].scalar_type() == at::kFloat, kMomentum, ": updates must be float32, got ",
                   args.updates[0].scalar_type());
  const at::ScalarType grad_dtype = checks::float_list_dtype(kMomentum, args.grads, "grads");
  for (size_t i = 0; i < n; ++i) {
    const at::Tensor& u = args.updates[i];
    checks::companion(kMomentum, args.grads[i], u, "grads", i, grad_dtype, u.sizes(), "updates");
    checks::companion(kMomentum, args.momentum_buffers[i], u, "momentum_buffers", i, at::kFloat, u.sizes(), "updates");
    // With Nesterov the update differs from the new momentum: one buffer cannot hold both.
    TORCH_CHECK_VALUE(u.is_meta() || u.numel() == 0 || args.momentum_buffers[i].data_ptr() != u.data_ptr(), kMomentum,
                      ": momentum_buffers[", i, "] and updates[", i, "] are the same tensor");
  }
  checks::disjoint(kMomentum, {{"updates", args.updates}, {"momentum_buffers", args.momentum_buffers}});
  checks::scalar_tensor(kMomentum, inv_scale, "inv_scale", device);
  checks::scalar_tensor(kMomentum, found_inf, "found_inf", device);

  switch (backend_of(args.updates)) {
    case Backend::kNone: return;
    case Backend::kCpu:
      if (found_inf_on_cpu(found_inf)) return;
      cpu::muon_momentum(args, inv_scale.has_value() ? inv_scale->item<float>() : 1.0f);
      return;
    case Backend::kCuda:
#if defined(MUON_EXT_WITH_CUDA)
      cuda::muon_momentum(args);
#endif
      return;
  }
}

// Phase 2: whole matrices.
void muon_orthogonalize_op(at::TensorList updates, at::TensorList second_momentum_buffers, std::optional<double> beta2,
                        int64_t ns_steps, at::ArrayRef<double> ns_coefficients, int64_t max_workspace_bytes,
                        std::optional<int64_t> polar_row_blocks, c10::string_view polar_dtype,
                        c10::string_view polar_method, const OptionalTensor& found_inf) {
  check_beta2(kOrthogonalize, beta2);
  checks::in_range(kOrthogonalize, "optimizer", "max_workspace_bytes", static_cast<double>(max_workspace_bytes));
  MuonOrthogonalizeArgs args;
  args.polar_row_blocks = check_row_blocks(kOrthogonalize, polar_row_blocks);
  args.polar_dtype = parse_polar_dtype(kOrthogonalize, polar_dtype);
  args.polar_method = parse_polar_method(kOrthogonalize, polar_method);
  args.coefficients = check_coefficients(kOrthogonalize, ns_coefficients, ns_steps);
  args.updates = to_vector(updates);
  args.second_momentum_buffers = to_vector(second_momentum_buffers);
  args.normuon = beta2.has_value();
  args.beta2 = beta2.value_or(0.0);
  args.max_workspace_bytes = max_workspace_bytes;
  args.found_inf = found_inf;
  if (args.updates.empty()) {
    check_second_moments(kOrthogonalize, args.second_momentum_buffers, args.updates, "updates", args.normuon, 0, 0);
    return;
  }
  const at::Device device = checks::params(kOrthogonalize, args.updates, "updates");
  TORCH_CHECK_TYPE(args.updates[0].scalar_type() == at::kFloat, kOrthogonalize, ": updates must be float32, got ",
                   args.updates[0].scalar_type());
  std::tie(args.rows, args.cols) = check_matrix_shapes(kOrthogonalize, args.updates, "updates");
  check_second_moments(kOrthogonalize, args.second_momentum_buffers, args.updates, "updates", args.normuon, args.rows,
                       args.cols);
  checks::disjoint(kOrthogonalize,
                   {{"updates", args.updates}, {"second_momentum_buffers", args.second_momentum_buffers}});
  checks::scalar_tensor(kOrthogonalize, found_inf, "found_inf", device);

  switch (backend_of(args.updates)) {
    case Backend::kNone: return;
    case Backend::kCpu:
      if (found_inf_on_cpu(found_inf)) return;
      cpu::muon_orthogonalize(args);
      return;
    case Backend::kCuda:
#if defined(MUON_EXT_WITH_CUDA)
      cuda::muon_orthogonalize(args);
#endif
      return;
  }
}

// Phase 3: elementwise; rows and cols name the whole matrix (for lr_scale).
void muon_apply_op(at::TensorList params, at::TensorList updates, at::TensorList masters, double lr,
                const OptionalTensor& lr_tensor, double weight_decay, c10::string_view lr_scale, int64_t rows,
                int64_t cols, const OptionalTensor& found_inf) {
  checks::in_range(kApply, "muon", "lr", lr);
  checks::in_range(kApply, "muon", "weight_decay", weight_decay);
  const MuonLrScale scale_mode = parse_lr_scale(kApply, lr_scale);
  TORCH_CHECK_VALUE(rows > 0 && cols > 0, kApply, ": rows and cols (the whole matrix's shape) must be positive, got ",
                    rows, "x", cols);
  MuonApplyArgs args;
  args.params = to_vector(params);
  args.updates = to_vector(updates);
  args.masters = to_vector(masters);
  args.lr = lr;
  args.lr_tensor = lr_tensor;
  args.lr_factor = static_cast<float>(muon_lr_factor(scale_mode, rows, cols));
  args.weight_decay = static_cast<float>(weight_decay);
  args.found_inf = found_inf;
  const size_t n = args.params.size();
  checks::same_lengths(kApply, n, {{"updates", args.updates.size()}});
  checks::optional_list_length(kApply, args.masters, "masters", n);
  if (n == 0) return;
  const at::Device device = checks::params(kApply, args.params, "params");
  args.master_mode = checks::master_mode(kApply, args.masters, args.params[0].scalar_type());
  const at::ScalarType master_dtype = args.master_mode == MasterMode::kRemainder ? at::kShort : at::kFloat;
  for (size_t i = 0; i < n; ++i) {
    const at::Tensor& p = args.params[i];
    checks::companion(kApply, args.updates[i], p, "updates", i, at::kFloat, p.sizes());
    if (!args.masters.empty()) checks::companion(kApply, args.masters[i], p, "masters", i, master_dtype, p.sizes());
  }
  checks::disjoint(kApply, {{"params", args.params}, {"masters", args.masters}});
  checks::scalar_tensor(kApply, lr_tensor, "lr", device);
  checks::scalar_tensor(kApply, found_inf, "found_inf", device);

  switch (backend_of(args.params)) {
    case Backend::kNone: return;
    case Backend::kCpu: {
      if (found_inf_on_cpu(found_inf)) return;
      const float lr_value = host_lr(lr_tensor, lr, kApply) * args.lr_factor;
      cpu::muon_apply(args, lr_value);
      return;
    }
    case Backend::kCuda:
#if defined(MUON_EXT_WITH_CUDA)
      cuda::muon_apply(args);
#endif
      return;
  }
}

// ---------------------------------------------------------------------------
// FP32 master <-> BF16 + int16 remainder
// ---------------------------------------------------------------------------

void check_remainder_triple(const char* op, const at::Tensor& master, const at::Tensor& param,
                            const at::Tensor& remainder) {
  TORCH_CHECK_TYPE(master.scalar_type() == at::kFloat, op, ": master must be float32, got ", master.scalar_type());
  TORCH_CHECK_TYPE(param.scalar_type() == at::kBFloat16, op, ": param must be bfloat16, got ", param.scalar_type());
  TORCH_CHECK_TYPE(remainder.scalar_type() == at::kShort, op, ": remainder must be int16, got ",
                   remainder.scalar_type());
  checks::device(op, master.device(), "master");
  for (const auto& [name, t] : {std::pair<const char*, const at::Tensor*>{"param", &param}, {"remainder", &remainder}}) {
    TORCH_CHECK_VALUE(t->device() == master.device(), op, ": ", name, " is on ", t->device(), " but master is on ",
                      master.device());
    TORCH_CHECK_VALUE(t->sizes() == master.sizes(), op, ": ", name, " has shape ", t->sizes(), " but master has ",
                      master.sizes());
  }
  for (const auto& [name, t] :
       {std::pair<const char*, const at::Tensor*>{"master", &master}, {"param", &param}, {"remainder", &remainder}}) {
    TORCH_CHECK_VALUE(t->is_contiguous(), op, ": ", name, " must be contiguous (tensors must be contiguous)");
    checks::storage(op, *t, name);
  }
}

void split_master_op(const at::Tensor& master, const at::Tensor& param, const at::Tensor& remainder) {
  check_remainder_triple("split_master", master, param, remainder);
  if (master.is_meta()) return;
  if (master.is_cpu()) return cpu::split_master(master, param, remainder);
#if defined(MUON_EXT_WITH_CUDA)
  cuda::split_master(master, param, remainder);
#endif
}

void merge_master_op(const at::Tensor& param, const at::Tensor& remainder, const at::Tensor& master) {
  check_remainder_triple("merge_master", master, param, remainder);
  if (master.is_meta()) return;
  if (master.is_cpu()) return cpu::merge_master(param, remainder, master);
#if defined(MUON_EXT_WITH_CUDA)
  cuda::merge_master(param, remainder, master);
#endif
}

}  // namespace
}  // namespace muon_ext

// Schemas: lists first, settings keyword-only.  (a!)... mark what each op writes.
TORCH_LIBRARY(muon_ext, m) {
  m.def(
      "adamw_step(Tensor(a!)[] params, Tensor[] grads, Tensor(b!)[] exp_avgs, Tensor(c!)[] exp_avg_sqs, "
      "Tensor(d!)[] masters, Tensor(e!)[] steps, *, float lr, Tensor? lr_tensor, float beta1, float beta2, "
      "float eps, float weight_decay, bool adam_w_mode, bool bias_correction, Tensor? inv_scale, "
      "Tensor? found_inf) -> ()");
  m.def(
      "muon_step(Tensor(a!)[] params, Tensor[] grads, Tensor(b!)[] momentum_buffers, "
      "Tensor(c!)[] second_momentum_buffers, Tensor(d!)[] masters, *, float lr, Tensor? lr_tensor, float momentum, "
      "bool nesterov, float? beta2, float weight_decay, int ns_steps, float[] ns_coefficients, str lr_scale, "
      "Tensor? inv_scale, Tensor? found_inf, int max_workspace_bytes, int? polar_row_blocks, str polar_dtype, "
      "str polar_method=\"standard\") -> ()");
  m.def(
      "muon_momentum(Tensor[] grads, Tensor(a!)[] momentum_buffers, Tensor(b!)[] updates, *, float momentum, "
      "bool nesterov, Tensor? inv_scale, Tensor? found_inf) -> ()");
  m.def(
      "muon_orthogonalize(Tensor(a!)[] updates, Tensor(b!)[] second_momentum_buffers, *, float? beta2, "
      "int ns_steps, float[] ns_coefficients, int max_workspace_bytes, int? polar_row_blocks, str polar_dtype, "
      "str polar_method=\"standard\", Tensor? found_inf=None) -> ()");
  m.def(
      "muon_apply(Tensor(a!)[] params, Tensor[] updates, Tensor(b!)[] masters, *, float lr, Tensor? lr_tensor, "
      "float weight_decay, str lr_scale, int rows, int cols, Tensor? found_inf) -> ()");
  m.def("split_master(Tensor master, Tensor(a!) param, Tensor(b!) remainder) -> ()");
  m.def("merge_master(Tensor param, Tensor remainder, Tensor(a!) master) -> ()");
  m.def(
      "quantize_fp8(Tensor master, int[]? block, Tensor(a!) out, Tensor(b!) out_scale_inv, Tensor? found_inf) "
      "-> ()");
  // Split matrices orthogonalized in place between collectives (csrc/sharded_polar_ops.cpp).
  m.def("sharded_polar_norms(Tensor x, Tensor(a!) sum_squares) -> ()");
  m.def("sharded_polar_scale(Tensor(a!) x, Tensor sum_squares, *, str polar_dtype) -> ()");
  m.def("sharded_polar_gram(Tensor x, Tensor(a!) gram, *, int shard_dim, str polar_dtype) -> ()");
  m.def(
      "sharded_polar_iterate(Tensor(a!) x, Tensor gram, *, float a, float b, float c, int shard_dim, "
      "str polar_dtype) -> ()");
  m.def(
      "sharded_normuon_partial(Tensor x, Tensor(a!) stats, Tensor(b!) payload, *, int rows, int cols, "
      "int shard_dim, Tensor? held, float beta2, bool stats_local) -> ()");
  m.def(
      "sharded_normuon_finish(Tensor(a!) x, Tensor(b!) stats, Tensor payload, *, int rows, int cols, "
      "int shard_dim, Tensor? held, float beta2, bool stats_local) -> ()");
}

namespace muon_ext {
namespace {

// The registered kernels of the two step ops: called through the dispatcher,
// without the step check's token, they check everything.
void adamw_step_op(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs, at::TensorList exp_avg_sqs,
                   at::TensorList masters, at::TensorList steps, double lr, const OptionalTensor& lr_tensor,
                   double beta1, double beta2, double eps, double weight_decay, bool adam_w_mode,
                   bool bias_correction, const OptionalTensor& inv_scale, const OptionalTensor& found_inf) {
  op::adamw_step(params, grads, exp_avgs, exp_avg_sqs, masters, steps, lr, lr_tensor, beta1, beta2, eps, weight_decay,
                 adam_w_mode, bias_correction, inv_scale, found_inf, /*checked=*/nullptr);
}

void muon_step_op(at::TensorList params, at::TensorList grads, at::TensorList momentum_buffers,
                  at::TensorList second_momentum_buffers, at::TensorList masters, double lr,
                  const OptionalTensor& lr_tensor, double momentum, bool nesterov, std::optional<double> beta2,
                  double weight_decay, int64_t ns_steps, at::ArrayRef<double> ns_coefficients,
                  c10::string_view lr_scale, const OptionalTensor& inv_scale, const OptionalTensor& found_inf,
                  int64_t max_workspace_bytes, std::optional<int64_t> polar_row_blocks,
                  c10::string_view polar_dtype, c10::string_view polar_method) {
  op::muon_step(params, grads, momentum_buffers, second_momentum_buffers, masters, lr, lr_tensor, momentum, nesterov,
                beta2, weight_decay, ns_steps, ns_coefficients, lr_scale, inv_scale, found_inf, max_workspace_bytes,
                polar_row_blocks, polar_dtype, polar_method, /*checked=*/nullptr);
}

}  // namespace
}  // namespace muon_ext

#define MUON_EXT_REGISTER_KERNELS(m)                          \
  m.impl("adamw_step", &muon_ext::adamw_step_op);                 \
  m.impl("muon_step", &muon_ext::muon_step_op);                   \
  m.impl("muon_momentum", &muon_ext::muon_momentum_op);           \
  m.impl("muon_orthogonalize", &muon_ext::muon_orthogonalize_op); \
  m.impl("muon_apply", &muon_ext::muon_apply_op);                 \
  m.impl("split_master", &muon_ext::split_master_op);             \
  m.impl("merge_master", &muon_ext::merge_master_op);             \
  m.impl("quantize_fp8", &muon_ext::op::quantize_fp8)

TORCH_LIBRARY_IMPL(muon_ext, CPU, m) { MUON_EXT_REGISTER_KERNELS(m); }
TORCH_LIBRARY_IMPL(muon_ext, CUDA, m) { MUON_EXT_REGISTER_KERNELS(m); }
TORCH_LIBRARY_IMPL(muon_ext, Meta, m) { MUON_EXT_REGISTER_KERNELS(m); }

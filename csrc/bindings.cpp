// The pybind11 module muon_ext._C: argument checks at the boundary (checks.h),
// then the CPU or CUDA implementation.  Every check runs before any tensor is
// written, so a rejected call leaves all state untouched.
#include <torch/extension.h>

#include <string>
#include <tuple>
#include <vector>

#include "checks.h"
#include "common/adamw_math.h"
#include "common/polar_plan.h"
#include "cpu/adamw_cpu.h"
#include "cpu/muon_cpu.h"
#include "muon_args.h"
#include "remainder_ops.h"
#if defined(MUON_EXT_WITH_CUDA)
#include "cuda/adamw_cuda.h"
#include "cuda/muon_cuda.h"
#endif

namespace muon_ext {
namespace {

using checks::TensorList;
using checks::where;

cpu::ScalarKind scalar_kind(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return cpu::ScalarKind::kFloat32;
    case at::kBFloat16: return cpu::ScalarKind::kBFloat16;
    default: return cpu::ScalarKind::kFloat16;
  }
}

bool found_inf_on_cpu(const c10::optional<at::Tensor>& found_inf) {
  return found_inf.has_value() && found_inf->item<float>() != 0.0f;
}

float host_lr(const c10::optional<at::Tensor>& lr_tensor, double lr, const char* op) {
  const float value = lr_tensor.has_value() ? lr_tensor->item<float>() : static_cast<float>(lr);
  TORCH_CHECK_VALUE(value >= 0.0f, op, ": lr must be >= 0, got ", value);
  return value;
}

// ---------------------------------------------------------------------------
// AdamW
// ---------------------------------------------------------------------------

constexpr const char* kAdamW = "adamw_step";

void check_adamw_hyper(const AdamWHyper& h, double lr) {
  TORCH_CHECK_VALUE(lr >= 0.0, "adamw_step: lr must be >= 0, got ", lr);
  TORCH_CHECK_VALUE(h.beta1 >= 0.0f && h.beta1 < 1.0f, "adamw_step: beta1 must be in [0, 1), got ", h.beta1);
  TORCH_CHECK_VALUE(h.beta2 >= 0.0f && h.beta2 < 1.0f, "adamw_step: beta2 must be in [0, 1), got ", h.beta2);
  TORCH_CHECK_VALUE(h.eps >= 0.0f, "adamw_step: eps must be >= 0, got ", h.eps);
  TORCH_CHECK_VALUE(h.weight_decay >= 0.0f, "adamw_step: weight_decay must be >= 0, got ", h.weight_decay);
}

// Validates every argument and returns the master kind they describe.
MasterKind check_adamw_args(const TensorList& params, const TensorList& grads, const TensorList& exp_avgs,
                            const TensorList& exp_avg_sqs, const TensorList& masters, const TensorList& steps,
                            const c10::optional<at::Tensor>& lr_tensor, const c10::optional<at::Tensor>& inv_scale,
                            const c10::optional<at::Tensor>& found_inf) {
  const size_t n = params.size();
  checks::same_lengths(kAdamW, n,
                       {{"grads", &grads}, {"exp_avgs", &exp_avgs}, {"exp_avg_sqs", &exp_avg_sqs}, {"steps", &steps}});
  TORCH_CHECK_VALUE(masters.empty() || masters.size() == n,
                    "adamw_step: masters must be empty or have one entry per param, got ", masters.size(), " for ",
                    n, " params");
  if (n == 0) return MasterKind::kNone;

  const at::Device device = checks::params(kAdamW, params);
  const at::ScalarType grad_dtype = checks::float_list_dtype(kAdamW, grads, "grads");
  const MasterKind kind = checks::master_kind(kAdamW, masters, params[0].scalar_type());
  const at::ScalarType master_dtype = kind == MasterKind::kRemainder ? at::kShort : at::kFloat;
  for (size_t i = 0; i < n; ++i) {
    const at::Tensor& p = params[i];
    checks::companion(kAdamW, grads[i], p, "grads", i, grad_dtype, p.sizes());
    checks::companion(kAdamW, exp_avgs[i], p, "exp_avgs", i, at::kFloat, p.sizes());
    checks::companion(kAdamW, exp_avg_sqs[i], p, "exp_avg_sqs", i, at::kFloat, p.sizes());
    if (!masters.empty()) checks::companion(kAdamW, masters[i], p, "masters", i, master_dtype, p.sizes());
    checks::scalar_tensor(kAdamW, steps[i], where("steps", i).c_str(), device);
  }
  checks::distinct(kAdamW, steps, "steps");
  checks::scalar_tensor(kAdamW, lr_tensor, "lr", device);
  checks::scalar_tensor(kAdamW, inv_scale, "inv_scale", device);
  checks::scalar_tensor(kAdamW, found_inf, "found_inf", device);
  return kind;
}

void adamw_step_cpu(const TensorList& params, const TensorList& grads, const TensorList& exp_avgs,
                    const TensorList& exp_avg_sqs, const TensorList& masters, const TensorList& steps,
                    MasterKind kind, const AdamWHyper& hyper, float lr, float inv_scale) {
  cpu::AdamWBatch batch;
  batch.param_kind = scalar_kind(params[0].scalar_type());
  batch.grad_kind = scalar_kind(grads[0].scalar_type());
  batch.master_kind = kind;
  batch.tensors.reserve(params.size());
  for (size_t i = 0; i < params.size(); ++i) {
    cpu::AdamWTensor t;
    t.param = params[i].data_ptr();
    t.grad = grads[i].data_ptr();
    t.exp_avg = exp_avgs[i].data_ptr<float>();
    t.exp_avg_sq = exp_avg_sqs[i].data_ptr<float>();
    t.master = masters.empty() ? nullptr : masters[i].data_ptr();
    t.step = steps[i].data_ptr<float>();
    t.numel = params[i].numel();
    batch.tensors.push_back(t);
  }
  cpu::adamw_step(batch, hyper, lr, inv_scale);
}

void adamw_step(const TensorList& params, const TensorList& grads, const TensorList& exp_avgs,
                const TensorList& exp_avg_sqs, const TensorList& masters, const TensorList& steps, double lr,
                const c10::optional<at::Tensor>& lr_tensor, double beta1, double beta2, double eps,
                double weight_decay, bool adam_w_mode, bool bias_correction,
                const c10::optional<at::Tensor>& inv_scale, const c10::optional<at::Tensor>& found_inf) {
  AdamWHyper hyper;
  hyper.lr = static_cast<float>(lr);
  hyper.beta1 = static_cast<float>(beta1);
  hyper.beta2 = static_cast<float>(beta2);
  hyper.eps = static_cast<float>(eps);
  hyper.weight_decay = static_cast<float>(weight_decay);
  hyper.adam_w_mode = adam_w_mode;
  hyper.bias_correction = bias_correction;
  check_adamw_hyper(hyper, lr);
  const MasterKind kind =
      check_adamw_args(params, grads, exp_avgs, exp_avg_sqs, masters, steps, lr_tensor, inv_scale, found_inf);
  if (params.empty()) return;

  if (params[0].device().is_cpu()) {
    if (found_inf_on_cpu(found_inf)) return;
    const float lr_value = host_lr(lr_tensor, lr, kAdamW);
    const float inv_scale_value = inv_scale.has_value() ? inv_scale->item<float>() : 1.0f;
    adamw_step_cpu(params, grads, exp_avgs, exp_avg_sqs, masters, steps, kind, hyper, lr_value, inv_scale_value);
    return;
  }
#if defined(MUON_EXT_WITH_CUDA)
  cuda::adamw_step(params, grads, exp_avgs, exp_avg_sqs, masters, steps, kind, hyper, lr, lr_tensor, inv_scale,
                   found_inf);
#endif
}

// ---------------------------------------------------------------------------
// Muon
// ---------------------------------------------------------------------------

constexpr const char* kMuon = "muon_step";

MuonLrScale parse_lr_scale(const std::string& mode) {
  if (mode == "original") return MuonLrScale::kOriginal;
  if (mode == "match_rms_adamw") return MuonLrScale::kMatchRmsAdamW;
  if (mode == "none") return MuonLrScale::kNone;
  TORCH_CHECK_VALUE(false, "muon_step: lr_scale must be 'original', 'match_rms_adamw' or 'none', got '", mode, "'");
  return MuonLrScale::kNone;
}

std::vector<std::array<float, 3>> check_coefficients(const std::vector<std::vector<double>>& coefficients,
                                                     int64_t ns_steps) {
  TORCH_CHECK_VALUE(ns_steps >= 0, "muon_step: ns_steps must be >= 0, got ", ns_steps);
  TORCH_CHECK_VALUE(ns_steps <= static_cast<int64_t>(coefficients.size()), "muon_step: ns_steps=", ns_steps,
                    " but only ", coefficients.size(), " coefficient tuples are given");
  std::vector<std::array<float, 3>> out;
  for (int64_t i = 0; i < ns_steps; ++i) {
    const std::vector<double>& abc = coefficients[i];
    TORCH_CHECK_VALUE(abc.size() == 3, "muon_step: ns_coefficients[", i, "] must be an (a, b, c) triple, got ",
                      abc.size(), " values");
    for (double v : abc) {
      TORCH_CHECK_VALUE(std::isfinite(v), "muon_step: ns_coefficients[", i, "] must be finite");
    }
    out.push_back({static_cast<float>(abc[0]), static_cast<float>(abc[1]), static_cast<float>(abc[2])});
  }
  return out;
}

// Validates a bucket and fills `bucket` (tensors are shared, not copied).
void check_muon_args(MuonBucket& bucket, const MuonStepOptions& options) {
  const TensorList& params = bucket.params;
  const size_t n = params.size();
  checks::same_lengths(kMuon, n, {{"grads", &bucket.grads}, {"momentum_buffers", &bucket.momentum_buffers}});
  TORCH_CHECK_VALUE(bucket.second_momentum_buffers.size() == (options.hyper.normuon ? n : 0),
                    "muon_step: second_momentum_buffers must have one entry per param when beta2 is set and be "
                    "empty when beta2 is None, got ",
                    bucket.second_momentum_buffers.size(), " for ", n, " params");
  TORCH_CHECK_VALUE(bucket.masters.empty() || bucket.masters.size() == n,
                    "muon_step: masters must be empty or have one entry per param, got ", bucket.masters.size(),
                    " for ", n, " params");
  if (n == 0) return;

  const at::Device device = checks::params(kMuon, params);
  const at::ScalarType grad_dtype = checks::float_list_dtype(kMuon, bucket.grads, "grads");
  bucket.master_kind = checks::master_kind(kMuon, bucket.masters, params[0].scalar_type());
  const at::ScalarType master_dtype = bucket.master_kind == MasterKind::kRemainder ? at::kShort : at::kFloat;

  TORCH_CHECK_VALUE(params[0].dim() >= 2, "muon_step: params[0] must have at least 2 dimensions (rows, cols), got ",
                    params[0].sizes());
  bucket.rows = params[0].size(-2);
  bucket.cols = params[0].size(-1);
  TORCH_CHECK_VALUE(bucket.rows > 0 && bucket.cols > 0, "muon_step: params[0] has zero-sized matrices ",
                    params[0].sizes(), "; Muon needs rows >= 1 and cols >= 1");
  for (size_t i = 0; i < n; ++i) {
    const at::Tensor& p = params[i];
    TORCH_CHECK_VALUE(p.dim() >= 2 && p.size(-2) == bucket.rows && p.size(-1) == bucket.cols, "muon_step: ",
                      where("params", i), " has shape ", p.sizes(), " but the bucket's matrices are ", bucket.rows,
                      "x", bucket.cols, " (one matrix shape per call)");
    checks::companion(kMuon, bucket.grads[i], p, "grads", i, grad_dtype, p.sizes());
    checks::companion(kMuon, bucket.momentum_buffers[i], p, "momentum_buffers", i, at::kFloat, p.sizes());
    if (options.hyper.normuon) {
      std::vector<int64_t> stat_shape = p.sizes().vec();
      stat_shape[stat_shape.size() - (bucket.rows >= bucket.cols ? 1 : 2)] = 1;
      checks::companion(kMuon, bucket.second_momentum_buffers[i], p, "second_momentum_buffers", i, at::kFloat,
                        stat_shape);
    }
    if (!bucket.masters.empty()) checks::companion(kMuon, bucket.masters[i], p, "masters", i, master_dtype, p.sizes());
  }
  checks::scalar_tensor(kMuon, options.lr_tensor, "lr", device);
  checks::scalar_tensor(kMuon, options.inv_scale, "inv_scale", device);
  checks::scalar_tensor(kMuon, options.found_inf, "found_inf", device);
}

void muon_step(const TensorList& params, const TensorList& grads, const TensorList& momentum_buffers,
               const TensorList& second_momentum_buffers, const TensorList& masters, double lr,
               const c10::optional<at::Tensor>& lr_tensor, double momentum, bool nesterov,
               const c10::optional<double>& beta2, double weight_decay, int64_t ns_steps,
               const std::vector<std::vector<double>>& ns_coefficients, const std::string& lr_scale,
               const c10::optional<at::Tensor>& inv_scale, const c10::optional<at::Tensor>& found_inf,
               int64_t max_workspace_bytes, const c10::optional<int64_t>& polar_row_blocks) {
  MuonStepOptions options;
  options.hyper.momentum = static_cast<float>(momentum);
  options.hyper.nesterov = nesterov;
  options.hyper.normuon = beta2.has_value();
  options.hyper.beta2 = beta2.has_value() ? static_cast<float>(*beta2) : 0.0f;
  options.hyper.weight_decay = static_cast<float>(weight_decay);
  TORCH_CHECK_VALUE(lr >= 0.0, "muon_step: lr must be >= 0, got ", lr);
  TORCH_CHECK_VALUE(momentum >= 0.0 && momentum < 1.0, "muon_step: momentum must be in [0, 1), got ", momentum);
  TORCH_CHECK_VALUE(!beta2.has_value() || (*beta2 >= 0.0 && *beta2 < 1.0),
                    "muon_step: beta2 must be in [0, 1) or None, got ", beta2.value_or(0.0));
  TORCH_CHECK_VALUE(weight_decay >= 0.0, "muon_step: weight_decay must be >= 0, got ", weight_decay);
  TORCH_CHECK_VALUE(max_workspace_bytes > 0, "muon_step: max_workspace_bytes must be positive, got ",
                    max_workspace_bytes);
  TORCH_CHECK_VALUE(!polar_row_blocks.has_value() || (*polar_row_blocks >= 1 && *polar_row_blocks <= kMaxPolarRowBlocks),
                    "muon_step: polar_row_blocks must be in [1, ", kMaxPolarRowBlocks, "] or None, got ",
                    polar_row_blocks.value_or(0));
  const MuonLrScale scale_mode = parse_lr_scale(lr_scale);
  options.coefficients = check_coefficients(ns_coefficients, ns_steps);
  options.lr = lr;
  options.lr_tensor = lr_tensor;
  options.inv_scale = inv_scale;
  options.found_inf = found_inf;
  options.max_workspace_bytes = max_workspace_bytes;
  options.polar_row_blocks = polar_row_blocks.value_or(0);

  MuonBucket bucket;
  bucket.params = params;
  bucket.grads = grads;
  bucket.momentum_buffers = momentum_buffers;
  bucket.second_momentum_buffers = second_momentum_buffers;
  bucket.masters = masters;
  check_muon_args(bucket, options);
  if (params.empty()) return;
  options.lr_factor = static_cast<float>(muon_lr_factor(scale_mode, bucket.rows, bucket.cols));

  if (params[0].device().is_cpu()) {
    if (found_inf_on_cpu(found_inf)) return;
    host_lr(lr_tensor, lr, kMuon);
    cpu::muon_step(bucket, options);
    return;
  }
#if defined(MUON_EXT_WITH_CUDA)
  cuda::muon_step(bucket, options);
#endif
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
  const at::Device device = master.device();
  TORCH_CHECK_VALUE(device.is_cpu() || device.is_cuda(), op, ": tensors must be on CPU or CUDA, got ", device);
#if !defined(MUON_EXT_WITH_CUDA)
  TORCH_CHECK_VALUE(!device.is_cuda(), op, ": this build of muon_ext has no CUDA kernels");
#endif
  for (const auto& [name, t] : {std::pair<const char*, const at::Tensor*>{"param", &param}, {"remainder", &remainder}}) {
    TORCH_CHECK_VALUE(t->device() == device, op, ": ", name, " is on ", t->device(), " but master is on ", device);
    TORCH_CHECK_VALUE(t->sizes() == master.sizes(), op, ": ", name, " has shape ", t->sizes(), " but master has ",
                      master.sizes());
  }
  for (const at::Tensor* t : {&master, &param, &remainder}) {
    TORCH_CHECK_VALUE(t->is_contiguous(), op, ": tensors must be contiguous");
  }
}

void split_master(const at::Tensor& master, const at::Tensor& param, const at::Tensor& remainder) {
  check_remainder_triple("split_master", master, param, remainder);
  if (master.device().is_cpu()) return cpu::split_master(master, param, remainder);
#if defined(MUON_EXT_WITH_CUDA)
  cuda::split_master(master, param, remainder);
#endif
}

void merge_master(const at::Tensor& param, const at::Tensor& remainder, const at::Tensor& master) {
  check_remainder_triple("merge_master", master, param, remainder);
  if (master.device().is_cpu()) return cpu::merge_master(param, remainder, master);
#if defined(MUON_EXT_WITH_CUDA)
  cuda::merge_master(param, remainder, master);
#endif
}

std::vector<std::array<double, 3>> polar_express_coefficients() {
  std::vector<std::array<double, 3>> out;
  for (const auto& abc : kPolarExpressCoefficients) out.push_back({abc[0], abc[1], abc[2]});
  return out;
}

std::vector<std::string> cpu_capabilities() {
  std::vector<std::string> out;
  for (cpu::CpuCapability c : cpu::available_capabilities()) out.emplace_back(cpu::capability_name(c));
  return out;
}

// The optimizer's per-step check of a bucket, in one call: (index of the first
// param that must not be stepped, or -1; whether every grad is present,
// contiguous and of one dtype). A param must not be stepped when its grad has
// another shape, device or layout or an unsupported dtype, or when the param
// itself is no longer contiguous; the caller then raises, naming it.
std::tuple<int64_t, bool> check_bucket_grads(const std::vector<at::Tensor>& params,
                                             const std::vector<c10::optional<at::Tensor>>& grads) {
  TORCH_CHECK_VALUE(params.size() == grads.size(), "check_bucket_grads: ", params.size(), " params but ",
                    grads.size(), " grads");
  bool uniform = true;
  for (size_t i = 0; i < params.size(); ++i) {
    const at::Tensor& p = params[i];
    if (!p.is_contiguous()) return {int64_t(i), false};
    if (!grads[i].has_value() || !grads[i]->defined()) {
      uniform = false;
      continue;
    }
    const at::Tensor& g = *grads[i];
    const at::ScalarType dtype = g.scalar_type();
    if (g.layout() != at::kStrided || !checks::is_supported_float(dtype) || g.sizes() != p.sizes() ||
        g.device() != p.device()) {
      return {int64_t(i), false};
    }
    uniform = uniform && g.is_contiguous() && (i == 0 || dtype == grads[0]->scalar_type());
  }
  return {-1, uniform};
}

}  // namespace
}  // namespace muon_ext

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "muon_ext kernels (CPU and, when built, CUDA); see muon_ext.ops for the contracts";
  m.def("adamw_step", &muon_ext::adamw_step, py::arg("params"), py::arg("grads"), py::arg("exp_avgs"),
        py::arg("exp_avg_sqs"), py::arg("masters"), py::arg("steps"), py::arg("lr"), py::arg("lr_tensor"),
        py::arg("beta1"), py::arg("beta2"), py::arg("eps"), py::arg("weight_decay"), py::arg("adam_w_mode"),
        py::arg("bias_correction"), py::arg("inv_scale"), py::arg("found_inf"));
  m.def("muon_step", &muon_ext::muon_step, py::arg("params"), py::arg("grads"), py::arg("momentum_buffers"),
        py::arg("second_momentum_buffers"), py::arg("masters"), py::arg("lr"), py::arg("lr_tensor"),
        py::arg("momentum"), py::arg("nesterov"), py::arg("beta2"), py::arg("weight_decay"), py::arg("ns_steps"),
        py::arg("ns_coefficients"), py::arg("lr_scale"), py::arg("inv_scale"), py::arg("found_inf"),
        py::arg("max_workspace_bytes"), py::arg("polar_row_blocks"));
  m.def("split_master", &muon_ext::split_master, py::arg("master"), py::arg("param"), py::arg("remainder"));
  m.def("merge_master", &muon_ext::merge_master, py::arg("param"), py::arg("remainder"), py::arg("master"));
  m.def("polar_express_coefficients", &muon_ext::polar_express_coefficients,
        "The default Polar-Express (a, b, c) tuples, one per iteration.");
  m.def("check_bucket_grads", &muon_ext::check_bucket_grads, py::arg("params"), py::arg("grads"));
  m.def("cpu_capabilities", &muon_ext::cpu_capabilities, "Instruction sets of the CPU kernels usable here, best last.");
#if defined(MUON_EXT_WITH_CUDA)
  m.attr("with_cuda") = true;
#else
  m.attr("with_cuda") = false;
#endif
}

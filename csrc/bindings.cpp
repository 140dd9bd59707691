// The pybind11 module muon_ext._C: argument checks at the boundary, then the
// CPU or CUDA kernel.  Every check runs before any tensor is written, so a
// rejected call leaves all state untouched.
#include <torch/extension.h>

#include <string>
#include <unordered_set>
#include <vector>

#include "common/adamw_math.h"
#include "cpu/adamw_cpu.h"
#if defined(MUON_EXT_WITH_CUDA)
#include "cuda/adamw_cuda.h"
#endif

namespace muon_ext {
namespace {

using TensorList = std::vector<at::Tensor>;

std::string where(const char* list, size_t index) { return std::string(list) + "[" + std::to_string(index) + "]"; }

cpu::ScalarKind scalar_kind(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return cpu::ScalarKind::kFloat32;
    case at::kBFloat16: return cpu::ScalarKind::kBFloat16;
    default: return cpu::ScalarKind::kFloat16;
  }
}

bool is_supported_float(at::ScalarType t) { return t == at::kFloat || t == at::kBFloat16 || t == at::kHalf; }

// A per-element companion of params[i] (grad, moment, master): same device and
// shape, contiguous, and of the expected dtype (or, for `expected` undefined,
// the dtype of the first tensor of its list).
void check_companion(const at::Tensor& t, const at::Tensor& param, const char* list, size_t i,
                     at::ScalarType expected) {
  const std::string name = where(list, i);
  TORCH_CHECK_VALUE(t.defined(), "adamw_step: ", name, " is undefined");
  TORCH_CHECK_TYPE(t.scalar_type() == expected, "adamw_step: ", name, " has dtype ", t.scalar_type(),
                   ", expected ", expected);
  TORCH_CHECK_VALUE(t.device() == param.device(), "adamw_step: ", name, " is on ", t.device(), " but params[", i,
                    "] is on ", param.device());
  TORCH_CHECK_VALUE(t.sizes() == param.sizes(), "adamw_step: ", name, " has shape ", t.sizes(), " but params[", i,
                    "] has shape ", param.sizes());
  TORCH_CHECK_VALUE(t.is_contiguous(), "adamw_step: ", name, " must be contiguous");
}

void check_scalar_tensor(const c10::optional<at::Tensor>& t, const char* name, const at::Device& device) {
  if (!t.has_value()) return;
  TORCH_CHECK_VALUE(t->defined(), "adamw_step: ", name, " is undefined");
  TORCH_CHECK_TYPE(t->scalar_type() == at::kFloat, "adamw_step: ", name, " must be float32, got ",
                   t->scalar_type());
  TORCH_CHECK_VALUE(t->numel() == 1, "adamw_step: ", name, " must hold one element, got ", t->numel());
  TORCH_CHECK_VALUE(t->device() == device, "adamw_step: ", name, " is on ", t->device(), " but params are on ",
                    device);
}

void check_hyper(const AdamWHyper& h, double lr) {
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
  TORCH_CHECK_VALUE(grads.size() == n && exp_avgs.size() == n && exp_avg_sqs.size() == n && steps.size() == n,
                    "adamw_step: params, grads, exp_avgs, exp_avg_sqs and steps must have the same length, got ", n,
                    ", ", grads.size(), ", ", exp_avgs.size(), ", ", exp_avg_sqs.size(), ", ", steps.size());
  TORCH_CHECK_VALUE(masters.empty() || masters.size() == n,
                    "adamw_step: masters must be empty or have one entry per param, got ", masters.size(), " for ",
                    n, " params");
  if (n == 0) return MasterKind::kNone;

  const at::Tensor& first = params[0];
  TORCH_CHECK_VALUE(first.defined(), "adamw_step: params[0] is undefined");
  const at::Device device = first.device();
  TORCH_CHECK_VALUE(device.is_cpu() || device.is_cuda(), "adamw_step: params must be on CPU or CUDA, got ", device);
#if !defined(MUON_EXT_WITH_CUDA)
  TORCH_CHECK_VALUE(!device.is_cuda(),
                    "adamw_step: params are on CUDA but this build of muon_ext has no CUDA kernels "
                    "(rebuild with nvcc available and without MUON_EXT_FORCE_CPU=1)");
#endif
  const at::ScalarType param_dtype = first.scalar_type();
  TORCH_CHECK_TYPE(is_supported_float(param_dtype), "adamw_step: params[0] has dtype ", param_dtype,
                   "; supported: float32, bfloat16, float16");
  TORCH_CHECK_VALUE(grads[0].defined(), "adamw_step: grads[0] is undefined");
  const at::ScalarType grad_dtype = grads[0].scalar_type();
  TORCH_CHECK_TYPE(is_supported_float(grad_dtype), "adamw_step: grads[0] has dtype ", grad_dtype,
                   "; supported: float32, bfloat16, float16");

  MasterKind kind = MasterKind::kNone;
  at::ScalarType master_dtype = at::kFloat;
  if (!masters.empty()) {
    TORCH_CHECK_VALUE(masters[0].defined(), "adamw_step: masters[0] is undefined");
    master_dtype = masters[0].scalar_type();
    if (master_dtype == at::kFloat) {
      TORCH_CHECK_TYPE(param_dtype != at::kFloat,
                       "adamw_step: float32 params are their own master; pass masters=[] for them");
      kind = MasterKind::kFP32;
    } else if (master_dtype == at::kShort) {
      TORCH_CHECK_TYPE(param_dtype == at::kBFloat16, "adamw_step: int16 remainders (masters) need bfloat16 params, got ",
                       param_dtype);
      kind = MasterKind::kRemainder;
    } else {
      TORCH_CHECK_TYPE(false, "adamw_step: masters[0] has dtype ", master_dtype,
                       "; expected float32 (FP32 masters) or int16 (BF16 remainders)");
    }
  }

  std::unordered_set<const void*> param_ptrs, step_ptrs;
  for (size_t i = 0; i < n; ++i) {
    const at::Tensor& p = params[i];
    TORCH_CHECK_VALUE(p.defined(), "adamw_step: ", where("params", i), " is undefined");
    TORCH_CHECK_TYPE(p.scalar_type() == param_dtype, "adamw_step: ", where("params", i), " has dtype ",
                     p.scalar_type(), " but params[0] has ", param_dtype, " (one dtype per call)");
    TORCH_CHECK_VALUE(p.device() == device, "adamw_step: ", where("params", i), " is on ", p.device(),
                      " but params[0] is on ", device);
    TORCH_CHECK_VALUE(p.is_contiguous(), "adamw_step: ", where("params", i), " must be contiguous");
    TORCH_CHECK_VALUE(p.numel() == 0 || param_ptrs.insert(p.data_ptr()).second, "adamw_step: ", where("params", i),
                      " shares its storage with an earlier param");
    check_companion(grads[i], p, "grads", i, grad_dtype);
    check_companion(exp_avgs[i], p, "exp_avgs", i, at::kFloat);
    check_companion(exp_avg_sqs[i], p, "exp_avg_sqs", i, at::kFloat);
    if (!masters.empty()) check_companion(masters[i], p, "masters", i, master_dtype);

    const at::Tensor& s = steps[i];
    const std::string step_name = where("steps", i);
    TORCH_CHECK_VALUE(s.defined(), "adamw_step: ", step_name, " is undefined");
    TORCH_CHECK_TYPE(s.scalar_type() == at::kFloat, "adamw_step: ", step_name, " must be float32, got ",
                     s.scalar_type());
    TORCH_CHECK_VALUE(s.numel() == 1, "adamw_step: ", step_name, " must hold one element, got ", s.numel());
    TORCH_CHECK_VALUE(s.device() == device, "adamw_step: ", step_name, " is on ", s.device(), " but params are on ",
                      device);
    TORCH_CHECK_VALUE(step_ptrs.insert(s.data_ptr()).second, "adamw_step: ", step_name,
                      " is the same tensor as an earlier step counter");
  }
  check_scalar_tensor(lr_tensor, "lr", device);
  check_scalar_tensor(inv_scale, "inv_scale", device);
  check_scalar_tensor(found_inf, "found_inf", device);
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
  check_hyper(hyper, lr);
  const MasterKind kind =
      check_adamw_args(params, grads, exp_avgs, exp_avg_sqs, masters, steps, lr_tensor, inv_scale, found_inf);
  if (params.empty()) return;

  if (params[0].device().is_cpu()) {
    if (found_inf.has_value() && found_inf->item<float>() != 0.0f) return;
    const float lr_value = lr_tensor.has_value() ? lr_tensor->item<float>() : hyper.lr;
    TORCH_CHECK_VALUE(lr_value >= 0.0f, "adamw_step: lr must be >= 0, got ", lr_value);
    const float inv_scale_value = inv_scale.has_value() ? inv_scale->item<float>() : 1.0f;
    adamw_step_cpu(params, grads, exp_avgs, exp_avg_sqs, masters, steps, kind, hyper, lr_value, inv_scale_value);
    return;
  }
#if defined(MUON_EXT_WITH_CUDA)
  cuda::adamw_step(params, grads, exp_avgs, exp_avg_sqs, masters, steps, kind, hyper, lr, lr_tensor, inv_scale,
                   found_inf);
#endif
}

std::vector<std::string> cpu_capabilities() {
  std::vector<std::string> out;
  for (cpu::CpuCapability c : cpu::available_capabilities()) out.emplace_back(cpu::capability_name(c));
  return out;
}

}  // namespace
}  // namespace muon_ext

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "muon_ext kernels (CPU and, when built, CUDA)";
  m.def("adamw_step", &muon_ext::adamw_step,
        "One multi-tensor AdamW step; see muon_ext.ops.adamw_step for the contract.", py::arg("params"),
        py::arg("grads"), py::arg("exp_avgs"), py::arg("exp_avg_sqs"), py::arg("masters"), py::arg("steps"),
        py::arg("lr"), py::arg("lr_tensor"), py::arg("beta1"), py::arg("beta2"), py::arg("eps"),
        py::arg("weight_decay"), py::arg("adam_w_mode"), py::arg("bias_correction"), py::arg("inv_scale"),
        py::arg("found_inf"));
  m.def("cpu_capabilities", &muon_ext::cpu_capabilities,
        "Instruction sets of the CPU kernels usable here, best last.");
#if defined(MUON_EXT_WITH_CUDA)
  m.attr("with_cuda") = true;
#else
  m.attr("with_cuda") = false;
#endif
}

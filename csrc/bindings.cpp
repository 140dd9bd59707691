// The pybind11 module muon_ext._C: what is not an op (the kernels are
// torch.library ops, csrc/ops.cpp): build facts, the schema table, and the
// optimizer's one-call grad check of a bucket.
#include <ATen/record_function.h>
#include <torch/extension.h>

#include <string>
#include <tuple>
#include <vector>

#include "checks.h"
#include "ops.h"
#include "common/muon_math.h"
#include "common/schema.h"
#include "cpu/adamw_cpu.h"

namespace muon_ext {
namespace {

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

// The table of csrc/common/schema.h: {"ranges": [(kind, name, low, high,
// high_inclusive, integer)], "modes": {mode: [values]}}.
py::dict schema_table() {
  py::list ranges;
  for (const schema::Range& r : schema::kRanges) {
    ranges.append(py::make_tuple(r.kind, r.name, r.low, r.high, r.high_inclusive, r.integer));
  }
  py::dict modes;
  for (const schema::Mode& m : schema::kModes) {
    py::list values;
    for (int i = 0; i < m.count; ++i) values.append(m.values[i]);
    modes[m.name] = py::tuple(values);
  }
  py::dict out;
  out["ranges"] = ranges;
  out["modes"] = modes;
  return out;
}

using Tensors = std::vector<at::Tensor>;
using OptionalTensor = std::optional<at::Tensor>;

// The fast eager entries of the two step ops (csrc/ops.h): same arguments as
// the schemas, recorded under the op's name for the profiler.
void adamw_step_eager(const Tensors& params, const Tensors& grads, const Tensors& exp_avgs, const Tensors& exp_avg_sqs,
                      const Tensors& masters, const Tensors& steps, double lr, const OptionalTensor& lr_tensor,
                      double beta1, double beta2, double eps, double weight_decay, bool adam_w_mode,
                      bool bias_correction, const OptionalTensor& inv_scale, const OptionalTensor& found_inf) {
  RECORD_FUNCTION("muon_ext::adamw_step", std::vector<c10::IValue>());
  op::adamw_step(params, grads, exp_avgs, exp_avg_sqs, masters, steps, lr, lr_tensor, beta1, beta2, eps, weight_decay,
                 adam_w_mode, bias_correction, inv_scale, found_inf);
}

void muon_step_eager(const Tensors& params, const Tensors& grads, const Tensors& momentum_buffers,
                     const Tensors& second_momentum_buffers, const Tensors& masters, double lr,
                     const OptionalTensor& lr_tensor, double momentum, bool nesterov, std::optional<double> beta2,
                     double weight_decay, int64_t ns_steps, const std::vector<double>& ns_coefficients,
                     const std::string& lr_scale, const OptionalTensor& inv_scale, const OptionalTensor& found_inf,
                     int64_t max_workspace_bytes, std::optional<int64_t> polar_row_blocks) {
  RECORD_FUNCTION("muon_ext::muon_step", std::vector<c10::IValue>());
  op::muon_step(params, grads, momentum_buffers, second_momentum_buffers, masters, lr, lr_tensor, momentum, nesterov,
                beta2, weight_decay, ns_steps, ns_coefficients, lr_scale, inv_scale, found_inf, max_workspace_bytes,
                polar_row_blocks);
}

}  // namespace
}  // namespace muon_ext

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "muon_ext kernels (CPU and, when built, CUDA); see muon_ext.ops for the contracts";
  m.def("adamw_step", &muon_ext::adamw_step_eager, py::arg("params"), py::arg("grads"), py::arg("exp_avgs"),
        py::arg("exp_avg_sqs"), py::arg("masters"), py::arg("steps"), py::kw_only(), py::arg("lr"),
        py::arg("lr_tensor"), py::arg("beta1"), py::arg("beta2"), py::arg("eps"), py::arg("weight_decay"),
        py::arg("adam_w_mode"), py::arg("bias_correction"), py::arg("inv_scale"), py::arg("found_inf"),
        "torch.ops.muon_ext.adamw_step for plain eager tensors (see csrc/ops.h).");
  m.def("muon_step", &muon_ext::muon_step_eager, py::arg("params"), py::arg("grads"), py::arg("momentum_buffers"),
        py::arg("second_momentum_buffers"), py::arg("masters"), py::kw_only(), py::arg("lr"), py::arg("lr_tensor"),
        py::arg("momentum"), py::arg("nesterov"), py::arg("beta2"), py::arg("weight_decay"), py::arg("ns_steps"),
        py::arg("ns_coefficients"), py::arg("lr_scale"), py::arg("inv_scale"), py::arg("found_inf"),
        py::arg("max_workspace_bytes"), py::arg("polar_row_blocks"),
        "torch.ops.muon_ext.muon_step for plain eager tensors (see csrc/ops.h).");
  m.def("polar_express_coefficients", &muon_ext::polar_express_coefficients,
        "The default Polar-Express (a, b, c) tuples, one per iteration.");
  m.def("schema", &muon_ext::schema_table, "The hyper-parameter ranges and mode names (csrc/common/schema.h).");
  m.def("check_bucket_grads", &muon_ext::check_bucket_grads, py::arg("params"), py::arg("grads"));
  m.def("cpu_capabilities", &muon_ext::cpu_capabilities, "Instruction sets of the CPU kernels usable here, best last.");
#if defined(MUON_EXT_WITH_CUDA)
  m.attr("with_cuda") = true;
#else
  m.attr("with_cuda") = false;
#endif
}

// The pybind11 module muon_ext._C, bindings only: what is not an op (the
// kernels are torch.library ops, csrc/ops.cpp): build facts, the schema
// table, the shape rules (common/shapes.h), the optimizer's one-call check of
// a bucket (step_checks.h) and the eager entries of the two step ops.
#include <ATen/record_function.h>
#include <torch/extension.h>

#if defined(MUON_EXT_WITH_CUDA)
#include <cuda_runtime_api.h>
#endif

#include <c10/util/SmallVector.h>

#include <algorithm>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "checks.h"
#include "ops.h"
#include "step_checks.h"
#include "common/muon_math.h"
#include "common/polar_plan.h"
#include "common/schema.h"
#include "common/shapes.h"
#include "cpu/adamw_cpu.h"
#include "cpu/bf16_tile_gemm.h"
#include "cpu/scratch_pool.h"
#include "cpu/polar_express_cpu.h"
#include "cpu/parallel_probe.h"

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

// check_bucket's `rules`: (key, dtype or None, StateShape or the entry's sizes (kGiven), required) tuples.
std::vector<checks::StateRule> state_rules(const py::tuple& rules_in) {
  std::vector<checks::StateRule> rules;
  for (const py::handle item : rules_in) {
    const py::tuple t = item.cast<py::tuple>();
    checks::StateRule rule;
    rule.key = py::reinterpret_borrow<py::object>(t[0]);
    if (!t[1].is_none()) rule.dtype = t[1].cast<at::ScalarType>();
    if (py::isinstance<py::tuple>(t[2])) {
      rule.shape = checks::StateShape::kGiven;
      rule.sizes = t[2].cast<std::vector<int64_t>>();
    } else {
      rule.shape = static_cast<checks::StateShape>(t[2].cast<int64_t>());
    }
    rule.required = t[3].cast<bool>();
    rules.push_back(std::move(rule));
  }
  return rules;
}

checks::BucketCheck check_bucket(const py::list& params, const py::object& grad_attr, const py::object& state,
                                 at::ScalarType dtype, at::Device device, const py::tuple& rules, int64_t rows,
                                 int64_t cols, const std::string& matrix_view, checks::MemoryRanges* ranges,
                                 int64_t bucket, bool param_data) {
  return checks::check_bucket(params, grad_attr, state, dtype, device, state_rules(rules), rows, cols,
                              shapes::parse_matrix_view(matrix_view.c_str()), ranges, bucket, param_data);
}

// The first two overlapping params recorded by check_bucket, as
// ((bucket, index), (bucket, index)), the second recorded later; or None.
py::object first_overlap(checks::MemoryRanges& ranges) {
  std::pair<int64_t, int64_t> a, b;
  if (!ranges.first_overlap(&a, &b)) return py::none();
  return py::make_tuple(py::make_tuple(a.first, a.second), py::make_tuple(b.first, b.second));
}

// common/shapes.h for muon_ext/_shapes.py: (rule, rows, cols).
py::tuple matrix_shape(const std::vector<int64_t>& sizes, const std::string& view) {
  const shapes::Matrices m =
      shapes::matrix_shape(sizes.data(), static_cast<int64_t>(sizes.size()), shapes::parse_matrix_view(view.c_str()));
  return py::make_tuple(m.rule, m.rows, m.cols);
}

// The NorMuon statistics shape of a param of shape `sizes` under `view`, or
// None where it is not matrices.
py::object second_moment_shape(const std::vector<int64_t>& sizes, const std::string& view) {
  const shapes::MatrixView v = shapes::parse_matrix_view(view.c_str());
  const int64_t dim = static_cast<int64_t>(sizes.size());
  const shapes::Matrices m = shapes::matrix_shape(sizes.data(), dim, v);
  if (m.rule != shapes::MatrixRule::kMatrices) return py::none();
  std::vector<int64_t> out;
  shapes::second_moment_shape(sizes.data(), dim, v, m.rows, m.cols, out);
  return py::tuple(py::cast(out));
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

// The fast eager entries of the two step ops (csrc/ops.h): the schemas'
// arguments and the step check's token (None: check everything), recorded
// under the op's name for the profiler.
void adamw_step_eager(const Tensors& params, const Tensors& grads, const Tensors& exp_avgs, const Tensors& exp_avg_sqs,
                      const Tensors& masters, const Tensors& steps, double lr, const OptionalTensor& lr_tensor,
                      double beta1, double beta2, double eps, double weight_decay, bool adam_w_mode,
                      bool bias_correction, const OptionalTensor& inv_scale, const OptionalTensor& found_inf,
                      checks::CheckedBucket* checked) {
  RECORD_FUNCTION("muon_ext::adamw_step", std::vector<c10::IValue>());
  op::adamw_step(params, grads, exp_avgs, exp_avg_sqs, masters, steps, lr, lr_tensor, beta1, beta2, eps, weight_decay,
                 adam_w_mode, bias_correction, inv_scale, found_inf, checked);
}

void muon_step_eager(const Tensors& params, const Tensors& grads, const Tensors& momentum_buffers,
                     const Tensors& second_momentum_buffers, const Tensors& masters, double lr,
                     const OptionalTensor& lr_tensor, double momentum, bool nesterov, std::optional<double> beta2,
                     double weight_decay, int64_t ns_steps, const std::vector<double>& ns_coefficients,
                     const std::string& lr_scale, const OptionalTensor& inv_scale, const OptionalTensor& found_inf,
                     int64_t max_workspace_bytes, std::optional<int64_t> polar_row_blocks,
                     const std::string& polar_dtype, const std::string& polar_method,
                     checks::CheckedBucket* checked) {
  RECORD_FUNCTION("muon_ext::muon_step", std::vector<c10::IValue>());
  op::muon_step(params, grads, momentum_buffers, second_momentum_buffers, masters, lr, lr_tensor, momentum, nesterov,
                beta2, weight_decay, ns_steps, ns_coefficients, lr_scale, inv_scale, found_inf, max_workspace_bytes,
                polar_row_blocks, polar_dtype, polar_method, checked);
}

}  // namespace
}  // namespace muon_ext

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "muon_ext kernels (CPU and, when built, CUDA); see muon_ext.ops for the contracts";
  m.def("adamw_step", &muon_ext::adamw_step_eager, py::arg("params"), py::arg("grads"), py::arg("exp_avgs"),
        py::arg("exp_avg_sqs"), py::arg("masters"), py::arg("steps"), py::kw_only(), py::arg("lr"),
        py::arg("lr_tensor"), py::arg("beta1"), py::arg("beta2"), py::arg("eps"), py::arg("weight_decay"),
        py::arg("adam_w_mode"), py::arg("bias_correction"), py::arg("inv_scale"), py::arg("found_inf"),
        py::arg("checked") = nullptr, "torch.ops.muon_ext.adamw_step for plain eager tensors (see csrc/ops.h).");
  m.def("muon_step", &muon_ext::muon_step_eager, py::arg("params"), py::arg("grads"), py::arg("momentum_buffers"),
        py::arg("second_momentum_buffers"), py::arg("masters"), py::kw_only(), py::arg("lr"), py::arg("lr_tensor"),
        py::arg("momentum"), py::arg("nesterov"), py::arg("beta2"), py::arg("weight_decay"), py::arg("ns_steps"),
        py::arg("ns_coefficients"), py::arg("lr_scale"), py::arg("inv_scale"), py::arg("found_inf"),
        py::arg("max_workspace_bytes"), py::arg("polar_row_blocks"), py::arg("polar_dtype"),
        py::arg("polar_method") = "standard", py::arg("checked") = nullptr,
        "torch.ops.muon_ext.muon_step for plain eager tensors (see csrc/ops.h).");
  m.def("polar_express_coefficients", &muon_ext::polar_express_coefficients,
        "The default Polar-Express (a, b, c) tuples, one per iteration.");
  m.def(
      "polar_method_for",
      [](const std::string& method, int64_t rows, int64_t cols) {
        TORCH_CHECK_VALUE(muon_ext::schema::find_mode("polar_method", method.c_str()) >= 0,
                          "polar_method must be 'standard', 'gram' or 'auto', got '", method, "'");
        const muon_ext::PolarMethod parsed = method == "gram"   ? muon_ext::PolarMethod::kGram
                                             : method == "auto" ? muon_ext::PolarMethod::kAuto
                                                                : muon_ext::PolarMethod::kStandard;
        return muon_ext::polar_method_for(parsed, rows, cols) == muon_ext::PolarMethod::kGram ? "gram" : "standard";
      },
      py::arg("method"), py::arg("rows"), py::arg("cols"),
      "The iteration ('standard' or 'gram') a rows x cols matrix runs under polar_method (csrc/common/polar_plan.h).");
  m.def("schema", &muon_ext::schema_table, "The hyper-parameter ranges and mode names (csrc/common/schema.h).");
  py::class_<muon_ext::checks::MemoryRanges>(m, "MemoryRanges",
                                             "Byte ranges of the params checked in one step (check_bucket).")
      .def(py::init<>())
      .def("first_overlap", &muon_ext::first_overlap);
  using muon_ext::checks::StepProblem;
  py::enum_<StepProblem>(m, "StepProblem", "What check_bucket found wrong (csrc/step_checks.h).")
      .value("none", StepProblem::kNone)
      .value("param_type", StepProblem::kParamType)
      .value("param_layout", StepProblem::kParamLayout)
      .value("param_dtype", StepProblem::kParamDtype)
      .value("param_device", StepProblem::kParamDevice)
      .value("param_contiguous", StepProblem::kParamContiguous)
      .value("param_shape", StepProblem::kParamShape)
      .value("param_storage", StepProblem::kParamStorage)
      .value("state_type", StepProblem::kStateType)
      .value("state_missing", StepProblem::kStateMissing)
      .value("state_unexpected", StepProblem::kStateUnexpected)
      .value("state_layout", StepProblem::kStateLayout)
      .value("state_dtype", StepProblem::kStateDtype)
      .value("state_device", StepProblem::kStateDevice)
      .value("state_shape", StepProblem::kStateShape)
      .value("state_contiguous", StepProblem::kStateContiguous)
      .value("state_storage", StepProblem::kStateStorage)
      .value("state_shared", StepProblem::kStateShared)
      .value("grad_type", StepProblem::kGradType)
      .value("grad_layout", StepProblem::kGradLayout)
      .value("grad_dtype", StepProblem::kGradDtype)
      .value("grad_shape", StepProblem::kGradShape)
      .value("grad_device", StepProblem::kGradDevice)
      .value("grad_storage", StepProblem::kGradStorage);
  py::class_<muon_ext::checks::CheckedBucket, std::shared_ptr<muon_ext::checks::CheckedBucket>>(
      m, "CheckedBucket", "The step check's single-use token for a step op (csrc/checks.h).")
      .def("invalidate", &muon_ext::checks::CheckedBucket::invalidate)
      .def_property_readonly("valid", &muon_ext::checks::CheckedBucket::valid);
  using muon_ext::checks::BucketCheck;
  py::class_<BucketCheck>(m, "BucketCheck", "The result of check_bucket (csrc/step_checks.h).")
      .def_readonly("problem", &BucketCheck::problem)
      .def_readonly("index", &BucketCheck::index)
      .def_readonly("key", &BucketCheck::key)
      .def_readonly("other", &BucketCheck::other)
      .def_readonly("uniform", &BucketCheck::uniform)
      .def_readonly("grads", &BucketCheck::grads)
      .def_readonly("state", &BucketCheck::state)
      .def_readonly("token", &BucketCheck::token);
  m.def("check_bucket", &muon_ext::check_bucket, py::arg("params"), py::arg("grad_attr"), py::arg("state"),
        py::kw_only(), py::arg("dtype"), py::arg("device"), py::arg("rules"), py::arg("rows"), py::arg("cols"),
        py::arg("matrix_view"), py::arg("ranges"), py::arg("bucket"), py::arg("param_data") = true,
        "The optimizer's metadata check of one bucket (csrc/step_checks.h).");
  using muon_ext::shapes::MatrixRule;
  py::enum_<MatrixRule>(m, "MatrixRule", "Whether a param is matrices under its matrix_view (csrc/common/shapes.h).")
      .value("matrices", MatrixRule::kMatrices)
      .value("rank_below_two", MatrixRule::kRankBelowTwo)
      .value("needs_view", MatrixRule::kNeedsView);
  m.def("matrix_shape", &muon_ext::matrix_shape, py::arg("sizes"), py::arg("matrix_view"),
        "(MatrixRule, rows, cols) of a param of shape `sizes` under `matrix_view` (csrc/common/shapes.h).");
  m.def("second_moment_shape", &muon_ext::second_moment_shape, py::arg("sizes"), py::arg("matrix_view"),
        "The NorMuon statistics shape of a param, or None where it is not matrices (csrc/common/shapes.h).");
  m.def("stats_per_row", &muon_ext::shapes::stats_per_row, py::arg("rows"), py::arg("cols"),
        "Whether NorMuon keeps one statistic per row (else per column) of a rows x cols matrix.");
  m.def("storage_problem", &muon_ext::checks::storage_problem, py::arg("tensor"),
        "What is wrong with a tensor's storage for its view, or '' when it holds every element.");
  m.def("cpu_capabilities", &muon_ext::cpu_capabilities, "Instruction sets of the CPU kernels usable here, best last.");
  m.def(
      "cpu_bf16_gemm",
      [] { return muon_ext::cpu::polar_bf16_gemm() == muon_ext::cpu::PolarGemm::kNativeBf16 ? "native" : "rounded"; },
      "How BF16 Polar-Express GEMMs run on this CPU (see muon_ext.ops.cpu_bf16_gemm).");
  m.def(
      "cpu_bf16_tile_gemm", [] { return std::string(muon_ext::cpu::bf16_tile_gemm_isa()); },
      "The instruction set of oneDNN's micro-kernel under native BF16 Polar-Express, or '' (see "
      "muon_ext.ops.cpu_bf16_tile_gemm).");
  m.def("cpu_scratch_pool_bytes", &muon_ext::cpu::scratch_pool_bytes,
        "Test hook: bytes of CPU scratch kept between calls (csrc/cpu/scratch_pool.h).");
  m.def("threads_used_by_parallel_for", &muon_ext::cpu::threads_used_by_parallel_for, py::arg("items"),
        py::arg("grain"), py::call_guard<py::gil_scoped_release>(),
        "Test hook: how many distinct threads at::parallel_for, as compiled into the kernels, runs on.");
#if defined(MUON_EXT_WITH_CUDA)
  m.attr("with_cuda") = true;
  // Page-locking of CPU slabs for offload="cpu" (muon_ext/offload.py). A failed
  // call's error is cleared here: left as CUDA's last error, it would be
  // reported by the next kernel launch check, in unrelated code.
  m.def(
      "register_host_memory",
      [](uintptr_t ptr, size_t nbytes) {
        if (cudaHostRegister(reinterpret_cast<void*>(ptr), nbytes, cudaHostRegisterDefault) == cudaSuccess) return true;
        (void)cudaGetLastError();
        return false;
      },
      py::arg("ptr"), py::arg("nbytes"), py::call_guard<py::gil_scoped_release>(),
      "Page-locks [ptr, ptr + nbytes) for asynchronous copies; False (error cleared) where CUDA refuses.");
  m.def(
      "unregister_host_memory",
      [](uintptr_t ptr) {
        if (cudaHostUnregister(reinterpret_cast<void*>(ptr)) == cudaSuccess) return true;
        (void)cudaGetLastError();
        return false;
      },
      py::arg("ptr"), py::call_guard<py::gil_scoped_release>(),
      "Undoes register_host_memory; False (error cleared) where CUDA refuses, e.g. after its shutdown.");
#else
  m.attr("with_cuda") = false;
#endif
}

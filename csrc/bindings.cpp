// The pybind11 module muon_ext._C: what is not an op (the kernels are
// torch.library ops, csrc/ops.cpp): build facts, the schema table, and the
// optimizer's one-call check of a bucket.
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
#include "common/muon_math.h"
#include "common/polar_plan.h"
#include "common/schema.h"
#include "cpu/adamw_cpu.h"
#include "cpu/muon_cpu.h"
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

// ---------------------------------------------------------------------------
// The optimizer's checks of its params and their state, one call per bucket
// (docs/design.md, "Data flow of one step"): metadata only, nothing is read
// or written.  They find the first param the kernels would refuse, or that
// they would read or write out of bounds, so that the optimizer raises,
// naming it, before the first kernel of a step runs.  Python words the
// message (muon_ext/buckets.py); this side only finds the param, fast.
// ---------------------------------------------------------------------------

// How a state entry's shape follows from its param's.
enum class StateShape : int64_t { kParam = 0, kScalar = 1, kSecondMoment = 2 };

// One state entry the kernels take: its key, the dtype it must have (none:
// the entry must be absent), its shape, and whether a missing entry is a
// problem (the caller creates missing ones where it is not).
struct StateRule {
  py::object key;
  std::optional<at::ScalarType> dtype;
  StateShape shape = StateShape::kParam;
  bool required = true;
};

enum class MatrixView { kNone, kError, kFlatten, kBatch };

// "" for params that are not Muon matrices (AdamW). Not decided by rows: a
// Muon param may have matrices of 0 rows (shape (3, 0, 7) under "batch").
MatrixView parse_view(const std::string& view) {
  if (view.empty()) return MatrixView::kNone;
  if (view == "flatten") return MatrixView::kFlatten;
  if (view == "batch") return MatrixView::kBatch;
  return MatrixView::kError;
}

// (rows, cols) of a Muon param's matrices under its group's matrix_view, as
// muon_ext/_shapes.py defines them; (0, 0) where it is not matrices.
std::pair<int64_t, int64_t> matrix_shape(const at::Tensor& p, MatrixView view) {
  const int64_t dim = p.dim();
  if (dim == 2) return {p.size(0), p.size(1)};
  if (dim < 2) return {0, 0};
  if (view == MatrixView::kFlatten) {
    int64_t cols = 1;
    for (int64_t d = 1; d < dim; ++d) cols *= p.size(d);
    return {p.size(0), cols};
  }
  if (view == MatrixView::kBatch) return {p.size(-2), p.size(-1)};
  return {0, 0};
}

// NorMuon's statistics shape for a param (muon_ext/_shapes.py, second_moment_shape).
c10::SmallVector<int64_t, 6> second_moment_shape(const at::Tensor& p, MatrixView view, int64_t rows, int64_t cols) {
  c10::SmallVector<int64_t, 6> shape;
  if (p.dim() > 2 && view == MatrixView::kBatch) shape.append(p.sizes().begin(), p.sizes().end() - 2);
  shape.push_back(rows >= cols ? rows : 1);
  shape.push_back(rows >= cols ? 1 : cols);
  return shape;
}

// The first problem found: index of the param, what is wrong (a code that
// muon_ext/buckets.py turns into words), the state key concerned, and the
// index of the other param for "state_shared".
struct Problem {
  int64_t index = -1;
  const char* what = "";
  std::string key;
  int64_t other = -1;
};

// The state dict of a param in the optimizer's state mapping (new reference),
// or null where there is none.  A dict (torch's defaultdict) is not asked for
// a missing entry, which would create one: checking writes nothing.
py::object state_of(PyObject* mapping, PyObject* param) {
  if (PyDict_Check(mapping)) {
    PyObject* entry = PyDict_GetItemWithError(mapping, param);
    if (entry == nullptr && PyErr_Occurred()) throw py::error_already_set();
    return entry == nullptr ? py::object() : py::reinterpret_borrow<py::object>(entry);
  }
  PyObject* entry = PyObject_GetItem(mapping, param);
  if (entry == nullptr) {
    if (!PyErr_ExceptionMatches(PyExc_KeyError)) throw py::error_already_set();
    PyErr_Clear();
    return py::object();
  }
  return py::reinterpret_steal<py::object>(entry);
}

// Checks param i's state entries under `rules`, storing each at i in its list
// (None where missing, marking the list `incomplete`); returns the problem's
// code, or null.
const char* check_state(const at::Tensor& p, Py_ssize_t i, PyObject* dict, const std::vector<StateRule>& rules,
                        MatrixView view, int64_t rows, int64_t cols, std::vector<py::list>& lists,
                        std::vector<char>& incomplete, const StateRule** bad) {
  for (size_t r = 0; r < rules.size(); ++r) {
    const StateRule& rule = rules[r];
    *bad = &rule;
    PyObject* value = dict == nullptr ? nullptr : PyDict_GetItemWithError(dict, rule.key.ptr());
    if (value == nullptr && PyErr_Occurred()) throw py::error_already_set();
    if (!rule.dtype.has_value()) {
      if (value != nullptr) return "state_unexpected";
      continue;
    }
    if (value == nullptr) {
      if (rule.required) return "state_missing";
      PyList_SET_ITEM(lists[r].ptr(), i, Py_NewRef(Py_None));
      incomplete[r] = 1;
      continue;
    }
    if (!THPVariable_Check(value)) return "state_type";
    const at::Tensor& t = THPVariable_Unpack(value);
    if (t.layout() != at::kStrided) return "state_layout";
    if (t.scalar_type() != *rule.dtype) return "state_dtype";
    if (t.device() != p.device()) return "state_device";
    const bool shape_ok = rule.shape == StateShape::kScalar  ? t.numel() == 1
                          : rule.shape == StateShape::kParam ? t.sizes() == p.sizes()
                                                             : t.sizes() == c10::IntArrayRef(second_moment_shape(
                                                                                p, view, rows, cols));
    if (!shape_ok) return "state_shape";
    if (!t.is_contiguous()) return "state_contiguous";
    if (!checks::storage_holds(t)) return "state_storage";
    PyList_SET_ITEM(lists[r].ptr(), i, Py_NewRef(value));
  }
  return nullptr;
}

// The index under which check_bucket records state tensor `rule` of param `i`
// in `ranges`: negative, so params keep their own index (muon_ext/buckets.py,
// overlap_entry, decodes it).
int64_t state_range_index(Py_ssize_t i, size_t rule, size_t rules) {
  return -1 - (static_cast<int64_t>(i) * static_cast<int64_t>(rules) + static_cast<int64_t>(rule));
}

// The optimizer's check of one bucket: params of one dtype and device (and,
// for Muon, one matrix shape `rows` x `cols` under `matrix_view`; matrix_view
// "" for AdamW), their state in the mapping `state` under `rules` ((key, dtype or
// None, StateShape, required) tuples), and, when `grad_attr` is a name, their
// grads.  Params are recorded in `ranges` (when given) as (`bucket`, index),
// and the state tensors of rules with a dtype as (`bucket`,
// state_range_index(index, rule, number of rules)), for the caller's overlap
// check across buckets.
//
// Returns (index of the first bad param or -1, problem code, state key, other
// index, whether every grad is present, contiguous and of one dtype, the grads,
// {key: the state entries, or None where one is missing}).  The lists let the
// caller hand the kernels what was checked without looking it up again.
//
// `param_data` false: the kernels neither read nor write the params' data
// (a param writer stores them from the FP32 master), so their storage may be
// released and they are not recorded in `ranges`.
py::tuple check_bucket(const py::list& params, const py::object& grad_attr, const py::object& state,
                       at::ScalarType dtype, at::Device device, const py::tuple& rules_in, int64_t rows,
                       int64_t cols, const std::string& matrix_view, checks::MemoryRanges* ranges, int64_t bucket,
                       bool param_data) {
  std::vector<StateRule> rules;
  for (const py::handle item : rules_in) {
    const py::tuple t = item.cast<py::tuple>();
    StateRule rule;
    rule.key = py::reinterpret_borrow<py::object>(t[0]);
    if (!t[1].is_none()) rule.dtype = t[1].cast<at::ScalarType>();
    rule.shape = static_cast<StateShape>(t[2].cast<int64_t>());
    rule.required = t[3].cast<bool>();
    rules.push_back(std::move(rule));
  }
  const MatrixView view = parse_view(matrix_view);
  const bool with_grads = !grad_attr.is_none();
  const Py_ssize_t n = PyList_GET_SIZE(params.ptr());
  py::list grads(with_grads ? n : 0);
  std::vector<py::list> lists;
  for (size_t r = 0; r < rules.size(); ++r) lists.emplace_back(rules[r].dtype.has_value() ? n : 0);
  std::vector<char> incomplete(rules.size(), 0);
  std::vector<std::pair<const void*, int64_t>> counters;  // step counters by address, to find one used twice
  counters.reserve(n);
  bool uniform = true;
  std::optional<at::ScalarType> grad_dtype;
  Problem problem;
  const auto fail = [&](Py_ssize_t i, const char* what, const StateRule* rule = nullptr, int64_t other = -1) {
    problem = {static_cast<int64_t>(i), what, rule ? py::str(rule->key).cast<std::string>() : "", other};
  };

  for (Py_ssize_t i = 0; i < n && problem.index < 0; ++i) {
    PyObject* param = PyList_GET_ITEM(params.ptr(), i);
    if (!THPVariable_Check(param)) {
      fail(i, "param_type");
      break;
    }
    const at::Tensor& p = THPVariable_Unpack(param);
    const char* bad = nullptr;
    if (p.layout() != at::kStrided) {
      bad = "param_layout";
    } else if (p.scalar_type() != dtype) {
      bad = "param_dtype";
    } else if (p.device() != device) {
      bad = "param_device";
    } else if (!p.is_contiguous()) {
      bad = "param_contiguous";
    } else if (view != MatrixView::kNone && matrix_shape(p, view) != std::make_pair(rows, cols)) {
      bad = "param_shape";
    } else if (param_data && !checks::storage_holds(p)) {
      bad = "param_storage";
    }
    if (bad != nullptr) {
      fail(i, bad);
      break;
    }
    if (ranges != nullptr && param_data) ranges->add(p, bucket, i);

    const py::object entry = state_of(state.ptr(), param);
    if (entry && !PyDict_Check(entry.ptr())) {
      fail(i, "state_type");
      break;
    }
    const StateRule* rule = nullptr;
    if (const char* what =
            check_state(p, i, entry ? entry.ptr() : nullptr, rules, view, rows, cols, lists, incomplete, &rule)) {
      fail(i, what, rule);
      break;
    }
    if (ranges != nullptr) {
      // The state tensors the kernels write, so that two params sharing a
      // moment, in one bucket or across buckets, are found before any write.
      for (size_t r = 0; r < rules.size(); ++r) {
        PyObject* entry_r = rules[r].dtype.has_value() ? PyList_GET_ITEM(lists[r].ptr(), i) : Py_None;
        if (entry_r != Py_None) ranges->add(THPVariable_Unpack(entry_r), bucket, state_range_index(i, r, rules.size()));
      }
    }
    for (size_t r = 0; r < rules.size(); ++r) {
      if (rules[r].shape != StateShape::kScalar || !rules[r].dtype.has_value()) continue;
      PyObject* counter = PyList_GET_ITEM(lists[r].ptr(), i);
      if (counter != Py_None && !THPVariable_Unpack(counter).is_meta()) {
        counters.emplace_back(THPVariable_Unpack(counter).const_data_ptr(), i);
      }
    }
    if (!with_grads) continue;

    PyObject* grad = PyObject_GetAttr(param, grad_attr.ptr());
    if (grad == nullptr) {
      if (!PyErr_ExceptionMatches(PyExc_AttributeError)) throw py::error_already_set();
      PyErr_Clear();
      grad = Py_NewRef(Py_None);
    }
    PyList_SET_ITEM(grads.ptr(), i, grad);  // steals the reference
    if (grad == Py_None) {
      uniform = false;
      continue;
    }
    if (!THPVariable_Check(grad)) {
      fail(i, "grad_type");
      break;
    }
    const at::Tensor& g = THPVariable_Unpack(grad);
    if (g.layout() != at::kStrided) {
      bad = "grad_layout";
    } else if (!checks::is_supported_float(g.scalar_type())) {
      bad = "grad_dtype";
    } else if (g.sizes() != p.sizes()) {
      bad = "grad_shape";
    } else if (g.device() != p.device()) {
      bad = "grad_device";
    } else if (!checks::storage_holds(g)) {
      bad = "grad_storage";
    }
    if (bad != nullptr) {
      fail(i, bad);
      break;
    }
    if (!grad_dtype.has_value()) grad_dtype = g.scalar_type();
    uniform = uniform && g.is_contiguous() && g.scalar_type() == *grad_dtype;
  }
  if (problem.index < 0 && !counters.empty()) {
    // A counter shared by two params would be stepped twice (the kernels refuse it).
    std::sort(counters.begin(), counters.end());
    for (size_t k = 1; k < counters.size(); ++k) {
      if (counters[k].first != counters[k - 1].first) continue;
      const StateRule* rule = nullptr;
      for (const StateRule& r : rules) {
        if (r.shape == StateShape::kScalar && r.dtype.has_value()) rule = &r;
      }
      fail(counters[k].second, "state_shared", rule, counters[k - 1].second);
      break;
    }
  }
  if (problem.index >= 0) {
    return py::make_tuple(problem.index, problem.what, problem.key, problem.other, false, py::none(), py::none());
  }
  py::dict entries;
  for (size_t r = 0; r < rules.size(); ++r) {
    if (rules[r].dtype.has_value()) entries[rules[r].key] = incomplete[r] ? py::object(py::none()) : lists[r];
  }
  return py::make_tuple(-1, "", "", -1, uniform, with_grads ? py::object(grads) : py::object(py::none()),
                        entries);
}

// The first two overlapping params recorded by check_bucket, as
// ((bucket, index), (bucket, index)), the second recorded later; or None.
py::object first_overlap(checks::MemoryRanges& ranges) {
  std::pair<int64_t, int64_t> a, b;
  if (!ranges.first_overlap(&a, &b)) return py::none();
  return py::make_tuple(py::make_tuple(a.first, a.second), py::make_tuple(b.first, b.second));
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
                     int64_t max_workspace_bytes, std::optional<int64_t> polar_row_blocks,
                     const std::string& polar_dtype, const std::string& polar_method) {
  RECORD_FUNCTION("muon_ext::muon_step", std::vector<c10::IValue>());
  op::muon_step(params, grads, momentum_buffers, second_momentum_buffers, masters, lr, lr_tensor, momentum, nesterov,
                beta2, weight_decay, ns_steps, ns_coefficients, lr_scale, inv_scale, found_inf, max_workspace_bytes,
                polar_row_blocks, polar_dtype, polar_method);
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
        py::arg("max_workspace_bytes"), py::arg("polar_row_blocks"), py::arg("polar_dtype"),
        py::arg("polar_method") = "standard", "torch.ops.muon_ext.muon_step for plain eager tensors (see csrc/ops.h).");
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
  m.def("check_bucket", &muon_ext::check_bucket, py::arg("params"), py::arg("grad_attr"), py::arg("state"),
        py::kw_only(), py::arg("dtype"), py::arg("device"), py::arg("rules"), py::arg("rows"), py::arg("cols"),
        py::arg("matrix_view"), py::arg("ranges"), py::arg("bucket"), py::arg("param_data") = true,
        "The optimizer's metadata check of one bucket; see csrc/bindings.cpp.");
  m.def("storage_problem", &muon_ext::checks::storage_problem, py::arg("tensor"),
        "What is wrong with a tensor's storage for its view, or '' when it holds every element.");
  m.def("cpu_capabilities", &muon_ext::cpu_capabilities, "Instruction sets of the CPU kernels usable here, best last.");
  m.def(
      "cpu_bf16_gemm",
      [] { return muon_ext::cpu::polar_bf16_gemm() == muon_ext::cpu::PolarGemm::kNativeBf16 ? "native" : "rounded"; },
      "How BF16 Polar-Express GEMMs run on this CPU (see muon_ext.ops.cpu_bf16_gemm).");
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

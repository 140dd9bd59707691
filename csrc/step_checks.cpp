#include "step_checks.h"

#include <algorithm>

namespace muon_ext {
namespace checks {
namespace {

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

StepProblem state_problem(Fault fault) {
  switch (fault) {
    case Fault::kNone: return StepProblem::kNone;
    case Fault::kLayout: return StepProblem::kStateLayout;
    case Fault::kDtype: return StepProblem::kStateDtype;
    case Fault::kDevice: return StepProblem::kStateDevice;
    case Fault::kShape: return StepProblem::kStateShape;
    case Fault::kContiguous: return StepProblem::kStateContiguous;
    case Fault::kStorage: return StepProblem::kStateStorage;
  }
  return StepProblem::kStateType;
}

// Checks param i's state entries under `rules` (tensor_fault, the ops' own
// rule for a companion tensor), storing each at i in its list (None where
// missing, marking the list `incomplete`); returns the problem and sets *bad
// to the rule concerned.
StepProblem check_state(const at::Tensor& p, Py_ssize_t i, PyObject* dict, const std::vector<StateRule>& rules,
                        shapes::MatrixView view, int64_t rows, int64_t cols, std::vector<py::list>& lists,
                        std::vector<char>& incomplete, const StateRule** bad) {
  c10::SmallVector<int64_t, 6> second_moment;
  for (size_t r = 0; r < rules.size(); ++r) {
    const StateRule& rule = rules[r];
    *bad = &rule;
    PyObject* value = dict == nullptr ? nullptr : PyDict_GetItemWithError(dict, rule.key.ptr());
    if (value == nullptr && PyErr_Occurred()) throw py::error_already_set();
    if (!rule.dtype.has_value()) {
      if (value != nullptr) return StepProblem::kStateUnexpected;
      continue;
    }
    if (value == nullptr) {
      if (rule.required) return StepProblem::kStateMissing;
      PyList_SET_ITEM(lists[r].ptr(), i, Py_NewRef(Py_None));
      incomplete[r] = 1;
      continue;
    }
    if (!THPVariable_Check(value)) return StepProblem::kStateType;
    std::optional<at::IntArrayRef> sizes;  // nullopt: one element
    if (rule.shape == StateShape::kParam) {
      sizes = p.sizes();
    } else if (rule.shape == StateShape::kSecondMoment) {
      second_moment.clear();
      shapes::second_moment_shape(p.sizes().data(), p.dim(), view, rows, cols, second_moment);
      sizes = at::IntArrayRef(second_moment);
    } else if (rule.shape == StateShape::kGiven) {
      sizes = at::IntArrayRef(rule.sizes);
    }
    const StepProblem problem = state_problem(tensor_fault(THPVariable_Unpack(value), *rule.dtype, p.device(), sizes));
    if (problem != StepProblem::kNone) return problem;
    PyList_SET_ITEM(lists[r].ptr(), i, Py_NewRef(value));
  }
  return StepProblem::kNone;
}

// Records the tensors of `list` under `role`; a list with an entry that is
// not a tensor (a missing grad or state entry) is not what an op takes, so
// it is left out and the token covers no call with that role.
void record(CheckedBucket& token, std::string role, const py::list& list) {
  std::vector<CheckedBucket::Entry> entries;
  entries.reserve(PyList_GET_SIZE(list.ptr()));
  for (Py_ssize_t i = 0; i < PyList_GET_SIZE(list.ptr()); ++i) {
    PyObject* item = PyList_GET_ITEM(list.ptr(), i);
    if (!THPVariable_Check(item)) return;
    const std::optional<CheckedBucket::Entry> entry = CheckedBucket::entry_of(THPVariable_Unpack(item));
    if (!entry.has_value()) return;
    entries.push_back(*entry);
  }
  token.record(std::move(role), std::move(entries));
}

}  // namespace

BucketCheck check_bucket(const py::list& params, const py::object& grad_attr, const py::object& state,
                         at::ScalarType dtype, at::Device device, const std::vector<StateRule>& rules, int64_t rows,
                         int64_t cols, shapes::MatrixView view, MemoryRanges* ranges, int64_t bucket,
                         bool param_data) {
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
  BucketCheck out;
  const auto fail = [&](Py_ssize_t i, StepProblem what, const StateRule* rule = nullptr, int64_t other = -1) {
    out.problem = what;
    out.index = static_cast<int64_t>(i);
    out.key = rule ? py::str(rule->key).cast<std::string>() : "";
    out.other = other;
  };

  for (Py_ssize_t i = 0; i < n && out.index < 0; ++i) {
    PyObject* param = PyList_GET_ITEM(params.ptr(), i);
    if (!THPVariable_Check(param)) {
      fail(i, StepProblem::kParamType);
      break;
    }
    const at::Tensor& p = THPVariable_Unpack(param);
    StepProblem bad = StepProblem::kNone;
    if (p.layout() != at::kStrided) {
      bad = StepProblem::kParamLayout;
    } else if (p.scalar_type() != dtype) {
      bad = StepProblem::kParamDtype;
    } else if (p.device() != device) {
      bad = StepProblem::kParamDevice;
    } else if (!p.is_contiguous()) {
      bad = StepProblem::kParamContiguous;
    } else if (view != shapes::MatrixView::kNone) {
      const shapes::Matrices m = shapes::matrix_shape(p.sizes().data(), p.dim(), view);
      if (m.rule != shapes::MatrixRule::kMatrices || m.rows != rows || m.cols != cols) bad = StepProblem::kParamShape;
    }
    if (bad == StepProblem::kNone && param_data && !storage_holds(p)) bad = StepProblem::kParamStorage;
    if (bad != StepProblem::kNone) {
      fail(i, bad);
      break;
    }
    if (ranges != nullptr && param_data) ranges->add(p, bucket, i);

    const py::object entry = state_of(state.ptr(), param);
    if (entry && !PyDict_Check(entry.ptr())) {
      fail(i, StepProblem::kStateType);
      break;
    }
    const StateRule* rule = nullptr;
    const StepProblem state_bad =
        check_state(p, i, entry ? entry.ptr() : nullptr, rules, view, rows, cols, lists, incomplete, &rule);
    if (state_bad != StepProblem::kNone) {
      fail(i, state_bad, rule);
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
      fail(i, StepProblem::kGradType);
      break;
    }
    const at::Tensor& g = THPVariable_Unpack(grad);
    if (g.layout() != at::kStrided) {
      bad = StepProblem::kGradLayout;
    } else if (!is_supported_float(g.scalar_type())) {
      bad = StepProblem::kGradDtype;
    } else if (g.sizes() != p.sizes()) {
      bad = StepProblem::kGradShape;
    } else if (g.device() != p.device()) {
      bad = StepProblem::kGradDevice;
    } else if (!storage_holds(g)) {
      bad = StepProblem::kGradStorage;
    }
    if (bad != StepProblem::kNone) {
      fail(i, bad);
      break;
    }
    if (!grad_dtype.has_value()) grad_dtype = g.scalar_type();
    uniform = uniform && g.is_contiguous() && g.scalar_type() == *grad_dtype;
  }
  if (out.index < 0 && !counters.empty()) {
    // A counter shared by two params would be stepped twice (the kernels refuse it).
    std::sort(counters.begin(), counters.end());
    for (size_t k = 1; k < counters.size(); ++k) {
      if (counters[k].first != counters[k - 1].first) continue;
      const StateRule* rule = nullptr;
      for (const StateRule& r : rules) {
        if (r.shape == StateShape::kScalar && r.dtype.has_value()) rule = &r;
      }
      fail(counters[k].second, StepProblem::kStateShared, rule, counters[k - 1].second);
      break;
    }
  }
  if (out.index >= 0) return out;
  out.uniform = uniform;
  out.grads = with_grads ? py::object(grads) : py::object(py::none());
  py::dict entries;
  for (size_t r = 0; r < rules.size(); ++r) {
    if (rules[r].dtype.has_value()) entries[rules[r].key] = incomplete[r] ? py::object(py::none()) : lists[r];
  }
  out.state = entries;
  // The token: what an op taking exactly these lists need not check again.
  // Params whose data the kernels do not touch, grads that are not uniform,
  // and state lists with a missing entry are left out (an op taking them
  // checks everything).
  if (with_grads && uniform && ranges != nullptr) {
    out.token = std::make_shared<CheckedBucket>();
    if (param_data) record(*out.token, "params", params);
    record(*out.token, "grads", grads);
    for (size_t r = 0; r < rules.size(); ++r) {
      if (rules[r].dtype.has_value() && !incomplete[r]) {
        record(*out.token, py::str(rules[r].key).cast<std::string>(), lists[r]);
      }
    }
  }
  return out;
}

}  // namespace checks
}  // namespace muon_ext

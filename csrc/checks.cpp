#include "checks.h"

#include "common/schema.h"

#include <c10/util/Exception.h>

#include <sstream>

#include <cmath>
#include <unordered_set>

namespace muon_ext {
namespace checks {

bool is_supported_float(at::ScalarType t) { return t == at::kFloat || t == at::kBFloat16 || t == at::kHalf; }

std::string where(const char* list, size_t index) { return std::string(list) + "[" + std::to_string(index) + "]"; }

void same_lengths(const char* op, size_t n, const std::vector<std::pair<const char*, size_t>>& lengths,
                  const char* base) {
  for (const auto& [name, length] : lengths) {
    TORCH_CHECK_VALUE(length == n, op, ": ", name, " has ", length, " entries but ", base, " has ", n);
  }
}

void optional_list_length(const char* op, const TensorList& list, const char* name, size_t n) {
  TORCH_CHECK_VALUE(list.empty() || list.size() == n, op, ": ", name,
                    " must be empty or have one entry per param, got ", list.size(), " for ", n, " params");
}

void device(const char* op, const at::Device& device, const char* name) {
  TORCH_CHECK_VALUE(device.is_cpu() || device.is_cuda() || device.is_meta(), op, ": ", name,
                    " must be on CPU or CUDA, got ", device);
#if !defined(MUON_EXT_WITH_CUDA)
  TORCH_CHECK_VALUE(!device.is_cuda(), op, ": ", name,
                    " are on CUDA but this build of muon_ext has no CUDA kernels "
                    "(rebuild with nvcc available and without MUON_EXT_FORCE_CPU=1)");
#endif
}

at::Device params(const char* op, const TensorList& params, const char* name) {
  TORCH_CHECK_VALUE(params[0].defined(), op, ": ", name, "[0] is undefined");
  const at::Device device = params[0].device();
  checks::device(op, device, name);
  const at::ScalarType dtype = params[0].scalar_type();
  TORCH_CHECK_TYPE(is_supported_float(dtype), op, ": ", name, "[0] has dtype ", dtype,
                   "; supported: float32, bfloat16, float16");
  // Meta tensors have no storage to share (fake tensors checked at trace time).
  const bool check_overlap = !device.is_meta();
  std::unordered_set<const void*> storages;
  for (size_t i = 0; i < params.size(); ++i) {
    const at::Tensor& p = params[i];
    TORCH_CHECK_VALUE(p.defined(), op, ": ", where(name, i), " is undefined");
    TORCH_CHECK_TYPE(p.scalar_type() == dtype, op, ": ", where(name, i), " has dtype ", p.scalar_type(), " but ",
                     name, "[0] has ", dtype, " (one dtype per call)");
    TORCH_CHECK_VALUE(p.device() == device, op, ": ", where(name, i), " is on ", p.device(), " but ", name,
                      "[0] is on ", device);
    TORCH_CHECK_VALUE(p.is_contiguous(), op, ": ", where(name, i), " must be contiguous");
    TORCH_CHECK_VALUE(!check_overlap || p.numel() == 0 || storages.insert(p.data_ptr()).second, op, ": ",
                      where(name, i), " shares its storage with an earlier ", name == std::string("params") ? "param" : "entry");
  }
  return device;
}

void companion(const char* op, const at::Tensor& t, const at::Tensor& like, const char* list, size_t index,
               at::ScalarType dtype, at::IntArrayRef sizes, const char* base) {
  const std::string name = where(list, index);
  TORCH_CHECK_VALUE(t.defined(), op, ": ", name, " is undefined");
  TORCH_CHECK_TYPE(t.scalar_type() == dtype, op, ": ", name, " has dtype ", t.scalar_type(), ", expected ", dtype);
  TORCH_CHECK_VALUE(t.device() == like.device(), op, ": ", name, " is on ", t.device(), " but ", base, "[", index,
                    "] is on ", like.device());
  TORCH_CHECK_VALUE(t.sizes() == sizes, op, ": ", name, " has shape ", t.sizes(), ", expected ", sizes);
  TORCH_CHECK_VALUE(t.is_contiguous(), op, ": ", name, " must be contiguous");
}

at::ScalarType float_list_dtype(const char* op, const TensorList& list, const char* name) {
  TORCH_CHECK_VALUE(list[0].defined(), op, ": ", name, "[0] is undefined");
  const at::ScalarType dtype = list[0].scalar_type();
  TORCH_CHECK_TYPE(is_supported_float(dtype), op, ": ", name, "[0] has dtype ", dtype,
                   "; supported: float32, bfloat16, float16");
  return dtype;
}

MasterKind master_kind(const char* op, const TensorList& masters, at::ScalarType param_dtype) {
  if (masters.empty()) return MasterKind::kNone;
  TORCH_CHECK_VALUE(masters[0].defined(), op, ": masters[0] is undefined");
  const at::ScalarType dtype = masters[0].scalar_type();
  if (dtype == at::kFloat) {
    TORCH_CHECK_TYPE(param_dtype != at::kFloat, op, ": float32 params are their own master; pass masters=[] for them");
    return MasterKind::kFP32;
  }
  if (dtype == at::kShort) {
    TORCH_CHECK_TYPE(param_dtype == at::kBFloat16, op, ": int16 remainders (masters) need bfloat16 params, got ",
                     param_dtype);
    return MasterKind::kRemainder;
  }
  TORCH_CHECK_TYPE(false, op, ": masters[0] has dtype ", dtype,
                   "; expected float32 (FP32 masters) or int16 (BF16 remainders)");
  return MasterKind::kNone;
}

void scalar_tensor(const char* op, const c10::optional<at::Tensor>& t, const char* name, const at::Device& device) {
  if (!t.has_value()) return;
  TORCH_CHECK_VALUE(t->defined(), op, ": ", name, " is undefined");
  TORCH_CHECK_TYPE(t->scalar_type() == at::kFloat, op, ": ", name, " must be float32, got ", t->scalar_type());
  TORCH_CHECK_VALUE(t->numel() == 1, op, ": ", name, " must hold one element, got ", t->numel());
  TORCH_CHECK_VALUE(t->device() == device, op, ": ", name, " is on ", t->device(), " but params are on ", device);
}

void distinct(const char* op, const TensorList& list, const char* name) {
  std::unordered_set<const void*> seen;
  for (size_t i = 0; i < list.size(); ++i) {
    if (list[i].is_meta()) continue;  // no storage to compare
    TORCH_CHECK_VALUE(seen.insert(list[i].data_ptr()).second, op, ": ", where(name, i),
                      " is the same tensor as an earlier entry of ", name);
  }
}

void in_range(const char* op, const char* kind, const char* name, double value, bool nullable) {
  const schema::Range* range = schema::find_range(kind, name);
  TORCH_CHECK(range != nullptr, op, ": no range for ", kind, " setting ", name, " in common/schema.h");
  if (schema::in_range(*range, value)) return;
  std::ostringstream bound;
  if (std::isinf(range->high)) {
    if (range->integer && range->low == 1.0) {
      bound << "positive";
    } else {
      bound << ">= " << range->low;
    }
  } else {
    bound << "in [" << range->low << ", " << range->high << (range->high_inclusive ? "]" : ")");
  }
  if (nullable) bound << " or None";
  TORCH_CHECK_VALUE(false, op, ": ", name, " must be ", bound.str(), ", got ", value);
}

}  // namespace checks
}  // namespace muon_ext

#include "checks.h"

#include "common/schema.h"

#include <c10/core/TensorImpl.h>
#include <c10/util/Exception.h>
#include <c10/util/safe_numerics.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <sstream>
#include <unordered_set>

namespace muon_ext {
namespace checks {

bool is_supported_float(at::ScalarType t) { return t == at::kFloat || t == at::kBFloat16 || t == at::kHalf; }

std::string where(const char* list, size_t index) { return std::string(list) + "[" + std::to_string(index) + "]"; }

bool on_off_setting(const char* name) {
  const char* setting = std::getenv(name);
  const std::string value = setting == nullptr ? "" : setting;
  TORCH_CHECK(value.empty() || value == "0" || value == "1", name, " must be '0' or '1', got '", value, "'");
  return value != "0";
}

namespace {

// The bytes of its storage that t's view reaches: up to and including its
// last element.  False where that cannot be computed (a negative stride, or
// more than 2^64 bytes): such a view is refused too.
bool bytes_needed(const at::Tensor& t, uint64_t* needed) {
  *needed = 0;
  if (t.numel() == 0) return true;
  uint64_t last = static_cast<uint64_t>(t.storage_offset());
  const c10::IntArrayRef sizes = t.sizes(), strides = t.strides();
  for (size_t d = 0; d < sizes.size(); ++d) {
    if (strides[d] < 0) return false;
    uint64_t span = 0;
    if (c10::mul_overflows(static_cast<uint64_t>(sizes[d] - 1), static_cast<uint64_t>(strides[d]), &span) ||
        c10::add_overflows(last, span, &last)) {
      return false;
    }
  }
  return !c10::add_overflows(last, uint64_t{1}, &last) &&
         !c10::mul_overflows(last, static_cast<uint64_t>(t.itemsize()), needed);
}

// The storage's size in bytes, or false where it has none to read (no
// storage, or a symbolic size while tracing).
bool storage_bytes(const at::Tensor& t, uint64_t* bytes, bool* has_data) {
  if (!t.defined() || t.is_meta()) return false;
  const c10::TensorImpl* impl = t.unsafeGetTensorImpl();
  if (!impl->has_storage()) return false;
  const c10::Storage& storage = impl->unsafe_storage();
  if (!storage) return false;
  const std::optional<int64_t> nbytes = storage.sym_nbytes().maybe_as_int();
  if (!nbytes.has_value()) return false;
  *bytes = static_cast<uint64_t>(*nbytes);
  *has_data = storage.data() != nullptr;
  return true;
}

}  // namespace

bool storage_holds(const at::Tensor& t) {
  uint64_t held = 0;
  bool has_data = false;
  if (!storage_bytes(t, &held, &has_data)) return true;
  uint64_t needed = 0;
  if (!bytes_needed(t, &needed)) return false;
  return needed == 0 || (has_data && held >= needed);
}

std::string storage_problem(const at::Tensor& t) {
  if (storage_holds(t)) return "";
  uint64_t held = 0, needed = 0;
  bool has_data = false;
  storage_bytes(t, &held, &has_data);
  std::ostringstream out;
  out << "its storage holds " << (has_data ? held : 0) << " bytes but its view (storage offset "
      << t.storage_offset() << ", shape " << t.sizes() << ", strides " << t.strides() << ", " << t.scalar_type()
      << ") needs ";
  if (bytes_needed(t, &needed)) {
    out << needed;
  } else {
    out << "more than can be addressed";
  }
  out << " (was the storage released, e.g. with untyped_storage().resize_(0), or shrunk under this view?)";
  return out.str();
}

void storage(const char* op, const at::Tensor& t, const std::string& name) {
  if (C10_LIKELY(storage_holds(t))) return;
  TORCH_CHECK_VALUE(false, op, ": ", name, ": ", storage_problem(t));
}

std::optional<CheckedBucket::Entry> CheckedBucket::entry_of(const at::Tensor& t) {
  if (!t.defined() || t.is_inference()) return std::nullopt;
  const c10::TensorImpl* impl = t.unsafeGetTensorImpl();
  const int64_t bytes =
      impl->has_storage() && impl->unsafe_storage() ? static_cast<int64_t>(impl->unsafe_storage().nbytes()) : -1;
  return Entry{impl, t.is_meta() ? nullptr : t.const_data_ptr(), bytes, t._version()};
}

bool CheckedBucket::has(const char* role) const {
  return std::any_of(lists_.begin(), lists_.end(), [&](const auto& l) { return l.first == role; });
}

bool CheckedBucket::covers(std::initializer_list<std::pair<const char*, TensorList>> lists) {
  if (!valid_) return false;
  for (const auto& [role, list] : lists) {
    if (role[0] == '\0') {
      if (!list.empty()) return false;
      continue;
    }
    const auto recorded = std::find_if(lists_.begin(), lists_.end(), [&](const auto& l) { return l.first == role; });
    if (recorded == lists_.end() || recorded->second.size() != list.size()) return false;
    for (size_t i = 0; i < list.size(); ++i) {
      const std::optional<Entry> entry = entry_of(list[i]);
      if (!entry.has_value() || !(*entry == recorded->second[i])) return false;
    }
  }
  valid_ = false;  // single use
  return true;
}

void MemoryRanges::add(const at::Tensor& t, int64_t group, int64_t index) {
  uint64_t needed = 0;
  if (t.is_meta() || !bytes_needed(t, &needed) || needed == 0) return;
  // The view spans from its first element to its last: `needed` counts from
  // the storage's start, the data pointer includes the storage offset.
  const uint64_t offset_bytes = static_cast<uint64_t>(t.storage_offset()) * static_cast<uint64_t>(t.itemsize());
  const uintptr_t begin = reinterpret_cast<uintptr_t>(t.const_data_ptr());
  const uintptr_t end = begin + static_cast<uintptr_t>(needed - offset_bytes);
  ranges_.push_back({begin, end, group, index, static_cast<int64_t>(ranges_.size())});
}

bool MemoryRanges::first_overlap(std::pair<int64_t, int64_t>* a, std::pair<int64_t, int64_t>* b) {
  const auto by_start = [](const Range& x, const Range& y) { return x.start < y.start; };
  if (!std::is_sorted(ranges_.begin(), ranges_.end(), by_start)) std::sort(ranges_.begin(), ranges_.end(), by_start);
  const Range* reach = nullptr;  // the range reaching furthest so far
  for (const Range& r : ranges_) {
    if (reach != nullptr && r.start < reach->end) {
      const Range* first = reach->order < r.order ? reach : &r;
      const Range* second = reach->order < r.order ? &r : reach;
      *a = {first->group, first->index};
      *b = {second->group, second->index};
      return true;
    }
    if (reach == nullptr || r.end > reach->end) reach = &r;
  }
  return false;
}

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
  MemoryRanges ranges;
  for (size_t i = 0; i < params.size(); ++i) {
    const at::Tensor& p = params[i];
    TORCH_CHECK_VALUE(p.defined(), op, ": ", where(name, i), " is undefined");
    TORCH_CHECK_TYPE(p.scalar_type() == dtype, op, ": ", where(name, i), " has dtype ", p.scalar_type(), " but ",
                     name, "[0] has ", dtype, " (one dtype per call)");
    TORCH_CHECK_VALUE(p.device() == device, op, ": ", where(name, i), " is on ", p.device(), " but ", name,
                      "[0] is on ", device);
    TORCH_CHECK_VALUE(p.is_contiguous(), op, ": ", where(name, i), " must be contiguous");
    if (!storage_holds(p)) storage(op, p, where(name, i));  // the name is built only for the message
  }
  return device;
}

void disjoint(const char* op, std::initializer_list<std::pair<const char*, TensorList>> lists) {
  MemoryRanges ranges;
  int64_t list_index = 0;
  for (const auto& [name, list] : lists) {
    for (size_t i = 0; i < list.size(); ++i) ranges.add(list[i], list_index, static_cast<int64_t>(i));
    ++list_index;
  }
  std::pair<int64_t, int64_t> first, second;
  if (!ranges.first_overlap(&first, &second)) return;
  // Name the later entry (list order, then index) as the one sharing the earlier one's storage.
  if (second < first) std::swap(first, second);
  const auto name_of = [&](int64_t index) { return (lists.begin() + index)->first; };
  TORCH_CHECK_VALUE(false, op, ": ", where(name_of(second.first), second.second), " shares its storage with ",
                    where(name_of(first.first), first.second), " (their memory overlaps)");
}

Fault tensor_fault(const at::Tensor& t, at::ScalarType dtype, const at::Device& device,
                   std::optional<at::IntArrayRef> sizes) {
  if (t.layout() != at::kStrided) return Fault::kLayout;
  if (t.scalar_type() != dtype) return Fault::kDtype;
  if (t.device() != device) return Fault::kDevice;
  if (sizes.has_value() ? t.sizes() != *sizes : t.numel() != 1) return Fault::kShape;
  if (!t.is_contiguous()) return Fault::kContiguous;
  if (!storage_holds(t)) return Fault::kStorage;
  return Fault::kNone;
}

void companion(const char* op, const at::Tensor& t, const at::Tensor& like, const char* list, size_t index,
               at::ScalarType dtype, at::IntArrayRef sizes, const char* base) {
  TORCH_CHECK_VALUE(t.defined(), op, ": ", where(list, index), " is undefined");
  const Fault fault = tensor_fault(t, dtype, like.device(), sizes);
  if (C10_LIKELY(fault == Fault::kNone)) return;
  const std::string name = where(list, index);  // built only for the message
  TORCH_CHECK_TYPE(fault != Fault::kLayout, op, ": ", name, " has layout ", t.layout(), "; expected strided");
  TORCH_CHECK_TYPE(fault != Fault::kDtype, op, ": ", name, " has dtype ", t.scalar_type(), ", expected ", dtype);
  TORCH_CHECK_VALUE(fault != Fault::kDevice, op, ": ", name, " is on ", t.device(), " but ", base, "[", index,
                    "] is on ", like.device());
  TORCH_CHECK_VALUE(fault != Fault::kShape, op, ": ", name, " has shape ", t.sizes(), ", expected ", sizes);
  TORCH_CHECK_VALUE(fault != Fault::kContiguous, op, ": ", name, " must be contiguous");
  storage(op, t, name);
}

at::ScalarType float_list_dtype(const char* op, const TensorList& list, const char* name) {
  TORCH_CHECK_VALUE(list[0].defined(), op, ": ", name, "[0] is undefined");
  const at::ScalarType dtype = list[0].scalar_type();
  TORCH_CHECK_TYPE(is_supported_float(dtype), op, ": ", name, "[0] has dtype ", dtype,
                   "; supported: float32, bfloat16, float16");
  return dtype;
}

MasterMode master_mode(const char* op, const TensorList& masters, at::ScalarType param_dtype) {
  if (masters.empty()) return MasterMode::kNone;
  TORCH_CHECK_VALUE(masters[0].defined(), op, ": masters[0] is undefined");
  const at::ScalarType dtype = masters[0].scalar_type();
  if (dtype == at::kFloat) {
    TORCH_CHECK_TYPE(param_dtype != at::kFloat, op, ": float32 params are their own master; pass masters=[] for them");
    return MasterMode::kFP32;
  }
  if (dtype == at::kShort) {
    TORCH_CHECK_TYPE(param_dtype == at::kBFloat16, op, ": int16 remainders (masters) need bfloat16 params, got ",
                     param_dtype);
    return MasterMode::kRemainder;
  }
  TORCH_CHECK_TYPE(false, op, ": masters[0] has dtype ", dtype,
                   "; expected float32 (FP32 masters) or int16 (BF16 remainders)");
  return MasterMode::kNone;
}

void scalar_tensor(const char* op, const c10::optional<at::Tensor>& t, const char* name, const at::Device& device) {
  if (!t.has_value()) return;
  TORCH_CHECK_VALUE(t->defined(), op, ": ", name, " is undefined");
  TORCH_CHECK_TYPE(t->scalar_type() == at::kFloat, op, ": ", name, " must be float32, got ", t->scalar_type());
  TORCH_CHECK_VALUE(t->numel() == 1, op, ": ", name, " must hold one element, got ", t->numel());
  TORCH_CHECK_VALUE(t->device() == device, op, ": ", name, " is on ", t->device(), " but params are on ", device);
  if (!storage_holds(*t)) storage(op, *t, name);
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

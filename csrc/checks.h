// Argument checks shared by the kernel entry points.  Each raises a Python
// TypeError / ValueError (via TORCH_CHECK_TYPE / TORCH_CHECK_VALUE) whose
// message names the operation, the argument and the list index.  Entry points
// run every check before any tensor is written.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/core/TensorBody.h>
#include <c10/util/ArrayRef.h>
#include <c10/util/Optional.h>

#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "common/adamw_math.h"

namespace muon_ext {
namespace checks {

// A list argument of an op, as the dispatcher hands it over (no copy).
using TensorList = at::TensorList;

bool is_supported_float(at::ScalarType t);

// `list[index]`, for messages.
std::string where(const char* list, size_t index);

// An on/off environment switch (MUON_EXT_CPU_TILE_GEMM, MUON_EXT_CUDA_POLAR_FOLD):
// unset, "" or "1" is on, "0" off; anything else raises, naming the variable.
bool on_off_setting(const char* name);

// All lists have `n` entries, as many as the list named `base` (names and
// lists in the same order).
void same_lengths(const char* op, size_t n, const std::vector<std::pair<const char*, size_t>>& lengths,
                  const char* base = "params");

// An optional per-param list (masters): empty or one entry per param.
void optional_list_length(const char* op, const TensorList& list, const char* name, size_t n);

// Whether t's storage holds every element its view reaches (storage offset,
// sizes and strides; any strides, so a tensor can be checked before its
// contiguity is).  True where there is nothing to read: no elements, meta
// (fake) tensors, tensors without a storage.
bool storage_holds(const at::Tensor& t);

// What is wrong with t's storage for messages ("its storage holds 0 bytes but
// its view needs 256 ..."), or "" when it holds t.
std::string storage_problem(const at::Tensor& t);

// Raises (ValueError) unless t's storage holds its elements: a storage
// released with untyped_storage().resize_(0), or shrunk under a view, would
// otherwise be read and written out of bounds.
void storage(const char* op, const at::Tensor& t, const std::string& name);

// A device the kernels run on: CPU, CUDA when built with it, or meta (checked
// only: fake tensors trace through the ops this way).
void device(const char* op, const at::Device& device, const char* name);

// The main list of one call (`name`, usually params): defined, one supported
// float dtype, one device, contiguous, storage holding the elements.  Returns
// the common device.  Overlap is `disjoint`'s check, over every written list.
at::Device params(const char* op, const TensorList& params, const char* name = "params");

// The lists a call writes, as (name, list): no two of their tensors, in one
// list or across lists, share a byte (a kernel would write it twice).  The
// error names both entries.  Lists already checked entry by entry.
void disjoint(const char* op, std::initializer_list<std::pair<const char*, TensorList>> lists);

// What is wrong with a tensor that must be strided, of `dtype`, on `device`,
// of shape `sizes` (nullopt: one element, any shape), contiguous and held by
// its storage: the first fault in that order.  The one rule for a companion
// tensor, used by the ops (companion, below) and by the step's state checks
// (step_checks.cpp).
enum class Fault { kNone, kLayout, kDtype, kDevice, kShape, kContiguous, kStorage };
Fault tensor_fault(const at::Tensor& t, at::ScalarType dtype, const at::Device& device,
                   std::optional<at::IntArrayRef> sizes);

// A per-element or per-param companion of base[i] (a list named `base`):
// defined, of dtype `dtype`, on base[i]'s device, of shape `sizes`, contiguous,
// its storage holding its elements (tensor_fault).
void companion(const char* op, const at::Tensor& t, const at::Tensor& like, const char* list, size_t index,
               at::ScalarType dtype, at::IntArrayRef sizes, const char* base = "params");

// A hyper-parameter within its range of common/schema.h (finite, and an
// integer for integer settings).  `nullable`: the message adds "or None".
void in_range(const char* op, const char* kind, const char* name, double value, bool nullable = false);

// The dtype of list[0] when it is one of float32 / bfloat16 / float16.
at::ScalarType float_list_dtype(const char* op, const TensorList& list, const char* name);

// Masters (empty, FP32 or int16 remainders) for params of `param_dtype`.
MasterMode master_mode(const char* op, const TensorList& masters, at::ScalarType param_dtype);

// An optional one-element FP32 tensor on `device` (lr, inv_scale, found_inf),
// its storage holding the element.
void scalar_tensor(const char* op, const c10::optional<at::Tensor>& t, const char* name, const at::Device& device);

// Distinct tensors (step counters would be bumped twice otherwise).
void distinct(const char* op, const TensorList& list, const char* name);

// A single-use token of the optimizer's step check (step_checks.h), bound to
// the very tensors it checked, by role ("params", "grads" or a state key):
// tells the step ops (ops.cpp) that the per-entry and byte-range checks of
// their lists were made.  It covers nothing where the op's lists are not
// exactly the recorded tensors in order, unchanged since (same storage bytes,
// data pointer and version), where it was used once already, or after the
// planner's next plan (invalidate).  An op called without it checks everything.
class CheckedBucket {
 public:
  struct Entry {
    const c10::TensorImpl* impl;
    const void* data;
    int64_t storage_bytes;
    int64_t version;
    bool operator==(const Entry& other) const {
      return impl == other.impl && data == other.data && storage_bytes == other.storage_bytes &&
             version == other.version;
    }
  };
  // Null for a tensor that cannot be recorded (undefined; inference tensors keep no version).
  static std::optional<Entry> entry_of(const at::Tensor& t);

  void record(std::string role, std::vector<Entry> entries) { lists_.emplace_back(std::move(role), std::move(entries)); }
  // The op's lists as (role, list), an empty role for a list that must be
  // empty: true, once, when every list holds exactly the recorded tensors.
  bool covers(std::initializer_list<std::pair<const char*, TensorList>> lists);
  // Whether `role` was recorded.
  bool has(const char* role) const;
  void invalidate() { valid_ = false; }
  bool valid() const { return valid_; }

 private:
  std::vector<std::pair<std::string, std::vector<Entry>>> lists_;
  bool valid_ = true;
};

// Byte ranges of tensors, to find two that overlap in memory (two params
// written by one call, or by one optimizer step).  Entries are tagged with
// (group, index) for the caller's messages.
class MemoryRanges {
 public:
  // Records t's bytes, unless t has nothing in memory (no elements, meta).
  // t's storage must hold t (storage_holds).
  void add(const at::Tensor& t, int64_t group, int64_t index);
  // The tags (a, b) of two overlapping entries, b the later added, if any.
  bool first_overlap(std::pair<int64_t, int64_t>* a, std::pair<int64_t, int64_t>* b);

 private:
  struct Range {
    uintptr_t start, end;
    int64_t group, index, order;
  };
  std::vector<Range> ranges_;
};

}  // namespace checks
}  // namespace muon_ext

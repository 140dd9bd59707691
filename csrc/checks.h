// Argument checks shared by the kernel entry points.  Each raises a Python
// TypeError / ValueError (via TORCH_CHECK_TYPE / TORCH_CHECK_VALUE) whose
// message names the operation, the argument and the list index.  Entry points
// run every check before any tensor is written.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Optional.h>

#include <string>
#include <vector>

#include "common/adamw_math.h"

namespace muon_ext {
namespace checks {

using TensorList = std::vector<at::Tensor>;

bool is_supported_float(at::ScalarType t);

// `list[index]`, for messages.
std::string where(const char* list, size_t index);

// All lists have `n` entries (names and lists in the same order).
void same_lengths(const char* op, size_t n, const std::vector<std::pair<const char*, const TensorList*>>& lists);

// The params of one call: defined, one supported float dtype, one CPU/CUDA
// device, contiguous, no two sharing storage.  Returns the common device.
at::Device params(const char* op, const TensorList& params);

// A per-element or per-param companion of params[i]: defined, of dtype
// `dtype`, on the param's device, of shape `sizes`, contiguous.
void companion(const char* op, const at::Tensor& t, const at::Tensor& param, const char* list, size_t index,
               at::ScalarType dtype, at::IntArrayRef sizes);

// The dtype of list[0] when it is one of float32 / bfloat16 / float16.
at::ScalarType float_list_dtype(const char* op, const TensorList& list, const char* name);

// Masters (empty, FP32 or int16 remainders) for params of `param_dtype`.
MasterKind master_kind(const char* op, const TensorList& masters, at::ScalarType param_dtype);

// An optional one-element FP32 tensor on `device` (lr, inv_scale, found_inf).
void scalar_tensor(const char* op, const c10::optional<at::Tensor>& t, const char* name, const at::Device& device);

// Distinct tensors (step counters would be bumped twice otherwise).
void distinct(const char* op, const TensorList& list, const char* name);

}  // namespace checks
}  // namespace muon_ext

// CUDA multi-tensor AdamW (ATen types only; no torch/extension.h, no pybind11).
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Optional.h>

#include <vector>

#include "../common/adamw_math.h"

namespace muon_ext {
namespace cuda {

// All arguments already validated by the caller: tensors contiguous, same CUDA device,
// params float32/bfloat16/float16 (one dtype), grads float32/bfloat16/float16 (one dtype),
// exp_avgs/exp_avg_sqs float32, masters empty (kNone) or float32 (kFP32) or int16 (kRemainder, bf16 params),
// steps: one float32 1-element tensor per param, on the params' device.
// lr_tensor, when given, is a 1-element float32 tensor on the params' device and replaces `lr`.
// inv_scale / found_inf, when given, are 1-element float32 tensors on the params' device.
// Never synchronizes the host. If *found_inf != 0 nothing changes (steps included);
// otherwise every step is incremented by one and then used (t = step after increment) for bias correction.
void adamw_step(const std::vector<at::Tensor>& params, const std::vector<at::Tensor>& grads,
                const std::vector<at::Tensor>& exp_avgs, const std::vector<at::Tensor>& exp_avg_sqs,
                const std::vector<at::Tensor>& masters, const std::vector<at::Tensor>& steps,
                MasterMode master_mode, const AdamWHyper& hyper, double lr,
                const c10::optional<at::Tensor>& lr_tensor, const c10::optional<at::Tensor>& inv_scale,
                const c10::optional<at::Tensor>& found_inf);

}  // namespace cuda
}  // namespace muon_ext

// The step ops behind torch.ops.muon_ext.adamw_step / muon_step, with one
// argument more than their schemas: the step check's token (checks.h,
// CheckedBucket; null: check everything).  The dispatcher's kernels pass
// null; the optimizer's eager entry (csrc/bindings.cpp, _C.adamw_step /
// _C.muon_step) passes the token of the bucket it steps (docs/design.md,
// "Ops (torch.library)").
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/ArrayRef.h>
#include <c10/util/string_view.h>

#include <optional>

#include "checks.h"

namespace muon_ext {
namespace op {

void adamw_step(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs, at::TensorList exp_avg_sqs,
                at::TensorList masters, at::TensorList steps, double lr, const std::optional<at::Tensor>& lr_tensor,
                double beta1, double beta2, double eps, double weight_decay, bool adam_w_mode, bool bias_correction,
                const std::optional<at::Tensor>& inv_scale, const std::optional<at::Tensor>& found_inf,
                checks::CheckedBucket* checked);

void muon_step(at::TensorList params, at::TensorList grads, at::TensorList momentum_buffers,
               at::TensorList second_momentum_buffers, at::TensorList masters, double lr,
               const std::optional<at::Tensor>& lr_tensor, double momentum, bool nesterov,
               std::optional<double> beta2, double weight_decay, int64_t ns_steps,
               at::ArrayRef<double> ns_coefficients, c10::string_view lr_scale,
               const std::optional<at::Tensor>& inv_scale, const std::optional<at::Tensor>& found_inf,
               int64_t max_workspace_bytes, std::optional<int64_t> polar_row_blocks,
               c10::string_view polar_dtype, c10::string_view polar_method, checks::CheckedBucket* checked);

}  // namespace op
}  // namespace muon_ext

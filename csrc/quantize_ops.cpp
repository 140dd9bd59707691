// torch.ops.muon_ext.quantize_fp8: every argument checked (naming it) before
// anything is written, then the CPU or CUDA kernel (csrc/quantize_ops.h).
#include <c10/util/Exception.h>

#include <algorithm>
#include <utility>
#include <vector>

#include "checks.h"
#include "quantize_ops.h"

namespace muon_ext {
namespace {

constexpr const char* kOp = "quantize_fp8";

// Overflow-free for any a >= 0, b > 0 (a + b - 1 wraps for b near INT64_MAX).
int64_t ceil_div(int64_t a, int64_t b) { return a / b + (a % b != 0); }

// The tensor an output must match: dtype, device, shape, contiguous, storage.
void check_output(const at::Tensor& t, const char* name, at::ScalarType dtype, const at::Device& device,
                  at::IntArrayRef sizes) {
  TORCH_CHECK_VALUE(t.defined(), kOp, ": ", name, " is undefined");
  TORCH_CHECK_TYPE(t.scalar_type() == dtype, kOp, ": ", name, " must be ", dtype, ", got ", t.scalar_type());
  TORCH_CHECK_VALUE(t.device() == device, kOp, ": ", name, " is on ", t.device(), " but master is on ", device);
  TORCH_CHECK_VALUE(t.sizes() == sizes, kOp, ": ", name, " has shape ", t.sizes(), ", expected ", sizes);
  TORCH_CHECK_VALUE(t.is_contiguous(), kOp, ": ", name, " must be contiguous");
  checks::storage(kOp, t, name);
}

QuantizeFp8Args check_args(const at::Tensor& master, at::OptionalIntArrayRef block, const at::Tensor& out,
                           const at::Tensor& out_scale_inv, const std::optional<at::Tensor>& found_inf) {
  QuantizeFp8Args args;
  TORCH_CHECK_VALUE(master.defined(), kOp, ": master is undefined");
  TORCH_CHECK_TYPE(master.scalar_type() == at::kFloat, kOp, ": master must be float32, got ", master.scalar_type());
  checks::device(kOp, master.device(), "master");
  TORCH_CHECK_VALUE(master.is_contiguous(), kOp, ": master must be contiguous, got strides ", master.strides(),
                    " for shape ", master.sizes());
  checks::storage(kOp, master, "master");
  std::vector<int64_t> scale_shape;  // () for one scale per tensor
  if (block.has_value()) {
    TORCH_CHECK_VALUE(block->size() == 2 && (*block)[0] > 0 && (*block)[1] > 0, kOp,
                      ": block must be two positive ints (rows, cols) or None, got ", *block);
    TORCH_CHECK_VALUE(master.dim() == 2, kOp, ": block=", *block, " needs a 2-D master, got shape ", master.sizes(),
                      " (block=None gives one scale for any shape)");
    // A block larger than the matrix covers all of it: clamp to the matrix, so
    // that no product or sum of block sizes in the kernels can overflow (a
    // block area wrapping to 0 divided by zero; a wrapped ceil_div wrote nothing).
    args.block_rows = std::min<int64_t>((*block)[0], std::max<int64_t>(master.size(0), 1));
    args.block_cols = std::min<int64_t>((*block)[1], std::max<int64_t>(master.size(1), 1));
    scale_shape = {ceil_div(master.size(0), args.block_rows), ceil_div(master.size(1), args.block_cols)};
  }
  check_output(out, "out", at::kFloat8_e4m3fn, master.device(), master.sizes());
  check_output(out_scale_inv, "out_scale_inv", at::kFloat, master.device(), scale_shape);
  if (found_inf.has_value()) {
    const at::Tensor& flag = *found_inf;
    TORCH_CHECK_VALUE(flag.defined(), kOp, ": found_inf is undefined");
    TORCH_CHECK_TYPE(flag.scalar_type() == at::kFloat, kOp, ": found_inf must be float32, got ", flag.scalar_type());
    TORCH_CHECK_VALUE(flag.numel() == 1, kOp, ": found_inf must hold one element, got ", flag.numel());
    TORCH_CHECK_VALUE(flag.device() == master.device(), kOp, ": found_inf is on ", flag.device(),
                      " but master is on ", master.device());
    checks::storage(kOp, flag, "found_inf");
  }

  // Written tensors must not overlap what is read, nor each other.
  const std::pair<const char*, const at::Tensor*> tensors[] = {
      {"master", &master}, {"out", &out}, {"out_scale_inv", &out_scale_inv}, {"found_inf", found_inf ? &*found_inf : nullptr}};
  checks::MemoryRanges ranges;
  for (int64_t i = 0; i < 4; ++i) {
    if (tensors[i].second != nullptr) ranges.add(*tensors[i].second, 0, i);
  }
  std::pair<int64_t, int64_t> a, b;
  TORCH_CHECK_VALUE(!ranges.first_overlap(&a, &b), kOp, ": ", tensors[b.second].first, " and ",
                    tensors[a.second].first, " overlap in memory");

  args.master = master;
  args.out = out;
  args.scale_inv = out_scale_inv;
  if (found_inf.has_value()) args.found_inf = *found_inf;
  return args;
}

}  // namespace

namespace op {

void quantize_fp8(const at::Tensor& master, at::OptionalIntArrayRef block, const at::Tensor& out,
                  const at::Tensor& out_scale_inv, const std::optional<at::Tensor>& found_inf) {
  const QuantizeFp8Args args = check_args(master, block, out, out_scale_inv, found_inf);
  if (master.is_meta()) return;
  if (master.is_cpu()) return cpu::quantize_fp8(args);
#if defined(MUON_EXT_WITH_CUDA)
  cuda::quantize_fp8(args);
#endif
}

}  // namespace op
}  // namespace muon_ext

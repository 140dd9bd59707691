// The fused small-matrix Muon step on the CPU (docs/design.md, "CPU kernels",
// fused small-matrix step): where Polar-Express runs on the SIMD kernel of
// polar_small.h, one pass over the state per run of matrices, with the element
// math of muon_elementwise.h, so the bits are the unfused passes'.
#include "muon_small_step_cpu.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "../common/polar_plan.h"
#include "../common/remainder.h"
#include "../common/shapes.h"
#include "adamw_cpu.h"
#include "balanced_runs.h"
#include "muon_elementwise.h"
#include "polar_express_cpu.h"
#include "polar_small.h"

namespace muon_ext {
namespace cpu {
namespace {

// Element types of the stored formats, for byte sizes.
template <ScalarKind K>
using ParamStorage = std::conditional_t<K == ScalarKind::kFloat32, float, uint16_t>;
template <MasterMode M>
using MasterStorage = std::conditional_t<M == MasterMode::kFP32, float, int16_t>;

constexpr int64_t kCacheLine = 64;

// The lines of [p, p + bytes) appended to a SmallPrefetch's ranges.
__attribute__((always_inline)) inline void add_prefetch_range(std::vector<PrefetchRange>& ranges, const void* p,
                                                              int64_t bytes) {
  const uintptr_t first = reinterpret_cast<uintptr_t>(p) & ~uintptr_t(kCacheLine - 1);
  const uintptr_t end = reinterpret_cast<uintptr_t>(p) + uintptr_t(bytes);
  if (end > first) ranges.push_back({first, int64_t((end - first + kCacheLine - 1) / kCacheLine)});
}

// apply_range for BF16 params with remainders and no multiplier, in two
// passes: the updated masters over the spent updates x, then split by the
// AdamW kernel's split_master_block for `capability` (a vector without a NaN
// by the NaN-free form: the full rule's NaN corrections per element were a
// third of the apply). Same bits as apply_range.
__attribute__((always_inline)) inline void apply_remainder_in_two_passes(uint16_t* hi, int16_t* rem, float* x,
                                                                         int64_t numel, float lr, float lr_wd,
                                                                         CpuCapability capability) {
  for (int64_t k = 0; k < numel; ++k) x[k] = muon_ext::muon_apply(merge_master(hi[k], rem[k]), x[k], lr, lr_wd);
  split_master_block(x, hi, rem, numel, capability);
}

// What every run of one step shares.
struct SmallStep {
  int64_t rows, cols, n, len;
  bool per_row, nesterov, normuon, gram;
  float mu, beta2, inv_scale, lr, lr_wd;
  PolarRounding rounding;
  CpuCapability capability;  // of the remainder split in the apply
  const float* abc;
  int64_t steps;
  std::vector<int64_t> starts;  // each param's first matrix number, and the total
  std::vector<const void*> grads;
  std::vector<float*> moms, second_moments;
  std::vector<void*> params, masters;
};

// One thread's buffers for a run of up to `matrices` matrices.
struct SmallBuffers {
  SmallBuffers(int64_t matrices, int64_t n, int64_t len, int64_t polar_floats)
      : polar(polar_floats), x(matrices * n), mult(len), sums(len), smb_of(matrices) {}
  PolarSmallScratch polar;
  std::vector<float> x, mult;
  std::vector<double> sums;
  std::vector<float*> smb_of;  // each matrix's second moments, for NorMuon in the lanes
  std::vector<PrefetchRange> prefetch_ranges;
};

// The matrices [begin, end) of the bucket through the whole step. Cloned per
// instruction set: the elementwise loops (momentum, norms, apply) vectorize
// with the widest the CPU has; the same IEEE operations, so the same bits.
template <ScalarKind G, ScalarKind P, MasterMode M>
MUON_EXT_ISA_CLONES void small_step_run(const SmallStep& s, int64_t begin, int64_t end, SmallBuffers& buf) {
  const int64_t n = s.n, len = s.len, first_param = std::upper_bound(s.starts.begin(), s.starts.end(), begin) -
                                                        s.starts.begin() - 1;
  float* const u = buf.x.data();
  // Prefetch what the apply of this run and the momentum of the next will
  // read, paced by the iterations, so those loads overlap their arithmetic.
  buf.prefetch_ranges.clear();
  const int64_t ahead = std::min(end + (end - begin), s.starts.back());
  for (int64_t at = begin, p = first_param; at < ahead; ++p) {
    const int64_t stop = std::min(ahead, s.starts[p + 1]), own_end = std::min(stop, end), next = std::max(at, end);
    if (at < own_end) {
      const int64_t offset = (at - s.starts[p]) * n, numel = (own_end - at) * n;
      add_prefetch_range(buf.prefetch_ranges, static_cast<char*>(s.params[p]) + offset * int64_t(sizeof(ParamStorage<P>)),
                         numel * int64_t(sizeof(ParamStorage<P>)));
      if constexpr (M != MasterMode::kNone) {
        add_prefetch_range(buf.prefetch_ranges,
                           static_cast<char*>(s.masters[p]) + offset * int64_t(sizeof(MasterStorage<M>)),
                           numel * int64_t(sizeof(MasterStorage<M>)));
      }
    }
    if (next < stop) {
      const int64_t offset = (next - s.starts[p]) * n, numel = (stop - next) * n;
      add_prefetch_range(buf.prefetch_ranges, s.moms[p] + offset, numel * int64_t(sizeof(float)));
      add_prefetch_range(buf.prefetch_ranges,
                         static_cast<const char*>(s.grads[p]) + offset * int64_t(sizeof(ParamStorage<G>)),
                         numel * int64_t(sizeof(ParamStorage<G>)));
    }
    at = stop;
  }
  // Momentum and Nesterov, param part by param part (a run may cross params).
  for (int64_t at = begin, p = first_param; at < end; ++p) {
    const int64_t count = std::min(end, s.starts[p + 1]) - at, offset = (at - s.starts[p]) * n;
    const void* grad = s.grads[p];
    float* mom = s.moms[p] + offset;
    float* out = u + (at - begin) * n;
    momentum_elements<G>(grad, offset, mom, out, count * n, s.inv_scale, s.mu, s.nesterov);
    at += count;
  }
  // NorMuon in the lanes where its statistics fit the scratch, else per matrix below.
  const bool lane_normuon = s.normuon && len <= kSmallNorMuonMaxStats;
  SmallNorMuon normuon{buf.smb_of.data(), s.beta2};
  if (lane_normuon) {
    for (int64_t at = begin, p = first_param; at < end; ++p) {
      const int64_t stop = std::min(end, s.starts[p + 1]);
      for (int64_t j = at; j < stop; ++j) buf.smb_of[j - begin] = s.second_moments[p] + (j - s.starts[p]) * len;
      at = stop;
    }
  }
  const SmallPrefetch prefetch{buf.prefetch_ranges.data(), static_cast<int64_t>(buf.prefetch_ranges.size())};
  polar_express_small_matrices(u, true, end - begin, s.rows, s.cols, s.abc, s.steps, s.rounding,
                               s.gram, lane_normuon ? &normuon : nullptr, &prefetch, buf.polar.data());
  for (int64_t at = begin, p = first_param; at < end; ++p) {
    const int64_t count = std::min(end, s.starts[p + 1]) - at, first = at - s.starts[p];
    float* xs = u + (at - begin) * n;
    if (s.normuon && !lane_normuon) {
      float* smb = s.second_moments[p] + first * len;
      for (int64_t j = 0; j < count; ++j) {
        float* xm = xs + j * n;
        normuon_matrix_multipliers(s.rows, s.cols, s.beta2, xm, smb + j * len, buf.mult.data(), buf.sums.data());
        // apply_range's x * multiplier, formed here; then x * 1 == x there.
        fold_matrix_multipliers(xm, buf.mult.data(), s.cols, s.per_row, 0, n);
      }
    }
    if (count > 0) {
      if constexpr (P == ScalarKind::kBFloat16 && M == MasterMode::kRemainder) {
        apply_remainder_in_two_passes(static_cast<uint16_t*>(s.params[p]) + first * n,
                                      static_cast<int16_t*>(s.masters[p]) + first * n, xs, count * n, s.lr, s.lr_wd,
                                      s.capability);
      } else {
        void* master = s.masters.empty() ? nullptr : s.masters[p];
        apply_range<P, M>(s.params[p], master, xs, nullptr, true, count * n, first * n, 0, count * n, s.lr, s.lr_wd);
      }
    }
    at += count;
  }
}

}  // namespace

// The fused small-matrix step (docs/design.md, "CPU kernels", small matrices):
// where Polar-Express runs on the SIMD kernel, each task takes a run of
// consecutive matrices of the bucket (whole lane groups, about
// kSmallTaskElements elements, so its buffers stay in the core's cache)
// through the whole step in one pass: momentum and Nesterov, the input scale,
// the iterations, NorMuon, and the apply into param and master. Every matrix
// sees the same operations on the same values as in the unfused passes above,
// so the bits are theirs, for any run, thread count or address.
constexpr int64_t kSmallTaskElements = 4096;

bool fused_small_step(const MuonBucket& b) {
  return polar_small_shape(b.rows, b.cols) && b.matrix_numel() <= kWorkItem;
}

void small_step(const MuonBucket& b, const MuonStepOptions& o, float inv_scale, float lr, float lr_wd) {
  SmallStep s;
  s.rows = b.rows, s.cols = b.cols, s.n = b.matrix_numel(), s.len = b.stat_length();
  s.per_row = shapes::stats_per_row(b.rows, b.cols);
  s.nesterov = o.hyper.nesterov, s.normuon = o.hyper.normuon;
  s.gram = polar_method_for(o.polar_method, b.rows, b.cols) == PolarMethod::kGram;
  s.mu = o.hyper.momentum, s.beta2 = o.hyper.beta2, s.inv_scale = inv_scale, s.lr = lr, s.lr_wd = lr_wd;
  s.rounding = rounding_of(o.polar_dtype);
  s.capability = best_capability();
  std::vector<float> abc;
  for (const auto& t : o.coefficients) abc.insert(abc.end(), t.begin(), t.end());
  s.abc = abc.data();
  s.steps = static_cast<int64_t>(o.coefficients.size());
  s.starts = {0};
  for (const at::Tensor& p : b.params) s.starts.push_back(s.starts.back() + p.numel() / s.n);
  s.grads = const_data_pointers(b.grads);
  s.moms = data_pointers<float>(b.momentum_buffers);
  s.second_moments = data_pointers<float>(b.second_momentum_buffers);
  s.params = data_pointers(b.params);
  s.masters = data_pointers(b.masters);
  const int64_t run_matrices =
      std::max<int64_t>(kPolarSmallLanes, kSmallTaskElements / s.n / kPolarSmallLanes * kPolarSmallLanes);
  const int64_t total = s.starts.back(), runs = (total + run_matrices - 1) / run_matrices;
  const int64_t polar_floats =
      polar_small_scratch_floats(b.rows, b.cols, s.gram, s.normuon && s.len <= kSmallNorMuonMaxStats);
  dispatch_storage(scalar_kind(b.grads[0].scalar_type()), [&](auto grad_storage) {
    dispatch_param(b.params[0].scalar_type(), b.master_mode, [&](auto param_storage, auto master_mode) {
      constexpr ScalarKind G = decltype(grad_storage)::value, P = decltype(param_storage)::value;
      constexpr MasterMode M = decltype(master_mode)::value;
      for_each_run_balanced(
          runs, [&] { return SmallBuffers(run_matrices, s.n, s.len, polar_floats); },
          [&](int64_t run, SmallBuffers& buffers) {
            small_step_run<G, P, M>(s, run * run_matrices, std::min(total, (run + 1) * run_matrices), buffers);
          });
    });
  });
}

}  // namespace cpu
}  // namespace muon_ext

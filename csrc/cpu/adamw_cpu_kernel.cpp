// AdamW element kernel for one instruction set.  Built once per ISA with
// CPU_CAPABILITY set to DEFAULT, AVX2 or AVX512 (flags: csrc/build_flags.json),
// which selects the matching at::vec::Vectorized backend.
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/vec.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "../common/bits.h"
#include "../common/remainder.h"
#include "adamw_cpu.h"
#include "balanced_runs.h"
#include "remainder_simd.h"
#include "scalar_io.h"

#ifndef CPU_CAPABILITY
#error "CPU_CAPABILITY must be defined (DEFAULT, AVX2 or AVX512)"
#endif

namespace muon_ext {

template <>
struct MathOps<at::vec::Vectorized<float>> {
  static at::vec::Vectorized<float> sqrt(const at::vec::Vectorized<float>& x) { return x.sqrt(); }
};

namespace cpu {
namespace CPU_CAPABILITY {
namespace {

using Vec = at::vec::Vectorized<float>;

// Scheduling unit (elements; 64 FP32 = 4 cache lines, 64 BF16 = 2), the
// fewest units a thread is given (below 2x this a call runs on one thread),
// and the elements per staging buffer.
constexpr int64_t kUnit = 64;
constexpr int64_t kMinUnitsPerThread = 16384 / kUnit;
constexpr int64_t kBlock = 512;
static_assert(kBlock % 64 == 0, "block must hold whole vectors");

// Software prefetch distance, in elements of every stream (2 KiB ahead on an
// FP32 stream, 1 KiB on a 16-bit one).  AdamW reads four or five streams and
// writes three; the hardware prefetchers alone leave one core well short of
// its streaming rate on them (docs/design.md, "CPU kernels").  A prefetch
// never faults, so one past a tensor's end or a thread's range is only a
// wasted line; it does not change what is computed.
constexpr int64_t kPrefetchAhead = 512;

template <typename T>
inline void prefetch_ahead(const T* stream, int64_t i) {
  const auto address = reinterpret_cast<std::uintptr_t>(stream) + sizeof(T) * static_cast<std::uintptr_t>(i + kPrefetchAhead);
  __builtin_prefetch(reinterpret_cast<const void*>(address), 0, 3);
}

inline AdamWCoeffs<Vec> broadcast(const AdamWCoeffs<float>& c) {
  AdamWCoeffs<Vec> v;
  v.lr = Vec(c.lr);
  v.beta1 = Vec(c.beta1);
  v.one_minus_beta1 = Vec(c.one_minus_beta1);
  v.beta2 = Vec(c.beta2);
  v.one_minus_beta2 = Vec(c.one_minus_beta2);
  v.eps = Vec(c.eps);
  v.weight_decay = Vec(c.weight_decay);
  v.inv_bias_correction1 = Vec(c.inv_bias_correction1);
  v.inv_bias_correction2 = Vec(c.inv_bias_correction2);
  v.inv_scale = Vec(c.inv_scale);
  v.adam_w_mode = c.adam_w_mode;
  return v;
}

// The update on n contiguous FP32 elements: vector body, scalar tail.  Both
// evaluate adamw_element with the same operation order, so every element gets
// the same bits whichever path it takes.
inline void adamw_contiguous(float* p, float* m, float* v, const float* g, int64_t n,
                             const AdamWCoeffs<float>& c, const AdamWCoeffs<Vec>& cv) {
  int64_t j = 0;
  for (; j + Vec::size() <= n; j += Vec::size()) {
    prefetch_ahead(p, j);
    prefetch_ahead(m, j);
    prefetch_ahead(v, j);
    prefetch_ahead(g, j);
    Vec vp = Vec::loadu(p + j);
    Vec vm = Vec::loadu(m + j);
    Vec vv = Vec::loadu(v + j);
    const Vec vg = Vec::loadu(g + j);
    adamw_element(vp, vm, vv, vg, cv);
    vp.store(p + j);
    vm.store(m + j);
    vv.store(v + j);
  }
  for (; j < n; ++j) adamw_element(p[j], m[j], v[j], g[j], c);
}

#if defined(MUON_EXT_REMAINDER_SIMD)
// BF16 params with remainders: merge, update and split in registers, one
// vector at a time, instead of staging the masters through a buffer in three
// passes.  The scalar tail evaluates the same element math, so every element
// gets the bits of the staged (DEFAULT) loop.
//
// The whole vectors of [begin, end); returns where the scalar tail starts.
// Instantiated per AdamW / L2 mode so that the mode is a constant in the loop.
template <ScalarKind G, bool kAdamWMode>
int64_t adamw_remainder_vectors(const AdamWTensor& t, int64_t begin, int64_t end, const AdamWCoeffs<Vec>& coeffs) {
  AdamWCoeffs<Vec> cv = coeffs;
  cv.adam_w_mode = kAdamWMode;  // a constant in the loop: no test per vector
  uint16_t* hi = static_cast<uint16_t*>(t.param);
  int16_t* rem = static_cast<int16_t*>(t.master);
  float* m = t.exp_avg;
  float* v = t.exp_avg_sq;
  const void* grad = t.grad;
  int64_t i = begin;
  for (; i + Vec::size() <= end; i += Vec::size()) {
    prefetch_ahead(hi, i);
    prefetch_ahead(rem, i);
    prefetch_ahead(m, i);
    prefetch_ahead(v, i);
    if constexpr (G == ScalarKind::kFloat32) {
      prefetch_ahead(static_cast<const float*>(grad), i);
    } else {
      prefetch_ahead(static_cast<const uint16_t*>(grad), i);
    }
    Vec p = merge_master_vec(hi + i, rem + i);
    Vec vm = Vec::loadu(m + i);
    Vec vv = Vec::loadu(v + i);
    Vec g;
    if constexpr (G == ScalarKind::kFloat32) {
      g = Vec::loadu(static_cast<const float*>(grad) + i);
    } else {
      g = load_bf16_vec(static_cast<const uint16_t*>(grad) + i);
    }
    adamw_element(p, vm, vv, g, cv);
    split_master_vec(p, hi + i, rem + i);
    vm.store(m + i);
    vv.store(v + i);
  }
  return i;
}

template <ScalarKind G>
void adamw_remainder_fused(const AdamWTensor& t, int64_t begin, int64_t end, const AdamWCoeffs<float>& c,
                           const AdamWCoeffs<Vec>& cv) {
  uint16_t* hi = static_cast<uint16_t*>(t.param);
  int16_t* rem = static_cast<int16_t*>(t.master);
  float* m = t.exp_avg;
  float* v = t.exp_avg_sq;
  int64_t i = c.adam_w_mode ? adamw_remainder_vectors<G, true>(t, begin, end, cv)
                            : adamw_remainder_vectors<G, false>(t, begin, end, cv);
  for (; i < end; ++i) {
    float p = merge_master(hi[i], rem[i]);
    adamw_element(p, m[i], v[i], load_scalar<G>(t.grad, i), c);
    const RemainderSplit s = split_master(p);
    hi[i] = s.bf16_bits;
    rem[i] = s.remainder;
  }
}
#endif

template <ScalarKind P, ScalarKind G, MasterMode M>
void adamw_range(const AdamWTensor& t, int64_t begin, int64_t end, const AdamWCoeffs<float>& c) {
  const AdamWCoeffs<Vec> cv = broadcast(c);
#if defined(MUON_EXT_REMAINDER_SIMD)
  // FP16 grads stay on the staged loop: only FP32 and BF16 loads have a vector form here.
  if constexpr (M == MasterMode::kRemainder && G != ScalarKind::kFloat16) {
    adamw_remainder_fused<G>(t, begin, end, c, cv);
    return;
  }
#endif
  alignas(64) float master_buf[kBlock];
  alignas(64) float grad_buf[kBlock];
  for (int64_t start = begin; start < end; start += kBlock) {
    const int64_t n = std::min(kBlock, end - start);

    const float* g;
    if constexpr (G == ScalarKind::kFloat32) {
      g = static_cast<const float*>(t.grad) + start;
    } else {
      for (int64_t j = 0; j < n; ++j) grad_buf[j] = load_scalar<G>(t.grad, start + j);
      g = grad_buf;
    }

    float* p;
    if constexpr (M == MasterMode::kFP32) {
      p = static_cast<float*>(t.master) + start;
    } else if constexpr (M == MasterMode::kRemainder) {
      const uint16_t* hi = static_cast<const uint16_t*>(t.param) + start;
      const int16_t* rem = static_cast<const int16_t*>(t.master) + start;
      for (int64_t j = 0; j < n; ++j) master_buf[j] = merge_master(hi[j], rem[j]);
      p = master_buf;
    } else if constexpr (P == ScalarKind::kFloat32) {
      p = static_cast<float*>(t.param) + start;
    } else {
      for (int64_t j = 0; j < n; ++j) master_buf[j] = load_scalar<P>(t.param, start + j);
      p = master_buf;
    }

    adamw_contiguous(p, t.exp_avg + start, t.exp_avg_sq + start, g, n, c, cv);

    if constexpr (M == MasterMode::kRemainder) {
      uint16_t* hi = static_cast<uint16_t*>(t.param) + start;
      int16_t* rem = static_cast<int16_t*>(t.master) + start;
      for (int64_t j = 0; j < n; ++j) {
        const RemainderSplit s = split_master(master_buf[j]);
        hi[j] = s.bf16_bits;
        rem[j] = s.remainder;
      }
    } else if constexpr (P != ScalarKind::kFloat32) {
      for (int64_t j = 0; j < n; ++j) store_rne<P>(t.param, start + j, p[j]);
    }
  }
}

using RangeFn = void (*)(const AdamWTensor&, int64_t, int64_t, const AdamWCoeffs<float>&);

template <ScalarKind P, MasterMode M>
RangeFn pick_grad(ScalarKind g) {
  switch (g) {
    case ScalarKind::kFloat32: return &adamw_range<P, ScalarKind::kFloat32, M>;
    case ScalarKind::kBFloat16: return &adamw_range<P, ScalarKind::kBFloat16, M>;
    case ScalarKind::kFloat16: return &adamw_range<P, ScalarKind::kFloat16, M>;
  }
  return nullptr;
}

RangeFn pick_range_fn(ScalarKind p, ScalarKind g, MasterMode m) {
  switch (p) {
    case ScalarKind::kFloat32:
      return m == MasterMode::kNone ? pick_grad<ScalarKind::kFloat32, MasterMode::kNone>(g) : nullptr;
    case ScalarKind::kBFloat16:
      switch (m) {
        case MasterMode::kNone: return pick_grad<ScalarKind::kBFloat16, MasterMode::kNone>(g);
        case MasterMode::kFP32: return pick_grad<ScalarKind::kBFloat16, MasterMode::kFP32>(g);
        case MasterMode::kRemainder: return pick_grad<ScalarKind::kBFloat16, MasterMode::kRemainder>(g);
      }
      return nullptr;
    case ScalarKind::kFloat16:
      switch (m) {
        case MasterMode::kNone: return pick_grad<ScalarKind::kFloat16, MasterMode::kNone>(g);
        case MasterMode::kFP32: return pick_grad<ScalarKind::kFloat16, MasterMode::kFP32>(g);
        case MasterMode::kRemainder: return nullptr;
      }
      return nullptr;
  }
  return nullptr;
}

}  // namespace

void split_master_block(const float* master, uint16_t* hi, int16_t* rem, int64_t n) {
  int64_t i = 0;
#if defined(MUON_EXT_REMAINDER_SIMD)
  for (; i + Vec::size() <= n; i += Vec::size()) split_master_vec(Vec::loadu(master + i), hi + i, rem + i);
#endif
  for (; i < n; ++i) {
    const RemainderSplit s = split_master(master[i]);
    hi[i] = s.bf16_bits;
    rem[i] = s.remainder;
  }
}

void merge_master_block(const uint16_t* hi, const int16_t* rem, float* master, int64_t n) {
  int64_t i = 0;
#if defined(MUON_EXT_REMAINDER_SIMD)
  for (; i + Vec::size() <= n; i += Vec::size()) merge_master_vec(hi + i, rem + i).store(master + i);
#endif
  for (; i < n; ++i) master[i] = merge_master(hi[i], rem[i]);
}

void adamw_apply(const AdamWBatch& batch, const std::vector<AdamWCoeffs<float>>& coeffs) {
  const RangeFn range_fn = pick_range_fn(batch.param_kind, batch.grad_kind, batch.master_mode);
  TORCH_CHECK(range_fn != nullptr, "adamw_apply: unsupported dtype / master combination");
  TORCH_CHECK(coeffs.size() == batch.tensors.size(), "adamw_apply: one coefficient set per tensor expected");

  // One parallel region over the concatenated tensors, cut into units of
  // kUnit elements and runs of kMinUnitsPerThread units, spread by
  // for_each_run_balanced (balanced_runs.h: each thread walks its own
  // contiguous share of runs in order, and an idle thread takes runs from the
  // back of a slower one's), so threads get equal element counts however the
  // sizes are mixed, and each walks its tensors in order, calling the kernel
  // once per tensor piece.  A unit holds whole cache lines of every stream, so
  // threads share no line inside a tensor.  The update is elementwise: the
  // bits do not depend on where the runs are cut.
  std::vector<int64_t> first_unit(batch.tensors.size() + 1, 0);
  for (size_t i = 0; i < batch.tensors.size(); ++i) {
    first_unit[i + 1] = first_unit[i] + (batch.tensors[i].numel + kUnit - 1) / kUnit;
  }
  const int64_t units = first_unit.back();
  if (units == 0) return;
  auto run_units = [&](int64_t unit_begin, int64_t unit_end) {
    // The last tensor starting at or before unit_begin (empty tensors own no unit).
    size_t tensor = std::upper_bound(first_unit.begin(), first_unit.end(), unit_begin) - first_unit.begin() - 1;
    for (; tensor < batch.tensors.size() && first_unit[tensor] < unit_end; ++tensor) {
      const AdamWTensor& t = batch.tensors[tensor];
      const int64_t begin = (std::max(unit_begin, first_unit[tensor]) - first_unit[tensor]) * kUnit;
      const int64_t end = std::min((unit_end - first_unit[tensor]) * kUnit, t.numel);
      if (begin < end) range_fn(t, begin, end, coeffs[tensor]);
    }
  };
  for_each_range_balanced(units, kMinUnitsPerThread, run_units);
}

}  // namespace CPU_CAPABILITY
}  // namespace cpu
}  // namespace muon_ext

// The one table of hyper-parameter ranges and mode names.  The op layer's
// checks (csrc/ops.cpp) and the Python checks (muon_ext/schema.py, which reads
// this table through muon_ext._C.schema()) both use it, so the two cannot
// refuse different values; tests/python/test_schema.py holds them to that.
// Torch-free, so gtests and the CUDA sources can include it.
#pragma once

#include <cmath>
#include <cstring>
#include <limits>

namespace muon_ext {
namespace schema {

inline constexpr double kInf = std::numeric_limits<double>::infinity();

// A setting's valid values: finite reals in [low, high) (or [low, high] when
// high_inclusive; high = kInf: no upper bound).  `integer` settings take ints.
struct Range {
  const char* kind;  // "adamw", "muon" or "optimizer" (a constructor argument)
  const char* name;
  double low;
  double high;
  bool high_inclusive;
  bool integer;
};

inline constexpr Range kRanges[] = {
    {"adamw", "lr", 0.0, kInf, false, false},
    {"adamw", "beta1", 0.0, 1.0, false, false},
    {"adamw", "beta2", 0.0, 1.0, false, false},
    {"adamw", "eps", 0.0, kInf, false, false},
    {"adamw", "weight_decay", 0.0, kInf, false, false},
    {"muon", "lr", 0.0, kInf, false, false},
    {"muon", "momentum", 0.0, 1.0, false, false},
    {"muon", "beta2", 0.0, 1.0, false, false},  // or None: NorMuon off
    {"muon", "weight_decay", 0.0, kInf, false, false},
    {"muon", "ns_steps", 0.0, kInf, false, true},
    {"muon", "polar_row_blocks", 1.0, 64.0, true, true},  // or None: the device's choice
    {"optimizer", "max_workspace_bytes", 1.0, kInf, false, true},
};

// Named modes: the accepted strings of each, in order.
struct Mode {
  const char* name;
  const char* values[3];
  int count;
};

inline constexpr Mode kModes[] = {
    {"lr_scale", {"original", "match_rms_adamw", "none"}, 3},
    {"matrix_view", {"error", "flatten", "batch"}, 3},
    {"master", {"none", "fp32", "remainder"}, 3},
    {"grad_attr", {"grad", "main_grad"}, 2},
    {"polar_dtype", {"bfloat16", "float32", "float16"}, 3},
    {"polar_method", {"standard", "gram", "auto"}, 3},
};

inline const Range* find_range(const char* kind, const char* name) {
  for (const Range& r : kRanges) {
    if (std::strcmp(r.kind, kind) == 0 && std::strcmp(r.name, name) == 0) return &r;
  }
  return nullptr;
}

inline bool in_bounds(const Range& r, double value) {
  if (!std::isfinite(value) || value < r.low) return false;
  return r.high_inclusive ? value <= r.high : value < r.high;
}

// The kernels compute in FP32, so a real setting must be in range both as
// given and rounded to float (a beta just below 1 rounds to 1.0f).
inline bool in_range(const Range& r, double value) {
  if (r.integer) return value == std::floor(value) && in_bounds(r, value);
  return in_bounds(r, value) && in_bounds(r, static_cast<double>(static_cast<float>(value)));
}

// Index of `value` among the mode's strings, or -1.
inline int find_mode(const char* mode, const char* value) {
  for (const Mode& m : kModes) {
    if (std::strcmp(m.name, mode) != 0) continue;
    for (int i = 0; i < m.count; ++i) {
      if (std::strcmp(m.values[i], value) == 0) return i;
    }
    return -1;
  }
  return -1;
}

}  // namespace schema
}  // namespace muon_ext

// The optimizer's checks of a step, one call per bucket (docs/design.md,
// "Data flow of one step"): metadata only, nothing is read or written.  They
// find the first param the kernels would refuse, or that they would read or
// write out of bounds, so that the optimizer raises, naming it, before the
// first kernel of a step runs.  The result is typed (StepProblem, the entry,
// the state key); muon_ext/buckets.py words the message.
//
// A passing check also yields a CheckedBucket (checks.h): the token that
// tells the step ops which of their own checks the planner already made.
#pragma once

#include <torch/extension.h>

#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "checks.h"
#include "common/shapes.h"

namespace muon_ext {
namespace checks {

// What the step check found wrong, by the param, its state or its grad.
enum class StepProblem : int {
  kNone = 0,
  kParamType,
  kParamLayout,
  kParamDtype,
  kParamDevice,
  kParamContiguous,
  kParamShape,
  kParamStorage,
  kStateType,  // the param's state is not a dict, or an entry is not a tensor
  kStateMissing,
  kStateUnexpected,
  kStateLayout,
  kStateDtype,
  kStateDevice,
  kStateShape,
  kStateContiguous,
  kStateStorage,
  kStateShared,  // a step counter shared with another param (`other`)
  kGradType,
  kGradLayout,
  kGradDtype,
  kGradShape,
  kGradDevice,
  kGradStorage,
};

// How a state entry's shape follows from its param's.  kGiven: the rule
// states it (`sizes`), e.g. the NorMuon statistics of row-blocked params, one
// column of every block's own statistics (muon_ext/row_blocks.py), the same
// for every param of a bucket.
enum class StateShape : int64_t { kParam = 0, kScalar = 1, kSecondMoment = 2, kGiven = 3 };

// One state entry the kernels take: its key, the dtype it must have (none:
// the entry must be absent), its shape, and whether a missing entry is a
// problem (the caller creates missing ones where it is not).
struct StateRule {
  py::object key;
  std::optional<at::ScalarType> dtype;
  StateShape shape = StateShape::kParam;
  std::vector<int64_t> sizes;  // kGiven only
  bool required = true;
};

// The result of check_bucket: the first problem (at entry `index`, state key
// `key`, and for kStateShared the other param's index), or on success whether
// every grad is present, contiguous and of one dtype, the grads, the state
// lists by key (None where an entry is missing), and the bucket's token.
struct BucketCheck {
  StepProblem problem = StepProblem::kNone;
  int64_t index = -1;
  std::string key;
  int64_t other = -1;
  bool uniform = false;
  py::object grads;
  py::object state;
  std::shared_ptr<CheckedBucket> token;
};

// The check of one bucket: params of one dtype and device (and, for Muon,
// one matrix shape `rows` x `cols` under `view`; kNone for AdamW), their state
// in the mapping `state` under `rules`, and, when `grad_attr` is a name, their
// grads.  Params are recorded in `ranges` (when given) as (`bucket`, index),
// and the state tensors of rules with a dtype as (`bucket`,
// state_range_index(index, rule, number of rules)), for the caller's overlap
// check across buckets.  `param_data` false: the kernels neither read nor
// write the params' data (a param writer stores them from the FP32 master),
// so their storage may be released and they are not recorded in `ranges`.
BucketCheck check_bucket(const py::list& params, const py::object& grad_attr, const py::object& state,
                         at::ScalarType dtype, at::Device device, const std::vector<StateRule>& rules, int64_t rows,
                         int64_t cols, shapes::MatrixView view, MemoryRanges* ranges, int64_t bucket,
                         bool param_data);

// The index under which check_bucket records state tensor `rule` of param `i`
// in `ranges`: negative, so params keep their own index (muon_ext/buckets.py,
// overlap_entry, decodes it).
inline int64_t state_range_index(int64_t i, size_t rule, size_t rules) {
  return -1 - (i * static_cast<int64_t>(rules) + static_cast<int64_t>(rule));
}

}  // namespace checks
}  // namespace muon_ext

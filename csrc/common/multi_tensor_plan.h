// Host-side planning of multi-tensor launches (torch-free, unit-tested on CPU).
//
// A list of tensors is cut into fixed-size chunks; each CUDA block processes
// one chunk.  A launch carries at most `max_tensors` tensor slots and
// `max_blocks` blocks (bounded by the kernel-argument size).  When a launch
// fills up in the middle of a tensor, that tensor is carried over into the
// next launch's first slot, so one tensor may be split across launches.
// Offsets are 64-bit: chunk * chunk_size may exceed 2^31.
#pragma once

#include <cstdint>
#include <vector>

namespace muon_ext {

struct MultiTensorBlock {
  int slot;       // index into MultiTensorLaunch::tensors
  int64_t chunk;  // chunk index within that tensor
};

struct MultiTensorLaunch {
  std::vector<int> tensors;  // indices into the caller's tensor list
  std::vector<MultiTensorBlock> blocks;
};

inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// Element range [begin, end) of `chunk` in a tensor of `numel` elements.
inline void chunk_range(int64_t numel, int64_t chunk_size, int64_t chunk, int64_t* begin, int64_t* end) {
  *begin = chunk * chunk_size;
  const int64_t stop = *begin + chunk_size;
  *end = stop < numel ? stop : numel;
}

// Empty tensors get no slot and no block.  Every chunk of every non-empty
// tensor appears in exactly one block of exactly one launch, and every slot
// of a launch owns at least one block.
inline std::vector<MultiTensorLaunch> plan_multi_tensor_launches(const std::vector<int64_t>& numels,
                                                                 int64_t chunk_size, int max_tensors,
                                                                 int max_blocks) {
  std::vector<MultiTensorLaunch> launches;
  MultiTensorLaunch current;
  for (int t = 0; t < static_cast<int>(numels.size()); ++t) {
    const int64_t chunks = ceil_div(numels[t], chunk_size);
    if (chunks == 0) continue;
    if (static_cast<int>(current.tensors.size()) == max_tensors ||
        static_cast<int>(current.blocks.size()) == max_blocks) {
      launches.push_back(std::move(current));
      current = MultiTensorLaunch();
    }
    current.tensors.push_back(t);
    for (int64_t c = 0; c < chunks; ++c) {
      if (static_cast<int>(current.blocks.size()) == max_blocks) {
        launches.push_back(std::move(current));
        current = MultiTensorLaunch();
        current.tensors.push_back(t);  // carry the partly covered tensor over
      }
      current.blocks.push_back({static_cast<int>(current.tensors.size()) - 1, c});
    }
  }
  if (!current.blocks.empty()) launches.push_back(std::move(current));
  return launches;
}

}  // namespace muon_ext

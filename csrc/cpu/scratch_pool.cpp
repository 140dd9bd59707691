#include "scratch_pool.h"

#include <array>

namespace muon_ext::cpu {
namespace {

struct PoolSlot {
  std::mutex mutex;
  at::Tensor block;  // kByte, empty until first used
};

// Never destroyed: a block freed during static destruction could outlive the allocator.
std::array<PoolSlot, kScratchSlotCount>& pool() {
  static auto* slots = new std::array<PoolSlot, kScratchSlotCount>();
  return *slots;
}

}  // namespace

ScratchLease::ScratchLease(ScratchSlot slot, at::IntArrayRef sizes, at::ScalarType dtype) {
  int64_t numel = 1;
  for (const int64_t s : sizes) numel *= s;
  const int64_t bytes = numel * static_cast<int64_t>(c10::elementSize(dtype));
  PoolSlot& entry = pool()[static_cast<int>(slot)];
  if (bytes > 0 && bytes <= kScratchPoolMaxBytes) lock_ = std::unique_lock<std::mutex>(entry.mutex, std::try_to_lock);
  if (!lock_.owns_lock()) {
    tensor_ = at::empty(sizes, at::TensorOptions().dtype(dtype));
    return;
  }
  if (!entry.block.defined() || entry.block.numel() < bytes) {
    entry.block = at::Tensor();  // free the old block before taking the larger one
    entry.block = at::empty({bytes}, at::TensorOptions().dtype(at::kByte));
  }
  tensor_ = entry.block.narrow(0, 0, bytes).view(dtype).view(sizes);
}

int64_t scratch_pool_bytes() {
  int64_t total = 0;
  for (PoolSlot& entry : pool()) {
    std::lock_guard<std::mutex> guard(entry.mutex);
    if (entry.block.defined()) total += entry.block.numel();
  }
  return total;
}

}  // namespace muon_ext::cpu

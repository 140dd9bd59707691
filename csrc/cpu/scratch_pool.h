#pragma once

// CPU scratch kept between calls (docs/design.md, "CPU kernels": scratch
// reuse). A fresh multi-megabyte at::empty is a new mapping whose first touch
// faults every 4 KiB page in; Polar-Express on one 1024x4096 FP32 matrix (48
// MiB of scratch) spent about a tenth of its time there at 2 threads.

#include <ATen/ATen.h>

#include <cstdint>
#include <mutex>

namespace muon_ext::cpu {

// The blocks a step may hold at once, one of each.
enum class ScratchSlot : int { kMuonWorkspace = 0, kPolarScratch = 1 };
constexpr int kScratchSlotCount = 2;

// A slot keeps at most this many bytes between calls; a larger request is a
// fresh allocation, freed with its lease (its page faults are then a smaller
// part of its GEMMs' time, which grows faster than its size).
constexpr int64_t kScratchPoolMaxBytes = int64_t(256) << 20;

// While alive, `tensor()` is a contiguous, 64-byte aligned tensor of the
// requested sizes and dtype, uninitialized (it holds an earlier call's
// values). It is the slot's block (grown if too small) unless another thread
// holds that slot or the request exceeds kScratchPoolMaxBytes: then it is a
// fresh allocation, so a call never waits for another.
class ScratchLease {
 public:
  ScratchLease(ScratchSlot slot, at::IntArrayRef sizes, at::ScalarType dtype);
  const at::Tensor& tensor() const { return tensor_; }

 private:
  std::unique_lock<std::mutex> lock_;
  at::Tensor tensor_;
};

// Bytes the pool holds now (all slots), for tests.
int64_t scratch_pool_bytes();

}  // namespace muon_ext::cpu

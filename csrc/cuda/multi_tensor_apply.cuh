// Generic multi-tensor launcher: one kernel launch processes many tensors.
//
// DEPTH parallel tensor lists (e.g. param, grad, exp_avg, exp_avg_sq) are cut
// into chunks of `chunk_size` elements; each block handles one chunk of one
// tensor.  Pointers, sizes and the block -> (slot, chunk) map travel in the
// kernel arguments, so nothing is copied to the device before a launch.  Which
// tensors and chunks go into which launch is decided by the CPU-tested planner
// in common/multi_tensor_plan.h.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/util/Exception.h>

#include <array>
#include <cstdint>
#include <limits>
#include <vector>

#include "../common/multi_tensor_plan.h"

namespace muon_ext {
namespace cuda {

// Elements per thread per iteration on the vector path: one 16-byte load of
// FP32, one 8-byte load of BF16/FP16.
constexpr int kILP = 4;
// Threads per block; every functor is written for (and launched with) this.
constexpr int kBlockSize = 512;

// CUDA's classic kernel-parameter limit is 4 KiB.  The metadata gets all of it
// but kFunctorArgBytes, which is left for the functor and the chunk size.
constexpr int kKernelArgBytes = 4096;
constexpr int kFunctorArgBytes = 256;
constexpr int kMaxBlocksPerLaunch = 320;

// Kernel-argument payload of one launch.  Per tensor slot: DEPTH chunked
// pointers, numel, and one unchunked "scalar" pointer (e.g. a step counter).
template <int DEPTH>
struct TensorListMetadata {
  static constexpr int kMaxBlocks = kMaxBlocksPerLaunch;
  static constexpr int kBytesPerBlock = int(sizeof(int32_t) + sizeof(uint8_t) + sizeof(bool));
  static constexpr int kBytesPerTensor = int(sizeof(void*)) * (DEPTH + 2);
  static constexpr int kMaxTensors = (kKernelArgBytes - kFunctorArgBytes - kMaxBlocks * kBytesPerBlock) / kBytesPerTensor;

  void* addresses[DEPTH][kMaxTensors];
  int64_t numel[kMaxTensors];
  void* scalars[kMaxTensors];
  // Per block: its slot, its chunk within that tensor, and whether all of its
  // pointers allow kILP-wide loads over the whole chunk.
  int32_t block_chunk[kMaxBlocks];
  uint8_t block_slot[kMaxBlocks];
  bool block_vectorized[kMaxBlocks];
};

// What one block works on, resolved from the metadata by the kernel so that
// functors never index kernel parameters themselves.
template <int DEPTH>
struct ChunkTask {
  void* addresses[DEPTH];
  void* scalar;
  int64_t begin;  // element range [begin, end) of the tensor
  int64_t end;
  bool vectorized;  // begin, end and every address are kILP-element aligned
};

template <int DEPTH, typename Functor>
__global__ void __launch_bounds__(kBlockSize)
    multi_tensor_apply_kernel(const TensorListMetadata<DEPTH> meta, int64_t chunk_size, Functor functor) {
  const int slot = meta.block_slot[blockIdx.x];
  ChunkTask<DEPTH> task;
#pragma unroll
  for (int d = 0; d < DEPTH; ++d) task.addresses[d] = meta.addresses[d][slot];
  task.scalar = meta.scalars[slot];
  // 64-bit offsets: a tensor may hold more than 2^31 elements.
  task.begin = int64_t(meta.block_chunk[blockIdx.x]) * chunk_size;
  task.end = min(task.begin + chunk_size, meta.numel[slot]);
  task.vectorized = meta.block_vectorized[blockIdx.x];
  functor(task);
}

inline bool is_vector_aligned(const at::Tensor& tensor) {
  return reinterpret_cast<uintptr_t>(tensor.data_ptr()) % (kILP * tensor.element_size()) == 0;
}

// Calls `functor(const ChunkTask<DEPTH>&)` in every block, over every chunk of
// every non-empty tensor.  tensor_lists[d][i] is the d-th operand of tensor i
// (all operands of a tensor have the same numel); `scalars`, when not null,
// holds one tensor per i whose address reaches the functor unchunked.
// Launches on the current stream of the current device; launches nothing when
// every tensor is empty.
template <int DEPTH, typename Functor>
void multi_tensor_apply(const std::array<const std::vector<at::Tensor>*, DEPTH>& tensor_lists,
                        const std::vector<at::Tensor>* scalars, int64_t chunk_size, const Functor& functor) {
  using Metadata = TensorListMetadata<DEPTH>;
  static_assert(Metadata::kMaxTensors >= 1 && Metadata::kMaxTensors <= 256, "slot must fit in uint8_t");
  static_assert(sizeof(Metadata) <= kKernelArgBytes - kFunctorArgBytes, "metadata exceeds its share of 4 KiB");
  static_assert(sizeof(Metadata) + sizeof(int64_t) + sizeof(Functor) <= kKernelArgBytes,
                "kernel arguments exceed CUDA's 4 KiB parameter limit");
  TORCH_CHECK(chunk_size > 0 && chunk_size % kILP == 0, "multi_tensor_apply: chunk_size must be a positive multiple of ",
              kILP);

  const size_t count = tensor_lists[0]->size();
  for (const std::vector<at::Tensor>* list : tensor_lists) {
    TORCH_CHECK(list->size() == count, "multi_tensor_apply: tensor lists differ in length");
  }
  TORCH_CHECK(scalars == nullptr || scalars->size() == count, "multi_tensor_apply: scalar list differs in length");

  std::vector<int64_t> numels;
  numels.reserve(count);
  for (const at::Tensor& tensor : *tensor_lists[0]) {
    TORCH_CHECK(ceil_div(tensor.numel(), chunk_size) <= std::numeric_limits<int32_t>::max(),
                "multi_tensor_apply: too many chunks in one tensor");
    numels.push_back(tensor.numel());
  }
  const std::vector<MultiTensorLaunch> launches =
      plan_multi_tensor_launches(numels, chunk_size, Metadata::kMaxTensors, Metadata::kMaxBlocks);
  if (launches.empty()) return;

  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  for (const MultiTensorLaunch& launch : launches) {
    Metadata meta{};
    std::array<bool, Metadata::kMaxTensors> slot_aligned{};
    for (size_t slot = 0; slot < launch.tensors.size(); ++slot) {
      const int tensor = launch.tensors[slot];
      bool aligned = true;
      for (int d = 0; d < DEPTH; ++d) {
        const at::Tensor& operand = (*tensor_lists[d])[tensor];
        meta.addresses[d][slot] = operand.data_ptr();
        aligned = aligned && is_vector_aligned(operand);
      }
      meta.numel[slot] = numels[tensor];
      meta.scalars[slot] = scalars != nullptr ? (*scalars)[tensor].data_ptr() : nullptr;
      slot_aligned[slot] = aligned;
    }
    for (size_t b = 0; b < launch.blocks.size(); ++b) {
      const MultiTensorBlock& block = launch.blocks[b];
      int64_t begin, end;
      chunk_range(meta.numel[block.slot], chunk_size, block.chunk, &begin, &end);
      meta.block_chunk[b] = static_cast<int32_t>(block.chunk);
      meta.block_slot[b] = static_cast<uint8_t>(block.slot);
      // begin is a multiple of kILP (chunk_size is); only a ragged last chunk
      // falls back to the scalar path.
      meta.block_vectorized[b] = slot_aligned[block.slot] && (end - begin) % kILP == 0;
    }
    multi_tensor_apply_kernel<DEPTH, Functor>
        <<<static_cast<unsigned>(launch.blocks.size()), kBlockSize, 0, stream>>>(meta, chunk_size, functor);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
}

}  // namespace cuda
}  // namespace muon_ext

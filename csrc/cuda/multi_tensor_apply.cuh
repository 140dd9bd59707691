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

#include <algorithm>
#include <array>
#include <cerrno>
#include <cstdlib>
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

// Kernel-parameter space.  CUDA 12.1 raised the limit from 4 KiB to 32764
// bytes for compute capability 7.0 and up (driver 530 and up; the CUDA 13
// toolkit builds nothing older and needs a newer driver).  A launch of this
// launcher moves one 64K-element chunk per block, and the block map lives in
// the parameters: at 4 KiB a launch held 320 blocks (about 21M elements), so a
// large model's AdamW step was a train of launches, each ending with a partly
// idle GPU.  At 32 KiB a launch holds 2560 blocks, several waves of a 132-SM
// GPU.  The metadata gets all of the space but kFunctorArgBytes, which is left
// for the functor and the chunk size.
#if defined(CUDART_VERSION) && CUDART_VERSION >= 12010
constexpr int kKernelArgBytes = 32764;
constexpr int kMaxBlocksPerLaunch = 2560;
#else
constexpr int kKernelArgBytes = 4096;
constexpr int kMaxBlocksPerLaunch = 320;
#endif
constexpr int kFunctorArgBytes = 256;
// A block names its tensor slot in one byte.
constexpr int kMaxTensorsPerLaunch = 256;

// Raises unless the current device takes kKernelArgBytes of kernel parameters,
// instead of a launch failing inside the driver with a less helpful error.
inline void check_kernel_arg_capacity() {
  if constexpr (kKernelArgBytes > 4096) {
    static const int driver_version = [] {
      int version = 0;
      C10_CUDA_CHECK(cudaDriverGetVersion(&version));
      return version;
    }();
    const cudaDeviceProp* device = at::cuda::getCurrentDeviceProperties();  // cached by ATen
    TORCH_CHECK(driver_version >= 12010 && device->major >= 7,
                "muon_ext: its CUDA kernels were built with CUDA >= 12.1 and pass up to ", kKernelArgBytes,
                " bytes of kernel parameters, which needs a CUDA driver >= 12.1 (found ", driver_version / 1000, ".",
                driver_version % 1000 / 10, ") and compute capability >= 7.0 (found ", device->major, ".",
                device->minor, ")");
  }
}

// Blocks per launch of multi_tensor_apply: kMaxBlocksPerLaunch, or the value of
// MUON_EXT_CUDA_BLOCKS_PER_LAUNCH (1..kMaxBlocksPerLaunch; anything else
// raises), read at every call so that a benchmark can compare launch sizes in
// one process (bench/adamw.py).  Bits do not depend on it: a block's work is
// its chunk alone.
inline int blocks_per_launch() {
  const char* text = std::getenv("MUON_EXT_CUDA_BLOCKS_PER_LAUNCH");
  if (text == nullptr || *text == '\0') return kMaxBlocksPerLaunch;
  char* end = nullptr;
  errno = 0;
  const long value = std::strtol(text, &end, 10);
  TORCH_CHECK(errno == 0 && *end == '\0' && value >= 1 && value <= kMaxBlocksPerLaunch,
              "MUON_EXT_CUDA_BLOCKS_PER_LAUNCH must be an integer from 1 to ", kMaxBlocksPerLaunch, ", got '", text,
              "'");
  return static_cast<int>(value);
}

// Kernel-argument payload of one launch.  Per tensor slot: DEPTH chunked
// pointers, numel, and one unchunked "scalar" pointer (e.g. a step counter).
template <int DEPTH>
struct TensorListMetadata {
  static constexpr int kMaxBlocks = kMaxBlocksPerLaunch;
  static constexpr int kBytesPerBlock = int(sizeof(int32_t) + sizeof(uint8_t) + sizeof(bool));
  static constexpr int kBytesPerTensor = int(sizeof(void*)) * (DEPTH + 2);
  static constexpr int kMaxTensors = std::min(
      kMaxTensorsPerLaunch, (kKernelArgBytes - kFunctorArgBytes - kMaxBlocks * kBytesPerBlock) / kBytesPerTensor);

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

// The block's chunk of the metadata, handed to the functor.
template <int DEPTH, typename Functor>
__device__ __forceinline__ void run_chunk(const TensorListMetadata<DEPTH>& meta, int64_t chunk_size,
                                          const Functor& functor) {
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

template <int DEPTH, typename Functor>
__global__ void __launch_bounds__(kBlockSize)
    multi_tensor_apply_kernel(const TensorListMetadata<DEPTH> meta, int64_t chunk_size, Functor functor) {
  run_chunk(meta, chunk_size, functor);
}

// The same for a functor that declares kMinBlocksPerSm (AdamWFunctor): ptxas
// keeps registers for that many blocks per SM. A separate kernel because an
// explicit minimum of 1 is not the same to ptxas as none (a Muon functor went
// from 32 to 37 registers).
template <int DEPTH, typename Functor, int kMinBlocks>
__global__ void __launch_bounds__(kBlockSize, kMinBlocks)
    multi_tensor_apply_capped_kernel(const TensorListMetadata<DEPTH> meta, int64_t chunk_size, Functor functor) {
  run_chunk(meta, chunk_size, functor);
}

inline bool is_vector_aligned(const at::Tensor& tensor) {
  return reinterpret_cast<uintptr_t>(tensor.data_ptr()) % (kILP * tensor.element_size()) == 0;
}

// Calls `functor(const ChunkTask<DEPTH>&)` in every block, over every chunk of
// every non-empty tensor, at most `max_blocks` blocks (blocks_per_launch(),
// which callers read before they change anything) per launch.
// tensor_lists[d][i] is the d-th operand of tensor i (all operands of a tensor
// have the same numel); `scalars`, when not null, holds one tensor per i whose
// address reaches the functor unchunked.  Launches on the current stream of
// the current device; launches nothing when every tensor is empty.
template <int DEPTH, typename Functor>
void multi_tensor_apply(const std::array<const std::vector<at::Tensor>*, DEPTH>& tensor_lists,
                        const std::vector<at::Tensor>* scalars, int64_t chunk_size, int max_blocks,
                        const Functor& functor) {
  using Metadata = TensorListMetadata<DEPTH>;
  static_assert(Metadata::kMaxTensors >= 1 && Metadata::kMaxTensors <= 256, "slot must fit in uint8_t");
  static_assert(sizeof(Metadata) <= kKernelArgBytes - kFunctorArgBytes, "metadata exceeds its share of the parameters");
  static_assert(sizeof(Metadata) + sizeof(int64_t) + sizeof(Functor) <= kKernelArgBytes,
                "kernel arguments exceed CUDA's parameter limit");
  TORCH_CHECK(max_blocks >= 1 && max_blocks <= Metadata::kMaxBlocks, "multi_tensor_apply: max_blocks out of range");
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
      plan_multi_tensor_launches(numels, chunk_size, Metadata::kMaxTensors, max_blocks);
  if (launches.empty()) return;
  check_kernel_arg_capacity();

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
    const unsigned grid = static_cast<unsigned>(launch.blocks.size());
    if constexpr (requires { Functor::kMinBlocksPerSm; }) {
      multi_tensor_apply_capped_kernel<DEPTH, Functor, Functor::kMinBlocksPerSm>
          <<<grid, kBlockSize, 0, stream>>>(meta, chunk_size, functor);
    } else {
      multi_tensor_apply_kernel<DEPTH, Functor><<<grid, kBlockSize, 0, stream>>>(meta, chunk_size, functor);
    }
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
}

}  // namespace cuda
}  // namespace muon_ext

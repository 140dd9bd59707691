// CUDA multi-tensor AdamW.
//
// The GPU twin of cpu/adamw_cpu_kernel.cpp: the same adamw_element<float>,
// the same BF16/FP16 conversions (common/bits.h) and the same remainder split
// (common/remainder.h), compiled with --fmad=false, so both backends produce
// the same bits.  A step is two launches on the current stream: one bumps the
// step counters, then the element kernel reads them for bias correction.  A
// set found-inf flag makes both do nothing, without a host synchronization.
#include "adamw_cuda.h"

#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <type_traits>

#include "../common/bits.h"
#include "../common/remainder.h"
#include "multi_tensor_apply.cuh"
#include "settings.h"
#include "storage.cuh"

namespace muon_ext {
namespace cuda {
namespace {

// 64K elements per block: 32 iterations of 512 threads x kILP, which amortizes
// the per-block coefficient setup and keeps a launch (320 blocks) at about
// 21M elements; 512 threads give each SM enough loads in flight to stream at
// memory bandwidth.  The same sizes as PyTorch's fused Adam.
constexpr int64_t kChunkSize = 65536;

// W consecutive elements moved with one load / store instruction.
template <typename T, int W>
struct alignas(sizeof(T) * W) Pack {
  T val[W];
};

template <int W, typename T>
__device__ __forceinline__ Pack<T, W> load_pack(const T* base, int64_t i) {
  return *reinterpret_cast<const Pack<T, W>*>(base + i);
}

template <int W, typename T>
__device__ __forceinline__ void store_pack(T* base, int64_t i, const Pack<T, W>& pack) {
  *reinterpret_cast<Pack<T, W>*>(base + i) = pack;
}

// Operand order in the tensor lists: param, grad, exp_avg, exp_avg_sq[, master].
template <typename P, typename G, MasterMode M>
struct AdamWFunctor {
  static constexpr int kDepth = M == MasterMode::kNone ? 4 : 5;
  // Registers for three 512-thread blocks per SM (at most 40 per thread).
  // Without the cap, ptxas (CUDA 13, sm_90) gave several instances (16-bit
  // params with int16 remainders or FP32 masters, FP16 params with FP16 grads)
  // 41-60 registers: two blocks per SM, half the threads, in a memory-bound
  // kernel. With it every instance takes 39-40, the FP32-master ones with
  // 16-bit params spilling 4 bytes. Register use changes no bits.
  static constexpr int kMinBlocksPerSm = 3;
  using param_t = typename P::storage;
  using grad_t = typename G::storage;
  // The master operand: FP32 master tensor or int16 remainder (unused for kNone).
  using master_t = master_storage_t<M>;

  AdamWHyper hyper;
  float lr;                    // used when lr_ptr is null
  const float* lr_ptr;         // device learning rate (capturable), or null
  const float* inv_scale_ptr;  // grad unscale factor, or null for 1
  const float* found_inf_ptr;  // skip flag, or null

  __device__ __forceinline__ void operator()(const ChunkTask<kDepth>& task) const {
    if (found_inf_ptr != nullptr && *found_inf_ptr != 0.0f) return;

    // The double-precision bias corrections in make_adamw_coeffs run once per block, not
    // once per thread.
    __shared__ AdamWCoeffs<float> shared_coeffs;
    if (threadIdx.x == 0) {
      const float step = *static_cast<const float*>(task.scalar);
      shared_coeffs = make_adamw_coeffs(hyper, lr_ptr != nullptr ? *lr_ptr : lr, step,
                                        inv_scale_ptr != nullptr ? *inv_scale_ptr : 1.0f);
    }
    __syncthreads();
    const AdamWCoeffs<float> coeffs = shared_coeffs;

    if (task.vectorized) {
      update<kILP>(task, coeffs);
    } else {
      update<1>(task, coeffs);
    }
  }

  template <int W>
  __device__ __forceinline__ void update(const ChunkTask<kDepth>& task, const AdamWCoeffs<float>& coeffs) const {
    param_t* param = static_cast<param_t*>(task.addresses[0]);
    const grad_t* grad = static_cast<const grad_t*>(task.addresses[1]);
    float* exp_avg = static_cast<float*>(task.addresses[2]);
    float* exp_avg_sq = static_cast<float*>(task.addresses[3]);
    master_t* master = kDepth > 4 ? static_cast<master_t*>(task.addresses[kDepth - 1]) : nullptr;

    const int64_t stride = int64_t(blockDim.x) * W;
    for (int64_t i = task.begin + int64_t(threadIdx.x) * W; i < task.end; i += stride) {
      // Issue every load before any math.
      Pack<param_t, W> param_pack = load_pack<W>(param, i);
      const Pack<grad_t, W> grad_pack = load_pack<W>(grad, i);
      Pack<float, W> m = load_pack<W>(exp_avg, i);
      Pack<float, W> v = load_pack<W>(exp_avg_sq, i);
      Pack<master_t, W> master_pack;
      if constexpr (M != MasterMode::kNone) master_pack = load_pack<W>(master, i);

#pragma unroll
      for (int j = 0; j < W; ++j) {
        // The FP32 master, exactly as the CPU kernel forms it.
        float p = load_master<P, M>(param_pack.val[j], master_pack.val[j]);

        adamw_element<float>(p, m.val[j], v.val[j], G::load(grad_pack.val[j]), coeffs);

        store_master<P, M>(p, param_pack.val[j], master_pack.val[j]);
      }

      store_pack<W>(param, i, param_pack);
      store_pack<W>(exp_avg, i, m);
      store_pack<W>(exp_avg_sq, i, v);
      if constexpr (M != MasterMode::kNone) store_pack<W>(master, i, master_pack);
    }
  }
};

// Step counters: one thread per counter, pointers in the kernel arguments.
constexpr int kMaxStepsPerLaunch = 504;

struct StepList {
  float* steps[kMaxStepsPerLaunch];
  int count;
};
static_assert(sizeof(StepList) + sizeof(const float*) <= kKernelArgBytes,
              "step kernel arguments exceed CUDA's parameter limit");
static_assert(kMaxStepsPerLaunch <= 1024, "one block of one thread per step");

__global__ void increment_steps_kernel(const StepList list, const float* found_inf_ptr) {
  if (found_inf_ptr != nullptr && *found_inf_ptr != 0.0f) return;
  const int i = threadIdx.x;
  if (i < list.count) *list.steps[i] += 1.0f;
}

void increment_steps(const std::vector<at::Tensor>& steps, const float* found_inf_ptr, cudaStream_t stream) {
  for (size_t first = 0; first < steps.size(); first += kMaxStepsPerLaunch) {
    StepList list;
    list.count = static_cast<int>(std::min<size_t>(kMaxStepsPerLaunch, steps.size() - first));
    for (int i = 0; i < list.count; ++i) list.steps[i] = steps[first + i].mutable_data_ptr<float>();
    increment_steps_kernel<<<1, list.count, 0, stream>>>(list, found_inf_ptr);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
}

// Steps first, then the element kernel that reads them, on the same stream.
template <typename P, typename G, MasterMode M>
void launch_adamw(const std::vector<at::Tensor>& params, const std::vector<at::Tensor>& grads,
                  const std::vector<at::Tensor>& exp_avgs, const std::vector<at::Tensor>& exp_avg_sqs,
                  const std::vector<at::Tensor>& masters, const std::vector<at::Tensor>& steps,
                  const AdamWFunctor<P, G, M>& functor) {
  // What can refuse the element launches is checked before the counters move.
  const int max_blocks = read_cuda_settings().blocks_per_launch;
  check_kernel_arg_capacity();
  // Every param's counter advances, empty params included, as on the CPU.
  increment_steps(steps, functor.found_inf_ptr, at::cuda::getCurrentCUDAStream());
  if constexpr (M == MasterMode::kNone) {
    multi_tensor_apply<4>({&params, &grads, &exp_avgs, &exp_avg_sqs}, &steps, kChunkSize, max_blocks, functor);
  } else {
    multi_tensor_apply<5>({&params, &grads, &exp_avgs, &exp_avg_sqs, &masters}, &steps, kChunkSize, max_blocks,
                          functor);
  }
}

}  // namespace

void adamw_step(const std::vector<at::Tensor>& params, const std::vector<at::Tensor>& grads,
                const std::vector<at::Tensor>& exp_avgs, const std::vector<at::Tensor>& exp_avg_sqs,
                const std::vector<at::Tensor>& masters, const std::vector<at::Tensor>& steps,
                MasterMode master_mode, const AdamWHyper& hyper, double lr,
                const c10::optional<at::Tensor>& lr_tensor, const c10::optional<at::Tensor>& inv_scale,
                const c10::optional<at::Tensor>& found_inf) {
  if (params.empty()) return;
  // Checked before anything is enqueued, so a bad call leaves no step counted.
  const size_t count = params.size();
  TORCH_CHECK(grads.size() == count && exp_avgs.size() == count && exp_avg_sqs.size() == count &&
                  steps.size() == count && (master_mode == MasterMode::kNone || masters.size() == count),
              "adamw_step: every tensor list needs one entry per param");
  const c10::cuda::CUDAGuard device_guard(params.front().device());
  const float* found_inf_ptr = found_inf.has_value() ? found_inf->const_data_ptr<float>() : nullptr;

  dispatch_param(params.front().scalar_type(), master_mode, [&](auto param_format, auto master_constant) {
    using P = decltype(param_format);
    constexpr MasterMode M = decltype(master_constant)::value;
    dispatch_storage(grads.front().scalar_type(), "grad", [&](auto grad_format) {
      using G = decltype(grad_format);
      const AdamWFunctor<P, G, M> functor{hyper,
                                          static_cast<float>(lr),
                                          lr_tensor.has_value() ? lr_tensor->const_data_ptr<float>() : nullptr,
                                          inv_scale.has_value() ? inv_scale->const_data_ptr<float>() : nullptr,
                                          found_inf_ptr};
      launch_adamw<P, G, M>(params, grads, exp_avgs, exp_avg_sqs, masters, steps, functor);
    });
  });
}

}  // namespace cuda
}  // namespace muon_ext

// How the Muon elementwise kernels reach their operands: the storage formats
// of params, grads and masters, packed loads and stores, per-matrix pointer
// lists in the kernel arguments, and positions within a matrix.
//
// A Muon bucket is a list of params, each holding one or more same-shape
// matrices.  Elementwise passes address matrix j of a chunk through pointers
// carried in the kernel arguments (nothing is copied to the device before a
// launch); the contiguous workspaces are indexed by j directly.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "../common/adamw_math.h"
#include "../common/bits.h"
#include "../common/remainder.h"
#include "multi_tensor_apply.cuh"
#include "storage.cuh"

namespace muon_ext {
namespace cuda {

// kILP consecutive elements.  Each thread always owns the same elements, whether
// they move with one vector instruction or one by one (misaligned operands, or
// the ragged end of a matrix), so per-thread sums never depend on alignment.
template <typename T>
struct alignas(sizeof(T) * kILP) Pack {
  T val[kILP];
};

template <typename T>
__device__ __forceinline__ Pack<T> load_pack(const T* base, int64_t i, int count, bool vectorized) {
  if (vectorized) return *reinterpret_cast<const Pack<T>*>(base + i);
  Pack<T> pack{};
#pragma unroll
  for (int j = 0; j < kILP; ++j) {
    if (j < count) pack.val[j] = base[i + j];
  }
  return pack;
}

template <typename T>
__device__ __forceinline__ void store_pack(T* base, int64_t i, int count, bool vectorized, const Pack<T>& pack) {
  if (vectorized) {
    *reinterpret_cast<Pack<T>*>(base + i) = pack;
    return;
  }
#pragma unroll
  for (int j = 0; j < kILP; ++j) {
    if (j < count) base[i + j] = pack.val[j];
  }
}

// Matrix `index` (leading-dim position) of bucket tensor `tensor`.
struct MatrixRef {
  int tensor;
  int64_t index;
};

inline std::vector<MatrixRef> list_matrices(const std::vector<at::Tensor>& params, int64_t matrix_numel) {
  std::vector<MatrixRef> matrices;
  for (size_t t = 0; t < params.size(); ++t) {
    for (int64_t e = 0; e < params[t].numel() / matrix_numel; ++e) matrices.push_back({int(t), e});
  }
  return matrices;
}

// Kernel-argument payload: DEPTH operand pointers for each of up to kCapacity
// matrices, which are matrices first, first + 1, ... of the chunk.
template <int DEPTH>
struct MatrixList {
  static constexpr int kCapacity = (kKernelArgBytes - kFunctorArgBytes) / int(DEPTH * sizeof(void*));
  void* addresses[DEPTH][kCapacity];
  int64_t first;
  bool vectorized;  // every address allows kILP-wide accesses over whole matrices
};

// Calls launch(list, count) for consecutive groups of the chunk's matrices
// [begin, end).  Operand d of matrix (t, e) starts at element e * stride of
// (*operands[d])[t]; vectorized also requires stride % kILP == 0.
template <int DEPTH, typename Launch>
void for_each_matrix_group(const std::vector<MatrixRef>& matrices, int64_t begin, int64_t end,
                           const std::array<const std::vector<at::Tensor>*, DEPTH>& operands, int64_t stride,
                           Launch&& launch) {
  using List = MatrixList<DEPTH>;
  if (begin < end) check_kernel_arg_capacity();
  for (int64_t first = begin; first < end; first += List::kCapacity) {
    const int count = int(std::min<int64_t>(List::kCapacity, end - first));
    List list{};
    list.first = first - begin;
    list.vectorized = stride % kILP == 0;
    for (int m = 0; m < count; ++m) {
      const MatrixRef& matrix = matrices[first + m];
      for (int d = 0; d < DEPTH; ++d) {
        const at::Tensor& tensor = (*operands[d])[matrix.tensor];
        char* address = static_cast<char*>(tensor.data_ptr()) + matrix.index * stride * tensor.element_size();
        list.addresses[d][m] = address;
        list.vectorized = list.vectorized && reinterpret_cast<uintptr_t>(address) % (kILP * tensor.element_size()) == 0;
      }
    }
    launch(list, count);
  }
}

// (row, col) of an element of a row-major matrix with `cols` columns, moved
// forward by rows_step * cols + cols_step elements (cols_step <= cols)
// without a division.
struct MatrixCursor {
  int64_t row, col;

  MUON_HD void advance(int64_t rows_step, int64_t cols_step, int64_t cols) {
    row += rows_step;
    col += cols_step;
    if (col >= cols) {
      col -= cols;
      ++row;
    }
  }
};

}  // namespace cuda
}  // namespace muon_ext

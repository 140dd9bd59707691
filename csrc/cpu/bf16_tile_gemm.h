// BF16 GEMMs on oneDNN's batch-reduce micro-kernel (AMX tiles or AVX-512 BF16), for the CPU
// Polar-Express (docs/design.md, "CPU kernels", native BF16 GEMM).
//
// at::addmm_out on BF16 pays a fixed cost per call and a separate pass for its
// beta term: at GPT sizes (sides of 256) it ran at half the rate of one
// batched call. Here each GEMM packs its right operand once, multiplies tiles
// of 64 columns into an FP32 accumulator and writes alpha * acc + beta * addend
// rounded to BF16 straight from it: the rounding contract of the BF16 path
// (FP32 accumulation, one rounding per output), no call overhead, and
// symmetric outputs computed on and above the diagonal only.
#pragma once

#include <cstdint>

namespace muon_ext {
namespace cpu {

// MUON_EXT_CPU_TILE_GEMM: unset, "" or "1" (the default: on) or "0" (off);
// anything else raises. Callers check it before they write anything.
bool bf16_tile_gemm_enabled();

// The micro-kernel's instruction set where this CPU runs it and the setting
// and torch's oneDNN switch allow it: "amx" (AMX-BF16) or "avx512_bf16"
// (AVX-512 BF16 without AMX: Zen 4, Cooper Lake); else "". The two sum in
// different orders, so they give different bits (as at::addmm does).
const char* bf16_tile_gemm_isa();

// bf16_tile_gemm_isa() is not "": bf16_tile_gemm may be used (for sides that
// are multiples of 16, the kernel's columns, and k even).
bool bf16_tile_gemm_available();

// BF16 values as bit patterns (uint16_t), row-major with leading dimensions.
struct Bf16Matrix {
  const uint16_t* data;
  int64_t ld;
  bool transposed;  // element (i, j) at data[j * ld + i]
};

// out[i, j] = bf16(alpha * sum_k lhs[i, k] rhs[k, j] + beta * addend[i, j])
// for an [m, k] lhs (row-major) and a [k, n] rhs (either layout); beta == 0
// reads no addend (it may be null); addend may be out itself. With
// `symmetric` (m == n and the product symmetric) tiles wholly below the
// diagonal are skipped and the strict lower triangle copied from the upper.
// The bits depend on the shapes only: every output is one FP32 sum over k
// in the kernel's order, whatever the thread, address or tile. With
// `spread_over_threads` (called outside a parallel region) the tiles are
// shared among the intra-op threads: one GEMM no longer waits on one core.
void bf16_tile_gemm(int64_t m, int64_t n, int64_t k, float alpha, const uint16_t* lhs, int64_t ld_lhs,
                    Bf16Matrix rhs, float beta, const uint16_t* addend, int64_t ld_addend, uint16_t* out,
                    int64_t ld_out, bool symmetric, bool spread_over_threads = false);

// The [cols, rows] transpose of an FP32 [rows, cols] matrix rounded to BF16
// (nearest even), and back (exact); rows and cols multiples of 16.
void transpose_to_bf16(const float* in, int64_t rows, int64_t cols, uint16_t* out);
void transpose_from_bf16(const uint16_t* in, int64_t rows, int64_t cols, float* out);

// Gives back the thread's AMX tile state (after its last bf16_tile_gemm of a task;
// nothing to give back on AVX-512 BF16).
void bf16_tile_gemm_release();

}  // namespace cpu
}  // namespace muon_ext

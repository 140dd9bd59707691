// Portability macros shared by host-only and CUDA translation units.
#pragma once

#if defined(__CUDACC__) || defined(__HIPCC__)
#define MUON_HD __host__ __device__ __forceinline__
#else
#define MUON_HD inline
#endif

// MUON_HD, and on the host always inlined too: for helpers that per-ISA files
// compile for several instruction sets, where an out-of-line copy (one name
// for all of them) could run AVX-512 code on a CPU without it.
#if defined(__CUDACC__) || defined(__HIPCC__)
#define MUON_HD_ALWAYS_INLINE MUON_HD
#else
#define MUON_HD_ALWAYS_INLINE inline __attribute__((always_inline))
#endif

// Portability macros shared by host-only and CUDA translation units.
#pragma once

#if defined(__CUDACC__) || defined(__HIPCC__)
#define MUON_HD __host__ __device__ __forceinline__
#else
#define MUON_HD inline
#endif

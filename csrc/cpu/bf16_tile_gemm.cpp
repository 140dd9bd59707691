// BF16 GEMMs on oneDNN's batch-reduce micro-kernel; see bf16_tile_gemm.h.
#include "bf16_tile_gemm.h"

#include <ATen/Context.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/Utils.h>
#include <ATen/native/CPUBlas.h>
#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cstring>
#include <exception>
#include <vector>

#include "../checks.h"
#include "../common/bits.h"
#include "balanced_runs.h"

#if defined(__x86_64__)
#include <immintrin.h>
#endif

// round_to_bf16 hands 16-lane vectors to bits.h's always-inlined rule inside
// this file's AVX-512 functions only: the vector ABI is never used.
#pragma GCC diagnostic ignored "-Wpsabi"

namespace muon_ext {
namespace cpu {

bool bf16_tile_gemm_enabled() {
  return checks::on_off_setting("MUON_EXT_CPU_TILE_GEMM");  // read per call: for A/B benchmarks and tests
}

#if defined(__x86_64__)
namespace {

// Hands the thread's AMX tile state back when a parallel share of tiles ends
// (nothing to hand back on AVX-512 BF16).
struct TileRelease {
  ~TileRelease() { bf16_tile_gemm_release(); }
};

// Columns per accumulator tile (the kernel's packed-operand block).
constexpr int64_t kTileCols = 64;
// Rows per accumulator tile; symmetric outputs take smaller tiles so more of
// the lower triangle is skipped (with 256 rows: 6 of 16 tiles, against 2 of 8).
constexpr int64_t kTileRows = 128;
constexpr int64_t kSymmetricTileRows = 64;
// Below this side the mirror costs more than the skipped tiles save: every
// tile is computed (the kernel's products and sums are symmetric in the two
// operands, so the lower triangle comes out equal to the upper anyway). Per
// instruction set, measured (docs/design.md, "CPU kernels"): AMX multiplies
// about three times faster than AVX-512 BF16, so there the mirror pays back
// later (from 512 rows on Sapphire Rapids); on AVX-512 BF16 (Zen 4) skipping
// paid from 128 rows: 1.23-1.25x faster on 4 x 256x256 at 1 and 2 threads, same bits.
constexpr int64_t kMinSkippedSideAmx = 512;
constexpr int64_t kMinSkippedSideAvx512Bf16 = 128;
// Columns of the packed right operand multiplied against every row tile in
// turn: at most this many elements, so the block stays in the core's L2.
constexpr int64_t kPackedChunkElements = int64_t(512) * 1024;

// r[i] := word i of each of the 16 vectors r[0..15], in order (a 16 x 16
// transpose of 32-bit words in registers).
__attribute__((target("avx512f"), always_inline)) inline void transpose_16x16(__m512i* r) {
  __m512i t[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {
    r[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
    r[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
    r[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
    r[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
  }
  for (int i = 0; i < 4; ++i) {
    t[i] = _mm512_shuffle_i32x4(r[i], r[i + 4], 0x88);
    t[i + 4] = _mm512_shuffle_i32x4(r[i], r[i + 4], 0xdd);
    t[i + 8] = _mm512_shuffle_i32x4(r[i + 8], r[i + 12], 0x88);
    t[i + 12] = _mm512_shuffle_i32x4(r[i + 8], r[i + 12], 0xdd);
  }
  for (int i = 0; i < 8; ++i) {
    r[i] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0x88);
    r[i + 8] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0xdd);
  }
}

// 16 FP32 values rounded to BF16, nearest even, NaN to 0x7FC0: the bits of
// float_to_bf16_bits_rne (bits.h) and of at::Tensor::to(kBFloat16).
__attribute__((target("avx512f,avx512bw"), always_inline)) inline __m256i round_to_bf16(__m512 v) {
  typedef uint32_t Bits __attribute__((vector_size(64)));  // bits.h's rule on 16 lanes at once
  __m512i r = (__m512i)(bf16_rne_high_bits((Bits)_mm512_castps_si512(v)) >> 16);
  r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_set1_epi32(0x7FC0));
  return _mm512_cvtepi32_epi16(r);
}

__attribute__((target("avx512f,avx512bw"))) void pack_transposed_block(const Bf16Matrix& rhs, int64_t k,
                                                                      int64_t col, int64_t w, uint16_t* dst) {
  // Transposed: element (r, c) at data[c * ld + r], so the pair (2p, 2p + 1)
  // of column c is the 32-bit word p of stored row c: a transpose of 32-bit
  // words, 16 x 16 at a time in registers.
  const int64_t pairs = k / 2;
  for (int64_t c0 = 0; c0 < w; c0 += 16) {
    int64_t p0 = 0;
    for (; p0 + 16 <= pairs; p0 += 16) {
      __m512i r[16];
      for (int i = 0; i < 16; ++i) r[i] = _mm512_loadu_si512(rhs.data + (col + c0 + i) * rhs.ld + 2 * p0);
      transpose_16x16(r);
      // r[j]: word p0 + j of the 16 rows, in row order.
      for (int j = 0; j < 16; ++j) _mm512_storeu_si512(dst + ((p0 + j) * w + c0) * 2, r[j]);
    }
    for (; p0 < pairs; ++p0) {
      for (int64_t c = 0; c < 16; ++c) {
        uint32_t v;
        std::memcpy(&v, rhs.data + (col + c0 + c) * rhs.ld + 2 * p0, sizeof(v));
        std::memcpy(dst + (p0 * w + c0 + c) * 2, &v, sizeof(v));
      }
    }
  }
}

// The kernel's layout of a [k, w] block of the right operand (w columns from
// `col`, w a multiple of 16): for each pair of rows (2p, 2p + 1), the w column
// pairs side by side, [k / 2][w][2] (at::native::cpublas::pack's layout;
// tests/python/test_polar_tiles.py checks the products). A chunk of columns
// is blocks of kTileCols (the last narrower) back to back, block c (its first
// column) at dst + c * k. Only CPUs with AVX-512 BF16 run this, and they all have AVX-512 BW.
__attribute__((target("avx512f,avx512bw"))) void pack_chunk(const Bf16Matrix& rhs, int64_t k, int64_t col,
                                                           int64_t chunk, uint16_t* dst) {
  if (!rhs.transposed) {
    // Interleave rows 2p and 2p + 1, 32 columns at a time, each row pair read
    // once across the whole chunk (in order: the prefetchers follow it).
    alignas(64) static const uint16_t kLow[32] = {0,  32, 1,  33, 2,  34, 3,  35, 4,  36, 5,  37, 6,  38, 7,  39,
                                                  8,  40, 9,  41, 10, 42, 11, 43, 12, 44, 13, 45, 14, 46, 15, 47};
    alignas(64) static const uint16_t kHigh[32] = {16, 48, 17, 49, 18, 50, 19, 51, 20, 52, 21, 53, 22, 54, 23, 55,
                                                   24, 56, 25, 57, 26, 58, 27, 59, 28, 60, 29, 61, 30, 62, 31, 63};
    const __m512i low = _mm512_load_si512(kLow), high = _mm512_load_si512(kHigh);
    for (int64_t p = 0; p < k / 2; ++p) {
      const uint16_t* row0 = rhs.data + (2 * p) * rhs.ld + col;
      const uint16_t* row1 = row0 + rhs.ld;
      for (int64_t b = 0; b < chunk; b += kTileCols) {
        const int64_t w = std::min(kTileCols, chunk - b);
        uint16_t* d = dst + b * k + p * w * 2;
        int64_t c = 0;
        for (; c + 32 <= w; c += 32) {
          const __m512i x0 = _mm512_loadu_si512(row0 + b + c), x1 = _mm512_loadu_si512(row1 + b + c);
          _mm512_storeu_si512(d + 2 * c, _mm512_permutex2var_epi16(x0, low, x1));
          _mm512_storeu_si512(d + 2 * c + 32, _mm512_permutex2var_epi16(x0, high, x1));
        }
        for (; c < w; ++c) {
          d[2 * c] = row0[b + c];
          d[2 * c + 1] = row1[b + c];
        }
      }
    }
    return;
  }
  for (int64_t b = 0; b < chunk; b += kTileCols) {
    pack_transposed_block(rhs, k, col + b, std::min(kTileCols, chunk - b), dst + b * k);
  }
}

// out rows of one tile: bf16(alpha * acc + beta * addend), FP32 multiplies
// and add (no fused multiply-add), one rounding per output by the CPU's own
// conversion (VCVTNE2PS2BF16, as oneDNN's epilogues: nearest even, denormals
// to zero like the kernel's sums themselves, NaN kept a NaN), 32 at a time.
template <bool kAddend>
__attribute__((target("avx512f,avx512bw,avx512bf16"))) inline __m512 tile_values(const float* acc,
                                                                                const uint16_t* addend,
                                                                                __m512 alpha_v, __m512 beta_v) {
  __m512 v = _mm512_mul_ps(alpha_v, _mm512_loadu_ps(acc));
  if constexpr (kAddend) {
    const __m256i s = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(addend));
    v = _mm512_add_ps(v, _mm512_mul_ps(beta_v, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(s), 16))));
  }
  return v;
}

template <bool kAddend>
__attribute__((target("avx512f,avx512bw,avx512bf16"))) void write_tile_rows(const float* acc, int64_t h, int64_t w,
                                                                            float alpha, float beta,
                                                                            const uint16_t* addend, int64_t ld_addend,
                                                                            uint16_t* out, int64_t ld_out) {
  const __m512 alpha_v = _mm512_set1_ps(alpha), beta_v = _mm512_set1_ps(beta);
  for (int64_t i = 0; i < h; ++i) {
    const float* a = acc + i * w;
    uint16_t* o = out + i * ld_out;
    // The addend of column j (none without one).
    auto s = [&](int64_t j) { return kAddend ? addend + i * ld_addend + j : nullptr; };
    int64_t j = 0;
    for (; j + 32 <= w; j += 32) {
      const __m512 low = tile_values<kAddend>(a + j, s(j), alpha_v, beta_v);
      const __m512 high = tile_values<kAddend>(a + j + 16, s(j + 16), alpha_v, beta_v);
      _mm512_storeu_si512(o + j, (__m512i)_mm512_cvtne2ps_pbh(high, low));
    }
    if (j < w) {  // w is a multiple of 16
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(o + j),
                          (__m256i)_mm512_cvtneps_pbh(tile_values<kAddend>(a + j, s(j), alpha_v, beta_v)));
    }
  }
}

void write_tile(const float* acc, int64_t h, int64_t w, float alpha, float beta, const uint16_t* addend,
                int64_t ld_addend, uint16_t* out, int64_t ld_out) {
  if (beta == 0.0f) return write_tile_rows<false>(acc, h, w, alpha, beta, nullptr, 0, out, ld_out);
  write_tile_rows<true>(acc, h, w, alpha, beta, addend, ld_addend, out, ld_out);
}

// At least n elements of `storage` starting on a 64-byte boundary.
template <typename T>
T* aligned_scratch(std::vector<T>& storage, int64_t n) {
  constexpr int64_t kSlack = 64 / sizeof(T);
  if (int64_t(storage.size()) < n + kSlack) storage.resize(n + kSlack);
  const uintptr_t address = reinterpret_cast<uintptr_t>(storage.data());
  return reinterpret_cast<T*>((address + 63) & ~uintptr_t(63));
}

// out(i, j) := out(j, i) for i > j in the row blocks [first, last) of 16
// rows (n a multiple of 16): 16 x 16 blocks transposed in registers, the
// diagonal blocks element by element. Row blocks write disjoint rows and read
// only the upper triangle, so any of them may run concurrently.
__attribute__((target("avx512f,avx512bw"))) void mirror_lower_rows(uint16_t* out, int64_t ld, int64_t first,
                                                                  int64_t last) {
  for (int64_t i0 = first * 16; i0 < last * 16; i0 += 16) {
    for (int64_t j0 = 0; j0 < i0; j0 += 16) {
      __m512i r[16];
      for (int i = 0; i < 16; ++i) {
        r[i] = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(out + (j0 + i) * ld + i0)));
      }
      transpose_16x16(r);
      for (int j = 0; j < 16; ++j) {
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + (i0 + j) * ld + j0), _mm512_cvtepi32_epi16(r[j]));
      }
    }
    for (int64_t i = i0 + 1; i < i0 + 16; ++i) {
      for (int64_t j = i0; j < i; ++j) out[i * ld + j] = out[j * ld + i];
    }
  }
}

// The micro-kernel's instruction set on this CPU, found once per process.
enum class TileIsa { kNone, kAmx, kAvx512Bf16 };

// Whether cpublas::brgemm multiplies BF16 pairs here: a torch without oneDNN's
// ukernel raises on the pair layout, so one small product, packed by
// pack_chunk as every GEMM is, is checked before any step relies on it. Its
// entries are small integers, exact in FP32 in any summation order, so the
// result must equal the double sum exactly. Called only where AVX-512 BF16
// (hence BW, which pack_chunk needs) is present.
bool micro_kernel_multiplies_correctly() {
  constexpr int64_t m = 16, n = 32, k = 32;
  std::vector<c10::BFloat16> lhs(m * k), rhs(k * n), packed(k * n);
  std::vector<float> acc(m * n);
  auto a = [](int64_t i, int64_t p) { return float((i + 2 * p) % 5 - 2); };
  auto b = [](int64_t p, int64_t j) { return float((3 * p + j) % 7 - 3); };
  for (int64_t i = 0; i < m; ++i) {
    for (int64_t p = 0; p < k; ++p) lhs[i * k + p] = c10::BFloat16(a(i, p));
  }
  for (int64_t p = 0; p < k; ++p) {
    for (int64_t j = 0; j < n; ++j) rhs[p * n + j] = c10::BFloat16(b(p, j));
  }
  pack_chunk(Bf16Matrix{reinterpret_cast<const uint16_t*>(rhs.data()), n, /*transposed=*/false}, k, 0, n,
             reinterpret_cast<uint16_t*>(packed.data()));
  try {
    at::native::cpublas::brgemm(m, n, k, k, n, n, /*add_C=*/false, lhs.data(), packed.data(), acc.data(),
                                /*is_vnni=*/true);
    at::native::cpublas::brgemm_release(/*is_vnni=*/true);
  } catch (const std::exception&) {
    return false;
  }
  for (int64_t i = 0; i < m; ++i) {
    for (int64_t j = 0; j < n; ++j) {
      double sum = 0;
      for (int64_t p = 0; p < k; ++p) sum += double(a(i, p)) * b(p, j);
      if (double(acc[i * n + j]) != sum) return false;
    }
  }
  return true;
}

TileIsa tile_isa() {
  // AVX-512 BF16 for the epilogue's conversion and the kernel's pairs; AMX-BF16
  // where cpublas packs for it (then the kernel multiplies on tiles).
  static const TileIsa isa = [] {
    const auto caps = at::cpu::get_cpu_capabilities();
    const auto it = caps.find("avx512_bf16");
    const bool avx512_bf16 = it != caps.end() && it->second.isBool() && it->second.toBool();
    if (!avx512_bf16 || !micro_kernel_multiplies_correctly()) return TileIsa::kNone;
    return at::native::cpublas::could_pack(at::kBFloat16) ? TileIsa::kAmx : TileIsa::kAvx512Bf16;
  }();
  return isa;
}

}  // namespace

const char* bf16_tile_gemm_isa() {
  if (!bf16_tile_gemm_enabled()) return "";
  // cpublas::brgemm takes its fallback (which refuses the pair layout) while
  // oneDNN is switched off (torch.backends.mkldnn.enabled = False).
  if (!at::globalContext().userEnabledMkldnn()) return "";
  switch (tile_isa()) {
    case TileIsa::kAmx:
      return "amx";
    case TileIsa::kAvx512Bf16:
      return "avx512_bf16";
    case TileIsa::kNone:
      break;
  }
  return "";
}

bool bf16_tile_gemm_available() { return bf16_tile_gemm_isa()[0] != '\0'; }

void bf16_tile_gemm(int64_t m, int64_t n, int64_t k, float alpha, const uint16_t* lhs, int64_t ld_lhs,
                    Bf16Matrix rhs, float beta, const uint16_t* addend, int64_t ld_addend, uint16_t* out,
                    int64_t ld_out, bool symmetric, bool spread_over_threads) {
  // The thread's packed operand and accumulator, kept between calls, on
  // 64-byte boundaries: from malloc's 16-byte ones every tile row the kernel
  // loads or stores could straddle two cache lines (runs of 4x768x256 took
  // 6.6 or 9.4 ms by the process's heap addresses).
  thread_local std::vector<uint16_t> packed_storage;
  thread_local std::vector<float> accumulator_storage;
  const int64_t min_skipped_side = tile_isa() == TileIsa::kAmx ? kMinSkippedSideAmx : kMinSkippedSideAvx512Bf16;
  symmetric = symmetric && m >= min_skipped_side;
  const int64_t tile_rows = symmetric ? kSymmetricTileRows : kTileRows;
  const int64_t chunk_cols =
      std::max<int64_t>(kTileCols, std::min(n, kPackedChunkElements / k) / kTileCols * kTileCols);
  uint16_t* const packed = aligned_scratch(packed_storage, chunk_cols * k);
  const auto* a = reinterpret_cast<const c10::BFloat16*>(lhs);
  const int64_t row_tiles = (m + tile_rows - 1) / tile_rows;
  std::vector<int64_t> tiles;  // the chunk's tiles not wholly below the diagonal, row tile by row tile
  for (int64_t n0 = 0; n0 < n; n0 += chunk_cols) {
    const int64_t chunk = std::min(chunk_cols, n - n0);
    const int64_t col_tiles = (chunk + kTileCols - 1) / kTileCols;
    tiles.clear();
    for (int64_t t = 0; t < row_tiles * col_tiles; ++t) {
      const int64_t m0 = (t / col_tiles) * tile_rows, col = n0 + (t % col_tiles) * kTileCols;
      if (!symmetric || col + std::min(kTileCols, n0 + chunk - col) > m0) tiles.push_back(t);  // else mirrored below
    }
    // Tiles [first, last) of the list: the same calls on whichever thread, so the same bits.
    auto run_tiles = [&](int64_t first, int64_t last) {
      float* const acc = aligned_scratch(accumulator_storage, tile_rows * kTileCols);
      for (int64_t i = first; i < last; ++i) {
        const int64_t t = tiles[i];
        const int64_t m0 = (t / col_tiles) * tile_rows, c = (t % col_tiles) * kTileCols;
        const int64_t h = std::min(tile_rows, m - m0), col = n0 + c, w = std::min(kTileCols, chunk - c);
        at::native::cpublas::brgemm(h, w, k, ld_lhs, w, w, /*add_C=*/false, a + m0 * ld_lhs,
                                    reinterpret_cast<const c10::BFloat16*>(packed + c * k), acc,
                                    /*is_vnni=*/true);
        write_tile(acc, h, w, alpha, beta, beta == 0.0f ? nullptr : addend + m0 * ld_addend + col, ld_addend,
                   out + m0 * ld_out + col, ld_out);
      }
    };
    const int64_t listed = static_cast<int64_t>(tiles.size());
    if (spread_over_threads) {
      // The threads pack the chunk's column blocks (each block's layout does
      // not depend on the others), then share its tiles, equal counts each.
      at::parallel_for(0, col_tiles, 1, [&](int64_t first, int64_t last) {
        for (int64_t b = first; b < last; ++b) {
          const int64_t c = b * kTileCols;
          pack_chunk(rhs, k, n0 + c, std::min(kTileCols, chunk - c), packed + c * k);
        }
      });
      for_each_run_balanced(
          listed, [] { return TileRelease{}; }, [&](int64_t tile, TileRelease&) { run_tiles(tile, tile + 1); });
    } else {
      pack_chunk(rhs, k, n0, chunk, packed);
      run_tiles(0, listed);
    }
  }
  if (!symmetric) return;
  const int64_t row_blocks = m / 16;
  if (!spread_over_threads) return mirror_lower_rows(out, ld_out, 0, row_blocks);
  // Row block i has i blocks to transpose: taken in the order 0, last, 1,
  // last - 1, ..., so each thread's contiguous share holds about equal work.
  at::parallel_for(0, row_blocks, 1, [&](int64_t first, int64_t last) {
    for (int64_t i = first; i < last; ++i) {
      const int64_t block = i % 2 == 0 ? i / 2 : row_blocks - 1 - i / 2;
      mirror_lower_rows(out, ld_out, block, block + 1);
    }
  });
}

__attribute__((target("avx512f,avx512bw"))) void transpose_to_bf16(const float* in, int64_t rows, int64_t cols,
                                                                  uint16_t* out) {
  for (int64_t r0 = 0; r0 < rows; r0 += 16) {
    for (int64_t c0 = 0; c0 < cols; c0 += 16) {
      __m512i r[16];
      for (int i = 0; i < 16; ++i) r[i] = _mm512_loadu_si512(in + (r0 + i) * cols + c0);
      transpose_16x16(r);
      for (int j = 0; j < 16; ++j) {
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + (c0 + j) * rows + r0),
                            round_to_bf16(_mm512_castsi512_ps(r[j])));
      }
    }
  }
}

__attribute__((target("avx512f,avx512bw"))) void transpose_from_bf16(const uint16_t* in, int64_t rows, int64_t cols,
                                                                    float* out) {
  for (int64_t r0 = 0; r0 < rows; r0 += 16) {
    for (int64_t c0 = 0; c0 < cols; c0 += 16) {
      __m512i r[16];
      for (int i = 0; i < 16; ++i) {
        const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(in + (r0 + i) * cols + c0));
        r[i] = _mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16);
      }
      transpose_16x16(r);
      for (int j = 0; j < 16; ++j) _mm512_storeu_si512(out + (c0 + j) * rows + r0, r[j]);
    }
  }
}

void bf16_tile_gemm_release() { at::native::cpublas::brgemm_release(/*is_vnni=*/true); }


#else  // the micro-kernel is x86 only: elsewhere the native path keeps at::addmm_out.

const char* bf16_tile_gemm_isa() {
  bf16_tile_gemm_enabled();  // the setting is checked on every host
  return "";
}
bool bf16_tile_gemm_available() { return false; }
void bf16_tile_gemm(int64_t, int64_t, int64_t, float, const uint16_t*, int64_t, Bf16Matrix, float, const uint16_t*,
                    int64_t, uint16_t*, int64_t, bool, bool) {
  TORCH_CHECK(false, "bf16_tile_gemm: x86 only");
}
void transpose_to_bf16(const float*, int64_t, int64_t, uint16_t*) { TORCH_CHECK(false, "x86 only"); }
void transpose_from_bf16(const uint16_t*, int64_t, int64_t, float*) { TORCH_CHECK(false, "x86 only"); }
void bf16_tile_gemm_release() {}

#endif

}  // namespace cpu
}  // namespace muon_ext

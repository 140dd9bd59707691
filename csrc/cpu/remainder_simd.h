// Vector forms of the remainder split / merge (common/remainder.h) and of the
// BF16 load, for the per-ISA kernel translation units.
//
// Each function handles exactly one at::vec::Vectorized<float> worth of
// elements (8 on AVX2, 16 on AVX512) and gives the bits of the scalar
// functions in common/remainder.h and common/bits.h, element for element: the
// split's carry and NaN corrections are the same compares and adds, done as
// lane masks.  tests/cpp/test_remainder.cpp sweeps all 2^32 patterns through
// the block functions that use them, for every instruction set.
//
// Only AVX2 and AVX512 have a vector form (MUON_EXT_REMAINDER_SIMD is then
// defined); the DEFAULT build keeps the scalar loops.
#pragma once

#include <ATen/cpu/vec/vec.h>
#include <c10/macros/Macros.h>

#include <cstdint>

#if defined(CPU_CAPABILITY_AVX2) || defined(CPU_CAPABILITY_AVX512)
#include <immintrin.h>
#endif

namespace muon_ext {
namespace cpu {
namespace CPU_CAPABILITY {
namespace {

#if defined(CPU_CAPABILITY_AVX512)

#define MUON_EXT_REMAINDER_SIMD 1

// The zero-masking forms with a full mask are the plain instructions; the
// unmasked intrinsics start from _mm512_undefined_epi32, which GCC 12 reports
// as "may be used uninitialized" at every inlined call.
constexpr __mmask16 kAllLanes = 0xFFFF;

inline __m512i widen_u16(const uint16_t* src) {
  return _mm512_maskz_cvtepu16_epi32(kAllLanes, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src)));
}

// FP32 masters from 16 BF16 high halves and 16 int16 remainders:
// (hi << 16) + sign_extend(rem), modulo 2^32.
inline at::vec::Vectorized<float> merge_master_vec(const uint16_t* hi, const int16_t* rem) {
  const __m512i high = _mm512_maskz_slli_epi32(kAllLanes, widen_u16(hi), 16);
  const __m512i low =
      _mm512_maskz_cvtepi16_epi32(kAllLanes, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(rem)));
  return _mm512_castsi512_ps(_mm512_add_epi32(high, low));
}

// The full rule of split_master_bits on 16 lanes, NaN corrections included.
inline void split_master_vec_with_nans(const at::vec::Vectorized<float>& master, uint16_t* hi, int16_t* rem) {
  const __m512i bits = _mm512_castps_si512(master);
  const __m512i lo = _mm512_and_si512(bits, _mm512_set1_epi32(0xFFFF));
  const __m512i magnitude = _mm512_and_si512(bits, _mm512_set1_epi32(0x7FFFFFFF));
  const __mmask16 up = _mm512_cmpgt_epi32_mask(magnitude, _mm512_set1_epi32(0x7F800000)) &
                       _mm512_cmplt_epi32_mask(magnitude, _mm512_set1_epi32(0x7F808000));
  const __mmask16 down = _mm512_cmpgt_epi32_mask(magnitude, _mm512_set1_epi32(0x7FFF7FFF));
  const __m512i one = _mm512_set1_epi32(1);
  __m512i high = _mm512_add_epi32(_mm512_maskz_srli_epi32(kAllLanes, bits, 16), _mm512_maskz_srli_epi32(kAllLanes, lo, 15));
  high = _mm512_mask_add_epi32(high, up, high, one);
  high = _mm512_mask_sub_epi32(high, down, high, one);
  // vpmovdw truncates each lane to its low 16 bits: the mod 2^16 of the rule.
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(hi), _mm512_maskz_cvtepi32_epi16(kAllLanes, high));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(rem), _mm512_maskz_cvtepi32_epi16(kAllLanes, lo));
}

// Splits 16 FP32 masters into BF16 high halves and int16 remainders.
inline void split_master_vec(const at::vec::Vectorized<float>& master, uint16_t* hi, int16_t* rem) {
  const __m512 values = master;
  if (C10_UNLIKELY(_mm512_cmp_ps_mask(values, values, _CMP_UNORD_Q) != 0)) {
    split_master_vec_with_nans(master, hi, rem);
    return;
  }
  const __m512i bits = _mm512_castps_si512(values);
  const __m512i rounded = _mm512_add_epi32(bits, _mm512_set1_epi32(0x8000));
  // vpmovdw keeps each lane's low 16 bits.
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(hi),
                      _mm512_maskz_cvtepi32_epi16(kAllLanes, _mm512_maskz_srli_epi32(kAllLanes, rounded, 16)));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(rem), _mm512_maskz_cvtepi32_epi16(kAllLanes, bits));
}

// 16 BF16 values, widened exactly to FP32.
inline at::vec::Vectorized<float> load_bf16_vec(const uint16_t* src) {
  return _mm512_castsi512_ps(_mm512_maskz_slli_epi32(kAllLanes, widen_u16(src), 16));
}

#elif defined(CPU_CAPABILITY_AVX2)

#define MUON_EXT_REMAINDER_SIMD 1

inline at::vec::Vectorized<float> merge_master_vec(const uint16_t* hi, const int16_t* rem) {
  const __m256i high = _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(hi))), 16);
  const __m256i low = _mm256_cvtepi16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(rem)));
  return _mm256_castsi256_ps(_mm256_add_epi32(high, low));
}

// The full rule of split_master_bits on 8 lanes, NaN corrections included.
inline void split_master_vec_with_nans(const at::vec::Vectorized<float>& master, uint16_t* hi, int16_t* rem) {
  const __m256i bits = _mm256_castps_si256(master);
  const __m256i low16 = _mm256_set1_epi32(0xFFFF);
  const __m256i lo = _mm256_and_si256(bits, low16);
  const __m256i magnitude = _mm256_and_si256(bits, _mm256_set1_epi32(0x7FFFFFFF));
  // Compares give -1 in a true lane, so "+ up - down" becomes "- up + down".
  const __m256i up = _mm256_and_si256(_mm256_cmpgt_epi32(magnitude, _mm256_set1_epi32(0x7F800000)),
                                      _mm256_cmpgt_epi32(_mm256_set1_epi32(0x7F808000), magnitude));
  const __m256i down = _mm256_cmpgt_epi32(magnitude, _mm256_set1_epi32(0x7FFF7FFF));
  __m256i high = _mm256_add_epi32(_mm256_srli_epi32(bits, 16), _mm256_srli_epi32(lo, 15));
  high = _mm256_and_si256(_mm256_add_epi32(_mm256_sub_epi32(high, up), down), low16);
  // Both operands are in [0, 0xFFFF], so the unsigned-saturating pack is a
  // plain truncation; it interleaves per 128-bit lane, which the permute undoes:
  // [hi 0-3, lo 0-3 | hi 4-7, lo 4-7] -> [hi 0-7 | lo 0-7].
  const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(high, lo), 0xD8);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(hi), _mm256_castsi256_si128(packed));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(rem), _mm256_extracti128_si256(packed, 1));
}

inline void split_master_vec(const at::vec::Vectorized<float>& master, uint16_t* hi, int16_t* rem) {
  const __m256 values = master;
  if (C10_UNLIKELY(_mm256_movemask_ps(_mm256_cmp_ps(values, values, _CMP_UNORD_Q)) != 0)) {
    split_master_vec_with_nans(master, hi, rem);
    return;
  }
  const __m256i bits = _mm256_castps_si256(values);
  const __m256i rounded = _mm256_add_epi32(bits, _mm256_set1_epi32(0x8000));
  // Each 32-bit lane: the low half of bits (the remainder), the high half of rounded (the BF16).
  const __m256i halves = _mm256_blend_epi16(bits, rounded, 0xAA);
  // Per 128-bit lane, the four remainders then the four BF16s; the permute
  // joins the lanes: [rem 0-3, rem 4-7 | hi 0-3, hi 4-7].
  const __m256i grouped = _mm256_shuffle_epi8(
      halves, _mm256_setr_epi8(0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15,
                               0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15));
  const __m256i packed = _mm256_permute4x64_epi64(grouped, 0xD8);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(rem), _mm256_castsi256_si128(packed));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(hi), _mm256_extracti128_si256(packed, 1));
}

inline at::vec::Vectorized<float> load_bf16_vec(const uint16_t* src) {
  return _mm256_castsi256_ps(
      _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src))), 16));
}

#endif

}  // namespace
}  // namespace CPU_CAPABILITY
}  // namespace cpu
}  // namespace muon_ext

// exp for AVX2 and FMA, shared by hearth's own kernels (gelu_avx2.cpp,
// attention_avx2.cpp). Included only by files built with -mavx2 -mfma; no
// ATen header (see gelu_avx2.cpp).
#pragma once

#include "kernel_paths.h"

#include <immintrin.h>

#include <cstdint>
#include <cstring>

namespace hearth_avx2 {

// exp(x) for x <= 0 (0 below the smallest normal float's logarithm, NaN for
// NaN): x = n ln2 + r with |r| <= ln2/2 (ln2 split in two, so n ln2 is
// exact), exp(r) by its Taylor series to r^7 (truncation under 1e-8
// relative), times 2^n built in the exponent bits. The tests bound its
// error by 4 units of float32 rounding (2^-24) relative (ops/fused.rs);
// M = kExpOff is the tests' deliberately wrong exp.
template <int M = hearth_kernels::kExact>
inline __m256 exp_nonpositive8(__m256 x) {
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693145751953125f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(1.428606765330187045e-06f), r);
  __m256 p = _mm256_set1_ps(1.0f / 5040);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 720));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 120));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 24));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 6));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
  // 2^n for n >= -126; smaller n (x < -87.3) give 0 below.
  const __m256i biased = _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127));
  const __m256 scale = _mm256_castsi256_ps(_mm256_slli_epi32(biased, 23));
  const __m256 underflow = _mm256_cmp_ps(x, _mm256_set1_ps(-87.33654f), _CMP_LT_OQ);
  if constexpr (M == hearth_kernels::kExpOff) {
    const __m256 zero = _mm256_setzero_ps();
    const __m256 off = _mm256_or_ps(
        _mm256_and_ps(_mm256_cmp_ps(r, zero, _CMP_GT_OQ), _mm256_set1_ps(1e-6f)),
        _mm256_and_ps(_mm256_cmp_ps(r, zero, _CMP_LT_OQ), _mm256_set1_ps(-1e-6f)));
    p = _mm256_fmadd_ps(p, off, p);
  }
  return _mm256_andnot_ps(underflow, _mm256_mul_ps(p, scale));
}

// For the tests' kResultOff: x[i * stride + c] for i < rows, c < cols moved
// 4 units in the last place away from zero (finite values; zero stays).
inline void move_4_ulps(float *x, int64_t rows, int64_t cols, int64_t stride) {
  for (int64_t i = 0; i < rows; ++i)
    for (int64_t c = 0; c < cols; ++c) {
      float *v = x + i * stride + c;
      uint32_t bits;
      std::memcpy(&bits, v, sizeof bits);
      if ((bits & 0x7fffffffu) == 0 || (bits & 0x7f800000u) == 0x7f800000u) continue;
      bits += 4;
      std::memcpy(v, &bits, sizeof bits);
    }
}

}  // namespace hearth_avx2

// exp for AVX2 and FMA, shared by hearth's own kernels (gelu_avx2.cpp,
// attention_avx2.cpp). Included only by files built with -mavx2 -mfma; no
// ATen header (see gelu_avx2.cpp).
#pragma once

#include <immintrin.h>

namespace hearth_avx2 {

// exp(x) for x <= 0 (0 below the smallest normal float's logarithm, NaN for
// NaN): x = n ln2 + r with |r| <= ln2/2 (ln2 split in two, so n ln2 is
// exact), exp(r) by its Taylor series to r^7 (truncation under 1e-8
// relative), times 2^n built in the exponent bits.
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
  return _mm256_andnot_ps(underflow, _mm256_mul_ps(p, scale));
}

}  // namespace hearth_avx2

// The exact GELU (erf form) and its derivative in one pass, for float32 on
// x86-64 with AVX2 and FMA. Built on its own with -mavx2 -mfma (build.rs)
// and called only where the CPU has both (gelu.cpp checks), so no other code
// is compiled for AVX2. It includes no ATen header: an inline function of
// ATen or c10 compiled here for AVX2 could be the copy the linker keeps for
// the whole binary.
//
// The formulas are those of ATen's GELU kernels, except that one exp serves
// both erf and the density (ATen's backward evaluates erf, with its exp,
// and then another exp), and that exp is the one below rather than
// SLEEF's, which took half the time of the whole pass:
//   e          = exp(-x*x/2)
//   erf(x/√2)  = sign(x) * (1 - t * r(t) * e),  t = 1 / (1 + p|x/√2|)
//                (Abramowitz & Stegun 7.1.26; r a quartic by Horner)
//   gelu(x)    = (x/2) * (1 + erf(x/√2))
//   gelu'(x)   = (1 + erf(x/√2))/2 + x * e/√(2π)
// The derivative is what gelu_backward multiplies the incoming gradient by;
// computing it here, where erf is already at hand, leaves the backward pass
// one multiplication. libtorch runs oneDNN's GELU on x86 CPUs; its values
// and these differ by a few units in the last place (host/ops/src/fused.rs
// tests against them).

#include "avx2_exp.h"

#include <immintrin.h>

#include <cmath>
#include <cstdint>
#include <cstring>

namespace {

template <int M>
inline void gelu8(const float *x, float *y, float *d) {
  const __m256 neg_zero = _mm256_set1_ps(-0.f);
  const __m256 one = _mm256_set1_ps(1.0f);
  const __m256 half = _mm256_set1_ps(0.5f);
  const __m256 xs = _mm256_loadu_ps(x);
  const __m256 v = _mm256_mul_ps(xs, _mm256_set1_ps(float(M_SQRT1_2)));
  const __m256 sign = _mm256_and_ps(neg_zero, v);
  const __m256 a = _mm256_xor_ps(sign, v);
  const __m256 t = _mm256_div_ps(one, _mm256_fmadd_ps(_mm256_set1_ps(0.3275911f), a, one));
  __m256 r = _mm256_fmadd_ps(_mm256_set1_ps(1.061405429f), t, _mm256_set1_ps(-1.453152027f));
  r = _mm256_fmadd_ps(r, t, _mm256_set1_ps(1.421413741f));
  r = _mm256_fmadd_ps(r, t, _mm256_set1_ps(-0.284496736f));
  r = _mm256_fmadd_ps(r, t, _mm256_set1_ps(0.254829592f));
  const __m256 e = hearth_avx2::exp_nonpositive8<M>(_mm256_mul_ps(_mm256_mul_ps(xs, xs), _mm256_set1_ps(-0.5f)));
  const __m256 erf = _mm256_xor_ps(sign, _mm256_fnmadd_ps(_mm256_mul_ps(e, t), r, one));
  const __m256 one_plus_erf = _mm256_add_ps(one, erf);
  _mm256_storeu_ps(y, _mm256_mul_ps(_mm256_mul_ps(xs, half), one_plus_erf));
  const __m256 pdf = _mm256_mul_ps(e, _mm256_set1_ps(float(M_2_SQRTPI * M_SQRT1_2 * 0.5)));
  _mm256_storeu_ps(d, _mm256_fmadd_ps(xs, pdf, _mm256_mul_ps(half, one_plus_erf)));
}

template <int M>
void gelu_and_derivative(const float *x, float *y, float *d, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) gelu8<M>(x + i, y + i, d + i);
  if (i < n) {
    // The tail goes through the same vector code, as libtorch's does.
    alignas(32) float xt[8] = {}, yt[8], dt[8];
    const size_t rest = size_t(n - i) * sizeof(float);
    std::memcpy(xt, x + i, rest);
    gelu8<M>(xt, yt, dt);
    std::memcpy(y + i, yt, rest);
    std::memcpy(d + i, dt, rest);
  }
}

}  // namespace

// y[i] = gelu(x[i]) and d[i] = gelu'(x[i]) for i < n; `mutation` is
// hearth_kernels::kExact but in the tests' mutation checks.
extern "C" void hearth_gelu_and_derivative_avx2(const float *x, float *y, float *d, int64_t n,
                                                int32_t mutation) {
  using namespace hearth_kernels;
  if (mutation == kExpOff) return gelu_and_derivative<kExpOff>(x, y, d, n);
  gelu_and_derivative<kExact>(x, y, d, n);
  if (mutation == kResultOff) {
    hearth_avx2::move_4_ulps(y, 1, n, n);
    hearth_avx2::move_4_ulps(d, 1, n, n);
  }
}

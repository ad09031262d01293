// The elementwise kernels behind the Llama-family patterns of the graph
// pass (jit_fuse.cpp's PATTERNS, llama_blocks.cpp's autograd functions),
// for float32 on x86-64 with AVX2 and FMA. Built on its own with -mavx2
// -mfma (build.rs) and called only where the CPU has both; no ATen header
// (see gelu_avx2.cpp). Each reads its inputs once and writes its outputs
// once, where the traced chain reads and writes the activation once per op,
// forward and again backward:
//   RMSNorm  y = w * x * r,  r = 1 / sqrt(mean(x^2) + eps)   (per row of n)
//            dx = r * (g*w) - x * r^3 * mean(g*w*x),  dw = sum_rows g * x * r
//   SwiGLU   y = silu(a) * b = a * s * b,  s = sigmoid(a)
//            da = g * b * s * (1 + a * (1 - s)),  db = g * a * s
//   rotary   y = x * cos + rotate_half(x) * sin, rotate_half(x) = [-x2, x1]
//            dx = g * cos + rotate_half^T(g * sin), rotate_half^T(z) = [z2, -z1]
// `mutation` is hearth_kernels::kExact but in the tests' mutation checks
// (kPatternOff: every result 2^-14 relative further from zero, more than
// the parity bound allows and less than any wrong formula).

#include "avx2_exp.h"

#include <immintrin.h>

#include <cmath>
#include <cstdint>
#include <cstring>

namespace {

// 2^-14: the tests' kPatternOff factor, applied to a whole output.
void scale_off(float *y, int64_t n) {
  for (int64_t i = 0; i < n; ++i) y[i] *= 1.0f + 1.0f / 16384.0f;
}

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
  return _mm_cvtss_f32(s);
}

// sum of a[i] * b[i] for i < n, in float32 lanes of 8 (then the tail).
inline float dot(const float *a, const float *b, int64_t n) {
  __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc0);
    acc1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8), _mm256_loadu_ps(b + i + 8), acc1);
  }
  for (; i + 8 <= n; i += 8)
    acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc0);
  float s = hsum(_mm256_add_ps(acc0, acc1));
  for (; i < n; ++i) s += a[i] * b[i];
  return s;
}

// sigmoid(a) for 8 lanes, through exp of -|a| (never overflows):
// e = exp(-|a|), sigmoid = a >= 0 ? 1 / (1 + e) : e / (1 + e).
inline __m256 sigmoid8(__m256 a) {
  const __m256 neg_zero = _mm256_set1_ps(-0.f);
  const __m256 e = hearth_avx2::exp_nonpositive8(_mm256_or_ps(a, neg_zero));
  const __m256 inv = _mm256_div_ps(_mm256_set1_ps(1.0f), _mm256_add_ps(_mm256_set1_ps(1.0f), e));
  const __m256 negative = _mm256_cmp_ps(a, _mm256_setzero_ps(), _CMP_LT_OQ);
  return _mm256_blendv_ps(inv, _mm256_mul_ps(e, inv), negative);
}

// Runs `body(offset, lanes)` over [0, n) in vectors of 8, the tail through
// zero-padded copies (`in` arrays of `k_in` inputs, `out` of `k_out`).
template <int K_IN, int K_OUT, class F>
inline void elementwise(const float *const (&in)[K_IN], float *const (&out)[K_OUT], int64_t n,
                        F body) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    __m256 x[K_IN];
    for (int k = 0; k < K_IN; ++k) x[k] = _mm256_loadu_ps(in[k] + i);
    __m256 y[K_OUT];
    body(x, y);
    for (int k = 0; k < K_OUT; ++k) _mm256_storeu_ps(out[k] + i, y[k]);
  }
  if (i < n) {
    const size_t rest = size_t(n - i) * sizeof(float);
    __m256 x[K_IN];
    for (int k = 0; k < K_IN; ++k) {
      alignas(32) float t[8] = {};
      std::memcpy(t, in[k] + i, rest);
      x[k] = _mm256_load_ps(t);
    }
    __m256 y[K_OUT];
    body(x, y);
    for (int k = 0; k < K_OUT; ++k) {
      alignas(32) float t[8];
      _mm256_store_ps(t, y[k]);
      std::memcpy(out[k] + i, t, rest);
    }
  }
}

}  // namespace

extern "C" {

// RMSNorm over `rows` rows of n: y = w * x * r, rstd[row] = r.
void hearth_rms_norm_forward_avx2(const float *x, const float *w, float *y, float *rstd,
                                  int64_t rows, int64_t n, float eps, int32_t mutation) {
  for (int64_t row = 0; row < rows; ++row) {
    const float *xr = x + row * n;
    float *yr = y + row * n;
    const float r = 1.0f / std::sqrt(dot(xr, xr, n) / float(n) + eps);
    rstd[row] = r;
    const __m256 rv = _mm256_set1_ps(r);
    const float *in[2] = {xr, w};
    float *out[1] = {yr};
    elementwise<2, 1>(in, out, n, [&](const __m256 *v, __m256 *o) {
      o[0] = _mm256_mul_ps(v[1], _mm256_mul_ps(v[0], rv));
    });
    if (mutation == hearth_kernels::kPatternOff) scale_off(yr, n);
  }
}

// Its gradient for the same rows: dx, and dw added into `dw` (n floats,
// this caller's own: the rows' sums are split between threads).
void hearth_rms_norm_backward_avx2(const float *x, const float *w, const float *rstd,
                                   const float *g, float *dx, float *dw, int64_t rows, int64_t n,
                                   int32_t mutation) {
  for (int64_t row = 0; row < rows; ++row) {
    const float *xr = x + row * n, *gr = g + row * n;
    float *dxr = dx + row * n;
    const float r = rstd[row];
    // mean(g*w*x), accumulated as in `dot`.
    __m256 acc = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
      acc = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_loadu_ps(gr + i), _mm256_loadu_ps(w + i)),
                            _mm256_loadu_ps(xr + i), acc);
    float s = hsum(acc);
    for (; i < n; ++i) s += gr[i] * w[i] * xr[i];
    const __m256 rv = _mm256_set1_ps(r), cv = _mm256_set1_ps(r * r * r * s / float(n));
    const float *in[4] = {xr, gr, w, dw};
    float *out[2] = {dxr, dw};
    elementwise<4, 2>(in, out, n, [&](const __m256 *v, __m256 *o) {
      // dx = r * g * w - c * x;  dw += g * x * r
      o[0] = _mm256_fmsub_ps(rv, _mm256_mul_ps(v[1], v[2]), _mm256_mul_ps(cv, v[0]));
      o[1] = _mm256_fmadd_ps(_mm256_mul_ps(v[1], v[0]), rv, v[3]);
    });
    if (mutation == hearth_kernels::kPatternOff) scale_off(dxr, n);
  }
}

// SwiGLU of n values: y = silu(a) * b.
void hearth_swiglu_forward_avx2(const float *a, const float *b, float *y, int64_t n,
                                int32_t mutation) {
  const float *in[2] = {a, b};
  float *out[1] = {y};
  elementwise<2, 1>(in, out, n, [&](const __m256 *v, __m256 *o) {
    o[0] = _mm256_mul_ps(_mm256_mul_ps(v[0], sigmoid8(v[0])), v[1]);
  });
  if (mutation == hearth_kernels::kPatternOff) scale_off(y, n);
}

// Its gradient: da and db from the incoming g.
void hearth_swiglu_backward_avx2(const float *a, const float *b, const float *g, float *da,
                                 float *db, int64_t n, int32_t mutation) {
  const __m256 one = _mm256_set1_ps(1.0f);
  const float *in[3] = {a, b, g};
  float *out[2] = {da, db};
  elementwise<3, 2>(in, out, n, [&](const __m256 *v, __m256 *o) {
    const __m256 s = sigmoid8(v[0]);
    const __m256 gs = _mm256_mul_ps(v[2], s);
    // da = g * b * s * (1 + a * (1 - s));  db = g * a * s
    const __m256 slope = _mm256_fmadd_ps(v[0], _mm256_sub_ps(one, s), one);
    o[0] = _mm256_mul_ps(_mm256_mul_ps(gs, v[1]), slope);
    o[1] = _mm256_mul_ps(gs, v[0]);
  });
  if (mutation == hearth_kernels::kPatternOff) {
    scale_off(da, n);
    scale_off(db, n);
  }
}

// Rotary embedding of one row of d (even) values: y = x * c + rotate_half(x)
// * s, or with `transpose` its gradient's map, y = x * c + rotate_half^T(x *
// s), for x the incoming gradient.
void hearth_rotary_row_avx2(const float *x, const float *c, const float *s, float *y, int64_t d,
                            bool transpose, int32_t mutation) {
  const int64_t h = d / 2;
  for (int64_t i = 0; i < h; ++i) {
    if (!transpose) {
      y[i] = x[i] * c[i] - x[i + h] * s[i];
      y[i + h] = x[i + h] * c[i + h] + x[i] * s[i + h];
    } else {
      y[i] = x[i] * c[i] + x[i + h] * s[i + h];
      y[i + h] = x[i + h] * c[i + h] - x[i] * s[i];
    }
  }
  if (mutation == hearth_kernels::kPatternOff) scale_off(y, d);
}

}  // extern "C"

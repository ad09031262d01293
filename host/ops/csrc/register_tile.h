// The register-tiled matrix product of hearth's attention kernels, written
// once over a vector width and compiled twice: for AVX2 and FMA (8 floats a
// register, attention_avx2.cpp) and for AVX-512 (16 floats a register,
// tile_avx512.cpp). Every output element is one chain of fused
// multiply-adds over k in order, whatever the width, so both give the same
// bits; the tests hold them to that (ops/fused/tests.rs). No ATen header
// (see gelu_avx2.cpp).
#pragma once

#include <immintrin.h>

#include <cstdint>

namespace hearth_tiles {

// C = alpha * A B for a tile of `rows` (1..kRows) rows: C[r][n] =
// alpha * sum_{k < K} A(r, k) * B[k][n] for n < N (a multiple of 8). A(r, k)
// is a[r*lda + k], or a[k*lda + r] when A is transposed; B is row-major
// with row stride ldb.
using Tile = void (*)(int64_t rows, int64_t K, const float *a, int64_t lda, const float *b,
                      int64_t ldb, float *c, int64_t ldc, int64_t N, float alpha);

// The largest tile: 6 rows of two registers of columns, 12 accumulators
// and two registers of B beside a broadcast of A, within AVX2's 16.
constexpr int64_t kRows = 6;

// The tiles for A as stored and A transposed, in one width (floats a
// register).
struct Tiles {
  Tile plain, transposed;
  int64_t lanes;
};

// The AVX-512 tiles (tile_avx512.cpp), for CPUs with AVX-512F.
Tiles avx512_tiles();

// One width's vector operations: `Lanes` floats a register, loads and
// stores of the first `count` (8 or Lanes) of them.
#if defined(__AVX2__) && defined(__FMA__)
struct Avx2 {
  using V = __m256;
  static constexpr int64_t Lanes = 8;
  static V zero() { return _mm256_setzero_ps(); }
  static V broadcast(const float *x) { return _mm256_broadcast_ss(x); }
  static V fmadd(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
  static V mul(V a, V b) { return _mm256_mul_ps(a, b); }
  static V set1(float x) { return _mm256_set1_ps(x); }
  static V load(const float *p) { return _mm256_loadu_ps(p); }
  static void store(float *p, V v) { _mm256_storeu_ps(p, v); }
  // N is a multiple of 8, so a partial register is never needed.
  static V load_first(const float *p, int64_t) { return load(p); }
  static void store_first(float *p, V v, int64_t) { store(p, v); }
};
#endif

#if defined(__AVX512F__)
struct Avx512 {
  using V = __m512;
  static constexpr int64_t Lanes = 16;
  static V zero() { return _mm512_setzero_ps(); }
  static V broadcast(const float *x) { return _mm512_set1_ps(*x); }
  static V fmadd(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
  static V mul(V a, V b) { return _mm512_mul_ps(a, b); }
  static V set1(float x) { return _mm512_set1_ps(x); }
  static V load(const float *p) { return _mm512_loadu_ps(p); }
  static void store(float *p, V v) { _mm512_storeu_ps(p, v); }
  static __mmask16 first(int64_t count) { return __mmask16((1u << count) - 1); }
  static V load_first(const float *p, int64_t count) {
    return _mm512_maskz_loadu_ps(first(count), p);
  }
  static void store_first(float *p, V v, int64_t count) {
    _mm512_mask_storeu_ps(p, first(count), v);
  }
};
#endif

// The tile for MR rows: two registers of columns at a time, then one
// register (or the first 8 of its lanes) for what is left.
template <class S, int MR, bool A_TRANSPOSED>
void tile(int64_t K, const float *a, int64_t lda, const float *b, int64_t ldb, float *c,
          int64_t ldc, int64_t N, float alpha) {
  using V = typename S::V;
  constexpr int64_t L = S::Lanes;
  const V scale = S::set1(alpha);
  auto a_at = [&](int r, int64_t k) { return A_TRANSPOSED ? a + k * lda + r : a + r * lda + k; };
  int64_t n = 0;
  for (; n + 2 * L <= N; n += 2 * L) {
    V lo[MR], hi[MR];
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r) lo[r] = hi[r] = S::zero();
    for (int64_t k = 0; k < K; ++k) {
      const V b0 = S::load(b + k * ldb + n);
      const V b1 = S::load(b + k * ldb + n + L);
#pragma GCC unroll 8
      for (int r = 0; r < MR; ++r) {
        const V x = S::broadcast(a_at(r, k));
        lo[r] = S::fmadd(x, b0, lo[r]);
        hi[r] = S::fmadd(x, b1, hi[r]);
      }
    }
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r) {
      S::store(c + r * ldc + n, S::mul(scale, lo[r]));
      S::store(c + r * ldc + n + L, S::mul(scale, hi[r]));
    }
  }
  for (; n < N; n += L) {
    const int64_t count = N - n < L ? N - n : L;
    V acc[MR];
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r) acc[r] = S::zero();
    for (int64_t k = 0; k < K; ++k) {
      const V b0 = S::load_first(b + k * ldb + n, count);
#pragma GCC unroll 8
      for (int r = 0; r < MR; ++r) acc[r] = S::fmadd(S::broadcast(a_at(r, k)), b0, acc[r]);
    }
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r) S::store_first(c + r * ldc + n, S::mul(scale, acc[r]), count);
  }
}

// tile() for a run-time row count 1..kRows.
template <class S, bool A_TRANSPOSED>
void tile_rows(int64_t rows, int64_t K, const float *a, int64_t lda, const float *b, int64_t ldb,
               float *c, int64_t ldc, int64_t N, float alpha) {
  switch (rows) {
    case 6: return tile<S, 6, A_TRANSPOSED>(K, a, lda, b, ldb, c, ldc, N, alpha);
    case 5: return tile<S, 5, A_TRANSPOSED>(K, a, lda, b, ldb, c, ldc, N, alpha);
    case 4: return tile<S, 4, A_TRANSPOSED>(K, a, lda, b, ldb, c, ldc, N, alpha);
    case 3: return tile<S, 3, A_TRANSPOSED>(K, a, lda, b, ldb, c, ldc, N, alpha);
    case 2: return tile<S, 2, A_TRANSPOSED>(K, a, lda, b, ldb, c, ldc, N, alpha);
    default: return tile<S, 1, A_TRANSPOSED>(K, a, lda, b, ldb, c, ldc, N, alpha);
  }
}

// The tiles of one width.
template <class S>
Tiles tiles_of() {
  return {&tile_rows<S, false>, &tile_rows<S, true>, S::Lanes};
}

}  // namespace hearth_tiles

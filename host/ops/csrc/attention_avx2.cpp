// Multi-head scaled-dot-product self-attention, forward and backward, for
// float32 on x86-64 with AVX2 and FMA, for short sequences: one (batch,
// head) at a time, its T x T scores whole in a buffer (T <= 512, checked
// by attention.cpp), every product a register-tiled loop over operands
// that sit in the caches (register_tile.h: AVX2's, or AVX-512's where the
// path is avx512; the rest is AVX2 on either path). libtorch's CPU flash
// kernel cuts the same work into q-blocks of 32 rows, each a handful of
// small MKL calls, and spent ~4.5 ms forward and ~12.6 ms backward per
// layer of the bench GPT (B=16, H=4, T=128, D=32, one thread) — about 15
// GFLOP/s. Built as gelu_avx2.cpp is (no ATen header, -mavx2 -mfma, called
// only where the CPU has both).
//
// Layout: qkv is [B, T, 3*H*D] (the packed projection, q | k | v, each
// head's D features side by side), the output and its gradient [B, T, H*D],
// lse [B, H, T]. With s = 1/sqrt(D):
//   S = s Q K^T, masked above the diagonal when causal
//   P = softmax(S) row by row,  lse_i = log sum_j exp(S_ij)
//   O = P V
// and backward, with P recomputed from Q, K and lse (as flash attention
// does, so nothing T x T is kept between the passes):
//   dV = P^T dO,  dP = dO V^T,  dS = P o (dP - rowsum(P o dP))
//   dQ = s dS K,  dK = s dS^T Q

#include "avx2_exp.h"
#include "register_tile.h"

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

namespace {

using hearth_tiles::kRows;
using hearth_tiles::Tiles;

inline int64_t round_up8(int64_t n) { return (n + 7) & ~int64_t(7); }

inline float sum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

inline float max8(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  m = _mm_max_ss(m, _mm_movehdup_ps(m));
  return _mm_cvtss_f32(m);
}

// Lanes j0 + 0..7 that are below len.
inline __m256 lanes_below(int64_t j0, int64_t len) {
  const __m256i lane = _mm256_add_epi32(_mm256_set1_epi32(int32_t(j0)),
                                        _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
  return _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(int32_t(len)), lane));
}

// Row i of P from row i of S in place, but for the division by its sum:
// exp(S_ij - max_j S_ij) over the first len entries, zero from there to
// width (width >= round_up8(len)). Returns the sum and sets *lse to the
// row's log-sum-exp; the caller divides the row's output by the sum (D
// values rather than len).
template <int M>
float exp_row(float *row, int64_t len, int64_t width, float *lse) {
  const __m256 minus_inf = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  __m256 vmax = minus_inf;
  for (int64_t j = 0; j < len; j += 8) {
    const __m256 x = _mm256_blendv_ps(minus_inf, _mm256_loadu_ps(row + j), lanes_below(j, len));
    vmax = _mm256_max_ps(vmax, x);
  }
  const float m = max8(vmax);
  const __m256 vm = _mm256_set1_ps(m);
  __m256 vsum = _mm256_setzero_ps();
  for (int64_t j = 0; j < len; j += 8) {
    const __m256 e = _mm256_and_ps(
        hearth_avx2::exp_nonpositive8<M>(_mm256_sub_ps(_mm256_loadu_ps(row + j), vm)),
        lanes_below(j, len));
    _mm256_storeu_ps(row + j, e);
    vsum = _mm256_add_ps(vsum, e);
  }
  const float sum = sum8(vsum);
  const int64_t done = round_up8(len);
  std::memset(row + done, 0, size_t(width - done) * sizeof(float));
  *lse = m + std::log(sum);
  return sum;
}

// x[c] *= a for c < n (a multiple of 8).
inline void scale_row(float *x, int64_t n, float a) {
  const __m256 va = _mm256_set1_ps(a);
  for (int64_t c = 0; c < n; c += 8) _mm256_storeu_ps(x + c, _mm256_mul_ps(va, _mm256_loadu_ps(x + c)));
}

// Row i of P from row i of S in place, given its log-sum-exp: exp(S - lse)
// over the first len entries, zero from there to width.
template <int M>
void probabilities_row(float *row, int64_t len, int64_t width, float lse) {
  const __m256 vl = _mm256_set1_ps(lse);
  for (int64_t j = 0; j < len; j += 8) {
    const __m256 e = hearth_avx2::exp_nonpositive8<M>(_mm256_sub_ps(_mm256_loadu_ps(row + j), vl));
    _mm256_storeu_ps(row + j, _mm256_and_ps(e, lanes_below(j, len)));
  }
  const int64_t done = round_up8(len);
  std::memset(row + done, 0, size_t(width - done) * sizeof(float));
}

// dS row from the dP row in place: P o (dP - delta) over width entries
// (P is zero where masked, so dS is too).
void score_gradient_row(float *dp, const float *p, int64_t width, float delta) {
  const __m256 vd = _mm256_set1_ps(delta);
  for (int64_t j = 0; j < width; j += 8) {
    const __m256 g = _mm256_sub_ps(_mm256_loadu_ps(dp + j), vd);
    _mm256_storeu_ps(dp + j, _mm256_mul_ps(_mm256_loadu_ps(p + j), g));
  }
}

float dot(const float *x, const float *y, int64_t n) {  // n a multiple of 8
  __m256 acc = _mm256_setzero_ps();
  for (int64_t c = 0; c < n; c += 8)
    acc = _mm256_fmadd_ps(_mm256_loadu_ps(x + c), _mm256_loadu_ps(y + c), acc);
  return sum8(acc);
}

// The 8 x 8 block at x (row stride ldx) transposed to out (row stride ldo).
inline void transpose8x8(const float *x, int64_t ldx, float *out, int64_t ldo) {
  __m256 r[8], t[8];
  for (int i = 0; i < 8; ++i) r[i] = _mm256_loadu_ps(x + i * ldx);
  for (int i = 0; i < 8; i += 2) {
    t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
  }
  for (int i = 0; i < 8; i += 4) {
    r[i] = _mm256_shuffle_ps(t[i], t[i + 2], _MM_SHUFFLE(1, 0, 1, 0));
    r[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], _MM_SHUFFLE(3, 2, 3, 2));
    r[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], _MM_SHUFFLE(1, 0, 1, 0));
    r[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], _MM_SHUFFLE(3, 2, 3, 2));
  }
  for (int i = 0; i < 4; ++i) {
    _mm256_storeu_ps(out + i * ldo, _mm256_permute2f128_ps(r[i], r[i + 4], 0x20));
    _mm256_storeu_ps(out + (i + 4) * ldo, _mm256_permute2f128_ps(r[i], r[i + 4], 0x31));
  }
}

// out[c][j] = x[j*ld + c] for j < rows, c < cols (a multiple of 8); zero
// for rows <= j < width.
void transpose_padded(const float *x, int64_t ld, int64_t rows, int64_t cols, float *out,
                      int64_t width) {
  int64_t j = 0;
  for (; j + 8 <= rows; j += 8)
    for (int64_t c = 0; c < cols; c += 8) transpose8x8(x + j * ld + c, ld, out + c * width + j, width);
  for (int64_t c = 0; c < cols; ++c) {
    float *o = out + c * width;
    for (int64_t jj = j; jj < rows; ++jj) o[jj] = x[jj * ld + c];
    std::fill(o + rows, o + width, 0.0f);
  }
}

// Asks for rows [i0, i0 + n) of a head's D columns at x (row stride ld) to
// be brought into the caches: the next head's q, k, v (and dO), fetched
// while this one computes. Without it, the first pass over each head's k
// waited on memory for most of its time.
inline void prefetch_rows(const float *x, int64_t ld, int64_t i0, int64_t n, int64_t D) {
  for (int64_t i = i0; i < i0 + n; ++i)
    for (int64_t c = 0; c < D; c += 16) _mm_prefetch(reinterpret_cast<const char *>(x + i * ld + c), _MM_HINT_T0);
}

struct Shape {
  int64_t B, T, H, D;
  bool causal;
  int64_t d() const { return H * D; }          // features of q, of k, of v, of the output
  int64_t ld() const { return 3 * H * D; }     // row stride of qkv
  int64_t padded() const { return round_up8(T); }
  // Row i attends to its first len(i) keys.
  int64_t len(int64_t i) const { return causal ? i + 1 : T; }
  // Columns of S computed for the row tile starting at i0 (rows <= i1).
  int64_t width(int64_t i1) const { return causal ? std::min(padded(), round_up8(i1)) : padded(); }
};

// Forward pass for heads [begin, end) of the B*H (batch-major), writing
// their columns of out and their rows of lse.
template <int M>
void forward(const Tiles &tiles, const float *qkv, float *out, float *lse, int64_t B, int64_t T,
             int64_t H, int64_t D, bool causal, int64_t begin, int64_t end) {
  const Shape g{B, T, H, D, causal};
  const int64_t Tp = g.padded(), ld = g.ld(), d = g.d();
  const float scale = 1.0f / std::sqrt(float(D));
  std::vector<float> kt(size_t(D * Tp)), s(size_t(Tp * Tp));
  for (int64_t bh = begin; bh < end; ++bh) {
    const int64_t b = bh / H, h = bh % H;
    const float *q = qkv + b * T * ld + h * D, *k = q + d, *v = q + 2 * d;
    float *o = out + b * T * d + h * D, *l = lse + bh * T;
    transpose_padded(k, ld, T, D, kt.data(), Tp);
    const float *next = bh + 1 < end ? qkv + ((bh + 1) / H) * T * ld + ((bh + 1) % H) * D : nullptr;
    for (int64_t i0 = 0; i0 < T; i0 += kRows) {
      const int64_t rows = std::min(kRows, T - i0), width = g.width(i0 + rows);
      if (next)
        for (int64_t part = 0; part < 3; ++part) prefetch_rows(next + part * d, ld, i0, rows, D);
      float *si = s.data() + i0 * Tp;
      tiles.plain(rows, D, q + i0 * ld, ld, kt.data(), Tp, si, Tp, width, scale);
      float sums[kRows];
      for (int64_t r = 0; r < rows; ++r) sums[r] = exp_row<M>(si + r * Tp, g.len(i0 + r), width, &l[i0 + r]);
      const int64_t keys = causal ? i0 + rows : T;
      tiles.plain(rows, keys, si, Tp, v, ld, o + i0 * d, d, D, 1.0f);
      for (int64_t r = 0; r < rows; ++r) scale_row(o + (i0 + r) * d, D, 1.0f / sums[r]);
    }
  }
}

// Backward pass for heads [begin, end): their columns of dqkv (q, k and v
// parts) from qkv, the forward's lse, and dout.
template <int M>
void backward(const Tiles &tiles, const float *qkv, const float *lse, const float *dout,
              float *dqkv, int64_t B, int64_t T, int64_t H, int64_t D, bool causal, int64_t begin,
              int64_t end) {
  const Shape g{B, T, H, D, causal};
  const int64_t Tp = g.padded(), ld = g.ld(), d = g.d();
  const float scale = 1.0f / std::sqrt(float(D));
  std::vector<float> kt(size_t(D * Tp)), vt(size_t(D * Tp)), p(size_t(Tp * Tp)),
      ds(size_t(Tp * Tp));
  for (int64_t bh = begin; bh < end; ++bh) {
    const int64_t b = bh / H, h = bh % H;
    const float *q = qkv + b * T * ld + h * D, *k = q + d, *v = q + 2 * d;
    const float *dO = dout + b * T * d + h * D, *l = lse + bh * T;
    float *dq = dqkv + b * T * ld + h * D, *dk = dq + d, *dv = dq + 2 * d;
    transpose_padded(k, ld, T, D, kt.data(), Tp);
    transpose_padded(v, ld, T, D, vt.data(), Tp);
    const int64_t nb = (bh + 1) / H, nh = (bh + 1) % H;
    const bool more = bh + 1 < end;
    // P, dS and dQ, a tile of rows at a time.
    for (int64_t i0 = 0; i0 < T; i0 += kRows) {
      const int64_t rows = std::min(kRows, T - i0), width = g.width(i0 + rows);
      if (more) {
        for (int64_t part = 0; part < 3; ++part)
          prefetch_rows(qkv + nb * T * ld + part * d + nh * D, ld, i0, rows, D);
        prefetch_rows(dout + nb * T * d + nh * D, d, i0, rows, D);
      }
      float *pi = p.data() + i0 * Tp, *dsi = ds.data() + i0 * Tp;
      tiles.plain(rows, D, q + i0 * ld, ld, kt.data(), Tp, pi, Tp, width, scale);
      tiles.plain(rows, D, dO + i0 * d, d, vt.data(), Tp, dsi, Tp, width, 1.0f);
      for (int64_t r = 0; r < rows; ++r) {
        const int64_t i = i0 + r;
        probabilities_row<M>(pi + r * Tp, g.len(i), width, l[i]);
        // rowsum(dO o O) is sum_j P_ij dP_ij; taken from the same P and dP
        // as dS, the row of dS sums to zero as it should (a single key gets
        // exactly zero), where dO . O rounds apart from them.
        const float delta = dot(pi + r * Tp, dsi + r * Tp, width);
        score_gradient_row(dsi + r * Tp, pi + r * Tp, width, delta);
        std::memset(pi + r * Tp + width, 0, size_t(Tp - width) * sizeof(float));
        std::memset(dsi + r * Tp + width, 0, size_t(Tp - width) * sizeof(float));
      }
      const int64_t keys = causal ? i0 + rows : T;
      tiles.plain(rows, keys, dsi, Tp, k, ld, dq + i0 * ld, ld, D, scale);
    }
    // dK and dV, a tile of key rows at a time: key j gets gradient only from
    // queries i >= j when causal.
    for (int64_t j0 = 0; j0 < T; j0 += kRows) {
      const int64_t rows = std::min(kRows, T - j0), first = causal ? j0 : 0;
      tiles.transposed(rows, T - first, ds.data() + first * Tp + j0, Tp, q + first * ld, ld,
                      dk + j0 * ld, ld, D, scale);
      tiles.transposed(rows, T - first, p.data() + first * Tp + j0, Tp, dO + first * d, d,
                      dv + j0 * ld, ld, D, 1.0f);
    }
  }
}

// The tiles of `path`: AVX-512's (tile_avx512.cpp) on hearth_kernels'
// kAvx512, this file's AVX2 ones otherwise. The callers (attention.cpp)
// have checked that the CPU runs them.
Tiles tiles_for(hearth_kernels::Path path) {
  if (path == hearth_kernels::kAvx512) {
    static const Tiles avx512 = hearth_tiles::avx512_tiles();
    return avx512;
  }
  static const Tiles avx2 = hearth_tiles::tiles_of<hearth_tiles::Avx2>();
  return avx2;
}

}  // namespace

// The kernels for heads [begin, end); `code` is hearth_kernels' path (kAvx2
// or kAvx512, which give the same bits) and mutation (kExact but in the
// tests' mutation checks).
extern "C" {

void hearth_attention_forward_kernel(const float *qkv, float *out, float *lse, int64_t B,
                                     int64_t T, int64_t H, int64_t D, bool causal, int64_t begin,
                                     int64_t end, int32_t code) {
  using namespace hearth_kernels;
  const Tiles tiles = tiles_for(path_of(code));
  const Mutation mutation = mutation_of(code);
  if (mutation == kExpOff)
    return forward<kExpOff>(tiles, qkv, out, lse, B, T, H, D, causal, begin, end);
  forward<kExact>(tiles, qkv, out, lse, B, T, H, D, causal, begin, end);
  if (mutation == kResultOff)
    for (int64_t bh = begin; bh < end; ++bh)
      hearth_avx2::move_4_ulps(out + (bh / H) * T * H * D + (bh % H) * D, T, D, H * D);
}

void hearth_attention_backward_kernel(const float *qkv, const float *lse, const float *dout,
                                      float *dqkv, int64_t B, int64_t T, int64_t H, int64_t D,
                                      bool causal, int64_t begin, int64_t end, int32_t code) {
  using namespace hearth_kernels;
  const Tiles tiles = tiles_for(path_of(code));
  const Mutation mutation = mutation_of(code);
  if (mutation == kExpOff)
    return backward<kExpOff>(tiles, qkv, lse, dout, dqkv, B, T, H, D, causal, begin, end);
  backward<kExact>(tiles, qkv, lse, dout, dqkv, B, T, H, D, causal, begin, end);
  if (mutation == kResultOff)
    for (int64_t bh = begin; bh < end; ++bh)
      for (int64_t part = 0; part < 3; ++part)
        hearth_avx2::move_4_ulps(dqkv + (bh / H) * T * 3 * H * D + part * H * D + (bh % H) * D, T,
                                 D, 3 * H * D);
}

// The floats a register of the tiles `code`'s path runs (8: AVX2, 16:
// AVX-512), for the tests: the two paths give the same bits, so only this
// tells them apart.
int64_t hearth_attention_tile_lanes(int32_t code) {
  return tiles_for(hearth_kernels::path_of(code)).lanes;
}

}  // extern "C"

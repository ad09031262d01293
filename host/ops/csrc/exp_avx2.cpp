// The exp that hearth's AVX2 kernels share (avx2_exp.h) over an array,
// for the test that bounds its error (host/ops/src/fused/tests.rs). Built
// with the kernels (-mavx2 -mfma), called only where the CPU has both.

#include "avx2_exp.h"

#include <cstring>

namespace {

template <int M>
void exp_all(const float *x, float *y, int64_t n) {
  for (int64_t i = 0; i < n; i += 8) {
    alignas(32) float in[8] = {}, out[8];
    const size_t count = size_t(n - i < 8 ? n - i : 8);
    std::memcpy(in, x + i, count * sizeof(float));
    _mm256_store_ps(out, hearth_avx2::exp_nonpositive8<M>(_mm256_load_ps(in)));
    std::memcpy(y + i, out, count * sizeof(float));
  }
}

}  // namespace

// y[i] = exp(x[i]) for x[i] <= 0, i < n; `mutation` as the kernels take it.
extern "C" void hearth_exp_nonpositive_avx2(const float *x, float *y, int64_t n, int32_t mutation) {
  if (mutation == hearth_kernels::kExpOff) return exp_all<hearth_kernels::kExpOff>(x, y, n);
  exp_all<hearth_kernels::kExact>(x, y, n);
  if (mutation == hearth_kernels::kResultOff) hearth_avx2::move_4_ulps(y, 1, n, n);
}

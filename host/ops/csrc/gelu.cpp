// The exact GELU with its derivative computed in the forward pass
// (gelu_avx2.cpp), as an autograd function whose backward is one
// multiplication: libtorch's gelu_backward evaluates erf and exp again, and
// on a CPU that made GELU's backward ~10 % of a small GPT's step. Elsewhere
// (no AVX2/FMA, other dtypes or devices, no gradient wanted) it is
// libtorch's own gelu.

#include "avx2_kernels.h"
#include "guarded.h"

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/gelu.h>
#include <ATen/ops/mul.h>
#include <torch/csrc/autograd/custom_function.h>


#if defined(__x86_64__)
extern "C" void hearth_gelu_and_derivative_avx2(const float *x, float *y, float *d, int64_t n,
                                                int32_t mutation);
#endif

namespace {

struct GeluSavingDerivative : torch::autograd::Function<GeluSavingDerivative> {
  static at::Tensor forward(torch::autograd::AutogradContext *ctx, const at::Tensor &input,
                            int64_t mutation) {
    const at::Tensor x = input.contiguous();
    at::Tensor y = at::empty_like(x), d = at::empty_like(x);
#if defined(__x86_64__)
    const float *xp = x.const_data_ptr<float>();
    float *yp = y.mutable_data_ptr<float>(), *dp = d.mutable_data_ptr<float>();
    // libtorch's grain for elementwise kernels.
    at::parallel_for(0, x.numel(), 32768, [&](int64_t begin, int64_t end) {
      hearth_gelu_and_derivative_avx2(xp + begin, yp + begin, dp + begin, end - begin,
                                      int32_t(mutation));
    });
#endif
    ctx->save_for_backward({d});
    return y;
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext *ctx,
                                                 torch::autograd::variable_list grads) {
    hearth_avx2::refuse_create_graph(
        "GELU", "libtorch's gelu (hearth::ops::gelu falls back to it without AVX2)");
    return {at::mul(grads[0], ctx->get_saved_variables()[0]), at::Tensor()};
  }
};

}  // namespace

extern "C" {

// out = GELU(x), exact (erf) form. A float32 CPU tensor that needs a
// gradient takes the fused path above when `kernels` (hearth_kernels'
// path and mutation) asks for the AVX2 kernels; anything else libtorch's
// at::gelu.
char *hearth_gelu(at::Tensor *x, int32_t kernels, at::Tensor **out) {
  return hearth_abi::guarded([&] {
    const bool fused = x->device().is_cpu() && x->scalar_type() == at::kFloat &&
                       x->requires_grad() && torch::autograd::GradMode::is_enabled() &&
                       hearth_avx2::kernels_asked(kernels);
    *out = new at::Tensor(fused ? GeluSavingDerivative::apply(
                                      *x, int64_t(hearth_kernels::mutation_of(kernels)))
                                : at::gelu(*x));
  });
}

// Whether this CPU can run hearth's AVX2 kernels (AVX2 and FMA).
bool hearth_cpu_has_avx2_fma() { return hearth_avx2::cpu_has_avx2_fma(); }

// Whether it can run them with AVX-512 tiles (AVX-512F too).
bool hearth_cpu_has_avx512f() { return hearth_avx2::cpu_has_avx512f(); }

}  // extern "C"

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
extern "C" void hearth_gelu_and_derivative_avx2(const float *x, float *y, float *d, int64_t n);
#endif

namespace {

struct GeluSavingDerivative : torch::autograd::Function<GeluSavingDerivative> {
  static at::Tensor forward(torch::autograd::AutogradContext *ctx, const at::Tensor &input) {
    const at::Tensor x = input.contiguous();
    at::Tensor y = at::empty_like(x), d = at::empty_like(x);
#if defined(__x86_64__)
    const float *xp = x.const_data_ptr<float>();
    float *yp = y.mutable_data_ptr<float>(), *dp = d.mutable_data_ptr<float>();
    // libtorch's grain for elementwise kernels.
    at::parallel_for(0, x.numel(), 32768, [&](int64_t begin, int64_t end) {
      hearth_gelu_and_derivative_avx2(xp + begin, yp + begin, dp + begin, end - begin);
    });
#endif
    ctx->save_for_backward({d});
    return y;
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext *ctx,
                                                 torch::autograd::variable_list grads) {
    hearth_avx2::refuse_create_graph(
        "GELU", "libtorch's gelu (hearth::ops::gelu falls back to it without AVX2)");
    return {at::mul(grads[0], ctx->get_saved_variables()[0])};
  }
};

}  // namespace

extern "C" {

// out = GELU(x), exact (erf) form. A float32 CPU tensor that needs a
// gradient, on a CPU with AVX2 and FMA, takes the fused path above; anything
// else libtorch's at::gelu.
char *hearth_gelu(at::Tensor *x, at::Tensor **out) {
  return hearth_abi::guarded([&] {
    const bool fused = hearth_avx2::kernels_run_here() && x->device().is_cpu() &&
                       x->scalar_type() == at::kFloat && x->requires_grad() &&
                       torch::autograd::GradMode::is_enabled();
    *out = new at::Tensor(fused ? GeluSavingDerivative::apply(*x) : at::gelu(*x));
  });
}

// Whether hearth_gelu can take its fused path on this CPU.
bool hearth_gelu_fused_available() { return hearth_avx2::kernels_run_here(); }

}  // extern "C"

// Multi-head self-attention from a packed qkv projection, as an autograd
// function over hearth's own kernels (attention_avx2.cpp) for short float32
// (or bf16/float16, computed in float32) sequences on CPUs with AVX2 and
// FMA; elsewhere libtorch's
// scaled_dot_product_attention on views of the same projection.
//
// Besides the kernels' speed, taking the packed projection saves two copies
// a layer: the output comes out as [B, T, H*D] (no transpose and reshape
// after), and the gradient goes back as one [B, T, 3*H*D] tensor (no `cat`
// of the q, k and v gradients behind the split).

#include "avx2_kernels.h"
#include "guarded.h"

#include <ATen/Parallel.h>
#include <ATen/autocast_mode.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/scaled_dot_product_attention.h>
#include <torch/csrc/autograd/custom_function.h>

#include <stdexcept>
#include <string>

#if defined(__x86_64__)
extern "C" void hearth_attention_forward_kernel(const float *qkv, float *out, float *lse,
                                                int64_t B, int64_t T, int64_t H, int64_t D,
                                                bool causal, int64_t begin, int64_t end,
                                                int32_t code);
extern "C" void hearth_attention_backward_kernel(const float *qkv, const float *lse,
                                                 const float *dout, float *dqkv, int64_t B,
                                                 int64_t T, int64_t H, int64_t D, bool causal,
                                                 int64_t begin, int64_t end, int32_t code);
#endif

namespace {

// The longest sequence the kernels take: each thread keeps two T x T float
// buffers (2 MiB at 512), and beyond that libtorch's flash kernel, which
// never holds a whole row of scores, is the better tool.
constexpr int64_t kMaxFusedLength = 512;

struct Dims {
  int64_t B, T, H, D;
};

Dims dims(const at::Tensor &qkv, int64_t heads) {
  if (qkv.dim() != 3 || qkv.size(2) % 3 != 0)
    throw std::invalid_argument("self_attention takes qkv of shape [batch, time, 3 * d_model], got " +
                                std::to_string(qkv.dim()) + " dimensions");
  const int64_t d = qkv.size(2) / 3;
  if (heads <= 0 || d % heads != 0)
    throw std::invalid_argument("self_attention: d_model " + std::to_string(d) +
                                " is not a multiple of the " + std::to_string(heads) + " heads");
  return {qkv.size(0), qkv.size(1), heads, d / heads};
}

// A projection CPU autocast gave in bf16 or float16: the kernels take it
// converted to float32 (see hearth_self_attention). Outside autocast a
// bf16 projection means bf16 parameters (a bf16 model, FSDP's param_dtype)
// and keeps libtorch's bf16 attention, the arithmetic PyTorch runs there.
bool lower_precision(const at::Tensor &qkv) {
  return (qkv.scalar_type() == at::kBFloat16 || qkv.scalar_type() == at::kHalf) &&
         at::autocast::is_autocast_enabled(at::kCPU);
}

// Whether hearth's kernels take qkv, when `kernels` asks for them.
bool fused_path_takes(const at::Tensor &qkv, const Dims &g, int32_t kernels) {
  return qkv.device().is_cpu() && (qkv.scalar_type() == at::kFloat || lower_precision(qkv)) &&
         g.D % 8 == 0 && g.T >= 1 && g.T <= kMaxFusedLength && g.B >= 1 &&
         hearth_avx2::kernels_asked(kernels);
}

struct FusedSelfAttention : torch::autograd::Function<FusedSelfAttention> {
  static at::Tensor forward(torch::autograd::AutogradContext *ctx, const at::Tensor &packed,
                            int64_t heads, bool causal, int64_t kernels) {
    const Dims g = dims(packed, heads);
    const at::Tensor qkv = packed.contiguous();
    at::Tensor out = at::empty({g.B, g.T, g.H * g.D}, qkv.options());
    at::Tensor lse = at::empty({g.B, g.H, g.T}, qkv.options());
#if defined(__x86_64__)
    const float *x = qkv.const_data_ptr<float>();
    float *o = out.mutable_data_ptr<float>(), *l = lse.mutable_data_ptr<float>();
    at::parallel_for(0, g.B * g.H, 1, [&](int64_t begin, int64_t end) {
      hearth_attention_forward_kernel(x, o, l, g.B, g.T, g.H, g.D, causal, begin, end,
                                      int32_t(kernels));
    });
#endif
    ctx->save_for_backward({qkv, lse});
    ctx->saved_data["heads"] = heads;
    ctx->saved_data["causal"] = causal;
    ctx->saved_data["kernels"] = kernels;
    return out;
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext *ctx,
                                                 torch::autograd::variable_list grads) {
    hearth_avx2::refuse_create_graph("attention", "libtorch's scaled_dot_product_attention");
    const auto saved = ctx->get_saved_variables();
    const at::Tensor &qkv = saved[0], &lse = saved[1];
    const Dims g = dims(qkv, ctx->saved_data["heads"].toInt());
    const bool causal = ctx->saved_data["causal"].toBool();
    const auto kernels = int32_t(ctx->saved_data["kernels"].toInt());
    const at::Tensor dout = grads[0].contiguous();
    at::Tensor dqkv = at::empty_like(qkv);
#if defined(__x86_64__)
    const float *x = qkv.const_data_ptr<float>(), *l = lse.const_data_ptr<float>(),
                *dO = dout.const_data_ptr<float>();
    float *dx = dqkv.mutable_data_ptr<float>();
    at::parallel_for(0, g.B * g.H, 1, [&](int64_t begin, int64_t end) {
      hearth_attention_backward_kernel(x, l, dO, dx, g.B, g.T, g.H, g.D, causal, begin, end,
                                       kernels);
    });
#endif
    return {dqkv, at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

// libtorch's attention on q, k and v viewed out of qkv, its output back to
// [B, T, H*D].
at::Tensor libtorch_attention(const at::Tensor &qkv, const Dims &g, bool causal) {
  const auto parts = qkv.split(g.H * g.D, -1);
  // reshape: the projection may come from a rewritten TorchScript graph
  // (jit_fuse.cpp) as a strided view, where view would refuse it.
  auto heads = [&](const at::Tensor &x) { return x.reshape({g.B, g.T, g.H, g.D}).transpose(1, 2); };
  return at::scaled_dot_product_attention(heads(parts[0]), heads(parts[1]), heads(parts[2]), {},
                                          0.0, causal)
      .transpose(1, 2)
      .reshape({g.B, g.T, g.H * g.D});
}

}  // namespace

extern "C" {

// out = multi-head attention of the packed projection qkv [B, T, 3*H*D]
// (q | k | v) with `heads` heads, causal or not: [B, T, H*D]; `kernels` is
// hearth_kernels' path and mutation.
//
// A bf16 or float16 projection under CPU autocast (mixed precision) runs
// the float32 kernels on its float32 copy and gives the output back in its
// own precision; autograd converts the gradient on the way back. The
// copies are [B, T, 4d] elements; libtorch's reduced-precision attention
// on the CPU converts inside its kernel as well, and its backward is
// several times slower than the float32 kernels'.
char *hearth_self_attention(at::Tensor *qkv, int64_t heads, bool causal, int32_t kernels,
                            at::Tensor **out) {
  return hearth_abi::guarded([&] {
    const Dims g = dims(*qkv, heads);
    if (!fused_path_takes(*qkv, g, kernels)) {
      *out = new at::Tensor(libtorch_attention(*qkv, g, causal));
      return;
    }
    if (!lower_precision(*qkv)) {
      *out = new at::Tensor(FusedSelfAttention::apply(*qkv, heads, causal, int64_t(kernels)));
      return;
    }
    *out = new at::Tensor(
        FusedSelfAttention::apply(qkv->to(at::kFloat), heads, causal, int64_t(kernels))
            .to(qkv->scalar_type()));
  });
}

// Whether hearth_self_attention runs hearth's kernels for qkv with `heads`
// under `kernels`.
bool hearth_self_attention_fused(at::Tensor *qkv, int64_t heads, int32_t kernels) {
  try {
    return fused_path_takes(*qkv, dims(*qkv, heads), kernels);
  } catch (...) {
    return false;
  }
}

}  // extern "C"

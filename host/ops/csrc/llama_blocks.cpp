// The operators the graph pass puts where a Llama-family block's chains
// were (jit_fuse.cpp's PATTERNS): hearth::rms_norm, hearth::swiglu and
// hearth::rotary. Each is an autograd function over hearth's kernels
// (llama_blocks_avx2.cpp) for float32 CPU tensors where the kernel path
// (kernel_paths.h) the graph pass gave them asks for them, and elsewhere the very chain it replaced,
// op for op, so that a graph runs as exported wherever the kernels do not.
// What each computes is written beside its kernels.

#include "avx2_kernels.h"
#include "guarded.h"

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/rsqrt.h>
#include <ATen/ops/silu.h>
#include <ATen/ops/zeros.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/library.h>

#include <atomic>
#include <stdexcept>
#include <vector>

#if defined(__x86_64__)
extern "C" {
void hearth_rms_norm_forward_avx2(const float *x, const float *w, float *y, float *rstd,
                                  int64_t rows, int64_t n, float eps, int32_t mutation);
void hearth_rms_norm_backward_avx2(const float *x, const float *w, const float *rstd,
                                   const float *g, float *dx, float *dw, int64_t rows, int64_t n,
                                   int32_t mutation);
void hearth_swiglu_forward_avx2(const float *a, const float *b, float *y, int64_t n,
                                int32_t mutation);
void hearth_swiglu_backward_avx2(const float *a, const float *b, const float *g, float *da,
                                 float *db, int64_t n, int32_t mutation);
void hearth_rotary_row_avx2(const float *x, const float *c, const float *s, float *y, int64_t d,
                            bool transpose, int32_t mutation);
}
#endif

namespace hearth_llama {

// libtorch's grain for elementwise loops, in elements.
constexpr int64_t kGrain = 32768;

bool kernels_for(const std::vector<at::Tensor> &tensors, int64_t code) {
  for (const auto &t : tensors)
    if (!t.defined() || !t.device().is_cpu() || t.scalar_type() != at::kFloat) return false;
  return hearth_avx2::kernels_asked(int32_t(code));
}

int32_t mutation(int32_t code) { return int32_t(hearth_kernels::mutation_of(code)); }

// ---- RMSNorm: weight * (x * rsqrt(mean(x^2, -1) + eps)) --------------------

at::Tensor rms_norm_chain(const at::Tensor &x, const at::Tensor &weight, double eps) {
  const at::Tensor h = x.to(at::kFloat);
  return weight * (h * at::rsqrt(h.pow(2).mean({-1}, true) + eps));
}

struct RmsNorm : torch::autograd::Function<RmsNorm> {
  static at::Tensor forward(torch::autograd::AutogradContext *ctx, const at::Tensor &input,
                            const at::Tensor &weight, double eps, int64_t code) {
    const at::Tensor x = input.contiguous(), w = weight.contiguous();
    const int64_t n = x.size(-1), rows = x.numel() / n;
    at::Tensor y = at::empty_like(x), rstd = at::empty({rows}, x.options());
#if defined(__x86_64__)
    const float *xp = x.const_data_ptr<float>(), *wp = w.const_data_ptr<float>();
    float *yp = y.mutable_data_ptr<float>(), *rp = rstd.mutable_data_ptr<float>();
    at::parallel_for(0, rows, std::max<int64_t>(1, kGrain / n), [&](int64_t begin, int64_t end) {
      hearth_rms_norm_forward_avx2(xp + begin * n, wp, yp + begin * n, rp + begin, end - begin, n,
                                   float(eps), mutation(int32_t(code)));
    });
#endif
    ctx->save_for_backward({x, w, rstd});
    ctx->saved_data["code"] = code;
    return y;
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext *ctx,
                                                 torch::autograd::variable_list grads) {
    hearth_avx2::refuse_create_graph("RMSNorm", "fuse-graph = false");
    const auto saved = ctx->get_saved_variables();
    const at::Tensor &x = saved[0], &w = saved[1], &rstd = saved[2];
    const at::Tensor g = grads[0].contiguous();
    const int64_t n = x.size(-1), rows = x.numel() / n;
    const int32_t code = int32_t(ctx->saved_data["code"].toInt());
    at::Tensor dx = at::empty_like(x);
    // Each chunk of rows adds into its own row of partial weight gradients.
    const int64_t chunks = std::max<int64_t>(1, std::min<int64_t>(rows, at::get_num_threads()));
    at::Tensor dw = at::zeros({chunks, n}, x.options());
#if defined(__x86_64__)
    const float *xp = x.const_data_ptr<float>(), *wp = w.const_data_ptr<float>(),
                *rp = rstd.const_data_ptr<float>(), *gp = g.const_data_ptr<float>();
    float *dxp = dx.mutable_data_ptr<float>(), *dwp = dw.mutable_data_ptr<float>();
    const int64_t per = (rows + chunks - 1) / chunks;
    at::parallel_for(0, chunks, 1, [&](int64_t begin, int64_t end) {
      for (int64_t c = begin; c < end; ++c) {
        const int64_t lo = c * per, hi = std::min(rows, lo + per);
        if (lo >= hi) continue;
        hearth_rms_norm_backward_avx2(xp + lo * n, wp, rp + lo, gp + lo * n, dxp + lo * n,
                                      dwp + c * n, hi - lo, n, mutation(code));
      }
    });
#endif
    return {dx, dw.sum(0), at::Tensor(), at::Tensor()};
  }
};

// The chain's inputs: x of any floating dtype, weight a float32 vector of
// x's last size (the pattern's casts to float32 are part of the chain).
at::Tensor rms_norm_with(const at::Tensor &x, const at::Tensor &weight, double eps, int64_t code) {
  if (!kernels_for({x, weight}, code) || x.dim() < 1 || weight.dim() != 1 ||
      weight.size(0) != x.size(-1) || x.numel() == 0) {
    return rms_norm_chain(x, weight, eps);
  }
  return RmsNorm::apply(x, weight, eps, code);
}

// ---- SwiGLU: silu(a) * b ---------------------------------------------------

struct SwiGlu : torch::autograd::Function<SwiGlu> {
  static at::Tensor forward(torch::autograd::AutogradContext *ctx, const at::Tensor &gate,
                            const at::Tensor &up, int64_t code) {
    const at::Tensor a = gate.contiguous(), b = up.contiguous();
    at::Tensor y = at::empty_like(a);
#if defined(__x86_64__)
    const float *ap = a.const_data_ptr<float>(), *bp = b.const_data_ptr<float>();
    float *yp = y.mutable_data_ptr<float>();
    at::parallel_for(0, a.numel(), kGrain, [&](int64_t begin, int64_t end) {
      hearth_swiglu_forward_avx2(ap + begin, bp + begin, yp + begin, end - begin,
                                 mutation(int32_t(code)));
    });
#endif
    ctx->save_for_backward({a, b});
    ctx->saved_data["code"] = code;
    return y;
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext *ctx,
                                                 torch::autograd::variable_list grads) {
    hearth_avx2::refuse_create_graph("SwiGLU", "fuse-graph = false");
    const auto saved = ctx->get_saved_variables();
    const at::Tensor &a = saved[0], &b = saved[1];
    const at::Tensor g = grads[0].contiguous();
    const int32_t code = int32_t(ctx->saved_data["code"].toInt());
    at::Tensor da = at::empty_like(a), db = at::empty_like(b);
#if defined(__x86_64__)
    const float *ap = a.const_data_ptr<float>(), *bp = b.const_data_ptr<float>(),
                *gp = g.const_data_ptr<float>();
    float *dap = da.mutable_data_ptr<float>(), *dbp = db.mutable_data_ptr<float>();
    at::parallel_for(0, a.numel(), kGrain, [&](int64_t begin, int64_t end) {
      hearth_swiglu_backward_avx2(ap + begin, bp + begin, gp + begin, dap + begin, dbp + begin,
                                  end - begin, mutation(code));
    });
#endif
    return {da, db, at::Tensor()};
  }
};

at::Tensor swiglu_with(const at::Tensor &gate, const at::Tensor &up, int64_t code) {
  if (!kernels_for({gate, up}, code) || !gate.sizes().equals(up.sizes())) {
    return at::silu(gate) * up;
  }
  return SwiGlu::apply(gate, up, code);
}

// ---- rotary: x * cos + rotate_half(x) * sin ---------------------------------

at::Tensor rotary_chain(const at::Tensor &x, const at::Tensor &cos, const at::Tensor &sin) {
  const int64_t half = x.size(-1) / 2;
  const at::Tensor rotated = at::cat({-x.narrow(-1, half, x.size(-1) - half), x.narrow(-1, 0, half)}, -1);
  return x * cos + rotated * sin;
}

// Row by row over x's leading dimensions (any strides, the last one 1), cos
// and sin expanded to x's shape: out (laid out as x) = the map of each row.
void rotary_rows(const at::Tensor &x, const at::Tensor &cos, const at::Tensor &sin,
                 const at::Tensor &out, bool transpose, int32_t code) {
  const int64_t dims = x.dim(), d = x.size(-1);
  int64_t rows = 1;
  for (int64_t i = 0; i + 1 < dims; ++i) rows *= x.size(i);
  const float *xp = x.const_data_ptr<float>(), *cp = cos.const_data_ptr<float>(),
              *sp = sin.const_data_ptr<float>();
  float *op = out.mutable_data_ptr<float>();
  at::parallel_for(0, rows, std::max<int64_t>(1, kGrain / d), [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      // The row's offset in each tensor, from its index in x's leading sizes.
      int64_t rest = row, ox = 0, oc = 0, os = 0, oo = 0;
      for (int64_t i = dims - 2; i >= 0; --i) {
        const int64_t idx = rest % x.size(i);
        rest /= x.size(i);
        ox += idx * x.stride(i);
        oc += idx * cos.stride(i);
        os += idx * sin.stride(i);
        oo += idx * out.stride(i);
      }
#if defined(__x86_64__)
      hearth_rotary_row_avx2(xp + ox, cp + oc, sp + os, op + oo, d, transpose, mutation(code));
#endif
    }
  });
}

struct Rotary : torch::autograd::Function<Rotary> {
  static at::Tensor forward(torch::autograd::AutogradContext *ctx, const at::Tensor &x,
                            const at::Tensor &cos, const at::Tensor &sin, int64_t code) {
    at::Tensor y = at::empty_like(x);
    rotary_rows(x, cos, sin, y, false, int32_t(code));
    ctx->save_for_backward({cos, sin});
    ctx->saved_data["code"] = code;
    return y;
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext *ctx,
                                                 torch::autograd::variable_list grads) {
    hearth_avx2::refuse_create_graph("rotary embedding", "fuse-graph = false");
    const auto saved = ctx->get_saved_variables();
    at::Tensor g = grads[0];
    if (g.stride(-1) != 1) g = g.contiguous();
    at::Tensor dx = at::empty_like(g);
    rotary_rows(g, saved[0].expand(g.sizes()), saved[1].expand(g.sizes()), dx, true,
                int32_t(ctx->saved_data["code"].toInt()));
    return {dx, at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

// The kernels take x with an even last size and unit stride there, and cos
// and sin (no gradient wanted: transformers computes them from a buffer)
// that broadcast to x's shape without changing its dtype.
at::Tensor rotary_with(const at::Tensor &x, const at::Tensor &cos, const at::Tensor &sin,
                       int64_t code) {
  bool fits = kernels_for({x, cos, sin}, code) && x.dim() >= 1 && x.size(-1) % 2 == 0 &&
              x.stride(-1) == 1 && cos.dim() == x.dim() && sin.dim() == x.dim() &&
              !cos.requires_grad() && !sin.requires_grad() && x.numel() > 0;
  for (int64_t i = 0; fits && i < x.dim(); ++i) {
    fits = (cos.size(i) == x.size(i) || cos.size(i) == 1) && (sin.size(i) == x.size(i) || sin.size(i) == 1);
  }
  if (!fits) return rotary_chain(x, cos, sin);
  at::Tensor c = cos.expand(x.sizes()), s = sin.expand(x.sizes());
  if (c.stride(-1) != 1) c = c.contiguous();
  if (s.stride(-1) != 1) s = s.contiguous();
  return Rotary::apply(x, c, s, code);
}

}  // namespace hearth_llama

TORCH_LIBRARY_FRAGMENT(hearth, m) {
  // `kernels`: the kernel path (kernel_paths.h) the graph was fused with.
  m.def("rms_norm(Tensor x, Tensor weight, float eps, int kernels) -> Tensor");
  m.def("swiglu(Tensor gate, Tensor up, int kernels) -> Tensor");
  m.def("rotary(Tensor x, Tensor cos, Tensor sin, int kernels) -> Tensor");
}

TORCH_LIBRARY_IMPL(hearth, CompositeImplicitAutograd, m) {
  m.impl("rms_norm", hearth_llama::rms_norm_with);
  m.impl("swiglu", hearth_llama::swiglu_with);
  m.impl("rotary", hearth_llama::rotary_with);
}

extern "C" {

// The operators above by the kernels `code` names (`csrc/kernel_paths.h`):
// the tests' entries, which pick a path and mutation per call.
char *hearth_rms_norm(at::Tensor *x, at::Tensor *weight, double eps, int32_t code,
                      at::Tensor **out) {
  return hearth_abi::guarded(
      [&] { *out = new at::Tensor(hearth_llama::rms_norm_with(*x, *weight, eps, code)); });
}

char *hearth_swiglu(at::Tensor *gate, at::Tensor *up, int32_t code, at::Tensor **out) {
  return hearth_abi::guarded(
      [&] { *out = new at::Tensor(hearth_llama::swiglu_with(*gate, *up, code)); });
}

char *hearth_rotary(at::Tensor *x, at::Tensor *cos, at::Tensor *sin, int32_t code,
                    at::Tensor **out) {
  return hearth_abi::guarded(
      [&] { *out = new at::Tensor(hearth_llama::rotary_with(*x, *cos, *sin, code)); });
}

}  // extern "C"

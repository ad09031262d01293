// The few ATen kernels hearth needs that tch 0.24 does not bind: libtorch's
// fused optimizer steps and the foreach norm used by gradient clipping.
//
// Every function takes tch's tensor handles (`at::Tensor*`), never throws
// across the C boundary, and returns NULL on success or an error message that
// the caller releases with `hearth_free_error`.

#include <ATen/core/Tensor.h>
#include <ATen/ops/_foreach_add.h>
#include <ATen/ops/_foreach_mul.h>
#include <ATen/ops/_foreach_norm.h>
#include <ATen/ops/_fused_adamw.h>
#include <ATen/ops/_fused_sgd.h>

#include <cstdlib>
#include <cstring>
#include <exception>
#include <vector>

namespace {

std::vector<at::Tensor> gather(at::Tensor **tensors, size_t n) {
  std::vector<at::Tensor> out;
  out.reserve(n);
  for (size_t i = 0; i < n; ++i) out.push_back(*tensors[i]);
  return out;
}

char *message(const char *what) { return strdup(what ? what : "unknown C++ error"); }

template <typename F> char *guarded(F &&f) {
  try {
    f();
    return nullptr;
  } catch (const std::exception &e) {
    return message(e.what());
  } catch (...) {
    return message(nullptr);
  }
}

}  // namespace

extern "C" {

void hearth_free_error(char *error) { free(error); }

// One AdamW step over `n` parameters, as torch.optim.AdamW(fused=True) does
// it: the per-parameter step counters are incremented first, then the fused
// kernel updates parameters and moments in place.
char *hearth_fused_adamw(at::Tensor **params, at::Tensor **grads, at::Tensor **exp_avgs,
                         at::Tensor **exp_avg_sqs, at::Tensor **steps, size_t n, double lr,
                         double beta1, double beta2, double weight_decay, double eps) {
  return guarded([&] {
    auto p = gather(params, n), g = gather(grads, n), m = gather(exp_avgs, n),
         v = gather(exp_avg_sqs, n), s = gather(steps, n);
    at::_foreach_add_(s, 1);
    at::_fused_adamw_(p, g, m, v, {}, s, lr, beta1, beta2, weight_decay, eps,
                      /*amsgrad=*/false, /*maximize=*/false);
  });
}

// One SGD step (weight decay, momentum, dampening, Nesterov) with libtorch's
// fused kernel; `first_step` initialises the momentum buffers from the grads.
char *hearth_fused_sgd(at::Tensor **params, at::Tensor **grads, at::Tensor **momentum_buffers,
                       size_t n, double lr, double momentum, double dampening,
                       double weight_decay, bool nesterov, bool first_step) {
  return guarded([&] {
    auto p = gather(params, n), g = gather(grads, n);
    std::vector<at::Tensor> b;
    if (momentum != 0.0) b = gather(momentum_buffers, n);
    at::_fused_sgd_(p, g, b, weight_decay, momentum, lr, dampening, nesterov,
                    /*maximize=*/false, first_step);
  });
}

// The L2 norm of every tensor (one kernel launch on CUDA); `out[i]` receives
// a new 0-dim tensor owned by the caller.
char *hearth_foreach_norm(at::Tensor **tensors, size_t n, at::Tensor **out) {
  return guarded([&] {
    auto norms = at::_foreach_norm(gather(tensors, n), 2);
    for (size_t i = 0; i < n; ++i) out[i] = new at::Tensor(std::move(norms[i]));
  });
}

// tensors[i] *= factor, where `factor` is a 0-dim tensor (no host sync).
char *hearth_foreach_mul_(at::Tensor **tensors, size_t n, at::Tensor *factor) {
  return guarded([&] {
    auto t = gather(tensors, n);
    at::_foreach_mul_(t, *factor);
  });
}

}  // extern "C"

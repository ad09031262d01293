// The few ATen pieces hearth needs that tch 0.24 does not bind: libtorch's
// fused optimizer steps, the foreach norm used by gradient clipping, the AMP
// kernels of the gradient scaler, autocast on any device type, and the
// state of the default random generators.
//
// Every function takes tch's tensor handles (`at::Tensor*`), never throws
// across the C boundary, and returns NULL on success or an error message that
// the caller releases with `hearth_free_error`.

#include "guarded.h"
#include <ATen/CPUGeneratorImpl.h>
#include <ATen/Context.h>
#include <ATen/Version.h>
#include <ATen/DeviceAccelerator.h>
#include <ATen/autocast_mode.h>
#include <ATen/core/Generator.h>
#include <ATen/detail/CUDAHooksInterface.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/_amp_foreach_non_finite_check_and_unscale.h>
#include <ATen/ops/_amp_update_scale.h>
#include <ATen/ops/_fused_adam.h>
#include <ATen/ops/randperm.h>
#include <ATen/ops/_foreach_add.h>
#include <ATen/ops/_foreach_mul.h>
#include <ATen/ops/_foreach_norm.h>
#include <ATen/ops/_fused_adamw.h>
#include <ATen/ops/_fused_sgd.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/variable.h>
#include <torch/csrc/jit/api/module.h>
#include <torch/csrc/jit/serialization/import.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <mutex>
#include <stdexcept>
#include <string>
#include <vector>

namespace {

std::vector<at::Tensor> gather(at::Tensor **tensors, size_t n) {
  std::vector<at::Tensor> out;
  out.reserve(n);
  for (size_t i = 0; i < n; ++i) out.push_back(*tensors[i]);
  return out;
}

using hearth_abi::guarded;

// Calls `ready(owner, index)` each time autograd has accumulated a gradient
// into the tensor (PyTorch's register_post_accumulate_grad_hook).
struct GradReady final : torch::autograd::PostAccumulateGradHook {
  GradReady(void (*ready)(uint64_t, uint64_t), uint64_t owner, uint64_t index)
      : ready(ready), owner(owner), index(index) {}
  void operator()(const torch::autograd::Variable &) override { ready(owner, index); }
  void (*ready)(uint64_t, uint64_t);
  uint64_t owner;
  uint64_t index;
};

}  // namespace

extern "C" {

void hearth_free_error(char *error) { free(error); }

// One Adam step over `n` parameters, as torch.optim.AdamW(fused=True) does
// it (`decoupled`: weight decay multiplies lr) or torch.optim.Adam(fused=True)
// (L2 decay added to the gradient): the per-parameter step counters are
// incremented first, then the fused kernel updates parameters and moments
// in place.
char *hearth_fused_adam(at::Tensor **params, at::Tensor **grads, at::Tensor **exp_avgs,
                        at::Tensor **exp_avg_sqs, at::Tensor **steps, size_t n, double lr,
                        at::Tensor *lr_tensor, double beta1, double beta2, double weight_decay, double eps,
                        bool decoupled) {
  return guarded([&] {
    auto p = gather(params, n), g = gather(grads, n), m = gather(exp_avgs, n),
         v = gather(exp_avg_sqs, n), s = gather(steps, n);
    at::_foreach_add_(s, 1);
    if (lr_tensor && decoupled) {
      at::_fused_adamw_(p, g, m, v, {}, s, *lr_tensor, beta1, beta2, weight_decay, eps,
                        /*amsgrad=*/false, /*maximize=*/false);
    } else if (lr_tensor) {
      at::_fused_adam_(p, g, m, v, {}, s, *lr_tensor, beta1, beta2, weight_decay, eps,
                       /*amsgrad=*/false, /*maximize=*/false);
    } else if (decoupled) {
      at::_fused_adamw_(p, g, m, v, {}, s, lr, beta1, beta2, weight_decay, eps,
                        /*amsgrad=*/false, /*maximize=*/false);
    } else {
      at::_fused_adam_(p, g, m, v, {}, s, lr, beta1, beta2, weight_decay, eps,
                       /*amsgrad=*/false, /*maximize=*/false);
    }
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
char *hearth_foreach_norm(at::Tensor **tensors, size_t n, double ord, at::Tensor **out) {
  return guarded([&] {
    auto norms = at::_foreach_norm(gather(tensors, n), ord);
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

// grads[i] *= inv_scale, and found_inf (a 1-element float tensor) becomes 1
// when any gradient holds an inf or NaN (GradScaler.unscale_).
char *hearth_amp_unscale_(at::Tensor **grads, size_t n, at::Tensor *found_inf,
                          at::Tensor *inv_scale) {
  return guarded([&] {
    auto g = gather(grads, n);
    at::_amp_foreach_non_finite_check_and_unscale_(g, *found_inf, *inv_scale);
  });
}

// GradScaler.update: backs `scale` off when found_inf, else grows it after
// `growth_interval` clean steps counted in `growth_tracker` (an int tensor).
char *hearth_amp_update_scale_(at::Tensor *scale, at::Tensor *growth_tracker,
                               at::Tensor *found_inf, double growth_factor,
                               double backoff_factor, int64_t growth_interval) {
  return guarded([&] {
    at::_amp_update_scale_(*scale, *growth_tracker, *found_inf, growth_factor, backoff_factor,
                           growth_interval);
  });
}

// Turns autocast on or off for a device type (c10::DeviceType as int) with
// the given dtype (c10::ScalarType as int); the previous state goes to
// `was_enabled` and `was_dtype`. Entering counts a nesting level, leaving
// clears the cast cache when the outermost level ends.
char *hearth_autocast_set(int device_type, bool enabled, int dtype, bool entering,
                          bool *was_enabled, int *was_dtype) {
  return guarded([&] {
    auto dev = static_cast<c10::DeviceType>(device_type);
    *was_enabled = at::autocast::is_autocast_enabled(dev);
    *was_dtype = static_cast<int>(at::autocast::get_autocast_dtype(dev));
    at::autocast::set_autocast_dtype(dev, static_cast<c10::ScalarType>(dtype));
    at::autocast::set_autocast_enabled(dev, enabled);
    if (entering) {
      at::autocast::increment_nesting();
    } else if (at::autocast::decrement_nesting() == 0) {
      at::autocast::clear_cache();
    }
  });
}

// Sets whether autocast caches its casts of leaf tensors (torch.autocast's
// cache_enabled); `*was` receives the setting before.
char *hearth_autocast_cache(bool enabled, bool *was) {
  return guarded([&] {
    *was = at::autocast::is_autocast_cache_enabled();
    at::autocast::set_autocast_cache_enabled(enabled);
  });
}

// The state of the default generator of a device (CPU: index -1) as a new
// uint8 tensor owned by the caller.
char *hearth_rng_get_state(int device_type, int index, at::Tensor **out) {
  return guarded([&] {
    auto dev = at::Device(static_cast<c10::DeviceType>(device_type), index);
    auto gen = at::globalContext().defaultGenerator(dev);
    std::lock_guard<std::mutex> lock(gen.mutex());
    *out = new at::Tensor(gen.get_state());
  });
}

// Restores a state returned by hearth_rng_get_state.
char *hearth_rng_set_state(int device_type, int index, at::Tensor *state) {
  return guarded([&] {
    auto dev = at::Device(static_cast<c10::DeviceType>(device_type), index);
    auto gen = at::globalContext().defaultGenerator(dev);
    std::lock_guard<std::mutex> lock(gen.mutex());
    gen.set_state(*state);
  });
}

// torch.randperm(n, generator=torch.Generator().manual_seed(seed)) with a
// private generator, so no global generator (CPU or CUDA) is touched.
char *hearth_randperm(int64_t n, uint64_t seed, at::Tensor **out) {
  return guarded([&] {
    auto gen = at::make_generator<at::CPUGeneratorImpl>(seed);
    *out = new at::Tensor(at::randperm(n, gen, at::TensorOptions().dtype(at::kLong)));
  });
}

// `torch.manual_seed(seed)` then one `torch.randn(shape, dtype)` per shape
// on the CPU, inside `torch.random.fork_rng()`: drawn in turn from a private
// generator, so the default generator is not touched. `dims` holds the
// shapes one after another, `ndims[i]` the length of shape i.
char *hearth_randn_seeded(const int64_t *dims, const size_t *ndims, size_t count, int dtype,
                          uint64_t seed, at::Tensor **outs) {
  return guarded([&] {
    auto gen = at::make_generator<at::CPUGeneratorImpl>(seed);
    auto options = at::TensorOptions().dtype(static_cast<c10::ScalarType>(dtype));
    for (size_t i = 0; i < count; i++) {
      outs[i] = new at::Tensor(at::randn(at::IntArrayRef(dims, ndims[i]), gen, options));
      dims += ndims[i];
    }
  });
}

// A copy of `t` (on any device) in page-locked host memory, copied straight
// into it (tch's pin_memory copies CPU tensors only and passes a deprecated
// device argument); a GPU copies from and to such memory at full speed.
// The memory is allocated pinned first: `t.to(options.pinned_memory(true))`
// ignores the request (aten's _to_copy pins its result only for a
// non-blocking copy out of a GPU), which left every "pinned" offload shard,
// gradient and checkpoint buffer in pageable memory, copied at 1.3-7 GB/s.
char *hearth_to_pinned_host(at::Tensor *t, at::Tensor **out) {
  return guarded([&] {
    auto pinned = at::empty(t->sizes(), t->options().device(at::kCPU).pinned_memory(true));
    pinned.copy_(*t);
    *out = new at::Tensor(std::move(pinned));
  });
}

// Copies `src` into `dst` without waiting for the device (`copy_(src,
// non_blocking=true)`, which tch does not bind): from a GPU into pinned host
// memory the copy is queued on the current stream and done once the stream
// reaches it.
char *hearth_copy_non_blocking(at::Tensor *dst, at::Tensor *src) {
  return guarded([&] { dst->copy_(*src, /*non_blocking=*/true); });
}

// Drops the gradients of `n` tensors (PyTorch's zero_grad(set_to_none=True)).
char *hearth_clear_grads(at::Tensor **tensors, size_t n) {
  return guarded([&] {
    for (size_t i = 0; i < n; ++i) tensors[i]->mutable_grad().reset();
  });
}

// Sets the gradient of `tensor` to `grad` (PyTorch's `param.grad = grad`).
char *hearth_set_grad(at::Tensor *tensor, at::Tensor *grad) {
  return guarded([&] { tensor->mutable_grad() = *grad; });
}

// After every backward pass that accumulates a gradient into `tensor`, calls
// `ready(owner, index)` on the thread that accumulated it (the caller's for
// CPU tensors, a device thread of the autograd engine for CUDA ones). A
// tensor holds one such hook: this replaces any earlier one. `ready` must
// not throw.
char *hearth_on_grad_accumulated(at::Tensor *tensor, void (*ready)(uint64_t, uint64_t),
                                 uint64_t owner, uint64_t index) {
  return guarded([&] {
    torch::autograd::impl::set_post_acc_grad_hooks(
        *tensor, std::make_unique<GradReady>(ready, owner, index));
  });
}

// Releases the accelerator's cached, unused memory (torch.cuda.empty_cache);
// nothing on a machine without one.
char *hearth_empty_device_cache() {
  return guarded([&] {
    if (at::accelerator::getAccelerator(false).has_value()) at::accelerator::emptyCache();
  });
}

// torch.use_deterministic_algorithms(on) (errors, not warnings), and
// whether it is on.
char *hearth_use_deterministic_algorithms(int on) {
  return guarded([&] { at::globalContext().setDeterministicAlgorithms(on != 0, false); });
}
int hearth_deterministic_algorithms() { return at::globalContext().deterministicAlgorithms() ? 1 : 0; }

// libtorch's CPU level ("DEFAULT", "AVX2", "AVX512", ...: what this CPU has,
// lowered by ATEN_CPU_CAPABILITY) into buf, NUL-terminated and cut to len;
// returns its full length.
size_t hearth_cpu_capability(char *buf, size_t len) {
  const std::string level = at::get_cpu_capability();
  if (len > 0) {
    const size_t n = std::min(len - 1, level.size());
    std::memcpy(buf, level.data(), n);
    buf[n] = '\0';
  }
  return level.size();
}

}  // extern "C"

// A TorchScript module hearth owns (tch's CModule hides its buffers): loaded
// on a device, listed (submodules with their qualified class names, then
// parameters and buffers as new at::Tensor handles sharing the module's own
// tensors, so that set_data on them changes the module), switched between
// training and evaluation, and run.
extern "C" char *hearth_jit_load(const char *path, int cuda_index, void **out) {
  return guarded([&] {
    at::Device device = cuda_index < 0 ? at::Device(at::kCPU) : at::Device(at::kCUDA, cuda_index);
    *out = new torch::jit::Module(torch::jit::load(std::string(path), device));
  });
}

extern "C" void hearth_jit_free(void *module) { delete static_cast<torch::jit::Module *>(module); }

extern "C" char *hearth_jit_list(void *handle,
                                 void (*module)(void *, const char *, const char *),
                                 void (*parameter)(void *, const char *, at::Tensor *),
                                 void (*buffer)(void *, const char *, at::Tensor *), void *ctx) {
  return guarded([&] {
    auto &m = *static_cast<torch::jit::Module *>(handle);
    for (const auto &sub : m.named_modules()) {
      auto name = sub.value.type()->name();
      std::string cls = name ? name->qualifiedName() : std::string();
      module(ctx, sub.name.c_str(), cls.c_str());
    }
    for (const auto &p : m.named_parameters()) parameter(ctx, p.name.c_str(), new at::Tensor(p.value));
    for (const auto &b : m.named_buffers()) buffer(ctx, b.name.c_str(), new at::Tensor(b.value));
  });
}

extern "C" char *hearth_jit_train(void *handle, bool on) {
  return guarded([&] { static_cast<torch::jit::Module *>(handle)->train(on); });
}

// forward(inputs[0], ..., inputs[n-1]): a tensor, or the first element of
// a tuple (transformers' outputs with torchscript=True) when it is one.
extern "C" char *hearth_jit_forward(void *handle, at::Tensor **inputs, int n, at::Tensor **out) {
  return guarded([&] {
    std::vector<c10::IValue> args;
    for (int i = 0; i < n; ++i) args.emplace_back(*inputs[i]);
    auto result = static_cast<torch::jit::Module *>(handle)->forward(args);
    if (result.isTuple()) {
      const auto &elements = result.toTupleRef().elements();
      if (elements.empty()) throw std::runtime_error("forward returned an empty tuple, not a tensor");
      result = elements[0];
    }
    if (!result.isTensor()) {
      throw std::runtime_error("forward returned " + result.tagKind() + ", not a tensor (or a tuple whose first element is one)");
    }
    *out = new at::Tensor(result.toTensor());
  });
}

// The CUDA runtime and cuDNN versions libtorch_cuda was built with (as
// 13000 and 91900), through the CUDA hooks it registers when loaded.
extern "C" char *hearth_cuda_versions(long *cudart, long *cudnn) {
  return guarded([&] {
    const auto &hooks = at::detail::getCUDAHooks();
    *cudart = hooks.versionCUDART();
    *cudnn = hooks.hasCuDNN() ? hooks.versionCuDNN() : 0;
  });
}

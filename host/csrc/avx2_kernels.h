// What the autograd functions over hearth's own AVX2/FMA kernels (the
// hearth_avx2_kernels library: gelu_avx2.cpp, attention_avx2.cpp) share:
// whether the kernels may run on this CPU, checked before every call, and
// the refusal of a second derivative. Included by gelu.cpp and
// attention.cpp, never by the kernels themselves.
#pragma once

#include <torch/csrc/autograd/grad_mode.h>

#include <stdexcept>
#include <string>

namespace hearth_avx2 {

inline bool kernels_run_here() {
#if defined(__x86_64__)
  static const bool yes = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  return yes;
#else
  return false;
#endif
}

// Called first in a fused function's backward: with create_graph=True the
// kernels' gradient would have no history, so a second derivative through
// it would silently be zero. `what` names the function, `instead` what to
// use for that.
inline void refuse_create_graph(const char *what, const char *instead) {
  if (torch::autograd::GradMode::is_enabled())
    throw std::runtime_error(std::string("hearth's fused ") + what +
                             " is differentiable once: a backward pass with create_graph needs " +
                             instead);
}

}  // namespace hearth_avx2

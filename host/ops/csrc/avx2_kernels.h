// What the autograd functions over hearth's own AVX2/FMA kernels (the
// hearth_avx2_kernels library: gelu_avx2.cpp, attention_avx2.cpp, with
// tile_avx512.cpp's AVX-512 tiles on that path) share:
// whether the path hearth::ops chose may run on this CPU, checked before
// every call, and the refusal of a second derivative. Included by gelu.cpp
// and attention.cpp, never by the kernels themselves.
#pragma once

#include "kernel_paths.h"

#include <torch/csrc/autograd/grad_mode.h>

#include <stdexcept>
#include <string>

namespace hearth_avx2 {

inline bool cpu_has_avx2_fma() {
#if defined(__x86_64__)
  static const bool yes = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  return yes;
#else
  return false;
#endif
}

inline bool cpu_has_avx512f() {
#if defined(__x86_64__)
  static const bool yes = cpu_has_avx2_fma() && __builtin_cpu_supports("avx512f");
  return yes;
#else
  return false;
#endif
}

// Whether `code` (hearth_kernels' path and mutation) asks for hearth's
// kernels (AVX2, or AVX2 with AVX-512 tiles); an error where this CPU
// cannot run them (hearth::ops refuses that choice before it gets here, so
// this is the last guard against an illegal instruction).
inline bool kernels_asked(int32_t code) {
  switch (hearth_kernels::path_of(code)) {
    case hearth_kernels::kAvx2:
      if (!cpu_has_avx2_fma())
        throw std::runtime_error(
            "hearth's AVX2 kernels were asked for on a CPU without AVX2 and FMA");
      return true;
    case hearth_kernels::kAvx512:
      if (!cpu_has_avx512f())
        throw std::runtime_error(
            "hearth's AVX-512 kernels were asked for on a CPU without AVX-512F, AVX2 and FMA");
      return true;
    default:
      return false;
  }
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

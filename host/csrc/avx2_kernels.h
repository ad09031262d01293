// Whether hearth's own AVX2/FMA kernels (the hearth_avx2_kernels library:
// gelu_avx2.cpp, attention_avx2.cpp) may run on this CPU. Their callers
// (gelu.cpp, attention.cpp) check it before every call.
#pragma once

namespace hearth_avx2 {

inline bool kernels_run_here() {
#if defined(__x86_64__)
  static const bool yes = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  return yes;
#else
  return false;
#endif
}

}  // namespace hearth_avx2

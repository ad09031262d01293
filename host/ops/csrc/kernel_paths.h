// Which code computes hearth's fused functions, as hearth::ops passes it
// across the C ABI: the path in the low byte, and in the next byte a
// deliberate error that only the kernels' own tests ask for (their mutation
// checks: a test that cannot see a kernel off by a few units in the last
// place is no test). Plain C++, included by the kernels and by the autograd
// functions over them.
#pragma once

#include <cstdint>

namespace hearth_kernels {

enum Path : int32_t {
  kLibtorch = 0,  // libtorch's own operators
  kAvx2 = 1,      // hearth's AVX2 + FMA kernels
  kAvx512 = 2,    // the same, their attention's matrix products in AVX-512
};

enum Mutation : int32_t {
  kExact = 0,
  // exp(x) off by 1e-6 relative, up or down with the sign of the reduced
  // argument (a uniform factor would cancel in softmax, rightly unseen).
  kExpOff = 1,
  // Every result 4 units in the last place further from zero.
  kResultOff = 2,
  // The Llama-family pattern kernels' (llama_blocks_avx2.cpp): every result
  // 2^-14 relative further from zero. Their tests hold whole values to the
  // pytorch_parity bound (64 units of rounding of the largest, plus four
  // times float32 libtorch's own error), which a few units would pass.
  kPatternOff = 3,
};

inline Path path_of(int32_t code) { return Path(code & 0xff); }
inline Mutation mutation_of(int32_t code) { return Mutation((code >> 8) & 0xff); }

}  // namespace hearth_kernels

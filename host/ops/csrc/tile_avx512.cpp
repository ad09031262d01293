// The attention kernels' register tile (register_tile.h) in AVX-512: built
// on its own with -mavx512f (build.rs) and called only where the CPU has
// AVX-512F and hearth's path is avx512 (attention_avx2.cpp, through
// avx512_tiles()). Twice AVX2's columns a register: on the bench GPT's
// heads (T=128, D=32, one thread) attention's forward and backward run
// 1.22x as fast as with the AVX2 tiles (docs/src/benchmarks.md), with the
// same bits.

#include "register_tile.h"

namespace hearth_tiles {

Tiles avx512_tiles() { return tiles_of<Avx512>(); }

}  // namespace hearth_tiles

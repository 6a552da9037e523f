// CPU noise in lanes. Philox words for kLaneBlocks consecutive blocks are laid out word-major,
// so the transforms in common/noise.h vectorise across blocks. Interleaving then puts each lane's
// values back in element order.
//
// Where avx2_enabled() (cpu/platform.h), both steps run hand-vectorised versions: GCC vectorises
// neither Philox's 32 x 32 -> 64-bit multiply nor a four-way interleaving store. Where
// avx512_enabled(), they run AVX-512 versions (16 blocks a vector, all 64 in flight; two-source
// permutes for the interleave). Elsewhere they run portable loops. All give the same bits.
#pragma once

#include <cstdint>

namespace privleak::cpu {

constexpr int64_t kLaneBlocks = 64;

// words[w][j] = word w of Philox block first_block + j of `stream` under `key`.
void philox_lanes(uint64_t key, uint32_t stream, uint64_t first_block, uint32_t (&words)[4][kLaneBlocks]);

// out[k j + lane] = values[lane][j]: a block's k values, block after block. For (float, 4) and
// (double, 2).
template <class T, int k>
void interleave_lanes(const T (&values)[k][kLaneBlocks], T* out);

}  // namespace privleak::cpu

// CPU noise in lanes. Philox words for kLaneBlocks consecutive blocks are laid out word-major,
// so the transforms in common/noise.h vectorise across blocks. Interleaving then puts each lane's
// values back in element order.
//
// x86-64 CPUs with AVX2 run hand-vectorised versions of both steps: GCC vectorises neither
// Philox's 32 x 32 -> 64-bit multiply nor a four-way interleaving store. Other CPUs run the
// portable loops, as does PRIVLEAK_CPU_CAPABILITY=default, read at the first use. That variable
// covers these two steps only; the transform between them is compiler-vectorised, with clones
// chosen by the CPU's features. The bits are the same either way.
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

// "avx2" or "default": which versions run on this CPU.
const char* cpu_capability();

}  // namespace privleak::cpu

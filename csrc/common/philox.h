// Philox4x32-10 (Salmon, Moraes, Dror, Shaw: "Parallel random numbers: as easy as 1, 2, 3", SC 2011),
// the counter-based generator behind privleak's fast noise. Checked against Random123's
// known-answer vectors in tests/test_noise.py.
#pragma once

#include <cstdint>

#include "common/hostdevice.h"

namespace privleak {

struct Words4 {
  uint32_t w[4];
};

PRIVLEAK_HOST_DEVICE void mul_hi_lo(uint32_t a, uint32_t b, uint32_t& hi, uint32_t& lo) {
  const uint64_t product = static_cast<uint64_t>(a) * b;
  hi = static_cast<uint32_t>(product >> 32);
  lo = static_cast<uint32_t>(product);
}

// The round multipliers and the key schedule's Weyl increments.
constexpr uint32_t kPhiloxMul0 = 0xD2511F53u, kPhiloxMul1 = 0xCD9E8D57u;
constexpr uint32_t kPhiloxWeyl0 = 0x9E3779B9u, kPhiloxWeyl1 = 0xBB67AE85u;
constexpr int kPhiloxRounds = 10;

PRIVLEAK_HOST_DEVICE Words4 philox4x32_10(Words4 counter, uint32_t key0, uint32_t key1) {
  uint32_t* c = counter.w;
  PRIVLEAK_UNROLL
  for (int round = 0; round < kPhiloxRounds; ++round) {
    uint32_t hi0, lo0, hi1, lo1;
    mul_hi_lo(kPhiloxMul0, c[0], hi0, lo0);
    mul_hi_lo(kPhiloxMul1, c[2], hi1, lo1);
    const Words4 next{{hi1 ^ c[1] ^ key0, lo1, hi0 ^ c[3] ^ key1, lo0}};
    counter = next;
    key0 += kPhiloxWeyl0;
    key1 += kPhiloxWeyl1;
  }
  return counter;
}

// The random words of block `block` of stream `stream` under a 64-bit key. Streams keep the
// distributions and dtypes apart, so one (key, offset) never feeds two different draws.
// The counter is (block low word, block high word, stream, 0).
PRIVLEAK_HOST_DEVICE Words4 philox_block(uint64_t key, uint32_t stream, uint64_t block) {
  const Words4 counter{{static_cast<uint32_t>(block), static_cast<uint32_t>(block >> 32), stream, 0u}};
  return philox4x32_10(counter, static_cast<uint32_t>(key), static_cast<uint32_t>(key >> 32));
}

}  // namespace privleak

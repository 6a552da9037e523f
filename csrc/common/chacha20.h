// The ChaCha20 block function (RFC 8439, Sec. 2.3): privleak's cryptographically secure,
// counter-based generator for secure-mode noise. Checked against RFC 8439's test vector and the
// `cryptography` package's keystream in tests/test_secure_noise.py.
#pragma once

#include <cstdint>

#include "common/hostdevice.h"

namespace privleak {

struct Words16 {
  uint32_t w[16];
};

PRIVLEAK_HOST_DEVICE uint32_t rotl32(uint32_t x, int n) { return (x << n) | (x >> (32 - n)); }

PRIVLEAK_HOST_DEVICE void quarter_round(uint32_t* s, int a, int b, int c, int d) {
  s[a] += s[b]; s[d] = rotl32(s[d] ^ s[a], 16);
  s[c] += s[d]; s[b] = rotl32(s[b] ^ s[c], 12);
  s[a] += s[b]; s[d] = rotl32(s[d] ^ s[a], 8);
  s[c] += s[d]; s[b] = rotl32(s[b] ^ s[c], 7);
}

// key: 8 words, nonce: 3 words (both as RFC 8439 reads them, little-endian), block counter.
PRIVLEAK_HOST_DEVICE Words16 chacha20_block(const uint32_t* key, uint32_t counter, const uint32_t* nonce) {
  Words16 state{{0x61707865u, 0x3320646eu, 0x79622d32u, 0x6b206574u, key[0], key[1], key[2], key[3], key[4],
                 key[5], key[6], key[7], counter, nonce[0], nonce[1], nonce[2]}};
  Words16 x = state;
  for (int round = 0; round < 10; ++round) {
    quarter_round(x.w, 0, 4, 8, 12);
    quarter_round(x.w, 1, 5, 9, 13);
    quarter_round(x.w, 2, 6, 10, 14);
    quarter_round(x.w, 3, 7, 11, 15);
    quarter_round(x.w, 0, 5, 10, 15);
    quarter_round(x.w, 1, 6, 11, 12);
    quarter_round(x.w, 2, 7, 8, 13);
    quarter_round(x.w, 3, 4, 9, 14);
  }
  for (int i = 0; i < 16; ++i) x.w[i] += state.w[i];
  return x;
}

}  // namespace privleak

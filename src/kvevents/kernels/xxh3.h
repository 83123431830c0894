/* XXH3-64 of short inputs, and the chain of a request's block keys (part of _native.c).
 *
 * Written from the xxHash specification (its published primes and default secret) for
 * inputs of 4 to 240 bytes: blocks of 1 to 60 four-byte tokens. Longer blocks take
 * XXH3's long-input path, with a secret derived from the seed; they are not keyed here,
 * and the caller keys them with the xxhash package (kvevents.wire.hashing). Tokens are
 * hashed as their bytes: the host must be little-endian (kernels/native.py checks).
 */
#ifndef KVEVENTS_XXH3_H
#define KVEVENTS_XXH3_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>

#define MAX_BLOCK_TOKENS 60

static const uint8_t SECRET[192] = {
    0xb8, 0xfe, 0x6c, 0x39, 0x23, 0xa4, 0x4b, 0xbe, 0x7c, 0x01, 0x81, 0x2c,
    0xf7, 0x21, 0xad, 0x1c, 0xde, 0xd4, 0x6d, 0xe9, 0x83, 0x90, 0x97, 0xdb,
    0x72, 0x40, 0xa4, 0xa4, 0xb7, 0xb3, 0x67, 0x1f, 0xcb, 0x79, 0xe6, 0x4e,
    0xcc, 0xc0, 0xe5, 0x78, 0x82, 0x5a, 0xd0, 0x7d, 0xcc, 0xff, 0x72, 0x21,
    0xb8, 0x08, 0x46, 0x74, 0xf7, 0x43, 0x24, 0x8e, 0xe0, 0x35, 0x90, 0xe6,
    0x81, 0x3a, 0x26, 0x4c, 0x3c, 0x28, 0x52, 0xbb, 0x91, 0xc3, 0x00, 0xcb,
    0x88, 0xd0, 0x65, 0x8b, 0x1b, 0x53, 0x2e, 0xa3, 0x71, 0x64, 0x48, 0x97,
    0xa2, 0x0d, 0xf9, 0x4e, 0x38, 0x19, 0xef, 0x46, 0xa9, 0xde, 0xac, 0xd8,
    0xa8, 0xfa, 0x76, 0x3f, 0xe3, 0x9c, 0x34, 0x3f, 0xf9, 0xdc, 0xbb, 0xc7,
    0xc7, 0x0b, 0x4f, 0x1d, 0x8a, 0x51, 0xe0, 0x4b, 0xcd, 0xb4, 0x59, 0x31,
    0xc8, 0x9f, 0x7e, 0xc9, 0xd9, 0x78, 0x73, 0x64, 0xea, 0xc5, 0xac, 0x83,
    0x34, 0xd3, 0xeb, 0xc3, 0xc5, 0x81, 0xa0, 0xff, 0xfa, 0x13, 0x63, 0xeb,
    0x17, 0x0d, 0xdd, 0x51, 0xb7, 0xf0, 0xda, 0x49, 0xd3, 0x16, 0x55, 0x26,
    0x29, 0xd4, 0x68, 0x9e, 0x2b, 0x16, 0xbe, 0x58, 0x7d, 0x47, 0xa1, 0xfc,
    0x8f, 0xf8, 0xb8, 0xd1, 0x7a, 0xd0, 0x31, 0xce, 0x45, 0xcb, 0x3a, 0x8f,
    0x95, 0x16, 0x04, 0x28, 0xaf, 0xd7, 0xfb, 0xca, 0xbb, 0x4b, 0x40, 0x7e,
};

#define P64_1 0x9E3779B185EBCA87ULL
#define MIX_1 0x165667919E3779F9ULL
#define MIX_2 0x9FB21C651E98DF25ULL

static inline uint64_t read64(const uint8_t *p) {
    uint64_t v;
    memcpy(&v, p, 8);
    return v;
}

static inline uint32_t read32(const uint8_t *p) {
    uint32_t v;
    memcpy(&v, p, 4);
    return v;
}

static inline uint64_t rotl64(uint64_t x, int r) { return (x << r) | (x >> (64 - r)); }

static inline uint64_t mul_fold(uint64_t a, uint64_t b) {
    __uint128_t product = (__uint128_t)a * b;
    return (uint64_t)product ^ (uint64_t)(product >> 64);
}

static inline uint64_t avalanche(uint64_t h) {
    h ^= h >> 37;
    h *= MIX_1;
    return h ^ (h >> 32);
}

static inline uint64_t mix16(const uint8_t *in, const uint8_t *secret, uint64_t seed) {
    return mul_fold(read64(in) ^ (read64(secret) + seed), read64(in + 8) ^ (read64(secret + 8) - seed));
}

/* XXH3-64 of len bytes (4 <= len <= 240) with seed. */
static inline uint64_t xxh3_short(const uint8_t *in, size_t len, uint64_t seed) {
    if (len <= 8) {
        seed ^= (uint64_t)__builtin_bswap32((uint32_t)seed) << 32;
        uint64_t bitflip = (read64(SECRET + 8) ^ read64(SECRET + 16)) - seed;
        uint64_t word = (uint64_t)read32(in + len - 4) + ((uint64_t)read32(in) << 32);
        uint64_t h = word ^ bitflip;
        h ^= rotl64(h, 49) ^ rotl64(h, 24);
        h *= MIX_2;
        h ^= (h >> 35) + len;
        h *= MIX_2;
        return h ^ (h >> 28);
    }
    if (len <= 16) {
        uint64_t lo = read64(in) ^ ((read64(SECRET + 24) ^ read64(SECRET + 32)) + seed);
        uint64_t hi = read64(in + len - 8) ^ ((read64(SECRET + 40) ^ read64(SECRET + 48)) - seed);
        return avalanche(len + __builtin_bswap64(lo) + hi + mul_fold(lo, hi));
    }
    uint64_t acc = len * P64_1;
    if (len <= 128) {
        if (len > 32) {
            if (len > 64) {
                if (len > 96) {
                    acc += mix16(in + 48, SECRET + 96, seed);
                    acc += mix16(in + len - 64, SECRET + 112, seed);
                }
                acc += mix16(in + 32, SECRET + 64, seed);
                acc += mix16(in + len - 48, SECRET + 80, seed);
            }
            acc += mix16(in + 16, SECRET + 32, seed);
            acc += mix16(in + len - 32, SECRET + 48, seed);
        }
        acc += mix16(in, SECRET, seed);
        acc += mix16(in + len - 16, SECRET + 16, seed);
        return avalanche(acc);
    }
    for (size_t i = 0; i < 8; i++) acc += mix16(in + 16 * i, SECRET + 16 * i, seed);
    uint64_t acc_end = mix16(in + len - 16, SECRET + 136 - 17, seed);
    acc = avalanche(acc);
    for (size_t i = 8; i < len / 16; i++) acc_end += mix16(in + 16 * i, SECRET + 16 * (i - 8) + 3, seed);
    return avalanche(acc + acc_end);
}

/* The keys of n_blocks blocks of block_size tokens, each block's XXH3-64 seeded by the
 * key before it (parent for the first). 1 <= block_size <= MAX_BLOCK_TOKENS. */
static void chain(const uint8_t *tokens, Py_ssize_t n_blocks, Py_ssize_t block_size, uint64_t parent,
                  uint64_t *out) {
    size_t step = 4 * (size_t)block_size;
    uint64_t key = parent;
    for (Py_ssize_t b = 0; b < n_blocks; b++) {
        key = xxh3_short(tokens + step * b, step, key);
        out[b] = key;
    }
}

#endif

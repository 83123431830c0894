"""Chained content keys in one compiled call: XXH3-64 of every block, seeded by the last.

Computes exactly what :func:`kvevents.wire.hashing.content_keys` computes with one
``xxhash.xxh3_64_intdigest`` call per block, for blocks of 4 to 240 bytes (1 to 60
tokens of 4 bytes): XXH3's short-input paths, which hash with the default secret and
the seed as given. Longer blocks take XXH3's long-input path, with a secret derived
from the seed; they are not compiled here, and the caller keeps the per-block loop for
them (:data:`MAX_BLOCK_TOKENS`).

The algorithm is XXH3 as specified by the xxHash project (the constants below are its
published primes and default secret); :mod:`tests.test_kernels` checks every block size
against the ``xxhash`` package. Input is read as little-endian uint32 words (the tokens
themselves), so every read of 8 bytes is two words and no byte is copied.

Importing this module imports numba and compiles (or loads from numba's cache) the
kernel on first call: load it through :func:`kvevents.kernels.load`.
"""

from __future__ import annotations

import numpy as np
from numba import njit, uint64

__all__ = ["MAX_BLOCK_TOKENS", "SECRET64", "chain_keys", "chain_keys_into"]

MAX_BLOCK_TOKENS = 60
"""Largest block (in 4-byte tokens) the kernel hashes: XXH3's short inputs end at 240 bytes."""

_DEFAULT_SECRET = bytes.fromhex(
    "b8fe6c3923a44bbe7c01812cf721ad1cded46de9839097db7240a4a4b7b3671f"
    "cb79e64eccc0e578825ad07dccff7221b8084674f743248ee03590e6813a264c"
    "3c2852bb91c300cb88d0658b1b532ea371644897a20df94e3819ef46a9deacd8"
    "a8fa763fe39c343ff9dcbbc7c70b4f1d8a51e04bcdb45931c89f7ec9d9787364"
    "eac5ac8334d3ebc3c581a0fffa1363eb170ddd51b7f0da49d316552629d4689e"
    "2b16be587d47a1fc8ff8b8d17ad031ce45cb3a8f95160428afd7fbcabb4b407e"
)
SECRET64 = np.array(
    [int.from_bytes(_DEFAULT_SECRET[i : i + 8], "little") for i in range(len(_DEFAULT_SECRET) - 7)],
    dtype=np.uint64,
)
"""The default secret read as a little-endian uint64 at every byte offset (unaligned
reads become one lookup)."""

_P64_1 = np.uint64(0x9E3779B185EBCA87)
_P64_2 = np.uint64(0xC2B2AE3D27D4EB4F)
_P64_3 = np.uint64(0x165667B19E3779F9)
_MX1 = np.uint64(0x165667919E3779F9)
_MX2 = np.uint64(0x9FB21C651E98DF25)
_LOW32 = np.uint64(0xFFFFFFFF)
_SECRET_SIZE_MIN = 136
_MIDSIZE_LAST_OFFSET = 17
_MIDSIZE_START_OFFSET = 3

# numba widens mixed signed/unsigned arithmetic to float64: every constant and shift
# below is a uint64 on purpose.


@njit(cache=True, inline="always")
def _word64(t, j):
    return uint64(t[j]) | (uint64(t[j + 1]) << uint64(32))


@njit(cache=True, inline="always")
def _rotl(x, r):
    return (x << uint64(r)) | (x >> uint64(64 - r))


@njit(cache=True, inline="always")
def _swap32(x):
    return (
        ((x << uint64(24)) & uint64(0xFF000000))
        | ((x << uint64(8)) & uint64(0x00FF0000))
        | ((x >> uint64(8)) & uint64(0x0000FF00))
        | ((x >> uint64(24)) & uint64(0x000000FF))
    )


@njit(cache=True, inline="always")
def _swap64(x):
    return (_swap32(x & _LOW32) << uint64(32)) | _swap32(x >> uint64(32))


@njit(cache=True, inline="always")
def _mul128_fold64(a, b):
    """Low 64 bits XOR high 64 bits of the 128-bit product a * b."""
    a_lo = a & _LOW32
    a_hi = a >> uint64(32)
    b_lo = b & _LOW32
    b_hi = b >> uint64(32)
    lo_lo = a_lo * b_lo
    hi_lo = a_hi * b_lo
    lo_hi = a_lo * b_hi
    hi_hi = a_hi * b_hi
    cross = (lo_lo >> uint64(32)) + (hi_lo & _LOW32) + lo_hi
    upper = (hi_lo >> uint64(32)) + (cross >> uint64(32)) + hi_hi
    lower = (cross << uint64(32)) | (lo_lo & _LOW32)
    return lower ^ upper


@njit(cache=True, inline="always")
def _avalanche(h):
    h ^= h >> uint64(37)
    h *= _MX1
    return h ^ (h >> uint64(32))


@njit(cache=True, inline="always")
def _rrmxmx(h, length):
    h ^= _rotl(h, 49) ^ _rotl(h, 24)
    h *= _MX2
    h ^= (h >> uint64(35)) + uint64(length)
    h *= _MX2
    return h ^ (h >> uint64(28))


@njit(cache=True, inline="always")
def _mix16(t, j, s, si, seed):
    """XXH3's 16-byte mix of tokens t[j:j+4] with the secret at byte offset si."""
    return _mul128_fold64(_word64(t, j) ^ (s[si] + seed), _word64(t, j + 2) ^ (s[si + 8] - seed))


@njit(cache=True, inline="always")  # a call per block was half the chain's time
def _xxh3_block(t, j, n, s, seed):
    """XXH3-64 of the n tokens t[j:j+n] (4*n bytes, 1 <= n <= 60) with ``seed``."""
    length = uint64(4 * n)
    if n <= 2:  # 4 to 8 bytes
        seed ^= _swap32(seed & _LOW32) << uint64(32)
        bitflip = (s[8] ^ s[16]) - seed
        keyed = (uint64(t[j + n - 1]) + (uint64(t[j]) << uint64(32))) ^ bitflip
        return _rrmxmx(keyed, length)
    if n <= 4:  # 9 to 16 bytes
        lo = _word64(t, j) ^ ((s[24] ^ s[32]) + seed)
        hi = _word64(t, j + n - 2) ^ ((s[40] ^ s[48]) - seed)
        return _avalanche(length + _swap64(lo) + hi + _mul128_fold64(lo, hi))
    acc = length * _P64_1
    if n <= 32:  # 17 to 128 bytes
        if n > 8:
            if n > 16:
                if n > 24:
                    acc += _mix16(t, j + 12, s, 96, seed)
                    acc += _mix16(t, j + n - 16, s, 112, seed)
                acc += _mix16(t, j + 8, s, 64, seed)
                acc += _mix16(t, j + n - 12, s, 80, seed)
            acc += _mix16(t, j + 4, s, 32, seed)
            acc += _mix16(t, j + n - 8, s, 48, seed)
        acc += _mix16(t, j, s, 0, seed)
        acc += _mix16(t, j + n - 4, s, 16, seed)
        return _avalanche(acc)
    for i in range(8):  # 129 to 240 bytes
        acc += _mix16(t, j + 4 * i, s, 16 * i, seed)
    acc_end = _mix16(t, j + n - 4, s, _SECRET_SIZE_MIN - _MIDSIZE_LAST_OFFSET, seed)
    acc = _avalanche(acc)
    for i in range(8, (4 * n) // 16):
        acc_end += _mix16(t, j + 4 * i, s, 16 * (i - 8) + _MIDSIZE_START_OFFSET, seed)
    return _avalanche(acc + acc_end)


@njit(cache=True)
def chain_keys(tokens, block_tokens, parent, secret):
    """Keys of every full block of ``tokens`` (a uint32 array), each block's XXH3-64
    seeded by the key before it (``parent`` for the first), as a uint64 array."""
    out = np.empty(len(tokens) // block_tokens, dtype=np.uint64)
    chain_keys_into(tokens, block_tokens, parent, secret, out)
    return out


@njit(cache=True)
def chain_keys_into(tokens, block_tokens, parent, secret, out):
    """:func:`chain_keys` written into ``out`` (uint64, one slot per full block at least),
    so that a caller holding a buffer makes no array per call. ``parent`` may be given as
    the signed int64 of the same 64 bits (a Python int is unboxed as int64)."""
    key = uint64(parent)
    for b in range(len(tokens) // block_tokens):
        key = _xxh3_block(tokens, b * block_tokens, block_tokens, secret, key)
        out[b] = key

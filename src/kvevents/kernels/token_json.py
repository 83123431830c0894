"""A request body's leading ``"input_ids"`` array, parsed to uint32 in one compiled call.

Routing bodies are ``{"input_ids": [...thousands of ints...], ...}``. Decoding the list
through msgspec builds a Python int per token and then an array from them; this kernel
reads the JSON text straight into a uint32 array instead. It accepts only the plain
case and gives up (``-1``) on anything else, so the caller decodes the whole body the
general way and reports its errors exactly as before:

* the body starts ``{ "input_ids" : [`` (any JSON whitespace between);
* the array holds only integers ``0 .. 2**32 - 1`` written as JSON integers (no sign,
  fraction, exponent or leading zero), separated by commas;
* after its ``]`` comes ``,`` or ``}``: :func:`parse_leading_input_ids` returns the
  index of that character, and the caller decodes the rest of the object itself.

Ids are read eight bytes at a time (:func:`_eight_digits`): one word gives the
number's length, its value and the separator after it, so the loop has no branch that
depends on the digits. For 2,048 ids (about 14 KB of JSON) that took the parse from
about 45 us to 14 us on the benchmark machine. Numbers of 8 digits or more, and the
last few bytes of a body, are read digit by digit.

Import it through :func:`kvevents.kernels.load` (this module imports numba).
"""

from __future__ import annotations

from typing import Any

import numpy as np
from numba import int64, njit, uint32, uint64
from numba.cpython.unsafe.numbers import trailing_zeros as _count_trailing_zeros

__all__ = ["INPUT_IDS_KEY", "parse_input_ids_into", "parse_leading_input_ids"]

INPUT_IDS_KEY = np.frombuffer(b'"input_ids"', dtype=np.uint8).copy()
"""The key the body must start with, quotes included (passed in: numba reads it as an array)."""
_MAX_ID = uint64(0xFFFFFFFF)
_trailing_zeros: Any = _count_trailing_zeros
"""LLVM's count of trailing zero bits (one instruction); typed Any, since mypy sees
the intrinsic's compile-time signature."""


_NO_NUMBER = uint64(1) << uint64(40)
"""Returned for "not a plain id": above every uint32, so one comparison tells."""
_ASCII_ZEROS = uint64(0x3030303030303030)
_PAST_NINE = uint64(0x7676767676767676)  # + 0x76 sets bit 7 of a byte above 9
_HIGH_BITS = uint64(0x8080808080808080)
_WORD = 8
_COMMA_SPACE = uint64(0x202C)  # ", " read as a little-endian pair


@njit(cache=True, inline="always")
def _eight_digits(word):
    """``(value, digits, after)`` of the number that ``word`` (8 bytes of the body read
    as one little-endian word) starts with: ``after`` is the two bytes after the digits (``0``
    where the word ends first). ``value`` is :data:`_NO_NUMBER` when ``digits`` is 0
    (the word does not start with a digit), 8 (all eight are digits: the caller reads
    such long numbers digit by digit) or the number has a leading zero.

    No branch depends on how many digits there are, and the number's end comes from
    one instruction: a digit-by-digit loop spent about 50 cycles an id, mostly on its
    mispredicted exit and on a chain of dependent loads.
    """
    # Byte by byte (little-endian: the first character is the low byte), "digit minus
    # '0'". A byte below '0' borrows from the byte after it and one above '9' may carry
    # into it, but only bytes after the first non-digit are spoiled, and only the first
    # is read: its bit 7 is set in ``stops`` (below '0': it wrapped past 0x80; above
    # '9': adding 0x76 passes 0x7F), while a digit's (0..9, + 0x76 <= 0x7F) is clear.
    x = word - _ASCII_ZEROS
    stops = (x | (x + _PAST_NINE)) & _HIGH_BITS
    if stops == uint64(0):
        return _NO_NUMBER, _WORD, uint64(0)
    width = uint64(_trailing_zeros(stops)) >> uint64(3)  # bytes before the first stop
    digits = int64(width)
    if digits == 0 or (digits > 1 and (x & uint64(0xFF)) == uint64(0)):
        return _NO_NUMBER, digits, uint64(0)  # no digit, or a leading zero
    after = (word >> (width << uint64(3))) & uint64(0xFFFF)
    # The digits to the top bytes (zeros before them), then pairs, fours and eights of
    # digits combined by multiply-and-shift.
    x <<= uint64(8) * (uint64(8) - width)
    x = ((x * uint64(10 * 256 + 1)) >> uint64(8)) & uint64(0x00FF00FF00FF00FF)
    x = ((x * uint64(100 * 65536 + 1)) >> uint64(16)) & uint64(0x0000FFFF0000FFFF)
    x = ((x * uint64((10000 << 32) + 1)) >> uint64(32)) & uint64(0xFFFFFFFF)
    return x, digits, after


@njit(cache=True, inline="always")
def _digits(b, i):
    """``(value, end)`` of the number starting at ``b[i]``, digit by digit;
    ``_NO_NUMBER`` for no digit, a leading zero, past 10 digits or past 2**32 - 1.
    The body ends in ``}``, so the scan stops inside it."""
    first = i
    value = uint64(0)
    digit = uint64(b[i]) - uint64(0x30)
    while digit < uint64(10):
        value = value * uint64(10) + digit
        i += 1
        digit = uint64(b[i]) - uint64(0x30)
    if i == first or i - first > 10 or (i - first > 1 and b[first] == 0x30) or value > _MAX_ID:
        return _NO_NUMBER, i
    return value, i


@njit(cache=True, inline="always")
def _skip_ws(b, i):
    n = len(b)
    while i < n:
        c = b[i]
        if c != 0x20 and c != 0x0A and c != 0x0D and c != 0x09:
            break
        i += 1
    return i


@njit(cache=True)
def parse_leading_input_ids(body, key):
    """``(tokens, end)``: the ids and the index of the ``,`` or ``}`` after the array;
    ``end == -1`` when the body is not the plain case (see the module docstring)."""
    out = np.empty(len(body) // 2 + 1, dtype=np.uint32)
    count, end = parse_input_ids_into(body, key, out)
    return out[: max(count, 0)], end


@njit(cache=True)
def parse_input_ids_into(body, key, out):
    """:func:`parse_leading_input_ids` written into ``out`` (uint32): ``(count, end)``.

    ``body`` and ``key`` may be ``bytes`` (numba reads them in place: no array is made
    per call). ``end == -1``: not the plain case; ``end == -2``: ``out`` is shorter than
    ``len(body) // 2 + 1`` ids, the most a body of that length can hold (nothing read).
    """
    if len(out) < len(body) // 2 + 1:
        return 0, -2
    last = len(body) - 1
    while last >= 0 and (
        body[last] == 0x20 or body[last] == 0x0A or body[last] == 0x0D or body[last] == 0x09
    ):
        last -= 1
    # Ending in "}" bounds every scan below: digits, whitespace and commas all stop there.
    if last < 0 or body[last] != 0x7D:
        return 0, -1
    i = _skip_ws(body, 0)
    if body[i] != 0x7B:  # {
        return 0, -1
    i = _skip_ws(body, i + 1)
    if i + len(key) > last:
        return 0, -1
    for k in range(len(key)):
        if body[i + k] != key[k]:
            return 0, -1
    i = _skip_ws(body, i + len(key))
    if body[i] != 0x3A:  # :
        return 0, -1
    i = _skip_ws(body, i + 1)
    if body[i] != 0x5B:  # [
        return 0, -1
    count = 0
    i = _skip_ws(body, i + 1)
    if body[i] == 0x5D:  # ]
        i += 1
    else:
        wide_end = len(body) - 8  # an 8-byte read at i stays inside the body up to here
        while True:  # at a number, or whitespace before one
            value = _NO_NUMBER
            if i <= wide_end:
                # The word is read here, not in a helper: an array passed to a helper
                # costs a reference count in and out, per id. The index is unsigned, so
                # no negative-index wraparound per byte; the reads become one load.
                j = uint64(i)
                word = (
                    uint64(body[j])
                    | (uint64(body[j + uint64(1)]) << uint64(8))
                    | (uint64(body[j + uint64(2)]) << uint64(16))
                    | (uint64(body[j + uint64(3)]) << uint64(24))
                    | (uint64(body[j + uint64(4)]) << uint64(32))
                    | (uint64(body[j + uint64(5)]) << uint64(40))
                    | (uint64(body[j + uint64(6)]) << uint64(48))
                    | (uint64(body[j + uint64(7)]) << uint64(56))
                )
                value, digits, after = _eight_digits(word)
                if value != _NO_NUMBER:
                    out[count] = uint32(value)
                    count += 1
                    # the separator read from the same word: no load waits on i
                    if after == _COMMA_SPACE:
                        i += digits + 2
                        continue
                    if after & uint64(0xFF) == uint64(0x2C):
                        i += digits + 1
                        continue
                    i += digits
                elif digits == 0:  # not a digit: whitespace before the number, or wrong
                    start = _skip_ws(body, i)
                    if start == i:
                        return 0, -1
                    i = start
                    continue
                elif digits != _WORD:  # a leading zero
                    return 0, -1
            if value == _NO_NUMBER:  # 8 digits or more, or too near the end for a word
                value, i = _digits(body, _skip_ws(body, i))
                if value == _NO_NUMBER:
                    return 0, -1
                out[count] = uint32(value)
                count += 1
            i = _skip_ws(body, i)
            c = body[i]
            if c == 0x2C:
                i += 1
            elif c == 0x5D:  # ]
                i += 1
                break
            else:  # a fraction, an exponent, anything else
                return 0, -1
    i = _skip_ws(body, i)
    if body[i] != 0x2C and body[i] != 0x7D:
        return 0, -1
    return count, i

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

Import it through :func:`kvevents.kernels.load` (this module imports numba).
"""

from __future__ import annotations

import numpy as np
from numba import njit, uint32, uint64

__all__ = ["INPUT_IDS_KEY", "parse_leading_input_ids"]

INPUT_IDS_KEY = np.frombuffer(b'"input_ids"', dtype=np.uint8).copy()
"""The key the body must start with, quotes included (passed in: numba reads it as an array)."""
_MAX_ID = uint64(0xFFFFFFFF)


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
    empty = np.empty(0, dtype=np.uint32)
    last = len(body) - 1
    while last >= 0 and (
        body[last] == 0x20 or body[last] == 0x0A or body[last] == 0x0D or body[last] == 0x09
    ):
        last -= 1
    # Ending in "}" bounds every scan below: digits, whitespace and commas all stop there.
    if last < 0 or body[last] != 0x7D:
        return empty, -1
    i = _skip_ws(body, 0)
    if body[i] != 0x7B:  # {
        return empty, -1
    i = _skip_ws(body, i + 1)
    if i + len(key) > last:
        return empty, -1
    for k in range(len(key)):
        if body[i + k] != key[k]:
            return empty, -1
    i = _skip_ws(body, i + len(key))
    if body[i] != 0x3A:  # :
        return empty, -1
    i = _skip_ws(body, i + 1)
    if body[i] != 0x5B:  # [
        return empty, -1
    out = np.empty((last - i) // 2 + 1, dtype=np.uint32)
    count = 0
    i = _skip_ws(body, i + 1)
    if body[i] == 0x5D:  # ]
        i += 1
    else:
        while True:
            first = i
            digit = uint64(body[i]) - uint64(0x30)
            if digit >= uint64(10):
                return empty, -1
            value = digit
            i += 1
            digit = uint64(body[i]) - uint64(0x30)
            while digit < uint64(10):  # the hot loop: one branch per digit
                value = value * uint64(10) + digit
                i += 1
                digit = uint64(body[i]) - uint64(0x30)
            if i - first > 10 or (i - first > 1 and body[first] == 0x30) or value > _MAX_ID:
                return empty, -1  # past 10 digits, a leading zero, past 2**32 - 1
            out[count] = uint32(value)
            count += 1
            c = body[i]
            if c == 0x2C:  # ",": the usual separator, then the next number at once
                i += 1
                if uint64(body[i]) - uint64(0x30) >= uint64(10):
                    i = _skip_ws(body, i)
                continue
            i = _skip_ws(body, i)
            c = body[i]
            if c == 0x2C:
                i = _skip_ws(body, i + 1)
            elif c == 0x5D:  # ]
                i += 1
                break
            else:  # a fraction, an exponent, anything else
                return empty, -1
    i = _skip_ws(body, i)
    if body[i] != 0x2C and body[i] != 0x7D:
        return empty, -1
    return out[:count], i

/* A request body's leading token-id array, read straight into uint32 (part of _native.c).
 *
 * Only the plain case is read; anything else answers -1 and the caller decodes the whole
 * body the general way (msgspec), so a refused body is worded exactly as before:
 *
 *   the body, past JSON whitespace, is  { ws KEY ws : ws [ ws (id (ws , ws id)*)? ws ]
 *   then ws and a , or }  (whose index is answered), and its last byte past whitespace
 *   is } ; an id is a JSON integer 0..2**32-1 (no sign, fraction, exponent or leading 0).
 *
 * KEY is the bytes given (``"input_ids"`` with its quotes, or whatever the caller says
 * stands between the { and the : ). kvevents/kernels/spec.py states the same grammar in
 * Python; tests and scripts/fuzz-native hold the two equal.
 *
 * Ids are read eight bytes at a time: one word gives the id's length, its value and the
 * separator after it, with no branch on the digits, in one pass over the body (a pass
 * that found the commas first and then read each id apart ran slower on bodies not in
 * the cache). Ids of 8 digits or more, and the last bytes of a body, are read digit by
 * digit. Every read stays inside the body: the scans stop at the final } at the latest,
 * and a word is read only whole.
 */
#ifndef KVEVENTS_TOKEN_JSON_H
#define KVEVENTS_TOKEN_JSON_H

#include <stdint.h>
#include <string.h>

#define NOT_AN_ID ((uint64_t)1 << 40) /* above every uint32: one comparison tells */

static inline int json_space(uint8_t c) { return c == ' ' || c == '\n' || c == '\r' || c == '\t'; }

static inline Py_ssize_t skip_space(const uint8_t *b, Py_ssize_t i, Py_ssize_t n) {
    while (i < n && json_space(b[i])) i++;
    return i;
}

/* The number a little-endian word of the body starts with: its value (NOT_AN_ID when it
 * has no digit, a leading zero, or eight digits: the caller reads those digit by digit),
 * *digits its length, *after the two bytes after it. A byte below '0' borrows from the
 * next one and one above '9' may carry into it, but only bytes past the first non-digit
 * are spoiled, and only that first one is read: its bit 7 is set in ``stops``. */
static inline uint64_t eight_digits(uint64_t word, int *digits, uint64_t *after) {
    uint64_t x = word - 0x3030303030303030ULL;
    uint64_t stops = (x | (x + 0x7676767676767676ULL)) & 0x8080808080808080ULL;
    if (stops == 0) {
        *digits = 8;
        return NOT_AN_ID;
    }
    int width = __builtin_ctzll(stops) >> 3;
    *digits = width;
    if (width == 0 || (width > 1 && (x & 0xFF) == 0)) return NOT_AN_ID;
    *after = (word >> (8 * width)) & 0xFFFF;
    /* the digits to the top bytes, then pairs, fours and eights combined */
    x <<= 8 * (8 - width);
    x = ((x * (10 * 256 + 1)) >> 8) & 0x00FF00FF00FF00FFULL;
    x = ((x * (100 * 65536 + 1)) >> 16) & 0x0000FFFF0000FFFFULL;
    return (x * ((10000ULL << 32) + 1)) >> 32;
}

/* The id at b[i], digit by digit (*end: past its digits); NOT_AN_ID for no digit, a
 * leading zero, or past 2**32 - 1. */
static inline uint64_t digit_by_digit(const uint8_t *b, Py_ssize_t i, Py_ssize_t n, Py_ssize_t *end) {
    Py_ssize_t first = i;
    uint64_t value = 0;
    while (i < n && (uint8_t)(b[i] - '0') < 10) {
        if (i - first < 11) value = value * 10 + (uint64_t)(b[i] - '0');
        i++;
    }
    *end = i;
    if (i == first || i - first > 10 || (i - first > 1 && b[first] == '0') || value > 0xFFFFFFFFULL)
        return NOT_AN_ID;
    return value;
}

/* The index of the , or } after the array, its ids written to ``out`` (room for n / 2 + 1
 * of them) and counted in *count; -1 when the body is not the plain case. */
static Py_ssize_t parse_ids(const uint8_t *b, Py_ssize_t n, const uint8_t *key, Py_ssize_t key_len, uint32_t *out,
                            Py_ssize_t *count) {
    Py_ssize_t last = n - 1;
    while (last >= 0 && json_space(b[last])) last--;
    if (last < 0 || b[last] != '}') return -1;
    /* From here every scan stops at b[last] at the latest: it is no space, digit or comma. */
    Py_ssize_t i = skip_space(b, 0, last);
    if (b[i] != '{') return -1;
    i = skip_space(b, i + 1, last);
    if (key_len > last - i || memcmp(b + i, key, (size_t)key_len) != 0) return -1;
    i = skip_space(b, i + key_len, last);
    if (b[i] != ':') return -1;
    i = skip_space(b, i + 1, last);
    if (b[i] != '[') return -1;
    i = skip_space(b, i + 1, last);
    Py_ssize_t c = 0;
    if (b[i] == ']') {
        i++;
    } else {
        for (;;) { /* at an id, or whitespace before one */
            uint64_t value = NOT_AN_ID;
            if (n - i >= 8) {
                int digits;
                uint64_t after = 0;
                value = eight_digits(read64(b + i), &digits, &after);
                if (value != NOT_AN_ID) {
                    out[c++] = (uint32_t)value;
                    /* the separator, read from the same word: no load waits on i */
                    if (after == 0x202C) { /* ", " */
                        i += digits + 2;
                        continue;
                    }
                    if ((after & 0xFF) == ',') {
                        i += digits + 1;
                        continue;
                    }
                    i += digits;
                } else if (digits == 0) { /* whitespace before the id, or something else */
                    Py_ssize_t start = skip_space(b, i, last);
                    if (start == i) return -1;
                    i = start;
                    continue;
                } else if (digits != 8) { /* a leading zero */
                    return -1;
                }
            }
            if (value == NOT_AN_ID) { /* 8 digits or more, or too near the end for a word */
                value = digit_by_digit(b, skip_space(b, i, last), last, &i);
                if (value == NOT_AN_ID) return -1;
                out[c++] = (uint32_t)value;
            }
            i = skip_space(b, i, last);
            if (b[i] == ',') {
                i++;
            } else if (b[i] == ']') {
                i++;
                break;
            } else { /* a fraction, an exponent, anything else */
                return -1;
            }
        }
    }
    i = skip_space(b, i, last);
    if (b[i] != ',' && b[i] != '}') return -1;
    *count = c;
    return i;
}

#endif

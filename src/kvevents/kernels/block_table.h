/* MaskMirror: the index's block masks in a flat hash table (part of _native.c).
 *
 * The index keeps its blocks in a dict of content key -> holder bitmask
 * (kvevents/index/mask_table.py); a match there is a dict lookup per block through
 * Python objects. This table holds the same masks' GPU tier (``words`` uint64 words
 * per key: 64 holder slots each) in two flat arrays with open addressing and linear
 * probing, so a lookup is a cache line or two and a whole match one call.
 *
 * Invariants:
 * - A slot is empty when its row is all 0 (a block nobody holds is never in the dict,
 *   so a held row is never 0); keys are any uint64.
 * - Deleting shifts the probe run back: no tombstones, a lookup stops at the first empty
 *   slot.
 * - capacity is a power of two, at least 3 * count when built, grown before a sync could
 *   fill half of it: a probe run always ends.
 *
 * The index does not write into it: its writers list the keys they changed and what
 * they did (one holder's bit set or cleared, or the key dropped), and sync() applies the
 * list before the next match. Listing the bit, not the mask, keeps a sync the same few
 * instructions a key at any width. A call that raises leaves the table as it was.
 */
#ifndef KVEVENTS_BLOCK_TABLE_H
#define KVEVENTS_BLOCK_TABLE_H

#include <stdint.h>
#include <string.h>

#define TABLE_MIX 0x9E3779B97F4A7C15ULL
#define MIN_CAPACITY 4096
#define MAX_WORDS 1024 /* 65,536 holder slots */
#define SEGMENTS 65    /* a one-word match's: one per holder, and those holding every block */

typedef struct {
    PyObject_HEAD
    Py_ssize_t words;
    Py_ssize_t capacity;
    Py_ssize_t count;
    Py_ssize_t grown;
    Py_ssize_t rebuilds;
    uint64_t *keys;
    uint64_t *values;    /* a row of ``words`` per slot */
    uint64_t *scratch;   /* wide matches: the live row, the held row, a dropped row per segment */
    Py_ssize_t *lengths; /* wide matches: a length per segment */
    PyObject *live;      /* wide matches: the int whose words scratch starts with, or NULL */
} MaskMirror;

static PyTypeObject MaskMirrorType;
static PyObject *SIXTY_FOUR; /* the int 64, for shifting masks a word at a time */
static PyObject *ZERO;

static inline uint64_t home_of(uint64_t key, uint64_t mask) {
    uint64_t h = key * TABLE_MIX;
    return (h ^ (h >> 32)) & mask;
}

static inline int row_empty(const uint64_t *row, Py_ssize_t words) {
    for (Py_ssize_t w = 0; w < words; w++)
        if (row[w]) return 0;
    return 1;
}

/* The mask (one word) a one-word table holds for ``key``, 0 for none. */
static inline uint64_t lookup1(const uint64_t *keys, const uint64_t *values, uint64_t mask, uint64_t key) {
    uint64_t i = home_of(key, mask);
    for (;;) {
        uint64_t v = values[i];
        if (v == 0) return 0;
        if (keys[i] == key) return v;
        i = (i + 1) & mask;
    }
}

/* The slot of raw arrays holding ``key``, or -1. */
static inline Py_ssize_t find_in(const uint64_t *keys, const uint64_t *values, Py_ssize_t capacity,
                                 Py_ssize_t words, uint64_t key) {
    uint64_t mask = (uint64_t)capacity - 1;
    uint64_t i = home_of(key, mask);
    for (;;) {
        if (row_empty(values + i * words, words)) return -1;
        if (keys[i] == key) return (Py_ssize_t)i;
        i = (i + 1) & mask;
    }
}

/* The slot holding ``key``, or -1. */
static inline Py_ssize_t find_slot(const MaskMirror *t, uint64_t key) {
    return find_in(t->keys, t->values, t->capacity, t->words, key);
}

/* Empty slot ``i``, moving back each later entry of its probe run that may move. */
static void delete_at(MaskMirror *t, uint64_t i) {
    uint64_t mask = (uint64_t)t->capacity - 1;
    Py_ssize_t words = t->words;
    uint64_t *keys = t->keys, *values = t->values;
    uint64_t j = i;
    for (;;) {
        j = (j + 1) & mask;
        if (row_empty(values + j * words, words)) break;
        uint64_t h = home_of(keys[j], mask);
        /* the entry at j stays when its home lies cyclically in (i, j] */
        int stays = i <= j ? (i < h && h <= j) : (i < h || h <= j);
        if (!stays) {
            keys[i] = keys[j];
            memcpy(values + i * words, values + j * words, 8 * (size_t)words);
            i = j;
        }
    }
    keys[i] = 0;
    memset(values + i * words, 0, 8 * (size_t)words);
}

/* Set ``key``'s row (not all 0) in raw arrays with an empty slot left; 1 when the key is new. */
static int put_row(uint64_t *keys, uint64_t *values, Py_ssize_t capacity, Py_ssize_t words, uint64_t key,
                   const uint64_t *row) {
    uint64_t mask = (uint64_t)capacity - 1;
    uint64_t i = home_of(key, mask);
    int fresh = 1;
    while (!row_empty(values + i * words, words)) {
        if (keys[i] == key) {
            fresh = 0;
            break;
        }
        i = (i + 1) & mask;
    }
    keys[i] = key;
    memcpy(values + i * words, row, 8 * (size_t)words);
    return fresh;
}

/* A power of two at least 3n (and MIN_CAPACITY); -1 when that is past any memory. */
static Py_ssize_t capacity_for(Py_ssize_t n) {
    if (n > PY_SSIZE_T_MAX / 64) return -1;
    Py_ssize_t capacity = MIN_CAPACITY;
    while (capacity < 3 * n) capacity *= 2;
    return capacity;
}

/* Fresh zeroed arrays for ``capacity`` slots; 0 with MemoryError set. */
static int table_arrays(Py_ssize_t capacity, Py_ssize_t words, uint64_t **keys, uint64_t **values) {
    *keys = *values = NULL;
    if (capacity < 0 || capacity > PY_SSIZE_T_MAX / 8 / words) {
        PyErr_NoMemory();
        return 0;
    }
    *keys = PyMem_Calloc((size_t)capacity, 8);
    *values = PyMem_Calloc((size_t)capacity * (size_t)words, 8);
    if (*keys == NULL || *values == NULL) {
        PyMem_Free(*keys);
        PyMem_Free(*values);
        *keys = *values = NULL;
        PyErr_NoMemory();
        return 0;
    }
    return 1;
}

/* Grow the table to room for ``n`` keys, filled from itself; 0 with MemoryError set. */
static int grow_to(MaskMirror *t, Py_ssize_t n) {
    Py_ssize_t capacity = capacity_for(n), words = t->words;
    uint64_t *keys, *values;
    if (!table_arrays(capacity, words, &keys, &values)) return 0;
    for (Py_ssize_t j = 0; j < t->capacity; j++) {
        const uint64_t *row = t->values + j * words;
        if (!row_empty(row, words)) put_row(keys, values, capacity, words, t->keys[j], row);
    }
    PyMem_Free(t->keys);
    PyMem_Free(t->values);
    t->keys = keys;
    t->values = values;
    t->capacity = capacity;
    t->grown++;
    return 1;
}

/* Apply one listed write: ``op`` is slot + 1 (set that slot's bit), -(slot + 1) (clear
 * it; a key left with no bit is deleted) or 0 (delete the key); checked by the caller. */
static void apply_op(MaskMirror *t, uint64_t key, int64_t op) {
    Py_ssize_t words = t->words;
    if (op == 0) {
        Py_ssize_t at = find_slot(t, key);
        if (at >= 0) {
            delete_at(t, (uint64_t)at);
            t->count--;
        }
        return;
    }
    int64_t slot = op > 0 ? op - 1 : -op - 1;
    Py_ssize_t word = (Py_ssize_t)(slot / 64);
    uint64_t bit = 1ULL << (slot % 64);
    uint64_t mask = (uint64_t)t->capacity - 1;
    uint64_t i = home_of(key, mask);
    for (;;) {
        uint64_t *row = t->values + i * words;
        if (row_empty(row, words)) {
            if (op > 0) {
                t->keys[i] = key;
                row[word] = bit;
                t->count++;
            }
            return;
        }
        if (t->keys[i] == key) {
            if (op > 0) {
                row[word] |= bit;
            } else {
                row[word] &= ~bit;
                if (row_empty(row, words)) {
                    delete_at(t, i);
                    t->count--;
                }
            }
            return;
        }
        i = (i + 1) & mask;
    }
}

/* ---- masks between Python ints and rows of words ---------------------------------- */

/* ``value``'s low ``words`` words into ``row``; ``exact``: OverflowError when it has bits
 * past them (a live mask), else they are dropped (a mask's offloaded tiers). 0 with an
 * exception set (TypeError for no int, ValueError for a negative one). */
static int words_of(PyObject *value, uint64_t *row, Py_ssize_t words, int exact, const char *what) {
    if (!PyLong_Check(value)) {
        PyErr_Format(PyExc_TypeError, "%s must be an int, not %.100s", what, Py_TYPE(value)->tp_name);
        return 0;
    }
    uint64_t low = PyLong_AsUnsignedLongLong(value);
    if (!(low == (uint64_t)-1 && PyErr_Occurred())) { /* the usual mask: one word */
        row[0] = low;
        if (words > 1) memset(row + 1, 0, 8 * (size_t)(words - 1));
        return 1;
    }
    PyErr_Clear();
    int negative = PyObject_RichCompareBool(value, ZERO, Py_LT);
    if (negative < 0) return 0;
    if (negative) {
        PyErr_Format(PyExc_ValueError, "%s must not be negative", what);
        return 0;
    }
    Py_INCREF(value);
    for (Py_ssize_t w = 0; w < words; w++) {
        row[w] = PyLong_AsUnsignedLongLongMask(value);
        PyObject *rest = PyNumber_Rshift(value, SIXTY_FOUR);
        Py_DECREF(value);
        if (rest == NULL) return 0;
        value = rest;
    }
    int past = PyObject_IsTrue(value);
    Py_DECREF(value);
    if (past < 0) return 0;
    if (past && exact) {
        PyErr_Format(PyExc_OverflowError, "%s has bits past %zd holder slots", what, 64 * words);
        return 0;
    }
    return 1;
}

/* The int of a row of ``words`` words. */
static PyObject *int_of_words(const uint64_t *row, Py_ssize_t words) {
    Py_ssize_t top = words;
    while (top > 1 && row[top - 1] == 0) top--;
    PyObject *value = PyLong_FromUnsignedLongLong(row[top - 1]);
    for (Py_ssize_t w = top - 2; w >= 0 && value != NULL; w--) {
        PyObject *shifted = PyNumber_Lshift(value, SIXTY_FOUR);
        Py_DECREF(value);
        if (shifted == NULL) return NULL;
        PyObject *word = PyLong_FromUnsignedLongLong(row[w]);
        if (word == NULL) {
            Py_DECREF(shifted);
            return NULL;
        }
        value = PyNumber_Or(shifted, word);
        Py_DECREF(shifted);
        Py_DECREF(word);
    }
    return value;
}

/* ---- matching ---------------------------------------------------------------------- */

/* Segments of a one-word match: the holders whose prefix ends at each length (dropped
 * and lengths, ``*found`` of them); answers the longest prefix anyone holds. With a
 * second table (``more_keys`` not NULL), a block counts where either holds it. */
static Py_ssize_t match1(const uint64_t *keys, Py_ssize_t n, const uint64_t *table_keys, const uint64_t *table_values,
                         uint64_t mask, const uint64_t *more_keys, const uint64_t *more_values, uint64_t more_mask,
                         uint64_t live, uint64_t *dropped, Py_ssize_t *lengths, int *found) {
    uint64_t held = live;
    *found = 0;
    for (Py_ssize_t j = 0; j < n; j++) {
        uint64_t value = lookup1(table_keys, table_values, mask, keys[j]);
        if (more_keys != NULL) value |= lookup1(more_keys, more_values, more_mask, keys[j]);
        uint64_t still = held & value;
        if (still != held) {
            if (j > 0) {
                dropped[*found] = held ^ still;
                lengths[*found] = j;
                (*found)++;
            }
            held = still;
            if (held == 0) return j;
        }
    }
    if (n > 0 && held != 0) {
        dropped[*found] = held;
        lengths[*found] = n;
        (*found)++;
        return n;
    }
    return 0;
}

/* match1 over a wide table, alone: ``held`` starts as a copy of ``live``; ``dropped``
 * has a row per segment (room for one per holder, and one). */
static Py_ssize_t match_wide(const MaskMirror *t, const uint64_t *keys, Py_ssize_t n, const uint64_t *live,
                             uint64_t *held, uint64_t *dropped, Py_ssize_t *lengths, Py_ssize_t *found) {
    Py_ssize_t words = t->words;
    memcpy(held, live, 8 * (size_t)words);
    *found = 0;
    for (Py_ssize_t j = 0; j < n; j++) {
        Py_ssize_t at = find_slot(t, keys[j]);
        const uint64_t *row = at < 0 ? NULL : t->values + at * words;
        int changed = 0;
        for (Py_ssize_t w = 0; w < words && !changed; w++) changed = (held[w] & (row ? row[w] : 0)) != held[w];
        if (!changed) continue;
        int remaining = 0;
        uint64_t *out = dropped + *found * words;
        for (Py_ssize_t w = 0; w < words; w++) {
            uint64_t still = held[w] & (row ? row[w] : 0);
            if (j > 0) out[w] = held[w] ^ still;
            held[w] = still;
            remaining |= still != 0;
        }
        if (j > 0) lengths[(*found)++] = j;
        if (!remaining) return j;
    }
    if (n > 0 && !row_empty(held, words)) {
        memcpy(dropped + *found * words, held, 8 * (size_t)words);
        lengths[(*found)++] = n;
        return n;
    }
    return 0;
}

#endif

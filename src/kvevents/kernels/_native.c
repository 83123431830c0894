/* The router's native calls (see kvevents/kernels/native.py).
 *
 * route_answer() keys a request's blocks (XXH3-64 chained, as content_keys does),
 * matches them against the index's flat mirror of GPU masks (kernels/block_table.py's
 * table: open addressing, linear probing) and, when the router holds predictions,
 * against the same mirror of the predictions' masks (a block counts where either holds
 * it), scores every candidate as the router's Ranking does (a stable-loads plan
 * prepared in Python: kvevents/router/decide/native_route.py) and writes the answer's JSON,
 * byte for byte what msgspec writes for the Python path. Anything it cannot answer
 * exactly (a float msgspec would print in exponent form, no available holder) answers
 * None, and the caller takes the Python path. query_answer() keys and matches alike and
 * writes the /query answer: every candidate's match. board_choice() keys and matches
 * alike and picks the best candidates of a request whose loads just changed (a relayed
 * or recorded one), every load read from the load board's table as board_top_scores
 * reads it.
 *
 * XXH3 is written from the xxHash specification (its published primes and default
 * secret), for inputs of 4 to 240 bytes: blocks of 1 to 60 four-byte tokens. The host
 * must be little-endian (the Python side checks): tokens are hashed as their bytes.
 *
 * Compiled with -ffp-contract=off: every float operation rounds as Python's does.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

/* ---- XXH3-64, short inputs ------------------------------------------------------ */

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
#define MAX_BLOCK_TOKENS 60
#define ABI 3 /* the calls' arguments and answers, as kvevents/kernels/native.py expects them */

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
static uint64_t xxh3_short(const uint8_t *in, size_t len, uint64_t seed) {
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

static void chain(const uint8_t *tokens, Py_ssize_t n_blocks, Py_ssize_t block_size,
                  uint64_t parent, uint64_t *out) {
    size_t step = 4 * (size_t)block_size;
    uint64_t key = parent;
    for (Py_ssize_t b = 0; b < n_blocks; b++) {
        key = xxh3_short(tokens + step * b, step, key);
        out[b] = key;
    }
}

/* ---- the mirror's table (block_table.py) ------------------------------------------ */

#define TABLE_MIX 0x9E3779B97F4A7C15ULL
#define SEGMENTS 65

/* The value the table holds for ``key`` (0: none). */
static inline uint64_t lookup(const uint64_t *table_keys, const uint64_t *table_values, uint64_t mask,
                              uint64_t key) {
    uint64_t h = key * TABLE_MIX;
    uint64_t i = (h ^ (h >> 32)) & mask;
    for (;;) {
        uint64_t v = table_values[i];
        if (v == 0) return 0;
        if (table_keys[i] == key) return v;
        i = (i + 1) & mask;
    }
}

/* Segments of a match: the slots whose prefix ends at each length; answers the longest.
 * With a second table (``more_keys`` not NULL), a block counts where either holds it. */
static Py_ssize_t match(const uint64_t *keys, Py_ssize_t n, const uint64_t *table_keys,
                        const uint64_t *table_values, uint64_t mask, const uint64_t *more_keys,
                        const uint64_t *more_values, uint64_t more_mask, uint64_t live,
                        uint64_t *dropped, Py_ssize_t *lengths, int *found) {
    uint64_t held = live;
    *found = 0;
    for (Py_ssize_t j = 0; j < n; j++) {
        uint64_t value = lookup(table_keys, table_values, mask, keys[j]);
        if (more_keys != NULL) value |= lookup(more_keys, more_values, more_mask, keys[j]);
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

/* ---- JSON ------------------------------------------------------------------------ */

typedef struct {
    char *p;
    Py_ssize_t n;
} Out;

static inline void put(Out *o, const char *s, Py_ssize_t n) {
    memcpy(o->p + o->n, s, n);
    o->n += n;
}

#define PUT_LITERAL(o, s) put((o), (s), (Py_ssize_t)sizeof(s) - 1)

static inline void put_bytes(Out *o, PyObject *b) { put(o, PyBytes_AS_STRING(b), PyBytes_GET_SIZE(b)); }

static void put_int(Out *o, long long v) {
    char digits[24];
    int k = 0;
    unsigned long long u = v < 0 ? 0ULL - (unsigned long long)v : (unsigned long long)v;
    do {
        digits[k++] = (char)('0' + u % 10);
        u /= 10;
    } while (u);
    if (v < 0) o->p[o->n++] = '-';
    while (k) o->p[o->n++] = digits[--k];
}

/* A float as msgspec writes it: Python's repr for 0 and for 1e-4 <= |x| < 1e16 (where
 * the two agree; tests/router/test_native_route.py checks); 0 for any other value (the caller
 * then answers None). At most 25 bytes. */
static int put_float(Out *o, double x) {
    double a = fabs(x);
    if (x == 0.0) {
        if (signbit(x)) PUT_LITERAL(o, "-0.0");
        else PUT_LITERAL(o, "0.0");
        return 1;
    }
    if (!(a >= 1e-4 && a < 1e16)) return 0; /* NaN fails too */
    if (a < 9007199254740992.0 && x == (double)(long long)x) {
        put_int(o, (long long)x);
        PUT_LITERAL(o, ".0");
        return 1;
    }
    char *s = PyOS_double_to_string(x, 'r', 0, Py_DTSF_ADD_DOT_0, NULL);
    if (s == NULL) {
        PyErr_Clear();
        return 0;
    }
    put(o, s, (Py_ssize_t)strlen(s));
    PyMem_Free(s);
    return 1;
}

/* ---- the answer ------------------------------------------------------------------ */

/* A candidate's figures in the plan's numbers (native byte order, 48 bytes each). */
typedef struct {
    double own;
    double pending;
    double recent;
    int64_t routed;
    int64_t unavailable;
    int64_t slot;
} Candidate;

#define FRAGMENTS 4 /* per candidate: head, score start, pending (to cost), score end (to predicted) */
#define MAX_TOP 64

typedef struct {
    int64_t unavailable;
    double cost;
    double pending;
    double recent;
    int64_t routed;
    double routed_figure; /* board_choice's: the board holds it as a float */
    Py_ssize_t position;
    Py_ssize_t gpu;
    Py_ssize_t predicted; /* blocks predictions add to the gpu ones */
    double cached;
    double prefill;
    double balance; /* board_choice's: recent work past the least */
} Scored;

/* Python's tuple order of (unavailable, cost, pending, recent, routed, position). */
static inline int before(const Scored *a, const Scored *b) {
    if (a->unavailable != b->unavailable) return a->unavailable < b->unavailable;
    if (a->cost != b->cost) return a->cost < b->cost;
    if (a->pending != b->pending) return a->pending < b->pending;
    if (a->recent != b->recent) return a->recent < b->recent;
    if (a->routed != b->routed) return a->routed < b->routed;
    if (a->routed_figure != b->routed_figure) return a->routed_figure < b->routed_figure;
    return a->position < b->position;
}

static int get_buffer(PyObject *obj, Py_buffer *view, Py_ssize_t itemsize, const char *what) {
    if (PyObject_GetBuffer(obj, view, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0) return 0;
    if (view->itemsize != itemsize) {
        PyErr_Format(PyExc_TypeError, "%s must hold %zd-byte items", what, itemsize);
        PyBuffer_Release(view);
        return 0;
    }
    return 1;
}

/* The block size and parent key of a keying, checked; 0 with an exception set. */
static int keying(PyObject *size, PyObject *parent_key, Py_ssize_t *block_size, uint64_t *parent) {
    *block_size = PyLong_AsSsize_t(size);
    if (*block_size == -1 && PyErr_Occurred()) return 0;
    *parent = PyLong_AsUnsignedLongLong(parent_key);
    if (*parent == (uint64_t)-1 && PyErr_Occurred()) return 0;
    if (*block_size < 1 || *block_size > MAX_BLOCK_TOKENS) {
        PyErr_Format(PyExc_ValueError, "block_size=%zd, not 1..%d", *block_size, MAX_BLOCK_TOKENS);
        return 0;
    }
    return 1;
}

/* The chained keys of every full block of the tokens in ``tok``, as uint64 bytes. */
static PyObject *keys_of(const Py_buffer *tok, Py_ssize_t block_size, uint64_t parent) {
    Py_ssize_t n_blocks = (tok->len / 4) / block_size;
    PyObject *keys = PyBytes_FromStringAndSize(NULL, 8 * n_blocks);
    if (keys != NULL)
        chain((const uint8_t *)tok->buf, n_blocks, block_size, parent, (uint64_t *)PyBytes_AS_STRING(keys));
    return keys;
}

/* A request keyed and matched: its keys (uint64 bytes, new reference) and segments. */
typedef struct {
    PyObject *keys;
    Py_ssize_t n_tokens;
    Py_ssize_t n_blocks;
    Py_ssize_t longest;
    int found;
    uint64_t dropped[SEGMENTS];
    Py_ssize_t lengths[SEGMENTS];
} Matched;

/* Key ``tokens`` in blocks of ``block_size`` from ``parent`` and match them against the
 * table from ``live``; 0 with an exception set on bad arguments. */
static int keyed_match(Matched *m, PyObject *tokens, PyObject *size, PyObject *parent_key,
                       PyObject *table_keys, PyObject *table_values, PyObject *live_mask) {
    Py_ssize_t block_size;
    uint64_t parent;
    if (!keying(size, parent_key, &block_size, &parent)) return 0;
    uint64_t live = PyLong_AsUnsignedLongLong(live_mask);
    if (live == (uint64_t)-1 && PyErr_Occurred()) return 0;
    Py_buffer tok, tk, tv;
    if (!get_buffer(tokens, &tok, 4, "tokens")) return 0;
    if (!get_buffer(table_keys, &tk, 8, "table_keys")) {
        PyBuffer_Release(&tok);
        return 0;
    }
    if (!get_buffer(table_values, &tv, 8, "table_values")) {
        PyBuffer_Release(&tok);
        PyBuffer_Release(&tk);
        return 0;
    }
    int ok = 0;
    Py_ssize_t slots = tk.len / 8;
    if (slots < 1 || (slots & (slots - 1)) || tv.len != tk.len) {
        PyErr_SetString(PyExc_ValueError,
                        "the table must be a power of two of slots, keys and values alike");
        goto done;
    }
    m->n_tokens = tok.len / 4;
    m->n_blocks = m->n_tokens / block_size;
    m->keys = keys_of(&tok, block_size, parent);
    if (m->keys == NULL) goto done;
    const uint64_t *words = (const uint64_t *)PyBytes_AS_STRING(m->keys);
    m->longest = match(words, m->n_blocks, (const uint64_t *)tk.buf, (const uint64_t *)tv.buf,
                       (uint64_t)(slots - 1), NULL, NULL, 0, live, m->dropped, m->lengths, &m->found);
    ok = 1;
done:
    PyBuffer_Release(&tok);
    PyBuffer_Release(&tk);
    PyBuffer_Release(&tv);
    return ok;
}

/* Blocks the holder in ``slot`` has of the request (0 for a slot past 63). */
static Py_ssize_t blocks_of(const Matched *m, int64_t slot) {
    if (slot < 0 || slot >= 64) return 0;
    uint64_t bit = 1ULL << slot;
    for (int s = 0; s < m->found; s++)
        if (m->dropped[s] & bit) return m->lengths[s];
    return 0;
}

/* ``with``: the match of ``m``'s keys where a block counts when either table holds it
 * (the blocks' and the predictions'); 0 with an exception set on bad arguments. */
static int match_either(const Matched *m, Matched *with, PyObject *table_keys, PyObject *table_values,
                        PyObject *more_keys, PyObject *more_values, PyObject *live_mask) {
    uint64_t live = PyLong_AsUnsignedLongLong(live_mask);
    if (live == (uint64_t)-1 && PyErr_Occurred()) return 0;
    Py_buffer view[4];
    PyObject *objects[4] = {table_keys, table_values, more_keys, more_values};
    int got = 0, ok = 0;
    for (; got < 4; got++)
        if (!get_buffer(objects[got], &view[got], 8, "a table")) goto done;
    Py_ssize_t slots = view[0].len / 8, more = view[2].len / 8;
    if (slots < 1 || (slots & (slots - 1)) || view[1].len != view[0].len || more < 1 ||
        (more & (more - 1)) || view[3].len != view[2].len) {
        PyErr_SetString(PyExc_ValueError,
                        "a table must be a power of two of slots, keys and values alike");
        goto done;
    }
    with->longest = match((const uint64_t *)PyBytes_AS_STRING(m->keys), m->n_blocks,
                          (const uint64_t *)view[0].buf, (const uint64_t *)view[1].buf, (uint64_t)(slots - 1),
                          (const uint64_t *)view[2].buf, (const uint64_t *)view[3].buf, (uint64_t)(more - 1),
                          live, with->dropped, with->lengths, &with->found);
    ok = 1;
done:
    while (got > 0) PyBuffer_Release(&view[--got]);
    return ok;
}

/* ``with`` for the predictions' table ``more_keys``/``more_values`` when given (not None;
 * *predicting set), as match_either; 1, or 0 with an exception set (``m``'s keys freed). */
static int predictions_match(Matched *m, Matched *with, int *predicting, PyObject *const *args,
                             Py_ssize_t more_at) {
    *predicting = args[more_at] != Py_None;
    if (*predicting == (args[more_at + 1] == Py_None)) {
        PyErr_SetString(PyExc_TypeError, "the predictions' keys and values, or neither");
    } else if (!*predicting || match_either(m, with, args[3], args[4], args[more_at], args[more_at + 1], args[5])) {
        return 1;
    }
    Py_DECREF(m->keys);
    return 0;
}

/* Blocks predictions add to the ``g`` a slot holds (0 when not predicting). */
static inline Py_ssize_t predicted_of(const Matched *with, int predicting, int64_t slot, Py_ssize_t g) {
    if (!predicting) return 0;
    Py_ssize_t either = blocks_of(with, slot);
    return either > g ? either - g : 0;
}

/* Check a plan's fragments: a tuple of ``per`` bytes objects for each of ``count``. */
static int check_fragments(PyObject *fragments, Py_ssize_t count, Py_ssize_t per) {
    if (!PyTuple_CheckExact(fragments) || PyTuple_GET_SIZE(fragments) != per * count) {
        PyErr_SetString(PyExc_ValueError, "the plan's numbers and fragments disagree");
        return 0;
    }
    for (Py_ssize_t i = 0; i < per * count; i++) {
        if (!PyBytes_CheckExact(PyTuple_GET_ITEM(fragments, i))) {
            PyErr_SetString(PyExc_TypeError, "the plan's fragments must be bytes");
            return 0;
        }
    }
    return 1;
}

/* (answer, keys, longest) from the ``n`` bytes written in ``buffer`` (freed here), the
 * answer None when not ``exact``; the match's keys are handed over. */
static PyObject *answered(Matched *m, char *buffer, Py_ssize_t n, int exact) {
    PyObject *answer = exact ? PyBytes_FromStringAndSize(buffer, n) : Py_NewRef(Py_None);
    PyMem_Free(buffer);
    if (answer == NULL) {
        Py_DECREF(m->keys);
        return NULL;
    }
    return Py_BuildValue("(NNn)", answer, m->keys, m->longest);
}

/* route_answer(tokens, block_size, parent, table_keys, table_values, live, plan, top,
 *              predicted_keys, predicted_values)
 *   -> (answer bytes or None, keys bytes, longest)
 * plan: (numbers, fragments, gpu, cpu, disk, head_tail, predicted credit) where numbers
 * packs a Candidate per candidate, fragments holds FRAGMENTS bytes per candidate and
 * head_tail the answer's bytes after "n_blocks": up to its "block_size" value; see
 * native_route.py. predicted_keys/_values: the predictions' table, or None for none. */
static PyObject *route_answer(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (nargs != 10) {
        PyErr_SetString(PyExc_TypeError, "route_answer takes 10 arguments");
        return NULL;
    }
    Py_ssize_t top = PyLong_AsSsize_t(args[7]);
    if (top == -1 && PyErr_Occurred()) return NULL;
    PyObject *plan = args[6];
    if (!PyTuple_CheckExact(plan) || PyTuple_GET_SIZE(plan) != 7) {
        PyErr_SetString(PyExc_TypeError, "route_answer: plan must be a 7-tuple");
        return NULL;
    }
    PyObject *numbers = PyTuple_GET_ITEM(plan, 0);
    PyObject *fragments = PyTuple_GET_ITEM(plan, 1);
    PyObject *head_tail = PyTuple_GET_ITEM(plan, 5);
    PyObject *const *credit = &PyTuple_GET_ITEM(plan, 2);
    if (!PyFloat_CheckExact(credit[0]) || !PyFloat_CheckExact(credit[1]) || !PyFloat_CheckExact(credit[2]) ||
        !PyFloat_CheckExact(PyTuple_GET_ITEM(plan, 6))) {
        PyErr_SetString(PyExc_TypeError, "route_answer: the plan's credits must be floats");
        return NULL;
    }
    double gpu = PyFloat_AS_DOUBLE(credit[0]);
    double cpu = PyFloat_AS_DOUBLE(credit[1]);
    double disk = PyFloat_AS_DOUBLE(credit[2]);
    double pcredit = PyFloat_AS_DOUBLE(PyTuple_GET_ITEM(plan, 6));
    if (!PyBytes_CheckExact(numbers) || !PyBytes_CheckExact(head_tail)) {
        PyErr_SetString(PyExc_TypeError, "route_answer: plan holds bytes, a tuple, floats, bytes");
        return NULL;
    }
    Py_ssize_t count = PyBytes_GET_SIZE(numbers) / (Py_ssize_t)sizeof(Candidate);
    if (count < 1 || PyBytes_GET_SIZE(numbers) != count * (Py_ssize_t)sizeof(Candidate)) {
        PyErr_SetString(PyExc_ValueError, "route_answer: the plan has no whole candidates");
        return NULL;
    }
    if (!check_fragments(fragments, count, FRAGMENTS)) return NULL;
    if (top < 1) top = 1;
    if (top > count) top = count;
    if (top > MAX_TOP) {
        PyErr_Format(PyExc_ValueError, "route_answer: top past %d", MAX_TOP);
        return NULL;
    }
    /* bytes objects hold their data 8-byte aligned (CPython's allocator) */
    const Candidate *cands = (const Candidate *)PyBytes_AS_STRING(numbers);

    Matched m = {0}, with = {0};
    int predicting;
    if (!keyed_match(&m, args[0], args[1], args[2], args[3], args[4], args[5])) return NULL;
    if (!predictions_match(&m, &with, &predicting, args, 8)) return NULL;

    /* Every candidate scored as Ranking.top scores it; the best ``top`` kept in order,
     * and the best on confirmed blocks alone (what by_prediction compares with). */
    Scored best[MAX_TOP], first = {0};
    Py_ssize_t kept = 0;
    double blocks = (double)m.n_blocks;
    for (Py_ssize_t p = 0; p < count; p++) {
        const Candidate *c = &cands[p];
        Py_ssize_t g = blocks_of(&m, c->slot);
        Scored item;
        item.unavailable = c->unavailable;
        item.cached = (double)g * gpu + 0.0 * cpu + 0.0 * disk;
        item.prefill = blocks > item.cached ? blocks - item.cached : 0.0;
        item.cost = item.prefill + c->own;
        item.pending = c->pending;
        item.recent = c->recent;
        item.routed = c->routed;
        item.routed_figure = 0.0;
        item.position = p;
        item.gpu = g;
        item.predicted = predicted_of(&with, predicting, c->slot, g);
        if (predicting) {
            if (p == 0 || before(&item, &first)) first = item;
            if (item.predicted) {
                item.cached += (double)item.predicted * pcredit;
                item.prefill = blocks > item.cached ? blocks - item.cached : 0.0;
                item.cost = item.prefill + c->own;
            }
        }
        if (kept == top && !before(&item, &best[kept - 1])) continue;
        Py_ssize_t at = kept < top ? kept++ : kept - 1;
        while (at > 0 && before(&item, &best[at - 1])) {
            best[at] = best[at - 1];
            at--;
        }
        best[at] = item;
    }
    if (best[0].unavailable) /* no holder to route to: the Python path words the error */
        return Py_BuildValue("(ONn)", Py_None, m.keys, m.longest);
    int by_prediction = best[0].predicted != 0 && first.position != best[0].position;
    /* The answer's size: its fragments, and at most 25 bytes per number written. */
    Py_ssize_t size = 512 + PyBytes_GET_SIZE(head_tail);
    size += PyBytes_GET_SIZE(PyTuple_GET_ITEM(fragments, FRAGMENTS * best[0].position));
    for (Py_ssize_t k = 0; k < kept; k++) {
        for (int f = 1; f < FRAGMENTS; f++)
            size += PyBytes_GET_SIZE(PyTuple_GET_ITEM(fragments, FRAGMENTS * best[k].position + f));
        size += 224;
    }
    char *buffer = PyMem_Malloc(size);
    if (buffer == NULL) {
        PyErr_NoMemory();
        Py_DECREF(m.keys);
        return NULL;
    }
    Out o = {buffer, 0};
    put_bytes(&o, PyTuple_GET_ITEM(fragments, FRAGMENTS * best[0].position));
    PUT_LITERAL(&o, ",\"recorded\":false,\"n_blocks\":");
    put_int(&o, m.n_blocks);
    put_bytes(&o, head_tail);
    PUT_LITERAL(&o, ",\"holders\":");
    put_int(&o, count);
    PUT_LITERAL(&o, ",\"predicted_blocks\":");
    put_int(&o, best[0].predicted);
    if (by_prediction) PUT_LITERAL(&o, ",\"by_prediction\":true,\"scores\":[");
    else PUT_LITERAL(&o, ",\"by_prediction\":false,\"scores\":[");
    int exact = 1;
    for (Py_ssize_t k = 0; k < kept && exact; k++) {
        PyObject *const *f = &PyTuple_GET_ITEM(fragments, FRAGMENTS * best[k].position);
        if (k) PUT_LITERAL(&o, ",");
        put_bytes(&o, f[1]);
        put_int(&o, best[k].gpu);
        PUT_LITERAL(&o, ",\"cpu\":0,\"disk\":0},\"cached_blocks\":");
        exact = put_float(&o, best[k].cached);
        PUT_LITERAL(&o, ",\"prefill_blocks\":");
        exact = exact && put_float(&o, best[k].prefill);
        put_bytes(&o, f[2]);
        exact = exact && put_float(&o, best[k].cost);
        put_bytes(&o, f[3]);
        put_int(&o, best[k].predicted);
        PUT_LITERAL(&o, "}");
    }
    PUT_LITERAL(&o, "]}");
    return answered(&m, buffer, o.n, exact);
}

/* query_answer(tokens, block_size, parent, table_keys, table_values, live, plan,
 *              predicted_keys, predicted_values)
 *   -> (answer bytes, keys bytes, longest)
 * plan: (slots, fragments, head_tail): per candidate its slot (int64, native order) and
 * the bytes of its match up to "matched_blocks":, and the answer's bytes after
 * "prompt_tokens": up to the matches' "["; see native_route.py. predicted_keys/_values:
 * the predictions' table, or None for none. */
static PyObject *query_answer(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (nargs != 9) {
        PyErr_SetString(PyExc_TypeError, "query_answer takes 9 arguments");
        return NULL;
    }
    PyObject *plan = args[6];
    if (!PyTuple_CheckExact(plan) || PyTuple_GET_SIZE(plan) != 3) {
        PyErr_SetString(PyExc_TypeError, "query_answer: plan must be a 3-tuple");
        return NULL;
    }
    PyObject *slots = PyTuple_GET_ITEM(plan, 0);
    PyObject *fragments = PyTuple_GET_ITEM(plan, 1);
    PyObject *head_tail = PyTuple_GET_ITEM(plan, 2);
    if (!PyBytes_CheckExact(slots) || !PyBytes_CheckExact(head_tail)) {
        PyErr_SetString(PyExc_TypeError, "query_answer: plan holds bytes, a tuple, bytes");
        return NULL;
    }
    Py_ssize_t count = PyBytes_GET_SIZE(slots) / 8;
    if (PyBytes_GET_SIZE(slots) != 8 * count) {
        PyErr_SetString(PyExc_ValueError, "query_answer: the plan's slots are not int64s");
        return NULL;
    }
    if (!check_fragments(fragments, count, 1)) return NULL;
    Py_ssize_t block_size = PyLong_AsSsize_t(args[1]);
    if (block_size == -1 && PyErr_Occurred()) return NULL;
    const int64_t *slot_of = (const int64_t *)PyBytes_AS_STRING(slots);

    Matched m = {0}, with = {0};
    int predicting;
    if (!keyed_match(&m, args[0], args[1], args[2], args[3], args[4], args[5])) return NULL;
    if (!predictions_match(&m, &with, &predicting, args, 7)) return NULL;
    Py_ssize_t size = 64 + PyBytes_GET_SIZE(head_tail);
    for (Py_ssize_t p = 0; p < count; p++) size += PyBytes_GET_SIZE(PyTuple_GET_ITEM(fragments, p)) + 192;
    char *buffer = PyMem_Malloc(size);
    if (buffer == NULL) {
        PyErr_NoMemory();
        Py_DECREF(m.keys);
        return NULL;
    }
    Out o = {buffer, 0};
    PUT_LITERAL(&o, "{\"prompt_tokens\":");
    put_int(&o, m.n_tokens);
    put_bytes(&o, head_tail);
    for (Py_ssize_t p = 0; p < count; p++) {
        Py_ssize_t g = blocks_of(&m, slot_of[p]);
        Py_ssize_t predicted = predicted_of(&with, predicting, slot_of[p], g);
        long long tokens = (long long)g * block_size;
        if (p) PUT_LITERAL(&o, ",");
        put_bytes(&o, PyTuple_GET_ITEM(fragments, p));
        put_int(&o, g);
        PUT_LITERAL(&o, ",\"matched_tokens\":");
        put_int(&o, tokens);
        PUT_LITERAL(&o, ",\"tiers\":{\"gpu\":");
        put_int(&o, tokens);
        PUT_LITERAL(&o, ",\"cpu\":0,\"disk\":0}");
        if (predicted) { /* the answer omits them when 0 */
            PUT_LITERAL(&o, ",\"predicted_blocks\":");
            put_int(&o, predicted);
            PUT_LITERAL(&o, ",\"predicted_tokens\":");
            put_int(&o, (long long)predicted * block_size);
        }
        PUT_LITERAL(&o, "}");
    }
    PUT_LITERAL(&o, "]}");
    return answered(&m, buffer, o.n, 1);
}

/* The load board's row of a slot (kvevents/router/decide/load_board.py): its fields' order. */
enum { ROW_AVAILABLE, ROW_ENGINE, ROW_INFLIGHT, ROW_BLOCKS, ROW_RAW, ROW_ROUTED, ROW_STRIDE };

/* A candidate's place on the board and in the index (native order, 16 bytes each). */
typedef struct {
    int64_t board_slot;
    int64_t index_slot;
} Seat;

/* board_choice(tokens, block_size, parent, table_keys, table_values, live, board, seats,
 *              scale, weights, predicted_keys, predicted_values, top)
 *   -> (keys bytes, longest, by_prediction, (figures, ...))
 * The best ``top`` candidates of a request, best first, as board_top_scores scores them
 * with every load read from the board (loads that change with every request: a relayed
 * one), GPU blocks only. board: the board's table (float64, ROW_STRIDE per slot); seats:
 * a Seat per candidate; weights: (load, balance, foreign request blocks, gpu, cpu, disk
 * credits, predicted credit), floats; predicted_keys/_values: the predictions' table, or
 * None for none. figures: (position, gpu blocks, cached, prefill, pending, cost, recent,
 * balance, routed, available, predicted blocks) per candidate kept; by_prediction when
 * the best on confirmed blocks alone is another candidate than the best. */
static PyObject *board_choice(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (nargs != 13) {
        PyErr_SetString(PyExc_TypeError, "board_choice takes 13 arguments");
        return NULL;
    }
    Py_ssize_t top = PyLong_AsSsize_t(args[12]);
    if (top == -1 && PyErr_Occurred()) return NULL;
    if (top < 1) top = 1;
    if (top > MAX_TOP) {
        PyErr_Format(PyExc_ValueError, "board_choice: top past %d", MAX_TOP);
        return NULL;
    }
    PyObject *seats = args[7];
    PyObject *weights = args[9];
    if (!PyBytes_CheckExact(seats) || !PyTuple_CheckExact(weights) || PyTuple_GET_SIZE(weights) != 7) {
        PyErr_SetString(PyExc_TypeError, "board_choice: seats must be bytes, weights a 7-tuple");
        return NULL;
    }
    double w[7];
    for (int k = 0; k < 7; k++) {
        PyObject *x = PyTuple_GET_ITEM(weights, k);
        if (!PyFloat_CheckExact(x)) {
            PyErr_SetString(PyExc_TypeError, "board_choice: the weights must be floats");
            return NULL;
        }
        w[k] = PyFloat_AS_DOUBLE(x);
    }
    double scale = PyFloat_AsDouble(args[8]);
    if (scale == -1.0 && PyErr_Occurred()) return NULL;
    Py_ssize_t count = PyBytes_GET_SIZE(seats) / (Py_ssize_t)sizeof(Seat);
    if (count < 1 || PyBytes_GET_SIZE(seats) != count * (Py_ssize_t)sizeof(Seat)) {
        PyErr_SetString(PyExc_ValueError, "board_choice: no whole seats");
        return NULL;
    }
    const Seat *seat = (const Seat *)PyBytes_AS_STRING(seats);
    Py_buffer board;
    if (!get_buffer(args[6], &board, 8, "board")) return NULL;
    const double *rows = (const double *)board.buf;
    Py_ssize_t board_slots = board.len / (8 * ROW_STRIDE);
    for (Py_ssize_t p = 0; p < count; p++) {
        if (seat[p].board_slot < 0 || seat[p].board_slot >= board_slots) {
            PyBuffer_Release(&board);
            PyErr_SetString(PyExc_ValueError, "board_choice: a seat past the board");
            return NULL;
        }
    }
    Matched m = {0}, with = {0}; /* with: blocks held or predicted */
    int predicting;
    if (!keyed_match(&m, args[0], args[1], args[2], args[3], args[4], args[5]) ||
        !predictions_match(&m, &with, &predicting, args, 10)) {
        PyBuffer_Release(&board);
        return NULL;
    }
    /* the least recent work among the available candidates, as the raw figure, then scaled */
    double least = 0.0;
    int any = 0;
    for (Py_ssize_t p = 0; p < count; p++) {
        const double *row = rows + ROW_STRIDE * seat[p].board_slot;
        if (row[ROW_AVAILABLE] != 0.0 && (!any || row[ROW_RAW] < least)) {
            least = row[ROW_RAW];
            any = 1;
        }
    }
    least *= scale;
    double blocks = (double)m.n_blocks;
    /* the best ``top`` counting predictions, in order, and the best on confirmed blocks alone */
    if (top > count) top = count;
    Scored best[MAX_TOP], first = {0};
    Py_ssize_t kept = 0;
    for (Py_ssize_t p = 0; p < count; p++) {
        const double *row = rows + ROW_STRIDE * seat[p].board_slot;
        Py_ssize_t g = blocks_of(&m, seat[p].index_slot);
        Scored item;
        item.predicted = predicted_of(&with, predicting, seat[p].index_slot, g);
        double confirmed = (double)g * w[3] + 0.0 * w[4] + 0.0 * w[5];
        double foreign = row[ROW_ENGINE] - row[ROW_INFLIGHT];
        item.pending = row[ROW_BLOCKS] + (foreign > 0.0 ? w[2] * foreign : 0.0);
        item.recent = row[ROW_RAW] * scale;
        item.balance = item.recent > least ? item.recent - least : 0.0;
        double load = w[0] * item.pending + w[1] * item.balance;
        item.unavailable = row[ROW_AVAILABLE] == 0.0;
        item.routed_figure = row[ROW_ROUTED];
        item.routed = 0;
        item.position = p;
        item.gpu = g;
        item.cached = confirmed;
        item.prefill = blocks > item.cached ? blocks - item.cached : 0.0;
        item.cost = item.prefill + load;
        if (p == 0 || before(&item, &first)) first = item;
        if (item.predicted) {
            item.cached = confirmed + (double)item.predicted * w[6];
            item.prefill = blocks > item.cached ? blocks - item.cached : 0.0;
            item.cost = item.prefill + load;
        }
        if (kept == top && !before(&item, &best[kept - 1])) continue;
        Py_ssize_t at = kept < top ? kept++ : kept - 1;
        while (at > 0 && before(&item, &best[at - 1])) {
            best[at] = best[at - 1];
            at--;
        }
        best[at] = item;
    }
    PyBuffer_Release(&board);
    int by_prediction = best[0].predicted != 0 && first.position != best[0].position;
    PyObject *scores = PyTuple_New(kept);
    if (scores == NULL) {
        Py_DECREF(m.keys);
        return NULL;
    }
    for (Py_ssize_t k = 0; k < kept; k++) {
        const Scored *b = &best[k];
        PyObject *figures = Py_BuildValue("(nndddddddOn)", b->position, b->gpu, b->cached, b->prefill, b->pending,
                                          b->cost, b->recent, b->balance, b->routed_figure,
                                          b->unavailable ? Py_False : Py_True, b->predicted);
        if (figures == NULL) {
            Py_DECREF(scores);
            Py_DECREF(m.keys);
            return NULL;
        }
        PyTuple_SET_ITEM(scores, k, figures);
    }
    return Py_BuildValue("(NnON)", m.keys, m.longest, by_prediction ? Py_True : Py_False, scores);
}


/* chain_keys(tokens, block_size, parent) -> bytes: the chained keys alone (for tests). */
static PyObject *chain_keys(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "chain_keys takes 3 arguments");
        return NULL;
    }
    Py_ssize_t block_size;
    uint64_t parent;
    if (!keying(args[1], args[2], &block_size, &parent)) return NULL;
    Py_buffer tok;
    if (!get_buffer(args[0], &tok, 4, "tokens")) return NULL;
    PyObject *keys = keys_of(&tok, block_size, parent);
    PyBuffer_Release(&tok);
    return keys;
}

/* json_float(x) -> bytes or None: how route_answer writes a float (for tests). */
static PyObject *json_float(PyObject *self, PyObject *arg) {
    (void)self;
    double x = PyFloat_AsDouble(arg);
    if (x == -1.0 && PyErr_Occurred()) return NULL;
    char text[64];
    Out o = {text, 0};
    if (!put_float(&o, x)) Py_RETURN_NONE;
    return PyBytes_FromStringAndSize(text, o.n);
}

static PyMethodDef methods[] = {
    {"route_answer", (PyCFunction)(void (*)(void))route_answer, METH_FASTCALL,
     "The plain /route answer of a request, its keys and longest match (see native.py)."},
    {"query_answer", (PyCFunction)(void (*)(void))query_answer, METH_FASTCALL,
     "The plain /query answer of a request, its keys and longest match (see native.py)."},
    {"board_choice", (PyCFunction)(void (*)(void))board_choice, METH_FASTCALL,
     "The best candidate of a request over the load board's loads (see native.py)."},
    {"chain_keys", (PyCFunction)(void (*)(void))chain_keys, METH_FASTCALL,
     "Chained XXH3-64 content keys of full blocks, as bytes of uint64."},
    {"json_float", json_float, METH_O, "A float as route_answer writes it, or None."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_native", "The router's plain /route and /query answers and relay choice in one call.",
    -1, methods,
    NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__native(void) {
    PyObject *m = PyModule_Create(&module);
    if (m == NULL) return NULL;
    if (PyModule_AddIntConstant(m, "ABI", ABI) < 0 ||
        PyModule_AddIntConstant(m, "MAX_BLOCK_TOKENS", MAX_BLOCK_TOKENS) < 0 ||
        PyModule_AddIntConstant(m, "MAX_TOP", MAX_TOP) < 0 ||
        PyModule_AddIntConstant(m, "CANDIDATE_BYTES", (long)sizeof(Candidate)) < 0 ||
        PyModule_AddIntConstant(m, "FRAGMENTS", FRAGMENTS) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}

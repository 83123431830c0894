/* kvevents' native core: everything the router does per request that is worth a C loop.
 *
 * One module, in parts (each header is included once, here, and holds one concern):
 *
 *   args.h         reading buffer arguments, and the calls answered, per kind
 *   xxh3.h         XXH3-64 of short inputs, and the chain of a request's block keys
 *   token_json.h   a body's leading token-id array read straight into uint32
 *   block_table.h  the flat hash table of block masks, and a match over it
 *   mask_mirror.h  MaskMirror, that table as a Python object the index keeps in sync
 *   load_scan.h    the best holders by load, over the load board's table
 *   json_out.h     numbers written as msgspec writes them
 *
 * and, in this file, the calls that answer a plain request whole: route_answer() keys a
 * request's blocks, matches those an engine reuses (all but a block-aligned prompt's last)
 * against the index's mirror (and the predictions'), scores
 * every candidate as the router's Ranking does (a plan prepared in Python:
 * kvevents/router/decide/native_route.py) and writes the /route answer's JSON, byte for byte
 * what msgspec writes for the Python path; query_answer() writes /query's; board_choice()
 * picks the best candidates of a request whose loads just changed, every load read from
 * the load board's table. Anything they cannot answer exactly answers None, and the
 * caller takes the Python path.
 *
 * Every call is only ever an acceleration: the Python path is the reference
 * (kvevents/kernels/spec.py, and the router's own code), tests compare the two, and
 * scripts/fuzz-native fuzzes every entry point under AddressSanitizer and UBSan. Every
 * call holds the GIL throughout and reads its arguments' buffers in place. The host must
 * be little-endian (kvevents/kernels/native.py checks): tokens are hashed as their bytes.
 *
 * Compiled with -ffp-contract=off: every float operation rounds as Python's does.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#define ABI 5 /* the calls' arguments and answers, as kvevents/kernels/native.py expects them */

#include "args.h"
#include "xxh3.h"
#include "token_json.h"
#include "block_table.h"
#include "mask_mirror.h"
#include "load_scan.h"
#include "json_out.h"

static PyObject *ARRAY;             /* array.array */
static PyObject *UINT32, *UINT64;   /* its typecodes "I" and "Q" */
static PyObject *FROMBYTES;         /* "frombytes" */
static PyObject *INPUT_IDS;         /* the key a /route body's ids go by, quotes included */

/* A new array.array of ``typecode`` holding the ``nbytes`` bytes at ``data``. */
static PyObject *array_from(PyObject *typecode, const void *data, Py_ssize_t nbytes) {
    PyObject *array = PyObject_CallOneArg(ARRAY, typecode);
    if (array == NULL || nbytes == 0) return array;
    PyObject *view = PyMemoryView_FromMemory((char *)data, nbytes, PyBUF_READ);
    PyObject *done = view == NULL ? NULL : PyObject_CallMethodOneArg(array, FROMBYTES, view);
    Py_XDECREF(view);
    if (done == NULL) {
        Py_DECREF(array);
        return NULL;
    }
    Py_DECREF(done);
    return array;
}

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

/* A request keyed and matched: its keys (uint64 bytes, new reference) and segments.
 * Every full block is keyed (n_blocks, the request's size), and only the blocks an engine
 * reuses are matched (reusable: every one but a block-aligned prompt's last, as
 * kvevents/index/reusable.py states and the Python path's match_keys(reusable=) does). */
typedef struct {
    PyObject *keys;
    Py_ssize_t n_tokens;
    Py_ssize_t n_blocks;
    Py_ssize_t reusable;
    Py_ssize_t longest;
    int found;
    uint64_t dropped[SEGMENTS];
    Py_ssize_t lengths[SEGMENTS];
} Matched;

/* ``obj`` as a one-word MaskMirror (what the answers read); NULL with TypeError. */
static MaskMirror *one_word(PyObject *obj, const char *what) {
    if (!PyObject_TypeCheck(obj, &MaskMirrorType) || ((MaskMirror *)obj)->words != 1) {
        PyErr_Format(PyExc_TypeError, "%s must be a MaskMirror of one word (64 holder slots)", what);
        return NULL;
    }
    return (MaskMirror *)obj;
}

/* Key ``tokens`` in blocks of ``block_size`` from ``parent`` and match the reusable ones
 * against the mirror from ``live``; 0 with an exception set on bad arguments. */
static int keyed_match(Matched *m, PyObject *tokens, PyObject *size, PyObject *parent_key, PyObject *mirror,
                       PyObject *live_mask) {
    Py_ssize_t block_size;
    uint64_t parent;
    if (!keying(size, parent_key, &block_size, &parent)) return 0;
    uint64_t live = PyLong_AsUnsignedLongLong(live_mask);
    if (live == (uint64_t)-1 && PyErr_Occurred()) return 0;
    MaskMirror *t = one_word(mirror, "the mirror");
    if (t == NULL) return 0;
    Py_buffer tok;
    if (!get_buffer(tokens, &tok, 4, "tokens")) return 0;
    m->n_tokens = tok.len / 4;
    m->n_blocks = m->n_tokens / block_size;
    m->reusable = m->n_tokens > 0 ? (m->n_tokens - 1) / block_size : 0;
    m->keys = keys_of(&tok, block_size, parent);
    PyBuffer_Release(&tok);
    if (m->keys == NULL) return 0;
    const uint64_t *words = (const uint64_t *)PyBytes_AS_STRING(m->keys);
    m->longest = match1(words, m->reusable, t->keys, t->values, (uint64_t)t->capacity - 1, NULL, NULL, 0, live,
                        m->dropped, m->lengths, &m->found);
    return 1;
}

/* Blocks the holder in ``slot`` has of the request (0 for a slot past 63). */
static Py_ssize_t blocks_of(const Matched *m, int64_t slot) {
    if (slot < 0 || slot >= 64) return 0;
    uint64_t bit = 1ULL << slot;
    for (int s = 0; s < m->found; s++)
        if (m->dropped[s] & bit) return m->lengths[s];
    return 0;
}

/* ``with``: the match of ``m``'s keys where a block counts when either mirror holds it
 * (the blocks' and the predictions'), when ``more`` is a mirror (*predicting set) and not
 * None; 1, or 0 with an exception set (``m``'s keys freed). */
static int predictions_match(Matched *m, Matched *with, int *predicting, PyObject *mirror, PyObject *more,
                             PyObject *live_mask) {
    *predicting = more != Py_None;
    if (!*predicting) return 1;
    MaskMirror *t = one_word(mirror, "the mirror"), *p = t == NULL ? NULL : one_word(more, "the predictions' mirror");
    uint64_t live = p == NULL ? 0 : PyLong_AsUnsignedLongLong(live_mask);
    if (p == NULL || (live == (uint64_t)-1 && PyErr_Occurred())) {
        Py_DECREF(m->keys);
        return 0;
    }
    with->longest = match1((const uint64_t *)PyBytes_AS_STRING(m->keys), m->reusable, t->keys, t->values,
                           (uint64_t)t->capacity - 1, p->keys, p->values, (uint64_t)p->capacity - 1, live,
                           with->dropped, with->lengths, &with->found);
    return 1;
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
 * answer None when not ``exact`` (else counted as a call of ``kind``); the match's keys
 * are handed over. */
static PyObject *answered(Matched *m, char *buffer, Py_ssize_t n, int exact, int kind) {
    PyObject *answer = exact ? PyBytes_FromStringAndSize(buffer, n) : Py_NewRef(Py_None);
    PyMem_Free(buffer);
    if (answer == NULL) {
        Py_DECREF(m->keys);
        return NULL;
    }
    if (exact) CALLS[kind]++;
    return Py_BuildValue("(NNn)", answer, m->keys, m->longest);
}

/* route_answer(tokens, block_size, parent, mirror, live, plan, top, predicted)
 *   -> (answer bytes or None, keys bytes, longest)
 * plan: (numbers, fragments, gpu, cpu, disk, head_tail, predicted credit) where numbers
 * packs a Candidate per candidate, fragments holds FRAGMENTS bytes per candidate and
 * head_tail the answer's bytes after "n_blocks": up to its "block_size" value; see
 * native_route.py. mirror: the index's MaskMirror; predicted: the predictions', or None. */
static PyObject *route_answer(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (nargs != 8) {
        PyErr_SetString(PyExc_TypeError, "route_answer takes 8 arguments");
        return NULL;
    }
    Py_ssize_t top = PyLong_AsSsize_t(args[6]);
    if (top == -1 && PyErr_Occurred()) return NULL;
    PyObject *plan = args[5];
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
    if (!keyed_match(&m, args[0], args[1], args[2], args[3], args[4])) return NULL;
    if (!predictions_match(&m, &with, &predicting, args[3], args[7], args[4])) return NULL;

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
    return answered(&m, buffer, o.n, exact, CALL_ROUTE);
}

/* query_answer(tokens, block_size, parent, mirror, live, plan, predicted)
 *   -> (answer bytes, keys bytes, longest)
 * plan: (slots, fragments, head_tail): per candidate its slot (int64, native order) and
 * the bytes of its match up to "matched_blocks":, and the answer's bytes after
 * "prompt_tokens": up to the matches' "["; see native_route.py. mirror, predicted: as
 * route_answer's. */
static PyObject *query_answer(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (nargs != 7) {
        PyErr_SetString(PyExc_TypeError, "query_answer takes 7 arguments");
        return NULL;
    }
    PyObject *plan = args[5];
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
    if (!keyed_match(&m, args[0], args[1], args[2], args[3], args[4])) return NULL;
    if (!predictions_match(&m, &with, &predicting, args[3], args[6], args[4])) return NULL;
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
    return answered(&m, buffer, o.n, 1, CALL_QUERY);
}

/* A candidate's place on the board and in the index (native order, 16 bytes each). */
typedef struct {
    int64_t board_slot;
    int64_t index_slot;
} Seat;

/* board_choice(tokens, block_size, parent, mirror, live, board, seats, scale, weights,
 *              predicted, top)
 *   -> (keys bytes, longest, by_prediction, (figures, ...))
 * The best ``top`` candidates of a request, best first, as board_top_scores scores them
 * with every load read from the board (loads that change with every request: a relayed
 * one), GPU blocks only. board: the board's table (float64, ROW_STRIDE per slot); seats:
 * a Seat per candidate; weights: (load, balance, foreign request blocks, gpu, cpu, disk
 * credits, predicted credit), floats; predicted: the predictions' mirror, or None.
 * figures: (position, gpu blocks, cached, prefill, pending, cost, recent, balance,
 * routed, available, predicted blocks) per candidate kept; by_prediction when the best
 * on confirmed blocks alone is another candidate than the best. */
static PyObject *board_choice(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (nargs != 11) {
        PyErr_SetString(PyExc_TypeError, "board_choice takes 11 arguments");
        return NULL;
    }
    Py_ssize_t top = PyLong_AsSsize_t(args[10]);
    if (top == -1 && PyErr_Occurred()) return NULL;
    if (top < 1) top = 1;
    if (top > MAX_TOP) {
        PyErr_Format(PyExc_ValueError, "board_choice: top past %d", MAX_TOP);
        return NULL;
    }
    PyObject *seats = args[6];
    PyObject *weights = args[8];
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
    double scale = PyFloat_AsDouble(args[7]);
    if (scale == -1.0 && PyErr_Occurred()) return NULL;
    Py_ssize_t count = PyBytes_GET_SIZE(seats) / (Py_ssize_t)sizeof(Seat);
    if (count < 1 || PyBytes_GET_SIZE(seats) != count * (Py_ssize_t)sizeof(Seat)) {
        PyErr_SetString(PyExc_ValueError, "board_choice: no whole seats");
        return NULL;
    }
    const Seat *seat = (const Seat *)PyBytes_AS_STRING(seats);
    Py_buffer board;
    if (!get_buffer(args[5], &board, 8, "board")) return NULL;
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
    if (!keyed_match(&m, args[0], args[1], args[2], args[3], args[4]) ||
        !predictions_match(&m, &with, &predicting, args[3], args[9], args[4])) {
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
    CALLS[CALL_CHOICE]++;
    return Py_BuildValue("(NnON)", m.keys, m.longest, by_prediction ? Py_True : Py_False, scores);
}

#define KEPT_IDS (1 << 20) /* the most ids the parse buffer keeps between calls (4 MiB) */
static uint32_t *kept_ids;  /* the parse buffer, kept warm: grown to the largest body seen */
static Py_ssize_t kept_room;

/* parse_input_ids(body, lead=None) -> (ids array("I"), end) or None (token_json.h). */
static PyObject *parse_input_ids(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (nargs < 1 || nargs > 2) {
        PyErr_SetString(PyExc_TypeError, "parse_input_ids takes a body and, optionally, a lead");
        return NULL;
    }
    PyObject *lead = nargs == 2 && args[1] != Py_None ? args[1] : INPUT_IDS;
    Py_buffer body, key;
    if (PyObject_GetBuffer(args[0], &body, PyBUF_SIMPLE) < 0) return NULL;
    if (PyObject_GetBuffer(lead, &key, PyBUF_SIMPLE) < 0) {
        PyBuffer_Release(&body);
        return NULL;
    }
    /* The most ids a body can hold: a body too large to keep a buffer for gets its own. */
    Py_ssize_t room = body.len / 2 + 1;
    uint32_t *ids = kept_ids;
    if (room > KEPT_IDS) {
        ids = PyMem_Malloc(4 * (size_t)room);
    } else if (room > kept_room) {
        Py_ssize_t grown = room < 4096 ? 4096 : room;
        ids = PyMem_Realloc(kept_ids, 4 * (size_t)grown);
        if (ids != NULL) {
            kept_ids = ids;
            kept_room = grown;
        }
    }
    PyObject *result = NULL;
    if (ids == NULL) {
        PyErr_NoMemory();
    } else {
        Py_ssize_t count = 0;
        Py_ssize_t end = parse_ids(body.buf, body.len, key.buf, key.len, ids, &count);
        if (end < 0) {
            result = Py_NewRef(Py_None);
        } else {
            PyObject *array = array_from(UINT32, ids, 4 * count);
            result = array == NULL ? NULL : Py_BuildValue("(Nn)", array, end);
            if (result != NULL) CALLS[CALL_PARSE]++;
        }
        if (ids != kept_ids) PyMem_Free(ids);
    }
    PyBuffer_Release(&key);
    PyBuffer_Release(&body);
    return result;
}

/* chain_keys(tokens, block_size, parent) -> array("Q") of the chained keys of every full
 * block, or None for blocks past MAX_BLOCK_TOKENS (the caller keys those one by one). */
static PyObject *chain_keys(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "chain_keys takes tokens, a block size and a parent key");
        return NULL;
    }
    Py_ssize_t block_size = PyLong_AsSsize_t(args[1]);
    if (block_size == -1 && PyErr_Occurred()) return NULL;
    uint64_t parent = PyLong_AsUnsignedLongLong(args[2]);
    if (parent == (uint64_t)-1 && PyErr_Occurred()) return NULL;
    if (block_size < 1) {
        PyErr_Format(PyExc_ValueError, "chain_keys: block_size=%zd must be a positive int", block_size);
        return NULL;
    }
    if (block_size > MAX_BLOCK_TOKENS) Py_RETURN_NONE;
    Py_buffer tok;
    if (!get_buffer(args[0], &tok, 4, "tokens")) return NULL;
    Py_ssize_t n_blocks = (tok.len / 4) / block_size;
    PyObject *result = NULL;
    uint64_t *keys = PyMem_Malloc(8 * (size_t)(n_blocks ? n_blocks : 1));
    if (keys == NULL) {
        PyErr_NoMemory();
    } else {
        chain((const uint8_t *)tok.buf, n_blocks, block_size, parent, keys);
        result = array_from(UINT64, keys, 8 * n_blocks);
        if (result != NULL) CALLS[CALL_KEYS]++;
        PyMem_Free(keys);
    }
    PyBuffer_Release(&tok);
    return result;
}

/* best_unmatched(slots, table, scale, n_blocks, load_weight, balance_weight,
 *                foreign_blocks, count) -> (positions, least) (load_scan.h). */
static PyObject *best_unmatched_call(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (nargs != 8) {
        PyErr_SetString(PyExc_TypeError, "best_unmatched takes 8 arguments");
        return NULL;
    }
    double figures[5];
    for (int k = 0; k < 5; k++) {
        figures[k] = PyFloat_AsDouble(args[2 + k]);
        if (figures[k] == -1.0 && PyErr_Occurred()) return NULL;
    }
    Py_ssize_t count = PyLong_AsSsize_t(args[7]);
    if (count == -1 && PyErr_Occurred()) return NULL;
    if (count < 0) {
        PyErr_Format(PyExc_ValueError, "best_unmatched: count=%zd must not be negative", count);
        return NULL;
    }
    Py_buffer slots, table;
    if (!get_buffer(args[0], &slots, 8, "best_unmatched: slots")) return NULL;
    if (!get_buffer(args[1], &table, 8, "best_unmatched: table")) {
        PyBuffer_Release(&slots);
        return NULL;
    }
    const int64_t *slot = (const int64_t *)slots.buf;
    Py_ssize_t n = slots.len / 8, rows = table.len / (8 * ROW_STRIDE);
    PyObject *result = NULL;
    int64_t *out = NULL;
    LoadKey *keys = NULL;
    for (Py_ssize_t i = 0; i < n; i++) {
        if (slot[i] < 0 || slot[i] >= rows) {
            PyErr_Format(PyExc_ValueError, "best_unmatched: slots[%zd] = %lld is not a row of the table (%zd rows)",
                         i, (long long)slot[i], rows);
            goto done;
        }
    }
    if (count > n) count = n;
    out = PyMem_Malloc(sizeof(int64_t) * (size_t)(count ? count : 1));
    keys = PyMem_Malloc(sizeof(LoadKey) * (size_t)(count ? count : 1));
    if (out == NULL || keys == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    double least;
    Py_ssize_t kept = best_unmatched(slot, n, (const double *)table.buf, figures[0], figures[1], figures[2],
                                     figures[3], figures[4], count, out, keys, &least);
    PyObject *positions = PyList_New(kept);
    for (Py_ssize_t k = 0; positions != NULL && k < kept; k++) {
        PyObject *position = PyLong_FromLongLong(out[k]);
        if (position == NULL) Py_CLEAR(positions);
        else PyList_SET_ITEM(positions, k, position);
    }
    if (positions != NULL) {
        result = Py_BuildValue("(Nd)", positions, least);
        if (result != NULL) CALLS[CALL_SCAN]++;
    }
done:
    PyMem_Free(out);
    PyMem_Free(keys);
    PyBuffer_Release(&table);
    PyBuffer_Release(&slots);
    return result;
}

/* json_float(x) -> bytes or None: how the answers write a float (for tests). */
static PyObject *json_float(PyObject *self, PyObject *arg) {
    (void)self;
    double x = PyFloat_AsDouble(arg);
    if (x == -1.0 && PyErr_Occurred()) return NULL;
    char text[64];
    Out o = {text, 0};
    if (!put_float(&o, x)) Py_RETURN_NONE;
    return PyBytes_FromStringAndSize(text, o.n);
}

/* calls() -> {kind: calls answered in this process} (for /workers). */
static PyObject *calls(PyObject *self, PyObject *unused) {
    (void)self;
    (void)unused;
    PyObject *out = PyDict_New();
    for (int k = 0; out != NULL && k < CALL_KINDS; k++) {
        PyObject *n = PyLong_FromUnsignedLongLong(CALLS[k]);
        if (n == NULL || PyDict_SetItemString(out, CALL_NAMES[k], n) < 0) Py_CLEAR(out);
        Py_XDECREF(n);
    }
    return out;
}

static PyMethodDef methods[] = {
    {"parse_input_ids", (PyCFunction)(void (*)(void))parse_input_ids, METH_FASTCALL,
     "parse_input_ids(body, lead=None) -> (ids, end) or None: a body's leading plain token-id array "
     "as an array('I'), and the index of the , or } after it."},
    {"chain_keys", (PyCFunction)(void (*)(void))chain_keys, METH_FASTCALL,
     "chain_keys(tokens, block_size, parent) -> array('Q') of chained XXH3-64 keys of full blocks, "
     "or None for blocks past MAX_BLOCK_TOKENS."},
    {"best_unmatched", (PyCFunction)(void (*)(void))best_unmatched_call, METH_FASTCALL,
     "best_unmatched(slots, table, scale, n_blocks, load_weight, balance_weight, foreign_blocks, count) "
     "-> (positions, least): the best candidates by load alone, best first."},
    {"route_answer", (PyCFunction)(void (*)(void))route_answer, METH_FASTCALL,
     "The plain /route answer of a request, its keys and longest match (see native_route.py)."},
    {"query_answer", (PyCFunction)(void (*)(void))query_answer, METH_FASTCALL,
     "The plain /query answer of a request, its keys and longest match (see native_route.py)."},
    {"board_choice", (PyCFunction)(void (*)(void))board_choice, METH_FASTCALL,
     "The best candidates of a request over the load board's loads (see native_route.py)."},
    {"json_float", json_float, METH_O, "A float as the answers write it, or None."},
    {"calls", calls, METH_NOARGS, "Calls answered in this process, per kind."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_native", "kvevents' native core (see kvevents/kernels/__init__.py).", -1, methods,
    NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__native(void) {
    if (PyType_Ready(&MaskMirrorType) < 0) return NULL;
    PyObject *array_module = PyImport_ImportModule("array");
    if (array_module == NULL) return NULL;
    ARRAY = PyObject_GetAttrString(array_module, "array");
    Py_DECREF(array_module);
    UINT32 = PyUnicode_InternFromString("I");
    UINT64 = PyUnicode_InternFromString("Q");
    FROMBYTES = PyUnicode_InternFromString("frombytes");
    INPUT_IDS = PyBytes_FromString("\"input_ids\"");
    SIXTY_FOUR = PyLong_FromLong(64);
    ZERO = PyLong_FromLong(0);
    if (ARRAY == NULL || UINT32 == NULL || UINT64 == NULL || FROMBYTES == NULL || INPUT_IDS == NULL ||
        SIXTY_FOUR == NULL || ZERO == NULL)
        return NULL;
    PyObject *m = PyModule_Create(&module);
    if (m == NULL) return NULL;
    if (PyModule_AddIntConstant(m, "ABI", ABI) < 0 ||
        PyModule_AddIntConstant(m, "MAX_BLOCK_TOKENS", MAX_BLOCK_TOKENS) < 0 ||
        PyModule_AddIntConstant(m, "MAX_TOP", MAX_TOP) < 0 ||
        PyModule_AddIntConstant(m, "CANDIDATE_BYTES", (long)sizeof(Candidate)) < 0 ||
        PyModule_AddIntConstant(m, "FRAGMENTS", FRAGMENTS) < 0 ||
        PyModule_AddIntConstant(m, "ROW_STRIDE", ROW_STRIDE) < 0 ||
        PyModule_AddObjectRef(m, "MaskMirror", (PyObject *)&MaskMirrorType) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}

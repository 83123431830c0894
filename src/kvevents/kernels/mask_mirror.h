/* The MaskMirror type: block_table.h's table as a Python object (part of _native.c).
 *
 * MaskMirror(words=1) holds the GPU tier of an index's masks for 64 * words holder
 * slots. sync() applies the index's listed writes, rebuild() copies a whole dict of
 * masks, match() answers as MaskTable._segments does over the dict, not_held() lists
 * the keys a slot lacks. kvevents/index/mask_table.py keeps one per index (and one of
 * the predictions' masks); the native answers in _native.c read it in place.
 */
#ifndef KVEVENTS_MASK_MIRROR_H
#define KVEVENTS_MASK_MIRROR_H

#include <structmember.h>

static PyObject *mirror_new(PyTypeObject *type, PyObject *args, PyObject *kwds) {
    static char *names[] = {"words", NULL};
    Py_ssize_t words = 1;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "|n:MaskMirror", names, &words)) return NULL;
    if (words < 1 || words > MAX_WORDS) {
        PyErr_Format(PyExc_ValueError, "MaskMirror(words=%zd): give 1 to %d words of 64 holder slots", words,
                     MAX_WORDS);
        return NULL;
    }
    MaskMirror *t = (MaskMirror *)type->tp_alloc(type, 0);
    if (t == NULL) return NULL;
    t->words = words;
    t->scratch = PyMem_Calloc((size_t)words, 8);
    if (t->scratch == NULL) {
        Py_DECREF(t);
        return PyErr_NoMemory();
    }
    if (!table_arrays(MIN_CAPACITY, words, &t->keys, &t->values)) {
        Py_DECREF(t);
        return NULL;
    }
    t->capacity = MIN_CAPACITY;
    return (PyObject *)t;
}

static void mirror_dealloc(MaskMirror *t) {
    PyMem_Free(t->keys);
    PyMem_Free(t->values);
    PyMem_Free(t->scratch);
    Py_XDECREF(t->live);
    Py_TYPE(t)->tp_free((PyObject *)t);
}

/* sync(keys, ops): apply the writes listed since the last sync, in order. */
static PyObject *mirror_sync(MaskMirror *t, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "MaskMirror.sync takes keys and ops");
        return NULL;
    }
    PyObject *seq = PySequence_Fast(args[0], "MaskMirror.sync: keys must be a sequence of ints");
    if (seq == NULL) return NULL;
    Py_buffer ops;
    if (!get_buffer(args[1], &ops, 8, "MaskMirror.sync: ops")) {
        Py_DECREF(seq);
        return NULL;
    }
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    const int64_t *op = (const int64_t *)ops.buf;
    int64_t limit = 64 * (int64_t)t->words;
    uint64_t *keys = NULL;
    PyObject *result = NULL;
    if (ops.len / 8 != n) {
        PyErr_Format(PyExc_ValueError, "MaskMirror.sync: %zd keys but %zd ops", n, ops.len / 8);
        goto done;
    }
    keys = PyMem_Malloc(8 * (size_t)(n ? n : 1));
    if (keys == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t j = 0; j < n; j++) { /* everything checked before the table changes */
        if (op[j] < -limit || op[j] > limit) {
            PyErr_Format(PyExc_ValueError,
                         "MaskMirror.sync: ops[%zd] = %lld names no slot of %lld (slot + 1 sets a bit, "
                         "-(slot + 1) clears it, 0 drops the key)",
                         j, (long long)op[j], (long long)limit);
            goto done;
        }
        keys[j] = PyLong_AsUnsignedLongLong(PySequence_Fast_GET_ITEM(seq, j));
        if (keys[j] == (uint64_t)-1 && PyErr_Occurred()) goto done;
    }
    if (2 * (t->count + n) > t->capacity && !grow_to(t, t->count + n)) goto done;
    for (Py_ssize_t j = 0; j < n; j++) apply_op(t, keys[j], op[j]);
    CALLS[CALL_SYNC]++;
    result = Py_NewRef(Py_None);
done:
    PyMem_Free(keys);
    PyBuffer_Release(&ops);
    Py_DECREF(seq);
    return result;
}

/* rebuild(blocks): the table afresh from a dict of key -> mask (its GPU tier). */
static PyObject *mirror_rebuild(MaskMirror *t, PyObject *blocks) {
    if (!PyDict_Check(blocks)) {
        PyErr_Format(PyExc_TypeError, "MaskMirror.rebuild takes a dict of masks, not %.100s",
                     Py_TYPE(blocks)->tp_name);
        return NULL;
    }
    Py_ssize_t words = t->words, capacity = capacity_for(PyDict_GET_SIZE(blocks)), count = 0;
    uint64_t *keys, *values;
    uint64_t *row = PyMem_Malloc(8 * (size_t)words);
    if (row == NULL) return PyErr_NoMemory();
    if (!table_arrays(capacity, words, &keys, &values)) {
        PyMem_Free(row);
        return NULL;
    }
    Py_ssize_t pos = 0;
    PyObject *key, *value;
    while (PyDict_Next(blocks, &pos, &key, &value)) {
        Py_INCREF(key);
        Py_INCREF(value);
        uint64_t k = PyLong_AsUnsignedLongLong(key);
        int ok = !(k == (uint64_t)-1 && PyErr_Occurred()) && words_of(value, row, words, 0, "a mask");
        Py_DECREF(key);
        Py_DECREF(value);
        if (!ok || count >= capacity / 2) { /* a dict grown while read: refuse it */
            if (ok) PyErr_SetString(PyExc_RuntimeError, "MaskMirror.rebuild: the dict changed size");
            PyMem_Free(keys);
            PyMem_Free(values);
            PyMem_Free(row);
            return NULL;
        }
        if (!row_empty(row, words)) count += put_row(keys, values, capacity, words, k, row);
    }
    PyMem_Free(row);
    PyMem_Free(t->keys);
    PyMem_Free(t->values);
    t->keys = keys;
    t->values = values;
    t->capacity = capacity;
    t->count = count;
    t->rebuilds++;
    Py_RETURN_NONE;
}

/* The segments of a match as Python reads them: [(holders dropped, length), ...]. */
static PyObject *segments_list(const uint64_t *dropped, const Py_ssize_t *lengths, Py_ssize_t found,
                               Py_ssize_t words) {
    PyObject *list = PyList_New(found);
    for (Py_ssize_t s = 0; list != NULL && s < found; s++) {
        PyObject *mask = int_of_words(dropped + s * words, words);
        PyObject *pair = mask == NULL ? NULL : Py_BuildValue("(Nn)", mask, lengths[s]);
        if (pair == NULL) {
            Py_CLEAR(list);
            break;
        }
        PyList_SET_ITEM(list, s, pair);
    }
    return list;
}

/* The words of ``live`` (kept from the last call: a router's live mask rarely changes). */
static const uint64_t *live_words(MaskMirror *t, PyObject *live) {
    if (t->live != NULL) {
        int same = t->live == live ? 1 : PyObject_RichCompareBool(t->live, live, Py_EQ);
        if (same < 0) return NULL;
        if (same) return t->scratch;
    }
    Py_CLEAR(t->live);
    if (!words_of(live, t->scratch, t->words, 1, "live")) return NULL;
    t->live = Py_NewRef(live);
    return t->scratch;
}

/* match(keys, live) -> (segments, longest), as MaskTable._segments answers over the dict. */
static PyObject *mirror_match(MaskMirror *t, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "MaskMirror.match takes keys and live");
        return NULL;
    }
    Py_buffer kb;
    if (!get_buffer(args[0], &kb, 8, "MaskMirror.match: keys")) return NULL;
    const uint64_t *keys = (const uint64_t *)kb.buf;
    Py_ssize_t n = kb.len / 8, words = t->words, longest;
    PyObject *segments = NULL;
    if (words == 1) {
        uint64_t live = PyLong_AsUnsignedLongLong(args[1]);
        if (!(live == (uint64_t)-1 && PyErr_Occurred())) {
            uint64_t dropped[SEGMENTS];
            Py_ssize_t lengths[SEGMENTS];
            int found;
            longest = match1(keys, n, t->keys, t->values, (uint64_t)t->capacity - 1, NULL, NULL, 0, live, dropped,
                             lengths, &found);
            segments = segments_list(dropped, lengths, found, 1);
        }
    } else {
        const uint64_t *live = live_words(t, args[1]);
        Py_ssize_t rows = (n < 64 * words ? n : 64 * words) + 1, found;
        uint64_t *held = live == NULL ? NULL : PyMem_Malloc(8 * (size_t)words * (size_t)(rows + 1));
        Py_ssize_t *lengths = held == NULL ? NULL : PyMem_Malloc(sizeof(Py_ssize_t) * (size_t)rows);
        if (live != NULL && lengths == NULL) PyErr_NoMemory();
        if (lengths != NULL) {
            longest = match_wide(t, keys, n, live, held, held + words, lengths, &found);
            segments = segments_list(held + words, lengths, found, words);
        }
        PyMem_Free(held);
        PyMem_Free(lengths);
    }
    PyBuffer_Release(&kb);
    if (segments == NULL) return NULL;
    CALLS[CALL_MATCH]++;
    return Py_BuildValue("(Nn)", segments, longest);
}

/* not_held(keys, slot) -> the keys whose mask lacks that slot's bit (absent ones too), in order. */
static PyObject *mirror_not_held(MaskMirror *t, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "MaskMirror.not_held takes keys and a slot");
        return NULL;
    }
    Py_ssize_t slot = PyLong_AsSsize_t(args[1]);
    if (slot == -1 && PyErr_Occurred()) return NULL;
    if (slot < 0 || slot >= 64 * t->words) {
        PyErr_Format(PyExc_ValueError, "MaskMirror.not_held: slot %zd is not one of 0..%zd", slot,
                     64 * t->words - 1);
        return NULL;
    }
    Py_buffer kb;
    if (!get_buffer(args[0], &kb, 8, "MaskMirror.not_held: keys")) return NULL;
    const uint64_t *keys = (const uint64_t *)kb.buf;
    Py_ssize_t n = kb.len / 8, word = slot / 64;
    uint64_t bit = 1ULL << (slot % 64);
    PyObject *out = PyList_New(0);
    for (Py_ssize_t j = 0; out != NULL && j < n; j++) {
        Py_ssize_t at = find_slot(t, keys[j]);
        if (at >= 0 && t->values[at * t->words + word] & bit) continue;
        PyObject *key = PyLong_FromUnsignedLongLong(keys[j]);
        if (key == NULL || PyList_Append(out, key) < 0) Py_CLEAR(out);
        Py_XDECREF(key);
    }
    PyBuffer_Release(&kb);
    if (out != NULL) CALLS[CALL_NOT_HELD]++;
    return out;
}

/* items() -> [(key, mask), ...] in table order (for tests). */
static PyObject *mirror_items(MaskMirror *t, PyObject *unused) {
    (void)unused;
    PyObject *out = PyList_New(0);
    for (Py_ssize_t i = 0; out != NULL && i < t->capacity; i++) {
        const uint64_t *row = t->values + i * t->words;
        if (row_empty(row, t->words)) continue;
        PyObject *mask = int_of_words(row, t->words);
        PyObject *pair = mask == NULL ? NULL : Py_BuildValue("(KN)", (unsigned long long)t->keys[i], mask);
        if (pair == NULL || PyList_Append(out, pair) < 0) Py_CLEAR(out);
        Py_XDECREF(pair);
    }
    return out;
}

static PyMethodDef mirror_methods[] = {
    {"sync", (PyCFunction)(void (*)(void))mirror_sync, METH_FASTCALL,
     "sync(keys, ops): apply the index's listed writes in order; ops (an array('q')) holds slot + 1 "
     "where that slot's bit was set, -(slot + 1) where it was cleared, 0 where the key was dropped."},
    {"rebuild", (PyCFunction)mirror_rebuild, METH_O,
     "rebuild(blocks): copy every mask of a dict (its GPU tier: the low 64 * words bits) afresh."},
    {"match", (PyCFunction)(void (*)(void))mirror_match, METH_FASTCALL,
     "match(keys, live) -> (segments, longest): a request's keys (an array('Q')) from the live slots' "
     "mask, answered as MaskTable._segments answers over the dict."},
    {"not_held", (PyCFunction)(void (*)(void))mirror_not_held, METH_FASTCALL,
     "not_held(keys, slot) -> the keys whose mask lacks that slot's bit, in order."},
    {"items", (PyCFunction)mirror_items, METH_NOARGS, "items() -> [(key, mask), ...] in table order (for tests)."},
    {NULL, NULL, 0, NULL},
};

static PyMemberDef mirror_members[] = {
    {"words", T_PYSSIZET, offsetof(MaskMirror, words), READONLY, "Words of 64 holder slots per mask."},
    {"count", T_PYSSIZET, offsetof(MaskMirror, count), READONLY, "Keys held."},
    {"capacity", T_PYSSIZET, offsetof(MaskMirror, capacity), READONLY, "Slots of the table."},
    {"grown", T_PYSSIZET, offsetof(MaskMirror, grown), READONLY, "Times the table grew (rehashed from itself)."},
    {"rebuilds", T_PYSSIZET, offsetof(MaskMirror, rebuilds), READONLY, "Rebuilds from a whole dict."},
    {NULL, 0, 0, 0, NULL},
};

static PyTypeObject MaskMirrorType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "kvevents.kernels._native.MaskMirror",
    .tp_basicsize = sizeof(MaskMirror),
    .tp_dealloc = (destructor)mirror_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "MaskMirror(words=1): an index's GPU masks for 64 * words holder slots in a flat table.",
    .tp_methods = mirror_methods,
    .tp_members = mirror_members,
    .tp_new = mirror_new,
};

#endif

/* What every entry point of the native core shares (part of _native.c): reading a buffer
 * argument, and counting the calls answered (for /workers: kvevents.kernels.calls()).
 */
#ifndef KVEVENTS_ARGS_H
#define KVEVENTS_ARGS_H

#include <stdint.h>

enum { CALL_PARSE, CALL_KEYS, CALL_SYNC, CALL_MATCH, CALL_NOT_HELD, CALL_SCAN, CALL_ROUTE, CALL_QUERY,
       CALL_CHOICE, CALL_KINDS };
static const char *const CALL_NAMES[CALL_KINDS] = {"parse", "keys", "sync", "match", "not_held",
                                                   "scan",  "route", "query", "choice"};
static unsigned long long CALLS[CALL_KINDS]; /* calls answered, per kind (the GIL is held) */

/* ``obj``'s buffer, C-contiguous, of ``itemsize``-byte items at an aligned address; 0
 * with an exception set. */
static int get_buffer(PyObject *obj, Py_buffer *view, Py_ssize_t itemsize, const char *what) {
    if (PyObject_GetBuffer(obj, view, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0) return 0;
    /* (an empty array's buffer may sit anywhere: it is never read) */
    if (view->itemsize != itemsize || (view->len && (uintptr_t)view->buf % (uintptr_t)itemsize != 0)) {
        PyErr_Format(PyExc_TypeError, "%s must hold aligned %zd-byte items (an array.array)", what, itemsize);
        PyBuffer_Release(view);
        return 0;
    }
    return 1;
}

#endif

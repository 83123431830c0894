/* JSON numbers written as msgspec writes them (part of _native.c).
 *
 * The native answers must be byte for byte what the Python path encodes with msgspec:
 * ints in decimal, floats as Python's repr where the two agree (0, and 1e-4 <= |x| <
 * 1e16). A float msgspec would write in exponent form is refused (put_float answers 0),
 * and the caller answers None: the Python path then encodes it.
 */
#ifndef KVEVENTS_JSON_OUT_H
#define KVEVENTS_JSON_OUT_H

#include <math.h>
#include <string.h>

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

#endif

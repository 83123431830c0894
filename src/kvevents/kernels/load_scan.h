/* The best holders by load, in one pass over the load board's table (part of _native.c).
 *
 * A relayed request (or a recorded /route) changes the loads it is routed by, so the
 * next one cannot reuse a ranking: it must look at every holder. The router's loads
 * live in one flat float64 table (kvevents/router/decide/load_board.py, ROW_STRIDE
 * numbers per holder slot); best_unmatched() ranks every candidate as if it cached
 * nothing of the request, by score()'s sort key (unavailable last, then the cost, the
 * pending work, the recent work, the requests routed and the position), with the same
 * float64 operations in the same order as Python, so it picks the holders Python would.
 * The caller scores the holders that matched the request itself and merges them in (a
 * match only lowers a cost). kvevents/kernels/spec.py states it in Python.
 */
#ifndef KVEVENTS_LOAD_SCAN_H
#define KVEVENTS_LOAD_SCAN_H

#include <math.h>
#include <stdint.h>

/* A slot's row in the load board's table: its fields' order. */
enum { ROW_AVAILABLE, ROW_ENGINE, ROW_INFLIGHT, ROW_BLOCKS, ROW_RAW, ROW_ROUTED, ROW_STRIDE };

/* A candidate's sort key, as score() orders candidates. */
typedef struct {
    double unavailable, cost, pending, recent, routed, position;
} LoadKey;

static inline int load_key_before(const LoadKey *a, const LoadKey *b) {
    if (a->unavailable != b->unavailable) return a->unavailable < b->unavailable;
    if (a->cost != b->cost) return a->cost < b->cost;
    if (a->pending != b->pending) return a->pending < b->pending;
    if (a->recent != b->recent) return a->recent < b->recent;
    if (a->routed != b->routed) return a->routed < b->routed;
    return a->position < b->position;
}

/* Write into out[:count] the positions (in ``slots``) of the best candidates as if none
 * cached anything of a request of ``n_blocks`` blocks, best first; answer how many were
 * written (fewer when there are fewer candidates), and the least recent work among the
 * available ones in *least (0.0 when none is). ``keys`` has room for ``count``. Every
 * slot must be a row of ``table`` (the caller checks). */
static Py_ssize_t best_unmatched(const int64_t *slots, Py_ssize_t n, const double *table, double scale,
                                 double n_blocks, double load_weight, double balance_weight, double foreign_blocks,
                                 Py_ssize_t count, int64_t *out, LoadKey *keys, double *least) {
    double lowest = INFINITY;
    for (Py_ssize_t i = 0; i < n; i++) {
        const double *row = table + ROW_STRIDE * slots[i];
        if (row[ROW_AVAILABLE] != 0.0) {
            double recent = row[ROW_RAW] * scale;
            if (recent < lowest) lowest = recent;
        }
    }
    if (lowest == INFINITY) lowest = 0.0;
    *least = lowest;
    double prefill = n_blocks > 0.0 ? n_blocks : 0.0;
    Py_ssize_t kept = 0;
    for (Py_ssize_t i = 0; i < n && count > 0; i++) {
        const double *row = table + ROW_STRIDE * slots[i];
        LoadKey key;
        key.unavailable = row[ROW_AVAILABLE] != 0.0 ? 0.0 : 1.0;
        double foreign = row[ROW_ENGINE] - row[ROW_INFLIGHT];
        key.pending = row[ROW_BLOCKS] + (foreign > 0.0 ? foreign_blocks * foreign : 0.0);
        key.recent = row[ROW_RAW] * scale;
        double balance = key.recent > lowest ? key.recent - lowest : 0.0;
        key.cost = prefill + (load_weight * key.pending + balance_weight * balance);
        key.routed = row[ROW_ROUTED];
        key.position = (double)i;
        if (kept == count && load_key_before(&keys[kept - 1], &key)) continue; /* not better than the worst kept */
        Py_ssize_t j = kept < count ? kept : count - 1;
        while (j > 0 && !load_key_before(&keys[j - 1], &key)) {
            keys[j] = keys[j - 1];
            out[j] = out[j - 1];
            j--;
        }
        keys[j] = key;
        out[j] = i;
        if (kept < count) kept++;
    }
    return kept;
}

#endif

/* Native same-host reader (tiersync.net._local): verified process_vm_readv, in parallel.
 *
 * read_summed(pid, remote, dests, threads) -> tuple of tsum64, one per destination
 *   remote: a buffer of 2 * len(dests) native uint64 (address, length) pairs, the ranges of
 *   process `pid` to copy; dests: writable C-contiguous buffers, dests[i] exactly as long as
 *   range i. Copies every range into its destination with process_vm_readv and returns the
 *   tsum64 of each destination's bytes as they landed (the caller compares them with the
 *   checksums the source sent: a range that changed or was mis-described never verifies).
 *   OSError with the kernel's errno when a copy is refused or comes up short (EFAULT).
 *
 * read_summed_at(pid, remote, dest, offsets, threads) -> the same, every range landing in the one
 *   writable buffer dest at its uint64 offset (each range checked to lie inside dest before
 *   anything is read, else ValueError): no Python object per range.
 *
 * Both take an optional (mapping, base): a buffer of this process that holds process `pid`'s
 *   memory from address `base` on (a sealed memfd both map). The ranges are then copied out of
 *   it instead of with process_vm_readv (no kernel copy per 4 KiB page), each range checked to
 *   lie inside the mapping before anything is copied (else ValueError), and each segment is
 *   copied and summed in one pass (ts_copy_partial: vector loads, the sum taken from the very
 *   registers stored, streamed stores where the destination is aligned for them).
 *
 * How: every range is cut into segments of PIECE bytes (a multiple of 64, so each segment
 *   starts on a tsum64 stripe); consecutive segments up to PIECE bytes form a unit, one
 *   process_vm_readv (or, from a mapping, one copy per segment). Up to `threads` threads (the
 *   caller's included, GIL released) take units in turn, copy one and sum each of its segments
 *   from zero while the bytes are in cache (from a mapping: while copying).
 *   tsum64's sums are a Fletcher pair, so a range's sum is the ordered combination of its
 *   segments' partial sums: from (S1, S2), a segment of m stripes with partial sums (p1, p2)
 *   gives S2 += m * S1 + p2; S1 += p1 (u64 arithmetic), then the usual digest. The result
 *   is bit-identical to tsum64 over the whole range (tests compare them).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <errno.h>
#include <pthread.h>
#include <stdatomic.h>
#include <sys/uio.h>
#include "../transfer/tsum64.h"
#include "tpool.h"

#define PIECE (256 << 10)
#define UNIT_IOV 256
#define MAX_THREADS TP_MAX
#define BYTES_PER_THREAD (2u << 20) /* less work than this per extra thread is not worth one */

typedef struct {
    uint64_t raddr;
    unsigned char *dst;
    uint64_t len;
    uint64_t s1[8], s2[8];
} segment;

typedef struct {
    int pid;
    const unsigned char *map; /* not NULL: copy from here, map[0] standing for address base */
    uint64_t base;
    segment *segs;
    size_t *units; /* unit u covers segs[units[u] .. units[u + 1]) */
    size_t nunits;
    atomic_size_t next;
    atomic_int err;
} task;

/* One unit's ranges, all of them, with as many calls as the kernel needs. 0 or an errno. */
static int copy_unit(int pid, segment *s, size_t n) {
    struct iovec lv[UNIT_IOV], rv[UNIT_IOV];
    for (size_t i = 0; i < n; i++) {
        lv[i] = (struct iovec){s[i].dst, s[i].len};
        rv[i] = (struct iovec){(void *)(uintptr_t)s[i].raddr, s[i].len};
    }
    size_t first = 0;
    while (first < n) {
        ssize_t got = process_vm_readv(pid, lv + first, n - first, rv + first, n - first, 0);
        if (got < 0 && errno == EINTR) continue;
        if (got < 0) return errno;
        if (got == 0) return EFAULT;
        while (first < n && (size_t)got >= lv[first].iov_len) {
            got -= (ssize_t)lv[first].iov_len;
            first++;
        }
        if (first < n && got > 0) { /* a partial range: the rest of it, in both vectors */
            lv[first].iov_base = (char *)lv[first].iov_base + got;
            lv[first].iov_len -= (size_t)got;
            rv[first].iov_base = (char *)rv[first].iov_base + got;
            rv[first].iov_len -= (size_t)got;
        }
    }
    return 0;
}

/* Partial tsum64 sums of one segment from zero (a final partial stripe zero-padded, as the
 * digest does: only a range's last segment can have one). */
static void sum_segment(segment *s) { ts_partial(s->s1, s->s2, s->dst, (size_t)s->len); }

/* One unit's ranges out of the mapping (every range was checked to lie inside it), each
 * segment copied and summed in one pass (ts_copy_partial: the sum is of the bytes stored). */
static int copy_mapped(const task *t, segment *s, size_t n) {
    for (size_t i = 0; i < n; i++)
        ts_copy_partial(s[i].s1, s[i].s2, s[i].dst, t->map + (s[i].raddr - t->base), (size_t)s[i].len);
    ts_copy_fence();
    return 0;
}

static void *worker(void *arg) {
    task *t = arg;
    for (;;) {
        size_t u = atomic_fetch_add(&t->next, 1);
        if (u >= t->nunits || atomic_load(&t->err)) break;
        size_t a = t->units[u], b = t->units[u + 1];
        int err = t->map ? copy_mapped(t, t->segs + a, b - a) : copy_unit(t->pid, t->segs + a, b - a);
        if (err) {
            int none = 0;
            atomic_compare_exchange_strong(&t->err, &none, err);
            break;
        }
        if (t->map == NULL)
            for (size_t i = a; i < b; i++) sum_segment(&t->segs[i]);
    }
    return NULL;
}

/* Segments and units for `count` ranges; returns the number of segments (units in *nunits). */
static size_t plan(const uint64_t *remote, Py_buffer *dests, Py_ssize_t count, segment *segs, size_t *units,
                   size_t *nunits) {
    size_t ns = 0, nu = 0, unit_bytes = 0;
    for (Py_ssize_t r = 0; r < count; r++) {
        for (uint64_t off = 0; off < remote[2 * r + 1]; off += PIECE) {
            uint64_t len = remote[2 * r + 1] - off < PIECE ? remote[2 * r + 1] - off : PIECE;
            if (ns == 0 || unit_bytes >= PIECE || ns - units[nu - 1] == UNIT_IOV) {
                units[nu++] = ns;
                unit_bytes = 0;
            }
            segs[ns++] = (segment){.raddr = remote[2 * r] + off, .dst = (unsigned char *)dests[r].buf + off, .len = len};
            unit_bytes += len;
        }
    }
    units[nu] = ns;
    *nunits = nu;
    return ns;
}

/* Run the task on up to `threads` threads (this one included; helpers from tpool.h). */
static void run(task *t, size_t threads, void *(*fn)(void *)) { tp_run(fn, t, threads); }

static uint64_t digest(const segment *s, size_t n) {
    ts_state st;
    ts_init(&st, 0);
    for (size_t i = 0; i < n; i++) ts_join(&st, s[i].s1, s[i].s2, s[i].len);
    return ts_digest(&st);
}

static void release(Py_buffer *views, Py_ssize_t n) {
    for (Py_ssize_t i = 0; i < n; i++) PyBuffer_Release(&views[i]);
    PyMem_Free(views);
}

/* Destination buffers, each writable, contiguous and exactly as long as its range. */
static Py_buffer *get_dests(PyObject *dests, const uint64_t *remote, uint64_t *total, size_t *nsegs) {
    Py_ssize_t count = PyList_GET_SIZE(dests);
    Py_buffer *views = PyMem_Calloc((size_t)count + 1, sizeof(Py_buffer));
    if (views == NULL) return (Py_buffer *)PyErr_NoMemory();
    for (Py_ssize_t i = 0; i < count; i++) {
        if (PyObject_GetBuffer(PyList_GET_ITEM(dests, i), &views[i], PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0) {
            release(views, i);
            return NULL;
        }
        if ((uint64_t)views[i].len != remote[2 * i + 1]) {
            release(views, i + 1);
            PyErr_Format(PyExc_ValueError, "dests[%zd] holds %zd bytes, its range %llu", i, views[i].len,
                         (unsigned long long)remote[2 * i + 1]);
            return NULL;
        }
        *total += remote[2 * i + 1];
        *nsegs += (size_t)((remote[2 * i + 1] + PIECE - 1) / PIECE);
    }
    return views;
}

static PyObject *sums_of(const segment *segs, const uint64_t *remote, Py_ssize_t count) {
    PyObject *out = PyTuple_New(count);
    size_t at = 0;
    for (Py_ssize_t r = 0; out != NULL && r < count; r++) {
        size_t n = (size_t)((remote[2 * r + 1] + PIECE - 1) / PIECE);
        PyObject *v = PyLong_FromUnsignedLongLong(digest(segs + at, n));
        if (v == NULL) Py_CLEAR(out);
        else PyTuple_SET_ITEM(out, r, v);
        at += n;
    }
    return out;
}

/* Copy `count` ranges of process `pid` into `views` (each exactly as long as its range) and sum
 * each landed range, on up to `threads` threads: the tuple of sums, or NULL with OSError (the
 * kernel's errno) or MemoryError set. */
static PyObject *copy_summed(int pid, const Py_buffer *map, uint64_t base, const uint64_t *remote, Py_buffer *views,
                             Py_ssize_t count, uint64_t total, size_t nsegs, int threads) {
    segment *segs = PyMem_Calloc(nsegs + 1, sizeof(segment));
    size_t *units = segs ? PyMem_Calloc(nsegs + 2, sizeof(size_t)) : NULL;
    size_t nunits = 0;
    PyObject *out = NULL;
    if (units == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    plan(remote, views, count, segs, units, &nunits);
    task t = {.pid = pid, .map = map->buf, .base = base, .segs = segs, .units = units, .nunits = nunits};
    size_t want = 1 + (size_t)(total / BYTES_PER_THREAD);
    if (want > (size_t)threads) want = (size_t)threads;
    if (want > MAX_THREADS) want = MAX_THREADS;
    Py_BEGIN_ALLOW_THREADS
    run(&t, want, worker);
    Py_END_ALLOW_THREADS
    if (atomic_load(&t.err)) {
        errno = atomic_load(&t.err);
        PyErr_SetFromErrno(PyExc_OSError);
    } else {
        out = sums_of(segs, remote, count);
    }
done:
    PyMem_Free(units);
    PyMem_Free(segs);
    return out;
}

/* Every range inside the mapping `map` standing for addresses from `base` on (an empty map: no
 * mapping, anything goes); else ValueError. 1 when they all are. */
static int inside(const Py_buffer *map, uint64_t base, const uint64_t *remote, Py_ssize_t count) {
    for (Py_ssize_t r = 0; map->buf != NULL && r < count; r++) {
        uint64_t at = remote[2 * r], len = remote[2 * r + 1];
        if (at < base || at - base > (uint64_t)map->len || len > (uint64_t)map->len - (at - base)) {
            PyErr_Format(PyExc_ValueError, "range %zd lies outside the mapping", r);
            return 0;
        }
    }
    return 1;
}

static PyObject *read_summed(PyObject *self, PyObject *args) {
    int pid, threads;
    Py_buffer rv, mv = {0};
    unsigned long long base = 0;
    PyObject *dests;
    if (!PyArg_ParseTuple(args, "iy*O!i|y*K", &pid, &rv, &PyList_Type, &dests, &threads, &mv, &base)) return NULL;
    Py_ssize_t count = PyList_GET_SIZE(dests);
    PyObject *out = NULL;
    if (rv.len != count * 16 || threads < 1) {
        PyErr_SetString(PyExc_ValueError, "remote must hold one (address, length) uint64 pair per dest; threads >= 1");
    } else if (inside(&mv, base, rv.buf, count)) {
        const uint64_t *remote = rv.buf;
        uint64_t total = 0;
        size_t nsegs = 0;
        Py_buffer *views = get_dests(dests, remote, &total, &nsegs);
        out = views ? copy_summed(pid, &mv, base, remote, views, count, total, nsegs, threads) : NULL;
        if (views) release(views, count);
    }
    if (mv.obj != NULL) PyBuffer_Release(&mv);
    PyBuffer_Release(&rv);
    return out;
}

/* read_summed_at(pid, remote, dest, offsets, threads): read_summed into one writable buffer,
 * range i landing at dest + offsets[i] (uint64 each; every range inside dest, else ValueError):
 * no Python object per range (a KV layer's blocks, a pool's slots). */
static PyObject *read_summed_at(PyObject *self, PyObject *args) {
    int pid, threads;
    Py_buffer rv, dv, ov, mv = {0};
    unsigned long long base = 0;
    if (!PyArg_ParseTuple(args, "iy*w*y*i|y*K", &pid, &rv, &dv, &ov, &threads, &mv, &base)) return NULL;
    Py_ssize_t count = ov.len / 8;
    const uint64_t *remote = rv.buf, *offs = ov.buf;
    int bad = rv.len != count * 16 || ov.len % 8 != 0 || threads < 1 || !PyBuffer_IsContiguous(&dv, 'C');
    Py_buffer *views = bad ? NULL : PyMem_Calloc((size_t)count + 1, sizeof(Py_buffer));
    uint64_t total = 0;
    size_t nsegs = 0;
    for (Py_ssize_t r = 0; views && !bad && r < count; r++) {
        uint64_t off = offs[r], len = remote[2 * r + 1];
        bad = off > (uint64_t)dv.len || len > (uint64_t)dv.len - off;
        views[r].buf = (char *)dv.buf + off, views[r].len = (Py_ssize_t)len;
        total += len;
        nsegs += (size_t)((len + PIECE - 1) / PIECE);
    }
    PyObject *out = NULL;
    if (bad)
        PyErr_SetString(PyExc_ValueError, "one remote (address, length) pair per dest offset, every range inside dest");
    else if (views == NULL)
        PyErr_NoMemory();
    else if (inside(&mv, base, remote, count))
        out = copy_summed(pid, &mv, base, remote, views, count, total, nsegs, threads);
    PyMem_Free(views);
    if (mv.obj != NULL) PyBuffer_Release(&mv);
    PyBuffer_Release(&ov);
    PyBuffer_Release(&dv);
    PyBuffer_Release(&rv);
    return out;
}

/* sum_ranges(buffer, ranges, threads[, states]) -> tsum64 of each (offset, length) range of
 * buffer, the ranges cut into segments summed on up to `threads` threads and combined as
 * read_summed's are (a source checksums what it is about to offer without a Python call per
 * range). `states`, a writable buffer of 17 uint64 per range, receives each range's partial
 * state (tsum64_partial's layout), so a run of ranges composes into the checksum of their
 * concatenation without reading them again. */
static void *sum_worker(void *arg) {
    task *t = arg;
    for (;;) {
        size_t u = atomic_fetch_add(&t->next, 1);
        if (u >= t->nunits) break;
        for (size_t i = t->units[u]; i < t->units[u + 1]; i++) sum_segment(&t->segs[i]);
    }
    return NULL;
}

/* Each range's partial state from zero (17 u64: tsum64_partial's layout) into out: its
 * segments joined as ts_join joins parts (S2 += m * S1 + p2; S1 += p1). */
static void states_of(const segment *segs, const uint64_t *pairs, Py_ssize_t count, uint64_t *out) {
    size_t at = 0;
    for (Py_ssize_t r = 0; r < count; r++, out += 17) {
        size_t n = (size_t)((pairs[2 * r + 1] + PIECE - 1) / PIECE);
        memset(out, 0, 16 * sizeof(uint64_t));
        for (size_t i = at; i < at + n; i++) {
            uint64_t stripes = (segs[i].len + 63) / 64;
            for (int k = 0; k < 8; k++) {
                out[8 + k] += stripes * out[k] + segs[i].s2[k];
                out[k] += segs[i].s1[k];
            }
        }
        out[16] = pairs[2 * r + 1];
        at += n;
    }
}

static PyObject *sum_ranges(PyObject *self, PyObject *args) {
    Py_buffer bv, rv, sv = {0};
    int threads;
    if (!PyArg_ParseTuple(args, "y*y*i|w*", &bv, &rv, &threads, &sv)) return NULL;
    Py_ssize_t count = rv.len / 16;
    uint64_t *pairs = PyMem_Calloc((size_t)count * 2 + 2, sizeof(uint64_t));
    Py_buffer *views = PyMem_Calloc((size_t)count + 1, sizeof(Py_buffer));
    size_t nsegs = 0, nunits = 0;
    PyObject *out = NULL;
    int bad = rv.len % 16 != 0 || threads < 1 || (sv.obj != NULL && sv.len != count * 17 * 8);
    for (Py_ssize_t r = 0; pairs && !bad && r < count; r++) {
        uint64_t off = ((const uint64_t *)rv.buf)[2 * r], len = ((const uint64_t *)rv.buf)[2 * r + 1];
        bad = off > (uint64_t)bv.len || len > (uint64_t)bv.len - off;
        pairs[2 * r] = 0, pairs[2 * r + 1] = len;
        views[r].buf = (char *)bv.buf + off, views[r].len = (Py_ssize_t)len;
        nsegs += (size_t)((len + PIECE - 1) / PIECE);
    }
    segment *segs = pairs && views && !bad ? PyMem_Calloc(nsegs + 1, sizeof(segment)) : NULL;
    size_t *units = segs ? PyMem_Calloc(nsegs + 2, sizeof(size_t)) : NULL;
    if (units == NULL) {
        if (bad)
            PyErr_SetString(PyExc_ValueError, "ranges must be (offset, length) uint64 pairs inside the buffer, "
                                              "states 17 uint64 per range");
        else PyErr_NoMemory();
        goto done;
    }
    plan(pairs, views, count, segs, units, &nunits);
    task t = {.segs = segs, .units = units, .nunits = nunits};
    size_t want = 1 + (size_t)(bv.len / BYTES_PER_THREAD);
    if (want > (size_t)threads) want = (size_t)threads;
    if (want > MAX_THREADS) want = MAX_THREADS;
    Py_BEGIN_ALLOW_THREADS
    run(&t, want, sum_worker);
    Py_END_ALLOW_THREADS
    out = sums_of(segs, pairs, count);
    if (out != NULL && sv.obj != NULL) {
        uint64_t *w = PyMem_Malloc((size_t)count * 17 * sizeof(uint64_t) + 1);
        if (w == NULL) {
            Py_CLEAR(out);
            PyErr_NoMemory();
        } else {
            states_of(segs, pairs, count, w);
            memcpy(sv.buf, w, (size_t)count * 17 * sizeof(uint64_t)); /* sv may be unaligned */
            PyMem_Free(w);
        }
    }
done:
    PyMem_Free(units);
    PyMem_Free(segs);
    PyMem_Free(views);
    PyMem_Free(pairs);
    if (sv.obj != NULL) PyBuffer_Release(&sv);
    PyBuffer_Release(&rv);
    PyBuffer_Release(&bv);
    return out;
}

/* The address of a contiguous buffer (read-only ones too): what a reader's iovec names. */
static PyObject *address(PyObject *self, PyObject *obj) {
    Py_buffer v;
    if (PyObject_GetBuffer(obj, &v, PyBUF_C_CONTIGUOUS) < 0) return NULL;
    PyObject *out = PyLong_FromVoidPtr(v.len ? v.buf : NULL);
    PyBuffer_Release(&v);
    return out;
}

static PyMethodDef methods[] = {
    {"address", address, METH_O, "address(buffer) -> int: where a C-contiguous buffer's bytes start."},
    {"sum_ranges", sum_ranges, METH_VARARGS,
     "sum_ranges(buffer, ranges, threads[, states]) -> tsum64 of each range (and its partial state)."},
    {"read_summed_at", read_summed_at, METH_VARARGS,
     "read_summed_at(pid, remote, dest, offsets, threads[, mapping, base]) -> tsum64 of each range landed in dest."},
    {"read_summed", read_summed, METH_VARARGS,
     "read_summed(pid, remote, dests, threads[, mapping, base]) -> tsum64 of each landed range (module comment)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_local", NULL, -1, methods};

PyMODINIT_FUNC PyInit__local(void) {
    ts_pick();
    tp_init();
    return PyModule_Create(&module);
}

/* Native span copier for tiersync.
 *
 * copy_spans(src_addr, dst_addr, src_offsets, dst_offsets, lengths, streaming)
 *   copies lengths[i] bytes from src_addr + src_offsets[i] to dst_addr + dst_offsets[i]
 *   for every i, with the GIL released. The offset and length arrays are int64
 *   buffers of equal size. Bounds are the caller's contract: the Python side
 *   validates every span against both buffers before calling.
 *   streaming != 0 uses non-temporal stores on x86-64 (no read-for-ownership of
 *   the destination), which is what lets scattered 16-64 KiB block copies reach
 *   the speed of one large memcpy.
 *
 * tsum64(buffer, seed=0) -> int, and the incremental Tsum64(seed=0) with update(buffer) and
 *   intdigest(): tiersync's own 64-bit payload checksum (error detection, not cryptographic),
 *   GIL released for inputs of TS_GIL_FREE bytes or more. Spec (u64 arithmetic mod 2**64,
 *   u32 additions mod 2**32, words little-endian; K[i] = KEY[i] low / high 32 bits):
 *     s1[i] = seed ^ INIT[i], s2[i] = seed, i = 0..7
 *     every 64-byte stripe of words w[0..7] (a final partial stripe is zero-padded):
 *       t = u64(lo32(w[i]) + Klo[i]) * u64(hi32(w[i]) + Khi[i]) + w[i]
 *       s1[i] += t; s2[i] += s1[i]                (a Fletcher-style pair: order matters)
 *     h = seed ^ (total_length * M5); for i = 0..7: h = fold(fold(h, s1[i]), s2[i])
 *     fold(h, x) = rotl(h ^ (x * M3), 31) * M4
 *     avalanche: h ^= h >> 31; h *= M5; h ^= h >> 29; h *= M3; h ^= h >> 32
 *   Splitting the input across update() calls never changes the result. The stripe loop is
 *   written with 32x32->64 vector multiplies (SSE2, AVX2, AVX-512F), the widest the CPU has
 *   picked at load time.
 *
 * tsum64_partial / tsum64_compose: a buffer's partial state, and the tsum64 of a concatenation
 *   from its parts' states. copy_partials(dst, src, piece): copy src into dst and return the
 *   partial state of each piece of what landed, in one pass (a trainer shard's version buffer).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>
#if defined(__x86_64__) || defined(_M_X64)
#include <emmintrin.h>
#define TS_HAVE_SSE2 1
#endif

static void stream_copy(char *d, const char *s, int64_t n) {
#ifdef TS_HAVE_SSE2
    uintptr_t mis = (uintptr_t)d & 15;
    if (mis) {
        int64_t head = 16 - (int64_t)mis;
        if (head > n) head = n;
        memcpy(d, s, (size_t)head);
        d += head; s += head; n -= head;
    }
    int64_t i = 0;
    for (; i + 64 <= n; i += 64) {
        __m128i a = _mm_loadu_si128((const __m128i *)(s + i));
        __m128i b = _mm_loadu_si128((const __m128i *)(s + i + 16));
        __m128i c = _mm_loadu_si128((const __m128i *)(s + i + 32));
        __m128i e = _mm_loadu_si128((const __m128i *)(s + i + 48));
        _mm_stream_si128((__m128i *)(d + i), a);
        _mm_stream_si128((__m128i *)(d + i + 16), b);
        _mm_stream_si128((__m128i *)(d + i + 32), c);
        _mm_stream_si128((__m128i *)(d + i + 48), e);
    }
    if (i < n) memcpy(d + i, s + i, (size_t)(n - i));
#else
    memcpy(d, s, (size_t)n);
#endif
}

static int get_i64(PyObject *obj, Py_buffer *view, const char *name) {
    if (PyObject_GetBuffer(obj, view, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0) return -1;
    if (view->itemsize != 8 || (view->format && strcmp(view->format, "q") && strcmp(view->format, "l"))) {
        PyErr_Format(PyExc_TypeError, "%s must be a contiguous int64 buffer", name);
        PyBuffer_Release(view);
        return -1;
    }
    return 0;
}

static PyObject *copy_spans(PyObject *self, PyObject *args) {
    unsigned long long src, dst;
    PyObject *so_obj, *do_obj, *len_obj;
    int streaming = 0;
    if (!PyArg_ParseTuple(args, "KKOOO|p", &src, &dst, &so_obj, &do_obj, &len_obj, &streaming)) return NULL;
    Py_buffer so, dof, ln;
    if (get_i64(so_obj, &so, "src_offsets") < 0) return NULL;
    if (get_i64(do_obj, &dof, "dst_offsets") < 0) { PyBuffer_Release(&so); return NULL; }
    if (get_i64(len_obj, &ln, "lengths") < 0) { PyBuffer_Release(&so); PyBuffer_Release(&dof); return NULL; }
    Py_ssize_t n = so.len / 8;
    if (dof.len / 8 != n || ln.len / 8 != n) {
        PyBuffer_Release(&so); PyBuffer_Release(&dof); PyBuffer_Release(&ln);
        PyErr_SetString(PyExc_ValueError, "offset and length arrays differ in size");
        return NULL;
    }
    const int64_t *s_off = (const int64_t *)so.buf, *d_off = (const int64_t *)dof.buf, *len = (const int64_t *)ln.buf;
    char *sb = (char *)(uintptr_t)src, *db = (char *)(uintptr_t)dst;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < n; i++) {
        if (streaming && len[i] >= 4096) stream_copy(db + d_off[i], sb + s_off[i], len[i]);
        else memcpy(db + d_off[i], sb + s_off[i], (size_t)len[i]);
    }
#ifdef TS_HAVE_SSE2
    if (streaming) _mm_sfence();
#endif
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&so); PyBuffer_Release(&dof); PyBuffer_Release(&ln);
    Py_RETURN_NONE;
}

/* copy_blocks: every region of a block pattern, for every block pair (see kernel.py). */
static PyObject *copy_blocks(PyObject *self, PyObject *args) {
    unsigned long long src, dst;
    PyObject *obj[5];
    int streaming = 0;
    static const char *names[5] = {"src_blocks", "dst_blocks", "src_regions", "dst_regions", "lengths"};
    if (!PyArg_ParseTuple(args, "KKOOOOO|p", &src, &dst, &obj[0], &obj[1], &obj[2], &obj[3], &obj[4], &streaming))
        return NULL;
    Py_buffer v[5];
    int got = 0;
    for (; got < 5; got++)
        if (get_i64(obj[got], &v[got], names[got]) < 0) break;
    if (got == 5 && (v[1].len != v[0].len || v[3].len != v[2].len || v[4].len != v[2].len)) {
        PyErr_SetString(PyExc_ValueError, "block arrays and region arrays must each agree in size");
        got = -got;
    }
    if (got != 5) {
        for (int i = 0; i < (got < 0 ? -got : got); i++) PyBuffer_Release(&v[i]);
        return NULL;
    }
    const int64_t *sb = v[0].buf, *db = v[1].buf, *sr = v[2].buf, *dr = v[3].buf, *len = v[4].buf;
    Py_ssize_t nb = v[0].len / 8, nr = v[2].len / 8;
    char *s0 = (char *)(uintptr_t)src, *d0 = (char *)(uintptr_t)dst;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t b = 0; b < nb; b++) {
        char *s = s0 + sb[b], *d = d0 + db[b];
        for (Py_ssize_t r = 0; r < nr; r++) {
            if (streaming && len[r] >= 256) stream_copy(d + dr[r], s + sr[r], len[r]);
            else memcpy(d + dr[r], s + sr[r], (size_t)len[r]);
        }
    }
#ifdef TS_HAVE_SSE2
    if (streaming) _mm_sfence();
#endif
    Py_END_ALLOW_THREADS
    for (int i = 0; i < 5; i++) PyBuffer_Release(&v[i]);
    Py_RETURN_NONE;
}

/* ---- tsum64 (core in tsum64.h) ------------------------------------------------------ */
#include "tsum64.h"

/* Feed a buffer-protocol object into st; the GIL is released for large inputs. */
static int ts_feed(ts_state *st, PyObject *obj) {
    Py_buffer view;
    if (PyObject_GetBuffer(obj, &view, PyBUF_C_CONTIGUOUS) < 0) return -1;
    if (view.len >= TS_GIL_FREE) {
        Py_BEGIN_ALLOW_THREADS
        ts_update(st, (const unsigned char *)view.buf, (size_t)view.len);
        Py_END_ALLOW_THREADS
    } else {
        ts_update(st, (const unsigned char *)view.buf, (size_t)view.len);
    }
    PyBuffer_Release(&view);
    return 0;
}

/* Feed the concatenation of a list or tuple of buffers into st: every buffer taken first (the
 * GIL held), then one GIL-free pass over all of them when they add up to TS_GIL_FREE bytes. */
static int ts_feed_parts(ts_state *st, PyObject *parts) {
    Py_ssize_t n = PySequence_Fast_GET_SIZE(parts), got = 0;
    Py_buffer *views = PyMem_Calloc(n ? (size_t)n : 1, sizeof(Py_buffer));
    if (views == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    size_t total = 0;
    for (; got < n; got++) {
        if (PyObject_GetBuffer(PySequence_Fast_GET_ITEM(parts, got), &views[got], PyBUF_C_CONTIGUOUS) < 0) break;
        total += (size_t)views[got].len;
    }
    if (got == n) {
        int free_gil = total >= TS_GIL_FREE;
        PyThreadState *ts = free_gil ? PyEval_SaveThread() : NULL;
        for (Py_ssize_t i = 0; i < n; i++) ts_update(st, (const unsigned char *)views[i].buf, (size_t)views[i].len);
        if (free_gil) PyEval_RestoreThread(ts);
    }
    for (Py_ssize_t i = 0; i < got; i++) PyBuffer_Release(&views[i]);
    PyMem_Free(views);
    return got == n ? 0 : -1;
}

static PyObject *tsum64(PyObject *self, PyObject *args, PyObject *kwargs) {
    static char *kwlist[] = {"data", "seed", NULL};
    PyObject *obj;
    unsigned long long seed = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "O|K", kwlist, &obj, &seed)) return NULL;
    ts_state st;
    ts_init(&st, seed);
    int rc;
    if (PyList_Check(obj) || PyTuple_Check(obj)) { /* the concatenation of the parts */
        PyObject *parts = PySequence_Tuple(obj); /* a snapshot: a part's buffer hook cannot resize it */
        if (parts == NULL) return NULL;
        rc = ts_feed_parts(&st, parts);
        Py_DECREF(parts);
    } else {
        rc = ts_feed(&st, obj);
    }
    if (rc < 0) return NULL;
    return PyLong_FromUnsignedLongLong(ts_digest(&st));
}

/* A partial state: the stripe sums of one buffer from zero (a final partial stripe zero-padded)
 * and its length, 17 native u64 (ts_partial). Buffers whose partials are composed in order
 * (ts_join) give the tsum64 of their concatenation when every one but the last is a whole
 * number of stripes; the same two steps combine a same-host read's pieces in _local.c. */
#define PARTIAL_WORDS 17
static PyObject *tsum64_partial(PyObject *self, PyObject *obj) {
    Py_buffer view;
    if (PyObject_GetBuffer(obj, &view, PyBUF_C_CONTIGUOUS) < 0) return NULL;
    uint64_t w[PARTIAL_WORDS];
    size_t n = (size_t)view.len;
    PyThreadState *ts = n >= TS_GIL_FREE ? PyEval_SaveThread() : NULL;
    ts_partial(w, w + 8, view.buf, n);
    if (ts) PyEval_RestoreThread(ts);
    w[16] = (uint64_t)n;
    PyBuffer_Release(&view);
    return PyBytes_FromStringAndSize((const char *)w, sizeof w);
}

static PyObject *tsum64_compose(PyObject *self, PyObject *args) {
    PyObject *obj;
    unsigned long long seed = 0;
    if (!PyArg_ParseTuple(args, "O|K", &obj, &seed)) return NULL;
    PyObject *parts = PySequence_Tuple(obj);
    if (parts == NULL) return NULL;
    ts_state st;
    ts_init(&st, seed);
    Py_ssize_t n = PySequence_Fast_GET_SIZE(parts);
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *item = PySequence_Fast_GET_ITEM(parts, i);
        uint64_t w[PARTIAL_WORDS];
        if (!PyBytes_Check(item) || PyBytes_GET_SIZE(item) != (Py_ssize_t)sizeof w) {
            Py_DECREF(parts);
            PyErr_Format(PyExc_ValueError, "partials[%zd] is not a tsum64_partial() value", i);
            return NULL;
        }
        memcpy(w, PyBytes_AS_STRING(item), sizeof w);
        if (i + 1 < n && w[16] % 64) {
            Py_DECREF(parts);
            PyErr_Format(PyExc_ValueError, "partials[%zd] is not a whole number of stripes and not the last", i);
            return NULL;
        }
        ts_join(&st, w, w + 8, w[16]);
    }
    Py_DECREF(parts);
    return PyLong_FromUnsignedLongLong(ts_digest(&st));
}

/* copy_partials(dst, src, piece): copy src into dst (equal lengths) and return the partial
 * state (tsum64_partial) of every piece of `piece` bytes of what landed, in order (the last
 * piece may be shorter), concatenated: one pass, the sums taken from the registers stored
 * (ts_copy_partial). `piece` is a positive multiple of 64, so the pieces compose. */
static PyObject *copy_partials(PyObject *self, PyObject *args) {
    PyObject *dst_obj, *src_obj;
    Py_ssize_t piece;
    if (!PyArg_ParseTuple(args, "OOn", &dst_obj, &src_obj, &piece)) return NULL;
    if (piece <= 0 || piece % 64) {
        PyErr_SetString(PyExc_ValueError, "piece must be a positive multiple of 64");
        return NULL;
    }
    Py_buffer dst, src;
    if (PyObject_GetBuffer(dst_obj, &dst, PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE) < 0) return NULL;
    if (PyObject_GetBuffer(src_obj, &src, PyBUF_C_CONTIGUOUS) < 0) {
        PyBuffer_Release(&dst);
        return NULL;
    }
    PyObject *out = NULL;
    if (dst.len != src.len) {
        PyErr_SetString(PyExc_ValueError, "dst and src differ in length");
        goto done;
    }
    size_t n = (size_t)src.len, count = (n + (size_t)piece - 1) / (size_t)piece;
    out = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)(count * PARTIAL_WORDS * sizeof(uint64_t)));
    if (out == NULL) goto done;
    char *at = PyBytes_AS_STRING(out);
    PyThreadState *ts = n >= TS_GIL_FREE ? PyEval_SaveThread() : NULL;
    for (size_t i = 0; i < count; i++, at += sizeof(uint64_t) * PARTIAL_WORDS) {
        size_t off = i * (size_t)piece, len = n - off < (size_t)piece ? n - off : (size_t)piece;
        uint64_t w[PARTIAL_WORDS];
        ts_copy_partial(w, w + 8, (unsigned char *)dst.buf + off, (const unsigned char *)src.buf + off, len);
        w[16] = (uint64_t)len;
        memcpy(at, w, sizeof w);
    }
    ts_copy_fence();
    if (ts) PyEval_RestoreThread(ts);
done:
    PyBuffer_Release(&src);
    PyBuffer_Release(&dst);
    return out;
}

/* Tests: tsum64 through a named stripe implementation ("scalar", "sse2", "avx2", "avx512"). */
static PyObject *tsum64_using(PyObject *self, PyObject *args) {
    const char *name;
    PyObject *obj;
    if (!PyArg_ParseTuple(args, "sO", &name, &obj)) return NULL;
    ts_stripes_fn saved = ts_stripes, fn = NULL;
    if (!strcmp(name, "scalar")) fn = ts_stripes_scalar;
#ifdef TS_HAVE_SSE2
    if (!strcmp(name, "sse2")) fn = ts_stripes_sse2;
    if (!strcmp(name, "avx2") && __builtin_cpu_supports("avx2")) fn = ts_stripes_avx2;
    if (!strcmp(name, "avx512") && __builtin_cpu_supports("avx512f")) fn = ts_stripes_avx512;
#endif
    if (fn == NULL) {
        PyErr_Format(PyExc_ValueError, "stripe implementation %s is not available here", name);
        return NULL;
    }
    Py_buffer view;
    if (PyObject_GetBuffer(obj, &view, PyBUF_C_CONTIGUOUS) < 0) return NULL;
    ts_state st;
    ts_init(&st, 0);
    ts_stripes = fn; /* the GIL is held throughout: no other thread sees the swap */
    ts_update(&st, (const unsigned char *)view.buf, (size_t)view.len);
    uint64_t h = ts_digest(&st);
    ts_stripes = saved;
    PyBuffer_Release(&view);
    return PyLong_FromUnsignedLongLong(h);
}

/* Tests: copy_partials(dst, src, len(src)) through a named copy loop ("plain", "avx2", "avx512"),
 * the GIL held throughout (no other thread sees the swap). */
static PyObject *copy_partials_using(PyObject *self, PyObject *args) {
    const char *name;
    PyObject *dst, *src;
    if (!PyArg_ParseTuple(args, "sOO", &name, &dst, &src)) return NULL;
    ts_copy_fn saved = ts_copy_stripes, fn = NULL;
    if (!strcmp(name, "plain")) fn = ts_copy_stripes_plain;
#ifdef TS_HAVE_SSE2
    if (!strcmp(name, "avx2") && __builtin_cpu_supports("avx2")) fn = ts_copy_stripes_avx2;
    if (!strcmp(name, "avx512") && __builtin_cpu_supports("avx512f")) fn = ts_copy_stripes_avx512;
#endif
    if (fn == NULL) {
        PyErr_Format(PyExc_ValueError, "copy implementation %s is not available here", name);
        return NULL;
    }
    Py_buffer view;  /* its length in bytes: a longer copy would run without the GIL, the loop swapped */
    if (PyObject_GetBuffer(src, &view, PyBUF_SIMPLE) < 0) return NULL;
    Py_ssize_t n = view.len;
    PyBuffer_Release(&view);
    if (n >= TS_GIL_FREE) {
        PyErr_SetString(PyExc_ValueError, "tests copy less than TS_GIL_FREE bytes");
        return NULL;
    }
    PyObject *call = Py_BuildValue("(OOn)", dst, src, n > 0 ? ((n + 63) / 64) * 64 : 64);
    if (call == NULL) return NULL;
    ts_copy_stripes = fn;
    PyObject *out = copy_partials(self, call);
    ts_copy_stripes = saved;
    Py_DECREF(call);
    return out;
}

typedef struct {
    PyObject_HEAD
    ts_state st;
    int busy; /* set while update() runs without the GIL: a concurrent update is refused */
} Tsum64Object;

static int Tsum64_init(Tsum64Object *self, PyObject *args, PyObject *kwargs) {
    static char *kwlist[] = {"seed", NULL};
    unsigned long long seed = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "|K", kwlist, &seed)) return -1;
    ts_init(&self->st, seed);
    self->busy = 0;
    return 0;
}

static PyObject *Tsum64_update(Tsum64Object *self, PyObject *obj) {
    if (self->busy) {
        PyErr_SetString(PyExc_RuntimeError, "Tsum64.update called concurrently from two threads");
        return NULL;
    }
    self->busy = 1;
    int rc = ts_feed(&self->st, obj);
    self->busy = 0;
    if (rc < 0) return NULL;
    Py_RETURN_NONE;
}

static PyObject *Tsum64_intdigest(Tsum64Object *self, PyObject *unused) {
    return PyLong_FromUnsignedLongLong(ts_digest(&self->st));
}

static PyMethodDef Tsum64_methods[] = {
    {"update", (PyCFunction)Tsum64_update, METH_O, "Feed a contiguous buffer (GIL released when large)."},
    {"intdigest", (PyCFunction)Tsum64_intdigest, METH_NOARGS, "The checksum of everything fed so far."},
    {NULL, NULL, 0, NULL},
};

static PyType_Slot Tsum64_slots[] = {
    {Py_tp_doc, "Incremental tsum64: update(buffer) any number of times, then intdigest()."},
    {Py_tp_init, Tsum64_init},
    {Py_tp_new, PyType_GenericNew},
    {Py_tp_methods, Tsum64_methods},
    {0, NULL},
};

static PyType_Spec Tsum64_spec = {
    "tiersync.transfer._kernel.Tsum64", sizeof(Tsum64Object), 0, Py_TPFLAGS_DEFAULT, Tsum64_slots,
};

static PyMethodDef methods[] = {
    {"copy_spans", copy_spans, METH_VARARGS, "Copy byte spans between two raw addresses, GIL released."},
    {"copy_blocks", copy_blocks, METH_VARARGS, "Copy a region pattern for each block pair, GIL released."},
    {"tsum64", (PyCFunction)(void (*)(void))tsum64, METH_VARARGS | METH_KEYWORDS,
     "tsum64(data, seed=0) -> int: tiersync's 64-bit payload checksum, GIL released when large."},
    {"_tsum64_using", tsum64_using, METH_VARARGS, "Tests only: tsum64 through one stripe implementation."},
    {"_copy_partials_using", copy_partials_using, METH_VARARGS, "Tests only: copy_partials through one copy loop."},
    {"tsum64_partial", tsum64_partial, METH_O, "The partial state of a buffer (bytes), for tsum64_compose."},
    {"tsum64_compose", tsum64_compose, METH_VARARGS, "tsum64 of a concatenation from its parts' partial states."},
    {"copy_partials", copy_partials, METH_VARARGS, "Copy src into dst, the partial state of each piece landed."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_kernel", NULL, -1, methods};

PyMODINIT_FUNC PyInit__kernel(void) {
    PyObject *m = PyModule_Create(&module);
    if (m == NULL) return NULL;
    ts_pick();
    if (PyModule_AddStringConstant(m, "TSUM64_IMPL", ts_impl) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    PyObject *type = PyType_FromSpec(&Tsum64_spec);
    if (type == NULL || PyModule_AddObject(m, "Tsum64", type) < 0) {
        Py_XDECREF(type);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}

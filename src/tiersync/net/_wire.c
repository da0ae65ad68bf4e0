/* Native fast paths of the TCP transport (tiersync.net._wire).
 *
 * send_all(sock, bufs, timeout_s, pinned=0) -> (sent, err)
 *   Writes every byte of the buffers `bufs` (a list, gathered by sendmsg, MSG_DONTWAIT, so a
 *   blocking socket behaves as a non-blocking one) waiting for room with poll, all with the GIL
 *   released, for at most timeout_s seconds. pinned > 0 on a non-blocking socket: each buffer of
 *   at least that many bytes goes by reference instead (vmsplice into a pipe, splice into the
 *   socket: the kernel holds its pages, not a copy, until the peer has read them), so the
 *   caller must not change those bytes until then; the smaller ones between them still go by
 *   sendmsg (MSG_MORE). Where no pipe of at least PIPE_MIN bytes can be had (the user's pipe
 *   pages spent, no descriptor left), or a blocking socket (a splice into it would wait past
 *   the deadline), the rest goes by sendmsg (copied_instead() counts the calls that wanted a pipe
 *   and had none, for socket_io's one warning). SIGPIPE is blocked meanwhile (a splice cannot say
 *   MSG_NOSIGNAL) and one it raised is taken back. sent: bytes written; err: 0 when all were,
 *   -1 when the time ran out first, else the errno of the failing sendmsg, splice or poll. A signal
 *   runs the interpreter's handlers and the write goes on; an exception from one is raised, the
 *   socket shut down first when part of the frames went out (no frame may follow a torn one).
 *   Both calls take the socket object (or a descriptor number) and duplicate its descriptor
 *   as they read it, under the GIL, so a close by another thread, before or while they run,
 *   never lets them read or write a socket that got its number.
 *
 * recv_many(sock, header, dests, request_ids, max_payload, empty_meta_sum, timeout_s) -> (done, sums, n, err)
 *   Receives consecutive frames, the i-th expected to be the DATA answer to request_ids[i]
 *   landing in dests[i] (the per-frame steps below), all in one call with the GIL released.
 *   dests[i] is one writable buffer, or a list of them filled in order (a vectored pull: the
 *   payload is scattered straight into the blocks it belongs to, summed piece by piece).
 *   done: frames received and verified (sums[i] their tsum64). When done < len(dests), frame
 *   `done` was not verified: n bytes of it were consumed (header first, then dests[done]) and
 *   go to the reference parser, n == 0 with err == 0 is end of stream, n == 0 with err != 0
 *   a failing read (errno err; raised as OSError when done == 0, so a timeout raises
 *   BlockingIOError and a signal InterruptedError, or what its handler raised) after which the
 *   caller reads again. timeout_s (> 0 and < 1e9; else none): no read starts once that many
 *   seconds have passed since the call began (a frame cut short hands what landed to the
 *   parser; no next frame is begun: n 0, err ETIMEDOUT), so with each read bounded by the
 *   socket's receive timeout a peer that trickles bytes ends the call within about twice it.
 *
 * Per frame: receives the next frame of a blocking stream
 *   socket `fd` at a frame boundary, expecting it to be the DATA answer to `request_id` whose
 *   payload is exactly len(dest) bytes:
 *     1. one scatter read (recvmsg, no MSG_WAITALL) into [header (64 bytes), the first TS_PIECE
 *        bytes of the dest buffers];
 *     2. the rest of the header (MSG_WAITALL: 64 bytes at most);
 *     3. the same checks as tiersync.net.frames.decode_header, in the same order: magic,
 *        version, header checksum (xxh3_64 of bytes 0..56), op, flags/reserved, payload
 *        algorithm, then what makes it the expected frame: op DATA, `request_id`, no metadata
 *        (meta checksum == `empty_meta_sum`), payload_len == len(dest) <= `max_payload`,
 *        algorithm TSUM64;
 *     4. the rest of the payload straight into dest (recvmsg MSG_WAITALL over the dest buffers,
 *        pieces of TS_PIECE so each is summed while still in cache), tsum64 over all of it,
 *        compared with the header's.
 *   n: bytes consumed from the stream (header bytes first, the rest landed in dest).
 *   ok: 1 only when every check passed and the payload checksum matched: then dest holds
 *   the verified payload and payload_sum its tsum64. ok 0: nothing was judged; the caller
 *   must hand the n bytes (header, then dest[:n - 64]) to the reference sans-IO parser,
 *   which decides (another frame, a partial read, a malformed or corrupt one). n 0: end of
 *   stream. A failing first read raises OSError (BlockingIOError when SO_RCVTIMEO fired);
 *   a failure after some bytes arrived returns them (ok 0) and the next read reports it.
 *
 * xxh3_64 here covers only the 56-byte input of a header (XXH3's 17..128-byte path with
 * the default secret and seed 0); tests compare it with the xxhash package.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <unistd.h>
#include <time.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include "../transfer/tsum64.h"

/* Bytes landed per recvmsg before the checksum reads them: small enough that they are still in
 * the core's cache. Measured on a Zen 4 VM (1 MiB L2), summing right after the receive: 128 KiB
 * pieces at 48-55 GB/s, 256 KiB ones at 16-26 GB/s (the kernel's copy had already pushed part
 * of them out). */
#define TS_PIECE (128 << 10)
#define HDR 64
#define OP_DATA 21
#define ALGO_TSUM64 1
#define VERSION 7  /* tiersync.net.frames.VERSION: a test checks they agree (_wire.VERSION) */

/* The first 64 bytes of XXH3's default secret (kSecret): all the 33..64-byte path reads. */
static const unsigned char XXH_SECRET[64] = {
    0xb8, 0xfe, 0x6c, 0x39, 0x23, 0xa4, 0x4b, 0xbe, 0x7c, 0x01, 0x81, 0x2c, 0xf7, 0x21, 0xad, 0x1c,
    0xde, 0xd4, 0x6d, 0xe9, 0x83, 0x90, 0x97, 0xdb, 0x72, 0x40, 0xa4, 0xa4, 0xb7, 0xb3, 0x67, 0x1f,
    0xcb, 0x79, 0xe6, 0x4e, 0xcc, 0xc0, 0xe5, 0x78, 0x82, 0x5a, 0xd0, 0x7d, 0xcc, 0xff, 0x72, 0x21,
    0xb8, 0x08, 0x46, 0x74, 0xf7, 0x43, 0x24, 0x8e, 0xe0, 0x35, 0x90, 0xe6, 0x81, 0x3a, 0x26, 0x4c};

static inline uint64_t xxh_mix16(const unsigned char *in, const unsigned char *sec) {
    __uint128_t p = (__uint128_t)(ts_load(in) ^ ts_load(sec)) * (ts_load(in + 8) ^ ts_load(sec + 8));
    return (uint64_t)p ^ (uint64_t)(p >> 64);
}

/* xxh3_64(in[0..56)), seed 0. */
static uint64_t xxh3_56(const unsigned char *in) {
    const size_t len = 56;
    uint64_t acc = (uint64_t)len * 0x9E3779B185EBCA87ULL;
    acc += xxh_mix16(in + 16, XXH_SECRET + 32);
    acc += xxh_mix16(in + len - 32, XXH_SECRET + 48);
    acc += xxh_mix16(in, XXH_SECRET);
    acc += xxh_mix16(in + len - 16, XXH_SECRET + 16);
    acc ^= acc >> 37;
    acc *= 0x165667919E3779F9ULL;
    return acc ^ (acc >> 32);
}

static inline uint16_t le16(const unsigned char *p) { return (uint16_t)(p[0] | p[1] << 8); }
static inline uint32_t le32(const unsigned char *p) { return (uint32_t)le16(p) | (uint32_t)le16(p + 2) << 16; }

/* Steps 3's checks; 1 when this is the expected verified-header DATA frame. */
static int expected_header(const unsigned char *h, uint64_t rid, uint64_t dest_len, uint64_t max_payload,
                           uint64_t empty_meta) {
    static const unsigned char zero[7] = {0};
    if (memcmp(h, "TSYN", 4) || le16(h + 4) != VERSION) return 0;
    if (xxh3_56(h) != ts_load(h + 56)) return 0;
    if (le16(h + 6) != OP_DATA || le32(h + 8) != 0 || memcmp(h + 49, zero, 7)) return 0;
    if (h[48] != ALGO_TSUM64 || ts_load(h + 12) != rid || le32(h + 20) != 0) return 0;
    if (ts_load(h + 24) != dest_len || dest_len > max_payload || ts_load(h + 40) != empty_meta) return 0;
    return 1;
}

typedef struct {
    unsigned char *base;
    size_t len;
} seg;

typedef struct {
    int fd;
    unsigned char *hdr;
    seg *segs;    /* where the payload lands, in order (one buffer, or a vectored pull's blocks) */
    size_t nsegs;
    uint64_t len, rid, max_payload, empty_meta;
    uint64_t n;   /* bytes consumed */
    int ok, err;  /* err: errno of a failing first read */
    uint64_t sum;
    uint64_t end_ns; /* CLOCK_MONOTONIC time after which no further read starts (0: none) */
} recv_job;

static uint64_t now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (uint64_t)t.tv_sec * 1000000000u + (uint64_t)t.tv_nsec;
}

/* 1 when the call's time is up: a peer trickling bytes (each read returning some before the
 * socket's receive timeout) must not keep the reader past its deadline. */
static inline int late(const recv_job *j) { return j->end_ns && now_ns() >= j->end_ns; }

#define IOV_BATCH 64

/* A position in a job's segments. */
typedef struct {
    size_t i, off;
} cursor;

/* iovecs for the next bytes from `c`, at most `most` bytes and `max_iov` vectors; their total. */
static size_t fill_iov(const recv_job *j, cursor c, struct iovec *iov, size_t max_iov, uint64_t most,
                       size_t *count) {
    size_t k = 0, total = 0;
    while (c.i < j->nsegs && k < max_iov && total < most) {
        size_t take = j->segs[c.i].len - c.off;
        if (take > most - total) take = (size_t)(most - total);
        iov[k].iov_base = j->segs[c.i].base + c.off;
        iov[k].iov_len = take;
        k++;
        total += take;
        c.i++;
        c.off = 0;
    }
    *count = k;
    return total;
}

/* Sum the `n` bytes that landed at `c` and move past them. */
static void landed(const recv_job *j, cursor *c, uint64_t n, ts_state *st) {
    while (n && c->i < j->nsegs) {
        size_t take = j->segs[c->i].len - c->off;
        if (take > n) take = (size_t)n;
        ts_update(st, j->segs[c->i].base + c->off, take);
        c->off += take;
        n -= take;
        if (c->off == j->segs[c->i].len) {
            c->i++;
            c->off = 0;
        }
    }
}

/* One recvmsg. EINTR is not retried here: it ends the call like any failed read (the first
 * read's errno goes back to the caller, a later one leaves a short frame for the reference
 * parser), so the interpreter runs its signal handlers and re-arms the deadline at once. */
static ssize_t recvmsg_some(int fd, struct iovec *iov, size_t count, int flags) {
    struct msghdr msg = {0};
    msg.msg_iov = iov;
    msg.msg_iovlen = count;
    return recvmsg(fd, &msg, flags);
}

/* Steps 1-4 without the GIL. */
static void run_job(recv_job *j) {
    struct iovec iov[IOV_BATCH + 1] = {{j->hdr, HDR}};
    size_t k = 0;
    cursor c = {0, 0};
    fill_iov(j, c, iov + 1, IOV_BATCH, TS_PIECE, &k);
    ssize_t r = recvmsg_some(j->fd, iov, k + 1, 0);
    if (r <= 0) { j->err = r < 0 ? errno : 0; return; }
    j->n = (uint64_t)r;
    while (j->n < HDR) {
        if (late(j)) return;
        r = recv(j->fd, j->hdr + j->n, HDR - (size_t)j->n, MSG_WAITALL);
        if (r <= 0) return;
        j->n += (uint64_t)r;
    }
    if (!expected_header(j->hdr, j->rid, j->len, j->max_payload, j->empty_meta)) return;
    ts_state st;
    ts_init(&st, 0);
    uint64_t have = j->n - HDR;
    landed(j, &c, have, &st);
    while (have < j->len) {  /* pieces of TS_PIECE, each summed while still in cache */
        if (late(j)) return;
        fill_iov(j, c, iov, IOV_BATCH, TS_PIECE, &k);
        r = recvmsg_some(j->fd, iov, k, MSG_WAITALL);
        if (r <= 0) return;
        landed(j, &c, (uint64_t)r, &st);
        have += (uint64_t)r;
        j->n += (uint64_t)r;
    }
    j->sum = ts_digest(&st);
    j->ok = j->sum == ts_load(j->hdr + 32);
}

#define MAX_FRAMES 64

/* Frames of one recv_many call, without the GIL: stops at the first one not verified. */
static size_t run_jobs(recv_job *jobs, size_t count) {
    size_t i = 0;
    for (; i < count; i++) {
        if (i && late(&jobs[i])) {  /* no next frame past the deadline (n 0, err set: not end of stream) */
            jobs[i].err = ETIMEDOUT;
            break;
        }
        run_job(&jobs[i]);
        if (!jobs[i].ok) break;
    }
    return i;
}

/* The buffers of every dest (a writable buffer, or a list of them), held in `views`. */
typedef struct {
    Py_buffer *views;
    seg *segs;
    Py_ssize_t held;
} dest_set;

static void release_dests(dest_set *d) {
    for (Py_ssize_t i = 0; i < d->held; i++) PyBuffer_Release(&d->views[i]);
    PyMem_Free(d->views);
    PyMem_Free(d->segs);
}

static int hold(dest_set *d, PyObject *obj, uint64_t *total) {
    if (PyObject_GetBuffer(obj, &d->views[d->held], PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0) return -1;
    d->segs[d->held].base = d->views[d->held].buf;
    d->segs[d->held].len = (size_t)d->views[d->held].len;
    *total += (uint64_t)d->views[d->held].len;
    d->held++;
    return 0;
}

static int get_dests(PyObject *dests, PyObject *rids, dest_set *d, recv_job *jobs, Py_ssize_t count) {
    Py_ssize_t nsegs = 0;
    for (Py_ssize_t i = 0; i < count; i++) {
        PyObject *dest = PyList_GET_ITEM(dests, i);
        nsegs += PyList_Check(dest) ? PyList_GET_SIZE(dest) : 1;
    }
    d->views = PyMem_Calloc((size_t)nsegs + 1, sizeof(Py_buffer));
    d->segs = PyMem_Calloc((size_t)nsegs + 1, sizeof(seg));
    if (d->views == NULL || d->segs == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    for (Py_ssize_t i = 0; i < count; i++) {
        PyObject *dest = PyList_GET_ITEM(dests, i);
        jobs[i].rid = PyLong_AsUnsignedLongLong(PyList_GET_ITEM(rids, i));
        if (PyErr_Occurred()) return -1;
        jobs[i].segs = d->segs + d->held;
        Py_ssize_t first = d->held;
        if (!PyList_Check(dest)) {
            if (hold(d, dest, &jobs[i].len) < 0) return -1;
        } else {
            for (Py_ssize_t k = 0; k < PyList_GET_SIZE(dest); k++)
                if (hold(d, PyList_GET_ITEM(dest, k), &jobs[i].len) < 0) return -1;
        }
        jobs[i].nsegs = (size_t)(d->held - first);
    }
    return 0;
}

/* A duplicate of `sock`'s descriptor (a socket object, or a number) held for a GIL-free call: a
 * close by another thread while the call runs cannot hand its number to a new socket under us (a
 * shutdown still ends our calls). The number is read and duplicated under the GIL in one step:
 * read in Python first, another thread could close it and accept a new connection under that
 * number before the call began, and the call would then read or write the wrong peer. */
static int hold_fd(PyObject *sock) {
    PyObject *num = PyLong_Check(sock) ? Py_NewRef(sock) : PyObject_CallMethod(sock, "fileno", NULL);
    if (num == NULL) return -1;
    long fd = PyLong_AsLong(num);
    Py_DECREF(num);
    if (fd == -1 && PyErr_Occurred()) return -1;
    if (fd < 0 || fd > INT_MAX) {  /* a closed socket's fileno() is -1 */
        errno = EBADF;
        PyErr_SetFromErrno(PyExc_OSError);
        return -1;
    }
    int held = fcntl((int)fd, F_DUPFD_CLOEXEC, 0);
    if (held < 0) PyErr_SetFromErrno(PyExc_OSError);
    return held;
}

static PyObject *recv_many(PyObject *self, PyObject *args) {
    PyObject *sock;
    Py_buffer hv;
    PyObject *dests, *rids;
    unsigned long long max_payload, empty_meta;
    double timeout_s;
    if (!PyArg_ParseTuple(args, "Ow*O!O!KKd", &sock, &hv, &PyList_Type, &dests, &PyList_Type, &rids, &max_payload,
                          &empty_meta, &timeout_s)) return NULL;
    int own = hold_fd(sock);  /* first: nothing below runs Python code, but keep the window shut */
    if (own < 0) {
        PyBuffer_Release(&hv);
        return NULL;
    }
    uint64_t end_ns = timeout_s > 0 && timeout_s < 1e9 ? now_ns() + (uint64_t)(timeout_s * 1e9) : 0;
    Py_ssize_t count = PyList_GET_SIZE(dests);
    if (hv.len != HDR || count < 1 || count > MAX_FRAMES || PyList_GET_SIZE(rids) != count) {
        close(own);
        PyBuffer_Release(&hv);
        PyErr_SetString(PyExc_ValueError, "header must be 64 writable bytes; 1..64 dests, one request id each");
        return NULL;
    }
    recv_job jobs[MAX_FRAMES];
    memset(jobs, 0, sizeof jobs);
    dest_set d = {NULL, NULL, 0};
    if (get_dests(dests, rids, &d, jobs, count) < 0) {
        close(own);
        release_dests(&d);
        PyBuffer_Release(&hv);
        return NULL;
    }
    for (Py_ssize_t i = 0; i < count; i++) {
        jobs[i].fd = own;
        jobs[i].hdr = hv.buf;
        jobs[i].max_payload = max_payload;
        jobs[i].empty_meta = empty_meta;
        jobs[i].end_ns = end_ns;
    }
    size_t done;
    Py_BEGIN_ALLOW_THREADS
    done = run_jobs(jobs, (size_t)count);
    Py_END_ALLOW_THREADS
    close(own);
    release_dests(&d);
    PyBuffer_Release(&hv);
    recv_job *last = done < (size_t)count ? &jobs[done] : NULL;
    if (done == 0 && last->n == 0 && last->err) {
        errno = last->err;
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    PyObject *sums = PyTuple_New((Py_ssize_t)done);
    if (sums == NULL) return NULL;
    for (size_t i = 0; i < done; i++) {
        PyObject *v = PyLong_FromUnsignedLongLong(jobs[i].sum);
        if (v == NULL) {
            Py_DECREF(sums);
            return NULL;
        }
        PyTuple_SET_ITEM(sums, (Py_ssize_t)i, v);
    }
    return Py_BuildValue("nNKi", (Py_ssize_t)done, sums, (unsigned long long)(last ? last->n : 0),
                         last ? last->err : 0);
}

/* send_all: the server's gather write, without the GIL. */
#define SEND_IOV 1024
#define SEND_DEADLINE (-1) /* send_all's err when the time ran out */

typedef struct {
    struct iovec *iov;
    size_t count;
} gather;

static double now_s(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + (double)t.tv_nsec / 1e9;
}

/* Drop the first `n` bytes of g's vectors, and the empty vectors then in front (a sendmsg of
 * nothing would return 0 and make no progress). */
static void advance(gather *g, size_t n) {
    while (g->count) {
        if (n < g->iov->iov_len) {
            g->iov->iov_base = (char *)g->iov->iov_base + n;
            g->iov->iov_len -= n;
            return;
        }
        n -= g->iov->iov_len;
        g->iov++;
        g->count--;
    }
}

/* Pinned buffers' way to the socket: a pipe holding `queued` bytes, always the next ones of g
 * (vmspliced from g's first vector, advanced only once spliced into the socket). */
typedef struct {
    size_t pinned;  /* vectors of at least this many bytes go by reference; 0: none */
    int rd, wr;     /* the pipe, -1 until a pinned vector comes */
    size_t queued;
    int broke;      /* a splice failed with EPIPE (and raised SIGPIPE) */
} by_ref;

#define PIPE_BYTES (1 << 20)  /* asked for with F_SETPIPE_SZ */
#define PIPE_MIN (64 << 10)    /* a smaller pipe (the user's pipe pages spent) is not worth a splice */

static unsigned long long copied_instead = 0;  /* send_all calls whose pinned bytes were copied after all */

static ssize_t by_copy(by_ref *b) {  /* no pipe or no pinning: the rest goes by sendmsg */
    __atomic_add_fetch(&copied_instead, 1, __ATOMIC_RELAXED);
    return b->pinned = 0, 0;
}

/* Move bytes of g's first vector toward the socket: into the pipe when it is empty, then out of
 * it; >= 0 bytes the socket took, -1 with errno set. Without a usable pipe, b->pinned becomes 0
 * and 0 is returned (the caller sends the rest by sendmsg). */
static ssize_t splice_some(int fd, gather *g, by_ref *b) {
    if (b->rd < 0) {
        int p[2];
        if (pipe2(p, O_CLOEXEC | O_NONBLOCK) < 0) return by_copy(b);
        b->rd = p[0], b->wr = p[1];
        (void)fcntl(b->wr, F_SETPIPE_SZ, PIPE_BYTES);
        if (fcntl(b->wr, F_GETPIPE_SZ) < PIPE_MIN) return by_copy(b);
    }
    if (!b->queued) {
        struct iovec v = {g->iov->iov_base, g->iov->iov_len < PIPE_BYTES ? g->iov->iov_len : PIPE_BYTES};
        ssize_t q = vmsplice(b->wr, &v, 1, SPLICE_F_NONBLOCK);
        if (q <= 0) return by_copy(b);  /* no memory to pin the pages: copy them instead */
        b->queued = (size_t)q;
    }
    unsigned flags = SPLICE_F_NONBLOCK | (b->queued < g->iov->iov_len || g->count > 1 ? SPLICE_F_MORE : 0);
    ssize_t r = splice(b->rd, NULL, fd, NULL, b->queued, flags);
    if (r > 0) b->queued -= (size_t)r;
    if (r < 0 && errno == EPIPE) b->broke = 1;
    return r;
}

/* Write every byte of g, waiting for room with poll until `end` (CLOCK_MONOTONIC seconds);
 * bytes written go to *sent; 0, SEND_DEADLINE, EINTR (a signal: the caller runs the handlers,
 * then calls again) or the errno of a failing sendmsg, vmsplice, splice or poll. */
static int send_gather(int fd, gather *g, double end, uint64_t *sent, by_ref *b) {
    advance(g, 0);
    while (g->count) {
        ssize_t r;
        if (b->queued || (b->pinned && g->iov->iov_len >= b->pinned)) {  /* the pipe's bytes come first */
            r = splice_some(fd, g, b);
        } else {
            size_t n = 0, most = g->count < SEND_IOV ? g->count : SEND_IOV;
            if (!b->pinned) n = most;  /* every vector is copied: no scan for the next pinned one */
            while (n < most && g->iov[n].iov_len < b->pinned) n++;
            struct msghdr msg = {0};
            msg.msg_iov = g->iov;
            msg.msg_iovlen = n;
            r = sendmsg(fd, &msg, MSG_NOSIGNAL | MSG_DONTWAIT | (n < g->count ? MSG_MORE : 0));
        }
        if (r >= 0) {
            *sent += (uint64_t)r;
            advance(g, (size_t)r);
            continue;
        }
        if (errno != EAGAIN && errno != EWOULDBLOCK) return errno;
        double left = end - now_s();
        if (left <= 0) return SEND_DEADLINE;
        struct pollfd p = {fd, POLLOUT, 0};
        int ms = left < 3600.0 ? (int)(left * 1000.0) + 1 : 3600 * 1000;  /* an hour at most per poll */
        if (poll(&p, 1, ms) < 0) return errno;
    }
    return 0;
}

/* send_gather with SIGPIPE blocked in this thread (a splice into a socket the peer closed raises
 * it: no MSG_NOSIGNAL there); the one a splice raised, if none was pending before, is taken back. */
static int send_quietly(int fd, gather *g, double end, uint64_t *sent, by_ref *b) {
    sigset_t pipe_only, old, before;
    sigemptyset(&pipe_only);
    sigaddset(&pipe_only, SIGPIPE);
    if (pthread_sigmask(SIG_BLOCK, &pipe_only, &old) != 0) return send_gather(fd, g, end, sent, b);
    sigpending(&before);
    int err = send_gather(fd, g, end, sent, b);
    if (b->broke && !sigismember(&before, SIGPIPE)) {
        struct timespec now = {0, 0};
        (void)sigtimedwait(&pipe_only, NULL, &now);
    }
    pthread_sigmask(SIG_SETMASK, &old, NULL);
    return err;
}

static PyObject *send_all(PyObject *self, PyObject *args) {
    PyObject *sock, *bufs;
    double timeout;
    Py_ssize_t pinned = 0;
    if (!PyArg_ParseTuple(args, "OO!d|n", &sock, &PyList_Type, &bufs, &timeout, &pinned)) return NULL;
    int own = hold_fd(sock);
    if (own < 0) return NULL;
    int fl = pinned > 0 ? fcntl(own, F_GETFL) : -1;
    int nonblocking = fl >= 0 && (fl & O_NONBLOCK);
    by_ref b = {nonblocking ? (size_t)pinned : 0, -1, -1, 0, 0};
    Py_ssize_t count = PyList_GET_SIZE(bufs);
    Py_buffer *views = PyMem_Calloc((size_t)count + 1, sizeof(Py_buffer));
    struct iovec *iov = PyMem_Calloc((size_t)count + 1, sizeof(struct iovec));
    Py_ssize_t held = 0;
    PyObject *out = NULL;
    if (views == NULL || iov == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    for (; held < count; held++) {
        if (PyObject_GetBuffer(PyList_GET_ITEM(bufs, held), &views[held], PyBUF_C_CONTIGUOUS) < 0) goto done;
        iov[held].iov_base = views[held].buf;
        iov[held].iov_len = (size_t)views[held].len;
    }
    gather g = {iov, (size_t)count};
    uint64_t sent = 0;
    double end = now_s() + timeout;
    int err;
    for (;;) {
        Py_BEGIN_ALLOW_THREADS
        err = b.pinned ? send_quietly(own, &g, end, &sent, &b) : send_gather(own, &g, end, &sent, &b);
        Py_END_ALLOW_THREADS
        if (err != EINTR) break;
        if (PyErr_CheckSignals() < 0) {  /* a handler raised (Ctrl-C): that is the answer */
            if (sent) shutdown(own, SHUT_RDWR);  /* part of a frame went out: no frame may follow it */
            goto done;
        }
    }
    out = Py_BuildValue("Ki", (unsigned long long)sent, err);
done:
    if (b.rd >= 0) close(b.rd), close(b.wr);  /* bytes still queued in it were not sent (nor counted) */
    if (own >= 0) close(own);
    for (Py_ssize_t i = 0; i < held; i++) PyBuffer_Release(&views[i]);
    PyMem_Free(views);
    PyMem_Free(iov);
    return out;
}

/* Tests: xxh3_64 of exactly 56 bytes, to compare with the xxhash package. */
static PyObject *copied_instead_py(PyObject *self, PyObject *unused) {
    return PyLong_FromUnsignedLongLong(__atomic_load_n(&copied_instead, __ATOMIC_RELAXED));
}

static PyObject *xxh3_56_py(PyObject *self, PyObject *arg) {
    Py_buffer v;
    if (PyObject_GetBuffer(arg, &v, PyBUF_C_CONTIGUOUS) < 0) return NULL;
    if (v.len != 56) {
        PyBuffer_Release(&v);
        PyErr_SetString(PyExc_ValueError, "needs exactly 56 bytes");
        return NULL;
    }
    uint64_t h = xxh3_56(v.buf);
    PyBuffer_Release(&v);
    return PyLong_FromUnsignedLongLong(h);
}

static PyMethodDef methods[] = {
    {"recv_many", recv_many, METH_VARARGS,
     "recv_many(sock, header, dests, request_ids, max_payload, empty_meta_sum, timeout_s) -> (done, sums, n, err)."},
    {"send_all", send_all, METH_VARARGS, "send_all(sock, bufs, timeout_s, pinned=0) -> (sent, err)."},
    {"copied_instead", copied_instead_py, METH_NOARGS,
     "copied_instead() -> int: send_all calls (this process) whose pinned bytes were copied (no pipe)."},
    {"_xxh3_56", xxh3_56_py, METH_O, "Tests only: xxh3_64 of a 56-byte header prefix."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_wire", NULL, -1, methods};

PyMODINIT_FUNC PyInit__wire(void) {
    ts_pick();
    PyObject *m = PyModule_Create(&module);
    if (m != NULL && (PyModule_AddIntConstant(m, "VERSION", VERSION) < 0 ||
                      PyModule_AddIntConstant(m, "OP_DATA", OP_DATA) < 0 ||
                      PyModule_AddIntConstant(m, "ALGO_TSUM64", ALGO_TSUM64) < 0)) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}

/* The flight recorder's rings: the hot path of every comm call, in C.
 *
 * flight_recorder.py has the design (what an entry holds, who reads it); this file is only
 * its storage. Written in C because a Python recorder could not get under 2% of an 8-byte
 * allreduce: each entry was a Python list whose fields (a torch.Size, two floats) were
 * allocated on every call and freed 512 calls later (BENCHMARKS.md, "The watchdog's cost").
 * Here the entries are preallocated structs: a call writes numbers into one and allocates
 * nothing but the shape tuple torch hands out, which is read and dropped at once.
 *
 * One Ring holds two rings, collectives and p2p ops, each indexed by its own sequence number
 * (seq & mask). It is also the communicator's byte counter: every op passes through `run`
 * whether or not it is recorded (capacity 0 keeps no entries but still numbers and counts
 * the ops), so the Python around a comm call is the same either way and recording costs only
 * the entry itself. A handle names an entry across both: seq * 2 + (1 for p2p). An entry whose
 * slot has been reused since (the ring wrapped) is gone: updates through a stale handle do
 * nothing and reading it gives None. Every method runs under the GIL and none releases it,
 * so the watchdog thread always reads whole entries.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>
#include <string.h>
#include <time.h>

#include "tensor_reader.h"

#define MAXDIM 8

enum { STARTED, POSTED, WAITING, ENQUEUED, DONE, FAILED, NSTATES };
static const char *STATE_NAMES[NSTATES] = {"started", "posted", "waiting", "enqueued", "done",
                                           "failed"};
static PyObject *state_str[NSTATES];

typedef struct {
    long long seq; /* 0: never written */
    PyObject *op, *dtype;
    PyObject *shape; /* the shape tuple itself when it has more than MAXDIM dims */
    long long dims[MAXDIM];
    int ndim, state, peer;
    long long nbytes;
    double t_start, t_wait, t_end;
} Entry;

/* The byte counter's row of one op: calls, and bus bytes sent by this rank, each call's bytes
 * being num * nbytes / den (the op's factor for this communicator's size, from
 * accounting.bus_factor, given once per op by count_as). */
#define NCOUNTED 16
typedef struct {
    PyObject *op;
    long long num, den, calls, bytes;
} Counter;

typedef struct {
    PyObject_HEAD
    Entry *ring[2]; /* [0] collectives, [1] p2p ops (NULL: capacity 0, nothing kept) */
    long long seq[2];
    long long capacity, mask;
    long long cur;    /* handle of the entry started last (0: none yet) */
    long long active; /* handle of the entry a wait() is blocked in (0: none) */
    long long *sent, *recvd; /* per peer: p2p messages posted since the start */
    Py_ssize_t size;
    Counter counted[NCOUNTED];
    int ncounted;
} Ring;

/* torch.Tensor's getters for shape, ndim and nbytes, called directly (the attribute lookup
 * costs as much again). A torch.Size costs 2.5x what ndim or nbytes cost to get (callgrind:
 * ~1000 instructions with its allocation and release, against ~300), so a tensor of at most
 * one dim is recorded from ndim and nbytes, which the byte counter needs anyway. */
typedef struct {
    getter get;
    void *closure;
} Getter;
static Getter get_shape, get_ndim, get_nbytes;
static PyTypeObject *tensor_type; /* the class the getters belong to */
static PyObject *shape_name, *itemsize_name, *send_name, *recv_name;
/* torch's C++ tensor read directly (tensor_reader.cpp), when the comm layer hands it over:
 * ~5 ns for what the getters take ~95 ns to tell */
static soap_tensor_reader reader;

/* dtype -> itemsize, looked up once per dtype (the dtypes are torch's immortal singletons) */
#define NDTYPES 32
static PyObject *dtype_key[NDTYPES];
static long long dtype_size[NDTYPES];

/* Timestamps. An entry takes two per call, and clock_gettime costs 23 ns each here against
 * 10 ns for the x86 time-stamp counter, so where the kernel itself keeps time by the TSC
 * (clocksource "tsc": invariant and synchronised across cores) entries store raw ticks and
 * are converted to time.monotonic() seconds only when read, anchored at the moment of the
 * read. Elsewhere entries store clock_gettime(CLOCK_MONOTONIC), time.monotonic()'s clock. */
static inline double mono(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

#if defined(__x86_64__) || defined(__i386__)
#include <x86intrin.h>
static int use_tsc;
static unsigned long long tsc0;
static double mono0, tsc_hz0; /* the calibration at import (1 ms) */

static inline double stamp(void) { return use_tsc ? (double)__rdtsc() : mono(); }

static void tsc_setup(void) {
    char buf[32] = {0};
    FILE *f = fopen("/sys/devices/system/clocksource/clocksource0/current_clocksource", "r");
    if (f == NULL) return;
    int ok = fgets(buf, sizeof buf, f) != NULL && strncmp(buf, "tsc", 3) == 0 &&
             (buf[3] == '\n' || buf[3] == 0);
    fclose(f);
    if (!ok) return;
    mono0 = mono();
    tsc0 = __rdtsc();
    double m;
    while ((m = mono()) - mono0 < 1e-3) {
    }
    tsc_hz0 = (double)(__rdtsc() - tsc0) / (m - mono0);
    use_tsc = tsc_hz0 > 0;
}

/* a stored stamp as time.monotonic() seconds (0.0 stays 0.0: not happened). The rate and
 * its anchor are refreshed at most once a second, from the whole time since import, so two
 * reads of one entry agree and the conversion does not drift over a long job. */
static double anchor_mono, anchor_tsc, hz;
static double to_mono(double v) {
    if (!use_tsc || v == 0.0) return v;
    double m = mono();
    if (hz == 0.0 || m - anchor_mono > 1.0) {
        unsigned long long now = __rdtsc();
        hz = m - mono0 > 0.1 ? (double)(now - tsc0) / (m - mono0) : tsc_hz0;
        anchor_mono = m;
        anchor_tsc = (double)now;
    }
    return anchor_mono + (v - anchor_tsc) / hz;
}
#else
static inline double stamp(void) { return mono(); }
static void tsc_setup(void) {}
static double to_mono(double v) { return v; }
#endif

static long long itemsize(PyObject *dtype) {
    for (int i = 0; i < NDTYPES; i++) {
        if (dtype_key[i] == dtype) return dtype_size[i];
        if (dtype_key[i] == NULL) {
            PyObject *v = PyObject_GetAttr(dtype, itemsize_name);
            if (v == NULL) return -1;
            long long n = PyLong_AsLongLong(v);
            Py_DECREF(v);
            if (n < 0) return -1;
            Py_INCREF(dtype);
            dtype_key[i] = dtype;
            dtype_size[i] = n;
            return n;
        }
    }
    PyObject *v = PyObject_GetAttr(dtype, itemsize_name); /* table full: no cache */
    if (v == NULL) return -1;
    long long n = PyLong_AsLongLong(v);
    Py_DECREF(v);
    return n;
}

static Entry *find(Ring *r, long long h) {
    if (h <= 0 || r->ring[0] == NULL) return NULL;
    long long seq = h >> 1;
    Entry *e = &r->ring[h & 1][seq & r->mask];
    return e->seq == seq ? e : NULL;
}

static void clear_entry(Entry *e) {
    Py_CLEAR(e->op);
    Py_CLEAR(e->dtype);
    Py_CLEAR(e->shape);
}

static void ring_dealloc(Ring *r) {
    for (int k = 0; k < 2; k++) {
        if (r->ring[k] == NULL) continue;
        for (long long i = 0; i < r->capacity; i++) clear_entry(&r->ring[k][i]);
        PyMem_Free(r->ring[k]);
    }
    PyMem_Free(r->sent);
    PyMem_Free(r->recvd);
    for (int i = 0; i < r->ncounted; i++) Py_CLEAR(r->counted[i].op);
    Py_TYPE(r)->tp_free((PyObject *)r);
}

/* Keep the last `capacity` entries per ring from now on (0: none), dropping those kept so
 * far; numbering, counters and the byte counter go on. */
static int set_capacity(Ring *r, long long capacity) {
    if (capacity < 0 || (capacity & (capacity - 1))) {
        PyErr_SetString(PyExc_ValueError, "capacity: 0 or a power of two");
        return -1;
    }
    Entry *fresh[2] = {NULL, NULL};
    for (int k = 0; k < 2 && capacity; k++) {
        fresh[k] = PyMem_Calloc((size_t)capacity, sizeof(Entry));
        if (fresh[k] == NULL) {
            PyMem_Free(fresh[0]);
            return PyErr_NoMemory(), -1;
        }
    }
    for (int k = 0; k < 2; k++) {
        if (r->ring[k] == NULL) continue;
        for (long long i = 0; i < r->capacity; i++) clear_entry(&r->ring[k][i]);
        PyMem_Free(r->ring[k]);
    }
    r->ring[0] = fresh[0];
    r->ring[1] = fresh[1];
    r->capacity = capacity;
    r->mask = capacity - 1;
    r->cur = r->active = 0; /* handles into the old rings name nothing now */
    return 0;
}

static int ring_init(Ring *r, PyObject *args, PyObject *kwds) {
    long long capacity;
    Py_ssize_t size;
    static char *kw[] = {"capacity", "size", NULL};
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "Ln", kw, &capacity, &size)) return -1;
    if (size < 1) {
        PyErr_SetString(PyExc_ValueError, "size >= 1");
        return -1;
    }
    if (r->sent != NULL) {
        PyErr_SetString(PyExc_RuntimeError, "Ring.__init__ called twice");
        return -1;
    }
    if (set_capacity(r, capacity) < 0) return -1;
    r->size = size;
    r->sent = PyMem_Calloc((size_t)size, sizeof(long long));
    r->recvd = PyMem_Calloc((size_t)size, sizeof(long long));
    if (r->sent == NULL || r->recvd == NULL) return PyErr_NoMemory(), -1;
    return 0;
}

static long long get_int(Getter g, PyObject *t) {
    PyObject *v = g.get(t, g.closure);
    if (v == NULL) return -1;
    long long n = PyLong_AsLongLong(v);
    Py_DECREF(v);
    return n;
}

/* t's dims into e (the tuple itself too when they do not fit) and its size in bytes, or -1
 * with an exception set */
static long long read_shape(Entry *e, PyObject *t, long long size) {
    if (reader != NULL) {
        long long nbytes = reader(t, e->dims, MAXDIM, &e->ndim);
        if (nbytes != SOAP_READ_UNKNOWN) return nbytes;
    }
    int fast = tensor_type != NULL && PyObject_TypeCheck(t, tensor_type);
    if (fast) {
        long long n = get_int(get_ndim, t);
        if (n < 0) return -1;
        if (n <= 1) {
            long long nbytes = get_int(get_nbytes, t);
            if (nbytes < 0) return -1;
            e->ndim = (int)n;
            e->dims[0] = nbytes / size;
            return nbytes;
        }
    }
    PyObject *shape = fast ? get_shape.get(t, get_shape.closure) : PyObject_GetAttr(t, shape_name);
    if (shape == NULL) return -1;
    if (!PyTuple_Check(shape)) {
        Py_DECREF(shape);
        PyErr_SetString(PyExc_TypeError, "t.shape is not a tuple");
        return -1;
    }
    Py_ssize_t n = PyTuple_GET_SIZE(shape);
    long long numel = 1;
    for (Py_ssize_t i = 0; i < n; i++) {
        long long d = PyLong_AsLongLong(PyTuple_GET_ITEM(shape, i));
        if (i < MAXDIM) e->dims[i] = d;
        numel *= d;
    }
    e->ndim = (int)n;
    if (n > MAXDIM) {
        e->shape = shape; /* keeps the reference */
    } else {
        Py_DECREF(shape);
    }
    return numel * size;
}

/* op's row of the byte counter, or NULL with an exception when count_as never named it */
static Counter *counter(Ring *r, PyObject *op) {
    for (int i = 0; i < r->ncounted; i++)
        if (r->counted[i].op == op) return &r->counted[i]; /* op names are interned */
    for (int i = 0; i < r->ncounted; i++) {
        int eq = PyObject_RichCompareBool(r->counted[i].op, op, Py_EQ);
        if (eq < 0) return NULL;
        if (eq) return &r->counted[i];
    }
    PyErr_Format(PyExc_KeyError, "the byte counter has no row for %R (count_as names it)", op);
    return NULL;
}

static inline void count_call(Counter *c, long long nbytes) {
    c->calls++;
    c->bytes += c->num * nbytes / c->den;
}

/* A new op on tensor t: a collective (peer < 0) or a p2p op with its peer and whether it sends
 * (the per-peer counters). It is numbered, counted in row c (if any) with t's bytes times
 * `times`, and when the rings keep entries it gets one, STARTED now, into *out (else NULL).
 * -1 with an exception set on bad input, before the op is numbered or counted. */
static int begin(Ring *r, PyObject *op, PyObject *t, PyObject *dtype, int peer, int sending,
                 Counter *c, long long times, Entry **out) {
    int kind = peer >= 0;
    *out = NULL;
    if (peer >= r->size) {
        PyErr_SetString(PyExc_ValueError, "peer out of range");
        return -1;
    }
    long long size = itemsize(dtype);
    if (size <= 0) {
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "dtype of itemsize 0");
        return -1;
    }
    long long seq = r->seq[kind] + 1;
    long long nbytes = 0;
    Entry *e = NULL;
    if (r->ring[0] != NULL) {
        e = &r->ring[kind][seq & r->mask];
        clear_entry(e); /* the entry capacity ops ago */
        e->seq = 0;     /* not an entry until it is whole */
        nbytes = read_shape(e, t, size);
    } else if (c != NULL) { /* counted, not kept: the bytes only (read_shape writes nothing
                             * but dims, ndim and, past MAXDIM dims, shape) */
        static Entry scratch;
        nbytes = read_shape(&scratch, t, size);
        Py_CLEAR(scratch.shape);
    }
    if (nbytes < 0) return -1;
    r->seq[kind] = seq;
    if (kind) (sending ? r->sent : r->recvd)[peer]++;
    if (c != NULL) count_call(c, nbytes * times);
    if (e == NULL) return 0;
    Py_INCREF(op);
    Py_INCREF(dtype);
    e->seq = seq;
    e->op = op;
    e->dtype = dtype;
    e->nbytes = nbytes;
    e->peer = peer;
    e->state = STARTED;
    e->t_start = stamp();
    e->t_wait = e->t_end = 0.0;
    r->cur = seq * 2 + kind;
    *out = e;
    return 0;
}

static int peer_args(PyObject *const *args, int *peer, int *sending) {
    long p = PyLong_AsLong(args[0]);
    if (p == -1 && PyErr_Occurred()) return -1;
    *peer = p < 0 ? -1 : (int)p;
    *sending = PyObject_IsTrue(args[1]);
    return *sending < 0 ? -1 : 0;
}

/* start(op, t, dtype[, peer, sending]) -> nbytes: a new entry, STARTED now. A collective
 * without peer; a p2p op with its peer and whether it sends. */
static PyObject *ring_start(Ring *r, PyObject *const *args, Py_ssize_t nargs) {
    int peer = -1, sending = 0;
    if (nargs != 3 && nargs != 5) {
        PyErr_SetString(PyExc_TypeError, "start(op, t, dtype[, peer, sending])");
        return NULL;
    }
    if (nargs == 5 && peer_args(args + 3, &peer, &sending) < 0) return NULL;
    if (r->ring[0] == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "this recorder does not record (capacity 0)");
        return NULL;
    }
    Entry *e;
    if (begin(r, args[0], args[1], args[2], peer, sending, NULL, 0, &e) < 0) return NULL;
    return PyLong_FromLongLong(e->nbytes);
}

/* run(op, t, dtype, peer, sending, times, async_op, fn, args) -> fn(*args), numbered, counted
 * and recorded: the entry starts, fn runs, and the entry is DONE (async_op: POSTED, for wait()
 * to finish) or FAILED if fn raised. Every comm call's hot path in one call. The byte counter
 * counts a collective's bytes times `times` under op (0: not counted), a p2p op's under
 * "send" or "recv". */
static PyObject *ring_run(Ring *r, PyObject *const *args, Py_ssize_t nargs) {
    int peer, sending;
    if (nargs != 9 || !PyTuple_Check(args[8])) {
        PyErr_SetString(PyExc_TypeError,
                        "run(op, t, dtype, peer, sending, times, async_op, fn, args: tuple)");
        return NULL;
    }
    if (peer_args(args + 3, &peer, &sending) < 0) return NULL;
    long long times = PyLong_AsLongLong(args[5]);
    if (times == -1 && PyErr_Occurred()) return NULL;
    int async_op = PyObject_IsTrue(args[6]);
    if (async_op < 0) return NULL;
    Counter *c = NULL;
    if (peer >= 0) {
        c = counter(r, sending ? send_name : recv_name);
        times = 1;
    } else if (times) {
        c = counter(r, args[0]);
    }
    if ((peer >= 0 || times) && c == NULL) return NULL;
    Entry *e;
    if (begin(r, args[0], args[1], args[2], peer, sending, c, times, &e) < 0) return NULL;
    long long h = e == NULL ? 0 : r->cur;
    PyObject *out = PyObject_Call(args[7], args[8], NULL);
    e = find(r, h); /* fn may have wrapped the ring, or resized it */
    if (e == NULL) return out;
    if (out == NULL) {
        e->t_end = stamp();
        e->state = FAILED;
    } else if (async_op) {
        e->state = POSTED;
    } else {
        e->t_end = stamp();
        e->state = DONE;
    }
    return out;
}

static PyObject *set_state(Ring *r, long long h, int state, int stamp_end) {
    Entry *e = find(r, h);
    if (e != NULL) {
        if (stamp_end) e->t_end = stamp();
        e->state = state;
    }
    Py_RETURN_NONE;
}

static int handle_arg(PyObject *const *args, Py_ssize_t nargs, long long dflt, long long *h) {
    if (nargs == 0) {
        *h = dflt;
        return 0;
    }
    *h = PyLong_AsLongLong(args[0]);
    return (*h == -1 && PyErr_Occurred()) ? -1 : 0;
}

/* done([h]): the blocking call of entry h (default: the one started last) returned */
static PyObject *ring_done(Ring *r, PyObject *const *args, Py_ssize_t nargs) {
    long long h;
    if (handle_arg(args, nargs, r->cur, &h) < 0) return NULL;
    return set_state(r, h, DONE, 1);
}

/* fail([h]): the backend raised during entry h */
static PyObject *ring_fail(Ring *r, PyObject *const *args, Py_ssize_t nargs) {
    long long h;
    if (handle_arg(args, nargs, r->cur, &h) < 0) return NULL;
    if (h == r->active) r->active = 0;
    return set_state(r, h, FAILED, 1);
}

/* post([h]) -> h: entry h (default: the one started last) is an async op, posted and not
 * waited yet */
static PyObject *ring_post(Ring *r, PyObject *const *args, Py_ssize_t nargs) {
    long long h;
    if (handle_arg(args, nargs, r->cur, &h) < 0) return NULL;
    Entry *e = find(r, h);
    if (e != NULL) e->state = POSTED;
    return PyLong_FromLongLong(h);
}

/* count_as(op, num, den): op's row of the byte counter; a call with nbytes counts
 * num * nbytes // den bus bytes (accounting.bus_factor) */
static PyObject *ring_count_as(Ring *r, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 3 || !PyUnicode_Check(args[0])) {
        PyErr_SetString(PyExc_TypeError, "count_as(op: str, num, den)");
        return NULL;
    }
    long long num = PyLong_AsLongLong(args[1]), den = PyLong_AsLongLong(args[2]);
    if (PyErr_Occurred()) return NULL;
    if (num < 0 || den < 1) {
        PyErr_SetString(PyExc_ValueError, "count_as: num >= 0 and den >= 1");
        return NULL;
    }
    Counter *c = counter(r, args[0]);
    if (c == NULL) {
        PyErr_Clear();
        if (r->ncounted == NCOUNTED) {
            PyErr_SetString(PyExc_ValueError, "count_as: too many ops");
            return NULL;
        }
        PyObject *op = args[0];
        Py_INCREF(op);
        PyUnicode_InternInPlace(&op); /* the hot path finds interned names by pointer */
        c = &r->counted[r->ncounted++];
        c->op = op;
        c->calls = c->bytes = 0;
    }
    c->num = num;
    c->den = den;
    Py_RETURN_NONE;
}

/* count(op, nbytes): one call of op moving nbytes, counted without a record (alltoallv's
 * caller knows the bytes that leave the rank) */
static PyObject *ring_count(Ring *r, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "count(op, nbytes)");
        return NULL;
    }
    long long nbytes = PyLong_AsLongLong(args[1]);
    if (nbytes == -1 && PyErr_Occurred()) return NULL;
    Counter *c = counter(r, args[0]);
    if (c == NULL) return NULL;
    count_call(c, nbytes);
    Py_RETURN_NONE;
}

/* stats() -> {op: (calls, bus bytes)} for every op called since the last reset */
static PyObject *ring_stats(Ring *r, PyObject *Py_UNUSED(ignored)) {
    PyObject *out = PyDict_New();
    for (int i = 0; out != NULL && i < r->ncounted; i++) {
        Counter *c = &r->counted[i];
        if (c->calls == 0) continue;
        PyObject *row = Py_BuildValue("(LL)", c->calls, c->bytes);
        if (row == NULL || PyDict_SetItem(out, c->op, row) < 0) Py_CLEAR(out);
        Py_XDECREF(row);
    }
    return out;
}

/* reset_stats(): zero the byte counter */
static PyObject *ring_reset_stats(Ring *r, PyObject *Py_UNUSED(ignored)) {
    for (int i = 0; i < r->ncounted; i++) r->counted[i].calls = r->counted[i].bytes = 0;
    Py_RETURN_NONE;
}

/* keep(capacity): keep the last `capacity` entries per ring from now on (0: none) */
static PyObject *ring_keep(Ring *r, PyObject *arg) {
    long long capacity = PyLong_AsLongLong(arg);
    if (capacity == -1 && PyErr_Occurred()) return NULL;
    if (set_capacity(r, capacity) < 0) return NULL;
    Py_RETURN_NONE;
}

/* wait_begin(h): wait() on async entry h starts blocking now (two calls around the wait,
 * not one taking it as a function: C calling back into the interpreter costs more, ~500
 * instructions a call under callgrind) */
static PyObject *ring_wait_begin(Ring *r, PyObject *arg) {
    long long h = PyLong_AsLongLong(arg);
    if (h == -1 && PyErr_Occurred()) return NULL;
    Entry *e = find(r, h);
    if (e != NULL) {
        e->t_wait = stamp();
        e->state = WAITING;
    }
    r->active = h;
    Py_RETURN_NONE;
}

/* wait_end(h): that wait() returned */
static PyObject *ring_wait_end(Ring *r, PyObject *arg) {
    long long h = PyLong_AsLongLong(arg);
    if (h == -1 && PyErr_Occurred()) return NULL;
    r->active = 0;
    return set_state(r, h, DONE, 1);
}

/* enqueued(h): NCCL: entry h is on the stream, not known complete */
static PyObject *ring_enqueued(Ring *r, PyObject *arg) {
    long long h = PyLong_AsLongLong(arg);
    if (h == -1 && PyErr_Occurred()) return NULL;
    return set_state(r, h, ENQUEUED, 0);
}

/* complete(h): NCCL: the event recorded after entry h has fired */
static PyObject *ring_complete(Ring *r, PyObject *arg) {
    long long h = PyLong_AsLongLong(arg);
    if (h == -1 && PyErr_Occurred()) return NULL;
    return set_state(r, h, DONE, 1);
}

static PyObject *entry_list(Entry *e) {
    PyObject *shape = e->shape;
    if (shape != NULL) {
        Py_INCREF(shape);
    } else {
        shape = PyTuple_New(e->ndim);
        if (shape == NULL) return NULL;
        for (int i = 0; i < e->ndim; i++) {
            PyObject *d = PyLong_FromLongLong(e->dims[i]);
            if (d == NULL) return Py_DECREF(shape), NULL;
            PyTuple_SET_ITEM(shape, i, d);
        }
    }
    /* [seq, op, shape, dtype, nbytes, peer, t_start, t_wait, t_end, state] */
    return Py_BuildValue("[LONOLidddO]", e->seq, e->op, shape, e->dtype, e->nbytes, e->peer,
                         to_mono(e->t_start), to_mono(e->t_wait), to_mono(e->t_end),
                         state_str[e->state]);
}

/* entry(h) -> the entry as a new list (see flight_recorder.py), or None if it is gone */
static PyObject *ring_entry(Ring *r, PyObject *arg) {
    long long h = PyLong_AsLongLong(arg);
    if (h == -1 && PyErr_Occurred()) return NULL;
    Entry *e = find(r, h);
    if (e == NULL) Py_RETURN_NONE;
    return entry_list(e);
}

/* newest(p2p) -> handle of the newest collective (or p2p) entry, 0 before the first */
static PyObject *ring_newest(Ring *r, PyObject *arg) {
    int kind = PyObject_IsTrue(arg);
    if (kind < 0) return NULL;
    long long seq = r->seq[kind];
    return PyLong_FromLongLong(seq && r->ring[0] ? seq * 2 + kind : 0);
}

/* entries() -> every kept entry of both rings as new lists, collectives first, each ring
 * oldest first */
static PyObject *ring_entries(Ring *r, PyObject *Py_UNUSED(ignored)) {
    PyObject *out = PyList_New(0);
    if (out == NULL || r->ring[0] == NULL) return out;
    for (int k = 0; k < 2; k++) {
        long long n = r->seq[k], first = n - r->capacity + 1;
        for (long long s = first > 1 ? first : 1; s <= n; s++) {
            Entry *e = &r->ring[k][s & r->mask];
            if (e->seq != s) continue;
            PyObject *item = entry_list(e);
            if (item == NULL || PyList_Append(out, item) < 0) {
                Py_XDECREF(item);
                Py_DECREF(out);
                return NULL;
            }
            Py_DECREF(item);
        }
    }
    return out;
}

static PyObject *counters(long long *v, Py_ssize_t n) {
    PyObject *out = PyList_New(n);
    if (out == NULL) return NULL;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *x = PyLong_FromLongLong(v[i]);
        if (x == NULL) return Py_DECREF(out), NULL;
        PyList_SET_ITEM(out, i, x);
    }
    return out;
}

static PyObject *ring_get_sent(Ring *r, void *c) { return counters(r->sent, r->size); }
static PyObject *ring_get_recvd(Ring *r, void *c) { return counters(r->recvd, r->size); }

static PyMethodDef ring_methods[] = {
    {"run", (PyCFunction)(void (*)(void))ring_run, METH_FASTCALL,
     "run(op, t, dtype, peer, sending, times, async_op, fn, args) -> fn(*args), recorded"},
    {"count_as", (PyCFunction)(void (*)(void))ring_count_as, METH_FASTCALL,
     "count_as(op, num, den): op's row of the byte counter (num * nbytes // den a call)"},
    {"count", (PyCFunction)(void (*)(void))ring_count, METH_FASTCALL,
     "count(op, nbytes): count one call of op without recording it"},
    {"stats", (PyCFunction)ring_stats, METH_NOARGS, "stats() -> {op: (calls, bus bytes)}"},
    {"reset_stats", (PyCFunction)ring_reset_stats, METH_NOARGS, "zero the byte counter"},
    {"keep", (PyCFunction)ring_keep, METH_O, "keep(capacity): entries kept per ring from now"},
    {"start", (PyCFunction)(void (*)(void))ring_start, METH_FASTCALL,
     "start(op, t, dtype[, peer, sending]) -> nbytes: record a call starting now"},
    {"done", (PyCFunction)(void (*)(void))ring_done, METH_FASTCALL,
     "done([h]): entry h (default: the newest started) returned"},
    {"fail", (PyCFunction)(void (*)(void))ring_fail, METH_FASTCALL,
     "fail([h]): the backend raised during entry h"},
    {"post", (PyCFunction)(void (*)(void))ring_post, METH_FASTCALL,
     "post([h]) -> h: entry h (default: the newest started) is async, not waited"},
    {"wait_begin", (PyCFunction)ring_wait_begin, METH_O, "wait_begin(h): wait() blocks now"},
    {"wait_end", (PyCFunction)ring_wait_end, METH_O, "wait_end(h): wait() returned"},
    {"enqueued", (PyCFunction)ring_enqueued, METH_O, "enqueued(h): on the CUDA stream"},
    {"complete", (PyCFunction)ring_complete, METH_O, "complete(h): its CUDA event fired"},
    {"entry", (PyCFunction)ring_entry, METH_O, "entry(h) -> list or None"},
    {"newest", (PyCFunction)ring_newest, METH_O, "newest(p2p) -> handle (0: none)"},
    {"entries", (PyCFunction)ring_entries, METH_NOARGS, "entries() -> kept entries as lists"},
    {NULL}};

static PyMemberDef ring_members[] = {
    {"seq", T_LONGLONG, offsetof(Ring, seq), READONLY, "collectives started"},
    {"p2p_seq", T_LONGLONG, offsetof(Ring, seq) + sizeof(long long), READONLY,
     "p2p ops started"},
    {"current", T_LONGLONG, offsetof(Ring, cur), READONLY,
     "handle of the entry started last (0: none)"},
    {"capacity", T_LONGLONG, offsetof(Ring, capacity), READONLY, "entries kept per ring"},
    {"mask", T_LONGLONG, offsetof(Ring, mask), READONLY, "capacity - 1"},
    {"active", T_LONGLONG, offsetof(Ring, active), READONLY,
     "handle of the entry a wait() is blocked in (0: none)"},
    {NULL}};

static PyGetSetDef ring_getset[] = {
    {"sent", (getter)ring_get_sent, NULL, "p2p messages posted to each peer", NULL},
    {"recvd", (getter)ring_get_recvd, NULL, "p2p receives posted from each peer", NULL},
    {NULL}};

static PyTypeObject RingType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "soapstone.comm.observe._flight_ring.Ring",
    .tp_basicsize = sizeof(Ring),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE,
    .tp_doc = "The two rings (collectives, p2p) of one communicator's flight recorder.",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)ring_init,
    .tp_dealloc = (destructor)ring_dealloc,
    .tp_methods = ring_methods,
    .tp_members = ring_members,
    .tp_getset = ring_getset,
};

static int getter_of(PyObject *desc, Getter *g) {
    if (!PyObject_TypeCheck(desc, &PyGetSetDescr_Type)) {
        PyErr_SetString(PyExc_TypeError, "expected a getset descriptor");
        return -1;
    }
    PyGetSetDescrObject *d = (PyGetSetDescrObject *)desc;
    if (tensor_type != NULL && d->d_common.d_type != tensor_type) {
        PyErr_SetString(PyExc_TypeError, "the descriptors must be of one class");
        return -1;
    }
    Py_INCREF(desc); /* keeps the getter's owner alive for good */
    tensor_type = d->d_common.d_type;
    g->get = d->d_getset->get;
    g->closure = d->d_getset->closure;
    return 0;
}

/* use_tensor_getters(shape, ndim, nbytes): read tensors through these getset descriptors
 * (torch.Tensor's, all of one class) for instances of their class */
static PyObject *use_tensor_getters(PyObject *m, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "use_tensor_getters(shape, ndim, nbytes)");
        return NULL;
    }
    Getter g[3];
    PyTypeObject *before = tensor_type;
    for (int i = 0; i < 3; i++) {
        if (getter_of(args[i], &g[i]) < 0) {
            tensor_type = before;
            return NULL;
        }
    }
    get_shape = g[0];
    get_ndim = g[1];
    get_nbytes = g[2];
    Py_RETURN_NONE;
}

/* use_tensor_reader(capsule): read tensors through the function in this capsule (tensor_reader.h)
 * first, and through the getters only where it cannot; None stops using it */
static PyObject *use_tensor_reader(PyObject *m, PyObject *capsule) {
    if (capsule == Py_None) {
        reader = NULL;
        Py_RETURN_NONE;
    }
    void *f = PyCapsule_GetPointer(capsule, SOAP_READER_CAPSULE);
    if (f == NULL) return NULL;
    Py_INCREF(capsule); /* keeps the reader's module alive for good */
    reader = (soap_tensor_reader)f;
    Py_RETURN_NONE;
}

static PyMethodDef module_methods[] = {
    {"use_tensor_getters", (PyCFunction)(void (*)(void))use_tensor_getters, METH_FASTCALL,
     "use_tensor_getters(shape, ndim, nbytes): read tensors through these descriptors"},
    {"use_tensor_reader", (PyCFunction)use_tensor_reader, METH_O,
     "use_tensor_reader(capsule): read tensors through this C reader first (None: stop)"},
    {NULL}};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_flight_ring",
                                    "The flight recorder's rings, in C.", -1, module_methods};

PyMODINIT_FUNC PyInit__flight_ring(void) {
    shape_name = PyUnicode_InternFromString("shape");
    itemsize_name = PyUnicode_InternFromString("itemsize");
    send_name = PyUnicode_InternFromString("send");
    recv_name = PyUnicode_InternFromString("recv");
    if (shape_name == NULL || itemsize_name == NULL || send_name == NULL || recv_name == NULL)
        return NULL;
    tsc_setup();
    PyObject *names = PyTuple_New(NSTATES);
    if (names == NULL) return NULL;
    for (int i = 0; i < NSTATES; i++) {
        state_str[i] = PyUnicode_InternFromString(STATE_NAMES[i]);
        if (state_str[i] == NULL) return NULL;
        Py_INCREF(state_str[i]);
        PyTuple_SET_ITEM(names, i, state_str[i]);
    }
    if (PyType_Ready(&RingType) < 0) return NULL;
    PyObject *m = PyModule_Create(&module);
    if (m == NULL) return NULL;
    Py_INCREF(&RingType);
    if (PyModule_AddObject(m, "Ring", (PyObject *)&RingType) < 0 ||
        PyModule_AddObject(m, "STATES", names) < 0)
        return NULL;
    return m;
}

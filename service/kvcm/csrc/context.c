/* The coordinator's arrays as the C core reads them (context.h). */
#include "context.h"

#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
#define NATIVE_LITTLE 1
#else
#define NATIVE_LITTLE 0
#endif

/* A C-contiguous buffer of itemsize-byte signed ints (itemsize 1: bools), writable if asked;
 * -1 with TypeError (or numpy's ValueError for a strided array) if it is not one. */
int buf_get(PyObject *obj, Buf *a, Py_ssize_t itemsize, int writable) {
    int flags = PyBUF_C_CONTIGUOUS | PyBUF_FORMAT | (writable ? PyBUF_WRITABLE : 0);
    if (PyObject_GetBuffer(obj, &a->view, flags) < 0) return -1;
    const char *f = a->view.format ? a->view.format : "B";
    /* native byte order only: no prefix, '@' or '=', or '<' on a little-endian host */
    if (f[0] == '@' || f[0] == '=' || (f[0] == '<' && NATIVE_LITTLE)) f++;
    int ok = a->view.itemsize == itemsize && strlen(f) == 1 &&
             (itemsize == 8 ? (f[0] == 'q' || f[0] == 'l') : f[0] == (itemsize == 1 ? '?' : 'i'));
    if (!ok) {
        PyBuffer_Release(&a->view);
        a->view.obj = NULL;
        PyErr_Format(PyExc_TypeError, "expected a C-contiguous %s%d array",
                     itemsize == 1 ? "bool" : "int", (int)(8 * itemsize));
        return -1;
    }
    a->p = a->view.buf;
    a->n = a->view.len / itemsize;
    return 0;
}

void buf_release(Buf *a) {
    if (a->view.obj) PyBuffer_Release(&a->view);
    a->view.obj = NULL;
}

void ctx_release(Ctx *c) {
    buf_release(&c->row_handle);
    buf_release(&c->scratch);
    buf_release(&c->num_tokens);
    buf_release(&c->history);
    buf_release(&c->lookahead);
    buf_release(&c->tables);
    for (int g = 0; g < c->got_blocks; g++) buf_release(&c->blocks[g]);
    for (int g = 0; g < c->got_released; g++) buf_release(&c->released[g]);
    for (int p = 0; p < c->got_refs; p++) buf_release(&c->refs[p]);
}

static int ctx_fail(const char *what) {
    PyErr_Format(PyExc_ValueError, "step context: %s", what);
    return -1;
}

int ctx_get(PyObject *t, Ctx *c, int writable) {
    memset(c, 0, sizeof *c);
    if (!PyTuple_Check(t) || PyTuple_GET_SIZE(t) != 14) return ctx_fail("a tuple of 14");
    PyObject **it = &PyTuple_GET_ITEM(t, 0);
    if (buf_get(it[0], &c->row_handle, 8, 0) < 0 || buf_get(it[1], &c->scratch, 8, 1) < 0 ||
        buf_get(it[2], &c->num_tokens, 8, 1) < 0 || buf_get(it[3], &c->history, 8, 1) < 0 ||
        buf_get(it[4], &c->lookahead, 8, 1) < 0 || buf_get(it[7], &c->tables, 4, writable) < 0)
        return -1;
    PyObject *blocks = it[5], *released = it[6], *refs = it[8], *pools = it[9], *wins = it[10];
    if (!PyTuple_Check(blocks) || !PyTuple_Check(released) || !PyTuple_Check(refs) ||
        !PyTuple_Check(pools) || !PyTuple_Check(wins))
        return ctx_fail("num_blocks, released_end, refs, group_pool and windows are tuples");
    c->groups = (int)PyTuple_GET_SIZE(blocks);
    c->pools = (int)PyTuple_GET_SIZE(refs);
    if (c->groups < 1 || c->groups > MAX_GROUPS || c->pools < 1 || c->pools > MAX_GROUPS ||
        PyTuple_GET_SIZE(released) != c->groups || PyTuple_GET_SIZE(pools) != c->groups ||
        PyTuple_GET_SIZE(wins) != c->groups)
        return ctx_fail("1 to 64 layer groups and pool groups, a value per group");
    c->max_seq_len = PyLong_AsLongLong(it[11]);
    c->tpb = PyLong_AsLongLong(it[12]);
    c->empty = PyLong_AsLongLong(it[13]);
    if (PyErr_Occurred()) return -1;
    c->nrows = c->num_tokens.n;
    if (c->tpb < 1) return ctx_fail("tokens_per_block must be >= 1");
    if (c->row_handle.n != c->nrows || c->scratch.n != c->nrows ||
        c->history.n != c->nrows || c->lookahead.n != c->nrows ||
        c->tables.view.ndim != 3 || c->tables.view.shape[0] != c->groups ||
        c->tables.view.shape[1] != c->nrows)
        return ctx_fail("arrays of mismatched sizes");
    c->width = c->tables.view.shape[2];
    for (int g = 0; g < c->groups; g++) {
        if (buf_get(PyTuple_GET_ITEM(blocks, g), &c->blocks[g], 8, 1) < 0) return -1;
        c->got_blocks = g + 1;
        if (buf_get(PyTuple_GET_ITEM(released, g), &c->released[g], 8, 1) < 0) return -1;
        c->got_released = g + 1;
        if (c->blocks[g].n != c->nrows || c->released[g].n != c->nrows)
            return ctx_fail("a per-group array without a cell per row");
        long pg = PyLong_AsLong(PyTuple_GET_ITEM(pools, g));
        c->window[g] = PyLong_AsLongLong(PyTuple_GET_ITEM(wins, g));
        if (PyErr_Occurred()) return -1;
        if (pg < 0 || pg >= c->pools || c->window[g] < 0) return ctx_fail("a group's pool or window");
        c->group_pool[g] = (int)pg;
    }
    for (int p = 0; p < c->pools; p++) {
        if (buf_get(PyTuple_GET_ITEM(refs, p), &c->refs[p], 4, writable) < 0) return -1;
        c->got_refs = p + 1;
    }
    return 0;
}

static int64_t attr_int(PyObject *obj, const char *name) {
    PyObject *v = PyObject_GetAttrString(obj, name);
    if (!v) return -1;
    int64_t x = PyLong_AsLongLong(v);
    Py_DECREF(v);
    return x;
}

int pool_get(PyObject *obj, Pool *p) {
    memset(p, 0, sizeof *p);
    p->obj = obj;
    PyObject *ring = PyObject_GetAttrString(obj, "_ring");
    PyObject *pos = ring ? PyObject_GetAttrString(obj, "_pos") : NULL;
    int bad = !pos || buf_get(ring, &p->ring, 4, 1) < 0 || buf_get(pos, &p->pos, 8, 1) < 0;
    Py_XDECREF(ring);
    Py_XDECREF(pos);
    if (bad) return -1;
    p->head = attr_int(obj, "_head");
    p->len = attr_int(obj, "_len");
    p->count = attr_int(obj, "_count");
    if (PyErr_Occurred()) return -1;
    if (p->ring.n < 1 || p->head < 0 || p->len < 0 || p->count < 0 || p->len > p->ring.n ||
        p->count > p->len) {
        PyErr_SetString(PyExc_ValueError, "a free queue out of shape");
        return -1;
    }
    return 0;
}

static PyObject *POOL_NAMES[3];

int pool_stage(Pool *p, int64_t head, int64_t len, int64_t count) {
    static const char *text[3] = {"_head", "_len", "_count"};
    for (int i = 0; i < 3; i++)
        if (!POOL_NAMES[i] && !(POOL_NAMES[i] = PyUnicode_InternFromString(text[i]))) return -1;
    int64_t v[3] = {head, len, count};
    for (int i = 0; i < 3; i++) {
        p->staged[i] = PyLong_FromLongLong(v[i]);
        if (!p->staged[i]) return -1;
    }
    return 0;
}

int pool_commit(Pool *p) {
    /* Interned once (at the first pool_stage): setting them makes no string. */
    for (int i = 0; i < 3; i++)
        if (p->staged[i] && PyObject_SetAttr(p->obj, POOL_NAMES[i], p->staged[i]) < 0) return -1;
    return 0;
}

void pool_release(Pool *p) {
    buf_release(&p->ring);
    buf_release(&p->pos);
    for (int i = 0; i < 3; i++) Py_CLEAR(p->staged[i]);
}

/* A tuple of Py_ssize_t counts. */
PyObject *counts_tuple(const Py_ssize_t *k, int n) {
    PyObject *t = PyTuple_New(n);
    for (int i = 0; t && i < n; i++) {
        PyObject *v = PyLong_FromSsize_t(k[i]);
        if (!v) {
            Py_CLEAR(t);
            break;
        }
        PyTuple_SET_ITEM(t, i, v);
    }
    return t;
}

#define CAPSULE "kvcm._native.context"

static void context_free(PyObject *capsule) {
    Ctx *c = PyCapsule_GetPointer(capsule, CAPSULE);
    if (!c) return;
    ctx_release(c);
    PyMem_Free(c);
}

/* context(t) -> object: the decode context tuple read once, its buffers held (writable: the
 * row ops write the tables and refs) until the object is freed. The coordinator changes its
 * arrays in place only, so the buffers stay its own; reading 10 or more buffers per call
 * cost more than the row ops' work. */
PyObject *kvcm_context(PyObject *self, PyObject *t) {
    Ctx *c = PyMem_Malloc(sizeof *c);
    if (!c) return PyErr_NoMemory();
    if (ctx_get(t, c, 1) < 0) {
        ctx_release(c);
        PyMem_Free(c);
        return NULL;
    }
    PyObject *capsule = PyCapsule_New(c, CAPSULE, context_free);
    if (!capsule) {
        ctx_release(c);
        PyMem_Free(c);
    }
    return capsule;
}

Ctx *ctx_open(PyObject *o, Ctx *local, int writable) {
    if (PyCapsule_CheckExact(o)) return PyCapsule_GetPointer(o, CAPSULE);
    if (ctx_get(o, local, writable) < 0) {
        ctx_release(local);
        return NULL;
    }
    return local;
}

void ctx_close(Ctx *c, Ctx *local) {
    if (c == local) ctx_release(local);
}

/* The sinks of each layer group (a tuple of ints), into out; -1 with an error. */
int sinks_get(PyObject *t, const Ctx *c, int64_t *out) {
    if (!PyTuple_Check(t) || PyTuple_GET_SIZE(t) != c->groups) {
        PyErr_SetString(PyExc_ValueError, "sinks: a tuple with an int per layer group");
        return -1;
    }
    for (int g = 0; g < c->groups; g++) {
        out[g] = PyLong_AsLongLong(PyTuple_GET_ITEM(t, g));
        if (PyErr_Occurred()) return -1;
    }
    return 0;
}

/* Each pool group's free queue (a tuple of BlockPool), into p[]; *got counts those read
 * (the caller releases them). -1 with an error. */
int pools_get(PyObject *t, const Ctx *c, Pool *p, int *got) {
    if (!PyTuple_Check(t) || PyTuple_GET_SIZE(t) != c->pools) {
        PyErr_SetString(PyExc_ValueError, "pools: a tuple with a BlockPool per pool group");
        return -1;
    }
    for (int q = 0; q < c->pools; q++) {
        if (pool_get(PyTuple_GET_ITEM(t, q), &p[q]) < 0) {
            pool_release(&p[q]);
            return -1;
        }
        *got = q + 1;
    }
    return 0;
}

int pools_commit(Pool *p, int n) {
    int ok = 0; /* every queue's counters set, even after one failed (setattr on a slot) */
    for (int q = 0; q < n; q++)
        if (pool_commit(&p[q]) < 0) ok = -1;
    return ok;
}

void pools_release(Pool *p, int n) {
    for (int q = 0; q < n; q++) pool_release(&p[q]);
}

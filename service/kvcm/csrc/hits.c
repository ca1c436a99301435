/* A new request's blocks in one call: its prefix hit and the blocks past it
 * (kvcm.native_rows.start).
 *
 * What kvcm.prefix_cache.find_hit, Coordinator.hit_need, check_fits, place_hits and then
 * grow_one do for a new request when every layer group is full attention: the hit is the
 * run of leading keys every layer group's index holds, the row takes those cached slots,
 * then new blocks for the rest of the request. A hashed 512-token allocate spent some 15 us
 * there in a dozen numpy and dict calls, then two calls into this module. */
#include "context.h"

/* row_start(row, keys, scopes, cap, num_tokens, lookahead, context, pools, sinks, cached)
 *     -> (hit, added, evict) | None | False
 *
 * `keys`: the prompt's block keys (a list, empty without a prompt); `scopes`: per layer
 * group, the dict key -> slot of the request's scope (None: nothing cached there); `cap`:
 * the longest hit allowed (kvcm.prefix_cache.hit_cap). The hit b is the number of leading
 * keys (at most cap) that every group's scope holds. The free row `row` then gets, in each
 * group, the cached slots of blocks [0, b): each is held once more, and one nobody held
 * leaves its pool group's free queue (a tombstone in its place), its released run at the
 * group's sinks. Then row_grow's blocks for num_tokens + lookahead tokens in all: blocks
 * [b, ceil((num_tokens + lookahead) / tokens_per_block)) of each group from the head of its
 * queue. The row holds num_tokens tokens, b * tokens_per_block of them history. Returns b,
 * the blocks each layer group added past it, and whether a slot they took holds a cached
 * block (`cached`: each pool group's flags, a bool array per slot), which the caller then
 * evicts.
 *
 * None, with nothing changed, when the request does not fit: its pool groups need the hit's
 * unheld slots plus the blocks past the hit (the numpy path then names the error); False,
 * with nothing changed, when the numpy path must run it (a row that is not free, a window in
 * a group when there is a hit to look for, a key that is not bytes, a slot or queue out of
 * shape, a count out of range; never from the coordinator but the window).
 *
 * Example (tokens_per_block 4, one group, free queue [7 8 2 5], cached keys k0 -> 7,
 * k1 -> 3, k2 -> 9, slot 3 held by another request): keys [k0 k1 k5], cap 3, 10 tokens and
 * 6 lookahead: b = 2; the row gets [7 3] (refs 1 and 2; 7 leaves the queue: [-1 8 2 5]),
 * then blocks 2 and 3 from the head, [8 2]; returns (2, (2,), False) if neither 8 nor 2
 * caches a block, and the queue is [5]. */
int cached_get(PyObject *t, const Ctx *c, Buf *out, int *got) {
    if (!PyTuple_Check(t) || PyTuple_GET_SIZE(t) != c->pools) {
        PyErr_SetString(PyExc_ValueError, "cached: a bool array per pool group");
        return -1;
    }
    for (int q = 0; q < c->pools; q++) {
        memset(&out[q], 0, sizeof out[q]);
        if (buf_get(PyTuple_GET_ITEM(t, q), &out[q], 1, 0) < 0) return -1;
        *got = q + 1;
        if (out[q].n != c->refs[q].n) {
            PyErr_SetString(PyExc_ValueError, "cached: a flag per slot");
            return -1;
        }
    }
    return 0;
}

void start_free(Start *s) {
    PyMem_Free(s->slots);
    PyMem_Free(s->marked);
    s->slots = NULL;
    s->marked = NULL;
}

/* The ring entries of the hit's unheld slots (s->marked: layer group << 32 | block): each
 * a tombstone (-1), or its slot again. */
static void set_marked(const Ctx *c, Pool *p, const Start *s, int tombstone) {
    for (Py_ssize_t i = 0; i < s->nmarked; i++) {
        int g = (int)(s->marked[i] >> 32);
        int q = c->group_pool[g];
        int32_t slot = s->slots[g * s->b + (s->marked[i] & 0xFFFFFFFF)];
        I32P(p[q].ring)[I64P(p[q].pos)[slot] % p[q].ring.n] = tombstone ? -1 : slot;
    }
}

void start_undo(const Ctx *c, Pool *p, Start *s) {
    set_marked(c, p, s, 0);
    s->nmarked = 0;
}

int start_plan(const Ctx *c, Pool *p, const Buf *cached, int64_t row, PyObject *keys,
               PyObject *scopes, int64_t cap, int64_t nt, int64_t la, Start *s) {
    memset(s, 0, sizeof *s);
    PyObject **found = NULL;
    int status = -1;
    if (row < 0 || row >= c->nrows || nt < 1 || nt > MAX_COUNT || la < 0 || la > MAX_COUNT)
        goto numpy;
    for (int g = 0; g < c->groups; g++)
        if (I64P(c->blocks[g])[row] != 0 || I64P(c->num_tokens)[row] != 0) goto numpy;
    /* b: the leading keys every group holds. Keys are exact bytes (chain_keys'), so the
     * dicts' lookups run no Python code that could change the list under us. */
    Py_ssize_t b = PyList_GET_SIZE(keys);
    if (cap < b) b = cap > 0 ? (Py_ssize_t)cap : 0;
    if (b && PyTuple_GET_SIZE(scopes) != c->groups) {
        PyErr_SetString(PyExc_ValueError, "scopes: one per layer group");
        goto done;
    }
    for (int g = 0; g < c->groups && b; g++)
        if (c->window[g]) goto numpy;
    for (Py_ssize_t j = 0; j < b; j++)
        if (!PyBytes_CheckExact(PyList_GET_ITEM(keys, j))) goto numpy;
    /* Each group's slot objects are kept as they are found (borrowed: no Python code runs
     * until they are read below), so every key is looked up once per group. */
    Py_ssize_t stride = b;
    if (b && !(found = PyMem_Malloc((size_t)(c->groups * stride) * sizeof *found))) {
        PyErr_NoMemory();
        goto done;
    }
    for (int g = 0; g < c->groups && b; g++) {
        PyObject *scope = PyTuple_GET_ITEM(scopes, g);
        if (scope == Py_None) {
            b = 0;
            break;
        }
        if (!PyDict_CheckExact(scope)) {
            PyErr_SetString(PyExc_TypeError, "scopes: dicts or None");
            goto done;
        }
        Py_ssize_t j = 0;
        for (; j < b; j++) {
            PyObject *v = PyDict_GetItemWithError(scope, PyList_GET_ITEM(keys, j));
            if (!v) {
                if (PyErr_Occurred()) goto done;
                break;
            }
            found[g * stride + j] = v;
        }
        b = j;
    }
    if (b > c->width) goto numpy;
    s->b = b;
    if (b && (!(s->slots = PyMem_Malloc((size_t)(c->groups * b) * sizeof *s->slots)) ||
              !(s->marked = PyMem_Malloc((size_t)(c->groups * b) * sizeof *s->marked)))) {
        PyErr_NoMemory();
        goto done;
    }
    for (int g = 0; g < c->groups && b; g++) {
        int q = c->group_pool[g];
        const int32_t *refs = I32P(c->refs[q]);
        for (Py_ssize_t j = 0; j < b; j++) {
            PyObject *v = found[g * stride + j];
            if (!PyLong_CheckExact(v)) goto numpy;
            long slot = PyLong_AsLong(v);
            if (slot == -1 && PyErr_Occurred()) goto done;
            if (slot <= c->empty || slot >= c->refs[q].n || slot >= p[q].pos.n)
                goto numpy; /* a slot out of range */
            int64_t at = I64P(p[q].pos)[slot] % p[q].ring.n;
            if (refs[slot] == 0 && (at < 0 || I32P(p[q].ring)[at] != slot))
                goto numpy; /* a free slot that is not where its queue says */
            s->slots[g * b + j] = (int32_t)slot;
            if (refs[slot] == 0) { /* unheld: it leaves its queue (below, once it fits) */
                s->claimed[q]++;
                s->marked[s->nmarked++] = (int64_t)g << 32 | j;
            }
        }
        s->current[g] = b;
    }
    s->history = b * c->tpb;
    if (grow_plan(c, row, s->history, s->current, nt - s->history, la, s->add, s->need))
        goto numpy;
    for (int q = 0; q < c->pools; q++) {
        if (s->need[q] + s->claimed[q] > p[q].count) {
            status = 2;
            goto done;
        }
    }
    /* The hit's unheld slots leave their queues first (tombstones), so that the grow's
     * spans skip them, as the numpy path's pops do after place_hits. */
    set_marked(c, p, s, 1);
    int staged = grow_stage(p, c->pools, s->need, s->claimed, c);
    if (staged) {
        start_undo(c, p, s);
        if (staged > 0) goto numpy;
        goto done;
    }
    /* Whether a slot the grow will take caches a block: the same slots pool_pop takes. */
    for (int q = 0; q < c->pools && !s->evict; q++) {
        const int32_t *ring = I32P(p[q].ring);
        const uint8_t *flags = (const uint8_t *)cached[q].p;
        int64_t taken = 0;
        for (int64_t at = p[q].head; taken < s->need[q]; at++) {
            int32_t v = ring[at % p[q].ring.n];
            if (v < 0) continue;
            s->evict |= flags[v] != 0;
            taken++;
        }
    }
    status = 0;
    goto done;
numpy:
    status = 1;
done:
    PyMem_Free(found);
    if (status) start_free(s);
    return status;
}

void start_write(Ctx *c, Pool *p, const int64_t *sinks, int64_t row, int64_t nt, int64_t la,
                 const Start *s) {
    for (int g = 0; g < c->groups && s->b; g++) {
        int q = c->group_pool[g];
        int32_t *refs = I32P(c->refs[q]);
        int32_t *cells = I32P(c->tables) + (g * c->nrows + row) * c->width;
        for (Py_ssize_t j = 0; j < s->b; j++) {
            refs[s->slots[g * s->b + j]]++;
            cells[j] = s->slots[g * s->b + j];
        }
        I64P(c->blocks[g])[row] = s->b;
        I64P(c->released[g])[row] = sinks[g];
    }
    grow_write(c, p, row, s->history, s->current, s->add, nt - s->history, la);
}

PyObject *kvcm_row_start(PyObject *self, PyObject *args) {
    PyObject *keys, *scopes, *ctx_o, *pools_o, *sinks_o, *cached_o;
    long long row, cap, nt, la;
    if (!PyArg_ParseTuple(args, "LO!O!LLLOOOO", &row, &PyList_Type, &keys, &PyTuple_Type,
                          &scopes, &cap, &nt, &la, &ctx_o, &pools_o, &sinks_o, &cached_o))
        return NULL;
    Ctx local, *c = NULL;
    Pool p[MAX_GROUPS];
    Buf cached[MAX_GROUPS];
    int got = 0, got_cached = 0;
    int64_t sinks[MAX_GROUPS];
    Start s;
    PyObject *result = NULL;
    if (!(c = ctx_open(ctx_o, &local, 1)) || sinks_get(sinks_o, c, sinks) < 0 ||
        pools_get(pools_o, c, p, &got) < 0 || cached_get(cached_o, c, cached, &got_cached) < 0)
        goto done;
    int planned = start_plan(c, p, cached, row, keys, scopes, cap, nt, la, &s);
    if (planned < 0) goto done;
    if (planned) {
        result = Py_NewRef(planned == 2 ? Py_None : Py_False);
        goto done;
    }
    result = Py_BuildValue("(nNO)", s.b, counts_tuple(s.add, c->groups),
                           s.evict ? Py_True : Py_False);
    if (!result) {
        start_undo(c, p, &s);
        start_free(&s);
        goto done;
    }
    start_write(c, p, sinks, row, nt, la, &s);
    start_free(&s);
    if (pools_commit(p, c->pools) < 0) Py_CLEAR(result);
done:
    for (int q = 0; q < got_cached; q++) buf_release(&cached[q]);
    pools_release(p, got);
    if (c) ctx_close(c, &local);
    return result;
}

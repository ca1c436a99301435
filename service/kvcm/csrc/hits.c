/* A new request's prefix hit in one call (kvcm.native_rows.place_hit).
 *
 * What kvcm.prefix_cache.find_hit, Coordinator.hit_need, check_fits and place_hits do for a
 * coordinator whose layer groups are all full attention: the hit is the run of leading keys
 * every layer group's index holds, and the row takes those cached slots. A hashed 512-token
 * allocate spent some 15 us there in a dozen numpy and dict calls. */
#include "context.h"

/* row_hit(row, keys, scopes, cap, capacity, context, pools, sinks) -> int | None | False
 *
 * `scopes`: per layer group, the dict key -> slot of the request's scope (None: nothing
 * cached there); `cap`: the longest hit allowed (find_hit's min(len(keys), (num_tokens - 1)
 * // tokens_per_block)); `capacity`: the request's tokens with lookahead. The hit b is the
 * number of leading keys (at most cap) that every group's scope holds. The free row `row`
 * then gets, in each group, the cached slots of blocks [0, b): each is held once more, and
 * one nobody held leaves its pool group's free queue (a tombstone in its place); b blocks,
 * b * tokens_per_block tokens (num_tokens and history), its released run at the group's
 * sinks. Returns b (0: no hit, nothing changed).
 *
 * None, with nothing changed, when the request with this hit does not fit: its pool groups
 * need the hit's unheld slots plus the blocks past the hit up to `capacity` (the numpy path
 * then names the error); False, with nothing changed, when the numpy path must run it (a
 * row that is not free, a key that is not bytes, a slot or queue out of shape, never from
 * the coordinator). History and the released runs are written as place_hits writes them
 * (row_grow, which always follows, sets history again; a full-attention group's sinks are
 * 0).
 *
 * Example (tokens_per_block 4, one group, cached keys k0 -> 7, k1 -> 3, k2 -> 9, slot 3
 * held by another request): keys [k0 k1 k5], cap 3, capacity 20: b = 2; the row gets [7 3],
 * refs 1 and 2; 7 leaves the queue; the request needs 1 + (5 - 2) = 4 free slots. */
PyObject *kvcm_row_hit(PyObject *self, PyObject *args) {
    PyObject *keys, *scopes, *ctx_o, *pools_o, *sinks_o;
    long long row, cap, capacity;
    if (!PyArg_ParseTuple(args, "LO!O!LLOOO", &row, &PyList_Type, &keys, &PyTuple_Type, &scopes,
                          &cap, &capacity, &ctx_o, &pools_o, &sinks_o))
        return NULL;
    Ctx local, *c = NULL;
    Pool p[MAX_GROUPS];
    int got = 0;
    int64_t sinks[MAX_GROUPS], need[MAX_GROUPS] = {0}, unheld[MAX_GROUPS] = {0};
    int32_t *slots = NULL;
    PyObject *result = NULL, **found = NULL;
    if (!(c = ctx_open(ctx_o, &local, 1)) || sinks_get(sinks_o, c, sinks) < 0 ||
        pools_get(pools_o, c, p, &got) < 0)
        goto done;
    if (PyTuple_GET_SIZE(scopes) != c->groups) {
        PyErr_SetString(PyExc_ValueError, "scopes: one per layer group");
        goto done;
    }
    if (row < 0 || row >= c->nrows || capacity < 1 || capacity > MAX_COUNT) goto numpy;
    for (int g = 0; g < c->groups; g++)
        if (c->window[g] || I64P(c->blocks[g])[row] != 0) goto numpy;
    /* b: the leading keys every group holds. Keys are exact bytes (chain_keys'), so the
     * dicts' lookups run no Python code that could change the list under us. */
    Py_ssize_t b = PyList_GET_SIZE(keys);
    if (cap < b) b = cap > 0 ? (Py_ssize_t)cap : 0;
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
    if (!b) {
        result = PyLong_FromLong(0);
        goto done;
    }
    if (b > c->width) goto numpy;
    if (!(slots = PyMem_Malloc((size_t)(c->groups * b) * sizeof *slots))) {
        PyErr_NoMemory();
        goto done;
    }
    int64_t want = (capacity + c->tpb - 1) / c->tpb;
    for (int g = 0; g < c->groups; g++) {
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
            slots[g * b + j] = (int32_t)slot;
            unheld[g] += refs[slot] == 0;
        }
        need[q] += (want > b ? want - b : 0) + unheld[g];
    }
    for (int q = 0; q < c->pools; q++) {
        if (need[q] > p[q].count) {
            result = Py_NewRef(Py_None);
            goto done;
        }
    }
    /* Everything that can fail comes before the first write. */
    int64_t claimed[MAX_GROUPS] = {0};
    for (int g = 0; g < c->groups; g++) claimed[c->group_pool[g]] += unheld[g];
    for (int q = 0; q < c->pools; q++)
        if (claimed[q] && pool_stage(&p[q], p[q].head, p[q].len, p[q].count - claimed[q]) < 0)
            goto done;
    result = PyLong_FromSsize_t(b);
    if (!result) goto done;
    for (int g = 0; g < c->groups; g++) {
        int q = c->group_pool[g];
        int32_t *refs = I32P(c->refs[q]);
        int32_t *cells = I32P(c->tables) + (g * c->nrows + row) * c->width;
        for (Py_ssize_t j = 0; j < b; j++) {
            int32_t slot = slots[g * b + j];
            if (refs[slot]++ == 0) I32P(p[q].ring)[I64P(p[q].pos)[slot] % p[q].ring.n] = -1;
            cells[j] = slot;
        }
        I64P(c->blocks[g])[row] = b;
        I64P(c->released[g])[row] = sinks[g];
    }
    I64P(c->num_tokens)[row] = b * c->tpb;
    I64P(c->history)[row] = b * c->tpb;
    if (pools_commit(p, c->pools) < 0) Py_CLEAR(result);
    goto done;
numpy:
    result = Py_NewRef(Py_False);
done:
    PyMem_Free(found);
    PyMem_Free(slots);
    pools_release(p, got);
    if (c) ctx_close(c, &local);
    return result;
}

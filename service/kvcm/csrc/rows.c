/* One row's new blocks and a freed row's blocks, one call each (kvcm.native_rows).
 *
 * Both do what the coordinator's numpy path does for one row (Coordinator.grow_one where
 * no window releases anything, Coordinator.release_row), in the same order: the same slots leave and join the
 * free queues in the same order, and the same table cells, references and counters change.
 * Evictions of cached slots, the host tier's copies and the device-table edits stay in
 * Python (the caller's), which reads what changed from the tables. */
#include "context.h"

/* How many ring entries from the head hold the k oldest free slots (tombstones, -1,
 * skipped), each checked to be a slot below ``slots``: -1 if the queue ends first or holds
 * another value (never from BlockPool). Reads only. */
int64_t pool_span(const Pool *p, int64_t k, Py_ssize_t slots) {
    const int32_t *ring = I32P(p->ring);
    int64_t used = 0;
    for (int64_t taken = 0; taken < k; used++) {
        if (used >= p->len) return -1;
        int32_t v = ring[(p->head + used) % p->ring.n];
        if (v >= slots) return -1;
        taken += v >= 0;
    }
    return used;
}

/* BlockPool.pop of k slots into out, once pool_span has measured them. */
void pool_pop(Pool *p, int64_t k, int32_t *out) {
    const int32_t *ring = I32P(p->ring);
    for (int64_t taken = 0; taken < k; p->head++, p->len--) {
        int32_t v = ring[p->head % p->ring.n];
        if (v >= 0) out[taken++] = v;
    }
    p->count -= k;
}

/* BlockPool.push of one slot at the tail (the caller checked len < capacity). */
void pool_push(Pool *p, int32_t slot) {
    int64_t at = p->head + p->len;
    I32P(p->ring)[at % p->ring.n] = slot;
    I64P(p->pos)[slot] = at;
    p->len++;
    p->count++;
}

int grow_plan(const Ctx *c, int64_t row, int64_t history, const int64_t *current, int64_t nt,
              int64_t la, Py_ssize_t *add, int64_t *need) {
    if (nt < 1 || nt > MAX_COUNT || la < 0 || la > MAX_COUNT) return 1;
    if (history < 0 || history > MAX_COUNT) return 1; /* never from the coordinator */
    int64_t want = (history + nt + la + c->tpb - 1) / c->tpb;
    if (want > c->width) return 1;
    for (int g = 0; g < c->groups; g++) {
        if (current[g] < 0 || current[g] > c->width) return 1; /* never from the coordinator */
        if (c->window[g]) {
            int64_t old = I64P(c->released[g])[row];
            if (released_end(old, history, c->window[g], c->tpb) != old) return 1;
        }
        add[g] = want > current[g] ? (Py_ssize_t)(want - current[g]) : 0;
        need[c->group_pool[g]] += add[g];
    }
    return 0;
}

int grow_stage(Pool *p, int pools, const int64_t *need, const int64_t *claimed,
               const Ctx *c) {
    for (int q = 0; q < pools; q++) {
        int64_t used = need[q] ? pool_span(&p[q], need[q], c->refs[q].n) : 0;
        if (used < 0) return 1;
        if ((need[q] || claimed[q]) &&
            pool_stage(&p[q], p[q].head + used, p[q].len - used,
                       p[q].count - claimed[q] - need[q]) < 0)
            return -1;
    }
    return 0;
}

void grow_write(Ctx *c, Pool *p, int64_t row, int64_t history, const int64_t *current,
                const Py_ssize_t *add, int64_t nt, int64_t la) {
    for (int g = 0; g < c->groups; g++) {
        if (!add[g]) continue;
        int32_t *cells = I32P(c->tables) + (g * c->nrows + row) * c->width + current[g];
        int32_t *refs = I32P(c->refs[c->group_pool[g]]);
        pool_pop(&p[c->group_pool[g]], add[g], cells);
        for (Py_ssize_t b = 0; b < add[g]; b++) refs[cells[b]] = 1;
        I64P(c->blocks[g])[row] = current[g] + add[g];
    }
    I64P(c->num_tokens)[row] = history + nt;
    I64P(c->history)[row] = history;
    I64P(c->lookahead)[row] = la;
}

/* row_grow(row, num_tokens, lookahead, context, pools) -> tuple | None | False
 *
 * Coordinator.grow_one of a row whose sliding windows release nothing (the blocks past a
 * prefix hit the Python path placed): the row's capacity becomes history + num_tokens +
 * lookahead tokens, history being its tokens before the call; each layer group in turn
 * takes the blocks from its count up to ceil(capacity / tokens_per_block) from the head of
 * its pool group's free queue: the slots are held once (refs 1) and written at
 * tables[g][row, count:]. Returns the blocks each layer group added.
 *
 * None, with nothing changed, when a pool group has fewer free slots than its groups need
 * (the numpy path then raises OutOfBlocks); False, with nothing changed, when the numpy
 * path must run it: a window that would release blocks, a row or count out of range, more
 * blocks than a row holds, a queue out of shape.
 *
 * Example (tokens_per_block 16, two layer groups in one pool group, free queue [7 3 9 4
 * 2]): a free row, 20 tokens and 4 lookahead: 2 blocks per group, group 0 gets [7 3],
 * group 1 [9 4]; the queue is [2]; returns (2, 2). The same row +10 tokens (34 with the
 * lookahead) needs block 2 in each group, 2 slots, and 1 is free: None.
 */
PyObject *kvcm_row_grow(PyObject *self, PyObject *args) {
    PyObject *ctx_o, *pools_o;
    long long row, nt, la;
    if (!PyArg_ParseTuple(args, "LLLOO", &row, &nt, &la, &ctx_o, &pools_o)) return NULL;
    Ctx local, *c = NULL;
    Pool p[MAX_GROUPS];
    int got = 0;
    int64_t need[MAX_GROUPS] = {0}, current[MAX_GROUPS], none[MAX_GROUPS] = {0};
    Py_ssize_t add[MAX_GROUPS] = {0};
    PyObject *result = NULL;
    if (!(c = ctx_open(ctx_o, &local, 1)) || pools_get(pools_o, c, p, &got) < 0) goto done;
    if (row < 0 || row >= c->nrows) goto numpy;
    for (int g = 0; g < c->groups; g++) current[g] = I64P(c->blocks[g])[row];
    int64_t history = I64P(c->num_tokens)[row];
    if (grow_plan(c, row, history, current, nt, la, add, need)) goto numpy;
    for (int q = 0; q < c->pools; q++) {
        if (need[q] > p[q].count) {
            result = Py_NewRef(Py_None);
            goto done;
        }
    }
    /* Everything that can fail comes before the first write: the spans read, the result
     * and the queues' new counters made. */
    int staged = grow_stage(p, c->pools, need, none, c);
    if (staged < 0) goto done;
    if (staged) goto numpy;
    result = counts_tuple(add, c->groups);
    if (!result) goto done;
    grow_write(c, p, row, history, current, add, nt, la);
    if (pools_commit(p, c->pools) < 0) Py_CLEAR(result);
    goto done;
numpy:
    result = Py_NewRef(Py_False);
done:
    pools_release(p, got);
    ctx_close(c, &local);
    return result;
}

/* row_release(row, context, pools, sinks) -> tuple | int | False
 *
 * Frees every block of a row, each layer group's tail first (so that its head is evicted
 * last): a slot the row held alone goes to the tail of its pool group's free queue, one a
 * prefix hit shares loses a reference. Then the row's cells are empty, its released runs at
 * their sinks and its counters 0. Returns the cells cleared per layer group (the blocks it
 * had, released ones included).
 *
 * An int (a pool group), with nothing changed, when that pool group's queue has no room for
 * what comes back until it is compacted: the caller compacts it and calls again. False,
 * with nothing changed, when the numpy path must run it (a row or a cell out of shape,
 * never from the coordinator).
 *
 * Example (empty -1): a row holding [5 8 -1 2] in group 0 (a window released position 2)
 * and [6] in group 1, all held alone, one pool group: the queue gets 2, 8, 5, then 6;
 * returns (4, 1).
 */
PyObject *kvcm_row_release(PyObject *self, PyObject *args) {
    PyObject *ctx_o, *pools_o, *sinks_o;
    long long row;
    if (!PyArg_ParseTuple(args, "LOOO", &row, &ctx_o, &pools_o, &sinks_o)) return NULL;
    Ctx local, *c = NULL;
    Pool p[MAX_GROUPS];
    int got = 0;
    int64_t sinks[MAX_GROUPS], back[MAX_GROUPS] = {0};
    Py_ssize_t cleared[MAX_GROUPS] = {0};
    PyObject *result = NULL;
    if (!(c = ctx_open(ctx_o, &local, 1)) || sinks_get(sinks_o, c, sinks) < 0 ||
        pools_get(pools_o, c, p, &got) < 0)
        goto done;
    if (row < 0 || row >= c->nrows) goto numpy;
    for (int g = 0; g < c->groups; g++) { /* check every cell */
        int q = c->group_pool[g];
        int64_t count = I64P(c->blocks[g])[row];
        const int32_t *cells = I32P(c->tables) + (g * c->nrows + row) * c->width;
        if (count < 0 || count > c->width) goto numpy;
        for (int64_t b = 0; b < count; b++) {
            int64_t slot = cells[b];
            if (slot > c->empty && (slot >= c->refs[q].n || slot >= p[q].pos.n)) goto numpy;
        }
        cleared[g] = (Py_ssize_t)count;
    }
    /* What comes back, counted as the writes will drop the references (a slot named twice,
     * never from the coordinator, comes back once), then the references put back. */
    int bad = 0;
    Py_ssize_t dropped = 0, undone = 0;
    for (int g = 0; g < c->groups && !bad; g++) {
        const int32_t *cells = I32P(c->tables) + (g * c->nrows + row) * c->width;
        int32_t *refs = I32P(c->refs[c->group_pool[g]]);
        for (int64_t b = cleared[g] - 1; b >= 0; b--) {
            if (cells[b] <= c->empty) continue;
            if (refs[cells[b]] < 1) { /* a cell nobody holds */
                bad = 1;
                break;
            }
            back[c->group_pool[g]] += --refs[cells[b]] == 0;
            dropped++;
        }
    }
    for (int g = 0; g < c->groups && undone < dropped; g++) {
        const int32_t *cells = I32P(c->tables) + (g * c->nrows + row) * c->width;
        int32_t *refs = I32P(c->refs[c->group_pool[g]]);
        for (int64_t b = cleared[g] - 1; b >= 0 && undone < dropped; b--) {
            if (cells[b] <= c->empty) continue;
            refs[cells[b]]++;
            undone++;
        }
    }
    if (bad) goto numpy;
    for (int q = 0; q < c->pools; q++) {
        if (p[q].len + back[q] > p[q].ring.n) { /* BlockPool.push would compact first */
            result = PyLong_FromLong(q);
            goto done;
        }
    }
    /* Everything that can fail comes before the first write. */
    for (int q = 0; q < c->pools; q++)
        if (back[q] && pool_stage(&p[q], p[q].head, p[q].len + back[q], p[q].count + back[q]) < 0)
            goto done;
    result = counts_tuple(cleared, c->groups);
    if (!result) goto done;
    for (int g = 0; g < c->groups; g++) {
        int q = c->group_pool[g];
        int32_t *cells = I32P(c->tables) + (g * c->nrows + row) * c->width;
        int32_t *refs = I32P(c->refs[q]);
        for (int64_t b = cleared[g] - 1; b >= 0; b--) {
            int32_t slot = cells[b];
            if (slot > c->empty && --refs[slot] == 0) pool_push(&p[q], slot);
            cells[b] = (int32_t)c->empty;
        }
        I64P(c->blocks[g])[row] = 0;
        I64P(c->released[g])[row] = sinks[g];
    }
    I64P(c->num_tokens)[row] = 0;
    I64P(c->history)[row] = 0;
    I64P(c->lookahead)[row] = 0;
    if (pools_commit(p, c->pools) < 0) Py_CLEAR(result);
    goto done;
numpy:
    result = Py_NewRef(Py_False);
done:
    pools_release(p, got);
    ctx_close(c, &local);
    return result;
}

/* A decode step's batch of extends, planned in one pass over the rows (kvcm.native_step). */
#include "context.h"

/* An int for every item, or an int64 array of one per item. */
typedef struct {
    int64_t one;
    Buf arr;
    int is_arr;
} Column;

static int column_get(PyObject *obj, Py_ssize_t n, Column *col) {
    memset(col, 0, sizeof *col);
    if (PyLong_Check(obj)) {
        col->one = PyLong_AsLongLong(obj);
        return (col->one == -1 && PyErr_Occurred()) ? -1 : 0;
    }
    if (buf_get(obj, &col->arr, 8, 0) < 0) return -1;
    col->is_arr = 1;
    if (col->arr.n != n) {
        PyErr_SetString(PyExc_ValueError, "a per-item column of the wrong length");
        return -1;
    }
    return 0;
}

#define COL(c, i) ((c).is_arr ? I64P((c).arr)[i] : (c).one)

/* decode_plan(handles, new, ahead, context, free, out, skip=False)
 *     -> (added, released, failing) | int | False | None
 *
 * Plans extends of live, distinct handles as one batch, item after item, changing no state
 * (the scratch array is work space). ``free``: each pool group's free slots; ``out``:
 * (rows int64 [R], add_items, add_positions, release_items, release_positions, each int64
 * [groups, cap]). Item i's row goes to rows[i]; layer group g's new blocks are its (item,
 * position) pairs add_*[g, :added[g]], and the table cells a sliding window releases are
 * release_*[g, :released[g]], both in item order (what the numpy plan gathers).
 * ``failing``: with ``skip``, the items that fail on their own (a handle that is not live, a
 * capacity past max_seq_len), left out of the plan (rows[i] = -1), as the numpy path's
 * ``extends_around_failures`` leaves them out (a live one still counts when rows repeat, as
 * in ``request_rows.failing_extends``); without it, such an item refuses the batch, and
 * ``failing`` is empty.
 *
 * An int (the cells some group needs) when the out arrays are too small: the caller grows
 * them and plans again. False when the numpy plan must decide (it plans what this one does
 * not): a released cell that holds no page, a count out of range, a strided or non-int64
 * column. None when the numpy plan would refuse the batch as well (the items then run one
 * by one, each naming its error): an item that fails on its own (without ``skip``), a row
 * named twice, or a batch that does not fit item after item: per pool group, every prefix
 * of the items must need at most ``free`` slots, net of those it releases (a windowed row's
 * released blocks serve later rows only).
 *
 * Example (tokens_per_block 16, one full-attention group): row a holds 16 tokens in 1
 * block, row b 20 tokens in 2 blocks; +1 token each: a wants ceil(17 / 16) = 2 blocks, so
 * (item 0, position 1) is planned; b's 21 tokens fit its 2 blocks: returns ((1,), (0,), []).
 * With a window of 32 tokens (no sinks), a row at 48 tokens that grows releases block 0:
 * floor((48 + 1 - 32) / 16) = 1, so its released run [0, 0) becomes [0, 1), and
 * (item, position 0) is a release_* pair.
 */
PyObject *kvcm_decode_plan(PyObject *self, PyObject *args) {
    PyObject *handles_o, *new_o, *ahead_o, *ctx_o, *free_o, *out_o;
    int skip = 0;
    if (!PyArg_ParseTuple(args, "OOOOOO|p", &handles_o, &new_o, &ahead_o, &ctx_o, &free_o, &out_o,
                          &skip))
        return NULL;
    Ctx local, *c = NULL;
    Buf handles = {0}, out[5];
    Column new = {0}, ahead = {0};
    memset(out, 0, sizeof out);
    PyObject *result = NULL, *failing = NULL;
    int64_t room[MAX_GROUPS], net[MAX_GROUPS] = {0};
    Py_ssize_t kadd[MAX_GROUPS] = {0}, krel[MAX_GROUPS] = {0};
    if (!(c = ctx_open(ctx_o, &local, 0))) goto done;
    /* a strided or non-int64 column: numpy's path takes any */
    if (buf_get(handles_o, &handles, 8, 0) < 0) goto soft;
    Py_ssize_t n = handles.n;
    if (column_get(new_o, n, &new) < 0 || column_get(ahead_o, n, &ahead) < 0) goto soft;
    if (!PyTuple_Check(free_o) || PyTuple_GET_SIZE(free_o) != c->pools || !PyTuple_Check(out_o) ||
        PyTuple_GET_SIZE(out_o) != 5) {
        PyErr_SetString(PyExc_ValueError, "decode_plan: free per pool group, 5 out arrays");
        goto done;
    }
    for (int p = 0; p < c->pools; p++) {
        room[p] = PyLong_AsLongLong(PyTuple_GET_ITEM(free_o, p));
        if (PyErr_Occurred()) goto done;
    }
    for (int j = 0; j < 5; j++)
        if (buf_get(PyTuple_GET_ITEM(out_o, j), &out[j], 8, 1) < 0) goto done;
    Py_ssize_t cap = out[1].n / c->groups;
    if (out[0].n != c->nrows || out[2].n != out[1].n || out[3].n != out[1].n ||
        out[4].n != out[1].n) {
        PyErr_SetString(PyExc_ValueError, "decode_plan: out arrays of mismatched sizes");
        goto done;
    }
    int64_t *rows = I64P(out[0]), *add_items = I64P(out[1]), *add_pos = I64P(out[2]);
    int64_t *rel_items = I64P(out[3]), *rel_pos = I64P(out[4]);
    const int64_t *h = I64P(handles), *live = I64P(c->row_handle), *tokens = I64P(c->num_tokens);
    int64_t *scratch = I64P(c->scratch);
    const int32_t *tables = I32P(c->tables);
    if (n > c->nrows) { /* cannot all be distinct rows; rows[] has a cell per row */
        if (!skip) goto none;
        goto numpy;
    }
    failing = PyList_New(0);
    if (!failing) goto done;
    for (Py_ssize_t i = 0; i < n; i++) {
        int64_t row = h[i] & ROW_MASK;
        int fails = row >= c->nrows || live[row] != h[i];
        if (!fails) {
            int64_t nt = COL(new, i), la = COL(ahead, i);
            if (nt < 1 || nt > MAX_COUNT || la < 0 || la > MAX_COUNT) goto numpy; /* it names */
            fails = tokens[row] + nt + la > c->max_seq_len; /* each term below 2**62 */
        }
        if (fails) { /* an item that fails on its own: refused, or left out with skip */
            if (!skip) goto none;
            PyObject *index = PyLong_FromSsize_t(i);
            int bad = !index || PyList_Append(failing, index) < 0;
            Py_XDECREF(index);
            if (bad) goto done;
            /* a live one still counts for the repeat check (failing_extends) */
            rows[i] = (row < c->nrows && live[row] == h[i]) ? -2 - row : -1;
            if (rows[i] != -1) scratch[row] = i;
            continue;
        }
        rows[i] = row;
        scratch[row] = i;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        int64_t row = rows[i];
        if (row == -1) continue; /* left out */
        if (row < -1) {
            if (scratch[-2 - row] != i) goto none; /* a live item repeats its row */
            rows[i] = -1;
            continue;
        }
        if (scratch[row] != i) goto none; /* a later item names the same row */
        int64_t history = tokens[row], nt = COL(new, i), la = COL(ahead, i);
        int64_t capacity = history + nt + la;
        int64_t want = (capacity + c->tpb - 1) / c->tpb;
        for (int g = 0; g < c->groups; g++) {
            int p = c->group_pool[g];
            if (c->window[g]) {
                int64_t old = I64P(c->released[g])[row];
                int64_t end = released_end(old, history, c->window[g], c->tpb);
                if (old < 0 || end > c->width) goto numpy; /* never from the coordinator */
                const int32_t *cells = tables + (g * c->nrows + row) * c->width;
                for (int64_t pos = old; pos < end; pos++) {
                    int64_t slot = cells[pos];
                    if (slot <= c->empty || slot >= c->refs[p].n || I32P(c->refs[p])[slot] < 1)
                        goto numpy; /* a cell without a page: let the numpy plan judge */
                    if (krel[g] < cap) {
                        rel_items[g * cap + krel[g]] = i;
                        rel_pos[g * cap + krel[g]] = pos;
                    }
                    krel[g]++;
                    /* Only a page this row holds alone comes back for later rows: a prefix
                     * hit's page others hold frees nothing (if all its holders release it in
                     * this batch it does, at the last; like the numpy plan, the in-order rule
                     * does not count it, erring toward refusing). */
                    net[p] -= I32P(c->refs[p])[slot] == 1;
                }
            }
            if (I64P(c->blocks[g])[row] < 0) goto numpy; /* never from the coordinator */
            for (int64_t pos = I64P(c->blocks[g])[row]; pos < want; pos++) {
                if (kadd[g] < cap) {
                    add_items[g * cap + kadd[g]] = i;
                    add_pos[g * cap + kadd[g]] = pos;
                }
                kadd[g]++;
                net[p]++;
            }
        }
        for (int p = 0; p < c->pools; p++)
            if (net[p] > room[p]) goto none; /* does not fit item after item */
    }
    Py_ssize_t most = 0;
    for (int g = 0; g < c->groups; g++) {
        if (kadd[g] > most) most = kadd[g];
        if (krel[g] > most) most = krel[g];
    }
    if (most > cap) { /* the caller makes the out arrays this large and plans again */
        result = PyLong_FromSsize_t(most);
        goto done;
    }
    PyObject *added = counts_tuple(kadd, c->groups), *released = counts_tuple(krel, c->groups);
    if (added && released) result = PyTuple_Pack(3, added, released, failing);
    Py_XDECREF(added);
    Py_XDECREF(released);
    goto done;
soft: /* a column numpy's path takes (strided, another dtype) */
    if (!PyErr_ExceptionMatches(PyExc_TypeError) && !PyErr_ExceptionMatches(PyExc_ValueError) &&
        !PyErr_ExceptionMatches(PyExc_BufferError) && !PyErr_ExceptionMatches(PyExc_OverflowError))
        goto done;
    PyErr_Clear();
numpy:
    result = Py_NewRef(Py_False);
    goto done;
none:
    result = Py_NewRef(Py_None);
done:
    Py_XDECREF(failing);
    ctx_close(c, &local);
    buf_release(&handles);
    buf_release(&new.arr);
    buf_release(&ahead.arr);
    for (int j = 0; j < 5; j++) buf_release(&out[j]);
    return result;
}

/* decode_commit(rows, new, ahead, context, out_added) -> None
 *
 * The counters of a planned batch, once its blocks are released and taken: per row,
 * history = num_tokens, num_tokens += new, lookahead = ahead, each group's num_blocks raised
 * to ceil((num_tokens + lookahead) / tokens_per_block) and each windowed group's released
 * run extended as the plan did; out_added (int32) gets each item's new blocks summed over the
 * groups.
 */
PyObject *kvcm_decode_commit(PyObject *self, PyObject *args) {
    PyObject *rows_o, *new_o, *ahead_o, *ctx_o, *added_o;
    if (!PyArg_ParseTuple(args, "OOOOO", &rows_o, &new_o, &ahead_o, &ctx_o, &added_o))
        return NULL;
    Ctx local, *c = NULL;
    Buf rows = {0}, added = {0};
    Column new = {0}, ahead = {0};
    PyObject *result = NULL;
    if (!(c = ctx_open(ctx_o, &local, 0)) || buf_get(rows_o, &rows, 8, 0) < 0) goto done;
    Py_ssize_t n = rows.n;
    if (column_get(new_o, n, &new) < 0 || column_get(ahead_o, n, &ahead) < 0 ||
        buf_get(added_o, &added, 4, 1) < 0)
        goto done;
    if (added.n != n) {
        PyErr_SetString(PyExc_ValueError, "decode_commit: out_added needs a cell per row");
        goto done;
    }
    int64_t *tokens = I64P(c->num_tokens);
    for (Py_ssize_t i = 0; i < n; i++) { /* all rows checked before any is written */
        int64_t row = I64P(rows)[i], nt = COL(new, i), la = COL(ahead, i);
        if (row < 0 || row >= c->nrows || nt < 1 || nt > MAX_COUNT || la < 0 || la > MAX_COUNT) {
            PyErr_SetString(PyExc_ValueError, "decode_commit: a row or count out of range");
            goto done;
        }
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        int64_t row = I64P(rows)[i];
        int64_t history = tokens[row], nt = COL(new, i), la = COL(ahead, i);
        int64_t want = (history + nt + la + c->tpb - 1) / c->tpb;
        int64_t sum = 0;
        for (int g = 0; g < c->groups; g++) {
            int64_t *cell = &I64P(c->blocks[g])[row];
            if (want > *cell) {
                sum += want - *cell;
                *cell = want;
            }
            if (c->window[g]) {
                int64_t *end = &I64P(c->released[g])[row];
                *end = released_end(*end, history, c->window[g], c->tpb);
            }
        }
        I64P(c->history)[row] = history;
        tokens[row] = history + nt;
        I64P(c->lookahead)[row] = la;
        I32P(added)[i] = (int32_t)sum;
    }
    result = Py_NewRef(Py_None);
done:
    ctx_close(c, &local);
    buf_release(&rows);
    buf_release(&added);
    buf_release(&new.arr);
    buf_release(&ahead.arr);
    return result;
}

/* live_rows(handles, context, rows) -> bool
 *
 * Whether every handle names a live request and no two name the same row: a step's batch
 * of commits (kvcm.columnar._Run.commits) runs as one only then. Each handle's row (its low
 * 32 bits) goes to rows[i] (int64, at least as long as handles unless there are more
 * handles than rows: False); the scratch array is work space, as in decode_plan. False
 * leaves rows' content unspecified and changes no state.
 *
 * Example: handles [2 << 32 | 5, 1 << 32 | 3] with rows 5 and 3 live under those handles:
 * rows [5 3], True; [2 << 32 | 5, 2 << 32 | 5]: False (row 5 twice); a handle of a freed
 * request (row 5's handle is now 3 << 32 | 5): False. */
PyObject *kvcm_live_rows(PyObject *self, PyObject *args) {
    PyObject *handles_o, *ctx_o, *rows_o;
    if (!PyArg_ParseTuple(args, "OOO", &handles_o, &ctx_o, &rows_o)) return NULL;
    Ctx local, *c = NULL;
    Buf handles = {0}, rows = {0};
    PyObject *result = NULL;
    if (!(c = ctx_open(ctx_o, &local, 0)) || buf_get(handles_o, &handles, 8, 0) < 0 ||
        buf_get(rows_o, &rows, 8, 1) < 0)
        goto done;
    Py_ssize_t n = handles.n;
    int ok = n <= c->nrows; /* more items than rows cannot be distinct */
    if (ok && rows.n < n) {
        PyErr_SetString(PyExc_ValueError, "live_rows: rows shorter than handles");
        goto done;
    }
    const int64_t *h = I64P(handles), *live = I64P(c->row_handle);
    int64_t *out = I64P(rows), *scratch = I64P(c->scratch);
    for (Py_ssize_t i = 0; ok && i < n; i++) {
        int64_t row = h[i] & ROW_MASK;
        ok = row < c->nrows && live[row] == h[i];
        out[i] = row;
        if (ok) scratch[row] = i;
    }
    for (Py_ssize_t i = 0; ok && i < n; i++) ok = scratch[out[i]] == i;
    result = Py_NewRef(ok ? Py_True : Py_False);
done:
    buf_release(&handles);
    buf_release(&rows);
    if (c) ctx_close(c, &local);
    return result;
}

/* decode_take(rows, added, context, pools, cached, items, positions, log, dry=False)
 *     -> tuple | False
 *
 * The new blocks of a planned batch (decode_plan's `added`, and its (item, position) pairs
 * in `items` and `positions`, int64 [groups, cap]), once a window's released cells are
 * back: each layer group in turn takes its slots off the head of its pool group's free
 * queue (tombstones skipped), held once, written at tables[g][rows[item], position], as the
 * coordinator's _take and _set do. Returns, per layer group, whether a slot it took caches
 * a block (`cached`: each pool group's flags), which the caller then evicts. `log`: None,
 * or a writable int64 [sum(added), 4] that receives the table edits, (group, row, position,
 * slot) in the order of the writes, for the device tables (the coordinator's edit log).
 *
 * False, with nothing changed, when the numpy path must take them: an item, row or position
 * out of range, a queue too short or out of shape (never after decode_plan).
 *
 * `dry`: the same checks (but the log's, which it ignores) and the same answer, but nothing
 * written (tables, references, queues, log): the slots that would be taken, their references
 * and the cells they would go to are only read. A rehearsal's (NativeDecode.rehearse): the
 * step after it then finds what its take reads and writes in the caches.
 *
 * Example (one layer group, free queue [7 3 9]): added (2,), items [0 2], positions [1 4],
 * rows [5 8 6]: table[0][5, 1] = 7, table[0][6, 4] = 3; the queue is [9]; returns
 * (False,) when neither 7 nor 3 caches a block; log [[0 5 1 7] [0 6 4 3]]. With dry, the
 * same (False,), and the queue still [7 3 9]. */

/* Where a dry take's reads go, so that the compiler keeps them. */
static volatile int64_t dry_sink;

/* The edit log a decode call writes, or NULL for None: a writable int64 buffer of `n` edits
 * [n, 4] (checked before any write); -1 with an error. */
static int log_get(PyObject *o, Buf *log, Py_ssize_t n, int64_t **out) {
    *out = NULL;
    if (o == Py_None) return 0;
    if (buf_get(o, log, 8, 1) < 0) return -1;
    if (log->n != 4 * n) {
        PyErr_SetString(PyExc_ValueError, "decode: the edit log is not [edits, 4]");
        return -1;
    }
    *out = I64P(*log);
    return 0;
}

PyObject *kvcm_decode_take(PyObject *self, PyObject *args) {
    PyObject *rows_o, *added_o, *ctx_o, *pools_o, *cached_o, *items_o, *pos_o, *log_o;
    int dry = 0;
    if (!PyArg_ParseTuple(args, "OO!OOOOOO|p", &rows_o, &PyTuple_Type, &added_o, &ctx_o,
                          &pools_o, &cached_o, &items_o, &pos_o, &log_o, &dry))
        return NULL;
    Ctx local, *c = NULL;
    Pool p[MAX_GROUPS];
    Buf cached[MAX_GROUPS], rows = {0}, items = {0}, positions = {0}, log = {0};
    int64_t *edit = NULL;
    int got = 0, got_cached = 0;
    int64_t k[MAX_GROUPS] = {0}, need[MAX_GROUPS] = {0};
    int evict[MAX_GROUPS] = {0};
    int32_t *taken = NULL;
    PyObject *result = NULL;
    if (!(c = ctx_open(ctx_o, &local, 1)) || pools_get(pools_o, c, p, &got) < 0 ||
        cached_get(cached_o, c, cached, &got_cached) < 0 || buf_get(rows_o, &rows, 8, 0) < 0 ||
        buf_get(items_o, &items, 8, 0) < 0 || buf_get(pos_o, &positions, 8, 0) < 0)
        goto done;
    if (PyTuple_GET_SIZE(added_o) != c->groups || items.n != positions.n ||
        items.n % c->groups) {
        PyErr_SetString(PyExc_ValueError, "decode_take: a count per layer group, items' shape");
        goto done;
    }
    Py_ssize_t cap = items.n / c->groups, total = 0;
    for (int g = 0; g < c->groups; g++) {
        k[g] = PyLong_AsLongLong(PyTuple_GET_ITEM(added_o, g));
        if (k[g] == -1 && PyErr_Occurred()) goto done;
        if (k[g] < 0 || k[g] > cap) goto numpy;
        for (int64_t j = 0; j < k[g]; j++) {
            int64_t item = I64P(items)[g * cap + j], pos = I64P(positions)[g * cap + j];
            if (item < 0 || item >= rows.n || pos < 0 || pos >= c->width) goto numpy;
            int64_t row = I64P(rows)[item];
            if (row < 0 || row >= c->nrows) goto numpy;
        }
        need[c->group_pool[g]] += k[g];
        total += (Py_ssize_t)k[g];
    }
    if (!dry && log_get(log_o, &log, total, &edit) < 0) goto done;
    /* Everything that can fail comes before the first write: the spans, the queues' new
     * counters, the slots popped into a buffer (pool_pop reads the ring only), the result. */
    for (int q = 0; q < c->pools; q++) {
        if (!need[q]) continue;
        int64_t used = need[q] <= p[q].count ? pool_span(&p[q], need[q], c->refs[q].n) : -1;
        if (used < 0) goto numpy;
        if (pool_stage(&p[q], p[q].head + used, p[q].len - used, p[q].count - need[q]) < 0)
            goto done;
    }
    if (total && !(taken = PyMem_Malloc((size_t)total * sizeof *taken))) {
        PyErr_NoMemory();
        goto done;
    }
    Py_ssize_t off = 0;
    for (int g = 0; g < c->groups; g++) {
        int q = c->group_pool[g];
        pool_pop(&p[q], k[g], taken + off);
        for (int64_t j = 0; j < k[g]; j++) evict[g] |= ((const uint8_t *)cached[q].p)[taken[off + j]];
        off += (Py_ssize_t)k[g];
    }
    if (!(result = PyTuple_New(c->groups))) goto done;
    for (int g = 0; g < c->groups; g++)
        PyTuple_SET_ITEM(result, g, Py_NewRef(evict[g] ? Py_True : Py_False));
    if (dry) {
        int64_t sum = 0;
        off = 0;
        for (int g = 0; g < c->groups; g++) {
            const int32_t *refs = I32P(c->refs[c->group_pool[g]]);
            for (int64_t j = 0; j < k[g]; j++) {
                int64_t row = I64P(rows)[I64P(items)[g * cap + j]];
                int64_t pos = I64P(positions)[g * cap + j];
                sum += I32P(c->tables)[(g * c->nrows + row) * c->width + pos];
                sum += refs[taken[off + j]];
            }
            off += (Py_ssize_t)k[g];
        }
        dry_sink = sum;
        goto done;
    }
    off = 0;
    for (int g = 0; g < c->groups; g++) {
        int32_t *refs = I32P(c->refs[c->group_pool[g]]);
        for (int64_t j = 0; j < k[g]; j++) {
            int64_t row = I64P(rows)[I64P(items)[g * cap + j]], pos = I64P(positions)[g * cap + j];
            I32P(c->tables)[(g * c->nrows + row) * c->width + pos] = taken[off + j];
            refs[taken[off + j]] = 1;
            if (edit) {
                int64_t *e = edit + 4 * (off + j);
                e[0] = g, e[1] = row, e[2] = pos, e[3] = taken[off + j];
            }
        }
        off += (Py_ssize_t)k[g];
    }
    if (pools_commit(p, c->pools) < 0) Py_CLEAR(result);
    goto done;
numpy:
    result = Py_NewRef(Py_False);
done:
    buf_release(&log);
    PyMem_Free(taken);
    for (int q = 0; q < got_cached; q++) buf_release(&cached[q]);
    buf_release(&rows);
    buf_release(&items);
    buf_release(&positions);
    pools_release(p, got);
    if (c) ctx_close(c, &local);
    return result;
}

/* decode_release(rows, released, context, pools, items, positions, log) -> True | False
 *
 * A planned batch's window releases (decode_plan's `released`, and its (item, position)
 * pairs in `items` and `positions`, int64 [groups, cap]), before its new blocks are taken:
 * each layer group in turn drops one reference from the slot of each released cell, puts
 * the slots nobody holds any more at the tail of its pool group's free queue, each once, in
 * the order of their first cell, and empties the cells, as the coordinator's unref and
 * set_cells do. The caller logs the table edits.
 *
 * False, with nothing changed, when the numpy path must release them: an item, row or
 * position out of range, a cell that holds no page or whose slot too few hold, a queue that
 * might need compacting first.
 *
 * Example (one layer group, empty -1, free queue [4]): released (2,), items [0 1],
 * positions [0 0], rows [5 8]; tables[0][5, 0] = 7 (held once), tables[0][8, 0] = 3 (held
 * twice): the queue becomes [4 7], 3 is held once, both cells are -1. */
PyObject *kvcm_decode_release(PyObject *self, PyObject *args) {
    PyObject *rows_o, *released_o, *ctx_o, *pools_o, *items_o, *pos_o, *log_o;
    if (!PyArg_ParseTuple(args, "OO!OOOOO", &rows_o, &PyTuple_Type, &released_o, &ctx_o,
                          &pools_o, &items_o, &pos_o, &log_o))
        return NULL;
    Ctx local, *c = NULL;
    Pool p[MAX_GROUPS];
    Buf rows = {0}, items = {0}, positions = {0}, log = {0};
    int64_t *edit = NULL;
    int got = 0;
    int64_t k[MAX_GROUPS] = {0}, cells_of[MAX_GROUPS] = {0};
    PyObject *result = NULL;
    if (!(c = ctx_open(ctx_o, &local, 1)) || pools_get(pools_o, c, p, &got) < 0 ||
        buf_get(rows_o, &rows, 8, 0) < 0 || buf_get(items_o, &items, 8, 0) < 0 ||
        buf_get(pos_o, &positions, 8, 0) < 0)
        goto done;
    if (PyTuple_GET_SIZE(released_o) != c->groups || items.n != positions.n ||
        items.n % c->groups) {
        PyErr_SetString(PyExc_ValueError, "decode_release: a count per layer group, items' shape");
        goto done;
    }
    Py_ssize_t cap = items.n / c->groups;
    const int64_t *it = I64P(items), *at = I64P(positions), *rw = I64P(rows);
    int32_t *tables = I32P(c->tables);
#define CELL(g, j) (tables + ((g) * c->nrows + rw[it[(g) * cap + (j)]]) * c->width + at[(g) * cap + (j)])
    for (int g = 0; g < c->groups; g++) {
        k[g] = PyLong_AsLongLong(PyTuple_GET_ITEM(released_o, g));
        if (k[g] == -1 && PyErr_Occurred()) goto done;
        if (k[g] < 0 || k[g] > cap) goto numpy;
        int q = c->group_pool[g];
        for (int64_t j = 0; j < k[g]; j++) {
            int64_t item = it[g * cap + j], pos = at[g * cap + j];
            if (item < 0 || item >= rows.n || pos < 0 || pos >= c->width) goto numpy;
            if (rw[item] < 0 || rw[item] >= c->nrows) goto numpy;
            int64_t slot = *CELL(g, j);
            if (slot <= c->empty || slot >= c->refs[q].n || slot >= p[q].pos.n) goto numpy;
        }
        cells_of[q] += k[g];
    }
    for (int q = 0; q < c->pools; q++) /* BlockPool.push might compact first */
        if (cells_of[q] && p[q].len + cells_of[q] > p[q].ring.n) goto numpy;
    Py_ssize_t logged = 0;
    for (int g = 0; g < c->groups; g++) logged += (Py_ssize_t)k[g];
    if (log_get(log_o, &log, logged, &edit) < 0) goto done;
    /* Everything that can fail comes before the first write: the count of the slots that
     * come back (each pushed once), the queues' new counters, then the result. The count
     * drops as the writes will, group after group, keeping the drops from one group to the
     * next (two groups of one pool group may name one slot); a slot that reaches 0 counts
     * once (marked -1, then 0 again); then every drop is put back. A slot held by fewer
     * cells than name it stops the count: the numpy path's to handle. */
    int64_t back[MAX_GROUPS] = {0}, dropped = 0;
    int bad = 0;
    for (int g = 0; g < c->groups && !bad; g++) {
        int q = c->group_pool[g];
        int32_t *refs = I32P(c->refs[q]);
        for (int64_t j = 0; j < k[g]; j++, dropped++) {
            int32_t *r = &refs[*CELL(g, j)];
            if (*r < 1) {
                bad = 1;
                break;
            }
            --*r;
        }
        if (bad) break;
        for (int64_t j = 0; j < k[g]; j++) {
            int32_t *r = &refs[*CELL(g, j)];
            if (*r == 0) {
                back[q]++;
                *r = -1;
            }
        }
        for (int64_t j = 0; j < k[g]; j++)
            if (refs[*CELL(g, j)] == -1) refs[*CELL(g, j)] = 0;
    }
    int64_t undone = 0;
    for (int g = 0; g < c->groups && undone < dropped; g++) {
        int32_t *refs = I32P(c->refs[c->group_pool[g]]);
        for (int64_t j = 0; j < k[g] && undone < dropped; j++, undone++) refs[*CELL(g, j)]++;
    }
    if (bad) goto numpy;
    for (int q = 0; q < c->pools; q++)
        if (back[q] && pool_stage(&p[q], p[q].head, p[q].len + back[q], p[q].count + back[q]) < 0)
            goto done;
    result = Py_NewRef(Py_True);
    for (int g = 0; g < c->groups; g++) {
        int q = c->group_pool[g];
        int32_t *refs = I32P(c->refs[q]);
        for (int64_t j = 0; j < k[g]; j++) refs[*CELL(g, j)]--;
        for (int64_t j = 0; j < k[g]; j++) { /* in the order of each slot's first cell */
            int32_t slot = *CELL(g, j);
            if (refs[slot] == 0) {
                pool_push(&p[q], slot);
                refs[slot] = -1;
            }
        }
        for (int64_t j = 0; j < k[g]; j++) {
            int32_t *cell = CELL(g, j);
            if (*cell > c->empty && refs[*cell] == -1) refs[*cell] = 0; /* a cell named twice */
            *cell = (int32_t)c->empty;
            if (edit) {
                edit[0] = g, edit[1] = rw[it[g * cap + j]], edit[2] = at[g * cap + j];
                edit[3] = c->empty;
                edit += 4;
            }
        }
    }
#undef CELL
    if (pools_commit(p, c->pools) < 0) Py_CLEAR(result);
    goto done;
numpy:
    result = Py_NewRef(Py_False);
done:
    buf_release(&log);
    buf_release(&rows);
    buf_release(&items);
    buf_release(&positions);
    pools_release(p, got);
    if (c) ctx_close(c, &local);
    return result;
}

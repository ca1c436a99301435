/* Slot mappings of a step's tokens: on the CPU's page tables (kvcm.views.TablesAndViews
 * map_tokens), or packed for the fused CUDA launch that maps them on the device's
 * (step_launch). */
#include "context.h"

/* A step's mapped items, from one of two sources: explicit arrays (rows, starts, counts:
 * item i is positions [starts[i], starts[i] + counts[i]) of table row rows[i]), or a decode
 * batch's handles (row = handle & ROW_MASK, the last `each` positions of the row's
 * `lengths`). */
typedef struct {
    Buf a, b, c; /* rows, starts, counts; or handles, lengths (c unused) */
    int decode;
    int64_t each;
    Py_ssize_t n, total;
} Items;

static void items_release(Items *it) {
    buf_release(&it->a);
    buf_release(&it->b);
    buf_release(&it->c);
}

static inline void item_at(const Items *it, Py_ssize_t i, int64_t *row, int64_t *start,
                           int64_t *count) {
    if (it->decode) {
        *row = I64P(it->a)[i] & ROW_MASK;
        *count = it->each;
        *start = I64P(it->b)[*row] - it->each;
    } else {
        *row = I64P(it->a)[i];
        *start = I64P(it->b)[i];
        *count = I64P(it->c)[i];
    }
}

/* Reads `spec`: a tuple (rows, starts, counts) or (handles, lengths, each), and checks every
 * item against tables of `table_rows` rows and `cols` blocks of `tpb` tokens, each range
 * checked without overflow (0 <= start, 0 <= count <= cols * tpb - start) and the total
 * bounded; 0, or -1 with ValueError (a row or a block outside the tables, named after
 * `what`) or TypeError, nothing kept. */
static int items_get(PyObject *spec, Items *it, Py_ssize_t table_rows, Py_ssize_t cols,
                     int64_t tpb, const char *what) {
    memset(it, 0, sizeof(*it));
    if (!PyTuple_Check(spec) || PyTuple_GET_SIZE(spec) != 3) {
        PyErr_Format(PyExc_TypeError, "%s: items are (rows, starts, counts) or (handles, "
                     "lengths, n)", what);
        return -1;
    }
    PyObject *third = PyTuple_GET_ITEM(spec, 2);
    it->decode = PyLong_Check(third);
    if (buf_get(PyTuple_GET_ITEM(spec, 0), &it->a, 8, 0) < 0 ||
        buf_get(PyTuple_GET_ITEM(spec, 1), &it->b, 8, 0) < 0)
        goto fail;
    it->n = it->a.n;
    if (it->decode) {
        it->each = PyLong_AsLongLong(third);
        if (it->each == -1 && PyErr_Occurred()) goto fail;
    } else if (buf_get(third, &it->c, 8, 0) < 0) {
        goto fail;
    } else if (it->b.n != it->n || it->c.n != it->n) {
        PyErr_Format(PyExc_ValueError, "%s: inconsistent shapes", what);
        goto fail;
    }
    if (tpb < 1 || cols < 1 || table_rows < 1 || tpb > INT64_MAX / cols || it->each < 0) {
        PyErr_Format(PyExc_ValueError, "%s: inconsistent shapes", what);
        goto fail;
    }
    const int64_t limit = (int64_t)cols * tpb; /* a row's positions: [0, limit) */
    Py_ssize_t total = 0;
    for (Py_ssize_t i = 0; i < it->n; i++) {
        int64_t row, start, count;
        if (it->decode) { /* the row and its length first: the start is length - each */
            row = I64P(it->a)[i] & ROW_MASK;
            if (row >= table_rows || row >= it->b.n) goto outside;
            int64_t length = I64P(it->b)[row];
            if (length < it->each || length > limit) goto outside;
        }
        item_at(it, i, &row, &start, &count);
        if (row < 0 || row >= table_rows || start < 0 || start > limit || count < 0 ||
            count > limit - start || count > PY_SSIZE_T_MAX - total)
            goto outside;
        total += (Py_ssize_t)count;
    }
    it->total = total;
    return 0;
outside:
    PyErr_Format(PyExc_ValueError, "%s: a row or block outside the tables", what);
fail:
    items_release(it);
    return -1;
}

/* map_slots(tables, table_rows, cols, items, tpb, min_live, out)
 *
 * tables: int32 [G, table_rows, cols] (the CPU manager's own arrays); items: as items_get
 * reads them; out: a writable int64 [G, T] with T the items' tokens (items after items, each
 * group a row of out): slot x tokens_per_block + position % tokens_per_block, or -1 where
 * the entry is below min_live (no page; with the null page 1). One call for what numpy does
 * in about ten (each a few microseconds cold, after a model pass). ValueError, with nothing
 * written, for a row or a block outside the tables or an out of the wrong size.
 *
 * Example (tokens_per_block 4, one group, row 3 = [5, 9, ...]): items ([3], [6], [2]) ->
 * positions 6, 7 in block 1 (slot 9): [38, 39]. A decode batch: items ([h], lengths, 1)
 * with h's row 3 at 8 tokens -> position 7: [39]. */
PyObject *kvcm_map_slots(PyObject *self, PyObject *args) {
    PyObject *tables_obj, *spec, *out_obj;
    Py_ssize_t table_rows, cols, tpb, min_live;
    if (!PyArg_ParseTuple(args, "OnnOnnO", &tables_obj, &table_rows, &cols, &spec, &tpb,
                          &min_live, &out_obj))
        return NULL;
    Buf tables = {0}, out = {0};
    Items it;
    if (items_get(spec, &it, table_rows, cols, tpb, "map_slots") < 0) return NULL;
    PyObject *result = NULL;
    if (buf_get(tables_obj, &tables, 4, 0) < 0 || buf_get(out_obj, &out, 8, 1) < 0) goto done;
    if (tables.n % (table_rows * cols)) {
        PyErr_SetString(PyExc_ValueError, "map_slots: inconsistent shapes");
        goto done;
    }
    Py_ssize_t groups = tables.n / (table_rows * cols), total = it.total;
    if (out.n != groups * total) {
        PyErr_SetString(PyExc_ValueError, "map_slots: out is not [groups, tokens]");
        goto done;
    }
    const int32_t *t = tables.p;
    int64_t *o = out.p;
    for (Py_ssize_t g = 0; g < groups; g++) {
        const int32_t *tg = t + g * table_rows * cols;
        int64_t *og = o + g * total;
        Py_ssize_t k = 0;
        for (Py_ssize_t i = 0; i < it.n; i++) {
            int64_t r, s, c;
            item_at(&it, i, &r, &s, &c);
            const int32_t *row = tg + r * cols;
            for (int64_t p = s, end = s + c; p < end; p++) {
                int64_t slot = row[p / tpb];
                og[k++] = slot >= min_live ? slot * tpb + p % tpb : -1;
            }
        }
    }
    result = Py_NewRef(Py_None);
done:
    buf_release(&tables);
    buf_release(&out);
    items_release(&it);
    return result;
}

/* The driver entry points step_launch calls (cuLaunchKernel, cuEventRecord,
 * cuEventSynchronize), by address: the caller resolves them where a CUDA driver is loaded; a
 * test passes its own. */
typedef int (*launch_fn)(void *f, unsigned gx, unsigned gy, unsigned gz, unsigned bx,
                         unsigned by, unsigned bz, unsigned shared, void *stream,
                         void **params, void **extra);
typedef int (*record_fn)(void *event, void *stream);
typedef int (*sync_fn)(void *event);

enum { C_LAUNCH, C_RECORD, C_SYNC, C_KERNEL, C_TABLES, C_GROUPS, C_ROWS, C_COLS, C_TPB,
       C_MIN_LIVE, C_THREADS, C_STAGED, C_SIZE };
#define KERNEL_ARGS 16

/* step_launch(consts, address, capacity, items, edits, out, pad_to, first_group,
 *             num_groups, stream, event, wait[, step_event])
 *
 * The fused step kernel (kvcm_kernels.step_tables, apply_edits_and_map_slots) launched
 * with its inputs packed in one pass: rows [n], query_start_loc [n + 1], positions [total],
 * edits [E, 4], int64 back to back at host `address` (pinned, `capacity` int64), then one
 * cuLaunchKernel on `stream` and, where `event` is not 0, one cuEventRecord of it after the
 * launch (the staging buffer's fence). Where `wait` is not 0 the buffer is written only
 * after cuEventSynchronize of it (the fence of the buffer's last launch, four steps back in
 * the staging ring, so almost always already done: the driver's check costs a fraction of
 * the Python runtime call it replaces). consts: int64 [C_SIZE], fixed for a manager's
 * tables: the three driver entry points, the kernel, the tables' device address and shape
 * (groups, rows, blocks), tokens_per_block, min_live, the block's threads and the staged
 * query_start_loc limit.
 * out: the device address of int64 [num_groups, pad_to]. What kvcm_kernels' StepLaunch
 * does in about a dozen Python calls, in one (docs/native.md). num_groups 0 with no items
 * and pad_to 0: the edits alone (a stream-ordered step's, whose mapping came from the host).
 * step_event (optional, 0: none): one more cuEventRecord after `event`'s, the interprocess
 * step event an engine's stream waits on (kvcm.step_order).
 *
 * Example: items ([3, 0], [6, 0], [1, 2]) and one edit at A: rows at A, query_start_loc
 * [0, 1, 3] at A + 16, positions [6, 0, 1] at A + 40, the edit at A + 64. Returns None;
 * ValueError (bad items, too little room, pad_to below the tokens) with nothing written or
 * launched (also groups outside the tables, a count past the kernel's int arguments);
 * RuntimeError with the driver's code if the wait, the launch or the record fails. */
PyObject *kvcm_step_launch(PyObject *self, PyObject *args) {
    PyObject *consts_obj, *spec, *edits_obj;
    unsigned long long address, out_ptr, stream, event, wait, step_event = 0;
    Py_ssize_t capacity, pad_to, first_group, num_groups;
    if (!PyArg_ParseTuple(args, "OKnOOKnnnKKK|K", &consts_obj, &address, &capacity, &spec,
                          &edits_obj, &out_ptr, &pad_to, &first_group, &num_groups, &stream,
                          &event, &wait, &step_event))
        return NULL;
    Buf consts = {0}, edits = {0};
    Items it = {0};
    PyObject *result = NULL;
    if (buf_get(consts_obj, &consts, 8, 0) < 0) return NULL;
    if (consts.n != C_SIZE) {
        PyErr_SetString(PyExc_ValueError, "step_launch: consts of the wrong size");
        buf_release(&consts);
        return NULL;
    }
    const int64_t *k = consts.p;
    if (items_get(spec, &it, k[C_ROWS], k[C_COLS], k[C_TPB], "step_launch") < 0) {
        buf_release(&consts);
        return NULL;
    }
    if (buf_get(edits_obj, &edits, 8, 0) < 0) goto done;
    Py_ssize_t n = it.n, total = it.total, e = edits.n / 4;
    /* every count fits the kernel's int arguments, so the packed size cannot overflow */
    int fits = !(edits.n % 4) && n < INT32_MAX && total <= INT32_MAX && e <= INT32_MAX &&
               pad_to <= INT32_MAX && total <= pad_to &&
               (num_groups >= 1 || (num_groups == 0 && !n && !pad_to)) && first_group >= 0 &&
               first_group <= k[C_GROUPS] - num_groups && address;
    Py_ssize_t size = fits ? n + (n + 1) + total + edits.n : 0;
    if (!fits || size > capacity) {
        PyErr_SetString(PyExc_ValueError, "step_launch: inconsistent sizes");
        goto done;
    }
    int code = 0;
    if (wait) { /* the buffer's last reader first; the GIL released in case it is not done */
        sync_fn sync = (sync_fn)(uintptr_t)k[C_SYNC];
        Py_BEGIN_ALLOW_THREADS
        code = sync((void *)(uintptr_t)wait);
        Py_END_ALLOW_THREADS
        if (code) {
            PyErr_Format(PyExc_RuntimeError,
                         "step_launch: cuEventSynchronize failed (CUresult %d)", code);
            goto done;
        }
    }
    int64_t *rows = (int64_t *)(uintptr_t)address, *qsl = rows + n, *pos = qsl + n + 1;
    qsl[0] = 0;
    Py_ssize_t at = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        int64_t r, s, c;
        item_at(&it, i, &r, &s, &c);
        rows[i] = r;
        for (int64_t j = 0; j < c; j++) pos[at++] = s + j;
        qsl[i + 1] = at;
    }
    if (e) memcpy(pos + total, edits.p, (size_t)edits.n * 8);
    int staged = n + 1 <= k[C_STAGED];
    int64_t a[KERNEL_ARGS] = {
        k[C_TABLES], (int64_t)(uintptr_t)(pos + total), e, (int64_t)(uintptr_t)rows,
        (int64_t)(uintptr_t)qsl, (int64_t)(uintptr_t)pos, (int64_t)out_ptr, n, pad_to,
        first_group, num_groups, k[C_ROWS], k[C_COLS], k[C_TPB], k[C_MIN_LIVE], staged};
    void *params[KERNEL_ARGS]; /* an int parameter reads its slot's low four bytes */
    for (int i = 0; i < KERNEL_ARGS; i++) params[i] = &a[i];
    unsigned shared = staged ? (unsigned)(8 * (n + 1)) : 0;
    launch_fn launch = (launch_fn)(uintptr_t)k[C_LAUNCH];
    code = launch((void *)(uintptr_t)k[C_KERNEL], 1, 1, 1, (unsigned)k[C_THREADS], 1, 1, shared,
                  (void *)(uintptr_t)stream, params, NULL);
    if (code) {
        PyErr_Format(PyExc_RuntimeError, "step_launch: cuLaunchKernel failed (CUresult %d)",
                     code);
        goto done;
    }
    record_fn record = (record_fn)(uintptr_t)k[C_RECORD];
    unsigned long long events[2] = {event, step_event};
    for (int i = 0; i < 2; i++) {
        if (!events[i]) continue;
        code = record((void *)(uintptr_t)events[i], (void *)(uintptr_t)stream);
        if (code) {
            PyErr_Format(PyExc_RuntimeError, "step_launch: cuEventRecord failed (CUresult %d)",
                         code);
            goto done;
        }
    }
    result = Py_NewRef(Py_None);
done:
    buf_release(&consts);
    buf_release(&edits);
    items_release(&it);
    return result;
}

/* Slot mappings of host page tables (kvcm.views.TablesAndViews.map_tokens on the CPU). */
#include "context.h"

/* map_slots(tables, table_rows, cols, rows, starts, counts, tokens_per_block, min_live, out)
 *
 * tables: int32 [G, table_rows, cols] (the CPU manager's own arrays); rows, starts, counts:
 * int64 [n]: item i maps positions [starts[i], starts[i] + counts[i]) of table row rows[i];
 * out: a writable int64 [G, T] with T = sum(counts) (items after items, each group a row of
 * out): slot x tokens_per_block + position % tokens_per_block, or -1 where the entry is below
 * min_live (no page; with the null page 1). One call for what numpy does in about ten (each
 * a few microseconds cold, after a model pass). ValueError, with nothing written, for a row
 * or a block outside the tables or an out of the wrong size.
 *
 * Example (tokens_per_block 4, one group, row 3 = [5, 9, ...]): rows [3], starts [6],
 * counts [2] -> positions 6, 7 in block 1 (slot 9): [38, 39]. */
PyObject *kvcm_map_slots(PyObject *self, PyObject *args) {
    PyObject *tables_obj, *rows_obj, *starts_obj, *counts_obj, *out_obj;
    Py_ssize_t table_rows, cols, tpb, min_live;
    if (!PyArg_ParseTuple(args, "OnnOOOnnO", &tables_obj, &table_rows, &cols, &rows_obj,
                          &starts_obj, &counts_obj, &tpb, &min_live, &out_obj))
        return NULL;
    Buf tables = {0}, rows = {0}, starts = {0}, counts = {0}, out = {0};
    PyObject *result = NULL;
    if (buf_get(tables_obj, &tables, 4, 0) < 0 || buf_get(rows_obj, &rows, 8, 0) < 0 ||
        buf_get(starts_obj, &starts, 8, 0) < 0 || buf_get(counts_obj, &counts, 8, 0) < 0 ||
        buf_get(out_obj, &out, 8, 1) < 0)
        goto done;
    Py_ssize_t n = rows.n;
    if (tpb < 1 || table_rows < 1 || cols < 1 || tables.n % (table_rows * cols) ||
        starts.n != n || counts.n != n) {
        PyErr_SetString(PyExc_ValueError, "map_slots: inconsistent shapes");
        goto done;
    }
    Py_ssize_t groups = tables.n / (table_rows * cols);
    const int64_t *r = rows.p, *s = starts.p, *c = counts.p;
    Py_ssize_t total = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        if (r[i] < 0 || r[i] >= table_rows || s[i] < 0 || c[i] < 0 ||
            (c[i] && (s[i] + c[i] - 1) / tpb >= cols)) {
            PyErr_SetString(PyExc_ValueError, "map_slots: a row or block outside the tables");
            goto done;
        }
        total += c[i];
    }
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
        for (Py_ssize_t i = 0; i < n; i++) {
            const int32_t *row = tg + r[i] * cols;
            for (int64_t p = s[i], end = s[i] + c[i]; p < end; p++) {
                int64_t slot = row[p / tpb];
                og[k++] = slot >= min_live ? slot * tpb + p % tpb : -1;
            }
        }
    }
    result = Py_NewRef(Py_None);
done:
    buf_release(&tables);
    buf_release(&rows);
    buf_release(&starts);
    buf_release(&counts);
    buf_release(&out);
    return result;
}

/* A step's allocate in one call (kvcm.allocation.start_op with the C core).
 *
 * What kvcm.allocation.start does for the usual request (an id, a token count, lookahead,
 * maybe its prompt's ids; no LoRA, salt, multimodal items or caller-given keys): the prompt
 * packed and keyed, the longest cached prefix placed and the blocks past it taken (hits.c),
 * then the request's row, handle, committed bytes, prefix state and retry record. In Python
 * that bookkeeping was some twenty calls, about 6 us of every allocate. */
#include "context.h"

/* The request table's attributes an allocate reads and writes (kvcm.request_table), then the
   prefix cache's. */
enum { A_FIRST, A_FREE_ROWS, A_ROWS, A_IDS, A_TOKENS, A_PREFIX, A_SERIAL, A_HANDLE,
       A_COMMITTED, A_HITS, A_INDEX, A_STATS, A_QUERIES, A_QUERY_TOKENS, A_HIT_TOKENS,
       A_COUNT };
static const char *const ATTR_TEXT[A_COUNT] = {
    "first", "free_rows", "rows", "ids", "tokens", "prefix", "serial", "handle",
    "committed", "hits", "index", "stats", "queries", "query_tokens", "hit_tokens"};
static PyObject *ATTR[A_COUNT];
/* An allocate op's keys (kvcm.columnar_parse fills every one). */
enum { K_ID, K_TOKENS, K_IDS, K_LOOKAHEAD, K_LORA, K_SALT, K_MULTIMODAL, K_KEYS, K_COUNT };
static const char *const KEY_TEXT[K_COUNT] = {
    "request_id", "num_tokens", "token_ids", "lookahead", "lora_id", "cache_salt",
    "multimodal", "block_keys"};
static PyObject *KEY[K_COUNT];

/* The fields of kvcm.publish.PrefixState and kvcm.allocation.FirstAllocation, in order. */
enum { F_STATE = 7, F_FIRST = 6 };
static const char *const STATE_TEXT[F_STATE] = {"root", "lora_id", "has_salt", "multimodal",
                                                "keys", "prompt", "prompt_keys"};
static const char *const FIRST_TEXT[F_FIRST] = {"args", "request_id", "row", "handle",
                                                "hit_tokens", "state_slot"};
static PyObject *STATE_FIELD[F_STATE], *FIRST_FIELD[F_FIRST];

static int names_init(void) {
    for (int i = 0; i < A_COUNT; i++)
        if (!ATTR[i] && !(ATTR[i] = PyUnicode_InternFromString(ATTR_TEXT[i]))) return -1;
    for (int i = 0; i < K_COUNT; i++)
        if (!KEY[i] && !(KEY[i] = PyUnicode_InternFromString(KEY_TEXT[i]))) return -1;
    for (int i = 0; i < F_STATE; i++)
        if (!STATE_FIELD[i] && !(STATE_FIELD[i] = PyUnicode_InternFromString(STATE_TEXT[i])))
            return -1;
    for (int i = 0; i < F_FIRST; i++)
        if (!FIRST_FIELD[i] && !(FIRST_FIELD[i] = PyUnicode_InternFromString(FIRST_TEXT[i])))
            return -1;
    return 0;
}

/* An instance of the slotted dataclass `cls` with its `n` fields set to `values`, as its
 * __init__ sets them but without running it: object.__new__, then each slot through its
 * descriptor (object.__setattr__, which a frozen dataclass's __init__ calls too). About
 * 0.3 us against 0.5-1 for the call. Both classes have no defaults and no __post_init__;
 * tests/test_native_allocate.py compares what this makes with what Python's path makes. */
static PyObject *made(PyObject *cls, PyObject *const *fields, PyObject *const *values, int n) {
    if (!PyType_Check(cls) || !((PyTypeObject *)cls)->tp_new) {
        PyErr_SetString(PyExc_TypeError, "allocate_one: classes must be types with instances");
        return NULL;
    }
    PyTypeObject *type = (PyTypeObject *)cls;
    PyObject *empty = PyTuple_New(0);
    PyObject *obj = empty ? type->tp_new(type, empty, NULL) : NULL;
    Py_XDECREF(empty);
    for (int i = 0; obj && i < n; i++)
        if (PyObject_GenericSetAttr(obj, fields[i], values[i]) < 0) Py_CLEAR(obj);
    return obj;
}

/* The request table's parts (new references), each checked for its type. */
typedef struct {
    PyObject *first, *free_rows, *rows, *ids, *tokens, *prefix;
    Buf serial, handle, committed, hits;
} Book;

static void book_release(Book *k) {
    Py_CLEAR(k->first);
    Py_CLEAR(k->free_rows);
    Py_CLEAR(k->rows);
    Py_CLEAR(k->ids);
    Py_CLEAR(k->tokens);
    Py_CLEAR(k->prefix);
    buf_release(&k->serial);
    buf_release(&k->handle);
    buf_release(&k->committed);
    buf_release(&k->hits);
}

/* 0, or -1 with an error (a table out of shape: never from kvcm.request_table). */
static int book_get(PyObject *m, const Ctx *c, Book *k) {
    memset(k, 0, sizeof *k);
    PyObject *arr[4] = {NULL};
    int bad = !(k->first = PyObject_GetAttr(m, ATTR[A_FIRST])) ||
              !(k->free_rows = PyObject_GetAttr(m, ATTR[A_FREE_ROWS])) ||
              !(k->rows = PyObject_GetAttr(m, ATTR[A_ROWS])) ||
              !(k->ids = PyObject_GetAttr(m, ATTR[A_IDS])) ||
              !(k->tokens = PyObject_GetAttr(m, ATTR[A_TOKENS])) ||
              !(k->prefix = PyObject_GetAttr(m, ATTR[A_PREFIX]));
    for (int i = 0; i < 4 && !bad; i++) bad = !(arr[i] = PyObject_GetAttr(m, ATTR[A_SERIAL + i]));
    if (!bad)
        bad = buf_get(arr[0], &k->serial, 8, 1) < 0 || buf_get(arr[1], &k->handle, 8, 1) < 0 ||
              buf_get(arr[2], &k->committed, 8, 1) < 0 || buf_get(arr[3], &k->hits, 8, 1) < 0;
    for (int i = 0; i < 4; i++) Py_XDECREF(arr[i]);
    if (bad) return -1;
    if (!PyDict_CheckExact(k->first) || !PyList_CheckExact(k->free_rows) ||
        !PyDict_CheckExact(k->rows) || !PyList_CheckExact(k->ids) ||
        PyList_GET_SIZE(k->ids) != c->nrows || !PyDict_CheckExact(k->tokens) ||
        !PyDict_CheckExact(k->prefix) || k->serial.n != c->nrows || k->handle.n != c->nrows ||
        k->committed.n != c->nrows || k->hits.n != c->nrows) {
        PyErr_SetString(PyExc_ValueError, "allocate_one: a request table out of shape");
        return -1;
    }
    return 0;
}

/* op[key] (borrowed), or NULL if it is absent. */
static PyObject *field(PyObject *op, int key) { return PyDict_GetItemWithError(op, KEY[key]); }

/* An exact int in [lo, MAX_COUNT] into *out; 0 if it is not one (or absent). */
static int count_of(PyObject *v, long long lo, long long *out) {
    if (!v || !PyLong_CheckExact(v)) return 0;
    int overflow;
    *out = PyLong_AsLongLongAndOverflow(v, &overflow);
    return !overflow && *out >= lo && *out <= MAX_COUNT;
}

/* obj.name + by (the prefix cache's stats, set after the writes), or NULL with an error. */
static PyObject *sum_of(PyObject *obj, PyObject *name, long long by) {
    PyObject *old = PyObject_GetAttr(obj, name);
    if (!old) return NULL;
    PyObject *step = PyLong_FromLongLong(by);
    PyObject *sum = step ? PyNumber_Add(old, step) : NULL;
    Py_DECREF(old);
    Py_XDECREF(step);
    return sum;
}

/* allocate_one(op, m, cache, context, pools, sinks, cached, classes, root, max_seq_len,
 *              prompts[, keyed]) -> (first, hit, added, evict) | None
 *
 * `op`: an allocate of kvcm.columnar_parse (a dict with every field); `m`: the request table,
 * `cache` the prefix cache; `classes`: (PrefixState, FirstAllocation); `root`: the key of
 * requests without LoRA or salt; `prompts`: whether prompts are keyed and hit here (the
 * SHA extensions, and every layer group full attention and reusable); `keyed`: the prompt's
 * (bytes, keys) as prompt_keys made them, or None (then they are made here). Starts the request
 * in the last free row as kvcm.allocation.start does: returns its FirstAllocation, the
 * hit in blocks, the blocks each layer group added past it and whether a slot taken caches
 * a block (the caller logs the table edits and evicts: kvcm.native_rows.placed).
 *
 * None, with nothing changed, when Python must run the op: another field set, a value not
 * of the usual type or range (Python names the error), a retry or a duplicate id, no free
 * row, a prompt here without `prompts`, a request that does not fit (hits.c's None or
 * False). Every object is made before the first write (if one cannot be, the tombstones go
 * back and nothing changed); after it, only setting the queues' counters and the stats and
 * the list and dict inserts can fail, without memory (Python's path is no better there).
 *
 * Example (tokens_per_block 4, root r, an empty cache, a new manager: free rows [.., 0]):
 * {"request_id": "a", "num_tokens": 9, "token_ids": [1..9], "lookahead": 3, ...None} keys
 * the 2 full blocks (SHA-256 of r || ids 1-4, then of that key || ids 5-8), finds no hit,
 * takes 3 blocks for 12 tokens, and gives "a" row 0 with handle 1 << 32 | 0 (the row's
 * first request); returns (FirstAllocation(args=(9, 3, ids' bytes, None, None, ()), "a",
 * 0, 1 << 32, 0, -1), 0, (3,), False). After "a" commits its 9 ids, the same prompt for
 * "b" hits both blocks (8 tokens) and takes one new block (tests/test_native_allocate.py). */
PyObject *kvcm_allocate_one(PyObject *self, PyObject *args) {
    PyObject *op, *m, *cache, *ctx_o, *pools_o, *sinks_o, *cached_o, *classes, *root;
    PyObject *keyed = Py_None;
    long long max_seq_len;
    int prompts;
    if (!PyArg_ParseTuple(args, "O!OOOOOOO!SLp|O", &PyDict_Type, &op, &m, &cache, &ctx_o,
                          &pools_o, &sinks_o, &cached_o, &PyTuple_Type, &classes, &root,
                          &max_seq_len, &prompts, &keyed))
        return NULL;
    if (names_init() < 0) return NULL;
    if (PyTuple_GET_SIZE(classes) != 2 || PyBytes_GET_SIZE(root) != 32) {
        PyErr_SetString(PyExc_ValueError, "allocate_one: (PrefixState, FirstAllocation), a key");
        return NULL;
    }
    /* The op: the usual fields only, each of its usual type (else Python names it). */
    /* Each held as soon as looked up: a later lookup may run a key's __eq__ */
    PyObject *rid = NULL, *nt_o = NULL, *ids = NULL, *la_o = NULL, *early = NULL;
    long long nt, la = 0;
    if (!(rid = Py_XNewRef(field(op, K_ID))) && PyErr_Occurred()) goto early_out;
    if (!(nt_o = Py_XNewRef(field(op, K_TOKENS))) && PyErr_Occurred()) goto early_out;
    if (!(ids = Py_XNewRef(field(op, K_IDS))) && PyErr_Occurred()) goto early_out;
    if (!(la_o = Py_XNewRef(field(op, K_LOOKAHEAD))) && PyErr_Occurred()) goto early_out;
    early = Py_None;
    if (!rid || !PyUnicode_CheckExact(rid) || PyUnicode_GET_LENGTH(rid) < 1 ||
        PyUnicode_GET_LENGTH(rid) > 256 || !count_of(nt_o, 1, &nt) || !count_of(la_o, 0, &la) ||
        nt + la > max_seq_len)
        goto early_out;
    for (int key = K_LORA; key < K_COUNT; key++) {
        PyObject *v = field(op, key);
        if (v && v != Py_None) goto early_out;
        if (PyErr_Occurred()) { early = NULL; goto early_out; }
    }
    if (ids == Py_None) Py_CLEAR(ids);
    if (ids && (!prompts || !PyList_CheckExact(ids) || PyList_GET_SIZE(ids) != nt))
        goto early_out;

    Ctx local, *c = NULL;
    Pool p[MAX_GROUPS];
    Buf cached[MAX_GROUPS];
    int got = 0, got_cached = 0, planned = -1;
    int64_t sinks[MAX_GROUPS];
    Book k;
    Start s;
    PyObject *result = NULL, *data = NULL, *keys = NULL, *scopes = NULL, *index = NULL;
    PyObject *stats = NULL, *hit_keys = NULL, *state = NULL, *held = NULL, *call = NULL;
    PyObject *first = NULL, *row_o = NULL, *handle_o = NULL, *hit_o = NULL, *added = NULL;
    PyObject *sums[3] = {NULL, NULL, NULL};
    memset(&k, 0, sizeof k);
    if (!(c = ctx_open(ctx_o, &local, 1)) || sinks_get(sinks_o, c, sinks) < 0 ||
        pools_get(pools_o, c, p, &got) < 0 || cached_get(cached_o, c, cached, &got_cached) < 0 ||
        book_get(m, c, &k) < 0)
        goto done;
    int known = PyDict_Contains(k.first, rid); /* a retry or a duplicate: Python's */
    Py_ssize_t free_rows = PyList_GET_SIZE(k.free_rows);
    if (known < 0) goto done;
    if (known || !free_rows) goto python;
    long row = PyLong_AsLong(PyList_GET_ITEM(k.free_rows, free_rows - 1));
    if (row == -1 && PyErr_Occurred()) goto done;

    /* The prompt's bytes and keys, and the cap on its hit. */
    int64_t cap = 0;
    if (ids) {
        Py_ssize_t full = (Py_ssize_t)(nt / c->tpb);
        if (keyed != Py_None) { /* prompt_keys' (bytes, keys) of this very op */
            if (!PyTuple_CheckExact(keyed) || PyTuple_GET_SIZE(keyed) != 2 ||
                !PyBytes_CheckExact(PyTuple_GET_ITEM(keyed, 0)) ||
                PyBytes_GET_SIZE(PyTuple_GET_ITEM(keyed, 0)) != 4 * nt ||
                !PyList_CheckExact(PyTuple_GET_ITEM(keyed, 1)) ||
                PyList_GET_SIZE(PyTuple_GET_ITEM(keyed, 1)) != full) {
                PyErr_SetString(PyExc_ValueError, "allocate_one: keyed is not this prompt's");
                goto done;
            }
            data = Py_NewRef(PyTuple_GET_ITEM(keyed, 0));
            keys = Py_NewRef(PyTuple_GET_ITEM(keyed, 1));
        } else {
            data = kvcm_packed(ids);
            if (data == Py_None) { /* not ids in [0, 2**31): Python names it */
                data = NULL;
                goto python;
            }
            if (!data) goto done;
            if (!(keys = PyList_New(full)) ||
                kvcm_chain_into((const uint8_t *)PyBytes_AS_STRING(root),
                                (const uint8_t *)PyBytes_AS_STRING(data), 4 * c->tpb, full, keys,
                                0) < 0)
                goto done;
        }
        cap = (nt - 1) / c->tpb < full ? (nt - 1) / c->tpb : full; /* prefix_cache.hit_cap */
        if (!(index = PyObject_GetAttr(cache, ATTR[A_INDEX])) ||
            !(stats = PyObject_GetAttr(cache, ATTR[A_STATS])))
            goto done;
        if (!PyList_CheckExact(index) || PyList_GET_SIZE(index) != c->groups) {
            PyErr_SetString(PyExc_ValueError, "allocate_one: an index per layer group");
            goto done;
        }
        if (!(scopes = PyTuple_New(c->groups))) goto done;
        for (int g = 0; g < c->groups; g++) {
            PyObject *scope = PyList_GET_ITEM(index, g);
            if (!PyDict_CheckExact(scope)) {
                PyErr_SetString(PyExc_ValueError, "allocate_one: an index that is not a dict");
                goto done;
            }
            PyObject *found = PyDict_GetItemWithError(scope, root);
            if (!found && PyErr_Occurred()) goto done;
            PyTuple_SET_ITEM(scopes, g, Py_NewRef(found ? found : Py_None));
        }
    } else {
        if (!(data = PyBytes_FromStringAndSize(NULL, 0)) || !(keys = PyList_New(0))) goto done;
    }
    /* scopes: read only when there are keys to look up (none without a prompt) */
    planned = start_plan(c, p, cached, row, keys, scopes, cap, nt, la, &s);
    if (planned < 0) goto done;
    if (planned) goto python; /* it does not fit, or numpy's: Python names or runs it */

    /* Every object the request keeps, made before the first write. */
    int64_t hit_tokens = s.b * c->tpb;
    /* request_rows.claim: serials 1 .. MAX_SERIAL, wrapping, so a handle stays below 2**63
     * (a Python % of a negative serial, never from the manager, is not C's: Python's). */
    int64_t old_serial = I64P(k.serial)[row];
    if (old_serial < 0) goto python_undo;
    int64_t serial = old_serial % MAX_SERIAL + 1;
    int64_t handle = serial << 32 | row;
    PyObject *none_args = NULL;
    PyObject *minus_one = NULL;
    if (!(hit_keys = PyList_GetSlice(keys, 0, s.b)) || !(none_args = PyTuple_New(0)) ||
        !(state = made(PyTuple_GET_ITEM(classes, 0), STATE_FIELD,
                       (PyObject *[]){root, Py_None, Py_False, none_args, hit_keys, data, keys},
                       F_STATE)) ||
        !(held = PyByteArray_FromStringAndSize(PyBytes_AS_STRING(data), 4 * hit_tokens)) ||
        !(call = Py_BuildValue("(OOOOOO)", nt_o, la_o, data, Py_None, Py_None, none_args)) ||
        !(row_o = PyLong_FromLong(row)) || !(handle_o = PyLong_FromLongLong(handle)) ||
        !(hit_o = PyLong_FromLongLong(hit_tokens)) || !(minus_one = PyLong_FromLong(-1)) ||
        !(first = made(PyTuple_GET_ITEM(classes, 1), FIRST_FIELD,
                       (PyObject *[]){call, rid, row_o, handle_o, hit_o, minus_one}, F_FIRST)) ||
        !(added = counts_tuple(s.add, c->groups)) ||
        !(result = Py_BuildValue("(OnOO)", first, s.b, added, s.evict ? Py_True : Py_False)) ||
        (ids && (!(sums[0] = sum_of(stats, ATTR[A_QUERIES], 1)) ||
                 !(sums[1] = sum_of(stats, ATTR[A_QUERY_TOKENS], nt)) ||
                 !(sums[2] = sum_of(stats, ATTR[A_HIT_TOKENS], hit_tokens))))) {
        Py_XDECREF(none_args);
        Py_XDECREF(minus_one);
        Py_CLEAR(result);
        start_undo(c, p, &s);
        goto done;
    }
    Py_DECREF(none_args);
    Py_DECREF(minus_one);

    /* The writes: the blocks, then the request's row and records (kvcm.allocation.start). */
    start_write(c, p, sinks, row, nt, la, &s);
    int bad = pools_commit(p, c->pools) < 0;
    for (int i = 0; ids && i < 3 && !bad; i++)
        bad = PyObject_SetAttr(stats, ATTR[A_QUERIES + i], sums[i]) < 0;
    if (!bad)
        bad = PyList_SetSlice(k.free_rows, free_rows - 1, free_rows, NULL) < 0 ||
              PyDict_SetItem(k.rows, rid, row_o) < 0;
    if (!bad) {
        PyList_SetItem(k.ids, row, Py_NewRef(rid)); /* in range: checked by book_get */
        I64P(k.serial)[row] = serial;
        I64P(k.handle)[row] = handle;
        bad = PyDict_SetItem(k.tokens, rid, held) < 0;
    }
    if (!bad) {
        I64P(k.committed)[row] = hit_tokens;
        I64P(k.hits)[row] = hit_tokens;
        bad = PyDict_SetItem(k.prefix, rid, state) < 0 || PyDict_SetItem(k.first, rid, first) < 0;
    }
    if (bad) Py_CLEAR(result);
    goto done;
python_undo: /* after start_plan: its tombstones back */
    start_undo(c, p, &s);
python:
    result = Py_NewRef(Py_None);
done:
    for (int i = 0; i < 3; i++) Py_XDECREF(sums[i]);
    if (planned == 0) start_free(&s);
    Py_XDECREF(data);
    Py_XDECREF(keys);
    Py_XDECREF(scopes);
    Py_XDECREF(index);
    Py_XDECREF(stats);
    Py_XDECREF(hit_keys);
    Py_XDECREF(state);
    Py_XDECREF(held);
    Py_XDECREF(call);
    Py_XDECREF(first);
    Py_XDECREF(row_o);
    Py_XDECREF(handle_o);
    Py_XDECREF(hit_o);
    Py_XDECREF(added);
    book_release(&k);
    for (int q = 0; q < got_cached; q++) buf_release(&cached[q]);
    pools_release(p, got);
    if (c) ctx_close(c, &local);
    Py_XDECREF(rid);
    Py_XDECREF(nt_o);
    Py_XDECREF(ids);
    Py_XDECREF(la_o);
    return result;
early_out:
    Py_XDECREF(rid);
    Py_XDECREF(nt_o);
    Py_XDECREF(ids);
    Py_XDECREF(la_o);
    return Py_XNewRef(early);
}

/* The op's prompt as allocate_one would key it: its int32 bytes (a new reference) and its
 * full blocks' count, or NULL with no error where allocate_one would not key it here (no
 * prompt, another field set, a value of another type or range). */
static PyObject *prompt_of(PyObject *op, long long tpb, Py_ssize_t *full) {
    if (!PyDict_CheckExact(op)) return NULL;
    PyObject *ids = field(op, K_IDS), *data = NULL;
    long long nt;
    if (!ids || !PyList_CheckExact(ids)) return NULL;
    Py_INCREF(ids); /* held before the lookups below, which may run a key's __eq__ */
    if (!count_of(field(op, K_TOKENS), 1, &nt)) goto done;
    for (int key = K_LORA; key < K_COUNT && !PyErr_Occurred(); key++) {
        PyObject *v = field(op, key);
        if (v && v != Py_None) goto done;
    }
    if (PyErr_Occurred() || PyList_GET_SIZE(ids) != nt) goto done;
    data = kvcm_packed(ids);
    if (data == Py_None) data = NULL;
    else if (data) *full = (Py_ssize_t)(nt / tpb);
done:
    Py_DECREF(ids);
    return data;
}

/* prompt_keys(ops, root, tokens_per_block) -> list, per op: (bytes, keys) of its prompt, or
 * None where allocate_one would not key it (it then keys nothing itself, or runs Python).
 *
 * A step's prompts keyed two at a time (kvcm_chain2_into: the SHA extensions' rounds of two
 * chains interleave), for allocate_one's `keyed`. Example: ops [a (20 ids), b (no
 * prompt), c (40 ids)], tokens_per_block 16: a's 1 key and c's 2 keys are chained together
 * (a's one pair, then c's second key alone); [(a's bytes, [ka0]), None, (c's bytes, [kc0,
 * kc1])]. */
PyObject *kvcm_prompt_keys(PyObject *self, PyObject *args) {
    PyObject *ops, *root;
    long long tpb;
    if (!PyArg_ParseTuple(args, "O!SL", &PyList_Type, &ops, &root, &tpb)) return NULL;
    if (names_init() < 0) return NULL;
    if (PyBytes_GET_SIZE(root) != 32 || tpb < 1) {
        PyErr_SetString(PyExc_ValueError, "prompt_keys: a 32-byte root and tokens_per_block");
        return NULL;
    }
    /* A snapshot: an op's lookups may run Python code (a key's __eq__) that changes the list */
    if (!(ops = PyList_AsTuple(ops))) return NULL;
    Py_ssize_t n = PyTuple_GET_SIZE(ops);
    PyObject *out = PyList_New(n);
    if (!out) {
        Py_DECREF(ops);
        return NULL;
    }
    const uint8_t *parent = (const uint8_t *)PyBytes_AS_STRING(root);
    Py_ssize_t waiting = -1; /* an op keyed but not yet chained: it waits for a partner */
    for (Py_ssize_t i = 0; i <= n; i++) {
        PyObject *data = NULL, *keys = NULL;
        Py_ssize_t full = 0;
        if (i < n) {
            data = prompt_of(PyTuple_GET_ITEM(ops, i), tpb, &full);
            if (!data) {
                if (PyErr_Occurred()) goto fail;
                PyList_SET_ITEM(out, i, Py_NewRef(Py_None));
                continue;
            }
            PyObject *pair = (keys = PyList_New(full)) ? PyTuple_Pack(2, data, keys) : NULL;
            Py_DECREF(data);
            Py_XDECREF(keys);
            if (!pair) goto fail;
            PyList_SET_ITEM(out, i, pair);
            if (waiting < 0) {
                waiting = i;
                continue;
            }
        } else if (waiting < 0) {
            break;
        }
        /* chain `waiting` with i, or alone at the end */
        PyObject *a = PyList_GET_ITEM(out, waiting);
        PyObject *da = PyTuple_GET_ITEM(a, 0), *ka = PyTuple_GET_ITEM(a, 1);
        int bad;
        if (i < n) {
            PyObject *b = PyList_GET_ITEM(out, i);
            PyObject *db = PyTuple_GET_ITEM(b, 0), *kb = PyTuple_GET_ITEM(b, 1);
            bad = kvcm_chain2_into(parent, (const uint8_t *)PyBytes_AS_STRING(da),
                                   PyList_GET_SIZE(ka), ka, parent,
                                   (const uint8_t *)PyBytes_AS_STRING(db), PyList_GET_SIZE(kb),
                                   kb, 4 * tpb);
        } else {
            bad = kvcm_chain_into(parent, (const uint8_t *)PyBytes_AS_STRING(da), 4 * tpb,
                                  PyList_GET_SIZE(ka), ka, 0);
        }
        if (bad < 0) goto fail;
        waiting = -1;
    }
    Py_DECREF(ops);
    return out;
fail:
    /* items not yet set are NULL, which the list's dealloc skips */
    Py_DECREF(ops);
    Py_DECREF(out);
    return NULL;
}

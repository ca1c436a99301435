/* A step's commits in one call (kvcm.commits.commit_batch with the C core).
 *
 * Each item does what commits._append does: the request's committed int32 bytes grow by the
 * item's, its committed count is written, and the blocks they fill are keyed
 * (kvcm.commit_keys: the prompt's kept keys where they apply, else the SHA-256 chain) and
 * published in every reusable layer group (kvcm.publish.publish, PrefixCache.store): the
 * same index entries, slot keys, cached flags, stats and KV events, in the same order. A
 * decode step's 256 commits were some 150 us of dict lookups and appends in Python, and each
 * one that filled a block about 7 us of publishing. */
#include "context.h"

/* Attribute names, made once (interned: a lookup by them is a pointer compare). */
enum { N_KEYS, N_ROOT, N_PROMPT, N_PROMPT_KEYS, N_MULTIMODAL, N_LORA, N_SALT,
       N_REUSABLE, N_INDEX, N_SLOT_KEY, N_CACHED, N_STATS, N_LOG, N_STORED_BLOCKS, N_STORED,
       N_COUNT };
static const char *const NAME_TEXT[N_COUNT] = {
    "keys", "root", "prompt", "prompt_keys", "multimodal", "lora_id", "has_salt",
    "reusable", "index", "slot_key", "cached", "stats", "log", "stored_blocks", "stored"};
static PyObject *NAME[N_COUNT];

static int names_init(void) {
    for (int i = 0; i < N_COUNT; i++)
        if (!NAME[i] && !(NAME[i] = PyUnicode_InternFromString(NAME_TEXT[i]))) return -1;
    return 0;
}

/* The prefix cache's parts, read when an item of the call first publishes. */
typedef struct {
    PyObject *obj, *reusable, *index, *slot_key, *stats, *log; /* new references but obj */
    Py_buffer cached[MAX_GROUPS];
    int got, got_cached;
} Cache;

static void cache_release(Cache *k) {
    Py_CLEAR(k->reusable);
    Py_CLEAR(k->index);
    Py_CLEAR(k->slot_key);
    Py_CLEAR(k->stats);
    Py_CLEAR(k->log);
    for (int q = 0; q < k->got_cached; q++) PyBuffer_Release(&k->cached[q]);
    k->got_cached = 0;
}

static int cache_fail(const char *what) {
    PyErr_Format(PyExc_ValueError, "prefix cache: %s", what);
    return -1;
}

/* Reads the cache's lists and its cached flags (a bool array per pool group). */
static int cache_get(Cache *k, const Ctx *c) {
    if (k->got) return 0;
    PyObject *cached = NULL;
    if (!(k->reusable = PyObject_GetAttr(k->obj, NAME[N_REUSABLE])) ||
        !(k->index = PyObject_GetAttr(k->obj, NAME[N_INDEX])) ||
        !(k->slot_key = PyObject_GetAttr(k->obj, NAME[N_SLOT_KEY])) ||
        !(k->stats = PyObject_GetAttr(k->obj, NAME[N_STATS])) ||
        !(k->log = PyObject_GetAttr(k->obj, NAME[N_LOG])) ||
        !(cached = PyObject_GetAttr(k->obj, NAME[N_CACHED])))
        goto fail;
    if (!PyList_Check(k->reusable) || PyList_GET_SIZE(k->reusable) != c->groups ||
        !PyList_Check(k->index) || PyList_GET_SIZE(k->index) != c->groups ||
        !PyList_Check(k->slot_key) || PyList_GET_SIZE(k->slot_key) != c->pools ||
        !PyList_Check(cached) || PyList_GET_SIZE(cached) != c->pools) {
        cache_fail("a list per layer group (reusable, index) and per pool group");
        goto fail;
    }
    for (int q = 0; q < c->pools; q++) {
        Py_buffer *b = &k->cached[q];
        int flags = PyBUF_C_CONTIGUOUS | PyBUF_FORMAT | PyBUF_WRITABLE;
        if (PyObject_GetBuffer(PyList_GET_ITEM(cached, q), b, flags) < 0) goto fail;
        k->got_cached = q + 1;
        if (b->itemsize != 1 || !b->format || strcmp(b->format, "?") != 0) {
            cache_fail("cached flags must be bool arrays");
            goto fail;
        }
    }
    Py_DECREF(cached);
    k->got = 1;
    return 0;
fail:
    Py_XDECREF(cached);
    cache_release(k);
    return -1;
}

/* A request's committed bytes and prefix state (both borrowed); -1 with an error, 0 if
 * the row names no request with both (the caller leaves the batch to Python). */
static int request_of(PyObject *ids, PyObject *tokens, PyObject *prefix, int64_t row,
                      PyObject **held, PyObject **state) {
    if (row < 0 || row >= PyList_GET_SIZE(ids)) return 0;
    PyObject *rid = PyList_GET_ITEM(ids, row);
    if (rid == Py_None) return 0;
    *held = PyDict_GetItemWithError(tokens, rid);
    if (!*held) return PyErr_Occurred() ? -1 : 0;
    *state = PyDict_GetItemWithError(prefix, rid);
    if (!*state) return PyErr_Occurred() ? -1 : 0;
    return PyByteArray_CheckExact(*held);
}

static int is_key(PyObject *o) { return PyBytes_CheckExact(o) && PyBytes_GET_SIZE(o) == 32; }

/* The item's prefix state, read for a publish (new references). */
typedef struct {
    PyObject *root, *prompt, *prompt_keys, *lora, *salt;
} Prefix;

static void prefix_release(Prefix *p) {
    Py_CLEAR(p->root);
    Py_CLEAR(p->prompt);
    Py_CLEAR(p->prompt_keys);
    Py_CLEAR(p->lora);
    Py_CLEAR(p->salt);
}

/* 1: read; 0: the state has multimodal items (Python keys those blocks); -1: error. */
static int prefix_get(PyObject *state, Prefix *p) {
    memset(p, 0, sizeof *p);
    PyObject *mm = PyObject_GetAttr(state, NAME[N_MULTIMODAL]);
    if (!mm) return -1;
    int has_mm = PyObject_IsTrue(mm);
    Py_DECREF(mm);
    if (has_mm) return has_mm < 0 ? -1 : 0;
    if (!(p->root = PyObject_GetAttr(state, NAME[N_ROOT])) ||
        !(p->prompt = PyObject_GetAttr(state, NAME[N_PROMPT])) ||
        !(p->prompt_keys = PyObject_GetAttr(state, NAME[N_PROMPT_KEYS])) ||
        !(p->lora = PyObject_GetAttr(state, NAME[N_LORA])) ||
        !(p->salt = PyObject_GetAttr(state, NAME[N_SALT]))) {
        prefix_release(p);
        return -1;
    }
    if (!is_key(p->root) || !PyBytes_CheckExact(p->prompt) || !PyList_Check(p->prompt_keys)) {
        prefix_release(p);
        PyErr_SetString(PyExc_ValueError, "a prefix state out of shape");
        return -1;
    }
    return 1;
}

/* The keys of blocks [have, have + count) of the committed bytes `chunk` (from block
 * `have`), parent `parent`: kvcm.commit_keys. The prompt's kept key of a block is reused
 * while the parent is the prompt's key of the block before and the block's bytes are the
 * prompt's; the rest are hashed. Example (tokens_per_block 4): a 10-token prompt keeps k0,
 * k1; a commit of its 10 tokens and 2 more fills blocks 0-2: k0 and k1 are taken, block 2
 * is hashed from k1. A new list, or NULL with an error. */
static PyObject *keys_of(const Prefix *p, PyObject *parent, const char *chunk, Py_ssize_t have,
                         Py_ssize_t count, Py_ssize_t step) {
    PyObject *keys = PyList_New(count);
    if (!keys) return NULL;
    Py_ssize_t kept = PyList_GET_SIZE(p->prompt_keys), same = 0;
    Py_ssize_t limit = count < kept - have ? count : kept - have;
    if (limit > 0 && (have == 0 || PyObject_RichCompareBool(
                                       PyList_GET_ITEM(p->prompt_keys, have - 1), parent, Py_EQ) == 1)) {
        const char *prompt = PyBytes_AS_STRING(p->prompt);
        Py_ssize_t plen = PyBytes_GET_SIZE(p->prompt);
        while (same < limit && (have + same + 1) * step <= plen &&
               memcmp(chunk + same * step, prompt + (have + same) * step, (size_t)step) == 0)
            same++;
    }
    if (PyErr_Occurred()) goto fail;
    for (Py_ssize_t j = 0; j < same; j++) {
        PyObject *key = PyList_GET_ITEM(p->prompt_keys, have + j);
        if (!is_key(key)) {
            PyErr_SetString(PyExc_ValueError, "a prompt key that is not 32 bytes");
            goto fail;
        }
        PyList_SET_ITEM(keys, j, Py_NewRef(key));
    }
    PyObject *from = same ? PyList_GET_ITEM(keys, same - 1) : parent;
    if (kvcm_chain_into((const uint8_t *)PyBytes_AS_STRING(from),
                        (const uint8_t *)chunk + same * step, step, count - same, keys, same) < 0)
        goto fail;
    return keys;
fail:
    Py_DECREF(keys);
    return NULL;
}

/* PrefixCache.store of blocks [b, e) of the item's new ones (positions have + b ...): the
 * index, the slot keys, the cached flags, the stats and one block_stored event. */
static int store_run(Cache *k, const Prefix *p, PyObject *keys, PyObject *gobj, int g, int q,
                     const int32_t *cells, Py_ssize_t have, Py_ssize_t b, Py_ssize_t e,
                     const char *chunk, Py_ssize_t step) {
    PyObject *run = NULL, *scope = NULL, *fresh = NULL, *count = NULL, *tb = NULL, *r = NULL;
    int ok = -1;
    PyObject *groups = PyList_GET_ITEM(k->index, g), *slot_key = PyList_GET_ITEM(k->slot_key, q);
    if (!PyDict_CheckExact(groups) || !PyDict_CheckExact(slot_key)) {
        cache_fail("index and slot keys are dicts");
        goto done;
    }
    if (!(run = PyList_GetSlice(keys, have + b, have + e))) goto done;
    scope = PyDict_GetItemWithError(groups, p->root); /* borrowed */
    if (!scope) { /* the scope's first block in this group: index.setdefault(root, {}) */
        if (PyErr_Occurred() || !(fresh = PyDict_New())) goto done;
        scope = PyDict_SetDefault(groups, p->root, fresh);
        if (!scope) goto done;
    }
    uint8_t *flags = k->cached[q].buf;
    for (Py_ssize_t j = b; j < e; j++) {
        PyObject *key = PyList_GET_ITEM(run, j - b);
        PyObject *slot = PyLong_FromLong(cells[j]);
        PyObject *where = slot ? PyTuple_Pack(3, gobj, p->root, key) : NULL;
        int bad = !where || PyDict_SetItem(scope, key, slot) < 0 ||
                  PyDict_SetItem(slot_key, slot, where) < 0;
        Py_XDECREF(slot);
        Py_XDECREF(where);
        if (bad) goto done;
        flags[cells[j]] = 1;
    }
    PyObject *before = PyObject_GetAttr(k->stats, NAME[N_STORED_BLOCKS]);
    if (!before) goto done;
    PyObject *n = PyLong_FromSsize_t(e - b);
    count = n ? PyNumber_Add(before, n) : NULL;
    Py_DECREF(before);
    Py_XDECREF(n);
    if (!count || PyObject_SetAttr(k->stats, NAME[N_STORED_BLOCKS], count) < 0) goto done;
    /* A salted tenant asked for isolation: its prompts do not leave in events. */
    int salted = PyObject_IsTrue(p->salt);
    if (salted < 0) goto done;
    tb = salted ? Py_NewRef(Py_None) : PyBytes_FromStringAndSize(chunk + b * step, (e - b) * step);
    if (!tb) goto done;
    PyObject *parent = have + b ? PyList_GET_ITEM(keys, have + b - 1) : Py_None;
    r = PyObject_CallMethodObjArgs(k->log, NAME[N_STORED], gobj, run, parent, tb, p->lora, p->salt,
                                   NULL);
    ok = r ? 0 : -1;
done:
    Py_XDECREF(run);
    Py_XDECREF(fresh);
    Py_XDECREF(count);
    Py_XDECREF(tb);
    Py_XDECREF(r);
    return ok;
}

/* kvcm.publish.publish of an item whose committed bytes `held` (now with its new ones)
 * fill blocks [have, full): keys them onto `keys` and stores the blocks new to each
 * reusable layer group's index, in runs of contiguous new blocks. A block is new in a group
 * when its slot there is a live page not cached yet and its key is not in the scope. -1
 * with an error (the keys may be extended: the caller cuts them). */
static int publish(const Ctx *c, Cache *k, const Prefix *p, PyObject *keys, PyObject *held,
                   int64_t row, Py_ssize_t have, Py_ssize_t full) {
    Py_ssize_t step = 4 * c->tpb, count = full - have;
    const char *chunk = PyByteArray_AS_STRING(held) + have * step;
    PyObject *parent = have ? PyList_GET_ITEM(keys, have - 1) : p->root;
    if (!is_key(parent)) {
        PyErr_SetString(PyExc_ValueError, "a block key that is not 32 bytes");
        return -1;
    }
    PyObject *added = keys_of(p, parent, chunk, have, count, step);
    if (!added) return -1;
    int bad = PyList_SetSlice(keys, have, have, added) < 0;
    Py_DECREF(added);
    if (bad || cache_get(k, c) < 0) return -1;
    char small[64], *fresh = count <= 64 ? small : PyMem_Malloc((size_t)count);
    if (!fresh) {
        PyErr_NoMemory();
        return -1;
    }
    int ok = 0;
    for (int g = 0; g < c->groups && !ok; g++) {
        int reusable = PyObject_IsTrue(PyList_GET_ITEM(k->reusable, g));
        if (reusable <= 0) {
            ok = reusable;
            continue;
        }
        int q = c->group_pool[g];
        const uint8_t *flags = k->cached[q].buf;
        Py_ssize_t nslots = k->cached[q].len;
        const int32_t *cells = I32P(c->tables) + (g * c->nrows + row) * c->width + have;
        PyObject *groups = PyList_GET_ITEM(k->index, g);
        PyObject *scope = PyDict_CheckExact(groups) ? PyDict_GetItemWithError(groups, p->root)
                                                    : NULL;
        if (!PyDict_CheckExact(groups) || PyErr_Occurred()) {
            ok = PyErr_Occurred() ? -1 : cache_fail("an index that is not a dict");
            break;
        }
        /* every block's verdict before any store, as publish computes them */
        for (Py_ssize_t j = 0; j < count && !ok; j++) {
            int32_t slot = cells[j];
            if (slot >= nslots) {
                ok = cache_fail("a slot past the cached flags");
                break;
            }
            fresh[j] = slot > c->empty && !flags[slot];
            if (fresh[j] && scope) {
                int in = PyDict_Contains(scope, PyList_GET_ITEM(keys, have + j));
                if (in < 0) ok = -1;
                fresh[j] = in == 0;
            }
        }
        PyObject *gobj = ok ? NULL : PyLong_FromLong(g);
        if (!ok && !gobj) ok = -1;
        for (Py_ssize_t b = 0; b < count && !ok;) {
            if (!fresh[b]) {
                b++;
                continue;
            }
            Py_ssize_t e = b;
            while (e < count && fresh[e]) e++;
            ok = store_run(k, p, keys, gobj, g, q, cells, have, b, e, chunk, step);
            b = e;
        }
        Py_XDECREF(gobj);
    }
    if (fresh != small) PyMem_Free(fresh);
    return ok;
}

/* Appends `data` to the bytearray `held`; -1 with an error (a bytearray whose buffer is
 * exported cannot grow). */
static int append(PyObject *held, PyObject *data) {
    Py_ssize_t old = PyByteArray_GET_SIZE(held), n = PyBytes_GET_SIZE(data);
    if (PyByteArray_Resize(held, old + n) < 0) return -1;
    memcpy(PyByteArray_AS_STRING(held) + old, PyBytes_AS_STRING(data), (size_t)n);
    return 0;
}

/* One item: 1 done, 0 left to Python (nothing changed), -1 failed (nothing of the item
 * changed but what a failed publish stored in the cache, as in Python). */
static int commit_item(const Ctx *c, Cache *k, PyObject *held, PyObject *state, PyObject *data,
                       int64_t row, int64_t *committed) {
    PyObject *keys = PyObject_GetAttr(state, NAME[N_KEYS]);
    if (!keys) return -1;
    int ok = -1;
    if (!PyList_Check(keys)) {
        PyErr_SetString(PyExc_ValueError, "a prefix state's keys are not a list");
        goto done;
    }
    Py_ssize_t step = 4 * c->tpb, old = PyByteArray_GET_SIZE(held);
    Py_ssize_t total = old + PyBytes_GET_SIZE(data), have = PyList_GET_SIZE(keys);
    Py_ssize_t full = total / step;
    if (full <= have) { /* a decode commit that fills no block */
        if (append(held, data) < 0) goto done;
        committed[row] = total / 4;
        ok = 1;
        goto done;
    }
    Prefix p;
    ok = full <= c->width ? prefix_get(state, &p) : 0;
    if (ok <= 0) goto done;
    ok = -1;
    if (append(held, data) == 0) {
        if (publish(c, k, &p, keys, held, row, have, full) == 0) {
            committed[row] = total / 4;
            ok = 1;
        } else { /* a refused commit changes nothing: its bytes and keys are cut */
            PyObject *type, *value, *tb;
            PyErr_Fetch(&type, &value, &tb);
            /* each cut on its own: a shrink can fail only where memory has run out */
            if (PyByteArray_Resize(held, old) < 0) PyErr_Clear();
            if (PyList_SetSlice(keys, have, PyList_GET_SIZE(keys), NULL) < 0) PyErr_Clear();
            PyErr_Restore(type, value, tb);
        }
    }
    prefix_release(&p);
done:
    Py_DECREF(keys);
    return ok;
}

/* commit_run(rows, data, start, ids, tokens, prefix, committed, context, cache)
 *     -> int | None | (int, exception)
 *
 * Items [start, n) of a step's commits (commits.commit_batch): distinct live rows (int64),
 * each item's token ids as int32 bytes; `ids`, `tokens`, `prefix`, `committed` the
 * manager's _ids, _tokens, _prefix and _committed, `cache` its PrefixCache. Runs the items
 * in order and returns the index of the first one it leaves to Python (n when none): one
 * that fills a block of a request with multimodal items (kvcm.hashing tags those blocks).
 * Keys are hashed with the selected SHA-256 (kvcm_use_sha_extensions).
 * (i, exception): item i failed, nothing of it changed (the caller reports the exception
 * as that item's); the items before it are done. None, with nothing changed, when the call
 * starts at 0 and an item does not fit its request (more tokens than it has uncommitted) or
 * names no request: the items then run one by one and each names its error.
 *
 * Example (tokens_per_block 4): requests at 5, 7 and 2 committed tokens commit one token
 * each: the first is appended (6 tokens), the second fills block 1 (8 tokens), which is
 * keyed and published, and the third is appended; returns 3. */
PyObject *kvcm_commit_run(PyObject *self, PyObject *args) {
    PyObject *rows_o, *data, *ids, *tokens, *prefix, *committed_o, *ctx_o;
    Py_ssize_t start;
    Cache k = {0};
    if (names_init() < 0 ||
        !PyArg_ParseTuple(args, "OO!nO!O!O!OOO", &rows_o, &PyList_Type, &data, &start,
                          &PyList_Type, &ids, &PyDict_Type, &tokens, &PyDict_Type, &prefix,
                          &committed_o, &ctx_o, &k.obj))
        return NULL;
    Ctx local, *c = NULL;
    Buf rows = {0}, committed = {0};
    PyObject *result = NULL, **held_of = NULL;
    Py_ssize_t n = 0;
    if (!(c = ctx_open(ctx_o, &local, 0)) || buf_get(rows_o, &rows, 8, 0) < 0 ||
        buf_get(committed_o, &committed, 8, 1) < 0)
        goto done;
    n = rows.n;
    if (PyList_GET_SIZE(data) != n || committed.n != c->nrows || start < 0 || start > n) {
        PyErr_SetString(PyExc_ValueError, "commit_run: mismatched sizes");
        goto done;
    }
    const int64_t *row_of = I64P(rows);
    /* Each item's request (its committed bytes and prefix state), looked up once and held
     * while the call runs: an event's Python call cannot drop them under it. */
    if (n > start && !(held_of = PyMem_Calloc((size_t)(2 * (n - start)), sizeof(PyObject *)))) {
        PyErr_NoMemory();
        goto done;
    }
    PyObject **state_of = held_of + (n - start);
    for (Py_ssize_t i = start; i < n; i++) {
        PyObject *held, *state, *d = PyList_GET_ITEM(data, i);
        int64_t row = row_of[i];
        int found = request_of(ids, tokens, prefix, row, &held, &state);
        if (found < 0) goto done;
        if (!found || row >= c->nrows || !PyBytes_CheckExact(d) || PyBytes_GET_SIZE(d) % 4 ||
            PyByteArray_GET_SIZE(held) + PyBytes_GET_SIZE(d) > 4 * I64P(c->num_tokens)[row]) {
            if (start) { /* checked when the call started at 0: never after */
                PyErr_SetString(PyExc_ValueError, "commit_run: an item changed between calls");
                goto done;
            }
            result = Py_NewRef(Py_None);
            goto done;
        }
        held_of[i - start] = Py_NewRef(held);
        state_of[i - start] = Py_NewRef(state);
    }
    Py_ssize_t i = start;
    for (; i < n; i++) {
        int ok = commit_item(c, &k, held_of[i - start], state_of[i - start],
                             PyList_GET_ITEM(data, i), row_of[i], I64P(committed));
        if (ok == 0) break;
        if (ok < 0) {
            PyObject *type, *value, *tb;
            PyErr_Fetch(&type, &value, &tb);
            PyErr_NormalizeException(&type, &value, &tb);
            if (tb) PyException_SetTraceback(value, tb);
            result = Py_BuildValue("(nO)", i, value);
            Py_XDECREF(type);
            Py_XDECREF(value);
            Py_XDECREF(tb);
            goto done;
        }
    }
    result = PyLong_FromSsize_t(i);
done:
    if (held_of)
        for (Py_ssize_t j = 0; j < 2 * (n - start); j++) Py_XDECREF(held_of[j]);
    PyMem_Free(held_of);
    cache_release(&k);
    buf_release(&rows);
    buf_release(&committed);
    if (c) ctx_close(c, &local);
    return result;
}

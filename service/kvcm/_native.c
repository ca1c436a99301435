/* kvcm._native: the step path's inner loops in C (docs/native.md).
 *
 * Optional: kvcm runs the same logic in numpy when this module is not built (no compiler)
 * or KVCM_NATIVE=0, and the tests compare the two (tests/test_native.py).
 *
 * - sha256_chain: the prefix-reuse key chain (kvcm.hashing.chain_keys), SHA-256 with the
 *   x86 SHA extensions when the CPU has them, else a portable C implementation.
 * - pack_tokens: a prompt's token ids (a list of ints) as int32 little-endian bytes.
 * - decode_plan, decode_commit: a batch of extends by handle (a decode step) planned in one
 *   pass over the rows, and its counters written in one more (kvcm.native_step).
 *
 * Arrays come in through the buffer protocol (numpy arrays, C-contiguous, int64 unless
 * named otherwise), so the module builds without numpy's headers.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>
#include <immintrin.h>
#define KVCM_X86 1
#endif

/* ---- SHA-256 (FIPS 180-4) ------------------------------------------------------------- */

static const uint32_t K256[64] = {
    0x428a2f98, 0x71374491, 0xb5c0fbcf, 0xe9b5dba5, 0x3956c25b, 0x59f111f1, 0x923f82a4,
    0xab1c5ed5, 0xd807aa98, 0x12835b01, 0x243185be, 0x550c7dc3, 0x72be5d74, 0x80deb1fe,
    0x9bdc06a7, 0xc19bf174, 0xe49b69c1, 0xefbe4786, 0x0fc19dc6, 0x240ca1cc, 0x2de92c6f,
    0x4a7484aa, 0x5cb0a9dc, 0x76f988da, 0x983e5152, 0xa831c66d, 0xb00327c8, 0xbf597fc7,
    0xc6e00bf3, 0xd5a79147, 0x06ca6351, 0x14292967, 0x27b70a85, 0x2e1b2138, 0x4d2c6dfc,
    0x53380d13, 0x650a7354, 0x766a0abb, 0x81c2c92e, 0x92722c85, 0xa2bfe8a1, 0xa81a664b,
    0xc24b8b70, 0xc76c51a3, 0xd192e819, 0xd6990624, 0xf40e3585, 0x106aa070, 0x19a4c116,
    0x1e376c08, 0x2748774c, 0x34b0bcb5, 0x391c0cb3, 0x4ed8aa4a, 0x5b9cca4f, 0x682e6ff3,
    0x748f82ee, 0x78a5636f, 0x84c87814, 0x8cc70208, 0x90befffa, 0xa4506ceb, 0xbef9a3f7,
    0xc67178f2};

static const uint32_t H0[8] = {0x6a09e667, 0xbb67ae85, 0x3c6ef372, 0xa54ff53a,
                               0x510e527f, 0x9b05688c, 0x1f83d9ab, 0x5be0cd19};

#define ROR(x, n) (((x) >> (n)) | ((x) << (32 - (n))))

static void compress_portable(uint32_t s[8], const uint8_t *p, size_t blocks) {
    uint32_t w[64];
    for (; blocks; blocks--, p += 64) {
        for (int t = 0; t < 16; t++)
            w[t] = (uint32_t)p[4 * t] << 24 | (uint32_t)p[4 * t + 1] << 16 |
                   (uint32_t)p[4 * t + 2] << 8 | p[4 * t + 3];
        for (int t = 16; t < 64; t++) {
            uint32_t s0 = ROR(w[t - 15], 7) ^ ROR(w[t - 15], 18) ^ (w[t - 15] >> 3);
            uint32_t s1 = ROR(w[t - 2], 17) ^ ROR(w[t - 2], 19) ^ (w[t - 2] >> 10);
            w[t] = w[t - 16] + s0 + w[t - 7] + s1;
        }
        uint32_t a = s[0], b = s[1], c = s[2], d = s[3], e = s[4], f = s[5], g = s[6], h = s[7];
        for (int t = 0; t < 64; t++) {
            uint32_t t1 = h + (ROR(e, 6) ^ ROR(e, 11) ^ ROR(e, 25)) + ((e & f) ^ (~e & g)) +
                          K256[t] + w[t];
            uint32_t t2 = (ROR(a, 2) ^ ROR(a, 13) ^ ROR(a, 22)) + ((a & b) ^ (a & c) ^ (b & c));
            h = g;
            g = f;
            f = e;
            e = d + t1;
            d = c;
            c = b;
            b = a;
            a = t1 + t2;
        }
        s[0] += a, s[1] += b, s[2] += c, s[3] += d, s[4] += e, s[5] += f, s[6] += g, s[7] += h;
    }
}

#ifdef KVCM_X86
/* Four rounds per step j: W[j % 4] holds the message words 4j..4j+3. From j = 4 on it is
 * computed from the four before it: msg1 adds sigma0 of w[t-15], alignr brings w[t-7], msg2
 * adds sigma1 of w[t-2]. The state is kept as the (A, B, E, F) and (C, D, G, H) halves that
 * sha256rnds2 works on. */
__attribute__((target("sha,sse4.1,ssse3"))) static void compress_ni(uint32_t s[8],
                                                                    const uint8_t *p,
                                                                    size_t blocks) {
    const __m128i swap = _mm_set_epi64x(0x0c0d0e0f08090a0bULL, 0x0405060700010203ULL);
    __m128i tmp = _mm_shuffle_epi32(_mm_loadu_si128((const __m128i *)&s[0]), 0xB1);
    __m128i st1 = _mm_shuffle_epi32(_mm_loadu_si128((const __m128i *)&s[4]), 0x1B);
    __m128i st0 = _mm_alignr_epi8(tmp, st1, 8);  /* A B E F */
    st1 = _mm_blend_epi16(st1, tmp, 0xF0);      /* C D G H */
    for (; blocks; blocks--, p += 64) {
        __m128i save0 = st0, save1 = st1, w[4];
        for (int j = 0; j < 16; j++) {
            if (j < 4) {
                w[j] = _mm_shuffle_epi8(_mm_loadu_si128((const __m128i *)(p + 16 * j)), swap);
            } else {
                __m128i m = _mm_sha256msg1_epu32(w[j & 3], w[(j + 1) & 3]);
                m = _mm_add_epi32(m, _mm_alignr_epi8(w[(j + 3) & 3], w[(j + 2) & 3], 4));
                w[j & 3] = _mm_sha256msg2_epu32(m, w[(j + 3) & 3]);
            }
            __m128i msg = _mm_add_epi32(w[j & 3], _mm_loadu_si128((const __m128i *)&K256[4 * j]));
            st1 = _mm_sha256rnds2_epu32(st1, st0, msg);
            st0 = _mm_sha256rnds2_epu32(st0, st1, _mm_shuffle_epi32(msg, 0x0E));
        }
        st0 = _mm_add_epi32(st0, save0);
        st1 = _mm_add_epi32(st1, save1);
    }
    tmp = _mm_shuffle_epi32(st0, 0x1B);           /* F E B A */
    st1 = _mm_shuffle_epi32(st1, 0xB1);           /* D C H G */
    st0 = _mm_blend_epi16(tmp, st1, 0xF0);        /* D C B A */
    st1 = _mm_alignr_epi8(st1, tmp, 8);           /* H G F E */
    _mm_storeu_si128((__m128i *)&s[0], st0);
    _mm_storeu_si128((__m128i *)&s[4], st1);
}

static int cpu_has_sha(void) {
    unsigned a, b, c, d;
    if (!__get_cpuid(1, &a, &b, &c, &d) || !(c & bit_SSE4_1) || !(c & bit_SSSE3)) return 0;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return 0;
    return (b >> 29) & 1;
}
#endif

typedef void (*compress_fn)(uint32_t *, const uint8_t *, size_t);
static compress_fn compress = compress_portable;
static int have_ni = 0;

/* SHA-256 of `len` bytes already in `buf`, which has room for the padding (len + 72). */
static void sha256_padded(uint8_t *buf, size_t len, uint8_t out[32]) {
    size_t total = (len + 9 + 63) / 64 * 64;
    buf[len] = 0x80;
    memset(buf + len + 1, 0, total - len - 9);
    uint64_t bits = (uint64_t)len * 8;
    for (int i = 0; i < 8; i++) buf[total - 1 - i] = (uint8_t)(bits >> (8 * i));
    uint32_t s[8];
    memcpy(s, H0, sizeof s);
    compress(s, buf, total / 64);
    for (int i = 0; i < 8; i++) {
        out[4 * i] = (uint8_t)(s[i] >> 24);
        out[4 * i + 1] = (uint8_t)(s[i] >> 16);
        out[4 * i + 2] = (uint8_t)(s[i] >> 8);
        out[4 * i + 3] = (uint8_t)s[i];
    }
}

/* sha256_chain(parent, data, block_bytes) -> list of the 32-byte keys of data's full blocks:
 * key_i = SHA-256(key_{i-1} || block_i), key_{-1} = parent. */
static PyObject *sha256_chain(PyObject *self, PyObject *args) {
    Py_buffer parent, data;
    Py_ssize_t step;
    if (!PyArg_ParseTuple(args, "y*y*n", &parent, &data, &step)) return NULL;
    PyObject *keys = NULL;
    uint8_t *buf = NULL;
    if (parent.len != 32 || step < 1) {
        PyErr_SetString(PyExc_ValueError, "parent must be 32 bytes and block_bytes >= 1");
        goto done;
    }
    Py_ssize_t count = data.len / step;
    keys = PyList_New(count);
    if (!keys || !count) goto done;
    buf = PyMem_Malloc((size_t)step + 32 + 72);
    if (!buf) {
        Py_CLEAR(keys);
        PyErr_NoMemory();
        goto done;
    }
    memcpy(buf, parent.buf, 32);
    for (Py_ssize_t i = 0; i < count; i++) {
        /* the previous key is already in buf[0:32]; the padding overwrote only what follows */
        memcpy(buf + 32, (const uint8_t *)data.buf + i * step, (size_t)step);
        PyObject *key = PyBytes_FromStringAndSize(NULL, 32);
        if (!key) {
            Py_CLEAR(keys);
            goto done;
        }
        uint8_t *out = (uint8_t *)PyBytes_AS_STRING(key);
        sha256_padded(buf, (size_t)step + 32, out);
        memcpy(buf, out, 32);
        PyList_SET_ITEM(keys, i, key);
    }
done:
    PyMem_Free(buf);
    PyBuffer_Release(&parent);
    PyBuffer_Release(&data);
    return keys;
}

/* sha256(data) -> its digest, with whichever compression is selected (tests). */
static PyObject *sha256_one(PyObject *self, PyObject *args) {
    Py_buffer data;
    if (!PyArg_ParseTuple(args, "y*", &data)) return NULL;
    uint8_t *buf = PyMem_Malloc((size_t)data.len + 72);
    PyObject *out = NULL;
    if (buf) {
        memcpy(buf, data.buf, (size_t)data.len);
        out = PyBytes_FromStringAndSize(NULL, 32);
        if (out) sha256_padded(buf, (size_t)data.len, (uint8_t *)PyBytes_AS_STRING(out));
        PyMem_Free(buf);
    } else {
        PyErr_NoMemory();
    }
    PyBuffer_Release(&data);
    return out;
}

/* use_sha_extensions(on) -> whether they are now used (only if the CPU has them). */
static PyObject *use_sha_extensions(PyObject *self, PyObject *arg) {
    int on = PyObject_IsTrue(arg);
    if (on < 0) return NULL;
    compress = compress_portable;
#ifdef KVCM_X86
    if (on && have_ni) compress = compress_ni;
#endif
    return PyBool_FromLong(compress != compress_portable);
}

/* ---- token ids -------------------------------------------------------------------------- */

/* ids (a list or tuple) as int32 LE bytes; a new reference, NULL with an error set, or
 * Py_None (borrowed, not incremented) when ids is not a list or tuple of ints in [0, 2**31). */
static PyObject *packed(PyObject *seq) {
    if (!PyList_CheckExact(seq) && !PyTuple_CheckExact(seq)) return Py_None;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    PyObject **items = PySequence_Fast_ITEMS(seq);
    PyObject *out = PyBytes_FromStringAndSize(NULL, n * 4);
    if (!out) return NULL;
    uint8_t *p = (uint8_t *)PyBytes_AS_STRING(out);
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *v = items[i];
        if (!PyLong_Check(v)) goto refuse;
        int overflow;
        long long x = PyLong_AsLongLongAndOverflow(v, &overflow);
        if (overflow || x < 0 || x > 0x7FFFFFFFLL) goto refuse;
        uint32_t u = (uint32_t)x;
        p[4 * i] = (uint8_t)u;
        p[4 * i + 1] = (uint8_t)(u >> 8);
        p[4 * i + 2] = (uint8_t)(u >> 16);
        p[4 * i + 3] = (uint8_t)(u >> 24);
    }
    return out;
refuse:
    Py_DECREF(out);
    return Py_None;
}

/* pack_tokens(ids) -> int32 LE bytes, or None when ids is not a list or tuple of ints in
 * [0, 2**31) (the caller's checks then name what is wrong). */
static PyObject *pack_tokens(PyObject *self, PyObject *seq) {
    PyObject *out = packed(seq);
    return out == Py_None ? Py_NewRef(Py_None) : out;
}

/* pack_token_lists(lists) -> [bytes, ...] for a list of id lists (a step's commits), or None
 * when one of them is not packable (the caller then checks each one to name the error). */
static PyObject *pack_token_lists(PyObject *self, PyObject *seq) {
    if (!PyList_CheckExact(seq) && !PyTuple_CheckExact(seq)) Py_RETURN_NONE;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    PyObject **items = PySequence_Fast_ITEMS(seq);
    PyObject *out = PyList_New(n);
    if (!out) return NULL;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *one = packed(items[i]);
        if (one == NULL || one == Py_None) {
            Py_DECREF(out);
            return one == NULL ? NULL : Py_NewRef(Py_None);
        }
        PyList_SET_ITEM(out, i, one);
    }
    return out;
}

/* ---- a decode step's batch of extends ----------------------------------------------------- */

#define MAX_GROUPS 64
#define ROW_MASK 0xFFFFFFFFLL
#define MAX_COUNT 0x7FFFFFFFLL /* kvcm.counts.MAX_COUNT */
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
#define NATIVE_LITTLE 1
#else
#define NATIVE_LITTLE 0
#endif

typedef struct {
    Py_buffer view;
    void *p;
    Py_ssize_t n;
} Buf;

/* A C-contiguous buffer of itemsize-byte signed ints, writable if asked; -1 with TypeError
 * (or numpy's ValueError for a strided array) if it is not one. */
static int buf_get(PyObject *obj, Buf *a, Py_ssize_t itemsize, int writable) {
    int flags = PyBUF_C_CONTIGUOUS | PyBUF_FORMAT | (writable ? PyBUF_WRITABLE : 0);
    if (PyObject_GetBuffer(obj, &a->view, flags) < 0) return -1;
    const char *f = a->view.format ? a->view.format : "B";
    /* native byte order only: no prefix, '@' or '=', or '<' on a little-endian host */
    if (f[0] == '@' || f[0] == '=' || (f[0] == '<' && NATIVE_LITTLE)) f++;
    int ok = a->view.itemsize == itemsize && strlen(f) == 1 &&
             (itemsize == 8 ? (f[0] == 'q' || f[0] == 'l') : f[0] == 'i');
    if (!ok) {
        PyBuffer_Release(&a->view);
        a->view.obj = NULL;
        PyErr_Format(PyExc_TypeError, "expected a C-contiguous int%d array", (int)(8 * itemsize));
        return -1;
    }
    a->p = a->view.buf;
    a->n = a->view.len / itemsize;
    return 0;
}

static void buf_release(Buf *a) {
    if (a->view.obj) PyBuffer_Release(&a->view);
    a->view.obj = NULL;
}

#define I64P(b) ((int64_t *)(b).p)
#define I32P(b) ((int32_t *)(b).p)

/* The coordinator's state a batch reads and writes (kvcm.native_step.NativeDecode.context):
 * (row_handle, scratch, num_tokens, history, lookahead, num_blocks, released_end, tables,
 *  refs, group_pool, windows, max_seq_len, tokens_per_block, empty), where num_blocks and
 * released_end are tuples of an int64 array per layer group, tables the int32 [groups,
 * rows, width] host page tables, refs a tuple of an int32 array per pool group, group_pool
 * and windows a tuple of ints per layer group (window 0: full attention). */
typedef struct {
    Buf row_handle, scratch, num_tokens, history, lookahead, tables;
    Buf blocks[MAX_GROUPS], released[MAX_GROUPS], refs[MAX_GROUPS];
    int64_t window[MAX_GROUPS];
    int group_pool[MAX_GROUPS];
    int groups, pools, got_blocks, got_released, got_refs;
    int64_t max_seq_len, tpb, empty;
    Py_ssize_t nrows, width;
} Ctx;

static void ctx_release(Ctx *c) {
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
    PyErr_Format(PyExc_ValueError, "decode context: %s", what);
    return -1;
}

static int ctx_get(PyObject *t, Ctx *c) {
    memset(c, 0, sizeof *c);
    if (!PyTuple_Check(t) || PyTuple_GET_SIZE(t) != 14) return ctx_fail("a tuple of 14");
    PyObject **it = &PyTuple_GET_ITEM(t, 0);
    if (buf_get(it[0], &c->row_handle, 8, 0) < 0 || buf_get(it[1], &c->scratch, 8, 1) < 0 ||
        buf_get(it[2], &c->num_tokens, 8, 1) < 0 || buf_get(it[3], &c->history, 8, 1) < 0 ||
        buf_get(it[4], &c->lookahead, 8, 1) < 0 || buf_get(it[7], &c->tables, 4, 0) < 0)
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
        if (buf_get(PyTuple_GET_ITEM(refs, p), &c->refs[p], 4, 0) < 0) return -1;
        c->got_refs = p + 1;
    }
    return 0;
}

/* floor(a / b) for b > 0 (C's division truncates toward zero). */
static inline int64_t floor_div(int64_t a, int64_t b) {
    int64_t q = a / b;
    return (a % b != 0 && a < 0) ? q - 1 : q;
}

/* The end of a windowed group's released run after an op from `history` tokens
 * (kvcm.attention.SlidingWindow.released_end). */
static inline int64_t released_end(int64_t old, int64_t history, int64_t window, int64_t tpb) {
    int64_t stale = floor_div(history + 1 - window, tpb);
    return stale > old ? stale : old;
}

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

/* A tuple of Py_ssize_t counts. */
static PyObject *counts_tuple(const Py_ssize_t *k, int n) {
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

/* decode_plan(handles, new, ahead, context, free, out) -> (added, released) | int | False | None
 *
 * Plans extends of live, distinct handles as one batch, item after item, changing no state
 * (the scratch array is work space). ``free``: each pool group's free slots; ``out``:
 * (rows int64 [R], add_items, add_positions, release_items, release_positions, each int64
 * [groups, cap]). Item i's row goes to rows[i]; layer group g's new blocks are its (item,
 * position) pairs add_*[g, :added[g]], and the table cells a sliding window releases are
 * release_*[g, :released[g]], both in item order (what the numpy plan gathers).
 *
 * An int (the cells some group needs) when the out arrays are too small: the caller grows
 * them and plans again. False when the numpy plan must decide (it plans what this one does
 * not): a released cell that holds no page, a count out of range, a strided or non-int64
 * column. None when the numpy plan would refuse
 * the batch as well (the items then run one by one, each naming its error): a handle that
 * is not live, a row named twice, a capacity past max_seq_len, or a batch that does not fit
 * item after item: per pool group, every prefix of the items must need at most ``free`` slots,
 * net of those it releases (a windowed row's released blocks serve later rows only).
 *
 * Example (tokens_per_block 16, one full-attention group): row a holds 16 tokens in 1
 * block, row b 20 tokens in 2 blocks; +1 token each: a wants ceil(17 / 16) = 2 blocks, so
 * (item 0, position 1) is planned; b's 21 tokens fit its 2 blocks: returns ((1,), (0,)).
 * With a window of 32 tokens (no sinks), a row at 48 tokens that grows releases block 0:
 * floor((48 + 1 - 32) / 16) = 1, so its released run [0, 0) becomes [0, 1), and
 * (item, position 0) is a release_* pair.
 */
static PyObject *decode_plan(PyObject *self, PyObject *args) {
    PyObject *handles_o, *new_o, *ahead_o, *ctx_o, *free_o, *out_o;
    if (!PyArg_ParseTuple(args, "OOOOOO", &handles_o, &new_o, &ahead_o, &ctx_o, &free_o, &out_o))
        return NULL;
    Ctx c;
    Buf handles = {0}, out[5];
    Column new = {0}, ahead = {0};
    memset(out, 0, sizeof out);
    PyObject *result = NULL;
    int64_t room[MAX_GROUPS], net[MAX_GROUPS] = {0};
    Py_ssize_t kadd[MAX_GROUPS] = {0}, krel[MAX_GROUPS] = {0};
    if (ctx_get(ctx_o, &c) < 0) goto done;
    /* a strided or non-int64 column: numpy's path takes any */
    if (buf_get(handles_o, &handles, 8, 0) < 0) goto soft;
    Py_ssize_t n = handles.n;
    if (column_get(new_o, n, &new) < 0 || column_get(ahead_o, n, &ahead) < 0) goto soft;
    if (!PyTuple_Check(free_o) || PyTuple_GET_SIZE(free_o) != c.pools || !PyTuple_Check(out_o) ||
        PyTuple_GET_SIZE(out_o) != 5) {
        PyErr_SetString(PyExc_ValueError, "decode_plan: free per pool group, 5 out arrays");
        goto done;
    }
    for (int p = 0; p < c.pools; p++) {
        room[p] = PyLong_AsLongLong(PyTuple_GET_ITEM(free_o, p));
        if (PyErr_Occurred()) goto done;
    }
    for (int j = 0; j < 5; j++)
        if (buf_get(PyTuple_GET_ITEM(out_o, j), &out[j], 8, 1) < 0) goto done;
    Py_ssize_t cap = out[1].n / c.groups;
    if (out[0].n != c.nrows || out[2].n != out[1].n || out[3].n != out[1].n ||
        out[4].n != out[1].n) {
        PyErr_SetString(PyExc_ValueError, "decode_plan: out arrays of mismatched sizes");
        goto done;
    }
    int64_t *rows = I64P(out[0]), *add_items = I64P(out[1]), *add_pos = I64P(out[2]);
    int64_t *rel_items = I64P(out[3]), *rel_pos = I64P(out[4]);
    const int64_t *h = I64P(handles), *live = I64P(c.row_handle), *tokens = I64P(c.num_tokens);
    int64_t *scratch = I64P(c.scratch);
    const int32_t *tables = I32P(c.tables);
    if (n > c.nrows) goto none; /* cannot all be distinct rows */
    for (Py_ssize_t i = 0; i < n; i++) {
        int64_t row = h[i] & ROW_MASK;
        if (row >= c.nrows || live[row] != h[i]) goto none;
        rows[i] = row;
        scratch[row] = i;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        int64_t row = rows[i];
        if (scratch[row] != i) goto none; /* a later item names the same row */
        int64_t history = tokens[row], nt = COL(new, i), la = COL(ahead, i);
        if (nt < 1 || nt > MAX_COUNT || la < 0 || la > MAX_COUNT) goto numpy; /* it names them */
        int64_t capacity = history + nt + la; /* no overflow: each term below 2**62 */
        if (capacity > c.max_seq_len) goto none;
        int64_t want = (capacity + c.tpb - 1) / c.tpb;
        for (int g = 0; g < c.groups; g++) {
            int p = c.group_pool[g];
            if (c.window[g]) {
                int64_t old = I64P(c.released[g])[row];
                int64_t end = released_end(old, history, c.window[g], c.tpb);
                if (end > c.width) goto numpy;
                const int32_t *cells = tables + (g * c.nrows + row) * c.width;
                for (int64_t pos = old; pos < end; pos++) {
                    int64_t slot = cells[pos];
                    if (slot <= c.empty || slot >= c.refs[p].n || I32P(c.refs[p])[slot] < 1)
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
                    net[p] -= I32P(c.refs[p])[slot] == 1;
                }
            }
            for (int64_t pos = I64P(c.blocks[g])[row]; pos < want; pos++) {
                if (kadd[g] < cap) {
                    add_items[g * cap + kadd[g]] = i;
                    add_pos[g * cap + kadd[g]] = pos;
                }
                kadd[g]++;
                net[p]++;
            }
        }
        for (int p = 0; p < c.pools; p++)
            if (net[p] > room[p]) goto none; /* does not fit item after item */
    }
    Py_ssize_t most = 0;
    for (int g = 0; g < c.groups; g++) {
        if (kadd[g] > most) most = kadd[g];
        if (krel[g] > most) most = krel[g];
    }
    if (most > cap) { /* the caller makes the out arrays this large and plans again */
        result = PyLong_FromSsize_t(most);
        goto done;
    }
    PyObject *added = counts_tuple(kadd, c.groups), *released = counts_tuple(krel, c.groups);
    if (added && released) result = PyTuple_Pack(2, added, released);
    Py_XDECREF(added);
    Py_XDECREF(released);
    goto done;
soft: /* a column numpy's path takes (strided, another dtype) */
    if (!PyErr_ExceptionMatches(PyExc_TypeError) && !PyErr_ExceptionMatches(PyExc_ValueError) &&
        !PyErr_ExceptionMatches(PyExc_BufferError))
        goto done;
    PyErr_Clear();
numpy:
    result = Py_NewRef(Py_False);
    goto done;
none:
    result = Py_NewRef(Py_None);
done:
    ctx_release(&c);
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
static PyObject *decode_commit(PyObject *self, PyObject *args) {
    PyObject *rows_o, *new_o, *ahead_o, *ctx_o, *added_o;
    if (!PyArg_ParseTuple(args, "OOOOO", &rows_o, &new_o, &ahead_o, &ctx_o, &added_o))
        return NULL;
    Ctx c;
    Buf rows = {0}, added = {0};
    Column new = {0}, ahead = {0};
    PyObject *result = NULL;
    if (ctx_get(ctx_o, &c) < 0 || buf_get(rows_o, &rows, 8, 0) < 0) goto done;
    Py_ssize_t n = rows.n;
    if (column_get(new_o, n, &new) < 0 || column_get(ahead_o, n, &ahead) < 0 ||
        buf_get(added_o, &added, 4, 1) < 0)
        goto done;
    if (added.n != n) {
        PyErr_SetString(PyExc_ValueError, "decode_commit: out_added needs a cell per row");
        goto done;
    }
    int64_t *tokens = I64P(c.num_tokens);
    for (Py_ssize_t i = 0; i < n; i++) { /* all rows checked before any is written */
        int64_t row = I64P(rows)[i], nt = COL(new, i), la = COL(ahead, i);
        if (row < 0 || row >= c.nrows || nt < 1 || nt > MAX_COUNT || la < 0 || la > MAX_COUNT) {
            PyErr_SetString(PyExc_ValueError, "decode_commit: a row or count out of range");
            goto done;
        }
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        int64_t row = I64P(rows)[i];
        int64_t history = tokens[row], nt = COL(new, i), la = COL(ahead, i);
        int64_t want = (history + nt + la + c.tpb - 1) / c.tpb;
        int64_t sum = 0;
        for (int g = 0; g < c.groups; g++) {
            int64_t *cell = &I64P(c.blocks[g])[row];
            if (want > *cell) {
                sum += want - *cell;
                *cell = want;
            }
            if (c.window[g]) {
                int64_t *end = &I64P(c.released[g])[row];
                *end = released_end(*end, history, c.window[g], c.tpb);
            }
        }
        I64P(c.history)[row] = history;
        tokens[row] = history + nt;
        I64P(c.lookahead)[row] = la;
        I32P(added)[i] = (int32_t)sum;
    }
    result = Py_NewRef(Py_None);
done:
    ctx_release(&c);
    buf_release(&rows);
    buf_release(&added);
    buf_release(&new.arr);
    buf_release(&ahead.arr);
    return result;
}

static PyMethodDef methods[] = {
    {"sha256_chain", sha256_chain, METH_VARARGS, "Chained SHA-256 keys of full blocks."},
    {"sha256", sha256_one, METH_VARARGS, "SHA-256 of bytes (the selected implementation)."},
    {"use_sha_extensions", use_sha_extensions, METH_O, "Select the SHA extensions or not."},
    {"pack_tokens", pack_tokens, METH_O, "Token ids as int32 LE bytes, or None."},
    {"pack_token_lists", pack_token_lists, METH_O, "pack_tokens of each list, or None."},
    {"decode_plan", decode_plan, METH_VARARGS, "Plan a batch of extends by handle."},
    {"decode_commit", decode_commit, METH_VARARGS, "Write a planned batch's counters."},
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "_native",
    .m_doc = "kvcm's step path in C (docs/native.md).",
    .m_size = -1,
    .m_methods = methods,
};

PyMODINIT_FUNC PyInit__native(void) {
#ifdef KVCM_X86
    have_ni = cpu_has_sha();
    if (have_ni) compress = compress_ni;
#endif
    PyObject *m = PyModule_Create(&module);
    if (m && PyModule_AddIntConstant(m, "HAVE_SHA_EXTENSIONS", have_ni) < 0) Py_CLEAR(m);
    return m;
}

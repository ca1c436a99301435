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

/* pack_tokens(ids) -> int32 LE bytes, or None when ids is not a list or tuple of ints in
 * [0, 2**31) (the caller's checks then name what is wrong). */
static PyObject *pack_tokens(PyObject *self, PyObject *seq) {
    if (!PyList_CheckExact(seq) && !PyTuple_CheckExact(seq)) Py_RETURN_NONE;
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
    Py_RETURN_NONE;
}

/* ---- a decode step's batch of extends ----------------------------------------------------- */

typedef struct {
    Py_buffer view;
    int64_t *p;
    Py_ssize_t n;
} I64;

/* An int64 C-contiguous buffer (writable if asked). */
static int i64_get(PyObject *obj, I64 *a, int writable) {
    int flags = PyBUF_C_CONTIGUOUS | PyBUF_FORMAT | (writable ? PyBUF_WRITABLE : 0);
    if (PyObject_GetBuffer(obj, &a->view, flags) < 0) return -1;
    const char *f = a->view.format ? a->view.format : "B";
    char last = f[strlen(f) - 1];
    if (a->view.itemsize != 8 || (last != 'q' && last != 'l') || (f[0] == '>' || f[0] == '!')) {
        PyBuffer_Release(&a->view);
        PyErr_SetString(PyExc_TypeError, "expected a C-contiguous int64 array");
        return -1;
    }
    a->p = (int64_t *)a->view.buf;
    a->n = a->view.len / 8;
    return 0;
}

/* An int for every item, or an int64 array of one per item: (scalar, array or NULL). */
static int per_item(PyObject *obj, Py_ssize_t n, int64_t *scalar, I64 *arr, int *is_arr) {
    if (PyLong_Check(obj)) {
        *scalar = PyLong_AsLongLong(obj);
        *is_arr = 0;
        return (*scalar == -1 && PyErr_Occurred()) ? -1 : 0;
    }
    if (i64_get(obj, arr, 0) < 0) return -1;
    *is_arr = 1;
    if (arr->n != n) {
        PyBuffer_Release(&arr->view);
        *is_arr = 0;
        PyErr_SetString(PyExc_ValueError, "a per-item column of the wrong length");
        return -1;
    }
    return 0;
}

#define MAX_GROUPS 64
#define ROW_MASK 0xFFFFFFFFLL

typedef struct {
    I64 handles, new_arr, ahead_arr, num_tokens, blocks[MAX_GROUPS];
    int64_t new_one, ahead_one;
    int new_is_arr, ahead_is_arr, groups, got_blocks;
} Batch;

static void batch_release(Batch *b) {
    if (b->handles.view.obj) PyBuffer_Release(&b->handles.view);
    if (b->new_is_arr) PyBuffer_Release(&b->new_arr.view);
    if (b->ahead_is_arr) PyBuffer_Release(&b->ahead_arr.view);
    if (b->num_tokens.view.obj) PyBuffer_Release(&b->num_tokens.view);
    for (int g = 0; g < b->got_blocks; g++) PyBuffer_Release(&b->blocks[g].view);
}

/* The arguments both calls share: rows or handles, counts, num_tokens, num_blocks. -2 when
 * a column (handles, new, ahead) is not an int or a contiguous int64 array of the right
 * length, -1 for any other error. */
static int batch_get(Batch *b, PyObject *handles, PyObject *new, PyObject *ahead,
                     PyObject *num_tokens, PyObject *num_blocks, int writable) {
    memset(b, 0, sizeof *b);
    if (i64_get(handles, &b->handles, 0) < 0) return -2;
    Py_ssize_t n = b->handles.n;
    if (per_item(new, n, &b->new_one, &b->new_arr, &b->new_is_arr) < 0) return -2;
    if (per_item(ahead, n, &b->ahead_one, &b->ahead_arr, &b->ahead_is_arr) < 0) return -2;
    if (i64_get(num_tokens, &b->num_tokens, writable) < 0) return -1;
    if (!PyTuple_Check(num_blocks) || PyTuple_GET_SIZE(num_blocks) > MAX_GROUPS ||
        PyTuple_GET_SIZE(num_blocks) < 1) {
        PyErr_SetString(PyExc_TypeError, "num_blocks must be a tuple of 1 to 64 arrays");
        return -1;
    }
    b->groups = (int)PyTuple_GET_SIZE(num_blocks);
    for (int g = 0; g < b->groups; g++) {
        if (i64_get(PyTuple_GET_ITEM(num_blocks, g), &b->blocks[g], writable) < 0) return -1;
        b->got_blocks = g + 1;
        if (b->blocks[g].n != b->num_tokens.n) {
            PyErr_SetString(PyExc_ValueError, "num_blocks arrays must have a cell per row");
            return -1;
        }
    }
    return 0;
}

/* decode_plan(handles, new, ahead, row_handle, scratch, num_tokens, num_blocks, max_seq_len,
 *             tokens_per_block, out_rows, out_items, out_positions) -> tuple | None
 *
 * Plans extends of live, distinct handles as one batch, changing no state (scratch is a work
 * array): out_rows[i] gets item i's row; for layer group g, the blocks to add are its
 * (item, block position) pairs out_items[g, :k_g], out_positions[g, :k_g], in item order.
 * Returns (k_0, ..., k_{G-1}); None when the batch is not for this path: a handle that is not
 * live, a row named twice, a capacity past max_seq_len, or more new blocks than the out
 * arrays hold (the caller then takes the general path, which names each item's error).
 *
 * Example (tokens_per_block 16, one group): row a holds 16 tokens in 1 block, row b 20
 * tokens in 2 blocks; +1 token each: a wants ceil(17 / 16) = 2 blocks, so (item 0, position 1)
 * is planned; b's 21 tokens fit its 2 blocks.
 * Returns (1,).
 */
static PyObject *decode_plan(PyObject *self, PyObject *args) {
    PyObject *handles, *new, *ahead, *row_handle_o, *scratch_o, *num_tokens, *num_blocks;
    PyObject *out_rows_o, *out_items_o, *out_pos_o;
    long long max_seq_len, tpb;
    if (!PyArg_ParseTuple(args, "OOOOOOOLLOOO", &handles, &new, &ahead, &row_handle_o,
                          &scratch_o, &num_tokens, &num_blocks, &max_seq_len, &tpb,
                          &out_rows_o, &out_items_o, &out_pos_o))
        return NULL;
    Batch b;
    I64 row_handle = {0}, scratch = {0}, out_rows = {0}, out_items = {0}, out_pos = {0};
    PyObject *result = NULL;
    int got = batch_get(&b, handles, new, ahead, num_tokens, num_blocks, 0);
    if (got == -2) { /* a strided or non-int64 column: numpy's path takes any */
        PyErr_Clear();
        goto none;
    }
    if (got < 0) goto done;
    if (i64_get(row_handle_o, &row_handle, 0) < 0 || i64_get(scratch_o, &scratch, 1) < 0 ||
        i64_get(out_rows_o, &out_rows, 1) < 0 || i64_get(out_items_o, &out_items, 1) < 0 ||
        i64_get(out_pos_o, &out_pos, 1) < 0)
        goto done;
    Py_ssize_t n = b.handles.n, nrows = b.num_tokens.n;
    Py_ssize_t cap = out_items.n / b.groups;
    if (tpb < 1 || row_handle.n != nrows || scratch.n != nrows || out_rows.n != nrows ||
        out_pos.n != out_items.n) {
        PyErr_SetString(PyExc_ValueError, "decode_plan: arrays of mismatched sizes");
        goto done;
    }
    const int64_t *h = b.handles.p;
    if (n > nrows) goto none; /* cannot all be distinct rows */
    for (Py_ssize_t i = 0; i < n; i++) {
        int64_t row = h[i] & ROW_MASK;
        if (row >= nrows || row_handle.p[row] != h[i]) goto none;
        out_rows.p[i] = row;
        scratch.p[row] = i;
    }
    Py_ssize_t k[MAX_GROUPS] = {0};
    for (Py_ssize_t i = 0; i < n; i++) {
        int64_t row = out_rows.p[i];
        if (scratch.p[row] != i) goto none; /* a later item names the same row */
        int64_t nt = b.new_is_arr ? b.new_arr.p[i] : b.new_one;
        int64_t la = b.ahead_is_arr ? b.ahead_arr.p[i] : b.ahead_one;
        int64_t capacity = b.num_tokens.p[row] + nt + la;
        if (capacity > max_seq_len) goto none;
        int64_t want = (capacity + tpb - 1) / tpb;
        for (int g = 0; g < b.groups; g++) {
            for (int64_t pos = b.blocks[g].p[row]; pos < want; pos++) {
                if (k[g] == cap) goto none;
                out_items.p[g * cap + k[g]] = i;
                out_pos.p[g * cap + k[g]] = pos;
                k[g]++;
            }
        }
    }
    result = PyTuple_New(b.groups);
    for (int g = 0; result && g < b.groups; g++) {
        PyObject *v = PyLong_FromSsize_t(k[g]);
        if (!v) {
            Py_CLEAR(result);
            break;
        }
        PyTuple_SET_ITEM(result, g, v);
    }
    goto done;
none:
    result = Py_NewRef(Py_None);
done:
    batch_release(&b);
    if (row_handle.view.obj) PyBuffer_Release(&row_handle.view);
    if (scratch.view.obj) PyBuffer_Release(&scratch.view);
    if (out_rows.view.obj) PyBuffer_Release(&out_rows.view);
    if (out_items.view.obj) PyBuffer_Release(&out_items.view);
    if (out_pos.view.obj) PyBuffer_Release(&out_pos.view);
    return result;
}

/* decode_commit(rows, new, ahead, num_tokens, history, lookahead, num_blocks,
 *               tokens_per_block, out_added) -> None
 *
 * The counters of a planned batch, once its blocks are in the tables: per row, history =
 * num_tokens, num_tokens += new, lookahead = ahead, and each group's num_blocks raised to
 * ceil((num_tokens + lookahead) / tokens_per_block); out_added (int32) gets each item's new
 * blocks summed over the groups.
 */
static PyObject *decode_commit(PyObject *self, PyObject *args) {
    PyObject *rows_o, *new, *ahead, *num_tokens, *history_o, *lookahead_o, *num_blocks, *added_o;
    long long tpb;
    if (!PyArg_ParseTuple(args, "OOOOOOOLO", &rows_o, &new, &ahead, &num_tokens, &history_o,
                          &lookahead_o, &num_blocks, &tpb, &added_o))
        return NULL;
    Batch b;
    I64 history = {0}, lookahead = {0};
    Py_buffer added = {0};
    PyObject *result = NULL;
    if (batch_get(&b, rows_o, new, ahead, num_tokens, num_blocks, 1) < 0) goto done;
    if (i64_get(history_o, &history, 1) < 0 || i64_get(lookahead_o, &lookahead, 1) < 0) goto done;
    if (PyObject_GetBuffer(added_o, &added, PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE) < 0) goto done;
    Py_ssize_t n = b.handles.n, nrows = b.num_tokens.n;
    if (tpb < 1 || added.itemsize != 4 || added.len / 4 != n || history.n != nrows ||
        lookahead.n != nrows) {
        PyErr_SetString(PyExc_ValueError, "decode_commit: arrays of mismatched sizes");
        goto done;
    }
    int32_t *out = (int32_t *)added.buf;
    for (Py_ssize_t i = 0; i < n; i++) {
        int64_t row = b.handles.p[i];
        if (row < 0 || row >= nrows) {
            PyErr_SetString(PyExc_IndexError, "decode_commit: a row out of range");
            goto done;
        }
        int64_t nt = b.new_is_arr ? b.new_arr.p[i] : b.new_one;
        int64_t la = b.ahead_is_arr ? b.ahead_arr.p[i] : b.ahead_one;
        int64_t past = b.num_tokens.p[row];
        int64_t want = (past + nt + la + tpb - 1) / tpb;
        int64_t sum = 0;
        for (int g = 0; g < b.groups; g++) {
            int64_t *cell = &b.blocks[g].p[row];
            if (want > *cell) {
                sum += want - *cell;
                *cell = want;
            }
        }
        history.p[row] = past;
        b.num_tokens.p[row] = past + nt;
        lookahead.p[row] = la;
        out[i] = (int32_t)sum;
    }
    result = Py_NewRef(Py_None);
done:
    batch_release(&b);
    if (history.view.obj) PyBuffer_Release(&history.view);
    if (lookahead.view.obj) PyBuffer_Release(&lookahead.view);
    if (added.obj) PyBuffer_Release(&added);
    return result;
}

static PyMethodDef methods[] = {
    {"sha256_chain", sha256_chain, METH_VARARGS, "Chained SHA-256 keys of full blocks."},
    {"sha256", sha256_one, METH_VARARGS, "SHA-256 of bytes (the selected implementation)."},
    {"use_sha_extensions", use_sha_extensions, METH_O, "Select the SHA extensions or not."},
    {"pack_tokens", pack_tokens, METH_O, "Token ids as int32 LE bytes, or None."},
    {"decode_plan", decode_plan, METH_VARARGS, "Plan a batch of extends by handle."},
    {"decode_commit", decode_commit, METH_VARARGS, "Write a planned batch's counters."},
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_native",
                                    "kvcm's step path in C (docs/native.md).", -1, methods};

PyMODINIT_FUNC PyInit__native(void) {
#ifdef KVCM_X86
    have_ni = cpu_has_sha();
    if (have_ni) compress = compress_ni;
#endif
    PyObject *m = PyModule_Create(&module);
    if (m && PyModule_AddIntConstant(m, "HAVE_SHA_EXTENSIONS", have_ni) < 0) Py_CLEAR(m);
    return m;
}

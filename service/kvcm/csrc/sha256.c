/* SHA-256 and the chain of block keys (kvcm.hashing.chain_keys): the x86 SHA extensions when
 * the CPU has them, else portable C. */
#include "native.h"

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
 * sha256rnds2 works on. The helpers are one message's pieces; compress_ni runs one message,
 * compress_ni2 two side by side. */
#define NI __attribute__((target("sha,sse4.1,ssse3")))
#define NI_INLINE __attribute__((target("sha,sse4.1,ssse3"), always_inline)) static inline

/* s[0..7] as the (A, B, E, F) and (C, D, G, H) halves */
NI_INLINE void ni_load(const uint32_t s[8], __m128i *st0, __m128i *st1) {
    __m128i tmp = _mm_shuffle_epi32(_mm_loadu_si128((const __m128i *)&s[0]), 0xB1);
    __m128i cdgh = _mm_shuffle_epi32(_mm_loadu_si128((const __m128i *)&s[4]), 0x1B);
    *st0 = _mm_alignr_epi8(tmp, cdgh, 8);  /* A B E F */
    *st1 = _mm_blend_epi16(cdgh, tmp, 0xF0); /* C D G H */
}

/* the halves back into s[0..7] */
NI_INLINE void ni_store(__m128i st0, __m128i st1, uint32_t s[8]) {
    __m128i tmp = _mm_shuffle_epi32(st0, 0x1B); /* F E B A */
    st1 = _mm_shuffle_epi32(st1, 0xB1);         /* D C H G */
    _mm_storeu_si128((__m128i *)&s[0], _mm_blend_epi16(tmp, st1, 0xF0)); /* D C B A */
    _mm_storeu_si128((__m128i *)&s[4], _mm_alignr_epi8(st1, tmp, 8));    /* H G F E */
}

/* w[j % 4] for step j of the block at p, plus the step's constants */
NI_INLINE __m128i ni_words(__m128i w[4], const uint8_t *p, int j) {
    const __m128i swap = _mm_set_epi64x(0x0c0d0e0f08090a0bULL, 0x0405060700010203ULL);
    if (j < 4) {
        w[j] = _mm_shuffle_epi8(_mm_loadu_si128((const __m128i *)(p + 16 * j)), swap);
    } else {
        __m128i m = _mm_sha256msg1_epu32(w[j & 3], w[(j + 1) & 3]);
        m = _mm_add_epi32(m, _mm_alignr_epi8(w[(j + 3) & 3], w[(j + 2) & 3], 4));
        w[j & 3] = _mm_sha256msg2_epu32(m, w[(j + 3) & 3]);
    }
    return _mm_add_epi32(w[j & 3], _mm_loadu_si128((const __m128i *)&K256[4 * j]));
}

/* the four rounds of one step */
NI_INLINE void ni_rounds(__m128i *st0, __m128i *st1, __m128i msg) {
    *st1 = _mm_sha256rnds2_epu32(*st1, *st0, msg);
    *st0 = _mm_sha256rnds2_epu32(*st0, *st1, _mm_shuffle_epi32(msg, 0x0E));
}

NI static void compress_ni(uint32_t s[8], const uint8_t *p, size_t blocks) {
    __m128i st0, st1;
    ni_load(s, &st0, &st1);
    for (; blocks; blocks--, p += 64) {
        __m128i save0 = st0, save1 = st1, w[4];
        for (int j = 0; j < 16; j++) ni_rounds(&st0, &st1, ni_words(w, p, j));
        st0 = _mm_add_epi32(st0, save0);
        st1 = _mm_add_epi32(st1, save1);
    }
    ni_store(st0, st1, s);
}

/* compress_ni for two independent messages at once: their rounds interleave, so each
 * waits less on the latency of sha256rnds2 (two key chains: 123 ns a key pair on the
 * development VM's EPYC, against 198 ns one chain after the other). */
NI static void compress_ni2(uint32_t sa[8], const uint8_t *pa, uint32_t sb[8], const uint8_t *pb,
                            size_t blocks) {
    __m128i a0, a1, b0, b1;
    ni_load(sa, &a0, &a1);
    ni_load(sb, &b0, &b1);
    for (; blocks; blocks--, pa += 64, pb += 64) {
        __m128i save_a0 = a0, save_a1 = a1, save_b0 = b0, save_b1 = b1, wa[4], wb[4];
        for (int j = 0; j < 16; j++) {
            __m128i ma = ni_words(wa, pa, j), mb = ni_words(wb, pb, j);
            ni_rounds(&a0, &a1, ma);
            ni_rounds(&b0, &b1, mb);
        }
        a0 = _mm_add_epi32(a0, save_a0);
        a1 = _mm_add_epi32(a1, save_a1);
        b0 = _mm_add_epi32(b0, save_b0);
        b1 = _mm_add_epi32(b1, save_b1);
    }
    ni_store(a0, a1, sa);
    ni_store(b0, b1, sb);
}
static int cpu_has_sha(void) {
    unsigned a, b, c, d;
    if (!__get_cpuid(1, &a, &b, &c, &d) || !(c & bit_SSE4_1) || !(c & bit_SSSE3)) return 0;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return 0;
    return (b >> 29) & 1;
}
#endif

typedef void (*compress_fn)(uint32_t *, const uint8_t *, size_t);
typedef void (*compress2_fn)(uint32_t *, const uint8_t *, uint32_t *, const uint8_t *, size_t);
static void compress2_portable(uint32_t *sa, const uint8_t *pa, uint32_t *sb, const uint8_t *pb,
                               size_t blocks) {
    compress_portable(sa, pa, blocks);
    compress_portable(sb, pb, blocks);
}
static compress_fn compress = compress_portable;
static compress2_fn compress2 = compress2_portable;
static int have_ni = 0;

/* SHA-256's padding after `len` bytes in `buf` (room for len + 72); the blocks to hash. */
static size_t pad(uint8_t *buf, size_t len) {
    size_t total = (len + 9 + 63) / 64 * 64;
    buf[len] = 0x80;
    memset(buf + len + 1, 0, total - len - 9);
    uint64_t bits = (uint64_t)len * 8;
    for (int i = 0; i < 8; i++) buf[total - 1 - i] = (uint8_t)(bits >> (8 * i));
    return total / 64;
}

static void digest(const uint32_t s[8], uint8_t out[32]) {
    for (int i = 0; i < 8; i++) {
        out[4 * i] = (uint8_t)(s[i] >> 24);
        out[4 * i + 1] = (uint8_t)(s[i] >> 16);
        out[4 * i + 2] = (uint8_t)(s[i] >> 8);
        out[4 * i + 3] = (uint8_t)s[i];
    }
}

/* SHA-256 of `len` bytes already in `buf`, which has room for the padding (len + 72). */
static void sha256_padded(uint8_t *buf, size_t len, uint8_t out[32]) {
    size_t blocks = pad(buf, len);
    uint32_t s[8];
    memcpy(s, H0, sizeof s);
    compress(s, buf, blocks);
    digest(s, out);
}

/* sha256_padded of two messages of the same length at once (compress2). */
static void sha256_padded2(uint8_t *a, uint8_t *b, size_t len, uint8_t out_a[32],
                           uint8_t out_b[32]) {
    size_t blocks = pad(a, len);
    pad(b, len);
    uint32_t sa[8], sb[8];
    memcpy(sa, H0, sizeof sa);
    memcpy(sb, H0, sizeof sb);
    compress2(sa, a, sb, b, blocks);
    digest(sa, out_a);
    digest(sb, out_b);
}

int kvcm_chain_into(const uint8_t *parent, const uint8_t *data, Py_ssize_t step,
                    Py_ssize_t count, PyObject *list, Py_ssize_t at) {
    if (!count) return 0;
    uint8_t *buf = PyMem_Malloc((size_t)step + 32 + 72);
    if (!buf) {
        PyErr_NoMemory();
        return -1;
    }
    memcpy(buf, parent, 32);
    for (Py_ssize_t i = 0; i < count; i++) {
        /* the previous key is already in buf[0:32]; the padding overwrote only what follows */
        memcpy(buf + 32, data + i * step, (size_t)step);
        PyObject *key = PyBytes_FromStringAndSize(NULL, 32);
        if (!key) {
            PyMem_Free(buf);
            return -1;
        }
        uint8_t *out = (uint8_t *)PyBytes_AS_STRING(key);
        sha256_padded(buf, (size_t)step + 32, out);
        memcpy(buf, out, 32);
        PyList_SET_ITEM(list, at + i, key);
    }
    PyMem_Free(buf);
    return 0;
}

int kvcm_chain2_into(const uint8_t *parent_a, const uint8_t *data_a, Py_ssize_t count_a,
                     PyObject *list_a, const uint8_t *parent_b, const uint8_t *data_b,
                     Py_ssize_t count_b, PyObject *list_b, Py_ssize_t step) {
    Py_ssize_t both = count_a < count_b ? count_a : count_b;
    if (!both) {
        if (kvcm_chain_into(parent_a, data_a, step, count_a, list_a, 0) < 0) return -1;
        return kvcm_chain_into(parent_b, data_b, step, count_b, list_b, 0);
    }
    size_t size = (size_t)step + 32 + 72;
    uint8_t *a = PyMem_Malloc(2 * size), *b = a ? a + size : NULL;
    if (!a) {
        PyErr_NoMemory();
        return -1;
    }
    memcpy(a, parent_a, 32);
    memcpy(b, parent_b, 32);
    for (Py_ssize_t i = 0; i < both; i++) {
        memcpy(a + 32, data_a + i * step, (size_t)step);
        memcpy(b + 32, data_b + i * step, (size_t)step);
        PyObject *ka = PyBytes_FromStringAndSize(NULL, 32);
        PyObject *kb = ka ? PyBytes_FromStringAndSize(NULL, 32) : NULL;
        if (!kb) {
            Py_XDECREF(ka);
            PyMem_Free(a);
            return -1;
        }
        uint8_t *out_a = (uint8_t *)PyBytes_AS_STRING(ka), *out_b = (uint8_t *)PyBytes_AS_STRING(kb);
        sha256_padded2(a, b, (size_t)step + 32, out_a, out_b);
        memcpy(a, out_a, 32);
        memcpy(b, out_b, 32);
        PyList_SET_ITEM(list_a, i, ka);
        PyList_SET_ITEM(list_b, i, kb);
    }
    /* the longer chain's rest, from its last key (in a or b) */
    int bad = kvcm_chain_into(a, data_a + both * step, step, count_a - both, list_a, both) < 0 ||
              kvcm_chain_into(b, data_b + both * step, step, count_b - both, list_b, both) < 0;
    PyMem_Free(a);
    return bad ? -1 : 0;
}

/* sha256_chain2(parent_a, data_a, parent_b, data_b, block_bytes) -> (keys_a, keys_b):
 * sha256_chain of each, the two chains hashed together (tests). */
PyObject *kvcm_sha256_chain2(PyObject *self, PyObject *args) {
    Py_buffer pa, da, pb, db;
    Py_ssize_t step;
    if (!PyArg_ParseTuple(args, "y*y*y*y*n", &pa, &da, &pb, &db, &step)) return NULL;
    PyObject *ka = NULL, *kb = NULL, *out = NULL;
    if (pa.len != 32 || pb.len != 32 || step < 1) {
        PyErr_SetString(PyExc_ValueError, "parents must be 32 bytes and block_bytes >= 1");
        goto done;
    }
    if (!(ka = PyList_New(da.len / step)) || !(kb = PyList_New(db.len / step)) ||
        kvcm_chain2_into(pa.buf, da.buf, da.len / step, ka, pb.buf, db.buf, db.len / step, kb,
                         step) < 0)
        goto done;
    out = PyTuple_Pack(2, ka, kb);
done:
    Py_XDECREF(ka);
    Py_XDECREF(kb);
    PyBuffer_Release(&pa);
    PyBuffer_Release(&da);
    PyBuffer_Release(&pb);
    PyBuffer_Release(&db);
    return out;
}

/* sha256_chain(parent, data, block_bytes) -> list of the 32-byte keys of data's full blocks:
 * key_i = SHA-256(key_{i-1} || block_i), key_{-1} = parent. */
PyObject *kvcm_sha256_chain(PyObject *self, PyObject *args) {
    Py_buffer parent, data;
    Py_ssize_t step;
    if (!PyArg_ParseTuple(args, "y*y*n", &parent, &data, &step)) return NULL;
    PyObject *keys = NULL;
    if (parent.len != 32 || step < 1) {
        PyErr_SetString(PyExc_ValueError, "parent must be 32 bytes and block_bytes >= 1");
        goto done;
    }
    Py_ssize_t count = data.len / step;
    keys = PyList_New(count);
    if (keys && kvcm_chain_into(parent.buf, data.buf, step, count, keys, 0) < 0) Py_CLEAR(keys);
done:
    PyBuffer_Release(&parent);
    PyBuffer_Release(&data);
    return keys;
}

/* sha256(data) -> its digest, with whichever compression is selected (tests). */
PyObject *kvcm_sha256(PyObject *self, PyObject *args) {
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
PyObject *kvcm_use_sha_extensions(PyObject *self, PyObject *arg) {
    int on = PyObject_IsTrue(arg);
    if (on < 0) return NULL;
    compress = compress_portable;
    compress2 = compress2_portable;
#ifdef KVCM_X86
    if (on && have_ni) {
        compress = compress_ni;
        compress2 = compress_ni2;
    }
#endif
    return PyBool_FromLong(compress != compress_portable);
}

int kvcm_sha_init(void) {
#ifdef KVCM_X86
    have_ni = cpu_has_sha();
    if (have_ni) {
        compress = compress_ni;
        compress2 = compress_ni2;
    }
#endif
    return have_ni;
}

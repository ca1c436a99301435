/* Token ids as int32 little-endian bytes, range checked (kvcm.hashing.token_bytes), and a
 * step's handles as int64 bytes (kvcm.columnar_parse). */
#include "native.h"

/* ids (a list or tuple) as int32 LE bytes; a new reference, NULL with an error set, or
 * Py_None (borrowed, not incremented) when ids is not a list or tuple of ints in [0, 2**31). */
PyObject *kvcm_packed(PyObject *seq) {
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
PyObject *kvcm_pack_tokens(PyObject *self, PyObject *seq) {
    PyObject *out = kvcm_packed(seq);
    return out == Py_None ? Py_NewRef(Py_None) : out;
}

/* pack_token_lists(lists) -> [bytes, ...] for a list of id lists (a step's commits), or None
 * when one of them is not packable (the caller then checks each one to name the error). */
PyObject *kvcm_pack_token_lists(PyObject *self, PyObject *seq) {
    if (!PyList_CheckExact(seq) && !PyTuple_CheckExact(seq)) Py_RETURN_NONE;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    PyObject **items = PySequence_Fast_ITEMS(seq);
    PyObject *out = PyList_New(n);
    if (!out) return NULL;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *one = kvcm_packed(items[i]);
        if (one == NULL || one == Py_None) {
            Py_DECREF(out);
            return one == NULL ? NULL : Py_NewRef(Py_None);
        }
        PyList_SET_ITEM(out, i, one);
    }
    return out;
}

/* pack_handles(handles) -> int64 bytes (native order) for a list or tuple of ints (exactly
 * int: no bool) in int64's range, or None for anything else (the caller's numpy path then
 * judges it): a step's handle list without numpy inferring a dtype per item. */
PyObject *kvcm_pack_handles(PyObject *self, PyObject *seq) {
    if (!PyList_CheckExact(seq) && !PyTuple_CheckExact(seq)) Py_RETURN_NONE;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    PyObject **items = PySequence_Fast_ITEMS(seq);
    PyObject *out = PyBytes_FromStringAndSize(NULL, n * 8);
    if (!out) return NULL;
    int64_t *p = (int64_t *)PyBytes_AS_STRING(out);
    for (Py_ssize_t i = 0; i < n; i++) {
        int overflow;
        if (!PyLong_CheckExact(items[i])) goto refuse;
        long long x = PyLong_AsLongLongAndOverflow(items[i], &overflow);
        if (overflow) goto refuse;
        p[i] = (int64_t)x;
    }
    return out;
refuse:
    Py_DECREF(out);
    Py_RETURN_NONE;
}

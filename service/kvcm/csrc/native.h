/* kvcm._native: the declarations its files share (docs/native.md). */
#ifndef KVCM_NATIVE_H
#define KVCM_NATIVE_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

/* sha256.c: block keys */
int kvcm_sha_init(void); /* selects the SHA extensions if the CPU has them; returns whether */
PyObject *kvcm_sha256_chain(PyObject *self, PyObject *args);
PyObject *kvcm_sha256(PyObject *self, PyObject *args);
PyObject *kvcm_use_sha_extensions(PyObject *self, PyObject *arg);
/* The chained keys of `count` blocks of `step` bytes at `data` (key_{-1}: the 32 bytes at
 * `parent`) into list[at:at + count], whose items there are unset (NULL); 0, or -1 with an
 * error (the items set stay owned by the list). */
int kvcm_chain_into(const uint8_t *parent, const uint8_t *data, Py_ssize_t step,
                    Py_ssize_t count, PyObject *list, Py_ssize_t at);
/* Two chains at once (each as kvcm_chain_into at 0), their keys hashed in pairs while both
 * have blocks left (the SHA extensions' rounds of two messages interleave). */
int kvcm_chain2_into(const uint8_t *parent_a, const uint8_t *data_a, Py_ssize_t count_a,
                     PyObject *list_a, const uint8_t *parent_b, const uint8_t *data_b,
                     Py_ssize_t count_b, PyObject *list_b, Py_ssize_t step);
PyObject *kvcm_sha256_chain2(PyObject *self, PyObject *args);

/* tokens.c: token ids as int32 bytes, handles as int64 bytes. kvcm_packed: a list or tuple
 * of ints in [0, 2**31) as int32 LE bytes (a new reference), Py_None (borrowed) for anything
 * else, NULL with an error. */
PyObject *kvcm_packed(PyObject *seq);
PyObject *kvcm_pack_tokens(PyObject *self, PyObject *seq);
PyObject *kvcm_pack_token_lists(PyObject *self, PyObject *seq);
PyObject *kvcm_pack_handles(PyObject *self, PyObject *seq);

/* decode.c: a decode step's batch of extends */
PyObject *kvcm_decode_plan(PyObject *self, PyObject *args);
PyObject *kvcm_decode_commit(PyObject *self, PyObject *args);
PyObject *kvcm_live_rows(PyObject *self, PyObject *args);
PyObject *kvcm_decode_take(PyObject *self, PyObject *args);
PyObject *kvcm_decode_release(PyObject *self, PyObject *args);

/* context.c: the coordinator's arrays read once */
PyObject *kvcm_context(PyObject *self, PyObject *t);

/* rows.c: a new request's blocks, a freed request's blocks */
PyObject *kvcm_row_grow(PyObject *self, PyObject *args);
PyObject *kvcm_row_release(PyObject *self, PyObject *args);

/* hits.c: a new request's prefix hit and the blocks past it */
PyObject *kvcm_row_start(PyObject *self, PyObject *args);

/* allocate.c: a step's allocate of the usual kind */
PyObject *kvcm_allocate_one(PyObject *self, PyObject *args);
PyObject *kvcm_prompt_keys(PyObject *self, PyObject *args);

/* commits.c: a step's commits and the blocks they fill */
PyObject *kvcm_commit_run(PyObject *self, PyObject *args);

/* slots.c: slot mappings of host page tables; the fused CUDA step launched */
PyObject *kvcm_map_slots(PyObject *self, PyObject *args);
PyObject *kvcm_step_launch(PyObject *self, PyObject *args);

/* ring.c: the step rings' request words watched */
PyObject *kvcm_ring_watch(PyObject *self, PyObject *args);

#endif

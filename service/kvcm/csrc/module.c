/* kvcm._native: the step path's inner loops in C (docs/native.md).
 *
 * Optional: kvcm runs the same logic in numpy when this module is not built (no compiler)
 * or KVCM_NATIVE=0, and the tests compare the two (tests/test_native.py).
 *
 * - sha256_chain: the prefix-reuse key chain (kvcm.hashing.chain_keys), SHA-256 with the
 *   x86 SHA extensions when the CPU has them, else a portable C implementation (sha256.c);
 *   sha256_chain2: two chains hashed together (a step's allocates key their prompts so).
 * - pack_tokens, pack_token_lists: a prompt's token ids, or a step's commits, as int32
 *   little-endian bytes; pack_handles: a step's handle list as int64 bytes (tokens.c).
 * - decode_plan, decode_commit: a batch of extends by handle (a decode step) planned in one
 *   pass over the rows, its new blocks taken (decode_take) and its counters written in one
 *   more (kvcm.native_step, decode.c); live_rows: whether a batch's handles are live and
 *   distinct (a step's commits).
 * - row_grow, row_release: one row's new blocks (those past a prefix hit the Python path
 *   placed) and a freed row's, one call each (kvcm.native_rows, rows.c).
 * - row_start: a new request's prefix hit and the blocks past it, in one call (hits.c).
 * - allocate_one: a step's allocate of the usual kind, its records included; prompt_keys:
 *   a step's prompts keyed two at a time for it (allocate.c).
 * - commit_run: a step's commits and the blocks they fill (commits.c).
 * - map_slots: the slot mapping of a step's tokens on the CPU's page tables, from explicit
 *   items or a decode batch's handles; step_launch: those items packed into pinned memory
 *   and the fused CUDA step kernel launched on them, through driver entry points the caller
 *   resolved (slots.c).
 * - ring_watch: busy-poll mode's watch of the step rings for a client's next frame (ring.c).
 *
 * This file holds the module's method table; native.h the declarations the files share,
 * context.h (context.c) the coordinator's arrays and free queues as they read them.
 *
 * Arrays come in through the buffer protocol (numpy arrays, C-contiguous, int64 unless
 * named otherwise), so the module builds without numpy's headers.
 */
#include "native.h"

static PyMethodDef methods[] = {
    {"sha256_chain", kvcm_sha256_chain, METH_VARARGS, "Chained SHA-256 keys of full blocks."},
    {"sha256_chain2", kvcm_sha256_chain2, METH_VARARGS, "Two key chains hashed together."},
    {"sha256", kvcm_sha256, METH_VARARGS, "SHA-256 of bytes (the selected implementation)."},
    {"use_sha_extensions", kvcm_use_sha_extensions, METH_O, "Select the SHA extensions or not."},
    {"pack_tokens", kvcm_pack_tokens, METH_O, "Token ids as int32 LE bytes, or None."},
    {"pack_token_lists", kvcm_pack_token_lists, METH_O, "pack_tokens of each list, or None."},
    {"pack_handles", kvcm_pack_handles, METH_O, "Handles as int64 bytes, or None."},
    {"decode_plan", kvcm_decode_plan, METH_VARARGS, "Plan a batch of extends by handle."},
    {"decode_commit", kvcm_decode_commit, METH_VARARGS, "Write a planned batch's counters."},
    {"context", kvcm_context, METH_O, "The decode context's arrays, read once."},
    {"live_rows", kvcm_live_rows, METH_VARARGS, "Rows of live, distinct handles, or False."},
    {"decode_take", kvcm_decode_take, METH_VARARGS, "A planned batch's new blocks taken."},
    {"decode_release", kvcm_decode_release, METH_VARARGS, "A planned batch's window releases."},
    {"row_grow", kvcm_row_grow, METH_VARARGS, "One row's new blocks (no window releasing)."},
    {"row_release", kvcm_row_release, METH_VARARGS, "Free every block of a row."},
    {"commit_run", kvcm_commit_run, METH_VARARGS, "A step's commits and their publishing."},
    {"row_start", kvcm_row_start, METH_VARARGS, "A new row's prefix hit and blocks."},
    {"allocate_one", kvcm_allocate_one, METH_VARARGS, "A step's allocate of the usual kind."},
    {"prompt_keys", kvcm_prompt_keys, METH_VARARGS, "A step's prompts keyed two at a time."},
    {"map_slots", kvcm_map_slots, METH_VARARGS, "Slot mappings of host page tables."},
    {"step_launch", kvcm_step_launch, METH_VARARGS, "The fused CUDA step, packed and launched."},
    {"ring_watch", kvcm_ring_watch, METH_VARARGS, "Watch step rings for a posted frame."},
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "_native",
    .m_doc = "kvcm's step path in C (docs/native.md).",
    .m_size = -1,
    .m_methods = methods,
};

PyMODINIT_FUNC PyInit__native(void) {
    int have_ni = kvcm_sha_init();
    PyObject *m = PyModule_Create(&module);
    /* API: the interface version kvcm.native expects (bumped when a function's arguments or
     * results change; a stale build is then left unused, not called wrongly). */
    if (m && (PyModule_AddIntConstant(m, "HAVE_SHA_EXTENSIONS", have_ni) < 0 ||
              PyModule_AddIntConstant(m, "API", 12) < 0))
        Py_CLEAR(m);
    return m;
}

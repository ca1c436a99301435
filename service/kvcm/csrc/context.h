/* The coordinator's arrays as the C core reads them: int buffers, the decode context
 * (kvcm.native_step.NativeDecode.context) and a free queue (kvcm.block_pool.BlockPool). */
#ifndef KVCM_CONTEXT_H
#define KVCM_CONTEXT_H

#include "native.h"

#define MAX_GROUPS 64
#define ROW_MASK 0xFFFFFFFFLL
#define MAX_COUNT 0x7FFFFFFFLL /* kvcm.counts.MAX_COUNT */
#define MAX_SERIAL 0x7FFFFFFFLL /* kvcm.request_rows.MAX_SERIAL */

typedef struct {
    Py_buffer view;
    void *p;
    Py_ssize_t n;
} Buf;

#define I64P(b) ((int64_t *)(b).p)
#define I32P(b) ((int32_t *)(b).p)

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

int buf_get(PyObject *obj, Buf *a, Py_ssize_t itemsize, int writable);
void buf_release(Buf *a);

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

/* Reads the context; ``writable``: the tables and refs too (the row ops write them). */
int ctx_get(PyObject *t, Ctx *c, int writable);
void ctx_release(Ctx *c);

/* The context of a call: a context object's (kvcm_context, its buffers held while it
 * lives), or the tuple's read into ``local``; NULL with an error. ctx_close releases what
 * ctx_open read into ``local``. */
Ctx *ctx_open(PyObject *o, Ctx *local, int writable);
void ctx_close(Ctx *c, Ctx *local);
PyObject *kvcm_context(PyObject *self, PyObject *t);

/* A tuple of Py_ssize_t counts (a new reference, NULL with an error). */
PyObject *counts_tuple(const Py_ssize_t *k, int n);

/* A BlockPool's ring, positions and counters (its _ring, _pos, _head, _len, _count), read by
 * pool_get. A call that changes the queue stages the new counters first (pool_stage: the
 * only step that can fail, taken before any write) and sets them once it has written
 * (pool_commit). */
typedef struct {
    PyObject *obj;
    Buf ring, pos;
    int64_t head, len, count;
    PyObject *staged[3];
} Pool;

int pool_get(PyObject *obj, Pool *p);
int pool_stage(Pool *p, int64_t head, int64_t len, int64_t count);
int pool_commit(Pool *p);
void pool_release(Pool *p);

/* Each pool group's free queue (a tuple of BlockPool) into p[], *got counting those read
 * (the caller releases them); each layer group's sinks (a tuple of ints) into out. -1 with
 * an error. */
int pools_get(PyObject *t, const Ctx *c, Pool *p, int *got);
/* pool_commit of the first n queues, each tried (-1 if one failed); pool_release of the
 * first n. */
int pools_commit(Pool *p, int n);
void pools_release(Pool *p, int n);
int sinks_get(PyObject *t, const Ctx *c, int64_t *out);

/* rows.c: a row's new blocks, in steps that row_grow and row_start share. grow_plan: the
 * blocks each layer group adds (add) and each pool group needs (need, added to) for a row
 * of `history` tokens holding current[g] blocks per group to hold history + nt + la; 1
 * when the numpy path must run it. grow_stage: each queue's new counters, after the spans
 * the pops will read and `claimed` slots a hit took out of the middle (0; 1 for a queue
 * out of shape; -1 with an error). grow_write: the pops, cells, references and counters. */
int64_t pool_span(const Pool *p, int64_t k, Py_ssize_t slots);
void pool_pop(Pool *p, int64_t k, int32_t *out);
void pool_push(Pool *p, int32_t slot);
int grow_plan(const Ctx *c, int64_t row, int64_t history, const int64_t *current, int64_t nt,
              int64_t la, Py_ssize_t *add, int64_t *need);
int grow_stage(Pool *p, int pools, const int64_t *need, const int64_t *claimed, const Ctx *c);
void grow_write(Ctx *c, Pool *p, int64_t row, int64_t history, const int64_t *current,
                const Py_ssize_t *add, int64_t nt, int64_t la);

/* hits.c: a new request's hit and the blocks past it, in steps that row_start and
 * allocate_one share. start_plan: the hit found (the leading keys every group's scope
 * holds, at most cap), the request's fit checked, the hit's unheld slots tombstoned in
 * their queues and the queues' new counters staged, and whether a slot the grow will take
 * caches a block (`cached`: each pool group's flags); 0, or 1 for the numpy path's to run,
 * 2 for a request that does not fit (nothing changed, nothing held), -1 with an error.
 * start_undo puts the tombstones back (before start_write only); start_write writes the
 * hit and the grow; start_free frees what a planned start holds. cached_get reads the
 * flags (*got counts those read, for buf_release). */
typedef struct {
    Py_ssize_t b, nmarked;
    int32_t *slots;
    int64_t *marked;
    int64_t claimed[MAX_GROUPS], need[MAX_GROUPS], current[MAX_GROUPS], history;
    Py_ssize_t add[MAX_GROUPS];
    int evict;
} Start;

int cached_get(PyObject *t, const Ctx *c, Buf *out, int *got);
int start_plan(const Ctx *c, Pool *p, const Buf *cached, int64_t row, PyObject *keys,
               PyObject *scopes, int64_t cap, int64_t nt, int64_t la, Start *s);
void start_undo(const Ctx *c, Pool *p, Start *s);
void start_write(Ctx *c, Pool *p, const int64_t *sinks, int64_t row, int64_t nt, int64_t la,
                 const Start *s);
void start_free(Start *s);

#endif

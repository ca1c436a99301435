"""A new request's blocks and a freed request's blocks in C (``kvcm._native``'s ``row_grow``
and ``row_release``), with the numpy path's effects in the numpy path's order
(tests/test_native.py compares the two).

An allocate without a prefix hit gives a free row its blocks, and a free gives every block
back: each is one C call instead of some twenty numpy calls (the load test's step with two
replacements spent most of its time there). The C core takes and gives back the slots and
writes the tables, references and counters; the coordinator still evicts what the taken
slots cached (to the host tier first, if there is one) and logs the device-table edits, from
the table cells the call wrote.

Only for coordinators without context parallelism (``Coordinator.plain``); otherwise, and
when the core is not built, the coordinator's own ``grow_one`` and ``release_row`` run.

Example (tokens_per_block 16, one layer group, free queue [4 9 2]): ``grow_new(m, row, 20,
0)`` takes [4 9] for table[0][row, :2] and returns 2; ``release(m, row)`` gives them back
tail first, so the queue is [2 9 4].
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from . import native

if TYPE_CHECKING:
    from .manager import KVCacheManager


def grow_new(m: KVCacheManager, row: int, num_tokens: int, lookahead: int) -> int:
    """``Coordinator.grow_one`` of a free row (a new request without a prefix hit): the
    block positions added, summed over layer groups. Raises ``OutOfBlocks`` (from the numpy
    path, which the C core defers to) with nothing changed when the pools cannot hold it."""
    c = m._coord
    core = native.core
    if core is None or not c.plain:
        return c.grow_one(row, num_tokens, lookahead)
    context, pools, sinks = m._native_decode.row_args(core, m)
    k = core.row_grow(row, num_tokens, lookahead, context, pools, sinks)
    if type(k) is not int:  # None: it does not fit (numpy names it); False: numpy's to run
        return c.grow_one(row, num_tokens, lookahead)
    edits = c.edits
    for g, pg in enumerate(c.group_pool):
        slots = c.tables[g][row, :k].copy()  # the edit log keeps it
        c.evict_taken(pg, slots)
        if edits is not None:
            edits.append((g, np.full(k, row), np.arange(k), slots))
    c.ops_since_take += 1
    return k * len(c.group_pool)


def release(m: KVCacheManager, row: int) -> None:
    """``Coordinator.release_row``: every block of the row back, tail first."""
    c = m._coord
    core = native.core
    if core is None or not c.plain:
        c.release_row(row)
        return
    context, pools, sinks = m._native_decode.row_args(core, m)
    cleared = core.row_release(row, context, pools, sinks)
    for _ in pools:  # an int: that pool group's queue needs compacting first (once each)
        if type(cleared) is not int:
            break
        pools[cleared].compact()
        cleared = core.row_release(row, context, pools, sinks)
    if type(cleared) is not tuple:  # False, or still asking: the numpy path's to run
        c.release_row(row)
        return
    if c.edits is not None:
        for g, k in enumerate(cleared):
            if k:
                c.edits.append((g, np.full(k, row), np.arange(k), None))
    c.ops_since_take += 1

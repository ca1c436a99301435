"""A new request's blocks, one row's new blocks and a freed row's blocks in C
(``kvcm._native``'s ``row_start``, ``row_grow`` and ``row_release``), with the numpy path's
effects in the numpy path's order (tests/test_native_rows.py compares the two).

An allocate gives its row blocks (past its prefix hit, if any), and a free gives every
block back: each is one C call instead of some twenty numpy calls (the load test's step with
two replacements spent most of its time there). The C core takes and gives back the slots
and writes the tables, references and counters; the coordinator still evicts what the taken
slots cached (to the host tier first, if there is one) and logs the device-table edits, from
the table cells the call wrote. A single extend keeps the coordinator's ``grow_one``, whose
usual case (no new block) is a few counter writes, cheaper than the call.

Only for coordinators without context parallelism (``Coordinator.plain``); otherwise, and
when the core is not built, the coordinator's own ``grow_one`` and ``release_row`` run.

A grow whose sliding windows would release blocks keeps the numpy path, which releases before
it takes (an allocate's never does: a prefix hit's row starts at the window's first needed
block).

Example (tokens_per_block 16, one layer group, free queue [4 9 2]): ``grow(m, row, 20, 0)``
on a free row takes [4 9] for table[0][row, :2]; ``release(m, row)`` gives them back tail
first, so the queue is [2 9 4].
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from . import native
from .prefix_cache import hit_cap

if TYPE_CHECKING:
    from .components import Components
    from .coordinator import Coordinator


def grow(m: Components, row: int, num_tokens: int, lookahead: int) -> None:
    """``Coordinator.grow_one`` (its callers here read the row's blocks, not the count it
    returns). In C unless a sliding window would release blocks (the numpy path then runs).
    Raises
    ``OutOfBlocks`` (from the numpy path, which the C core defers to) with nothing changed
    when the pools cannot hold it."""
    c = m.coord
    core = native.core
    if core is None or not c.plain:
        c.grow_one(row, num_tokens, lookahead)
        return
    context, pools, _ = m.native_decode.row_args(core, m)
    added = core.row_grow(row, num_tokens, lookahead, context, pools)
    if type(added) is not tuple:  # None: it does not fit (numpy names it); False: numpy's
        c.grow_one(row, num_tokens, lookahead)
        return
    edits = c.edits
    for g, k in enumerate(added):
        if k:
            end = c.num_blocks[g].item(row)
            slots = c.tables[g][row, end - k : end].copy()  # the edit log keeps it
            c.evict_taken(c.group_pool[g], slots)
            if edits is not None:
                edits.append((g, np.full(k, row), np.arange(end - k, end), slots))
    c.ops_since_take += 1


def start(
    m: Components, row: int, root: bytes, keys: list[bytes], num_tokens: int, lookahead: int
) -> int | None:
    """A new request's blocks in its free ``row``, in C (``row_start``): the longest cached
    prefix of its prompt's ``keys`` (at most num_tokens - 1 tokens), then new blocks for the
    rest and ``lookahead``; the coordinator evicts what the taken slots cached and logs the
    table edits. Returns the hit in blocks. None, with nothing changed, when the Python path
    must place them: a prompt whose hit the C core cannot find (layer groups with a window or
    without reuse, a host tier, whose onboarding comes first, or state layers, whose
    checkpoints cut hits), context-parallel ranks, no C core, or a request that does not fit
    (Python names the error).

    Example (tokens_per_block 16, one layer group, blocks k0 and k1 cached in slots 7 and 3,
    free queue [8 2 5]): a 40-token prompt with keys [k0 k1] and lookahead 8 gets [7 3] as
    its first two blocks and [8] as its third (48 tokens); returns 2.
    """
    core = native.core
    c = m.coord
    decode = m.native_decode
    if core is None or not c.plain or (keys and not decode.hits_in_c(m)):
        return None
    cap = hit_cap(len(keys), num_tokens, c.tokens_per_block) if keys else 0
    scopes = tuple([index.get(root) for index in c.cache.index]) if cap > 0 else ()
    context, pools, sinks = decode.row_args(core, m)
    done = core.row_start(
        row, keys, scopes, cap, num_tokens, lookahead, context, pools, sinks, decode.cached(m)
    )
    if type(done) is not tuple:  # None: it does not fit; False: numpy's to run
        return None
    hit, added, evict = done
    placed(c, row, hit, added, evict)
    return hit


def placed(c: Coordinator, row: int, hit: int, added: tuple[int, ...], evict: bool) -> None:
    """After the C core placed a new request's hit of ``hit`` blocks and ``added`` blocks
    past it in ``row`` (``row_start``, ``allocate_one``): the table edits logged and, where
    a taken slot cached a block (``evict``), the evictions, as the coordinator's own path
    does."""
    edits = c.edits
    if hit and edits is not None:
        for g in range(len(c.tables)):
            slots = c.tables[g][row, :hit].copy()  # the edit log keeps it
            edits.append((g, np.full(hit, row), np.arange(hit), slots))
    for g, k in enumerate(added):
        if k and (evict or edits is not None):  # else nothing to evict or log
            c.taken_in_c(g, np.full(k, row), np.arange(hit, hit + k), evict)
    c.ops_since_take += 2 if hit else 1  # the hit and the grow, as the Python path counts


def release(m: Components, row: int) -> None:
    """``Coordinator.release_row``: every block of the row back, tail first."""
    c = m.coord
    core = native.core
    if core is None or not c.plain:
        c.release_row(row)
        return
    context, pools, sinks = m.native_decode.row_args(core, m)
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

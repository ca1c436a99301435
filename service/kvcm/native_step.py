"""A decode step's batch of extends in C (``kvcm._native``): the numpy path's plan in one
pass over the rows, the same blocks, tables, edits and counters (tests/test_native.py).

Only for coordinators without context parallelism (``Coordinator.plain``), whose plans have
no per-class part. Planning is, for each row in order: the cells a sliding window releases,
from the row's released run's end up to ``(history + 1 - window) // tokens_per_block``, and
the block positions from its current count up to ceil(capacity / tokens_per_block), in every
layer group. Only released pages a row holds alone count as room for the rows after it (a
prefix hit's page that others hold frees nothing), as in the numpy plan. The cells a window
released are given back by the coordinator (``unref``, ``set_cells``); the new blocks are then
taken and written in C (``decode_take``), and Python evicts what the taken slots cached (to
the host tier first, if there is one) and logs the device-table edits.

Example (tokens_per_block 16, one full-attention layer group): handles of rows 3 and 8, at
16 and 20 tokens, +1 token each. The plan gives row 3's block position 1 (17 tokens need 2
blocks), nothing for row 8; one slot is taken, written at table[0][3, 1], and the counters
become 17 and 21 tokens, with 2 blocks each; the items' new blocks are [1, 0].
"""

from __future__ import annotations

import contextlib
import copy
from types import ModuleType
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

if TYPE_CHECKING:
    from kvcm_client.models import ManagerConfig

    from .coordinator import Coordinator
    from .host_tier import HostTier
    from .request_table import RequestTable
    from .state_pools import StatePools


class Components(Protocol):
    """What the C decode path reads of a manager's components (``kvcm.components``, which
    is above this module: a protocol, not an import)."""

    config: ManagerConfig
    coord: Coordinator
    requests: RequestTable
    host: HostTier | None
    state: StatePools | None
    windows: list[tuple[int | None, int]]


#: Planned new (or released) blocks per row of the manager that the work arrays hold at
#: first: a decode step has at most one per row and layer group; a batch with more (a chunked
#: prefill's extends) grows them.
_PER_ROW = 2


def _free(c: Coordinator) -> tuple[int, ...]:
    """Each pool's free blocks, as ``decode_plan`` reads them (a list into the tuple: a
    generator costs 0.3 us more)."""
    return tuple([p.num_free for p in c.pools])


class NativeDecode:
    """One manager's C decode path: its work arrays (no allocation per step) and the
    coordinator's arrays as the C core reads them."""

    __slots__ = (
        "_arrays",
        "_cached",
        "_context",
        "_hits",
        "_row_args",
        "allocate_args",
        "out",
        "rows",
    )

    def __init__(self, max_requests: int, num_groups: int) -> None:
        self.rows = np.zeros(max_requests, dtype=np.int64)
        self.out: tuple[np.ndarray, ...] = ()
        self._cells(num_groups, _PER_ROW * max_requests)
        self._context: tuple[Any, ...] | None = None
        self._arrays: object | None = None
        self._row_args: tuple[object, tuple[Any, ...], tuple[int, ...]] | None = None
        self._cached: tuple[np.ndarray, ...] | None = None
        self._hits: bool | None = None
        #: ``kvcm.allocation.c_args``' tuple, made once (empty: allocates stay Python's).
        self.allocate_args: tuple[Any, ...] | None = None

    def __deepcopy__(self, memo: dict[int, Any]) -> NativeDecode:
        """A copy (of a copied manager) over the copy's arrays: the context object is not
        copied, since its buffers are the original's; the copy makes its own when used."""
        twin: NativeDecode = NativeDecode.__new__(NativeDecode)
        memo[id(self)] = twin
        twin.rows = copy.deepcopy(self.rows, memo)
        twin.out = copy.deepcopy(self.out, memo)
        twin._context = copy.deepcopy(self._context, memo)
        twin._arrays = None
        twin._row_args = None
        twin._cached = None
        twin.allocate_args = None
        twin._hits = self._hits
        return twin

    def _cells(self, num_groups: int, cells: int) -> None:
        """Work arrays for ``cells`` new or released blocks per layer group: rows, then the
        (items, positions) of new blocks and of released cells."""
        shape = (num_groups, cells)
        self.out = (self.rows, *(np.zeros(shape, dtype=np.int64) for _ in range(4)))

    def context(self, m: Components) -> tuple[Any, ...]:
        """The arrays ``decode_plan`` reads: built once (the coordinator restores its arrays
        in place, so these stay its own)."""
        if self._context is None:
            c: Coordinator = m.coord
            self._context = (
                m.requests.handle,
                m.requests.scratch,
                c.num_tokens,
                c.history,
                c.lookahead,
                tuple(c.num_blocks),
                tuple(c.released_end),
                c.tables,
                tuple(c.refs),
                tuple(c.group_pool),
                tuple(p.sliding_window or 0 for p in c.policies),
                m.config.max_seq_len,
                c.tokens_per_block,
                c.empty,
            )
        return self._context

    def arrays(self, core: ModuleType, m: Components) -> object:
        """``context`` as the C core's context object, which holds the arrays' buffers: a
        call then reads none (reading its dozen buffers cost about 1 us a call)."""
        if self._arrays is None:
            self._arrays = core.context(self.context(m))
        return self._arrays

    def row_args(
        self, core: ModuleType, m: Components
    ) -> tuple[object, tuple[Any, ...], tuple[int, ...]]:
        """(context object, free queues, sinks): what ``row_grow`` (the first two) and
        ``row_release`` read besides the row (``kvcm.native_rows``); the queues are restored
        in place, too."""
        if self._row_args is None:
            c = m.coord
            self._row_args = (self.arrays(core, m), tuple(c.pools), tuple(c.sinks))
        return self._row_args

    def cached(self, m: Components) -> tuple[np.ndarray, ...]:
        """Each pool group's cached flags, as ``row_start`` reads them (restored in place,
        so kept)."""
        if self._cached is None:
            self._cached = tuple(m.coord.cache.cached)
        return self._cached

    def hits_in_c(self, m: Components) -> bool:
        """Whether ``row_start`` can place this manager's prefix hits (``native_rows.start``):
        every layer group full attention and reusable, no context parallelism, host tier or
        state layers. Fixed for the manager's life, so decided once."""
        if self._hits is None:
            c = m.coord
            self._hits = (
                c.plain
                and m.host is None
                and m.state is None
                and all(c.cache.reusable)
                and all(window is None for window, _ in m.windows)
            )
        return self._hits

    def _take(
        self, core: ModuleType, m: Components, rows: np.ndarray, added: tuple[int, ...]
    ) -> None:
        """The planned new blocks, ``added`` per layer group: taken, written and their table
        edits logged in C (``decode_take``), then what the taken slots cached evicted, as
        ``Coordinator.take`` and ``set_cells`` do; by those where C leaves them."""
        c = m.coord
        _, add_items, add_positions, _, _ = self.out
        context, pools, _ = self.row_args(core, m)
        log = None if c.edits is None else np.empty((sum(added), 4), dtype=np.int64)
        evicts = core.decode_take(
            rows, added, context, pools, self.cached(m), add_items, add_positions, log
        )
        if evicts is not False and log is not None:
            c.logged(log)
        for g, k in enumerate(added):
            if not k or (evicts is not False and not evicts[g]):
                continue
            r = rows[add_items[g, :k]]
            positions = add_positions[g, :k].copy()  # kept by the edit log
            if evicts is False:  # the coordinator's own take
                c.set_cells(g, r, positions, c.take(c.group_pool[g], k, positions))
            else:
                c.evict_taken(c.group_pool[g], c.tables[g][r, positions])

    def _release(
        self, core: ModuleType, m: Components, rows: np.ndarray, released: tuple[int, ...]
    ) -> None:
        """The planned window releases, ``released`` per layer group: the slots dropped, put
        back, the cells emptied and the table edits logged in C (``decode_release``); by the
        coordinator where C leaves them (``unref`` and ``set_cells``)."""
        c = m.coord
        _, _, _, items, where = self.out
        context, pools, _ = self.row_args(core, m)
        log = None if c.edits is None else np.empty((sum(released), 4), dtype=np.int64)
        if core.decode_release(rows, released, context, pools, items, where, log):
            if log is not None:
                c.logged(log)
            return
        for g, k in enumerate(released):
            if not k:
                continue
            r = rows[items[g, :k]]
            positions = where[g, :k].copy()  # kept by the edit log
            c.unref(c.group_pool[g], c.tables[g][r, positions])
            c.set_cells(g, r, positions, None)

    def extend(
        self, core: ModuleType, m: Components, handles: np.ndarray, new: Any, ahead: Any
    ) -> tuple[np.ndarray, np.ndarray] | bool | None:
        """``request_rows.extend_handles`` in C: (rows, new blocks per item); None, with
        nothing changed, when the numpy path would refuse the batch too (its items then run
        one by one); False, with nothing changed, when the numpy path must plan it."""
        done = self._run(core, m, handles, new, ahead, False)
        if done is None or done is False:
            return done
        rows, added, _ = done
        return rows, added

    def extend_around_failures(
        self, core: ModuleType, m: Components, handles: np.ndarray, new: Any, ahead: Any
    ) -> tuple[np.ndarray, np.ndarray, list[int]] | bool | None:
        """The batch without the items that fail on their own (a handle that is not live, a
        capacity past max_seq_len), as ``columnar._Run.extends_around_failures`` runs it:
        (the items extended, their new blocks, the failing items, which changed nothing);
        None or False as ``extend``.

        Example: handles [h0, stale, h2]: h0 and h2 are extended as one batch, and (array([0,
        2]), their new blocks, [1]) is returned; item 1 is the caller's to report.
        """
        done = self._run(core, m, handles, new, ahead, True)
        if done is None or done is False:
            return done
        rows, added, failing = done
        if not failing:
            return np.arange(handles.size), added, failing
        return np.flatnonzero(rows >= 0), added, failing

    def rehearse(
        self, core: ModuleType, m: Components, handles: np.ndarray, new: Any, ahead: Any
    ) -> None:
        """A decode batch's plan (``decode_plan``, into this object's work arrays), the take
        of its new blocks, dry (``decode_take``: read, not written), and the slot mapping of
        each item's last token (``map_slots``, into a scratch array), all changing no
        state: what busy-poll mode's rehearsal runs between steps, so that the step after it
        finds its rows, tables, free queues and C code in the caches
        (``KVCacheManager.rehearse_columns``). A batch they refuse rehearses less; nothing
        is reported."""
        c = m.coord
        planned = core.decode_plan(
            handles, new, ahead, self.arrays(core, m), _free(c), self.out, True
        )
        if type(planned) is tuple and any(planned[0]):  # new blocks: their take, dry
            _, add_items, add_positions, _, _ = self.out
            context, pools, _ = self.row_args(core, m)
            rows, added, cached = self.rows[: handles.size], planned[0], self.cached(m)
            core.decode_take(
                rows, added, context, pools, cached, add_items, add_positions, None, True
            )
        tables = c.tables
        scratch = np.empty((tables.shape[0], handles.size), dtype=np.int64)
        with contextlib.suppress(ValueError):  # a stale handle's row may hold no token
            items = (handles, c.num_tokens, 1)
            tpb = c.tokens_per_block
            core.map_slots(tables, tables.shape[1], tables.shape[2], items, tpb, 0, scratch)

    def _run(
        self,
        core: ModuleType,
        m: Components,
        handles: np.ndarray,
        new: Any,
        ahead: Any,
        skip: bool,
    ) -> tuple[np.ndarray, np.ndarray, list[int]] | bool | None:
        """Plan in C and apply: (each item's row, -1 for a failing one; the extended items'
        new blocks; the failing items), or the plan's None or False, with nothing changed."""
        if not handles.size:  # callers batch two items or more; numpy decides otherwise
            return False
        c = m.coord
        context = self.arrays(core, m)
        free = _free(c)
        planned = core.decode_plan(handles, new, ahead, context, free, self.out, skip)
        if type(planned) is int:  # more cells than the arrays hold: grow them, plan again
            self._cells(self.out[1].shape[0], planned)
            planned = core.decode_plan(handles, new, ahead, context, free, self.out, skip)
        if planned is None or planned is False:
            return planned
        added, released, failing = planned
        rows = self.rows[: handles.size].copy()
        if len(failing) == handles.size:  # nothing to extend (an op that changes nothing)
            return rows, np.empty(0, dtype=np.int32), failing
        if any(released):  # a window's stale blocks first, as the numpy plan
            self._release(core, m, rows, released)
        if any(added):
            self._take(core, m, rows, added)
        kept = rows
        if failing:  # the others' rows and counts
            keep = rows >= 0
            kept = rows[keep]
            new = new[keep] if isinstance(new, np.ndarray) else new
            ahead = ahead[keep] if isinstance(ahead, np.ndarray) else ahead
        out = np.empty(kept.size, dtype=np.int32)
        core.decode_commit(kept, new, ahead, context, out)
        c.ops_since_take += 1
        return rows, out, failing

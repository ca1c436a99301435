"""Block bookkeeping of all requests across layer groups, vectorised over requests.

State lives in numpy arrays indexed by page-table row, so one decode step over N requests is a
fixed number of numpy calls per layer group, not N Python iterations:

- ``num_tokens[row]``, ``history[row]`` (length before the latest allocate/extend),
  ``lookahead[row]``;
- per layer group g: ``num_blocks[g][row]`` (block positions allocated, released ones included),
  ``released_end[g][row]`` (released run is [sink_blocks, released_end)) and the host page table
  ``tables[g]`` int32 ``[max_requests, max_blocks_per_request]``, ``empty`` where there is no
  page.

``empty`` is -1, or 0 with the null page: slot 0 of every pool group is then reserved (never
handed out), so in both modes a cell holds a live page exactly when it is ``> empty``. Example
with the null page: a request of 3 blocks whose window released block 1 has the row
[5, 0, 7, 0, 0, ...]; its block list is [5, -1, 7] (``block_list`` keeps -1 for bookkeeping).

Every op first plans (computes and checks, touching nothing), then applies, so a failed op
changes nothing. Within one op a layer group's stale blocks are released before new blocks are
taken: the stale blocks' KV is not read by the tokens of that step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from kvcm_client.errors import InvalidRewind, OutOfBlocks

from .attention import AttentionPolicy, policy_for
from .block_pool import BlockPool
from .context_parallel import ClassPools, class_counts, slot_classes
from .coordinator_hits import PrefixHits
from .coordinator_log import EditLog, EditRecord
from .ids import LayerGroupId, PoolGroupId
from .layout import Layout
from .prefix_cache import PrefixCache


def segments(counts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Expand per-item counts into (item index, offset within item) for every unit.

    counts [2, 0, 3] gives items [0, 0, 2, 2, 2] and offsets [0, 1, 0, 1, 2].
    """
    if counts.size and counts.max() <= 1:
        items = np.flatnonzero(counts)
        return items, np.zeros(items.size, dtype=np.int64)
    items = np.repeat(np.arange(counts.size), counts)
    starts = np.cumsum(counts) - counts
    return items, np.arange(items.size) - starts[items]


def _net(moves: list[tuple[np.ndarray, np.ndarray | int]]) -> np.ndarray:
    """Blocks each row takes net of those it frees, over the groups of one pool group."""
    net = moves[0][0] - moves[0][1]
    for add, freed in moves[1:]:
        net = net + add - freed
    return net


@dataclass(slots=True)
class _GroupPlan:
    group: int
    add: np.ndarray
    num_add: int
    released_old: np.ndarray
    released_new: np.ndarray
    num_released: int
    current: np.ndarray
    stale: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None
    """Table cells the op releases: (rows, positions, slots), gathered once by the plan."""


class Coordinator(PrefixHits, EditLog):
    """Owns the block pools, the per-row request state and the host page tables."""

    def __init__(
        self,
        layout: Layout,
        slots: dict[PoolGroupId, int],
        max_requests: int,
        max_blocks: int,
        tables_buffer: memoryview | None = None,
        null_page: bool = False,
        kv_events: bool = True,
        kv_event_buffer: int = 10_000,
        context_parallel: int = 1,
    ) -> None:
        """``context_parallel`` > 1: block position b takes a slot of class b mod cp
        (``kvcm.context_parallel``); needs and releases are then counted per class."""
        tpb = layout.tokens_per_block
        self.tokens_per_block = tpb
        self.max_blocks = max_blocks
        #: What a table cell holds where there is no page: the null page 0, or -1.
        self.empty = 0 if null_page else -1
        reserved = int(null_page)
        self.cp = cp = context_parallel
        self.pools: list[Any] = [
            BlockPool(slots[pg.pool_group_id], reserved)
            if cp == 1
            else ClassPools(slots[pg.pool_group_id], reserved, cp)
            for pg in layout.pool_groups
        ]
        #: Requests holding each slot (prefix hits share slots); a slot is free at 0.
        self.refs = [np.zeros(slots[pg.pool_group_id], dtype=np.int32) for pg in layout.pool_groups]
        self.cache = PrefixCache(layout, slots, kv_event_buffer, kv_events)
        self.group_pool = [int(g.pool_group) for g in layout.layer_groups]
        self.policies: list[AttentionPolicy] = [
            policy_for(g.sliding_window, g.sink_blocks, tpb) for g in layout.layer_groups
        ]
        self.sinks = [g.sink_blocks for g in layout.layer_groups]
        self.windowed = [g.sliding_window is not None for g in layout.layer_groups]
        self.any_windowed = any(self.windowed)
        #: No per-class part in a plan: the C decode path applies (``kvcm.native_step``).
        self.plain = cp == 1
        ng = len(layout.layer_groups)
        self.num_tokens = np.zeros(max_requests, dtype=np.int64)
        self.history = np.zeros(max_requests, dtype=np.int64)
        self.lookahead = np.zeros(max_requests, dtype=np.int64)
        self.num_blocks = [np.zeros(max_requests, dtype=np.int64) for _ in range(ng)]
        self.released_end = [np.full(max_requests, s, dtype=np.int64) for s in self.sinks]
        #: Host page tables of all layer groups in one array, ``[groups, rows, blocks]``.
        shape = (ng, max_requests, max_blocks)
        if tables_buffer is None:
            self.tables = np.full(shape, self.empty, dtype=np.int32)
        else:  # in shared memory, so another process sees every edit at once
            self.tables = np.ndarray(shape, dtype=np.int32, buffer=tables_buffer)
            self.tables.fill(self.empty)
        #: Table edits since the last ``take_edits`` (only kept for device tables), as
        #: ``kvcm.coordinator_log.EditRecord``s.
        self.edits: list[EditRecord] | None = None
        #: Edit batches taken so far (``take_edits``): an undo after a take must edit back.
        self.takes = 0
        self.ops_since_take = 0
        #: The host tier (``kvcm.host_tier``), set by the manager when it has one.
        self.host: Any = None

    # -- planning ----------------------------------------------------------------------------

    def _plan(
        self,
        rows: np.ndarray,
        history: np.ndarray,
        capacity: np.ndarray,
        in_order: bool = False,
    ) -> list[_GroupPlan]:
        tpb = self.tokens_per_block
        want = (capacity + (tpb - 1)) // tpb
        plans = []
        need = self._zeros()
        back = self._zeros()
        #: Per pool group, each group's (blocks added, blocks freed) per row, in order.
        moves: list[list[tuple[np.ndarray, np.ndarray | int]]] = [[] for _ in self.pools]
        stale: list[list[np.ndarray]] = [[] for _ in self.pools]
        for g, policy in enumerate(self.policies):
            current = self.num_blocks[g][rows]
            add = want - current
            np.maximum(add, 0, out=add)
            num_add = int(add.sum())
            if self.windowed[g]:
                rel_old = self.released_end[g][rows]
                rel_new = policy.released_end(history, rel_old)
                num_released = int((rel_new - rel_old).sum())
            else:  # nothing is released: the plan never reads these
                rel_old = rel_new = current
                num_released = 0
            pg = self.group_pool[g]
            need[pg] += num_add if self.cp == 1 else class_counts(current, current + add, self.cp)
            freed: np.ndarray | int = 0
            cells = None
            if num_released:
                items, offsets = segments(rel_new - rel_old)
                r, pos = rows[items], rel_old[items] + offsets
                slots = self.tables[g][r, pos]
                cells = (r, pos, slots)
                stale[pg].append(slots)
                if in_order:
                    alone = self.refs[pg][slots] == 1
                    if alone.all():  # no prefix hit shares them: every row frees its own
                        freed = rel_new - rel_old
                    else:
                        # Per row, the blocks it held alone. A slot that two rows of the
                        # batch share frees at the second; counting it for neither errs
                        # toward refusing the batch, whose ops then run one by one.
                        freed = np.bincount(items[alone], minlength=rows.size)
            if in_order:
                moves[pg].append((add, freed))
            plans.append(
                _GroupPlan(g, add, num_add, rel_old, rel_new, num_released, current, cells)
            )
        for pg, slots in enumerate(stale):
            if slots:
                back[pg] = self._freed(pg, slots[0] if len(slots) == 1 else np.concatenate(slots))
        for pg, pool in enumerate(self.pools):
            # In order, row i runs after rows < i: it needs what they took net of what they
            # gave back, so every prefix of the net needs must fit, not only the total. Per
            # class (context parallelism), the batch must fit without what it gives back: a
            # stricter rule, whose refusal only sends the rows one by one.
            if self.cp > 1:
                if in_order and bool(np.any(back[pg])):
                    note = " (not counted: the rows run one after another)"
                    self._fit_classes(pg, need[pg], back[pg], pool.free_by_class(), note)
                continue
            if in_order and back[pg] and int(np.cumsum(_net(moves[pg])).max()) > pool.num_free:
                raise OutOfBlocks(
                    f"pool group {pg}: the rows do not fit one after another",
                    pool_group=pg,
                    needed=need[pg],
                    free=pool.num_free,
                    released=back[pg],
                )
        self.check_fits(need, back)
        return plans

    def _fit_classes(
        self, pg: int, need: np.ndarray, back: np.ndarray, room: np.ndarray, note: str = ""
    ) -> None:
        """Refuse (``OutOfBlocks``, naming the class that lacks most) if some class of pool
        group pg needs more slots than ``room`` (its free slots, with or without those the op
        releases: ``back``)."""
        if not bool(np.any(need > room)):
            return
        c = int(np.argmax(need - room))
        free = int(self.pools[pg].free_by_class()[c])
        raise OutOfBlocks(
            f"pool group {pg} needs {int(need[c])} blocks of context-parallel rank {c}, "
            f"{free} are free and the op releases {int(back[c])}{note}",
            pool_group=pg,
            needed=int(need[c]),
            free=free,
            released=int(back[c]),
            cp_rank=c,
        )

    def _zeros(self) -> list[Any]:
        """A count per pool group: an int, or per class an int64 ``[cp]``."""
        if self.cp == 1:
            return [0] * len(self.pools)
        return [np.zeros(self.cp, dtype=np.int64) for _ in self.pools]

    def _freed(self, pg: int, slots: np.ndarray) -> Any:
        """Slots of pool group pg that releasing these table cells frees (per class with
        context parallelism): a slot goes back only when its last holder drops it, so a
        stale window block that a prefix hit shares with another request frees nothing
        (one listed k times, by k rows, frees it if they are all its holders)."""
        if int(self.refs[pg][slots].max()) == 1:  # the usual case: each cell its own slot
            return int(slots.size) if self.cp == 1 else slot_classes(slots, self.cp)
        unique, counts = np.unique(slots, return_counts=True)
        freed = unique[self.refs[pg][unique] == counts]
        return int(freed.size) if self.cp == 1 else slot_classes(freed, self.cp)

    def check_fits(self, need: list[Any], back: list[Any] | None = None) -> None:
        """Refuse an op that needs more slots than are free once its releases are back (per
        class with context parallelism: ``need`` and ``back`` are then ``[cp]`` arrays)."""
        back = back or self._zeros()
        for pg, pool in enumerate(self.pools):
            if self.cp > 1:
                self._fit_classes(pg, need[pg], back[pg], pool.free_by_class() + back[pg])
                continue
            if need[pg] > pool.num_free + back[pg]:
                raise OutOfBlocks(
                    f"pool group {pg} needs {need[pg]} blocks, {pool.num_free + back[pg]} are free",
                    pool_group=pg,
                    needed=need[pg],
                    free=pool.num_free,
                    released=back[pg],
                )

    # -- ops ---------------------------------------------------------------------------------

    def grow(
        self,
        rows: np.ndarray,
        new_tokens: np.ndarray,
        lookahead: np.ndarray,
        in_order: bool = False,
    ) -> np.ndarray | int:
        """Add ``new_tokens`` to each row (distinct rows), all or nothing; returns the block
        positions added per row, summed over layer groups (an int for one row).

        A row that was never used or was released is empty, so allocate is grow on a new row.
        ``in_order`` also refuses a batch that fits as a whole but not row after row (a row
        whose window releases blocks can make room for an earlier one only in a batch).
        """
        if rows.size == 1:  # single ops: plain ints instead of ~40 tiny numpy calls
            return self.grow_one(int(rows[0]), int(new_tokens[0]), int(lookahead[0]))
        history = self.num_tokens[rows]
        length = history + new_tokens
        return self.grow_rows(rows, history, length, length + lookahead, lookahead, in_order)

    def grow_rows(
        self,
        rows: np.ndarray,
        history: np.ndarray,
        length: np.ndarray,
        capacity: np.ndarray,
        lookahead: np.ndarray | int,
        in_order: bool = False,
    ) -> np.ndarray:
        """``grow`` of several rows with their lengths computed by the caller (``history``:
        ``num_tokens[rows]``, ``length`` after the op, ``capacity`` = length + lookahead)."""
        plans = self._plan(rows, history, capacity, in_order)
        for plan in plans:
            if plan.num_released:
                self._release(plan)
        for plan in plans:
            if plan.num_add:
                self._allocate(plan, rows)
                self.num_blocks[plan.group][rows] = plan.current + plan.add
            if self.windowed[plan.group]:
                self.released_end[plan.group][rows] = plan.released_new
        self.num_tokens[rows] = length
        self.history[rows] = history
        self.lookahead[rows] = lookahead
        self.ops_since_take += 1
        added = plans[0].add
        for plan in plans[1:]:
            added = added + plan.add
        return added

    def grow_one(self, row: int, new_tokens: int, lookahead: int) -> int:
        """``grow`` of one row, same plan, same order of effects (release, then allocate)."""
        tpb = self.tokens_per_block
        history = self.num_tokens.item(row)
        length = history + new_tokens
        if self.cp > 1:  # per-class counts: the batch path, with one row
            one = np.array([row])
            past = np.array([history])
            grown = self.grow_rows(
                one, past, past + new_tokens, past + new_tokens + lookahead, lookahead
            )
            return int(grown[0])
        want = -(-(length + lookahead) // tpb)
        if not self.any_windowed:
            for held in self.num_blocks:
                if held.item(row) < want:
                    break
            else:  # most decode tokens: no block to take, none to release
                self.num_tokens[row] = length
                self.history[row] = history
                self.lookahead[row] = lookahead
                self.ops_since_take += 1
                return 0
        need = [0] * len(self.pools)
        back = [0] * len(self.pools)
        steps = []
        for g, policy in enumerate(self.policies):
            current = int(self.num_blocks[g][row])
            rel_old = int(self.released_end[g][row])
            rel_new = rel_old
            if self.windowed[g]:
                rel_new = max(rel_old, (history + 1 - policy.sliding_window) // tpb)  # type: ignore[operator]
            add = max(want - current, 0)
            pg = self.group_pool[g]
            need[pg] += add
            if rel_new > rel_old:
                back[pg] += self._freed(pg, self.tables[g][row, rel_old:rel_new])
            steps.append((g, pg, current, add, rel_old, rel_new))
        self.check_fits(need, back)
        for g, pg, _, _, rel_old, rel_new in steps:
            if rel_new > rel_old:
                self.unref(pg, self.tables[g][row, rel_old:rel_new].copy())
                self.set_cells(g, row, slice(rel_old, rel_new), None)
        for g, pg, current, add, _, rel_new in steps:
            if add:
                self.set_cells(g, row, slice(current, current + add), self.take(pg, add))
            self.num_blocks[g][row] = current + add
            self.released_end[g][row] = rel_new
        self.num_tokens[row] = length
        self.history[row] = history
        self.lookahead[row] = lookahead
        self.ops_since_take += 1
        return sum(step[3] for step in steps)

    def release_window(self, g: int, row: int, end: int) -> None:
        """Release the row's blocks of windowed group ``g`` up to position ``end``, as its own
        growth would once its history passed them: a pulled request drops the positions its
        peer had released, whose KV it never receives. Example (sink 1 block): released_end
        1 and ``end`` 5 release positions 1 to 4; an ``end`` at or below released_end does
        nothing."""
        start = int(self.released_end[g][row])
        if end <= start:
            return
        self.unref(self.group_pool[g], self.tables[g][row, start:end].copy())
        self.set_cells(g, row, slice(start, end), None)
        self.released_end[g][row] = end

    def _release(self, plan: _GroupPlan) -> None:
        assert plan.stale is not None
        r, pos, slots = plan.stale
        self.unref(self.group_pool[plan.group], slots)
        self.set_cells(plan.group, r, pos, None)

    def _allocate(self, plan: _GroupPlan, rows: np.ndarray) -> None:
        pg = self.group_pool[plan.group]
        items = plan.add.nonzero()[0]
        if items.size == plan.num_add:
            # Each row adds at most one block (a decode step): no offsets to expand.
            positions = plan.current[items]
        else:
            items, offsets = segments(plan.add)
            positions = plan.current[items] + offsets
        slots = self.take(pg, plan.num_add, positions)
        self.set_cells(plan.group, rows[items], positions, slots)

    def take(self, pg: int, k: int, positions: np.ndarray | None = None) -> np.ndarray:
        """k slots off the queue's head (with context parallelism, one of each position's
        class), held once; blocks cached in them are evicted (to the host tier first, if
        there is one: copied before the slots are handed out)."""
        if self.cp > 1:
            assert positions is not None and positions.size == k
            slots = self.pools[pg].pop_positions(positions)
        else:
            slots = self.pools[pg].pop(k)
        self.refs[pg][slots] = 1
        self.evict_taken(pg, slots)
        return slots

    def evict_taken(self, pg: int, slots: np.ndarray) -> None:
        """Slots just taken off pool group pg's queue: the blocks they cached are evicted
        (copied to the host tier first, if there is one). The C core's takes have written
        the slots into the tables already (``native_rows``, ``native_step``): that is safe,
        since nobody writes a taken slot's pages before the op answers, and it settles its
        copies before it does (``kvcm.manager._settles``)."""
        if self.host is not None and self.cache.slot_key[pg]:
            cached = slots[self.cache.cached[pg][slots]].tolist()
            if cached:
                keys = self.cache.slot_key[pg]
                self.host.offload(pg, [(s, keys[s]) for s in cached])
        self.cache.evict(pg, slots)

    def taken_in_c(self, g: int, rows: np.ndarray, positions: np.ndarray, evict: bool) -> None:
        """Slots the C core took and wrote into layer group g's cells (``rows``,
        ``positions``) without logging them (a new row's blocks, ``kvcm.native_rows``): what
        they cached evicted when ``evict`` (one of them caches a block) and the cells
        logged, as ``take`` and ``set_cells`` do."""
        if not evict and self.edits is None:
            return
        slots = self.tables[g][rows, positions]
        if evict:
            self.evict_taken(self.group_pool[g], slots)
        if self.edits is not None:
            self.edits.append((g, rows, positions, slots))

    def logged(self, edits: np.ndarray) -> None:
        """Table edits the C core made and logged itself, int64 ``[E, 4]`` (group, row,
        position, slot), in the order it made them (``kvcm.native_step``): one record,
        which ``take_edits`` passes on as it is."""
        if self.edits is not None:
            self.edits.append(edits)

    def set_cells(
        self,
        g: int,
        rows: int | np.ndarray,
        positions: slice | np.ndarray,
        slots: np.ndarray | None,
    ) -> None:
        """Write table cells of layer group g (slots, or ``empty`` for None) and log them for
        the device tables. A single row with a slice of positions is written as a slice."""
        self.tables[g][rows, positions] = self.empty if slots is None else slots
        if self.edits is None:
            return
        if isinstance(positions, slice):
            positions = np.arange(positions.start, positions.stop)
        if isinstance(rows, int):
            rows = np.full(positions.size, rows)
        self.edits.append((g, rows, positions, slots))

    def rewind(self, row: int, num_tokens: int) -> None:
        """Drop the last ``num_tokens`` tokens; blocks past the new capacity are freed."""
        new_len = int(self.num_tokens[row]) - num_tokens
        for g, policy in enumerate(self.policies):
            released = int(self.released_end[g][row])
            if released > self.sinks[g] and policy.first_needed_block(new_len) < released:
                raise InvalidRewind(
                    f"rewinding to {new_len} tokens needs blocks that layer group {g}'s "
                    f"sliding window already released",
                    layer_group=g,
                    num_tokens=new_len,
                    released_end=released,
                )
        keep = -(-(new_len + int(self.lookahead[row])) // self.tokens_per_block)
        for g in range(len(self.policies)):
            self._free_tail(g, row, keep)
        self.num_tokens[row] = new_len
        self.history[row] = min(int(self.history[row]), new_len)
        self.ops_since_take += 1

    def release_row(self, row: int) -> None:
        """Free every block of the row, tail first (so the head is evicted last later)."""
        for g in range(len(self.policies)):
            self._free_tail(g, row, 0)
            self.released_end[g][row] = self.sinks[g]
        self.num_tokens[row] = 0
        self.history[row] = 0
        self.lookahead[row] = 0
        self.ops_since_take += 1

    def _free_tail(self, g: int, row: int, keep: int) -> None:
        count = int(self.num_blocks[g][row])
        if count <= keep:
            return
        seg = self.tables[g][row, keep:count]
        live = seg[seg > self.empty][::-1]
        if live.size:  # one row's pages: distinct slots
            self.unref(self.group_pool[g], live, distinct=True)
        self.set_cells(g, row, slice(keep, count), None)
        self.num_blocks[g][row] = keep

    def unref(self, pg: int, slots: np.ndarray, distinct: bool = False) -> None:
        """Drop one reference from each slot; those nobody holds go to the queue, in order.
        ``distinct``: the caller knows no slot is listed twice (one row's pages)."""
        refs = self.refs[pg]
        held = refs[slots]
        if held.size and held.max() == 1:
            # Nobody else holds any of them (the usual case without prefix hits): a slot
            # listed twice would show 2 here, so these are distinct and all become free.
            refs[slots] = 0
            self.pools[pg].push(slots)
            return
        if distinct:  # a plain subtraction, and no slot can free twice
            refs[slots] = held - 1
            self.pools[pg].push(slots[held == 1])
            return
        np.subtract.at(refs, slots, 1)
        free = slots[refs[slots] == 0]
        if free.size > 1:
            unique, first = np.unique(free, return_index=True)
            if unique.size != free.size:  # a shared slot released twice in one op
                free = free[np.sort(first)]
        self.pools[pg].push(free)

    # -- queries -----------------------------------------------------------------------------

    def usable_slots(self) -> dict[PoolGroupId, int]:
        """Slots per pool group that requests can hold: all of them but the null page."""
        return {PoolGroupId(pg): pool.num_usable for pg, pool in enumerate(self.pools)}

    def block_list(self, g: LayerGroupId, row: int) -> list[int]:
        """The row's block slots by position, -1 where there is none (whatever ``empty`` is)."""
        seg = self.tables[g][row, : int(self.num_blocks[g][row])]
        return np.where(seg > self.empty, seg, -1).tolist()

"""Decode context parallelism (Helix): a request's pages spread over ``cp`` ranks.

Block position b of every request lives on context-parallel (CP) rank b mod cp. The
bookkeeping keeps one set of global slot ids: slot s of a pool group is of class s mod cp
and is local slot s // cp of the pools of the CP ranks of that class, each of which holds
1/cp of the pool group's slots. The allocator hands block position b a slot of class b mod cp
(``ClassPools``: one free list per class), so fit checks, evictions and sizing are per class,
and a prefix hit, which puts a cached block at the position it was computed for, always finds
it on the right rank.

Each CP rank sees its own pages only: its local page table holds, in entry j of a row, the
local slot of global block j * cp + r (``local_edits`` turns the coordinator's table edits
into those), its slot mappings send the tokens of other ranks' blocks to -1
(``local_positions``), its attention reads ``local_lengths`` tokens, and a sliding window's
stale blocks are local pages ``local_count(s0)`` to ``local_count(s1)``.

Worked example (cp 2, 4 tokens per block, a request of 10 tokens): blocks 0, 1, 2 hold tokens
[0, 4), [4, 8), [8, 10); rank 0 holds blocks 0 and 2 (local pages 0 and 1: 4 + 2 = 6 tokens),
rank 1 block 1 (local page 0: 4 tokens). Global slots 6, 3, 10 are local slots 3, 1, 5 of
ranks 0, 1 and 0. Token 9 maps to 5 * 4 + 1 = 21 on rank 0 and to -1 on rank 1.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .block_pool import BlockPool


def local_count(n: Any, cp: int, c: int) -> Any:
    """How many of the positions [0, n) are of class c: ceil((n - c) / cp), never negative
    for n >= 0. Example (cp 4): n = 6 covers positions 0..5, so class 1 has 2 (1 and 5),
    class 3 has 1 (3)."""
    return (n - c + cp - 1) // cp


def class_counts(start: np.ndarray | int, stop: np.ndarray | int, cp: int) -> np.ndarray:
    """Positions of each class in the ranges [start[i], stop[i]), summed over i: int64
    ``[cp]``. Example (cp 2): ranges [1, 4) and [2, 3) give class 0: 2 and 2, class 1: 1 and
    3, so [2, 2]."""
    begin = np.asarray(start, dtype=np.int64).reshape(-1)
    end = np.asarray(stop, dtype=np.int64).reshape(-1)
    if begin.size > 1 and int((end - begin).max(initial=0)) <= 1:
        # A decode step: at most one position per range, the range's start.
        return np.bincount(begin[end > begin] % cp, minlength=cp)
    classes = np.arange(cp, dtype=np.int64)
    begin, end = begin.reshape(-1, 1), end.reshape(-1, 1)
    return (local_count(end, cp, classes) - local_count(begin, cp, classes)).sum(axis=0)


def slot_classes(slots: np.ndarray, cp: int) -> np.ndarray:
    """How many of ``slots`` (global ids) each class has: int64 ``[cp]``."""
    return np.bincount(np.asarray(slots, dtype=np.int64) % cp, minlength=cp)


class ClassPools:
    """The free slots of one pool group in ``cp`` classes, one ``BlockPool`` each (over its
    local slots), with the global ids the coordinator keeps: class c's local slot l is
    global slot l * cp + c. Each class reserves its own local slots below ``reserved`` (with
    the null page, local slot 0: global slots 0..cp-1), so every CP rank has a null page.

    Example (cp 2, 8 slots, null page): class 0 hands out 2, 4, 6 and class 1 3, 5, 7;
    ``pop_positions([0, 1, 2])`` gives [2, 3, 4].
    """

    __slots__ = ("classes", "cp", "num_slots", "num_usable")

    def __init__(self, num_slots: int, reserved: int, cp: int) -> None:
        self.cp = cp
        self.num_slots = num_slots
        self.classes = [BlockPool(num_slots // cp, reserved) for _ in range(cp)]
        self.num_usable = sum(p.num_usable for p in self.classes)

    @property
    def num_free(self) -> int:
        return sum(p.num_free for p in self.classes)

    def free_by_class(self) -> np.ndarray:
        return np.array([p.num_free for p in self.classes], dtype=np.int64)

    def pop_positions(self, positions: np.ndarray) -> np.ndarray:
        """A free slot for each block position, of that position's class (the oldest free
        of the class first, in the order of the positions); the caller has checked that
        each class has enough."""
        cp = self.cp
        if not positions.size:
            return np.empty(0, dtype=np.int32)
        classes = positions % cp
        order = np.argsort(classes, kind="stable")  # positions grouped by class, in order
        counts = np.bincount(classes, minlength=cp).tolist()
        taken = [
            self.classes[c].pop(k).astype(np.int64) * cp + c for c, k in enumerate(counts) if k
        ]
        out = np.empty(positions.size, dtype=np.int32)
        out[order] = np.concatenate(taken) if len(taken) > 1 else taken[0]
        return out

    def _split(self, slots: np.ndarray) -> list[tuple[BlockPool, np.ndarray]]:
        slots = np.asarray(slots, dtype=np.int64)
        classes = slots % self.cp
        return [
            (pool, slots[classes == c] // self.cp)
            for c, pool in enumerate(self.classes)
            if (classes == c).any()
        ]

    def push(self, slots: np.ndarray) -> None:
        """Return slots to their classes' tails, in the order given within each class."""
        for pool, local in self._split(slots):
            pool.push(local)

    def claim(self, slots: np.ndarray) -> None:
        """Take these free slots out of their classes' queues (prefix hits)."""
        for pool, local in self._split(slots):
            pool.claim(local)

    def checkpoint(self) -> list[Any]:
        return [p.checkpoint() for p in self.classes]

    def restore(self, saved: list[Any]) -> None:
        for pool, state in zip(self.classes, saved, strict=True):
            pool.restore(state)

    def free_order(self) -> np.ndarray:
        """The free slots (global ids), class by class, each next to be allocated first."""
        cp = self.cp
        return np.concatenate(
            [p.free_order().astype(np.int64) * cp + c for c, p in enumerate(self.classes)]
        )


def local_edits(edits: np.ndarray, cp: int, c: int) -> np.ndarray:
    """The coordinator's table edits (int64 ``[E, 4]``: group, row, position, global slot)
    as CP rank c's: those of its positions, at local position b // cp with local slot
    s // cp. ``empty`` stays itself: -1 // cp is -1 and 0 // cp is 0."""
    mine = edits[edits[:, 2] % cp == c]  # a copy: boolean indexing
    mine //= np.array([1, 1, cp, cp], dtype=np.int64)  # one call for both columns
    return mine


def table_width(max_blocks: int, cp: int) -> int:
    """Entries per row of a rank's page tables: ``max_blocks``, or for a CP rank its share
    of the ``max_blocks`` positions and one more, always empty, where ``local_positions``
    sends other ranks' tokens. Example: 24 positions and cp 3 give 8 + 1 = 9."""
    return max_blocks if cp == 1 else local_count(max_blocks, cp, 0) + 1


def local_positions(
    positions: np.ndarray, tokens_per_block: int, cp: int, c: int, width: int
) -> np.ndarray:
    """Token positions as CP rank c's local positions: a token of block b = p // tpb of
    class c is at (b // cp) * tpb + p % tpb of its local pages; any other goes to the last
    entry of a ``width``-entry local row, always empty, so that it maps to -1.

    Example (cp 2, tpb 4, rank 1, width 3): tokens 4, 7, 9 (blocks 1, 1, 2) are local
    positions 0, 3 and 8 (entry 2: no page)."""
    block = positions // tokens_per_block
    local = (block // cp) * tokens_per_block + positions % tokens_per_block
    return np.where(block % cp == c, local, (width - 1) * tokens_per_block)


def local_lengths(num_tokens: np.ndarray, tokens_per_block: int, cp: int, c: int) -> np.ndarray:
    """Tokens of each request on CP rank c: ``tpb`` per full block of its class, and the
    last block's tokens when that block is of its class (only the globally last block can be
    partial, so a rank's local pages are full but for its last one)."""
    full = num_tokens // tokens_per_block
    last = num_tokens % tokens_per_block
    return local_count(full, cp, c) * tokens_per_block + np.where(full % cp == c, last, 0)

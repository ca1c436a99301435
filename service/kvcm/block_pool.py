"""Free slots of one pool group: a FIFO ring of int32 slot ids with O(1) removal by slot.

Allocation takes from the head, freeing appends at the tail, so the slot freed longest ago is
reused first: with prefix reuse that is least-recently-used eviction, since a freed block that
is still cached stays in the queue until its slot is taken. Both ends move by slices:
allocating or freeing k slots is a few numpy copies, never a Python loop over blocks.

A prefix hit takes a cached slot out of the middle of the queue (``claim``). That entry is
left in the ring and skipped later: an entry at absolute position p is live only while its
slot is free and ``_pos[slot] == p`` (a slot claimed and freed again has a newer entry). The
ring has room for twice the slots; when stale entries would overflow it, the live ones are
compacted in order.

Example with 4 slots: the ring starts [0 1 2 3]; pop(3) gives [0 1 2]; push([2 0]) makes the
free order [3 2 0]; claim([2]) makes it [3 0]; pop(2) gives [3 0].
"""

from __future__ import annotations

import numpy as np

_Saved = tuple[np.ndarray, np.ndarray, np.ndarray, int, int, int]


class BlockPool:
    __slots__ = ("_count", "_free", "_head", "_len", "_pos", "_ring", "num_slots")

    def __init__(self, num_slots: int) -> None:
        self.num_slots = num_slots
        cap = max(2 * num_slots, 1)
        self._ring = np.zeros(cap, dtype=np.int32)
        self._ring[:num_slots] = np.arange(num_slots, dtype=np.int32)
        #: Absolute ring position of each free slot's live entry.
        self._pos = np.arange(num_slots, dtype=np.int64)
        self._free = np.ones(num_slots, dtype=bool)
        self._head = 0  # absolute position of the first entry
        self._len = num_slots  # entries, live and stale
        self._count = num_slots  # live entries (free slots)

    @property
    def num_free(self) -> int:
        return self._count

    def _entries(self, start: int, n: int) -> np.ndarray:
        cap = self._ring.size
        idx = (start + np.arange(n)) % cap
        return self._ring[idx]

    def _live(self, start: int, slots: np.ndarray) -> np.ndarray:
        pos = start + np.arange(slots.size)
        return self._free[slots] & (self._pos[slots] == pos)

    def pop(self, k: int) -> np.ndarray:
        """Take the k oldest free slots; the caller has checked that k <= num_free."""
        if k == 0:
            return np.empty(0, dtype=np.int32)
        stale = self._len - self._count
        window = self._entries(self._head, min(self._len, k + stale))
        if stale == 0:
            out, used = window[:k].copy(), k
        else:
            live = np.flatnonzero(self._live(self._head, window))[:k]
            out, used = window[live], int(live[-1]) + 1
        self._free[out] = False
        self._head += used
        self._len -= used
        self._count -= k
        return out

    def push(self, slots: np.ndarray) -> None:
        """Return slots to the tail, in the order given (the first is reused first)."""
        k = len(slots)
        if k == 0:
            return
        if self._len + k > self._ring.size:
            self._compact()
        cap = self._ring.size
        start = self._head + self._len
        pos = start + np.arange(k)
        self._ring[pos % cap] = slots
        self._pos[slots] = pos
        self._free[slots] = True
        self._len += k
        self._count += k

    def claim(self, slots: np.ndarray) -> None:
        """Take these free slots out of the queue wherever they are (prefix hits)."""
        if len(slots):
            self._free[slots] = False
            self._count -= len(slots)

    def is_free(self, slots: np.ndarray) -> np.ndarray:
        return self._free[slots]

    def _compact(self) -> None:
        order = self.free_order()
        self._ring[: order.size] = order
        self._pos[order] = np.arange(order.size)
        self._head, self._len = 0, order.size

    def checkpoint(self) -> _Saved:
        """A copy of the queue, for ``restore``."""
        return (
            self._ring.copy(),
            self._pos.copy(),
            self._free.copy(),
            self._head,
            self._len,
            self._count,
        )

    def restore(self, saved: _Saved) -> None:
        ring, pos, free, self._head, self._len, self._count = saved
        self._ring[:] = ring
        self._pos[:] = pos
        self._free[:] = free

    def free_order(self) -> np.ndarray:
        """The free slots, next to be allocated first (for tests and debugging)."""
        window = self._entries(self._head, self._len)
        return window[self._live(self._head, window)]

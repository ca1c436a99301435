"""Free slots of one pool group: a FIFO ring of int32 slot ids with removal by slot.

Allocation takes from the head, freeing appends at the tail, so the slot freed longest ago is
reused first: with prefix reuse that is least-recently-used eviction, since a freed block that
is still cached stays in the queue until its slot is taken. Both ends move by slices:
allocating or freeing k slots is a few numpy copies, never a Python loop over blocks.

A prefix hit takes a cached slot out of the middle of the queue (``claim``): its ring entry
becomes a tombstone (-1), found through ``_pos`` (the absolute ring position of each free
slot's entry, written by ``push``), and skipped when the head passes it. The ring has room
for twice the slots; when tombstones would overflow it, the live entries are compacted in
order.

Example with 4 slots: the ring starts [0 1 2 3]; pop(3) gives [0 1 2]; push([2 0]) makes the
free order [3 2 0]; claim([2]) makes it [3 0] (ring [3 -1 0]); pop(2) gives [3 0].

Slots below ``reserved`` are never in the queue, so never handed out: with the null page,
slot 0 (``reserved=1``); 4 slots then start as the ring [1 2 3], three of them usable.
"""

from __future__ import annotations

import numpy as np

_Saved = tuple[np.ndarray, np.ndarray, int, int, int]


class BlockPool:
    __slots__ = ("_count", "_head", "_len", "_pos", "_ring", "num_slots", "num_usable")

    def __init__(self, num_slots: int, reserved: int = 0) -> None:
        self.num_slots = num_slots
        #: Slots the queue can hand out: all but the reserved ones.
        self.num_usable = num_slots - reserved
        self._ring = np.full(max(2 * num_slots, 1), -1, dtype=np.int32)
        self._ring[: self.num_usable] = np.arange(reserved, num_slots, dtype=np.int32)
        # Ring position of each slot's entry: slot s starts at s - reserved (a reserved slot's
        # value is never read: it is never pushed or claimed).
        self._pos = np.arange(-reserved, self.num_usable, dtype=np.int64)
        self._head = 0  # absolute position of the first entry
        self._len = self.num_usable  # entries, tombstones included
        self._count = self.num_usable  # free slots

    @property
    def num_free(self) -> int:
        return self._count

    def _entries(self, start: int, n: int) -> np.ndarray:
        """Ring entries at absolute positions [start, start + n): a slice unless it wraps."""
        cap = self._ring.size
        first = start % cap
        if first + n <= cap:
            return self._ring[first : first + n]
        return np.concatenate((self._ring[first:], self._ring[: first + n - cap]))

    def pop(self, k: int) -> np.ndarray:
        """Take the k oldest free slots; the caller has checked that k <= num_free.

        With tombstones in the ring, the entries read from the head grow (doubling) until k
        are live: prefix hits leave tombstones anywhere in the queue, and reading past all of
        them (thousands in a large pool) at each pop would cost more than the pop.
        """
        if k == 0:
            return np.empty(0, dtype=np.int32)
        first = self._entries(self._head, k)
        # Tombstones anywhere, but none of them among the first k entries (the usual case:
        # a hit's tombstone sits where its slot was freed, far from the head).
        if self._len == self._count or first.min() >= 0:
            out, used = first.copy(), k
        else:
            span = k
            while True:
                span = min(self._len, span)
                window = self._entries(self._head, span)
                live = np.flatnonzero(window >= 0)
                if live.size >= k or span == self._len:
                    break
                span = 2 * span + (k - live.size)
            live = live[:k]
            out, used = window[live], int(live[-1]) + 1
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
            self.compact()
        cap = self._ring.size
        start = self._head + self._len
        first = start % cap
        if first + k <= cap:
            self._ring[first : first + k] = slots
        else:
            split = cap - first
            self._ring[first:] = slots[:split]
            self._ring[: k - split] = slots[split:]
        self._pos[slots] = np.arange(start, start + k)
        self._len += k
        self._count += k

    def claim(self, slots: np.ndarray) -> None:
        """Take these free slots out of the queue wherever they are (prefix hits)."""
        if len(slots):
            self._ring[self._pos[slots] % self._ring.size] = -1
            self._count -= len(slots)

    def compact(self) -> None:
        """Rewrite the ring as the live entries in order, from position 0 (no tombstones)."""
        order = self.free_order()
        self._ring[:] = -1
        self._ring[: order.size] = order
        self._pos[order] = np.arange(order.size)
        self._head, self._len = 0, order.size

    def checkpoint(self) -> _Saved:
        """A copy of the queue, for ``restore``."""
        return self._ring.copy(), self._pos.copy(), self._head, self._len, self._count

    def restore(self, saved: _Saved) -> None:
        ring, pos, self._head, self._len, self._count = saved
        self._ring[:] = ring
        self._pos[:] = pos

    def free_order(self) -> np.ndarray:
        """The free slots, next to be allocated first (for tests and debugging)."""
        window = self._entries(self._head, self._len)
        return window[window >= 0]

"""Free slots of one pool group: a FIFO ring of int32 slot ids.

Allocation takes from the head, freeing appends at the tail, so the slot freed longest ago is
reused first (the order prefix reuse will need for LRU eviction). Both ends move by slices:
allocating or freeing k slots is one or two numpy copies, never a Python loop over blocks.

Example with 4 slots: the ring starts [0 1 2 3]; pop(3) gives [0 1 2]; push([2 0]) makes the
free order [3 2 0]; pop(2) gives [3 2].
"""

from __future__ import annotations

import numpy as np


class BlockPool:
    __slots__ = ("_count", "_head", "_ring", "num_slots")

    def __init__(self, num_slots: int) -> None:
        self.num_slots = num_slots
        self._ring = np.arange(num_slots, dtype=np.int32)
        self._head = 0
        self._count = num_slots

    @property
    def num_free(self) -> int:
        return self._count

    def pop(self, k: int) -> np.ndarray:
        """Take the k oldest free slots; the caller has checked that k <= num_free."""
        n, head = self.num_slots, self._head
        end = head + k
        if end <= n:
            out = self._ring[head:end].copy()
        else:
            out = np.concatenate((self._ring[head:], self._ring[: end - n]))
        self._head = end % n if n else 0
        self._count -= k
        return out

    def push(self, slots: np.ndarray) -> None:
        """Return slots to the tail, in the order given (the first is reused first)."""
        k = len(slots)
        n = self.num_slots
        tail = (self._head + self._count) % n
        end = tail + k
        if end <= n:
            self._ring[tail:end] = slots
        else:
            split = n - tail
            self._ring[tail:] = slots[:split]
            self._ring[: end - n] = slots[split:]
        self._count += k

    def checkpoint(self) -> tuple[np.ndarray, int, int]:
        """A copy of the free list, for ``restore`` (one copy of num_slots int32)."""
        return self._ring.copy(), self._head, self._count

    def restore(self, saved: tuple[np.ndarray, int, int]) -> None:
        ring, self._head, self._count = saved
        self._ring[:] = ring

    def free_order(self) -> np.ndarray:
        """The free slots, next to be allocated first (for tests and debugging)."""
        idx = (self._head + np.arange(self._count)) % max(self.num_slots, 1)
        return self._ring[idx]

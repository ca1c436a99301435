"""The index in this process: the router's default when it has no Redis.

A dict from block key (32 bytes) to holder mask (a Python int, ``store.member`` bits), and
per slot the keys it has bits in, so that dropping a slot clears exactly those (they share
the index's key objects: about 40 bytes more per held block, not 32 + 33). The per-slot
keys are dicts to None, not sets: a dict of bytes and None is not tracked by the cyclic
garbage collector, a set is, and a full collection walking a million set entries stalls
every route for 60 ms. Slots are reused lowest first. Nothing survives the process: a
restarted router loads every sidecar's snapshot again.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from itertools import repeat

from .keyspace import KeySpace
from .store import Applied, Cursor, Group, Op, Walk, member

#: Masks a lookup hands a walk at once: a walk stops early, so the rest are never read.
CHUNK = 256


class MemoryStore:
    def __init__(self) -> None:
        self.space: KeySpace | None = None
        self.width = 0
        self.masks: dict[bytes, int] = {}
        self.slot_keys: dict[int, dict[bytes, None]] = {}
        self.cursors: dict[str, Cursor] = {}
        self._free: list[int] = []
        self._next = 0

    async def bind(self, space: KeySpace) -> KeySpace:
        if self.space is None:
            self.space = space
            self.width = 2 * len(space.groups)
        return self.space

    async def cursor(self, sidecar: str) -> Cursor | None:
        return self.cursors.get(sidecar)

    def _claim(self) -> int:
        if self._free:
            return heapq.heappop(self._free)
        self._next += 1
        return self._next - 1

    def _drop(self, slot: int) -> None:
        keep = ~(((1 << self.width) - 1) << (slot * self.width))
        masks = self.masks
        for key in self.slot_keys.pop(slot, ()):
            mask = masks[key] & keep
            if mask:
                masks[key] = mask
            else:
                del masks[key]
        heapq.heappush(self._free, slot)

    def _set(self, slot: int, bit: int, keys: Sequence[bytes]) -> None:
        masks = self.masks
        held = self.slot_keys.setdefault(slot, {})
        for key in keys:
            masks[key] = masks.get(key, 0) | bit
        held.update(dict.fromkeys(keys))

    async def replace(
        self,
        sidecar: str,
        generation: str,
        last_seq: int,
        groups: Sequence[Group],
        expect: Cursor | None = None,
    ) -> Cursor | None:
        if expect is not None:
            mine = self.cursors.get(sidecar)
            if (
                mine is None
                or (mine.slot, mine.generation) != (expect.slot, expect.generation)
                or mine.last_seq >= last_seq
            ):
                return None
        slot = self._claim()
        self.slot_keys[slot] = {}
        for g in groups:
            self._set(slot, 1 << member(slot, self.width, g.group, g.tier), g.keys)
        old = self.cursors.get(sidecar)
        cursor = self.cursors[sidecar] = Cursor(slot, generation, last_seq)
        if old is not None:
            self._drop(old.slot)
        return cursor

    async def apply(self, sidecar: str, cursor: Cursor, ops: Sequence[Op]) -> Applied:
        mine = self.cursors.get(sidecar)
        if mine is None or (mine.slot, mine.generation) != (cursor.slot, cursor.generation):
            return Applied("stale", mine)
        if ops and ops[0].seq > mine.last_seq + 1:
            return Applied("gap", mine)
        slot, last = mine.slot, mine.last_seq
        slot_bits = ((1 << self.width) - 1) << (slot * self.width)
        masks, held = self.masks, self.slot_keys[slot]
        for op in ops:
            if op.seq <= last:
                continue
            bit = 1 << member(slot, self.width, op.group, op.tier)
            if op.stored:
                self._set(slot, bit, op.keys)
            else:
                for key in op.keys:
                    mask = masks.get(key, 0)
                    if not mask & bit:
                        continue
                    mask &= ~bit
                    if mask:
                        masks[key] = mask
                    else:
                        del masks[key]
                    if not mask & slot_bits:
                        held.pop(key, None)
            last = op.seq
        new = self.cursors[sidecar] = Cursor(slot, mine.generation, last)
        return Applied("ok", new)

    async def lookup(self, sidecars: Sequence[str], keys: Sequence[bytes], walk: Walk) -> None:
        walk.start({s: self.cursors[s] for s in sidecars if s in self.cursors})
        get = self.masks.get
        for i in range(0, len(keys), CHUNK):
            if not walk.feed(list(map(get, keys[i : i + CHUNK], repeat(0)))):
                return

    async def check(self) -> bool:
        return True

    async def renew(self, sidecars: Sequence[str]) -> list[str]:
        """No leases (the process's own sidecars are the only ones): only those it holds
        nothing of are missing."""
        return [s for s in sidecars if s not in self.cursors]

    async def sweep(self) -> int:
        """Nothing to sweep: a replaced slot's entries are dropped at once."""
        return 0

    async def close(self) -> None:
        """Nothing to release."""

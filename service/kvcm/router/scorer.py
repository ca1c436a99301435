"""A prompt's holder masks, walked into each sidecar's hits (the rules of the sidecar's own
``probe`` and ``probe_tiers``).

The walk follows every (sidecar, layer group) at once with two ints: the device bits still
held from block 0 on, and the bits held on the device or the host (a host bit is its
device bit's neighbour, so ``mask | mask >> 1`` folds the host into the device's position).
A bit that drops out at block i ends that group's run at i. Per block that is a few
big-int operations whatever the number of sidecars, and with a full-attention group the walk
ends at the first block no sidecar holds (a full group needs every block of a hit).

A sidecar's hit is the longest prefix, at most ``cap`` blocks, whose needed blocks every
group holds (``prefix_cache.needed_blocks``): all blocks for a full group, so at most its
run; for a sliding window its sinks and the blocks the first new token attends to, checked
from the longest candidate down. A needed block k that is missing rules out every hit
longer than k at once (each of them needs k), so the next candidate is k.

Example (tokens_per_block 4, one full group, sidecars a in slot 0 and b in slot 1, width 2):
a holds blocks 0-2 on the device, b holds 0 on the device and 1 on the host; a 17-token
prompt (cap 4): a hits 3 blocks on the device; b 1 on the device, 2 with the host.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ..prefix_cache import needed_blocks
from .keyspace import KeySpace
from .store import Cursor, member


@dataclass(frozen=True, slots=True)
class Hits:
    """One sidecar's hits for a prompt (blocks): the prefix served from the device or the
    host, from the device alone, and per layer group (device run, host blocks after it)."""

    hit_blocks: int
    device_hit_blocks: int
    groups: tuple[tuple[int, int], ...]


def _bits(value: int) -> list[int]:
    """Positions of the set bits of ``value``."""
    out = []
    while value:
        low = value & -value
        out.append(low.bit_length() - 1)
        value ^= low
    return out


class Walk:
    """Reads masks in prompt order (``store.Walk``), then ``hits()`` per sidecar."""

    def __init__(self, space: KeySpace, cap: int) -> None:
        self.space = space
        self.cap = cap if space.reusable else 0
        self.width = 2 * len(space.groups)
        self.cursors: dict[str, Cursor] = {}
        self.masks: list[int] = []
        self._device = 0
        self._alive_device = self._alive_any = 0
        self._run_device: dict[int, int] = {}
        self._run_any: dict[int, int] = {}
        self._stop_early = space.has_full_group

    def start(self, cursors: dict[str, Cursor]) -> None:
        self.cursors = cursors
        device = 0
        for cursor in cursors.values():
            for g in range(len(self.space.groups)):
                device |= 1 << member(cursor.slot, self.width, g, 0)
        self._device = self._alive_device = self._alive_any = device

    def feed(self, masks: Sequence[int]) -> bool:
        room = self.cap - len(self.masks)
        if room <= 0 or not self._device:
            return False
        alive_d, alive_a = self._alive_device, self._alive_any
        i = len(self.masks)
        for mask in masks[:room]:
            held_d = alive_d & mask
            held_a = alive_a & (mask | mask >> 1)
            if held_d != alive_d:
                for bit in _bits(alive_d ^ held_d):
                    self._run_device[bit] = i
            if held_a != alive_a:
                for bit in _bits(alive_a ^ held_a):
                    self._run_any[bit] = i
            alive_d, alive_a = held_d, held_a
            i += 1
            if not alive_a and self._stop_early:
                break
        self.masks.extend(masks[: i - len(self.masks)])
        self._alive_device, self._alive_any = alive_d, alive_a
        return len(self.masks) < self.cap and not (self._stop_early and not alive_a)

    def hits(self) -> dict[str, Hits]:
        return {name: self._hits(cursor.slot) for name, cursor in self.cursors.items()}

    def _hits(self, slot: int) -> Hits:
        walked = len(self.masks)
        groups = []
        bound_d = bound_a = walked
        for g, rule in enumerate(self.space.groups):
            bit = member(slot, self.width, g, 0)
            run_d = self._run_device.get(bit, walked)
            run_a = self._run_any.get(bit, walked)
            groups.append((run_d, run_a - run_d))
            if rule.sliding_window is None:
                bound_d, bound_a = min(bound_d, run_d), min(bound_a, run_a)
        if not self.cap:
            return Hits(0, 0, tuple(groups))
        return Hits(
            self._windowed(slot, bound_a, 3), self._windowed(slot, bound_d, 1), tuple(groups)
        )

    def _windowed(self, slot: int, b: int, tiers: int) -> int:
        """The longest hit of at most ``b`` blocks whose window groups hold their needed
        blocks on the tiers of ``tiers`` (1: the device, 3: device or host)."""
        windows = [(g, w) for g, w in enumerate(self.space.windows) if w[0] is not None]
        tpb = self.space.tokens_per_block
        masks = self.masks
        while b > 0 and windows:
            missing = b
            for g, window in windows:
                shift = member(slot, self.width, g, 0)
                for i in needed_blocks(b, [window], tpb)[0]:
                    if not (masks[i] >> shift) & tiers:
                        missing = min(missing, i)
                        break
            if missing == b:
                return b
            b = missing
        return b

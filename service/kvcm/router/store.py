"""The index store's contract: what a follower writes and what a route reads.

The index maps each block key to a holder mask, an int with one bit per (slot, layer group,
tier): bit ``slot * width + 2 * group + tier`` (tier 0 the device, 1 the host; ``width`` is
twice the layer groups). A slot is one load of one sidecar: a snapshot goes into a fresh
slot, which then replaces the sidecar's previous slot in one step, so a sidecar seen with a
new generation (or after lost events) drops all its old entries at once, and a route never
sees half a snapshot. Example: two layer groups (width 4), slot 3 holding a block on the host
in group 1: bit 3 * 4 + 2 * 1 + 1 = 15.

A route reads the masks of a prompt's keys in order (``lookup``) and a ``Walk`` turns them
into hits, stopping as soon as it has what it needs (the store then reads no more).

Every write carries the cursor (slot, generation, last sequence number) it extends, and the
store applies only what extends its own cursor: events at or below its sequence number are
skipped, a gap is refused, and a cursor the store no longer has (another load replaced it,
or the store was emptied) is refused as stale. So two routers feeding one Redis, or a router
restarted mid-stream, cannot reorder a sidecar's events.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, Protocol

from .keyspace import KeySpace

DEVICE, HOST = 0, 1
TIERS = {"device": DEVICE, "host": HOST}


def member(slot: int, width: int, group: int, tier: int) -> int:
    """The bit of (slot, layer group, tier) in a holder mask."""
    return slot * width + 2 * group + tier


@dataclass(frozen=True, slots=True)
class Cursor:
    """Where a sidecar's entries stand in the store: its slot, the sidecar generation they
    are of, and the last event they include."""

    slot: int
    generation: str
    last_seq: int


@dataclass(frozen=True, slots=True)
class Op:
    """One event's change: ``keys`` (32 bytes each) stored in or removed from one layer
    group and tier, at sequence number ``seq``."""

    seq: int
    stored: bool
    group: int
    tier: int
    keys: tuple[bytes, ...]


@dataclass(frozen=True, slots=True)
class Applied:
    """A write's outcome: ``ok`` (``cursor`` is the new one), ``stale`` (the store has
    another cursor for the sidecar, or none: ``cursor``), ``gap`` (the ops start after
    the store's next sequence number; ``cursor`` is the store's)."""

    status: Literal["ok", "stale", "gap"]
    cursor: Cursor | None


@dataclass(frozen=True, slots=True)
class Group:
    """One (layer group, tier) of a snapshot: every key held there."""

    group: int
    tier: int
    keys: Sequence[bytes]


class Walk(Protocol):
    """A route's reader of holder masks (``scorer.Walk``)."""

    def start(self, cursors: dict[str, Cursor]) -> None:
        """The cursors of the sidecars asked for that the store has (before any mask)."""

    def feed(self, masks: Sequence[int]) -> bool:
        """The next blocks' masks, in prompt order; False once it needs no more."""


class IndexStore(Protocol):
    """The cluster-wide prefix index (``MemoryStore``, ``RedisStore``)."""

    async def bind(self, space: KeySpace) -> KeySpace:
        """The key space the index is of: ``space`` if it had none (the first sidecar)."""

    async def cursor(self, sidecar: str) -> Cursor | None:
        """The sidecar's cursor, None if the index holds nothing of it."""

    async def replace(
        self,
        sidecar: str,
        generation: str,
        last_seq: int,
        groups: Sequence[Group],
        expect: Cursor | None = None,
    ) -> Cursor | None:
        """Load a snapshot (or nothing: an ``all_blocks_cleared``) into a fresh slot, then
        make it the sidecar's, dropping its previous slot's entries at once. With ``expect``
        (an ``all_blocks_cleared`` at ``last_seq``, after the events of ``expect``), only if
        the store's cursor is still in that slot and generation and before ``last_seq``:
        None otherwise, the store unchanged (another router moved the cursor)."""

    async def apply(self, sidecar: str, cursor: Cursor, ops: Sequence[Op]) -> Applied:
        """Apply ops that extend ``cursor`` (see the module doc)."""

    async def lookup(self, sidecars: Sequence[str], keys: Sequence[bytes], walk: Walk) -> None:
        """Feed ``walk`` the cursors of ``sidecars``, then the masks of ``keys`` in order
        until it wants no more."""

    async def check(self) -> bool:
        """False once, when the index was found emptied (a Redis restarted without its
        data): every sidecar must be loaded again."""

    async def renew(self, sidecars: Sequence[str]) -> list[str]:
        """Periodic: the sidecars followed now are still wanted (the leases of whatever slots
        their stored cursors point at). Returns those the store has no live cursor of: their
        followers must load again."""

    async def sweep(self) -> int:
        """Periodic: clear what dropped slots left and reuse the slots; returns how many
        block keys changed."""

    async def close(self) -> None: ...

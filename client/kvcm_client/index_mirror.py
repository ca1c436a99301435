"""A follower's copy of one kvcm's prefix index, built from a snapshot and its KV events
(docs/prefix-reuse.md#following-the-index).

A router that scores replicas by cached prefix keeps one mirror per sidecar. The sidecar is
the exact source: ``index_snapshot()`` says what it caches now and the sequence number of the
last event that includes; ``events(after=that)`` says every change since. The mirror refuses
what it cannot apply exactly and asks for a snapshot again: a batch of another generation
(the sidecar restarted or registered another model, and sequence numbers start again), a
batch that says events were lost (the follower fell behind the sidecar's buffer), or a gap
in sequence numbers.

Worked example: a snapshot of generation g at seq 7 with key k1 on the device of layer group
0; then events 8 (k2 stored on the device) and 9 (k1 removed from the device, stored on the
host): the mirror holds k2 on the device and k1 on the host, at seq 9.
"""

from __future__ import annotations

from .models import IndexSnapshot, KVEvents

Tier = str
"""``"device"`` or ``"host"``."""


class IndexMirror:
    """Block keys (hex) per (layer group, tier) of one sidecar, at ``last_seq`` of its
    ``generation``; ``needs_snapshot`` until a snapshot is loaded or after a refused batch."""

    def __init__(self) -> None:
        self.generation: str | None = None
        self.last_seq = 0
        self.keys: dict[tuple[int, Tier], set[str]] = {}
        self.needs_snapshot = True

    def load(self, snapshot: IndexSnapshot) -> None:
        """Replace everything with ``snapshot``."""
        self.generation = snapshot.generation
        self.last_seq = snapshot.last_seq
        self.keys = {(g.layer_group, g.tier): set(g.block_keys) for g in snapshot.groups}
        self.needs_snapshot = False

    def apply(self, batch: KVEvents) -> bool:
        """Apply a batch of events; False (and nothing applied) when it cannot be applied
        exactly: another generation, lost events, or a gap after ``last_seq``. Events at
        or before ``last_seq`` (a snapshot already includes them) are skipped."""
        if (
            self.needs_snapshot
            or batch.generation != self.generation
            or batch.lost
            or (batch.events and batch.events[0].seq > self.last_seq + 1)
        ):
            self.needs_snapshot = True
            return False
        for event in batch.events:
            if event.seq <= self.last_seq:
                continue
            if event.kind == "all_blocks_cleared":
                self.keys.clear()
            else:
                assert event.layer_group is not None
                keys = self.keys.setdefault((event.layer_group, event.tier), set())
                if event.kind == "block_stored":
                    keys.update(event.block_keys)
                else:
                    keys.difference_update(event.block_keys)
            self.last_seq = event.seq
        return True

    def holds(self, layer_group: int, tier: Tier, key: str) -> bool:
        return key in self.keys.get((layer_group, tier), ())

    def as_sets(self) -> dict[tuple[int, Tier], set[str]]:
        """The non-empty key sets (what a snapshot of the same state would list)."""
        return {k: v for k, v in self.keys.items() if v}

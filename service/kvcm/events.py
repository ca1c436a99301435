"""The bounded log of KV events, kept as compact records and built into dicts when read.

A commit publishes blocks far more often than a router reads events, so a publish records only
the facts it already has, as a tuple: the keys as bytes (not hex), the parent key, the tokens
as the int32 bytes the keys were hashed from (not a list of ints). ``after`` builds the event
dicts (``KVEvent`` fields) from them. A log built with ``enabled=False`` records nothing and
its sequence number stays 0: ``ManagerConfig.kv_events=False``.

Records: ``(seq, "block_stored", layer_group, keys, parent, token_bytes or None, lora_id,
has_salt)``, ``(seq, "block_removed", layer_group, keys)``, ``(seq, "all_blocks_cleared")``;
events of the host tier (docs/host-tier.md) carry ``"host"`` as one more field, and the dict
says ``tier`` (``"device"`` otherwise). A block moved to the host is a ``block_stored`` on
the host, then a ``block_removed`` on the device; one brought back a ``block_stored`` on the
device, then a ``block_removed`` on the host: a follower never sees a block nowhere.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any

import numpy as np


def _built(record: tuple[Any, ...]) -> dict[str, Any]:
    """The event dict of a record (the fields of ``KVEvent``)."""
    seq, kind = record[0], record[1]
    if kind == "all_blocks_cleared":
        return {"seq": seq, "kind": kind}
    tier = "device"
    if record[-1] == "host":
        tier, record = "host", record[:-1]
    event = {
        "seq": seq,
        "kind": kind,
        "layer_group": record[2],
        "block_keys": [k.hex() for k in record[3]],
        "tier": tier,
    }
    if kind == "block_stored" and len(record) > 4:
        parent, tokens, lora_id, has_salt = record[4:]
        event["parent_key"] = None if parent is None else parent.hex()
        event["token_ids"] = None if tokens is None else np.frombuffer(tokens, "<i4").tolist()
        event["lora_id"] = lora_id
        event["has_salt"] = has_salt
    return event


@dataclass(slots=True)
class EventLog:
    capacity: int
    enabled: bool = True
    events: deque[tuple[Any, ...]] = field(default_factory=deque)
    last_seq: int = 0

    def _append(self, record: tuple[Any, ...]) -> None:
        self.last_seq += 1
        self.events.append(record)
        if len(self.events) > self.capacity:
            self.events.popleft()

    def stored(
        self,
        layer_group: int,
        keys: list[bytes],
        parent: bytes | None,
        token_bytes: bytes | None,
        lora_id: int | str | None,
        has_salt: bool,
    ) -> None:
        """Blocks published in one layer group (``token_bytes`` None for salted blocks)."""
        if self.enabled:
            seq = self.last_seq + 1
            self._append(
                (seq, "block_stored", layer_group, keys, parent, token_bytes, lora_id, has_salt)
            )

    def removed(self, layer_group: int, keys: list[bytes]) -> None:
        """Blocks evicted or taken out of one layer group."""
        if self.enabled:
            self._append((self.last_seq + 1, "block_removed", layer_group, keys))

    def host(self, kind: str, layer_group: int, keys: list[bytes]) -> None:
        """Blocks of one layer group stored on or removed from the host tier (keys only: the
        host keeps no parent or tokens)."""
        if self.enabled:
            self._append((self.last_seq + 1, kind, layer_group, keys, "host"))

    def cleared(self) -> None:
        if self.enabled:
            self._append((self.last_seq + 1, "all_blocks_cleared"))

    def after(self, seq: int, limit: int) -> tuple[list[dict[str, Any]], bool]:
        """Events with a sequence number above ``seq`` (at most ``limit``), as dicts, and
        whether some of those were already dropped."""
        first = self.events[0][0] if self.events else self.last_seq + 1
        lost = seq < first - 1
        start = max(0, seq + 1 - first)
        end = min(len(self.events), start + limit)
        return [_built(self.events[i]) for i in range(start, end)], lost

    def truncate(self, last_seq: int, kept: list[tuple[Any, ...]]) -> None:
        """Undo: back to the log as it was (``kept`` is its content then)."""
        self.events = deque(kept)
        self.last_seq = last_seq

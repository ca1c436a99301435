"""Which slot holds the block of each key, per reusable layer group, with KV events and stats.

The cache only indexes; ownership stays with the coordinator: a slot is in use while its
reference count is positive, and free (in its pool group's LRU queue) otherwise. A cached free
slot keeps its key until the queue hands the slot out again (eviction), so the blocks freed
longest ago are evicted first.

The index is partitioned by scope, the root key of a request's extra keys (LoRA id, cache
salt): a lookup only sees blocks published under the same root. Honest keys of two scopes
never collide anyway (the chain starts at the root), so this changes nothing for them; it
makes a hit across scopes impossible for a client that sends block keys it read elsewhere
(events, another tenant's traffic) with its own, other, extra keys.

KV events (for routers that track what each replica caches) have increasing sequence numbers
and live in a bounded log; a reader that asks for events the log has already dropped is told
so (``lost``) and should resynchronise, e.g. by treating the replica's cache as unknown.
The log (``events.EventLog``) builds events only when they are read, and records none with
``kv_events`` off.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, replace
from itertools import compress, count
from typing import Any

import numpy as np

from .events import EventLog
from .layout import Layout


@dataclass(slots=True)
class CacheStats:
    queries: int = 0
    query_tokens: int = 0
    hit_tokens: int = 0
    stored_blocks: int = 0
    evictions: int = 0


_EMPTY: dict[bytes, int] = {}


class PrefixCache:
    def __init__(
        self,
        layout: Layout,
        slots: dict[Any, int],
        event_capacity: int = 10_000,
        kv_events: bool = True,
    ):
        groups = layout.layer_groups
        self.reusable = [g.reuse == "reusable" for g in groups]
        self.group_pool = [int(g.pool_group) for g in groups]
        #: Per layer group: scope (root key) -> block key -> slot.
        self.index: list[dict[bytes, dict[bytes, int]]] = [{} for _ in groups]
        #: Per pool group: slot -> (layer group, scope, key) of the cached slots.
        self.slot_key: list[dict[int, tuple[int, bytes, bytes]]] = [{} for _ in layout.pool_groups]
        self.cached = [np.zeros(slots[pg.pool_group_id], dtype=bool) for pg in layout.pool_groups]
        self.stats = CacheStats()
        self.log = EventLog(event_capacity, kv_events)

    def num_cached(self, pool_group: int) -> int:
        return len(self.slot_key[pool_group])

    def scope(self, group: int, root: bytes) -> dict[bytes, int]:
        """Key -> slot of layer group ``group``'s blocks published under ``root`` (read only;
        an empty dict when there are none)."""
        return self.index[group].get(root, _EMPTY)

    def store(
        self,
        group: int,
        root: bytes,
        keys: list[bytes],
        slots: list[int],
        parent: bytes | None,
        token_bytes: bytes,
        lora_id: int | str | None,
        has_salt: bool,
    ) -> None:
        """Publish full blocks of one layer group (already filtered: new keys, live slots);
        ``token_bytes``: their token ids as int32 bytes, for the event."""
        pg = self.group_pool[group]
        index = self.index[group].setdefault(root, {})
        index.update(zip(keys, slots, strict=True))
        self.slot_key[pg].update(zip(slots, [(group, root, key) for key in keys], strict=True))
        flags = self.cached[pg]
        if len(slots) <= 4:  # a decode-time commit: scalar writes beat converting the list
            for slot in slots:
                flags[slot] = True
        else:
            flags[slots] = True
        self.stats.stored_blocks += len(keys)
        # A salted tenant asked for isolation: its prompts do not leave in events.
        self.log.stored(group, keys, parent, None if has_salt else token_bytes, lora_id, has_salt)

    def evict(self, pool_group: int, slots: np.ndarray) -> None:
        """Slots the queue just handed out: forget the blocks they held."""
        if not self.slot_key[pool_group]:  # nothing cached in this pool group
            return
        hit = slots[self.cached[pool_group][slots]]
        if hit.size:
            self._remove(pool_group, hit.tolist())
            self.stats.evictions += int(hit.size)

    def uncache(self, pool_group: int, slots: list[int]) -> None:
        """Forget these slots' blocks (their owner is about to overwrite them)."""
        self._remove(pool_group, [s for s in slots if self.cached[pool_group][s]])

    def _remove(self, pool_group: int, slots: list[int]) -> None:
        by_group: dict[int, list[bytes]] = {}
        for slot in slots:
            group, root, key = self.slot_key[pool_group].pop(slot)
            scoped = self.index[group][root]
            del scoped[key]
            if not scoped:
                del self.index[group][root]
            self.cached[pool_group][slot] = False
            by_group.setdefault(group, []).append(key)
        for group, keys in by_group.items():
            self.log.removed(group, keys)

    def clear(self) -> None:
        for index in self.index:
            index.clear()
        for keys, mask in zip(self.slot_key, self.cached, strict=True):
            keys.clear()
            mask[:] = False
        self.log.cleared()

    # -- undo for all-or-nothing steps -------------------------------------------------------

    def checkpoint(self) -> tuple[Any, ...]:
        return (
            [{root: dict(keys) for root, keys in i.items()} for i in self.index],
            [dict(k) for k in self.slot_key],
            [m.copy() for m in self.cached],
            replace(self.stats),
            self.log.last_seq,
            list(self.log.events),
        )

    def restore(self, saved: tuple[Any, ...]) -> None:
        index, slot_key, cached, stats, last_seq, events = saved
        self.index, self.slot_key = index, slot_key
        for mask, old in zip(self.cached, cached, strict=True):
            mask[:] = old
        self.stats = stats
        self.log.truncate(last_seq, events)


def needed_blocks(b: int, windows: list[tuple[int | None, int]], tpb: int) -> list[list[int]]:
    """Per layer group, the blocks a hit of ``b`` blocks needs (as ``find_hit`` rules): all
    of ``[0, b)`` for full attention; a window's sinks and the blocks the first new token
    attends to, ``[max(S, (b * tpb + 1 - W) // tpb), b)``. Example: W 8, tpb 4, no sinks,
    b 3: blocks [1, 2]."""
    out = []
    for window, sinks in windows:
        if window is None:
            out.append(list(range(b)))
        else:
            start = max(sinks, (b * tpb + 1 - window) // tpb)
            out.append([*range(min(sinks, b)), *range(start, b)])
    return out


def hit_cap(num_keys: int, num_tokens: int, tokens_per_block: int) -> int:
    """The most blocks a prompt of ``num_tokens`` tokens with ``num_keys`` block keys can
    reuse: its full blocks before its last token (which is always computed), so at most
    num_tokens - 1 tokens. Example: tpb 4, 12 tokens (3 keys): 2 blocks, since block 2 holds
    the last token; 13 tokens: 3. At most 0 means no hit."""
    return min(num_keys, (num_tokens - 1) // tokens_per_block)


def find_hit(
    cache: PrefixCache,
    root: bytes,
    keys: list[bytes],
    num_tokens: int,
    tokens_per_block: int,
    windows: list[tuple[int | None, int]],
    length_only: bool = False,
) -> tuple[int, list[np.ndarray], list[int]]:
    """The longest block-aligned prefix every layer group can serve, at most num_tokens - 1.

    ``windows[g]`` is (sliding window or None, sink blocks) of layer group g. A full-attention
    group needs every block of the prefix; a sliding-window group only its sinks and the
    blocks the first new token (at position H) attends to, ``[max(S, (H + 1 - W) // tpb), H /
    tpb)``; a group with ``reuse="none"`` serves nothing, so then nothing is reused.

    Returns (hit blocks b, per group the slots of blocks [0, b) with -1 where a window does not
    need them, per group the end of the released run); with ``length_only`` (a probe) just b.
    Example: W = 8, tpb 4, no sinks, 3 cached blocks, 13 tokens: b = 3 (H = 12) needs blocks
    [(12 + 1 - 8) // 4, 3) = [1, 3), so the slots are [-1, s1, s2] and the released run ends
    at 1.
    """
    tpb = tokens_per_block
    cap = hit_cap(len(keys), num_tokens, tpb)
    if cap <= 0 or not all(cache.reusable):
        return 0, [], []
    index = [cache.scope(g, root) for g in range(len(windows))]
    for g, (window, _) in enumerate(windows):
        if window is None:
            # Length of the cached run of keys (C-level iteration: prompts have 100s of blocks).
            present = map(index[g].__contains__, keys[:cap])
            cap = next(compress(count(), map(operator.not_, present)), cap)
    for b in range(cap, 0, -1):
        starts, needed = [], []
        for g, (window, sinks) in enumerate(windows):
            if window is None:
                starts.append(0)
                needed.append([])
                continue
            start = max(sinks, (b * tpb + 1 - window) // tpb)
            blocks = [*range(min(sinks, b)), *range(start, b)]
            if not all(keys[i] in index[g] for i in blocks):
                break
            starts.append(start)
            needed.append(blocks)
        else:
            if length_only:
                return b, [], []
            hits, ends = [], []
            for g, (window, sinks) in enumerate(windows):
                lookup = index[g].__getitem__
                if window is None:
                    slots = np.fromiter(map(lookup, keys[:b]), dtype=np.int32, count=b)
                    ends.append(sinks)
                else:
                    slots = np.full(b, -1, dtype=np.int32)
                    for i in needed[g]:
                        slots[i] = lookup(keys[i])
                    ends.append(starts[g])
                hits.append(slots)
            return b, hits, ends
    return 0, [], []

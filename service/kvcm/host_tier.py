"""The host tier: cached blocks the device pools evict are copied to host memory instead of
being dropped, and a prefix hit on them copies them back (docs/host-tier.md).

One host region per pool group, ``host_slots`` slots of the pool group's slot size (every pool
of the group has its own region, as on the device), allocated in chunks of at most 64 MiB so
that a large tier does not stall start-up; pinned when the device is CUDA (a second ordinary
memory region on the CPU, so every feature runs in CI).

The index says where each block key of a layer group is: on the device (the prefix cache), on
the host (this index), or both (``BlockState``). Offloading happens inside the op that evicts
the device slot, before that slot is handed to its new owner; onboarding happens inside the
allocate that hits, before the hit is placed. Copies are queued and launched in batches by
``kvcm.tier_copies`` (one launch per step unless two copies of a step involve the same slot),
and every op waits for its copies before it answers: nothing outside the manager ever reads
or writes a slot whose copy is in flight.

Worked example (one pool group, 2 host slots): device slot 7 holds cached key k1 and is
handed out to a new request: k1's page is copied to host slot 0 and indexed there; later an
allocate whose prompt continues past the device hit with k1 takes a free device slot (say 3),
copies host slot 0 into it, publishes k1 on the device again and frees host slot 0.

State layers (docs/state-layers.md): each state group has a host region of ``state_slots``
slots of its slot size, holding suspended requests' live states (nothing is cached there, so
there is no index and no LRU). A request holds one host state slot id, the same in every
group, as it holds one live slot id on the device. The copier knows state group g as one more
pool group of a single pool (``state_target[g]``, numbered after the pool groups), so state
copies are batched and ordered with the blocks' copies.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass, field, fields
from enum import Enum
from typing import TYPE_CHECKING

import numpy as np
import torch

from .events import EventLog
from .layout import Layout
from .prefix_cache import needed_blocks
from .tier_copies import CopyStats, TierCopier

if TYPE_CHECKING:
    from .coordinator import Coordinator
    from .prefix_cache import PrefixCache

#: Largest single host allocation: a large tier is built from chunks of at most this size.
CHUNK_BYTES = 64 << 20

HostKey = tuple[int, bytes, bytes]
"""(layer group, scope root, block key) of a block on the host."""


class BlockState(Enum):
    """Where a cached block is: what the device index, the host index and the queued copies
    say together (``HostTier.state_of``). The transitions, each made by one op:

    - ``DEVICE`` -> ``COPYING_OUT``: its device slot is handed out (evicted); the copy to a
      host slot is queued and the host index has it. -> ``HOST`` when the copy completes.
    - ``HOST`` -> ``COPYING_IN``: a prefix hit takes a fresh device slot for it; the copy is
      queued, the device index has it, its host slot is free. -> ``DEVICE`` when it completes.
    - ``HOST`` -> ``BOTH``: the same block is computed and published again on the device.
      ``BOTH`` -> ``HOST`` when the device slot is evicted (no copy needed), -> ``DEVICE``
      when the host's LRU drops it.
    - ``DEVICE`` or ``HOST`` -> gone: evicted with no host tier, or dropped by the host LRU.

    The copying states exist only inside an op: every op waits for its copies before it
    answers, and until then nothing outside the manager sees the slots involved.
    """

    DEVICE = "device"
    COPYING_OUT = "copying_out"
    BOTH = "both"
    HOST = "host"
    COPYING_IN = "copying_in"


@dataclass(slots=True)
class HostStats(CopyStats):
    offloaded_blocks: int = 0
    offloaded_bytes: int = 0
    onboarded_blocks: int = 0
    onboarded_bytes: int = 0
    dropped_blocks: int = 0
    """Host blocks dropped to make room (the host tier's own LRU eviction)."""
    offloaded_states: int = 0
    """Suspended requests' live states copied to the host (one per suspend, every state
    group)."""
    onboarded_states: int = 0
    """Live states copied back at a resume."""


#: The counts an undo puts back (the copier's launch counts and times measure work that was
#: done, undone or not, and stay).
_UNDONE_COUNTS = tuple(f.name for f in fields(HostStats) if not f.name.startswith("copy_"))


@dataclass(slots=True)
class _Undo:
    """An all-or-nothing step's journal in the host tier (``HostTier.begin``): what its undo
    takes back, and what its end applies. Per pool group: the blocks its offloads stored
    (key, host slot, in order), the blocks to move to the LRU's end (already on the host,
    evicted again from the device), and the host slots its frees of suspended requests gave
    up (held back until the step ends); the counts, held slots and free state slots as the
    step found them."""

    counts: tuple[int, ...]
    held: dict[int, int]
    state_free: deque[int]
    stored: dict[int, list[tuple[HostKey, int]]] = field(default_factory=dict)
    touched: dict[int, list[HostKey]] = field(default_factory=dict)
    released: dict[int, list[list[int]]] = field(default_factory=dict)


class _Region:
    """``num_slots`` host slots of ``slot_bytes``, in chunks of at most ``CHUNK_BYTES``."""

    def __init__(self, num_slots: int, slot_bytes: int, pinned: bool) -> None:
        per_chunk = max(1, CHUNK_BYTES // max(slot_bytes, 1))
        self.per_chunk = per_chunk
        self.chunks = [
            torch.empty(
                (min(per_chunk, num_slots - start), slot_bytes),
                dtype=torch.uint8,
                pin_memory=pinned,
            )
            for start in range(0, num_slots, per_chunk)
        ]


class HostTier:
    """Host copies of evicted cached blocks, per pool group, with their own LRU."""

    def __init__(
        self,
        layout: Layout,
        device_pools: list[torch.Tensor],
        host_slots: dict[int, int],
        device: torch.device,
        log: EventLog,
        state_memory: list[torch.Tensor] | None = None,
        state_slots: int = 0,
    ) -> None:
        """``state_memory``: each state group's device slots, ``[slots, slot_bytes]`` uint8
        (``StatePools.memory``); ``state_slots``: host state slots per state group."""
        self.layout = layout
        self.log = log
        self.device_pools = device_pools
        self.pinned = device.type == "cuda"
        self.num_slots = dict(host_slots)
        #: Per pool group: its pools (a slot spans the same row of each) and slot bytes.
        self.pools_of = {pg.pool_group_id: list(pg.pools) for pg in layout.pool_groups}
        self.slot_bytes = {pg.pool_group_id: pg.slot_bytes for pg in layout.pool_groups}
        self.regions = {
            pool.pool_id: _Region(host_slots[pool.pool_group], pool.slot_bytes, self.pinned)
            for pool in layout.pools
        }
        state_memory = state_memory or []
        self.state_slots = state_slots if state_memory else 0
        self.state_regions = [
            _Region(self.state_slots, int(memory.shape[1]), self.pinned) for memory in state_memory
        ]
        num_pools, num_groups = len(device_pools), len(self.pools_of)
        self.state_target = [num_groups + g for g in range(len(state_memory))]
        #: Free host state slots, taken from the right.
        self.state_free = deque(range(self.state_slots - 1, -1, -1))
        self.stats = HostStats()
        self.copier = TierCopier(
            [*device_pools, *state_memory],
            {
                **{pool: region.chunks for pool, region in self.regions.items()},
                **{num_pools + g: region.chunks for g, region in enumerate(self.state_regions)},
            },
            {**self.pools_of, **{t: [num_pools + g] for g, t in enumerate(self.state_target)}},
            device,
            stats=self.stats,
        )
        self.group_pool = [int(g.pool_group) for g in layout.layer_groups]
        #: Per pool group: free host slots, taken from the right; slots a copy in just read
        #: go back on the left (reused last, so a later copy of the same step rarely has to
        #: wait for that read), and key -> host slot in LRU order.
        self.free = {pg: deque(range(n - 1, -1, -1)) for pg, n in host_slots.items()}
        self.lru: dict[int, OrderedDict[HostKey, int]] = {pg: OrderedDict() for pg in host_slots}
        #: Per pool group: host slots held by suspended requests (private, never dropped).
        self.held = dict.fromkeys(host_slots, 0)
        #: Inside an all-or-nothing step: what its undo puts back (``begin``).
        self._undo: _Undo | None = None

    # -- queries ---------------------------------------------------------------------------------

    def tensors(self) -> list[torch.Tensor]:
        """Every chunk of host memory the tier owns (blocks and state): what a transfer
        engine registers."""
        regions = [*self.regions.values(), *self.state_regions]
        return [chunk for region in regions for chunk in region.chunks]

    def holds(self, group: int, root: bytes, key: bytes) -> bool:
        return (group, root, key) in self.lru[self.group_pool[group]]

    def state_of(
        self, cache: PrefixCache, group: int, root: bytes, key: bytes
    ) -> BlockState | None:
        """Where the block ``key`` of layer group ``group`` (scope ``root``) is; None when
        neither tier has it."""
        pg = self.group_pool[group]
        slot = cache.scope(group, root).get(key)
        host_slot = self.lru[pg].get((group, root, key))
        if slot is not None and self.copier.writing_device(pg, slot):
            return BlockState.COPYING_IN
        if host_slot is not None and self.copier.writing_host(pg, host_slot):
            return BlockState.COPYING_OUT
        if slot is not None:
            return BlockState.DEVICE if host_slot is None else BlockState.BOTH
        return None if host_slot is None else BlockState.HOST

    def num_used(self, pool_group: int) -> int:
        return len(self.lru[pool_group])

    # -- copies ------------------------------------------------------------------------------------

    def _copy_out(self, pool_group: int, device_slots: list[int], host_slots: list[int]) -> None:
        self.copier.queue(pool_group, True, device_slots, host_slots)
        self.stats.offloaded_blocks += len(host_slots)
        self.stats.offloaded_bytes += len(host_slots) * self.slot_bytes[pool_group]

    def _copy_in(self, pool_group: int, host_slots: list[int], device_slots: list[int]) -> None:
        self.copier.queue(pool_group, False, device_slots, host_slots)
        self.stats.onboarded_blocks += len(host_slots)
        self.stats.onboarded_bytes += len(host_slots) * self.slot_bytes[pool_group]

    def _drop_oldest(self, pool_group: int) -> HostKey:
        """Drop the host's least recently used block (its slot is free again)."""
        key, slot = self.lru[pool_group].popitem(last=False)
        self.free[pool_group].append(slot)
        self.stats.dropped_blocks += 1
        return key

    # -- all-or-nothing steps ------------------------------------------------------------------

    def begin(self) -> None:
        """Journal what an all-or-nothing step changes from now on (``kvcm.transactions``):
        its undo takes it back exactly, at a cost in proportion to what the step did.

        Offloads are the only copies such a step makes (it neither onboards nor suspends or
        resumes: those write device pages that an undo would hand back to other owners), and
        within the step they store blocks only into host slots that were free when it began:
        no cached host block is dropped for room (a block evicted while the host is full is
        dropped instead), the slots of suspended requests the step frees stay unused until
        it ends, and a host block evicted again from the device moves to the LRU's end when
        the step ends. So no byte that the undo gives back is ever overwritten, and the undo
        is: the stored keys out of the index, their slots free again. Example: a full host
        and an atomic step that evicts k3 from the device: k3 is dropped, not copied, and
        the host keeps its blocks, whether the step stops or not."""
        self._undo = _Undo(
            tuple(getattr(self.stats, name) for name in _UNDONE_COUNTS),
            dict(self.held),
            self.state_free.copy(),
        )

    def end(self) -> None:
        """The step is over: what its journal defers (LRU moves, freed suspended slots)
        happens now; after an undo there is nothing left to do."""
        undo, self._undo = self._undo, None
        if undo is None:
            return
        for pg, keys in undo.touched.items():
            lru = self.lru[pg]
            for key in keys:
                if key in lru:
                    lru.move_to_end(key)
        for pg, parts in undo.released.items():
            for host_slots in parts:
                self.free[pg].extendleft(host_slots)

    def undo(self) -> None:
        """Put back what the host tier held when ``begin`` ran: the stored blocks out of the
        index (their copies waited for, their slots free again, in the free list's order),
        held and free state slots, counts."""
        undo = self._undo
        assert undo is not None
        self.copier.finish()  # no slot goes back to the free list with a copy in flight
        for pg, stored in undo.stored.items():
            lru, free = self.lru[pg], self.free[pg]
            for key, host_slot in reversed(stored):
                del lru[key]
                free.append(host_slot)  # taken from the right, in reverse: the same order
        self.held = undo.held
        self.state_free = undo.state_free
        for name, value in zip(_UNDONE_COUNTS, undo.counts, strict=True):
            setattr(self.stats, name, value)
        self.begin()  # a fresh journal: what follows the undo, if anything, is undone alone

    def offload(self, pool_group: int, entries: list[tuple[int, HostKey]]) -> None:
        """Copy evicted device blocks (device slot, key) to host slots, dropping the host's
        least recently used blocks when it is full (a block finds no room at all only when
        suspended requests hold every host slot: it is dropped then). Called before the
        device slots are handed out again. Inside an all-or-nothing step, only into slots
        free when it began, journaled (``begin``)."""
        if not self.num_slots.get(pool_group):
            return
        undo = self._undo
        lru, free = self.lru[pool_group], self.free[pool_group]
        #: Keys this call stores -> their host slots, in order: a copy each. A key the loop
        #: itself drops again (a host with little room besides suspended requests) loses its
        #: copy and makes no event: two copies into one host slot would race in a batch.
        fresh: dict[HostKey, int] = {}
        removed: dict[int, list[bytes]] = {}
        devices: dict[int, int] = {}
        for slot, key in entries:
            if key in lru:  # already on the host (it was onboarded and kept a copy)
                if undo is None:
                    lru.move_to_end(key)
                else:
                    undo.touched.setdefault(pool_group, []).append(key)
                continue
            if not free:
                if not lru or undo is not None:  # no room it may take: dropped
                    self.stats.dropped_blocks += 1
                    continue
                old = self._drop_oldest(pool_group)
                if old in fresh:
                    del devices[fresh.pop(old)]
                else:
                    removed.setdefault(old[0], []).append(old[2])
            h = free.pop()
            devices[h] = slot
            fresh[key] = h
            lru[key] = h
            if undo is not None:
                undo.stored.setdefault(pool_group, []).append((key, h))
        for group, keys in removed.items():
            self.log.host("block_removed", group, keys)
        stored: dict[int, list[bytes]] = {}
        for group, _, key in fresh:
            stored.setdefault(group, []).append(key)
        for group, keys in stored.items():
            self.log.host("block_stored", group, keys)
        if devices:
            self._copy_out(pool_group, list(devices.values()), list(devices))

    def reserve(self, pool_group: int, keys: list[HostKey]) -> list[int]:
        """Take blocks out of the index for onboarding: their host slots are then neither
        free nor indexed (copying in) until ``onboard`` frees them, so that offloads of the
        same op (the device slots the onboarding takes may evict) cannot drop them."""
        assert self._undo is None, "an all-or-nothing step does not onboard"
        lru = self.lru[pool_group]
        return [lru.pop(key) for key in keys]

    def onboard(self, pool_group: int, host_slots: list[int], device_slots: list[int]) -> None:
        """Copy reserved host slots into (fresh) device slots, then free the host slots."""
        self._copy_in(pool_group, host_slots, device_slots)
        self.free[pool_group].extendleft(host_slots)

    # -- suspended requests --------------------------------------------------------------------

    def room(self, pool_group: int) -> int:
        """Host slots a suspend can have: the free ones and those of cached blocks (dropped
        for it, least recently used first)."""
        return len(self.free[pool_group]) + len(self.lru[pool_group])

    def hold(self, pool_group: int, device_slots: list[int]) -> list[int]:
        """Copy device slots (a suspended request's blocks) into private host slots, which
        no LRU drops; the caller checked ``room``."""
        assert self._undo is None, "an all-or-nothing step does not suspend"
        free = self.free[pool_group]
        while len(free) < len(device_slots):
            old = self._drop_oldest(pool_group)
            self.log.host("block_removed", old[0], [old[2]])
        host_slots = [free.pop() for _ in device_slots]
        self._copy_out(pool_group, device_slots, host_slots)
        self.held[pool_group] += len(host_slots)
        return host_slots

    def give_back(self, pool_group: int, host_slots: list[int], device_slots: list[int]) -> None:
        """Copy held host slots into device slots (resume) and free them."""
        self._copy_in(pool_group, host_slots, device_slots)
        self.discard(pool_group, host_slots)

    def discard(self, pool_group: int, host_slots: list[int]) -> None:
        """Free held host slots (a resumed or freed suspended request); inside an
        all-or-nothing step, when it ends (``begin``)."""
        self.held[pool_group] -= len(host_slots)
        if self._undo is not None:
            self._undo.released.setdefault(pool_group, []).append(host_slots)
            return
        self.free[pool_group].extendleft(host_slots)

    # -- suspended requests' state -------------------------------------------------------------

    def hold_state(self, live_slot: int) -> int:
        """Copy a suspended request's live state (``live_slot`` of every state group) into a
        free host state slot and return that slot; the caller checked ``state_free``."""
        host_slot = self.state_free.pop()
        for target in self.state_target:
            self.copier.queue(target, True, [live_slot], [host_slot])
        self.stats.offloaded_states += 1
        return host_slot

    def give_back_state(self, host_slot: int, live_slot: int) -> None:
        """Copy a resumed request's state from ``host_slot`` into its new ``live_slot``
        (every state group), then free the host slot."""
        for target in self.state_target:
            self.copier.queue(target, False, [live_slot], [host_slot])
        self.stats.onboarded_states += 1
        self.state_free.appendleft(host_slot)

    def discard_state(self, host_slot: int) -> None:
        """Free a host state slot (a suspended request freed)."""
        self.state_free.appendleft(host_slot)

    def clear(self) -> None:
        assert self._undo is None, "the prefix cache is not reset inside an all-or-nothing step"
        for pg, lru in self.lru.items():
            self.free[pg].extend(lru.values())
            lru.clear()


def tier_hit(
    cache: PrefixCache,
    host: HostTier,
    root: bytes,
    keys: list[bytes],
    cap: int,
    tpb: int,
    windows: list[tuple[int | None, int]],
) -> int:
    """The longest hit, at most ``cap`` blocks, whose needed blocks every layer group holds
    on the device or the host (what onboarding can serve, free slots permitting)."""
    if cap <= 0 or not all(cache.reusable):
        return 0
    index = [cache.scope(g, root) for g in range(len(windows))]

    def present(g: int, i: int) -> bool:
        return keys[i] in index[g] or host.holds(g, root, keys[i])

    for g, (window, _) in enumerate(windows):
        if window is None:
            run = 0
            while run < cap and present(g, run):
                run += 1
            cap = run
    for b in range(cap, 0, -1):
        needed = needed_blocks(b, windows, tpb)
        if all(present(g, i) for g, blocks in enumerate(needed) for i in blocks):
            return b
    return 0


def onboard_prefix(
    c: Coordinator,
    host: HostTier,
    root: bytes,
    keys: list[bytes],
    b: int,
    capacity: int,
    data: bytes,
    lora_id: int | str | None,
    has_salt: bool,
    windows: list[tuple[int | None, int]],
) -> None:
    """Bring the host-resident blocks of a prompt's reusable prefix back to the device,
    so that the hit that follows finds them there (docs/host-tier.md). ``OutOfBlocks``,
    before anything changes, when the request (``capacity`` tokens with its lookahead)
    would not fit with that hit: an allocate that refuses must not have onboarded, evicted
    or logged anything.

    The prefix is a hit of ``b`` blocks whose needed blocks (``needed_blocks``: all of them,
    or a window's sinks and last blocks) every layer group holds on the device or the host
    (``tier_hit``, cut where state layers can resume: ``kvcm.prefix_reuse``). Its idle device
    blocks are pinned first (held once, out of the queue) so that the slots taken for the
    host blocks cannot evict them; the host blocks are reserved (out of the host index)
    before those slots are taken, since taking them may offload other blocks to a full
    host. A request that does not fit with this hit fits with no smaller one (a block less
    in the hit is a new block more), so it is refused rather than cut.

    Example (tpb 4, 1 group): blocks 0-1 cached on the device, 2-3 on the host, a 17-token
    prompt: 2 slots are taken, the host pages copied into them and published; the allocate
    then hits 16 tokens. With 6 free slots (idle blocks 0-1 among them), a 25-token prompt
    needs 7 (2 idle hits, 2 onboarded, 3 new): refused before any copy.
    """
    cache = c.cache
    tpb = c.tokens_per_block
    if not b:
        return
    index = [cache.scope(g, root) for g in range(len(c.policies))]
    gaps: dict[int, list[int]] = {}
    pins: dict[int, list[int]] = {}
    for g, blocks in enumerate(needed_blocks(b, windows, tpb)):
        pg = c.group_pool[g]
        gaps[g] = [i for i in blocks if keys[i] not in index[g]]
        idle = [index[g][keys[i]] for i in blocks if keys[i] in index[g]]
        pins[pg] = pins.get(pg, []) + [s for s in idle if c.refs[pg][s] == 0]
    if not any(gaps.values()):
        return  # the device serves this hit already
    # Covers the onboarding too: its pinned and fresh slots are hit blocks the request holds.
    c.check_fits(_request_need(c, b, index, keys, capacity, windows))
    pinned: dict[int, list[int]] = {}
    for pg, slots in pins.items():
        slots = sorted(set(slots))
        if slots:
            c.pools[pg].claim(np.array(slots, dtype=np.int64))
            c.refs[pg][slots] = 1
            pinned[pg] = slots
    reserved = {
        g: host.reserve(c.group_pool[g], [(g, root, keys[i]) for i in blocks])
        for g, blocks in gaps.items()
    }
    step = 4 * tpb
    taken: dict[int, list[int]] = {}
    for g, blocks in gaps.items():
        if not blocks:
            continue
        pg = c.group_pool[g]
        slots = c.take(pg, len(blocks)).tolist()
        host.onboard(pg, reserved[g], slots)
        taken.setdefault(pg, []).extend(slots)
        for i, slot in zip(blocks, slots, strict=True):
            cache.store(
                g,
                root,
                [keys[i]],
                [slot],
                keys[i - 1] if i else None,
                data[i * step : (i + 1) * step],
                lora_id,
                has_salt,
            )
        host.log.host("block_removed", g, [keys[i] for i in blocks])
    # Onboarded blocks become idle cached blocks; pinned ones idle again (queue tail).
    for pg, slots in (*taken.items(), *pinned.items()):
        c.unref(pg, np.array(slots, dtype=np.int64))


def _request_need(
    c: Coordinator,
    b: int,
    index: list[dict[bytes, int]],
    keys: list[bytes],
    capacity: int,
    windows: list[tuple[int | None, int]],
) -> list[int]:
    """Free slots per pool group a new request of ``capacity`` tokens needs with a hit of
    ``b`` blocks, some of them still on the host: counted as ``Coordinator.hit_need``
    counts a hit, a block to onboard being one more hit block nobody holds (its fresh slot
    comes out of the queue, as an idle cached one does). Example (tpb 4, one group): a hit
    of 2 blocks, block 0 idle on the device and block 1 on the host, for 25 tokens: 7
    blocks, 5 new + 2 unheld = 7."""
    tpb = c.tokens_per_block
    want = -(-capacity // tpb)
    need = [0] * len(c.pools)
    for g, blocks in enumerate(needed_blocks(b, windows, tpb)):
        pg = c.group_pool[g]
        refs, at = c.refs[pg], index[g]
        unheld = sum(1 for i in blocks if keys[i] not in at or refs[at[keys[i]]] == 0)
        need[pg] += max(want - b, 0) + unheld
    return need

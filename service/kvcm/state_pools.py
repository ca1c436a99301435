"""State layers' memory: one state slot per request per state group, and checkpoints of it
for prefix reuse (docs/state-layers.md).

A state group is the state layers of equal (owner, reuse). Its slot holds every buffer of
every layer of the group, back to back in layer order then buffer order, each at an offset
aligned to 16 bytes, so a slot is as large as the state itself (the alignment adds at most
15 bytes a buffer): no padding to attention pages. A group has ``live`` live slots, then
``checkpoints`` checkpoint slots. A request takes a live slot at allocation (and at resume)
and gives it back when it is freed (or suspended); it holds the same slot id in every group.
It takes the slot of its own page-table row when that one is free, so with one live slot per
row (the default) a request's slot is always its row.

A checkpoint is a copy of a request's live slot taken when its committed length is a
multiple of ``stride`` blocks, keyed by (scope, key of its last full block): the prefix it
summarises, exactly like the block it ends. Checkpoints are evicted least recently used. A
prefix hit of b blocks restores, in every state group, the checkpoint keyed by block b - 1
into the new request's live slot. An op's copies (zeroing, saves, restores) are queued and
made together when it ends (``flush``): one fill and one gather-scatter per group.

Worked example (tokens_per_block 4, stride 1, one group of 2 live slots and 2 checkpoint
slots): a request in row 1 takes live slot 1 and commits 8 tokens: slot 1 is copied to
checkpoint slot 2 keyed by block 1's key; another request with the same 9-token prompt, in
row 0, takes slot 0, hits 8 tokens and gets slot 2 copied into slot 0.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

import numpy as np
import torch

from kvcm_client.errors import InvalidArgument, UnknownLayer
from kvcm_client.models import ManagerConfig, SharedSegment
from kvcm_client.state import SharedStateBuffer, StateLayerSpec

from .ids import StateGroupId
from .shared_memory import CudaSegments, SharedSegments, strided

ALIGN = 16
_TORCH_DTYPE = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}

CheckpointKey = tuple[bytes, bytes]
"""(scope root, key of the last block the checkpoint covers)."""


@dataclass(frozen=True, slots=True)
class StatePlacement:
    """Where one buffer of one state layer lives in its group's slot."""

    layer_id: int
    name: str
    offset: int
    nbytes: int
    shape: tuple[int, ...]
    dtype: str


@dataclass(slots=True)
class _StateCopies:
    """One group's queued copies: ``dst[i] = src[i]``, and slots to zero."""

    src: list[int] = field(default_factory=list)
    dst: list[int] = field(default_factory=list)
    zeros: list[int] = field(default_factory=list)
    reads: set[int] = field(default_factory=set)
    writes: set[int] = field(default_factory=set)


@dataclass(frozen=True, slots=True)
class StateGroup:
    group_id: StateGroupId
    owner: str
    reusable: bool
    layers: tuple[int, ...]
    buffers: tuple[StatePlacement, ...]
    slot_bytes: int

    @property
    def state_bytes(self) -> int:
        """Bytes of the state itself (no alignment), per slot."""
        return sum(b.nbytes for b in self.buffers)


def build_state_groups(specs: list[StateLayerSpec]) -> tuple[StateGroup, ...]:
    """Group state layers by (owner, reuse), in order of first appearance; lay out each
    group's slot. Example: layers 1 and 3 with ``conv`` [8, 3] bf16 (48 bytes) and ``ssm``
    [2, 4, 16] fp32 (512 bytes): offsets 0, 48, 560, 608 and a 1120-byte slot."""
    keys: list[tuple[str, str]] = []
    members: dict[tuple[str, str], list[StateLayerSpec]] = {}
    for spec in specs:
        key = (spec.owner, spec.reuse)
        if key not in members:
            keys.append(key)
            members[key] = []
        members[key].append(spec)
    groups = []
    for gid, key in enumerate(keys):
        offset = 0
        placed = []
        for spec in members[key]:
            for buf in spec.buffers:
                placed.append(
                    StatePlacement(
                        spec.layer_id, buf.name, offset, buf.nbytes, buf.shape, buf.dtype
                    )
                )
                offset += -(-buf.nbytes // ALIGN) * ALIGN
        groups.append(
            StateGroup(
                StateGroupId(gid),
                key[0],
                key[1] == "reusable",
                tuple(s.layer_id for s in members[key]),
                tuple(placed),
                offset,
            )
        )
    return tuple(groups)


def group_checkpoints(group: StateGroup, checkpoints: int) -> int:
    """Checkpoint slots of a group: none for one without reuse (it never restores)."""
    return checkpoints if group.reusable else 0


def state_memory(cfg: ManagerConfig) -> int:
    """Device bytes of the state layers: every state group's live slots and checkpoint
    slots; ``memory_bytes`` pays for them before the KV pools."""
    live = cfg.num_state_live_slots
    return sum(
        g.slot_bytes * (live + group_checkpoints(g, cfg.num_state_checkpoints))
        for g in build_state_groups(cfg.state_layers)
    )


class StatePools:
    """The state groups' memory, their checkpoints, and the copies between slots."""

    def __init__(
        self,
        groups: tuple[StateGroup, ...],
        max_requests: int,
        live: int,
        checkpoints: int,
        stride: int,
        device: torch.device,
        segments: SharedSegments | CudaSegments | None = None,
    ) -> None:
        self.groups = groups
        self.live = live
        self.num_checkpoints = checkpoints
        self.stride = stride
        #: Shared segments, one per group, when the manager shares its memory.
        self.segments: list[SharedSegment] = []
        self.memory = []
        for g in groups:
            slots = live + group_checkpoints(g, checkpoints)
            if segments is None:
                tensor = torch.empty((slots, g.slot_bytes), dtype=torch.uint8, device=device)
            else:
                segment, raw = segments.allocate(slots * g.slot_bytes)
                self.segments.append(segment)
                tensor = raw.view(slots, g.slot_bytes)
            self.memory.append(tensor.zero_())
        self.placement = {(b.layer_id, b.name): (g.group_id, b) for g in groups for b in g.buffers}
        #: Per group: checkpoint key -> slot, least recently used first; free slots.
        self.lru: list[OrderedDict[CheckpointKey, int]] = [OrderedDict() for _ in groups]
        self.free = [
            list(range(live + group_checkpoints(g, checkpoints) - 1, live - 1, -1)) for g in groups
        ]
        #: Per page-table row: its request's live slot, -1 for none (a free row, or a
        #: suspended request's); which live slots are free, and how many.
        self.slot_of = np.full(max_requests, -1, dtype=np.int64)
        self.free_live = np.ones(live, dtype=bool)
        self.num_free_live = live
        self.saves = 0
        self.restores = 0
        #: Batches of copies made (one per op that queued any, more after a hazard).
        self.batches = 0
        #: Per group: the copies the op queued (made at its end, ``flush``).
        self._pending = [_StateCopies() for _ in groups]
        self._queued = False
        #: In a transaction: (group, live slot) -> its state before the first write, and
        #: the live slots' bookkeeping at its start; None outside one.
        self._undo: dict[tuple[int, int], torch.Tensor] | None = None
        self._undo_slots: tuple[np.ndarray, np.ndarray, int] | None = None

    # -- views and indices --------------------------------------------------------------------

    def view(self, layer_id: int, name: str) -> torch.Tensor:
        """Buffer ``name`` of state layer ``layer_id`` for every slot, ``[slots, *shape]`` of
        its dtype: index ``slot_of[row]`` is the live state of the request in that row."""
        try:
            gid, place = self.placement[(layer_id, name)]
        except KeyError:
            raise UnknownLayer(
                f"no state buffer {name!r} of state layer {layer_id}", layer_id=layer_id
            ) from None
        raw = self.memory[gid][:, place.offset : place.offset + place.nbytes]
        return raw.view(_TORCH_DTYPE[place.dtype]).unflatten(1, place.shape)

    def shared_buffers(self) -> list[SharedStateBuffer]:
        """The descriptors of every buffer's view, for ``SharedLayout.state_buffers``."""
        return [
            SharedStateBuffer(
                layer_id=layer_id,
                name=name,
                state_group=int(gid),
                **strided(self.view(layer_id, name)),
            )
            for (layer_id, name), (gid, _) in self.placement.items()
        ]

    def group_of(self, group: int) -> StateGroup:
        if not 0 <= group < len(self.groups):
            raise InvalidArgument(f"no state group {group}", state_group=group)
        return self.groups[group]

    # -- transactions (all-or-nothing steps) ---------------------------------------------------

    def begin(self) -> None:
        """Start recording what an undo must put back: which request holds which live slot,
        and the live slots the step's copies write (checkpoints need nothing: one saved by
        an undone commit still holds its prefix's state, it only took an older one's
        slot)."""
        self.flush()
        self._undo = {}
        self._undo_slots = (self.slot_of.copy(), self.free_live.copy(), self.num_free_live)

    def undo(self) -> None:
        """Drop the queued copies, put back every live slot the transaction wrote and give
        every request the live slot it had."""
        assert self._undo is not None and self._undo_slots is not None
        self._pending = [_StateCopies() for _ in self.groups]
        self._queued = False
        for (g, slot), state in self._undo.items():
            self.memory[g][slot].copy_(state)
        self._undo.clear()
        slot_of, free_live, self.num_free_live = self._undo_slots
        self.slot_of[:] = slot_of  # in place: the manager reads the same array
        self.free_live[:] = free_live

    def end(self) -> None:
        self._undo = None
        self._undo_slots = None

    # -- live slots ----------------------------------------------------------------------------

    def take(self, row: int) -> int:
        """Give the request in ``row`` a live slot and return it (the caller checked
        ``num_free_live``): slot ``row`` when it is free, else the lowest free one. With one
        live slot per row, a request's own slot is free whenever it takes one (only its
        row's requests ever took it), so slot r is always row r's. Example: 2 live slots, 4
        rows; the requests of
        rows 0 and 1 hold slots 0 and 1; row 0's is suspended (slot 0 is free again); a new
        request in row 2 takes slot 0, and row 0's request cannot resume until one is free."""
        free = self.free_live
        slot = row if row < self.live and free[row] else int(free.argmax())
        free[slot] = False
        self.num_free_live -= 1
        self.slot_of[row] = slot
        return slot

    def release(self, row: int) -> int:
        """Give back the live slot of ``row``'s request (freed or suspended); returns it
        (-1: it held none)."""
        slot = int(self.slot_of[row])
        if slot >= 0:
            self.free_live[slot] = True
            self.num_free_live += 1
            self.slot_of[row] = -1
        return slot

    # -- copies, batched per op -----------------------------------------------------------------

    def _queue(self, g: int, src: int | None, dst: int) -> None:
        """Queue ``dst = src`` (None: zeros) in group g; launches what is queued first if it
        reads or writes a slot this copy writes, or writes the slot this copy reads, so that
        a batch's copies are independent (any order gives the same bytes)."""
        if self._undo is not None and dst < self.live and (g, dst) not in self._undo:
            # The first write to a live slot in a transaction: keep what an undo puts back
            # (nothing queued writes it yet: the transaction started with nothing queued).
            self._undo[(g, dst)] = self.memory[g][dst].clone()
        p = self._pending[g]
        if (dst in p.writes or dst in p.reads) or (src is not None and src in p.writes):
            self.flush()
            p = self._pending[g]
        if src is None:
            p.zeros.append(dst)
        else:
            p.src.append(src)
            p.dst.append(dst)
            p.reads.add(src)
        p.writes.add(dst)
        self._queued = True

    def flush(self) -> None:
        """Make every queued copy: per group one fill for the zeros and one gather-scatter
        for the copies (on CUDA, a launch or two per group, not one per copy)."""
        if not self._queued:
            return
        self.batches += 1
        for g, p in enumerate(self._pending):
            mem = self.memory[g]
            if p.zeros:
                mem[torch.tensor(p.zeros, device=mem.device)] = 0
            if p.dst:
                dst = torch.tensor(p.dst, device=mem.device)
                mem[dst] = mem[torch.tensor(p.src, device=mem.device)]
            self._pending[g] = _StateCopies()
        self._queued = False

    # -- lifecycle -----------------------------------------------------------------------------

    def start(self, slot: int) -> None:
        """A new request's live ``slot``: its state starts from zeros."""
        for g in range(len(self.memory)):
            self._queue(g, None, slot)

    def has(self, root: bytes, key: bytes) -> bool:
        """Whether every state group has the checkpoint of (root, key) (never when one keeps
        no checkpoints: its state could not go back)."""
        return self.restorable() and all((root, key) in lru for lru in self.lru)

    def restorable(self) -> bool:
        """Whether prefix hits can restore state at all (every group keeps checkpoints)."""
        return self.num_checkpoints > 0 and all(g.reusable for g in self.groups)

    def save(self, slot: int, root: bytes, key: bytes) -> None:
        """Checkpoint the live state in ``slot`` under (root, key), in every reusable group;
        the least recently used checkpoint makes room."""
        for g, lru in enumerate(self.lru):
            if not self.groups[g].reusable or not self.num_checkpoints:
                continue
            ck = (root, key)
            checkpoint = lru.pop(ck, None)
            if checkpoint is None:
                checkpoint = self.free[g].pop() if self.free[g] else lru.popitem(last=False)[1]
            lru[ck] = checkpoint
            self._queue(g, slot, checkpoint)
        self.saves += 1

    def restore(self, slot: int, root: bytes, key: bytes) -> None:
        """Copy the checkpoint of (root, key) into the live ``slot`` (``has`` said yes)."""
        for g, lru in enumerate(self.lru):
            checkpoint = lru[(root, key)]
            lru.move_to_end((root, key))
            self._queue(g, checkpoint, slot)
        self.restores += 1

    def clear(self) -> None:
        """Drop every checkpoint (``reset_prefix_cache``)."""
        for g, lru in enumerate(self.lru):
            self.free[g].extend(lru.values())
            lru.clear()

    def num_saved(self, group: int) -> int:
        return len(self.lru[group])

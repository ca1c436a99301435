"""Block copies between the device pools and the host tier's regions, batched per step.

The host tier queues each copy here (``queue``): a pool group's device slots to or from host
slots, every pool of the group. Queued copies are launched together (``flush``): on CUDA, on
the tier's own stream after the work already on the current stream (a CUDA event orders
them), large segments on the copy engines and all small ones in one ``copy_segments`` kernel
that reads them straight from pinned memory (``kvcm_kernels.block_copy``); on the CPU, a
``memmove`` per segment. Copies whose segments all go to the copy engines (large slots)
launch as soon as they are queued (``_copy_now``): the engines start while the op goes on,
and a batch would save nothing there. ``finish`` flushes and waits for the copies: every
public op that can queue copies calls it before it answers (``kvcm.manager._settles``), so
no caller ever sees a slot whose copy is in flight.

Within a step, a queued copy and a later one can involve the same slot: an onboard into a
device slot the step just evicted (whose copy out is queued), a host slot dropped and reused,
a host block offloaded and hit again. A copy that reads or writes a slot a queued copy writes,
or writes a slot a queued copy reads, first launches what is queued; stream order then puts
the earlier copy first (a hazard costs one more launch, never a wrong byte). The usual decode
step with offloading queues copies out of distinct evicted slots into distinct free host slots
and launches once.

``immediate`` copies run as they are queued. It is the CPU's default: the CPU page tables are
the numpy arrays the coordinator edits in place, so a consumer mapping them would see a table
cell as soon as it is written, and the copy that fills that slot must already be done. On CUDA
the tables reach the device only at ``DeviceTables.sync``, which runs after ``finish``.

Worked example (one pool of 64-byte slots, CUDA): an op evicts device slots 7 and 9 (cached
blocks) to host slots 0 and 1: two queued copies out; it then onboards a host block from host
slot 4 into device slot 7: slot 7 is read by a queued copy, so the two copies out launch
first (one kernel, 2 segments) and the copy in is queued; ``finish`` launches it (a second
kernel) and waits for the tier stream's event. Slots of 2 MiB (a Llama-8B block in one pool)
go to the copy engines instead: two ``cudaMemcpyAsync`` as the eviction queues them, one
more as the onboard does, and ``finish`` only waits.
"""

from __future__ import annotations

import copy
import time
import weakref
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

import kvcm_kernels
from kvcm_client.errors import DeviceUnavailable
from kvcm_kernels.block_copy import MEMCPY_DEFAULT


@dataclass(slots=True)
class _Pending:
    """Queued copies of one pool group; ``out``: device to host."""

    out: list[bool] = field(default_factory=list)
    device: list[list[int]] = field(default_factory=list)
    host: list[list[int]] = field(default_factory=list)
    device_read: set[int] = field(default_factory=set)
    device_write: set[int] = field(default_factory=set)
    host_read: set[int] = field(default_factory=set)
    host_write: set[int] = field(default_factory=set)


@dataclass(slots=True)
class CopyStats:
    copy_launches: int = 0
    """Batches launched (CUDA: a kernel and copy-engine calls; the CPU: copies made)."""
    copy_hazard_launches: int = 0
    """Of those, batches launched early because a new copy involved a queued copy's slot."""
    copy_seconds: float = 0.0
    """Time the ops spent launching copies (the CPU: copying) and waiting for them."""


class TierCopier:
    """Queues and launches the host tier's copies (one per tier)."""

    def __init__(
        self,
        device_pools: list[torch.Tensor],
        regions: dict[int, list[torch.Tensor]],
        pools_of: dict[int, list[int]],
        device: torch.device,
        immediate: bool | None = None,
        stats: CopyStats | None = None,
    ) -> None:
        """``device_pools[pool]``: ``[slots, slot_bytes]`` uint8; ``regions[pool]``: the host
        chunks of that pool, each ``[rows, slot_bytes]``, all but the last of equal rows;
        ``pools_of[pool_group]``: its pools; ``stats``: where to count (the host tier's)."""
        self.device_pools = device_pools
        self.regions = regions
        self.pools_of = pools_of
        self.cuda = device.type == "cuda"
        self.immediate = not self.cuda if immediate is None else immediate
        self.per_chunk = {
            pool: int(chunks[0].shape[0]) if chunks else 1 for pool, chunks in regions.items()
        }
        self.device = device
        self._index = device.index if device.index is not None else 0
        # Raw runtime handles: the step path makes four calls per launch, and each torch
        # stream or event call costs several microseconds there.
        self._rt = kvcm_kernels.block_copy.cuda_runtime() if self.cuda else None
        if self.cuda and self._rt is None:  # (kvcm_kernels logged why, if CuPy is installed)
            raise DeviceUnavailable(
                "a host tier on CUDA needs CuPy (the gpu extra, e.g. cupy-cuda12x): its "
                "copies are CuPy kernels and raw CUDA calls",
                device=str(device),
            )
        self.stream = torch.cuda.Stream(device) if self.cuda else None
        if self.stream is not None:
            self._stream = int(self.stream.cuda_stream)
            flags = self._rt.eventDisableTiming
            with torch.cuda.device(self.stream.device):
                #: Recorded on the current stream before each launch (the tier's stream
                #: waits for it), and on the tier's stream after it (``finish`` waits).
                self._ready = self._rt.eventCreateWithFlags(flags)
                self._done = self._rt.eventCreateWithFlags(flags)
            weakref.finalize(
                self, kvcm_kernels.block_copy.destroy_events, self._rt, (self._ready, self._done)
            )
        self.pending = {pg: _Pending() for pg in pools_of}
        #: CUDA: the slots of launched copies not yet waited for (the CPU's are done).
        self.flying = {pg: _Pending() for pg in pools_of}
        self.queued = 0
        #: Thread blocks of a CUDA launch, and the segment size from which the copy engines
        #: copy instead (``kvcm_kernels.block_copy``).
        self.max_blocks = kvcm_kernels.block_copy.MAX_BLOCKS
        self.dma_min_bytes = kvcm_kernels.block_copy.DMA_MIN_BYTES
        #: Per pool group: whether every segment of its copies goes to the copy engines.
        self._engines = {
            pg: all(int(device_pools[pool].shape[1]) >= self.dma_min_bytes for pool in pools)
            for pg, pools in pools_of.items()
        }
        #: Launched and not yet waited for (CUDA), with their pinned pieces (None when the
        #: copy engines took every segment): keeps them alive until they are done.
        self._launched: list[torch.Tensor | None] = []
        self.stats = CopyStats() if stats is None else stats
        self._addresses()

    def _addresses(self) -> None:
        """The raw addresses the copies use, read from this copier's own tensors."""
        #: Per pool: the address of each host chunk.
        self._bases = {
            pool: np.array([c.data_ptr() for c in chunks], dtype=np.int64)
            for pool, chunks in self.regions.items()
        }
        #: The same as ints, and each device pool's (address, slot bytes), for ``_copy_now``.
        self._chunks_at = {pool: [int(a) for a in at] for pool, at in self._bases.items()}
        self._device_at = {
            pool: (self.device_pools[pool].data_ptr(), int(self.device_pools[pool].shape[1]))
            for pool in self.regions
        }

    def __deepcopy__(self, memo: dict[int, Any]) -> TierCopier:
        """A copy (of a copied manager) whose addresses are its own tensors': copied as they
        were, the copy's copies would write into the original's memory, freed with it."""
        if self.cuda:
            raise TypeError("a host tier's copier on CUDA cannot be copied (its stream)")
        twin: TierCopier = TierCopier.__new__(TierCopier)
        memo[id(self)] = twin
        for name, value in self.__dict__.items():
            setattr(twin, name, copy.deepcopy(value, memo))
        twin._addresses()
        return twin

    # -- state queries (the block states of kvcm.host_tier) ---------------------------------

    def writing_device(self, pool_group: int, slot: int) -> bool:
        """Whether a copy queued or in flight writes this device slot."""
        return slot in self.pending[pool_group].device_write or (
            slot in self.flying[pool_group].device_write
        )

    def writing_host(self, pool_group: int, slot: int) -> bool:
        return slot in self.pending[pool_group].host_write or (
            slot in self.flying[pool_group].host_write
        )

    def busy_device_slots(self, pool_group: int) -> set[int]:
        """Device slots a copy queued or in flight reads or writes."""
        p, f = self.pending[pool_group], self.flying[pool_group]
        return p.device_read | p.device_write | f.device_read | f.device_write

    # -- queue, launch, wait -------------------------------------------------------------------

    def queue(self, pool_group: int, out: bool, device: list[int], host: list[int]) -> None:
        """Copy ``device`` slots to ``host`` slots (``out``) or back, in every pool of the
        group; launches what is queued first when the copy involves a slot a queued copy
        writes, or writes one a queued copy reads."""
        if not device:
            return
        if len(set(device)) < len(device) or len(set(host)) < len(host):
            raise ValueError("a copy names a slot twice")  # its segments would race
        p = self.pending[pool_group]
        reads, writes = (device, host) if out else (host, device)
        read_w, write_w = (p.device_write, p.host_write) if out else (p.host_write, p.device_write)
        write_r = p.host_read if out else p.device_read
        if self.queued and (
            not read_w.isdisjoint(reads)
            or not write_w.isdisjoint(writes)
            or not write_r.isdisjoint(writes)
        ):
            self.stats.copy_hazard_launches += 1
            self.flush()
            p = self.pending[pool_group]
        if self.stream is not None and self._engines[pool_group]:
            # Launched as soon as queued: the engines start while the op goes on, and
            # batching would save nothing (a call per segment either way).
            self._copy_now(pool_group, out, device, host)
            return
        p.out.append(out)
        p.device.append(list(device))
        p.host.append(list(host))
        (p.device_read if out else p.device_write).update(device)
        (p.host_write if out else p.host_read).update(host)
        self.queued += 1
        if self.immediate:
            self.flush()

    def flush(self) -> None:
        """Launch everything queued (CUDA: one kernel, not waited for; CPU: the copies)."""
        if not self.queued:
            return
        self.stats.copy_launches += 1
        t0 = time.perf_counter()
        self._launch()
        self.stats.copy_seconds += time.perf_counter() - t0
        for pg, p in self.pending.items():
            if self.cuda:
                f = self.flying[pg]
                for mine, theirs in (
                    (f.device_read, p.device_read),
                    (f.device_write, p.device_write),
                    (f.host_read, p.host_read),
                    (f.host_write, p.host_write),
                ):
                    mine |= theirs
            self.pending[pg] = _Pending()
        self.queued = 0

    def finish(self) -> None:
        """Launch what is queued and wait until every launched copy has completed."""
        if self.queued:
            self.flush()
        if self._launched:
            t0 = time.perf_counter()
            self._rt.eventSynchronize(self._done)
            self.stats.copy_seconds += time.perf_counter() - t0
            self._launched.clear()
            self.flying = {pg: _Pending() for pg in self.pools_of}

    def order_before(self, stream: torch.cuda.Stream) -> None:
        """Make ``stream``'s later work wait for every copy queued or launched so far."""
        self.flush()
        if self._launched:
            with kvcm_kernels.block_copy.on_device(self._index):  # handle 0: this device's
                self._rt.streamWaitEvent(stream.cuda_stream, self._done, 0)

    def _copy_now(self, pool_group: int, out: bool, device: list[int], host: list[int]) -> None:
        """Copy on the copy engines now (CUDA, slots of at least ``dma_min_bytes``): one
        ``cudaMemcpyAsync`` per block and pool on the tier's stream, after the current
        stream's work, addresses in plain ints. The short path of a decode step's offload:
        numpy and the batch's bookkeeping would cost more than the calls themselves."""
        t0 = time.perf_counter()
        rt, stream = self._rt, self._stream
        self._after_current()
        for pool in self.pools_of[pool_group]:
            base, size = self._device_at[pool]
            per, chunks = self.per_chunk[pool], self._chunks_at[pool]
            for d, h in zip(device, host, strict=True):
                dev_at = base + d * size
                host_at = chunks[h // per] + (h % per) * size
                if out:
                    rt.memcpyAsync(host_at, dev_at, size, MEMCPY_DEFAULT, stream)
                else:
                    rt.memcpyAsync(dev_at, host_at, size, MEMCPY_DEFAULT, stream)
        rt.eventRecord(self._done, stream)
        self._launched.append(None)
        f = self.flying[pool_group]
        (f.device_read if out else f.device_write).update(device)
        (f.host_write if out else f.host_read).update(host)
        self.stats.copy_launches += 1
        self.stats.copy_seconds += time.perf_counter() - t0

    def _after_current(self) -> None:
        """Order the tier stream's next copies after the work on the current stream (which
        may have written the blocks a copy out reads). When that stream is idle (a sidecar's
        own stream between steps, always so when the engine is another process), everything
        it ran has completed and no wait is needed: the query costs less than a record and
        a wait, and the copy engines start without a cross-stream hand-off."""
        rt = self._rt
        current = kvcm_kernels.current_stream_handle(self._index)
        with kvcm_kernels.block_copy.on_device(self._index):  # handle 0: this device's
            if rt.streamQuery(current) != 0:  # cudaErrorNotReady: work in flight
                rt.eventRecord(self._ready, current)
                rt.streamWaitEvent(self._stream, self._ready, 0)

    # -- the batch ----------------------------------------------------------------------------

    def _segments(self) -> np.ndarray:
        """Every queued copy as (source, destination, bytes) segments, one per block and pool:
        device slot d of a pool is at ``base + d * slot_bytes``, host slot h at row
        ``h % per_chunk`` of chunk ``h // per_chunk``."""
        parts = []
        for pg, p in self.pending.items():
            for out, device, host in zip(p.out, p.device, p.host, strict=True):
                d = np.asarray(device, dtype=np.int64)
                h = np.asarray(host, dtype=np.int64)
                for pool in self.pools_of[pg]:
                    dev = self.device_pools[pool]
                    slot_bytes = int(dev.shape[1])
                    per = self.per_chunk[pool]
                    dev_at = dev.data_ptr() + d * slot_bytes
                    host_at = self._bases[pool][h // per] + (h % per) * slot_bytes
                    src, dst = (dev_at, host_at) if out else (host_at, dev_at)
                    parts.append(kvcm_kernels.segments(src, dst, slot_bytes))
        return np.concatenate(parts)

    def _launch(self) -> None:
        """CUDA: one kernel on the tier's stream, after the current stream's work; the CPU:
        the copies, now."""
        desc = self._segments()
        if self.stream is None:
            kvcm_kernels.copy_segments(desc, torch.device("cpu"))
            return
        rt = self._rt
        self._after_current()
        pinned = kvcm_kernels.copy_segments(
            desc, self.stream.device, self.max_blocks, self.dma_min_bytes, self._stream
        )
        rt.eventRecord(self._done, self._stream)
        self._launched.append(pinned)

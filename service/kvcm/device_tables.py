"""Page tables on the manager's device, kept in step with the host tables.

On the CPU the device tables are the host tables (one shared array, nothing to do; every rank
of a manager reads the same one). On CUDA the host keeps the bookkeeping and the coordinator
logs every table edit; with several ranks each rank's tables take the edits from their own
queue (``kvcm.ranks.EditQueues``). The edits of a step
reach the device in one upload and one launch for all layer groups: fused with the step's slot
mapping when the scheduler asks for it (``take_pending``), alone (``sync``) before anything
else reads the device tables, or alone before a stream-ordered step answers (``publish``).
With a step order (``kvcm.step_order``) every path records the step event after the edits it
queued, so the event's last record always follows every edit.
"""

from __future__ import annotations

import contextlib
import sys
import weakref
from types import ModuleType
from typing import Any

import numpy as np
import torch

import kvcm_kernels
from kvcm_kernels.step_tables import (
    STAGED_QSL_LIMIT,
    THREADS,
    StepLaunch,
    driver_entry_points,
)

from . import native
from .context_parallel import local_edits, table_width
from .coordinator import Coordinator
from .mapped_items import MappedItems
from .step_order import StepOrder

_NO_EDITS = np.empty((0, 4), dtype=np.int64)
#: A decode batch of no request (``MappedItems``): a launch that maps no token.
_NO_ITEMS: MappedItems = (np.empty(0, dtype=np.int64), np.empty(0, dtype=np.int64), 1)


class EditQueues:
    """The coordinator's page-table edits, kept for each rank until that rank's device
    tables take them: one bookkeeping, a device table per rank. A rank that takes collects
    the coordinator's new edits for every rank first, so no rank misses any."""

    #: Batches a queue holds before they are folded into one (the last edit of each cell).
    FOLD = 64

    def __init__(self, coord: Coordinator, num_ranks: int) -> None:
        self._coord = coord
        self._queues: list[list[np.ndarray]] = [[] for _ in range(num_ranks)]

    def take(self, rank: int) -> np.ndarray:
        """Rank ``rank``'s edits not yet applied, int64 ``[E, 4]``, one per cell (the last
        one when several steps edited it)."""
        c = self._coord
        if c.ops_since_take:
            edits = c.take_edits()
            if edits.shape[0]:
                for queue in self._queues:
                    queue.append(edits)
                    if len(queue) > self.FOLD:  # a rank nobody reads: bounded by its cells
                        queue[:] = [c.last_edits(np.concatenate(queue))]
        queue = self._queues[rank]
        if not queue:
            return _NO_EDITS
        out = queue[0] if len(queue) == 1 else c.last_edits(np.concatenate(queue))
        queue.clear()
        return out


class Uploader:
    """Copies small host arrays to the device without a synchronous pageable copy.

    Staging buffers are pinned and used in turn (a ring of ``DEPTH``); a buffer is rewritten
    only after the event of its last copy, so the host rarely waits even when the stream is
    busy. The device buffer is reused in stream order: the returned tensor is valid for work
    queued on the current stream before the next upload.
    """

    DEPTH = 4

    def __init__(self, device: torch.device, dtype: torch.dtype) -> None:
        self.device = device
        self.index = device.index if device.index is not None else torch.cuda.current_device()
        self.dtype = dtype
        self._host = [torch.empty(0, dtype=dtype, pin_memory=True) for _ in range(self.DEPTH)]
        self._numpy = [host.numpy() for host in self._host]
        self._addresses = [host.data_ptr() for host in self._host]
        self._capacity = [0] * self.DEPTH
        # Raw CUDA events (CuPy's runtime): a record and a wait cost well under a microsecond
        # each, a torch event's record with its stream lookup several; a step records one
        # per rank. torch's events without CuPy.
        self._rt = kvcm_kernels.block_copy.cuda_runtime()
        self._events: list[Any]
        if self._rt is None:
            self._events = [torch.cuda.Event() for _ in range(self.DEPTH)]
        else:
            with torch.cuda.device(self.index):
                flags = self._rt.eventDisableTiming
                self._events = [self._rt.eventCreateWithFlags(flags) for _ in range(self.DEPTH)]
            weakref.finalize(
                self, kvcm_kernels.block_copy.destroy_events, self._rt, tuple(self._events)
            )
        self._used = [False] * self.DEPTH
        self._turn = 0
        self._staged = 0
        self._dev = torch.empty(0, dtype=dtype, device=device)

    def reserve(self, n: int) -> np.ndarray:
        """The next pinned buffer's first ``n`` int64 (or this uploader's dtype) as a numpy
        array to fill in place: no copy of its own. Kernels may read it at ``address``
        (unified addressing); call ``commit`` once the work that reads it is queued, so the
        buffer is not rewritten before that work is done."""
        return self._numpy[self._next(n)][:n]

    def reserve_address(self, n: int) -> int:
        """``reserve`` for C code that writes the buffer itself: the host address of the
        next buffer, which holds at least ``n`` entries. Fence it with ``commit``, or with
        ``raw_event`` recorded by the caller and then ``fenced``."""
        return self._addresses[self._next(n)]

    def reserve_unwaited(self, n: int) -> tuple[int, int]:
        """``reserve_address`` for C code that also waits for the buffer's last reader
        itself (``kvcm._native.step_launch``: a driver call of well under a microsecond
        against the 1-2 us of a Python runtime call): the address, and the raw event to
        synchronize before writing it (0: nothing to wait for). Needs ``raw_event``."""
        k = self._next(n, wait=False)
        return self._addresses[k], (int(self._events[k]) if self._used[k] else 0)

    @property
    def raw_event(self) -> int:
        """The raw CUDA event that fences the buffer given last (for a caller that records
        it itself, e.g. in C right after its launch), or 0 where the events are torch's."""
        return 0 if self._rt is None else int(self._events[self._staged])

    def fenced(self) -> None:
        """The caller recorded ``raw_event`` after the work that reads the buffer given
        last: it is rewritten only after that work (as ``commit`` does it)."""
        self._used[self._staged] = True

    def _next(self, n: int, wait: bool = True) -> int:
        """The next buffer of the ring, once its last reader is done (``wait=False``: the
        caller waits for it), grown to ``n`` (a buffer is replaced only after its reader:
        torch may hand freed pinned memory out again at once)."""
        k = self._turn
        self._turn = (k + 1) % self.DEPTH
        grow = n > self._capacity[k]
        if self._used[k] and (wait or grow):
            if self._rt is None:
                self._events[k].synchronize()
            else:
                self._rt.eventSynchronize(self._events[k])
            self._used[k] = False
        if grow:
            self._host[k] = torch.empty(max(n, 4096), dtype=self.dtype, pin_memory=True)
            self._numpy[k] = self._host[k].numpy()
            self._addresses[k] = self._host[k].data_ptr()
            self._capacity[k] = self._host[k].numel()
        self._staged = k
        return k

    @property
    def address(self) -> int:
        """The host address of the buffer ``reserve`` or ``stage`` gave last."""
        return self._host[self._staged].data_ptr()

    def staged(self, n: int) -> torch.Tensor:
        """The first ``n`` entries of the buffer ``reserve`` gave last, as a pinned tensor."""
        return self._host[self._staged][:n]

    def stage(self, array: np.ndarray) -> torch.Tensor:
        """Copy ``array`` into the next pinned buffer and return it (a host tensor), as
        ``reserve`` then ``staged``."""
        self.reserve(array.size)[:] = array.reshape(-1)
        return self.staged(array.size).view(array.shape)

    def commit(self, stream: int | None = None) -> None:
        """Fence the buffer given last with the work queued so far on ``stream`` (a raw
        handle on the current device, as a step's launch took it), else on torch's current
        stream of the uploader's device."""
        k = self._staged
        if self._rt is None:
            self._events[k].record(torch.cuda.current_stream(self.device))
        elif stream is not None:
            self._rt.eventRecord(self._events[k], stream)
        else:
            with kvcm_kernels.block_copy.on_device(self.index):  # handle 0: this device's
                stream = kvcm_kernels.current_stream_handle(self.index)
                self._rt.eventRecord(self._events[k], stream)
        self._used[k] = True

    def __call__(self, array: np.ndarray) -> torch.Tensor:
        """``array`` on the device (one asynchronous copy)."""
        host = self.stage(array)
        n = array.size
        if n > self._dev.numel():
            self._dev = torch.empty(
                max(n, 2 * self._dev.numel(), 4096), dtype=self.dtype, device=self.device
            )
        dev = self._dev[:n]
        dev.copy_(host.view(-1), non_blocking=True)
        self.commit()
        return dev.view(array.shape)


#: torch's count of the tensors that share a storage (private, as torch's own callers use
#: it); without it, or without a tensor's own use count, ``Outputs`` never reuses a buffer.
_storage_use_count = getattr(torch._C, "_storage_Use_Count", None)  # noqa: SLF001
_REUSE = _storage_use_count is not None and hasattr(torch.Tensor, "_use_count")


class Outputs:
    """The device tensors the step's slot mappings are written into, reused once nothing
    else refers to them.

    Allocating a small CUDA tensor costs 3-6 us of host time (torch's allocator and the
    tensor's making), a tenth of a decode step that is otherwise one C call. A ring of
    ``DEPTH`` slots hands a slot's tensor out again when (a) nothing but the ring refers to
    it: no Python reference, no holder of the tensor itself in C++ (autograd, DLPack) and no
    other tensor on its storage (a view such as ``out[0]``, a DLPack import); (b) the shape
    is the same and (c) the current stream is the one it was made on: then every reader the
    engine queued on that stream runs before the next step's kernel writes it, the
    guarantee torch's caching allocator gives memory freed on a stream. Else the slot gets
    a fresh tensor and the old one is left to its holders. As with freed memory, a reader
    that keeps only the address (``data_ptr()`` given to other code, a CUDA graph that read
    it), or reads on another stream (``record_stream`` is not seen here), holds the tensor
    until it is done.

    Example: steps 1-4 allocate slots 0-3; the engine drops each step's outcome after its
    forward, so step 5 gets slot 0's tensor again; an engine that kept step 1's mapping gets
    a fresh tensor for step 5 instead, and step 1's stays as it was.
    """

    DEPTH = 4

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._held: list[torch.Tensor | None] = [None] * self.DEPTH
        self._streams = [0] * self.DEPTH
        #: ``_refs`` of each slot's tensor when nothing else referred to it (its making).
        self._alone: list[tuple[int, int, int]] = [(0, 0, 0)] * self.DEPTH
        self._turn = 0

    def take(self, shape: tuple[int, int], stream: int) -> torch.Tensor:
        """An int64 tensor of ``shape`` on the device, to be written on ``stream`` (a raw
        handle): a slot's again where nothing else holds it, else a fresh one."""
        if not _REUSE:
            return torch.empty(shape, dtype=torch.int64, device=self.device)
        k = self._turn
        self._turn = (k + 1) % self.DEPTH
        held = self._held[k]
        if (
            held is not None
            and self._streams[k] == stream
            and held.shape == shape
            and self._refs(k) == self._alone[k]
        ):
            return held
        held = self._held[k] = torch.empty(shape, dtype=torch.int64, device=self.device)
        self._streams[k] = stream
        # Counted as the check counts (the same call, ``held`` bound here too), so the
        # interpreter's own references are the same in both.
        self._alone[k] = self._refs(k)
        return held

    def _refs(self, k: int) -> tuple[int, int, int]:
        """Python references to slot ``k``'s tensor, holders of the tensor itself, and
        tensors on its storage."""
        held = self._held[k]
        storage = held.untyped_storage()._cdata  # noqa: SLF001
        return sys.getrefcount(held), held._use_count(), _storage_use_count(storage)  # noqa: SLF001


class DeviceTables:
    def __init__(
        self,
        coordinator: Coordinator,
        device: torch.device,
        memory: torch.Tensor | None = None,
        queues: EditQueues | None = None,
        rank: int = 0,
        cp: tuple[int, int] = (1, 0),
        order: StepOrder | None = None,
    ) -> None:
        """``memory`` (uint8, on ``device``): where the CUDA tables live when shared;
        ``queues``: with several ranks, where this rank (``rank``) takes its edits. ``cp``:
        (context_parallel, this rank's cp_rank); with context parallelism the tables are
        the rank's local ones (``kvcm.context_parallel``), on the CPU too. ``order``: the
        step and done events of shared CUDA tables on one rank (``kvcm.step_order``)."""
        self._coord = coordinator
        self._order = order
        self._queues = queues
        self._rank = rank
        self._cp = cp
        self.device = device
        self._on_host = device.type == "cpu"  # (torch's ``device.type`` costs ~1 us a read)
        host = coordinator.tables
        self._upload: Uploader | None = None
        self._launch: StepLaunch | None = None
        #: ``map_launch``'s consts (None: not made yet; False: no driver to launch with).
        self._consts: np.ndarray | bool | None = None
        if cp[0] > 1:
            groups, rows, cols = host.shape
            shape = (groups, rows, table_width(cols, cp[0]))
            if memory is None:
                self.tensor = torch.full(shape, coordinator.empty, dtype=torch.int32, device=device)
            else:  # shared: a consumer maps this rank's tables there
                self.tensor = memory.view(torch.int32).view(shape)
                self.tensor.fill_(coordinator.empty)
            coordinator.edits = coordinator.edits if coordinator.edits is not None else []
            if device.type != "cpu":
                self._upload = Uploader(device, torch.int64)
        elif device.type == "cpu":
            self.tensor = torch.from_numpy(host)
        else:
            if memory is None:
                self.tensor = torch.from_numpy(host).to(device)
            else:
                self.tensor = memory.view(torch.int32).view(host.shape)
                self.tensor.copy_(torch.from_numpy(host))
            coordinator.edits = []
            self._upload = Uploader(device, torch.int64)
            self._launch = StepLaunch.create(self.tensor)
            self._outputs = Outputs(device)
            #: The empty ``[0, 0]`` mapping of ``publish``'s launch, which maps no token.
            self._no_tokens = torch.empty((0, 0), dtype=torch.int64, device=device)

    @property
    def uploader(self) -> Uploader | None:
        return self._upload

    @property
    def on_host(self) -> bool:
        """Whether these tables live in host memory (the CPU): read by the host, not by a
        kernel (the coordinator's own arrays, or a context-parallel rank's, which take
        edits)."""
        return self._on_host

    def map_launch(
        self,
        core: ModuleType,
        items: MappedItems,
        total: int,
        edits: np.ndarray,
        pad_to: int,
        first_group: int,
        num_groups: int,
    ) -> torch.Tensor | None:
        """The step's fused launch packed and made by the C core (``core.step_launch``): the
        pending ``edits`` (``take_pending``'s) applied and the slot mapping of ``items``
        (``total`` tokens) on layer groups ``[first_group, first_group + num_groups)``,
        int64 ``[num_groups, pad_to]`` on the device (``Outputs``': reused once nothing
        holds it), in one C call on the current stream (which also waits for the staging
        buffer's last reader and records its event, and the step event after edits). None,
        with nothing launched, where ``StepLaunch`` (or the usual dispatch) must run it: no
        fused launch here, one launch would not take it, the driver's entry points or raw
        events are missing, or the C core refuses the inputs (which the caller's checks make
        unreachable); the caller then applies ``edits`` itself. A driver error is a
        RuntimeError, as from ``StepLaunch``."""
        launch = self._launch
        if launch is None or not self._c_ready(len(edits), num_groups * pad_to):
            return None
        stream = kvcm_kernels.current_stream_handle(launch.index)
        out = self._outputs.take((num_groups, pad_to), stream)
        launched = self._c_launch(
            core, items, total, edits, (out.data_ptr(), pad_to, first_group, num_groups), stream
        )
        return out if launched else None

    def _c_launch(
        self,
        core: ModuleType,
        items: MappedItems,
        total: int,
        edits: np.ndarray,
        mapping: tuple[int, int, int, int],
        stream: int,
    ) -> bool:
        """``core.step_launch`` on ``stream`` (once ``_c_ready``) with ``mapping`` (the
        output's device address, pad_to, first group, groups; ``(0, 0, 0, 0)``: the edits
        alone), the staging buffer's event and, after edits, the step event recorded in the
        same call; False, with nothing launched, where the C core refuses the inputs. A
        driver error is a RuntimeError, the device synchronized first."""
        upload, consts = self._upload, self._consts
        assert upload is not None and isinstance(consts, np.ndarray)
        order = self._order
        step_event = order.event if order is not None and edits.shape[0] else 0
        size = 2 * items[0].size + 1 + total + edits.size
        address, wait = upload.reserve_unwaited(size)
        try:
            core.step_launch(
                consts,
                address,
                size,
                items,
                edits,
                *mapping,
                stream,
                upload.raw_event,
                wait,
                step_event,
            )
        except (ValueError, TypeError):  # refused, nothing launched: the caller's path runs
            return False  # (with the same edits, which are still the caller's to apply)
        except RuntimeError:  # the driver failed: a launch may read the buffer unfenced
            with contextlib.suppress(RuntimeError):  # (a broken context fails this too)
                torch.cuda.synchronize(self.device)
            raise
        upload.fenced()
        return True

    def _c_ready(self, num_edits: int, outputs: int) -> bool:
        """Whether ``_c_launch`` can take a step of ``num_edits`` edits and ``outputs``
        slot-mapping entries: a fused launch that fits them (``StepLaunch.fits``), raw
        events to fence the staging buffer with and the driver's entry points."""
        launch, upload = self._launch, self._upload
        return (
            launch is not None
            and upload is not None
            and bool(upload.raw_event)
            and launch.fits(num_edits, outputs)
            and self._launch_consts(launch) is not None
        )

    def _launch_consts(self, launch: StepLaunch) -> np.ndarray | None:
        """``core.step_launch``'s consts for these tables (made once): the driver's entry
        points, the kernel, the tables' address and shape (groups, rows, blocks),
        tokens_per_block, min_live, the block's threads and the staged query_start_loc
        limit; None without a driver."""
        if self._consts is None:
            entries = driver_entry_points()
            if entries is None:
                self._consts = False
                return None
            groups, rows, cols = self.tensor.shape
            c = self._coord
            self._consts = np.array(
                [
                    *entries,
                    launch.kernel,
                    self.tensor.data_ptr(),
                    groups,
                    rows,
                    cols,
                    c.tokens_per_block,
                    c.empty + 1,
                    THREADS,
                    STAGED_QSL_LIMIT,
                ],
                dtype=np.int64,
            )
        return self._consts if self._consts is not False else None

    @property
    def launch(self) -> StepLaunch | None:
        """The step's fused launch on these tables' device (``kvcm_kernels.step_tables``):
        rank 0's CUDA tables with CuPy; None elsewhere."""
        return self._launch

    @property
    def order(self) -> StepOrder | None:
        """The step and done events (``kvcm.step_order``): shared CUDA tables on one rank
        only; None elsewhere."""
        return self._order

    def take_pending(self) -> np.ndarray:
        """The edits not yet on the device, int64 ``[E, 4]``; the caller must apply them on
        the current stream, which then waits for the host tier's copies so far: a table
        cell never reaches the device before the copy that fills or empties its slot. With
        consumers' done events (``kvcm.step_order``) it waits for those too: every path
        that edits the shared tables queues its edits after the consumers' reads."""
        if self._queues is not None:  # several ranks (no host tier with them)
            edits = self._queues.take(self._rank)
            cp, mine = self._cp
            return edits if cp == 1 else local_edits(edits, cp, mine)
        if self._upload is None or not self._coord.ops_since_take:
            return _NO_EDITS  # read only: nobody writes an empty array
        if self._coord.host is not None:
            self._coord.host.copier.order_before(torch.cuda.current_stream(self.device))
        self.before_writes()
        return self._coord.take_edits()

    def before_writes(self) -> None:
        """A step is about to queue device writes (host-tier copies, state copies, table
        edits): with consumers' done events, the current stream waits for them first, so
        that no write of this step lands in a page, a state slot or a cell that a
        consumer's forward still reads (the host tier's copies wait for the current stream's
        earlier work, so they inherit the wait). Nothing without watched consumers."""
        order = self._order
        if order is not None and order.watched:
            order.wait_for_consumers(kvcm_kernels.current_stream_handle(order.index))

    def edits_queued(self) -> None:
        """The edits ``take_pending`` gave were queued on the current stream by their
        caller (a slot mapping's fused launch): the step event follows them, so that a later
        stream-ordered step without edits of its own, which records nothing, still answers
        after them."""
        order = self._order
        if order is not None:
            order.record(kvcm_kernels.current_stream_handle(order.index))

    def sync(self) -> torch.Tensor:
        """Apply pending edits (one launch) and return the tables ``[groups, rows, blocks]``."""
        edits = self.take_pending()
        if edits.shape[0]:
            if self._upload is None:  # a context-parallel rank's tables on the CPU
                # One numpy assignment (a cell appears once in a batch of edits).
                self.tensor.numpy()[edits[:, 0], edits[:, 1], edits[:, 2]] = edits[:, 3]
                return self.tensor
            # The kernel reads the edits from pinned memory: no copy of their own.
            kvcm_kernels.apply_page_table_edits(self.tensor, self._upload.stage(edits))
            self._upload.commit()
            self.edits_queued()  # the step event follows every edit of the tables
        return self.tensor

    def publish(self) -> None:
        """Apply the pending edits on the current stream and record the step event after
        them (``step_columns(stream_ordered=True)``): no wait on the host. Needs ``order``
        (shared CUDA tables of one rank, which have the uploader and, with CuPy, the step's
        pre-bound launch: the edits go as a step that maps no token, one driver call; with
        the C core the edits, the staging buffer's fence and the step event are one C
        call). Without edits nothing is launched nor recorded (most decode steps cross no
        block boundary): every path that applies edits records the event after them
        (``sync``, a slot mapping's fused launch), so its last record follows them all."""
        order = self._order
        assert order is not None and self._upload is not None
        edits = self.take_pending()
        if edits.shape[0]:
            stream = kvcm_kernels.current_stream_handle(order.index)
            core = native.core
            if (
                core is not None
                and self._c_ready(len(edits), 0)
                and self._c_launch(core, _NO_ITEMS, 0, edits, (0, 0, 0, 0), stream)
            ):
                return
            size = 1 + edits.size  # query_start_loc [0], then the edits (StepLaunch's layout)
            packed = self._upload.reserve(size)
            packed[0] = 0
            packed[1:] = edits.reshape(-1)
            launch = self._launch
            if launch is None or not launch(
                self._upload.address, 0, 0, len(edits), 1, 0, self._no_tokens, 0, stream
            ):
                staged = self._upload.staged(size)[1:].view(-1, 4)
                kvcm_kernels.apply_page_table_edits(self.tensor, staged)
            self._upload.commit(stream)
            order.record(stream)

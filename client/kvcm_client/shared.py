"""Map the service's pools and page tables into this process: the inference server's side.

``attach(layout)`` opens the shared-memory segments that ``pools()`` describes and returns
torch views that alias them (nothing is copied): per (layer, role) the same
``[num_slots, tokens_per_block, heads, head_dim]`` strided view the manager has, and the page
tables ``[groups, max_requests, max_blocks_per_request]`` int32, which the manager edits in
place. ``KVCacheClient.attach()`` also registers this process with the service, which counts
attached consumers; a consumer that dies without detaching is noticed by its pid.

Needs torch (the inference server has it); ``import kvcm_client`` alone does not import it.
"""

from __future__ import annotations

import base64
import contextlib
import logging
import os
from collections.abc import Callable
from multiprocessing import resource_tracker, shared_memory
from typing import Any

from .errors import DeviceUnavailable, InvalidArgument, StaleGeneration, StreamOrderUnavailable
from .models import SharedLayout, SharedSegment

log = logging.getLogger(__name__)


def require_torch() -> None:
    """Raise ``ModuleNotFoundError`` (install ``kvcm-client[attach]``) unless torch imports:
    checked before a consumer is registered, so that a failed attach leaves none behind."""
    try:
        import torch  # noqa: F401
    except ModuleNotFoundError as exc:
        raise ModuleNotFoundError(
            "attaching to the pools needs torch: pip install 'kvcm-client[attach]'", name="torch"
        ) from exc


def cupy_for_ipc(
    purpose: str = "mapping CUDA pools",
    install: str = "e.g. pip install cupy-cuda12x",
    logger: logging.Logger = log,
) -> Any:
    """CuPy, which CUDA IPC goes through, or ``DeviceUnavailable`` naming CuPy and why.

    There is no other way to share or map a CUDA pool (the allocations and their IPC
    handles are CuPy's runtime calls), so a missing or unusable CuPy is a typed error rather
    than its import's own exception (``PermissionError`` when ``$HOME`` is not writable for
    CuPy's kernel cache) surfacing from inside ``attach`` or a registration. An unusable one
    is logged too (to ``logger``: the service's log, for its side), since an error answered
    over HTTP would not reach that log otherwise. ``purpose`` and ``install`` word the
    message: the consumer's "mapping", the service's "sharing" and its ``gpu`` extra.
    """
    try:
        import cupy
    except ModuleNotFoundError as exc:
        if exc.name == "cupy":
            raise DeviceUnavailable(f"{purpose} needs CuPy ({install}) for CUDA IPC") from None
        # CuPy is there, something it imports is not.
        raise _unusable_cupy(exc, purpose, logger) from exc
    except Exception as exc:
        raise _unusable_cupy(exc, purpose, logger) from exc
    return cupy


def _unusable_cupy(exc: Exception, purpose: str, logger: logging.Logger) -> DeviceUnavailable:
    """The error for an installed CuPy that cannot be used, logged on the way."""
    message = (
        f"{purpose} needs CuPy for CUDA IPC, and CuPy is installed but unusable "
        f"({type(exc).__name__}: {exc})"
    )
    if isinstance(exc, OSError):  # nearly always its kernel cache, ~/.cupy/kernel_cache
        message += ": set CUPY_CACHE_DIR or HOME to a directory this user can write"
    logger.warning("%s", message)
    return DeviceUnavailable(message)


def _open(segment: SharedSegment) -> shared_memory.SharedMemory:
    try:
        shm = shared_memory.SharedMemory(name=segment.name, create=False)
    except FileNotFoundError:
        raise StaleGeneration(
            f"shared segment {segment.name} is gone: the service restarted or stopped",
            name=segment.name,
        ) from None
    # The service owns and unlinks the segment; this process only maps it (Python < 3.13
    # registers every opened segment for unlinking at exit).
    with contextlib.suppress(Exception):
        # SharedMemory keeps the tracker's key (the name with its leading slash) private.
        resource_tracker.unregister(shm._name, "shared_memory")  # type: ignore[attr-defined]  # noqa: SLF001
    return shm


class StepEvents:
    """The engine's side of stream-ordered steps (docs/shared-memory.md#stream-ordered-steps):
    the service's step event, opened here, and this process's own done event, whose IPC
    handle the consumer registration gives the service.

    CUDA streams order work within a process only, so the two events carry the order both
    ways without a host wait: ``wait_step`` makes a stream wait for the service's latest
    step edits, ``step_done`` marks the end of a forward's reads of the tables, and the
    service's next edits wait for it on the device.
    """

    def __init__(self, layout: SharedLayout) -> None:
        """Open ``layout``'s step event on its GPU and create the done event there;
        ``StreamOrderUnavailable`` (nothing created) where the layout has no step event."""
        if layout.step_event is None:
            raise StreamOrderUnavailable(
                "the service offers no step event: stream-ordered steps need its page tables "
                "in shared CUDA memory on one rank",
                reason="no_step_event",
            )
        cupy = cupy_for_ipc()
        rt = cupy.cuda.runtime
        self._rt = rt
        self.index = _device_with_uuid(layout.page_tables.device_uuid or "")
        with cupy.cuda.Device(self.index):
            self._step = rt.ipcOpenEventHandle(base64.b64decode(layout.step_event))
            try:
                self._done = rt.eventCreateWithFlags(rt.eventDisableTiming | rt.eventInterprocess)
            except BaseException:
                rt.eventDestroy(self._step)
                raise
            raw = bytes(rt.ipcGetEventHandle(self._done))
        #: The done event's IPC handle, base64 (``ConsumerRequest.done_event``).
        self.done_handle = base64.b64encode(raw).decode()
        self.closed = False

    def _stream(self, stream: Any) -> int:
        if self.closed:
            raise InvalidArgument("this attachment is closed")
        if stream is None:
            import torch

            return torch.cuda.current_stream(self.index).cuda_stream
        return int(getattr(stream, "cuda_stream", stream))

    def wait_step(self, stream: Any = None) -> None:
        """Make ``stream`` (a torch stream or raw handle; default torch's current stream on
        the service's GPU) wait for the service's latest step edits. No host wait."""
        self._rt.streamWaitEvent(self._stream(stream), self._step, 0)

    def step_done(self, stream: Any = None) -> None:
        """Record the done event on ``stream`` (as ``wait_step``) once the work that reads
        the tables is queued on it: the service's next edits wait for that work."""
        self._rt.eventRecord(self._done, self._stream(stream))

    def close(self, keep_done: bool = False) -> None:
        """Destroy both events here. ``keep_done``: the service may still wait on the done
        event (its consumer not unregistered): CUDA leaves an imported event undefined once
        its exporter destroys it, so that one is left to go with this process."""
        if self.closed:
            return
        self.closed = True
        cupy = cupy_for_ipc()
        with cupy.cuda.Device(self.index):
            for event in (self._step,) if keep_done else (self._step, self._done):
                with contextlib.suppress(Exception):
                    self._rt.eventDestroy(event)


class Attachment:
    """Views of one service generation's pools and page tables (see the module docstring)."""

    def __init__(
        self,
        layout: SharedLayout,
        expected_generation: str | None = None,
        on_close: Callable[[], None] | None = None,
        check: Callable[[], object] | None = None,
        events: StepEvents | None = None,
    ) -> None:
        """``events``: the stream-ordered steps' events (``KVCacheClient.attach(
        stream_order=True)``), closed with the attachment."""
        import torch

        if expected_generation is not None and layout.generation != expected_generation:
            raise StaleGeneration(
                f"descriptors of generation {layout.generation[:12]}, expected "
                f"{expected_generation[:12]}",
                generation=layout.generation,
            )
        self.layout = layout
        self.generation = layout.generation
        self._segments: list[shared_memory.SharedMemory] = []
        self._ipc: list[tuple[int, int]] = []  # (device index, pointer) opened here
        self._on_close = on_close
        self._check = check
        self._events = events

        def raw(segment: SharedSegment) -> Any:
            if segment.kind == "cuda_ipc":
                return self._open_ipc(segment)
            shm = _open(segment)
            self._segments.append(shm)
            return torch.frombuffer(shm.buf, dtype=torch.uint8, count=segment.nbytes)

        pools = [raw(seg) for seg in layout.pools]
        self.views: dict[tuple[int, str], Any] = {}
        for b in layout.buffers:
            typed = pools[b.pool].view(getattr(torch, b.dtype))
            self.views[(b.layer_id, b.role)] = typed.as_strided(b.shape, b.strides, b.offset)
        self.page_tables = raw(layout.page_tables).view(torch.int32).view(layout.page_table_shape)
        states = [raw(seg) for seg in layout.state_pools]
        self.state_views: dict[tuple[int, str], Any] = {}
        for sb in layout.state_buffers:
            typed = states[sb.state_group].view(getattr(torch, sb.dtype))
            self.state_views[(sb.layer_id, sb.name)] = typed.as_strided(
                sb.shape, sb.strides, sb.offset
            )
        self.closed = False

    def _open_ipc(self, segment: SharedSegment) -> Any:
        """Open a CUDA IPC handle on the local device with the segment's UUID (zero-copy)."""
        import base64

        import torch

        cupy = cupy_for_ipc()
        index = _device_with_uuid(segment.device_uuid or "")
        with cupy.cuda.Device(index):
            pointer = cupy.cuda.runtime.ipcOpenMemHandle(
                base64.b64decode(segment.handle or ""),
                cupy.cuda.runtime.cudaIpcMemLazyEnablePeerAccess,
            )
            memory = cupy.cuda.UnownedMemory(pointer, segment.nbytes, owner=None, device_id=index)
            array = cupy.ndarray(
                (segment.nbytes,), dtype=cupy.uint8, memptr=cupy.cuda.MemoryPointer(memory, 0)
            )
            tensor = torch.as_tensor(array, device=f"cuda:{index}")
        self._ipc.append((index, pointer))
        return tensor

    def check(self) -> None:
        """Raise ``StaleGeneration`` if these mappings belong to a service that restarted.

        Cheap enough for every step or every few: with a client (``KVCacheClient.attach``) one
        ``GET /livez`` whose answer names the generation; without one, on the CPU, one
        ``stat`` per segment (a restarted service reclaims the segments of the one before,
        and a stopped one unlinks its own). A stale attachment still maps valid, orphaned
        memory: writes land nowhere the new service reads, so check, then re-attach.
        """
        if self._check is not None:
            self._check()
            return
        for segment in (*self.layout.pools, self.layout.page_tables, *self.layout.state_pools):
            if segment.kind != "shm":
                raise InvalidArgument("checking a CUDA attachment needs a client's attach()")
            if not os.path.exists(f"/dev/shm/{segment.name}"):
                raise StaleGeneration(
                    f"shared segment {segment.name} is gone: the service restarted or stopped",
                    name=segment.name,
                )

    def _step_events(self) -> StepEvents:
        if self._events is None:
            raise StreamOrderUnavailable(
                "this attachment has no step events: attach with stream_order=True",
                reason="not_attached",
            )
        return self._events

    def wait_step(self, stream: Any = None) -> None:
        """After a ``step_columns(stream_ordered=True)`` answer and before the forward reads
        the tables: ``stream`` (torch's current stream on the service's GPU by default)
        waits for the step's table edits on the device; the host does not wait."""
        self._step_events().wait_step(stream)

    def step_done(self, stream: Any = None) -> None:
        """Once the forward's reads of the tables are queued on ``stream``, and before the
        next step is sent: the service's next table edits wait for them on the device."""
        self._step_events().step_done(stream)

    def layer_view(self, layer_id: int, role: str = "key") -> Any:
        try:
            return self.views[(layer_id, role)]
        except KeyError:
            raise InvalidArgument(f"no buffer for layer {layer_id}, role {role!r}") from None

    def page_table(self, layer_group: int) -> Any:
        return self.page_tables[layer_group]

    def state_view(self, layer_id: int, name: str) -> Any:
        """Buffer ``name`` of state layer ``layer_id``: ``[slots, *shape]``, the live state of
        the request in page-table row r at ``[r]`` (``KVCacheManager.state_view``)."""
        try:
            return self.state_views[(layer_id, name)]
        except KeyError:
            raise InvalidArgument(f"no state buffer {name!r} of layer {layer_id}") from None

    def close(self, unregistered: bool = False) -> None:
        """Unregister from the service and drop this object's views and mappings.

        A mapping stays until every tensor made from it is gone; views the caller still
        holds keep it alive (and valid) until then. ``unregistered``: the caller unregistered
        the consumer already (the async client's ``detach``); otherwise, without an
        ``on_close`` that does, a stream-ordered attachment's done event is kept (the
        service may still wait on it: ``StepEvents.close``).
        """
        if self.closed:
            return
        self.closed = True
        if self._on_close is not None:
            self._on_close()
            unregistered = True
        self.views.clear()
        del self.page_tables
        if self._events is not None:
            self._events.close(keep_done=not unregistered)
        for shm in self._segments:
            with contextlib.suppress(BufferError):
                shm.close()
        self._segments.clear()
        if self._ipc:
            cupy = cupy_for_ipc()  # it opened them, so it imports
            for index, pointer in self._ipc:
                with cupy.cuda.Device(index), contextlib.suppress(Exception):
                    cupy.cuda.runtime.ipcCloseMemHandle(pointer)
            self._ipc.clear()

    def __enter__(self) -> Attachment:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _device_with_uuid(uuid: str) -> int:
    cupy = cupy_for_ipc()
    for index in range(cupy.cuda.runtime.getDeviceCount()):
        if bytes(cupy.cuda.runtime.getDeviceProperties(index)["uuid"]).hex() == uuid:
            return index
    raise InvalidArgument(
        f"no visible CUDA device has UUID {uuid}: the consumer must see the service's GPU",
        device_uuid=uuid,
    )


def attach(layout: SharedLayout, expected_generation: str | None = None) -> Attachment:
    """Map ``layout`` (from ``pools()``) without registering with a service."""
    return Attachment(layout, expected_generation)

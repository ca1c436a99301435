"""Stream order between the service's table edits and an engine's reads, across processes.

CUDA streams order work inside one process only. A CUDA sidecar that answered a step only
once its stream had applied the step's page-table edits (a synchronous device-to-host copy of
the slot mapping) made the engine's reads safe by waiting on the host, about 250 us a step on
an H100. ``step_columns(stream_ordered=True)`` answers without that wait; this component
orders the device work instead (docs/shared-memory.md#stream-ordered-steps):

- the **step event**: an interprocess CUDA event the manager records on its stream after a
  step's edits (after any edits ``DeviceTables`` applies; a step without edits leaves the
  last record); its IPC handle is in the shared layout, and an engine's stream waits on it
  (``cudaStreamWaitEvent``) before its forward reads the tables;
- **done events**: each consumer that registered one records it on its stream after its
  forward's last read of the tables; the manager's stream waits on every one before it
  applies the next edits (``DeviceTables.take_pending``), so that no edit lands in a cell a
  forward still reads (the tables are edited in place: one copy, no double buffering).

Neither side waits on the host. Both waits refer to the event's latest record when the wait
is queued, so a consumer waits on the step event after the step's answer and before it lets
the next step be sent, and records its done event before that too.
"""

from __future__ import annotations

import base64
import contextlib
import logging
import weakref
from collections.abc import Iterable
from typing import Any

from kvcm_client import shared
from kvcm_client.errors import InvalidArgument

_log = logging.getLogger("kvcm")


def cupy_for_ipc() -> Any:
    """CuPy, or ``DeviceUnavailable`` naming it (``kvcm_client.shared.cupy_for_ipc``)."""
    return shared.cupy_for_ipc("ordering steps across processes", "the gpu extra", _log)


def _destroy(runtime: Any, index: int, events: Iterable[int]) -> None:
    """Destroy events (the step event, opened done events) on their device."""
    cupy = cupy_for_ipc()
    with cupy.cuda.Device(index):
        for event in list(events):
            with contextlib.suppress(Exception):  # a context torn down at exit
                runtime.eventDestroy(event)


class StepOrder:
    """The step event and the consumers' done events of one CUDA device (module docstring)."""

    def __init__(self, index: int) -> None:
        cupy = cupy_for_ipc()
        rt = cupy.cuda.runtime
        self._rt = rt
        self._cupy = cupy
        self.index = index
        with cupy.cuda.Device(index):
            self._event = rt.eventCreateWithFlags(rt.eventDisableTiming | rt.eventInterprocess)
            raw = bytes(rt.ipcGetEventHandle(self._event))
        #: The step event's IPC handle, base64 (``SharedLayout.step_event``).
        self.handle = base64.b64encode(raw).decode()
        self._done: dict[str, int] = {}
        # The step event and the done events still open go with this object (a new model).
        weakref.finalize(self, _destroy, rt, index, self._done.values())
        weakref.finalize(self, _destroy, rt, index, [self._event])

    def watch(self, consumer_id: str, handle: str) -> None:
        """Open consumer ``consumer_id``'s done event (base64 IPC handle): later edits wait on
        it. ``InvalidArgument`` (nothing opened) for a handle that is not one."""
        try:
            raw = base64.b64decode(handle, validate=True)
        except ValueError:
            raw = b""
        if len(raw) != 64:
            raise InvalidArgument("done_event must be a base64 CUDA IPC event handle (64 bytes)")
        with self._cupy.cuda.Device(self.index):
            try:
                event = self._rt.ipcOpenEventHandle(raw)
            except self._cupy.cuda.runtime.CUDARuntimeError as exc:
                raise InvalidArgument(
                    f"done_event cannot be opened on this device: {exc}"
                ) from None
        self.forget(consumer_id)
        self._done[consumer_id] = event

    def forget(self, consumer_id: str) -> None:
        """Stop waiting on a consumer's done event (it detached or died); no-op if none."""
        event = self._done.pop(consumer_id, None)
        if event is not None:
            _destroy(self._rt, self.index, [event])

    @property
    def watched(self) -> int:
        """How many done events later edits wait on."""
        return len(self._done)

    def wait_for_consumers(self, stream: int) -> None:
        """Make ``stream`` (a raw handle on this device) wait for every consumer's latest
        done event: queued before edits, so that no edit overtakes a read."""
        for event in self._done.values():
            self._rt.streamWaitEvent(stream, event, 0)

    @property
    def event(self) -> int:
        """The step event's raw handle (a ``CUevent``), for C code that records it itself
        (``kvcm._native.step_launch``)."""
        return int(self._event)

    def record(self, stream: int) -> None:
        """Record the step event on ``stream`` after the step's edits were queued on it."""
        self._rt.eventRecord(self._event, stream)

"""The step channel's server: the step-path calls over a Unix socket (docs/step-channel.md).

It runs on the event loop that serves HTTP (started in the app's lifespan), and each frame is
handled without awaiting in between, so ``ServiceState``'s rule (every manager call on the
event-loop thread, never interleaved) holds across both transports. Each call goes through the
same ``ServiceState`` methods as its HTTP route: the same op counters, leases and errors.

A connection is served in order: frames are answered in the order they arrive, so a client
may pipeline. A frame must arrive whole within ``read_timeout`` seconds of its first byte (an
idle connection between frames costs nothing and may stay open). A frame
over the body limit, or one that is not a msgpack map, is answered with the HTTP route's error
and the connection is closed, since whatever follows cannot be trusted to be a frame. A frame
of length zero is the doorbell: not answered, it tells the service that the client's next
frame is on its way (``step_poll``).
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import os
import socket
from collections.abc import Callable
from pathlib import Path
from time import perf_counter, perf_counter_ns
from typing import Any

import msgpack
import numpy as np
from pydantic import BaseModel, ValidationError

from kvcm_client.errors import (
    InternalError,
    InvalidArgument,
    KVCMError,
    LimitReached,
    MalformedRequest,
    PayloadTooLarge,
    RingUnavailable,
    StaleGeneration,
    Unauthorized,
    invalid_from_validation,
)
from kvcm_client.models import (
    AllocateOp,
    CommitOp,
    ExtendManyRequest,
    ExtendOp,
    FreeOp,
    ProbeRequest,
    RequestRef,
    RewindOp,
    SlotMappingRequest,
    StepRequest,
)
from kvcm_client.step_channel import HEADER, OPS, unpack
from kvcm_client.step_ring import RING_OP, SLOT_BYTES, supported

from ..columnar_parse import columns_from_wire
from ..ops import plain_step
from .repeat_frame import RepeatFrame, decode_args
from .state import Due, ServiceState
from .step_poll import DEFAULT_POLL_US, WAKE, FramePoll, GapPredictor
from .step_ring import MAX_RINGS, RING_WATCH_NS, ServiceRing, watch
from .unix_socket import OwnSocket, bind

log = logging.getLogger("kvcm.step_channel")

#: Keys a request map may have (docs/step-channel.md).
_KEYS = frozenset({"op", "args", "session", "generation", "token"})
#: The args of a decode step's frame: ``step_columns`` with extends alone.
_DECODE_ARGS = frozenset(
    {"extend", "num_new_tokens", "lookahead", "map_slots", "table_edits", "stream_ordered"}
)
#: The largest frame and answer (bytes together) the busy poll rehearses (``rehearse``):
#: a larger one would hold a frame that comes meanwhile for longer than it saves.
REHEARSAL_BYTES = 64 << 10


def _table(values: Any) -> dict[str, Any]:
    """An int table as raw little-endian int64 bytes and its shape."""
    if hasattr(values, "cpu"):  # a torch tensor, maybe on the GPU
        values = values.cpu().numpy()
    array = np.ascontiguousarray(values, dtype="<i8")
    return {"dtype": "int64", "shape": list(array.shape), "data": array.tobytes()}


class StepChannel:
    """The calls of one service over its step socket."""

    def __init__(
        self,
        state: ServiceState,
        token: bytes | None,
        limit: Callable[[], int],
        read_timeout: float = 10.0,
        poll_us: float = DEFAULT_POLL_US,
        spin_s: float = 0.0,
    ) -> None:
        """``poll_us``: the adaptive poll after an answer (``step_poll``); ``spin_s``: the
        busy-poll mode (``spin``): after each answer, poll for this long for the next frame,
        whatever came before (0: off). Neither runs on a machine of one CPU (the client needs
        it); the adaptive poll neither where the service may run on one CPU only."""
        self.state = state
        self.token = token
        self.limit = limit
        self.read_timeout = read_timeout
        # Busy-poll mode is asked for by an operator who gives the sidecar a core of its own,
        # usually by pinning it to one (taskset, cpuset): it spins wherever the machine has
        # another CPU for the clients. The adaptive poll, on by default, needs a second CPU
        # among the service's own.
        self.spin_ns = int(spin_s * 1e9) if (os.cpu_count() or 1) > 1 else 0
        self.spin_s = self.spin_ns / 1e9  # (what each answer says: ``_answer``)
        adaptive = poll_us > 0 and _cpus() > 1
        #: The poll after an answer (``step_poll``), also the busy poll's; None: sleep in the
        #: loop at once.
        self.poll = FramePoll(poll_us) if adaptive or self.spin_ns else None
        #: Busy-poll mode: when the current spin ends, and whether one is running.
        self._spin_until = 0
        self._spinning = False
        #: What the frame being answered leaves for after its answer is out (``answer_first``).
        self.due: Due = []
        #: The last decode step's frame, cut around its handles (``repeat_frame``), and
        #: whether the frame being answered was one (``_step_columns`` says).
        self._again: RepeatFrame | None = None
        self._decoded = False
        #: The last small frame answered without an error, and its answer (``rehearse``).
        self._rehearsal: tuple[bytes, dict[str, Any]] | None = None
        self.server: asyncio.AbstractServer | None = None
        #: The socket file ``start`` made, removed by ``stop``.
        self.socket_file: OwnSocket | None = None
        #: The open connections: each adds itself when made and removes itself when lost.
        self.connections: set[_Connection] = set()
        #: The connections with a shared-memory ring (``step_ring``), which the spin polls.
        self.ringed: set[_Connection] = set()
        m = state.metrics
        self._latency = {op: m.latency.labels(f"/v1/{op}") for op in OPS}
        self._handlers: dict[str, Callable[[Any, str | None], Any]] = {
            "step": self._step,
            "step_columns": self._step_columns,
            "allocate": self._model(AllocateOp, state.allocate),
            "extend": self._model(ExtendOp, state.extend),
            "extend_many": self._model(ExtendManyRequest, state.extend_many),
            "rewind": self._model(RewindOp, state.rewind),
            "commit": self._model(CommitOp, state.commit),
            "free": self._model(FreeOp, state.free),
            "suspend": self._model(RequestRef, state.suspend),
            "resume": self._model(RequestRef, state.resume),
            "slot_mapping": self._model(SlotMappingRequest, self._slot_mapping),
            "slot_mappings": self._model(SlotMappingRequest, self._slot_mappings),
            "probe": self._model(ProbeRequest, self._probe),
        }

    async def start(self, path: Path) -> None:
        sock, self.socket_file = bind(path, "--step-socket")
        sock.listen(128)
        loop = asyncio.get_running_loop()
        self.server = await loop.create_unix_server(lambda: _Connection(self), sock=sock)
        log.info("step channel on %s", path)

    async def stop(self) -> None:
        """Stop accepting, close every connection and remove the socket file."""
        if self.server is None:
            return
        self.server.close()
        for conn in list(self.connections):
            conn.close()
        await self.server.wait_closed()
        if self.socket_file is not None:
            self.socket_file.remove()

    # -- one frame -----------------------------------------------------------------------------

    def handle(
        self, body: bytes, conn: _Connection | None = None
    ) -> tuple[dict[str, Any], bool, str]:
        """The answer to one frame, whether to close the connection after it, and its op
        (``invalid`` for a frame without a known op), counted. ``conn``: the connection it
        came on (the ``ring`` op attaches its ring to it)."""
        out = self.answer_first(body, conn)
        self.settle()
        return out

    def answer_first(
        self, body: bytes, conn: _Connection | None = None
    ) -> tuple[dict[str, Any], bool, str]:
        """``handle`` without what can wait until the answer is out: the frame's counts,
        latency, leases and the events' wake-up, left in ``due`` for ``settle``, which the
        caller runs once it has sent the answer, before it reads another frame.

        Why: the client waits for the answer, not for them; at an engine's cadence they
        run cold and cost a decode step's round trip a few microseconds (the development
        VM, the ring at 5 ms: docs/step-channel.md#errors-order-and-limits)."""
        self._decoded = False
        again = self._again
        if again is not None and again.fits(body):
            # The last decode step's frame with other handles (``repeat_frame``): its map is
            # the learnt one's, so only the checks that depend on the service run again.
            return self._answer(conn, again.message, "step_columns", (again, body))
        try:
            message = unpack(body)
        except Exception:  # msgpack raises several types for junk
            err = MalformedRequest("the frame is not msgpack")
            return self.error_frame("invalid", err), True, "invalid"
        if type(message) is not dict:
            err = MalformedRequest("a frame must hold a msgpack map")
            return self.error_frame("invalid", err), True, "invalid"
        op = message.get("op")
        answer = self._answer(conn, message, op, None)
        if self._decoded:  # a decode step's frame, answered: the next may repeat it
            self._again = RepeatFrame.learn(body, message)
        return answer

    def _answer(
        self,
        conn: _Connection | None,
        message: dict[str, Any],
        op: Any,
        again: tuple[RepeatFrame, bytes] | None,
    ) -> tuple[dict[str, Any], bool, str]:
        """``answer_first`` of a parsed map; ``again``: a decode step's frame seen again
        (``repeat_frame``) and its body, or None."""
        label = op if type(op) is str and (op in OPS or op == RING_OP) else "invalid"
        try:
            if again is not None:
                result = self._decode_again(*again)
            elif op == RING_OP:
                result = self._offer_ring(conn, message)
            else:
                result = self._call(op, message)
        except KVCMError as exc:
            return self.error_frame(label, exc), False, label
        except Exception as exc:
            log.exception("internal error on step channel op %r", op)
            err = InternalError(f"internal error: {type(exc).__name__}")
            return self.error_frame(label, err), False, label
        self.due.append((self._framed, (label,)))
        answer = {"result": result, "generation": self.state.generation}
        if self.spin_ns:  # the client need not ring within the spin (docs: busy-poll mode)
            answer["spin"] = self.spin_s
        return answer, False, label

    def _decode_again(self, again: RepeatFrame, body: bytes) -> dict[str, Any]:
        """A decode step's frame seen again, run: the checks that depend on the service
        (the pinned generation, the token), then the step with the handles cut out of
        ``body`` and the learnt frame's counts, flags and session (``RepeatFrame.call``),
        as ``_step_columns`` runs a decode step's frame, timed as ``_run`` times it.

        Why its own lines: an engine sends this frame every forward pass, and at its
        cadence every line runs cold; the general dispatch (``_run``'s handler, the args
        copied and checked again) cost it ~3 us (the development VM, the ring at 5 ms)."""
        self._check("step_columns", again.message)
        start = perf_counter()
        new, ahead, flags, session = again.call
        rows = np.frombuffer(again.handles(body), np.int64)
        self._decoded = True
        result = self.state.decode_step(rows, new, ahead, flags, session, self.due).to_wire()
        self.due.append((self._called, ("step_columns", perf_counter() - start)))
        return result

    def _call(self, op: Any, message: dict[str, Any]) -> Any:
        if not message.keys() <= _KEYS:
            unknown = sorted(str(k) for k in message.keys() - _KEYS)
            raise InvalidArgument(f"unknown keys in a step channel frame: {unknown}")
        handler = self._handlers.get(op) if type(op) is str else None
        if handler is None:
            raise InvalidArgument(f"no step channel op {op!r}", ops=sorted(OPS))
        self._check(op, message)
        args = message.get("args", {})
        if type(args) is not dict:
            raise InvalidArgument("args must be a map")
        session = message.get("session")
        if session is not None and type(session) is not str:
            raise InvalidArgument("session must be a string")
        return self._run(op, args, session)

    def _run(self, op: str, args: dict[str, Any], session: Any) -> Any:
        """A checked frame's op (its generation and token too): its handler, timed."""
        start = perf_counter()
        result = self._handlers[op](args, session)
        self.due.append((self._called, (op, perf_counter() - start)))
        return result

    def _called(self, op: str, seconds: float) -> None:
        """An op that ran: its latency, and the events it logged (``due``)."""
        self.state.metrics.observe_later(self._latency[op], seconds)
        self.state.notify_events()

    def _framed(self, label: str) -> None:
        """A frame answered without an error, counted (``due``)."""
        metrics = self.state.metrics
        metrics.later(metrics.step_channel_frames, 1, label, "ok")

    def settle(self) -> None:
        """Run what the last frames' answers left (``answer_first``), in order. Their
        answers are out: a failure (a bug) is logged, never raised into the connection."""
        due, self.due = self.due, []
        for fn, args in due:
            try:
                fn(*args)
            except Exception:
                log.exception("step channel: accounting after an answer failed")

    def _check(self, op: str, message: dict[str, Any]) -> None:
        """The pinned generation, then the token (for the ops whose HTTP route needs it):
        HTTP's order (its generation check is the outermost middleware)."""
        pinned = message.get("generation")
        if pinned is not None and pinned != self.state.generation:
            shown = str(pinned)[:32]
            raise StaleGeneration(
                f"this client pinned generation {shown!r}; the service is now "
                f"{self.state.generation[:12]} (restarted, or a new model was registered): "
                "reconnect (docs/service.md)",
                generation=shown,
            )
        if self.token is not None and OPS[op]:
            given = message.get("token")
            if type(given) is not str or not hmac.compare_digest(given.encode(), self.token):
                raise Unauthorized("this op needs the service's token (KVCM_API_TOKEN)")

    def _offer_ring(self, conn: _Connection | None, message: dict[str, Any]) -> dict[str, int]:
        """The ``ring`` op: a shared-memory ring for ``conn`` (``step_ring``), whose fd goes
        with the answer. Offered in busy-poll mode only (a ring is polled by the spin; a
        service that sleeps would need a doorbell per frame, which is what the socket costs),
        on x86-64 Linux, one per connection, ``MAX_RINGS`` in all. Each frame through it is
        checked as on the socket (generation, token); the ring itself needs the token too,
        where the service has one, so that a peer without it cannot take the rings."""
        if not message.keys() <= _KEYS:
            unknown = sorted(str(k) for k in message.keys() - _KEYS)
            raise InvalidArgument(f"unknown keys in a step channel frame: {unknown}")
        if self.token is not None:
            given = message.get("token")
            if type(given) is not str or not hmac.compare_digest(given.encode(), self.token):
                raise Unauthorized("the step ring needs the service's token (KVCM_API_TOKEN)")
        if message.get("args", {}) != {}:
            raise InvalidArgument("the ring op takes no args")
        if conn is None or conn.ring is not None:
            raise InvalidArgument("a ring is asked for once, on the socket")
        if not self.spin_ns:
            raise RingUnavailable(
                "the step ring needs busy-poll mode (kvcm serve --step-spin-s) on 2+ CPUs",
                reason="busy_poll_off",
            )
        if not supported():
            raise RingUnavailable("the step ring runs on x86-64 Linux only", reason="platform")
        if len(self.ringed) >= MAX_RINGS:
            raise LimitReached(f"{MAX_RINGS} step rings are open", max_rings=MAX_RINGS)
        if conn.transport is None or conn.transport.get_write_buffer_size():
            raise RingUnavailable("answers to this connection are unsent", reason="unsent")
        slot = min(SLOT_BYTES, self.limit())
        conn.attach(ServiceRing(slot))
        self.ringed.add(conn)
        return {"slot": slot}

    def rang(self) -> None:
        """Count a doorbell (``kvcm_step_channel_frames_total{op="wake"}``)."""
        metrics = self.state.metrics
        metrics.later(metrics.step_channel_frames, 1, WAKE, "ok")

    def wait_for_frame(self, after: str) -> bool:
        """Poll for a connection's next frame after an answer or a doorbell (``after``:
        the poll's key, ``WAKE`` for a doorbell's; ``step_poll``), counting how the poll
        ended: True for a frame, which the event loop then reads as any other."""
        assert self.poll is not None
        metrics = self.state.metrics
        frame = self.poll.wait()
        label = "doorbell" if after == WAKE else "answer"
        metrics.child(metrics.step_channel_polls, label, "frame" if frame else "timeout").inc()
        return frame

    def spin(self) -> None:
        """Busy-poll mode (``kvcm serve --step-spin-s``): after an answer or a doorbell, keep
        polling every connection for ``spin_ns``, so that a frame that comes after a model
        pass finds the service awake on a hot core (a sleeping one takes a wake-up and cold
        caches: ~0.7 ms at a 5 ms cadence on the development VM against ~0.1 spinning).

        The poll runs in slices of ``SPIN_SLICE_NS`` handed back to the event loop between
        them (``call_soon``), so HTTP calls and other connections wait at most a slice; a
        frame ends the slice at once and the loop reads it. It stops when a spin passes with
        no frame (the engine went idle: no core burnt while nothing comes) or no connection
        is left. Example (spin 100 ms, a step every 5 ms): each answer pushes the end out to
        100 ms after it, the service never sleeps while the steps come, and it sleeps again
        100 ms after the last one."""
        self._spin_until = until = perf_counter_ns() + self.spin_ns
        self._rings_awake_until(until)
        if not self._spinning:
            self._spinning = True
            asyncio.get_running_loop().call_soon(self._spin_slice)

    #: The longest the busy poll holds the event loop at a time.
    SPIN_SLICE_NS = 200_000

    def _spin_slice(self) -> None:
        try:
            again = self._spin_on()
        except BaseException:
            self._spinning = False  # a doorbell or an answer starts the next spin
            self._rings_awake_until(0)  # their clients ring from now on
            raise
        if again:
            asyncio.get_running_loop().call_soon(self._spin_slice)
        else:
            self._spinning = False

    def _spin_on(self) -> bool:
        """One slice of the spin; whether to go on with another."""
        if not self.connections or self.server is None:
            self._rings_awake_until(0)
            return False
        left = self._spin_until - perf_counter_ns()
        if left <= 0:
            self._rings_asleep()
            return self._spin_until > perf_counter_ns()  # a frame served as it ended
        assert self.poll is not None
        if not _nothing_unsent(self.connections):
            # Part of an answer unsent: only the loop sends the rest, so the sockets wait
            # for it; the rings need not (their clients were told the service is awake).
            self._serve_rings()
            return True
        ready = self._ring_frame if self.ringed else None
        looked = self.poll.wait(min(left, self.SPIN_SLICE_NS), ready, self.rehearse)
        # A socket frame: the loop reads it next, and its answer spins again.
        return not looked or self._serve_rings()

    def remember(self, frame: bytes, answer: dict[str, Any], answer_bytes: int) -> None:
        """A frame was answered (``answer_bytes`` long): in busy-poll mode, keep it for
        ``rehearse`` if it succeeded and both are small."""
        if self.spin_ns:
            small = len(frame) + answer_bytes <= REHEARSAL_BYTES
            self._rehearsal = (frame, answer) if small and "result" in answer else None

    def rehearse(self) -> None:
        """Busy-poll mode, while it waits: run the last frame's way in and out again,
        changing nothing. A decode step's frame seen again (``repeat_frame``) rehearses as
        it runs: its handles cut out, its batch planned and its slots mapped in C
        (``KVCacheManager.rehearse_decode``); any other frame is parsed again
        (``step_columns``' arrays too, and their shape check: ``parse_keywords``; a decode
        step's batch too: ``KVCacheManager.rehearse_columns``); then its answer is packed
        again.

        Why: the spin keeps the core, not what the step path left in its caches and branch
        predictors, which other work takes over milliseconds (measured on the development
        VM: a step run again 5 ms later costs 57% more than back to back, 1 ms later 18%,
        50 us later nothing). Rehearsing every ``FramePoll.IDLE_EVERY_NS`` keeps the frame's
        way in and out warm at no cost the spin does not already pay. The step itself does
        not run: it changes state; its plan, which does not, does (measured in process on
        the VM, a 256-request decode step with its mapping after 5 ms of spinning: p50
        34.9-35.8 -> 32.1-32.9 us, p90 51-56 -> 40-42 with ``rehearse_columns`` every 100
        us of the spin).

        A ring's frame that comes meanwhile waits for one piece of the rehearsal at most:
        the rings are looked at between the pieces, and a frame there ends it (a
        rehearsal is ~15 us in all, one every 100 us: without the looks one frame in six
        waited for it, ~8 us on average). Only small frames are rehearsed
        (``REHEARSAL_BYTES``).

        A rehearsal that fails (the frame no longer fits the service: a model registered
        since, say) is dropped with a debug log, never raised into the spin: the next frame
        answered is the next rehearsal."""
        if self._rehearsal is None:
            return
        frame, answer = self._rehearsal
        manager = self.state.manager
        try:
            again = self._again
            if again is not None and again.fits(frame):
                new, ahead, _, _ = again.call
                manager.rehearse_decode(np.frombuffer(again.handles(frame), np.int64), new, ahead)
            else:
                message = unpack(frame)
                if message.get("op") == "step_columns":
                    columns = columns_from_wire(message.get("args", {}))
                    if self._ring_waiting():
                        return
                    manager.rehearse_columns(columns)
            if not self._ring_waiting():
                _body(answer, False)
        except Exception:  # rehearsing is optional; the spin and the frames go on
            self._rehearsal = None
            log.debug("busy poll: the last frame no longer rehearses", exc_info=True)

    def _ring_frame(self) -> bool:
        """Whether a ring holds a frame to serve, watched for ``RING_WATCH_NS`` (the spin's
        look at the rings between its polls of the sockets)."""
        return watch(self._watched(), RING_WATCH_NS)

    def _ring_waiting(self) -> bool:
        """Whether a ring holds a frame to serve now (one look)."""
        return bool(self.ringed) and watch(self._watched(), 0)

    def _watched(self) -> list[ServiceRing]:
        return [ring for conn in self.ringed if (ring := conn.watched_ring()) is not None]

    def _serve_rings(self) -> bool:
        """Serve each ring's waiting frame, in the spin (each answer spins again); whether
        there was one."""
        served = False
        for conn in list(self.ringed):
            if conn.ring_pending():
                conn.serve_ring()
                served = True
        return served

    def _rings_asleep(self) -> None:
        """The spin ended: tell the rings' clients to ring the doorbell from now on, then
        serve a frame that came as the spin ended (it may have seen the service awake)."""
        self._rings_awake_until(0)
        self._serve_rings()  # each answer spins again

    def _rings_awake_until(self, ns: int) -> None:
        for conn in self.ringed:
            conn.ring_awake(ns)

    def error_frame(self, label: str, exc: KVCMError) -> dict[str, Any]:
        """The answer of a frame that failed; ``label``: its op, or ``invalid``."""
        metrics = self.state.metrics
        metrics.child(metrics.step_channel_frames, label, exc.code).inc()
        return {"error": exc.to_dict(), "status": exc.status, "generation": self.state.generation}

    # -- the ops -------------------------------------------------------------------------------

    def _step(self, args: dict[str, Any], session: str | None) -> list[dict[str, Any]]:
        parsed = plain_step(args)
        if parsed is None:
            try:
                req = StepRequest.model_validate(args)
            except ValidationError as exc:
                raise _invalid(exc) from None
            parsed = [op.model_dump() for op in req.ops], req.atomic, req.brief
        return self.state.step_results(parsed, session)

    def _step_columns(self, args: dict[str, Any], session: str | None) -> dict[str, Any]:
        handles = args.get("extend")
        new, ahead, flags = decode_args(args)
        if (
            type(handles) is bytes
            and not len(handles) % 8
            and type(new) is int
            and type(ahead) is int
            and type(flags[0]) is bool
            and type(flags[1]) is bool
            and type(flags[2]) is bool
            and args.keys() <= _DECODE_ARGS
        ):
            # A decode step's frame (what the client's DecodeFrames sends): its own path,
            # which runs the general one for what it does not (KVCacheManager.decode_step).
            # Anything else, a malformed frame too, takes the general path, whose checks
            # name what is wrong.
            rows = np.frombuffer(handles, np.int64)
            self._decoded = True
            return self.state.decode_step(rows, new, ahead, flags, session, self.due).to_wire()
        return self.state.step_columns(columns_from_wire(args), session, self.due).to_wire()

    @staticmethod
    def _model(
        model: type[BaseModel], call: Callable[[Any, str | None], Any]
    ) -> Callable[[Any, str | None], Any]:
        def run(args: dict[str, Any], session: str | None) -> Any:
            try:
                parsed = model.model_validate(args)
            except ValidationError as exc:
                raise _invalid(exc) from None
            result = call(parsed, session)
            return result.model_dump(mode="json") if isinstance(result, BaseModel) else result

        return run

    def _slot_mapping(self, r: SlotMappingRequest, _: str | None) -> dict[str, Any]:
        if r.layer_id is None:
            raise InvalidArgument("slot_mapping needs a layer_id (slot_mappings maps every group)")
        manager = self.state.manager
        return _table(manager.slot_mapping(r.request_ids, r.layer_id, r.num_tokens, r.pad_to))

    def _slot_mappings(self, r: SlotMappingRequest, _: str | None) -> dict[str, Any]:
        return _table(self.state.manager.slot_mappings(r.request_ids, r.num_tokens, r.pad_to))

    def _probe(self, r: ProbeRequest, _: str | None) -> int:
        return self.state.manager.probe(
            r.token_ids, r.lora_id, r.cache_salt, r.multimodal, r.block_keys
        )


class _Connection(asyncio.Protocol):
    """One client's connection: frames parsed from the bytes as they arrive and answered at
    once, in order, on the event loop (a protocol, not streams: a stream read under
    ``asyncio.timeout`` costs ~65 us a frame in timer bookkeeping, more than the step).

    A timer runs only while a frame is incomplete (``read_timeout``: the rest must arrive in
    time, or the connection closes and nothing of that frame runs); an idle connection has
    none. While the client does not read its answers (the transport's write buffer is full),
    its frames are not read either.
    """

    def __init__(self, channel: StepChannel) -> None:
        self.channel = channel
        self.buffer = bytearray()
        self.transport: Any = None  # asyncio's or uvloop's transport
        self.timer: asyncio.TimerHandle | None = None
        self.paused = False
        self.closing = False
        self.fd: int | None = None  # registered with the channel's poll
        #: The shared-memory ring (``step_ring``), once the client asked for one.
        self.ring: ServiceRing | None = None
        poll = channel.poll
        #: The adaptive poll's record (none in busy-poll mode, which polls after every
        #: answer).
        self.gaps = (
            GapPredictor(poll.window_ns) if poll is not None and not channel.spin_ns else None
        )

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport
        self.channel.connections.add(self)
        self.channel.state.metrics.step_channel_connections.inc()
        poll = self.channel.poll
        sock = None if poll is None else transport.get_extra_info("socket")
        if sock is not None:
            assert poll is not None
            self.fd = sock.fileno()
            poll.add(self.fd)

    def connection_lost(self, exc: Exception | None) -> None:
        self.channel.connections.discard(self)
        self._stop_timer()
        self._unpoll()
        self._drop_ring()
        self.closing = True

    def close(self) -> None:
        self.closing = True
        self._stop_timer()
        self._unpoll()  # before the transport closes the descriptor, which may be reused
        self._drop_ring()
        if self.transport is not None:
            self.transport.close()

    # -- the ring --------------------------------------------------------------------------------

    def attach(self, ring: ServiceRing) -> None:
        """This connection's ring (``StepChannel._offer_ring``); its fd goes with the answer."""
        self.ring = ring

    def watched_ring(self) -> ServiceRing | None:
        """The ring the spin watches for this connection's frames: none while it closes."""
        return None if self.closing else self.ring

    def ring_pending(self) -> bool:
        ring = self.watched_ring()
        return ring is not None and ring.pending()

    def ring_awake(self, until_ns: int) -> None:
        if self.ring is not None:
            self.ring.awake_until(until_ns)

    def serve_ring(self) -> None:
        """Answer the frame waiting in the ring, as ``_frames`` answers one from the socket
        (an answer over the ring's area goes over the socket), then spin again."""
        ring, channel = self.ring, self.channel
        assert ring is not None
        limit = min(ring.slot, channel.limit())
        taken = ring.take(limit)
        if type(taken) is int:
            err = PayloadTooLarge(f"frame over the {limit}-byte limit", limit=limit, size=taken)
            answer, close = channel.error_frame("invalid", err), True
        else:
            answer, close, _ = channel.answer_first(taken, self)
        try:
            body = _body(answer, close)
            if not ring.reply(body):
                assert self.transport is not None
                self.transport.write(HEADER.pack(len(body)) + body)
                ring.replied_on_socket()
            if type(taken) is bytes and not close:
                channel.remember(taken, answer, len(body))
        except Exception:  # (a bug) the client must not wait out its timeout for nothing
            log.exception("step ring answer failed; connection closed")
            close = True
        finally:
            channel.settle()
        if close:
            self.close()
        elif channel.spin_ns:
            channel.spin()

    def _drop_ring(self) -> None:
        if self.ring is not None:
            self.channel.ringed.discard(self)
            self.ring.close()
            self.ring = None

    def _send_ring(self, answer: dict[str, Any], close: bool) -> None:
        """The ``ring`` op's answer, with the ring's fd beside its first bytes (``SCM_RIGHTS``),
        on the connection's socket itself (asyncio's transports send no fds; nothing of this
        connection is unsent: ``_offer_ring`` checked)."""
        assert self.ring is not None and self.transport is not None
        body = _body(answer, close)
        frame = HEADER.pack(len(body)) + body
        fd = self.ring.give_fd()
        try:
            raw = self.transport.get_extra_info("socket").fileno()
            with socket.socket(fileno=os.dup(raw)) as sock:
                sent = socket.send_fds(sock, [frame], [fd])
        except OSError:
            log.warning("could not send a step ring to its client; connection closed")
            self.close()
            return
        finally:
            os.close(fd)
        if sent < len(frame):
            self.transport.write(frame[sent:])
        if close:
            self.close()

    def _unpoll(self) -> None:
        if self.fd is not None:
            assert self.channel.poll is not None
            self.channel.poll.remove(self.fd)
            self.fd = None

    def pause_writing(self) -> None:
        self.paused = True
        if self.transport is not None:
            self.transport.pause_reading()

    def resume_writing(self) -> None:
        self.paused = False
        if self.transport is not None and not self.closing:
            self.transport.resume_reading()
            self._frames()

    def data_received(self, data: bytes) -> None:
        if not self.buffer and self.gaps is not None:
            self.gaps.frame_began()
        self.buffer += data
        if not self.paused:
            self._frames()

    def _frames(self) -> None:
        """Answer every whole frame in the buffer; time the incomplete one, if any."""
        buffer = self.buffer
        channel = self.channel
        poll: str | None = None  # after the last answer or doorbell: its poll's key
        news = False  # an answer or a doorbell: what a busy poll follows
        while not self.closing and not self.paused and len(buffer) >= HEADER.size:
            (size,) = HEADER.unpack_from(buffer)
            limit = channel.limit()
            if size > limit:
                err = PayloadTooLarge(f"frame over the {limit}-byte limit", limit=limit, size=size)
                self._send(channel.error_frame("invalid", err), close=True)
                return
            end = HEADER.size + size
            if not size:  # the doorbell: no answer; the client's frame follows
                del buffer[:end]
                channel.rang()
                if self.ring_pending():  # it is in the ring already
                    self.serve_ring()
                poll = None if self.gaps is None else self.gaps.rang()
                news = True
                continue
            if len(buffer) < end:
                break
            body = bytes(buffer[HEADER.size : end])
            del buffer[:end]
            self._stop_timer()  # the next frame, if begun, gets a timer of its own
            answer, close, op = channel.answer_first(body, self)
            try:
                if op == RING_OP and self.ring is not None and "result" in answer:
                    self._send_ring(answer, close)
                elif not close:
                    channel.remember(body, answer, self._send(answer, close))
                else:
                    self._send(answer, close)
            finally:
                channel.settle()
            poll = None if self.gaps is None else self.gaps.answered(op)
            news = True
        if self.closing or self.paused:
            # Paused, the buffer may hold whole frames that wait for the client to read:
            # no timer then; resuming looks again.
            self._stop_timer()
        elif buffer:
            if self.timer is None:
                loop = asyncio.get_running_loop()
                self.timer = loop.call_later(channel.read_timeout, self._too_slow)
        else:
            self._stop_timer()
            if channel.spin_ns:
                if news and not self.closing:
                    channel.spin()
            elif poll is not None and _nothing_unsent(channel.connections):
                assert self.gaps is not None
                self.gaps.poll_ended(poll, channel.wait_for_frame(poll))

    def _too_slow(self) -> None:
        """A frame did not arrive whole in time: drop it and the connection."""
        self.timer = None
        self.close()

    def _stop_timer(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None

    def _send(self, answer: dict[str, Any], close: bool) -> int:
        """Write ``answer`` (then close, if ``close``); its body's length."""
        body = _body(answer, close)
        assert self.transport is not None
        self.transport.write(HEADER.pack(len(body)) + body)
        if close:
            self.close()
        return len(body)


def _body(answer: dict[str, Any], close: bool) -> bytes:
    """An answer's msgpack body, saying ``close`` when the connection closes after it."""
    if close:
        answer["close"] = True
    return msgpack.packb(answer, default=str)


def _cpus() -> int:
    """CPUs this process may run on: the poll after an answer needs a second one, for the
    client to send its frame while the service polls (``step_poll``)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def _nothing_unsent(connections: set[_Connection]) -> bool:
    """Whether a poll would hold back nothing the event loop must do for the connections:
    no answer partly unsent (only the loop sends the rest, and its client sends nothing
    before it has the whole answer: the poll would run out and delay the answer by the
    window), and no connection paused by back-pressure (its unread frames would end every
    poll at once)."""
    return not any(c.paused or c.transport.get_write_buffer_size() for c in connections)


def _invalid(exc: ValidationError) -> KVCMError:
    return invalid_from_validation(exc.errors())

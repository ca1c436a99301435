"""The step channel: the per-step calls over a Unix socket, msgpack frames (docs/step-channel.md).

HTTP/JSON costs a few milliseconds per 256-request step, mostly in HTTP framing and in JSON;
a scheduler step is the one call that runs every few milliseconds, so it gets a channel of its
own beside the HTTP API: one persistent connection, a 4-byte little-endian length prefix and a
msgpack map each way, answers in request order. Everything else stays on HTTP.

This module is the wire format (shared with the service, which imports it) and the blocking
connection the sync client uses. It needs msgpack and pydantic only (never torch): slot
mappings come back as raw int64 bytes and are turned into lists with ``memoryview.cast``.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import struct
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import msgpack
from pydantic import TypeAdapter

from ._calls import _default, prompt_body
from .columns import StepColumnsResult
from .errors import (
    InvalidArgument,
    KVCMError,
    MalformedRequest,
    ServiceUnavailable,
    error_from_dict,
)
from .models import OpResult, RequestInfo
from .step_ring import RING_OP, ClientRing, supported

T = TypeVar("T")

#: The length prefix of every frame: the msgpack body's size in bytes, unsigned little-endian.
HEADER = struct.Struct("<I")
#: The doorbell: a frame of length zero, which the service does not answer. A client rings
#: it as a call begins after an idle spell, so that the service wakes while the client builds
#: its frame (docs/step-channel.md, "The doorbell").
DOORBELL = HEADER.pack(0)
#: A call rings the doorbell first when its connection has been idle (no call in flight)
#: longer than this (seconds): the service's own poll after an answer (``--step-poll-us``,
#: 300 us by default) has run out by then, and it sleeps.
WAKE_AFTER_S = 0.0003

#: Ops a step channel serves, and whether each one needs the API token (as its HTTP route).
OPS: dict[str, bool] = {
    "step": True,
    "step_columns": True,
    "allocate": True,
    "extend": True,
    "extend_many": True,
    "rewind": True,
    "commit": True,
    "free": True,
    "suspend": True,
    "resume": True,
    "slot_mapping": False,
    "slot_mappings": False,
    "probe": False,
}


def pack(message: dict[str, Any], packer: msgpack.Packer | None = None) -> bytes:
    """One frame: the length prefix, then ``message`` as msgpack. numpy integers and arrays
    and pydantic models are sent as plain values (as the HTTP client's JSON does).
    ``packer``: a connection's own (``new_packer()``), which saves making one per frame."""
    try:
        body = (packer or new_packer()).pack(message)
    except (TypeError, OverflowError, ValueError) as exc:
        raise InvalidArgument(f"cannot send this call over the step channel: {exc}") from None
    return HEADER.pack(len(body)) + body


def new_packer() -> msgpack.Packer:
    """A packer for ``pack``, for one connection (a packer is not safe to share between
    threads; it empties itself after a failed pack)."""
    return msgpack.Packer(default=_default)


def header(session: str | None, generation: str | None, token: str | None) -> dict[str, str]:
    """A request frame's ``session``, ``generation`` and ``token`` keys: those given."""
    out = {}
    if session is not None:
        out["session"] = session
    if generation is not None:
        out["generation"] = generation
    if token is not None:
        out["token"] = token
    return out


def bin_header(n: int) -> bytes:
    """msgpack's header of a ``bin`` of ``n`` bytes (the smallest that holds it): 0xc4 and
    one length byte below 256, 0xc5 and two big-endian bytes below 65536, else 0xc6 and
    four. Example: ``bin_header(16) == b"\\xc4\\x10"``, ``bin_header(2048) ==
    b"\\xc5\\x08\\x00"``."""
    if n < 0x100:
        return bytes((0xC4, n))
    if n < 0x10000:
        return b"\xc5" + n.to_bytes(2, "big")
    return b"\xc6" + n.to_bytes(4, "big")


#: A decode step's flags, in ``DecodeFrames.frame``'s key.
_DECODE_FLAGS = ("map_slots", "table_edits", "stream_ordered")


class DecodeFrames:
    """Frames of decode steps (``step_columns`` with extends alone) from cached msgpack
    pieces. An engine sends one every forward pass with the same arguments but its handles,
    and at an engine's cadence each line of Python runs cold: on the development VM, 5 ms
    after the last call, building the args map, the call and the packing took ~13 us of the
    client's 19 us before its frame went out (3.9 back to back). Here the pieces around the
    handles are packed once per set of arguments (and session, generation and token) and a
    frame is one join; it equals msgpack's packing of the same map
    (tests/test_step_channel_frames.py).

    Example: 2 handles (16 bytes), ``num_new_tokens=1``, ``lookahead=0``, session "s": the
    frame is the length prefix, then the map header (3 entries), "op", "step_columns",
    "args", the args map's header (3 entries), "extend", 0xc4 0x10 (msgpack's bin 8 of 16
    bytes), the handles' bytes, then "num_new_tokens" 1, "lookahead" 0 and "session" "s".
    """

    def __init__(self, packer: msgpack.Packer) -> None:
        self._packer = packer
        self._key: tuple[Any, ...] | None = None
        self._prefix = self._suffix = b""
        #: The last frame and its handles (an engine's decode steps repeat their requests).
        self._handles: bytes | None = None
        self._frame = b""

    def frame(self, handles: bytes, key: tuple[Any, ...]) -> bytes:
        """The whole frame (length prefix included) of a decode step: ``{"op":
        "step_columns", "args": {"extend": handles, "num_new_tokens": n, "lookahead": a,
        and "map_slots", "table_edits", "stream_ordered" where True}, **header(session,
        generation, token)}``, with ``key`` = ``(n, a, map_slots, table_edits,
        stream_ordered, session, generation, token)``: exact ints and bools (the key is
        compared with ``==``, where ``True == 1``: the caller checks the types), and str or
        None."""
        if key != self._key:
            self._prefix, self._suffix = self._pieces(key)  # both, or neither on an error
            self._key = key
            self._handles = None
        elif handles == self._handles:  # the last step's requests again: the same frame
            return self._frame
        n = len(handles)
        kind = bin_header(n)
        size = len(self._prefix) + len(kind) + n + len(self._suffix)
        frame = b"".join((HEADER.pack(size), self._prefix, kind, handles, self._suffix))
        self._handles, self._frame = handles, frame
        return frame

    def _pieces(self, key: tuple[Any, ...]) -> tuple[bytes, bytes]:
        """The frame's bytes before the handles' and after them, for ``key``;
        ``InvalidArgument`` for what msgpack cannot pack (a count past 64 bits, a string
        that is not UTF-8), as ``pack`` says it."""
        new, ahead, *flags = key[:5]
        args = [("num_new_tokens", new), ("lookahead", ahead)]
        args += [(name, True) for name, on in zip(_DECODE_FLAGS, flags, strict=True) if on]
        head = header(*key[5:])
        p = self._packer
        try:
            prefix = b"".join(
                (
                    p.pack_map_header(2 + len(head)),
                    p.pack("op"),
                    p.pack("step_columns"),
                    p.pack("args"),
                    p.pack_map_header(1 + len(args)),
                    p.pack("extend"),
                )
            )
            suffix = b"".join(p.pack(k) + p.pack(v) for k, v in (*args, *head.items()))
        except (TypeError, OverflowError, ValueError) as exc:
            raise InvalidArgument(f"cannot send this call over the step channel: {exc}") from None
        return prefix, suffix


def unpack(body: bytes) -> Any:
    """A frame's body (msgpack: maps with str keys, arrays as lists, str as str)."""
    return msgpack.unpackb(body, raw=False, strict_map_key=True)


def int64_table(data: bytes, shape: Sequence[int]) -> list[Any]:
    """Raw little-endian int64 bytes of ``shape`` as (nested) lists of ints, without numpy."""
    view = memoryview(data)
    if sys.byteorder != "little":  # pragma: no cover - no big-endian hosts in CI
        import array

        swapped = array.array("q", data)
        swapped.byteswap()
        view = memoryview(swapped.tobytes())
    return view.cast("q", list(shape)).tolist() if all(shape) else _empty(shape)


def _empty(shape: Sequence[int]) -> list[Any]:
    """A table with a zero dimension (``memoryview.cast`` refuses those)."""
    if len(shape) == 1 or shape[0] == 0:
        return []
    return [_empty(shape[1:]) for _ in range(shape[0])]


# -- the calls, sans-IO: op name, arguments, retry rule, how to read the result -----------------


@dataclass(frozen=True, slots=True)
class StepCall(Generic[T]):
    op: str
    args: dict[str, Any]
    parse: Callable[[Any], T]
    idempotent: bool = False
    """Safe to resend after the request was sent and the answer did not come."""


_RESULTS: TypeAdapter[list[OpResult]] = TypeAdapter(list[OpResult])


def _none(_: Any) -> None:
    return None


def _info(result: Any) -> RequestInfo:
    return RequestInfo.model_validate(result)


def _matrix(result: Any) -> Any:
    return int64_table(result["data"], result["shape"])


def step(ops: Sequence[Any], atomic: bool, brief: bool) -> StepCall[list[OpResult]]:
    return StepCall(
        "step", {"ops": list(ops), "atomic": atomic, "brief": brief}, _RESULTS.validate_python
    )


def step_columns(args: dict[str, Any]) -> StepCall[StepColumnsResult]:
    return StepCall("step_columns", args, StepColumnsResult)


#: A decode step's call, whose frame ``DecodeFrames`` packs (its ``args`` are in the frame).
DECODE = StepCall("step_columns", {}, StepColumnsResult)


def extend_many(request_ids: Sequence[str], num_new_tokens: Any, lookahead: Any) -> StepCall[None]:
    args = {
        "request_ids": list(request_ids),
        "num_new_tokens": num_new_tokens,
        "lookahead": lookahead,
    }
    return StepCall("extend_many", args, _none)


def slot_mapping(
    request_ids: Sequence[str], layer_id: int | None, num_tokens: Any, pad_to: int | None
) -> StepCall[Any]:
    args = {"request_ids": list(request_ids), "num_tokens": num_tokens, "pad_to": pad_to}
    if layer_id is None:
        return StepCall("slot_mappings", args, _matrix, idempotent=True)
    return StepCall("slot_mapping", args | {"layer_id": layer_id}, _matrix, idempotent=True)


def probe(
    token_ids: Any, lora_id: Any, cache_salt: Any, multimodal: Any, block_keys: Any
) -> StepCall[int]:
    args = {"token_ids": list(token_ids)} | prompt_body(
        None, lora_id, cache_salt, multimodal, block_keys
    )
    return StepCall("probe", args, int, idempotent=True)


def allocate(
    request_id: str,
    num_tokens: int,
    token_ids: Any,
    lookahead: int,
    lora_id: Any,
    cache_salt: Any,
    multimodal: Any,
    block_keys: Any,
    max_new_tokens: int | None = None,
) -> StepCall[RequestInfo]:
    # Idempotent as over HTTP: the manager returns the first result for an identical allocate.
    args = {"request_id": request_id, "num_tokens": num_tokens, "lookahead": lookahead}
    args |= prompt_body(token_ids, lora_id, cache_salt, multimodal, block_keys)
    if max_new_tokens is not None:
        args["max_new_tokens"] = max_new_tokens
    return StepCall("allocate", args, _info, idempotent=True)


def extend(request_id: str, num_new_tokens: int, lookahead: int) -> StepCall[RequestInfo]:
    args = {"request_id": request_id, "num_new_tokens": num_new_tokens, "lookahead": lookahead}
    return StepCall("extend", args, _info)


def rewind(request_id: str, num_tokens: int) -> StepCall[RequestInfo]:
    return StepCall("rewind", {"request_id": request_id, "num_tokens": num_tokens}, _info)


def commit(request_id: str, token_ids: Sequence[int]) -> StepCall[RequestInfo]:
    return StepCall("commit", {"request_id": request_id, "token_ids": list(token_ids)}, _info)


def suspend(request_id: str) -> StepCall[RequestInfo]:
    return StepCall("suspend", {"request_id": request_id}, _info)


def resume(request_id: str) -> StepCall[RequestInfo]:
    return StepCall("resume", {"request_id": request_id}, _info)


def free(request_id: str) -> StepCall[None]:
    return StepCall("free", {"request_id": request_id}, _none)


# -- the blocking connection ---------------------------------------------------------------------


class _Broken(Exception):
    """The connection failed; ``sent``: whether the whole request had gone out."""

    def __init__(self, cause: BaseException, sent: bool) -> None:
        super().__init__(str(cause))
        self.cause = cause
        self.sent = sent


#: How long a call polls for its answer before it sleeps in the kernel (seconds).
SPIN_S = 0.002
#: Looks at a ring's answer for each yield of the core while a call polls for it, after the
#: first ``RING_SPIN_NS`` (without a yield: a decode step's answer usually comes within them).
_RING_LOOKS = 16
RING_SPIN_NS = 200_000
#: Bytes asked for by an answer's first read: room for a decode step's whole answer.
_READ = 1 << 16


class _Doorbell:
    """When a socket's call rings the doorbell first: after an idle spell of its connection
    longer than ``wake_after_ns`` (None: never). ``_idle_since`` is when the connection
    last had news for the service: an answer read, or a doorbell rung (the service is awake
    from then); None while a call is in flight and without a connection: nothing to ring
    for then. ``_rang``: a doorbell went out since the last answer was read.

    Example (300 us): answers at t = 0 and calls at t = 0.1 ms (no ring: the service is
    still polling for it) and at t = 5 ms (ring, then build and send the frame; a call
    that fails before its frame leaves the next one to ring again after 300 us).

    A service older than the doorbell answers one ``malformed_request`` and closes (the
    frame after it never runs). The first answer after a ring that says so turns the
    doorbell off for this socket, and the call is sent again, without a ring; if that too is
    refused, the frame was at fault, not the doorbell, which is turned back on (``_judged``).
    That answer can be lost with the connection (asyncio drops what it read once a write
    fails; a service gone between the ring and the frame looks the same): a connection the
    peer closed before the frame went out, right after a ring, has the call sent again at
    once, and two such in a row, with no rung call answered between, turn the doorbell off
    (``_lost``; a restart of the service makes one).
    """

    wake_after_ns: int | None
    _wake_setting: int | None  # what the socket was made with
    _idle_since: int | None
    _rang: bool
    _strikes: int  # connections lost right after a ring, in a row
    _checking: bool  # the doorbell was turned off at a refusal: the next answer confirms
    _awake_ns: int  # the service busy-polls this long after its last answer (its ``spin``)

    def __init__(self, wake_after_s: float | None) -> None:
        self.wake_after_ns = None if wake_after_s is None else int(wake_after_s * 1e9)
        self._wake_setting = self.wake_after_ns
        self._idle_since = None
        self._rang = False
        self._strikes = 0
        self._checking = False
        self._awake_ns = 0

    def _ring_due(self) -> bool:
        """Whether this call rings: the connection idle longer than ``wake_after_ns``, and
        not within a busy-polling service's spin (its answers say how long it polls after
        each: ``spin``; docs/step-channel.md, "Busy-poll mode"), where a ring only costs."""
        since = self._idle_since
        if since is None or self.wake_after_ns is None:
            return False
        now = time.perf_counter_ns()
        if now - since <= self.wake_after_ns or now - since < self._awake_ns:
            return False
        self._idle_since = now
        self._rang = True
        return True

    def _judged(self, answer: dict[str, Any]) -> bool:
        """Whether to send the call again: ``answer`` refused the doorbell that went out
        before it (an older service; the call never ran). Clears ``_rang``; notes how long
        the service busy-polls after its answers (``spin``, seconds; 0 when it says none:
        nine tenths of it, the service's spin having begun before the answer was read)."""
        spin = answer.get("spin")
        self._awake_ns = int(spin * 0.9e9) if type(spin) is float else 0
        rang, self._rang = self._rang, False
        error = answer.get("error")
        refusal = (
            bool(answer.get("close"))
            and type(error) is dict
            and error.get("code") == MalformedRequest.code
        )
        if self._checking:  # the answer to the call sent again, without a ring
            self._checking = False
            if refusal:  # refused without a doorbell too: the frame's fault
                self.wake_after_ns = self._wake_setting
            return False
        if rang and refusal:
            self.wake_after_ns = None
            self._checking = True
            return True
        if rang:
            self._strikes = 0
        return False

    def _lost(self, exc: _Broken) -> bool:
        """Whether to send the call again at once: its connection was closed by the peer
        before the frame went out, right after a ring (the refusal of an older service,
        lost). Clears ``_rang`` (and ``_checking``: the check it was is void)."""
        rang, self._rang = self._rang, False
        self._checking = False
        if not rang or exc.sent or not isinstance(exc.cause, ConnectionError):
            return False
        self._strikes += 1
        if self._strikes >= 2:
            self.wake_after_ns = None
        return True

    def _interrupted(self) -> None:
        """A call was cancelled or interrupted: what it rang and checked is void."""
        self._rang = False
        self._checking = False

    def wake(self) -> None:
        """Ring the doorbell if the connection has been idle longer than ``wake_after_s``:
        the service, asleep by then, wakes and polls for the frame this call is about to
        build and send, instead of being woken by it (docs/step-channel.md, "The doorbell")."""
        raise NotImplementedError


class StepSocket(_Doorbell):
    """One blocking connection to a step channel, opened on first use and again after it
    broke. A call that broke before its request was fully sent never ran (the service runs
    only whole frames) and is resent; one that broke later is resent only if idempotent
    (``step``, ``extend`` and the like are not: the service may have applied them).

    Waiting for an answer, the call first polls the socket without blocking for up to
    ``spin_s`` (2 ms by default), yielding its core between looks (the service may need it),
    then sleeps in the kernel: a sleeping reader must be woken
    by the service's write, and a wake-up across cores costs tens of microseconds on virtual
    machines (measured: 83 us a round trip sleeping, 47 us polling; docs/step-channel.md).
    It spins only while its own call is in flight, never when idle; ``spin_s=0`` turns it
    off. The timeout is the socket's (``SO_RCVTIMEO``/``SO_SNDTIMEO``), not Python's timeout
    mode, which would poll before every read.

    A call that begins after the connection was idle longer than ``wake_after_s`` rings the
    doorbell first (``wake``); None turns that off.

    ``ring=True``: each connection asks for a shared-memory ring (``step_ring``) as it opens
    (with ``token``, where the service has one) and, where the service offers one, sends its
    frames through it (a frame larger than the
    ring's area still goes over the socket); where it refuses (``ring_unavailable``, or an
    older service), the socket serves, as without.
    """

    def __init__(
        self,
        path: str,
        timeout: float,
        retries: int,
        backoff_s: float,
        spin_s: float = SPIN_S,
        wake_after_s: float | None = WAKE_AFTER_S,
        ring: bool = False,
        token: str | None = None,
    ) -> None:
        self.path = path
        self.token = token  # for the ring op (each call's frame carries its own)
        self.timeout = timeout
        self.retries = retries
        self.backoff_s = backoff_s
        self.spin_ns = int(spin_s * 1e9)
        super().__init__(wake_after_s)
        self._sock: socket.socket | None = None
        self._packer = new_packer()
        #: A decode step's frames (``DecodeFrames``), from this connection's packer.
        self.decode_frames = DecodeFrames(self._packer)
        self.want_ring = ring and supported()
        #: This connection's ring, if the service gave one.
        self.ring: ClientRing | None = None
        #: A call through the ring not answered this long rings the doorbell (once), in case
        #: the service fell asleep as the frame went in.
        self.ring_again_ns = 1_000_000
        #: Why the service refused the last ring asked for (its error code), if it did.
        self.ring_refusal: str | None = None
        #: The last answer read from the ring that may be read again, and its body: a
        #: decode step's answer without its slot mapping is the same bytes until a request
        #: crosses a block boundary, and is not unpacked again.
        self._ring_body: bytes | None = None
        self._ring_answer: dict[str, Any] = {}

    def close(self) -> None:
        self._idle_since = None
        ring, self.ring = self.ring, None
        sock, self._sock = self._sock, None
        try:
            if ring is not None:
                ring.close()
        finally:
            if sock is not None:
                sock.close()

    def wake(self) -> None:
        """``_Doorbell.wake``: ``DOORBELL`` without blocking; one that cannot go out at
        once is skipped (a part that went out is completed: the stream stays framed), and
        the call that follows finds a broken connection as it would have without it."""
        sock = self._sock
        if sock is None or not self._ring_due():
            return
        try:
            sent = sock.send(DOORBELL, socket.MSG_DONTWAIT)
        except OSError:  # full (nothing went out), or broken: the call finds out
            self._rang = False
            return
        if sent < len(DOORBELL):
            try:
                sock.sendall(DOORBELL[sent:])
            except OSError:  # a part went out: the stream is no longer framed
                self.close()

    def call(self, call: StepCall[Any], header: dict[str, Any]) -> dict[str, Any]:
        """Send ``call`` (with ``header``: session, generation, token) and return the answer
        map; ``ServiceUnavailable`` when the retries run out or a resend would be unsafe."""
        return self.call_frame(
            call, pack({"op": call.op, "args": call.args, **header}, self._packer)
        )

    def call_frame(self, call: StepCall[Any], frame: bytes) -> dict[str, Any]:
        """``call`` as ``frame``, packed already (``DecodeFrames``); the rest as ``call``."""
        attempt = 0
        while True:
            try:
                answer = self._exchange(frame)
            except _Broken as exc:
                self.close()
                if self._lost(exc):
                    continue  # the frame never went out: at once, not an attempt
                _give_up(self.path, call, attempt, self.retries, exc)
            else:
                if not self._judged(answer):
                    return answer
                continue  # an older service closed on the doorbell: the call never ran
            time.sleep(self.backoff_s * 2**attempt)
            attempt += 1

    def _connect(self) -> socket.socket:
        if self._sock is None:
            self._rang = False  # (kept across a close: the answer that closed is judged)
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.settimeout(self.timeout)
            try:
                sock.connect(self.path)
            except OSError as exc:
                sock.close()
                raise _Broken(exc, sent=False) from None
            except BaseException:
                sock.close()
                raise
            # Blocking mode with the kernel's timeouts (see the class docstring); no timeout
            # (None) blocks, and at least 1 us is set (a zero timeval means no timeout).
            sock.settimeout(None)
            if self.timeout is not None:
                micros = max(int(self.timeout * 1e6), 1)
                limit = struct.pack("ll", micros // 1_000_000, micros % 1_000_000)
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, limit)
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, limit)
            self._sock = sock
            if self.want_ring:
                self._attach_ring(sock)
        return self._sock

    def _attach_ring(self, sock: socket.socket) -> None:
        """Ask for this connection's ring; its fd comes with the answer's first bytes. A
        refusal leaves the connection on the socket (``ring_refusal`` says why)."""
        try:
            sock.sendall(pack({"op": RING_OP} | header(None, None, self.token)))
            data, fds, _, _ = socket.recv_fds(sock, _READ, 1, socket.MSG_CMSG_CLOEXEC)
        except OSError as exc:
            raise _Broken(exc, sent=False) from None
        left = list(fds)  # closed below unless a ring took one
        try:
            if not data:
                raise ConnectionResetError("the step channel closed")
            if len(data) < HEADER.size:
                data += _recv_exactly(sock, HEADER.size - len(data))
            end = HEADER.size + HEADER.unpack_from(data)[0]
            if len(data) < end:
                data += _recv_exactly(sock, end - len(data))
            answer = unpack(memoryview(data)[HEADER.size : end])
            if type(answer) is not dict:
                raise ValueError("the step channel's answer is not a map")
            result = answer.get("result")
            if left and type(result) is dict and type(result.get("slot")) is int:
                self.ring = ClientRing(left.pop(0), result["slot"])  # it owns the fd now
                self.ring_refusal = None
                return
        except (OSError, ValueError, msgpack.UnpackException) as exc:
            raise _Broken(exc, sent=False) from None
        finally:
            for fd in left:
                os.close(fd)
        error = answer.get("error")
        self.ring_refusal = str(error.get("code")) if type(error) is dict else "no_ring"
        if answer.get("close"):  # a service that closes on what it cannot read
            raise _Broken(ConnectionResetError("the step channel refused the ring"), sent=False)

    def _exchange(self, frame: bytes) -> dict[str, Any]:
        sock = self._connect()
        self._idle_since = None
        try:
            return self._send_and_read(sock, frame)
        except _Broken:
            raise
        except BaseException:  # interrupted: its answer may still come, out of step
            self._interrupted()
            self.close()
            raise

    def _send_and_read(self, sock: socket.socket, frame: bytes) -> dict[str, Any]:
        ring = self.ring
        if ring is not None and len(frame) - HEADER.size <= ring.slot:
            try:
                answer = self._over_ring(ring, sock, frame)
            except OSError as exc:
                raise _Broken(exc, sent=True) from None
            if self._sock is not None:
                self._idle_since = time.perf_counter_ns()
            return answer
        try:
            sock.sendall(frame)
        except OSError as exc:
            # The service may have refused the frame (too large) and closed: its answer
            # is then already here. Otherwise nothing of this frame ran.
            answer = self._leftover(sock)
            if answer is None:
                raise _Broken(exc, sent=False) from None
            return answer
        try:
            answer = self._read(sock)
        except OSError as exc:
            raise _Broken(exc, sent=True) from None
        if self._sock is not None:  # still open: idle from now on
            self._idle_since = time.perf_counter_ns()
        return answer

    def _over_ring(self, ring: ClientRing, sock: socket.socket, frame: bytes) -> dict[str, Any]:
        """A call through the ring: the body in, the doorbell if the service says it sleeps,
        then the answer polled for (``spin_s``; yielding the core now and then after the
        first ``RING_SPIN_NS``), then looked for every
        50 us, the socket checked for a service gone, until the timeout. A call not answered
        in 1 ms rings once more, in case the service fell asleep just as the frame went in.
        The answer is read from the socket where the ring says it went there."""
        seq = ring.post(frame, HEADER.size)
        # A ring ``wake`` sent before the frame was built does not do: the service's spin
        # may have ended while it was built. Ring once after the post where the ring says
        # the service sleeps, else once if no answer comes in 1 ms.
        rang = not ring.awake()
        if rang:
            sock.sendall(DOORBELL)
        now = start = time.perf_counter_ns()
        spin_until = start + self.spin_ns
        yield_from = start + RING_SPIN_NS
        ring_again = start + self.ring_again_ns
        deadline = None if self.timeout is None else start + int(self.timeout * 1e9)
        looks = 0
        while not ring.answered(seq):
            looks += 1
            if not rang and now >= ring_again:
                sock.sendall(DOORBELL)
                rang = True
            if now < spin_until:
                # A load is cheap, a system call is not, and a yield may hand the core to
                # another process for a while: none in the first RING_SPIN_NS (the service
                # polls on a core of its own in busy-poll mode), then one every few looks.
                if now >= yield_from and not looks % _RING_LOOKS:
                    os.sched_yield()
            else:
                if _peer_closed(sock):
                    raise ConnectionResetError("the step channel closed the connection")
                if deadline is not None and now >= deadline:
                    raise TimeoutError("the step channel did not answer in time")
                time.sleep(0.00005)
            now = time.perf_counter_ns()
        if self._ring_body is not None and ring.answer_repeats(seq):
            # The body the area held, which the map kept is of: not read again.
            answer = self._ring_answer
        elif (body := ring.answer_body()) is None:
            answer = self._read(sock, spin=False)
        elif body == self._ring_body:  # the last answer again: its map again (read only)
            answer = self._ring_answer
        else:
            answer = unpack(body)
            result = answer.get("result")
            # Kept where a result hands out nothing of it uncopied: not errors nor pulls,
            # whose maps typed errors and models share. Another body in the area: the
            # map kept is not of it, so a repeat of it is read.
            keep = type(result) is dict and "errors" not in result and "pulls" not in result
            self._ring_body, self._ring_answer = (body, answer) if keep else (None, {})
        if answer.get("close"):
            self.close()
        return answer

    def _leftover(self, sock: socket.socket) -> dict[str, Any] | None:
        try:
            sock.settimeout(0.05)
            return self._read(sock, spin=False)
        except OSError:
            return None

    def _read(self, sock: socket.socket, spin: bool = True) -> dict[str, Any]:
        until_ns = time.perf_counter_ns() + self.spin_ns if spin and self.spin_ns else 0
        data = _first_bytes(sock, until_ns)
        if len(data) < HEADER.size:
            data += _recv_exactly(sock, HEADER.size - len(data))
        (size,) = HEADER.unpack_from(data)
        end = HEADER.size + size
        if len(data) > end:
            # One frame is in flight and each frame gets one answer: more is not an answer.
            raise ConnectionResetError("the step channel sent more than one answer")
        if len(data) < end:
            data += _recv_exactly(sock, end - len(data))
        answer = unpack(memoryview(data)[HEADER.size :])
        if answer.get("close"):  # the service closes after this answer
            self.close()
        return answer


def _give_up(path: str, call: StepCall[Any], attempt: int, retries: int, exc: _Broken) -> None:
    """Raise ``ServiceUnavailable`` unless ``call`` may be sent again after ``exc``."""
    if attempt == retries or (exc.sent and not call.idempotent):
        raise ServiceUnavailable(
            f"step channel {call.op} failed after {attempt + 1} attempt(s): "
            f"{type(exc.cause).__name__}: {exc.cause}",
            path=path,
            attempts=attempt + 1,
        ) from exc.cause


class AsyncStepSocket(_Doorbell):
    """``StepSocket`` on an asyncio stream, for ``AsyncKVCacheClient``: one connection, one
    call at a time on it (a lock keeps each request next to its answer)."""

    def __init__(
        self,
        path: str,
        timeout: float,
        retries: int,
        backoff_s: float,
        wake_after_s: float | None = WAKE_AFTER_S,
    ) -> None:
        self.path = path
        self.timeout = timeout
        self.retries = retries
        self.backoff_s = backoff_s
        super().__init__(wake_after_s)
        self._conn: tuple[asyncio.StreamReader, asyncio.StreamWriter] | None = None
        self._lock = asyncio.Lock()

    def wake(self) -> None:
        """``_Doorbell.wake``: written to the stream's buffer (whole, between frames: the
        connection has no call in flight), not awaited."""
        if self._conn is not None and self._ring_due():
            self._conn[1].write(DOORBELL)

    async def aclose(self) -> None:
        self._idle_since = None
        if self._conn is not None:
            writer = self._conn[1]
            self._conn = None
            writer.close()
            with contextlib.suppress(OSError):
                await writer.wait_closed()

    async def call(self, call: StepCall[Any], header: dict[str, Any]) -> dict[str, Any]:
        """As ``StepSocket.call``."""
        frame = pack({"op": call.op, "args": call.args, **header})
        async with self._lock:
            attempt = 0
            while True:
                try:
                    answer = await self._exchange(frame)
                except _Broken as exc:
                    await self.aclose()
                    if self._lost(exc):
                        continue  # as in StepSocket.call
                    _give_up(self.path, call, attempt, self.retries, exc)
                else:
                    if not self._judged(answer):
                        return answer
                    continue  # as in StepSocket.call
                await asyncio.sleep(self.backoff_s * 2**attempt)
                attempt += 1

    async def _exchange(self, frame: bytes) -> dict[str, Any]:
        if self._conn is None:
            self._rang = False  # as in StepSocket._connect
            try:
                # asyncio.timeout, not wait_for: 3.11's wait_for can swallow a caller's
                # cancel that lands as the connection opens, and the cancelled call then
                # ran on (tests/test_step_doorbell.py caught it under load).
                async with asyncio.timeout(self.timeout):
                    self._conn = await asyncio.open_unix_connection(self.path)
            except (OSError, TimeoutError) as exc:
                raise _Broken(exc, sent=False) from None
        reader, writer = self._conn
        self._idle_since = None
        try:
            return await self._send_and_read(reader, writer, frame)
        except _Broken:
            raise
        except BaseException:  # cancelled or interrupted: its answer may still come
            self._interrupted()
            self._conn = None
            self._idle_since = None
            writer.close()
            raise

    async def _send_and_read(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, frame: bytes
    ) -> dict[str, Any]:
        try:
            writer.write(frame)
            await writer.drain()
        except OSError as exc:
            try:  # as in StepSocket: the service's answer may be here (a refused frame)
                async with asyncio.timeout(0.05):
                    return await self._read(reader)
            except (OSError, EOFError, TimeoutError):
                raise _Broken(exc, sent=False) from None
        try:
            async with asyncio.timeout(self.timeout):
                answer = await self._read(reader)
        except (OSError, EOFError, TimeoutError) as exc:
            raise _Broken(exc, sent=True) from None
        if self._conn is not None:  # still open: idle from now on
            self._idle_since = time.perf_counter_ns()
        return answer

    async def _read(self, reader: asyncio.StreamReader) -> dict[str, Any]:
        (size,) = HEADER.unpack(await reader.readexactly(HEADER.size))
        answer = unpack(await reader.readexactly(size))
        if answer.get("close"):
            await self.aclose()
        return answer


def _first_bytes(sock: socket.socket, until_ns: int) -> bytes:
    """The answer's first bytes, usually all of it, in one read: polled for without blocking
    until ``until_ns``, then waited for in the kernel (``SO_RCVTIMEO``)."""
    while time.perf_counter_ns() < until_ns:
        try:
            chunk = sock.recv(_READ, socket.MSG_DONTWAIT)
            break
        except BlockingIOError:
            os.sched_yield()
    else:
        try:
            chunk = sock.recv(_READ)
        except BlockingIOError:  # SO_RCVTIMEO ran out
            raise TimeoutError("the step channel did not answer in time") from None
    if not chunk:
        raise ConnectionResetError("the step channel closed the connection")
    return chunk


def _peer_closed(sock: socket.socket) -> bool:
    """Whether the peer closed the connection (a ring's service gone), without blocking."""
    try:
        return sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
    except BlockingIOError:
        return False


def _recv_exactly(sock: socket.socket, n: int) -> bytes:
    chunks = []
    while n:
        try:
            chunk = sock.recv(min(n, 1 << 20))
        except BlockingIOError:  # SO_RCVTIMEO ran out
            raise TimeoutError("the step channel did not answer in time") from None
        if not chunk:
            raise ConnectionResetError("the step channel closed the connection")
        chunks.append(chunk)
        n -= len(chunk)
    return b"".join(chunks)


def result_of(call: StepCall[T], answer: dict[str, Any]) -> T:
    """The call's typed result, or the typed error the answer carries."""
    error = answer.get("error")
    if error is not None:
        raise error_from_dict(error, int(answer.get("status", 400)))
    if "result" not in answer:
        raise KVCMError(f"a step channel answer without result or error: {sorted(answer)}")
    return call.parse(answer["result"])

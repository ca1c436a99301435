"""The step channel's per-connection protocol (``_Connection``) with a fake transport: frame
cutting across chunks, the read timer (only while a frame is incomplete, fresh per frame, none
while paused) and back-pressure."""

from __future__ import annotations

import asyncio
from typing import Any

import msgpack
from helpers import ChannelState, FakeTransport

from kvcm.server.step_channel import _Connection
from kvcm_client.step_channel import DOORBELL, HEADER, pack


class FakeChannel:
    """Answers each frame with its ``args["i"]``."""

    read_timeout = 0.3
    state = ChannelState()
    poll = None  # no poll after answers (``step_poll``; tests/test_step_poll.py)
    spin_ns = 0  # no busy poll either

    def __init__(self) -> None:
        self.connections: set[Any] = set()
        self.rings = 0
        self.answered = self.settled = 0

    def rang(self) -> None:
        self.rings += 1

    def limit(self) -> int:
        return 1 << 20

    def remember(self, *_: Any) -> None:
        """No busy poll: nothing to rehearse (``StepChannel.rehearse``)."""

    def answer_first(self, body: bytes, conn: Any = None) -> tuple[dict[str, Any], bool, str]:
        assert self.settled == self.answered, "the last answer's accounts ran before this one"
        self.answered += 1
        return {"result": msgpack.unpackb(body)["args"]["i"]}, False, "x"

    def settle(self) -> None:
        self.settled += 1


def _answers(out: bytearray) -> list[Any]:
    found, i = [], 0
    while i + HEADER.size <= len(out):
        (n,) = HEADER.unpack_from(out, i)
        found.append(msgpack.unpackb(bytes(out[i + 4 : i + 4 + n]))["result"])
        i += 4 + n
    return found


def _frames(n: int) -> list[bytes]:
    return [pack({"op": "x", "args": {"i": i}}) for i in range(n)]


def test_frames_are_cut_the_same_in_one_chunk_or_byte_by_byte() -> None:
    async def run() -> None:
        blob = b"".join(_frames(5))
        for chunks in ([blob], [bytes([b]) for b in blob]):
            channel = FakeChannel()
            conn, tr = _Connection(channel), FakeTransport()  # type: ignore[arg-type]
            conn.connection_made(tr)  # type: ignore[arg-type]
            for chunk in chunks:
                conn.data_received(chunk)
            assert _answers(tr.out) == [0, 1, 2, 3, 4] and conn.timer is None
            assert channel.settled == 5  # each answer's accounts, after it

    asyncio.run(run())


def test_doorbells_are_cut_like_frames_and_not_answered() -> None:
    """Zero-length frames between, before and after frames, whole or byte by byte: each
    is counted and consumed, only the frames are answered, and no timer is left."""

    async def run() -> None:
        f = _frames(2)
        blob = DOORBELL + f[0] + DOORBELL * 2 + f[1] + DOORBELL
        for chunks in ([blob], [bytes([b]) for b in blob]):
            channel = FakeChannel()
            conn, tr = _Connection(channel), FakeTransport()  # type: ignore[arg-type]
            conn.connection_made(tr)  # type: ignore[arg-type]
            for chunk in chunks:
                conn.data_received(chunk)
            assert _answers(tr.out) == [0, 1] and channel.rings == 4
            assert conn.timer is None and not conn.buffer and not tr.closed

    asyncio.run(run())


def test_a_pipelining_client_is_not_cut_off_while_each_frame_arrives_in_time() -> None:
    """Each chunk ends one frame and begins the next: every frame is whole within 0.1 s, the
    read timeout is 0.3 s, so the connection must stay open (the timer restarts per frame)."""

    async def run() -> None:
        conn, tr = _Connection(FakeChannel()), FakeTransport()  # type: ignore[arg-type]
        conn.connection_made(tr)  # type: ignore[arg-type]
        frames = _frames(8)
        conn.data_received(frames[0][:5])
        for i in range(7):
            await asyncio.sleep(0.1)
            conn.data_received(frames[i][5:] + frames[i + 1][:5])
        assert not tr.closed and _answers(tr.out) == list(range(7))
        await asyncio.sleep(0.4)  # the last frame never completes: now it times out
        assert tr.closed

    asyncio.run(run())


def test_paused_with_whole_frames_waiting_runs_no_timer_and_resumes() -> None:
    async def run() -> None:
        conn, tr = _Connection(FakeChannel()), FakeTransport()  # type: ignore[arg-type]
        written = 0
        real_write = tr.write

        def write(data: bytes) -> None:
            nonlocal written
            real_write(data)
            written += 1
            if written == 2:
                conn.pause_writing()  # the client stopped reading

        tr.write = write  # type: ignore[method-assign]
        conn.connection_made(tr)  # type: ignore[arg-type]
        conn.data_received(b"".join(_frames(5)))
        assert _answers(tr.out) == [0, 1] and conn.timer is None
        await asyncio.sleep(0.4)
        assert not tr.closed
        conn.resume_writing()
        assert _answers(tr.out) == [0, 1, 2, 3, 4]

    asyncio.run(run())

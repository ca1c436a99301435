"""The step channel's poll after an answer on real event loops (uvloop, as ``kvcm serve``
runs, and asyncio's): the connections' file descriptors follow them however they end, and
no poll starts while an answer is still being written."""

from __future__ import annotations

import asyncio
import os
import socket
import struct
import threading
import time
from pathlib import Path
from typing import Any

import msgpack
import pytest
import uvloop
from helpers import ChannelState

from kvcm.server.step_channel import _Connection
from kvcm.server.step_poll import FramePoll
from kvcm_client.step_channel import HEADER, pack


class TrackingPoll(FramePoll):
    """A ``FramePoll`` that records its descriptors and any double add or remove."""

    def __init__(self, window_us: float) -> None:
        super().__init__(window_us)
        self.fds: set[int] = set()
        self.errors: list[str] = []

    def add(self, fd: int) -> None:
        if fd in self.fds:
            self.errors.append(f"fd {fd} registered twice")
        self.fds.add(fd)
        super().add(fd)

    def remove(self, fd: int) -> None:
        if fd not in self.fds:
            self.errors.append(f"fd {fd} unregistered twice")
        self.fds.discard(fd)
        super().remove(fd)


class Channel:
    """Answers a frame with its ``args`` (or ``answer_size`` bytes); closes after a frame
    with ``close`` or one that is not msgpack; polls with a real ``FramePoll``."""

    state = ChannelState()
    spin_ns = 0  # the adaptive poll, not the busy-poll mode

    def __init__(self, window_us: float, read_timeout: float = 5.0, answer_size: int = 0):
        self.connections: set[Any] = set()
        self.poll = TrackingPoll(window_us)
        self.read_timeout = read_timeout
        self.answer_size = answer_size
        self.polls: list[tuple[int, bool, float]] = []  # (bytes unsent, ended by a frame, s)

    def limit(self) -> int:
        return 1000 if not self.answer_size else 1 << 24

    def remember(self, *_: Any) -> None:
        """No busy poll: nothing to rehearse (``StepChannel.rehearse``)."""

    def settle(self) -> None:
        """Nothing counted after an answer (``StepChannel.settle``)."""

    def answer_first(self, body: bytes, conn: Any = None) -> tuple[dict[str, Any], bool, str]:
        try:
            message = msgpack.unpackb(body)
        except Exception:
            return {"error": "junk"}, True, "invalid"
        result = b"x" * self.answer_size if self.answer_size else message.get("args")
        return {"result": result}, bool(message.get("close")), "x"

    @staticmethod
    def error_frame(op: Any, exc: Exception) -> dict[str, Any]:
        return {"error": str(exc)}

    def wait_for_frame(self, after: str) -> None:
        unsent = sum(c.transport.get_write_buffer_size() for c in self.connections)
        t0 = time.perf_counter()
        ended = self.poll.wait()
        self.polls.append((unsent, ended, time.perf_counter() - t0))

    def check(self) -> None:
        """Every registered descriptor is open and a live connection's."""
        live = {c.fd for c in self.connections if c.fd is not None}
        for fd in self.poll.fds:
            os.fstat(fd)  # a closed one would end every poll at once (POLLNVAL)
        assert self.poll.fds <= live, (self.poll.fds, live)
        assert not self.poll.errors, self.poll.errors


LOOPS = [uvloop.new_event_loop, asyncio.new_event_loop]


async def _client(path: Path, how: str) -> None:
    reader, writer = await asyncio.open_unix_connection(str(path))
    sock = writer.get_extra_info("socket")
    frame = pack({"op": "x", "args": 1})
    if how == "back to back":
        for _ in range(5):
            writer.write(frame)
            await reader.readexactly(HEADER.size + len(msgpack.packb({"result": 1})))
    elif how == "half a frame":
        writer.write(frame[:5])
        await writer.drain()
        await asyncio.sleep(0.1)  # the read timer closes it
    elif how == "too large":
        writer.write(HEADER.pack(10_000))
    elif how == "not msgpack":
        writer.write(HEADER.pack(3) + b"\xc1\xc1\xc1")
    elif how == "close answer":
        writer.write(pack({"op": "x", "args": 1, "close": True}))
    elif how == "reset":
        writer.write(frame)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    await writer.drain()
    await asyncio.sleep(0.005)
    writer.close()


@pytest.mark.parametrize("loop_factory", LOOPS, ids=["uvloop", "asyncio"])
def test_descriptors_follow_the_connections_however_they_end(
    tmp_path: Path, loop_factory: Any
) -> None:
    """A client's close or reset, half a frame cut by the read timer, a frame over the limit,
    one that is not msgpack, an answer that closes, and the channel's stop: each connection's
    descriptor is removed from the poll exactly once, before it is closed."""
    channel = Channel(300, read_timeout=0.05)
    path = tmp_path / "s.sock"
    loop_errors: list[Any] = []

    async def run() -> None:
        loop = asyncio.get_running_loop()
        loop.set_exception_handler(lambda _, context: loop_errors.append(context))
        server = await loop.create_unix_server(lambda: _Connection(channel), str(path))  # type: ignore[arg-type]
        kinds = ["back to back", "half a frame", "too large", "not msgpack", "close answer"]
        for _ in range(6):
            clients = (_client(path, k) for k in [*kinds, "reset"] * 2)
            await asyncio.gather(*clients, return_exceptions=True)
            await asyncio.sleep(0.02)
            channel.check()
        still_open = [await asyncio.open_unix_connection(str(path)) for _ in range(5)]
        await asyncio.sleep(0.01)
        channel.check()
        assert len(channel.poll.fds) == 5
        server.close()  # as StepChannel.stop does
        for conn in list(channel.connections):
            conn.close()
        await server.wait_closed()
        await asyncio.sleep(0.01)
        for _, writer in still_open:
            writer.close()
        channel.check()
        assert channel.poll.fds == set()

    with asyncio.Runner(loop_factory=loop_factory) as runner:
        runner.run(run())
    assert not loop_errors, loop_errors
    assert channel.polls  # the back-to-back clients' answers were followed by polls


def _kernel_takes() -> int:
    """Bytes one non-blocking send puts into a fresh Unix socket pair."""
    a, b = socket.socketpair()
    try:
        return a.send(b"x" * (4 << 20), socket.MSG_DONTWAIT)
    finally:
        a.close()
        b.close()


def _back_to_back(sock: socket.socket, n: int, took: list[float]) -> None:
    """The next frame as soon as the whole answer is read."""
    for i in range(n):
        t0 = time.perf_counter()
        sock.sendall(pack({"op": "x", "args": i}))
        (size,) = HEADER.unpack(sock.recv(HEADER.size, socket.MSG_WAITALL))
        body = b""
        while len(body) < size:
            body += sock.recv(size - len(body))
        took.append(time.perf_counter() - t0)


@pytest.mark.parametrize("loop_factory", LOOPS, ids=["uvloop", "asyncio"])
def test_no_poll_while_an_answer_is_still_being_written(loop_factory: Any) -> None:
    """An answer a little larger than the kernel takes at once leaves its rest in the
    transport (under the 64 KiB high-water mark: no pause). Only the event loop sends it,
    and the client sends nothing before it has the whole answer: a poll then would run out
    and delay the answer by the whole window (100 ms here, to be unmistakable)."""
    channel = Channel(100_000, answer_size=_kernel_takes() + 20_000)
    server_end, client_end = socket.socketpair()
    took: list[float] = []

    async def run() -> None:
        loop = asyncio.get_running_loop()
        _, conn = await loop.connect_accepted_socket(
            lambda: _Connection(channel),  # type: ignore[arg-type]
            sock=server_end,
        )
        thread = threading.Thread(target=_back_to_back, args=(client_end, 6, took))
        thread.start()
        while thread.is_alive():
            await asyncio.sleep(0.005)
        conn.close()
        await asyncio.sleep(0.01)

    with asyncio.Runner(loop_factory=loop_factory) as runner:
        runner.run(run())
    client_end.close()
    assert len(took) == 6
    assert not [p for p in channel.polls if p[0]], channel.polls
    assert max(took) < 0.05, took

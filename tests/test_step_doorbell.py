"""The step channel's doorbell (docs/step-channel.md, "The doorbell"): which calls ring it,
in the sync and async clients, against a recording fake service; and what a real service does
with doorbells: counts them, polls for the frame each announces, answers nothing to them, and
backs off from a client that rings and never sends."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import threading
import time
from pathlib import Path

import httpx
import pytest
from helpers import FakeStepChannel
from servers import serve_process

from kvcm_client import AsyncKVCacheClient, KVCacheClient
from kvcm_client.columns import wire_columns
from kvcm_client.errors import (
    InvalidArgument,
    MalformedRequest,
    PayloadTooLarge,
    ServiceUnavailable,
)
from kvcm_client.step_channel import (
    DOORBELL,
    HEADER,
    AsyncStepSocket,
    StepSocket,
    free,
    pack,
    unpack,
)

ARGS = ("--default-model", "--num-blocks", "64", "--log-level", "warning")


class Recorder(FakeStepChannel):
    """A fake step channel: answers each frame ``{"result": None}`` and records, per
    connection, what came in order: ``"ring"`` for a doorbell, the op for a frame."""

    def __init__(self, path: Path) -> None:
        super().__init__(path)
        self.seen: list[str] = []

    def serve(self, conn: socket.socket) -> None:
        for body in self.frames(conn):
            if not body:
                self.seen.append("ring")
                continue
            self.seen.append(unpack(body)["op"])
            conn.sendall(pack({"result": None, "generation": "g"}))


@pytest.fixture
def recorder(tmp_path_factory: pytest.TempPathFactory) -> Recorder:
    rec = Recorder(Path(tmp_path_factory.mktemp("uds")) / "step.sock")
    rec.start()
    return rec


def _path(rec: Recorder) -> str:
    return rec.listener.getsockname()


def test_a_call_after_an_idle_spell_rings_once_before_its_frame(recorder: Recorder) -> None:
    """Wake after 50 ms: the first call has no connection to ring on; calls back to back do
    not ring; after 80 ms idle the next call rings once (``step_columns`` rings before it
    builds its frame, and ``_fast`` then does not ring again)."""
    with KVCacheClient(
        "http://127.0.0.1:9", step_socket=_path(recorder), step_wake_after_s=0.05
    ) as kv:
        kv.free("a")
        kv.free("b")
        time.sleep(0.08)
        kv.free("c")
        kv.free("d")
        time.sleep(0.08)
        kv.step_columns(free=[1])
        kv.step_columns(free=[2])
    time.sleep(0.05)
    assert recorder.seen == [
        "free",
        "free",
        "ring",
        "free",
        "free",
        "ring",
        "step_columns",
        "step_columns",
    ]


def test_no_ring_when_turned_off(recorder: Recorder) -> None:
    with KVCacheClient(
        "http://127.0.0.1:9", step_socket=_path(recorder), step_wake_after_s=None
    ) as kv:
        kv.free("a")
        time.sleep(0.02)
        kv.step_columns(free=[1])
    time.sleep(0.05)
    assert recorder.seen == ["free", "step_columns"]


def test_the_async_client_rings_as_the_sync_one(recorder: Recorder) -> None:
    async def run() -> None:
        kv = AsyncKVCacheClient(
            "http://127.0.0.1:9", step_socket=_path(recorder), step_wake_after_s=0.05
        )
        try:
            await kv.free("a")
            await kv.free("b")
            await asyncio.sleep(0.08)
            await kv.step_columns(free=[1])
            await kv.free("c")
        finally:
            await kv.aclose()

    asyncio.run(run())
    time.sleep(0.05)
    assert recorder.seen == ["free", "free", "ring", "step_columns", "free"]


def test_a_frame_slow_to_build_still_rings_once(
    recorder: Recorder, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``step_columns`` rings before it builds its frame; a frame that takes longer to build
    than the window (a loaded machine, a large step) must not ring again before it goes out:
    the service is already awake for it. (It did, one extra doorbell per slow call.) A call
    right after an answer does not ring, however long its frame takes to build."""
    import kvcm_client.async_client
    import kvcm_client.client

    def slow(**columns: object) -> object:
        time.sleep(0.03)  # three windows
        return wire_columns(**columns)

    monkeypatch.setattr(kvcm_client.client, "wire_columns", slow)
    monkeypatch.setattr(kvcm_client.async_client, "wire_columns", slow)
    path = _path(recorder)
    with KVCacheClient("http://127.0.0.1:9", step_socket=path, step_wake_after_s=0.01) as kv:
        kv.free("a")
        time.sleep(0.05)
        kv.step_columns(free=[1])
        kv.step_columns(free=[2])

    async def run() -> None:
        kv = AsyncKVCacheClient("http://127.0.0.1:9", step_socket=path, step_wake_after_s=0.01)
        try:
            await kv.free("b")
            await asyncio.sleep(0.05)
            await kv.step_columns(free=[3])
            await kv.step_columns(free=[4])
        finally:
            await kv.aclose()

    asyncio.run(run())
    time.sleep(0.05)
    once = ["ring", "step_columns", "step_columns"]
    assert recorder.seen == ["free", *once, "free", *once]


class SpinningRecorder(Recorder):
    """A ``Recorder`` whose answers say it busy-polls 0.2 s after each (``spin``)."""

    def serve(self, conn: socket.socket) -> None:
        for body in self.frames(conn):
            if not body:
                self.seen.append("ring")
                continue
            self.seen.append(unpack(body)["op"])
            conn.sendall(pack({"result": None, "generation": "g", "spin": 0.2}))


def test_no_ring_within_a_busy_polling_service_s_spin(tmp_path: Path) -> None:
    """A service in busy-poll mode says how long it polls after each answer: a call within
    that (after 50 ms idle, past the 10 ms window) does not ring, one after it (0.3 s) does."""
    rec = SpinningRecorder(tmp_path / "step.sock")
    rec.start()
    with KVCacheClient("http://127.0.0.1:9", step_socket=_path(rec), step_wake_after_s=0.01) as kv:
        kv.free("a")
        time.sleep(0.05)
        kv.free("b")  # the service still spins: no ring
        time.sleep(0.3)
        kv.free("c")  # its spin ran out: ring
    time.sleep(0.05)
    assert rec.seen == ["free", "free", "ring", "free"]


def _metric(url: str, name: str, **labels: str) -> float:
    want = ",".join(f'{k}="{v}"' for k, v in labels.items())
    for line in httpx.get(f"{url}/metrics").text.splitlines():
        if line.startswith(f"{name}{{{want}}} "):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def _polls(url: str) -> tuple[float, float]:
    """The polls after doorbells: ended by a frame, ran out."""
    name = "kvcm_step_channel_polls_total"
    return (
        _metric(url, name, after="doorbell", ended="frame"),
        _metric(url, name, after="doorbell", ended="timeout"),
    )


@pytest.mark.slow
def test_a_real_service_counts_doorbells_and_polls_for_their_frames(tmp_path: Path) -> None:
    """A client calling every 5 ms (each gap over the 300 us window) rings before each call
    but its connection's first: 20 doorbells, each counted. A poll after a doorbell ends by
    its frame, runs out (a loaded machine kept the client from sending its frame within the
    window), or does not run (the frame came in the same read): at most one per doorbell.
    The answers are those of the same calls without doorbells."""
    sock = tmp_path / "step.sock"
    args = (*ARGS, "--step-socket", str(sock), "--step-poll-us", "300")
    wakes = {"op": "wake", "result": "ok"}
    with serve_process(*args) as (url, _, _), KVCacheClient(url, step_socket=sock) as kv:
        handle = kv.step_columns(allocate=[{"request_id": "a", "num_tokens": 1}]).handles[0]
        before = _polls(url)
        assert _metric(url, "kvcm_step_channel_frames_total", **wakes) == 0  # the first call
        for _ in range(20):
            time.sleep(0.005)
            assert kv.step_columns(extend=[handle]).ok
        frame, timeout = (a - b for a, b in zip(_polls(url), before, strict=True))
        assert _metric(url, "kvcm_step_channel_frames_total", **wakes) == 20
        assert frame + timeout <= 20  # at most one poll per doorbell
        assert kv.request("a").num_tokens == 21


@pytest.mark.slow
def test_a_burst_after_a_doorbell_finds_the_service_polling(tmp_path: Path) -> None:
    """Pairs of calls every 5 ms: the doorbell's poll, then the poll after the pair's first
    answer (the burst's), which the second frame ends; nothing of the op's record would
    have polled there (its last frame came 5 ms after an answer). Polls after answers that
    run out (the second answer's: the pause) back off."""
    sock = tmp_path / "step.sock"
    args = (*ARGS, "--step-socket", str(sock), "--step-poll-us", "300")
    with serve_process(*args) as (url, _, _), KVCacheClient(url, step_socket=sock) as kv:
        handle = kv.step_columns(allocate=[{"request_id": "a", "num_tokens": 1}]).handles[0]
        name = "kvcm_step_channel_polls_total"
        for _ in range(20):
            time.sleep(0.005)
            assert kv.step_columns(extend=[handle]).ok
            assert kv.step_columns(extend=[handle]).ok
        frame = _metric(url, name, after="answer", ended="frame")
        timeout = _metric(url, name, after="answer", ended="timeout")
        assert kv.request("a").num_tokens == 41
    if len(os.sched_getaffinity(0)) > 1:  # (one CPU: no polls at all)
        # What the service decides: it polls after at least half the pairs' first answers
        # (the burst), and a poll that runs out backs off, so the 20 pauses add few. How a
        # poll ends is the machine's: a client descheduled past the 300 us window lets it
        # run out (two busy loops on two cores do that to about half of them).
        assert frame + timeout >= 10 and frame >= 1, (frame, timeout)
        assert timeout < 30, (frame, timeout)
        if os.getloadavg()[0] < 1.0:  # a quiet machine: most polls find their frame
            assert frame >= 10 and timeout < 15, (frame, timeout)


def _ring_all(path: Path, data: bytes, answers: int) -> list[dict[str, object]]:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(5)
        s.connect(str(path))
        s.sendall(data)
        got, buf = [], b""
        while len(got) < answers:
            chunk = s.recv(65536)
            assert chunk, "closed"
            buf += chunk
            while len(buf) >= 4 and len(buf) >= 4 + HEADER.unpack_from(buf)[0]:
                (size,) = HEADER.unpack_from(buf)
                got.append(unpack(buf[4 : 4 + size]))
                buf = buf[4 + size :]
        s.settimeout(0.2)
        with pytest.raises(TimeoutError):  # nothing more: doorbells are not answered
            s.recv(1)
        return got


@pytest.mark.slow
def test_doorbells_get_no_answer_and_one_that_announces_nothing_backs_off(
    tmp_path: Path,
) -> None:
    """1000 doorbells around two frames: two answers, the connection stays open. Then 60
    doorbells 2 ms apart with no frame: the polls after them run out and back off (misses
    at doorbells 0, 2, 6, 14, 30: 5 of 60 run out, not 60; the schedule itself is
    tests/test_step_poll.py's, and on a loaded machine a doorbell may end a poll the
    service began late, which starts the back-off over: under 20 here), and the service
    still answers. (A service on one CPU never polls.)"""
    sock = tmp_path / "step.sock"
    args = (*ARGS, "--step-socket", str(sock), "--step-poll-us", "300")
    with serve_process(*args) as (url, _, _):
        probe = pack({"op": "probe", "args": {"token_ids": [1, 2, 3]}})
        got = _ring_all(sock, DOORBELL * 500 + probe + DOORBELL * 500 + probe, 2)
        assert [a["result"] for a in got] == [0, 0]
        assert _metric(url, "kvcm_step_channel_frames_total", op="wake", result="ok") == 1000
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.connect(str(sock))
            _, before = _polls(url)
            for _ in range(60):
                s.sendall(DOORBELL)
                time.sleep(0.002)
            _, after = _polls(url)
            polls = 1 if len(os.sched_getaffinity(0)) > 1 else 0  # one CPU: never polls
            assert polls <= after - before < 20
            s.settimeout(5)
            s.sendall(probe)
            (size,) = HEADER.unpack(s.recv(4, socket.MSG_WAITALL))
            assert unpack(s.recv(size, socket.MSG_WAITALL))["result"] == 0


class _PartialSocket:
    """A socket whose non-blocking send takes ``takes`` bytes (None: raises
    BlockingIOError) and whose blocking ``sendall`` fails when ``broken``."""

    def __init__(self, takes: int | None, broken: bool = False) -> None:
        self.takes, self.broken = takes, broken
        self.out = b""
        self.closed = False

    def send(self, data: bytes, flags: int) -> int:
        if self.takes is None:
            raise BlockingIOError
        self.out += data[: self.takes]
        return self.takes

    def sendall(self, data: bytes) -> None:
        if self.broken:
            raise TimeoutError
        self.out += data

    def close(self) -> None:
        self.closed = True


@pytest.mark.parametrize(
    ("takes", "broken", "out", "closed"),
    [
        (4, False, DOORBELL, False),
        (1, False, DOORBELL, False),
        (None, False, b"", False),
        (2, True, DOORBELL[:2], True),
    ],
)
def test_a_doorbell_goes_out_whole_or_not_at_all(
    takes: int | None, broken: bool, out: bytes, closed: bool
) -> None:
    """A doorbell the kernel takes in part is completed, so the stream stays framed; one it
    cannot take is skipped; one whose rest cannot go out closes the connection (the next
    call reconnects) rather than leave a torn frame."""
    fake = _PartialSocket(takes, broken)
    step = StepSocket("unused", 1.0, 0, 0.0, wake_after_s=0.0)
    step._sock = fake  # type: ignore[assignment]
    step._idle_since = time.perf_counter_ns() - 1_000_000
    step.wake()
    assert fake.out == out and fake.closed == closed
    assert (step._sock is None) == closed


def test_a_call_that_fails_before_its_frame_leaves_the_next_call_to_ring(
    recorder: Recorder,
) -> None:
    """The doorbell rang, then the call could not build its frame: the service is awake
    from that ring on, and the next call after an idle spell rings again."""
    with KVCacheClient(
        "http://127.0.0.1:9", step_socket=_path(recorder), step_wake_after_s=0.05
    ) as kv:
        kv.free("a")
        time.sleep(0.08)
        with pytest.raises(InvalidArgument):
            kv.step_columns(free=[object()])  # rings, then cannot pack its handles
        time.sleep(0.08)
        kv.free("b")
    time.sleep(0.05)
    assert recorder.seen == ["free", "ring", "ring", "free"]


class Closer(Recorder):
    """Answers each frame ``payload_too_large`` with ``close`` and closes, as a service
    refusing a frame does."""

    def serve(self, conn: socket.socket) -> None:
        for body in self.frames(conn):
            if not body:
                self.seen.append("ring")
                continue
            self.seen.append("frame")
            error = {"code": PayloadTooLarge.code, "message": "too large", "detail": {}}
            conn.sendall(pack({"error": error, "status": 413, "close": True}))
            return


def test_after_a_closing_answer_the_next_call_reconnects_without_ringing(
    tmp_path: Path,
) -> None:
    """A closed connection has nothing to ring on: the next call connects anew and sends
    its frame first, in both clients."""
    closer = Closer(tmp_path / "s.sock")
    closer.start()
    path = _path(closer)
    with KVCacheClient("http://127.0.0.1:9", step_socket=path, step_wake_after_s=0.001) as kv:
        for _ in range(2):
            with pytest.raises(PayloadTooLarge):
                kv.free("a")
            time.sleep(0.01)

    async def run() -> None:
        kv = AsyncKVCacheClient("http://127.0.0.1:9", step_socket=path, step_wake_after_s=0.001)
        try:
            for _ in range(2):
                with pytest.raises(PayloadTooLarge):
                    await kv.free("a")
                await asyncio.sleep(0.01)
        finally:
            await kv.aclose()

    asyncio.run(run())
    time.sleep(0.05)
    assert closer.seen == ["frame"] * 4


class OldService(Recorder):
    """A service older than the doorbell: a zero-length frame is not msgpack, so it is
    answered ``malformed_request`` and the connection closed, unread frames unrun
    (``closed`` is set then)."""

    def __init__(self, path: Path) -> None:
        super().__init__(path)
        self.closed = threading.Event()

    def serve(self, conn: socket.socket) -> None:
        for body in self.frames(conn):
            if not body:
                self.seen.append("refused")
                error = {"code": "malformed_request", "message": "not msgpack", "detail": {}}
                conn.sendall(pack({"error": error, "status": 400, "close": True}))
                conn.close()
                self.closed.set()
                return
            self.seen.append(unpack(body)["args"]["request_id"])
            conn.sendall(pack({"result": None, "generation": "g"}))


def test_an_older_service_turns_the_doorbell_off_and_the_call_is_sent_again(
    tmp_path: Path,
) -> None:
    """The call after an idle spell rings; the older service refuses the doorbell and
    closes without running the frame; the sync client reads the refusal, turns its doorbell
    off and sends the call again on a new connection, and never rings again. The async
    client may lose the refusal with the connection (asyncio drops what was read once a
    write fails): the call is then sent again as any whose frame did not go out. Either
    way each call runs once, in order."""
    old = OldService(tmp_path / "s.sock")
    old.start()
    path = _path(old)
    with KVCacheClient("http://127.0.0.1:9", step_socket=path, step_wake_after_s=0.01) as kv:
        for rid in "abc":
            kv.free(rid)
            time.sleep(0.03)
        assert kv._channel is not None and kv._channel.wake_after_ns is None
    time.sleep(0.05)
    assert old.seen == ["a", "refused", "b", "c"]

    async def run() -> None:
        kv = AsyncKVCacheClient("http://127.0.0.1:9", step_socket=path, step_wake_after_s=0.01)
        try:
            for rid in "abc":
                await kv.free(rid)
                await asyncio.sleep(0.03)
        finally:
            await kv.aclose()

    asyncio.run(run())
    time.sleep(0.05)
    assert [x for x in old.seen[4:] if x != "refused"] == ["a", "b", "c"], old.seen


def test_an_async_client_that_loses_the_refusal_sends_again_and_turns_the_doorbell_off(
    tmp_path: Path,
) -> None:
    """The older service closes on the doorbell before the frame is written (a frame slow
    to build): asyncio loses the refusal with the connection. The call is sent again at
    once, even with no retries left, and after two such losses in a row the doorbell is
    off; every call runs once."""
    old = OldService(tmp_path / "s.sock")
    old.start()

    async def run() -> AsyncStepSocket:
        sock = AsyncStepSocket(_path(old), 5.0, 0, 0.05, wake_after_s=0.001)
        try:
            for rid in "abcd":
                await asyncio.sleep(0.01)
                old.closed.clear()
                sock.wake()
                if sock._rang:  # (not before "a": no connection; nor once it is off)
                    assert old.closed.wait(5)  # building the frame: the service closes
                assert (await sock.call(free(rid), {}))["result"] is None
        finally:
            await sock.aclose()
        return sock

    sock = asyncio.run(run())
    time.sleep(0.05)
    assert [x for x in old.seen if x != "refused"] == list("abcd")
    assert sock.wake_after_ns is None and old.seen.count("refused") == 2


@pytest.mark.slow
def test_a_current_service_refusing_the_frame_itself_keeps_the_doorbell(tmp_path: Path) -> None:
    """A frame the service cannot read (an int key in a map, refused by its strict unpack)
    after a ring looks like an older service's refusal: the call is sent again without a
    ring, refused again, and so the doorbell is turned back on; the caller gets the
    typed error."""
    sock = tmp_path / "step.sock"
    args = (*ARGS, "--step-socket", str(sock))
    with serve_process(*args) as (url, _, _), KVCacheClient(url, step_socket=sock) as kv:
        kv.probe([1, 2, 3])
        time.sleep(0.01)
        with pytest.raises(MalformedRequest):
            kv.step([{"op": "free", "request_id": "x", 1: 2}])
        assert kv._channel is not None and kv._channel.wake_after_ns is not None
        assert kv.probe([1, 2, 3]) == 0


class Echo(Recorder):
    """Answers each frame 0.3 s late with its request id: late enough that a client stalled
    by a loaded machine still times out at 10 ms first (at 50 ms, a loop descheduled that
    long found the answer and the timeout ready together, and took the answer)."""

    def serve(self, conn: socket.socket) -> None:
        for body in self.frames(conn):
            if not body:
                continue
            time.sleep(0.3)
            try:
                conn.sendall(pack({"result": unpack(body)["args"]["request_id"]}))
            except OSError:  # the client closed meanwhile
                return


def test_an_interrupted_call_does_not_leave_its_answer_to_the_next(tmp_path: Path) -> None:
    """A call cancelled (async) or interrupted (sync) while it waits for its answer closes
    its connection: the next call reads its own answer, not the late one."""
    echo = Echo(tmp_path / "a.sock")
    echo.start()

    async def run() -> list[object]:
        sock = AsyncStepSocket(_path(echo), 5.0, 0, 0.05, wake_after_s=None)
        try:
            with pytest.raises(TimeoutError):
                await asyncio.wait_for(sock.call(free("a"), {}), 0.01)
            return [(await sock.call(free(r), {}))["result"] for r in "bc"]
        finally:
            await sock.aclose()

    assert asyncio.run(run()) == ["b", "c"]
    slow = Echo(tmp_path / "s.sock")
    slow.start()
    step = StepSocket(_path(slow), 5.0, 0, 0.05, wake_after_s=None)
    _interrupt_after(0.01)
    try:
        with pytest.raises(KeyboardInterrupt):
            step.call(free("a"), {})  # interrupted while it waits for its answer
    finally:
        signal.signal(signal.SIGALRM, signal.SIG_DFL)
    try:
        assert step._sock is None and step._idle_since is None
        assert [step.call(free(r), {})["result"] for r in "bc"] == ["b", "c"]
    finally:
        step.close()


def _interrupt_after(seconds: float) -> None:
    """A KeyboardInterrupt in this (the main) thread after ``seconds``."""

    def interrupt(*_: object) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGALRM, interrupt)
    signal.setitimer(signal.ITIMER_REAL, seconds)


def test_an_interrupted_rung_call_leaves_no_ring_behind(tmp_path: Path) -> None:
    """A call that rang and was cancelled (async) or interrupted (sync), then a service
    that is gone: the failed reconnects are not taken for an older service's lost refusals
    (twice would turn the doorbell off against a current service)."""
    path = tmp_path / "s.sock"

    async def cycle(sock: AsyncStepSocket, rid: str) -> None:
        echo = Echo(path)
        echo.start()
        assert (await sock.call(free(rid + "1"), {}))["result"] == rid + "1"
        await asyncio.sleep(0.01)
        sock.wake()
        with pytest.raises(TimeoutError):  # the caller's own timeout cancels the call
            await asyncio.wait_for(sock.call(free(rid + "2"), {}), 0.01)
        echo.listener.close()
        path.unlink()  # the service goes away (a restart)
        with pytest.raises(ServiceUnavailable):
            await sock.call(free(rid + "3"), {})

    async def run() -> AsyncStepSocket:
        sock = AsyncStepSocket(str(path), 5.0, 0, 0.05, wake_after_s=0.001)
        try:
            for rid in "ab":
                await cycle(sock, rid)
        finally:
            await sock.aclose()
        return sock

    assert asyncio.run(run()).wake_after_ns is not None
    step = StepSocket(str(path), 5.0, 0, 0.05, wake_after_s=0.001)
    try:
        for rid in "ab":
            echo = Echo(path)
            echo.start()
            assert step.call(free(rid + "1"), {})["result"] == rid + "1"
            time.sleep(0.01)
            step.wake()
            _interrupt_after(0.01)
            try:
                with pytest.raises(KeyboardInterrupt):
                    step.call(free(rid + "2"), {})
            finally:
                signal.signal(signal.SIGALRM, signal.SIG_DFL)
            echo.listener.close()
            path.unlink()
            with pytest.raises(ServiceUnavailable):
                step.call(free(rid + "3"), {})
        assert step.wake_after_ns is not None
    finally:
        step.close()

"""The step ring (``KVCacheClient(..., step_ring=True)`` with ``kvcm serve --step-spin-s``;
docs/step-channel.md, "The shared-memory ring"): the step channel's frames through shared
memory. A random engine workload through it equals the same steps in process, across pauses
longer than the spin (the doorbell path); an answer too large for the ring comes over the
socket; without busy-poll mode the ring is refused and the socket serves; frames through it are
checked as on the socket (token, limits, junk), a client gets no more than one, and a service
that dies mid-call fails the call at once instead of at the timeout."""

from __future__ import annotations

import contextlib
import mmap
import os
import random
import re
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
from helpers import layer, manager
from servers import serve_process, small_model_args

from kvcm import native
from kvcm.server.step_ring import KEEP_BYTES, MAX_RINGS, ServiceRing, watch
from kvcm_client import KVCacheClient, step_channel
from kvcm_client.errors import ServiceUnavailable, Unauthorized
from kvcm_client.step_channel import DOORBELL, HEADER, pack, unpack
from kvcm_client.step_ring import (
    ANSWER_LEN,
    ANSWER_REPEATS,
    ANSWER_SEQ,
    AWAKE_UNTIL,
    HEADER_BYTES,
    ON_SOCKET,
    REQUEST_LEN,
    REQUEST_REPEATS,
    REQUEST_SEQ,
    SLOT_BYTES,
    ClientRing,
    supported,
)

pytestmark = [
    pytest.mark.skipif(not supported(), reason="the step ring runs on x86-64 Linux only"),
    pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="busy-poll mode needs 2 CPUs"),
]

LAYERS = [layer(0), layer(1, sliding_window=8, sink_tokens=4)]
SPIN = ["--step-spin-s", "0.1"]


def frames_by_op(url: str) -> dict[str, float]:
    text = httpx.get(f"{url}/metrics").text
    found = re.findall(r'kvcm_step_channel_frames_total\{op="(\w+)",result="ok"\} (\S+)', text)
    return {op: float(n) for op, n in found}


def same_step(kv: Any, m: Any, rng: random.Random, live: dict[str, int], serial: int) -> int:
    """One random engine step (frees, rewinds, chunked extends with lookahead, allocates
    with shared prefixes, slot mappings) through ``kv`` and in process on ``m``: the
    outcomes must be equal. ``live``: request id -> handle (the same on both sides)."""
    free = [h for h in live.values() if rng.random() < 0.15]
    extend = [h for h in live.values() if h not in free]
    counts = [rng.choice([1, 1, 2, 5]) for _ in extend]
    rewind = [h for h in extend if rng.random() < 0.2]
    allocate = []
    for _ in range(rng.randint(0, 2)):
        serial += 1
        n = rng.randint(1, 18)
        prompt = [rng.choice([1, 2]) for _ in range(n)]
        allocate.append({"request_id": f"r{serial}", "num_tokens": n, "token_ids": prompt})
    cols = {
        "free": free,
        "rewind": rewind,
        "rewind_tokens": 1,
        "extend": extend,
        "num_new_tokens": counts or 1,
        "lookahead": [rng.choice([0, 2]) for _ in extend] or 0,
        "allocate": allocate,
        "map_slots": True,
    }
    got, want = kv.step_columns(**cols), m.step_columns(**cols)
    for section, status in want.status.items():
        assert list(got.status[section]) == status.tolist(), section
    assert list(got.handles) == want.handles.tolist()
    assert [list(g) for g in got.slot_mapping] == np.asarray(want.slot_mapping).tolist()
    for h, s in zip(free, want.status["free"], strict=True):
        if s == 0:
            live.pop(next(r for r, x in live.items() if x == h))
    for op, h, s in zip(allocate, want.handles, want.status["allocate"], strict=True):
        if s == 0:
            live[op["request_id"]] = int(h)
    return serial


def test_a_workload_through_the_ring_equals_the_same_steps_in_process(tmp_path: Path) -> None:
    args, sock = small_model_args(tmp_path, LAYERS)
    m = manager(LAYERS, num_blocks=40, null_page=True)  # as `kvcm serve`
    rng = random.Random(5)
    with (
        serve_process(*args, *SPIN) as (url, _, _),
        KVCacheClient(url, step_socket=sock, step_ring=True) as kv,
    ):
        live: dict[str, int] = {}
        serial = 0
        for step in range(60):
            if step % 15 == 7:
                time.sleep(0.25)  # past the spin: the service sleeps, the call rings first
            serial = same_step(kv, m, rng, live, serial)
            assert kv.ring_attached  # (asked for as the connection opened)
        assert serial > 30
        frames = frames_by_op(url)
        # Every step went through the ring (asked for once); the pauses rang the doorbell.
        assert frames["ring"] == 1 and frames["step_columns"] == 60
        assert frames["wake"] >= 3


def test_an_answer_too_large_for_the_ring_comes_over_the_socket(tmp_path: Path) -> None:
    """With a 2 KiB frame limit the ring's areas are 2 KiB: a step whose slot mappings
    take more answers over the socket, and the next call goes through the ring again."""
    args, sock = small_model_args(tmp_path, [layer(0)])
    with (
        serve_process(*args, *SPIN, "--max-body-bytes", "2048", "--num-blocks", "100") as (
            url,
            _,
            _,
        ),
        KVCacheClient(url, step_socket=sock, step_ring=True) as kv,
    ):
        ops = [{"request_id": f"r{i}", "num_tokens": 60} for i in range(4)]
        big = kv.step_columns(allocate=ops, map_slots=True)  # 240 slots: ~2.2 KiB of answer
        ring = kv._channel.ring if kv._channel is not None else None
        assert ring is not None and ring.slot == 2048
        assert big.ok and len(big.slot_mapping[0]) == 240
        assert ring.words[ANSWER_SEQ] == 1 and ring.words[ANSWER_LEN] == ON_SOCKET
        small = kv.step_columns(extend=big.handles, map_slots=True)
        assert small.ok and len(small.slot_mapping[0]) == 4
        assert ring.words[ANSWER_SEQ] == 2 and 0 < ring.words[ANSWER_LEN] <= 2048


def test_without_busy_poll_the_ring_is_refused_and_the_socket_serves(tmp_path: Path) -> None:
    args, sock = small_model_args(tmp_path, [layer(0)])
    with (
        serve_process(*args) as (url, _, _),
        KVCacheClient(url, step_socket=sock, step_ring=True) as kv,
    ):
        out = kv.step_columns(allocate=[{"request_id": "a", "num_tokens": 5}])
        assert out.ok and not kv.ring_attached
        assert kv.ring_refusal == "ring_unavailable"
        assert kv.step_columns(extend=out.handles).ok
        assert kv.request("a").num_tokens == 6


def raw_ring(sock_path: Path) -> tuple[socket.socket, ClientRing]:
    """A connection and its ring, asked for by hand."""
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    conn.connect(str(sock_path))
    conn.sendall(pack({"op": "ring"}))
    data, fds, _, _ = socket.recv_fds(conn, 1 << 16, 1)
    answer = unpack(data[HEADER.size :])
    assert len(fds) == 1, answer
    return conn, ClientRing(fds[0], answer["result"]["slot"])


def read_frame(conn: socket.socket) -> dict[str, Any]:
    data = b""
    while len(data) < HEADER.size or len(data) < HEADER.size + HEADER.unpack_from(data)[0]:
        chunk = conn.recv(1 << 16)
        assert chunk, "closed before a whole answer"
        data += chunk
    return unpack(data[HEADER.size :])


def ring_call(
    conn: socket.socket, ring: ClientRing, body: bytes, length: int | None = None
) -> dict[str, Any]:
    """Post ``body`` (claiming ``length`` bytes) and ring the doorbell (the service may
    have stopped spinning on a busy machine), then wait for the answer in the ring."""
    ring.request[: len(body)] = body
    ring.words[REQUEST_LEN] = len(body) if length is None else length
    ring.seq += 1
    ring.words[REQUEST_SEQ] = ring.seq
    conn.sendall(DOORBELL)
    deadline = time.monotonic() + 5
    while ring.words[ANSWER_SEQ] != ring.seq:
        assert time.monotonic() < deadline, "no answer in the ring"
    return unpack(bytes(ring.answer[: ring.words[ANSWER_LEN]]))


def closed(conn: socket.socket) -> bool:
    conn.settimeout(5)
    try:
        return conn.recv(1) == b""
    except ConnectionResetError:
        return True


def test_hostile_frames_through_the_ring(tmp_path: Path) -> None:
    """A second ring, a frame longer than the ring, junk that is not msgpack: each gets the
    socket's answer for it (the last two close the connection, which unmaps its ring), and
    the service goes on serving others."""
    args, sock = small_model_args(tmp_path, [layer(0)])
    with serve_process(*args, *SPIN) as (url, _, _):
        conn, ring = raw_ring(sock)
        assert ring.slot == SLOT_BYTES
        conn.sendall(pack({"op": "ring"}))
        assert read_frame(conn)["error"]["code"] == "invalid_argument"
        ok = ring_call(conn, ring, pack({"op": "step_columns", "args": {}})[HEADER.size :])
        assert "result" in ok and ring.words[AWAKE_UNTIL] > 0  # its answer spins
        assert ring_call(conn, ring, pack({"op": "ring"})[HEADER.size :])["error"]["code"] == (
            "invalid_argument"  # a ring is asked for on the socket
        )
        too_long = ring_call(conn, ring, b"\x80", length=ring.slot + 1)
        assert too_long["error"]["code"] == "payload_too_large" and too_long["close"]
        assert closed(conn)
        ring.close()
        conn, ring = raw_ring(sock)
        junk = ring_call(conn, ring, b"\xc1\xc1\xc1")
        assert junk["error"]["code"] == "malformed_request" and junk["close"]
        assert closed(conn)
        ring.close()
        with KVCacheClient(url, step_socket=sock, step_ring=True) as kv:
            assert kv.step_columns(allocate=[{"request_id": "a", "num_tokens": 3}]).ok
            assert kv.ring_attached


def test_the_ring_and_its_frames_need_the_token_as_on_the_socket(tmp_path: Path) -> None:
    """With a token: no ring without it (the client stays on its socket, where its calls
    are refused as before); with it, a ring whose frames carry the token each, checked."""
    args, sock = small_model_args(tmp_path, [layer(0)])
    env = {"KVCM_API_TOKEN": "s3cret"}
    with serve_process(*args, *SPIN, env=env) as (url, _, _):
        with KVCacheClient(url, step_socket=sock, step_ring=True, token="wrong") as kv:
            with pytest.raises(Unauthorized):
                kv.step_columns(allocate=[{"request_id": "a", "num_tokens": 3}])
            assert not kv.ring_attached and kv.ring_refusal == "unauthorized"
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        conn.connect(str(sock))
        conn.sendall(pack({"op": "ring"}))  # no token at all
        assert read_frame(conn)["error"]["code"] == "unauthorized"
        conn.close()
        with KVCacheClient(url, step_socket=sock, step_ring=True, token="s3cret") as kv:
            assert kv.step_columns(allocate=[{"request_id": "a", "num_tokens": 3}]).ok
            assert kv.ring_attached
            ring = kv._channel.ring if kv._channel is not None else None
            assert ring is not None
            # A frame through the ring without the token is refused like one on the socket.
            body = pack({"op": "step_columns", "args": {}})[HEADER.size :]
            refused = ring_call(kv._channel._sock, ring, body)  # type: ignore[union-attr]
            assert refused["error"]["code"] == "unauthorized"


def test_a_service_that_dies_fails_the_call_at_once(tmp_path: Path) -> None:
    """Killed between two calls: the next one, posted to a ring nobody polls, sees the
    socket closed once its own poll ends (2 ms), not at the 10 s timeout; a step is not
    resent (the service may have applied it)."""
    args, sock = small_model_args(tmp_path, [layer(0)])
    with (
        serve_process(*args, *SPIN) as (url, proc, _),
        KVCacheClient(url, step_socket=sock, step_ring=True, timeout=10) as kv,
    ):
        out = kv.step_columns(allocate=[{"request_id": "a", "num_tokens": 3}])
        assert kv.ring_attached
        proc.kill()
        proc.wait()
        start = time.monotonic()
        with pytest.raises(ServiceUnavailable):
            kv.step_columns(extend=out.handles)
        assert time.monotonic() - start < 2


def test_the_ring_layout_is_what_the_docstring_says() -> None:
    """The words sit in cache lines of their own, before the bodies (a page)."""
    words = (REQUEST_SEQ, REQUEST_LEN, REQUEST_REPEATS, ANSWER_SEQ, ANSWER_LEN, ANSWER_REPEATS)
    offsets = [8 * w for w in (*words, AWAKE_UNTIL)]
    assert offsets == [64, 72, 80, 128, 136, 144, 192] and HEADER_BYTES == mmap.PAGESIZE


def test_a_frame_or_answer_equal_to_the_last_is_published_without_being_written_again() -> None:
    """Each side publishes a body equal to the last one it wrote with its sequence number
    alone, saying so in its repeats word (the area holds it still; a decode step repeats its
    frame and, between block crossings, its answer), and the reader takes the body it kept:
    the service its copy of the last frame, the client its map of the last answer. Each
    side's area is its own to write: a probe written into it is not what the other side
    reads, and any other body is written whole and read from the area."""
    service = ServiceRing(4096)
    client = ClientRing(service.give_fd(), 4096)
    try:
        a, b = HEADER.pack(600) + os.urandom(600), HEADER.pack(40) + os.urandom(40)
        taken, repeats = [], []
        for frame, probe in ((a, False), (a, True), (b, False), (a, False), (a, True)):
            if probe:  # the request area no longer holds the last frame
                client.request[:600] = bytes(600)
            seq = client.post(frame, HEADER.size)
            assert service.pending() and client.words[REQUEST_LEN] == len(frame) - 4
            repeats.append(client.words[REQUEST_REPEATS] == seq)
            taken.append(service.take(4096))
            assert service.seq == seq == len(taken)
        assert taken == [a[4:], a[4:], b[4:], a[4:], a[4:]] and taken[0] is taken[1]
        assert repeats == [False, True, False, False, True] and taken[3] is taken[4]
        # An older client, which never writes the repeats word: the area, whatever is kept.
        client.request[:600] = bytes(600)
        client.seq = client.words[REQUEST_SEQ] = 6
        assert service.take(4096) == bytes(600) and service.seq == 6
        client.post(b, HEADER.size)  # a new body, written whole...
        client.words[REQUEST_REPEATS] = client.seq  # ...that the client says repeats the last
        assert service.take(4096) == bytes(600)  # the last frame taken, run again
        x, y = os.urandom(300), os.urandom(500)
        read = []
        for body, probe in ((x, False), (x, True), (y, False), (x, False)):
            if probe:
                client.answer[:300] = b"\xff" * 300
            client.post(b, HEADER.size)  # a frame for each answer
            service.take(4096)
            assert service.reply(body) and client.answered(service.seq)
            read.append((client.answer_repeats(service.seq), client.answer_body()))
        assert read == [(False, x), (True, b"\xff" * 300), (False, y), (False, x)]
    finally:
        client.close()
        service.close()


def test_a_frame_said_to_repeat_is_checked_against_the_limit_and_a_refused_one_is_not_kept() -> (
    None
):
    """A frame taken over the limit is refused and not kept: the same frame again is read
    from the area and refused again, whatever the repeats word says; a kept frame over a
    lowered limit is refused too. A first frame said to repeat is read from the area (none
    is kept yet), and a body over ``KEEP_BYTES`` is never kept."""
    service = ServiceRing(4096)
    client = ClientRing(service.give_fd(), 4096)
    try:
        a = HEADER.pack(600) + os.urandom(600)
        client.words[REQUEST_REPEATS] = 1  # a lie: frame 1 is the first
        client.post(a, HEADER.size)
        kept = service.take(4096)
        assert kept == a[4:]
        client.post(a, HEADER.size)
        assert service.take(4096) is kept  # the copy kept, not the area again
        client.post(a, HEADER.size)
        assert service.take(500) == 600  # refused: over the limit
        client.post(a, HEADER.size)
        assert client.words[REQUEST_REPEATS] == client.seq and service.take(500) == 600
        client.post(a, HEADER.size)
        assert service.take(4096) == a[4:]  # read from the area
        client.post(a, HEADER.size)
        assert service.take(599) == 600  # kept, but over the limit now
        client.post(a, HEADER.size)
        assert service.take(4096) == a[4:]
    finally:
        client.close()
        service.close()
    slot = 2 * KEEP_BYTES
    service = ServiceRing(slot)
    client = ClientRing(service.give_fd(), slot)
    try:
        big = HEADER.pack(KEEP_BYTES + 1) + os.urandom(KEEP_BYTES + 1)
        taken = []
        for _ in range(2):
            client.post(big, HEADER.size)
            taken.append(service.take(slot))
        assert client.words[REQUEST_REPEATS] == 2 and taken[0] == taken[1] == big[4:]
        assert taken[1] is not taken[0]  # read from the area again: not kept
    finally:
        client.close()
        service.close()


@pytest.mark.parametrize("in_c", [True, False])
def test_the_watch_sees_a_frame_another_process_posts_in_c_and_in_python(in_c: bool) -> None:
    """``step_ring.watch`` (the busy poll's look at the rings: ``kvcm._native.ring_watch``,
    or looks in Python without the C core) is True exactly when a ring holds its client's
    next frame: a client process that posts into the second of two rings 50 ms later is
    seen there, and nothing is seen before it or after the frame is taken. The C watch
    looks for the whole time it is given."""
    if in_c and not native.available():
        pytest.skip("kvcm._native is not built")
    was = native.core is not None
    native.use(in_c)
    rings = [ServiceRing(4096), ServiceRing(4096)]
    child = (
        "import sys, time\n"
        "from kvcm_client.step_ring import ClientRing\n"
        "ring = ClientRing(int(sys.argv[1]), 4096)\n"
        "time.sleep(0.05)\n"
        "ring.post(b'\\0\\0\\0\\x03abc', 4)\n"
    )
    fds = [r.give_fd() for r in rings]
    os.close(fds[0])
    try:
        assert not watch(rings, 0)
        proc = subprocess.Popen([sys.executable, "-c", child, str(fds[1])], pass_fds=[fds[1]])
        os.close(fds[1])
        deadline = time.monotonic() + 30
        while not watch(rings, 1_000_000):
            assert time.monotonic() < deadline, "the posted frame was never seen"
        assert proc.wait(30) == 0
        assert rings[1].pending() and not rings[0].pending()
        assert rings[1].take(4096) == b"abc" and not watch(rings, 0)
        if in_c:
            start = time.perf_counter_ns()
            assert not watch(rings, 2_000_000)
            assert time.perf_counter_ns() - start >= 2_000_000
    finally:
        native.use(was)
        for r in rings:
            r.close()


@pytest.mark.skipif(not native.available(), reason="kvcm._native is not built")
def test_the_c_watch_refuses_what_is_not_a_ring() -> None:
    """``ring_watch``'s arguments are checked: words and wants of one length (64 at most), an
    index inside each buffer (however large), aligned buffers, sequence numbers that fit 64
    bits. With no ring to watch it returns at once, whatever its time."""
    was = native.core is not None
    native.use(True)
    core = native.core
    assert core is not None
    ring = ServiceRing(4096)
    words = (ring.ring.words,)
    try:
        assert core.ring_watch(words, REQUEST_SEQ, (1,), 0) == -1
        ring.ring.words[REQUEST_SEQ] = 1
        assert core.ring_watch(words, REQUEST_SEQ, (1,), 0) == 0
        for bad in [
            (words, REQUEST_SEQ, (1, 2), 0),
            (words * 65, REQUEST_SEQ, (1,) * 65, 0),
            (words, HEADER_BYTES // 8, (1,), 0),
            (words, (1 << 62) + REQUEST_SEQ, (1,), 0),
            ((b"1234567",), 0, (1,), 0),
            ((memoryview(bytearray(200))[1:],), REQUEST_SEQ, (1,), 0),  # not aligned
        ]:
            with pytest.raises(ValueError):
                core.ring_watch(*bad)
        with pytest.raises(TypeError):
            core.ring_watch((object(),), REQUEST_SEQ, (1,), 0)
        with pytest.raises(OverflowError):
            core.ring_watch(words, REQUEST_SEQ, (1 << 64,), 0)
        start = time.monotonic()
        assert core.ring_watch((), REQUEST_SEQ, (), 10 * 10**9) == -1  # none: at once
        assert time.monotonic() - start < 5
    finally:
        native.use(was)
        ring.close()


def test_repeated_decode_steps_through_the_ring_equal_the_same_steps_in_process(
    tmp_path: Path,
) -> None:
    """Decode steps as an engine sends them: the same requests step after step (the same
    frame), then one fewer, then one more. Each step's status, new blocks and slot mapping
    equal the in-process manager's."""
    args, sock = small_model_args(tmp_path, [layer(0)])
    m = manager([layer(0)], num_blocks=40, null_page=True)
    with (
        serve_process(*args, *SPIN) as (url, _, _),
        KVCacheClient(url, step_socket=sock, step_ring=True) as kv,
    ):
        ops = [{"request_id": f"r{i}", "num_tokens": 3 + i} for i in range(3)]
        got, want = kv.step_columns(allocate=ops), m.step_columns(allocate=ops)
        assert list(got.handles) == want.handles.tolist() and kv.ring_attached
        handles = np.asarray(want.handles, dtype=np.int64)
        plan = [handles] * 6 + [handles[:2]] * 3 + [handles[::2]] * 4
        for step, h in enumerate(plan):
            got, want = (
                kv.step_columns(extend=h, map_slots=True),
                m.step_columns(extend=h, map_slots=True),
            )
            assert list(got.status["extend"]) == want.status["extend"].tolist(), step
            assert got.new_blocks == want.new_blocks.tolist(), step
            assert [list(g) for g in got.slot_mapping] == np.asarray(want.slot_mapping).tolist()
        frames = frames_by_op(url)
        assert frames["step_columns"] == 1 + len(plan) and frames["ring"] == 1


@pytest.mark.parametrize("flags", [{}, {"table_edits": True}])
def test_a_decode_steps_answer_seen_again_is_read_again_as_the_same_map(
    tmp_path: Path, flags: dict[str, bool]
) -> None:
    """Without its slot mapping a decode step's answer is the same bytes until a request
    crosses a block boundary: the service says it repeats, the client returns the last
    answer's map for it without reading the answer area (junk there is never read), and for
    nothing else, and every result equals the manager's. A stale handle's answer, whose
    errors a result hands out as typed errors, is never kept: it is read again."""
    args, sock = small_model_args(tmp_path, [layer(0)])
    m = manager([layer(0)], num_blocks=40, null_page=True)
    with (
        serve_process(*args, *SPIN) as (url, _, _),
        KVCacheClient(url, step_socket=sock, step_ring=True) as kv,
    ):
        ops = [{"request_id": r, "num_tokens": 1} for r in "ab"]
        h = m.step_columns(allocate=ops).handles
        assert kv.step_columns(allocate=ops).handles == h.tolist() and kv.ring_attached
        outcomes, reads = [], []
        for step in range(10):  # blocks of 4 tokens: new blocks at the 3rd and 7th step
            got, want = kv.decode_step(h, **flags), m.decode_step(h, **flags)
            outcome = [want.status["extend"].tolist(), want.new_blocks.tolist()]
            assert [list(got.status["extend"]), got.new_blocks] == outcome, step
            if flags:
                edits = np.asarray(want.table_edits).ravel().tolist()
                assert list(got.table_edits) == edits, step
                outcome.append(edits)
            outcomes.append(outcome)
            reads.append(got._raw)
            # Junk in the client's answer area (msgpack's unused byte): an answer that
            # repeats is not read from the area at all, and one that differs is written whole.
            kv._channel.ring.answer[:64] = b"\xc1" * 64
        again = [i for i in range(1, 10) if outcomes[i] == outcomes[i - 1]]
        assert len(again) >= 4  # (the steps within a block but the first)
        assert [i for i in range(1, 10) if reads[i] is reads[i - 1]] == again
        assert kv.step_columns(free=h[1:]).ok and m.step_columns(free=h[1:]).ok
        stale = [kv.decode_step(h[1:]) for _ in range(2)]  # the same answer twice
        assert [s.errors[0].error.code for s in stale] == ["unknown_request"] * 2
        assert stale[0]._raw is not stale[1]._raw


def test_a_service_pinned_to_a_core_of_its_own_spins_and_gives_rings(tmp_path: Path) -> None:
    """Busy-poll mode's deployment: the service pinned to one CPU (it inherits the test's
    affinity at start), its client on another. It spins (its answers say so) and gives a
    ring; the adaptive poll's rule (off on one CPU) does not turn busy-poll mode off."""
    cpus = sorted(os.sched_getaffinity(0))
    args, sock = small_model_args(tmp_path, [layer(0)])
    os.sched_setaffinity(0, {cpus[-1]})
    try:
        server = serve_process(*args, *SPIN)
        url, _, _ = server.__enter__()
    finally:
        os.sched_setaffinity(0, set(cpus))
    try:
        with KVCacheClient(url, step_socket=sock, step_ring=True) as kv:
            os.sched_setaffinity(0, set(cpus[:-1]))
            out = kv.step_columns(allocate=[{"request_id": "a", "num_tokens": 3}])
            assert out.ok and kv.ring_attached
            assert kv.step_columns(extend=out.handles).ok
    finally:
        os.sched_setaffinity(0, set(cpus))
        server.__exit__(None, None, None)


def test_a_call_built_after_the_spin_ended_still_wakes_the_service(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A general step's call rings as it begins (the service slept), then its frame takes
    longer to build than the service spins after that doorbell: the frame lands in a ring
    nobody polls, and the call rings again after its post instead of waiting out its
    timeout. A decode step's call through the ring rings after its post only (its frame is
    built in microseconds); built as slowly, it is answered the same way."""
    args, sock = small_model_args(tmp_path, [layer(0)])
    with (
        serve_process(*args, "--step-spin-s", "0.05") as (url, _, _),
        KVCacheClient(url, step_socket=sock, step_ring=True, timeout=5) as kv,
    ):
        h = kv.step_columns(allocate=[{"request_id": "a", "num_tokens": 3}]).handles
        assert kv.ring_attached
        pack_now, decode_now = step_channel.pack, step_channel.DecodeFrames.frame

        def slow_pack(*a: Any) -> bytes:
            time.sleep(0.3)  # past the 50 ms spin the doorbell started
            return pack_now(*a)

        def slow_decode(*a: Any) -> bytes:  # a decode step's frame (``DecodeFrames``)
            time.sleep(0.3)
            return decode_now(*a)

        monkeypatch.setattr(step_channel, "pack", slow_pack)
        monkeypatch.setattr(step_channel.DecodeFrames, "frame", slow_decode)
        for call, rings in (
            (lambda: kv.step_columns(extend=h, free=[]), 2),  # before the frame, and after
            (lambda: kv.step_columns(extend=h), 1),  # after the post only
            (lambda: kv.decode_step(h), 1),
        ):
            time.sleep(0.2)  # the service sleeps
            wakes = frames_by_op(url).get("wake", 0)
            start = time.monotonic()
            assert call().ok
            assert time.monotonic() - start < 2.5  # not the 5 s timeout
            assert frames_by_op(url)["wake"] == wakes + rings
        assert kv.request("a").num_tokens == 6


def test_a_client_cannot_shrink_the_ring_under_the_service(tmp_path: Path) -> None:
    """The memfd's size is sealed: truncating it (which would make the service's next look
    a SIGBUS) is refused, and the service serves on."""
    args, sock = small_model_args(tmp_path, [layer(0)])
    with serve_process(*args, *SPIN) as (_, proc, _):
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        conn.connect(str(sock))
        conn.sendall(pack({"op": "ring"}))
        data, fds, _, _ = socket.recv_fds(conn, 1 << 16, 1)
        slot = unpack(data[HEADER.size :])["result"]["slot"]
        for size in (0, 4096, 1 << 30):
            with pytest.raises(PermissionError):
                os.ftruncate(fds[0], size)
        ring = ClientRing(fds[0], slot)
        ok = ring_call(conn, ring, pack({"op": "step_columns", "args": {}})[HEADER.size :])
        assert "result" in ok and proc.poll() is None
        ring.close()
        conn.close()


def test_rings_are_given_back_with_their_connections(tmp_path: Path) -> None:
    """More connections than MAX_RINGS, one after another, each with its ring: a closed
    connection's ring no longer counts."""
    args, sock = small_model_args(tmp_path, [layer(0)])
    with serve_process(*args, *SPIN):
        for _ in range(MAX_RINGS + 6):
            conn, ring = raw_ring(sock)
            ring.close()
            conn.close()


def test_a_peer_that_reads_nothing_does_not_hold_up_the_rings(tmp_path: Path) -> None:
    """A peer floods the socket with frames and reads none of the answers: its connection
    has answers unsent, which the spin's socket poll waits out; the rings are served all the
    same. The client's re-ring after 1 ms is put off here, so that no doorbell rescues a
    ring left unserved: it would wait for the end of the 2 s spin (whose last look serves
    it), 20 s for the ten calls, where served they take well under a second each even on
    a loaded machine."""
    args, sock = small_model_args(tmp_path, [layer(0)])
    with serve_process(*args, "--step-spin-s", "2") as (url, _, _):
        flood = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        flood.connect(str(sock))
        flood.setblocking(False)
        frame = pack({"op": "no_such_op"})  # answered with an error of a few hundred bytes
        sent = 0
        with contextlib.suppress(BlockingIOError):
            while sent < 64 << 20:
                sent += flood.send(frame * 64)
        time.sleep(0.2)  # the service answers what it read until its writes back up
        with KVCacheClient(url, step_socket=sock, step_ring=True, timeout=30) as kv:
            h = kv.step_columns(allocate=[{"request_id": "a", "num_tokens": 3}]).handles
            assert kv.ring_attached and kv._channel is not None
            kv._channel.ring_again_ns = 60 * 10**9
            start = time.monotonic()
            for _ in range(10):
                assert kv.step_columns(extend=h).ok
            assert time.monotonic() - start < 8
            assert kv.request("a").num_tokens == 13
        flood.close()

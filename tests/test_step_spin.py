"""The step channel's busy-poll mode (``kvcm serve --step-spin-s``, docs/step-channel.md): after
an answer the service polls for the next frame for the spin's length, handing the event loop
back between slices, and stops when the spin runs out with no frame."""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from array import array
from pathlib import Path

import numpy as np
import pytest
from helpers import layer, manager_state, same

from kvcm import KVCacheManager
from kvcm.columnar_parse import parse_keywords
from kvcm.server import step_channel
from kvcm.server.state import ServiceState
from kvcm.server.step_channel import REHEARSAL_BYTES, StepChannel
from kvcm_client.columns import wire_columns
from kvcm_client.step_channel import HEADER, pack, unpack

TWO_CPUS = pytest.mark.skipif(
    len(os.sched_getaffinity(0)) < 2, reason="the busy poll needs a second CPU (off on one)"
)


def _channel(spin_s: float) -> tuple[StepChannel, KVCacheManager]:
    m = KVCacheManager({"layers": [layer(0)], "num_blocks": 64, "max_seq_len": 256})
    return StepChannel(ServiceState(m, 30.0), None, lambda: 1 << 20, spin_s=spin_s), m


async def _call(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, frame: bytes) -> dict:
    writer.write(frame)
    await writer.drain()
    (size,) = HEADER.unpack(await reader.readexactly(HEADER.size))
    return unpack(await reader.readexactly(size))


@TWO_CPUS
def test_it_spins_after_an_answer_serves_the_loop_meanwhile_and_stops_when_idle(
    tmp_path: Path,
) -> None:
    """With a 0.3 s spin: right after an answer it spins; a frame during the spin is
    answered; other work on the loop goes on during it (the loop gets each slice back);
    0.3 s after the last answer, with no frame, it has stopped."""
    channel, m = _channel(0.3)
    path = tmp_path / "step.sock"

    async def run() -> tuple[list[bool], list[bool]]:
        await channel.start(path)
        try:
            reader, writer = await asyncio.open_unix_connection(str(path))
            frame = pack(
                {"op": "step_columns", "args": {"allocate": [{"request_id": "a", "num_tokens": 3}]}}
            )
            first = await _call(reader, writer, frame)
            handle = array("q", memoryview(first["result"]["handles"]).cast("q"))
            spinning = [channel._spinning]
            for _ in range(20):  # other work on the loop: each slice hands it back
                await asyncio.sleep(0)
            spinning.append(channel._spinning)  # still: the ticks did not wait out the spin
            extend = pack({"op": "step_columns", "args": wire_columns(extend=handle)})
            second = await _call(reader, writer, extend)
            spinning.append(channel._spinning)
            for _ in range(400):  # its spin (0.3 s) runs out with no frame
                if not channel._spinning:
                    break
                await asyncio.sleep(0.01)
            spinning.append(channel._spinning)
            writer.close()
            statuses = [not bool(r["result"].get("errors")) for r in (first, second)]
            return spinning, statuses
        finally:
            await channel.stop()

    spinning, ok = asyncio.run(run())
    assert spinning == [True, True, True, False] and ok == [True, True]
    assert m.request("a").num_tokens == 4


def test_without_the_mode_nothing_spins(tmp_path: Path) -> None:
    channel, _ = _channel(0.0)
    path = tmp_path / "step.sock"

    async def run() -> bool:
        await channel.start(path)
        try:
            reader, writer = await asyncio.open_unix_connection(str(path))
            frame = pack({"op": "step_columns", "args": {}})
            await _call(reader, writer, frame)
            writer.close()
            return channel._spinning
        finally:
            await channel.stop()

    assert asyncio.run(run()) is False


@TWO_CPUS
def test_a_real_service_says_it_spins_and_goes_idle_after_the_spin(tmp_path: Path) -> None:
    """``kvcm serve --step-spin-s 0.3``: its answers carry the spin (the clients' cue not to
    ring), and once the spin ran out with no frame the service uses no CPU. (How much CPU it
    takes while it spins depends on what else wants the core: it yields between looks.)"""
    import socket

    from servers import serve_process

    sock = tmp_path / "step.sock"
    args = ("--default-model", "--num-blocks", "64", "--log-level", "warning")
    flags = ("--step-socket", str(sock), "--step-spin-s", "0.3")
    with (
        serve_process(*args, *flags) as (_, proc, _),
        socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as client,
    ):
        client.settimeout(30)
        client.connect(str(sock))
        client.sendall(pack({"op": "step_columns", "args": {}}))
        (size,) = HEADER.unpack(client.recv(HEADER.size, socket.MSG_WAITALL))
        answer = unpack(client.recv(size, socket.MSG_WAITALL))
        time.sleep(0.6)  # the spin ran out
        idle = _cpu(proc.pid, 0.5)
    assert answer["spin"] == 0.3 and "result" in answer
    assert idle < 0.05, idle


def _cpu(pid: int, wall: float) -> float:
    """CPU seconds ``pid`` ran during the next ``wall`` seconds (/proc/PID/schedstat)."""

    def total() -> float:
        ns = 0
        for task in Path(f"/proc/{pid}/task").iterdir():
            with contextlib.suppress(FileNotFoundError):  # a thread that ended meanwhile
                ns += int((task / "schedstat").read_text().split()[0])
        return ns / 1e9

    before = total()
    time.sleep(wall)
    return total() - before


@TWO_CPUS
def test_the_busy_poll_rehearses_the_last_small_frame_and_changes_nothing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``rehearse`` runs the last frame remembered again, changing nothing: a decode step's
    frame seen again (``repeat_frame``) as it runs, its handles cut out and its batch
    planned (``KVCacheManager.rehearse_decode``), any other frame parsed again
    (``step_columns``' arrays and their shape check too, and a decode step's plan:
    ``rehearse_columns``); then its answer packed again. The manager, the metrics and the
    answer are as they were. Only a frame answered without an error, small, in busy-poll
    mode is remembered."""
    channel, m = _channel(0.3)
    parsed: list[dict] = []
    checked: list = []
    decoded: list[tuple] = []
    real = step_channel.columns_from_wire
    real_rehearse, real_decode = m.rehearse_columns, m.rehearse_decode

    def counted(args: dict) -> dict:
        parsed.append(args)
        return real(args)

    def counted_rehearse(columns: dict) -> None:
        checked.append(parse_keywords(columns))
        real_rehearse(columns)

    def counted_decode(extend: np.ndarray, new: int = 1, ahead: int = 0) -> None:
        decoded.append((extend.tolist(), new, ahead))
        real_decode(extend, new, ahead)

    monkeypatch.setattr(step_channel, "columns_from_wire", counted)
    monkeypatch.setattr(m, "rehearse_columns", counted_rehearse)
    monkeypatch.setattr(m, "rehearse_decode", counted_decode)

    def answer(message: dict) -> tuple[bytes, dict]:
        body = pack(message)[HEADER.size :]
        out, close, _ = channel.handle(body)
        assert not close
        channel.remember(body, out, 200)
        return body, out

    ops = [{"request_id": k, "num_tokens": 3} for k in "ab"]
    _, first = answer({"op": "step_columns", "args": {"allocate": ops}})
    handles = array("q", memoryview(first["result"]["handles"]).cast("q"))
    _, second = answer({"op": "step_columns", "args": wire_columns(extend=handles, lookahead=2)})
    assert len(parsed) == 1  # the decode step's frame took its own path (decode_step)
    before = (manager_state(m), channel.state.metrics.render())
    packed = step_channel._body(dict(second), False)
    for _ in range(20):
        channel.rehearse()
    assert decoded == [(list(handles), 1, 2)] * 20 and len(parsed) == 1 and not checked
    assert m.request("a").num_tokens == 4 and same(manager_state(m), before[0])
    assert channel.state.metrics.render() == before[1]
    assert step_channel._body(dict(second), False) == packed and "close" not in second

    # Counts per request: not a decode step's frame, so parsed again and rehearsed so.
    decode = wire_columns(extend=handles, num_new_tokens=[1, 1])
    answer({"op": "step_columns", "args": decode})
    before = (manager_state(m), channel.state.metrics.render())
    for _ in range(20):
        channel.rehearse()
    assert len(parsed) == 22 and parsed[-1] == decode and len(decoded) == 20
    assert len(checked) == 20 and checked[-1].extend.tolist() == list(handles)
    assert m.request("a").num_tokens == 5 and same(manager_state(m), before[0])
    assert channel.state.metrics.render() == before[1]

    def broken(columns: dict) -> None:
        raise RuntimeError("the frame no longer fits the service")

    monkeypatch.setattr(m, "rehearse_columns", broken)
    channel.rehearse()  # dropped, not raised into the spin
    channel.rehearse()  # nothing left to rehearse
    assert len(parsed) == 23
    monkeypatch.setattr(m, "rehearse_columns", counted_rehearse)

    answer({"op": "no_such_op"})  # an error: nothing to rehearse
    channel.rehearse()
    channel.remember(b"x" * REHEARSAL_BYTES, second, 1)  # too large together
    channel.rehearse()
    assert len(parsed) == 23 and m.request("a").num_tokens == 5

    idle, _ = _channel(0.0)  # not in busy-poll mode: nothing is remembered
    idle.remember(pack({"op": "step_columns", "args": {}})[HEADER.size :], second, 10)
    idle.rehearse()
    assert len(parsed) == 23


@TWO_CPUS
@pytest.mark.parametrize("decode_frame", [True, False])
def test_a_ring_frame_waiting_ends_a_rehearsal_between_its_pieces(
    decode_frame: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A rehearsal looks at the rings between its pieces (``_ring_waiting``) and stops where a
    frame waits there: the frame waits for one piece at most. A decode step's frame seen
    again: its plan rehearsed, its answer not packed; another frame: parsed, neither its plan
    nor its answer rehearsed. With no frame waiting, every piece runs."""
    channel, m = _channel(0.3)
    ran: list[str] = []
    monkeypatch.setattr(m, "rehearse_decode", lambda *a: ran.append("decode"))
    monkeypatch.setattr(m, "rehearse_columns", lambda c: ran.append("columns"))
    body_of = step_channel._body
    monkeypatch.setattr(step_channel, "_body", lambda a, c: ran.append("body") or body_of(a, c))
    handles = [int(m.allocate(k, 3).handle) for k in "ab"]
    counts = 1 if decode_frame else [1, 1]
    body = pack({"op": "step_columns", "args": wire_columns(extend=handles, num_new_tokens=counts)})
    out, _, _ = channel.handle(body[HEADER.size :])
    channel.remember(body[HEADER.size :], out, 100)
    ran.clear()
    waiting = [True]
    monkeypatch.setattr(channel, "_ring_waiting", lambda: waiting[0])
    channel.rehearse()
    assert ran == (["decode"] if decode_frame else [])
    ran.clear()
    waiting[0] = False
    channel.rehearse()
    assert ran == ["decode" if decode_frame else "columns", "body"]

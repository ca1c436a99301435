"""Where a step channel round trip goes: one timeline per frame, across the two processes.

  python bench/step_channel_timeline.py            # 2000 frames per kind (~30 s)
  python bench/step_channel_timeline.py --quick    # a smoke run

A child process serves ``StepChannel`` on uvloop (as ``kvcm serve`` does) for a manager of the
load test's config; this process sends raw frames on a blocking Unix socket. Both processes
stamp ``time.perf_counter_ns`` (CLOCK_MONOTONIC, one clock for both), so each frame splits
into: the client's send returning -> the server's ``data_received`` (wake: the kernel and the
event loop), ``StepChannel.answer_first`` (the op itself, with its checks; its counts are
taken after the answer is written), the answer's packing and write, the server done -> the
client's recv returning (wake), and the total.
Each wake is the difference of two processes' stamps taken after a call returns, so a small
negative one means the other side ran before that call returned.

Kinds: ``bad op`` (an unknown op: the channel's floor, no manager call), ``empty step``
(``step_columns`` with no items), ``decode 256`` (+1 token for 256 requests) and ``decode
256 + 2 replacements`` (the same, plus frees of the two requests the last such frame
allocated and two allocates of 300 tokens: the load test's step), each with a
client that sleeps in ``recv`` and one that polls for its answer as ``KVCacheClient`` does
(it spins up to 2 ms while its call is in flight). Medians in microseconds. The in-process
cost of the same ``handle`` call, in a hot loop, is printed beside it: the gap is what
running cold between frames costs.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import os
import pickle
import platform
import signal
import socket
import statistics
import struct
import sys
import tempfile
import time
from array import array
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from loadtest import _config

from kvcm_client.columns import wire_columns
from kvcm_client.step_channel import HEADER, pack, unpack

N = 256


def _channel() -> tuple[Any, Any]:
    from kvcm import KVCacheManager
    from kvcm.server.state import ServiceState
    from kvcm.server.step_channel import StepChannel

    state = ServiceState(KVCacheManager(_config(N, 1)), 30.0)
    return state, StepChannel(state, None, lambda: 1 << 24)


def _serve(path: Path, out: Path) -> None:
    """The child: serve the channel, stamping each frame; write the stamps at SIGTERM."""
    import uvloop

    from kvcm.server import step_channel as sc

    state, channel = _channel()
    stamps: list[tuple[int, int, int, int]] = []
    received, answer_first = sc._Connection.data_received, channel.answer_first
    send = sc._Connection._send
    marks: dict[str, int] = {}

    def timed_handle(body: bytes, conn: Any = None) -> Any:
        marks["h0"] = time.perf_counter_ns()
        answer = answer_first(body, conn)
        marks["h1"] = time.perf_counter_ns()
        return answer

    def timed_send(self: Any, answer: dict[str, Any], close: bool) -> None:
        send(self, answer, close)
        stamps.append((marks["start"], marks["h0"], marks["h1"], time.perf_counter_ns()))

    def timed_received(self: Any, data: bytes) -> None:
        # One stamp per answered frame, from its first bytes: a loaded machine can deliver
        # a frame in several reads (or none of it yet), so reads and frames do not pair.
        if not self.buffer:
            marks["start"] = time.perf_counter_ns()
        received(self, data)

    channel.answer_first = timed_handle
    sc._Connection._send = timed_send  # type: ignore[method-assign]
    sc._Connection.data_received = timed_received  # type: ignore[method-assign]

    def stop(*_: object) -> None:
        out.write_bytes(pickle.dumps(stamps))
        os._exit(0)

    signal.signal(signal.SIGTERM, stop)

    async def main() -> None:
        state.loop = asyncio.get_running_loop()
        await channel.start(path)
        await asyncio.Event().wait()

    uvloop.run(main())


REPLACE = "decode 256 + 2 replacements"


def _frames(handles: array) -> dict[str, bytes]:
    return {
        "bad op": pack({"op": "no_such_op", "args": {}}),
        "empty step": pack({"op": "step_columns", "args": {}}),
        "decode 256": pack({"op": "step_columns", "args": wire_columns(extend=handles)}),
    }


class _Replacements:
    """``REPLACE`` frames: each frees the two requests the previous one allocated (read from
    its answer) and allocates two new ones."""

    def __init__(self, handles: array) -> None:
        self.handles = handles
        self.count = 0
        self.last: list[int] = []

    def frame(self) -> bytes:
        self.count += 1
        allocate = [{"request_id": f"x{self.count}-{j}", "num_tokens": 300} for j in (0, 1)]
        columns = wire_columns(extend=self.handles, free=self.last, allocate=allocate)
        return pack({"op": "step_columns", "args": columns})

    def answered(self, body: bytes) -> None:
        result = unpack(body)["result"]
        self.last = array("q", result["handles"]).tolist()


def _hot_handle_us(frames: dict[str, bytes], count: int) -> dict[str, float]:
    """``StepChannel.handle`` of each frame in a hot loop, in this process."""
    state, channel = _channel()
    m = state.manager
    handles = array("q", m.step_columns(allocate=_allocates()).handles)
    frames = {**frames, "decode 256": _frames(handles)["decode 256"]}
    out = {}
    for name, frame in frames.items():
        body = frame[HEADER.size :]
        times = []
        for _ in range(min(count, 300)):  # decodes stay below max_seq_len
            t0 = time.perf_counter_ns()
            channel.handle(body)
            times.append(time.perf_counter_ns() - t0)
        out[name] = statistics.median(times[50:]) / 1000
    turnover = _Replacements(handles)
    times = []
    for _ in range(min(count, 300)):
        body = turnover.frame()[HEADER.size :]
        t0 = time.perf_counter_ns()
        answer, _, _ = channel.handle(body)
        times.append(time.perf_counter_ns() - t0)
        turnover.answered(pack(answer)[HEADER.size :])
    out[REPLACE] = statistics.median(times[50:]) / 1000
    return out


def _connect(path: Path, child: Any, timeout_s: float = 60.0) -> socket.socket:
    """A connection to the child's step socket once it listens. The socket file appears at
    its bind, a moment before its listen, and a connect between the two is refused (the
    smoke test met it under load), so a refused or missing socket is tried again until the
    child dies or ``timeout_s`` passes."""
    deadline = time.monotonic() + timeout_s
    while True:
        client = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            client.connect(str(path))
            return client
        except (FileNotFoundError, ConnectionRefusedError):
            client.close()
            if not child.is_alive() or time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def _allocates() -> list[dict[str, Any]]:
    return [{"request_id": f"d{i}", "num_tokens": 32} for i in range(N)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    count = 200 if args.quick else 2000
    with tempfile.TemporaryDirectory(prefix="kvcm-tl-") as tmp:
        path, stamps_file = Path(tmp) / "step.sock", Path(tmp) / "stamps.pkl"
        child = mp.get_context("spawn").Process(target=_serve, args=(path, stamps_file))
        child.start()
        client = _connect(path, child)
        # A lost answer raises after 30 s instead of hanging (the kernel's timeout: Python's
        # timeout mode would poll before every read and change what is measured).
        client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, struct.pack("ll", 30, 0))

        def call(frame: bytes) -> bytes:
            client.sendall(frame)
            (size,) = HEADER.unpack(client.recv(HEADER.size, socket.MSG_WAITALL))
            return client.recv(size, socket.MSG_WAITALL)

        answer = unpack(call(pack({"op": "step_columns", "args": {"allocate": _allocates()}})))
        handles = array("q", answer["result"]["handles"])
        frames = _frames(handles)
        turnover = _Replacements(handles)
        sent: dict[str, list[tuple[int, int, int]]] = {}
        peek = socket.MSG_PEEK | socket.MSG_DONTWAIT
        for spin in (False, True):
            for name in [*frames, REPLACE]:
                calls = sent[f"{name}, client {'spins' if spin else 'sleeps'}"] = []
                # Decodes stay below max_seq_len (1024 tokens from 32): 4 x 225 steps.
                steps = count if name in ("bad op", "empty step") else min(count, 225)
                for _ in range(steps):
                    frame = turnover.frame() if name == REPLACE else frames[name]
                    t0 = time.perf_counter_ns()
                    client.sendall(frame)
                    t1 = time.perf_counter_ns()
                    while spin:  # as KVCacheClient's step socket waits for its answer
                        try:
                            client.recv(1, peek)
                            break
                        except BlockingIOError:
                            pass
                    (size,) = HEADER.unpack(client.recv(HEADER.size, socket.MSG_WAITALL))
                    body = client.recv(size, socket.MSG_WAITALL)
                    calls.append((t0, t1, time.perf_counter_ns()))
                    if name == REPLACE:
                        turnover.answered(body)
        client.close()
        os.kill(child.pid, signal.SIGTERM)
        child.join()
        stamps = pickle.loads(stamps_file.read_bytes())[1:]  # after the allocate
    hot = _hot_handle_us(frames, count)
    print(f"{platform.node()} {platform.processor() or platform.machine()}")
    print("| frame | wake to server | handle | pack, write | wake to client | total | hot handle |")
    print("|---|---|---|---|---|---|---|")
    at = 0
    for name, calls in sent.items():
        server = stamps[at : at + len(calls)]
        at += len(calls)
        skip = len(calls) // 10  # warm-up
        pairs = list(zip(calls, server, strict=True))[skip:]

        def med(values: list[int]) -> float:
            return statistics.median(values) / 1000

        cells = (
            med([s[0] - c[1] for c, s in pairs]),
            med([s[2] - s[1] for _, s in pairs]),
            med([s[3] - s[2] for _, s in pairs]),
            med([c[2] - s[3] for c, s in pairs]),
            med([c[2] - c[0] for c, _ in pairs]),
            hot[name.split(",")[0]],
        )
        print(f"| {name} | " + " | ".join(f"{v:.1f}" for v in cells) + " |")


if __name__ == "__main__":
    main()

"""The step channel's poll after an answer (``kvcm.server.step_poll``): when it polls, what
ends a poll, and what a real service does with back-to-back, spaced and idle clients."""

from __future__ import annotations

import socket
import time
from pathlib import Path

import httpx
import pytest
from servers import serve_process

from kvcm.server.step_poll import FramePoll, GapPredictor
from kvcm_client import KVCacheClient

ARGS = ("--default-model", "--num-blocks", "64", "--log-level", "warning")


class Clock:
    def __init__(self) -> None:
        self.ns = 0

    def __call__(self) -> int:
        return self.ns


def test_it_polls_after_an_op_only_once_a_frame_followed_that_op_within_the_window() -> None:
    clock = Clock()
    gaps = GapPredictor(300_000, clock)
    assert not gaps.answered("step_columns")  # nothing known yet
    clock.ns += 120_000
    gaps.frame_began()
    assert gaps.answered("step_columns")  # the last one was followed 120 us later
    clock.ns += 300_000
    gaps.frame_began()  # exactly the window: still soon
    assert gaps.answered("step_columns")
    clock.ns += 300_001
    gaps.frame_began()  # 1 ns past: the poll would have run out
    assert not gaps.answered("step_columns")
    clock.ns += 50_000
    gaps.frame_began()
    assert gaps.answered("step_columns")  # soon again


def test_ops_are_predicted_apart_so_an_alternating_engine_polls_only_where_it_helps() -> None:
    """A step, its slot mappings 40 us later, then 20 ms of model: polls after every step's
    answer and never after the slot mappings'."""
    clock = Clock()
    gaps = GapPredictor(300_000, clock)
    polled = []
    for _ in range(5):
        polled.append(gaps.answered("step_columns"))
        clock.ns += 40_000
        gaps.frame_began()
        polled.append(gaps.answered("slot_mappings"))
        clock.ns += 20_000_000
        gaps.frame_began()
    assert polled == [False, False] + [True, False] * 4


def test_a_pipelined_frame_after_the_first_records_no_gap() -> None:
    """``frame_began`` is called for a frame's first bytes only when the connection's buffer
    is empty; answers in between move the op along, and only the last one's gap counts."""
    clock = Clock()
    gaps = GapPredictor(300_000, clock)
    gaps.answered("extend")
    gaps.answered("commit")
    clock.ns += 1_000
    gaps.frame_began()
    assert gaps.soon == {"commit": True}
    gaps.frame_began()  # no answer since: nothing to record
    assert gaps.soon == {"commit": True}


def test_frame_poll_ends_on_bytes_on_any_connection_or_after_the_window() -> None:
    a, a_peer = socket.socketpair()
    b, b_peer = socket.socketpair()
    poll = FramePoll(2_000)  # 2 ms
    try:
        poll.add(a.fileno())
        poll.add(b.fileno())
        t0 = time.perf_counter_ns()
        assert not poll.wait()  # nothing to read: the window runs out
        assert time.perf_counter_ns() - t0 >= 2_000_000
        b_peer.send(b"x")
        assert poll.wait()  # the other connection's bytes end it
        b.recv(1)
        poll.remove(b.fileno())
        b_peer.send(b"y")
        assert not poll.wait()  # a removed connection is not watched
        a_peer.send(b"z")
        assert poll.wait()
    finally:
        for s in (a, a_peer, b, b_peer):
            s.close()


def _polls(url: str) -> dict[str, float]:
    text = httpx.get(f"{url}/metrics").text
    found = {"frame": 0.0, "timeout": 0.0}
    for line in text.splitlines():
        if line.startswith("kvcm_step_channel_polls_total{"):
            ended = line.split('ended="', 1)[1].split('"', 1)[0]
            found[ended] = float(line.rsplit(" ", 1)[1])
    return found


def _decode_steps(kv: KVCacheClient, handle: int, n: int, gap_s: float) -> None:
    for _ in range(n):
        assert kv.step_columns(extend=[handle]).ok
        if gap_s:
            time.sleep(gap_s)


@pytest.mark.parametrize("window", ["300", "0"])
def test_a_service_polls_for_a_back_to_back_client_and_not_for_a_spaced_one(
    tmp_path_factory: pytest.TempPathFactory, window: str
) -> None:
    """Back to back (the next frame as soon as the answer is read), the answers are followed
    by polls that the next frame ends; at one frame per 5 ms, by none at all (each gap is
    over the window, so the op is never predicted soon). ``--step-poll-us 0``: no polls."""
    sock = Path(tmp_path_factory.mktemp("uds")) / "step.sock"
    args = (*ARGS, "--step-socket", str(sock), "--step-poll-us", window)
    with serve_process(*args) as (url, _, _), KVCacheClient(url, step_socket=sock) as kv:
        handle = kv.step_columns(allocate=[{"request_id": "a", "num_tokens": 1}]).handles[0]
        _decode_steps(kv, handle, 60, 0.0)
        back_to_back = _polls(url)
        _decode_steps(kv, handle, 40, 0.005)
        spaced = _polls(url)
        assert kv.request("a").num_tokens == 101
    if window == "0":
        assert back_to_back == spaced == {"frame": 0.0, "timeout": 0.0}
        return
    # A noisy machine may hold this client past 300 us now and then: most polls still hit.
    assert back_to_back["frame"] >= 30, back_to_back
    # 61 answers (the allocate's first): no poll after the first, whose op had no record.
    assert back_to_back["frame"] + back_to_back["timeout"] <= 60
    # Spaced: at most the first answer after the switch is followed by a poll (predicted
    # from the back-to-back frames), which runs out.
    assert spaced["frame"] == back_to_back["frame"]
    assert spaced["timeout"] - back_to_back["timeout"] <= 1

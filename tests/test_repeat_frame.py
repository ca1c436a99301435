"""A decode step's frame seen again (``kvcm.server.repeat_frame``): the cut learnt from a
parsed frame fits exactly the frames that parse to the same map with other handles, and the
step channel answers those as it answers any frame, with the same state and counts after."""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import pytest
from helpers import layer, manager, manager_state, same

from kvcm import native
from kvcm.server.repeat_frame import RepeatFrame
from kvcm.server.state import ServiceState
from kvcm.server.step_channel import StepChannel
from kvcm_client.step_channel import HEADER, DecodeFrames, new_packer, unpack

#: Handle counts around msgpack's bin sizes (bin 8 up to 31 handles, bin 16 up to 8191).
COUNTS = (1, 2, 31, 32, 8191, 8192)


def _body(handles: bytes, key: tuple[Any, ...]) -> bytes:
    """A decode step's frame body as the sync client packs it."""
    return DecodeFrames(new_packer()).frame(handles, key)[HEADER.size :]


def _key(**kw: Any) -> tuple[Any, ...]:
    given = {"new": 1, "ahead": 0, "map_slots": False, "table_edits": False}
    given |= {"stream_ordered": False, "session": None, "generation": None, "token": None}
    given |= kw
    return tuple(given.values())


def _handles(rng: np.random.Generator, n: int) -> bytes:
    return rng.integers(-(2**63), 2**63 - 1, n, dtype="<i8", endpoint=True).tobytes()


@pytest.mark.parametrize("count", COUNTS)
def test_a_cut_fits_the_same_frame_with_any_handles_and_nothing_else(count: int) -> None:
    """Learnt from one frame, the cut fits every frame of the same arguments and as many
    handles, whatever their bytes (random, all zero, all 0xff), and its handles are theirs;
    such a frame parses to the learnt map with those handles. It fits no frame of another
    length, another count, flag or header, nor one with a byte changed outside the handles."""
    rng = np.random.default_rng(count)
    key = _key(new=2, ahead=1, map_slots=True, session="s", generation="g" * 32, token="t")
    first = _body(_handles(rng, count), key)
    message = unpack(first)
    cut = RepeatFrame.learn(first, message)
    assert cut is not None
    for h in (_handles(rng, count), bytes(8 * count), b"\xff" * 8 * count):
        body = _body(h, key)
        assert cut.fits(body) and cut.handles(body) == h
        parsed = unpack(body)
        assert parsed == dict(message, args=dict(message["args"], extend=h))
    others = [
        _body(_handles(rng, count + 1), key),
        _body(_handles(rng, count), _key(new=3, ahead=1, map_slots=True, session="s")),
        _body(_handles(rng, count), (*key[:3], True, *key[4:])),  # table_edits too
        _body(_handles(rng, count), (*key[:5], "S", *key[6:])),  # another session
        _body(_handles(rng, count), (*key[:6], "h" * 32, *key[7:])),  # another generation
    ]
    assert not any(cut.fits(body) for body in others)
    body = bytearray(_body(_handles(rng, count), key))
    for at in (0, cut.at - 1, cut.at + 8 * count, len(body) - 1):  # outside the handles
        changed = body.copy()
        changed[at] ^= 1
        assert not cut.fits(bytes(changed)), at


def test_no_cut_is_learnt_where_the_handles_occur_twice() -> None:
    """A session that holds the handles' field (bin header and bytes) again: the place of
    the handles cannot be told from the bytes, so nothing is learnt."""
    handles = np.arange(1, 18, dtype="<i8").tobytes()  # 136 bytes: bin 8 header c4 88
    session = (b"\xc4\x88" + handles).decode()  # "Ĉ" and ASCII: a valid str
    body = _body(handles, _key(session=session))
    assert unpack(body)["session"] == session
    assert RepeatFrame.learn(body, unpack(body)) is None
    assert RepeatFrame.learn(_body(handles, _key(session="x")), unpack(body)) is not None


# -- through the step channel ---------------------------------------------------------------


def _channel(token: bytes | None) -> tuple[StepChannel, list[int]]:
    m = manager([layer(0), layer(1, sliding_window=5)], num_blocks=96, max_seq_len=256)
    state = ServiceState(m, 30.0)
    handles = [int(m.allocate(f"r{i}", i + 1).handle) for i in range(6)]
    return StepChannel(state, token, lambda: 1 << 24, poll_us=0), handles


def _counted(state: ServiceState) -> list[str]:
    text = state.metrics.render().decode().splitlines()
    return [
        line
        for line in text
        if line.startswith(("kvcm_ops_total", "kvcm_step_channel_frames_total"))
    ]


@pytest.mark.skipif(not native.available(), reason="kvcm._native is not built")
@pytest.mark.parametrize("seed", [0, 1])
def test_repeated_frames_answer_as_parsed_ones(seed: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """300 frames of decode steps as an engine sends them (the same arguments for runs of
    steps, then others; handles of every live request, some stale, some repeated; a
    generation pinned that goes stale; a wrong token), through a channel that answers
    repeated frames past their parsing and through a twin that parses every frame: equal
    answers, equal manager state after each, equal op and frame counts. Most frames of the
    first channel (over 100) are repeats."""
    rng = random.Random(seed)
    fast, handles = _channel(b"t")
    twin, _ = _channel(b"t")
    learnt: list[RepeatFrame | None] = []
    learn = RepeatFrame.learn

    def spied(body: bytes, message: dict[str, Any]) -> RepeatFrame | None:
        learnt.append(learn(body, message))
        return learnt[-1]

    monkeypatch.setattr(RepeatFrame, "learn", spied)
    # One generation for both services (each has its own otherwise), later a new one.
    monkeypatch.setattr(ServiceState, "generation", property(lambda _: "g0"))
    fits = 0
    key = _key(token="t")
    live = list(handles)
    for step in range(300):
        if rng.random() < 0.1:  # new arguments: a lookahead, counts, a flag, a session
            key = _key(
                new=rng.choice([1, 1, 2]),
                ahead=rng.choice([0, 2]),
                map_slots=rng.random() < 0.5,
                session=rng.choice([None, "s"]),
                generation=rng.choice([None, "g0"]),
                token=rng.choice(["t", "t", "t", "x"]),
            )
        extend = list(live)
        if rng.random() < 0.1:
            extend[rng.randrange(len(extend))] = 12345  # a stale handle
        if rng.random() < 0.1:
            extend.append(extend[0])  # a row twice
        body = _body(np.array(extend, dtype="<i8").tobytes(), key)
        if step == 250:  # the service's generation moves on: pinned frames go stale
            monkeypatch.setattr(ServiceState, "generation", property(lambda _: "new"))
        fits += fast._again is not None and fast._again.fits(body)
        got, want = fast.handle(body)[0], twin.handle(body)[0]
        twin._again = None  # the twin parses every frame
        assert got == want, step
        states = manager_state(fast.state.manager), manager_state(twin.state.manager)
        assert all(same(x, y) for x, y in zip(*states, strict=True)), step
    assert _counted(fast.state) == _counted(twin.state)
    assert fits > 100 and any(c is not None for c in learnt)
    assert any('result="stale_generation"' in line for line in _counted(fast.state))
    assert any('result="unauthorized"' in line for line in _counted(fast.state))

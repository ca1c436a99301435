"""A decode step's frame from cached pieces (``step_channel.DecodeFrames``) is the frame the
general path packs, byte for byte, and the sync client sends it for decode steps alone."""

from __future__ import annotations

import random
import socket
from array import array
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from helpers import FakeStepChannel

from kvcm_client import KVCacheClient
from kvcm_client import client as client_module
from kvcm_client.columns import wire_columns
from kvcm_client.errors import InvalidArgument
from kvcm_client.step_channel import DecodeFrames, header, new_packer, pack, unpack

#: Handle counts around msgpack's bin sizes: 31 handles are 248 bytes (bin 8), 32 are 256
#: (bin 16), 8191 are 65528 (bin 16), 8192 are 65536 (bin 32).
COUNTS = (1, 2, 31, 32, 33, 8191, 8192, 8193)


def _general(handles: array, key: tuple[Any, ...]) -> bytes:
    """The frame of the general path (``wire_columns``, then msgpack) for ``key`` as
    ``DecodeFrames.frame`` reads it."""
    new, ahead, map_slots, table_edits, stream_ordered, session, generation, token = key
    args = wire_columns(
        extend=handles,
        num_new_tokens=new,
        lookahead=ahead,
        map_slots=map_slots,
        table_edits=table_edits,
        stream_ordered=stream_ordered,
    )
    message = {"op": "step_columns", "args": args, **header(session, generation, token)}
    return pack(message, new_packer())


def _key(rng: random.Random) -> tuple[Any, ...]:
    return (
        rng.choice([0, 1, 4, 2**40, -1]),
        rng.choice([0, 1, 3]),
        rng.random() < 0.5,
        rng.random() < 0.5,
        rng.random() < 0.5,
        rng.choice([None, "s", "ş" * 40]),
        rng.choice([None, "g" * 32]),
        rng.choice([None, "t"]),
    )


def test_decode_frames_equal_the_general_paths_frames() -> None:
    """Every handle count around msgpack's bin sizes, then 300 calls with random counts,
    flags and headers through one ``DecodeFrames`` (its pieces kept or remade as the
    arguments change, its handles new or the last ones again): each frame equals the general
    path's, and reads back as the step."""
    rng = random.Random(0)
    frames = DecodeFrames(new_packer())
    key = (1, 0, True, False, False, "s", "g", None)
    for n in COUNTS:
        handles = array("q", range(n))
        assert frames.frame(handles.tobytes(), key) == _general(handles, key)
    for _ in range(300):
        key = _key(rng) if rng.random() < 0.3 else key
        if rng.random() < 0.6:  # new handles (else the last again, as a decode step sends)
            n = rng.choice(COUNTS)
            handles = array("q", (rng.randrange(-(2**63), 2**63) for _ in range(n)))
        frame = frames.frame(handles.tobytes(), key)
        assert frame == _general(handles, key)
        step = unpack(frame[4:])
        assert step["args"]["extend"] == handles.tobytes()
        assert step["args"]["num_new_tokens"] == key[0] and step["args"]["lookahead"] == key[1]


def test_the_last_steps_handles_again_give_the_same_frame() -> None:
    """The same handles under the same key: the very frame object again (the ring then
    publishes it without writing it, ``ClientRing.post``); new handles, or the same under
    another key, a new frame."""
    frames = DecodeFrames(new_packer())
    key = (1, 0, False, False, False, "s", None, None)
    first = frames.frame(array("q", [4, 5]).tobytes(), key)
    assert frames.frame(array("q", [4, 5]).tobytes(), key) is first
    other = frames.frame(array("q", [4, 6]).tobytes(), key)
    assert other != first and unpack(other[4:])["args"]["extend"] == array("q", [4, 6]).tobytes()
    mapped = frames.frame(array("q", [4, 6]).tobytes(), (1, 0, True, *key[3:]))
    assert unpack(mapped[4:])["args"]["map_slots"] is True
    assert frames.frame(array("q", [4, 6]).tobytes(), key) == other


def test_a_key_msgpack_cannot_pack_is_refused_and_keeps_the_last_pieces() -> None:
    """A count past 64 bits or a header that is not UTF-8 is an ``InvalidArgument``, as on
    the general path, and the pieces of the key before it stay whole: the next frame for
    that key is its frame again (the pieces were once replaced half, so a later frame of
    the old key joined the new key's prefix to the old suffix)."""
    frames = DecodeFrames(new_packer())
    handles = array("q", [3, 9]).tobytes()
    good = (1, 0, True, False, False, "s", "g", None)
    first = frames.frame(handles, good)
    for bad in (
        (2**64, 0, False, True, True, None, None, "t"),
        (1, 0, True, False, False, "\ud800", "g", None),
    ):
        with pytest.raises(InvalidArgument, match="cannot send"):
            frames.frame(handles, bad)
        with pytest.raises(InvalidArgument, match="cannot send"):
            _general(array("q", [3, 9]), bad)
        assert frames.frame(handles, good) == first == _general(array("q", [3, 9]), good)


class Frames(FakeStepChannel):
    """A fake step channel that keeps every frame's body and answers ``{"result": None}``
    with a generation, as a service does."""

    def __init__(self, path: Path) -> None:
        super().__init__(path)
        self.bodies: list[bytes] = []

    def serve(self, conn: socket.socket) -> None:
        for body in self.frames(conn):
            if body:
                self.bodies.append(body)
                conn.sendall(pack({"result": None, "generation": "gen-1"}))


@pytest.fixture
def fake(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Frames]:
    channel = Frames(Path(tmp_path_factory.mktemp("uds")) / "step.sock")
    channel.start()
    yield channel
    channel.listener.close()


def test_the_client_sends_a_decode_steps_frame_from_pieces(
    fake: Frames, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A decode step (extends alone, one count each, bool flags) goes out without the
    general path (``wire_columns`` is never called for it) in the very bytes the general
    path sends for the same step (an empty list for ``free`` takes that path), before and
    after the generation is pinned; any other step takes the general path."""
    handles = np.array([7, (3 << 32) | 5, 2**62], dtype=np.int64)
    with KVCacheClient("http://127.0.0.1:9", step_socket=fake.listener.getsockname()) as kv:
        general = []
        for _ in range(2):  # the second frame carries the generation the first pinned
            kv.step_columns(extend=handles, map_slots=True, free=[])
            general.append(fake.bodies[-1])
        called: list[int] = []
        real = client_module.wire_columns
        monkeypatch.setattr(
            client_module, "wire_columns", lambda **kw: called.append(1) or real(**kw)
        )
        kv.generation = None  # as before the first answer
        for _ in range(2):
            kv.step_columns(extend=handles, map_slots=True)
        assert fake.bodies[-2:] == general and not called
        assert unpack(general[1])["generation"] == "gen-1"

        kv.step_columns(extend=array("q", handles), num_new_tokens=2, lookahead=1)
        step = unpack(fake.bodies[-1])["args"]
        assert step == {"extend": handles.tobytes(), "num_new_tokens": 2, "lookahead": 1}
        assert not called
        for general_only in (
            {"num_new_tokens": [1, 2, 3]},
            {"map_slots": 1},
            {"atomic": True},
            {"rewind": [7]},
        ):
            kv.step_columns(extend=handles, **general_only)
        assert len(called) == 4
        assert unpack(fake.bodies[-3])["args"]["map_slots"] == 1  # sent as given

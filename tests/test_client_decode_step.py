"""``KVCacheClient.decode_step``, an engine's decode step through the client's shortest path,
is ``step_columns`` of the same extends: over the shared-memory ring, the socket and HTTP it
gives the in-process manager's statuses, new blocks and slot mappings, with handles as numpy,
a list or an ``array('q')``; counts per request or as numpy integers, a stale handle and bad
arguments come out as the manager reports them; a restarted service refuses it before
anything runs."""

from __future__ import annotations

import os
from array import array
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from helpers import layer, manager
from servers import serve_process, small_model_args

from kvcm_client import KVCacheClient
from kvcm_client.errors import InvalidArgument, StaleGeneration
from kvcm_client.step_ring import supported

LAYERS = [layer(0)]
SPIN = ["--step-spin-s", "0.1"]


def _same(got: Any, want: Any, step: int) -> None:
    assert list(got.status["extend"]) == want.status["extend"].tolist(), step
    assert got.new_blocks == want.new_blocks.tolist(), step
    assert [(e.index, e.error.code) for e in got.errors] == [
        (e.index, e.error.code) for e in want.errors
    ], step
    if want.slot_mapping is None:
        assert got.slot_mapping is None
    else:
        assert [list(g) for g in got.slot_mapping] == np.asarray(want.slot_mapping).tolist()


@pytest.mark.parametrize("way", ["ring", "socket", "http"])
def test_decode_steps_equal_the_managers(tmp_path: Path, way: str) -> None:
    if way == "ring" and (not supported() or len(os.sched_getaffinity(0)) < 2):
        pytest.skip("the step ring needs x86-64 Linux and 2 CPUs")
    args, sock = small_model_args(tmp_path, LAYERS)
    m = manager(LAYERS, num_blocks=40, null_page=True)  # as `kvcm serve`
    with (
        serve_process(*args, *(SPIN if way == "ring" else [])) as (url, _, _),
        KVCacheClient(
            url, step_socket=None if way == "http" else sock, step_ring=way == "ring"
        ) as kv,
    ):
        ops = [{"request_id": f"r{i}", "num_tokens": 3 + i} for i in range(4)]
        h = m.step_columns(allocate=ops).handles
        assert kv.step_columns(allocate=ops).handles == h.tolist()
        assert kv.ring_attached == (way == "ring")
        plan: list[tuple[Any, dict[str, Any]]] = [
            (h, {}),
            (h, {"map_slots": True}),
            (h, {"map_slots": True}),  # the same frame again
            (h.tolist(), {"map_slots": True}),
            (array("q", h.tolist()), {"num_new_tokens": 2, "lookahead": 1, "map_slots": True}),
            (h[:2], {"num_new_tokens": [1, 3], "map_slots": True}),  # counts per request
            (h, {"num_new_tokens": np.int64(1), "lookahead": np.int32(2), "map_slots": True}),
            (h[::-1].copy(), {"map_slots": True}),
        ]
        for step, (handles, kw) in enumerate(plan):
            _same(kv.decode_step(handles, **kw), m.decode_step(np.asarray(handles), **kw), step)
        ops = [h[3:]]
        assert kv.step_columns(free=ops[0]).ok and m.step_columns(free=ops[0]).ok
        for step in range(2):  # a stale handle: its item fails, the others run
            _same(kv.decode_step(h, map_slots=True), m.decode_step(h, map_slots=True), step)
        for bad in ({"num_new_tokens": 0}, {"lookahead": -1}, {"num_new_tokens": True}):
            with pytest.raises(InvalidArgument):
                m.decode_step(h[:3], **bad)
            with pytest.raises(InvalidArgument):
                kv.decode_step(h[:3], **bad)
        # Nothing of the refused steps ran: the next step's slots are the manager's.
        _same(kv.decode_step(h[:3], map_slots=True), m.decode_step(h[:3], map_slots=True), 9)


def test_a_restarted_service_refuses_a_decode_step_before_it_runs(tmp_path: Path) -> None:
    args, sock = small_model_args(tmp_path, LAYERS)
    kv = KVCacheClient("http://127.0.0.1:9", step_socket=sock, backoff_s=0.05)
    with kv:
        with serve_process(*args):
            handles = kv.step_columns(allocate=[{"request_id": "a", "num_tokens": 3}]).handles
            assert kv.decode_step(handles).ok
        with serve_process(*args) as (url, _, _):
            with pytest.raises(StaleGeneration):
                kv.decode_step(handles)
            with KVCacheClient(url) as http:
                assert http.request_ids() == []

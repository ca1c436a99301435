"""A step's ragged pages (``step_columns(..., ragged_layers=[...])``): per layer, FlashInfer's
CSR pages of the requests the step maps, in ``slot_mapping``'s order, in the same call. After
every step of an engine-like workload (chunked prefill, decode with lookahead, rejected
drafts, windows with sinks, prefix hits, frees, out_of_blocks) they equal
``ragged_page_indices(..., per_layer=True)`` of those requests, in process, over HTTP and over
the step channel; a bad layer list is refused before the step runs."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from helpers import layer, manager
from servers import serve_process, small_model_args

from kvcm_client import KVCacheClient
from kvcm_client.columns import wire_columns
from kvcm_client.errors import InvalidArgument, UnknownLayer

LAYERS = [layer(0), layer(1, sliding_window=8, sink_tokens=4), layer(2, kv_factor=1)]
ASKED = [0, 1, 2]
FIELDS = ("indptr", "indices", "last_page_len", "first_token", "num_sink_pages")


def lists(pages: Any) -> dict[str, list[int]]:
    """A RaggedPages (tensors) or RaggedPageIndices (lists) as lists."""
    return {f: list(map(int, getattr(pages, f))) for f in FIELDS}


def workload(kv: Any, rng: random.Random, steps: int) -> int:
    """Random engine steps through ``kv`` (a manager or a client); returns the requests whose
    pages were compared."""
    live: dict[int, tuple[str, int]] = {}  # handle -> (request id, tokens)
    serial = compared = 0
    for _ in range(steps):
        free = [h for h in live if rng.random() < 0.15]
        extend = [h for h in live if h not in free]
        counts = [rng.choice([1, 1, 1, 4, 8]) for _ in extend]
        rewind = [h for h in extend if rng.random() < 0.2 and live[h][1] > 3]
        allocate = []
        for _ in range(rng.randint(0, 2)):
            serial += 1
            n = rng.randint(1, 20)
            prompt = [rng.choice([1, 2]) for _ in range(n)]  # shared prefixes: hits
            allocate.append({"request_id": f"r{serial}", "num_tokens": n, "token_ids": prompt})
        out = kv.step_columns(
            free=free,
            rewind=rewind,
            rewind_tokens=2,
            extend=extend,
            num_new_tokens=counts or 1,
            lookahead=[rng.choice([0, 2]) for _ in extend] or 0,
            allocate=allocate,
            map_slots=rng.random() < 0.5,
            ragged_layers=ASKED,
        )
        for h, s in zip(free, out.status["free"], strict=True):
            if s == 0:
                del live[h]
        for h, s in zip(rewind, out.status["rewind"], strict=True):
            if s == 0:
                live[h] = (live[h][0], live[h][1] - 2)
        mapped = []
        for h, n, s in zip(extend, counts, out.status["extend"], strict=True):
            if s == 0:
                live[h] = (live[h][0], live[h][1] + n)
                mapped.append(live[h][0])
        for op, s, h in zip(allocate, out.status["allocate"], out.handles, strict=True):
            if s == 0:
                live[int(h)] = (op["request_id"], op["num_tokens"])
                mapped.append(op["request_id"])
        assert sorted(out.ragged) == ASKED
        for k in ASKED:
            assert lists(out.ragged[k]) == lists(kv.ragged_page_indices(mapped, k, per_layer=True))
        compared += len(mapped)
        while sum(t for _, t in live.values()) > 160:  # keep it mostly fitting
            h = max(live, key=lambda x: live[x][1])
            kv.step_columns(free=[h])
            del live[h]
    return compared


@pytest.mark.parametrize("null_page", [False, True])
def test_a_step_answers_the_ragged_pages_of_what_it_maps(null_page: bool) -> None:
    m = manager(LAYERS, num_blocks=40, null_page=null_page, max_requests=8)
    assert workload(m, random.Random(5), 60) > 100


def test_bad_layer_lists_are_refused_before_the_step_runs() -> None:
    m = manager(LAYERS, num_blocks=40, max_requests=8)
    h = int(m.step_columns(allocate=[{"request_id": "a", "num_tokens": 5}]).handles[0])
    bad_lists = [([9], UnknownLayer), ([0, 0], InvalidArgument), ("0", InvalidArgument)]
    bad_lists += [(np.array(0), InvalidArgument), ([True], InvalidArgument)]
    for bad, error in bad_lists:
        with pytest.raises(error):
            m.step_columns(extend=[h], ragged_layers=bad)
        assert m.request("a").num_tokens == 5  # nothing ran
    out = m.step_columns(extend=[h], ragged_layers=[])
    assert out.ragged is None and m.request("a").num_tokens == 6


@pytest.mark.parametrize("channel", [False, True])
def test_over_the_sidecar(channel: bool, tmp_path: Path) -> None:
    args, sock = small_model_args(tmp_path, LAYERS)
    with (
        serve_process(*args) as (url, _, _),
        KVCacheClient(url, step_socket=sock if channel else None) as kv,
    ):
        assert workload(kv, random.Random(3), 25) > 30
        h = kv.step_columns(allocate=[{"request_id": "z", "num_tokens": 3}]).handles[0]
        with pytest.raises(UnknownLayer):
            kv.step_columns(extend=[h], ragged_layers=[9])
        assert kv.request("z").num_tokens == 3


def test_the_client_sends_numpy_layer_ids_as_their_own_python_values() -> None:
    """numpy ints go as ints, a numpy bool or float as what it is: the service refuses those
    (not a 1 made up on the way)."""
    sent = wire_columns(ragged_layers=[np.int64(2), np.True_, np.float64(1.5)])["ragged_layers"]
    assert sent == [2, True, 1.5] and [type(k) for k in sent] == [int, bool, float]

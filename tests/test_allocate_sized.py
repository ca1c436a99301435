"""``allocate(..., max_new_tokens=k)``: a request sized by its own prefix hit, the probe a
scheduler made before each admission folded into the allocate (docs/prefix-reuse.md)."""

from __future__ import annotations

import copy
from typing import Any

import numpy as np
import pytest
from helpers import layer, manager, manager_state, same

from kvcm import DuplicateRequest, InvalidArgument, KVCacheManager
from kvcm_client.models import AllocateOp

TPB = 4


def test_the_docstring_example_and_its_retry() -> None:
    """A 21-token sequence whose first 12 tokens are cached: k 3 gives 15 tokens, 12 hit;
    the same call again returns that result; another k for the live id is a duplicate."""
    m = manager([layer(0)], num_blocks=64)
    seq = list(range(30))
    m.allocate("a", 13, token_ids=seq[:13])
    m.commit("a", seq[:13])
    info = m.allocate("b", 21, token_ids=seq[:21], max_new_tokens=3)
    assert (info.num_tokens, info.num_hit_tokens, info.capacity) == (15, 12, 15)
    assert m.block_table("b")[0][:3] == m.block_table("a")[0][:3]  # the hit's blocks
    assert m.committed_tokens("b") == seq[:12]
    assert m.allocate("b", 21, token_ids=seq[:21], max_new_tokens=3) == info
    with pytest.raises(DuplicateRequest):
        m.allocate("b", 21, token_ids=seq[:21], max_new_tokens=4)
    with pytest.raises(DuplicateRequest):
        m.allocate("b", 15, token_ids=seq[:15])  # the length it got, but not this call
    wide = m.allocate("c", 21, token_ids=seq[:21], max_new_tokens=100)
    assert (wide.num_tokens, wide.num_hit_tokens) == (21, 12)  # at most num_tokens
    cold = m.allocate("d", 9, token_ids=list(range(100, 109)), max_new_tokens=4)
    assert (cold.num_tokens, cold.num_hit_tokens) == (4, 0)


@pytest.mark.parametrize(
    "kwargs",
    [
        {},  # no token_ids
        {"token_ids": list(range(8)), "block_keys": ["00" * 32, "11" * 32]},
        {"token_ids": list(range(8)), "max_new_tokens": 0},
        {"token_ids": list(range(8)), "max_new_tokens": True},
    ],
)
def test_bad_sizing_is_refused_and_changes_nothing(kwargs: dict[str, Any]) -> None:
    m = manager([layer(0)], num_blocks=16)
    before = manager_state(m)
    with pytest.raises(InvalidArgument):
        m.allocate("a", 8, **({"max_new_tokens": 2} | kwargs))
    assert same(manager_state(m), before)


@pytest.mark.parametrize("seed", range(6))
def test_it_equals_a_probe_then_an_allocate_of_hit_plus_k(seed: int) -> None:
    """Two copies of one manager, random prompts sharing prefixes (a window, a host tier
    with blocks evicted to it, a state layer's checkpoints, by seed): ``max_new_tokens``
    on one, ``probe``/``probe_tiers`` then an allocate of ``min(L, hit + k)`` on the other,
    give the same state after every op (tables, queues, cache, events, host tier)."""
    rng = np.random.default_rng(seed)
    kind = ("full", "window", "host")[seed % 3]
    layers = [layer(0, sliding_window=8), layer(1)] if kind == "window" else [layer(0)]
    extra: dict[str, Any] = {"host_memory_bytes": 1 << 13} if kind == "host" else {}
    a = manager(layers, num_blocks=40 if kind == "window" else 20, max_seq_len=48, **extra)
    b = copy.deepcopy(a)
    families = [rng.integers(0, 500, 48).tolist() for _ in range(3)]
    live: list[str] = []
    for i in range(120):
        if live and (rng.random() < 0.4 or len(live) >= 6):
            rid = live.pop(int(rng.integers(0, len(live))))
            a.free(rid)
            b.free(rid)
            continue
        seq = families[int(rng.integers(0, 3))][: int(rng.integers(2, 48))]
        k = int(rng.integers(1, 20))
        rid = f"r{i}"
        try:
            got = a.allocate(rid, len(seq), token_ids=seq, max_new_tokens=k)
        except Exception as exc:  # out of blocks: the other one refuses the same
            hit = b.probe(seq) if kind != "host" else sum(b.probe_tiers(seq))
            with pytest.raises(type(exc)):
                b.allocate(rid, min(len(seq), hit + k), token_ids=seq[: min(len(seq), hit + k)])
            assert same(manager_state(a), manager_state(b))
            continue
        hit = b.probe(seq) if kind != "host" else sum(b.probe_tiers(seq))
        n = min(len(seq), hit + k)
        want = b.allocate(rid, n, token_ids=seq[:n])
        assert (got.num_tokens, got.num_hit_tokens, got.row) == (
            want.num_tokens,
            want.num_hit_tokens,
            want.row,
        )
        for m in (a, b):
            m.commit(rid, seq[got.num_hit_tokens : got.num_tokens])
        live.append(rid)
        assert same(manager_state(a), manager_state(b))


def test_a_columnar_step_and_an_op_list_size_their_allocates_too() -> None:
    m = manager([layer(0)], num_blocks=64)
    seq = list(range(40))
    m.allocate("a", 17, token_ids=seq[:17])
    m.commit("a", seq[:17])
    out = m.step_columns(
        allocate=[
            AllocateOp(request_id="b", num_tokens=40, token_ids=seq, max_new_tokens=5),
            {"request_id": "c", "num_tokens": 9, "token_ids": seq[:9], "max_new_tokens": 2},
        ],
        map_slots=True,
    )
    assert out.hit_tokens.tolist() == [16, 8]
    assert [info.num_tokens for info in out.infos] == [21, 9]  # c: at most its 9 tokens
    assert out.slot_mapping.shape == (1, 5 + 1)  # the tokens past each hit
    assert out.slot_mapping.tolist() == m.slot_mappings(["b", "c"], [5, 1]).tolist()
    results = m.step(
        [
            {
                "op": "allocate",
                "request_id": "d",
                "num_tokens": 40,
                "token_ids": seq,
                "max_new_tokens": 1,
            }
        ]
    )
    assert results[0].request is not None and results[0].request.num_tokens == 17


def test_over_http_and_the_step_channel(tmp_path: Any) -> None:
    """The typed clients' ``allocate`` and ``step_columns`` carry it, over HTTP and the
    step channel, with the in-process manager's results."""
    from servers import serve_process

    from kvcm_client import KVCacheClient

    sock = tmp_path / "step.sock"
    args = ("--layers", _layers(tmp_path), "--num-blocks", "64", "--tokens-per-block", "4")
    seq = list(range(40))
    with serve_process(*args, "--step-socket", str(sock)) as (url, _, _):
        for channel in (None, sock):
            with KVCacheClient(url, step_socket=channel) as kv:
                tag = "s" if channel else "h"
                first = kv.allocate(f"a{tag}", 17, token_ids=seq[:17])
                kv.commit(f"a{tag}", seq[first.num_hit_tokens : 17])
                info = kv.allocate(f"b{tag}", 40, token_ids=seq, max_new_tokens=5)
                assert (info.num_tokens, info.num_hit_tokens) == (21, 16)
                op = {"request_id": f"c{tag}", "num_tokens": 40, "token_ids": seq}
                out = kv.step_columns(allocate=[op | {"max_new_tokens": 3}], map_slots=True)
                assert list(out.hit_tokens) == [16]
                assert out.slot_mapping is not None and len(out.slot_mapping[0]) == 3


def _layers(tmp_path: Any) -> str:
    import json

    path = tmp_path / "layers.json"
    path.write_text(json.dumps([layer(0)]))
    return str(path)


def test_a_plain_allocate_is_unchanged_by_the_option() -> None:
    """Without ``max_new_tokens`` an allocate is what it was (the C core's path included):
    the same state as a manager that never saw the option."""
    m = manager([layer(0)], num_blocks=16)
    twin: KVCacheManager = copy.deepcopy(m)
    m.allocate("a", 9, token_ids=list(range(9)))
    twin.step_columns(allocate=[{"request_id": "a", "num_tokens": 9, "token_ids": list(range(9))}])
    assert same(manager_state(m), manager_state(twin))

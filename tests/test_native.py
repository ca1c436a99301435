"""kvcm's C core (``kvcm._native``) against its numpy and hashlib references.

Each test runs the same inputs through both paths (``kvcm.native.use``) and asserts equal
results and equal manager state: block ids, tables, counters, free order, edits.
"""

from __future__ import annotations

import hashlib
import os
import struct
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from helpers import CoreSpy, engine_handles, layer, manager, manager_state, same

from kvcm import InvalidArgument, native
from kvcm.hashing import block_keys, token_bytes

built = pytest.mark.skipif(not native.available(), reason="kvcm._native is not built")


pytestmark = pytest.mark.usefixtures("restore_native")


# -- SHA-256 and block keys ------------------------------------------------------------------


@pytest.fixture(params=[True, False], ids=["sha-extensions", "portable"])
def sha_core(request: pytest.FixtureRequest) -> Iterator[Any]:
    """The C core with its SHA-256 on the CPU's SHA extensions, or on portable C."""
    core = native._built
    if core is None:
        pytest.skip("kvcm._native is not built")
    if core.use_sha_extensions(request.param) != request.param:
        pytest.skip("this CPU has no SHA extensions")
    yield core
    core.use_sha_extensions(True)


def test_sha256_equals_hashlib(sha_core: Any, rng: np.random.Generator) -> None:
    # every padding case (0-200 bytes: one, two and three blocks), then longer inputs
    for n in [*range(201), 1000, 4096, 65537]:
        data = rng.bytes(n)
        assert sha_core.sha256(data) == hashlib.sha256(data).digest(), n


def _chain(parent: bytes, data: bytes, step: int) -> list[bytes]:
    keys = []
    for i in range(len(data) // step):
        parent = hashlib.sha256(parent + data[i * step : (i + 1) * step]).digest()
        keys.append(parent)
    return keys


def test_key_chain_equals_hashlib(sha_core: Any, rng: np.random.Generator) -> None:
    for tpb in (1, 2, 3, 16, 64, 257):
        for n in (0, tpb - 1, tpb, 5 * tpb + 1, 40 * tpb):
            parent = rng.bytes(32)
            data = rng.integers(0, 2**31, n, dtype=np.int64).astype("<i4").tobytes()
            assert sha_core.sha256_chain(parent, data, 4 * tpb) == _chain(parent, data, 4 * tpb)
    with pytest.raises(ValueError):
        sha_core.sha256_chain(b"short", b"", 4)


@built
def test_block_keys_are_the_same_with_and_without_the_core(rng: np.random.Generator) -> None:
    tokens = rng.integers(0, 50_000, 300).tolist()
    keys = {}
    for on in (True, False):
        native.use(on)
        keys[on] = [
            block_keys(tokens, 16),
            block_keys(tokens, 7, lora_id=3, cache_salt="tenant-a"),
            block_keys(tokens, 16, multimodal=[{"digest": "img", "start": 20, "length": 40}]),
        ]
    assert keys[True] == keys[False]
    # the hashing module's worked example: [5, 6, 7] with 2 tokens per block
    root = hashlib.sha256(b"kvcm/v1/root").digest()
    native.use(True)
    assert block_keys([5, 6, 7], 2) == [hashlib.sha256(root + struct.pack("<2i", 5, 6)).digest()]


# -- token ids -------------------------------------------------------------------------------


@built
def test_pack_tokens_takes_only_ids_in_range() -> None:
    core = native._built
    assert core is not None
    ids = [0, 1, 2**31 - 1, 65_536, 7]
    assert core.pack_tokens(ids) == struct.pack("<5i", *ids)
    assert core.pack_tokens(tuple(ids)) == struct.pack("<5i", *ids)
    assert core.pack_tokens([]) == b""
    assert core.pack_tokens([True, False]) == struct.pack("<2i", 1, 0)  # as struct does
    for bad in ([-1], [2**31], [2**70], [-(2**70)], ["1"], [1.0], [np.int64(3)], [None]):
        assert core.pack_tokens([5, *bad]) is None, bad  # the Python path names the error
    for other in ("abc", b"ab", np.arange(3), range(3), {1: 2}):
        assert core.pack_tokens(other) is None


@built
def test_pack_token_lists_packs_each_or_none() -> None:
    core = native._built
    assert core is not None
    lists = [[1, 2], [], (7,), [2**31 - 1]]
    assert core.pack_token_lists(lists) == [struct.pack(f"<{len(t)}i", *t) for t in lists]
    assert core.pack_token_lists(tuple(lists)) == core.pack_token_lists(lists)
    assert core.pack_token_lists([]) == []
    for bad in ([[1], [-1]], [[1], "ab"], [[1], np.arange(2)], [[1], [2**31]], "ab", [None]):
        assert core.pack_token_lists(bad) is None, bad


@built
def test_a_step_s_handle_lists_parse_the_same_with_and_without_the_core(
    rng: np.random.Generator,
) -> None:
    """``pack_handles`` takes lists and tuples of ints in int64's range; anything else
    (bools, numpy ints, floats, ints past int64) is left to the numpy path, whose error or
    value the step gets either way."""
    from kvcm.columnar_parse import _handles

    core = native._built
    assert core is not None
    edges = [0, -1, 2**63 - 1, -(2**63), (3 << 32) | 7]
    lists: list[Any] = [edges, tuple(edges), rng.integers(-(2**62), 2**62, 300).tolist()]
    for values in lists:
        assert core.pack_handles(values) == struct.pack(f"={len(values)}q", *values)
    odd: list[Any] = [[1, True], [np.int64(3)], [1.0], [2**63], [-(2**63) - 1], "ab", {1: 2}]
    for bad in odd:
        assert core.pack_handles(bad) is None, bad
    for values in [*lists, *odd, [2**64 - 1, 5]]:
        got = []
        for on in (True, False):
            native.use(on)
            try:
                got.append(_handles("free", values).tolist())
            except InvalidArgument as exc:
                got.append(exc.code)
        assert got[0] == got[1], values


@built
def test_token_bytes_is_the_same_with_and_without_the_core() -> None:
    cases: list[Any] = [[1, 2, 3], (4, 5), [], np.arange(6), [np.int32(9), 2], [True, 3]]
    bad: list[Any] = [[-1], [2**31], [2**64], ["x"], [1.5], "abc", b"\x00"]
    for on in (True, False):
        native.use(on)
        got = [token_bytes(c) for c in cases]
        assert got == [struct.pack(f"<{len(c)}i", *(int(x) for x in c)) for c in cases]
        for b in bad:
            with pytest.raises(InvalidArgument):
                token_bytes(b)


# -- a decode step's batch of extends --------------------------------------------------------


def _columns(
    rng: np.random.Generator, live: list[int], stale: list[int], big: bool
) -> dict[str, Any]:
    """An extend section of the shapes engines send, some of them for the general path."""
    handles = engine_handles(rng, live, stale)
    n = len(handles)
    cols: dict[str, Any] = {"extend": np.array(handles, dtype=np.int64)}
    r = rng.random()
    if r < 0.3:
        cols["num_new_tokens"] = rng.integers(1, 6, n)
    elif r < 0.4:  # a chunked prefill's chunks: several blocks per row
        cols["num_new_tokens"] = rng.integers(1, 40 if big else 12, n)
    elif r < 0.45:  # a strided column (made contiguous for the C path)
        cols["num_new_tokens"] = rng.integers(1, 3, 2 * n)[::2]
    if rng.random() < 0.3:  # speculative decoding's lookahead
        cols["lookahead"] = int(rng.integers(0, 4)) if rng.random() < 0.5 else rng.integers(0, 4, n)
    return cols


#: (layers, config): layer groups sharing a pool group or not, windows with and without
#: sinks, the null page, one token per block, and a pool large enough for chunked extends of
#: many blocks per row (the C path's work arrays grow).
_CONFIGS = [
    ([layer(0)], {}),
    ([layer(0), layer(1, owner="draft")], {}),
    ([layer(0), layer(1, owner="draft"), layer(2, head_dim=8, owner="draft")], {"null_page": True}),
    ([layer(0), layer(1, reuse="none", kv_factor=1)], {"tokens_per_block": 1, "num_blocks": 320}),
    ([layer(0), layer(1, sliding_window=8)], {}),
    (
        [
            layer(0, sliding_window=6, sink_tokens=2),
            layer(1),
            layer(2, kv_factor=1, sliding_window=13),
            layer(3, owner="draft"),
        ],
        {"null_page": True},
    ),
    (
        [layer(0, sliding_window=3), layer(1, sliding_window=5, sink_tokens=1)],
        {"tokens_per_block": 1, "num_blocks": 320},
    ),
    ([layer(0), layer(1, owner="draft")], {"num_blocks": 1000, "max_seq_len": 1024}),
    # a host tier: evicted cached blocks are offloaded, requests are suspended and resumed
    (
        [layer(0, sliding_window=6, sink_tokens=2), layer(1)],
        {"tokens_per_block": 2, "num_blocks": 48, "host_memory_bytes": 1 << 14},
    ),
]


@built
@pytest.mark.parametrize("seed", [1234, 0, 4])
@pytest.mark.parametrize("layers, kw", _CONFIGS)
def test_decode_batches_match_the_numpy_path(
    layers: list[dict[str, Any]], kw: dict[str, Any], seed: int
) -> None:
    """Random steps (frees, rewinds of rejected drafts, preemption to the host tier and back,
    allocates with prompts that hit and evict cached blocks, commits, then a batch of
    extends) on two managers, one with the C core and one without: same statuses, block
    counts and state after every step, device-table edits included."""
    rng = np.random.default_rng(seed)
    suspended: list[int] = []
    preempted = {"suspend": 0, "resume": 0}
    cfg = {"num_blocks": 64, "max_requests": 12, "max_seq_len": 96, **kw}
    ms = {on: manager(layers, **cfg) for on in (True, False)}
    for m in ms.values():
        m.parts.coord.edits = []  # as with a CUDA device
    spy = CoreSpy(ms[True])
    prompts = [rng.integers(0, 9, 24).tolist() for _ in range(3)]
    live: list[int] = []
    stale: list[int] = []
    for step in range(300):
        cols = _columns(rng, live, stale, cfg["num_blocks"] >= 1000)
        if live and rng.random() < 0.3:
            gone = [live.pop(int(rng.integers(len(live))))]
            if live and rng.random() < 0.3:
                gone.append(live.pop(int(rng.integers(len(live)))))
            cols["free"] = gone
            stale += gone
        commit = [h for h in live if rng.random() < 0.2]
        if commit:
            cols["commit"] = commit
            cols["commit_tokens"] = [rng.integers(0, 9, 3).tolist() for _ in commit]
        if rng.random() < 0.3:
            prompt = prompts[int(rng.integers(3))][: int(rng.integers(1, 25))]
            cols["allocate"] = [
                {"request_id": f"q{step}", "num_tokens": len(prompt), "token_ids": prompt}
            ]
            if rng.random() < 0.5:  # no prompt: no hit, a new row's blocks in one call
                n = int(rng.integers(1, 13))
                ahead = int(rng.integers(0, 4))
                new = {"request_id": f"n{step}", "num_tokens": n, "lookahead": ahead}
                cols["allocate"].append(new)
        if live and rng.random() < 0.15:  # a verified draft's rejected tokens
            cols["rewind"] = [live[int(rng.integers(len(live)))]]
            cols["rewind_tokens"] = int(rng.integers(1, 4))
        atomic = bool(rng.random() < 0.1)
        if "host_memory_bytes" in cfg and not atomic:  # preemption, and back
            if live and rng.random() < 0.1:
                cols["suspend"] = [live[int(rng.integers(len(live)))]]
            if suspended and rng.random() < 0.3:
                cols["resume"] = [suspended[int(rng.integers(len(suspended)))]]
        outs = {}
        for on, m in ms.items():
            native.use(on)
            native.core = spy if on else None
            outs[on] = m.step_columns(**cols, atomic=atomic)
        a, b = outs[True], outs[False]
        assert same(a.status, b.status), step
        for name in ("new_blocks", "handles", "hit_tokens", "allocate_new_blocks"):
            assert same(getattr(a, name), getattr(b, name)), (step, name)
        assert [(e.section, e.index, e.error.code) for e in a.errors] == [
            (e.section, e.index, e.error.code) for e in b.errors
        ]
        states = manager_state(ms[True]), manager_state(ms[False])
        differ = [i for i, (x, y) in enumerate(zip(*states, strict=True)) if not same(x, y)]
        assert not differ, (step, differ)
        if "suspend" in cols and a.status["suspend"][0] == 0:
            suspended.append(cols["suspend"][0])
            preempted["suspend"] += 1
        if "resume" in cols and a.status["resume"][0] == 0:
            suspended.remove(cols["resume"][0])  # it has its handle back
            live.append(cols["resume"][0])
            preempted["resume"] += 1
        live = [h for h in live if ms[True].parts.requests.handle[h & 0xFFFFFFFF] == h]
        live += [int(h) for h in a.handles if h]
    if "host_memory_bytes" in cfg:
        assert preempted["suspend"] > 3 and preempted["resume"] > 3
    # Every batch was planned in C or refused as the numpy plan refuses it (a stale, repeated
    # or unknown handle, a request at max_seq_len, a full pool): none needed the numpy plan.
    assert spy.planned > 20 and spy.deferred == 0
    assert spy.around > 5  # batches run around a stale handle or a request at max_seq_len
    # Every planned batch's new blocks were taken in C, some of them evicting cached blocks.
    assert spy.results["take tuple"] > 10 and spy.results["take False"] == 0, spy.results
    assert spy.results["take evict"] > 0, spy.results
    # Every planned batch's window releases ran in C (the layouts with a window).
    windows = any("sliding_window" in spec for spec in layers)
    assert (spy.results["window True"] > 10) == windows and not spy.results["window False"]
    # New rows and frees ran in C, a full pool's allocate was left to numpy to name its error.
    placed = sum(
        spy.results[k]
        for k in ("grow tuple", "start grow", "start hit", "allocate no hit", "allocate hit")
    )
    assert placed > 10 and spy.results["release tuple"] > 10, spy.results
    assert spy.results["grow bool"] == spy.results["release bool"] == 0, spy.results
    assert spy.results["start bool"] == 0, spy.results
    assert spy.results["grow released"] == 0  # an allocate's window releases nothing


@built
@pytest.mark.parametrize("new", [[1, 1, 100], [100, 1, 1], [100, 1, 100]])
def test_a_row_named_twice_runs_item_by_item_even_with_an_item_past_max_seq_len(
    new: list[int],
) -> None:
    """The numpy path refuses a batch whose live items repeat a row, also when one of them
    fails on its own (past max_seq_len): every item runs one by one, and the C path does the
    same (two layer groups in one pool: a batch would take other slots)."""
    got = []
    for on in (True, False):
        native.use(on)
        m = manager(
            [layer(0), layer(1, owner="draft")], tokens_per_block=4, max_seq_len=16, num_blocks=16
        )
        m.parts.coord.edits = []
        a, b = m.allocate("a", 4).handle, m.allocate("b", 4).handle
        out = m.step_columns(extend=[a, b, a], num_new_tokens=new)
        got.append((out.status["extend"].tolist(), out.new_blocks.tolist(), manager_state(m)))
    assert same(got[0], got[1])


@built
def test_decode_batch_exact_tables() -> None:
    """The worked example of kvcm.native_step: rows at 16 and 20 tokens, +1 token each."""
    native.use(True)
    m = manager([layer(0)], tokens_per_block=16, num_blocks=8, max_seq_len=256)
    a = m.allocate("a", 16)
    b = m.allocate("b", 20)
    assert m.block_table("a") == [[0]] and m.block_table("b") == [[1, 2]]
    out = m.step_columns(extend=[a.handle, b.handle])
    assert out.new_blocks.tolist() == [1, 0]
    assert m.block_table("a") == [[0, 3]] and m.block_table("b") == [[1, 2]]
    assert [m.request("a").num_tokens, m.request("b").num_tokens] == [17, 21]
    assert m.num_free_blocks() == 4


@built
@pytest.mark.parametrize("on", [True, False])
def test_a_window_releasing_a_shared_page_frees_no_room(on: bool) -> None:
    """b shares a's blocks 1 and 2 by a prefix hit (window 8, 4 tokens per block). Growing to
    17 tokens releases b's block 1, which a still holds, so it frees nothing: b's new block
    does not fit in a full pool, on both paths, and nothing changes; c's extend runs."""
    native.use(on)
    m = manager([layer(0, sliding_window=8)], num_blocks=8, max_seq_len=64)
    prompt = list(range(12))
    m.allocate("a", 12, token_ids=prompt)
    m.commit("a", prompt)
    b = m.allocate("b", 13, token_ids=[*prompt, 99])
    c = m.allocate("c", 2)
    m.allocate("fill", 4 * m.num_free_blocks())
    assert m.block_table("a") == [[0, 1, 2]] and m.block_table("b") == [[-1, 1, 2, 3]]
    out = m.step_columns(extend=[b.handle, c.handle], num_new_tokens=[3, 1])  # 16 and 3
    assert out.status["extend"].tolist() == [0, 0] and m.num_free_blocks() == 0
    tables = m.parts.coord.tables.copy()
    out = m.step_columns(extend=[b.handle, c.handle])
    assert [e.error.code for e in out.errors] == ["out_of_blocks"]
    assert out.status["extend"][1] == 0 and m.request("c").num_tokens == 4
    assert m.request("b").num_tokens == 16 and m.block_table("b") == [[-1, 1, 2, 3]]
    assert np.array_equal(m.parts.coord.tables, tables) and m.num_free_blocks() == 0
    assert m.parts.coord.refs[0][1] == 2


@built
def test_decode_plan_leaves_to_numpy_what_it_does_not_plan() -> None:
    """False (the numpy plan decides), changing nothing: columns the parser never makes (a
    strided or int32 column, counts out of range); None for a batch numpy refuses too."""
    core = native._built
    assert core is not None
    m = manager([layer(0)], max_seq_len=64)
    handles = np.array([m.allocate(r, 5).handle for r in "ab"], dtype=np.int64)
    nd = m.parts.native_decode
    ctx, free = nd.context(m.parts), (m.num_free_blocks(),)
    before = manager_state(m)
    for new, ahead in [
        (np.array([1, 9, 1, 9])[::2], 0),  # strided
        (np.array([1, 1], dtype=np.int32), 0),
        (0, 0),
        (2**40, 0),
        (1, -1),
        (1, 2**31),
        (np.array([1, 2**62]), 0),
    ]:
        assert core.decode_plan(handles, new, ahead, ctx, free, nd.out) is False, (new, ahead)
    assert (
        core.decode_plan(handles[::-1].copy(), 1, 0, ctx, free, nd.out)
        == ((0,), (0,), [])  # 6 tokens fit 2 blocks
    )
    assert core.decode_plan(np.append(handles, handles[0]), 1, 0, ctx, free, nd.out) is None
    assert core.decode_plan(handles, 60, 0, ctx, free, nd.out) is None  # past max_seq_len
    assert core.decode_plan(handles, 30, 0, ctx, (0,), nd.out) is None  # no room
    assert same(manager_state(m), before)


@built
def test_decode_plan_can_leave_out_the_items_that_fail_on_their_own() -> None:
    """With skip: a stale handle and a request that would pass max_seq_len are listed and
    left out (row -1), the others planned; without it the batch is refused. More items than
    rows: the numpy path decides."""
    core = native._built
    assert core is not None
    m = manager([layer(0)], max_seq_len=64, max_requests=4, num_blocks=32)
    a, b, c = (m.allocate(r, n).handle for r, n in (("a", 4), ("b", 60), ("c", 5)))
    m.free("c")
    nd = m.parts.native_decode
    ctx, free = nd.context(m.parts), (m.num_free_blocks(),)
    before = manager_state(m)
    handles = np.array([a, c, b], dtype=np.int64)  # c is stale; b + 5 > 64
    assert core.decode_plan(handles, 5, 0, ctx, free, nd.out) is None
    assert core.decode_plan(handles, 5, 0, ctx, free, nd.out, True) == ((2,), (0,), [1, 2])
    assert nd.rows[:3].tolist() == [0, -1, -1]
    assert nd.out[1][0, :2].tolist() == [0, 0] and nd.out[2][0, :2].tolist() == [1, 2]  # a: 9
    many = np.array([a, c, c, c, c], dtype=np.int64)
    assert core.decode_plan(many, 1, 0, ctx, free, nd.out, True) is False
    assert core.decode_plan(handles, 2**70, 0, ctx, free, nd.out, True) is False  # no int64
    assert core.decode_plan(np.array([a, a]), np.array([5, 60]), 0, ctx, free, nd.out, True) is None
    assert same(manager_state(m), before)
    out = m.step_columns(extend=handles, num_new_tokens=5)
    assert out.status["extend"].tolist()[0] == 0 and [e.index for e in out.errors] == [1, 2]
    assert m.request("a").num_tokens == 9 and m.request("b").num_tokens == 60


@built
def test_decode_commit_checks_every_row_before_writing_any() -> None:
    core = native._built
    assert core is not None
    m = manager([layer(0)])
    m.allocate("a", 5)
    ctx = m.parts.native_decode.context(m.parts)
    before = manager_state(m)
    added = np.zeros(2, dtype=np.int32)
    for rows, new in [(np.array([0, 99]), 1), (np.array([0, -1]), 1), (np.array([0, 1]), 0)]:
        with pytest.raises(ValueError):
            core.decode_commit(rows, new, 0, ctx, added)
    with pytest.raises(TypeError):  # a float32 result array is no int32 one
        core.decode_commit(np.array([0, 1]), 1, 0, ctx, np.zeros(2, dtype=np.float32))
    with pytest.raises(ValueError):
        core.decode_commit(np.array([0, 1]), 1, 0, ctx[:5], added)
    assert same(manager_state(m), before)


def test_the_numpy_path_serves_context_parallel_ranks() -> None:
    """The C path is only for plans without per-class parts."""
    assert manager([layer(0), layer(1)]).parts.coord.plain
    assert manager([layer(0, sliding_window=8)]).parts.coord.plain
    ranks = [{"device": "cpu", "layers": [layer(0)], "cp_rank": c} for c in range(2)]
    assert not manager([layer(0)], context_parallel=2, ranks=ranks).parts.coord.plain


@pytest.mark.skipif(os.environ.get("KVCM_REQUIRE_NATIVE") != "1", reason="not required here")
def test_the_core_is_built_where_required() -> None:
    """CI sets KVCM_REQUIRE_NATIVE=1: a build that silently skipped the C core fails there."""
    assert native.available() and native.core is not None


def test_kvcm_native_0_turns_the_core_off() -> None:
    env = {**os.environ, "KVCM_NATIVE": "0"}
    code = "from kvcm import native; print(native.core is None, native.summary())"
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    )
    expected = "numpy (KVCM_NATIVE=0)" if native.available() else "numpy (kvcm._native not built)"
    assert out.stdout.strip() == f"True {expected}"


def test_a_stale_build_is_left_unused() -> None:
    """An extension built from older sources (another ``API``) is not called: its functions
    may take other arguments. kvcm runs numpy and says why."""
    code = (
        "import sys, types\n"
        "fake = types.ModuleType('kvcm._native')\n"
        "fake.API, fake.HAVE_SHA_EXTENSIONS = -1, 1\n"
        "sys.modules['kvcm._native'] = fake\n"
        "from kvcm import native\n"
        "print(native.core is None, native.stale, native.available(), native.summary())\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == (
        "True True False numpy (kvcm._native is stale: rebuild it, e.g. bash scripts/setup)"
    )
    if native.available():
        assert native._built is not None and native._built.API == native.API


@built
def test_live_rows_says_whether_a_batch_of_handles_is_live_and_distinct() -> None:
    """The worked example, then random batches against ``handle_rows`` and ``distinct_rows``
    (the numpy path): stale handles, repeated rows, rows past the table, negative and huge
    handles, more items than rows."""

    core = native._built
    m = manager([layer(0)], max_requests=8, num_blocks=32)
    handles = [m.allocate(f"r{i}", 3).handle for i in range(6)]
    stale = handles[5]
    m.free("r5")
    fresh = m.allocate("r6", 3).handle  # row 5 again, a new handle
    assert fresh & 0xFFFFFFFF == stale & 0xFFFFFFFF and fresh != stale
    context, out = m.parts.native_decode.arrays(core, m.parts), np.full(16, -7, dtype=np.int64)

    def live_rows(batch: list[int]) -> bool:
        return bool(core.live_rows(np.array(batch, dtype=np.int64), context, out))

    assert live_rows([handles[2], handles[0]]) and out[:2].tolist() == [2, 0]
    assert not live_rows([handles[2], handles[2]])  # a row twice
    assert not live_rows([handles[1], stale])  # a freed request's handle
    assert live_rows([]) and live_rows([fresh])
    pool = [*handles[:5], fresh, stale, -1, 0, 8, 1 << 40 | 2, -(1 << 63), (1 << 63) - 1]
    rng = np.random.default_rng(5)
    for _ in range(300):
        batch = np.array(rng.choice(pool, int(rng.integers(0, 10))), dtype=np.int64)
        rows, live = m.parts.requests.handle_rows(batch)
        expected = live is None and m.parts.requests.distinct_rows(rows)
        assert core.live_rows(batch, context, out) is expected, batch
        if expected:
            assert out[: batch.size].tolist() == rows.tolist()
    many = np.array(handles[:5] * 2, dtype=np.int64)  # more items than rows
    assert core.live_rows(many, context, out[:4]) is False
    with pytest.raises(ValueError):
        core.live_rows(np.array(handles[:3], dtype=np.int64), context, out[:2])


@built
def test_decode_take_takes_from_the_head_and_leaves_odd_input_to_numpy() -> None:
    """decode_take's worked example: rows [5 8 6], items [0 2], positions [1 4]: table[0][5,
    1] and table[0][6, 4] get the queue's first two slots, held once. An item, row or
    position out of range, more items than the arrays hold, or a queue entry past the
    slots: False, nothing changed."""
    core = native._built
    m = manager([layer(0)], max_requests=12, num_blocks=32, max_seq_len=64)
    for i in range(9):
        m.allocate(f"r{i}", 4)  # rows 0-8, a block each
    c, nd = m.parts.coord, m.parts.native_decode
    context, pools, _ = nd.row_args(core, m.parts)
    rows = np.array([5, 8, 6], dtype=np.int64)
    items, positions = np.zeros((1, 4), dtype=np.int64), np.zeros((1, 4), dtype=np.int64)
    items[0, :2], positions[0, :2] = [0, 2], [1, 4]
    head = c.pools[0].free_order()[:3].tolist()
    before = manager_state(m)

    def take(r: np.ndarray, i: np.ndarray, p: np.ndarray, added: int = 2, log: Any = None) -> Any:
        return core.decode_take(r, (added,), context, pools, nd.cached(m.parts), i, p, log)

    # rows: 3 from the middle of a longer array of valid rows, so that a read before or
    # after them would find a valid row and only the bounds checks refuse it.
    inner = np.array([5, 8, 6, 7, 7], dtype=np.int64)[1:4]
    for bad in ([0, 3], [-1, 2]):  # an item past the rows, a negative one
        assert take(inner, np.array([[*bad, 0, 0]]), positions) is False
    for bad_row in (12, -1):  # a row past the table, a negative one
        assert take(np.array([5, 8, bad_row]), items, positions) is False
    for bad_position in (c.tables.shape[2], -1):
        assert take(rows, items, np.array([[1, bad_position, 0, 0]])) is False
    assert take(rows, items, positions, added=5) is False  # more than the arrays hold
    assert same(manager_state(m), before)
    ring = c.pools[0]._ring
    at = c.pools[0]._head % ring.size
    ring[at] = c.refs[0].size  # a queue entry past the slots
    corrupt = manager_state(m)
    assert take(rows, items, positions) is False and same(manager_state(m), corrupt)
    ring[at] = head[0]
    with pytest.raises(ValueError, match="edit log"):  # a log of the wrong size
        take(rows, items, positions, log=np.zeros((3, 4), dtype=np.int64))
    assert same(manager_state(m), before)
    # Dry (a rehearsal's): the same checks and answer, nothing written, the log untouched.
    log = np.full((2, 4), -7, dtype=np.int64)
    dry = core.decode_take(
        rows, (2,), context, pools, nd.cached(m.parts), items, positions, log, True
    )
    assert dry == (False,) and same(manager_state(m), before) and (log == -7).all()
    bad_items = np.array([[0, 3, 0, 0]])  # an item past the rows: refused, dry too
    cached = nd.cached(m.parts)
    refused = core.decode_take(inner, (2,), context, pools, cached, bad_items, positions, None, 1)
    assert refused is False and same(manager_state(m), before)
    assert take(rows, items, positions, log=log) == (False,)  # nothing cached
    assert c.tables[0][5, 1] == head[0] and c.tables[0][6, 4] == head[1]
    assert log.tolist() == [[0, 5, 1, head[0]], [0, 6, 4, head[1]]]  # the edits, in order
    assert c.refs[0][head[:2]].tolist() == [1, 1]
    assert c.pools[0].free_order()[0] == head[2]


@built
def test_decode_release_frees_each_slot_once_and_leaves_odd_input_to_numpy() -> None:
    """decode_release's worked example: rows [5 8], items [0 1], positions [0 0]: the slot of
    row 5's cell, held once, joins the queue's tail; row 8's, held twice, stays held once;
    both cells are emptied. A slot named by more cells than hold it, an item, row or
    position out of range: False, nothing changed."""
    core = native._built
    m = manager([layer(0, sliding_window=8)], max_requests=12, num_blocks=32, max_seq_len=64)
    for i in range(9):
        m.allocate(f"r{i}", 4)  # rows 0-8, a block each
    c, nd = m.parts.coord, m.parts.native_decode
    context, pools, _ = nd.row_args(core, m.parts)
    a, b = int(c.tables[0][5, 0]), int(c.tables[0][8, 0])
    c.refs[0][b] = 2  # as if another row shared it
    rows = np.array([5, 8], dtype=np.int64)
    items, positions = np.zeros((1, 4), dtype=np.int64), np.zeros((1, 4), dtype=np.int64)
    items[0, :2] = [0, 1]
    before = manager_state(m)

    def release(r: np.ndarray, i: np.ndarray, p: np.ndarray, k: int = 2, log: Any = None) -> Any:
        return core.decode_release(r, (k,), context, pools, i, p, log)

    assert release(rows, np.array([[0, 2, 0, 0]]), positions) is False  # an item past rows
    assert release(np.array([5, 12]), items, positions) is False  # a row past the table
    assert release(rows, items, np.array([[0, c.tables.shape[2], 0, 0]])) is False
    assert release(rows, items, positions, k=5) is False  # more than the arrays hold
    assert release(rows, np.array([[0, 0, 0, 0]]), positions) is False  # a held-once slot twice
    assert same(manager_state(m), before)
    with pytest.raises(ValueError, match="edit log"):  # a log of the wrong size
        release(rows, items, positions, log=np.zeros((1, 4), dtype=np.int64))
    assert same(manager_state(m), before)
    tail = c.pools[0].free_order().tolist()
    log = np.full((2, 4), -7, dtype=np.int64)
    assert release(rows, items, positions, log=log) is True
    assert log.tolist() == [[0, 5, 0, c.empty], [0, 8, 0, c.empty]]
    assert c.pools[0].free_order().tolist() == [*tail, a]
    assert c.refs[0][a] == 0 and c.refs[0][b] == 1
    assert c.tables[0][5, 0] == c.tables[0][8, 0] == c.empty
    assert c.pools[0].num_free == len(tail) + 1


@built
def test_decode_release_counts_drops_across_groups_and_cells_named_twice() -> None:
    """Two layer groups of one pool group name one slot held twice: the first drop frees
    nothing, the second puts it on the queue, once, and the queue's counters say so (as
    ``Coordinator.unref`` group after group). A cell named twice in one group, its slot held
    twice: one push, the cell emptied."""
    core = native._built
    m = manager([layer(0, sliding_window=8), layer(1)], max_requests=12, num_blocks=40)
    for i in range(9):
        m.allocate(f"r{i}", 4)
    c, nd = m.parts.coord, m.parts.native_decode
    assert c.group_pool[0] == c.group_pool[1]
    context, pools, _ = nd.row_args(core, m.parts)
    rows = np.array([5, 8], dtype=np.int64)
    positions = np.zeros((2, 4), dtype=np.int64)
    items = np.zeros((2, 4), dtype=np.int64)
    items[1, 0] = 1  # group 0: row 5's cell; group 1: row 8's
    a = int(c.tables[0][5, 0])
    c.tables[1][8, 0] = a  # (its own slot is left aside: this state is made up)
    c.refs[0][a] = 2
    tail = c.pools[0].free_order().tolist()
    assert core.decode_release(rows, (1, 1), context, pools, items, positions, None) is True
    assert c.pools[0].free_order().tolist() == [*tail, a]
    assert c.pools[0].num_free == len(tail) + 1 and c.refs[0][a] == 0
    b = int(c.tables[0][6, 0])
    c.refs[0][b] = 2
    twice = np.zeros((2, 4), dtype=np.int64)  # row 6's cell, twice
    rows = np.array([6], dtype=np.int64)
    assert core.decode_release(rows, (2, 0), context, pools, twice, positions, None) is True
    assert c.pools[0].free_order().tolist() == [*tail, a, b]
    assert c.refs[0][b] == 0 and c.tables[0][6, 0] == c.empty


@built
@pytest.mark.parametrize("seed", range(5))
def test_map_slots_equals_the_numpy_mapping(seed: int) -> None:
    """``map_slots`` (the CPU's step mapping in C) against ``slot_mapping_host`` (numpy) on
    random tables of several groups with -1 and null-page entries, items of 0 tokens
    included; rows and blocks outside the tables are refused with nothing written."""
    import kvcm_kernels

    core = native._built
    assert core is not None
    rng = np.random.default_rng(seed)
    groups, table_rows, cols, tpb = int(rng.integers(1, 4)), 12, 7, int(rng.choice([1, 4, 16]))
    tables = rng.integers(-1, 90, size=(groups, table_rows, cols)).astype(np.int32)
    n = int(rng.integers(0, 8))
    rows = rng.integers(0, table_rows, n).astype(np.int64)
    counts = rng.integers(0, 5, n).astype(np.int64)
    starts = np.array(
        [int(rng.integers(0, cols * tpb - c + 1)) for c in counts.tolist()], dtype=np.int64
    )
    total = int(counts.sum())
    for min_live in (0, 1):
        out = np.full((groups, total), 7, dtype=np.int64)
        core.map_slots(tables, table_rows, cols, (rows, starts, counts), tpb, min_live, out)
        items = np.repeat(np.arange(n), counts)
        offsets = np.arange(total) - np.repeat(np.cumsum(counts) - counts, counts)
        want = kvcm_kernels.slot_mapping_host(
            tables, rows[items], starts[items] + offsets, tpb, total, min_live
        )
        assert out.tolist() == want.tolist()
    bad_row = np.array([table_rows], dtype=np.int64)
    past = np.array([cols * tpb - 1], dtype=np.int64)
    out = np.full((groups, 2), 7, dtype=np.int64)
    for r, s in ((bad_row, np.zeros(1, np.int64)), (np.zeros(1, np.int64), past)):
        with pytest.raises(ValueError, match="outside"):
            core.map_slots(tables, table_rows, cols, (r, s, np.array([2])), tpb, 0, out)
        assert (out == 7).all()
    with pytest.raises(ValueError, match="groups, tokens"):
        wrong = np.empty((groups, total + 1), dtype=np.int64)
        core.map_slots(tables, table_rows, cols, (rows, starts, counts), tpb, 0, wrong)


@built
@pytest.mark.parametrize("seed", range(3))
def test_map_slots_of_a_decode_batch_equals_its_explicit_items(seed: int) -> None:
    """A decode batch's items ``(handles, lengths, n)``: each handle's row (its low 32 bits;
    the serial above them ignored) maps its last ``n`` positions, as the explicit items;
    a handle whose row is past the tables or the lengths, or a row shorter than ``n``, is
    refused with nothing written."""
    from kvcm.mapped_items import expand_items

    core = native._built
    assert core is not None
    rng = np.random.default_rng(seed)
    groups, table_rows, cols, tpb = int(rng.integers(1, 4)), 10, 6, int(rng.choice([1, 4, 16]))
    tables = rng.integers(-1, 90, size=(groups, table_rows, cols)).astype(np.int32)
    lengths = rng.integers(3, cols * tpb + 1, table_rows).astype(np.int64)
    rows = rng.permutation(table_rows)[: int(rng.integers(1, table_rows))]
    handles = (rng.integers(1, 2**31 - 1, rows.size) << 32) | rows
    for each in (1, 3):
        decode = (handles, lengths, each)
        out = np.full((groups, rows.size * each), -7, dtype=np.int64)
        core.map_slots(tables, table_rows, cols, decode, tpb, 1, out)
        explicit = expand_items(decode)
        assert explicit[0].tolist() == rows.tolist()
        want = np.full_like(out, -7)
        core.map_slots(tables, table_rows, cols, explicit, tpb, 1, want)
        assert out.tolist() == want.tolist()
        assert (out != -7).all()  # every entry written
    short = lengths.copy()
    short[rows[0]] = 1
    bad = [
        (np.array([table_rows], np.int64), lengths, 1),  # a row past the tables
        (handles[:1], lengths[: rows[0]], 1),  # a row past the lengths
        (handles[:1], short, 2),  # two positions of a 1-token row
    ]
    for items in bad:
        out = np.full((groups, items[0].size * items[2]), -7, dtype=np.int64)
        with pytest.raises(ValueError, match="outside"):
            core.map_slots(tables, table_rows, cols, items, tpb, 0, out)
        assert (out == -7).all()


class _FakeDriver:
    """cuLaunchKernel, cuEventRecord and cuEventSynchronize as ctypes callbacks: what
    ``step_launch`` passes the driver, recorded (each kernel argument read from its slot as
    the driver would: a pointer's 8 bytes, an int's low 4; a wait with the staging buffer's
    first entry as it finds it), with the result codes a test sets."""

    INTS = (2, 7, 8, 9, 10, 11, 12, 13, 14, 15)  # the kernel's int parameters

    def __init__(self) -> None:
        import ctypes

        self.launches: list[dict[str, Any]] = []
        self.records: list[tuple[int, int]] = []
        self.waits: list[tuple[int, int | None]] = []
        self.watch: np.ndarray | None = None  # the staging buffer a wait looks at
        self.launch_code = 0
        self.record_code = 0
        #: The one event whose record fails with ``record_code`` (None: every record).
        self.failing_event: int | None = None
        self.sync_code = 0
        u, vp = ctypes.c_uint, ctypes.c_void_p
        launch_t = ctypes.CFUNCTYPE(
            ctypes.c_int, vp, u, u, u, u, u, u, u, vp, ctypes.POINTER(vp), vp
        )
        record_t = ctypes.CFUNCTYPE(ctypes.c_int, vp, vp)
        sync_t = ctypes.CFUNCTYPE(ctypes.c_int, vp)

        def launch(f, gx, gy, gz, bx, by, bz, shared, stream, params, extra):
            values = []
            for i in range(16):
                kind = ctypes.c_int32 if i in self.INTS else ctypes.c_uint64
                values.append(ctypes.cast(params[i], ctypes.POINTER(kind))[0])
            self.launches.append(
                {
                    "kernel": f,
                    "grid": (gx, gy, gz),
                    "block": (bx, by, bz),
                    "shared": shared,
                    "stream": stream,
                    "args": values,
                    "extra": extra,
                }
            )
            return self.launch_code

        def record(event, stream):
            self.records.append((event, stream))
            return self.record_code if self.failing_event in (None, event) else 0

        def sync(event):
            self.waits.append((event, None if self.watch is None else int(self.watch[0])))
            return self.sync_code

        self._callbacks = (launch_t(launch), record_t(record), sync_t(sync))  # kept alive
        self.addresses = [ctypes.cast(cb, ctypes.c_void_p).value for cb in self._callbacks]


@built
def test_step_launch_packs_the_inputs_and_launches_once() -> None:
    """``step_launch`` (the CUDA step's launch in C) against a fake driver: the packed
    buffer holds rows | query_start_loc | positions | edits, the kernel's sixteen arguments
    point into it, the launch is one 1024-thread block on the given stream with the
    query_start_loc staged in shared memory, and the buffer's event is recorded after it;
    the decode form packs what its explicit items pack. Bad sizes launch nothing and write
    nothing; a driver error is a RuntimeError with its code."""
    from kvcm.mapped_items import expand_items

    core = native._built
    assert core is not None
    fake = _FakeDriver()
    kernel, tables_ptr, groups, table_rows, cols, tpb = 0xABC, 0x7000, 3, 8, 5, 4
    min_live = 1
    consts = np.array(
        [*fake.addresses, kernel, tables_ptr, groups, table_rows, cols, tpb, min_live, 1024, 4096],
        dtype=np.int64,
    )
    buf = np.full(64, -9, dtype=np.int64)
    address = buf.ctypes.data
    edits = np.array([[0, 3, 1, 9], [1, 0, 0, 4]], dtype=np.int64)
    rows, starts, counts = (np.array(v, np.int64) for v in ([3, 0], [6, 0], [1, 2]))
    core.step_launch(
        consts, address, 64, (rows, starts, counts), edits, 0xD00, 8, 0, 2, 0x55, 0x66, 0
    )
    size = 2 + 3 + 3 + 8
    assert buf[:size].tolist() == [3, 0, 0, 1, 3, 6, 0, 1, *edits.reshape(-1).tolist()]
    assert (buf[size:] == -9).all()
    (call,) = fake.launches
    assert call["kernel"] == kernel and call["stream"] == 0x55 and call["extra"] is None
    assert call["grid"] == (1, 1, 1) and call["block"] == (1024, 1, 1)
    assert call["shared"] == 8 * 3  # query_start_loc staged: n + 1 entries
    a = call["args"]
    assert a == [
        tables_ptr,
        address + 8 * 8,  # the edits, after rows (2), query_start_loc (3), positions (3)
        2,
        address,
        address + 16,
        address + 40,
        0xD00,
        2,  # n
        8,  # pad_to
        0,  # first group
        2,  # groups
        table_rows,
        cols,
        tpb,
        min_live,
        1,  # staged
    ]
    assert fake.records == [(0x66, 0x55)]

    # A decode batch (handles with serials, 1 token each) packs as its explicit items.
    lengths = np.arange(10, 10 + table_rows, dtype=np.int64)
    handles = np.array([(5 << 32) | 3, (9 << 32) | 0], dtype=np.int64)
    decode = (handles, lengths, 1)
    want = np.full(64, -9, dtype=np.int64)
    core.step_launch(consts, want.ctypes.data, 64, expand_items(decode), edits, 1, 2, 0, 1, 1, 0, 0)
    buf[:] = -9
    core.step_launch(consts, address, 64, decode, edits, 1, 2, 0, 1, 1, 0, 0)
    assert buf.tolist() == want.tolist() and buf[:2].tolist() == [3, 0]
    assert len(fake.records) == 1  # event 0: nothing recorded

    # Refused with nothing written or launched: too little room, pad_to below the tokens,
    # an item outside the tables, edits not [E, 4], groups outside the tables, counts whose
    # sums would overflow (a start past int64 by its count; a row's length below zero with
    # a huge count: start = length - n wraps around).
    buf[:] = -9
    launches = len(fake.launches)
    huge = np.iinfo(np.int64).max
    negative = lengths.copy()
    negative[3] = -2
    fine = (rows, starts, counts)
    bad = [
        (15, fine, edits, 8, 0, 1),
        (64, fine, edits, 2, 0, 1),
        (64, (np.array([table_rows, 0]), starts, counts), edits, 8, 0, 1),
        (64, fine, edits.reshape(-1)[:7].copy(), 8, 0, 1),
        (64, fine, edits, 8, 2, 2),  # groups 2 and 3 of 3
        (64, fine, edits, 8, 0, 0),  # no group
        (
            64,
            (np.zeros(3, np.int64), np.array([2, 2, 0]), np.array([huge, huge, 6])),
            edits,
            8,
            0,
            1,
        ),
        (64, (np.array([3, 3], np.int64), negative, huge), edits, 8, 0, 1),
    ]
    for capacity, items, e, pad_to, first, num in bad:
        with pytest.raises(ValueError):
            core.step_launch(consts, address, capacity, items, e, 1, pad_to, first, num, 1, 0, 5)
    assert (buf == -9).all() and len(fake.launches) == launches and not fake.waits
    out = np.full((1, 6), -7, dtype=np.int64)  # map_slots reads items the same way
    tables = np.zeros((1, table_rows, cols), dtype=np.int32)
    for items in (bad[-2][1], bad[-1][1]):
        with pytest.raises(ValueError, match="outside"):
            core.map_slots(tables, table_rows, cols, items, tpb, 0, out)
    assert (out == -7).all()

    # A wait for the buffer's last reader comes before the buffer is written; a failed
    # wait writes and launches nothing.
    buf[:] = -9
    fake.watch = buf
    core.step_launch(consts, address, 64, decode, edits, 1, 2, 0, 1, 1, 0, 0x77)
    assert fake.waits == [(0x77, -9)] and buf.tolist() == want.tolist()
    fake.sync_code = 700
    buf[:] = -9
    with pytest.raises(RuntimeError, match="cuEventSynchronize failed \\(CUresult 700\\)"):
        core.step_launch(consts, address, 64, decode, edits, 1, 2, 0, 1, 1, 0, 0x77)
    assert (buf == -9).all() and len(fake.launches) == launches + 1
    fake.sync_code = 0

    fake.launch_code = 719
    with pytest.raises(RuntimeError, match="cuLaunchKernel failed \\(CUresult 719\\)"):
        core.step_launch(consts, address, 64, decode, edits, 1, 2, 0, 1, 1, 7, 0)
    assert len(fake.records) == 1  # no record after a failed launch
    fake.launch_code, fake.record_code = 0, 400
    with pytest.raises(RuntimeError, match="cuEventRecord failed \\(CUresult 400\\)"):
        core.step_launch(consts, address, 64, decode, edits, 1, 2, 0, 1, 1, 7, 0)


@built
def test_step_launch_of_edits_alone_records_the_step_event_after_the_fence() -> None:
    """A stream-ordered step's edits (``DeviceTables.publish``): no items, no group and
    pad_to 0 launch the kernel on the edits alone, and the optional step event is recorded
    after the staging buffer's fence, on the same stream; no group with a pad_to, or past
    the tables, is refused; a failed fence record leaves the step event unrecorded, and a
    failed step event record is an error too."""
    core = native._built
    assert core is not None
    fake = _FakeDriver()
    kernel, tables_ptr, groups, table_rows, cols, tpb = 0xABC, 0x7000, 2, 8, 5, 4
    consts = np.array(
        [*fake.addresses, kernel, tables_ptr, groups, table_rows, cols, tpb, 1, 1024, 4096],
        dtype=np.int64,
    )
    buf = np.full(16, -9, dtype=np.int64)
    address = buf.ctypes.data
    edits = np.array([[0, 3, 1, 9], [1, 0, 0, 4]], dtype=np.int64)
    none = (np.empty(0, np.int64), np.empty(0, np.int64), 1)
    core.step_launch(consts, address, 16, none, edits, 0, 0, 0, 0, 0x55, 0x66, 0, 0x88)
    assert buf[:9].tolist() == [0, *edits.reshape(-1).tolist()] and (buf[9:] == -9).all()
    (call,) = fake.launches
    a = call["args"]
    assert a[1:4] == [address + 8, 2, address]  # the edits after query_start_loc [0]
    assert a[6:11] == [0, 0, 0, 0, 0]  # no output, n, pad_to, first group, groups
    assert call["shared"] == 8 and call["stream"] == 0x55
    assert fake.records == [(0x66, 0x55), (0x88, 0x55)]

    # Refused: no group with pad_to 8 (the edits alone have no mapping), no group past the
    # tables' last.
    buf[:] = -9
    for pad_to, first in ((8, 0), (0, groups + 1)):
        with pytest.raises(ValueError, match="inconsistent sizes"):
            core.step_launch(consts, address, 16, none, edits, 0, pad_to, first, 0, 0x55, 0x66, 0)
    assert (buf == -9).all() and len(fake.launches) == 1

    # The fence's record fails: the step event is not recorded after it; the step event's
    # own record fails: an error too, after the fence's.
    fake.record_code = 400
    fake.failing_event = 0x66
    with pytest.raises(RuntimeError, match="cuEventRecord failed"):
        core.step_launch(consts, address, 16, none, edits, 0, 0, 0, 0, 0x55, 0x66, 0, 0x88)
    assert fake.records[2:] == [(0x66, 0x55)]
    fake.failing_event = 0x88
    with pytest.raises(RuntimeError, match="cuEventRecord failed \\(CUresult 400\\)"):
        core.step_launch(consts, address, 16, none, edits, 0, 0, 0, 0, 0x55, 0x66, 0, 0x88)
    assert fake.records[3:] == [(0x66, 0x55), (0x88, 0x55)]

"""A new request's blocks and a freed request's blocks in C (``kvcm.native_rows``) against the
coordinator's numpy path: the same slots in the same order, tables, references, free order,
cache index and device-table edits (``helpers.manager_state``)."""

from __future__ import annotations

import copy
from collections import Counter
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from helpers import CoreSpy, layer, manager, manager_state, same

from kvcm import KVCacheManager, KVCMError, OutOfBlocks, native

pytestmark = [
    pytest.mark.skipif(not native.available(), reason="kvcm._native is not built"),
    pytest.mark.usefixtures("restore_native"),
]


def _both(
    layers: list[dict[str, Any]], ops: list[Callable[[KVCacheManager], Any]], **kw: Any
) -> tuple[dict[bool, KVCacheManager], CoreSpy]:
    """Run ``ops`` on a manager with the C core and on one without, comparing results (or
    error codes) and state after each op."""
    ms = {on: manager(layers, **kw) for on in (True, False)}
    for m in ms.values():
        m.parts.coord.edits = []  # as with a CUDA device
    spy = CoreSpy(ms[True])
    for i, op in enumerate(ops):
        got = {}
        for on, m in ms.items():
            native.use(on)
            native.core = spy if on else None
            try:
                got[on] = op(m)
            except OutOfBlocks as exc:
                got[on] = exc.code
        assert got[True] == got[False], i
        assert same(manager_state(ms[True]), manager_state(ms[False])), i
    return ms, spy


def _guarded(op: Callable[[KVCacheManager], Any]) -> Callable[[KVCacheManager], Any]:
    """The op's result, or its error's code (a commit or free of a request whose allocate did
    not fit: unknown_request on both paths)."""

    def run(m: KVCacheManager) -> Any:
        try:
            return op(m)
        except KVCMError as exc:
            return exc.code

    return run


def test_a_new_row_takes_each_group_s_blocks_from_the_head_and_gives_them_back_tail_first() -> None:
    """The worked examples of row_grow and row_release: two layer groups in one pool group,
    20 tokens and 4 lookahead (tokens_per_block 16) take 2 blocks each, group 0 first; the
    free gives each group's back tail first, group 0 first."""
    native.use(True)
    m = manager(
        [layer(0), layer(1, owner="draft")], num_blocks=12, max_seq_len=64, tokens_per_block=16
    )
    c = m.parts.coord
    assert c.group_pool == [0, 0]
    m.allocate("x", 33)  # 3 blocks per group: the queue no longer starts at 0
    m.free("x")
    order = c.pools[0].free_order().tolist()
    info = m.allocate("a", 20, lookahead=4)
    assert info.capacity == 24 and m.block_table("a") == [order[:2], order[2:4]]
    assert c.refs[0][order[:4]].tolist() == [1, 1, 1, 1]
    assert c.pools[0].free_order().tolist() == order[4:]
    m.free("a")
    back = [order[1], order[0], order[3], order[2]]
    assert c.pools[0].free_order().tolist() == order[4:] + back
    assert c.refs[0][order[:4]].tolist() == [0, 0, 0, 0]
    assert (c.tables[:, info.row] == c.empty).all()


@pytest.mark.parametrize("null_page", [False, True])
def test_a_freed_row_keeps_what_a_prefix_hit_shares_and_a_window_released(
    null_page: bool,
) -> None:
    """b shares a's first two blocks; its 8-token window released b's block 0 already, and
    its extends release more. Freeing b gives back only its own blocks (the shared one loses
    a reference); then a's free gives the shared ones back. Same on both paths, the null
    page (empty 0) or not (-1)."""
    prompt = list(range(12))
    ops: list[Callable[[KVCacheManager], Any]] = [
        lambda m: m.allocate("a", 12, token_ids=prompt).num_hit_tokens,
        lambda m: m.commit("a", prompt),
        lambda m: m.allocate("b", 13, token_ids=[*prompt, 99]).num_hit_tokens,
        lambda m: m.extend("b", 8).num_tokens,
        lambda m: m.extend("b", 8).num_tokens,
        lambda m: m.block_table("b"),
        lambda m: m.free("b"),
        lambda m: m.free("a"),
        lambda m: m.allocate("c", 30, lookahead=2).capacity,
        lambda m: m.free("c"),
    ]
    layers = [layer(0), layer(1, sliding_window=8)]
    ms, spy = _both(layers, ops, num_blocks=24, max_seq_len=64, null_page=null_page)
    # a's blocks and b's past its hit (the window's hit is Python's), c's in one call
    # (extends keep grow_one), and the three frees
    assert spy.results == Counter({"grow tuple": 2, "start grow": 1, "release tuple": 3})
    pool = ms[True].parts.coord.pools
    assert [p.num_free for p in pool] == [p.num_usable for p in pool]


def test_a_full_pool_is_left_to_numpy_to_name_and_changes_nothing() -> None:
    def fill(m: KVCacheManager) -> int:
        return m.allocate("fill", 4 * (m.num_free_blocks() - 1)).capacity

    ops: list[Callable[[KVCacheManager], Any]] = [
        fill,
        lambda m: m.allocate("big", 9).capacity,  # 3 blocks of 4, 1 free
        lambda m: m.allocate("fits", 4).capacity,
    ]
    _, spy = _both([layer(0)], ops, tokens_per_block=4, num_blocks=8, max_seq_len=32)
    # "big" does not fit in C, then not in the Python path's row_grow: numpy names it
    assert spy.results == Counter({"start grow": 2, "start NoneType": 1, "grow NoneType": 1})


@pytest.mark.parametrize(
    "layers",
    [[layer(0)], [layer(0), layer(1), layer(2, owner="draft")]],
    ids=["one pool group", "two pool groups"],
)
def test_a_queue_full_of_tombstones_is_compacted_before_a_free(
    layers: list[dict[str, Any]],
) -> None:
    """Prefix hits take cached slots out of the queue's tail (tombstones) while the one new
    block of each request comes off its head: each hit-and-free cycle leaves two more, the
    ring (twice the slots) fills, and a free then needs the queue compacted first:
    row_release asks for it (an int), and the free order matches numpy's."""
    prompt = list(range(9))
    ops: list[Callable[[KVCacheManager], Any]] = [
        lambda m: m.allocate("seed", 9, token_ids=prompt).capacity,
        lambda m: m.commit("seed", prompt),
        lambda m: m.free("seed"),
    ]
    for i in range(12):
        ops += [
            lambda m, i=i: m.allocate(f"r{i}", 9, token_ids=prompt).num_hit_tokens,
            lambda m, i=i: m.free(f"r{i}"),
        ]
    ms, spy = _both(layers, ops, tokens_per_block=4, num_blocks=6, max_seq_len=32)
    pools = len(ms[True].parts.coord.pools)
    assert spy.results["release int"] >= pools, spy.results  # each pool group compacted
    assert spy.results["release tuple"] == 13, spy.results  # every free ran in C at last


def test_row_ops_leave_to_numpy_what_they_do_not_run() -> None:
    """False, changing nothing: a window that would release blocks (grow), a row, count,
    cell or queue entry out of range."""
    core = native._built
    assert core is not None
    m = manager([layer(0), layer(1, sliding_window=4)], num_blocks=16, max_seq_len=64)
    row = m.allocate("a", 13).row
    c = m.parts.coord
    args = (m.parts.native_decode.context(m.parts), tuple(c.pools), tuple(c.sinks))
    grow = args[:2]
    before = manager_state(m)
    assert core.row_grow(row, 4, 0, *grow) is False  # from 13 tokens: the window releases
    assert core.row_grow(-1, 4, 0, *grow) is False
    assert core.row_grow(c.num_tokens.size, 4, 0, *grow) is False
    assert core.row_grow(row + 1, 0, 0, *grow) is False  # no token
    assert core.row_grow(row + 1, 4, -1, *grow) is False
    assert core.row_grow(row + 1, 2**31, 0, *grow) is False
    assert core.row_grow(row + 1, 10**6, 0, *grow) is False  # more blocks than a row holds
    assert core.row_release(-1, *args) is False
    assert core.row_release(c.num_tokens.size, *args) is False
    # State the coordinator never makes, each checked unchanged before it is put back.
    slot = int(c.tables[0][row, 0])
    c.tables[0][row, 0] = c.refs[0].size  # a cell past the slots
    corrupt = manager_state(m)
    assert core.row_release(row, *args) is False and same(manager_state(m), corrupt)
    c.tables[0][row, 0] = slot
    c.refs[0][slot] = 0  # a cell nobody holds, after cells whose references are dropped
    corrupt = manager_state(m)
    assert core.row_release(row, *args) is False and same(manager_state(m), corrupt)
    c.refs[0][slot] = 1
    ring = c.pools[0]._ring
    head = int(ring[c.pools[0]._head % ring.size])
    ring[c.pools[0]._head % ring.size] = c.refs[0].size  # a queue entry past the slots
    corrupt = manager_state(m)
    assert core.row_grow(row + 1, 4, 0, *grow) is False and same(manager_state(m), corrupt)
    ring[c.pools[0]._head % ring.size] = head
    with pytest.raises(ValueError):
        core.row_release(row, args[0], args[1], ())  # a sink per layer group
    with pytest.raises(ValueError):
        core.row_release(row, args[0], (), args[2])  # a queue per pool group
    assert same(manager_state(m), before)


def test_random_allocates_and_frees_match_the_numpy_path() -> None:
    """Allocates with and without prompts (hits, evictions), frees in any order, in three
    layer groups over two pool groups with a window and the null page."""
    rng = np.random.default_rng(7)
    prompts = [rng.integers(0, 5, 30).tolist() for _ in range(3)]
    ops: list[Callable[[KVCacheManager], Any]] = []
    live: list[str] = []
    for i in range(400):
        if live and rng.random() < 0.45:
            rid = live.pop(int(rng.integers(len(live))))
            ops.append(lambda m, rid=rid: m.free(rid))
            continue
        rid = f"r{i}"
        n = int(rng.integers(1, 30))
        ahead = int(rng.integers(0, 3))
        if rng.random() < 0.5:
            tokens = prompts[int(rng.integers(3))][:n]
            ops.append(lambda m, rid=rid, t=tokens: m.allocate(rid, len(t), token_ids=t))
            ops.append(lambda m, rid=rid, t=tokens: m.commit(rid, t))
        else:
            ops.append(lambda m, rid=rid, n=n, a=ahead: m.allocate(rid, n, lookahead=a).capacity)
        live.append(rid)
    layers = [  # layer groups: full and windowed in pool group 0, the draft's in 1
        layer(0),
        layer(1, sliding_window=6, sink_tokens=2),
        layer(2, owner="draft"),
        layer(3, head_dim=8, owner="draft"),
    ]

    _, spy = _both(
        layers,
        [_guarded(op) for op in ops],
        tokens_per_block=4,
        num_blocks=40,
        max_seq_len=64,
        null_page=True,
    )
    # Prompts' blocks: the window's hits are Python's, then row_grow; the others row_start.
    assert spy.results["grow tuple"] > 10 and spy.results["start grow"] > 20, spy.results
    assert spy.results["release tuple"] > 30, spy.results
    assert spy.results["grow bool"] == spy.results["start bool"] == 0, spy.results
    assert spy.results["release bool"] == 0, spy.results
    assert spy.results["grow released"] == 0  # an allocate's window releases nothing


def test_the_context_object_reads_the_arrays_once_and_checks_them() -> None:
    """``core.context`` holds the context tuple's buffers: a call with it sees the arrays as
    they are now (the coordinator changes them in place); a bad tuple or another capsule is
    refused with an error."""
    import datetime

    core = native._built
    assert core is not None
    m = manager([layer(0)], num_blocks=8, max_seq_len=64)
    c = m.parts.coord
    nd = m.parts.native_decode
    held = core.context(nd.context(m.parts))
    row = m.allocate("a", 5).row  # after the object was made: it reads the live arrays
    assert core.row_release(row, held, tuple(c.pools), tuple(c.sinks)) == (2,)
    assert m.num_free_blocks() == 8 and c.num_tokens[row] == 0
    with pytest.raises(ValueError):
        core.context(nd.context(m.parts)[:5])
    with pytest.raises(ValueError):  # a capsule that is not a context
        core.row_release(row, datetime.datetime_CAPI, tuple(c.pools), tuple(c.sinks))


def test_a_copied_manager_makes_its_own_context_object() -> None:
    """``copy.deepcopy`` of a manager whose C core has run (tests twin managers so): the copy
    does not share the original's context object (whose buffers are the original's), so its
    row ops change only the copy."""
    native.use(True)
    m = manager([layer(0), layer(1, owner="draft")], num_blocks=12, max_seq_len=64)
    m.allocate("a", 9)
    m.free("a")
    m.allocate("b", 5)
    twin = copy.deepcopy(m)
    before = manager_state(m)
    table = m.block_table("b")
    twin.allocate("c", 8)
    twin.free("b")
    assert same(manager_state(m), before) and twin.request_ids() == ["c"]
    assert m.block_table("b") == table
    m.free("b")  # the original's own object still serves it
    pool = m.parts.coord.pools[0]
    assert pool.num_free == pool.num_usable


def test_a_slot_named_twice_in_a_row_comes_back_once_as_in_numpy() -> None:
    """A hand-made row whose two layer groups (one pool group) name the same slot, held
    twice (never from the coordinator): the C free drops both references and gives the slot
    back once, as the numpy path does."""
    native.use(True)
    m = manager([layer(0), layer(1, owner="draft")], num_blocks=12, max_seq_len=64)
    row = m.allocate("a", 4).row
    c = m.parts.coord
    c.refs[0][c.tables[1][row, 0]] = 0  # group 1's own slot goes back to nobody...
    c.pools[0].push(c.tables[1][row, :1].copy())
    c.tables[1][row, 0] = c.tables[0][row, 0]  # ...and it names group 0's slot instead
    c.refs[0][c.tables[0][row, 0]] = 2
    twin = copy.deepcopy(m)
    native.use(False)
    twin.parts.coord.release_row(row)
    native.use(True)
    context, pools, sinks = m.parts.native_decode.row_args(native._built, m.parts)
    assert native._built.row_release(row, context, pools, sinks) == (1, 1)
    assert same(manager_state(m)[:9], manager_state(twin)[:9])  # tables, counters, queues
    pool = m.parts.coord.pools[0]
    assert pool.num_free == pool.num_usable


def test_a_prefix_hit_takes_the_cached_slots_and_only_the_free_ones_leave_the_queue() -> None:
    """A hit's worked example: cached k0 (held by another request) and k1 (free), a prompt
    whose third block differs: the hit is 2 blocks, the row gets both slots (refs 2 and 1),
    only k1's slot leaves the queue, and the request needs 1 + 3 free slots (20 tokens)."""
    native.use(True)
    m = manager([layer(0)], num_blocks=16, max_seq_len=64)
    prompt = list(range(13))
    m.allocate("a", 13, token_ids=prompt)
    m.commit("a", prompt)
    m.free("a")
    m.allocate("holder", 5, token_ids=prompt[:5])  # holds k0's slot
    c = m.parts.coord
    keys = m.parts.requests.prefix["holder"].prompt_keys
    s0 = c.cache.scope(0, m.parts.requests.prefix["holder"].root)[keys[0]]
    assert c.refs[0][s0] == 1
    queue = c.pools[0].free_order().tolist()
    info = m.allocate("b", 16, token_ids=[*prompt[:8], 50, 51, 52, 53, 54, 55, 56, 57], lookahead=4)
    s1 = m.block_table("b")[0][1]
    assert info.num_hit_tokens == 8 and m.block_table("b")[0][:2] == [s0, s1]
    assert c.refs[0][[s0, s1]].tolist() == [2, 1]
    rest = [s for s in queue if s != s1]
    assert m.block_table("b")[0][2:] == rest[:3]  # the blocks past the hit, off the head
    assert c.pools[0].free_order().tolist() == rest[3:]


def _hits_ops(rng: np.random.Generator, n: int) -> list[Callable[[KVCacheManager], Any]]:
    """Allocates with prompts sharing prefixes (hits on held and on free cached blocks,
    LoRA and salt scopes, identical retries, some too big for the pool), their commits,
    extends, rewinds, frees and all-or-nothing steps whose last allocate fails (undone), at
    most 4 requests live, in random order."""
    prompts = [rng.integers(0, 4, 40).tolist() for _ in range(3)]
    ops: list[Callable[[KVCacheManager], Any]] = []
    live: list[str] = []
    for i in range(n):
        r = rng.random()
        if live and (r < 0.3 or len(live) >= 4):
            rid = live.pop(int(rng.integers(len(live))))
            ops.append(lambda m, rid=rid: m.free(rid))
            continue
        if live and r < 0.4:
            rid = live[int(rng.integers(len(live)))]
            ops.append(lambda m, rid=rid: m.extend(rid, 3).num_tokens)
            continue
        if live and r < 0.45:
            rid = live[int(rng.integers(len(live)))]
            ops.append(lambda m, rid=rid: m.rewind(rid, 2).num_tokens)
            continue
        rid = f"r{i}"
        tokens = prompts[int(rng.integers(3))][: int(rng.integers(1, 40))]
        ahead = int(rng.integers(0, 9))
        extra = [{}, {}, {}, {"cache_salt": "t"}, {"lora_id": 3}][int(rng.integers(5))]
        if rng.random() < 0.1:  # an all-or-nothing step whose second allocate fails: undone
            ops.append(
                lambda m, rid=rid, t=tokens, e=extra: (
                    m.step_columns(
                        allocate=[
                            {"request_id": rid, "num_tokens": len(t), "token_ids": t, **e},
                            {"request_id": rid + "x", "num_tokens": 10_000},
                        ],
                        atomic=True,
                    )
                    .status["allocate"]
                    .tolist()
                )
            )
            continue
        ops.append(
            lambda m, rid=rid, t=tokens, a=ahead, e=extra: (
                m.allocate(rid, len(t), token_ids=t, lookahead=a, **e).num_hit_tokens
            )
        )
        if rng.random() < 0.1:  # the same allocate again: its first result, nothing placed
            ops.append(
                lambda m, rid=rid, t=tokens, a=ahead, e=extra: (
                    m.allocate(rid, len(t), token_ids=t, lookahead=a, **e).num_hit_tokens
                )
            )
        ops.append(lambda m, rid=rid, t=tokens: m.commit(rid, t).num_tokens)
        live.append(rid)
    return ops


@pytest.mark.parametrize(
    ("layers", "kw", "fills", "group_pool"),
    [
        ([layer(0)], {"tokens_per_block": 4, "num_blocks": 40}, False, [0]),
        (
            [layer(0), layer(1, owner="draft")],
            {"tokens_per_block": 1, "null_page": True, "num_blocks": 100},
            True,
            [0, 0],
        ),
        (
            [layer(0), layer(1, owner="draft", head_dim=8)],
            {"tokens_per_block": 3, "num_blocks": 44},
            True,
            [0, 1],
        ),
    ],
    ids=[
        "one layer group",
        "two layer groups in one pool group, null page",
        "two layer groups in two pool groups",
    ],
)
def test_random_prefix_hits_match_the_numpy_path(
    layers: list[dict[str, Any]], kw: dict[str, Any], fills: bool, group_pool: list[int]
) -> None:
    """500 random ops whose allocates hit the cache (row_start) on two managers, C and numpy:
    the same hits, tables, references, free queues (tombstones included), cache index,
    events and edits after every op; allocates that do not fit are named by numpy."""

    ops = [_guarded(op) for op in _hits_ops(np.random.default_rng(3), 500)]
    ms, spy = _both(layers, ops, max_seq_len=64, **kw)
    assert ms[True].parts.coord.group_pool == group_pool
    assert spy.results["start hit"] > 50, spy.results
    assert (spy.results["start NoneType"] > 0) == fills, spy.results  # left to numpy to name
    assert spy.results["start bool"] == 0, spy.results
    # Grows that took cached slots (then evicted in Python), and grows that took none.
    assert 0 < spy.results["start evict"] < spy.results["start hit"] + spy.results["start grow"]


def test_a_hit_that_fits_exactly_is_placed_in_c() -> None:
    """A request whose hit's unheld slots plus its new blocks are exactly the free slots:
    placed in C (the check is need > free), and the pool is then empty."""
    native.use(True)
    m = manager([layer(0)], num_blocks=8, max_seq_len=64)
    prompt = list(range(9))
    m.allocate("a", 9, token_ids=prompt)
    m.commit("a", prompt)
    m.free("a")  # its 3 blocks are free and cached: the queue holds all 8
    spy = CoreSpy(m)
    native.core = spy
    info = m.allocate("b", 9 + 4 * 6 - 1, token_ids=[*prompt[:8], *range(50, 74)])
    assert info.num_hit_tokens == 8 and m.num_free_blocks() == 0
    assert spy.results["start hit"] == 1, spy.results


def test_a_hit_is_left_to_python_where_c_does_not_place_it() -> None:
    """A window, a layer group without reuse, a host tier, or caller-given block keys: the
    Python path finds and places the hit (no row_start call), with the same result."""
    prompt = list(range(12))
    ops: list[Callable[[KVCacheManager], Any]] = [
        lambda m: m.allocate("a", 12, token_ids=prompt).num_hit_tokens,
        lambda m: m.commit("a", prompt),
        lambda m: m.allocate("b", 12, token_ids=prompt).num_hit_tokens,
    ]
    for layers in ([layer(0), layer(1, sliding_window=8)], [layer(0), layer(1, reuse="none")]):
        _, spy = _both(layers, ops, num_blocks=24, max_seq_len=64)
        assert not any(k.startswith("start") for k in spy.results), spy.results
    from kvcm.hashing import block_keys

    keyed = [
        *ops[:2],
        lambda m: (
            m.allocate("b", 12, token_ids=prompt, block_keys=block_keys(prompt, 4)).num_hit_tokens
        ),
    ]
    _, spy = _both([layer(0)], keyed, num_blocks=24, max_seq_len=64)
    assert spy.results["start grow"] == 1 and spy.results["start hit"] == 0, spy.results  # a's
    _, spy = _both([layer(0)], ops, num_blocks=24, max_seq_len=64)
    assert spy.results["start hit"] == 1 and spy.results["start grow"] == 1, spy.results


def _cached_prompt(
    m: KVCacheManager, prompt: list[int]
) -> tuple[tuple[dict[bytes, int], ...], list[bytes], tuple[Any, ...]]:
    """``prompt`` allocated, committed and freed as request "a": its full blocks cached and
    free. Returns each layer group's scope of its root, its keys (published in block order)
    and ``row_start``'s arguments after the counts (context, queues, sinks, cached flags)."""
    m.allocate("a", len(prompt), token_ids=prompt)
    m.commit("a", prompt)
    m.free("a")
    c, decode = m.parts.coord, m.parts.native_decode
    root = next(iter(c.cache.index[0]))
    scopes = tuple(index[root] for index in c.cache.index)
    return (
        scopes,
        list(scopes[0]),
        (*decode.row_args(native._built, m.parts), decode.cached(m.parts)),
    )


def test_row_start_leaves_keys_that_are_not_bytes_to_numpy() -> None:
    """A key of a bytes subclass (whose comparison could run Python code that changes the
    list under the call) or a scope slot that is not an int: False, nothing changed."""

    class Key(bytes):
        pass

    native.use(True)
    m = manager([layer(0)], num_blocks=16, max_seq_len=64)
    scopes, keys, args = _cached_prompt(m, list(range(13)))
    core = native._built
    c = m.parts.coord
    root = next(iter(c.cache.index[0]))
    row = m.parts.requests.free_rows[-1]
    before = manager_state(m)
    assert core.row_start(row, [keys[0], Key(keys[1])], scopes, 2, 9, 0, *args) is False
    odd = {keys[0]: np.int64(c.cache.index[0][root][keys[0]])}
    assert core.row_start(row, keys[:1], (odd,), 1, 9, 0, *args) is False
    assert same(manager_state(m), before)
    assert core.row_start(row, keys[:2], scopes, 2, 9, 0, *args) == (2, (1,), False)


def test_row_start_puts_back_the_tombstones_of_a_hit_whose_grow_cannot_run() -> None:
    """A hit on free cached slots takes their queue entries out (tombstones) before the
    grow's spans are read. A queue entry past the slots at the head (never from the
    coordinator) leaves the grow to numpy: False, and the queue is as it was, each tombstone
    put back. A row that is not free, a window where there is a hit to look for, and counts
    out of range: False too, nothing changed."""
    native.use(True)
    m = manager([layer(0)], num_blocks=16, max_seq_len=64)
    prompt = list(range(13))
    scopes, keys, args = _cached_prompt(m, prompt)  # 3 blocks, at the queue's tail
    keys = keys[:2]
    live = m.allocate("b", 5).row
    core = native._built
    c = m.parts.coord
    row = m.parts.requests.free_rows[-1]
    before = manager_state(m)
    assert core.row_start(live, keys, scopes, 2, 9, 0, *args) is False  # not a free row
    assert core.row_start(row, keys, scopes, 2, 0, 0, *args) is False  # no token
    assert core.row_start(row, keys, scopes, 2, 9, -1, *args) is False
    assert core.row_start(row, keys, scopes, 2, 2**31, 0, *args) is False
    assert core.row_start(row, keys, scopes, 2, 8, 0, *args) is False  # a hit of every token
    assert same(manager_state(m), before)
    pool = c.pools[0]
    head = pool._head % pool._ring.size
    slot = int(pool._ring[head])
    pool._ring[head] = c.refs[0].size  # a queue entry past the slots
    corrupt = manager_state(m)
    assert core.row_start(row, keys, scopes, 2, 9, 0, *args) is False
    assert same(manager_state(m), corrupt)  # the hit's two entries are back in the ring
    pool._ring[head] = slot
    assert core.row_start(row, keys, scopes, 2, 9, 0, *args) == (2, (1,), False)
    assert c.tables[0][row, :3].tolist() == [scopes[0][keys[0]], scopes[0][keys[1]], slot]

    w = manager([layer(0), layer(1, sliding_window=8)], num_blocks=16, max_seq_len=64)
    w.allocate("a", 13, token_ids=prompt)
    w.commit("a", prompt)
    wc = w.parts.coord
    wroot = next(iter(wc.cache.index[0]))
    wscopes = tuple(index[wroot] for index in wc.cache.index)
    wkeys = list(wscopes[0])[:2]
    wargs = (*w.parts.native_decode.row_args(core, w.parts), w.parts.native_decode.cached(w.parts))
    before = manager_state(w)
    assert core.row_start(w.parts.requests.free_rows[-1], wkeys, wscopes, 2, 9, 0, *wargs) is False
    assert same(manager_state(w), before)


def test_a_hit_that_does_not_fit_only_for_its_claimed_slots_is_none() -> None:
    """The fit counts the hit's unheld slots with the blocks past it: 2 claimed + 7 new of 8
    free is None (numpy names it), though 7 alone would fit; nothing changed."""
    native.use(True)
    m = manager([layer(0)], num_blocks=8, max_seq_len=64)
    prompt = list(range(9))
    scopes, keys, args = _cached_prompt(m, prompt)  # blocks 0 and 1: all 8 slots free
    core = native._built
    before = manager_state(m)
    assert core.row_start(m.parts.requests.free_rows[-1], keys, scopes, 2, 36, 0, *args) is None
    assert same(manager_state(m), before)
    with pytest.raises(OutOfBlocks):
        m.allocate("b", 36, token_ids=[*prompt[:8], *range(50, 78)])
    assert same(manager_state(m), before)

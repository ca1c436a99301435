"""``ragged_page_indices``: FlashInfer's ragged (CSR) pages of requests, checked exactly against
a brute-force model built from ``block_table`` (which pages a request holds) and the dense
kernel-mode rows of ``page_indices`` (their indices) over random steps: chunked prefill,
sliding windows with sinks, prefix hits, lookahead, rewinds, the null page on and off, and
key-only and key/value layers in one pool group; context-parallel ranks; typed errors that
change nothing; and the HTTP route through the real uvicorn server and both clients."""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np
import pytest
import torch
from servers import serve_in_thread

import kvcm_kernels
from kvcm import InvalidArgument, KVCacheManager, UnknownLayer, UnknownRequest
from kvcm.server.app import create_app
from kvcm_client import AsyncKVCacheClient, KVCacheClient
from kvcm_client.errors import KVCMError, RequestSuspended

TPB = 4
FIELDS = ("indptr", "indices", "last_page_len", "first_token", "num_sink_pages")


def spec(i: int, **kw: Any) -> dict[str, Any]:
    return {"layer_id": i, "num_kv_heads": 1, "head_dim": 4, "dtype": "fp16"} | kw


#: Layer group 0: a window of 10 tokens with 5 sink tokens (2 sink blocks); group 1: full
#: attention with a key/value layer (pool of 1 K/V buffer pair: index = slot) and two key-only
#: layers of the same width (pool of 2 buffers: index = 2 x slot, + 0 or 1 per layer), which
#: share the pool group's slots; group 2: a window of 6 without sinks.
LAYERS = [
    spec(0, sliding_window=10, sink_tokens=5),
    spec(1),
    spec(2, kv_factor=1, head_dim=8),
    spec(3, kv_factor=1, head_dim=8),
    spec(4, sliding_window=6),
]
#: (layer, role, per_layer) asked for in every check.
ASKS = [
    (0, "key", False),
    (0, "value", True),
    (1, "key", False),
    (1, "value", True),
    (2, "key", False),
    (2, "key", True),
    (3, "key", True),
    (4, "value", False),
]


def make(null_page: bool = False, **kw: Any) -> KVCacheManager:
    cfg: dict[str, Any] = {
        "layers": LAYERS,
        "tokens_per_block": TPB,
        "max_requests": 6,
        "max_seq_len": 64,
        "num_blocks": 90,
        "null_page": null_page,
    }
    return KVCacheManager(cfg | kw)


def _group_of(m: Any, layer_id: int) -> tuple[int, int]:
    """(layer group, sink blocks) of a layer, from ``describe``."""
    for g in m.describe().layer_groups:
        if layer_id in g.layer_ids:
            return g.group_id, g.sink_blocks
    raise AssertionError(layer_id)


def brute_force(
    m: Any, views: Any, ids: list[str], layer_id: int, role: str, per_layer: bool
) -> dict[str, list[int]]:
    """The expected arrays, request by request: the dense kernel row's entries at the blocks
    ``block_table`` says the request holds, of the blocks that hold its tokens (this rank's,
    with context parallelism: local entry j is block j * cp + rank)."""
    desc = views.describe()
    cp, rank = desc.context_parallel, desc.cp_rank
    group, sinks = _group_of(views, layer_id)
    dense = views.page_indices(ids, layer_id, role, mode="kernel", per_layer=per_layer).tolist()
    out: dict[str, list[int]] = {f: [] for f in FIELDS}
    out["indptr"].append(0)
    for i, rid in enumerate(ids):
        held = m.block_table(rid)[group]  # global blocks, -1 where none
        length = m.request(rid).num_tokens
        blocks = -(-length // TPB)
        listed = [
            j
            for j in range(len(dense[i]))
            if j * cp + rank < blocks and j * cp + rank < len(held) and held[j * cp + rank] >= 0
        ]
        out["indices"] += [dense[i][j] for j in listed]
        out["indptr"].append(out["indptr"][-1] + len(listed))
        glob = [j * cp + rank for j in listed]
        out["last_page_len"].append(min(length - glob[-1] * TPB, TPB) if glob else 0)
        late = [b for b in glob if b >= sinks]
        out["first_token"].append(late[0] * TPB if late else 0)
        out["num_sink_pages"].append(len(glob) - len(late))
        # The rule the docstring states: sinks first, then consecutive blocks (cp apart).
        assert glob[: len(glob) - len(late)] == list(range(rank, min(sinks, blocks), cp))
        assert late == list(range(late[0], late[0] + cp * len(late), cp)) if late else True
        # 0 only where no page is listed: no token, or (cp > 1) no block on this rank.
        assert 1 <= out["last_page_len"][-1] <= TPB or (not glob and (length == 0 or cp > 1))
        # Unheld entries of the dense row: -1, or the null page's one index with null_page.
        unheld = [
            dense[i][j]
            for j in range(len(dense[i]))
            if j * cp + rank >= len(held) or held[j * cp + rank] < 0
        ]
        if desc.null_page:
            assert len(set(unheld)) <= 1 and min(unheld, default=0) >= 0, unheld
        else:
            assert set(unheld) <= {-1}, unheld
    return out


def check(m: Any, views: Any, ids: list[str]) -> None:
    for layer_id, role, per_layer in ASKS:
        got = views.ragged_page_indices(ids, layer_id, role, per_layer)
        want = brute_force(m, views, ids, layer_id, role, per_layer)
        for f in FIELDS:
            value = getattr(got, f)
            assert value.dtype == torch.int32 and value.device == views.device, f
            assert value.tolist() == want[f], (layer_id, role, per_layer, f)


class Driver:
    """Random ops on a manager: prompts drawn from two shared token sequences (so prompts
    share prefixes and later requests hit what earlier ones committed), chunked prefill
    (multi-token extends), decode with lookahead, rewinds, commits and frees."""

    def __init__(self, m: Any, rng: np.random.Generator, host: bool = False) -> None:
        self.m, self.rng, self.host = m, rng, host
        self.bases = [[int(t) for t in rng.integers(1, 50, size=64)] for _ in range(2)]
        self.tokens: dict[str, list[int]] = {}
        self.suspended: set[str] = set()
        self.serial = 0
        self.resumed = 0

    def live(self) -> list[str]:
        return [r for r in self.m.request_ids() if r not in self.suspended]

    def step(self) -> None:
        m, rng = self.m, self.rng
        ids = self.live()
        kind = int(rng.integers(7 if self.host else 6))
        try:
            if kind == 6:  # the host tier: suspend a live request, or resume one
                if self.suspended and rng.random() < 0.5:
                    rid = sorted(self.suspended)[0]
                    m.resume(rid)
                    self.suspended.discard(rid)
                    self.resumed += 1
                elif len(ids) > 1:
                    rid = ids[int(rng.integers(len(ids)))]
                    m.suspend(rid)
                    self.suspended.add(rid)
                return
            if (kind == 0 and len(ids) < 5) or not ids:
                self.serial += 1
                rid = f"r{self.serial}"
                tokens = self.bases[int(rng.integers(2))]
                n = int(rng.integers(1, 24))
                m.allocate(rid, n, token_ids=tokens[:n], lookahead=int(rng.integers(0, 3)))
                self.tokens[rid] = tokens
                return
            rid = ids[int(rng.integers(len(ids)))]
            info = m.request(rid)
            if kind == 1:  # a prefill chunk or a decode step (with drafts' room)
                n = int(rng.integers(1, 9)) if rng.random() < 0.4 else 1
                m.extend(rid, n, lookahead=int(rng.integers(0, 3)))
            elif kind == 2:
                m.rewind(rid, int(rng.integers(1, max(2, info.num_tokens // 2))))
            elif kind in (3, 4):
                m.commit(rid, self.tokens[rid][info.num_committed : info.num_tokens])
            elif len(ids) > 2:
                m.free(rid)
        except KVCMError:
            pass  # refused (too long, past the window, out of blocks): nothing changed


@pytest.mark.parametrize("null_page", [False, True])
@pytest.mark.parametrize("seed", range(4))
def test_equals_brute_force_over_random_steps(null_page: bool, seed: int) -> None:
    """Odd seeds add a host tier: suspends and resumes (the resumed blocks in new slots)."""
    rng = np.random.default_rng(seed)
    host = seed % 2 == 1
    m = make(null_page, **({"host_memory_bytes": 1 << 16} if host else {}))
    driver = Driver(m, rng, host)
    hits = 0
    for _ in range(250):
        driver.step()
        ids = driver.live()
        order = [ids[int(k)] for k in rng.permutation(len(ids))] if ids else []
        check(m, m, order + order[:1])  # any order, a repeat too
        hits = max(hits, *(m.request(r).num_hit_tokens for r in ids), 0)
    assert hits > 0  # prefix hits happened
    assert not host or driver.resumed > 0
    check(m, m, [])


def test_worked_example_and_index_spaces() -> None:
    """The docstring's example, and a key-only layer next to a key/value layer of one pool
    group: different index spaces for the same slots."""
    m = KVCacheManager(
        {
            "layers": [spec(0, sliding_window=8, sink_tokens=1), spec(1)],
            "tokens_per_block": 4,
            "num_blocks": 32,
            "max_seq_len": 64,
        }
    )
    m.allocate("a", 16)
    for _ in range(3):
        m.extend("a", 1)  # 19 tokens; the history 18 released block 1
    window, full = m.block_table("a")
    assert window[1] == -1 and -1 not in full
    got = m.ragged_page_indices(["a"], 0)
    assert got.indices.tolist() == [window[0], *window[2:5]]
    assert got.indptr.tolist() == [0, 4]
    assert got.last_page_len.tolist() == [3]
    assert got.num_sink_pages.tolist() == [1] and got.first_token.tolist() == [8]
    got = m.ragged_page_indices(["a"], 1)
    assert got.indices.tolist() == full and got.first_token.tolist() == [0]
    assert got.num_sink_pages.tolist() == [0] and got.last_page_len.tolist() == [3]

    m = make()
    m.allocate("b", 9)  # 3 blocks in group 1
    slots = m.block_table("b")[1]
    assert m.ragged_page_indices(["b"], 1).indices.tolist() == slots  # K/V alone: slot
    assert m.ragged_page_indices(["b"], 2).indices.tolist() == [2 * s for s in slots]
    key_only = m.ragged_page_indices(["b"], 3, per_layer=True).indices.tolist()
    assert key_only == [2 * s + 1 for s in slots]


@pytest.mark.parametrize("null_page", [False, True])
def test_lookahead_pages_and_empty_requests_are_not_listed(null_page: bool) -> None:
    m = make(null_page)
    m.allocate("a", 8, lookahead=5)  # capacity 13: 4 blocks, tokens in 2
    assert len(m.block_table("a")[1]) == 4
    got = m.ragged_page_indices(["a"], 1)
    assert got.indices.tolist() == m.block_table("a")[1][:2]
    assert got.last_page_len.tolist() == [4]


@pytest.mark.parametrize("cp", [2, 3])
def test_context_parallel_ranks_list_their_own_pages(cp: int) -> None:
    layers = [spec(0, sliding_window=10, sink_tokens=5), spec(1)]
    m = KVCacheManager(
        {
            "ranks": [{"device": "cpu", "layers": layers, "cp_rank": c} for c in range(cp)],
            "context_parallel": cp,
            "tokens_per_block": TPB,
            "max_requests": 6,
            "max_seq_len": 64,
            "num_blocks": 30 * cp,
        }
    )
    rng = np.random.default_rng(cp)
    driver = Driver(m, rng)
    for _ in range(120):
        driver.step()
        ids = m.request_ids()
        for r in range(cp):
            views = m.rank(r)
            for layer_id, role, per_layer in ((0, "key", False), (1, "value", True)):
                got = views.ragged_page_indices(ids, layer_id, role, per_layer)
                want = brute_force(m, views, ids, layer_id, role, per_layer)
                for f in FIELDS:
                    assert getattr(got, f).tolist() == want[f], (r, layer_id, f)


@pytest.mark.parametrize("cp,sinks,min_live", [(1, 0, 0), (1, 2, 1), (3, 4, 0), (2, 1, 1)])
def test_kernel_reference_on_random_tables(cp: int, sinks: int, min_live: int) -> None:
    """The CPU reference of ``kvcm_kernels.ragged_page_indices`` on tables with holes
    anywhere, entry by entry; a ``total`` the table does not list is refused."""
    rng = np.random.default_rng(cp * 10 + sinks)
    tpb, cols, mult, off = 4, 9, 3, 1
    table = rng.integers(min_live, 1000, size=(12, cols)).astype(np.int32)
    table[rng.random(table.shape) < 0.3] = min_live - 1
    rows = rng.integers(0, 12, size=20)
    lengths = rng.integers(1, cols * cp * tpb + 9, size=20)
    rank = cp - 1
    got = kvcm_kernels.ragged_page_indices(
        torch.from_numpy(table),
        torch.from_numpy(rows),
        torch.from_numpy(lengths),
        tpb,
        mult,
        off,
        sinks,
        min_live,
        cp,
        rank,
    )
    indptr = [0]
    for i, (r, length) in enumerate(zip(rows, lengths, strict=True)):
        blocks = [
            (j, j * cp + rank)
            for j in range(cols)
            if table[r, j] >= min_live and j * cp + rank < -(-length // tpb)
        ]
        pages = got[1][indptr[-1] : indptr[-1] + len(blocks)].tolist()
        assert pages == [int(table[r, j]) * mult + off for j, _ in blocks]
        indptr.append(indptr[-1] + len(blocks))
        last = blocks[-1][1] if blocks else None
        assert int(got[2][i]) == (0 if last is None else min(length - last * tpb, tpb))
        late = [b for _, b in blocks if b >= sinks]
        assert int(got[3][i]) == (late[0] * tpb if late else 0)
        assert int(got[4][i]) == len(blocks) - len(late)
    assert got[0].tolist() == indptr and got[1].numel() == indptr[-1]
    pages_all = got[1].tolist()
    args = (torch.from_numpy(table), torch.from_numpy(rows), torch.from_numpy(lengths), tpb)
    args += (mult, off, sinks, min_live, cp, rank)
    assert kvcm_kernels.ragged_page_indices(*args, total=indptr[-1])[1].tolist() == pages_all
    placed = kvcm_kernels.ragged_page_indices(*args, indptr=torch.tensor(indptr))
    assert placed[1].tolist() == pages_all
    with pytest.raises(RuntimeError, match="disagree"):
        kvcm_kernels.ragged_page_indices(*args, total=indptr[-1] + 1)
    shifted = [0, *[v + 1 for v in indptr[1:-1]], indptr[-1]]  # the same total, other rows
    with pytest.raises(RuntimeError, match="disagree"):
        kvcm_kernels.ragged_page_indices(*args, indptr=torch.tensor(shifted))


def _state(m: Any) -> Any:
    return (
        [(r, m.request(r).model_dump()) for r in m.request_ids()],
        m.block_table("a"),
        m.stats().model_dump(),
        m.page_tables().clone(),
    )


def test_bad_input_gives_page_indices_errors_and_changes_nothing() -> None:
    m = make(host_memory_bytes=1 << 16)
    m.allocate("a", 9)
    m.allocate("s", 5)
    m.suspend("s")
    before = _state(m)
    cases: list[tuple[tuple[Any, ...], dict[str, Any], type[Exception]]] = [
        ((["nope"], 0), {}, UnknownRequest),
        ((["a", "nope"], 1), {}, UnknownRequest),
        ((["a"], 9), {}, UnknownLayer),
        ((["a"], -1), {}, UnknownLayer),
        ((["a"], 2), {"role": "value"}, InvalidArgument),  # a key-only layer
        ((["a"], 0), {"role": "query"}, InvalidArgument),
        (("a", 0), {}, InvalidArgument),  # a str is not a list of ids
        ((["s"], 0), {}, RequestSuspended),
    ]
    for args, kw, error in cases:
        with pytest.raises(error) as ragged:
            m.ragged_page_indices(*args, **kw)
        with pytest.raises(error) as dense:
            m.page_indices(*args, **kw)
        assert (ragged.value.code, ragged.value.detail) == (dense.value.code, dense.value.detail)
    after = _state(m)
    assert before[:3] == after[:3] and torch.equal(before[3], after[3])


def test_http_route_and_clients_equal_the_manager() -> None:
    m = make(null_page=True)
    driver = Driver(m, np.random.default_rng(7))
    for _ in range(60):
        driver.step()
    ids = m.request_ids()
    want = {
        ask: {f: getattr(m.ragged_page_indices(ids, *ask), f).tolist() for f in FIELDS}
        for ask in ASKS
    }
    with serve_in_thread(create_app(m)) as url, KVCacheClient(url) as kv:
        for ask in ASKS:
            got = kv.ragged_page_indices(ids, *ask)
            assert got.model_dump() == want[ask], ask
        with pytest.raises(UnknownLayer):
            kv.ragged_page_indices(ids, 9)
        with pytest.raises(UnknownRequest):
            kv.ragged_page_indices(["nope"], 0)
        with pytest.raises(InvalidArgument):
            kv.ragged_page_indices(ids, 2, "value")

        async def run() -> list[Any]:
            async with AsyncKVCacheClient(url) as akv:
                return [await akv.ragged_page_indices(ids, *ask) for ask in ASKS]

        for ask, got in zip(ASKS, asyncio.run(run()), strict=True):
            assert got.model_dump() == want[ask], ask

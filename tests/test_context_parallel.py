"""Decode context parallelism (Helix, kvcm.context_parallel, docs/ranks.md): block position b
on context-parallel rank b mod cp, one free list per slot class, and per rank its own page
tables, slot mappings, lengths and released pages, checked against a brute-force model of
the global block tables on random op sequences."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from pydantic import ValidationError
from servers import serve_process

from kvcm import KVCacheManager
from kvcm.context_parallel import ClassPools, class_counts, local_count, local_lengths
from kvcm_client import KVCacheClient
from kvcm_client.errors import InvalidArgument, KVCMError, OutOfBlocks

TPB = 4


def spec(i: int, window: int | None = None, sinks: int = 0, **kw: Any) -> dict[str, Any]:
    out: dict[str, Any] = {"layer_id": i, "num_kv_heads": 1, "head_dim": 4, "dtype": "fp32"}
    if window is not None:
        out |= {"sliding_window": window, "sink_tokens": sinks}
    return out | kw


def manager(
    cp: int, layers: list[dict[str, Any]] | None = None, device: str = "cpu", **kw: Any
) -> KVCacheManager:
    layers = layers or [spec(0)]
    cfg: dict[str, Any] = {
        "ranks": [{"device": device, "layers": layers, "cp_rank": c} for c in range(cp)],
        "context_parallel": cp,
        "tokens_per_block": TPB,
        "max_requests": 6,
        "max_seq_len": 96,
        "num_blocks": 12 * cp,
    }
    return KVCacheManager(cfg | kw)


# -- the pieces --------------------------------------------------------------------------------


def test_local_counts_and_class_counts_match_enumeration() -> None:
    for cp in (1, 2, 3, 5):
        for n in range(0, 23):
            for c in range(cp):
                assert local_count(n, cp, c) == sum(1 for b in range(n) if b % cp == c)
        starts, stops = np.array([0, 3, 7]), np.array([5, 3, 13])
        spans = [range(a, z) for a, z in zip(starts, stops, strict=True)]
        want = [sum(1 for r in spans for b in r if b % cp == c) for c in range(cp)]
        assert class_counts(starts, stops, cp).tolist() == want
    rng = np.random.default_rng(0)
    for _ in range(300):  # decode-shaped ranges (at most one position each) and longer ones
        cp, n = int(rng.integers(1, 6)), int(rng.integers(1, 6))
        starts = rng.integers(0, 20, n)
        stops = starts + rng.integers(0, 2 if rng.random() < 0.5 else 5, n)
        spans = [range(a, z) for a, z in zip(starts, stops, strict=True)]
        want = [sum(1 for r in spans for b in r if b % cp == c) for c in range(cp)]
        assert class_counts(starts, stops, cp).tolist() == want


def test_class_pools_hand_out_each_position_a_slot_of_its_class() -> None:
    pools = ClassPools(8, reserved=1, cp=2)  # class 0: 2, 4, 6; class 1: 3, 5, 7
    assert pools.num_usable == 6 and pools.free_by_class().tolist() == [3, 3]
    got = pools.pop_positions(np.array([0, 1, 2, 5]))
    assert got.tolist() == [2, 3, 4, 5]
    assert pools.pop_positions(np.array([], dtype=np.int64)).tolist() == []
    pools.push(np.array([5, 2]))
    assert pools.free_order().tolist() == [6, 2, 7, 5]
    pools.claim(np.array([2]))
    assert pools.free_by_class().tolist() == [1, 2] and pools.num_free == 3
    saved = pools.checkpoint()
    pools.pop_positions(np.array([1, 3]))
    pools.restore(saved)
    assert pools.free_order().tolist() == [6, 7, 5]


# -- configs ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("change", "code"),
    [
        ({"context_parallel": 3}, "cp_ranks_mismatch"),  # no rank of class 2
        (
            {"ranks": [{"device": "cpu", "layers": [spec(0)], "cp_rank": 1}] * 2},
            "cp_ranks_mismatch",
        ),
        ({"num_blocks": 25}, "cp_num_blocks"),
        ({"num_blocks": None, "memory_bytes": 1 << 20}, "ranks_unsupported"),
    ],
)
def test_inconsistent_context_parallel_configs_are_refused(
    change: dict[str, Any], code: str
) -> None:
    cfg = {
        "ranks": [{"device": "cpu", "layers": [spec(0)], "cp_rank": c} for c in range(2)],
        "context_parallel": 2,
        "tokens_per_block": TPB,
        "max_requests": 4,
        "max_seq_len": 64,
        "num_blocks": 24,
    }
    with pytest.raises(ValidationError) as exc:
        KVCacheManager(cfg | change)
    assert exc.value.errors()[0]["type"] == code


def test_a_cp_rank_without_context_parallelism_is_refused() -> None:
    with pytest.raises(ValidationError) as exc:
        KVCacheManager(
            {
                "ranks": [
                    {"device": "cpu", "layers": [spec(0)]},
                    {"device": "cpu", "layers": [spec(0)], "cp_rank": 1},
                ],
                "num_blocks": 8,
                "max_seq_len": 64,
            }
        )
    assert exc.value.errors()[0]["type"] == "cp_ranks_mismatch"


# -- exact tables ------------------------------------------------------------------------------


def test_pages_alternate_between_ranks_with_local_tables_lengths_and_mappings() -> None:
    m = manager(2, num_blocks=16)
    info = m.allocate("a", 10)  # blocks 0, 1, 2
    assert m.block_table("a") == [[0, 1, 2]]  # classes 0, 1, 0
    r0, r1 = m.rank(0), m.rank(1)
    assert r0.page_table(0)[info.row, :3].tolist() == [0, 1, -1]  # global 0, 2
    assert r1.page_table(0)[info.row, :2].tolist() == [0, -1]  # global 1
    assert r0.context_lengths(["a"]).tolist() == [6] and r1.context_lengths(["a"]).tolist() == [4]
    assert r0.slot_mapping(["a"], 0).tolist() == [0, 1, 2, 3, -1, -1, -1, -1, 4, 5]
    assert r1.slot_mapping(["a"], 0).tolist() == [-1, -1, -1, -1, 0, 1, 2, 3, -1, -1]
    assert m.rank(0).kv_view(0).shape[0] == 8  # each rank holds half of the 16 slots
    m.extend("a", 3)  # 13 tokens: block 3 (class 1) is new
    assert m.block_table("a") == [[0, 1, 2, 3]]
    assert r1.page_table(0)[info.row, :2].tolist() == [0, 1]
    assert r1.slot_mapping(["a"], 0).tolist() == [-1, -1, 4]  # tokens 10, 11 (block 2), 12
    assert r0.slot_mapping(["a"], 0).tolist() == [6, 7, -1]


def test_null_page_is_local_slot_0_of_every_rank_through_chunked_prefill_and_refusal() -> None:
    m = manager(3, num_blocks=12, null_page=True)  # 4 slots per class, local 0 reserved
    assert m.parts.coord.pools[0].free_order().tolist() == [3, 6, 9, 4, 7, 10, 5, 8, 11]
    info = m.allocate("a", 5)  # chunked prefill: 5 + 8 + 8 = 21 tokens, blocks 0..5
    m.extend("a", 8)
    m.extend("a", 8)
    assert m.block_table("a") == [[3, 4, 5, 6, 7, 8]]  # classes 0, 1, 2, 0, 1, 2
    for r in range(3):  # local slots 1, 2 on every rank; padding is the null page 0
        assert m.rank(r).page_table(0)[info.row].tolist() == [1, 2] + [0] * 7
        assert m.rank(r).kv_view(0).shape[0] == 4
    assert [m.rank(r).context_lengths(["a"]).item() for r in range(3)] == [8, 8, 5]
    assert m.parts.coord.pools[0].free_by_class().tolist() == [1, 1, 1]
    before = [m.rank(r).page_tables().clone() for r in range(3)]
    with pytest.raises(OutOfBlocks) as exc:
        m.extend("a", 16)  # blocks 6..9: classes 0, 1, 2, 0, and class 0 has 1 free
    assert exc.value.detail["cp_rank"] == 0 and exc.value.detail["needed"] == 2
    assert m.request("a").num_tokens == 21 and m.block_table("a") == [[3, 4, 5, 6, 7, 8]]
    assert m.parts.coord.pools[0].free_by_class().tolist() == [1, 1, 1]
    assert all(bool((m.rank(r).page_tables() == before[r]).all()) for r in range(3))
    m.extend("a", 15)  # blocks 6..8: one of each class
    assert m.block_table("a") == [[3, 4, 5, 6, 7, 8, 9, 10, 11]]
    assert m.rank(2).page_table(0)[info.row, :4].tolist() == [1, 2, 3, 0]
    m.free("a")
    assert m.parts.coord.pools[0].free_by_class().tolist() == [3, 3, 3]
    assert m.rank(1).page_table(0)[info.row].tolist() == [0] * 9


def test_a_window_releases_each_ranks_share_of_its_stale_blocks() -> None:
    m = manager(3, [spec(0), spec(1, window=9, sinks=4)], num_blocks=36)
    info = m.allocate("w", 10)
    for _ in range(5):
        m.extend("w", 4)
    # History 26, window 9, 1 sink block: stale global blocks [1, (26 + 1 - 9) // 4) = [1, 4).
    assert m.block_table("w") == [[0, 1, 2, 6, 7, 8, 12, 13], [3, -1, -1, -1, 10, 11, 15, 16]]
    # Rank r's local entries [ceil((1 - r) / 3), ceil((4 - r) / 3)): block 3, 1 and 2.
    released = [m.rank(r).released_pages(["w"], 1).tolist() for r in range(3)]
    assert released == [[[1, 2]], [[0, 1]], [[0, 1]]]
    assert m.rank(0).page_table(1)[info.row, :3].tolist() == [1, -1, 5]  # blocks 0, 3, 6
    assert m.rank(1).page_table(1)[info.row, :3].tolist() == [-1, 3, 5]  # blocks 1, 4, 7
    assert m.rank(2).page_table(1)[info.row, :3].tolist() == [-1, 3, -1]  # blocks 2, 5
    assert m.rank(0).released_pages(["w"], 0).tolist() == [[0, 0]]  # full attention
    # One pool group for both groups; class 2 holds blocks 2 and 5 of layer 0, 5 of layer 1.
    assert m.parts.coord.pools[0].free_by_class().tolist() == [7, 7, 9]


def test_prefix_hits_land_on_the_rank_of_their_position() -> None:
    m = manager(4, num_blocks=16)  # 4 slots per class
    prompt = list(range(22))
    m.allocate("a", 22, token_ids=prompt)  # blocks 0..5: classes 0, 1, 2, 3, 0, 1
    assert m.block_table("a") == [[0, 1, 2, 3, 4, 5]]
    m.commit("a", prompt)
    m.free("a")  # its 5 full blocks stay cached
    assert m.probe(prompt) == 20
    info = m.allocate("b", 20, token_ids=prompt[:20])
    assert info.num_hit_tokens == 16  # the last token is computed: block 4 is new
    assert m.block_table("b") == [[0, 1, 2, 3, 8]]  # hits at their positions; 8 is class 0
    assert m.rank(0).page_table(0)[info.row, :3].tolist() == [0, 2, -1]  # slots 0, 8
    for r in (1, 2, 3):
        assert m.rank(r).page_table(0)[info.row, :2].tolist() == [0, -1]
    assert [m.rank(r).context_lengths(["b"]).item() for r in range(4)] == [8, 4, 4, 4]
    assert m.parts.coord.pools[0].free_by_class().tolist() == [2, 3, 3, 3]


def test_rejected_drafts_give_their_blocks_back_to_their_class() -> None:
    m = manager(2, num_blocks=16)
    info = m.allocate("d", 6, lookahead=3)  # capacity 9: blocks 0, 1, 2
    m.extend("d", 3, lookahead=4)  # 9 tokens, capacity 13: block 3 (class 1) is new
    assert m.block_table("d") == [[0, 1, 2, 3]]
    assert m.parts.coord.pools[0].free_by_class().tolist() == [6, 6]
    m.rewind("d", 2)  # 7 tokens, capacity 11: block 3 goes back to class 1's tail
    assert m.block_table("d") == [[0, 1, 2]]
    assert m.parts.coord.pools[0].free_by_class().tolist() == [6, 7]
    assert m.parts.coord.pools[0].free_order().tolist()[-1] == 3
    assert m.rank(1).page_table(0)[info.row, :2].tolist() == [0, -1]
    assert [m.rank(r).context_lengths(["d"]).item() for r in range(2)] == [4, 3]
    # The last token, 6, is in block 1 (slot 1: rank 1's local slot 0) at offset 2.
    assert [m.rank(r).slot_mapping(["d"], 0).tolist() for r in range(2)] == [[-1], [2]]


def test_cp_ranks_that_are_also_tp_ranks_share_their_class_tables_not_their_pools() -> None:
    layers = [spec(0, num_kv_heads=2), spec(1, window=9)]  # two pool groups
    m = KVCacheManager(
        {
            "ranks": [{"device": "cpu", "layers": layers, "cp_rank": c} for c in (0, 1, 1, 0)],
            "context_parallel": 2,
            "tokens_per_block": TPB,
            "max_requests": 4,
            "max_seq_len": 64,
            "num_blocks": 32,
        }
    )
    m.allocate("x", 4)  # slot 0 of each pool group
    info = m.allocate("a", 10)
    m.extend("a", 8)
    m.extend("a", 3)  # 21 tokens; history 18: the window releases blocks [0, 2)
    assert m.block_table("a") == [[2, 1, 4, 3, 6, 5], [-1, -1, 4, 3, 6, 5]]
    # Class 0 (ranks 0 and 3): blocks 0, 2, 4; class 1 (ranks 1 and 2): blocks 1, 3, 5.
    want = {0: [[1, 2, 3, -1], [-1, 2, 3, -1]], 1: [[0, 1, 2, -1], [-1, 1, 2, -1]]}
    mapping = {0: [12, 13, 14, 15, -1], 1: [-1, -1, -1, -1, 8]}  # tokens 16..20
    for r, c in enumerate((0, 1, 1, 0)):
        view = m.rank(r)
        assert view.page_tables()[:, info.row, :4].tolist() == want[c], r
        assert view.context_lengths(["a"]).tolist() == [[12, 9][c]]
        assert view.slot_mapping(["a"], 0, 5).tolist() == mapping[c]
        assert view.released_pages(["a"], 1).tolist() == [[0, 1]]
        assert view.kv_view(0).shape[0] == 16  # half of the 32 slots
    assert m.rank(3).kv_view(0).data_ptr() != m.rank(0).kv_view(0).data_ptr()  # own heads


def test_a_class_that_runs_out_refuses_even_with_other_classes_free() -> None:
    m = manager(2, num_blocks=8)  # 4 slots per class
    m.allocate("a", 3 * TPB)  # blocks 0, 1, 2: classes 0, 1, 0
    assert m.parts.coord.pools[0].free_by_class().tolist() == [2, 3]
    before = m.block_table("a")
    with pytest.raises(OutOfBlocks) as exc:
        m.allocate("b", 5 * TPB)  # 5 blocks, 5 free: but 3 of class 0, and 2 are free
    assert exc.value.detail["cp_rank"] == 0 and exc.value.detail["needed"] == 3
    assert m.request_ids() == ["a"] and m.block_table("a") == before
    assert m.num_free_blocks(0) == 5
    m.allocate("b", 4 * TPB)  # 2 of each class: fits
    assert m.block_table("b") == [[4, 3, 6, 5]]


def test_estimates_hold_exactly_per_class() -> None:
    for cp, seq_len in ((2, 40), (3, 41), (4, 17)):
        m = manager(
            cp, [spec(0), spec(1, window=9, sinks=4)], num_blocks=10 * cp, max_prefill_chunk=8
        )
        est = m.estimate(seq_len)
        n = est.max_requests
        assert 0 < n < 6
        for i in range(n):
            m.allocate(f"r{i}", 8)
        # Lockstep to seq_len in chunks of 8: every op fits.
        while m.request("r0").num_tokens < seq_len:
            for i in range(n):
                m.extend(f"r{i}", min(8, seq_len - m.request(f"r{i}").num_tokens))
        # One more request of the worst history does not: it runs out in some class.
        with pytest.raises(OutOfBlocks):
            m.allocate("extra", 8)
            while m.request("extra").num_tokens < seq_len:
                m.extend("extra", min(8, seq_len - m.request("extra").num_tokens))


def test_copy_tokens_is_refused_with_context_parallelism() -> None:
    m = manager(2)
    m.allocate("a", 8)
    with pytest.raises(InvalidArgument, match="context parallelism"):
        m.copy_tokens(["a"], [0], [5])


# -- the brute-force model ---------------------------------------------------------------------


def _check(m: KVCacheManager, cp: int, null_page: bool) -> None:
    """Every rank's tables, lengths, mappings and released pages against the global block
    tables; slot classes, holders and free counts per class."""
    empty = 0 if null_page else -1
    c = m.parts.coord
    ids = m.request_ids()
    holders: dict[tuple[int, int], int] = {}
    for rid in ids:
        row = m.request(rid).row
        for g, blocks in enumerate(m.block_table(rid)):
            pg = c.group_pool[g]
            for b, s in enumerate(blocks):
                if s >= 0:
                    assert s % cp == b % cp, (rid, g, b, s)
                    holders[pg, s] = holders.get((pg, s), 0) + 1
            assert len(blocks) == int(c.num_blocks[g][row])
    for pg, pool in enumerate(c.pools):
        held = {s for (q, s) in holders if q == pg}
        for s in held:
            assert c.refs[pg][s] == holders[pg, s]
        cached = set(np.flatnonzero(c.cache.cached[pg]).tolist())
        free = set(pool.free_order().tolist())
        assert not free & held
        for k in range(cp):  # every usable slot of a class is held, or free (maybe cached)
            usable = {s for s in range(k, pool.num_slots, cp) if s // cp >= int(null_page)}
            assert {s for s in free if s % cp == k} | {s for s in held if s % cp == k} == usable
        assert cached <= free | held
    for r in range(cp):
        view = m.rank(r)
        tables = view.page_tables().cpu().numpy()
        width = tables.shape[2]
        assert (tables[:, :, -1] == empty).all()
        for rid in ids:
            info = m.request(rid)
            row, length = info.row, info.num_tokens
            for g, blocks in enumerate(m.block_table(rid)):
                want = [empty] * width
                for b, s in enumerate(blocks):
                    if b % cp == r:
                        want[b // cp] = s // cp if s >= 0 else empty
                assert tables[g, row].tolist() == want, (rid, r, g)
            tokens = sum(1 for t in range(length) if (t // TPB) % cp == r)
            assert view.context_lengths([rid]).tolist() == [tokens]
            k = min(length, 7)
            for g, group in enumerate(m.layout.layer_groups):
                layer = int(group.layers[0].layer_id)
                blocks = m.block_table(rid)[g]
                want_map = []
                for t in range(length - k, length):
                    b = t // TPB
                    s = blocks[b] if b < len(blocks) else -1
                    mine = b % cp == r and s >= 0
                    want_map.append((s // cp) * TPB + t % TPB if mine else -1)
                assert view.slot_mapping([rid], layer, k).tolist() == want_map, (rid, r, g)
                start, end = view.released_pages([rid], layer).tolist()[0]
                sinks, rel_end = group.sink_blocks, int(c.released_end[g][row])
                # The released range is exactly the global table's holes.
                holes = {b for b, s in enumerate(blocks) if s < 0}
                assert holes == set(range(sinks, rel_end)), (rid, g)
                local = {b // cp for b in range(sinks, rel_end) if b % cp == r}
                assert set(range(start, end)) == local
                for j in local:  # released: no page there
                    assert tables[g, row, j] == empty


@pytest.mark.parametrize(
    ("cp", "null_page", "seed"), [(2, False, 0), (3, True, 1), (4, False, 2), (2, True, 3)]
)
def test_random_ops_match_the_brute_force_model(cp: int, null_page: bool, seed: int) -> None:
    random_ops_against_the_model(cp, null_page, seed, "cpu", check_every=1 + seed % 3)


def random_ops_against_the_model(
    cp: int, null_page: bool, seed: int, device: str, check_every: int = 1
) -> None:
    """Allocates (with prompts that hit the prefix cache), chunked extends with lookahead,
    rejected drafts, commits, frees and decode batches; after every ``check_every`` ops
    every rank's view is checked against the model (``_check``), so that with more than 1
    the ranks' tables take the edits of several ops at once."""
    rng = np.random.default_rng(seed)
    m = manager(
        cp,
        [spec(0), spec(1, window=9, sinks=4)],
        device,
        num_blocks=18 * cp,
        null_page=null_page,
    )
    prompts = [rng.integers(0, 4, 24).tolist() for _ in range(3)]
    given: dict[str, list[int]] = {}
    serial = 0
    for step in range(120):
        ids = m.request_ids()
        op = rng.integers(0, 6) if ids else 0
        try:
            if op == 0:
                serial += 1
                prompt = prompts[rng.integers(0, 3)][: rng.integers(1, 25)]
                given[f"r{serial}"] = prompt
                m.allocate(
                    f"r{serial}", len(prompt), token_ids=prompt, lookahead=int(rng.integers(0, 3))
                )
            else:
                rid = ids[rng.integers(0, len(ids))]
                n = m.request(rid).num_tokens
                if op == 1:
                    m.extend(rid, int(rng.integers(1, 9)), lookahead=int(rng.integers(0, 4)))
                elif op == 2 and n > 1:
                    m.rewind(rid, int(rng.integers(1, min(n, 5))))
                elif op == 3:
                    done = len(m.committed_tokens(rid))
                    k = int(rng.integers(0, n - done + 1))
                    # The prompt's own tokens first (their blocks are what later prompts hit).
                    ours = given[rid][done : done + k]
                    m.commit(rid, ours + rng.integers(0, 4, k - len(ours)).tolist())
                elif op == 4:
                    m.free(rid)
                else:
                    # A decode batch; every third one all or nothing with a chunk that may
                    # not fit (then undone whole).
                    handles = [m.request(r).handle for r in ids]
                    atomic = step % 3 == 0
                    chunk = int(rng.integers(1, 60)) if atomic else 1
                    m.step_columns(extend=handles, num_new_tokens=chunk, atomic=atomic)
        except KVCMError:
            pass
        if step % check_every == 0:
            _check(m, cp, null_page)
    assert m.stats().prefix_cache.hit_tokens > 0  # the prompts did hit the cache


# -- Helix attention: every rank's partial attention, merged, is dense attention ------------


def _partial(
    m: KVCacheManager, r: int, rid: str, query: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank r's attention of ``query`` [heads, dim] over its own pages of ``rid``: the
    output and the log-sum-exp of the scores per head (what Helix ranks exchange)."""
    view = m.rank(r)
    row = m.request(rid).row
    n = int(view.context_lengths([rid])[0])
    pages = -(-n // TPB)
    slots = view.page_table(0)[row, :pages].long()
    keys = view.layer_view(0, "key")[slots].reshape(-1, *query.shape)[:n]
    values = view.layer_view(0, "value")[slots].reshape(-1, *query.shape)[:n]
    scores = torch.einsum("hd,thd->ht", query, keys) / query.shape[-1] ** 0.5
    lse = torch.logsumexp(scores, dim=-1)
    out = torch.einsum("ht,thd->hd", torch.softmax(scores, dim=-1), values)
    return out, lse


@pytest.mark.parametrize("cp", [2, 3])
def test_helix_ranks_merged_attention_equals_dense_attention(cp: int) -> None:
    helix_against_dense(cp, "cpu")


def helix_against_dense(cp: int, device: str) -> None:
    """A request prefilled in chunks then decoded: each step writes its tokens' KV through
    every rank's slot mapping (other ranks' tokens are -1 there), and a decode query's
    partial attentions of all ranks, merged by their log-sum-exps, equal dense attention
    over every token (the test's own copy of the KV)."""
    heads, dim = 2, 4
    m = manager(cp, [spec(0, num_kv_heads=heads, head_dim=dim)], device, num_blocks=16 * cp)
    gen = torch.Generator().manual_seed(cp)
    dense_k, dense_v = torch.empty(0, heads, dim), torch.empty(0, heads, dim)

    def step(new: int, first: bool = False) -> None:
        nonlocal dense_k, dense_v
        if first:
            m.allocate("a", new)
        else:
            m.extend("a", new)
        k, v = (
            torch.randn(new, heads, dim, generator=gen),
            torch.randn(new, heads, dim, generator=gen),
        )
        dense_k, dense_v = torch.cat([dense_k, k]), torch.cat([dense_v, v])
        for r in range(cp):
            view = m.rank(r)
            mapping = view.slot_mapping(["a"], 0)
            keep = mapping >= 0
            assert int(keep.sum()) == sum(
                1 for t in range(len(dense_k) - new, len(dense_k)) if (t // TPB) % cp == r
            )
            slots = mapping[keep]
            for role, data in (("key", k), ("value", v)):
                pages = view.layer_view(0, role)
                pages[slots // TPB, slots % TPB] = data.to(pages.device)[keep.to(pages.device)]

    step(11, first=True)
    for chunk in (7, 1, 1, 5, 1, 1, 1, 9, 1):
        step(chunk)
        query = torch.randn(heads, dim, generator=gen)
        parts = [_partial(m, r, "a", query.to(m.rank(r).device)) for r in range(cp)]
        parts = [(o.cpu(), lse.cpu()) for o, lse in parts]
        lse = torch.stack([p[1] for p in parts])  # [cp, heads]
        weights = torch.softmax(lse, dim=0)  # exp(lse_r - logsumexp over ranks)
        merged = sum(w.unsqueeze(-1) * p[0] for w, p in zip(weights, parts, strict=True))
        scores = torch.einsum("hd,thd->ht", query, dense_k) / dim**0.5
        dense = torch.einsum("ht,thd->hd", torch.softmax(scores, dim=-1), dense_v)
        torch.testing.assert_close(merged, dense)


# -- shared: a process per CP rank maps its own pools and tables ------------------------------


def cp_config(tmp_path: Path, cp: int, device: str = "cpu") -> Path:
    heads, dim = 2, 4
    layers = [spec(0, num_kv_heads=heads, head_dim=dim)]
    cfg = {
        "ranks": [{"device": device, "layers": layers, "cp_rank": c} for c in range(cp)],
        "context_parallel": cp,
        "tokens_per_block": TPB,
        "max_requests": 4,
        "max_seq_len": 96,
        "num_blocks": 16 * cp,
        "share": True,
    }
    path = tmp_path / "cfg.json"
    path.write_text(json.dumps(cfg))
    return path


def helix_through_attachments(url: str, cp: int) -> None:
    """The scheduler steps one request through the sidecar (its ``slot_mappings`` brings
    every rank's tables up to date); each rank's attachment writes the KV of its own tokens,
    found through its own shared tables, and the ranks' partial attentions, merged, equal
    dense attention. Then a process per rank maps its rank and reads its table row back."""
    heads, dim = 2, 4
    gen = torch.Generator().manual_seed(7)
    dense_k, dense_v = torch.empty(0, heads, dim), torch.empty(0, heads, dim)
    with KVCacheClient(url) as kv:
        atts = [kv.attach(rank=r) for r in range(cp)]
        assert [(a.layout.cp_rank, a.layout.context_parallel) for a in atts] == [
            (r, cp) for r in range(cp)
        ]
        kv.allocate("a", 11)
        new = 11
        for chunk in (0, 6, 1, 1, 9, 1):
            if chunk:
                kv.extend("a", chunk)
                new = chunk
            kv.slot_mappings(["a"])  # the step's mappings: every rank's tables are current
            info = kv.request("a")
            k = torch.randn(new, heads, dim, generator=gen)
            v = torch.randn(new, heads, dim, generator=gen)
            first = len(dense_k)
            dense_k, dense_v = torch.cat([dense_k, k]), torch.cat([dense_v, v])
            query = torch.randn(heads, dim, generator=gen)
            parts = []
            for r, att in enumerate(atts):
                table = att.page_tables[0, info.row]
                keys, values = att.layer_view(0, "key"), att.layer_view(0, "value")
                for i, t in enumerate(range(first, first + new)):
                    b = t // TPB
                    if b % cp == r:
                        slot = int(table[b // cp])
                        keys[slot, t % TPB] = k[i].to(keys.device)
                        values[slot, t % TPB] = v[i].to(keys.device)
                n = int(local_lengths(np.array([info.num_tokens]), TPB, cp, r)[0])
                slots = table[: -(-n // TPB)].long()
                mine_k = keys[slots].reshape(-1, heads, dim)[:n]
                mine_v = values[slots].reshape(-1, heads, dim)[:n]
                q = query.to(keys.device)
                scores = torch.einsum("hd,thd->ht", q, mine_k) / dim**0.5
                out = torch.einsum("ht,thd->hd", torch.softmax(scores, dim=-1), mine_v)
                parts.append((out.cpu(), torch.logsumexp(scores, dim=-1).cpu()))
            weights = torch.softmax(torch.stack([p[1] for p in parts]), dim=0)
            merged = sum(w.unsqueeze(-1) * p[0] for w, p in zip(weights, parts, strict=True))
            scores = torch.einsum("hd,thd->ht", query, dense_k) / dim**0.5
            dense_out = torch.einsum("ht,thd->hd", torch.softmax(scores, dim=-1), dense_v)
            torch.testing.assert_close(merged, dense_out)
        blocks = kv.block_table("a")[0]
        row = kv.request("a").row
        for att in atts:
            att.close()
        code = (
            "import sys; from kvcm_client import KVCacheClient\n"
            "r, row = int(sys.argv[2]), int(sys.argv[3])\n"
            "with KVCacheClient(sys.argv[1]) as kv, kv.attach(rank=r) as att:\n"
            "    print(att.page_tables[0, row, :8].tolist())\n"
        )
        for r in range(cp):
            proc = subprocess.run(
                [sys.executable, "-c", code, url, str(r), str(row)],
                capture_output=True,
                text=True,
                timeout=120,
            )
            assert proc.returncode == 0, proc.stderr
            mine = [s // cp for b, s in enumerate(blocks) if b % cp == r]
            assert json.loads(proc.stdout) == (mine + [-1] * 8)[:8]


@pytest.mark.slow
def test_a_process_per_cp_rank_maps_its_own_pools_and_tables(tmp_path: Path) -> None:
    with serve_process("--config", str(cp_config(tmp_path, 3))) as (url, _, _):
        helix_through_attachments(url, 3)


def test_free_blocks_count_what_a_new_request_can_get_per_class() -> None:
    """Block 0 of every request is of class 0: with class 0 full there is no room for any
    new request, however many slots other classes have (the router reads this figure)."""
    m = manager(2, num_blocks=8)  # 4 slots per class
    assert m.num_free_blocks() == m.num_total_blocks() == 4 * 2 + 0
    for i in range(4):
        m.allocate(f"r{i}", TPB)  # block 0 each: class 0 is full
    assert m.parts.coord.pools[0].free_by_class().tolist() == [0, 4]
    assert m.num_free_blocks() == 0 and m.stats().request_free_blocks == 0
    assert m.num_free_blocks(0) == 4  # the pool group's free slots, all classes
    with pytest.raises(OutOfBlocks):
        m.allocate("x", 1)
    m.free("r0")  # class 0: 1 free, class 1: 4 free -> blocks 0 and 1 fit, block 2 does not
    assert m.num_free_blocks() == 2
    m.allocate("y", 2 * TPB)
    with pytest.raises(OutOfBlocks):
        m.allocate("z", 1)
    for rid in m.request_ids():
        m.free(rid)
    assert m.num_free_blocks() == m.num_total_blocks()


def test_describe_says_a_cp_ranks_table_width() -> None:
    m = manager(3)  # max_seq_len 96: 24 positions, 8 per CP rank and the empty column
    for r in range(3):
        info = m.rank(r).describe()
        assert (info.context_parallel, info.cp_rank) == (3, r)
        assert info.max_blocks_per_request == 24
        assert info.page_table_width == m.rank(r).page_tables().shape[2] == 9
    assert manager(1).describe().page_table_width == 24

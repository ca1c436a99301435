"""Prefix reuse: block keys, hits, reference counts, LRU free order, probes, events."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
from helpers import layer, manager

from kvcm import KVCacheManager, block_keys
from kvcm.block_pool import BlockPool
from kvcm.hashing import MultimodalItem
from kvcm.prefix_cache import EventLog
from kvcm_client.errors import (
    DuplicateRequest,
    InvalidArgument,
    KVCMError,
    OutOfBlocks,
    PrefixCacheInUse,
    RequestLimitReached,
    RewindIntoSharedBlock,
)
from kvcm_client.models import AllocateOp, CommitOp, RewindOp

P = list(range(100, 148))  # a 48-token shared prefix: 3 blocks of 16


def full16(num_blocks: int = 16, **kw: object) -> KVCacheManager:
    return manager([layer(0)], tokens_per_block=16, num_blocks=num_blocks, max_seq_len=256, **kw)


def order(m: KVCacheManager, pg: int = 0) -> list[int]:
    return m.parts.coord.pools[pg].free_order().tolist()


def refs(m: KVCacheManager, slots: list[int], pg: int = 0) -> list[int]:
    return m.parts.coord.refs[pg][slots].tolist()


def test_miss_then_hit_on_a_shared_48_token_prefix() -> None:
    m = full16()
    a = m.allocate("a", 50, token_ids=[*P, 1, 2])
    assert (a.num_hit_tokens, m.block_table("a")) == (0, [[0, 1, 2, 3]])
    m.commit("a", [*P, 1, 2])  # blocks 0..2 are full: published; block 3 holds 2 tokens
    (stored,) = m.events().events
    assert stored.kind == "block_stored" and stored.layer_group == 0
    assert stored.block_keys == [k.hex() for k in block_keys(P, 16)]
    assert stored.parent_key is None and stored.token_ids == P
    b = m.allocate("b", 52, token_ids=[*P, 7, 8, 9, 10])
    assert (b.num_hit_tokens, b.num_committed) == (48, 48)
    assert m.block_table("b") == [[0, 1, 2, 4]]  # the hit blocks, then the queue's head
    assert refs(m, [0, 1, 2, 3, 4, 5]) == [2, 2, 2, 1, 1, 0]
    assert m.committed_tokens("b") == P
    # The last prompt token is always computed: a 48-token prompt reuses 32.
    assert m.probe(P) == 32 and m.probe([*P, 5]) == 48
    assert m.num_free_blocks() == 11  # probes claim nothing
    stats = m.stats().prefix_cache
    assert stats is not None
    assert (stats.queries, stats.query_tokens, stats.hit_tokens) == (2, 102, 48)
    assert stats.hit_rate == pytest.approx(48 / 102)
    assert stats.cached_blocks == {0: 3}


def test_free_order_after_two_requests_finish_and_a_hit_takes_a_freed_block() -> None:
    m = full16()
    m.allocate("a", 50, token_ids=[*P, 1, 2])
    m.commit("a", [*P, 1, 2])
    m.allocate("b", 52, token_ids=[*P, 7, 8, 9, 10])
    m.free("a")  # tail first: 3 is free now; 0..2 are still held by b
    assert order(m)[-1] == 3 and refs(m, [0, 1, 2]) == [1, 1, 1]
    m.free("b")  # 4, then the shared head 2, 1, 0: evicted last
    assert order(m) == [5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 3, 4, 2, 1, 0]
    assert m.num_free_blocks() == 16 and m.stats().prefix_cache.cached_blocks == {0: 3}  # type: ignore[union-attr]
    c = m.allocate("c", 40, token_ids=[*P[:32], *[0] * 8])
    assert c.num_hit_tokens == 32 and m.block_table("c") == [[0, 1, 5]]
    assert order(m) == [6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 3, 4, 2]  # 0 and 1 left the queue
    assert refs(m, [0, 1, 2, 5]) == [1, 1, 0, 1]


def test_eviction_takes_the_oldest_free_block_and_reports_it() -> None:
    m = full16(num_blocks=4)
    m.allocate("a", 33, token_ids=[*P[:32], 9])
    m.commit("a", [*P[:32], 9])  # blocks 0, 1 cached
    m.free("a")  # free order [3, 2, 1, 0]: 2 uncached, then the cached tail-first 1, 0
    assert order(m) == [3, 2, 1, 0]
    seq = m.events().last_seq
    m.allocate("x", 48)  # takes 3, 2, 1: evicts block 1's key
    removed = m.events(after=seq).events
    assert [(e.kind, e.block_keys) for e in removed] == [
        ("block_removed", [block_keys(P[:32], 16)[1].hex()])
    ]
    assert m.probe([*P[:32], 9]) == 16  # block 0 (never taken) still hits
    assert m.stats().prefix_cache.evictions == 1  # type: ignore[union-attr]
    with pytest.raises(OutOfBlocks):
        m.allocate("y", 40, token_ids=[*P[:32], *[1] * 8])  # hit 0 + 2 new > 1 free
    assert order(m) == [0] and refs(m, [0]) == [0]  # nothing changed


def test_decode_inside_a_partial_block_allocates_nothing_and_a_full_block_is_published() -> None:
    m = full16()
    tokens = list(range(500, 540))
    m.allocate("d", 20, token_ids=tokens[:20])
    m.commit("d", tokens[:20])  # block 0 published, block 1 holds 4 tokens
    seq = m.events().last_seq
    free = m.num_free_blocks()
    for t in range(20, 32):
        m.extend("d", 1)
        m.commit("d", [tokens[t]])
        assert m.num_free_blocks() == free  # positions 20..31 are in block 1
        if t < 31:
            assert m.events(after=seq).events == []
    (stored,) = m.events(after=seq).events
    keys = block_keys(tokens[:32], 16)
    assert stored.block_keys == [keys[1].hex()] and stored.parent_key == keys[0].hex()
    assert stored.token_ids == tokens[16:32]
    m.extend("d", 1)  # position 32: a new block
    assert m.num_free_blocks() == free - 1


def test_salts_and_lora_ids_isolate_tenants() -> None:
    m = full16()
    m.allocate("t1", 33, token_ids=[*P[:32], 0], cache_salt="tenant-1")
    m.commit("t1", [*P[:32], 0])
    assert m.probe([*P[:32], 0], cache_salt="tenant-1") == 32
    assert m.probe([*P[:32], 0], cache_salt="tenant-2") == 0
    assert m.probe([*P[:32], 0]) == 0
    assert m.events().events[0].has_salt is True
    keys = {
        repr(extra): block_keys(P, 16, **extra)[0]  # type: ignore[arg-type]
        for extra in (
            {},
            {"cache_salt": "a"},
            {"cache_salt": "b"},
            {"lora_id": 1},
            {"lora_id": "1"},
            {"lora_id": 1, "cache_salt": "a"},
        )
    }
    assert len(set(keys.values())) == 6


def test_multimodal_items_change_the_keys_of_the_blocks_they_touch() -> None:
    tokens = [7] * 64
    plain = block_keys(tokens, 16)
    image = block_keys(tokens, 16, multimodal=[{"digest": "img-A", "start": 20, "length": 20}])
    moved = block_keys(tokens, 16, multimodal=[MultimodalItem("img-A", 21, 20)])
    other = block_keys(tokens, 16, multimodal=[MultimodalItem("img-B", 20, 20)])
    assert image[0] == plain[0] == moved[0] == other[0]  # block 0 holds no image token
    for keys in (moved, other):
        assert all(k != i for k, i in zip(keys[1:], image[1:], strict=True))
    assert image[2] != plain[2]  # block 2 (32..47) holds the image's last tokens
    # A request with the image does not hit blocks cached without it.
    m = full16()
    m.allocate("p", 64, token_ids=tokens)
    m.commit("p", tokens)
    assert m.probe([*tokens, 1]) == 64
    assert m.probe([*tokens, 1], multimodal=[{"digest": "img-A", "start": 20, "length": 20}]) == 16


def test_keys_are_the_same_in_another_process() -> None:
    code = "from kvcm import block_keys; print(block_keys(list(range(40)), 8, 3, 's')[-1].hex())"
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout.strip()
    assert out == block_keys(list(range(40)), 8, 3, "s")[-1].hex()
    for bad in ([-1], [2**31], ["x"]):
        with pytest.raises(InvalidArgument):
            block_keys(bad, 8)  # type: ignore[arg-type]


def test_full_plus_sliding_hybrid_hit_needs_only_the_window() -> None:
    # Layer 0 full, layer 1 window 32, 16-token blocks: equal shapes, so one pool group of
    # 40 slots serves both layer groups.
    m = manager(
        [layer(0), layer(1, sliding_window=32)],
        tokens_per_block=16,
        num_blocks=40,
        max_seq_len=256,
    )
    prompt = list(range(1000, 1064))
    m.allocate("a", 64, token_ids=prompt)  # 4 blocks in each group
    m.commit("a", prompt)
    m.extend("a", 1)  # history 64: the window releases blocks [0, (65 - 32) // 16) = [0, 2)
    full_a, slide_a = m.block_table("a")
    assert slide_a[:2] == [-1, -1] and len(full_a) == 5
    b = m.allocate("b", 80, token_ids=[*prompt, *range(16)])
    assert b.num_hit_tokens == 64
    full_b, slide_b = m.block_table("b")
    assert full_b[:4] == full_a[:4]
    # The first new token (position 64) attends back to 33: blocks 2 and 3 are needed.
    assert slide_b[:4] == [-1, -1, slide_a[2], slide_a[3]]
    assert refs(m, [*full_a[:4], slide_a[2], slide_a[3]]) == [2] * 6
    # Released sliding blocks 0 and 1 were free (cached): a hit did not claim them.
    assert m.probe([*prompt, 0]) == 64


def test_reuse_none_groups_never_hit() -> None:
    m = manager([layer(0), layer(1, reuse="none")], tokens_per_block=16, max_seq_len=256)
    m.allocate("a", 33, token_ids=[*P[:32], 0])
    m.commit("a", [*P[:32], 0])
    assert [e.layer_group for e in m.events().events] == [0]  # only the reusable group
    assert m.probe([*P[:32], 0]) == 0
    assert m.allocate("b", 33, token_ids=[*P[:32], 0]).num_hit_tokens == 0


def test_rewinding_into_a_shared_block_is_refused_and_an_own_block_is_unpublished() -> None:
    m = full16()
    m.allocate("a", 40, token_ids=[*P[:32], *[0] * 8])
    m.commit("a", [*P[:32], *[0] * 8])
    m.allocate("b", 40, token_ids=[*P[:32], *[1] * 8])  # shares blocks 0, 1
    with pytest.raises(RewindIntoSharedBlock):
        m.rewind("b", 10)  # to 30 tokens: block 1 would be written again
    assert m.request("b").num_tokens == 40
    m.free("b")
    seq = m.events().last_seq
    m.rewind("a", 10)  # block 1 is a's alone now: taken out of the cache
    (removed,) = m.events(after=seq).events
    assert removed.kind == "block_removed"
    assert removed.block_keys == [block_keys(P[:32], 16)[1].hex()]
    assert m.probe([*P[:32], 0]) == 16


def test_reset_refuses_while_blocks_are_in_use_then_clears() -> None:
    m = full16()
    m.allocate("a", 33, token_ids=[*P[:32], 0])
    m.commit("a", [*P[:32], 0])
    with pytest.raises(PrefixCacheInUse):
        m.reset_prefix_cache()
    m.free("a")
    m.reset_prefix_cache()
    assert m.events().events[-1].kind == "all_blocks_cleared"
    assert m.probe([*P[:32], 0]) == 0 and m.num_free_blocks() == 16
    seqs = [e.seq for e in m.events().events]
    assert seqs == sorted(seqs) and len(set(seqs)) == len(seqs)


def test_the_event_log_is_bounded_and_says_when_a_reader_fell_behind() -> None:
    log = EventLog(capacity=3)
    for i in range(5):
        log.removed(0, [bytes([i])])
    events, lost = log.after(0, 10)
    assert lost and [e["seq"] for e in events] == [3, 4, 5]
    events, lost = log.after(2, 10)
    assert not lost and [e["seq"] for e in events] == [3, 4, 5]
    assert log.after(5, 10) == ([], False)
    assert log.after(3, 1)[0][0]["seq"] == 4


def test_an_atomic_step_that_fails_undoes_hits_publishing_and_events() -> None:
    m = full16(num_blocks=6)
    m.allocate("a", 33, token_ids=[*P[:32], 0])
    before = (m.events().last_seq, order(m), m.parts.coord.refs[0].tolist())
    results = m.step(
        [
            CommitOp(request_id="a", token_ids=[*P[:32], 0]),
            AllocateOp(request_id="b", num_tokens=33, token_ids=[*P[:32], 1]),
            AllocateOp(request_id="c", num_tokens=100),  # does not fit
        ],
        atomic=True,
    )
    assert [r.error.code for r in results if r.error] == [
        "step_aborted",
        "step_aborted",
        "out_of_blocks",
    ]
    assert (m.events().last_seq, order(m), m.parts.coord.refs[0].tolist()) == before
    assert m.probe([*P[:32], 0]) == 0 and m.request_ids() == ["a"]
    ok = m.step([CommitOp(request_id="a", token_ids=[*P[:32], 0])], atomic=True)
    assert ok[0].ok and m.probe([*P[:32], 5]) == 32


def test_idempotent_allocate_compares_the_prompt_too() -> None:
    m = full16()
    first = m.allocate("a", 20, token_ids=list(range(20)))
    assert m.allocate("a", 20, token_ids=list(range(20))) == first
    with pytest.raises(DuplicateRequest):
        m.allocate("a", 20, token_ids=list(range(1, 21)))
    with pytest.raises(InvalidArgument):
        m.allocate("z", 20, token_ids=list(range(19)))  # 19 ids for 20 tokens
    # The prompt is kept as bytes: a scheduler that appends to its own list after the
    # allocate still gets the first result for a retry with the prompt it sent.
    prompt = list(range(5, 25))
    second = m.allocate("b", 20, token_ids=prompt)
    prompt.append(99)
    assert m.allocate("b", 20, token_ids=list(range(5, 25))) == second
    assert m.allocate("b", 20, token_ids=(*range(5, 25),)) == second  # a tuple of the same ids


def test_random_sharing_keeps_reference_counts_and_the_free_list_consistent(
    rng: np.random.Generator,
) -> None:
    """Every slot is either free (in the queue once) or held: refs = holders, never both."""
    m = manager(
        [layer(0), layer(1, sliding_window=24, sink_tokens=4)],
        tokens_per_block=8,
        num_blocks=48,
        max_seq_len=128,
        max_requests=8,
    )
    prompts = [list(rng.integers(0, 50, 64)) for _ in range(3)]
    live: dict[str, list[int]] = {}
    most_shared = 0
    for i in range(400):
        kind = int(rng.integers(0, 6))
        if kind == 0 or not live:
            base = prompts[int(rng.integers(3))]
            n = int(rng.integers(2, 64))
            tokens = [int(t) for t in base[:n]]
            try:
                m.allocate(f"r{i}", n, token_ids=tokens)
            except (OutOfBlocks, RequestLimitReached):
                continue
            live[f"r{i}"] = tokens
            info = m.request(f"r{i}")
            m.commit(f"r{i}", tokens[info.num_committed :])
        elif kind == 1:
            rid = list(live)[int(rng.integers(len(live)))]
            try:
                m.extend(rid, 1)
            except OutOfBlocks:
                continue
            live[rid].append(int(rng.integers(0, 50)))
            m.commit(rid, live[rid][-1:])
        elif kind == 2:
            rid = list(live)[int(rng.integers(len(live)))]
            m.free(rid)
            del live[rid]
        elif kind == 3:
            m.probe([int(t) for t in prompts[int(rng.integers(3))][:40]])
        elif kind == 4:
            rid = list(live)[int(rng.integers(len(live)))]
            n = int(rng.integers(1, 6))
            try:
                info = m.rewind(rid, n)
            except KVCMError:  # past a window, into a shared block, or too far
                continue
            del live[rid][info.num_tokens :]
        else:
            ids = list(live)
            try:
                m.extend_many(ids)  # one batch over every request
            except OutOfBlocks:
                continue
            for rid in ids:
                live[rid].append(int(rng.integers(0, 50)))
                m.commit(rid, live[rid][-1:])
        for pg in range(len(m.parts.coord.pools)):
            held = np.zeros(m.num_total_blocks(pg), dtype=np.int32)
            for rid in live:
                row = m.request(rid).row
                for g, group in enumerate(m.layout.layer_groups):
                    if group.pool_group != pg:
                        continue
                    blocks = m.parts.coord.tables[g][row]
                    np.add.at(held, blocks[blocks >= 0], 1)
            assert m.parts.coord.refs[pg].tolist() == held.tolist()
            free = order(m, pg)
            assert sorted(free) == np.flatnonzero(held == 0).tolist()
            most_shared = max(most_shared, int(held.max()))
    assert most_shared >= 3  # prefixes were really shared, by several requests at once


@pytest.mark.parametrize("sizes", [(1, 10), (50, 300)])
def test_block_pool_matches_a_list_model_with_claims(
    sizes: tuple[int, int], rng: np.random.Generator
) -> None:
    """Pops, pushes and claims (which leave tombstones: with large pools, runs of them that a
    pop reads past as it widens its window) against a list."""
    for _ in range(100 if sizes[1] <= 10 else 20):
        n = int(rng.integers(*sizes))
        pool, model, held = BlockPool(n), list(range(n)), []
        for _ in range(100):
            action = int(rng.integers(0, 3))
            if action == 0 and model:
                k = int(rng.integers(0, len(model) + 1))
                assert pool.pop(k).tolist() == model[:k]
                held += model[:k]
                model = model[k:]
            elif action == 1 and held:
                k = int(rng.integers(0, len(held) + 1))
                back, held = held[:k], held[k:]
                pool.push(np.array(back, dtype=np.int32))
                model += back
            elif model:
                pick = [
                    int(s)
                    for s in rng.choice(model, int(rng.integers(0, len(model) + 1)), replace=False)
                ]
                pool.claim(np.array(pick, dtype=np.int32))
                model = [s for s in model if s not in pick]
                held += pick
            assert pool.free_order().tolist() == model and pool.num_free == len(model)


def test_an_aborted_step_restores_the_block_keys_a_rewind_dropped() -> None:
    m = full16(num_blocks=8)
    m.allocate("a", 40, token_ids=[*P[:32], *[0] * 8])
    m.commit("a", [*P[:32], *[0] * 8])
    keys = list(m.parts.requests.prefix["a"].keys)
    assert len(keys) == 2
    results = m.step(
        [RewindOp(request_id="a", num_tokens=20), AllocateOp(request_id="b", num_tokens=200)],
        atomic=True,
    )
    assert [r.error.code for r in results if r.error] == ["step_aborted", "out_of_blocks"]
    assert m.parts.requests.prefix["a"].keys == keys and m.committed_tokens("a") == [
        *P[:32],
        *[0] * 8,
    ]


def test_probe_takes_a_numpy_prompt_with_its_keys() -> None:
    m = full16()
    m.allocate("a", 33, token_ids=[*P[:32], 0])
    m.commit("a", [*P[:32], 0])
    prompt = np.array([*P[:32], 5])
    assert m.probe(prompt, block_keys=block_keys(prompt.tolist(), 16)) == 32
    assert m.probe(np.array([], dtype=np.int64), block_keys=[]) == 0

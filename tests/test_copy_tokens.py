"""``copy_tokens``: copy by value in every layer and role, and never into another request's KV.

The oracle snapshots every request's per-token KV of every (layer, role) through its block
table, applies the expected moves to the snapshot by value, and compares every token of every
request after the call, plus every slot no request holds.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers import copy_positions, layer, manager, random_copy_ops

import kvcm_kernels
from kvcm import InvalidArgument, KVCacheManager
from kvcm_client.errors import CopyIntoSharedBlock

TPB = 4

LAYOUTS: dict[str, list[dict[str, object]]] = {
    "full": [layer(0), layer(1)],
    # Groups {0} (window 8, 2 sink tokens = 1 block) and {1} (full) share pool group 0;
    # group {2} (window 12, key only, other shape) has pool group 1.
    "hybrid": [
        layer(0, sliding_window=8, sink_tokens=2),
        layer(1),
        layer(2, sliding_window=12, kv_factor=1, head_dim=8),
    ],
    "key_only": [layer(0, kv_factor=1), layer(1, kv_factor=1, num_kv_heads=1, dtype="fp32")],
    "nvfp4": [
        layer(0, num_kv_heads=2, head_dim=16, dtype="nvfp4"),
        layer(1, kv_factor=1, num_kv_heads=1, head_dim=32, dtype="nvfp4"),
    ],
    "everything": [
        layer(0),
        layer(1, sliding_window=8),
        layer(2, kv_factor=1, num_kv_heads=1),
        layer(3, num_kv_heads=2, head_dim=16, dtype="nvfp4"),
    ],
}


def _model(
    name: str = "everything", num_blocks: int = 64, null_page: bool = False
) -> KVCacheManager:
    m = manager(
        LAYOUTS[name], num_blocks=num_blocks, max_seq_len=64, max_requests=8, null_page=null_page
    )
    gen = torch.Generator().manual_seed(0)
    for t in m.memory.tensors:
        t.copy_(torch.randint(0, 256, t.shape, dtype=torch.uint8, generator=gen))
    return m


Snapshot = dict[tuple[int, str, str], dict[int, torch.Tensor]]


def _snapshot(m: KVCacheManager) -> Snapshot:
    """Per (layer, role, request): position -> a copy of that token's bytes, for every
    position of the request's capacity whose block its layer group holds."""
    out: Snapshot = {}
    for lid, spec in m.layout.layers.items():
        group = m.layer_group_of(lid)
        for role in spec.roles():
            view = m.layer_view(lid, role)
            for rid in m.request_ids():
                slots = np.array(m.block_table(rid)[group])
                out[(lid, role, rid)] = {
                    p: view[int(slots[p // TPB]), p % TPB].clone()
                    for p in range(m.request(rid).capacity)
                    if slots[p // TPB] >= 0
                }
    return out


def _free_slot_bytes(m: KVCacheManager) -> list[torch.Tensor]:
    """The bytes of every pool's slots that no request holds."""
    held: list[set[int]] = [set() for _ in m.layout.pool_groups]
    for rid in m.request_ids():
        for g, blocks in enumerate(m.block_table(rid)):
            held[m.layout.layer_groups[g].pool_group].update(b for b in blocks if b >= 0)
    out = []
    for pool, mem in zip(m.layout.pools, m.memory.tensors, strict=True):
        free = [s for s in range(mem.shape[0]) if s not in held[pool.pool_group]]
        out.append(mem[free].clone())
    return out


def _check_copy(m: KVCacheManager, request_ids: list[str], src: list[int], dst: list[int]) -> None:
    """``copy_tokens`` against the by-value oracle: each destination gets what its source
    held before the call; every other token and every free slot keeps its bytes."""
    before, free_before = _snapshot(m), _free_slot_bytes(m)
    expect = {key: dict(tokens) for key, tokens in before.items()}
    for (lid, role, rid), tokens in before.items():
        for r, s, d in zip(request_ids, src, dst, strict=True):
            if r == rid:
                expect[(lid, role, rid)][d] = tokens[s]
    m.copy_tokens(request_ids, src, dst)
    after = _snapshot(m)
    assert after.keys() == expect.keys()
    for key, tokens in expect.items():
        assert tokens.keys() == after[key].keys(), key
        for p, value in tokens.items():
            got = after[key][p]
            assert torch.equal(got.view(torch.uint8), value.view(torch.uint8)), (key, p)
    for old, new in zip(free_before, _free_slot_bytes(m), strict=True):
        assert torch.equal(old, new)


def _pool_bytes(m: KVCacheManager) -> list[torch.Tensor]:
    return [t.clone() for t in m.memory.tensors]


def _unchanged(m: KVCacheManager, before: list[torch.Tensor]) -> bool:
    return all(torch.equal(a, b) for a, b in zip(before, m.memory.tensors, strict=True))


# -- copy by value ---------------------------------------------------------------------------


@pytest.mark.parametrize("null_page", [False, True])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_tree_speculation_accepted_paths_relocate(layout: str, null_page: bool) -> None:
    m = _model(layout, null_page=null_page)
    # 44 verified tokens, then a draft tree at positions 44..51 (lookahead slots included).
    m.allocate("t", 40, lookahead=12)
    m.extend("t", 8, lookahead=4)  # length 48, capacity 52: blocks 0..12
    # A path through the tree 45 -> 44, 46 -> 45, 47 -> 46 (a chain: each destination is the
    # next op's source), crossing into block 11 from block 11's own tokens.
    _check_copy(m, ["t"] * 3, [45, 46, 47], [44, 45, 46])
    # Non-contiguous accepted nodes, out of order: 50 (block 12) -> 45, 47 -> 46.
    _check_copy(m, ["t", "t"], [50, 47], [45, 46])
    # The path in reverse order and a node that stays where it is (47 -> 47).
    _check_copy(m, ["t"] * 4, [51, 49, 47, 46], [47, 46, 45, 44])


@pytest.mark.parametrize("null_page", [False, True])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_cycles_swaps_and_repeated_sources(layout: str, null_page: bool) -> None:
    m = _model(layout, null_page=null_page)
    m.allocate("a", 30, lookahead=6)  # capacity 36
    m.allocate("b", 13)
    m.extend("b", 3, lookahead=2)  # capacity 18
    _check_copy(m, ["a", "a"], [33, 29], [29, 33])  # a swap across blocks 7 and 8
    _check_copy(m, ["a"] * 3, [31, 34, 28], [28, 31, 34])  # a 3-cycle
    _check_copy(m, ["b"] * 3, [15, 15, 15], [16, 17, 14])  # one source, three destinations
    # Both requests in one call: a's chain 32 -> 31 -> 30, b's token 16 -> 15 and back.
    _check_copy(m, ["a", "b", "a", "b"], [31, 16, 32, 15], [30, 15, 31, 16])


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("seed", range(8))
def test_random_relocations_copy_by_value(layout: str, seed: int) -> None:
    rng = np.random.default_rng(seed)
    m = _model(layout, num_blocks=128)
    prompt = [int(t) for t in rng.integers(0, 1000, size=20)]
    m.allocate("p", 20, token_ids=prompt)
    m.commit("p", prompt)  # blocks 0..4 published
    # q hits p's 5 blocks (20 tokens): all of them in full groups, sinks and window otherwise.
    m.allocate("q", 23, token_ids=[*prompt, 1, 2, 3], lookahead=3)
    for i in range(3):
        n = int(rng.integers(1, 30))
        m.allocate(f"r{i}", n, lookahead=int(rng.integers(0, 6)))
        m.extend(f"r{i}", int(rng.integers(1, 20)), lookahead=int(rng.integers(0, 8)))
    for _ in range(3):
        _check_copy(m, *random_copy_ops(rng, m))


def test_the_kernel_is_told_when_no_destination_is_read(monkeypatch: pytest.MonkeyPatch) -> None:
    """``disjoint=True`` (one launch on CUDA, racy if wrong) only when no op reads a
    (request, position) that another op writes."""
    calls: list[bool] = []
    monkeypatch.setattr(
        kvcm_kernels, "copy_tokens", lambda *args, disjoint, min_live: calls.append(disjoint)
    )
    m = _model("full")
    m.allocate("a", 12)
    m.allocate("b", 12)
    m.copy_tokens(["a", "a"], [9, 10], [1, 2])  # reads 9, 10, writes 1, 2
    m.copy_tokens(["a", "b"], [5, 6], [6, 5])  # same numbers, different requests
    m.copy_tokens(["a", "a"], [10, 11], [9, 10])  # a chain: 10 is read and written
    m.copy_tokens(["a", "a"], [3, 7], [7, 3])  # a swap
    m.copy_tokens(["b"], [4], [4])  # onto itself
    assert calls == [True, True, False, False, False]


def test_copy_tokens_of_no_ops_is_a_no_op() -> None:
    m = _model()
    m.allocate("a", 5)
    before = _pool_bytes(m)
    m.copy_tokens([], [], [])
    assert _unchanged(m, before)


# -- refusals ----------------------------------------------------------------------------------


def _shared_pair(layout: str) -> KVCacheManager:
    """a committed 13 tokens (full blocks 0..2 published); b hit them (shared, refs 2)."""
    m = _model(layout)
    prompt = list(range(100, 112))
    m.allocate("a", 13, token_ids=[*prompt, 7], lookahead=3)
    m.commit("a", [*prompt, 7])
    info = m.allocate("b", 14, token_ids=[*prompt, 8, 9], lookahead=2)
    assert info.num_hit_tokens == 12
    return m


@pytest.mark.parametrize("rid,dst", [("b", 5), ("a", 5), ("b", 0), ("a", 11)])
def test_copy_into_a_block_shared_through_a_prefix_hit_is_refused(rid: str, dst: int) -> None:
    m = _shared_pair("full")
    before = _pool_bytes(m)
    with pytest.raises(CopyIntoSharedBlock) as err:
        # The first op is fine; the second writes into the shared block: nothing happens.
        m.copy_tokens([rid, rid], [13, 14], [15, dst])
    assert err.value.code == "copy_into_shared_block" and err.value.status == 409
    assert err.value.detail["position"] == dst and err.value.detail["holders"] == 2
    assert _unchanged(m, before)


def test_copy_into_a_published_block_held_by_this_request_alone_is_refused() -> None:
    m = _model("hybrid")
    prompt = list(range(10, 22))
    m.allocate("a", 12, token_ids=prompt, lookahead=4)
    m.commit("a", prompt)  # blocks 0..2 published; nobody else holds them
    before = _pool_bytes(m)
    with pytest.raises(CopyIntoSharedBlock) as err:
        m.copy_tokens(["a"], [13], [9])
    assert err.value.detail == {
        "request_id": "a",
        "position": 9,
        "layer_group": 0,
        "holders": 1,
        "published": True,
    }
    assert _unchanged(m, before)
    _check_copy(m, ["a"], [9], [13])  # out of it is fine, and so is the unpublished tail


def test_copy_into_a_block_published_in_one_layer_group_only_is_refused() -> None:
    """Group 0 never publishes (reuse none), group 1 does: refused all the same."""
    m = manager([layer(0, reuse="none"), layer(1)], num_blocks=32)
    prompt = list(range(8))
    m.allocate("a", 9, token_ids=[*prompt, 8])
    m.commit("a", prompt)
    a = m.block_table("a")  # both groups in pool group 0
    assert not m.parts.coord.cache.cached[0][a[0][1]] and m.parts.coord.cache.cached[0][a[1][1]]
    before = _pool_bytes(m)
    with pytest.raises(CopyIntoSharedBlock) as err:
        m.copy_tokens(["a"], [8], [7])
    assert err.value.detail["layer_group"] == 1
    assert _unchanged(m, before)


@pytest.mark.parametrize("layout", ["full", "hybrid", "everything"])
def test_sources_in_shared_blocks_may_be_read(layout: str) -> None:
    m = _shared_pair(layout)
    readable, _ = copy_positions(m, "b")
    shared = [int(p) for p in readable if p < 12]
    # b's own tokens 12..15 get copies of shared tokens; a's tail 13..15 too.
    _check_copy(m, ["b", "b", "a"], [shared[0], shared[-1], shared[-1]], [12, 15, 14])
    assert m.block_table("a")[0][:3] == m.block_table("b")[0][:3]


@pytest.mark.parametrize("null_page", [False, True])
def test_invalid_positions_are_refused_and_change_nothing(null_page: bool) -> None:
    """With the null page a released block is 0 in the table: refused all the same."""
    m = _model(null_page=null_page)
    m.allocate("a", 16)
    m.extend("a", 1)  # window group: blocks 0, 1 released ((16 + 1 - 8) // 4 = 2)
    before = _pool_bytes(m)
    with pytest.raises(InvalidArgument):
        m.copy_tokens(["a"], [17], [2])  # past capacity (17 tokens)
    with pytest.raises(InvalidArgument):
        m.copy_tokens(["a"], [2], [16])  # past capacity: the source
    with pytest.raises(InvalidArgument, match="layer group 1 released"):
        m.copy_tokens(["a"], [16], [1])  # a destination in a released window block
    with pytest.raises(InvalidArgument, match="layer group 1 released"):
        m.copy_tokens(["a", "a"], [14, 5], [12, 13])  # a source in a released window block
    with pytest.raises(InvalidArgument, match="distinct"):
        m.copy_tokens(["a", "a"], [14, 15], [12, 12])  # duplicate destination
    with pytest.raises(InvalidArgument):
        m.copy_tokens(["a"], [14, 15], [12])
    with pytest.raises(InvalidArgument):
        m.copy_tokens(["a"], [-1], [12])
    assert _unchanged(m, before)

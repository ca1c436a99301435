"""The null page (``ManagerConfig.null_page``): slot 0 of every pool group is reserved and
zero-filled, and every kernel-facing table holds 0 where there is no page, so that attention
kernels that load whole tiles of pages never read through a -1.

The hybrid model below has two full layers (0, 1) and two sliding-window layers (2, 3: window
8, 4 sink tokens = 1 sink block) of one shape, so one pool group (slots 1..15 usable, handed
out in order) serves layer group 0 (full) and layer group 1 (window), 4 tokens per block.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from helpers import layer, manager
from servers import serve_process

from kvcm import InsufficientMemory, KVCacheManager, KVCMError, OutOfBlocks
from kvcm_client import KVCacheClient
from kvcm_client.models import AllocateOp, ExtendOp
from kvcm_client.paged_attention import key_mask, write_kv
from kvcm_client.shared import Attachment

HYBRID = [
    layer(0),
    layer(1),
    layer(2, sliding_window=8, sink_tokens=4),
    layer(3, sliding_window=8, sink_tokens=4),
]


def _hybrid() -> KVCacheManager:
    return manager(HYBRID, max_requests=4, max_seq_len=32, null_page=True)


def _decoded() -> KVCacheManager:
    """a: 10-token prompt, b: 5-token prompt, then 7 decode steps of both (a to 17, b to 12).

    Slots in order: a takes 1 2 3 (full) and 4 5 6 (window), b 7 8 and 9 10. b's third block
    (step 4) is 13 / 14 after a's fourth (step 3, 11 / 12). At step 6 a goes from 15 to 16
    tokens with history 15: (15 + 1 - 8) // 4 = 2, so window block 1 (slot 5) is released,
    and at step 7 a's fifth block takes 15 (full) and the freed 5 (window).
    """
    m = _hybrid()
    m.allocate("a", 10)
    m.allocate("b", 5)
    assert m.page_tables().tolist() == [
        [[1, 2, 3, 0, 0, 0, 0, 0], [7, 8, 0, 0, 0, 0, 0, 0], [0] * 8, [0] * 8],
        [[4, 5, 6, 0, 0, 0, 0, 0], [9, 10, 0, 0, 0, 0, 0, 0], [0] * 8, [0] * 8],
    ]
    for _ in range(7):
        m.extend_many(["a", "b"])
    return m


def test_tables_after_prefill_decode_past_the_window_and_free() -> None:
    m = _decoded()
    assert m.page_tables().tolist() == [
        [[1, 2, 3, 11, 15, 0, 0, 0], [7, 8, 13, 0, 0, 0, 0, 0], [0] * 8, [0] * 8],
        [[4, 0, 6, 12, 5, 0, 0, 0], [9, 10, 14, 0, 0, 0, 0, 0], [0] * 8, [0] * 8],
    ]
    # Bookkeeping keeps -1 for the released block.
    assert m.block_table("a") == [[1, 2, 3, 11, 15], [4, -1, 6, 12, 5]]
    assert m.block_table("b") == [[7, 8, 13], [9, 10, 14]]
    # Slot mode is the table; kernel mode is slot x 4 buffers / kv_factor 2 = 2 x slot, and
    # per layer adds layer 3's page offset 1 (K2 V2 K3 V3): the null page is page 0 or 1, both
    # inside slot 0.
    assert m.page_indices(["b", "a"], 2).tolist() == [
        [9, 10, 14, 0, 0, 0, 0, 0],
        [4, 0, 6, 12, 5, 0, 0, 0],
    ]
    assert m.page_indices(["a", "b"], 2, mode="kernel").tolist() == [
        [8, 0, 12, 24, 10, 0, 0, 0],
        [18, 20, 28, 0, 0, 0, 0, 0],
    ]
    assert m.page_indices(["a", "b"], 3, "value", mode="kernel", per_layer=True).tolist() == [
        [9, 1, 13, 25, 11, 1, 1, 1],
        [19, 21, 29, 1, 1, 1, 1, 1],
    ]
    assert m.page_indices(["a"], 0, mode="kernel", per_layer=True).tolist() == [
        [2, 4, 6, 22, 30, 0, 0, 0]
    ]
    assert m.parts.coord.pools[0].free_order().tolist() == []
    st = m.stats()
    assert (st.total_blocks, st.used_blocks, st.free_blocks) == ({0: 15}, {0: 15}, {0: 0})
    m.free("a")
    assert m.page_tables()[:, 0].tolist() == [[0] * 8, [0] * 8]
    # Freed tail first per layer group: full 15 11 3 2 1, then window 5 12 6 4.
    assert m.parts.coord.pools[0].free_order().tolist() == [15, 11, 3, 2, 1, 5, 12, 6, 4]
    m.free("b")
    assert (m.page_tables() == 0).all()
    assert m.num_free_blocks(0) == m.num_total_blocks(0) == 15
    assert m.num_free_blocks() == m.num_total_blocks() == 7  # 15 // 2 layer groups


def test_slot_mapping_keeps_minus_one_for_padding_and_released_blocks() -> None:
    m = _decoded()
    # a's 17 positions in the window group: block 1 (positions 4..7) is the null page in the
    # table and -1 here; b's 12 positions; 3 of padding. Slot s covers 4 s .. 4 s + 3.
    want = [16, 17, 18, 19, -1, -1, -1, -1, 24, 25, 26, 27, 48, 49, 50, 51, 20]
    want += [36, 37, 38, 39, 40, 41, 42, 43, 56, 57, 58, 59, -1, -1, -1]
    got = m.slot_mapping(["a", "b"], 2, num_tokens=[17, 12], pad_to=32)
    assert got.tolist() == want
    assert not ((got >= 0) & (got < m.tokens_per_block)).any()  # nothing lands in slot 0
    # The step's own tokens (a's 17th, b's 12th) in both layer groups at once.
    assert m.slot_mappings(["a", "b"], pad_to=3).tolist() == [[60, 55, -1], [20, 59, -1]]


def test_slot_zero_is_never_handed_out_even_when_the_pool_runs_dry() -> None:
    m = manager([layer(0), layer(1, sliding_window=4)], num_blocks=9, null_page=True)
    assert m.describe().pool_groups[0].num_slots == 9  # the memory: slot 0 included
    assert m.num_total_blocks(0) == m.stats().total_blocks[0] == 8
    m.allocate("a", 9)  # 3 + 3 blocks
    with pytest.raises(OutOfBlocks):
        m.allocate("b", 5)  # 2 + 2 > 2 free
    m.allocate("b", 4)  # 1 + 1
    assert m.num_free_blocks() == 0
    for grow in (lambda: m.extend("b", 1), lambda: m.allocate("c", 1)):
        with pytest.raises(OutOfBlocks):
            grow()
    assert m.block_table("a") == [[1, 2, 3], [4, 5, 6]] and m.block_table("b") == [[7], [8]]
    assert m.parts.coord.refs[0][0] == 0 and not m.parts.coord.cache.cached[0][0]


def test_the_null_page_needs_a_second_slot_in_every_pool_group() -> None:
    with pytest.raises(InsufficientMemory) as exc:
        manager([layer(0)], num_blocks=1, null_page=True)
    assert exc.value.detail == {"pool_group": 0, "num_slots": 1}
    assert manager([layer(0)], num_blocks=2, null_page=True).num_total_blocks() == 1


SIZING_LAYERS = [  # two pool groups: window + full of one shape, and a wider window layer
    layer(0, sliding_window=32, sink_tokens=4),
    layer(1),
    layer(2, sliding_window=24, num_kv_heads=4),
]


def _grow_lockstep(m: KVCacheManager, n: int, seq_len: int) -> None:
    """n requests decoded one token per step up to seq_len tokens."""
    ids = [f"r{i}" for i in range(n)]
    for rid in ids:
        m.allocate(rid, 1)
    for _ in range(seq_len - 1):
        m.extend_many(ids)


@pytest.mark.parametrize("budget", [{"memory_bytes": 96 << 10}, {"num_blocks": 61}])
@pytest.mark.parametrize("seq_len", [17, 100, 333])
def test_the_estimate_counts_usable_slots_so_n_fit_and_n_plus_one_do_not(
    budget: dict[str, int], seq_len: int
) -> None:
    def fresh() -> KVCacheManager:
        return manager(
            SIZING_LAYERS,
            tokens_per_block=16,
            max_requests=1024,
            max_seq_len=512,
            max_prefill_chunk=1,  # the lockstep below grows one token per op
            null_page=True,
            **budget,
        )

    m = fresh()
    est = m.estimate(seq_len)
    allocated = [pg.num_slots for pg in m.describe().pool_groups]
    assert [pg.num_slots for pg in est.pool_groups] == [n - 1 for n in allocated]
    assert [m.num_total_blocks(pg) for pg in range(2)] == [n - 1 for n in allocated]
    assert est.limited_by == "memory" and est.max_requests >= 1
    _grow_lockstep(fresh(), est.max_requests, seq_len)
    with pytest.raises(OutOfBlocks):
        _grow_lockstep(fresh(), est.max_requests + 1, seq_len)


def test_slot_zero_of_every_pool_is_zeroed_at_start(monkeypatch: pytest.MonkeyPatch) -> None:
    """Private pools come from ``torch.empty``: poison what it returns to see the zeroing."""
    real_empty = torch.empty

    def poisoned(*args: Any, **kwargs: Any) -> torch.Tensor:
        out = real_empty(*args, **kwargs)
        if out.dtype == torch.uint8:
            out.fill_(0xA5)
        return out

    monkeypatch.setattr(torch, "empty", poisoned)
    layers = [layer(0), layer(1, sliding_window=8), layer(2, head_dim=16, dtype="nvfp4")]
    on = manager(layers, null_page=True)
    off = manager(layers)
    monkeypatch.undo()
    assert len(on.memory.tensors) == 3  # data pools and the nvfp4 scale pool
    for pool_on, pool_off in zip(on.memory.tensors, off.memory.tensors, strict=True):
        assert (pool_on[0] == 0).all() and (pool_on[1:] == 0xA5).all()
        assert (pool_off == 0xA5).all()
    assert (on.kv_view(2)[0].view(torch.uint8) == 0).all()
    assert (on.layer_view(2, "value_scale")[0].view(torch.uint8) == 0).all()


def test_prefix_hits_are_exact_and_unneeded_window_blocks_are_the_null_page() -> None:
    """p's 21 tokens commit 5 full blocks, p is freed, q with the same prompt hits 20 tokens.

    The window group needs its sink block 0 and the blocks the first new token (position 20)
    attends to, [max(1, (20 + 1 - 8) // 4), 5) = [3, 5): blocks 1 and 2 are not placed
    (-1 in block_table, 0 in the table). q's sixth blocks are the queue's head, 13 and 14.
    """
    m = _hybrid()
    prompt = list(range(100, 121))
    m.allocate("p", 21, token_ids=prompt)
    m.commit("p", prompt)
    assert m.block_table("p") == [[1, 2, 3, 4, 5, 6], [7, 8, 9, 10, 11, 12]]
    m.free("p")
    info = m.allocate("q", 21, token_ids=prompt)
    assert (info.row, info.num_hit_tokens, info.num_committed) == (0, 20, 20)
    assert m.block_table("q") == [[1, 2, 3, 4, 5, 13], [7, -1, -1, 10, 11, 14]]
    assert m.page_tables()[:, 0].tolist() == [
        [1, 2, 3, 4, 5, 13, 0, 0],
        [7, 0, 0, 10, 11, 14, 0, 0],
    ]
    # Free: 15, p's sixth blocks (6, 12: never full, never cached) and p's window blocks 2
    # and 1 (9, 8), still cached for a later hit.
    assert m.parts.coord.pools[0].free_order().tolist() == [15, 6, 12, 9, 8]
    assert m.parts.coord.cache.cached[0][[6, 12, 9, 8]].tolist() == [False, False, True, True]
    assert m.probe(prompt) == 20
    m.free("q")
    assert (m.page_tables() == 0).all()


def test_an_aborted_atomic_step_restores_tables_holding_the_null_page() -> None:
    """The step releases a's window block 2 (history 21: (21 + 1 - 8) // 4 = 3), writing the
    null page into the table, then fails: the table holds slot 6 there again."""
    m = _decoded()
    m.free("b")

    def snapshot() -> object:
        return (
            m.page_tables().tolist(),
            m.block_table("a"),
            m.parts.coord.pools[0].free_order().tolist(),
            m.stats(),
        )

    before = snapshot()
    ops = [
        ExtendOp(request_id="a", num_new_tokens=4),
        ExtendOp(request_id="a", num_new_tokens=4),
        AllocateOp(request_id="c", num_tokens=64),  # past max_seq_len: the step fails
    ]
    results = m.step(ops, atomic=True)
    assert [r.ok for r in results] == [False] * 3
    assert results[2].error is not None and results[2].error.code == "sequence_too_long"
    assert snapshot() == before
    assert [r.ok for r in m.step(ops[:2], atomic=True)] == [True, True]
    assert m.block_table("a")[1][:3] == [4, -1, -1]
    assert m.page_tables()[1, 0, :3].tolist() == [4, 0, 0]


# -- the null page changes nothing but the slot numbers ------------------------------------------


def _shifted(table: torch.Tensor) -> torch.Tensor:
    """A plain manager's table as the null-page manager shows it: slot s is s + 1 there (its
    free queue starts [1, 2, ...] where the plain one starts [0, 1, ...]), -1 is the null page."""
    return torch.where(table >= 0, table + 1, 0)


def test_random_ops_give_the_plain_managers_tables_one_slot_up(rng: np.random.Generator) -> None:
    """With one slot more allocated, the null-page manager has the plain manager's usable slots
    and makes the same decisions (hits, releases, evictions, out-of-blocks) on random ops of
    every kind; its tables are the plain ones with slot s as s + 1 and 0 for -1, its block
    tables keep -1, and its slot mappings point one slot (tokens_per_block) further."""
    layers = [
        layer(0, sliding_window=6, sink_tokens=3),
        layer(1),
        layer(2, sliding_window=9),
        layer(3, num_kv_heads=1, kv_factor=1),
    ]
    plain = manager(layers, num_blocks=40)
    null = manager(layers, num_blocks=41, null_page=True)
    assert null.num_total_blocks(0) == plain.num_total_blocks(0) == 40
    assert null.num_total_blocks(1) == plain.num_total_blocks(1) == 40
    tpb = plain.tokens_per_block
    families = [rng.integers(0, 50, size=80).tolist() for _ in range(3)]
    family: dict[str, int] = {}

    def both(op: Callable[[KVCacheManager], Any]) -> Any:
        out = []
        for m in (plain, null):
            try:
                out.append(op(m))
            except KVCMError as exc:
                out.append(exc.code)
        assert out[0] == out[1]
        return out[0]

    for step in range(300):
        live = plain.request_ids()
        kind = rng.choice(["allocate", "batch", "commit", "rewind", "free", "atomic"])
        if kind == "allocate" or not live:
            rid, f, n = f"r{step}", int(rng.integers(3)), int(rng.integers(1, 40))
            family[rid] = f
            both(lambda m, rid=rid, f=f, n=n: m.allocate(rid, n, token_ids=families[f][:n]))
        elif kind == "batch":
            ids = [r for r in live if plain.request(r).num_tokens + 3 <= 64]
            both(lambda m, ids=ids: m.extend_many(ids, 1, 1))
        elif kind == "commit":
            rid = live[int(rng.integers(len(live)))]
            info = plain.request(rid)
            ids = families[family[rid]][info.num_committed : info.num_tokens]
            both(lambda m, rid=rid, ids=ids: m.commit(rid, ids))
        elif kind == "rewind":
            rid = live[int(rng.integers(len(live)))]
            k = int(rng.integers(1, 5))
            both(lambda m, rid=rid, k=k: m.rewind(rid, k))
        elif kind == "free":
            rid = live[int(rng.integers(len(live)))]
            both(lambda m, rid=rid: m.free(rid))
        else:
            # All or nothing; the allocate fails past max_seq_len (64), undoing the extends.
            rid, f, n = f"x{step}", int(rng.integers(3)), int(rng.integers(1, 80))
            family[rid] = f
            ops = [ExtendOp(request_id=r, num_new_tokens=2) for r in live[:3]]
            ops.append(AllocateOp(request_id=rid, num_tokens=n, token_ids=families[f][:n]))
            both(lambda m, ops=ops: m.step(ops, atomic=True))
        assert torch.equal(null.page_tables(), _shifted(plain.page_tables()))
        live = plain.request_ids()
        assert null.request_ids() == live
        for rid in live:
            shifted = [[s + 1 if s >= 0 else -1 for s in row] for row in plain.block_table(rid)]
            assert null.block_table(rid) == shifted
        for pg in range(2):
            order = plain.parts.coord.pools[pg].free_order() + 1
            assert np.array_equal(null.parts.coord.pools[pg].free_order(), order)
        assert null.stats() == plain.stats()
        if live and step % 10 == 0:  # a CPU slot mapping costs ms on a busy 2-core machine
            counts = [plain.request(r).num_tokens for r in live]
            want = plain.slot_mappings(live, counts)
            assert torch.equal(
                null.slot_mappings(live, counts), torch.where(want >= 0, want + tpb, -1)
            )
            a = plain.page_indices(live, 1, "value", mode="kernel", per_layer=True)
            b = null.page_indices(live, 1, "value", mode="kernel", per_layer=True)
            # Layer 1 alone in its pool (K V): kernel page = slot, value offset 0.
            assert torch.equal(b, _shifted(a))


# -- a consumer that loads whole tiles of pages ----------------------------------------------------

TPB, TILE = 16, 32  # a tile covers two pages, as in tile-loading paged-attention kernels
TILE_LAYERS = [
    {"layer_id": 0, "num_kv_heads": 2, "head_dim": 8, "dtype": "fp32"},
    {
        "layer_id": 1,
        "num_kv_heads": 2,
        "head_dim": 8,
        "dtype": "fp32",
        "sliding_window": 24,
        "sink_tokens": 4,
    },
]
TILE_CONFIG = {
    "layers": TILE_LAYERS,
    "tokens_per_block": TPB,
    "max_requests": 4,
    "max_seq_len": 128,  # rows of 8 pages: 4 tiles
    "num_blocks": 64,
}
Q_HEADS = 4  # GQA 2:1


def _tile_pages(tables: torch.Tensor, group: int, row: int) -> torch.Tensor:
    """What the kernel loads: every page of every tile of the whole padded row, ``[tiles,
    pages per tile]``, straight from the page table, with no check of the entries."""
    return tables[group, row].long().view(-1, TILE // TPB)


def _masked_attention(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, num_tokens: int, spec: dict
) -> torch.Tensor:
    """Attention of the last ``len(q)`` of ``num_tokens`` positions over ``keys`` / ``values``
    ``[T, H, D]`` (T >= num_tokens), masked by position only: causal, window and sinks.
    Computed on the keys' device, returned on the CPU."""
    held = torch.ones(num_tokens, dtype=torch.bool, device=keys.device)  # no table check
    window, sinks = spec.get("sliding_window"), spec.get("sink_tokens", 0)
    allowed = key_mask(num_tokens, q.shape[0], held, window, sinks)
    mask = torch.nn.functional.pad(allowed, (0, keys.shape[0] - num_tokens))  # False past T
    g = q.shape[1] // keys.shape[1]
    k = keys.float().repeat_interleave(g, dim=1)
    v = values.float().repeat_interleave(g, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.to(k.device).float(), k) / math.sqrt(q.shape[-1])
    scores = scores.masked_fill(~mask[None], float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(dim=-1), v).cpu()


def tile_attention(
    att: Attachment, layer_id: int, row: int, num_tokens: int, q: torch.Tensor, spec: dict
) -> torch.Tensor:
    """Like a tile-loading kernel: gather every page of every tile of the row unmasked (keys
    and values of ``max_blocks_per_request * TPB`` positions), then mask only the scores."""
    pages = _tile_pages(att.page_tables, att.layout.layer_group_of[layer_id], row)
    keys = att.layer_view(layer_id, "key")[pages].flatten(0, 2)  # [tiles * 2 * TPB, H, D]
    values = att.layer_view(layer_id, "value")[pages].flatten(0, 2)
    return _masked_attention(q, keys, values, num_tokens, spec)


def write_tile_config(tmp_path: Path, device: str = "cpu") -> Path:
    """A ``--config`` file for ``kvcm serve`` that turns the null page on and shares memory."""
    path = tmp_path / "cfg.json"
    config = TILE_CONFIG | {"device": device, "share": True, "null_page": True}
    path.write_text(json.dumps(config))
    return path


def decode_tiles_against_dense(url: str, steps: int = 40) -> float:
    """Three requests prefill, then decode ``steps`` steps. At every step this process,
    attached to the service's pools and tables, loads whole tiles of every row, and the result
    must equal dense attention over every key so far (the worst absolute difference is
    returned). The shared tables never hold -1: released window blocks and the rows' tails are
    the null page, which is still zero at the end."""
    gen = torch.Generator().manual_seed(0)
    prompts = {"a": 20, "b": 33, "c": 50}
    ids = list(prompts)
    worst = 0.0
    with KVCacheClient(url) as kv, kv.attach() as att:
        assert att.layout.null_page and (att.page_tables == 0).all()
        rows = {rid: kv.allocate(rid, n).row for rid, n in prompts.items()}
        lengths, new = dict(prompts), dict(prompts)
        history: dict[tuple[str, int], list[torch.Tensor]] = {}
        null_pages_read = 0
        for step in range(steps + 1):
            if step:
                kv.extend_many(ids)
                lengths = {rid: n + 1 for rid, n in lengths.items()}
                new = dict.fromkeys(ids, 1)
            # The step's slot mapping also brings CUDA tables up to date (edits are lazy).
            mappings = torch.tensor(kv.slot_mappings(ids))
            assert int(att.page_tables.min()) == 0
            start = 0
            for rid in ids:
                n, length, row = new[rid], lengths[rid], rows[rid]
                for spec in TILE_LAYERS:
                    lid, group = spec["layer_id"], att.layout.layer_group_of[spec["layer_id"]]
                    q = torch.randn(n, Q_HEADS, 8, generator=gen)
                    kv_new = torch.randn(2, n, 2, 8, generator=gen)
                    write_kv(att, lid, mappings[group, start : start + n], *kv_new)
                    history.setdefault((rid, lid), []).append(kv_new)
                    every = torch.cat(history[(rid, lid)], dim=1)
                    want = _masked_attention(q, every[0], every[1], length, spec)
                    got = tile_attention(att, lid, row, length, q, spec)
                    worst = max(worst, float((got - want).abs().max()))
                    live = _tile_pages(att.page_tables, group, row).flatten()[: -(-length // TPB)]
                    null_pages_read += int((live == 0).sum())
                start += n
        assert null_pages_read > 0  # released window blocks were read as the null page
        window = kv.block_table("a")[1]  # bookkeeping: -1 for the released blocks
        table = att.page_table(1)[rows["a"]].tolist()
        assert window[1] == -1 and table[: len(window)] == [max(s, 0) for s in window]
        for (lid, role), view in att.views.items():
            assert (view[0] == 0).all(), (lid, role)  # nobody wrote into the null page
        for rid in ids:
            kv.free(rid)
        kv.slot_mappings([])  # CUDA: applies the frees' table edits
        assert (att.page_tables == 0).all()
    return worst


@pytest.fixture
def one_torch_thread() -> Iterator[None]:
    """Tiny CPU ops run faster on one thread, and far faster on a busy machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_a_tile_loading_consumer_equals_dense_attention_with_the_null_page(
    tmp_path: Path, one_torch_thread: None
) -> None:
    """40 decode steps take every request past the window (24 tokens, one sink block: blocks
    are released from history 55 on, so a's from step 35)."""
    with serve_process("--config", str(write_tile_config(tmp_path))) as (url, _, _):
        assert decode_tiles_against_dense(url) < 1e-5


def test_without_the_null_page_the_tile_consumer_would_index_minus_one() -> None:
    """The same tile gather on a manager without the null page: the tiles hold -1 past the
    live pages and in released window blocks (an out-of-bounds load in a GPU kernel; torch
    would silently wrap it to the last slot)."""
    m = KVCacheManager(TILE_CONFIG)
    m.allocate("a", 100)
    m.extend("a", 1)  # history 100: (100 + 1 - 24) // 16 = 4: blocks [1, 4) released
    row, live = m.request("a").row, -(-101 // TPB)
    full, window = (_tile_pages(m.page_tables(), g, row).flatten() for g in (0, 1))
    assert full[:live].min() >= 0 and full[live:].tolist() == [-1]  # the row's tail
    assert window[:live].tolist().count(-1) == 3  # released blocks inside the live pages
    assert m.block_table("a")[1] == window[:live].tolist()

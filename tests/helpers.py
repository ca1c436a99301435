"""Tiny specs and comparison helpers shared by the tests."""

from __future__ import annotations

from oracle import Oracle, OracleGroup

from kvcm import KVCacheManager


def layer(i: int, **kw: object) -> dict[str, object]:
    spec: dict[str, object] = {"layer_id": i, "num_kv_heads": 2, "head_dim": 4, "dtype": "fp16"}
    spec.update(kw)
    return spec


def manager(layers: list[dict[str, object]], **kw: object) -> KVCacheManager:
    cfg: dict[str, object] = {
        "layers": layers,
        "tokens_per_block": 4,
        "max_requests": 8,
        "max_seq_len": 64,
    }
    cfg.update(kw)
    if "memory_bytes" not in cfg:
        cfg.setdefault("num_blocks", 16)
    return KVCacheManager(cfg)


def oracle_for(m: KVCacheManager) -> Oracle:
    groups = [
        OracleGroup(g.sliding_window, g.sink_blocks, g.pool_group) for g in m.layout.layer_groups
    ]
    slots = [m.num_total_blocks(pg.pool_group_id) for pg in m.layout.pool_groups]
    return Oracle(groups, slots, m.tokens_per_block, int(m.config.null_page))


def assert_matches(m: KVCacheManager, o: Oracle) -> None:
    """Same requests, same block ids per position, same free counts; the page tables hold the
    null page 0 where the block tables hold -1 when ``null_page`` is on."""
    empty = 0 if m.config.null_page else -1
    assert sorted(m.request_ids()) == sorted(o.requests)
    for rid, req in o.requests.items():
        info = m.request(rid)
        assert (info.num_tokens, info.capacity) == (req.length, req.length + req.lookahead)
        assert m.block_table(rid) == req.blocks, rid
        for g, blocks in enumerate(req.blocks):
            row = m.page_table(g)[info.row].numpy()
            assert row[: len(blocks)].tolist() == [b if b >= 0 else empty for b in blocks]
            assert (row[len(blocks) :] == empty).all()
    assert m.num_free_blocks() == o.num_free()
    for pg, free in enumerate(o.free):
        assert m._coord.pools[pg].free_order().tolist() == list(free)

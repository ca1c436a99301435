from __future__ import annotations

import pytest
from helpers import layer, oracle_for

from kvcm import InsufficientMemory, InvalidArgument, KVCacheManager, OutOfBlocks

MODELS: dict[str, list[dict[str, object]]] = {
    "full": [layer(i) for i in range(4)],
    "hybrid": [
        layer(i, sliding_window=32, sink_tokens=4) if i % 2 == 0 else layer(i) for i in range(6)
    ],
    "hybrid_two_shapes": [
        layer(0, sliding_window=24, num_kv_heads=4),
        layer(1),
        layer(2, sliding_window=24, num_kv_heads=4),
    ],
    "key_only": [
        layer(i, kv_factor=1, num_kv_heads=1, head_dim=72, dtype="bf16") for i in range(3)
    ],
    "nvfp4": [
        layer(0, num_kv_heads=2, head_dim=16, dtype="nvfp4"),
        layer(1, num_kv_heads=2, head_dim=16, dtype="nvfp4"),
        layer(2, num_kv_heads=2, head_dim=16, dtype="fp8_e4m3"),
    ],
    "target_draft": [layer(i) for i in range(4)] + [layer(4, owner="draft", num_kv_heads=1)],
}


def _manager(layers: list[dict[str, object]], memory: int) -> KVCacheManager:
    return KVCacheManager(
        {
            "layers": layers,
            "tokens_per_block": 16,
            "max_requests": 4096,
            "max_seq_len": 512,
            "memory_bytes": memory,
        }
    )


def _grow_lockstep(m: KVCacheManager, n: int, seq_len: int) -> None:
    """n requests decoded one token per step up to seq_len tokens."""
    ids = [f"r{i}" for i in range(n)]
    for rid in ids:
        m.allocate(rid, 1)
    for _ in range(seq_len - 1):
        m.extend_many(ids)


@pytest.mark.parametrize("name", sorted(MODELS))
@pytest.mark.parametrize("seq_len", [1, 17, 100, 333])
def test_estimate_and_allocator_agree_exactly(name: str, seq_len: int) -> None:
    memory = 1 << 20
    est = _manager(MODELS[name], memory).estimate(seq_len)
    assert est.limited_by == "memory" and est.max_requests >= 1
    fits = _manager(MODELS[name], memory)
    _grow_lockstep(fits, est.max_requests, seq_len)
    assert all(fits.request(r).num_tokens == seq_len for r in fits.request_ids())
    with pytest.raises(OutOfBlocks):
        _grow_lockstep(_manager(MODELS[name], memory), est.max_requests + 1, seq_len)


@pytest.mark.parametrize("name", sorted(MODELS))
def test_max_tokens_is_the_longest_single_request(name: str) -> None:
    memory = 40_000
    m = _manager(MODELS[name], memory)
    est = m.estimate(1)
    try:
        _grow_lockstep(m, 1, est.max_tokens)
    except OutOfBlocks:
        pytest.fail(f"one request of max_tokens={est.max_tokens} did not fit")
    if est.max_tokens < m.config.max_seq_len:
        with pytest.raises(OutOfBlocks):
            m.extend("r0", 1)


@pytest.mark.parametrize("name", sorted(MODELS))
def test_budget_is_split_so_pool_groups_run_out_together(name: str) -> None:
    memory = 5 << 20
    m = _manager(MODELS[name], memory)
    info = m.describe()
    assert sum(p.nbytes for p in info.pools) <= memory
    est = m.estimate(m.config.max_seq_len)
    per_group = [p.max_requests for p in est.pool_groups]
    # Flooring costs at most one request of difference between pool groups.
    assert max(per_group) - min(per_group) <= 1
    # Less than one max-length request of memory is left unused in each pool group.
    for pg in est.pool_groups:
        spare = pg.num_slots - pg.max_requests * pg.blocks_per_request
        assert 0 <= spare < pg.blocks_per_request + len(info.pool_groups)


def test_two_shape_hybrid_has_two_pool_groups_and_target_draft_too() -> None:
    assert len(_manager(MODELS["hybrid_two_shapes"], 1 << 20).describe().pool_groups) == 2
    assert len(_manager(MODELS["target_draft"], 1 << 20).describe().pool_groups) == 2
    assert len(_manager(MODELS["hybrid"], 1 << 20).describe().pool_groups) == 1


def test_sliding_window_fixed_cost_matches_a_brute_force_decode() -> None:
    m = _manager([layer(0, sliding_window=40, sink_tokens=20), layer(1)], 1 << 22)
    est = m.estimate(500)
    window_group = est.layer_groups[0]
    o = oracle_for(m)
    o.allocate("r", 1)
    peak = 1
    for _ in range(499):
        o.extend("r", 1)
        peak = max(peak, sum(1 for s in o.requests["r"].blocks[0] if s >= 0))
    assert window_group.fixed_blocks == peak == window_group.blocks_per_request
    assert est.layer_groups[1].fixed_blocks is None
    assert est.layer_groups[1].blocks_per_request == 32
    # Window 40 with 2 sink blocks: 2 sinks + the blocks spanning 40 tokens (4) + 1 new block.
    assert peak == 6
    assert est.fixed_bytes_per_request == peak * 16 * m.layout.layer_groups[0].bytes_per_token
    assert est.bytes_per_token == {0: 32, 1: 32}


def test_estimate_reports_bytes_and_fit_for_num_requests() -> None:
    m = _manager(MODELS["nvfp4"], 1 << 20)
    # nvfp4: 2 layers x 2 roles x (32 / 2 + 32 / 16) bytes; fp8: 2 roles x 32 bytes.
    assert m.estimate(64).bytes_per_token == {0: 2 * 2 * (16 + 2) + 2 * 32}
    est = m.estimate(64, num_requests=3)
    assert est.fits is True and est.pool_groups[0].required_blocks == 12
    too_many = m.estimate(64, num_requests=est.max_requests + 1)
    assert too_many.fits is False


def test_estimate_caps_by_max_requests() -> None:
    m = KVCacheManager(
        {"layers": [layer(0)], "max_requests": 2, "max_seq_len": 64, "num_blocks": 1000}
    )
    est = m.estimate(16)
    assert (est.max_requests, est.limited_by) == (2, "max_requests")
    assert est.pool_groups[0].max_requests == 1000


def test_estimate_and_budget_errors() -> None:
    m = _manager(MODELS["full"], 1 << 20)
    for bad in (0, 513):
        with pytest.raises(InvalidArgument):
            m.estimate(bad)
    with pytest.raises(InvalidArgument):
        m.estimate(10, num_requests=-1)
    with pytest.raises(InsufficientMemory) as exc:
        _manager(MODELS["target_draft"], 1000)
    assert exc.value.code == "insufficient_memory"

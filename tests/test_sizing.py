"""Sizing by the engine's step shape: estimate() against the allocator, exactly.

A request of L tokens grows by ops of at most C new tokens (C = None: a whole prompt in one
op), each reserving D draft slots. The estimate says N: any N requests that keep to that shape
fit (lockstep or not, smaller chunks, rewinds of rejected drafts), and N + 1 requests that all
take the worst history do not. The worst history is found here by brute force on the real
allocator, not by the formula in sizing.py.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
from helpers import layer, oracle_for

from kvcm import InsufficientMemory, InvalidArgument, InvalidRewind, KVCacheManager, OutOfBlocks

MODELS: dict[str, list[dict[str, object]]] = {
    "full": [layer(i) for i in range(4)],
    "hybrid": [
        layer(i, sliding_window=32, sink_tokens=4) if i % 2 == 0 else layer(i) for i in range(6)
    ],
    "hybrid_own_pool": [  # window layers with a pool group of their own
        layer(0, sliding_window=40),
        layer(1),
        layer(2, sliding_window=40),
        layer(3, sliding_window=40),
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

#: (prefill_chunk, lookahead) step shapes.
SHAPES = [(1, 0), (None, 0), (40, 3), (100, 0), (7, 2)]
MAX_SEQ_LEN = 512


def _manager(
    layers: list[dict[str, object]], memory: int, check_budget: bool = True, **kw: object
) -> KVCacheManager:
    cfg = {
        "layers": layers,
        "tokens_per_block": 16,
        "max_requests": 4096,
        "max_seq_len": MAX_SEQ_LEN,
        "memory_bytes": memory,
        **kw,
    }
    return KVCacheManager(cfg, check_budget=check_budget)


def _used(m: KVCacheManager) -> np.ndarray:
    groups = range(len(m.layout.pool_groups))
    return np.array([m.num_total_blocks(pg) - m.num_free_blocks(pg) for pg in groups])


def _held_by_history(
    layers: list[dict[str, object]], length: int, chunk: int | None, ahead: int
) -> np.ndarray:
    """Slots per pool group one request holds after its op from history h, for every h < L
    (on a roomy manager: the held count does not depend on how the request reached h)."""
    m = KVCacheManager(
        {
            "layers": layers,
            "tokens_per_block": 16,
            "max_seq_len": MAX_SEQ_LEN,
            "num_blocks": 4096,
        }
    )
    c = length if chunk is None else chunk
    out = []
    for h in range(length):
        if h == 0:
            m.allocate("p", min(c, length), lookahead=ahead)
        else:
            m.allocate("p", h, lookahead=ahead)
            m.extend("p", min(c, length - h), lookahead=ahead)
        out.append(_used(m))
        m.free("p")
    return np.array(out)


def _path(h: int, length: int, chunk: int | None) -> list[int]:
    """New tokens per op of a request that takes history h with ops of at most ``chunk``:
    the first is the allocate. h = 0 starts with a full chunk."""
    c = length if chunk is None else chunk
    ops: list[int] = []
    done = 0
    target = h if h else 0
    while done < target:
        ops.append(min(c, target - done))
        done += ops[-1]
    while done < length:
        ops.append(min(c, length - done))
        done += ops[-1]
    return ops


def _lockstep(m: KVCacheManager, n: int, ops: list[int], ahead: int) -> None:
    ids = [f"r{i}" for i in range(n)]
    for rid in ids:
        m.allocate(rid, ops[0], lookahead=ahead)
    for k in ops[1:]:
        m.extend_many(ids, k, ahead)


def _worst(
    name: str, m: KVCacheManager, length: int, chunk: int | None, ahead: int
) -> tuple[int, np.ndarray]:
    """(history that binds, peak slots per pool group) by brute force."""
    held = _held_by_history(MODELS[name], length, chunk, ahead)
    peak = held.max(axis=0)
    slots = np.array([m.num_total_blocks(pg) for pg in range(peak.size)])
    binding = int(np.argmin(slots // peak))
    return int(held[:, binding].argmax()), peak


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("name", sorted(MODELS))
@pytest.mark.parametrize("seq_len", [17, 100, 333])
def test_estimate_and_allocator_agree_exactly(
    name: str, seq_len: int, shape: tuple[int | None, int]
) -> None:
    chunk, ahead = shape
    memory = 1 << 20
    m = _manager(MODELS[name], memory)
    est = m.estimate(seq_len, prefill_chunk=chunk or seq_len, lookahead=ahead)
    assert (est.prefill_chunk, est.lookahead) == (chunk or seq_len, ahead)
    assert est.limited_by == "memory" and est.max_requests >= 1
    history, peak = _worst(name, m, seq_len, chunk, ahead)
    assert [p.blocks_per_request for p in est.pool_groups] == peak.tolist()
    worst = _path(history, seq_len, chunk)
    _lockstep(m, est.max_requests, worst, ahead)
    assert all(m.request(r).num_tokens == seq_len for r in m.request_ids())
    with pytest.raises(OutOfBlocks):
        _lockstep(_manager(MODELS[name], memory), est.max_requests + 1, worst, ahead)
    # The aligned pattern (an allocate of min(C, L), then extends of C) and smaller chunks fit.
    for smaller in {chunk or seq_len, max(1, (chunk or seq_len) // 3), 1}:
        if seq_len // smaller <= 120:
            _lockstep(
                _manager(MODELS[name], memory),
                est.max_requests,
                _path(0, seq_len, smaller),
                ahead,
            )


@pytest.mark.parametrize("name", ["hybrid", "hybrid_own_pool", "target_draft"])
def test_any_n_requests_that_keep_to_the_shape_fit(name: str) -> None:
    """Random chunks of at most C, lookahead up to D, rejected drafts rewound, requests at
    different phases: the estimate's N all reach L."""
    chunk, ahead, seq_len = 40, 3, 300
    m = _manager(MODELS[name], 1 << 20, max_prefill_chunk=chunk, max_lookahead=ahead)
    n = m.estimate(seq_len).max_requests
    rng = random.Random(7)
    left = {f"r{i}": seq_len for i in range(n)}
    started: set[str] = set()
    while left:
        rid = rng.choice(sorted(left))
        k = rng.randint(1, min(chunk, left[rid]))
        d = rng.randint(0, ahead)
        if rid in started:
            m.extend(rid, k, lookahead=d)
        else:
            m.allocate(rid, k, lookahead=d)
            started.add(rid)
        left[rid] -= k
        drafts = rng.randint(0, min(k, seq_len - left[rid]) - 1)
        if drafts and rng.random() < 0.3:
            try:
                m.rewind(rid, drafts)
                left[rid] += drafts
            except InvalidRewind:
                pass
        if left[rid] == 0:
            del left[rid]
    assert {m.request(r).num_tokens for r in m.request_ids()} == {seq_len}
    assert len(m.request_ids()) == n


@pytest.mark.parametrize("shape", [(1, 0), (None, 0), (40, 3)], ids=str)
@pytest.mark.parametrize("name", sorted(MODELS))
def test_max_tokens_is_the_longest_single_request(name: str, shape: tuple[int | None, int]) -> None:
    chunk, ahead = shape
    # A budget below one max_seq_len request (allowed with check_budget=False).
    small = {"max_prefill_chunk": chunk, "max_lookahead": ahead, "check_budget": False}
    m = _manager(MODELS[name], 40_000, **small)  # type: ignore[arg-type]
    longest = m.estimate(1).max_tokens
    assert longest >= 1
    history, _ = _worst(name, m, longest, chunk, ahead)
    _lockstep(m, 1, _path(history, longest, chunk), ahead)
    if longest < MAX_SEQ_LEN - ahead:
        beyond = longest + 1
        history, _ = _worst(name, m, beyond, chunk, ahead)
        with pytest.raises(OutOfBlocks):
            _lockstep(
                _manager(MODELS[name], 40_000, **small),  # type: ignore[arg-type]
                1,
                _path(history, beyond, chunk),
                ahead,
            )


@pytest.mark.parametrize("shape", [(1, 0), (None, 0), (64, 2)], ids=str)
@pytest.mark.parametrize("name", sorted(MODELS))
def test_budget_is_split_so_pool_groups_run_out_together(
    name: str, shape: tuple[int | None, int]
) -> None:
    chunk, ahead = shape
    memory = 5 << 20
    m = _manager(MODELS[name], memory, max_prefill_chunk=chunk, max_lookahead=ahead)
    info = m.describe()
    assert sum(p.nbytes for p in info.pools) <= memory
    est = m.estimate(MAX_SEQ_LEN - ahead)
    per_group = [p.max_requests for p in est.pool_groups]
    # Flooring costs at most one request of difference between pool groups.
    assert max(per_group) - min(per_group) <= 1
    # Less than one max-length request of memory is left unused in each pool group.
    for pg in est.pool_groups:
        spare = pg.num_slots - pg.max_requests * pg.blocks_per_request
        assert 0 <= spare < pg.blocks_per_request + len(info.pool_groups)


# -- the cases measured on the code before step shapes ------------------------------------------

HYBRID_128 = [
    {"layer_id": i, "num_kv_heads": 2, "head_dim": 64, "dtype": "bf16"}
    | ({"sliding_window": 128} if i % 2 == 0 else {})
    for i in range(4)
]


def _fit_in_lockstep(cfg: dict[str, object], length: int, chunk: int) -> int:
    """How many requests of ``length`` tokens, allocated then extended in chunks, fit."""
    n = 0
    while True:
        try:
            _lockstep(KVCacheManager(cfg), n + 1, _path(0, length, chunk), 0)
        except OutOfBlocks:
            return n
        n += 1


def test_hybrid_window_128_promises_what_whole_prompts_and_chunks_get() -> None:
    base = {"layers": HYBRID_128, "max_requests": 64, "max_seq_len": 1024, "memory_bytes": 8 << 20}
    # One pool group of 512 slots of 16 KiB; a whole 1024-token prompt takes 64 blocks in each
    # group: 512 // 128 = 4 (the one-token estimate said 7).
    m = KVCacheManager(base)
    assert m.estimate(1024).max_requests == 4 == _fit_in_lockstep(base, 1024, 1024)
    # 512-token chunks: worst history 510 (from 510 to 1022 tokens): 64 - (511 - 128) // 16 =
    # 41 window blocks + 64 full = 105 per request, 512 // 105 = 4; the aligned chunks fit too.
    est = m.estimate(1024, prefill_chunk=512)
    assert est.pool_groups[0].blocks_per_request == 105 and est.max_requests == 4
    assert _fit_in_lockstep(base, 1024, 512) >= 4
    # Decode-shaped (one token per op): 64 + 9 = 73 blocks, 7 requests.
    assert m.estimate(1024, prefill_chunk=1).max_requests == 7 == _fit_in_lockstep(base, 1024, 1)
    # The window layers with a pool group of their own (other head count): the budget split is
    # made for the configured chunk, so the window pool holds what those chunks need.
    own = [spec | {"num_kv_heads": 1} if "sliding_window" in spec else spec for spec in HYBRID_128]
    cfg = base | {"layers": own, "max_prefill_chunk": 512}
    n = KVCacheManager(cfg).estimate(1024).max_requests
    assert n >= 4 and _fit_in_lockstep(cfg, 1024, 512) >= n


def _gemma3_27b_like(chunk: int) -> dict[str, object]:
    """Gemma-3-27B's attention pattern (62 layers, 5 window-1024 layers then 1 full) at 32k;
    heads shrunk so that the pools are small (block counts do not depend on them)."""
    layers = [
        {"layer_id": i, "num_kv_heads": 1, "head_dim": 8, "dtype": "bf16"}
        | ({} if i % 6 == 5 else {"sliding_window": 1024})
        for i in range(62)
    ]
    return {
        "layers": layers,
        "max_requests": 64,
        "max_seq_len": 32768,
        "max_prefill_chunk": chunk,
        "memory_bytes": 5 * (10 * 2048 + 52 * 577) * 16 * 32 + 1000,
    }


def test_gemma3_like_model_with_8k_chunks_gets_what_the_estimate_says() -> None:
    cfg = _gemma3_27b_like(8192)
    m = KVCacheManager(cfg)
    est = m.estimate(32768)
    # Per request: the window group (pool group 0, all 52 window layers in one slot) peaks at
    # 64 + 512 + 1 = 577 blocks: a chunk of 8192 from h = 16k + r (0 < r < 15) reaches
    # k + 513 blocks while k - 64 are released. The full group needs 32768 / 16 = 2048.
    assert [p.blocks_per_request for p in est.pool_groups] == [577, 2048]
    assert est.max_requests == 5 and est.max_tokens == 32768
    ids = [f"r{i}" for i in range(5)]
    for rid in ids:
        m.allocate(rid, 8192)
    for _ in range(3):
        m.extend_many(ids, 8192)
    assert {m.request(r).num_tokens for r in ids} == {32768}
    # The same pools hold one whole 32k prompt in one op (2048 blocks of the window pool's
    # 5 x 577 = 2885), and the estimate for that shape says so.
    whole = KVCacheManager(cfg)
    assert whole.estimate(32768, prefill_chunk=32768).max_requests == 1
    whole.allocate("long", 32768)
    with pytest.raises(OutOfBlocks):
        whole.allocate("second", 32768)


def test_target_and_draft_with_lookahead_3() -> None:
    layers = [layer(i) for i in range(4)] + [layer(4, owner="draft", num_kv_heads=1)]
    cfg = {
        "layers": layers,
        "tokens_per_block": 16,
        "max_seq_len": 512,
        "max_lookahead": 3,
        "max_prefill_chunk": 1,
        "memory_bytes": 1 << 20,
    }
    m = KVCacheManager(cfg)
    n = m.estimate(509).max_requests
    _lockstep(m, n, [1] * 509, 3)
    with pytest.raises(OutOfBlocks):
        _lockstep(KVCacheManager(cfg), n + 1, [1] * 509, 3)


def test_a_budget_that_cannot_hold_one_max_seq_len_request_is_refused() -> None:
    # One layer of K + V x 2 heads x 4 dims fp16 = 32 bytes per token: 512 tokens need 16 KiB.
    layers = [layer(0)]
    cfg = {"layers": layers, "tokens_per_block": 16, "max_seq_len": 512, "memory_bytes": 10_000}
    with pytest.raises(InsufficientMemory) as exc:
        KVCacheManager(cfg)
    # 10,000 bytes hold 19 slots of 512 bytes: 304 tokens.
    assert exc.value.detail["max_seq_len_that_fits"] == 304
    assert "the largest max_seq_len this budget holds is 304" in exc.value.message
    assert KVCacheManager(cfg | {"max_seq_len": 304}).estimate(304).max_requests == 1
    with pytest.raises(InsufficientMemory):
        KVCacheManager(cfg | {"max_seq_len": 305})
    # With draft slots the answer counts them: 304 tokens hold 300 + 4 lookahead.
    with pytest.raises(InsufficientMemory) as exc:
        KVCacheManager(cfg | {"max_lookahead": 4})
    assert exc.value.detail["max_seq_len_that_fits"] == 304
    # Refused as a config, and estimate() refuses lengths past max_seq_len - lookahead.
    m = KVCacheManager(cfg | {"max_seq_len": 304, "max_lookahead": 4})
    with pytest.raises(InvalidArgument):
        m.estimate(301)


def test_num_free_blocks_is_what_a_new_request_can_get() -> None:
    m = KVCacheManager(
        {"layers": [layer(0), layer(1, sliding_window=64)], "max_seq_len": 4096, "num_blocks": 100}
    )
    assert len(m.layout.pool_groups) == 1 and len(m.layout.layer_groups) == 2
    assert m.num_free_blocks() == 50 == m.num_total_blocks()
    assert m.num_free_blocks(pool_group=0) == 100 == m.num_total_blocks(0)
    with pytest.raises(OutOfBlocks):
        m.allocate("big", 51 * 16)
    m.allocate("a", 50 * 16)
    assert m.num_free_blocks() == 0
    m.free("a")
    # Two pool groups: the least of them.
    two = KVCacheManager(
        {
            "layers": [layer(0), layer(1, sliding_window=64, num_kv_heads=4)],
            "max_seq_len": 4096,
            "num_blocks": 30,
        }
    )
    two.allocate("x", 20 * 16)
    assert two.num_free_blocks() == 10 and two.num_free_blocks(0) == 10


def test_two_shape_hybrid_has_two_pool_groups_and_target_draft_too() -> None:
    assert len(_manager(MODELS["hybrid_two_shapes"], 1 << 20).describe().pool_groups) == 2
    assert len(_manager(MODELS["target_draft"], 1 << 20).describe().pool_groups) == 2
    assert len(_manager(MODELS["hybrid"], 1 << 20).describe().pool_groups) == 1


def test_sliding_window_fixed_cost_matches_a_brute_force_decode() -> None:
    m = _manager(
        [layer(0, sliding_window=40, sink_tokens=20), layer(1)], 1 << 22, max_prefill_chunk=1
    )
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
    # Chunks of 32 tokens: the 6 above plus the 2 blocks a chunk adds past one token. Chunks
    # of 500 = 31 x 16 + 4 from h = 16k + r (r in 1..6): k + 32 blocks, k - 5 released.
    assert m.estimate(500, prefill_chunk=32).layer_groups[0].fixed_blocks == 8
    assert m.estimate(500, prefill_chunk=500).layer_groups[0].fixed_blocks == 37
    # When one op may add a whole prompt, a window group has no fixed cost.
    whole = _manager([layer(0, sliding_window=40, sink_tokens=20), layer(1)], 1 << 22)
    assert whole.estimate(500).layer_groups[0].fixed_blocks is None


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
    for kw in ({"prefill_chunk": 0}, {"lookahead": -1}, {"prefill_chunk": True}):
        with pytest.raises(InvalidArgument):
            m.estimate(10, **kw)  # type: ignore[arg-type]
    with pytest.raises(InsufficientMemory) as exc:
        _manager(MODELS["target_draft"], 1000)
    assert exc.value.code == "insufficient_memory"

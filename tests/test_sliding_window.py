from __future__ import annotations

import numpy as np
import pytest
from helpers import assert_matches, oracle_for

from kvcm import KVCacheManager


def _hybrid_32(null_page: bool = False) -> KVCacheManager:
    layers = [
        {"layer_id": i, "num_kv_heads": 1, "head_dim": 8, "dtype": "fp16"}
        | ({"sliding_window": 128, "sink_tokens": 4} if i % 2 == 0 else {})
        for i in range(32)
    ]
    return KVCacheManager(
        {
            "layers": layers,
            "tokens_per_block": 16,
            "max_requests": 4,
            "max_seq_len": 1024,
            "num_blocks": 3 * 80,
            "null_page": null_page,
        }
    )


def _expected_rows(length: int) -> tuple[list[bool], list[bool]]:
    """Which positions hold a page after decoding to ``length`` (history length - 1)."""
    blocks = -(-length // 16)
    first_needed = max(1, (length - 128) // 16)  # (h + 1 - W) // 16 with h = length - 1
    window = [p == 0 or p >= first_needed for p in range(blocks)]
    return window, [True] * blocks


@pytest.mark.parametrize("null_page", [False, True])
def test_32_layer_hybrid_decoded_to_1000_tokens_has_exact_rows_at_every_step(
    null_page: bool,
) -> None:
    m = _hybrid_32(null_page)
    empty = 0 if null_page else -1  # what the page tables hold where there is no page
    info = m.describe()
    assert [g.layer_ids for g in info.layer_groups] == [
        tuple(range(0, 32, 2)),
        tuple(range(1, 32, 2)),
    ]
    assert [(g.sliding_window, g.sink_blocks) for g in info.layer_groups] == [(128, 1), (None, 0)]
    assert len(info.pool_groups) == 1  # same slot layout: window and full share memory
    o = oracle_for(m)
    for rid in ("a", "b", "c"):
        m.allocate(rid, 1)
        o.allocate(rid, 1)
    checked_boundaries = 0
    for length in range(2, 1001):
        m.extend_many(["a", "b"])
        o.grow_batch([("a", 1, 0), ("b", 1, 0)])
        m.extend("c", 1)
        o.extend("c", 1)
        window_live, full_live = _expected_rows(length)
        for rid in ("a", "b", "c"):
            row = m.request(rid).row
            win = m.page_table(0)[row].numpy()
            ful = m.page_table(1)[row].numpy()
            assert (win[: len(window_live)] > empty).tolist() == window_live
            assert (ful[: len(full_live)] > empty).tolist() == full_live
            assert (win[len(window_live) :] == empty).all()
            assert (ful[len(full_live) :] == empty).all()
        held = 3 * (sum(window_live) + len(full_live))
        assert m.num_free_blocks(0) == m.num_total_blocks(0) - held
        if (length - 1) % 16 == 0 or (length - 128) % 16 == 0:
            checked_boundaries += 1
            assert_matches(m, o)  # exact block ids at every block boundary
    assert checked_boundaries == 62 + 62  # new-block steps and window-edge steps
    # At 1000 tokens: sink block 0, released 1..53, window blocks 54..62 (positions 864..999).
    table = m.block_table("a")
    assert [p for p, s in enumerate(table[0]) if s >= 0] == [0, *range(54, 63)]
    assert len(table[1]) == 63 and min(table[1]) >= 0
    for rid in ("a", "b", "c"):
        m.free(rid)
    assert m.num_free_blocks() == m.num_total_blocks()


def test_window_without_sinks_releases_from_block_zero() -> None:
    m = KVCacheManager(
        {
            "layers": [{"layer_id": 0, "num_kv_heads": 1, "head_dim": 8, "sliding_window": 8}],
            "tokens_per_block": 4,
            "num_blocks": 8,
            "max_seq_len": 64,
        }
    )
    m.allocate("a", 12)  # prefill keeps every block: token 0 is computed now
    assert m.block_table("a") == [[0, 1, 2]]
    m.extend("a", 1)  # history 12: (12 + 1 - 8) // 4 = 1
    assert m.block_table("a") == [[-1, 1, 2, 3]]
    assert m.parts.coord.pools[0].free_order().tolist() == [4, 5, 6, 7, 0]
    m.extend("a", 4)  # history 13: (13 + 1 - 8) // 4 = 1, nothing more
    assert m.block_table("a") == [[-1, 1, 2, 3, 4]]
    m.extend("a", 1)  # history 17: (17 + 1 - 8) // 4 = 2
    assert m.block_table("a") == [[-1, -1, 2, 3, 4]]
    assert np.array_equal(m.page_table(0)[0, :5].numpy(), [-1, -1, 2, 3, 4])

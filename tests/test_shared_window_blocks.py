"""A sliding window that releases a block a prefix hit shares frees no slot.

Found by tests/test_property_manager.py: the fit check of extend counted every stale window
block as given back, but a block another request still holds (shared through a prefix hit)
stays held. With the pool full, the op passed the check, took slots that were not there and
failed with a numpy ``ValueError`` half applied (the stale cell already cleared, the free count
off by one); with one slot short of two it could hand one slot out twice.

The setup, window 4 and 4 tokens per block: "a" commits 8 tokens (blocks 0 and 1) and "b"
hits them: its window needs only block 1 (slot 1, now held by both) and takes block 2 as its
own. "c" and "d" fill the pool. "b" at 12 tokens extends by 1: history 12 releases block 1
((12 + 1 - 4) // 4 = 2) and needs block 3, but slot 1 stays with "a", so nothing is free.
"""

from __future__ import annotations

import pytest

from kvcm import KVCacheManager, OutOfBlocks
from kvcm_client.models import ExtendOp

PROMPT = list(range(100, 109))


def _full_pool() -> KVCacheManager:
    m = KVCacheManager(
        {
            "layers": [{"layer_id": 0, "num_kv_heads": 1, "head_dim": 8, "sliding_window": 4}],
            "tokens_per_block": 4,
            "num_blocks": 8,
            "max_seq_len": 64,
        }
    )
    m.allocate("a", 9, token_ids=PROMPT)  # slots 0 1 2
    m.commit("a", PROMPT[:8])
    assert m.allocate("b", 9, token_ids=PROMPT).num_hit_tokens == 8
    assert m.block_table("b") == [[-1, 1, 3]]  # block 1 shared with "a", block 2 its own
    m.allocate("c", 2, lookahead=2)  # slot 4
    m.allocate("d", 12)  # slots 5 6 7
    m.extend("b", 3)  # 12 tokens in 3 blocks: nothing new
    assert m.num_free_blocks() == 0 and m.parts.coord.refs[0][1] == 2
    return m


def _state(m: KVCacheManager) -> object:
    c = m.parts.coord
    return (
        [(r, m.request(r), m.block_table(r)) for r in m.request_ids()],
        c.refs[0].tolist(),
        c.pools[0].free_order().tolist(),
        c.pools[0].num_free,
        c.tables.tolist(),
    )


@pytest.mark.parametrize("call", ["extend", "extend_many"])
def test_releasing_a_shared_window_block_frees_no_slot(call: str) -> None:
    m = _full_pool()
    before = _state(m)
    with pytest.raises(OutOfBlocks):
        if call == "extend":
            m.extend("b", 1)
        else:
            m.extend_many(["b", "c"], 1)  # "c" needs nothing and releases nothing
    assert _state(m) == before
    # Once "a" is gone, "b" holds slot 1 alone: releasing it frees the slot the op needs.
    m.free("a")  # slots 2 and 0 go back; slot 1 stays with "b"
    m.allocate("e", 8)  # takes them
    assert m.num_free_blocks() == 0
    m.extend("b", 1)
    assert m.block_table("b") == [[-1, -1, 3, 1]]


def test_a_step_runs_the_refused_batch_one_by_one() -> None:
    m = _full_pool()
    ops = [ExtendOp(request_id="b", num_new_tokens=1), ExtendOp(request_id="c", num_new_tokens=1)]
    results = m.step(ops)
    assert [(r.ok, r.error and r.error.code) for r in results] == [
        (False, "out_of_blocks"),
        (True, None),
    ]
    assert m.request("b").num_tokens == 12 and m.request("c").num_tokens == 3

from __future__ import annotations

import numpy as np
import pytest
from helpers import assert_matches, layer, manager, oracle_for
from oracle import OracleOutOfBlocks

from kvcm import (
    DuplicateRequest,
    InvalidArgument,
    InvalidRewind,
    KVCacheManager,
    OutOfBlocks,
    RequestLimitReached,
    SequenceTooLong,
    UnknownRequest,
)
from kvcm_client.models import AllocateOp, ExtendOp, FreeOp, RewindOp


def full(num_blocks: int = 8, **kw: object) -> KVCacheManager:
    return manager([layer(0)], num_blocks=num_blocks, **kw)


def test_allocate_extend_free_exact_block_ids() -> None:
    m = full()
    a = m.allocate("a", 10)
    assert (a.row, a.num_tokens, a.capacity) == (0, 10, 10)
    assert m.block_table("a") == [[0, 1, 2]]
    assert m.allocate("b", 5).row == 1
    assert m.block_table("b") == [[3, 4]]
    assert m.num_free_blocks() == 3
    # 10 -> 12 tokens stays inside block 2; 12 -> 13 takes block 5.
    m.extend("a", 2)
    assert m.block_table("a") == [[0, 1, 2]]
    m.extend("a", 1)
    assert m.block_table("a") == [[0, 1, 2, 5]]
    m.free("a")
    # Freed tail first, appended behind the never-used slots 6 and 7.
    assert m.parts.coord.pools[0].free_order().tolist() == [6, 7, 5, 2, 1, 0]
    c = m.allocate("c", 9)
    assert c.row == 0  # the freed row is reused
    assert m.block_table("c") == [[6, 7, 5]]
    row = m.page_table(0)[0].tolist()
    assert row[:3] == [6, 7, 5] and set(row[3:]) == {-1}


def test_lookahead_reserves_draft_slots() -> None:
    m = full()
    info = m.allocate("a", 5, lookahead=3)
    assert (info.num_tokens, info.capacity) == (5, 8)
    assert m.block_table("a") == [[0, 1]]
    info = m.extend("a", 1, lookahead=3)
    assert (info.num_tokens, info.capacity) == (6, 9)
    assert m.block_table("a") == [[0, 1, 2]]


def test_one_token_past_capacity_raises_and_changes_nothing() -> None:
    m = full(num_blocks=4)
    m.allocate("a", 12)
    m.allocate("b", 4)
    before = (m.num_free_blocks(), m.block_table("a"), m.block_table("b"), m.page_table(0).clone())
    with pytest.raises(OutOfBlocks) as exc:
        m.extend("b", 1)
    assert exc.value.code == "out_of_blocks"
    assert exc.value.detail == {"pool_group": 0, "needed": 1, "free": 0, "released": 0}
    with pytest.raises(OutOfBlocks):
        m.allocate("c", 1)
    after = (m.num_free_blocks(), m.block_table("a"), m.block_table("b"), m.page_table(0))
    assert before[:3] == after[:3] and bool((before[3] == after[3]).all())
    assert m.request("b").num_tokens == 4
    assert "c" not in m.request_ids()


def test_after_freeing_everything_the_free_count_equals_the_total() -> None:
    m = manager([layer(0), layer(1, sliding_window=8, sink_tokens=2)], num_blocks=120)
    for i in range(5):
        m.allocate(f"r{i}", 3 + 5 * i)
    for _ in range(20):
        m.extend_many([f"r{i}" for i in range(5)])
    assert m.num_free_blocks() < m.num_total_blocks()
    for i in range(5):
        m.free(f"r{i}")
    # One pool group of 120 slots shared by two layer groups: 60 blocks in each for a new request.
    assert m.num_free_blocks() == m.num_total_blocks() == 60
    assert m.num_free_blocks(0) == m.num_total_blocks(0) == 120
    assert bool((m.page_table(0) == -1).all()) and bool((m.page_table(1) == -1).all())


@pytest.mark.parametrize(
    "call,error,code",
    [
        (lambda m: m.extend("nope", 1), UnknownRequest, "unknown_request"),
        (lambda m: m.free("nope"), UnknownRequest, "unknown_request"),
        (lambda m: m.rewind("nope", 1), UnknownRequest, "unknown_request"),
        (lambda m: m.block_table("nope"), UnknownRequest, "unknown_request"),
        (lambda m: m.allocate("a", 1), DuplicateRequest, "duplicate_request"),
        (lambda m: m.allocate("z", 0), InvalidArgument, "invalid_argument"),
        (lambda m: m.allocate("z", -3), InvalidArgument, "invalid_argument"),
        (lambda m: m.allocate("z", 2.5), InvalidArgument, "invalid_argument"),
        (lambda m: m.allocate("", 2), InvalidArgument, "invalid_argument"),
        (lambda m: m.allocate("z", 2, lookahead=-1), InvalidArgument, "invalid_argument"),
        (lambda m: m.extend("a", 0), InvalidArgument, "invalid_argument"),
        (lambda m: m.rewind("a", 0), InvalidArgument, "invalid_argument"),
        (lambda m: m.rewind("a", 6), InvalidArgument, "invalid_argument"),
        (lambda m: m.allocate("z", 33), SequenceTooLong, "sequence_too_long"),
        (lambda m: m.allocate("z", 30, lookahead=3), SequenceTooLong, "sequence_too_long"),
        (lambda m: m.extend("a", 27), SequenceTooLong, "sequence_too_long"),
        (lambda m: m.extend_many(["a", "a"]), InvalidArgument, "invalid_argument"),
        (lambda m: m.extend_many(["a", "x"]), UnknownRequest, "unknown_request"),
        (lambda m: m.extend_many(["a"], [1, 2]), InvalidArgument, "invalid_argument"),
        (lambda m: m.extend_many(["a"], [0]), InvalidArgument, "invalid_argument"),
    ],
)
def test_bad_input_raises_typed_errors_and_changes_nothing(call, error, code) -> None:  # type: ignore[no-untyped-def]
    m = full(num_blocks=16, max_seq_len=32)
    m.allocate("a", 6)
    before = (m.num_free_blocks(), m.block_table("a"), m.request("a"), m.request_ids())
    with pytest.raises(error) as exc:
        call(m)
    assert exc.value.code == code
    assert (m.num_free_blocks(), m.block_table("a"), m.request("a"), m.request_ids()) == before


def test_running_out_of_rows_is_its_own_error() -> None:
    m = full(num_blocks=16, max_requests=2)
    m.allocate("a", 1)
    m.allocate("b", 1)
    with pytest.raises(RequestLimitReached) as exc:
        m.allocate("c", 1)
    assert exc.value.code == "max_requests_reached"
    m.free("a")
    assert m.allocate("c", 1).row == 0


def test_rewind_frees_whole_blocks_past_the_new_capacity() -> None:
    m = full()
    m.allocate("a", 9, lookahead=2)  # capacity 11: blocks 0..2
    assert m.block_table("a") == [[0, 1, 2]]
    info = m.rewind("a", 2)  # 7 tokens + 2 lookahead = 9 tokens: still 3 blocks
    assert (info.num_tokens, info.capacity) == (7, 9)
    assert m.block_table("a") == [[0, 1, 2]]
    m.rewind("a", 1)  # 6 + 2 = 8 tokens: block 2 is freed
    assert m.block_table("a") == [[0, 1]]
    assert m.parts.coord.pools[0].free_order().tolist() == [3, 4, 5, 6, 7, 2]


def test_rewind_into_a_released_window_is_refused() -> None:
    m = manager([layer(0, sliding_window=4)], num_blocks=16)
    m.allocate("a", 8)
    m.extend("a", 1)  # history 8: (8 + 1 - 4) // 4 = 1, block 0 released
    assert m.block_table("a") == [[-1, 1, 2]]
    with pytest.raises(InvalidRewind) as exc:
        m.rewind("a", 6)  # length 3: the next token attends to position 0
    assert exc.value.code == "rewind_past_window"
    assert m.block_table("a") == [[-1, 1, 2]]
    m.rewind("a", 1)  # length 8: the next token attends back to 5, block 1
    assert m.block_table("a") == [[-1, 1]]


def test_step_runs_ops_in_order_with_one_result_each() -> None:
    m = full(num_blocks=4)
    results = m.step(
        [
            AllocateOp(request_id="a", num_tokens=8),
            {"op": "allocate", "request_id": "b", "num_tokens": 4},
            ExtendOp(request_id="b", num_new_tokens=5),  # needs 2 blocks, 1 free
            ExtendOp(request_id="b", num_new_tokens=4),
            RewindOp(request_id="a", num_tokens=4),
            FreeOp(request_id="zzz"),
            FreeOp(request_id="b"),
        ]
    )
    assert [r.ok for r in results] == [True, True, False, True, True, False, True]
    assert results[2].error is not None and results[2].error.code == "out_of_blocks"
    assert results[3].request is not None and results[3].request.num_tokens == 8
    assert results[4].request is not None and results[4].request.num_tokens == 4
    assert results[5].error is not None and results[5].error.code == "unknown_request"
    assert results[6].request is None
    assert m.block_table("a") == [[0]] and m.num_free_blocks() == 3


def test_decode_step_batch_falls_back_to_per_op_results_when_it_does_not_fit() -> None:
    m = full(num_blocks=4)
    m.allocate("a", 4)
    m.allocate("b", 4)
    m.allocate("c", 3)
    # a and b cross into a new block, c does not; one block is free.
    results = m.step([ExtendOp(request_id=r, num_new_tokens=1) for r in "abc"])
    assert [r.ok for r in results] == [True, False, True]
    assert m.request("c").num_tokens == 4 and m.request("b").num_tokens == 4
    assert m.block_table("a") == [[0, 3]]


def test_step_rejects_malformed_ops() -> None:
    m = full()
    with pytest.raises(Exception) as exc:
        m.step([{"op": "explode", "request_id": "a"}])
    assert "explode" in str(exc.value)


def _random_ops(m: KVCacheManager, rng: np.random.Generator, steps: int) -> None:
    o = oracle_for(m)
    live: list[str] = []
    counter = 0
    for _ in range(steps):
        kind = rng.choice(
            ["allocate", "extend", "batch", "rewind", "free"], p=[0.2, 0.3, 0.3, 0.1, 0.1]
        )
        try:
            if kind == "allocate" or not live:
                rid, n, la = f"r{counter}", int(rng.integers(1, 40)), int(rng.integers(0, 4))
                counter += 1
                try:
                    o.allocate(rid, n, la)
                except OracleOutOfBlocks:
                    with pytest.raises(OutOfBlocks):
                        m.allocate(rid, n, lookahead=la)
                else:
                    m.allocate(rid, n, lookahead=la)
                    live.append(rid)
            elif kind == "extend":
                rid = live[int(rng.integers(len(live)))]
                n, la = int(rng.integers(1, 9)), int(rng.integers(0, 3))
                if m.request(rid).num_tokens + n + la > m.config.max_seq_len:
                    continue
                try:
                    o.extend(rid, n, la)
                except OracleOutOfBlocks:
                    with pytest.raises(OutOfBlocks):
                        m.extend(rid, n, la)
                else:
                    m.extend(rid, n, la)
            elif kind == "batch":
                ids = [r for r in live if m.request(r).num_tokens + 4 <= m.config.max_seq_len]
                ns = [int(rng.integers(1, 3)) for _ in ids]
                try:
                    o.grow_batch([(r, n, 0) for r, n in zip(ids, ns, strict=True)])
                except OracleOutOfBlocks:
                    with pytest.raises(OutOfBlocks):
                        m.extend_many(ids, ns)
                else:
                    m.extend_many(ids, ns)
            elif kind == "rewind":
                rid = live[int(rng.integers(len(live)))]
                length = m.request(rid).num_tokens
                if length < 2:
                    continue
                k = int(rng.integers(1, min(length, 6)))
                try:
                    m.rewind(rid, k)
                except InvalidRewind:
                    continue
                o.rewind(rid, k)
            else:
                rid = live.pop(int(rng.integers(len(live))))
                m.free(rid)
                o.free_request(rid)
        finally:
            assert_matches(m, o)


def test_random_ops_match_the_brute_force_model_full_attention(rng: np.random.Generator) -> None:
    _random_ops(manager([layer(0), layer(1)], num_blocks=40), rng, 400)


@pytest.mark.parametrize("null_page", [False, True])
def test_random_ops_match_the_brute_force_model_hybrid(
    rng: np.random.Generator, null_page: bool
) -> None:
    m = manager(
        [
            layer(0, sliding_window=6, sink_tokens=3),
            layer(1),
            layer(2, sliding_window=9),
            layer(3, num_kv_heads=1, kv_factor=1),
        ],
        num_blocks=60,
        null_page=null_page,
    )
    assert len(m.layout.pool_groups) == 2
    _random_ops(m, rng, 500)


def test_request_infos_the_manager_builds_behave_as_validated_ones() -> None:
    """The manager builds a RequestInfo without validating its own ints again
    (``request_rows.trusted_info``): it must be the same model in every way a caller uses."""
    import copy
    import pickle

    from pydantic import ValidationError

    from kvcm_client.models import RequestInfo

    m = manager([layer(0)])
    got = m.allocate("a", 5)
    got = m.extend("a", 2)
    want = RequestInfo.model_validate(got.model_dump())
    assert got == want and type(got) is RequestInfo
    assert got.model_dump(exclude_unset=True) == want.model_dump(exclude_unset=True)
    assert got.model_dump_json() == want.model_dump_json()
    assert got.model_copy(update={"num_tokens": 9}).num_tokens == 9 and got.num_tokens == 7
    assert copy.deepcopy(got) == got and pickle.loads(pickle.dumps(got)) == got
    with pytest.raises(ValidationError):
        got.num_tokens = 1  # frozen

"""Idempotent allocate, commit, and all-or-nothing steps of the in-process manager."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import layer, manager

from kvcm import DuplicateRequest, InvalidArgument, KVCacheManager, KVCMError
from kvcm_client.models import AllocateOp, CommitOp, ExtendOp, FreeOp, OpResult, RewindOp


def snapshot(m: KVCacheManager) -> object:
    """Everything observable: requests, block lists, tables, free lists, committed tokens."""
    return (
        {r: (m.request(r), m.block_table(r), m.committed_tokens(r)) for r in m.request_ids()},
        [m.parts.coord.pools[pg].free_order().tolist() for pg in range(len(m.parts.coord.pools))],
        m.page_tables().clone().tolist(),
        sorted(m.parts.requests.free_rows),
    )


def test_identical_allocate_retry_returns_the_first_result_and_allocates_nothing() -> None:
    m = manager([layer(0)], num_blocks=8)
    first = m.allocate("a", 6, lookahead=1)
    m.extend("a", 3)
    free = m.num_free_blocks()
    again = m.allocate("a", 6, lookahead=1)
    assert again == first and again.num_tokens == 6  # the first result, not today's state
    assert m.num_free_blocks() == free and m.request("a").num_tokens == 9
    with pytest.raises(DuplicateRequest) as exc:
        m.allocate("a", 6, lookahead=0)
    assert exc.value.detail == {"request_id": "a", "num_tokens": 6, "lookahead": 1}
    m.free("a")
    assert m.allocate("a", 2).num_tokens == 2  # a freed id starts afresh


def test_commit_records_a_prefix_and_rewind_drops_its_tail() -> None:
    m = manager([layer(0)], num_blocks=8)
    m.allocate("a", 5)
    assert m.commit("a", [7, 8, 9]).num_committed == 3
    with pytest.raises(InvalidArgument) as exc:
        m.commit("a", [1, 2, 3])  # 3 + 3 > 5 tokens
    assert exc.value.detail["num_committed"] == 3
    assert m.committed_tokens("a") == [7, 8, 9]
    m.extend("a", 2)
    assert m.commit("a", [10, 11, 12, 13]).num_committed == 7
    info = m.rewind("a", 3)
    assert (info.num_tokens, info.num_committed) == (4, 4)
    assert m.committed_tokens("a") == [7, 8, 9, 10]
    for bad in ([-1], [2**31], [1.5], "abc", 7, ["1"]):
        with pytest.raises(InvalidArgument):
            m.commit("a", bad)  # type: ignore[arg-type]
    assert m.committed_tokens("a") == [7, 8, 9, 10]


def test_decode_step_results_carry_committed_counts() -> None:
    m = manager([layer(0)], num_blocks=8)
    m.allocate("a", 3)
    m.allocate("b", 3)
    m.commit("a", [1, 2, 3])
    results = m.step(
        [ExtendOp(request_id="a", num_new_tokens=1), ExtendOp(request_id="b", num_new_tokens=1)]
    )
    assert [r.request.num_committed for r in results if r.request] == [3, 0]


def test_atomic_step_that_fails_changes_nothing_and_names_the_failing_op() -> None:
    m = manager([layer(0, sliding_window=4), layer(1)], num_blocks=12)
    m.allocate("a", 8)
    m.commit("a", list(range(8)))
    m.allocate("b", 4)
    m.extend("a", 1)  # window releases a's block 0
    before = snapshot(m)
    ops = [
        FreeOp(request_id="b"),
        CommitOp(request_id="a", token_ids=[99]),
        RewindOp(request_id="a", num_tokens=1),
        AllocateOp(request_id="c", num_tokens=12),  # 3 blocks in each group: 6 of the 9 free
        ExtendOp(request_id="a", num_new_tokens=40),  # needs 20 more blocks
        AllocateOp(request_id="d", num_tokens=1),
    ]
    results = m.step(ops, atomic=True)
    assert [r.ok for r in results] == [False] * 6
    assert results[4].error is not None and results[4].error.code == "out_of_blocks"
    for i in (0, 1, 2, 3, 5):
        err = results[i].error
        assert err is not None and err.code == "step_aborted" and err.detail == {"failed_op": 4}
    assert snapshot(m) == before
    # The same ops without the failing one apply in full.
    ok = m.step(ops[:4] + ops[5:], atomic=True)
    assert all(r.ok for r in ok)
    assert sorted(m.request_ids()) == ["a", "c", "d"]
    assert m.committed_tokens("a") == list(range(8))  # 9 committed, rewound to 8 tokens


def test_atomic_and_plain_steps_agree_when_nothing_fails(rng: np.random.Generator) -> None:
    """Random steps that succeed give the same state either way; failing ones undo exactly."""
    layers = [layer(0, sliding_window=8, sink_tokens=2), layer(1), layer(2, kv_factor=1)]
    plain = manager(layers, num_blocks=24)
    atomic = manager(layers, num_blocks=24)
    live: list[str] = []
    for step in range(300):
        ops: list[object] = []
        for k in range(int(rng.integers(1, 5))):
            kind = rng.integers(0, 5)
            if kind == 0 or not live:
                ops.append(
                    AllocateOp(request_id=f"r{step}-{k}", num_tokens=int(rng.integers(1, 20)))
                )
            else:
                rid = live[int(rng.integers(len(live)))]
                if kind == 1:
                    ops.append(ExtendOp(request_id=rid, num_new_tokens=int(rng.integers(1, 6))))
                elif kind == 2:
                    ops.append(RewindOp(request_id=rid, num_tokens=int(rng.integers(1, 3))))
                elif kind == 3:
                    ops.append(CommitOp(request_id=rid, token_ids=[int(rng.integers(100))]))
                else:
                    ops.append(FreeOp(request_id=rid))
        before = snapshot(atomic)
        got = atomic.step(ops, atomic=True)  # type: ignore[arg-type]
        if all(r.ok for r in got):
            assert plain.step(ops) == got  # type: ignore[arg-type]
        else:
            assert snapshot(atomic) == before
            failed = [i for i, r in enumerate(got) if r.error and r.error.code != "step_aborted"]
            assert len(failed) == 1
            # The ops before the failing one succeed when run alone.
            with plain.transaction() as undo:
                assert all(r.ok for r in plain.step(ops[: failed[0]]))  # type: ignore[arg-type]
                assert not plain.step(ops[failed[0] : failed[0] + 1])[0].ok  # type: ignore[arg-type]
                undo()
        assert snapshot(atomic) == snapshot(plain)
        live = atomic.request_ids()


def _one_by_one(m: KVCacheManager, ops: list[dict[str, object]]) -> list[tuple[object, ...]]:
    out: list[tuple[object, ...]] = []
    for op in ops:
        kind, rid = op["op"], op["request_id"]
        try:
            if kind == "extend":
                info = m.extend(rid, op["num_new_tokens"])  # type: ignore[arg-type]
            elif kind == "allocate":
                info = m.allocate(rid, op["num_tokens"])  # type: ignore[arg-type]
            else:
                m.free(rid)  # type: ignore[arg-type]
                info = None
        except KVCMError as exc:
            out.append((False, exc.code))
            continue
        out.append((True, None if info is None else (info.num_tokens, info.capacity)))
    return out


def _outcomes(results: list[OpResult]) -> list[tuple[object, ...]]:
    return [
        (True, None if r.request is None else (r.request.num_tokens, r.request.capacity))
        if r.ok
        else (False, r.error.code if r.error else None)
        for r in results
    ]


def test_a_batch_that_fits_only_thanks_to_a_later_release_runs_op_by_op() -> None:
    # Window 4, 4-token blocks, 4 slots, all taken. a (4 tokens) needs a block for its 5th
    # token and releases none; b (10 tokens, allocated at once) needs no block for its 11th
    # and releases its block 0 ((10 + 1 - 4) // 4 = 1). In order, a comes first and finds no
    # free slot; only a batch would let it take the slot b gives back after it.
    m = manager([layer(0, sliding_window=4)], num_blocks=4)
    m.allocate("a", 4)  # slot 0
    m.allocate("b", 10)  # slots 1, 2, 3
    assert m.num_free_blocks() == 0
    results = m.step(
        [
            {"op": "extend", "request_id": "a", "num_new_tokens": 1},
            {"op": "extend", "request_id": "b", "num_new_tokens": 1},
        ]
    )
    assert [r.ok for r in results] == [False, True]
    assert results[0].error is not None and results[0].error.code == "out_of_blocks"
    assert m.block_table("b") == [[-1, 2, 3]] and m.block_table("a") == [[0]]
    assert m.parts.coord.pools[0].free_order().tolist() == [1]


def test_mixed_steps_have_the_outcomes_of_running_the_ops_one_by_one(
    rng: np.random.Generator,
) -> None:
    layers = [layer(0, sliding_window=8, sink_tokens=2), layer(1, sliding_window=12)]
    batched = manager(layers, num_blocks=40, max_requests=8)
    single = manager(layers, num_blocks=40, max_requests=8)
    counter = 0
    for _ in range(400):
        live = batched.request_ids()
        ops: list[dict[str, object]] = []
        for rid in live:
            if rng.random() < 0.1:
                ops.append({"op": "free", "request_id": rid})
            else:
                n = int(rng.integers(1, 4))
                ops.append({"op": "extend", "request_id": rid, "num_new_tokens": n})
        for _ in range(int(rng.integers(0, 3))):
            counter += 1
            ops.insert(
                int(rng.integers(len(ops) + 1)),
                {
                    "op": "allocate",
                    "request_id": f"n{counter}",
                    "num_tokens": int(rng.integers(1, 20)),
                },
            )
        assert _outcomes(batched.step(ops)) == _one_by_one(single, ops)
        for rid in batched.request_ids():
            if batched.request(rid).num_tokens > 50:
                batched.free(rid)
                single.free(rid)


def test_steps_split_into_pieces_in_section_order_without_repeated_requests() -> None:
    from kvcm.op_steps import op_segments

    def ops(spec: str) -> list[dict[str, object]]:
        kinds = {"e": "extend", "f": "free", "a": "allocate", "c": "commit", "r": "rewind"}
        return [{"op": kinds[s[0]], "request_id": s[1]} for s in spec.split()]

    # commit < free < rewind < extend < allocate; a kind of lower rank or a repeated id
    # starts a new piece.
    assert op_segments(ops("ca fb rc ed ee af")) == [(0, 6)]
    assert op_segments(ops("ea eb fc ea ea")) == [(0, 2), (2, 4), (4, 5)]
    assert op_segments(ops("ea eb ec eb ed")) == [(0, 3), (3, 5)]
    assert op_segments(ops("fa ab")) == [(0, 2)]
    assert op_segments(ops("fa aa")) == [(0, 1), (1, 2)]
    assert op_segments(ops("ab ea")) == [(0, 1), (1, 2)]
    assert op_segments(ops("ca fa")) == [(0, 1), (1, 2)]
    assert op_segments(ops("fa cb")) == [(0, 1), (1, 2)]
    assert op_segments([]) == []

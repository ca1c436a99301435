"""The columnar step (``KVCacheManager.step_columns``): handles, section order, statuses,
fallback and all-or-nothing, against one-by-one single ops as the oracle."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers import CoreSpy, layer, manager, manager_state, same
from test_step_atomic import snapshot

from kvcm import KVCacheManager, native
from kvcm_client.errors import (
    ERRORS_BY_CODE,
    STATUS_CODES,
    InvalidArgument,
    KVCMError,
    status_of,
)

OK = 0
UNKNOWN = status_of("unknown_request")
OUT = status_of("out_of_blocks")
ABORTED = status_of("step_aborted")


def test_status_codes_cover_every_error_and_never_repeat() -> None:
    assert STATUS_CODES[0] == "ok" and len(set(STATUS_CODES)) == len(STATUS_CODES)
    assert set(ERRORS_BY_CODE) <= set(STATUS_CODES)
    assert status_of("a_code_from_a_newer_service") == status_of("kvcm_error") == 1


def test_allocate_extend_free_by_handle_with_exact_blocks() -> None:
    m = manager([layer(0)], num_blocks=8)
    out = m.step_columns(
        allocate=[{"request_id": "a", "num_tokens": 3}, {"request_id": "b", "num_tokens": 5}]
    )
    assert out.ok and out.status["allocate"].tolist() == [OK, OK]
    ha, hb = out.handles.tolist()
    assert (ha & 0xFFFFFFFF, ha >> 32) == (m.request("a").row, 1)
    assert hb == m.request("b").handle and out.allocate_new_blocks.tolist() == [1, 2]
    assert m.block_table("a") == [[0]] and m.block_table("b") == [[1, 2]]
    out = m.step_columns(extend=np.array([ha, hb]), num_new_tokens=[1, 4], lookahead=0)
    assert out.status["extend"].tolist() == [OK, OK] and out.new_blocks.tolist() == [0, 1]
    assert m.block_table("a") == [[0]] and m.block_table("b") == [[1, 2, 3]]
    assert (m.request("a").num_tokens, m.request("b").num_tokens) == (4, 9)
    out = m.step_columns(free=[ha])
    assert out.status["free"].tolist() == [OK] and out.freed_ids == ["a"]
    assert m.request_ids() == ["b"] and m.num_free_blocks() == 8 - 3


def test_a_handle_kept_past_its_free_names_nothing_even_when_the_row_is_reused() -> None:
    m = manager([layer(0)], num_blocks=8, max_requests=1)
    old = m.allocate("a", 2).handle
    m.free("a")
    new = m.allocate("b", 2)
    assert new.row == old & 0xFFFFFFFF and new.handle != old and new.handle >> 32 == 2
    before = snapshot(m)
    out = m.step_columns(extend=[old], free=[old], rewind=[old], commit=[old], commit_tokens=[[1]])
    for section in ("extend", "free", "rewind", "commit"):
        assert out.status[section].tolist() == [UNKNOWN]
    assert [e.error.detail for e in out.errors] == [{"handle": old}] * 4
    assert snapshot(m) == before


@pytest.mark.parametrize("bad", [0, -1, 2**40 + 7, 2**63 - 1, (1 << 32) | 0])
def test_handles_that_were_never_issued_are_unknown(bad: int) -> None:
    m = manager([layer(0)], num_blocks=8)
    m.allocate("a", 2)  # row 0, handle 1 << 32; (1 << 32) | 0 is it only while it lives
    m.free("a")
    out = m.step_columns(extend=[bad])
    assert out.status["extend"].tolist() == [UNKNOWN]


@pytest.mark.parametrize("section", ["free", "rewind", "commit"])
def test_a_few_handles_past_the_rows_are_unknown(section: str) -> None:
    """A short section runs in Python ints (``_Run.each_of_few``): a handle whose row bits are
    max_requests or more, or that is negative, names nothing; the live one still runs."""
    m = manager([layer(0)], num_blocks=8)
    a = m.allocate("a", 2).handle
    rows = m.config.max_requests
    handles = [(1 << 32) | rows, rows, (5 << 32) | (rows + 3), 2**63 - 1, -1, a]
    extra = {"commit_tokens": [[1]] * len(handles)} if section == "commit" else {}
    out = m.step_columns(**{section: handles}, **extra)
    assert out.status[section].tolist() == [UNKNOWN] * 5 + [OK]
    assert [e.index for e in out.errors] == [0, 1, 2, 3, 4]


def test_sections_run_commit_free_rewind_extend_allocate() -> None:
    """Frees serve the same step's extends and allocates; a commit serves its allocate's hit;
    a request that finished commits its last tokens in the step that frees it."""
    m = manager([layer(0)], num_blocks=4)
    a = m.allocate("a", 8, token_ids=list(range(8))).handle  # blocks 0, 1
    b = m.allocate("b", 4).handle  # block 2
    out = m.step_columns(
        free=[b],
        commit=[a],
        commit_tokens=[list(range(8))],
        extend=[a],
        num_new_tokens=4,
        allocate=[{"request_id": "c", "num_tokens": 9, "token_ids": list(range(9))}],
    )
    assert out.ok
    # b's block 2 went back; a's extend took block 3 then c reused a's two committed blocks
    # and took block 2 for its ninth token.
    assert m.block_table("a") == [[0, 1, 3]]
    assert m.block_table("c") == [[0, 1, 2]] and out.hit_tokens.tolist() == [8]
    assert out.allocate_new_blocks.tolist() == [3]
    # A finished request commits its last tokens and is freed in one step; the allocate of
    # the same step hits its blocks (idle now, still cached).
    d = m.request("c").handle
    out = m.step_columns(
        commit=[d],
        commit_tokens=[list(range(8, 9))],
        free=[d, m.request("a").handle],
        allocate=[{"request_id": "e", "num_tokens": 9, "token_ids": list(range(9))}],
    )
    assert out.ok and out.freed_ids == ["c", "a"] and out.hit_tokens.tolist() == [8]
    # c's free gave back block 2 (a still held 0 and 1), then a's gave back 3, 1, 0: e
    # claims its hits 0 and 1 and takes the queue's head, 2.
    assert m.block_table("e") == [[0, 1, 2]]


def test_a_batch_that_does_not_fit_runs_item_by_item() -> None:
    m = manager([layer(0)], num_blocks=4)
    a = m.allocate("a", 4).handle
    b = m.allocate("b", 4).handle
    out = m.step_columns(extend=[a, b], num_new_tokens=[4, 8])  # 1 + 2 blocks, 2 are free
    assert out.status["extend"].tolist() == [OK, OUT] and out.new_blocks.tolist() == [1, 0]
    assert [(e.section, e.index, e.error.code) for e in out.errors] == [
        ("extend", 1, "out_of_blocks")
    ]
    assert m.request("a").num_tokens == 8 and m.request("b").num_tokens == 4


def test_repeated_handles_run_one_after_another() -> None:
    m = manager([layer(0)], num_blocks=8)
    a = m.allocate("a", 4).handle
    out = m.step_columns(extend=[a, a, a], num_new_tokens=[1, 2, 3])
    assert out.ok and out.new_blocks.tolist() == [1, 0, 1]
    assert m.request("a").num_tokens == 10 and m.block_table("a") == [[0, 1, 2]]


def test_atomic_step_changes_nothing_when_an_item_fails() -> None:
    m = manager([layer(0)], num_blocks=6)
    a = m.allocate("a", 4, token_ids=[1, 2, 3, 4]).handle
    b = m.allocate("b", 4).handle
    before = snapshot(m)
    out = m.step_columns(
        free=[b],
        commit=[a],
        commit_tokens=[[1, 2, 3, 4]],
        extend=[a],
        num_new_tokens=40,  # 10 more blocks: out of blocks
        allocate=[{"request_id": "c", "num_tokens": 2}],
        atomic=True,
    )
    assert out.failed == ("extend", 0)
    assert out.status["free"].tolist() == [ABORTED]
    assert out.status["commit"].tolist() == [ABORTED]
    assert out.status["extend"].tolist() == [OUT]
    assert out.status["allocate"].tolist() == [ABORTED]
    assert out.handles.tolist() == [0] and out.freed_ids == [] and out.allocated_ids == []
    assert snapshot(m) == before


@pytest.mark.parametrize(
    "kwargs",
    [
        {"extend": [True]},
        {"extend": [[1, 2]]},
        {"extend": "ab"},
        {"extend": [1.5]},
        {"extend": [1, 2], "num_new_tokens": [1]},
        {"extend": "H", "num_new_tokens": 0},
        {"extend": "H", "lookahead": -1},
        {"extend": "H", "num_new_tokens": 2**63},
        {"commit": [1], "commit_tokens": []},
        {"commit": [1], "commit_tokens": "x"},
        {"rewind": [1], "rewind_tokens": 0},
        {"allocate": [{"request_id": "x"}]},
        {"allocate": [{"request_id": "x", "num_tokens": 1, "colour": 1}]},
        {"allocate": {"request_id": "x", "num_tokens": 1}},
        {"atomic": 1},
    ],
)
def test_a_malformed_step_is_refused_whole_and_changes_nothing(kwargs: dict) -> None:
    m = manager([layer(0)], num_blocks=8)
    h = m.allocate("a", 2).handle
    kwargs = {k: ([h] if v == "H" else v) for k, v in kwargs.items()}
    before = snapshot(m)
    with pytest.raises(InvalidArgument):
        m.step_columns(**kwargs)
    assert snapshot(m) == before


def test_an_item_with_bad_arguments_fails_alone() -> None:
    m = manager([layer(0)], num_blocks=8)
    a = m.allocate("a", 4).handle
    b = m.allocate("b", 4).handle
    out = m.step_columns(
        rewind=[a, b],
        rewind_tokens=[4, 1],  # a would keep no token
        commit=[b],
        commit_tokens=[[1, 2, 3, 4, 5]],  # b has 4 tokens (commits run before rewinds)
        allocate=[{"request_id": "c", "num_tokens": 0}, {"request_id": "d", "num_tokens": 1}],
    )
    assert out.status["rewind"].tolist() == [status_of("invalid_argument"), OK]
    assert out.status["commit"].tolist() == [status_of("invalid_argument")]
    assert out.status["allocate"].tolist() == [status_of("invalid_argument"), OK]
    assert out.handles[0] == 0 and out.handles[1] == m.request("d").handle
    assert m.request("a").num_tokens == 4 and m.request("b").num_tokens == 3
    assert m.committed_tokens("b") == []


def _one_by_one(m, ops: list[tuple]) -> list[str]:  # type: ignore[no-untyped-def]
    codes = []
    for kind, rid, *args in ops:
        try:
            if kind == "free":
                m.free(rid)
            elif kind == "rewind":
                m.rewind(rid, *args)
            elif kind == "commit":
                m.commit(rid, *args)
            elif kind == "extend":
                m.extend(rid, *args)
            else:
                m.allocate(rid, *args)
            codes.append("ok")
        except KVCMError as exc:
            codes.append(exc.code)
    return codes


@pytest.mark.parametrize("seed", range(6))
def test_random_steps_match_single_ops_in_section_order(seed: int) -> None:
    """Each columnar step equals its items run one by one, section after section, on a
    twin manager: statuses, block tables, free lists and committed tokens."""
    rng = np.random.default_rng(seed)
    layers = [layer(0, sliding_window=8), layer(1)] if seed % 2 else [layer(0)]
    col = manager(layers, num_blocks=24)
    one = manager(layers, num_blocks=24)
    serial = 0
    for _ in range(40):
        live = col.request_ids()
        ops: list[tuple] = []
        picks = list(rng.permutation(live)) if live else []
        for rid in picks[: rng.integers(0, 2)]:
            ops.append(("free", rid))
        rest = [r for r in picks if r not in {o[1] for o in ops}]
        for rid in rest:
            choice = rng.integers(0, 4)
            n = col.request(rid).num_tokens
            if choice == 0 and n > 1:
                ops.append(("rewind", rid, int(rng.integers(1, n))))
            elif choice == 1:
                done = len(col.committed_tokens(rid))
                k = int(rng.integers(0, n - done + 1))
                ops.append(("commit", rid, [int(t) for t in rng.integers(0, 5, k)]))
            ops.append(("extend", rid, int(rng.integers(1, 6)), int(rng.integers(0, 3))))
        for _ in range(rng.integers(0, 3)):
            serial += 1
            n = int(rng.integers(1, 14))
            ops.append(("allocate", f"r{serial}", n, [int(t) for t in rng.integers(0, 3, n)]))
        ops.sort(key=lambda o: ["commit", "free", "rewind", "extend", "allocate"].index(o[0]))
        # Extends run after all rewinds and commits (section order): the oracle too.
        expected = _one_by_one(one, ops)
        handle = {r: col.request(r).handle for r in live}
        by = {k: [o for o in ops if o[0] == k] for k in ("free", "rewind", "commit", "extend")}
        out = col.step_columns(
            free=[handle[o[1]] for o in by["free"]],
            rewind=[handle[o[1]] for o in by["rewind"]],
            rewind_tokens=[o[2] for o in by["rewind"]] or 1,
            commit=[handle[o[1]] for o in by["commit"]],
            commit_tokens=[o[2] for o in by["commit"]],
            extend=[handle[o[1]] for o in by["extend"]],
            num_new_tokens=[o[2] for o in by["extend"]] or 1,
            lookahead=[o[3] for o in by["extend"]] or 0,
            allocate=[
                {"request_id": o[1], "num_tokens": o[2], "token_ids": o[3]}
                for o in ops
                if o[0] == "allocate"
            ],
        )
        got = [
            STATUS_CODES[s]
            for section in ("commit", "free", "rewind", "extend", "allocate")
            for s in out.status[section].tolist()
        ]
        assert got == expected
        if seed % 2:
            # A batch releases its stale window blocks before it takes new ones, so block ids
            # may differ from one-by-one runs; everything else may not.
            def seen(m):  # type: ignore[no-untyped-def]
                return (
                    {r: (m.request(r), m.committed_tokens(r)) for r in m.request_ids()},
                    [m.num_free_blocks(pg) for pg in range(len(m.parts.coord.pools))],
                )

            assert seen(col) == seen(one)
        else:
            assert snapshot(col) == snapshot(one)
        for rid in col.request_ids():
            assert col.request(rid).num_tokens <= 60
            if col.request(rid).num_tokens > 40:
                col.free(rid)
                one.free(rid)


def test_a_handle_freed_twice_in_one_step_is_unknown_the_second_time() -> None:
    m = manager([layer(0)], num_blocks=8)
    a = m.allocate("a", 2).handle
    b = m.allocate("b", 3).handle
    out = m.step_columns(free=[a, a], extend=[b])
    assert out.status["free"].tolist() == [OK, UNKNOWN] and out.freed_ids == ["a"]
    assert out.status["extend"].tolist() == [OK] and out.failed is None
    assert m.request("b").num_tokens == 4


def test_more_extends_than_rows_run_one_by_one() -> None:
    m = manager([layer(0)], num_blocks=8, max_requests=2)
    a = m.allocate("a", 4).handle
    out = m.step_columns(extend=[a, a, a])  # 4 tokens in 1 block: the 5th opens block 2
    assert out.ok and out.new_blocks.tolist() == [1, 0, 0]
    assert m.request("a").num_tokens == 7
    results = m.step([{"op": "extend", "request_id": r, "num_new_tokens": 1} for r in "axy"])
    assert [r.ok for r in results] == [True, False, False]
    assert [r.error.code for r in results[1:] if r.error] == ["unknown_request"] * 2


def test_a_retried_allocate_answers_its_first_result_and_allocates_nothing() -> None:
    m = manager([layer(0)], num_blocks=8)
    ops = [
        {"op": "allocate", "request_id": "a", "num_tokens": 5},
        {"op": "extend", "request_id": "a", "num_new_tokens": 3},
        {"op": "allocate", "request_id": "a", "num_tokens": 5},
    ]
    assert [r.request.num_tokens for r in m.step(ops) if r.request] == [5, 8, 5]
    out = m.step_columns(allocate=[{"request_id": "a", "num_tokens": 5}])
    assert out.ok and out.allocate_new_blocks.tolist() == [0] and out.allocated_ids == []
    assert out.handles.tolist() == [m.request("a").handle]


def test_handles_of_a_replaced_model_name_nothing_in_the_new_one() -> None:
    m = manager([layer(0)], num_blocks=8)
    old = m.allocate("a", 2).handle
    m.free("a")
    m.register_model(layers=[layer(0)], num_blocks=8, tokens_per_block=4, max_seq_len=64)
    new = m.allocate("b", 2).handle
    assert new & 0xFFFFFFFF == old & 0xFFFFFFFF and new != old
    out = m.step_columns(free=[old])
    assert out.status["free"].tolist() == [UNKNOWN] and m.request_ids() == ["b"]


def test_one_huge_unsigned_handle_fails_alone() -> None:
    m = manager([layer(0)], num_blocks=8)
    h = m.allocate("a", 2).handle
    out = m.step_columns(extend=np.array([h, 2**64 - 1], dtype=np.uint64))
    assert out.status["extend"].tolist() == [OK, UNKNOWN]
    assert m.request("a").num_tokens == 3


def test_step_results_are_built_when_read_and_equal_the_models() -> None:
    from kvcm_client.models import OpResult

    m = manager([layer(0)], num_blocks=8)
    ops = [
        {"op": "allocate", "request_id": "a", "num_tokens": 3},
        {"op": "extend", "request_id": "a", "num_new_tokens": 2},
        {"op": "extend", "request_id": "zz", "num_new_tokens": 1},
    ]
    results = m.step(ops)
    assert len(results) == 3 and results._built == [None, None, None]  # nothing built yet
    assert results[-1].error is not None and results[-1].error.code == "unknown_request"
    assert results._built[0] is None and results._built[2] is not None
    expected = [OpResult.model_validate(d) for d in results._dicts]
    assert results == expected and list(results) == expected and results[:2] == expected[:2]
    assert results[1].request is not None and results[1].request.num_tokens == 5


TOO_LONG = status_of("sequence_too_long")


def _decode_twins(n: int) -> tuple:
    """Two equal managers with ``n`` requests of staggered lengths, one of them freed (its
    handle is stale), and request 2 at max_seq_len: a decode batch's failing items."""
    twins = []
    for _ in range(2):
        m = manager([layer(0)], num_blocks=64, max_seq_len=24)
        handles = [m.allocate(f"r{i}", 3 + 2 * i).handle for i in range(n)]
        m.extend("r2", 24 - m.request("r2").num_tokens)
        m.free("r1")
        twins.append((m, handles))
    return twins


def test_failing_items_of_a_decode_batch_fail_alone_and_the_rest_runs_as_one_by_one() -> None:
    """A stale handle and a request at max_seq_len among a decode batch: the other items
    extend exactly as single extends would (tables, free blocks), the two fail alone."""
    (col, handles), (one, _) = _decode_twins(6)
    stale = handles[1]
    out = col.step_columns(extend=[*handles, 2**40 + 3], num_new_tokens=3)
    assert out.status["extend"].tolist() == [OK, UNKNOWN, TOO_LONG, OK, OK, OK, UNKNOWN]
    assert [(e.index, e.error.code) for e in out.errors] == [
        (1, "unknown_request"),
        (2, "sequence_too_long"),
        (6, "unknown_request"),
    ]
    assert out.errors[0].error.detail == {"handle": stale}
    added = []
    for rid in ("r0", "r3", "r4", "r5"):
        before = sum(len(t) for t in one.block_table(rid))
        one.extend(rid, 3)
        added.append(sum(len(t) for t in one.block_table(rid)) - before)
    assert out.new_blocks.tolist() == [added[0], 0, 0, *added[1:], 0]
    assert snapshot(col) == snapshot(one)


def test_an_atomic_decode_batch_with_a_failing_item_changes_nothing() -> None:
    (m, handles), _ = _decode_twins(5)
    before = snapshot(m)
    out = m.step_columns(extend=handles, num_new_tokens=1, atomic=True)
    assert out.failed == ("extend", 1)
    assert out.status["extend"].tolist() == [ABORTED, UNKNOWN, ABORTED, ABORTED, ABORTED]
    assert out.new_blocks.tolist() == [0] * 5 and snapshot(m) == before


@pytest.mark.parametrize("seed", range(4))
def test_random_decode_batches_with_failures_match_single_extends(seed: int) -> None:
    """Random decode batches (one count for all, distinct handles) with stale handles and
    requests near max_seq_len mixed in, against single extends on a twin manager."""
    rng = np.random.default_rng(seed)
    col = manager([layer(0)], num_blocks=48, max_requests=12, max_seq_len=20)
    one = manager([layer(0)], num_blocks=48, max_requests=12, max_seq_len=20)
    stale: list[int] = []
    for step in range(30):
        for i in range(10 - len(col.request_ids())):
            n = int(rng.integers(1, 16))
            for m in (col, one):
                m.allocate(f"s{step}-{i}", n)
        ids = col.request_ids()
        assert ids == one.request_ids()
        picked = [ids[i] for i in rng.permutation(len(ids))[: rng.integers(2, len(ids) + 1)]]
        handles = [col.request(r).handle for r in picked]
        items: list[tuple[int, str | None]] = list(zip(handles, picked, strict=True))
        if stale:
            items += [(h, None) for h in rng.choice(stale, min(len(stale), 2), replace=False)]
        order = rng.permutation(len(items))
        items = [items[i] for i in order]
        k, ahead = int(rng.integers(1, 4)), int(rng.integers(0, 2))
        out = col.step_columns(extend=[int(h) for h, _ in items], num_new_tokens=k, lookahead=ahead)
        expected = []
        for _, rid in items:
            try:
                if rid is None:
                    raise KVCMError("stale")
                before = sum(len(t) for t in one.block_table(rid))
                one.extend(rid, k, lookahead=ahead)
                expected.append((OK, sum(len(t) for t in one.block_table(rid)) - before))
            except KVCMError as exc:
                expected.append((UNKNOWN if rid is None else status_of(exc.code), 0))
        got = list(zip(out.status["extend"].tolist(), out.new_blocks.tolist(), strict=True))
        assert got == expected
        assert snapshot(col) == snapshot(one)
        for rid in picked[: rng.integers(0, 3)]:
            stale.append(col.request(rid).handle)
            col.free(rid)
            one.free(rid)


def test_a_step_of_failing_items_leaves_no_garbage_cycles() -> None:
    """Each failed item's error is kept without its traceback, whose frames would hold the
    step's result and make a cycle per item that only the garbage collector frees."""
    import gc

    (m, handles), _ = _decode_twins(5)
    gc.collect()
    gc.disable()
    try:
        out = m.step_columns(extend=handles, num_new_tokens=1)
        assert out.status["extend"].tolist() == [OK, UNKNOWN, TOO_LONG, OK, OK]
        del out
        assert gc.collect() == 0
    finally:
        gc.enable()


@pytest.mark.parametrize("section", ["free", "allocate"])
def test_a_bug_in_a_free_or_an_allocate_is_that_items_internal_error(
    section: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """An untyped exception (a bug) in a step's free or allocate is logged and becomes the
    item's ``internal_error``; the step stops there (items after it ``step_aborted``, those
    before it applied). A typed error stays that item's own, and the step goes on."""
    from kvcm import allocation, request_rows

    m = manager([layer(0)], num_blocks=8)
    ha, hb = m.step_columns(
        allocate=[{"request_id": "a", "num_tokens": 3}, {"request_id": "b", "num_tokens": 3}]
    ).handles.tolist()
    target, name = (request_rows, "free_row") if section == "free" else (allocation, "start_op")
    real = getattr(target, name)
    calls = []

    def second_one_breaks(*args: object) -> object:
        calls.append(args)
        if len(calls) == 2:
            raise RuntimeError("a bug")
        return real(*args)

    monkeypatch.setattr(target, name, second_one_breaks)
    allocs = [{"request_id": r, "num_tokens": 2} for r in ("c", "d", "e")]
    out = m.step_columns(free=[ha, hb], allocate=allocs if section == "allocate" else [])
    internal, aborted = status_of("internal_error"), ABORTED
    if section == "free":
        assert out.status["free"].tolist() == [OK, internal]
        assert out.freed_ids == ["a"] and sorted(m.request_ids()) == ["b"]
    else:
        assert out.status["free"].tolist() == [OK, OK]
        assert out.status["allocate"].tolist() == [OK, internal, aborted]
        assert sorted(m.request_ids()) == ["c"] and out.handles.tolist()[1:] == [0, 0]
    assert out.failed == (section, 1) and [e.error.code for e in out.errors] == ["internal_error"]
    assert "failed with an internal error" in caplog.text
    # A typed error (no such row: the request freed meanwhile) is the item's own status.
    monkeypatch.setattr(target, name, real)
    out = m.step_columns(free=[ha])
    assert out.status["free"].tolist() == [UNKNOWN] and out.failed is None


def test_statuses_start_as_shared_zeros_that_a_failure_never_writes() -> None:
    """An ok step's statuses and block counts are read-only views of shared zeros; a failing
    item's section gets a copy of its own, so no later step sees an earlier one's codes, and
    an earlier outcome keeps its own after later steps."""
    m = manager([layer(0)], num_blocks=8)
    ha, hb = m.step_columns(
        allocate=[{"request_id": "a", "num_tokens": 3}, {"request_id": "b", "num_tokens": 3}]
    ).handles.tolist()
    stale = ha + (1 << 32)
    bad = m.step_columns(extend=[ha, stale, hb], num_new_tokens=[1, 1, 1], free=[stale])
    assert bad.status["extend"].tolist() == [OK, UNKNOWN, OK]
    assert bad.status["free"].tolist() == [UNKNOWN] and bad.new_blocks.tolist() == [0, 0, 0]
    good = m.step_columns(extend=[ha, hb, ha], free=[], num_new_tokens=[1, 1, 1])
    assert good.ok and good.status["extend"].tolist() == [OK, OK, OK]
    assert not good.status["extend"].flags.writeable  # the shared zeros
    assert good.new_blocks.tolist() == [1, 1, 0]  # a and b's 5th tokens: second blocks
    assert bad.status["extend"].tolist() == [OK, UNKNOWN, OK]  # its own copy, unchanged
    atomic = m.step_columns(extend=[ha, stale], atomic=True)
    assert atomic.status["extend"].tolist() == [ABORTED, UNKNOWN]
    assert m.step_columns(extend=[ha, hb]).status["extend"].tolist() == [OK, OK]


def test_reshaping_one_outcome_s_statuses_leaves_later_steps_alone() -> None:
    """Each outcome's statuses are views of their own (of shared read-only zeros): a caller
    that reshapes the one it got changes no later step's."""
    m = manager([layer(0)], num_blocks=64)
    handles = m.step_columns(
        allocate=[{"request_id": "a", "num_tokens": 4}, {"request_id": "b", "num_tokens": 4}]
    ).handles.tolist()
    first = m.step_columns(extend=handles)
    first.status["extend"].shape = (1, 2)
    second = m.step_columns(extend=handles)
    assert second.status["extend"].shape == (2,)
    assert second.to_json()["status"]["extend"] == [0, 0]


def test_map_slots_maps_each_successful_item_s_computed_tokens() -> None:
    """``map_slots``: the step's extends' new tokens, then its allocates' past their hits,
    failed items left out; exactly what ``slot_mappings`` gives for those requests and
    counts after the step (tokens_per_block 4, a window of 8 beside full attention)."""
    m = manager([layer(0, sliding_window=8), layer(1)], num_blocks=40, null_page=True)
    first = m.step_columns(
        allocate=[
            {"request_id": "a", "num_tokens": 9, "token_ids": list(range(9))},
            {"request_id": "b", "num_tokens": 3},
        ],
        map_slots=True,
    )
    assert first.slot_mapping.shape == (2, 12)
    assert first.slot_mapping.tolist() == m.slot_mappings(["a", "b"], [9, 3]).tolist()
    ha, hb = first.handles.tolist()
    m.commit("a", list(range(9)))
    out = m.step_columns(
        extend=[ha, 12345, hb],  # the middle one names nothing: no tokens
        num_new_tokens=[2, 1, 5],
        allocate=[
            {"request_id": "c", "num_tokens": 11, "token_ids": list(range(11))},  # hits 8
            {"request_id": "d", "num_tokens": 999},  # too long: no tokens
        ],
        map_slots=True,
    )
    assert out.status["extend"].tolist()[1] != 0 and out.status["allocate"].tolist()[1] != 0
    assert out.hit_tokens.tolist()[0] == 8
    want = m.slot_mappings(["a", "b", "c"], [2, 5, 3])
    assert out.slot_mapping.shape == (2, 10) and out.slot_mapping.tolist() == want.tolist()
    assert (out.slot_mapping[0, :2] >= 0).all()  # a's tokens 9, 10: in a's window
    nothing = m.step_columns(free=[ha], map_slots=True)
    assert nothing.slot_mapping.shape == (2, 0)
    without = m.step_columns(extend=[hb])
    assert without.slot_mapping is None
    with pytest.raises(InvalidArgument, match="map_slots"):
        m.step_columns(extend=[hb], map_slots=1)  # type: ignore[arg-type]


def test_an_atomic_step_that_stops_maps_nothing() -> None:
    m = manager([layer(0)], num_blocks=8)
    h = m.step_columns(allocate=[{"request_id": "a", "num_tokens": 4}]).handles[0]
    out = m.step_columns(extend=[h, 999], atomic=True, map_slots=True)
    assert out.failed is not None and out.slot_mapping.shape == (1, 0)
    assert m.request("a").num_tokens == 4


@pytest.mark.parametrize("seed", range(4))
def test_map_slots_on_random_steps_equals_slot_mappings(seed: int) -> None:
    """Random steps of extends (some past the pool or the length limit), allocates with
    shared prefixes (hits) and frees, with a sliding window: every step's mapping equals
    ``slot_mappings`` of its successful items with their computed counts."""
    rng = np.random.default_rng(seed)
    m = manager(
        [layer(0, sliding_window=8, sink_tokens=2), layer(1)],
        num_blocks=48,
        max_requests=6,
        max_seq_len=48,
        null_page=bool(seed % 2),
    )
    prompts = [rng.integers(0, 50, 40).tolist() for _ in range(3)]
    live: dict[int, str] = {}
    count = 0
    for _ in range(60):
        handles = list(live)
        extend = [h for h in handles if rng.random() < 0.7]
        new = [int(rng.integers(1, 12)) for _ in extend]
        allocate = []
        for _ in range(int(rng.integers(0, 3))):
            p = prompts[rng.integers(0, 3)]
            n = int(rng.integers(1, 30))
            allocate.append({"request_id": f"r{count}", "num_tokens": n, "token_ids": p[:n]})
            count += 1
        free = [h for h in handles if h not in extend and rng.random() < 0.3]
        out = m.step_columns(
            free=free, extend=extend, num_new_tokens=new or 1, allocate=allocate, map_slots=True
        )
        for h in free:
            del live[h]
        ids, counts = [], []
        for h, n, status in zip(extend, new, out.status["extend"].tolist(), strict=True):
            if not status:
                ids.append(live[h])
                counts.append(n)
        for op, status, h, hit in zip(
            allocate,
            out.status["allocate"].tolist(),
            out.handles.tolist(),
            out.hit_tokens.tolist(),
            strict=True,
        ):
            if not status:
                live[h] = op["request_id"]
                ids.append(op["request_id"])
                counts.append(op["num_tokens"] - hit)
                m.commit(op["request_id"], op["token_ids"][hit:])
        want = m.slot_mappings(ids, counts)
        assert out.slot_mapping.tolist() == want.tolist()


def test_the_client_sends_numpy_columns_as_their_int64_values() -> None:
    """The step channel's client packs numpy columns as little-endian int64 (handles) or
    int32 (commit tokens) bytes of the same values, whatever the array's own type: native
    int64 as is, big-endian or narrower ints cast, unsigned ints range-checked, and refuses
    values a cast would wrap and non-integer arrays."""
    from array import array

    from kvcm_client.columns import wire_columns
    from kvcm_client.errors import InvalidArgument

    values = [0, 7, 2**40 + 3, 2**63 - 1, -(2**63)]
    want = array("q", values).tobytes()
    for dtype in ("<i8", ">i8", "=i8"):
        got = wire_columns(extend=np.array(values, dtype=dtype))["extend"]
        assert got == want, dtype
    sliced = np.repeat(np.array(values, dtype=np.int64), 2)[::2]  # not contiguous
    assert wire_columns(extend=sliced)["extend"] == want
    small = [0, 5, 2**15 - 1]
    for dtype in ("<i4", ">i4", "<i2", "<u4", "<u8"):
        got = wire_columns(extend=np.array(small, dtype=dtype))["extend"]
        assert got == array("q", small).tobytes(), dtype
    tokens = wire_columns(commit=[3], commit_tokens=[np.array([1, -2, 2**31 - 1])])
    assert tokens["commit_tokens"] == array("i", [1, -2, 2**31 - 1]).tobytes()
    bad = [
        np.array([2**63], dtype=np.uint64),
        np.array([1.0, 2.0]),
        np.array([True, False]),
    ]
    for column in bad:
        with pytest.raises(InvalidArgument):
            wire_columns(extend=column)
    with pytest.raises(InvalidArgument):  # an int64 token id past int32
        wire_columns(commit=[3], commit_tokens=[np.array([2**31], dtype=np.int64)])


@pytest.mark.parametrize("null_page", [False, True])
def test_a_rehearsed_step_changes_nothing_and_the_step_runs_as_without_it(
    rng: np.random.Generator, null_page: bool
) -> None:
    """``rehearse_columns`` and ``rehearse_decode`` (busy-poll mode's rehearsals): over
    random decode steps (windows with sinks, a key-only layer, block crossings, lookahead, a
    stale or repeated handle, requests past max_seq_len, full pools) they change nothing a
    manager holds, and the step run after them equals the same step on a twin never
    rehearsed, mapping included. Decode steps run the C plan (when built); other steps are
    parsed only; a malformed one raises as the step would, where ``rehearse_decode`` plans
    only what ``decode_step`` runs as its batch and raises nothing."""
    from kvcm.native_step import NativeDecode

    layers = [layer(0, sliding_window=8, sink_tokens=2), layer(1), layer(2, kv_factor=1)]
    cfg = {"num_blocks": 40, "max_requests": 8, "max_seq_len": 48, "null_page": null_page}
    a, b = manager(layers, **cfg), manager(layers, **cfg)
    planned: list[int] = []
    real = NativeDecode.rehearse

    def counted(self: NativeDecode, core: object, m: object, handles: np.ndarray, *rest: object):
        planned.append(handles.size)
        return real(self, core, m, handles, *rest)

    NativeDecode.rehearse = counted  # type: ignore[method-assign]
    try:
        live: list[int] = []
        for step in range(120):
            if len(live) < 6 and rng.random() < 0.3:
                n = int(rng.integers(1, 20))
                op = {"request_id": f"r{step}", "num_tokens": n}
                ha, hb = a.step_columns(allocate=[op]), b.step_columns(allocate=[op])
                assert ha.status["allocate"].tolist() == hb.status["allocate"].tolist()
                if ha.ok:
                    live.append(int(ha.handles[0]))
            if len(live) < 2:
                continue
            handles = list(live)
            if rng.random() < 0.15:
                handles.append(handles[0] ^ (1 << 40))  # a stale handle: its row, not its id
            if rng.random() < 0.1:
                handles.append(handles[-1])  # a row twice: the plan refuses the batch
            cols = {
                "extend": np.array(handles, dtype=np.int64),
                "num_new_tokens": int(rng.integers(1, 4)),
                "lookahead": int(rng.integers(0, 3)),
            }
            before = manager_state(a)
            a.rehearse_columns(cols)
            a.rehearse_decode(cols["extend"], cols["num_new_tokens"], cols["lookahead"])
            assert same(manager_state(a), before), step
            oa = a.step_columns(**cols, map_slots=True)
            ob = b.step_columns(**cols, map_slots=True)
            assert oa.status["extend"].tolist() == ob.status["extend"].tolist(), step
            assert torch.equal(oa.slot_mapping, ob.slot_mapping), step
            assert same(manager_state(a), manager_state(b)), step
            gone = [h for h, s in zip(handles, oa.status["extend"].tolist(), strict=True) if s]
            if gone or rng.random() < 0.1:  # too long or out of blocks: freed, as an engine
                drop = [h for h in live if h in gone] or [live[0]]
                a.step_columns(free=drop)
                b.step_columns(free=drop)
                live = [h for h in live if h not in drop]
        before = manager_state(a)
        a.rehearse_columns({"free": live[:1], "extend": live[1:]})  # not a decode: parsed
        with pytest.raises(InvalidArgument):
            a.rehearse_columns({"extend": [live[0]], "num_new_tokens": 0})
        n = len(planned)
        a.rehearse_decode(live)  # not an int64 array: not decode_step's batch, not planned
        a.rehearse_decode(np.array(live, dtype=np.uint64))
        a.rehearse_decode(np.array([live, live], dtype=np.int64))
        a.rehearse_decode(np.array(live, dtype=np.int64), np.int64(1))  # type: ignore[arg-type]
        assert same(manager_state(a), before) and len(planned) == n
    finally:
        NativeDecode.rehearse = real  # type: ignore[method-assign]
    assert (len(planned) > 50) == native.available()


@pytest.mark.skipif(not native.available(), reason="kvcm._native is not built")
@pytest.mark.usefixtures("restore_native")
def test_a_rehearsal_reads_the_take_of_cached_blocks_and_evicts_nothing() -> None:
    """At a block crossing whose new blocks are cached ones (the free queue's head), the
    rehearsal takes them dry (``decode_take``: evictions reported, nothing written): the
    cache still holds them, and the step after it evicts them as on a twin never rehearsed."""

    def build() -> tuple[KVCacheManager, np.ndarray]:
        m = manager([layer(0)], num_blocks=8, max_requests=4)
        live = m.step_columns(allocate=[{"request_id": r, "num_tokens": 4} for r in "ab"])
        m.allocate("p", 8, token_ids=list(range(8)))
        m.commit("p", list(range(8)))
        m.free("p")  # its two blocks cached, at the queue's tail
        m.allocate("c", 16)  # the four uncached blocks: the cached ones are the head now
        return m, live.handles

    a, handles = build()
    b, _ = build()
    spy = CoreSpy(a)
    native.core = spy
    before = manager_state(a)
    prompt = [*range(8), 99]  # p's two blocks, then a token of its own
    assert a.probe(prompt) == 8
    a.rehearse_columns({"extend": handles})
    assert spy.results["take evict"] == 1 and same(manager_state(a), before)
    assert a.probe(prompt) == 8  # still cached
    oa, ob = a.step_columns(extend=handles), b.step_columns(extend=handles)
    assert oa.new_blocks.tolist() == ob.new_blocks.tolist() == [1, 1]
    assert same(manager_state(a), manager_state(b)) and a.probe(prompt) == 0

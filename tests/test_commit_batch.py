"""A step's commits as one batch (``commits.commit_batch``) against the same commits item by
item: equal statuses, errors, committed tokens, block keys, cache index and KV events."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from helpers import layer, manager

from kvcm import KVCacheManager, columnar, native

#: The batch path (tests put item by item in its place on the other manager).
_BATCH = columnar.commit_batch


def _state(m: KVCacheManager, after: int) -> dict[str, Any]:
    """What commits change (the KV events since sequence number ``after``)."""
    live = m.request_ids()
    return {
        "tokens": {r: bytes(m.parts.requests.tokens[r]) for r in live},
        "keys": {r: list(m.parts.requests.prefix[r].keys) for r in live},
        "committed": m.parts.requests.committed.copy().tolist(),
        "index": [{k: dict(v) for k, v in g.items()} for g in m.parts.coord.cache.index],
        "events": m.events(after, 100_000).model_dump(exclude={"generation"}),
        "num_tokens": m.parts.coord.num_tokens.tolist(),
    }


def _keys_follow_commits(m: KVCacheManager) -> None:
    """What the batch relies on: a request's keys are those of its full committed blocks."""
    for rid in m.request_ids():
        assert (
            len(m.parts.requests.prefix[rid].keys)
            == len(m.parts.requests.tokens[rid]) // 4 // m.tokens_per_block
        ), rid


@pytest.mark.parametrize("core", [True, False])
@pytest.mark.parametrize("tpb", [1, 4])
def test_batched_commits_match_item_by_item(
    core: bool, tpb: int, rng: np.random.Generator, monkeypatch: pytest.MonkeyPatch
) -> None:
    """300 random steps on two managers, one committing item by item: commits of one or
    several tokens or too many, bad token ids, stale and repeated handles, prompts that hit
    the cache, rewinds (rejected drafts) and frees, some steps all or nothing."""
    native.use(core)
    batches = {"ran": 0}

    def counted(*args: Any) -> bool:
        ran = _BATCH(*args)
        batches["ran"] += ran
        return ran

    cfg = {"tokens_per_block": tpb, "num_blocks": 400, "max_requests": 10, "max_seq_len": 120}
    ms = {True: manager([layer(0), layer(1, sliding_window=9)], **cfg)}
    ms[False] = manager([layer(0), layer(1, sliding_window=9)], **cfg)
    prompts = [rng.integers(0, 20, 30).tolist() for _ in range(3)]
    seqs: dict[int, list[int]] = {}  # handle -> its tokens so far (committed or not)
    stale: list[int] = []
    try:
        for step in range(300):
            live = list(seqs)
            cols: dict[str, Any] = {}
            if live:
                picked = [h for h in live if rng.random() < 0.8]
                tokens = []
                for h in picked:
                    done = (
                        len(
                            ms[True].parts.requests.tokens[
                                ms[True].parts.requests.ids[h & 0xFFFFFFFF]
                            ]
                        )
                        // 4
                    )
                    pending = len(seqs[h]) - done
                    r = rng.random()
                    if r < 0.05:
                        tokens.append(rng.integers(0, 20, pending + 1).tolist())  # too many
                    elif r < 0.08:
                        tokens.append([-1])  # not a token id
                    else:
                        part = seqs[h][done : done + int(rng.integers(0, pending + 1))]
                        kind = rng.random()  # what schedulers pass: lists, tuples, arrays
                        tokens.append(
                            tuple(part) if kind < 0.1 else np.array(part) if kind < 0.2 else part
                        )
                if stale and rng.random() < 0.1:
                    picked.append(stale[-1])
                    tokens.append([1])
                elif picked and rng.random() < 0.05:
                    picked.append(picked[0])
                    tokens.append([])
                cols["commit"], cols["commit_tokens"] = picked, tokens
                cols["extend"] = live
                cols["num_new_tokens"] = rng.integers(1, 4, len(live))
            if live and rng.random() < 0.15:
                gone = live[int(rng.integers(len(live)))]
                cols["free"] = [gone]
            if live and rng.random() < 0.15:
                h = live[int(rng.integers(len(live)))]
                cols["rewind"], cols["rewind_tokens"] = [h], 1
            if rng.random() < 0.3:
                prompt = prompts[int(rng.integers(3))][: int(rng.integers(2, 31))]
                salt = {"cache_salt": "tenant-b"} if rng.random() < 0.3 else {}
                cols["allocate"] = [
                    {
                        "request_id": f"q{step}",
                        "num_tokens": len(prompt),
                        "token_ids": prompt,
                        **salt,
                    }
                ]
            atomic = bool(rng.random() < 0.1)
            seen = ms[True].last_event_seq
            outs = {}
            for batched, m in ms.items():
                monkeypatch.setattr(
                    columnar, "commit_batch", counted if batched else (lambda *_: False)
                )
                outs[batched] = m.step_columns(**cols, atomic=atomic)
            a, b = outs[True], outs[False]
            assert {s: v.tolist() for s, v in a.status.items()} == {
                s: v.tolist() for s, v in b.status.items()
            }, step
            assert [(e.section, e.index, e.error.code) for e in a.errors] == [
                (e.section, e.index, e.error.code) for e in b.errors
            ]
            assert _state(ms[True], seen) == _state(ms[False], seen), step
            for m in ms.values():
                _keys_follow_commits(m)
            # the scheduler's view: new tokens of extends, drafts rewound, frees, new requests
            m = ms[True]
            for h in list(seqs):
                row = h & 0xFFFFFFFF
                if m.parts.requests.handle[row] != h:
                    del seqs[h]
                    stale.append(h)
                    continue
                n = int(m.parts.coord.num_tokens[row])
                seqs[h] = (seqs[h] + rng.integers(0, 20, n).tolist())[:n]
            for i, h in enumerate(a.handles.tolist()):
                if h:
                    seqs[h] = list(cols["allocate"][i]["token_ids"])
    finally:
        native.use(True)
    assert batches["ran"] > 100  # most steps' commits ran as a batch


@pytest.mark.parametrize("core", [True, False])
@pytest.mark.parametrize("atomic", [False, True])
def test_a_step_stopped_by_a_failed_publish_applies_nothing_after_it(
    atomic: bool, core: bool, monkeypatch: pytest.MonkeyPatch, restore_native: None
) -> None:
    """An internal error in the publish of the second commit (its KV event) stops the step
    (atomic or not): the first commit (no block filled) is applied unless the step is
    atomic, the third (no block filled either) is not, as item by item; the failed commit
    keeps none of its tokens or keys. With the C core the batch is ``commit_run``'s."""
    from kvcm.events import EventLog

    real = EventLog.stored
    armed = {"on": False}

    def failing(log: EventLog, *args: Any) -> None:
        if armed["on"]:
            raise RuntimeError("a bug in publish")
        real(log, *args)

    monkeypatch.setattr(EventLog, "stored", failing)
    native.use(core)
    outs, tokens, keys = {}, {}, {}
    for batched in (True, False):
        monkeypatch.setattr(columnar, "commit_batch", _BATCH if batched else lambda *_: False)
        m = manager([layer(0)], num_blocks=16, max_seq_len=64)
        handles = [m.allocate(r, 8).handle for r in "abc"]  # rows 0, 1, 2
        for r in "abc":
            m.commit(r, [1, 2])
        armed["on"] = True
        out = m.step_columns(commit=handles, commit_tokens=[[3], [3, 4], [3]], atomic=atomic)
        armed["on"] = False
        outs[batched] = [v.tolist() for v in out.status.values()]
        assert [e.error.code for e in out.errors] == ["internal_error"]
        tokens[batched] = [m.committed_tokens(r) for r in "abc"]
        keys[batched] = [len(m.parts.requests.prefix[r].keys) for r in "abc"]
    assert outs[True] == outs[False]
    assert tokens[True] == tokens[False]
    assert keys[True] == keys[False] == [0, 0, 0]
    assert tokens[True][1] == [1, 2]  # the failed commit: nothing kept
    assert tokens[True][2] == [1, 2]  # after the stop: not applied
    assert tokens[True][0] == ([1, 2] if atomic else [1, 2, 3])

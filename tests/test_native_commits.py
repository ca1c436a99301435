"""A step's commits in C (``commit_run``, ``commits.commit_batch`` with the C core) against the
same steps without the core: the same committed tokens, keys, cache index, slot keys, cached
flags, stats and KV events (``helpers.manager_state``)."""

from __future__ import annotations

from collections import Counter
from typing import Any

import numpy as np
import pytest
from helpers import layer, manager, manager_state, same

from kvcm import KVCacheManager, native

pytestmark = [
    pytest.mark.skipif(not native.available(), reason="kvcm._native is not built"),
    pytest.mark.usefixtures("restore_native"),
]


class _Spy:
    """The C core, counting what ``commit_run`` returned (``done`` for n, ``handed back``
    for an item left to Python, ``refused`` for None, ``failed`` for an item's error)."""

    def __init__(self) -> None:
        self._core = native._built
        self.results: Counter[str] = Counter()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._core, name)

    def commit_run(self, rows: np.ndarray, data: list[bytes], *args: Any) -> Any:
        out = self._core.commit_run(rows, data, *args)
        kind = (
            "refused"
            if out is None
            else "failed"
            if type(out) is tuple
            else "done"
            if out == len(data)
            else "handed back"
        )
        self.results[kind] += 1
        return out


def _prefix_state(m: KVCacheManager) -> Any:
    """Each live request's committed bytes and keys, the cache index and its stats."""
    live = m.request_ids()
    cache = m.parts.coord.cache
    return [
        {r: bytes(m.parts.requests.tokens[r]) for r in live},
        {r: list(m.parts.requests.prefix[r].keys) for r in live},
        [{root: dict(keys) for root, keys in g.items()} for g in cache.index],
        cache.stats,
    ]


def test_the_worked_example_appends_publishes_and_appends() -> None:
    """commit_run's docstring: tokens_per_block 4, requests at 5, 7 and 2 committed tokens
    commit one token each; only the second fills a block (block 1), which is keyed from
    block 0's key and published (index, slot key, cached flag, one event)."""
    native.use(True)
    m = manager([layer(0)], num_blocks=16, max_seq_len=64)
    for rid, n in (("a", 5), ("b", 7), ("c", 2)):
        m.allocate(rid, n + 1)
        m.commit(rid, list(range(10, 10 + n)))
    core = native._built
    cache = m.parts.coord.cache
    seq = cache.log.last_seq
    rows = np.array([m.parts.requests.rows[r] for r in "abc"], dtype=np.int64)
    data = [np.array([t], dtype="<i4").tobytes() for t in (1, 2, 3)]
    args = (
        m.parts.requests.ids,
        m.parts.requests.tokens,
        m.parts.requests.prefix,
        m.parts.requests.committed,
        m.parts.native_decode.arrays(core, m.parts),
    )
    assert core.commit_run(rows, data, 0, *args, cache) == 3
    assert m.committed_tokens("a") == [10, 11, 12, 13, 14, 1]
    assert m.committed_tokens("b") == [10, 11, 12, 13, 14, 15, 16, 2]
    assert m.committed_tokens("c") == [10, 11, 3]
    assert m.parts.requests.committed[rows].tolist() == [6, 8, 3]
    keys = m.parts.requests.prefix["b"].keys
    from kvcm.hashing import chain_keys

    assert keys == chain_keys(
        m.parts.requests.prefix["b"].root,
        np.array([10, 11, 12, 13, 14, 15, 16, 2], "<i4").tobytes(),
        4,
    )
    slot = int(m.parts.coord.tables[0][m.parts.requests.rows["b"], 1])
    assert cache.scope(0, m.parts.requests.prefix["b"].root)[keys[1]] == slot
    assert cache.slot_key[0][slot] == (0, m.parts.requests.prefix["b"].root, keys[1])
    assert cache.cached[0][slot]
    (event,) = m.events(seq).events
    assert event.kind == "block_stored" and event.block_keys == [keys[1].hex()]
    assert event.parent_key == keys[0].hex() and event.token_ids == [14, 15, 16, 2]


def test_an_item_that_does_not_fit_refuses_the_call_with_nothing_changed() -> None:
    """More tokens than a request has uncommitted: None, no item applied (the columnar step
    then runs the items one by one and names the error)."""
    native.use(True)
    m = manager([layer(0)], num_blocks=16, max_seq_len=64)
    for rid in "ab":
        m.allocate(rid, 4)
    core = native._built
    before = _prefix_state(m), manager_state(m)
    rows = np.array([m.parts.requests.rows["a"], m.parts.requests.rows["b"]], dtype=np.int64)
    data = [np.arange(4, dtype="<i4").tobytes(), np.arange(5, dtype="<i4").tobytes()]
    args = (
        m.parts.requests.ids,
        m.parts.requests.tokens,
        m.parts.requests.prefix,
        m.parts.requests.committed,
        m.parts.native_decode.arrays(core, m.parts),
    )
    assert core.commit_run(rows, data, 0, *args, m.parts.coord.cache) is None
    assert same((_prefix_state(m), manager_state(m)), before)
    handles = [m.request(r).handle for r in "ab"]
    out = m.step_columns(commit=handles, commit_tokens=[[1] * 4, [1] * 5])
    assert out.status["commit"][0] == 0 and out.status["commit"][1] != 0
    assert [(e.index, e.error.code) for e in out.errors] == [(1, "invalid_argument")]
    assert m.committed_tokens("a") == [1] * 4 and m.committed_tokens("b") == []


def _random_steps(
    m: dict[bool, KVCacheManager], rng: np.random.Generator, steps: int, spy: _Spy
) -> None:
    """``steps`` random columnar steps on both managers, compared after each: commits of
    one token, a few, a block or a whole prompt (prompt tokens, so kept keys are reused,
    or, after a rewind, tokens that differ from the prompt's part way), rewinds, frees and
    allocates (shared prompts, so hits and duplicate keys; salts, LoRA ids and multimodal
    items)."""
    prompts = [rng.integers(0, 6, 40).tolist() for _ in range(3)]
    seqs: dict[int, list[int]] = {}  # handle -> the tokens the scheduler would commit
    for step in range(steps):
        cols: dict[str, Any] = {}
        live = list(seqs)
        any_m = m[True]
        if live:
            picked = [h for h in live if rng.random() < 0.7]
            tokens = []
            for h in picked:
                rid = any_m.parts.requests.ids[h & 0xFFFFFFFF]
                done = len(any_m.parts.requests.tokens[rid]) // 4
                pending = seqs[h][done:]
                k = int(rng.integers(0, len(pending) + 1))
                if rng.random() < 0.2:
                    k = len(pending)
                tokens.append(pending[:k])
            cols["commit"], cols["commit_tokens"] = picked, tokens
        if live and rng.random() < 0.3:
            h = live[int(rng.integers(len(live)))]
            cols["rewind"], cols["rewind_tokens"] = [h], int(rng.integers(1, 6))
        if live and rng.random() < 0.2:
            cols["free"] = [live[int(rng.integers(len(live)))]]
        if rng.random() < 0.4:
            p = prompts[int(rng.integers(3))]
            prompt = p[: int(rng.integers(2, len(p) + 1))]
            extra: dict[str, Any] = {}
            r = rng.random()
            if r < 0.15:
                extra["cache_salt"] = "tenant-b"
            elif r < 0.3:
                extra["lora_id"] = 7
            elif r < 0.4:
                extra["multimodal"] = [{"digest": "img", "start": 1, "length": 3}]
            cols["allocate"] = [
                {"request_id": f"q{step}", "num_tokens": len(prompt), "token_ids": prompt, **extra}
            ]
        outs = {}
        for on, mm in m.items():
            native.use(on)
            native.core = spy if on else None
            outs[on] = mm.step_columns(**cols)
        a, b = outs[True], outs[False]
        assert {s: v.tolist() for s, v in a.status.items()} == {
            s: v.tolist() for s, v in b.status.items()
        }, step
        assert same(_prefix_state(m[True]), _prefix_state(m[False])), step
        assert same(manager_state(m[True]), manager_state(m[False])), step
        # The scheduler's view: a rewind cuts its sequence; the tokens after the committed
        # ones are what it computes next (the prompt's, else new ones, which may differ).
        mm = m[True]
        for h in list(seqs):
            row = h & 0xFFFFFFFF
            if mm.parts.requests.handle[row] != h:
                del seqs[h]
                continue
            n = int(mm.parts.coord.num_tokens[row])
            seqs[h] = (seqs[h] + rng.integers(0, 6, n).tolist())[:n]
            if "rewind" in cols and cols["rewind"][0] == h and rng.random() < 0.5:
                seqs[h] = seqs[h][: max(n - 3, 0)]  # rejected: others come in their place
        for i, h in enumerate(a.handles.tolist()):
            if h:
                seqs[h] = list(cols["allocate"][i]["token_ids"])
        grow = int(rng.integers(1, 6))
        for mm in m.values():  # room to commit more: every live request grows
            live = [int(h) for h in mm.parts.requests.handle if h > 0]
            if live:
                mm.step_columns(extend=live, num_new_tokens=grow)
        for h in seqs:
            n = int(m[True].parts.coord.num_tokens[h & 0xFFFFFFFF])
            seqs[h] = (seqs[h] + rng.integers(0, 6, n).tolist())[:n]


@pytest.mark.parametrize(
    ("config", "draft_reuse"),
    [
        ({"tokens_per_block": 1}, "reusable"),
        ({"tokens_per_block": 4, "null_page": True}, "reusable"),
        ({"tokens_per_block": 3, "kv_events": False}, "reusable"),
        ({"tokens_per_block": 2}, "none"),
    ],
)
@pytest.mark.parametrize("sha_extensions", [True, False])
def test_random_steps_of_commits_match_the_python_path(
    config: dict[str, Any], draft_reuse: str, sha_extensions: bool
) -> None:
    """200 random steps over three layer groups in two pool groups (full attention, a
    window with sinks, the draft's, reusable or not: then nothing hits, and commits publish
    in the other groups only), with and without the SHA extensions (the portable
    compression keys them in C then)."""
    core = native._built
    assert core is not None
    if sha_extensions and not core.HAVE_SHA_EXTENSIONS:
        pytest.skip("the CPU has no SHA extensions")
    layers = [
        layer(0),
        layer(1, sliding_window=7, sink_tokens=2),
        layer(2, owner="draft", reuse=draft_reuse, head_dim=8),  # its own pool group
    ]
    kw = {"num_blocks": 600, "max_requests": 12, "max_seq_len": 96, **config}
    spy = _Spy()
    ms = {on: manager(layers, **kw) for on in (True, False)}
    assert ms[True].parts.coord.group_pool == [0, 0, 1]
    core.use_sha_extensions(sha_extensions)
    try:
        _random_steps(ms, np.random.default_rng(11), 200, spy)
    finally:
        core.use_sha_extensions(True)
    assert spy.results["done"] > 50, spy.results
    assert spy.results["handed back"] > 0, spy.results  # multimodal blocks: Python keys them
    assert spy.results["failed"] == 0, spy.results
    assert ms[True].parts.coord.cache.stats.stored_blocks > 100


@pytest.mark.parametrize("on", [True, False])
def test_a_cached_slot_is_not_published_again(on: bool) -> None:
    """A block whose slot is cached already (under any key) is not stored again, with or
    without the core: the slot keeps its one entry. (Hand-made: the manager uncaches a slot
    before a request writes into it again.)"""
    native.use(on)
    m = manager([layer(0)], num_blocks=16, max_seq_len=64)
    m.allocate("a", 8)
    m.commit("a", [1, 2, 3])
    cache = m.parts.coord.cache
    slot = int(m.parts.coord.tables[0][m.parts.requests.rows["a"], 0])
    cache.cached[0][slot] = True
    seq = cache.log.last_seq
    handles = [m.request("a").handle, m.allocate("b", 4).handle]
    out = m.step_columns(commit=handles, commit_tokens=[[4, 5, 6], [7]])  # fills block 0
    assert out.ok and m.committed_tokens("a") == [1, 2, 3, 4, 5, 6]
    assert (
        len(m.parts.requests.prefix["a"].keys) == 1
        and cache.index == [{}]
        and cache.slot_key == [{}]
    )
    assert cache.log.last_seq == seq and cache.stats.stored_blocks == 0


@pytest.mark.parametrize("on", [True, False])
def test_a_kept_prompt_key_is_reused_only_after_the_prompt_s_own_blocks(on: bool) -> None:
    """commit_keys' rule in C: block 1 committed with other tokens than the prompt's gets a
    hashed key, and so does block 2 although its tokens are the prompt's (its parent is no
    longer the prompt's key); blocks committed as the prompt's take its kept keys. Every
    key is the chain of the committed tokens."""
    from kvcm.hashing import chain_keys

    native.use(on)
    m = manager([layer(0)], num_blocks=16, max_seq_len=64)
    prompt = list(range(1, 13))
    m.allocate("a", 12, token_ids=prompt)
    m.allocate("b", 12, token_ids=prompt)
    kept = list(m.parts.requests.prefix["a"].prompt_keys)
    assert len(kept) == 3
    handles = [m.request(r).handle for r in "ab"]
    m.step_columns(commit=handles, commit_tokens=[[1, 2, 3, 4, 5, 6, 7, 99], prompt[:8]])
    m.step_columns(commit=handles, commit_tokens=[prompt[8:], prompt[8:]])
    root = m.parts.requests.prefix["a"].root
    for rid in "ab":
        tokens = np.array(m.committed_tokens(rid), dtype="<i4").tobytes()
        assert m.parts.requests.prefix[rid].keys == chain_keys(root, tokens, 4), rid
    assert m.parts.requests.prefix["b"].keys == kept
    for rid in "ab":  # the kept key objects themselves: reused, not hashed again
        n = 3 if rid == "b" else 1
        own = m.parts.requests.prefix[rid].prompt_keys[:n]
        assert all(k is p for k, p in zip(m.parts.requests.prefix[rid].keys[:n], own, strict=True))
    assert not set(m.parts.requests.prefix["a"].keys[1:]) & set(kept)


@pytest.mark.parametrize("on", [True, False])
def test_given_keys_that_hit_are_not_kept_for_a_commit_after_a_rewind(on: bool) -> None:
    """A client allocates prompt Y with X's keys (they hit X's cached blocks), rewinds below
    the hit and commits Y's tokens: block 0 now holds Y's KV, so it is published under Y's
    own key, and a later request for X does not hit it."""
    from kvcm.hashing import chain_keys

    native.use(on)
    m = manager([layer(0)], num_blocks=32, max_seq_len=64)
    x = [1, 2, 3, 4, 5, 6, 7, 8, 9]
    y = [1, 2, 3, 9, 5, 6, 7, 8, 9]  # block 0 differs at position 3
    m.allocate("a", 9, token_ids=x)
    m.commit("a", x)
    kx = list(m.parts.requests.prefix["a"].keys)
    hb = m.allocate("b", 9, token_ids=y, block_keys=[k.hex() for k in kx]).handle
    assert m.request("b").num_hit_tokens == 8 and m.parts.requests.prefix["b"].prompt_keys == []
    m.free("a")
    m.rewind("b", 6)
    m.step_columns(extend=[hb], num_new_tokens=6)
    out = m.step_columns(commit=[hb, m.allocate("c", 4).handle], commit_tokens=[y[3:], [0]])
    assert out.ok
    root = m.parts.requests.prefix["b"].root
    assert m.parts.requests.prefix["b"].keys == chain_keys(
        root, np.array(y[:8], "<i4").tobytes(), 4
    )
    assert kx[0] not in m.parts.coord.cache.scope(0, root)
    assert m.allocate("d", 9, token_ids=x).num_hit_tokens == 0


@pytest.mark.parametrize("on", [True, False])
def test_given_keys_of_any_bytes_type_are_taken_as_bytes(on: bool) -> None:
    """Caller-given keys mixing bytes and a bytes subclass: converted at allocate, so the
    hit's keys are plain bytes and a later commit publishes on both paths."""

    class Key(bytes):
        pass

    native.use(on)
    m = manager([layer(0)], num_blocks=32, max_seq_len=64)
    x = list(range(1, 14))
    m.allocate("a", 13, token_ids=x)
    m.commit("a", x)
    kx = list(m.parts.requests.prefix["a"].keys)
    hb = m.allocate("b", 13, token_ids=x, block_keys=[kx[0], Key(kx[1]), kx[2]]).handle
    assert all(type(k) is bytes for k in m.parts.requests.prefix["b"].keys)
    out = m.step_columns(commit=[hb, m.allocate("c", 4).handle], commit_tokens=[x[12:], [0]])
    assert out.ok, out.errors


@pytest.mark.parametrize("nth", [2, 3])
def test_a_publish_failing_part_way_leaves_the_same_state_with_and_without_the_core(
    nth: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The event log raises at its ``nth`` call of a step (the second layer group of the
    first publishing commit, or the next commit): the step stops at that item on both paths,
    the items before it applied, that one without its tokens or keys, and the cache, stats
    and events (what was stored before the failure included) equal."""
    from kvcm.events import EventLog

    real = EventLog.stored
    calls = {"n": 0, "armed": False}

    def stored(log: EventLog, *args: Any) -> None:
        if calls["armed"]:
            calls["n"] += 1
            if calls["n"] == nth:
                raise RuntimeError("the event log failed")
        real(log, *args)

    monkeypatch.setattr(EventLog, "stored", stored)
    layers = [layer(0), layer(1, owner="draft", head_dim=8)]
    states, outs = {}, {}
    for on in (True, False):
        native.use(on)
        m = manager(layers, num_blocks=32, max_seq_len=64)
        handles = [m.allocate(r, 12).handle for r in "abc"]
        m.commit("a", [1, 2])
        calls.update(n=0, armed=True)
        out = m.step_columns(commit=handles, commit_tokens=[[3, 4, 5], [6] * 5, [7] * 8])
        calls["armed"] = False
        outs[on] = ([v.tolist() for v in out.status.values()], [e.index for e in out.errors])
        states[on] = (_prefix_state(m), manager_state(m))
        assert [e.error.code for e in out.errors] == ["internal_error"]
    assert outs[True] == outs[False]
    assert same(states[True], states[False])


def test_publishing_allocates_nothing_that_outlives_it() -> None:
    """No object leaks per commit_run: the interpreter's allocated blocks stay flat over
    600 cycles of allocates with prompts (a LoRA, a salt), two publishing commit steps and
    frees, in three layer groups (a leak of one object per published block would add
    thousands)."""
    import gc
    import sys

    native.use(True)
    m = manager(
        [layer(0), layer(1, sliding_window=9), layer(2, head_dim=8)],
        num_blocks=64,
        max_seq_len=64,
        tokens_per_block=2,
        kv_event_buffer=50,
    )
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 50, 30).tolist() for _ in range(64)]

    def cycle(k: int) -> None:
        hs = []
        for j in range(3):
            extra = [{}, {"lora_id": "L"}, {"cache_salt": "s"}][j]
            p = prompts[(3 * k + j) % 64]
            hs.append(m.allocate(f"r{k}-{j}", 30, token_ids=p, **extra).handle)
        ps = [prompts[(3 * k + j) % 64] for j in range(3)]
        assert m.step_columns(commit=hs, commit_tokens=[p[:13] for p in ps]).ok
        assert m.step_columns(commit=hs, commit_tokens=[p[13:] for p in ps]).ok
        m.step_columns(free=hs)

    for k in range(200):  # the cache and the event log reach their steady size
        cycle(k)
    gc.collect()
    before = sys.getallocatedblocks()
    stored = m.parts.coord.cache.stats.stored_blocks
    for k in range(200, 800):
        cycle(k)
    gc.collect()
    assert m.parts.coord.cache.stats.stored_blocks - stored > 5000
    assert sys.getallocatedblocks() - before < 500

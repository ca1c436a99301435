"""Hostile input: edge integers and refused calls change nothing, in process and over HTTP."""

from __future__ import annotations

from collections.abc import Iterator
from functools import partial

import httpx
import numpy as np
import pytest
from helpers import layer
from servers import serve_in_thread

from kvcm import InvalidArgument, KVCacheManager, MultimodalItem
from kvcm.server.app import create_app

CONFIG = {
    "layers": [layer(0, sliding_window=8), layer(1)],
    "tokens_per_block": 4,
    "max_requests": 4,
    "max_seq_len": 32,
    "num_blocks": 16,
}
HUGE = [2**31, 2**62, 2**63 - 1, 2**63, 2**64 + 5]


def _state(m: KVCacheManager) -> tuple[object, ...]:
    return (
        sorted((r, m.request(r).num_tokens, m.request(r).capacity) for r in m.request_ids()),
        [m.block_table(r) for r in sorted(m.request_ids())],
        m.num_free_blocks(0),
        m.page_tables().clone().numpy().tolist(),
    )


@pytest.mark.parametrize("big", HUGE)
def test_counts_past_the_bound_are_refused_before_any_arithmetic(big: int) -> None:
    m = KVCacheManager(CONFIG)
    m.allocate("a", 2)
    m.allocate("b", 2)
    before = _state(m)
    calls = [
        lambda: m.extend_many(["a", "b"], big),
        lambda: m.extend_many(["a", "b"], 1, big),
        lambda: m.extend_many(["a", "b"], [1, big]),
        lambda: m.extend("a", big),
        lambda: m.extend("a", 1, lookahead=big),
        lambda: m.allocate("c", big),
        lambda: m.allocate("c", 2**62, lookahead=big),
        lambda: m.rewind("a", big),
        lambda: m.step([{"op": "extend", "request_id": "a", "num_new_tokens": big}] * 1),
        lambda: m.slot_mappings(["a"], pad_to=big),
        lambda: m.copy_tokens(["a"], [big], [0]),
    ]
    for call in calls:
        try:
            out = call()
        except (InvalidArgument, OverflowError) as exc:
            assert not isinstance(exc, OverflowError), "untyped error"
        else:  # step reports the error in the op's result
            assert len(out) == 1 and not out[0].ok
        assert _state(m) == before
    assert m.request("a").num_tokens == 2 and m.request("b").num_tokens == 2


@pytest.mark.parametrize("pad_to", [2**31 - 1, 10**9, 4 * 32 + 1])
def test_pad_to_is_bounded_by_what_a_step_can_hold(pad_to: int) -> None:
    """A valid count as pad_to made the manager allocate pad_to int64 per layer group up
    front: 16 GiB per group for 2**31 - 1, a RuntimeError (500 over HTTP) or an OOM kill. It
    is at most max_requests x max_seq_len now, and a refused call leaves the step's edits."""
    m = KVCacheManager(CONFIG)
    m.allocate("a", 5)
    assert m.max_step_tokens == 4 * 32
    with pytest.raises(InvalidArgument) as exc:
        m.slot_mappings(["a"], pad_to=pad_to)
    assert exc.value.detail["pad_to"] == pad_to
    with pytest.raises(InvalidArgument):
        m.slot_mapping(["a"], 1, num_tokens=[5], pad_to=pad_to)
    fresh = KVCacheManager(CONFIG)
    fresh.allocate("a", 5)
    full = m.slot_mappings(["a"], pad_to=m.max_step_tokens)
    assert full.shape == (2, m.max_step_tokens)
    assert full.tolist() == fresh.slot_mappings(["a"], pad_to=m.max_step_tokens).tolist()


def test_over_http_a_huge_pad_to_is_422_not_500(http: httpx.Client) -> None:
    http.post("/v1/allocate", json={"request_id": "a", "num_tokens": 5})
    for path, body in (
        ("/v1/slot_mappings", {"request_ids": ["a"], "pad_to": 2**31 - 1}),
        ("/v1/slot_mapping", {"request_ids": ["a"], "layer_id": 0, "pad_to": 10**9}),
        ("/v1/slot_mapping", {"request_ids": [], "layer_id": 1, "pad_to": 10**9}),
    ):
        r = http.post(path, json=body)
        assert r.status_code == 422 and r.json()["code"] == "invalid_argument", r.text
    r = http.post("/v1/slot_mappings", json={"request_ids": ["a"], "pad_to": 8})
    assert r.status_code == 200 and len(r.json()["rows"][0]) == 8


def test_unsigned_arrays_do_not_wrap_into_negative_counts() -> None:
    m = KVCacheManager(CONFIG)
    m.allocate("a", 2)
    m.allocate("b", 2)
    with pytest.raises(InvalidArgument):
        m.extend_many(["a", "b"], np.array([2**63, 1], dtype=np.uint64))
    m.extend_many(["a", "b"], np.array([3, 1], dtype=np.uint64))
    assert [m.request(r).num_tokens for r in ("a", "b")] == [5, 3]


@pytest.mark.parametrize("lora", [2**63, -(2**63) - 1, 2**100])
def test_lora_ids_past_64_bits_are_a_typed_error(lora: int) -> None:
    m = KVCacheManager(CONFIG)
    with pytest.raises(InvalidArgument):
        m.allocate("a", 4, token_ids=[1, 2, 3, 4], lora_id=lora)
    with pytest.raises(InvalidArgument):
        m.probe([1, 2, 3, 4], lora_id=lora)
    assert m.request_ids() == []
    # The largest that fits is a valid key.
    m.allocate("a", 4, token_ids=[1, 2, 3, 4], lora_id=2**63 - 1)


def test_token_ids_are_checked_even_with_block_keys() -> None:
    from kvcm import block_keys

    m = KVCacheManager(CONFIG)
    keys = block_keys([1] * 12, 4)
    before = _state(m)
    with pytest.raises(InvalidArgument):
        m.allocate("a", 13, token_ids=[-5] * 13, block_keys=keys)
    assert _state(m) == before and m.request_ids() == []
    # A refused commit changes nothing either (its ids are checked before anything moves).
    m.allocate("a", 13, token_ids=[1] * 13, block_keys=keys)
    m.rewind("a", 7)
    m.extend("a", 2)
    committed = m.request("a").num_committed
    with pytest.raises(InvalidArgument):
        m.commit("a", [1, -2])
    assert m.request("a").num_committed == committed
    assert m.committed_tokens("a") == [1] * committed


@pytest.fixture
def http() -> Iterator[httpx.Client]:
    with (
        serve_in_thread(create_app(KVCacheManager(CONFIG))) as url,
        httpx.Client(base_url=url) as client,
    ):
        yield client


def test_over_http_edge_integers_are_422_and_the_tables_stay_readable(
    http: httpx.Client,
) -> None:
    for rid in ("a", "b", "y"):
        assert http.post("/v1/allocate", json={"request_id": rid, "num_tokens": 2}).status_code
    for big in (2**63 - 1, 2**64):
        r = http.post("/v1/extend_many", json={"request_ids": ["a", "b"], "num_new_tokens": big})
        assert r.status_code == 422 and r.json()["code"] == "invalid_argument"
        body = {"request_id": "a", "num_new_tokens": 2**62, "lookahead": big}
        r = http.post("/v1/extend", json=body)
        assert r.status_code == 422 and r.json()["code"] == "invalid_argument"
    r = http.post("/v1/slot_mappings", json={"request_ids": ["a", "b"]})
    assert r.status_code == 200
    for path, body in (
        ("/v1/allocate", {"request_id": "z", "num_tokens": 4, "token_ids": [1] * 4}),
        ("/v1/probe", {"token_ids": [1] * 4}),
    ):
        r = http.post(path, json=body | {"lora_id": 2**63})
        assert r.status_code == 422 and r.json()["code"] == "invalid_argument", r.text
    # A step whose last op is refused: the earlier ops applied, each result says so.
    ops = [
        {"op": "free", "request_id": "y"},
        {"op": "allocate", "request_id": "z", "num_tokens": 2},
        {"op": "allocate", "request_id": "w", "num_tokens": 4, "token_ids": [1] * 4}
        | {"lora_id": 2**63},
    ]
    r = http.post("/v1/step", json={"ops": ops})
    assert r.status_code == 200
    assert [res["ok"] for res in r.json()["results"]] == [True, True, False]
    assert sorted(http.get("/v1/requests").json()["request_ids"]) == ["a", "b", "z"]


def _published(m: KVCacheManager, rid: str, prompt: list[int], **extras: object) -> list[str]:
    """Allocate and commit ``prompt`` under ``extras``; the block keys its events show."""
    after = m.last_event_seq
    m.allocate(rid, len(prompt), token_ids=prompt, **extras)  # type: ignore[arg-type]
    m.commit(rid, prompt)
    return [k for e in m.events(after).events for k in e.block_keys]


@pytest.mark.parametrize(
    "victim,attacker",
    [
        ({"cache_salt": "tenant-a"}, {}),
        ({"cache_salt": "tenant-a"}, {"cache_salt": "tenant-b"}),
        ({"lora_id": 7}, {"lora_id": 8}),
        ({"lora_id": 7, "cache_salt": "s"}, {"lora_id": 7}),
        ({}, {"cache_salt": "x"}),
    ],
    ids=str,
)
def test_block_keys_from_another_scope_never_hit(
    victim: dict[str, object], attacker: dict[str, object]
) -> None:
    from kvcm import block_keys

    m = KVCacheManager(CONFIG | {"layers": [layer(0), layer(1)]})
    prompt = [11, 12, 13, 14, 15, 16, 17, 18, 19]
    seen = _published(m, "victim", prompt, **victim)
    keys = [bytes.fromhex(k) for k in seen[:2]]
    assert keys == block_keys(prompt, 4, **victim)[:2]  # type: ignore[arg-type]
    junk = [0] * 9
    assert m.probe(junk, block_keys=keys, **attacker) == 0  # type: ignore[arg-type]
    info = m.allocate("attacker", 9, token_ids=junk, block_keys=keys, **attacker)  # type: ignore[arg-type]
    assert info.num_hit_tokens == 0
    assert not set(m.block_table("attacker")[0]) & set(m.block_table("victim")[0])
    # The same scope with the same keys hits (keys within a scope are trusted).
    assert m.probe(prompt, **victim) == 8  # type: ignore[arg-type]


def test_salted_prompts_do_not_leave_in_events() -> None:
    m = KVCacheManager(CONFIG | {"layers": [layer(0), layer(1)]})
    _published(m, "open", [1, 2, 3, 4, 5])
    _published(m, "salted", [6, 7, 8, 9, 10], cache_salt="secret")
    stored = [e for e in m.events().events if e.kind == "block_stored"]
    assert [e.token_ids for e in stored] == [[1, 2, 3, 4], None]
    assert [e.has_salt for e in stored] == [False, True]


def test_routes_that_reveal_prompts_need_the_token_when_one_is_set() -> None:
    app = create_app(KVCacheManager(CONFIG), api_token="tok")
    with serve_in_thread(app) as url, httpx.Client(base_url=url) as http:
        auth = {"Authorization": "Bearer tok"}
        body = {"request_id": "a", "num_tokens": 4, "token_ids": [1, 2, 3, 4]}
        assert http.post("/v1/allocate", json=body, headers=auth).status_code == 200
        for path in ("/v1/committed_tokens?request_id=a", "/v1/events"):
            assert http.get(path).status_code == 401
            assert http.get(path, headers=auth).status_code == 200
        # Layout and estimates reveal no prompt: open to probes and dashboards.
        assert http.get("/v1/layout").status_code == 200


def test_events_long_poll_refuses_non_finite_timeouts(http: httpx.Client) -> None:
    for bad in ("nan", "inf", "-inf"):
        r = http.get(f"/v1/events?timeout_s={bad}")
        assert r.status_code == 422 and r.json()["code"] == "invalid_argument"
    assert http.get("/v1/events?timeout_s=0.01").status_code == 200


def test_a_bug_inside_a_step_reports_exactly_what_was_applied(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An untyped exception in one op (a bug) is that op's ``internal_error``; the ops before
    it stay applied and say so, the ops after it are not run; the lease table follows."""
    from kvcm.server.state import ServiceState

    m = KVCacheManager(CONFIG)
    state = ServiceState(m, lease_ttl_s=30.0)
    session = state.open_session(None).session_id
    for rid in ("y", "x"):
        state.step_json(
            b'{"ops": [{"op": "allocate", "request_id": "%s", "num_tokens": 2}]}' % rid.encode(),
            session,
        )
    from kvcm import allocation

    real = allocation.start_op

    def broken(
        m: KVCacheManager, op: dict[str, object], fast: object, keyed: object = None
    ) -> object:
        if op["request_id"] == "boom":
            raise ZeroDivisionError("a bug")
        return real(m, op, fast, keyed)  # type: ignore[arg-type]

    monkeypatch.setattr(allocation, "start_op", broken)  # what a step's allocates call
    body = {
        "ops": [
            {"op": "free", "request_id": "y"},
            {"op": "allocate", "request_id": "z", "num_tokens": 2},
            {"op": "allocate", "request_id": "boom", "num_tokens": 2},
            {"op": "free", "request_id": "x"},
        ]
    }
    import orjson

    results = orjson.loads(state.step_json(orjson.dumps(body), session))["results"]
    assert [r["ok"] for r in results] == [True, True, False, False]
    assert [r["error"]["code"] for r in results[2:]] == ["internal_error", "step_aborted"]
    assert sorted(m.request_ids()) == ["x", "z"]
    assert state.leases.close(session) == ["x", "z"]


def test_consumer_pids_past_32_bits_are_refused_and_listing_stays_up(http: httpx.Client) -> None:
    for pid in (2**63, 2**31, 0, -1):
        r = http.post("/v1/consumers", json={"pid": pid, "generation": "g"})
        assert r.status_code == 422 and r.json()["code"] == "invalid_argument"
    assert http.get("/v1/consumers").status_code == 200
    r = http.delete("/v1/consumers/nope")
    assert r.status_code == 404 and r.json()["code"] == "unknown_consumer"


def test_sessions_consumers_and_request_ids_are_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    from kvcm.manager import MAX_REQUEST_ID
    from kvcm.server.leases import Leases
    from kvcm.server.state import ServiceState
    from kvcm_client.errors import LimitReached
    from kvcm_client.models import ConsumerRequest

    monkeypatch.setattr(Leases, "MAX_SESSIONS", 3)
    monkeypatch.setattr(ServiceState, "MAX_CONSUMERS", 2)
    m = KVCacheManager(CONFIG | {"share": True})
    try:
        state = ServiceState(m, lease_ttl_s=30.0)
        for _ in range(3):
            state.open_session(None)
        with pytest.raises(LimitReached) as exc:
            state.open_session(None)
        assert exc.value.status == 429
        import os

        for _ in range(2):
            state.register_consumer(ConsumerRequest(pid=os.getpid(), generation=m.generation))
        with pytest.raises(LimitReached):
            state.register_consumer(ConsumerRequest(pid=os.getpid(), generation=m.generation))
    finally:
        m.close()
    m = KVCacheManager(CONFIG)
    m.allocate("x" * MAX_REQUEST_ID, 1)
    with pytest.raises(InvalidArgument) as exc2:
        m.allocate("x" * (MAX_REQUEST_ID + 1), 1)
    assert len(exc2.value.message) < 200
    long_id = "y" * 1_000_000
    from kvcm import UnknownRequest

    with pytest.raises(UnknownRequest) as exc3:
        m.extend(long_id, 1)
    assert len(exc3.value.message) < 200 and len(exc3.value.detail["request_id"]) <= 64


def test_client_session_misuse_and_long_polls_past_the_client_timeout() -> None:
    from kvcm_client import KVCacheClient
    from kvcm_client.errors import UnknownSession

    with (
        serve_in_thread(create_app(KVCacheManager(CONFIG))) as url,
        KVCacheClient(url, timeout=0.5, retries=0) as kv,
    ):
        with pytest.raises(UnknownSession):
            kv.renew_session()
        with pytest.raises(UnknownSession):
            kv.close_session()
        import time

        start = time.monotonic()
        batch = kv.events(timeout_s=1.0)  # longer than the client's 0.5 s read timeout
        assert batch.events == [] and 0.9 < time.monotonic() - start < 5


def test_sessions_and_consumers_check_the_token_first_and_limit_chunked_bodies() -> None:
    app = create_app(KVCacheManager(CONFIG), api_token="tok", max_body_bytes=1024)
    auth = {"Authorization": "Bearer tok"}

    def chunks() -> Iterator[bytes]:
        yield b'{"ttl_s": 1' + b" " * 4000
        yield b"}"

    with serve_in_thread(app) as url, httpx.Client(base_url=url) as http:
        for path in ("/v1/sessions", "/v1/consumers"):
            # No token: 401 whatever the body, before it is parsed.
            assert http.post(path, content=b"{junk").status_code == 401
            r = http.post(path, content=chunks(), headers=auth)  # chunked, no Content-Length
            assert r.status_code == 413 and r.json()["code"] == "payload_too_large", r.text
        r = http.post("/v1/sessions", json={"ttl_s": True}, headers=auth)
        assert r.status_code == 422 and r.json()["code"] == "invalid_argument"
        assert http.post("/v1/sessions", headers=auth).status_code == 200  # no body: defaults
        r = http.post("/v1/sessions", json={"ttl_s": 2}, headers=auth)
        assert r.status_code == 200 and r.json()["ttl_s"] == 2.0


def test_one_call_s_work_is_bounded_before_it_starts(monkeypatch: pytest.MonkeyPatch) -> None:
    """Prompts past max_seq_len are refused before hashing; steps past MAX_STEP_OPS before
    any op runs."""
    import kvcm.manager as manager_module
    import kvcm.prefix_reuse as prefix_reuse_module
    from kvcm import SequenceTooLong
    from kvcm.manager import MAX_STEP_OPS

    m = KVCacheManager(CONFIG)
    hashed: list[int] = []
    real = prefix_reuse_module.chain_keys
    monkeypatch.setattr(
        prefix_reuse_module, "chain_keys", lambda *a, **k: hashed.append(1) or real(*a, **k)
    )
    with pytest.raises(SequenceTooLong):
        m.probe([1] * 1_000_000)
    with pytest.raises(InvalidArgument):
        m.allocate("a", 4, token_ids=[1] * 1_000_000)
    assert hashed == [] and m.request_ids() == []
    ops = [{"op": "allocate", "request_id": f"r{i}", "num_tokens": 1} for i in range(3)]
    monkeypatch.setattr(manager_module, "MAX_STEP_OTHER_OPS", 2)
    with pytest.raises(InvalidArgument) as exc:
        m.step(ops)
    assert exc.value.detail["max_other_ops"] == 2 and m.request_ids() == []
    assert all(r.ok for r in m.step(ops[:2]))
    # Extends count against the larger bound only.
    extends = [{"op": "extend", "request_id": "r0", "num_new_tokens": 1}] * 3
    monkeypatch.setattr(manager_module, "MAX_STEP_OPS", 2)
    with pytest.raises(InvalidArgument) as exc:
        m.step(extends)
    assert exc.value.detail["max_ops"] == 2 and m.request("r0").num_tokens == 1
    monkeypatch.setattr(manager_module, "MAX_STEP_OPS", MAX_STEP_OPS)
    assert all(r.ok for r in m.step(extends)) and m.request("r0").num_tokens == 4


def test_large_bodies_are_parsed_off_the_event_loop(monkeypatch: pytest.MonkeyPatch) -> None:
    """A body past OFFLOAD_BYTES is parsed in a worker thread, the op still runs on the loop."""
    import threading

    import kvcm.server.app as app_module
    from kvcm.server.state import ServiceState

    seen: list[str] = []
    real = ServiceState.parse_step

    def spy(raw: bytes) -> object:
        seen.append(threading.current_thread().name)
        return real(raw)

    monkeypatch.setattr(ServiceState, "parse_step", staticmethod(spy))
    monkeypatch.setattr(app_module, "OFFLOAD_BYTES", 100)
    with (
        serve_in_thread(create_app(KVCacheManager(CONFIG))) as url,
        httpx.Client(base_url=url) as http,
    ):
        small = {"ops": [{"op": "allocate", "request_id": "a", "num_tokens": 1}]}
        big = {"ops": [{"op": "allocate", "request_id": "b" * 80, "num_tokens": 1}]}
        for body in (small, big):
            r = http.post("/v1/step", json=body)
            assert r.status_code == 200 and r.json()["results"][0]["ok"]
    loop_thread, worker = seen
    assert loop_thread != worker  # the big one went to a worker thread


# -- found by tests/test_property_manager.py ---------------------------------------------------


def test_request_id_lists_must_be_collections_of_ids() -> None:
    """None or an int used to raise TypeError; a bare str was read as one id per character
    (``extend_many("ab")`` extended requests "a" and "b")."""
    m = KVCacheManager(CONFIG)
    m.allocate("a", 2)
    m.allocate("b", 2)
    before = _state(m)
    for ids in (None, 5, "a", "ab", b"ab"):
        for call in (
            partial(m.extend_many, ids, 1),
            partial(m.copy_tokens, ids, [0], [1]),
            partial(m.slot_mappings, ids),
            partial(m.page_indices, ids, 0),
        ):
            with pytest.raises(InvalidArgument):
                call()
            assert _state(m) == before
    m.extend_many(("a", "b"), 1)  # any collection of ids is fine
    assert [m.request(r).num_tokens for r in ("a", "b")] == [3, 3]


def test_a_bool_in_a_list_of_counts_is_refused_like_a_bool_count() -> None:
    """numpy reads [True, 2] as ints: it used to extend by 1 where extend_many(ids, True) is
    refused."""
    m = KVCacheManager(CONFIG)
    m.allocate("a", 2, lookahead=2)
    m.allocate("b", 2)
    before = _state(m)
    for call in (
        lambda: m.extend_many(["a", "b"], [True, 2]),
        lambda: m.extend_many(["a", "b"], 1, (0, False)),
        lambda: m.copy_tokens(["a", "a"], [True, 0], [0, 1]),
        lambda: m.slot_mappings(["a", "b"], num_tokens=[1, True]),
    ):
        with pytest.raises(InvalidArgument):
            call()
        assert _state(m) == before


@pytest.mark.parametrize(
    "items",
    [
        5,
        "img",
        [{"digest": "img", "start": -1, "length": 2}],
        [{"digest": "img", "start": 0, "length": 0}],
        [MultimodalItem("img", -3, 2)],
    ],
    ids=str,
)
def test_multimodal_items_are_checked_when_a_request_gets_them(items: object) -> None:
    """A request keeps its items for its later commits. An item refused only when blocks are
    hashed was accepted by an allocate that hashes nothing (no token ids, or given block keys),
    and then every commit that filled a block failed; a non-list raised TypeError."""
    from kvcm import block_keys

    m = KVCacheManager(CONFIG)
    prompt = [1, 2, 3, 4, 5]
    calls = [
        lambda: m.allocate("a", 5, multimodal=items),  # type: ignore[arg-type]
        lambda: m.allocate(
            "a",
            5,
            token_ids=prompt,
            block_keys=block_keys(prompt, 4),
            multimodal=items,  # type: ignore[arg-type]
        ),
        lambda: m.probe(prompt, multimodal=items),  # type: ignore[arg-type]
        lambda: block_keys(prompt, 4, multimodal=items),  # type: ignore[arg-type]
    ]
    for call in calls:
        with pytest.raises(InvalidArgument):
            call()
    assert m.request_ids() == []


def test_block_keys_and_a_probed_prompt_must_be_sequences() -> None:
    """``block_keys=5`` raised TypeError in allocate and probe, and so did a probe whose
    prompt, given its keys, was not a sequence (only its length is read)."""
    m = KVCacheManager(CONFIG)
    before = _state(m)
    for call in (
        lambda: m.allocate("a", 4, token_ids=[1, 2, 3, 4], block_keys=5),  # type: ignore[arg-type]
        lambda: m.probe([1, 2, 3, 4], block_keys=5),  # type: ignore[arg-type]
        lambda: m.probe(None, block_keys=[]),  # type: ignore[arg-type]
        lambda: m.probe(5, block_keys=[]),  # type: ignore[arg-type]
        lambda: m.probe("abcd", block_keys=[b"\0" * 32]),
    ):
        with pytest.raises(InvalidArgument):
            call()
        assert _state(m) == before


def test_a_one_prompt_body_with_too_many_items_is_refused_before_parsing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from kvcm_client.models import ProbeRequest

    parsed: list[int] = []
    real = ProbeRequest.model_validate_json
    monkeypatch.setattr(
        ProbeRequest,
        "model_validate_json",
        classmethod(lambda cls, data: parsed.append(1) or real(data)),
    )
    with (
        serve_in_thread(create_app(KVCacheManager(CONFIG))) as url,
        httpx.Client(base_url=url) as http,
    ):
        # max_seq_len 32: a prompt and its keys have far fewer than 2 x 32 + 4096 commas.
        junk = b'{"token_ids": [' + b"1," * 5000 + b"1]}"
        for path in ("/v1/probe", "/v1/allocate"):
            r = http.post(path, content=junk, headers={"content-type": "application/json"})
            assert r.status_code == 413 and r.json()["code"] == "sequence_too_long"
        assert parsed == []
        r = http.post("/v1/probe", json={"token_ids": [1] * 20})
        assert r.status_code == 200 and parsed == [1]

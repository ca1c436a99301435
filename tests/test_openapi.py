"""The OpenAPI document tells the truth, and /docs works without the internet.

The document is walked route by route (every status each route can answer, every error body the
``Error`` schema, no FastAPI ``HTTPValidationError``), and a live server is driven into every
error it documents: each error it answers is listed for its route, with its code, and every
code the document lists was seen (all but ``internal_error``, which only a bug produces, and
which one sample provokes with a broken manager method instead).

The limits the service enforces are in the document (a walk of every request body and query),
with the service's own constants, and the manager enforces exactly those; a seeded
positive-only schemathesis run (``KVCM_OPENAPI_CASES``, default 200) checks that no request
the document calls valid gets a 422 the schema could have prevented.
"""

from __future__ import annotations

import json
import os
import random
import re
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest
from helpers import layer
from hypothesis import strategies as st
from servers import serve_in_thread

from kvcm import KVCacheManager
from kvcm.server.app import create_app
from kvcm.server.leases import Leases
from kvcm.server.openapi import ERROR_SCHEMA, ROUTES, documented_statuses
from kvcm.server.state import ServiceState
from kvcm_client.errors import ERRORS_BY_CODE

CONFIG = {
    "layers": [layer(0, sliding_window=8), layer(1)],
    "tokens_per_block": 4,
    "max_requests": 4,
    "max_seq_len": 64,
    "num_blocks": 24,
}
TOKEN = "tok"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
LIMIT = 4096
ERROR_REF = f"#/components/schemas/{ERROR_SCHEMA}"


@pytest.fixture(scope="module")
def doc() -> dict[str, Any]:
    return create_app(KVCacheManager(CONFIG)).openapi()


def _operations(doc: dict[str, Any]) -> Iterator[tuple[str, str, dict[str, Any]]]:
    for path, item in doc["paths"].items():
        for method, op in item.items():
            yield method.upper(), path, op


def test_every_route_is_in_the_table_and_lists_its_statuses(doc: dict[str, Any]) -> None:
    ops = {(m, p): op for m, p, op in _operations(doc)}
    assert set(ops) == set(ROUTES)
    for key, op in ops.items():
        statuses = {int(s) for s in op["responses"]}
        assert 500 in statuses, key
        assert any(200 <= s < 300 for s in statuses), key
        want = {cls.status for cls in ROUTES[key].error_classes()}
        assert want <= statuses, key
        if "requestBody" in op:  # the raw-body routes too
            assert {400, 413, 422} <= statuses, key
        if any(p["in"] == "query" for p in op.get("parameters", [])):
            assert 422 in statuses, key
        if op.get("security"):
            assert 401 in statuses, key
        if any(p["name"] == "X-KVCM-Session" for p in op.get("parameters", [])):
            assert "unknown_session" in documented_statuses(doc, *key)[404], key
    # Spot checks against what the routes do (tests/test_service.py provokes these).
    assert set(documented_statuses(doc, "POST", "/v1/allocate")) == {
        200,
        400,
        401,
        404,
        409,
        413,
        422,
        500,
        503,
        507,
    }
    assert documented_statuses(doc, "POST", "/v1/allocate")[507] == {
        "out_of_blocks",
        "max_requests_reached",
    }
    assert documented_statuses(doc, "POST", "/v1/sessions")[429] == {"limit_reached"}
    assert documented_statuses(doc, "POST", "/v1/consumers")[429] == {"limit_reached"}
    assert documented_statuses(doc, "GET", "/v1/events")[401] == {"unauthorized"}
    assert 401 not in documented_statuses(doc, "GET", "/v1/layout")
    for path in ("/v1/step", "/v1/allocate", "/v1/extend_many", "/v1/probe", "/v1/sessions"):
        body = doc["paths"][path]["post"]["requestBody"]
        assert body["required"] is (path != "/v1/sessions"), path
        assert body["content"]["application/json"]["schema"]["$ref"], path


def test_every_error_response_is_the_error_schema_and_no_validation_error_remains(
    doc: dict[str, Any],
) -> None:
    assert "HTTPValidationError" not in json.dumps(doc)
    assert "ValidationError" not in doc["components"]["schemas"]
    error = doc["components"]["schemas"][ERROR_SCHEMA]
    assert set(error["required"]) == {"code", "message", "detail"}
    for method, path, op in _operations(doc):
        for status, response in op["responses"].items():
            if int(status) < 400:
                continue
            schema = response["content"]["application/json"]["schema"]
            if (method, path, status) == ("GET", "/readyz", "503"):
                assert schema == {"$ref": "#/components/schemas/Health"}
                continue
            assert schema["allOf"] == [{"$ref": ERROR_REF}], (method, path, status)
            codes = schema["properties"]["code"]["enum"]
            assert codes, (method, path, status)
            for code in codes:  # a real error class, of that very status
                assert ERRORS_BY_CODE[code].status == int(status), (path, code)
                assert f"`{code}`" in response["description"]
    for sub in re.findall(r'"#/components/schemas/([^"]+)"', json.dumps(doc)):
        assert sub in doc["components"]["schemas"], sub


def test_the_bearer_requirement_is_optional_without_a_token_and_a_must_with_one() -> None:
    open_doc = create_app(KVCacheManager(CONFIG)).openapi()
    closed_doc = create_app(KVCacheManager(CONFIG), api_token=TOKEN).openapi()
    assert open_doc["paths"]["/v1/allocate"]["post"]["security"] == [{"bearer": []}, {}]
    assert closed_doc["paths"]["/v1/allocate"]["post"]["security"] == [{"bearer": []}]
    assert "security" not in closed_doc["paths"]["/v1/probe"]["post"]
    assert closed_doc["components"]["securitySchemes"]["bearer"]["scheme"] == "bearer"


def test_a_route_missing_from_the_table_fails_the_document(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from kvcm.server import openapi

    table = dict(ROUTES)
    del table["GET", "/v1/stats"]
    monkeypatch.setattr(openapi, "ROUTES", table)
    with pytest.raises(RuntimeError, match="GET /v1/stats has no entry"):
        create_app(KVCacheManager(CONFIG))


def test_docs_page_is_self_contained_and_reads_the_document() -> None:
    app = create_app(KVCacheManager(CONFIG))
    with serve_in_thread(app) as url, httpx.Client(base_url=url) as http:
        page = http.get("/docs")
        assert page.status_code == 200
        assert page.headers["content-type"].startswith("text/html")
        html = page.text
        assert not re.search(r"(?i)(https?:)?//[a-z0-9.-]+\.[a-z]", html), "an off-host URL"
        assert not re.search(r"(?i)<(script|link|img|iframe)[^>]*\b(src|href)=", html)
        assert '"/openapi.json"' in html and "fetch(OPENAPI_URL)" in html
        assert http.get("/openapi.json").status_code == 200
        assert http.get("/redoc").status_code == 404  # FastAPI's, which loads from a CDN
        assert "/docs" not in http.get("/openapi.json").json()["paths"]


# -- live samples ---------------------------------------------------------------------------------

Sample = tuple[str, str, httpx.Response]


class Recorder:
    """Calls a live server and keeps (method, route, response) of every call."""

    def __init__(self, http: httpx.Client) -> None:
        self.http = http
        self.samples: list[Sample] = []

    def __call__(
        self,
        method: str,
        route: str,
        want: str | None = None,
        *,
        path: str | None = None,
        auth: bool = True,
        **kw: Any,
    ) -> httpx.Response:
        headers = {**(AUTH if auth else {}), **kw.pop("headers", {})}
        resp = self.http.request(method, path or route, headers=headers, **kw)
        self.samples.append((method, route, resp))
        if want is not None:
            got = resp.json().get("code") if resp.status_code >= 400 else resp.status_code
            assert got == want, (method, path or route, resp.status_code, resp.text)
        return resp


#: A body each body route accepts (so that only the point of a sample fails).
VALID = {
    "/v1/allocate": {"request_id": "v", "num_tokens": 1},
    "/v1/extend": {"request_id": "v", "num_new_tokens": 1},
    "/v1/extend_many": {"request_ids": ["v"]},
    "/v1/rewind": {"request_id": "v", "num_tokens": 1},
    "/v1/commit": {"request_id": "v", "token_ids": [1]},
    "/v1/commit_many": {"request_ids": ["v"], "token_ids": [[1]]},
    "/v1/free": {"request_id": "v"},
    "/v1/step": {"ops": []},
    "/v1/page_indices": {"request_ids": [], "layer_id": 0},
    "/v1/ragged_page_indices": {"request_ids": [], "layer_id": 0},
    "/v1/slot_mapping": {"request_ids": [], "layer_id": 0},
    "/v1/slot_mappings": {"request_ids": []},
    "/v1/probe": {"token_ids": [1]},
    "/v1/probe_tiers": {"token_ids": [1]},
    "/v1/suspend": {"request_id": "v"},
    "/v1/resume": {"request_id": "v"},
    "/v1/step_columns": {},
    "/v1/reset_prefix_cache": {},
    "/v1/consumers": {"pid": 1, "generation": "g"},
    "/v1/sessions": {"ttl_s": 1},
    "/v1/model": {"layers": [layer(0)], "tokens_per_block": 4, "max_seq_len": 64, "num_blocks": 8},
    "/v1/transfer/hand_off": {"request_id": "v"},
    "/v1/transfer/export": {"request_id": "v", "scope": "s"},
    "/v1/transfer/pull": {"request_id": "v", "peer": "a", "peer_request_id": "v"},
    "/v1/transfer/prefix": {"token_ids": [1]},
    "/v1/transfer/fetch": {"request_id": "v", "peer": "a", "num_tokens": 2, "token_ids": [1, 2]},
    "/v1/transfer/status": {"request_ids": ["v"]},
}
#: Values for the routes' path and query parameters.
PATH_IDS = {"consumer_id": "nope", "session_id": "nope"}
QUERY = {"request_id": "nope"}


def _generic(call: Recorder) -> None:
    """Errors every route of a kind answers: auth, bodies, queries, sessions, path ids."""
    for (method, route), entry in ROUTES.items():
        path = route.format(**PATH_IDS)
        params = QUERY if route.endswith(("/request", "/block_table", "/committed_tokens")) else {}
        if entry.auth:
            call(method, route, "unauthorized", path=path, auth=False, params=params)
        if entry.body:
            call(method, route, "malformed_request", content=b"{")
            call(method, route, "payload_too_large", content=b" " * (LIMIT + 1))
            call(method, route, "invalid_argument", json=[])
        if entry.session:
            call(
                method,
                route,
                "unknown_session",
                json=VALID[route],
                headers={"X-KVCM-Session": "nope"},
            )
        if "{" in route:
            call(method, route, "not_found", path=route.format(**dict.fromkeys(PATH_IDS, "a%2Fb")))
    for route in ("/v1/request", "/v1/block_table", "/v1/committed_tokens", "/v1/estimate"):
        call("GET", route, "invalid_argument")  # the required parameter is missing
    call("GET", "/v1/events", "invalid_argument", params={"timeout_s": "nan"})
    call("GET", "/v1/events", "invalid_argument", params={"after": "x"})


def _specific(call: Recorder, generation: str) -> None:
    """Each route's own errors, in an order that builds the state each needs."""
    nope = {"request_id": "nope"}
    for route, body in VALID.items():
        if route == "/v1/allocate" or route.startswith("/v1/transfer/"):  # _transfers
            continue
        if "request_id" in body:
            call("POST", route, "unknown_request", json=body | nope)
        elif "request_ids" in body:
            call("POST", route, "unknown_request", json=body | {"request_ids": ["nope"]})
    for route in ("/v1/request", "/v1/block_table", "/v1/committed_tokens"):
        call("GET", route, "unknown_request", params=nope)
    call("POST", "/v1/page_indices", "unknown_layer", json={"request_ids": [], "layer_id": 9})
    call(
        "POST",
        "/v1/ragged_page_indices",
        "unknown_layer",
        json={"request_ids": [], "layer_id": 9},
    )
    call("POST", "/v1/probe", "sequence_too_long", json={"token_ids": [1] * 1000})
    call("POST", "/v1/slot_mapping", "unknown_layer", json={"request_ids": [], "layer_id": 9})
    call("GET", "/v1/estimate", "invalid_argument", params={"seq_len": 0})

    alloc = "/v1/allocate"
    call("POST", alloc, 200, json={"request_id": "a", "num_tokens": 5})
    call("POST", alloc, "duplicate_request", json={"request_id": "a", "num_tokens": 6})
    call("POST", alloc, "sequence_too_long", json={"request_id": "b", "num_tokens": 65})
    call("POST", "/v1/extend", "sequence_too_long", json={"request_id": "a", "num_new_tokens": 60})
    call(
        "POST",
        "/v1/extend_many",
        "sequence_too_long",
        json={"request_ids": ["a"], "num_new_tokens": 60},
    )
    call("POST", "/v1/reset_prefix_cache", "prefix_cache_in_use", json={})

    # Sliding window of 8 tokens (2 blocks of 4): a step to 16 tokens releases block 0.
    call("POST", alloc, 200, json={"request_id": "w", "num_tokens": 12})
    call("POST", "/v1/extend", 200, json={"request_id": "w", "num_new_tokens": 4})
    call("POST", "/v1/rewind", "rewind_past_window", json={"request_id": "w", "num_tokens": 10})
    # Two requests share the cached blocks of one prompt; rewinding into them is refused.
    prompt = list(range(1, 10))
    call("POST", alloc, 200, json={"request_id": "p1", "num_tokens": 9, "token_ids": prompt})
    call("POST", "/v1/commit", 200, json={"request_id": "p1", "token_ids": prompt})
    r = call("POST", alloc, 200, json={"request_id": "p2", "num_tokens": 9, "token_ids": prompt})
    assert r.json()["num_hit_tokens"] == 8
    call(
        "POST", "/v1/rewind", "rewind_into_shared_block", json={"request_id": "p2", "num_tokens": 4}
    )
    call("POST", alloc, "max_requests_reached", json={"request_id": "x", "num_tokens": 1})
    call("POST", "/v1/free", 204, json={"request_id": "w"})
    call("POST", alloc, "out_of_blocks", json={"request_id": "big", "num_tokens": 64})
    call("POST", "/v1/extend", "out_of_blocks", json={"request_id": "a", "num_new_tokens": 59})
    call(
        "POST",
        "/v1/extend_many",
        "out_of_blocks",
        json={"request_ids": ["a"], "num_new_tokens": 59},
    )

    model = VALID["/v1/model"]
    call("GET", "/v1/model", 200)
    call("POST", "/v1/model", "requests_live", json=model)  # requests a, p1, p2 live
    call("POST", "/v1/model", "insufficient_memory", json=model | {"num_blocks": 2**31 - 1})
    hf = {"num_hidden_layers": 1, "num_attention_heads": 1, "head_dim": 8}
    call("POST", "/v1/model", "unsupported_model", json={"hf_config": hf | {"layer_types": ["x"]}})

    call("POST", "/v1/consumers", "stale_generation", json={"pid": 1, "generation": "old"})
    assert generation != "old"
    call("DELETE", "/v1/consumers/{consumer_id}", "unknown_consumer", path="/v1/consumers/nope")
    for method, route in (
        ("GET", "/v1/sessions/{session_id}"),
        ("POST", "/v1/sessions/{session_id}/renew"),
        ("DELETE", "/v1/sessions/{session_id}"),
    ):
        call(method, route, "unknown_session", path=route.format(session_id="nope"))


def _host_tier(call: Recorder) -> None:
    """Suspend and resume, and what a suspended request answers (a manager of 8 device
    slots and 2 host slots; both layer groups share one pool group)."""
    call("POST", "/v1/allocate", 200, json={"request_id": "s", "num_tokens": 1})
    call("POST", "/v1/suspend", 200, json={"request_id": "s"})
    s = {"request_id": "s"}
    ids = {"request_ids": ["s"]}
    for method, route, body in (
        ("POST", "/v1/extend", s | {"num_new_tokens": 1}),
        ("POST", "/v1/extend_many", ids),
        ("POST", "/v1/rewind", s | {"num_tokens": 1}),
        ("POST", "/v1/commit", s | {"token_ids": [1]}),
        ("POST", "/v1/commit_many", ids | {"token_ids": [[1]]}),
        ("POST", "/v1/suspend", s),
        ("POST", "/v1/page_indices", ids | {"layer_id": 0}),
        ("POST", "/v1/ragged_page_indices", ids | {"layer_id": 0}),
        ("POST", "/v1/slot_mapping", ids | {"layer_id": 0}),
        ("POST", "/v1/slot_mappings", ids),
    ):
        call(method, route, "request_suspended", json=body)
    call("GET", "/v1/block_table", "request_suspended", params=s)
    call("POST", "/v1/allocate", 200, json={"request_id": "t", "num_tokens": 5})  # 4 blocks
    call("POST", "/v1/suspend", "out_of_blocks", json={"request_id": "t"})  # the host: 2
    call("POST", "/v1/resume", "invalid_argument", json={"request_id": "t"})  # not suspended
    call("POST", "/v1/allocate", 200, json={"request_id": "u", "num_tokens": 8})  # device full
    call("POST", "/v1/resume", "out_of_blocks", json=s)
    call("POST", "/v1/probe_tiers", "sequence_too_long", json={"token_ids": [1] * 100})
    call("POST", "/v1/free", 204, json={"request_id": "u"})
    call("POST", "/v1/resume", 200, json=s)


def _state_layers(call: Recorder) -> None:
    """A hybrid model: a rewind below the committed tokens where the state has no checkpoint."""
    call("POST", "/v1/allocate", 200, json={"request_id": "h", "num_tokens": 6})
    call("POST", "/v1/commit", 200, json={"request_id": "h", "token_ids": [1, 2, 3, 4, 5, 6]})
    call("POST", "/v1/rewind", "state_not_rewindable", json={"request_id": "h", "num_tokens": 1})


def _no_transfer(call: Recorder) -> None:
    """A sidecar started without --transfer: every transfer route says so."""
    call("GET", "/v1/transfer/agent", "transfer_unavailable")
    for route, body in VALID.items():
        if route.startswith("/v1/transfer/"):
            call("POST", route, "transfer_unavailable", json=body)


def _transfers(a: Recorder, b: Recorder, o: Recorder) -> None:
    """Hand-offs, pulls and fetches between live sidecars: ``a`` (a host tier, max_seq_len
    128), ``b`` (8 slots, pulls from a, from o of another block size, from a gone peer), and
    ``o``."""
    # a: a handed-off request refuses every op that needs its blocks.
    a("POST", "/v1/allocate", 200, json={"request_id": "h", "num_tokens": 4})
    a("POST", "/v1/commit", 200, json={"request_id": "h", "token_ids": [1, 2, 3, 4]})
    a("POST", "/v1/transfer/hand_off", 200, json={"request_id": "h"})
    h = {"request_id": "h"}
    ids = {"request_ids": ["h"]}
    for method, route, body in (
        ("POST", "/v1/extend", h | {"num_new_tokens": 1}),
        ("POST", "/v1/extend_many", ids),
        ("POST", "/v1/rewind", h | {"num_tokens": 1}),
        ("POST", "/v1/commit", h | {"token_ids": [1]}),
        ("POST", "/v1/commit_many", ids | {"token_ids": [[1]]}),
        ("POST", "/v1/suspend", h),
        ("POST", "/v1/page_indices", ids | {"layer_id": 0}),
        ("POST", "/v1/ragged_page_indices", ids | {"layer_id": 0}),
        ("POST", "/v1/slot_mapping", ids | {"layer_id": 0}),
        ("POST", "/v1/slot_mappings", ids),
        ("POST", "/v1/transfer/hand_off", h),
    ):
        a(method, route, "kv_in_flight", json=body)
    a("GET", "/v1/block_table", "kv_in_flight", params=h)
    a("POST", "/v1/transfer/hand_off", "unknown_request", json={"request_id": "nope"})
    a("POST", "/v1/allocate", 200, json={"request_id": "s", "num_tokens": 1})
    a("POST", "/v1/suspend", 200, json={"request_id": "s"})
    a("POST", "/v1/transfer/hand_off", "request_suspended", json={"request_id": "s"})
    a("POST", "/v1/transfer/export", "unknown_request", json={"request_id": "nope", "scope": "x"})
    a("POST", "/v1/transfer/export", "scope_mismatch", json={"request_id": "h", "scope": "x"})
    a("POST", "/v1/transfer/prefix", "sequence_too_long", json={"token_ids": [1] * 200})
    a("POST", "/v1/transfer/status", 200, json={"request_ids": ["h"]})
    a("GET", "/v1/transfer/agent", 200)

    # b pulls.
    pull = {"request_id": "p", "peer": "a", "peer_request_id": "h"}
    b("POST", "/v1/transfer/pull", "unknown_peer", json=pull | {"peer": "elsewhere"})
    b("POST", "/v1/transfer/pull", "peer_unreachable", json=pull | {"peer": "gone"})
    b("POST", "/v1/transfer/pull", "unknown_request", json=pull | {"peer_request_id": "nope"})
    b("POST", "/v1/transfer/pull", "scope_mismatch", json=pull | {"cache_salt": "t"})
    b("POST", "/v1/allocate", 200, json={"request_id": "p", "num_tokens": 1})
    b("POST", "/v1/transfer/pull", "duplicate_request", json=pull)
    b("POST", "/v1/free", 204, json={"request_id": "p"})
    b("POST", "/v1/transfer/pull", 200, json=pull)
    fetch = {"request_id": "f", "peer": "a", "num_tokens": 9, "token_ids": list(range(9))}
    b("POST", "/v1/transfer/fetch", "unknown_peer", json=fetch | {"peer": "elsewhere"})
    b("POST", "/v1/transfer/fetch", "peer_unreachable", json=fetch | {"peer": "gone"})
    b("POST", "/v1/transfer/fetch", "duplicate_request", json=fetch | {"request_id": "p"})
    # o has another block size: refused before anything moves.
    o("POST", "/v1/allocate", 200, json={"request_id": "x", "num_tokens": 8, "token_ids": [1] * 8})
    o("POST", "/v1/commit", 200, json={"request_id": "x", "token_ids": [1] * 8})
    o("POST", "/v1/transfer/hand_off", 200, json={"request_id": "x"})
    b(
        "POST",
        "/v1/transfer/pull",
        "layout_mismatch",
        json=pull | {"request_id": "p5", "peer": "o", "peer_request_id": "x"},
    )
    o("POST", "/v1/free", 204, json={"request_id": "x"})
    b(
        "POST",
        "/v1/transfer/fetch",
        "layout_mismatch",
        json=fetch | {"peer": "o", "token_ids": [1] * 9},
    )
    # a's long request: past b's max_seq_len (64), then past b's 6 free slots.
    long = list(range(100, 180))
    a("POST", "/v1/allocate", 200, json={"request_id": "l", "num_tokens": 80, "token_ids": long})
    a("POST", "/v1/commit", 200, json={"request_id": "l", "token_ids": long})
    a("POST", "/v1/transfer/hand_off", 200, json={"request_id": "l"})
    b(
        "POST",
        "/v1/transfer/pull",
        "sequence_too_long",
        json=pull | {"request_id": "p4", "peer_request_id": "l"},
    )
    b(
        "POST",
        "/v1/transfer/fetch",
        "sequence_too_long",
        json=fetch | {"num_tokens": 80, "token_ids": long},
    )
    other = list(range(300, 320))
    q = {"request_id": "q", "num_tokens": 20, "token_ids": other}
    a("POST", "/v1/allocate", 200, json=q)
    nothing_committed = {"request_id": "q"}
    a("POST", "/v1/transfer/hand_off", "invalid_argument", json=nothing_committed)
    a("POST", "/v1/commit", 200, json={"request_id": "q", "token_ids": other})
    a("POST", "/v1/transfer/hand_off", 200, json={"request_id": "q"})
    b(
        "POST",
        "/v1/transfer/pull",
        "out_of_blocks",
        json=pull | {"request_id": "p2", "peer_request_id": "q"},
    )
    b(
        "POST",
        "/v1/transfer/fetch",
        "out_of_blocks",
        json=fetch | {"num_tokens": 30, "token_ids": long[:30]},
    )
    for i in range(3):  # b's 4 rows: p and three more
        b("POST", "/v1/allocate", 200, json={"request_id": f"r{i}", "num_tokens": 1})
    b(
        "POST",
        "/v1/transfer/pull",
        "max_requests_reached",
        json=pull | {"request_id": "p3", "peer_request_id": "q"},
    )
    b("POST", "/v1/transfer/fetch", "max_requests_reached", json=fetch | {"request_id": "f2"})
    # a's rows all taken (h, s, l, q): no pin for a prefix, so it exports none.
    r = a("POST", "/v1/transfer/prefix", 200, json={"token_ids": long[:9]})
    assert r.json()["token_ids"] == []


def _without_a_model(call: Recorder) -> None:
    """Every route that needs the model, on a service that has none; and a registration on a
    device the service cannot use."""
    params = {
        "/v1/request": QUERY,
        "/v1/block_table": QUERY,
        "/v1/committed_tokens": QUERY,
        "/v1/estimate": {"seq_len": 1},
    }
    for (method, route), entry in ROUTES.items():
        if "no_model" in {cls.code for cls in entry.error_classes()}:
            body = VALID.get(route) if method == "POST" else None
            call(method, route, "no_model", json=body, params=params.get(route, {}))
    call("POST", "/v1/model", "device_unavailable", json=VALID["/v1/model"])


def test_live_errors_are_the_documented_ones(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every error a live server answers is listed for its route, with its code; and every
    code the document lists for a route was answered by some sample."""
    manager = KVCacheManager(CONFIG | {"share": True})
    app = create_app(manager, api_token=TOKEN, max_body_bytes=LIMIT)
    doc = app.openapi()
    with serve_in_thread(app) as url, httpx.Client(base_url=url) as http:
        call = Recorder(http)
        _generic(call)
        _specific(call, manager.generation)
        with monkeypatch.context() as patch:  # full tables of sessions and consumers
            patch.setattr(Leases, "MAX_SESSIONS", 0)
            patch.setattr(ServiceState, "MAX_CONSUMERS", 0)
            call("POST", "/v1/sessions", "limit_reached", json={})
            call(
                "POST",
                "/v1/consumers",
                "limit_reached",
                json={"pid": 1, "generation": manager.generation},
            )

        # Any route refuses a caller that pinned another generation, before anything else.
        stale = {"X-KVCM-Generation": "0" * 32}
        for method, route in ROUTES:
            path = route.replace("{consumer_id}", "c").replace("{session_id}", "s")
            call(method, route, "stale_generation", path=path, headers=stale)

        _no_transfer(call)
        # Stream-ordered steps and done events need shared CUDA tables; these are the CPU's.
        call("POST", "/v1/step_columns", "stream_order_unavailable", json={"stream_ordered": True})
        done = {"pid": 1, "generation": manager.generation, "done_event": "A" * 88}
        call("POST", "/v1/consumers", "stream_order_unavailable", json=done)

        def broken(*_: object) -> None:
            raise ZeroDivisionError("a bug")

        with monkeypatch.context() as patch:
            patch.setattr(manager, "stats", broken)
            call("GET", "/v1/stats", "internal_error")  # the last call: it drops the connection
        samples = call.samples
    # KV moves between sidecars: three with a transfer endpoint, b pulling from the others.
    pytest.importorskip("nixl_cu12", reason="the transfer extra (nixl-cu12) is not installed")
    moving = CONFIG | {"transfer": "nixl"}
    a_mgr = KVCacheManager(
        moving
        | {"transfer_name": "a", "max_seq_len": 128, "num_blocks": 96, "host_memory_bytes": 512}
    )
    o_mgr = KVCacheManager(moving | {"transfer_name": "o", "tokens_per_block": 8})
    b_mgr = KVCacheManager(moving | {"transfer_name": "b", "num_blocks": 8})
    with (
        serve_in_thread(create_app(a_mgr, api_token=TOKEN)) as a_url,
        serve_in_thread(create_app(o_mgr, api_token=TOKEN)) as o_url,
    ):
        peers = {"a": (a_url, TOKEN), "o": (o_url, TOKEN), "gone": ("http://127.0.0.1:9", TOKEN)}
        with (
            serve_in_thread(create_app(b_mgr, api_token=TOKEN, peers=peers)) as b_url,
            httpx.Client(base_url=a_url) as ha,
            httpx.Client(base_url=b_url) as hb,
            httpx.Client(base_url=o_url) as ho,
        ):
            recorders = [Recorder(ha), Recorder(hb), Recorder(ho)]
            _transfers(*recorders)
            samples += [s for r in recorders for s in r.samples]
    # The same without share=True: /v1/pools has nothing to describe.
    with serve_in_thread(create_app(KVCacheManager(CONFIG))) as url:
        samples.append(("GET", "/v1/pools", httpx.get(f"{url}/v1/pools")))
    # A host tier: a suspended request refuses every op that needs its blocks.
    host = CONFIG | {"num_blocks": 8, "host_memory_bytes": 256}  # 2 host slots
    with serve_in_thread(create_app(KVCacheManager(host))) as url, httpx.Client(base_url=url) as h:
        call = Recorder(h)
        _host_tier(call)
        samples += call.samples
    # State layers: a recurrent state cannot be rewound past its checkpoints.
    state = {"layer_id": 99, "buffers": [{"name": "s", "shape": [4]}]}
    hybrid = CONFIG | {"state_layers": [state]}
    with (
        serve_in_thread(create_app(KVCacheManager(hybrid))) as url,
        httpx.Client(base_url=url) as h,
    ):
        call = Recorder(h)
        _state_layers(call)
        samples += call.samples
    # A manager that records no KV events refuses to list them.
    with serve_in_thread(create_app(KVCacheManager(CONFIG | {"kv_events": False}))) as url:
        samples.append(("GET", "/v1/events", httpx.get(f"{url}/v1/events")))
    # No model yet, on a device that does not exist.
    app = create_app(None, defaults={"device": "cuda:99"})
    with serve_in_thread(app) as url, httpx.Client(base_url=url) as http:
        call = Recorder(http)
        _without_a_model(call)
        samples += call.samples

    seen: set[tuple[str, str, str]] = set()
    for method, route, resp in samples:
        listed = documented_statuses(doc, method, route)
        assert resp.status_code in listed, (method, route, resp.status_code, resp.text)
        if resp.status_code >= 400:
            body = resp.json()
            assert set(body) == {"code", "message", "detail"}, body
            assert body["code"] in listed[resp.status_code], (method, route, body)
            seen.add((method, route, body["code"]))
    unseen = {
        (method, route, code)
        for (method, route), entry in ROUTES.items()
        for code in {cls.code for cls in entry.error_classes()}
        if (method, route, code) not in seen and code != "internal_error"
    }
    assert not unseen, sorted(unseen)
    assert ("GET", "/v1/stats", "internal_error") in seen


def test_unknown_routes_and_methods_keep_the_error_body() -> None:
    with (
        serve_in_thread(create_app(KVCacheManager(CONFIG))) as url,
        httpx.Client(base_url=url) as http,
    ):
        check: Callable[[httpx.Response], tuple[int, str]] = lambda r: (  # noqa: E731
            r.status_code,
            r.json()["code"],
        )
        assert check(http.get("/v1/nope")) == (404, "not_found")
        assert check(http.put("/v1/allocate")) == (405, "method_not_allowed")
        assert http.put("/v1/allocate").headers["allow"] == "POST"


# -- limits: the document states what the service enforces ---------------------------------------

#: Integers of request bodies and queries without an upper bound in the document, and why.
_NO_MAXIMUM = {
    "layer_id": "any id: one the model lacks is unknown_layer (404), the model's to say",
    "ragged_layers": "layer ids, as layer_id: one the model lacks is unknown_layer",
    "start": "a multimodal item past the prompt touches no block",
    "length": "a multimodal item past the prompt touches no block",
    "num_requests": "any number answers whether they fit",
    "rank": "below the model's number of ranks (its description)",
}
#: Routes whose body the walk leaves out: a registration's rules are the config's own
#: validators (cross-field: exactly one source, nvfp4 shapes, layer ids), not counts.
_UNWALKED = {("POST", "/v1/model")}


def _leaves(
    doc: dict[str, Any], schema: dict[str, Any], where: str, seen: frozenset[str] = frozenset()
) -> Iterator[tuple[str, dict[str, Any]]]:
    """Every (location, schema) of an integer or string in ``schema``, through refs."""
    components = doc["components"]["schemas"]
    if "$ref" in schema:
        name = schema["$ref"].rsplit("/", 1)[1]
        if name not in seen:
            yield from _leaves(doc, components[name], name, seen | {name})
        return
    if schema.get("type") in ("integer", "string"):
        yield where, schema
    for key in ("anyOf", "oneOf", "allOf"):
        for branch in schema.get(key, []):
            yield from _leaves(doc, branch, where, seen)
    if "items" in schema:
        yield from _leaves(doc, schema["items"], f"{where}[]", seen)
    for name, sub in schema.get("properties", {}).items():
        yield from _leaves(doc, sub, f"{where}.{name}", seen)


def _request_leaves(doc: dict[str, Any]) -> Iterator[tuple[str, str, dict[str, Any]]]:
    """(route, location, schema) of every integer and string a request carries: bodies and
    query parameters."""
    for method, path, op in _operations(doc):
        if (method, path) in _UNWALKED:
            continue
        route = f"{method} {path}"
        body = op.get("requestBody")
        if body is not None:
            for where, schema in _leaves(doc, body["content"]["application/json"]["schema"], ""):
                yield route, where, schema
        for param in op.get("parameters", []):
            if param["in"] == "query":
                for where, schema in _leaves(doc, param["schema"], f"?{param['name']}"):
                    yield route, where, schema


def test_every_count_and_request_id_of_a_request_has_its_documented_range(
    doc: dict[str, Any],
) -> None:
    """A walk of every request body and query: each integer has a lower bound and (unless
    ``_NO_MAXIMUM`` says why not) an upper one, so a new count cannot ship without its
    range; each request id has the service's length."""
    from kvcm.manager import MAX_REQUEST_ID

    ids = 0
    for route, where, schema in _request_leaves(doc):
        name = where.rsplit(".", 1)[-1].removesuffix("[]").lstrip("?")
        if schema["type"] == "integer":
            assert "minimum" in schema or "exclusiveMinimum" in schema, (route, where)
            if name not in _NO_MAXIMUM:
                assert "maximum" in schema, (route, where)
        elif name in ("request_id", "request_ids"):
            ids += 1
            assert (schema["minLength"], schema["maxLength"]) == (1, MAX_REQUEST_ID), where
    assert ids >= 20  # every op route, the id lists and the three queries


def _props(doc: dict[str, Any], model: str) -> dict[str, Any]:
    props: dict[str, Any] = doc["components"]["schemas"][model]["properties"]
    return props


def _ints(schema: dict[str, Any]) -> list[dict[str, Any]]:
    """The integer schemas of a field: itself, its items, its anyOf branches (and theirs)."""
    if schema.get("type") == "integer":
        return [schema]
    out = []
    for branch in schema.get("anyOf", []):
        out += _ints(branch)
    if "items" in schema:
        out += _ints(schema["items"])
    return out


def test_the_limits_are_the_service_s_own_constants(doc: dict[str, Any]) -> None:
    """Each documented limit is the constant the service checks with (imported from the
    service's modules, which take them from ``kvcm_client.specs``)."""
    from kvcm.counts import MAX_COUNT
    from kvcm.hashing import KEY_BYTES
    from kvcm.manager import MAX_STEP_OPS, MAX_STEP_OTHER_OPS
    from kvcm.server.app import default_body_limit

    positive, non_negative = (1, MAX_COUNT), (0, MAX_COUNT)
    ranges = {
        ("AllocateOp", "num_tokens"): positive,
        ("AllocateOp", "lookahead"): non_negative,
        ("AllocateOp", "token_ids"): (0, 2**31 - 1),
        ("ExtendOp", "num_new_tokens"): positive,
        ("ExtendOp", "lookahead"): non_negative,
        ("RewindOp", "num_tokens"): positive,
        ("CommitOp", "token_ids"): (0, 2**31 - 1),
        ("ExtendManyRequest", "num_new_tokens"): positive,
        ("ExtendManyRequest", "lookahead"): non_negative,
        ("CommitManyRequest", "token_ids"): (0, 2**31 - 1),
        ("StepColumnsRequest", "rewind_tokens"): positive,
        ("StepColumnsRequest", "num_new_tokens"): positive,
        ("StepColumnsRequest", "lookahead"): non_negative,
        ("StepColumnsRequest", "extend"): (-(2**63), 2**63 - 1),
        ("SlotMappingRequest", "num_tokens"): non_negative,
        ("ProbeRequest", "token_ids"): (0, 2**31 - 1),
        ("ProbeTiersRequest", "token_ids"): (0, 2**31 - 1),
        ("AllocateOp", "lora_id"): (-(2**63), 2**63 - 1),
    }
    for (model, field), (low, high) in ranges.items():
        schemas = _ints(_props(doc, model)[field])
        assert schemas, (model, field)
        for schema in schemas:
            assert (schema["minimum"], schema["maximum"]) == (low, high), (model, field)

    step = _props(doc, "StepRequest")["ops"]
    assert step["maxItems"] == MAX_STEP_OPS and step["items"]["required"] == ["op"]
    assert f"{MAX_STEP_OPS} ops" in step["description"]
    assert f"{MAX_STEP_OTHER_OPS} of them other than extends" in step["description"]
    columns = _props(doc, "StepColumnsRequest")
    assert columns["extend"]["maxItems"] == MAX_STEP_OPS
    for section in ("free", "rewind", "commit", "commit_tokens", "allocate", "suspend", "resume"):
        assert columns[section]["maxItems"] == MAX_STEP_OTHER_OPS, section
    for model in ("ExtendManyRequest", "CommitManyRequest"):
        assert _props(doc, model)["request_ids"]["uniqueItems"] is True, model
    for model in ("AllocateOp", "ProbeRequest"):
        keys = _props(doc, model)["block_keys"]["anyOf"][0]["items"]
        assert keys["pattern"] == f"^[0-9a-fA-F]{{{2 * KEY_BYTES}}}$", model
    slot_mapping = doc["paths"]["/v1/slot_mapping"]["post"]["requestBody"]["content"]
    ref = slot_mapping["application/json"]["schema"]["$ref"].rsplit("/", 1)[1]
    assert "layer_id" in doc["components"]["schemas"][ref]["required"]
    assert "layer_id" not in doc["components"]["schemas"]["SlotMappingRequest"]["required"]

    # What depends on the model is said in words.
    for model, field in (
        ("AllocateOp", "num_tokens"),
        ("ExtendOp", "num_new_tokens"),
        ("ProbeRequest", "token_ids"),
    ):
        assert "max_seq_len" in _props(doc, model)[field]["description"], (model, field)
    estimate = {p["name"]: p for p in doc["paths"]["/v1/estimate"]["get"]["parameters"]}
    assert "max_seq_len" in estimate["seq_len"]["description"]
    events = {p["name"]: p for p in doc["paths"]["/v1/events"]["get"]["parameters"]}
    assert (events["after"]["schema"]["minimum"], events["after"]["schema"]["maximum"]) == (
        0,
        2**63 - 1,
    )
    assert events["limit"]["schema"]["maximum"] == MAX_COUNT

    # The body limit's note and the function the app sizes it with.
    note = doc["paths"]["/v1/allocate"]["post"]["responses"]["413"]["description"]
    assert "1 MiB and 64 KiB + 8 bytes per token of the model's max_seq_len" in note
    assert default_body_limit(0) == 1 << 20
    assert default_body_limit(10**6) == (64 << 10) + 8 * 10**6
    sessions = doc["paths"]["/v1/sessions"]["post"]["responses"]["429"]["description"]
    assert f"{Leases.MAX_SESSIONS} sessions" in sessions


def test_a_stale_query_limit_fails_the_document(monkeypatch: pytest.MonkeyPatch) -> None:
    """``QUERY_LIMITS`` names parameters by hand: one the app lacks fails ``create_app``."""
    from kvcm.server import openapi

    table = dict(openapi.QUERY_LIMITS)
    table["GET", "/v1/stats"] = {"nope": {"minimum": 0}}
    monkeypatch.setattr(openapi, "QUERY_LIMITS", table)
    with pytest.raises(RuntimeError, match=r"GET /v1/stats\?nope"):
        create_app(KVCacheManager(CONFIG))
    table.pop(("GET", "/v1/stats"))
    table["GET", "/v1/nope"] = {}
    with pytest.raises(RuntimeError, match="GET /v1/nope"):
        create_app(KVCacheManager(CONFIG))


def test_the_manager_enforces_the_documented_bounds_exactly() -> None:
    """At each documented bound the count check passes, one past it the manager refuses
    with ``invalid_argument``: the document and the checks cannot part."""
    from kvcm_client.errors import InvalidArgument, SequenceTooLong
    from kvcm_client.models import (
        INT64_MAX,
        MAX_COUNT,
        MAX_REQUEST_ID,
        MAX_STEP_OPS,
        MAX_STEP_OTHER_OPS,
        MAX_TOKEN_ID,
    )

    m = KVCacheManager(CONFIG)
    m.allocate("x" * MAX_REQUEST_ID, 1)
    for rid in ("", "x" * (MAX_REQUEST_ID + 1)):
        with pytest.raises(InvalidArgument, match="request_id"):
            m.allocate(rid, 1)
    with pytest.raises(SequenceTooLong):  # past the count check, stopped by max_seq_len
        m.allocate("n", MAX_COUNT)
    for n in (0, MAX_COUNT + 1):
        with pytest.raises(InvalidArgument, match="num_tokens"):
            m.allocate("n", n)
    assert m.probe([0, MAX_TOKEN_ID]) == 0
    for bad in (-1, MAX_TOKEN_ID + 1):
        with pytest.raises(InvalidArgument, match="token ids"):
            m.probe([1, bad])
    assert m.probe([1, 2], lora_id=INT64_MAX) == 0
    with pytest.raises(InvalidArgument, match="lora_id"):
        m.probe([1, 2], lora_id=INT64_MAX + 1)
    m.events(after=INT64_MAX, limit=MAX_COUNT)
    for kw in ({"after": INT64_MAX + 1}, {"after": -1}, {"limit": 0}, {"limit": MAX_COUNT + 1}):
        with pytest.raises(InvalidArgument):
            m.events(**kw)
    key = "ab" * 32
    assert m.probe(list(range(4)), block_keys=[key]) == 0
    with pytest.raises(InvalidArgument, match="32-byte"):
        m.allocate("k", 4, token_ids=list(range(4)), block_keys=[key[:-2]])
    with pytest.raises(InvalidArgument, match="start >= 0 and length > 0"):
        m.probe([1], multimodal=[{"digest": "d", "start": 0, "length": 0}])
    extends = [{"op": "extend", "request_id": "nope", "num_new_tokens": 1}]
    assert len(m.step(extends * MAX_STEP_OPS)) == MAX_STEP_OPS
    with pytest.raises(InvalidArgument, match="at most"):
        m.step(extends * (MAX_STEP_OPS + 1))
    frees = [{"op": "free", "request_id": "nope"}]
    assert len(m.step(frees * MAX_STEP_OTHER_OPS)) == MAX_STEP_OTHER_OPS
    with pytest.raises(InvalidArgument, match="at most"):
        m.step(frees * (MAX_STEP_OTHER_OPS + 1))
    with pytest.raises(InvalidArgument, match="at most"):
        m.step_columns(free=[0] * (MAX_STEP_OTHER_OPS + 1))
    assert m.step_columns(free=[-(2**63), 2**63 - 1]).status["free"].tolist() == [4, 4]


# -- a schema-valid request gets no 422 the schema could have prevented ---------------------------

#: Cases of the positive run over all routes; ``KVCM_OPENAPI_CASES`` for a longer one.
POSITIVE_CASES = int(os.environ.get("KVCM_OPENAPI_CASES", "200"))
LIVE_IDS = ("live0", "live1")
#: ``invalid_argument`` messages a schema-valid request may get, and why no schema can say
#: them: they depend on the model, on state, or on two fields together.
NOT_STATABLE = [
    (r"token_ids has \d+ ids for num_tokens=", "two fields: one id per token"),
    (r"commit_many got \d+ request ids and \d+ token id lists", "two fields: one list per id"),
    (r"must be an int or \d+ ints", "two fields: one count per id or handle"),
    (r"\d+ commits and \d+ token id lists", "two fields: one list per commit"),
    (r"block_keys must be the \d+ keys", "two fields and the model: one key per full block"),
    (r"per_layer needs mode='kernel'", "two fields"),
    (r"all-or-nothing step", "two fields: atomic and suspend or resume ops"),
    (r"a step takes at most", "all sections together"),
    (r"seq_len must be in \[1, max_seq_len - lookahead", "the model's max_seq_len"),
    (r"rank -?\d+: this manager has \d+ ranks", "the model's ranks"),
    (r"has no role", "the layer's roles"),
    (r"pad_to must be in \[0, \d+\]", "the model: max_requests x max_seq_len"),
    (r"pad_to=\d+ is below the \d+ tokens", "state: the tokens mapped"),
    (r"num_tokens exceeds a request's length", "state"),
    (r"rewind removes at most", "state: the request's length"),
    (r"more do not fit", "state: the uncommitted tokens"),
    (r"is not suspended", "state"),
    (r"needs a host tier", "the model: host_memory_bytes"),
    (r"max_new_tokens sizes a request by its prompt", "two fields: token_ids, no block_keys"),
]
#: Codes a schema-valid request may get besides ``invalid_argument``: lookups and state
#: (400 ``malformed_request`` and 413 ``payload_too_large`` are not among them).
STATE_CODES = {
    "unknown_request",
    "unknown_session",
    "unknown_consumer",
    "unknown_layer",
    "duplicate_request",
    "request_suspended",
    "sequence_too_long",
    "out_of_blocks",
    "max_requests_reached",
    "rewind_past_window",
    "rewind_into_shared_block",
    "state_not_rewindable",
    "prefix_cache_in_use",
    "stale_generation",
    "limit_reached",
    "step_aborted",  # the other ops of an all-or-nothing step that one op failed
    "kv_in_flight",  # a request whose KV moves between sidecars
    "transfer_unavailable",  # the transfer routes of a sidecar started without --transfer
}


def _whole(value: Any) -> Any:
    """``value`` with JSON's whole floats (``2.0``) as ints (``2``): the same value to JSON
    Schema (2020-12 counts ``2.0`` as an integer), which schemathesis sends on purpose. The
    service takes counts as integers spelled as such (strict, as in process), a rule no
    schema can state: its 422 says so, and ``test_a_whole_float_is_refused_as_documented``
    checks it."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, dict):
        return {k: _whole(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_whole(v) for v in value]
    return value


def _nudged(value: Any, rng: random.Random, generation: str, key: str = "") -> Any:
    """Schema-valid values nudged to live ids and the real generation (also schema-valid),
    so that a case gets past the lookups half the time."""
    if isinstance(value, dict):
        return {k: _nudged(v, rng, generation, k) for k, v in value.items()}
    if key == "request_ids" and isinstance(value, list):
        return rng.sample(LIVE_IDS, rng.randint(0, len(LIVE_IDS)))
    if isinstance(value, list):
        return [_nudged(v, rng, generation, key) for v in value]
    if key == "request_id" and rng.random() < 0.7:
        return rng.choice(LIVE_IDS)
    if key == "generation" and rng.random() < 0.7:
        return generation
    return value


def _statable(code: str, message: str) -> bool:
    """Whether an error is one a schema could have prevented."""
    if code in STATE_CODES:
        return False
    if code != "invalid_argument":
        return True
    return not any(re.search(pattern, message) for pattern, _ in NOT_STATABLE)


def _restock(http: httpx.Client) -> None:
    for rid in http.get("/v1/requests").json()["request_ids"]:
        http.post("/v1/free", json={"request_id": rid}, headers=AUTH)
    for rid in LIVE_IDS:
        body = {"request_id": rid, "num_tokens": 9, "token_ids": list(range(9))}
        http.post("/v1/allocate", json=body, headers=AUTH).raise_for_status()


class PositiveRun:
    """Sends schemathesis's cases to a live service and keeps what it answered: statuses,
    and the errors a schema could have prevented (``problems``)."""

    def __init__(self, http: httpx.Client, url: str, generation: str, doc: dict[str, Any]) -> None:
        self.http = http
        self.url = url
        self.generation = generation
        self.doc = doc
        self.statuses: dict[int, int] = {}
        self.problems: list[str] = []

    def send(self, case: Any, rng: random.Random) -> None:
        kw = case.as_transport_kwargs(base_url=self.url)
        path = case.operation.path
        # The case's headers are the token and the lease header: the real token, and no
        # lease (a random one would only be unknown_session).
        headers = dict(AUTH)
        params = dict(kw.get("params") or {})
        if path == "/v1/events":
            params["timeout_s"] = 0  # a wait, not a case
        if "request_id" in params and rng.random() < 0.7:
            params["request_id"] = rng.choice(LIVE_IDS)
        body = kw.get("json")
        if body is not None:
            body = _nudged(_whole(body), rng, self.generation)
        resp = self.http.request(kw["method"], kw["url"], params=params, headers=headers, json=body)
        self.statuses[resp.status_code] = self.statuses.get(resp.status_code, 0) + 1
        shown = f"{kw['method']} {path} params={params} body={json.dumps(body)[:300]}"
        listed = documented_statuses(self.doc, kw["method"], path)
        assert resp.status_code in listed and resp.status_code != 500, (shown, resp.text)
        errors: list[tuple[str, str]] = []
        if resp.status_code >= 400:
            answer = resp.json()
            errors.append((answer["code"], answer["message"]))
        elif path == "/v1/step":
            errors += [
                (r["error"]["code"], r["error"]["message"])
                for r in resp.json()["results"]
                if r["error"] is not None
            ]
        elif path == "/v1/step_columns":
            errors += [(e["code"], e["message"]) for e in resp.json()["errors"]]
        for code, message in errors:
            if _statable(code, message):
                self.problems.append(f"{shown}\n  -> {resp.status_code} {code}: {message}")


def test_a_schema_valid_request_gets_no_422_the_schema_could_state() -> None:
    """A seeded positive-only schemathesis run against a live service: every 4xx a case
    gets is a lookup, a state or a rule of the model or of two fields together
    (``NOT_STATABLE``, ``STATE_CODES``), also inside step results; never a range, a length,
    a count of items or a required field the document leaves out. ``POST /v1/model`` is left
    out: it would replace the model the other cases aim at."""
    import schemathesis
    from hypothesis import HealthCheck, Phase, given, seed, settings
    from schemathesis import GenerationMode

    assert not STATE_CODES - set(ERRORS_BY_CODE), STATE_CODES - set(ERRORS_BY_CODE)
    manager = KVCacheManager(CONFIG | {"share": True, "host_memory_bytes": 1 << 12})
    app = create_app(manager, api_token=TOKEN)
    routes = sorted(key for key in ROUTES if key != ("POST", "/v1/model"))
    per_route = max(2, -(-POSITIVE_CASES // len(routes)))
    with serve_in_thread(app) as url, httpx.Client(base_url=url, timeout=30) as http:
        schema = schemathesis.openapi.from_url(f"{url}/openapi.json")
        run = PositiveRun(http, url, manager.generation, app.openapi())
        for method, path in routes:
            _restock(http)
            strategy = schema[path][method].as_strategy(GenerationMode.POSITIVE)
            hypothesis_settings = settings(
                max_examples=per_route,
                deadline=None,
                database=None,
                phases=[Phase.generate],
                suppress_health_check=list(HealthCheck),
            )
            cases = given(case=strategy, salt=st.integers(0, 2**32 - 1))(
                lambda case, salt: run.send(case, random.Random(salt))
            )
            seed(0)(hypothesis_settings(cases))()
    print(f"positive run: {len(routes)} routes, statuses {sorted(run.statuses.items())}")
    assert sum(run.statuses.values()) >= len(routes) * 2, run.statuses
    assert not run.problems, f"{len(run.problems)} schema-valid requests refused:\n" + "\n".join(
        run.problems[:30]
    )


def test_a_whole_float_is_refused_as_documented(doc: dict[str, Any]) -> None:
    """JSON Schema counts ``2.0`` as an integer; the service does not (strict counts, the
    same refusal as in process), and its 422 says so on every body route."""
    note = doc["paths"]["/v1/extend"]["post"]["responses"]["422"]["description"]
    assert "such as 2.0, is refused" in note
    with (
        serve_in_thread(create_app(KVCacheManager(CONFIG))) as url,
        httpx.Client(base_url=url) as http,
    ):
        http.post("/v1/allocate", json={"request_id": "a", "num_tokens": 1})
        resp = http.post("/v1/extend", json={"request_id": "a", "num_new_tokens": 2.0})
        assert (resp.status_code, resp.json()["code"]) == (422, "invalid_argument")
        assert resp.json()["detail"]["errors"][0]["type"] == "int_type"

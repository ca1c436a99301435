"""The OpenAPI document tells the truth, and /docs works without the internet.

The document is walked route by route (every status each route can answer, every error body the
``Error`` schema, no FastAPI ``HTTPValidationError``), and a live server is driven into every
error it documents: each error it answers is listed for its route, with its code, and every
code the document lists was seen (all but ``internal_error``, which only a bug produces, and
which one sample provokes with a broken manager method instead).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest
from helpers import layer
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
        if route == "/v1/allocate":
            continue
        if "request_id" in body:
            call("POST", route, "unknown_request", json=body | nope)
        elif "request_ids" in body:
            call("POST", route, "unknown_request", json=body | {"request_ids": ["nope"]})
    for route in ("/v1/request", "/v1/block_table", "/v1/committed_tokens"):
        call("GET", route, "unknown_request", params=nope)
    call("POST", "/v1/page_indices", "unknown_layer", json={"request_ids": [], "layer_id": 9})
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

        def broken(*_: object) -> None:
            raise ZeroDivisionError("a bug")

        with monkeypatch.context() as patch:
            patch.setattr(manager, "stats", broken)
            call("GET", "/v1/stats", "internal_error")
        samples = call.samples
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

"""The HTTP service on a real uvicorn server: errors, limits, auth, metrics, OpenAPI, races."""

from __future__ import annotations

import asyncio
import json
import re
import threading
import time
from collections.abc import Iterator

import httpx
import numpy as np
import pytest
from helpers import layer
from servers import serve_in_thread

from kvcm import KVCacheManager
from kvcm.server.app import create_app
from kvcm_client import AsyncKVCacheClient, KVCacheClient
from kvcm_client.errors import OutOfBlocks, Unauthorized

CONFIG = {
    "layers": [layer(0, sliding_window=8), layer(1), layer(2, kv_factor=1)],
    "tokens_per_block": 4,
    "max_requests": 4,
    "max_seq_len": 32,
    "num_blocks": 8,
}


@pytest.fixture
def url() -> Iterator[str]:
    with serve_in_thread(create_app(KVCacheManager(CONFIG), max_body_bytes=4096)) as u:
        yield u


@pytest.fixture
def http(url: str) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=url) as client:
        yield client


def _err(resp: httpx.Response) -> tuple[int, str]:
    body = resp.json()
    assert set(body) == {"code", "message", "detail"}
    return resp.status_code, body["code"]


def test_errors_are_json_with_stable_codes_and_fitting_statuses(http: httpx.Client) -> None:
    assert http.post("/v1/allocate", json={"request_id": "a", "num_tokens": 5}).status_code == 200
    cases = [
        (("/v1/allocate", b"{not json"), (400, "malformed_request")),
        (("/v1/allocate", b""), (400, "malformed_request")),
        (("/v1/extend", {"request_id": "zz", "num_new_tokens": 1}), (404, "unknown_request")),
        (("/v1/allocate", {"request_id": "a", "num_tokens": 6}), (409, "duplicate_request")),
        (("/v1/allocate", {"request_id": "b", "num_tokens": 33}), (413, "sequence_too_long")),
        (("/v1/allocate", {"request_id": "b", "num_tokens": "5"}), (422, "invalid_argument")),
        (("/v1/allocate", {"request_id": "b"}), (422, "invalid_argument")),
        (("/v1/allocate", {"request_id": "b", "num_tokens": 0}), (422, "invalid_argument")),
        (("/v1/allocate", {"request_id": "b", "num_tokens": 1, "x": 1}), (422, "invalid_argument")),
        (("/v1/allocate", {"request_id": "b", "num_tokens": 30}), (507, "out_of_blocks")),
        (("/v1/rewind", {"request_id": "a", "num_tokens": 9}), (422, "invalid_argument")),
        (("/v1/page_indices", {"request_ids": ["a"], "layer_id": 7}), (404, "unknown_layer")),
        (("/v1/nope", {}), (404, "not_found")),
    ]
    for (path, body), want in cases:
        resp = (
            http.post(path, content=body) if isinstance(body, bytes) else http.post(path, json=body)
        )
        assert _err(resp) == want, (path, body)
    assert _err(http.get("/v1/allocate")) == (405, "method_not_allowed")
    assert _err(http.get("/v1/estimate")) == (422, "invalid_argument")
    assert _err(http.get("/v1/estimate", params={"seq_len": "x"})) == (422, "invalid_argument")
    assert _err(http.get("/v1/estimate", params={"seq_len": 10**30})) == (422, "invalid_argument")
    for rid in ("b", "c", "d"):
        http.post("/v1/allocate", json={"request_id": rid, "num_tokens": 1})
    resp = http.post("/v1/allocate", json={"request_id": "e", "num_tokens": 1})
    assert _err(resp) == (507, "max_requests_reached")
    # None of the failures changed anything.
    assert http.get("/v1/request", params={"request_id": "a"}).json()["num_tokens"] == 5
    assert http.get("/v1/stats").json()["num_requests"] == 4


def test_bad_input_never_yields_a_500(http: httpx.Client) -> None:
    rng = np.random.default_rng(3)
    junk: list[object] = [
        None,
        0,
        -1,
        2**70,
        1.5,
        "x",
        "",
        "\u0000\ud7ff\U0001f600",
        [],
        {},
        [1, "a"],
        {"a": [None]},
        True,
    ]
    fields = [
        "request_id",
        "num_tokens",
        "num_new_tokens",
        "lookahead",
        "token_ids",
        "ops",
        "atomic",
        "request_ids",
        "layer_id",
        "role",
        "mode",
        "per_layer",
        "pad_to",
        "op",
    ]
    routes = [r for r in json.loads(http.get("/openapi.json").text)["paths"]]
    posts = [
        r
        for r in routes
        if r.startswith("/v1/")
        and "{" not in r
        and r
        not in (
            "/v1/layout",
            "/v1/estimate",
            "/v1/stats",
            "/v1/requests",
            "/v1/request",
            "/v1/block_table",
            "/v1/committed_tokens",
        )
    ]
    assert "/v1/step" in posts and "/v1/allocate" in posts
    http.post("/v1/allocate", json={"request_id": "live", "num_tokens": 3})
    for _ in range(600):
        body = {
            str(rng.choice(fields)): junk[int(rng.integers(len(junk)))]
            for _ in range(int(rng.integers(0, 5)))
        }
        if rng.random() < 0.3:
            body["request_id"] = "live"
        if rng.random() < 0.2:
            body = {
                "ops": [
                    body
                    | {"op": str(rng.choice(["allocate", "extend", "free", "commit", "rewind"]))}
                ]
            }
        path = str(rng.choice(posts))
        resp = http.post(path, json=body)
        assert resp.status_code < 500, (path, body, resp.text)
        if resp.status_code >= 400:
            assert resp.json()["code"]
    for name in ("request", "block_table", "committed_tokens"):
        for value in ("", "live", "\u00e9", "x" * 5000):
            assert http.get(f"/v1/{name}", params={"request_id": value}).status_code < 500
    metrics = http.get("/metrics").text
    assert not re.search(r'kvcm_http_requests_total\{.*status="5', metrics)


def test_request_bodies_over_the_limit_are_refused_with_413(url: str) -> None:
    big = {"request_id": "a", "token_ids": list(range(2000))}  # about 9 KB > 4096
    with httpx.Client(base_url=url) as http:
        assert _err(http.post("/v1/commit", json=big)) == (413, "payload_too_large")

        def chunks() -> Iterator[bytes]:  # no Content-Length: counted as it arrives
            yield b'{"request_id": "a", "token_ids": ['
            for _ in range(1000):
                yield b"12345,"
            yield b"1]}"

        assert _err(http.post("/v1/commit", content=chunks())) == (413, "payload_too_large")
        assert http.get("/v1/stats").json()["num_requests"] == 0


def test_a_token_guards_mutating_routes_only() -> None:
    app = create_app(KVCacheManager(CONFIG), api_token="t0ken")
    with (
        serve_in_thread(app) as url,
        KVCacheClient(url, token="wrong") as bad,
        KVCacheClient(url, token="t0ken") as good,
    ):
        with pytest.raises(Unauthorized) as exc:
            bad.allocate("a", 3)
        assert exc.value.status == 401
        with pytest.raises(Unauthorized):
            bad.open_session()
        assert bad.stats().num_requests == 0  # reads stay open
        assert good.allocate("a", 3).num_tokens == 3
        with httpx.Client(base_url=url) as anon:
            assert anon.post("/v1/free", json={"request_id": "a"}).status_code == 401
            assert anon.get("/livez").status_code == 200
            assert anon.get("/metrics").status_code == 200
        assert good.request_ids() == ["a"]


def test_metrics_report_blocks_requests_ops_and_latencies(url: str) -> None:
    with KVCacheClient(url) as kv:
        kv.allocate("a", 9)
        kv.step([{"op": "extend", "request_id": "a", "num_new_tokens": 1}])
        kv.allocate("b", 4)
        with pytest.raises(OutOfBlocks):
            kv.extend("a", 20)  # 8 blocks of 4 tokens in the full group; 4 are free
        stats = kv.stats()
    text = httpx.get(f"{url}/metrics").text
    for pg, free in stats.free_blocks.items():
        assert f'kvcm_blocks_free{{pool_group="{pg}"}} {float(free)}' in text
        assert f'kvcm_blocks_used{{pool_group="{pg}"}} {float(stats.used_blocks[pg])}' in text
    assert "kvcm_requests_running 2.0" in text
    assert 'kvcm_ops_total{op="allocate",result="ok"} 2.0' in text
    assert 'kvcm_ops_total{op="extend",result="ok"} 1.0' in text
    assert 'kvcm_ops_total{op="extend",result="out_of_blocks"} 1.0' in text
    assert 'kvcm_op_duration_seconds_count{route="/v1/step"} 1.0' in text
    assert 'kvcm_http_requests_total{route="/v1/extend",status="507"} 1.0' in text


def test_openapi_documents_every_route_and_its_body(http: httpx.Client) -> None:
    doc = http.get("/openapi.json").json()
    paths = doc["paths"]
    for route in (
        "/v1/allocate",
        "/v1/step",
        "/v1/extend_many",
        "/v1/sessions",
        "/livez",
        "/readyz",
        "/metrics",
        "/v1/layout",
        "/v1/estimate",
    ):
        assert route in paths, route
    ref = paths["/v1/step"]["post"]["requestBody"]["content"]["application/json"]["schema"]["$ref"]
    schema = doc["components"]["schemas"][ref.rsplit("/", 1)[1]]
    assert set(schema["properties"]) == {"ops", "atomic", "brief"}
    for sub in re.findall(r'"#/components/schemas/([^"]+)"', json.dumps(doc)):
        assert sub in doc["components"]["schemas"], sub


def test_concurrent_calls_never_race() -> None:
    """Threads and async tasks hammer the service; the books must still balance."""
    app = create_app(KVCacheManager(CONFIG | {"num_blocks": 80, "max_requests": 8}))
    with serve_in_thread(app) as url:
        _hammer(url)


def _hammer(url: str) -> None:
    errors: list[BaseException] = []

    def worker(w: int) -> None:
        rng = np.random.default_rng(w)
        try:
            with KVCacheClient(url) as kv:
                for i in range(60):
                    rid = f"w{w}"
                    r = kv.step(
                        [
                            {
                                "op": "allocate",
                                "request_id": rid,
                                "num_tokens": int(rng.integers(1, 8)),
                            },
                            {
                                "op": "extend",
                                "request_id": rid,
                                "num_new_tokens": int(rng.integers(1, 5)),
                            },
                        ]
                    )
                    if r[0].ok and i % 3:
                        kv.free(rid)
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(w,)) for w in range(6)]
    for t in threads:
        t.start()

    async def same_allocate() -> list[object]:
        async with AsyncKVCacheClient(url) as kv:
            return await asyncio.gather(*(kv.allocate("same", 4) for _ in range(40)))

    results = asyncio.run(same_allocate())
    for t in threads:
        t.join()
    assert not errors
    assert all(r == results[0] for r in results)  # one allocation, 40 identical answers
    with KVCacheClient(url) as kv:
        stats = kv.stats()
        held: dict[int, list[int]] = {}
        layout = kv.describe()
        for rid in kv.request_ids():
            for g, blocks in enumerate(kv.block_table(rid)):
                pg = layout.layer_groups[g].pool_group
                held.setdefault(pg, []).extend(b for b in blocks if b >= 0)
        for pg, used in stats.used_blocks.items():
            assert len(held.get(pg, [])) == used
            assert len(set(held.get(pg, []))) == used  # no slot handed out twice


def test_plain_ops_accept_exactly_what_the_op_models_accept() -> None:
    """The service's model-free path must never accept, or change, what the models refuse."""
    from pydantic import ValidationError

    from kvcm.ops import plain_step
    from kvcm_client.models import StepRequest

    rng = np.random.default_rng(11)
    values: list[object] = [
        1,
        3,
        0,
        -2,
        True,
        1.0,
        "1",
        None,
        2**40,
        [1, 2],
        [1, True],
        [],
        ["ab"],
        [{"digest": "d", "start": 0, "length": 1}],
    ]
    fields = [
        "request_id",
        "num_tokens",
        "num_new_tokens",
        "lookahead",
        "token_ids",
        "extra",
        "lora_id",
        "cache_salt",
        "multimodal",
        "block_keys",
    ]
    valid = {
        "allocate": {"request_id": "a", "num_tokens": 2},
        "extend": {"request_id": "b", "num_new_tokens": 1},
        "rewind": {"request_id": "c", "num_tokens": 1},
        "commit": {"request_id": "d", "token_ids": [4, 5]},
        "free": {"request_id": "e"},
    }
    accepted = 0
    for _ in range(4000):
        ops: list[object] = []
        for _ in range(int(rng.integers(1, 4))):
            kind = str(rng.choice([*valid, "explode"]))
            op: dict[str, object] = {"op": kind, **valid.get(kind, {})}
            for _ in range(int(rng.poisson(0.4))):
                op[str(rng.choice(fields))] = values[int(rng.integers(len(values)))]
            if rng.random() < 0.05 and len(op) > 1:
                del op[str(rng.choice([k for k in op if k != "op"]))]
            ops.append(op)
        body: dict[str, object] = {"ops": ops}
        for flag in ("atomic", "brief"):
            if rng.random() < 0.2:
                body[flag] = values[int(rng.integers(len(values)))]
        fast = plain_step(body)
        try:
            req = StepRequest.model_validate_json(json.dumps(body))
        except ValidationError:
            assert fast is None, body
            continue
        accepted += 1
        if fast is None:  # allowed only for the nested fields left to the models
            assert any(
                op.op == "allocate" and (op.multimodal is not None or op.block_keys is not None)
                for op in req.ops
            ), body
            continue
        assert fast == ([op.model_dump() for op in req.ops], req.atomic, req.brief), body
    assert accepted > 700  # of 4000 random bodies; the rest must be refused by both


def test_event_followers_wake_when_another_client_publishes(url: str) -> None:
    got: list[object] = []

    def follow() -> None:
        with KVCacheClient(url) as kv:
            for batch in kv.follow_events(after=0, timeout_s=5):
                got.append((time.monotonic(), batch))
                return

    thread = threading.Thread(target=follow)
    thread.start()
    time.sleep(0.3)  # the follower is waiting in its long-poll now
    with KVCacheClient(url) as kv:
        kv.allocate("a", 9, token_ids=list(range(9)))
        published = time.monotonic()
        kv.commit("a", list(range(9)))  # 2 full blocks of 4
    thread.join(10)
    ((when, batch),) = got
    assert when - published < 1.0  # woken by the commit, not by the 5 s timeout
    # One event per layer group (sliding and full), each with the 2 full blocks of 4 tokens.
    events = batch.events  # type: ignore[attr-defined]
    assert [(e.kind, e.layer_group, len(e.block_keys)) for e in events] == [
        ("block_stored", 0, 2),
        ("block_stored", 1, 2),
    ]
    assert "kvcm_prefix_stored_blocks_total 4.0" in httpx.get(f"{url}/metrics").text
    with KVCacheClient(url) as kv:
        empty = kv.events(after=batch.last_seq, timeout_s=0.2)  # type: ignore[attr-defined]
        assert empty.events == [] and not empty.lost

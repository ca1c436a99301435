"""An OpenAPI-driven fuzz of the served API: no input may yield a 5xx.

Cases come from the live ``/openapi.json``: schemathesis generates them from each operation's
schemas, positive and negative (wrong types, missing fields, out-of-range values). 80% are then
nudged towards live request ids, sessions, consumers and small counts, so that they reach past
the lookups, and 40% are mutated with what breaks services: 2**63, 2**64 and larger ints, NaN and
infinities (also as JSON tokens and in queries), long and odd strings, deep nesting, extra and
missing fields, bodies that are not JSON, bad tokens and session ids. Every case goes to a real
uvicorn server on loopback. Every answer must be below 500 (no ``internal_error`` in step results
either), every error ``{code, message, detail}``, and its status, content type and body what
the document lists for that route (schemathesis's conformance checks).

``KVCM_FUZZ_CASES`` (default 400) is the number of cases over all operations, spread evenly;
``KVCM_FUZZ_SEED`` (default 0) the seed. A long run::

    KVCM_FUZZ_CASES=20000 python -m pytest -q tests/test_fuzz.py

All failures of an operation are collected and reported together (not only the first), each with
the request that caused it.
"""

from __future__ import annotations

import functools
import json
import math
import os
import random
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import quote

import httpx
import pytest
import schemathesis
from helpers import layer
from hypothesis import HealthCheck, Phase, given, seed, settings
from hypothesis import strategies as st
from schemathesis import GenerationMode
from servers import serve_in_thread

from kvcm import KVCacheManager
from kvcm.server.app import create_app
from kvcm.server.openapi import ROUTES
from kvcm_client.models import ManagerConfig

pytestmark = pytest.mark.slow  # schemathesis against a live server

CASES = int(os.environ.get("KVCM_FUZZ_CASES", "400"))
SEED = int(os.environ.get("KVCM_FUZZ_SEED", "0"))
PER_OPERATION = max(2, -(-CASES // len(ROUTES)))
TOKEN = "fuzz-token"
AUTH = f"Bearer {TOKEN}"
LIMIT = 1 << 20
CONFIG = {
    "layers": [
        layer(0, sliding_window=8),
        layer(1),
        layer(2, kv_factor=1),
        layer(3, num_kv_heads=0),  # dropped: no KV cache
    ],
    "tokens_per_block": 4,
    "max_requests": 8,
    "max_seq_len": 64,
    "num_blocks": 64,
    "share": True,
}
LIVE = ("live0", "live1", "live2")

#: Past every bound, and the service's own largest count (2**31 - 1) and below it: valid counts
#: that must not make the service allocate or loop in proportion to them.
HUGE_INTS = [2**31, 2**32, 2**53 + 1, 2**63 - 1, 2**63, 2**64, 2**64 + 5, 10**30, 10**400]
BIG_COUNTS = [2**31 - 1, 2**31 - 2, 2**30, 10**9, 10**8]
HOSTILE: list[Any] = [
    *HUGE_INTS,
    *BIG_COUNTS,
    *(-n for n in HUGE_INTS),
    -1,
    0,
    math.nan,
    math.inf,
    -math.inf,
    1e308,
    -0.0,
    1.5,
    5e-324,
    "",
    "x" * 100_000,
    "\x00",
    "\ud800",  # a lone surrogate: valid JSON text, not valid UTF-8
    "\u00e9\U0001f600",
    "../../etc",
    "%2F",
    "nan",
    None,
    True,
    False,
    [],
    {},
    [[[[]]]],
    {"a": {"b": None}},
    [None] * 1000,
    list(range(5000)),
]
QUERY_HOSTILE = [
    "nan",
    "NaN",
    "inf",
    "-inf",
    "Infinity",
    "1e309",
    "-0",
    "1.0",
    "1e3",
    "0x10",
    " 1",
    "1_000",
    "true",
    "",
    str(2**63 - 1),
    str(2**63),
    str(2**64),
    str(-(2**63) - 1),
    str(2**31 - 1),
    str(10**9),
    "9" * 5000,
    "x" * 10_000,
    "\u00e9",
    "%00",
]
RAW_BODIES = [
    b"",
    b"{",
    b"null",
    b"[]",
    b'"x"',
    b"1e999",
    b"\xff\xfe{}",
    b"\xef\xbb\xbf{}",  # a UTF-8 byte order mark
    b'{"a": NaN}',
    b'{"ops": [' * 3000,
    b"[" * 100_000 + b"]" * 100_000,
    b'{"request_id": "live0", "request_id": 1}',
]


@dataclass
class Failures:
    """What one operation's cases broke (the first 50 in full), and the statuses they got."""

    total: int = 0
    items: list[str] = field(default_factory=list)
    statuses: dict[int, int] = field(default_factory=dict)

    def add(self, what: str) -> None:
        self.total += 1
        if len(self.items) < 50:
            self.items.append(what)


@dataclass
class Live:
    """Ids that exist on the server now, so that cases can get past the lookups."""

    generation: str = ""
    sessions: list[str] = field(default_factory=list)
    consumers: list[str] = field(default_factory=list)


def _clean(http: httpx.Client, live: Live, bare: bool = False) -> None:
    """Free what earlier cases left (requests, sessions, consumers: the tables are bounded),
    then put live requests (unless ``bare``), a session and a consumer back."""
    headers = {"Authorization": AUTH}
    for rid in http.get("/v1/requests").json()["request_ids"]:
        http.post("/v1/free", json={"request_id": rid}, headers=headers)
    if not bare:
        for i, rid in enumerate(LIVE):
            n = 5 + 4 * i
            body = {"request_id": rid, "num_tokens": n, "token_ids": list(range(n))}
            http.post("/v1/allocate", json=body, headers=headers)
        body = {"request_id": "live1", "token_ids": list(range(9))}
        http.post("/v1/commit", json=body, headers=headers)
    for sid in live.sessions:
        http.delete(f"/v1/sessions/{quote(sid, safe='')}", headers=headers)
    for consumer in http.get("/v1/consumers").json()["consumers"]:
        http.delete(f"/v1/consumers/{consumer['consumer_id']}", headers=headers)
    live.generation = http.get("/v1/pools").json()["generation"]
    session = http.post("/v1/sessions", headers=headers)
    session.raise_for_status()
    live.sessions = [session.json()["session_id"]]
    body = {"pid": os.getpid(), "generation": live.generation}
    consumer = http.post("/v1/consumers", json=body, headers=headers)
    consumer.raise_for_status()
    live.consumers = [consumer.json()["consumer_id"]]


def _restore(http: httpx.Client) -> None:
    """Serve ``CONFIG`` again if a case registered another model (later operations' nudges
    aim at its layers and sizes)."""
    want = ManagerConfig.model_validate(CONFIG)
    if ManagerConfig.model_validate(http.get("/v1/model").json()["config"]) == want:
        return
    _clean(http, Live(), bare=True)
    body = want.model_dump(exclude={"device", "memory_bytes"})
    http.post("/v1/model", json=body, headers={"Authorization": AUTH}).raise_for_status()


@pytest.fixture(scope="module")
def served() -> Iterator[tuple[Any, httpx.Client]]:
    manager = KVCacheManager(CONFIG)
    app = create_app(manager, api_token=TOKEN, max_body_bytes=LIMIT)
    with serve_in_thread(app) as url, httpx.Client(base_url=url, timeout=30) as http:
        schema = schemathesis.openapi.from_url(f"{url}/openapi.json")
        yield schema, http


def test_the_document_has_exactly_the_table_s_operations(served: Any) -> None:
    schema, _ = served
    labels = {op.ok().label for op in schema.get_all_operations()}
    assert labels == {f"{m} {p}" for m, p in ROUTES}


def _paths(value: Any, prefix: tuple[Any, ...] = ()) -> Iterator[tuple[Any, ...]]:
    """Every location inside a JSON value (the value itself first)."""
    yield prefix
    if isinstance(value, dict):
        for k, v in value.items():
            yield from _paths(v, (*prefix, k))
    elif isinstance(value, list):
        for i, v in enumerate(value[:20]):
            yield from _paths(v, (*prefix, i))


def _set(value: Any, path: tuple[Any, ...], new: Any) -> Any:
    if not path:
        return new
    head, *rest = path
    copy = dict(value) if isinstance(value, dict) else list(value)
    copy[head] = _set(copy[head], tuple(rest), new)
    return copy


def _delete(value: Any, path: tuple[Any, ...]) -> Any:
    head, *rest = path
    if rest:
        return _set(value, (head,), _delete(value[head], tuple(rest)))
    copy = dict(value) if isinstance(value, dict) else list(value)
    del copy[head]
    return copy


SMALL = [0, 1, 1, 2, 3, 4, 5, 8, 9, 16, 20, 33, 63, 64, 65]


def _plausible(value: Any, rng: random.Random, live: Live, key: str = "") -> Any:
    """Schema-made values nudged towards ones the server can act on: small counts (and now
    and then a valid big one), live request ids, the real generation and pid, token ids as
    many as the tokens."""
    if isinstance(value, dict):
        out = {k: _plausible(v, rng, live, k) for k, v in value.items()}
        ids = out.get("token_ids")
        if "num_tokens" in out and isinstance(ids, list) and rng.random() < 0.6:
            out["num_tokens"] = len(ids)
        return out
    if key == "request_ids" and isinstance(value, list):
        return rng.sample(LIVE, rng.randint(0, len(LIVE)))
    if key == "block_keys" and isinstance(value, list):  # 32-byte keys in hex, a few
        return [rng.randbytes(32).hex() for _ in range(rng.choice([0, 1, 2, 4, 5]))]
    if key == "token_ids" and isinstance(value, list):
        return [rng.randint(0, 30) for _ in range(rng.choice([0, 1, 4, 5, 8, 9, 16, 20]))]
    if isinstance(value, list):
        return [_plausible(v, rng, live, key) for v in value]
    if key == "request_id":
        return rng.choice([*LIVE, "new0", "new1", "new2"])
    if key == "layer_id" and isinstance(value, int):
        return rng.choice([0, 1, 2, 3, 9])  # 3 has no KV cache, 9 does not exist
    if key == "role" and isinstance(value, str):
        return rng.choice(["key", "value", "key_scale", value])
    if key == "timeout_s":
        return rng.choice([0, 0.0, 0.01])
    if key == "generation":
        return live.generation
    if key == "pid":
        return os.getpid()
    if isinstance(value, int) and not isinstance(value, bool):
        return rng.choice(BIG_COUNTS) if rng.random() < 0.1 else rng.choice(SMALL)
    return value


def _mutate_body(body: Any, rng: random.Random) -> Any:
    for _ in range(rng.choice([1, 1, 1, 2, 3])):
        paths = list(_paths(body))
        where = rng.choice(paths)
        kind = rng.random()
        if kind < 0.55:
            body = _set(body, where, rng.choice(HOSTILE))
        elif kind < 0.75 and where:
            body = _delete(body, where)
        else:  # an extra field where there is an object
            objects = [p for p in paths if isinstance(_get(body, p), dict)]
            if objects:
                spot = rng.choice(objects)
                extra = {**_get(body, spot), rng.choice(["x", "op", "", "\u00e9"]): 1}
                body = _set(body, spot, extra)
    return body


def _get(value: Any, path: tuple[Any, ...]) -> Any:
    for part in path:
        value = value[part]
    return value


@dataclass
class Request:
    method: str
    path: str
    params: dict[str, Any]
    headers: dict[str, str]
    content: bytes | None

    def show(self) -> str:
        body = (self.content or b"")[:300]
        return f"{self.method} {self.path} params={self.params!r:.300} body={body!r}"


def _request(case: Any, rng: random.Random, live: Live) -> Request:
    """The HTTP request of a case: plausible (most), hostile (half), both or neither."""
    op = case.operation
    path_params = dict(case.path_parameters or {})
    query = dict(case.query or {})
    headers = {k: str(v) for k, v in (case.headers or {}).items()}
    body = case.body if op.body else None
    has_body = bool(op.body) and not _is_unset(body)
    if rng.random() < 0.8:
        if has_body and not isinstance(body, bytes):
            body = _plausible(body, rng, live)
        query = {k: _plausible(v, rng, live, k) for k, v in query.items()}
        for name in path_params:
            ids = live.sessions if name == "session_id" else live.consumers
            if ids and rng.random() < 0.6:
                path_params[name] = rng.choice(ids)
        if "X-KVCM-Session" in headers or rng.random() < 0.2:
            if rng.random() < 0.8 and live.sessions:
                headers["X-KVCM-Session"] = live.sessions[0]
            else:
                headers.pop("X-KVCM-Session", None)
    raw: bytes | None = None
    if rng.random() < 0.4:
        target = rng.random()
        if has_body and not isinstance(body, bytes) and target < 0.6:
            body = _mutate_body(body, rng)
        elif op.body and target < 0.7:
            raw = rng.choice(RAW_BODIES)
        elif query or target < 0.85:
            names = [p.name for p in op.query] or ["x"]
            query[rng.choice(names)] = rng.choice(QUERY_HOSTILE)
        if path_params and rng.random() < 0.3:
            name = rng.choice(list(path_params))
            path_params[name] = rng.choice(["x" * 3000, "\u00e9", " ", "..", "a b", "%00"])
        if rng.random() < 0.1:
            headers["X-KVCM-Session"] = rng.choice(["", "x" * 5000, "nope", "\t"])
    if has_body and raw is None:
        raw = body if isinstance(body, bytes) else _dumps(body)
    # The token on most cases (so they get past it), a wrong or no token on some.
    auth = rng.random()
    if auth < 0.85:
        headers["Authorization"] = AUTH
    elif auth < 0.93:
        headers["Authorization"] = rng.choice(["Bearer nope", "Basic x", "Bearer", ""])
    else:
        headers.pop("Authorization", None)
    path = op.path
    for name, value in path_params.items():
        path = path.replace("{" + name + "}", quote(str(value), safe=""))
    params = {k: _query_value(v) for k, v in query.items()}
    if _long_poll(params.get("timeout_s")):  # a wait, not a case: up to 60 s of nothing
        params["timeout_s"] = "0.01"
    return Request(op.method.upper(), path, params, headers, raw)


def _long_poll(value: Any) -> bool:
    try:
        seconds = float(value)
    except (TypeError, ValueError, OverflowError):
        return False
    return math.isfinite(seconds) and seconds > 0.05


def _dumps(body: Any) -> bytes:
    """JSON with NaN and Infinity tokens as they are, bytes as latin-1 text."""

    def other(value: Any) -> Any:
        if isinstance(value, bytes):
            return value.decode("latin-1")
        raise TypeError(type(value).__name__)

    text = json.dumps(body, allow_nan=True, default=other)
    return text.encode("utf-8", "surrogatepass")


def _query_value(value: Any) -> Any:
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, list):
        return [_query_value(v) for v in value]
    if value is None:
        return "null"
    if isinstance(value, dict):
        return json.dumps(value)
    return value


def _is_unset(value: Any) -> bool:
    return type(value).__name__ == "NotSet"


def _send(http: httpx.Client, req: Request) -> httpx.Response:
    headers = {k: v for k, v in req.headers.items() if _header_ok(k, v)}
    if req.content is not None:
        headers.setdefault("content-type", "application/json")
    return http.request(
        req.method, req.path, params=req.params, headers=headers, content=req.content
    )


def _header_ok(name: str, value: str) -> bool:
    """Whether h11 sends it (a client refuses control characters and edge whitespace)."""
    return bool(_TOKEN.fullmatch(name)) and bool(_FIELD.fullmatch(value))


_TOKEN = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")
_FIELD = re.compile(r"([\x21-\x7e\x80-\xff]([\x20-\x7e\x80-\xff\t]*[\x21-\x7e\x80-\xff])?)?")


@functools.cache
def _checks() -> list[Any]:
    import schemathesis.checks as c

    return [
        c.not_a_server_error,
        c.status_code_conformance,
        c.content_type_conformance,
        c.response_schema_conformance,
    ]


def _check(case: Any, req: Request, resp: httpx.Response, failures: Failures) -> None:
    failures.statuses[resp.status_code] = failures.statuses.get(resp.status_code, 0) + 1
    problems = []
    if resp.status_code >= 500:
        problems.append(f"status {resp.status_code}")
    if resp.status_code >= 400 and not (req.path == "/readyz" and resp.status_code == 503):
        try:
            body = resp.json()
        except ValueError:
            body = None
        if not (isinstance(body, dict) and set(body) == {"code", "message", "detail"}):
            problems.append("error body is not {code, message, detail}")
        elif not isinstance(body["detail"], dict) or not isinstance(body["code"], str):
            problems.append("error body has the wrong types")
    try:
        case.validate_response(resp, checks=_checks())
    except BaseExceptionGroup as group:  # schemathesis's group of the failed checks
        problems += [f"{type(f).__name__}: {f.title}: {f.message[:300]}" for f in group.exceptions]
    if req.path == "/v1/step" and resp.status_code == 200:  # a bug inside an op is a result
        broken = [
            r
            for r in resp.json()["results"]
            if (r.get("error") or {}).get("code") == "internal_error"
        ]
        if broken:
            problems.append(f"internal_error in step results: {broken[0]}")
    if problems:
        failures.add(f"{req.show()}\n  -> {resp.status_code} {resp.text[:300]}\n  {problems}")


@pytest.mark.parametrize("route", sorted(ROUTES), ids=lambda r: f"{r[0]} {r[1]}")
def test_fuzz_operation(served: Any, route: tuple[str, str]) -> None:
    schema, http = served
    method, path = route
    op = schema[path][method]
    positive = op.as_strategy(GenerationMode.POSITIVE)
    strategy = st.one_of(positive, positive, op.as_strategy(GenerationMode.NEGATIVE))
    failures = Failures()
    count = 0
    live = Live()
    _clean(http, live)

    @seed(SEED)
    @settings(
        max_examples=PER_OPERATION,
        deadline=None,
        database=None,
        phases=[Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    @given(case=strategy, salt=st.integers(0, 2**32 - 1))
    def run(case: Any, salt: int) -> None:
        nonlocal count
        count += 1
        if count % 50 == 0:  # every fourth time without requests (reset_prefix_cache works)
            _clean(http, live, bare=count % 200 == 0)
        rng = random.Random(salt)
        req = _request(case, rng, live)
        try:
            resp = _send(http, req)
        except httpx.TransportError as exc:  # the server dropped or stalled the connection
            failures.add(f"{req.show()}\n  -> {type(exc).__name__}: {exc}")
            return
        _check(case, req, resp, failures)
        if req.path == "/v1/sessions" and resp.status_code == 200:  # closed at the next clean
            live.sessions.append(resp.json()["session_id"])

    run()
    _restore(http)
    print(f"{method} {path}: {count} cases, statuses {sorted(failures.statuses.items())}")
    assert count >= min(PER_OPERATION, 2)
    assert not failures.total, f"{failures.total} failures:\n" + "\n".join(failures.items)


def test_no_5xx_was_counted(served: Any) -> None:
    """The server's own counter agrees: no answer of the whole run was a 5xx."""
    _, http = served
    metrics = http.get("/metrics").text
    lines = [ln for ln in metrics.splitlines() if ln.startswith("kvcm_http_requests_total{")]
    assert lines and not [ln for ln in lines if 'status="5' in ln], lines


def test_other_methods_and_paths_keep_the_error_body(served: Any) -> None:
    """Methods a route lacks and paths no route has: 405 and 404 with the error body."""
    schema, http = served
    paths = {op.ok().path for op in schema.get_all_operations()}
    for path in sorted(paths):
        concrete = path.replace("{consumer_id}", "x").replace("{session_id}", "x")
        for method in ("PUT", "PATCH", "OPTIONS", "HEAD", "TRACE", "GET", "POST", "DELETE"):
            resp = http.request(method, concrete, headers={"Authorization": AUTH})
            assert resp.status_code < 500, (method, concrete, resp.status_code)
            if resp.status_code >= 400 and method != "HEAD":
                assert set(resp.json()) == {"code", "message", "detail"}, (method, concrete)
    for path in ("/v2/allocate", "/v1/", "//v1/stats", "/v1/allocate/", "/v1/sessions/x/y"):
        resp = http.post(path, headers={"Authorization": AUTH})
        assert resp.status_code < 500, path

"""``kvcm router`` with real processes: three ``kvcm serve`` sidecars with different cached
prompts, a real ``redis-server``, routers on it; requests go to the longest hit, a sidecar
killed and restarted loses its stale entries, a restarted router resumes from Redis, and a
Redis restarted empty under a router is rebuilt from snapshots (docs/router.md). The router's
documented errors are all provoked at the end."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import AbstractContextManager, ExitStack
from pathlib import Path
from typing import Any, TypeVar

import httpx
import pytest
import redis
from helpers import layer
from servers import RedisServer, free_port, serve_in_thread, serve_process

from kvcm import KVCacheManager
from kvcm.cli import main
from kvcm.router.app import ROUTES, create_router_app
from kvcm.router.keyspace import GroupRule, KeySpace, ModelGate
from kvcm.router.memory_store import MemoryStore
from kvcm.router.redis_store import RedisStore, mask_of
from kvcm.router.service import Router
from kvcm.server.app import create_app
from kvcm.server.openapi import ERROR_SCHEMA, documented_statuses
from kvcm_client import KVCacheClient
from kvcm_client.errors import IndexUnavailable, NoModel
from kvcm_client.router import AsyncRouterClient, RouterClient
from kvcm_client.routing import GroupHit, RouteResult, SidecarStatus

pytestmark = pytest.mark.slow  # kvcm router and sidecars on a real redis-server

T = TypeVar("T")
TPB = 4
NAMES = ("a", "b", "c")


def wait_for(check: Callable[[], T], what: str, timeout: float = 30.0) -> T:
    """Poll ``check`` until it returns something true (a liveness bound, not a timing check).
    A router that no sidecar has answered yet routes nothing (``NoModel``, 503): until one
    has, that is "not yet" too (a loaded machine's first poll may come after the first look;
    CI once saw it)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            got: T | str = check()
        except NoModel:
            got = "no_model"
        else:
            if got:
                return got
        if time.monotonic() > deadline:
            raise AssertionError(f"gave up waiting for {what}; last: {got!r}")
        time.sleep(0.05)


class Fleet:
    """Three sidecars on fixed loopback ports (a restart keeps its URL)."""

    def __init__(self, layers: Path, stack: ExitStack) -> None:
        self.layers = layers
        self.stack = stack
        self.ports = {name: free_port() for name in NAMES}
        self.urls = {name: f"http://127.0.0.1:{port}" for name, port in self.ports.items()}
        self.procs: dict[str, subprocess.Popen[str]] = {}
        self._servers: dict[str, AbstractContextManager[Any]] = {}

    def _start(self, name: str) -> None:
        args = ("--layers", str(self.layers), "--tokens-per-block", str(TPB))
        server = serve_process(
            *args, "--num-blocks", "128", "--max-seq-len", "256", port=self.ports[name]
        )
        _, self.procs[name], _ = server.__enter__()
        self._servers[name] = server
        self.stack.push(server)

    def start_all(self) -> None:
        with ThreadPoolExecutor(len(NAMES)) as pool:  # each start is mostly importing torch
            list(pool.map(self._start, NAMES))

    def kill_and_restart(self, name: str) -> None:
        """kill -9, then the same command on the same port (a new generation, empty)."""
        os.kill(self.procs[name].pid, signal.SIGKILL)
        self.procs[name].wait()
        self._start(name)

    def cache(self, name: str, prompt: list[int], rid: str, **kw: Any) -> None:
        """A finished request: its prompt's full blocks stay cached."""
        with KVCacheClient(self.urls[name]) as kv:
            info = kv.allocate(rid, len(prompt), token_ids=prompt, **kw)
            kv.commit(rid, prompt[info.num_hit_tokens :])
            kv.free(rid)


@pytest.fixture(scope="module")
def redis_server() -> Iterator[RedisServer]:
    with RedisServer() as server:
        yield server


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    layers = tmp_path_factory.mktemp("router") / "layers.json"
    layers.write_text(json.dumps([layer(0)]))
    with ExitStack() as stack:
        fleet = Fleet(layers, stack)
        fleet.start_all()
        yield fleet


def router_process(
    fleet: Fleet, *args: str, sidecars: dict[str, str] | None = None
) -> AbstractContextManager[tuple[str, subprocess.Popen[str], list[str]]]:
    given = sidecars if sidecars is not None else fleet.urls
    flags = [f"--sidecar={name}={url}" for name, url in given.items()]
    return serve_process(
        *flags,
        "--poll-timeout",
        "1",
        "--upkeep-interval",
        "0.1",
        "--sweep-interval",
        "0.2",
        *args,
        command="router",
        model=False,
    )


def statuses(url: str) -> dict[str, SidecarStatus]:
    with RouterClient(url) as router:
        return {s.name: s for s in router.sidecars()}


def hits(url: str, prompt: list[int], **kw: Any) -> dict[str, int]:
    with RouterClient(url) as router:
        return {s.sidecar: s.hit_blocks for s in router.route(prompt, **kw).scores}


def following(url: str, names: tuple[str, ...] = NAMES) -> bool:
    states = statuses(url)
    return all(states[n].state == "following" for n in names)


def test_requests_go_to_the_longest_hit(
    fleet: Fleet, redis_server: RedisServer, capsys: pytest.CaptureFixture[str]
) -> None:
    """a, b and c hold 10, 5 and 2 blocks of one document; two routers on one Redis index
    and one in process rank them alike, exactly; an event (c caching all of it) shows in
    all three; a sidecar of another model is refused; a salted tenant's prefix scores only
    for its salt; ``kvcm route`` and both clients give the same answer."""
    doc = list(range(1000, 1064))  # 16 blocks
    for name, n in (("a", 40), ("b", 20), ("c", 8)):
        fleet.cache(name, doc[:n], f"doc-{name}")
    other = KVCacheManager(
        {"layers": [layer(0)], "tokens_per_block": 8, "num_blocks": 16, "max_seq_len": 64}
    )
    with (
        serve_in_thread(create_app(other)) as other_url,
        router_process(
            fleet,
            *("--redis-url", redis_server.url, "--namespace", "longest"),
            *("--tokens-per-block", str(TPB)),  # x must not be the one that sets it
            sidecars={**fleet.urls, "x": other_url},
        ) as (url, _, _),
        router_process(fleet) as (local, _, lines),
        router_process(fleet, "--redis-url", redis_server.url, "--namespace", "longest") as (
            replica,
            _,
            _,
        ),
    ):
        assert "index in process" in lines[0]
        for where in (url, local, replica):
            wait_for(lambda: following(where), "the sidecars followed")  # noqa: B023
        refused = wait_for(lambda: (x := statuses(url)["x"]).state == "refused" and x, "x")
        assert "has 8 tokens per block; this router scores 4" in str(refused.error)
        with RouterClient(url) as router:
            result = router.route(doc)
        assert result.tokens_per_block == TPB and result.num_blocks == 15  # 63 tokens reusable
        assert [
            (s.sidecar, s.hit_blocks, s.device_hit_blocks, s.hit_tokens) for s in result.scores
        ] == [("a", 10, 10, 40), ("b", 5, 5, 20), ("c", 2, 2, 8)]
        assert [s.groups for s in result.scores] == [
            [GroupHit(layer_group=0, device_blocks=n, host_blocks=0)] for n in (10, 5, 2)
        ]
        assert {s.url for s in result.scores} == {fleet.urls[n] for n in NAMES}
        wait_for(lambda: statuses(url)["a"].free_blocks is not None, "stats")
        top = RouterClient(url).route(doc).scores[0]
        assert (top.running_requests, top.free_blocks) == (0, 127)  # 128 slots, 1 null page
        plan = RouterClient(url).route(doc, fetch_plan=True).plan
        # Equal loads: the name decides (a), and a holds the longest prefix: nothing to fetch.
        assert plan is not None and (plan.run_on, plan.fetch_from, plan.hit_blocks) == (
            "a",
            None,
            10,
        )
        assert RouterClient(url).route(doc).plan is None
        for other in (local, replica):  # one in process, one sharing the Redis index
            assert RouterClient(other).route(doc).scores == RouterClient(url).route(doc).scores
        metrics = httpx.get(f"{url}/metrics").text
        assert 'kvcm_router_sidecars{state="following"} 3.0' in metrics
        assert 'kvcm_router_sidecars{state="refused"} 1.0' in metrics
        assert "kvcm_router_snapshots_total 3.0" in metrics

        fleet.cache("c", doc, "doc-c-all")
        want = {"a": 10, "b": 5, "c": 15}
        for where in (url, local, replica):
            wait_for(lambda: hits(where, doc) == want, "c's new blocks")  # noqa: B023

        salted = list(range(5000, 5024))  # 6 blocks, 5 reusable
        fleet.cache("b", salted, "salted", cache_salt="tenant-1")
        wait_for(lambda: hits(url, salted, cache_salt="tenant-1")["b"] == 5, "b's salted blocks")
        assert hits(url, salted, cache_salt="tenant-1") == {"a": 0, "b": 5, "c": 0}
        assert hits(url, salted) == {"a": 0, "b": 0, "c": 0}
        assert hits(url, salted, cache_salt="tenant-2") == {"a": 0, "b": 0, "c": 0}

        assert main(["route", "--router", url, "--token-ids", ",".join(map(str, doc))]) == 0
        table = capsys.readouterr().out.splitlines()
        assert table[0] == "15 reusable blocks of 4 tokens; 3 sidecars, best first"
        assert [row.split()[:4] for row in table[3:]] == [
            ["1", "c", "60", "15"],
            ["2", "a", "40", "10"],
            ["3", "b", "20", "5"],
        ]
        assert main(["route", "--router", url, "--json", "--token-ids", "1 2 3 4 5"]) == 0
        answer = RouteResult.model_validate_json(capsys.readouterr().out)
        assert answer.num_blocks == 1 and all(s.hit_blocks == 0 for s in answer.scores)

        async def async_route() -> RouteResult:
            async with AsyncRouterClient(url) as router:
                return await router.route(doc)

        assert asyncio.run(async_route()).scores == RouterClient(url).route(doc).scores


def test_a_sidecar_killed_and_restarted_loses_its_entries(
    fleet: Fleet, redis_server: RedisServer
) -> None:
    """kill -9 of b, then b again on its port (a new generation, nothing cached): the router
    loads it again, its old placements score nothing at once, and the sweep clears every
    bit of its old slot from Redis."""
    prompt = list(range(2000, 2033))  # 8 blocks reusable
    fleet.cache("b", prompt, "kill-b")
    with router_process(fleet, "--redis-url", redis_server.url, "--namespace", "kill") as (
        url,
        _,
        _,
    ):
        wait_for(lambda: hits(url, prompt).get("b") == 8, "b's blocks")
        before = statuses(url)["b"]
        store = redis.Redis.from_url(redis_server.url)
        old_slot = int(store.hget("kill:sc:b", "slot"))
        fleet.kill_and_restart("b")
        after = wait_for(
            lambda: (
                (s := statuses(url)["b"]).generation != before.generation
                and s.state == "following"
                and s
            ),
            "b followed again",
        )
        assert after.snapshots == before.snapshots + 1
        assert hits(url, prompt) == {"a": 0, "b": 0, "c": 0}
        bits = ((1 << 2) - 1) << (2 * old_slot)  # one layer group: 2 bits per slot

        def old_bits_left() -> int:
            return sum(
                bool(mask_of(store.get(k)) & bits) for k in store.scan_iter(match=b"kill:b:*")
            )

        wait_for(lambda: old_bits_left() == 0, "the sweep of b's old slot")
        assert int(store.hget("kill:sc:b", "slot")) != old_slot
        store.close()


def test_a_restarted_router_resumes_from_redis(fleet: Fleet, redis_server: RedisServer) -> None:
    """A router stopped and started again on the same Redis resumes every sidecar from its
    cursor there (no snapshot), with the events it missed meanwhile."""
    first, missed = list(range(3000, 3017)), list(range(3100, 3125))  # 4 and 6 blocks
    fleet.cache("a", first, "resume-1")
    args = ("--redis-url", redis_server.url, "--namespace", "resume")
    with router_process(fleet, *args) as (url, _, _):
        wait_for(lambda: hits(url, first).get("a") == 4, "a's blocks")
    fleet.cache("c", missed, "resume-2")  # while no router runs
    with router_process(fleet, *args) as (url, _, _):
        wait_for(lambda: following(url), "the sidecars resumed")
        assert [s.snapshots for s in statuses(url).values()] == [0, 0, 0]
        wait_for(lambda: hits(url, missed).get("c") == 6, "the missed events")
        assert hits(url, first) == {"a": 4, "b": 0, "c": 0}
        assert hits(url, missed) == {"a": 0, "b": 0, "c": 6}


def test_redis_restarted_empty_under_the_router(fleet: Fleet, redis_server: RedisServer) -> None:
    """Redis killed and started again without its data: the router answers
    ``index_unavailable`` while it is gone, then notices the missing marker and loads
    every sidecar again."""
    prompt = list(range(4000, 4021))  # 5 blocks
    fleet.cache("a", prompt, "redis-gone")
    with router_process(fleet, "--redis-url", redis_server.url, "--namespace", "gone") as (
        url,
        _,
        _,
    ):
        wait_for(lambda: hits(url, prompt).get("a") == 5, "a's blocks")
        loads = {n: s.snapshots for n, s in statuses(url).items()}
        redis_server.stop()
        with pytest.raises(IndexUnavailable, match="cannot be reached"):
            RouterClient(url).route(prompt)
        redis_server.start()
        wait_for(lambda: hits(url, prompt) == {"a": 5, "b": 0, "c": 0}, "the rebuilt index")
        assert all(s.snapshots == loads[n] + 1 for n, s in statuses(url).items())


# -- the documented errors ---------------------------------------------------------------------

FULL = KeySpace(TPB, (GroupRule(None, 0, True),))


def test_router_live_errors_are_the_documented_ones(monkeypatch: pytest.MonkeyPatch) -> None:
    """As tests/test_openapi.py for the sidecar: every error a live router answers is listed
    for its route, and every listed code was answered."""
    samples: list[tuple[str, str, httpx.Response]] = []

    def call(http: httpx.Client, method: str, route: str, want: Any, **kw: Any) -> None:
        resp = http.request(method, route, **kw)
        samples.append((method, route, resp))
        coded = resp.status_code >= 400 and isinstance(want, str)
        got = resp.json()["code"] if coded else resp.status_code
        assert got == want, (route, resp.status_code, resp.text)

    gate = ModelGate()
    router = Router(MemoryStore(), gate, [])
    app = create_router_app(router, max_body_bytes=1024)
    doc = app.openapi()
    assert {(m.upper(), p) for p, item in doc["paths"].items() for m in item} == set(ROUTES)
    with serve_in_thread(app) as url, httpx.Client(base_url=url) as http:
        call(http, "POST", "/v1/route", "malformed_request", content=b"{")
        call(http, "POST", "/v1/route", "payload_too_large", content=b" " * 1025)
        call(http, "POST", "/v1/route", "invalid_argument", json=[])
        call(http, "POST", "/v1/route", "invalid_argument", json={})
        call(
            http,
            "POST",
            "/v1/route",
            "invalid_argument",
            json={"block_keys": ["00" * 32], "cache_salt": "s"},
        )
        call(http, "POST", "/v1/route", "no_model", json={"token_ids": [1, 2, 3]})
        call(http, "GET", "/readyz", 503)
        gate.space = FULL
        call(http, "POST", "/v1/route", "invalid_argument", json={"block_keys": ["00"]})
        call(http, "POST", "/v1/route", "invalid_argument", json={"token_ids": [-1]})
        call(http, "POST", "/v1/route", 200, json={"block_keys": ["ab" * 32]})
        call(http, "GET", "/readyz", 200)
        call(http, "GET", "/livez", 200)
        call(http, "GET", "/v1/sidecars", 200)
        call(http, "GET", "/metrics", 200)
        assert b"kvcm_router_route_seconds_count 1.0" in samples[-1][2].content

        def broken(*_: object) -> None:
            raise ZeroDivisionError("a bug")

        resp = http.get("/v1/nope")
        assert (resp.status_code, resp.json()["code"]) == (404, "not_found")
        with monkeypatch.context() as patch:  # last: uvicorn drops the connection after it
            patch.setattr(router, "route", broken)
            call(http, "POST", "/v1/route", "internal_error", json={"token_ids": [1]})
    gone = Router(RedisStore(f"redis://127.0.0.1:{free_port()}/0"), ModelGate(), [], upkeep_s=0.05)
    gone.gate.space = FULL
    with serve_in_thread(create_router_app(gone)) as url, httpx.Client(base_url=url) as http:
        call(http, "POST", "/v1/route", "index_unavailable", json={"token_ids": [1, 2, 3, 4, 5]})
        big = list(range(100_000, 160_000))  # over 256 KiB: parsed in a worker thread
        call(http, "POST", "/v1/route", "index_unavailable", json={"token_ids": big})
        call(http, "POST", "/v1/route", "malformed_request", content=json.dumps(big)[:-1])
        wait_for(lambda: gone.store_error, "the upkeep to fail")
        call(http, "GET", "/readyz", 503)

    seen = set()
    for method, route, resp in samples:
        listed = documented_statuses(doc, method, route)
        assert resp.status_code in listed, (method, route, resp.status_code)
        if resp.status_code >= 400 and route != "/readyz":
            body = resp.json()
            assert set(body) == {"code", "message", "detail"}
            assert body["code"] in listed[resp.status_code], (route, body)
            seen.add((method, route, body["code"]))
    listed_codes = {  # internal_error: only one route's is provoked (a bug is needed)
        (method, route, cls.code)
        for (method, route), entry in ROUTES.items()
        for cls in entry.error_classes()
        if cls.code != "internal_error" or route == "/v1/route"
    }
    assert listed_codes == seen
    schema = doc["paths"]["/v1/route"]["post"]["responses"]["503"]["content"]
    assert schema["application/json"]["schema"]["allOf"] == [
        {"$ref": f"#/components/schemas/{ERROR_SCHEMA}"}
    ]

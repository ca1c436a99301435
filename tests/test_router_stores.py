"""The router's index stores (in process, and on a real redis-server) hold exactly what the
sidecars cache, and its hits are exactly what the sidecars' own probes answer
(docs/router.md)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Iterator
from itertools import count
from typing import Any

import numpy as np
import pytest
from helpers import layer, manager
from servers import RedisServer

from kvcm import KVCacheManager
from kvcm.router.follower import Follower
from kvcm.router.keyspace import GroupRule, KeySpace, ModelGate
from kvcm.router.memory_store import MemoryStore
from kvcm.router.redis_store import RedisStore, mask_of
from kvcm.router.scorer import Walk
from kvcm.router.service import Router
from kvcm.router.store import DEVICE, HOST, Applied, Cursor, Group, IndexStore, Op
from kvcm_client.errors import (
    IndexUnavailable,
    ModelMismatch,
    ServiceUnavailable,
    StaleGeneration,
)
from kvcm_client.routing import RouteRequest

FULL = KeySpace(4, (GroupRule(None, 0, True),))
TWO = KeySpace(4, (GroupRule(None, 0, True), GroupRule(8, 0, True)))  # width 4
K = [bytes([i]) * 32 for i in range(8)]


@pytest.fixture(scope="module")
def redis_server() -> Iterator[RedisServer]:
    with RedisServer() as server:
        yield server


_namespaces = count()
Make = Callable[[], IndexStore]


@pytest.fixture(params=["memory", "redis"])
def make(request: pytest.FixtureRequest) -> Make:
    """A factory of empty stores (called inside the test's event loop)."""
    if request.param == "memory":
        return MemoryStore
    url = request.getfixturevalue("redis_server").url
    return lambda: RedisStore(url, f"t{next(_namespaces)}")


def run(body: Callable[[], Awaitable[None]]) -> None:
    asyncio.run(body())


async def contents(store: IndexStore) -> dict[bytes, int]:
    """Every block key the store holds and its holder mask, read from the store itself."""
    if isinstance(store, MemoryStore):
        return dict(store.masks)
    assert isinstance(store, RedisStore)
    keys = await store.redis.keys(store.block_prefix + b"*")
    prefix = len(store.block_prefix)
    return {k[prefix:]: mask_of(await store.redis.get(k)) for k in keys}


def test_loads_and_events_give_exact_masks(make: Make) -> None:
    """Bits are slot * 4 + 2 * group + tier; events at or below the cursor are skipped, a
    gap and a stale cursor are refused with the store's cursor, a removal that empties a
    mask deletes its key, and removing what is not there creates nothing."""

    async def body() -> None:
        s = make()
        assert await s.bind(TWO) == TWO
        a = await s.replace(
            "a",
            "ga",
            5,
            [Group(0, DEVICE, K[0:3]), Group(1, DEVICE, K[1:3]), Group(0, HOST, [K[3]])],
        )
        b = await s.replace("b", "gb", 0, [Group(0, DEVICE, [K[0]])])
        assert (a, b) == (Cursor(0, "ga", 5), Cursor(1, "gb", 0))
        assert await contents(s) == {K[0]: 0b1_0001, K[1]: 0b101, K[2]: 0b101, K[3]: 0b10}
        ops = [
            Op(5, True, 0, DEVICE, (K[5],)),  # already in the load: skipped
            Op(6, False, 0, HOST, (K[3],)),
            Op(7, True, 1, HOST, (K[4],)),
            Op(8, False, 0, DEVICE, (K[0], K[6])),
        ]
        assert await s.apply("a", a, ops) == Applied("ok", Cursor(0, "ga", 8))
        want = {K[0]: 0b1_0000, K[1]: 0b101, K[2]: 0b101, K[4]: 0b1000}
        assert await contents(s) == want
        a = Cursor(0, "ga", 8)
        assert await s.apply("a", a, [Op(10, True, 0, 0, (K[7],))]) == Applied("gap", a)
        assert await s.apply("a", Cursor(0, "old", 8), ops) == Applied("stale", a)
        assert await s.apply("zz", Cursor(9, "g", 0), ops) == Applied("stale", None)
        assert await contents(s) == want
        assert await s.cursor("a") == a and await s.cursor("zz") is None
        assert await s.bind(FULL) == TWO  # the first key space stays
        await s.close()

    run(body)


def test_a_new_load_drops_the_old_entries_at_once(make: Make) -> None:
    """A sidecar loaded again (a new generation) stops counting its old slot at once; the
    in-process store clears it at once, Redis at the next sweep, and both reuse the slot
    (lowest first) only once it is clear."""

    async def body() -> None:
        s = make()
        await s.bind(FULL)
        await s.replace("a", "g1", 3, [Group(0, DEVICE, K[0:3])])
        await s.replace("b", "g1", 0, [Group(0, DEVICE, K[0:2])])
        a = await s.replace("a", "g2", 0, [Group(0, DEVICE, [K[0]])])
        assert a == Cursor(2, "g2", 0)
        walk = Walk(FULL, 3)
        await s.lookup(["a", "b", "c"], K[0:3], walk)
        assert walk.cursors == {"a": a, "b": Cursor(1, "g1", 0)}
        hits = walk.hits()
        assert (hits["a"].device_hit_blocks, hits["b"].device_hit_blocks) == (1, 2)
        clear = {K[0]: 0b1_0100, K[1]: 0b100}
        if isinstance(s, RedisStore):
            assert await contents(s) == {K[0]: 0b1_0101, K[1]: 0b101, K[2]: 0b1}
            assert await s.sweep() == 3
            assert await s.redis.zrange(s.free, 0, -1) == [b"0"]
        assert await contents(s) == clear
        assert await s.sweep() == 0
        c = await s.replace("c", "g", 0, [Group(0, DEVICE, [K[7]])])
        assert c.slot == 0
        assert await contents(s) == {**clear, K[7]: 0b1}
        await s.close()

    run(body)


def test_redis_emptied_under_the_store_is_noticed_once(redis_server: RedisServer) -> None:
    async def body() -> None:
        s = RedisStore(redis_server.url, "emptied")
        await s.bind(FULL)
        a = await s.replace("a", "g", 0, [Group(0, DEVICE, [K[0]])])
        assert await s.check()
        await s.redis.flushdb()
        assert not await s.check()  # noticed: the marker is back, with a new epoch
        assert await s.check()
        assert await s.cursor("a") is None
        assert await s.apply("a", a, [Op(1, True, 0, 0, (K[1],))]) == Applied("stale", None)
        assert await contents(s) == {}
        await s.close()

    run(body)


def test_redis_drops_sidecars_whose_lease_ran_out(redis_server: RedisServer) -> None:
    """A sidecar no router renewed within the lease (it left the fleet) is swept with its
    cursor; one renewed, even late, stays."""

    async def body() -> None:
        s = RedisStore(redis_server.url, "leases", lease_s=0.3)
        await s.bind(FULL)
        await s.replace("a", "g", 0, [Group(0, DEVICE, K[0:2])])
        b = await s.replace("b", "g", 0, [Group(0, DEVICE, [K[1]])])
        await asyncio.sleep(0.5)
        assert await s.renew(["b", "z"]) == ["z"]  # z: no cursor, its follower must load
        assert await s.sweep() == 2
        assert await contents(s) == {K[1]: 0b100}
        assert await s.cursor("a") is None and await s.cursor("b") == b
        slots = await s.redis.hgetall(s.slots)
        assert list(slots) == [b"1"] and slots[b"1"].startswith(b"live ")
        await s.close()

    run(body)


def test_redis_out_of_reach_is_index_unavailable() -> None:
    from servers import free_port

    async def body() -> None:
        s = RedisStore(f"redis://127.0.0.1:{free_port()}/0")
        with pytest.raises(IndexUnavailable, match="cannot be reached"):
            await s.bind(FULL)
        with pytest.raises(IndexUnavailable):
            await s.lookup(["a"], K[0:2], Walk(FULL, 2))
        await s.close()

    run(body)


# -- the hits are the sidecar's own --------------------------------------------------------------


class ManagerSource:
    """A follower's source over an in-process manager (what ``AsyncKVCacheClient`` asks)."""

    def __init__(self, m: KVCacheManager) -> None:
        self.m = m

    async def model(self) -> Any:
        return self.m.model()

    async def index_snapshot(self) -> Any:
        return self.m.index_snapshot()

    async def events(self, after: int = 0, limit: int = 1000, timeout_s: float = 0.0) -> Any:
        return self.m.events(after, limit)

    async def stats(self) -> Any:
        return self.m.stats()

    def reconnect(self) -> None:
        """Nothing pinned."""


async def sync(f: Follower, m: KVCacheManager, limit: int = 5) -> None:
    """Follow until caught up, in small batches (several events per store write)."""
    while True:
        if f.needs_snapshot:
            await f.load()
        batch = m.events(f.cursor.last_seq if f.cursor else 0, limit)
        await f.ingest(batch)
        if not batch.events and not f.needs_snapshot:
            return


def _sidecar(**kw: Any) -> KVCacheManager:
    return manager(
        [layer(0), layer(1, sliding_window=8)],
        num_blocks=24,
        host_memory_bytes=1 << 12,
        max_seq_len=64,
        **kw,
    )


def test_hits_are_the_sidecars_probes(make: Make) -> None:
    """Two sidecars with a full and a sliding-window layer group and a host tier, under a
    random workload of shared prefixes (evictions to the host, drops, onboarding, a
    restart): after every round, each sidecar's score for many prompts is its own probe
    (device) and probe_tiers (device or host), in blocks."""
    rng = np.random.default_rng(7)
    families = [rng.integers(0, 500, 60).tolist() for _ in range(5)]

    async def body() -> None:
        store = make()
        gate = ModelGate()
        managers = {"a": _sidecar(), "b": _sidecar()}
        followers = {n: Follower(n, n, ManagerSource(m), store, gate) for n, m in managers.items()}
        router = Router(store, gate, list(followers.values()))
        live: dict[str, list[str]] = {"a": [], "b": []}
        checked = hits = host = 0
        for round_ in range(24):
            if round_ == 12:  # b restarts: a new generation, an empty cache
                managers["b"] = _sidecar()
                followers["b"].source = ManagerSource(managers["b"])
                live["b"] = []
            for name, m in managers.items():
                for i in range(8):
                    ids = live[name]
                    if ids and (len(ids) > 3 or rng.random() < 0.4):
                        m.free(ids.pop(int(rng.integers(0, len(ids)))))
                        continue
                    n = int(rng.integers(5, 60))
                    prompt = families[int(rng.integers(0, 5))][:n]
                    try:
                        got = m.allocate(f"r{round_}.{i}", n, token_ids=prompt)
                    except Exception:
                        continue
                    m.commit(f"r{round_}.{i}", prompt[got.num_hit_tokens :])
                    ids.append(f"r{round_}.{i}")
                await sync(followers[name], m)
            for family in families:
                for n in (3, 9, 17, 30, 41, 60):
                    prompt = family[:n]
                    result = await router.route(RouteRequest(token_ids=prompt))
                    assert {s.sidecar for s in result.scores} == {"a", "b"}
                    for score in result.scores:
                        m = managers[score.sidecar]
                        device, more = m.probe_tiers(prompt)
                        assert score.device_hit_blocks * 4 == device == m.probe(prompt)
                        assert score.hit_blocks * 4 == device + more, (round_, n)
                        checked += 1
                        hits += device > 0
                        host += more > 0
        assert followers["b"].snapshots == 2 and followers["a"].snapshots == 1
        assert checked == 24 * 5 * 6 * 2 and hits > 200 and host > 20
        await store.close()

    run(body)


def test_a_salted_prefix_never_scores_for_another_scope(make: Make) -> None:
    async def body() -> None:
        store = make()
        gate = ModelGate()
        m = manager([layer(0)], num_blocks=32)
        f = Follower("a", "a", ManagerSource(m), store, gate)
        router = Router(store, gate, [f])
        prompt = list(range(30, 50))
        for rid, salt, lora in (("t", "tenant-a", None), ("l", None, 7)):
            m.allocate(rid, 20, token_ids=prompt, cache_salt=salt, lora_id=lora)
            m.commit(rid, prompt)
        await sync(f, m)

        async def hit(**kw: Any) -> int:
            return (await router.route(RouteRequest(token_ids=prompt, **kw))).scores[0].hit_blocks

        assert await hit(cache_salt="tenant-a") == 4  # 19 tokens reusable: 4 blocks
        assert await hit() == 0
        assert await hit(cache_salt="tenant-b") == 0
        assert await hit(lora_id=7) == 4
        assert await hit(lora_id=7, cache_salt="tenant-a") == 0
        assert await hit(lora_id="7") == 0  # a str LoRA id is another scope than an int
        await store.close()

    run(body)


def test_a_sidecar_of_another_model_is_refused() -> None:
    async def body() -> None:
        store = MemoryStore()
        gate = ModelGate()
        ok = Follower("a", "a", ManagerSource(manager([layer(0)])), store, gate)
        await ok.load()
        other = manager([layer(0)], tokens_per_block=8)
        bad = Follower("b", "b", ManagerSource(other), store, gate)
        with pytest.raises(ModelMismatch, match="8 tokens per block, layer groups \\[full\\]"):
            await bad.load()
        windowed = manager([layer(0, sliding_window=8)])
        with pytest.raises(ModelMismatch, match="window 8"):
            await Follower("c", "c", ManagerSource(windowed), store, gate).load()
        pinned = ModelGate(tokens_per_block=8)
        with pytest.raises(ModelMismatch, match="--tokens-per-block"):
            await Follower("a", "a", ManagerSource(manager([layer(0)])), store, pinned).load()
        assert bad.needs_snapshot and store.cursors.keys() == {"a"}

    run(body)


def test_an_all_blocks_cleared_event_drops_everything_before_it(make: Make) -> None:
    async def body() -> None:
        store = make()
        m = manager([layer(0)], num_blocks=32)
        f = Follower("a", "a", ManagerSource(m), store, ModelGate())
        await sync(f, m)
        prompt = list(range(9))
        m.allocate("x", 9, token_ids=prompt)
        m.commit("x", prompt)
        m.free("x")
        m.reset_prefix_cache()  # one all_blocks_cleared event
        m.allocate("y", 5, token_ids=prompt[:5])
        m.commit("y", prompt[:5])
        batch = m.events(f.cursor.last_seq)
        assert [e.kind for e in batch.events] == [
            "block_stored",
            "all_blocks_cleared",
            "block_stored",
        ]
        await f.ingest(batch)
        assert f.cursor == Cursor(1, m.generation, 3) and f.snapshots == 1
        if isinstance(store, RedisStore):
            assert await store.sweep() == 2  # x's two blocks, in the dropped slot 0
        assert await contents(store) == {
            bytes.fromhex(k): 0b100 for k in batch.events[2].block_keys
        }
        await store.close()

    run(body)


def test_a_stalled_load_is_reclaimed(redis_server: RedisServer) -> None:
    """A load whose router stalled past the lease is swept; the stalled writer's next chunk
    is refused rather than writing into a slot that may be someone else's."""

    async def body() -> None:
        s = RedisStore(redis_server.url, "stall", lease_s=0.2)
        await s.bind(FULL)
        slot = await s._run("CLAIM", [s.slots, s.free, s.next], [b"a", s.lease_ms, 8])
        await s._write(slot, b"a", [s.slots, s.block_prefix + K[0]], [7, 1])
        assert await contents(s) == {K[0]: 0b1}
        time.sleep(0.4)
        assert await s.sweep() == 1
        with pytest.raises(IndexUnavailable, match="outlived its lease"):
            await s._write(slot, b"a", [s.slots, s.block_prefix + K[1]], [7, 1])
        assert await contents(s) == {}
        await s.close()

    run(body)


def test_prompt_keys_are_block_keys_a_slice_at_a_time() -> None:
    """The router hashes long prompts in slices (yielding to its followers between them):
    the keys are still ``block_keys``', extra keys and images included, and the reusable
    count is ``probe``'s."""
    from kvcm import block_keys
    from kvcm.router.service import HASH_SLICE, prompt_keys

    tokens = [(7 * i) % 1000 for i in range(4 * (2 * HASH_SLICE + 3) + 2)]  # 3 slices, a tail
    image = [{"digest": "img", "start": 4 * HASH_SLICE - 2, "length": 5}]  # across a slice
    for kw in ({}, {"cache_salt": "t", "lora_id": 3, "multimodal": image}):
        keys, cap = asyncio.run(prompt_keys(RouteRequest(token_ids=tokens, **kw), FULL))
        assert keys == block_keys(tokens, 4, **kw) and len(keys) == 2 * HASH_SLICE + 3
        assert cap == len(keys)  # the 2-token tail holds the last token
    keys, cap = asyncio.run(prompt_keys(RouteRequest(token_ids=tokens[:8]), FULL))
    assert (len(keys), cap) == (2, 1)
    assert asyncio.run(prompt_keys(RouteRequest(token_ids=[]), FULL)) == ([], 0)


def test_the_router_loads_no_torch() -> None:
    """What ``kvcm router`` imports (docs/router.md: a small process)."""
    import subprocess
    import sys

    code = (
        "import sys, kvcm.cli\n"
        "from kvcm.router import app, follower, memory_store, redis_store, service\n"
        "from kvcm.server.protocol import with_deadline\n"
        "print('torch' in sys.modules, 'kvcm.manager' in sys.modules)\n"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert run.stdout.split() == ["False", "False"]


# -- leases, sweeps and replicas: interleavings, driven step by step ------------------------------


async def eventually(check: Callable[[], Awaitable[bool]], what: str, timeout: float = 4.0) -> None:
    """Wait (yielding to the loop) until ``check`` holds; fails with ``what`` otherwise."""
    deadline = time.monotonic() + timeout
    while not await check():
        assert time.monotonic() < deadline, f"never: {what}"
        await asyncio.sleep(0.02)


def _prompt_in(m: KVCacheManager) -> list[int]:
    prompt = list(range(100, 117))
    m.allocate("p", 17, token_ids=prompt)
    m.commit("p", prompt)
    return prompt


async def _scored(router: Router, prompt: list[int]) -> dict[str, int]:
    result = await router.route(RouteRequest(token_ids=prompt))
    return {s.sidecar: s.hit_blocks for s in result.scores}


def test_a_replica_renews_the_slot_another_replica_loaded(redis_server: RedisServer) -> None:
    """Two routers follow an idle sidecar; B loads it again (its cursor moves to B's slot
    while A's follower still holds the old one), then B stops. A's lease renewals go to the
    store cursor's slot, by name, so the sidecar stays scored past the lease."""

    async def body() -> None:
        m = manager([layer(0)], num_blocks=32)
        prompt = _prompt_in(m)
        routers = []
        for _ in range(2):
            store = RedisStore(redis_server.url, "replicas", lease_s=0.3)
            gate = ModelGate()
            f = Follower("a", "a", ManagerSource(m), store, gate)
            routers.append(Router(store, gate, [f]))
        (ra, fa), (rb, fb) = ((r, r.followers[0]) for r in routers)
        await sync(fa, m)
        fb.resync()  # e.g. lost events: B loads a snapshot of its own
        await sync(fb, m)
        assert (fa.cursor.slot, fb.cursor.slot) == (0, 1) and fa.state == fb.state == "following"
        await rb.store.close()  # B stops
        for _ in range(8):  # 0.8 s: past the lease, the sidecar idle
            await asyncio.sleep(0.1)
            await fa.ingest(m.events(fa.cursor.last_seq))
            await ra.upkeep(sweep=True)
        assert fa.state == "following"
        assert await ra.store.cursor("a") == Cursor(1, m.generation, fb.cursor.last_seq)
        assert await _scored(ra, prompt) == {"a": 4}
        await ra.store.close()

    run(body)


class FlakySource(ManagerSource):
    """A sidecar that can be made unreachable; its long-poll waits a little when idle."""

    down = False

    def _check(self) -> None:
        if self.down:
            raise ServiceUnavailable("the sidecar cannot be reached")

    async def model(self) -> Any:
        self._check()
        return await super().model()

    async def index_snapshot(self) -> Any:
        self._check()
        return await super().index_snapshot()

    async def events(self, after: int = 0, limit: int = 1000, timeout_s: float = 0.0) -> Any:
        await asyncio.sleep(0.02)
        self._check()
        return await super().events(after, limit, timeout_s)

    async def stats(self) -> Any:
        self._check()
        return await super().stats()


def test_a_sidecar_back_after_its_lease_ran_out_is_loaded_again(
    redis_server: RedisServer,
) -> None:
    """A sidecar unreachable for longer than the lease is swept from the index; when it
    comes back in the same generation, idle, the router loads it again (the renewal finds
    no live cursor) rather than showing it following and never scoring it."""

    async def body() -> None:
        m = manager([layer(0)], num_blocks=32)
        prompt = _prompt_in(m)
        store = RedisStore(redis_server.url, "outage", lease_s=0.3)
        gate = ModelGate()
        source = FlakySource(m)
        f = Follower("a", "a", source, store, gate, poll_s=0.05, retry_s=0.02)
        router = Router(store, gate, [f], upkeep_s=0.05, sweep_s=0.05)
        await router.start()
        try:

            async def scored() -> bool:
                return await _scored(router, prompt) == {"a": 4}

            await eventually(lambda: _true(f.state == "following"), "a followed")
            await eventually(scored, "a scored")
            source.down = True
            await eventually(lambda: _true(f.state == "unreachable"), "a unreachable")
            await eventually(lambda: _none(store.cursor("a")), "a's lease ran out")
            source.down = False
            await eventually(scored, "a scored again")
            assert f.state == "following" and f.snapshots == 2
        finally:
            await router.stop()

    run(body)


async def _true(value: bool) -> bool:
    return value


async def _none(value: Awaitable[Any]) -> bool:
    return await value is None


class PinnedSource(ManagerSource):
    """A client pinned to the generation it first saw (``AsyncKVCacheClient``): any call
    answered by another generation raises ``StaleGeneration`` until ``reconnect``."""

    def __init__(self, m: KVCacheManager, pinned: str) -> None:
        super().__init__(m)
        self.pinned: str | None = pinned
        self.calls = 0

    def _pin(self, value: Any) -> Any:
        self.calls += 1
        if self.pinned is not None and self.pinned != self.m.generation:
            raise StaleGeneration("the service restarted: call reconnect()")
        self.pinned = self.m.generation
        return value

    async def model(self) -> Any:
        await asyncio.sleep(0)  # a network call: the loop gets a turn
        return self._pin(await super().model())

    async def index_snapshot(self) -> Any:
        return self._pin(await super().index_snapshot())

    async def events(self, after: int = 0, limit: int = 1000, timeout_s: float = 0.0) -> Any:
        await asyncio.sleep(0.02)
        return self._pin(await super().events(after, limit, timeout_s))

    def reconnect(self) -> None:
        self.pinned = None


def test_a_router_resuming_a_sidecar_that_restarted_loads_it(make: Make) -> None:
    """The store has a cursor of the sidecar's old generation and the router's client is
    pinned to it (by its stats poller), but the sidecar restarted: the follower unpins and
    loads a snapshot of the new generation instead of retrying the resume forever."""

    async def body() -> None:
        store = make()
        gate = ModelGate()
        m = manager([layer(0)], num_blocks=32)
        prompt = _prompt_in(m)
        await gate.admit("a", m.model(), store.bind)
        await store.replace("a", "old-generation", 9, [])
        source = PinnedSource(m, "old-generation")
        f = Follower("a", "a", source, store, gate, poll_s=0.05, retry_s=0.02)
        router = Router(store, gate, [f])
        task = asyncio.create_task(f._follow())
        try:
            await eventually(lambda: _true(f.snapshots > 0 or source.calls > 200), "a load")
        finally:
            f.stopping = True
            await task
        assert f.snapshots == 1 and source.calls < 200
        assert f.state == "following" and f.cursor.generation == m.generation
        assert await _scored(router, prompt) == {"a": 4}
        await store.close()

    run(body)


def _before_first_scan(s: RedisStore, meanwhile: Callable[[], Awaitable[None]]) -> None:
    """Run ``meanwhile`` when ``s``'s sweep has read its dead slots, before its first scan."""
    scan = s.redis.scan
    ran = False

    async def hooked(*args: Any, **kw: Any) -> Any:
        nonlocal ran
        if not ran:
            ran = True
            await meanwhile()
        return await scan(*args, **kw)

    s.redis.scan = hooked  # type: ignore[method-assign]


def test_a_sweep_spares_a_new_load_in_a_slot_redis_lost_mid_sweep(
    redis_server: RedisServer,
) -> None:
    """Redis restarts empty while a sweep that read slot 0 as dead runs; a follower loads
    into slot 0 again (the counter starts over): the sweep leaves that load's bits alone."""

    async def body() -> None:
        s = RedisStore(redis_server.url, "flushed")
        other = RedisStore(redis_server.url, "flushed")
        await s.bind(FULL)
        await other.bind(FULL)
        await s.replace("a", "g1", 0, [Group(0, DEVICE, [K[0]])])
        await s.replace("a", "g2", 0, [Group(0, DEVICE, [K[1]])])  # slot 0 dead, 1 a's

        async def flush_and_load() -> None:
            await s.redis.flushdb()
            assert not await other.check()
            assert await other.replace("b", "g", 0, [Group(0, DEVICE, K[0:2])]) == Cursor(0, "g", 0)

        _before_first_scan(s, flush_and_load)
        assert await s.sweep() == 0
        assert await contents(s) == {K[0]: 0b1, K[1]: 0b1}
        assert await s.redis.get(s.lock) is None
        await s.close()
        await other.close()

    run(body)


def test_a_sweep_whose_lock_ran_out_mid_scan_stops(redis_server: RedisServer) -> None:
    """A sweep's lock runs out while it scans; another router sweeps, frees slot 0, and a
    new load takes it: the first sweep clears nothing of it and frees nothing, and does not
    release the lock another router holds now."""

    async def body() -> None:
        s = RedisStore(redis_server.url, "lock")
        other = RedisStore(redis_server.url, "lock")
        await s.bind(FULL)
        await other.bind(FULL)
        await s.replace("a", "g1", 0, [Group(0, DEVICE, [K[0]])])
        await s.replace("a", "g2", 0, [Group(0, DEVICE, [K[1]])])  # slot 0 dead, 1 a's

        async def expire_sweep_and_load() -> None:
            await s.redis.delete(s.lock)  # ran out
            assert await other.sweep() == 1  # slot 0 cleared and freed
            assert await other.replace("b", "g", 0, [Group(0, DEVICE, K[0:2])]) == Cursor(0, "g", 0)
            await s.redis.set(s.lock, b"a third router's")

        _before_first_scan(s, expire_sweep_and_load)
        assert await s.sweep() == 0
        assert await contents(s) == {K[0]: 0b1, K[1]: 0b101}  # b's slot 0, a's slot 1
        assert await s.redis.get(s.lock) == b"a third router's"
        assert await s.redis.hget(s.slots, "0") is not None  # b's slot, not freed
        await s.close()
        await other.close()

    run(body)


def test_a_late_all_blocks_cleared_never_moves_the_cursor_back(make: Make) -> None:
    """Replicas follow one sidecar. B applies an ``all_blocks_cleared`` and the events after
    it; A, late, applies the clear: it is refused (the stored cursor moved on), so the
    cursor does not go back to the clear (dropping B's later blocks), and A goes on from the
    store's. Then the sidecar is loaded in another generation: a lagging replica's clear of
    the old one changes nothing."""

    async def body() -> None:
        store = make()
        gate = ModelGate()
        m = manager([layer(0)], num_blocks=32)
        fa, fb, fc = (Follower("a", "a", ManagerSource(m), store, gate) for _ in range(3))
        await sync(fa, m)
        for f in (fb, fc):  # replicas that resumed from fa's load
            f.cursor, f.admitted, f.needs_snapshot = fa.cursor, fa.admitted, False
        m.reset_prefix_cache()  # an all_blocks_cleared at seq 1
        prompt = _prompt_in(m)  # then blocks stored at seq 2
        batch = m.events(0)
        assert [e.kind for e in batch.events] == ["all_blocks_cleared", "block_stored"]
        await fb.ingest(batch)
        assert fb.cursor == Cursor(1, m.generation, 2)
        await fa.ingest(m.events(0, 1))  # A, late: the clear alone
        assert await store.cursor("a") == fb.cursor == fa.cursor
        router = Router(store, gate, [fa])
        assert await _scored(router, prompt) == {"a": 4}

        newer = await store.replace("a", "g2", 5, [Group(0, DEVICE, [K[0]])])
        await fc.ingest(m.events(0))  # a lagging replica: the old generation's clear, refused
        assert await store.cursor("a") == newer == fc.cursor
        await store.close()

    run(body)


def test_a_claim_never_takes_a_slot_in_use(redis_server: RedisServer) -> None:
    """With the slot counter lost (evicted), a load is refused rather than overwriting a
    slot in use, and a retry goes on to a free one."""

    async def body() -> None:
        s = RedisStore(redis_server.url, "evicted")
        await s.bind(FULL)
        a = await s.replace("a", "g", 0, [Group(0, DEVICE, [K[0]])])
        await s.replace("b", "g", 0, [Group(0, DEVICE, [K[1]])])
        await s.redis.delete(s.next)
        for _ in range(2):  # slots 0 and 1 are a's and b's
            with pytest.raises(IndexUnavailable, match="noeviction"):
                await s.replace("c", "g", 0, [Group(0, DEVICE, [K[2]])])
        assert await s.replace("c", "g", 0, [Group(0, DEVICE, [K[2]])]) == Cursor(2, "g", 0)
        assert await s.cursor("a") == a
        assert (await s.redis.hget(s.slots, "0")).startswith(b"live ")
        assert await contents(s) == {K[0]: 0b1, K[1]: 0b100, K[2]: 0b1_0000}
        await s.close()

    run(body)


def test_upkeep_loads_again_only_followers_not_loading_already() -> None:
    """A followed sidecar the store holds nothing of is loaded again, unless its follower is
    loading it now (that load brings its cursor)."""

    async def body() -> None:
        store = MemoryStore()
        gate = ModelGate()
        followers = [Follower(n, n, ManagerSource(manager([layer(0)])), store, gate) for n in "ab"]
        for f in followers:
            f.cursor, f.state, f.needs_snapshot = Cursor(0, "g", 0), "following", False
        followers[1].loading = True
        await Router(store, gate, followers).upkeep()
        assert [f.needs_snapshot for f in followers] == [True, False]

    run(body)

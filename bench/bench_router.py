"""kvcm router benchmarks: scoring, event visibility, index bytes, restart (docs/router.md).

  python bench/bench_router.py            # full run (about 3 minutes; starts a redis-server)
  python bench/bench_router.py --quick    # smoke run
  python bench/bench_router.py --redis-url redis://127.0.0.1:6379/0   # an existing Redis

Simulated sidecars (``SyntheticSidecar``: a key set and an event log, with ``kvcm serve``'s
snapshot, long-poll and stats calls, in this process) are followed by the router's own
``Follower`` loops, so events go through the same ingest code as from HTTP (the HTTP hop
itself is not in these figures). 16 tokens per block, one full-attention layer group.

1. Score latency: 64 sidecars each cache prefixes of 4 of 16 shared 32k-token documents
   (random lengths); prompts of 32k tokens (a document and a unique tail) arrive at a fixed
   rate while every sidecar publishes and evicts a 32-block request twice a second. Latency
   is from each request's scheduled arrival to its answer (``Router.route``: hashing, index
   reads, ranking). Baseline, same prompts: one ``IndexMirror``-style set of hex keys per
   sidecar, walked sidecar by sidecar. Also the worst case: all 64 hold the whole prompt.
2. Event-to-index visibility: from an event batch's append on a simulated sidecar to the end
   of its write to the store (the follower's long-poll is waiting), under the load of 1.
3. Index bytes: per block key and per (block, sidecar), in process (tracemalloc), in Redis
   (``INFO`` used_memory and ``MEMORY USAGE``), and the per-sidecar hex-set baseline.
4. Restart at 1M indexed blocks (64 sidecars): a router restarted on Redis resumes every
   sidecar from its cursor there; the baselines load every snapshot again (in process, and
   into an emptied Redis), snapshot JSON parsing included.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import json
import os
import platform
import random
import shutil
import socket
import statistics
import subprocess
import time
import tracemalloc
from collections.abc import Callable
from pathlib import Path
from typing import Any

import redis

from kvcm import KVCacheManager, block_keys
from kvcm.router.follower import Follower
from kvcm.router.keyspace import KeySpace, ModelGate
from kvcm.router.memory_store import MemoryStore
from kvcm.router.redis_store import RedisStore
from kvcm.router.service import Router
from kvcm.router.store import Group, IndexStore
from kvcm_client.models import IndexSnapshot, KVEvent, KVEvents, ModelInfo, Stats
from kvcm_client.routing import RouteRequest

TPB = 16
DOC_TOKENS = 32 * 1024
SIDECARS = 64


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def model_info() -> ModelInfo:
    """A real manager's model (one full-attention group, 16 tokens per block)."""
    return KVCacheManager(
        {
            "layers": [{"layer_id": 0, "num_kv_heads": 1, "head_dim": 8}],
            "tokens_per_block": TPB,
            "num_blocks": 8,
            "max_seq_len": 64,
        }
    ).model()


class SyntheticSidecar:
    """What a follower asks a sidecar, over a key set and an event log in memory."""

    def __init__(self, info: ModelInfo, generation: str) -> None:
        self.info = info.model_copy(update={"generation": generation})
        self.generation = generation
        self.keys: set[str] = set()
        self.log: list[KVEvent] = []
        self.appended: dict[int, float] = {}  # seq -> when its batch was appended
        self.wave = asyncio.Event()
        self.snapshot_json: bytes | None = None

    def publish(self, stored: list[str], removed: list[str]) -> None:
        now = time.perf_counter()
        for kind, keys in (("block_stored", stored), ("block_removed", removed)):
            if keys:
                seq = len(self.log) + 1
                self.log.append(KVEvent(seq=seq, kind=kind, layer_group=0, block_keys=keys))
                self.appended[seq] = now
        self.keys.update(stored)
        self.keys.difference_update(removed)
        self.wave.set()
        self.wave = asyncio.Event()

    async def model(self) -> ModelInfo:
        return self.info

    async def index_snapshot(self) -> IndexSnapshot:
        if self.snapshot_json is not None:  # parsed as the client parses the service's
            return IndexSnapshot.model_validate_json(self.snapshot_json)
        groups = [{"layer_group": 0, "tier": "device", "block_keys": sorted(self.keys)}]
        return IndexSnapshot(generation=self.generation, last_seq=len(self.log), groups=groups)

    async def events(self, after: int = 0, limit: int = 1000, timeout_s: float = 0.0) -> KVEvents:
        if len(self.log) <= after and timeout_s > 0:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.wave.wait(), timeout_s)
        events = self.log[after : after + limit]
        return KVEvents(
            events=events, last_seq=len(self.log), lost=False, generation=self.generation
        )

    async def stats(self) -> Stats:
        return Stats(
            num_requests=3,
            free_blocks={0: 1000},
            used_blocks={0: 3000},
            total_blocks={0: 4000},
            request_free_blocks=1000,
            request_total_blocks=4000,
        )

    def reconnect(self) -> None:
        """Nothing pinned."""


def router_over(store: IndexStore, sources: list[SyntheticSidecar], poll_s: float = 5.0) -> Router:
    gate = ModelGate()
    followers = [
        Follower(f"s{i}", f"http://sidecar-{i}", src, store, gate, poll_s=poll_s)
        for i, src in enumerate(sources)
    ]
    return Router(store, gate, followers)


# -- 1 and 2: scoring under event load -------------------------------------------------------


def documents(n: int, rng: random.Random) -> list[list[int]]:
    return [[rng.randrange(100_000) for _ in range(DOC_TOKENS)] for _ in range(n)]


def fleet(info: ModelInfo, docs: list[list[str]], rng: random.Random) -> list[SyntheticSidecar]:
    """64 sidecars, each holding a random-length prefix of 4 of the documents."""
    out = []
    for i in range(SIDECARS):
        s = SyntheticSidecar(info, f"gen-{i}")
        for d in rng.sample(range(len(docs)), 4):
            s.keys.update(docs[d][: rng.randrange(len(docs[d]) + 1)])
        out.append(s)
    return out


async def churn(sources: list[SyntheticSidecar], rate: float, stop: asyncio.Event) -> None:
    """Every sidecar publishes a 32-block request and evicts its previous one, ``rate``
    times a second (random phases)."""

    start = time.perf_counter()

    async def one(s: SyntheticSidecar, seed: int) -> None:
        rng = random.Random(seed)
        due = start + rng.random() / rate
        previous: list[str] = []
        while not stop.is_set():
            # On an absolute schedule: a stall of the loop delays publishes, but does not
            # leave them in step with each other afterwards.
            await asyncio.sleep(max(0.0, due - time.perf_counter()))
            fresh = [rng.randbytes(32).hex() for _ in range(32)]
            s.publish(fresh, previous)
            previous = fresh
            due += 1 / rate

    await asyncio.gather(*(one(s, i) for i, s in enumerate(sources)))


def baseline_score(sets: list[set[str]], prompt: list[int]) -> list[tuple[int, int]]:
    """Per-sidecar hex sets walked sidecar by sidecar (an ``IndexMirror`` per sidecar)."""
    keys = [k.hex() for k in block_keys(prompt, TPB)]
    cap = min(len(keys), (len(prompt) - 1) // TPB)
    out = []
    for i, held in enumerate(sets):
        n = 0
        while n < cap and keys[n] in held:
            n += 1
        out.append((n, i))
    return sorted(out, reverse=True)


async def scoring(
    store: IndexStore,
    info: ModelInfo,
    docs: list[list[int]],
    doc_keys: list[list[str]],
    requests: int,
    rate: float,
    churn_rate: float,
    seed: int,
) -> dict[str, Any]:
    rng = random.Random(seed)
    sources = fleet(info, doc_keys, rng)
    router = router_over(store, sources)
    visible: list[float] = []
    recording = {"on": True}
    for f, src in zip(router.followers, sources, strict=True):
        await f.load()
        done = {"seq": len(src.log)}

        def seen(
            _: str, n: int, f: Follower = f, src: SyntheticSidecar = src, done: Any = done
        ) -> None:
            """From the append of the batch's first event to the end of its write."""
            assert f.cursor is not None
            if recording["on"]:
                visible.append(time.perf_counter() - src.appended[done["seq"] + 1])
            done["seq"] = f.cursor.last_seq

        f.on_events = seen
    await router.start()
    prompts = [  # a document's prefix and a unique last block: 32k tokens
        [*docs[rng.randrange(len(docs))][: DOC_TOKENS - TPB], *rng.sample(range(10**5), TPB)]
        for _ in range(requests)
    ]
    latencies: list[float] = []
    best: list[int] = []

    async def one(prompt: list[int], due: float) -> None:
        delay = due - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        result = await router.route(RouteRequest(token_ids=prompt))
        latencies.append(time.perf_counter() - due)
        best.append(result.scores[0].hit_blocks)

    for p in prompts[:5]:  # warm up (connections to Redis)
        await router.route(RouteRequest(token_ids=p))
    # The bench's own data (documents, 32k-token prompts, the simulated sidecars) out of the
    # collector's walks: a router holds none of it. What the router allocates still counts.
    gc.collect()
    gc.freeze()
    stop = asyncio.Event()
    churning = asyncio.create_task(churn(sources, churn_rate, stop))
    await asyncio.sleep(0.5)  # churn under way
    start = time.perf_counter() + 0.05
    await asyncio.gather(*(one(p, start + i / rate) for i, p in enumerate(prompts)))
    stop.set()
    await churning
    recording["on"] = False
    # The baseline on the same prompts, and the worst case: every sidecar holds all of one.
    sets = [set(s.keys) for s in sources]
    alone, base = [], []
    for p in prompts[: max(10, requests // 4)]:
        t0 = time.perf_counter()
        await router.route(RouteRequest(token_ids=p))
        t1 = time.perf_counter()
        baseline_score(sets, p)
        alone.append(t1 - t0)
        base.append(time.perf_counter() - t1)
    full = docs[0]
    for s in sources:
        s.publish(doc_keys[0], [])
    while any(
        f.cursor.last_seq < len(s.log) for f, s in zip(router.followers, sources, strict=True)
    ):
        await asyncio.sleep(0.01)
    worst = []
    for _ in range(max(10, requests // 8)):
        t0 = time.perf_counter()
        result = await router.route(RouteRequest(token_ids=full))
        worst.append(time.perf_counter() - t0)
    assert [s.hit_blocks for s in result.scores] == [DOC_TOKENS // TPB - 1] * SIDECARS
    base_worst = []
    sets = [set(s.keys) for s in sources]
    for _ in range(max(10, requests // 8)):
        t0 = time.perf_counter()
        baseline_score(sets, full)
        base_worst.append(time.perf_counter() - t0)
    t0 = time.perf_counter()
    block_keys(full, TPB)
    hashing = time.perf_counter() - t0
    await router.stop()
    gc.unfreeze()
    ms = 1e3
    return {
        "requests": requests,
        "rate": rate,
        "score_p50_ms": percentile(latencies, 0.5) * ms,
        "score_p99_ms": percentile(latencies, 0.99) * ms,
        "alone_p50_ms": percentile(alone, 0.5) * ms,
        "alone_p99_ms": percentile(alone, 0.99) * ms,
        "baseline_p50_ms": percentile(base, 0.5) * ms,
        "baseline_p99_ms": percentile(base, 0.99) * ms,
        "worst_p50_ms": percentile(worst, 0.5) * ms,
        "worst_p99_ms": percentile(worst, 0.99) * ms,
        "baseline_worst_p50_ms": percentile(base_worst, 0.5) * ms,
        "hashing_ms": hashing * ms,
        "mean_best_hit_blocks": statistics.mean(best),
        "batches_seen": len(visible),
        "visible_p50_ms": percentile(visible, 0.5) * ms,
        "visible_p99_ms": percentile(visible, 0.99) * ms,
    }


# -- 3: index bytes --------------------------------------------------------------------------


def index_bytes(url: str, blocks: int, holders: int) -> dict[str, float]:
    """``blocks`` distinct keys, each held by ``holders`` of 64 sidecars."""
    rng = random.Random(3)
    keys = [rng.randbytes(32) for _ in range(blocks)]
    held = [
        [k for j, k in enumerate(keys) if (j + i) % SIDECARS < holders] for i in range(SIDECARS)
    ]
    pairs = sum(len(h) for h in held)
    info = model_info()

    async def load(store: IndexStore) -> None:
        await store.bind(KeySpace.of(info))
        for i, h in enumerate(held):
            await store.replace(f"s{i}", f"g{i}", 0, [Group(0, 0, h)])

    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    memory = MemoryStore()
    asyncio.run(load(memory))
    in_process = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    del memory

    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    mirror = [{k.hex() for k in h} for h in held]
    baseline = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    del mirror

    plain = redis.Redis.from_url(url)
    plain.flushdb()
    used0 = int(plain.info("memory")["used_memory"])

    async def redis_load() -> None:
        store = RedisStore(url, "bytes")
        await load(store)
        await store.close()

    asyncio.run(redis_load())
    used = int(plain.info("memory")["used_memory"]) - used0
    sample = [b"bytes:b:" + k for k in rng.sample(keys, min(2000, len(keys)))]
    usage = statistics.mean(plain.memory_usage(k, samples=0) for k in sample)
    plain.flushdb()
    plain.close()
    return {
        "blocks": blocks,
        "holders": holders,
        "in_process_bytes_per_block": in_process / blocks,
        "in_process_bytes_per_pair": in_process / pairs,
        "redis_used_bytes_per_block": used / blocks,
        "redis_memory_usage_per_key": usage,
        "baseline_bytes_per_block": baseline / blocks,
        "baseline_bytes_per_pair": baseline / pairs,
    }


# -- 4: restart ------------------------------------------------------------------------------


async def follow_all(router: Router) -> float:
    """Seconds until every follower is following and a route answers, from start()."""
    t0 = time.perf_counter()
    await router.start()
    while any(f.state != "following" for f in router.followers):
        await asyncio.sleep(0.001)
    await router.route(RouteRequest(token_ids=list(range(33))))
    return time.perf_counter() - t0


def restart(url: str, total: int) -> dict[str, float]:
    info = model_info()
    rng = random.Random(4)
    sources = [SyntheticSidecar(info, f"gen-{i}") for i in range(SIDECARS)]
    for s in sources:
        s.keys = {rng.randbytes(32).hex() for _ in range(total // SIDECARS)}
        groups = [{"layer_group": 0, "tier": "device", "block_keys": sorted(s.keys)}]
        s.snapshot_json = json.dumps(
            {"generation": s.generation, "last_seq": 0, "groups": groups}
        ).encode()

    async def run(make: Callable[[], IndexStore], snapshots: int) -> float:
        for s in sources:
            s.wave = asyncio.Event()  # of this run's event loop
        router = router_over(make(), sources)
        seconds = await follow_all(router)
        assert sum(f.snapshots for f in router.followers) == snapshots
        await router.stop()
        return seconds

    plain = redis.Redis.from_url(url)
    plain.flushdb()
    out = {"blocks": float(total)}
    out["redis_load_s"] = asyncio.run(run(lambda: RedisStore(url, "restart"), SIDECARS))
    out["redis_block_keys"] = float(plain.dbsize())
    out["redis_resume_s"] = asyncio.run(run(lambda: RedisStore(url, "restart"), 0))
    plain.flushdb()
    plain.close()
    out["in_process_load_s"] = asyncio.run(run(MemoryStore, SIDECARS))
    return out


# -- the run ---------------------------------------------------------------------------------


def start_redis() -> tuple[subprocess.Popen[bytes], str]:
    binary = shutil.which("redis-server")
    if binary is None:
        raise SystemExit("redis-server is not installed (apt-get install -y redis-server)")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    proc = subprocess.Popen(
        [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
        stdout=subprocess.DEVNULL,
    )
    url = f"redis://127.0.0.1:{port}/0"
    client = redis.Redis.from_url(url)
    for _ in range(200):
        try:
            client.ping()
            break
        except redis.ConnectionError:
            time.sleep(0.02)
    client.close()
    return proc, url


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--redis-url", help="an existing Redis (its database is flushed)")
    parser.add_argument("--rate", type=float, default=20.0, help="route requests per second")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    proc, url = (None, args.redis_url) if args.redis_url else start_redis()
    try:
        rng = random.Random(1)
        info = model_info()
        docs = documents(4 if args.quick else 16, rng)
        doc_keys = [[k.hex() for k in block_keys(d, TPB)] for d in docs]
        requests = 20 if args.quick else 400
        results: dict[str, Any] = {}
        for name, make in (("memory", MemoryStore), ("redis", lambda: RedisStore(url, "score"))):
            if name == "redis":
                redis.Redis.from_url(url).flushdb()
            results[f"score_{name}"] = asyncio.run(
                scoring(make(), info, docs, doc_keys, requests, args.rate, 2.0, seed=2)
            )
        results["bytes"] = index_bytes(url, 20_000 if args.quick else 200_000, 8)
        results["restart"] = restart(url, 50_000 if args.quick else 1_000_000)
    finally:
        if proc is not None:
            proc.kill()
            proc.wait()
    report(results, args)
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))


def report(r: dict[str, Any], args: argparse.Namespace) -> None:
    print(
        f"kvcm router bench on {platform.node()} ({os.cpu_count()} CPUs, "
        f"{platform.python_version()}); {SIDECARS} simulated sidecars, {DOC_TOKENS}-token "
        f"prompts, {TPB} tokens per block"
    )
    print()
    print("| measure | in process | redis | baseline |")
    print("|---|---|---|---|")
    m, rd = r["score_memory"], r["score_redis"]
    print(
        f"| score p50 / p99 ms, {m['rate']:.0f} req/s open loop, with churn (mean best hit "
        f"{m['mean_best_hit_blocks']:.0f} blocks) | {m['score_p50_ms']:.2f} / "
        f"{m['score_p99_ms']:.2f} | {rd['score_p50_ms']:.2f} / {rd['score_p99_ms']:.2f} | - |"
    )
    print(
        f"| score p50 / p99 ms, the same prompts one at a time | {m['alone_p50_ms']:.2f} / "
        f"{m['alone_p99_ms']:.2f} | {rd['alone_p50_ms']:.2f} / {rd['alone_p99_ms']:.2f} | "
        f"{m['baseline_p50_ms']:.2f} / {m['baseline_p99_ms']:.2f} |"
    )
    print(
        f"| score p50 / p99 ms, all 64 hold the whole prompt | {m['worst_p50_ms']:.2f} / "
        f"{m['worst_p99_ms']:.2f} | {rd['worst_p50_ms']:.2f} / {rd['worst_p99_ms']:.2f} | "
        f"{m['baseline_worst_p50_ms']:.2f} / - |"
    )
    print(f"| of which hashing the prompt, ms | {m['hashing_ms']:.2f} | | |")
    print(
        f"| event-to-index visibility p50 / p99 ms ({m['batches_seen']} / "
        f"{rd['batches_seen']} batches) | {m['visible_p50_ms']:.2f} / "
        f"{m['visible_p99_ms']:.2f} | {rd['visible_p50_ms']:.2f} / {rd['visible_p99_ms']:.2f} | |"
    )
    b = r["bytes"]
    print(
        f"| index bytes per block ({b['blocks']} blocks, {b['holders']} holders each) | "
        f"{b['in_process_bytes_per_block']:.0f} | {b['redis_used_bytes_per_block']:.0f} "
        f"(MEMORY USAGE {b['redis_memory_usage_per_key']:.0f}) | "
        f"{b['baseline_bytes_per_block']:.0f} |"
    )
    s = r["restart"]
    print(
        f"| restart to complete, s ({s['blocks']:.0f} blocks) | load snapshots "
        f"{s['in_process_load_s']:.2f} | resume {s['redis_resume_s']:.3f} (load snapshots "
        f"{s['redis_load_s']:.2f}) | |"
    )


if __name__ == "__main__":
    main()

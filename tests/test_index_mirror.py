"""Following a sidecar's prefix index (docs/prefix-reuse.md#following-the-index): a snapshot
and the events after it give exactly the index the manager has, through evictions, the host
tier, lost events and new generations."""

from __future__ import annotations

import numpy as np
from helpers import layer, manager

from kvcm import KVCacheManager
from kvcm_client.index_mirror import IndexMirror
from kvcm_client.models import IndexSnapshot


def _truth(m: KVCacheManager) -> dict[tuple[int, str], set[str]]:
    """What the manager caches, straight from its indexes (not from a snapshot)."""
    out: dict[tuple[int, str], set[str]] = {}
    for g, index in enumerate(m.parts.coord.cache.index):
        keys = {k.hex() for scope in index.values() for k in scope}
        if keys:
            out[(g, "device")] = keys
    if m.parts.host is not None:
        for lru in m.parts.host.lru.values():
            for g, _, key in lru:
                out.setdefault((g, "host"), set()).add(key.hex())
    return out


def _sync(mirror: IndexMirror, m: KVCacheManager, limit: int = 1000) -> int:
    """Follow until caught up; returns how many snapshots it took."""
    snapshots = 0
    while True:
        if mirror.needs_snapshot:
            mirror.load(m.index_snapshot())
            snapshots += 1
        batch = m.events(mirror.last_seq, limit)
        if not mirror.apply(batch):
            continue
        if not batch.events:
            return snapshots


def test_a_snapshot_then_events_is_the_managers_index() -> None:
    """A random workload of shared prefixes on a small pool with a host tier: blocks are
    stored, evicted to the host, dropped there, onboarded, all of it in events of both tiers.
    The mirror, followed in small batches, equals the manager's indexes at every check."""
    rng = np.random.default_rng(0)
    m = manager([layer(0), layer(1, sliding_window=8)], num_blocks=24, host_memory_bytes=1 << 12)
    mirror = IndexMirror()
    assert _sync(mirror, m) == 1 and mirror.as_sets() == {}
    families = [rng.integers(0, 500, 48).tolist() for _ in range(5)]
    live: list[str] = []
    for i in range(400):
        if live and (len(live) > 3 or rng.random() < 0.4):
            m.free(live.pop(int(rng.integers(0, len(live)))))
        else:
            n = int(rng.integers(5, 40))
            prompt = families[int(rng.integers(0, 5))][:n]
            try:
                info = m.allocate(f"r{i}", n, token_ids=prompt)
            except Exception:
                continue
            m.commit(f"r{i}", prompt[info.num_hit_tokens :])
            live.append(f"r{i}")
        if i % 25 == 0:
            assert _sync(mirror, m, limit=7) == 0  # caught up by events alone
            assert mirror.as_sets() == _truth(m)
    assert _sync(mirror, m) == 0 and mirror.as_sets() == _truth(m)
    assert any(tier == "host" for _, tier in mirror.as_sets())
    assert m.host_stats()["onboarded_blocks"] > 0


def test_lost_events_and_a_new_generation_mean_a_new_snapshot() -> None:
    m = manager([layer(0)], num_blocks=32, kv_event_buffer=4)
    mirror = IndexMirror()
    _sync(mirror, m)
    prompt = list(range(20))
    m.allocate("a", 20, token_ids=prompt)
    m.commit("a", prompt)  # one stored event per layer group: 1
    assert _sync(mirror, m) == 0
    for i in range(6):  # 6 more events: more than the buffer of 4 since the mirror's seq
        p = list(range(100 * (i + 1), 100 * (i + 1) + 5))
        m.allocate(f"b{i}", 5, token_ids=p)
        m.commit(f"b{i}", p)
    batch = m.events(mirror.last_seq)
    assert batch.lost and not mirror.apply(batch) and mirror.needs_snapshot
    assert _sync(mirror, m) == 1 and mirror.as_sets() == _truth(m)
    # A new generation (a registration): sequence numbers start again; the old index is
    # stale even though the numbers look fine.
    old = mirror.generation
    for rid in m.request_ids():
        m.free(rid)
    m.register_model(layers=[layer(0)], num_blocks=32, max_seq_len=64, max_requests=8)
    batch = m.events(0)
    assert batch.generation != old and not mirror.apply(batch)
    assert _sync(mirror, m) == 1 and mirror.generation == m.generation
    assert mirror.as_sets() == {}


def test_the_service_serves_snapshots_and_generations() -> None:
    from servers import serve_in_thread

    from kvcm.server.app import create_app
    from kvcm_client import KVCacheClient

    m = manager([layer(0)], num_blocks=32)
    with serve_in_thread(create_app(m)) as url, KVCacheClient(url) as kv:
        prompt = list(range(12))
        kv.allocate("a", 12, token_ids=prompt)
        kv.commit("a", prompt)
        snap = kv.index_snapshot()
        assert isinstance(snap, IndexSnapshot) and snap.generation == m.generation
        assert snap.last_seq == kv.events().last_seq == 1
        assert [(g.layer_group, g.tier, len(g.block_keys)) for g in snap.groups] == [
            (0, "device", 3)
        ]
        mirror = IndexMirror()
        mirror.load(snap)
        kv.free("a")
        kv.allocate("x", 48)  # every slot but ... evicts a's cached blocks
        assert mirror.apply(kv.events(mirror.last_seq))
        assert mirror.as_sets() == _truth(m)

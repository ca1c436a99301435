"""The host tier (docs/host-tier.md): evicted cached blocks offloaded to host memory, prefix
hits onboarded from it, with a checksum in every block's KV to prove nothing is corrupted."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from helpers import layer, manager

from kvcm import KVCacheManager, block_keys
from kvcm.host_tier import BlockState
from kvcm_client.errors import InvalidArgument, OutOfBlocks, status_of

TPB = 4


def _words(m: KVCacheManager, group: int = 0) -> np.ndarray:
    """The first pool of a layer group's pool group as int64 words, [slots, words per slot]:
    the test writes checksums into word 0 of a block's slot (a slot belongs to one block of
    one layer group at a time, even where layer groups share a pool group)."""
    pg = m.layout.layer_groups[group].pool_group
    pool = m.memory.tensors[m.layout.pool_groups[pg].pools[0]]
    return pool.view(-1).numpy().view(np.int64).reshape(pool.shape[0], -1)


class Words:
    """Word 0 of each slot of ``memory`` (``[slots, slot_bytes]`` uint8: a pool, or a state
    group's slots), on any device: where the random test writes checksums (a numpy view on
    the CPU, int64 tensor ops on CUDA)."""

    def __init__(self, memory: torch.Tensor) -> None:
        self.cpu = memory.device.type == "cpu"
        words = memory.view(torch.int64)
        self.words = words.numpy() if self.cpu else words

    @staticmethod
    def of_group(m: KVCacheManager, group: int) -> Words:
        """Those of a layer group's first pool (a slot belongs to one block of one layer
        group at a time, even where layer groups share a pool group)."""
        pg = m.layout.layer_groups[group].pool_group
        return Words(m.memory.tensors[m.layout.pool_groups[pg].pools[0]])

    def write(self, slot: int, value: int) -> None:
        self.words[slot, 0] = value

    def read(self, slots: list[int]) -> list[int]:
        if self.cpu:
            return self.words[slots, 0].tolist()
        return self.words[torch.tensor(slots, device=self.words.device), 0].tolist()


def _sum(tokens: list[int]) -> int:
    """The KV content the test writes for a block whose prefix is ``tokens``."""
    return hash(tuple(tokens)) & 0x7FFF_FFFF_FFFF_FFFF


def test_evicted_blocks_go_to_the_host_and_come_back_on_a_hit() -> None:
    m = manager([layer(0)], num_blocks=4, host_memory_bytes=1 << 16)
    words = _words(m)
    prompt = list(range(9))
    m.allocate("a", 9, token_ids=prompt)  # blocks 0, 1, 2
    m.commit("a", prompt)
    for b, slot in enumerate(m.block_table("a")[0]):
        words[slot] = b + 100
    m.free("a")  # 0 and 1 cached (idle), 2 free
    m.allocate("b", 16)  # takes every slot: 0 and 1 are copied to the host first
    assert m.host_stats()["offloaded_blocks"] == 2 and m.host_stats()["host_used"] == {0: 2}
    words[:] = -1  # b overwrites everything on the device
    m.free("b")
    assert m.probe(prompt) == 0 and m.probe_tiers(prompt) == (0, 8)
    info = m.allocate("c", 9, token_ids=prompt)
    assert info.num_hit_tokens == 8
    table = m.block_table("c")[0]
    assert [int(words[s][0]) for s in table[:2]] == [100, 101]  # the pages came back
    stats = m.host_stats()
    assert stats["onboarded_blocks"] == 2 and stats["host_used"] == {0: 0}
    # Events say where each block went: published on the device; stored on the host, then
    # removed from the device, when its slot was taken (a router never sees it nowhere);
    # back on the device at the hit.
    keys = [k.hex() for k in block_keys(prompt, TPB)[:2]]
    seen = [(e.kind, e.tier, sorted(e.block_keys)) for e in m.events().events]
    assert seen == [
        ("block_stored", "device", sorted(keys)),
        ("block_stored", "host", sorted(keys)),
        ("block_removed", "device", sorted(keys)),
        ("block_stored", "device", keys[:1]),
        ("block_stored", "device", keys[1:]),
        ("block_removed", "host", sorted(keys)),
    ]


def test_a_full_host_drops_its_least_recently_used_blocks() -> None:
    # 1 << 9 bytes over 8 device slots of 128 bytes: 4 host slots.
    m = manager([layer(0)], num_blocks=8, host_memory_bytes=1 << 9)
    assert m.host_stats()["host_slots"] == {0: 4}
    for i in range(3):  # three prompts of 2 full blocks, cached then evicted
        prompt = [i * 100 + t for t in range(9)]
        m.allocate(f"p{i}", 9, token_ids=prompt)
        m.commit(f"p{i}", prompt)
        m.free(f"p{i}")
        m.allocate("fill", 32)  # every slot: the cached blocks go to the host
        m.free("fill")
    stats = m.host_stats()
    assert stats["host_used"] == {0: 4} and stats["dropped_blocks"] == 2
    assert m.probe_tiers([t for t in range(9)]) == (0, 0)  # p0's blocks were dropped
    assert m.probe_tiers([200 + t for t in range(9)]) == (0, 8)


def test_onboarding_stops_where_free_slots_end() -> None:
    m = manager([layer(0)], num_blocks=6, host_memory_bytes=1 << 16)
    prompt = list(range(17))
    m.allocate("a", 17, token_ids=prompt)
    m.commit("a", prompt)
    m.free("a")
    m.allocate("fill", 24)  # all 6 slots: a's 4 cached blocks offloaded
    m.free("fill")
    m.allocate("hold", 16)  # 4 slots held: 2 free
    with pytest.raises(OutOfBlocks):
        m.allocate("b", 17, token_ids=prompt)  # 2 could be onboarded, but 5 are needed
    assert m.probe_tiers(prompt) == (0, 16)  # refused before any copy (issue 31)
    m.free("hold")
    assert m.allocate("b", 17, token_ids=prompt).num_hit_tokens == 16


@pytest.mark.slow
@pytest.mark.parametrize(
    ("seed", "cycles", "windowed", "deferred", "state"),
    [(0, 100_000, False, False, False), (1, 6000, False, False, False),
     (2, 20_000, True, False, False), (3, 20_000, False, True, False),
     (4, 10_000, True, True, False), (5, 20_000, False, False, True),
     (6, 10_000, True, True, True)],
)  # fmt: skip
def test_random_cycles_never_corrupt_a_block_and_leak_no_slot(
    seed: int, cycles: int, windowed: bool, deferred: bool, state: bool
) -> None:
    stats = run_cycles(seed, cycles, windowed, "cpu", deferred, state=state)
    if deferred:  # batches launched early because two copies of an op shared a slot
        assert stats["hazard_launches"] > 100


def run_cycles(
    seed: int,
    cycles: int,
    windowed: bool,
    device: str,
    deferred: bool = False,
    dma_min_bytes: int | None = None,
    state: bool = False,
) -> dict[str, Any]:
    """Many allocate / extend / commit / free / suspend / resume cycles with shared prefixes
    on a pool much smaller than the working set, so that blocks are evicted to the host,
    dropped there and onboarded again, and requests are preempted to the host and back.
    The test writes a checksum of each block's token prefix into its KV (what an engine
    writes), then checks every live request's blocks against it: a block served from the
    host must hold exactly the KV its key was computed for. ``deferred``: the CPU's copies
    wait for the op's end as on CUDA, so an op's copies that share a slot exercise the
    copier's early launches; between ops no block is in a copying state. ``dma_min_bytes``
    (CUDA): the copier's threshold for the copy engines (1: every copy on them). ``state``:
    with a state layer (docs/state-layers.md) of 4 live slots for the 6 rows, whose live
    state the test sets to the checksum of the request's whole sequence as it commits it:
    a new request's state must be the checksum of its hit (restored from a checkpoint) or
    zeros, a resumed one's that of its sequence."""
    rng = np.random.default_rng(seed)
    # Windowed: a sliding window of 8 tokens (group 0) beside full attention (group 1), in
    # one pool group of 40 slots shared by both.
    layers = [layer(0, sliding_window=8), layer(1)] if windowed else [layer(0)]
    states: dict[str, object] = {
        "state_layers": [
            {"layer_id": 9, "buffers": [{"name": "sum", "shape": [2], "dtype": "fp32"}]}
        ],
        "state_live_slots": 4,
        "state_checkpoints": 16,
    }
    m = manager(
        layers,
        num_blocks=40 if windowed else 20,
        max_requests=6,
        max_seq_len=48,
        host_memory_bytes=1 << 12 if windowed else 1 << 11,
        device=device,
        **(states if state else {}),
    )  # 16 host slots per pool group (fewer with the state's share)
    groups = range(len(m.layout.layer_groups))
    words = [Words.of_group(m, g) for g in groups]
    state_words = Words(m.parts.state.memory[0]) if m.parts.state is not None else None
    host = m.parts.host
    assert host is not None
    host.copier.immediate = not deferred and device == "cpu"
    if dma_min_bytes is not None:
        host.copier.dma_min_bytes = dma_min_bytes
    families = [rng.integers(0, 1000, 40).tolist() for _ in range(8)]
    seqs: dict[str, list[int]] = {}
    counter = 0

    def write(rid: str, start: int) -> None:
        seq = seqs[rid]
        for g, table in enumerate(m.block_table(rid)):
            for b in range(start // TPB, -(-len(seq) // TPB)):
                if table[b] >= 0:  # -1: released by the window
                    words[g].write(table[b], _sum(seq[: min(len(seq), (b + 1) * TPB)]) + g)
        if state_words is not None:  # the state after the whole sequence
            state_words.write(m.request(rid).state_slot, _sum(seq))

    def check_state(rid: str, prefix: list[int]) -> None:
        """The request's live state is that after ``prefix`` (zeros after none)."""
        if state_words is not None:
            got = state_words.read([m.request(rid).state_slot])
            assert got == [_sum(prefix) if prefix else 0], (rid, "state", prefix)

    def check(rid: str) -> None:
        seq = seqs[rid]
        for g, table in enumerate(m.block_table(rid)):
            held = [(b, s) for b, s in enumerate(table[: -(-len(seq) // TPB)]) if s >= 0]
            got = words[g].read([s for _, s in held]) if held else []
            want = [_sum(seq[: min(len(seq), (b + 1) * TPB)]) + g for b, _ in held]
            assert got == want, (rid, g, seq)
        check_state(rid, seq)

    suspended: set[str] = set()
    for cycle in range(cycles):
        choice = rng.integers(0, 5)
        live = [r for r in seqs if r not in suspended]
        if choice == 3 and live:  # preemption: the blocks go to the host, the row stays
            rid = live[rng.integers(0, len(live))]
            check(rid)
            try:
                m.suspend(rid)
            except OutOfBlocks:
                continue
            suspended.add(rid)
            continue
        if choice == 4 and suspended:
            rid = sorted(suspended)[rng.integers(0, len(suspended))]
            if rng.random() < 0.2:
                m.free(rid)
                del seqs[rid]
                suspended.discard(rid)
                continue
            try:
                m.resume(rid)
            except OutOfBlocks:
                continue
            suspended.discard(rid)
            check(rid)
            continue
        if choice > 2:
            continue
        if choice == 0 and len(seqs) < 6:
            family = families[rng.integers(0, len(families))]
            n = int(rng.integers(2, 30))
            seq = (
                family[:n]
                if rng.random() < 0.7
                else [*family[: n // 2], *rng.integers(0, 1000, n - n // 2).tolist()]
            )
            rid = f"r{counter}"
            counter += 1
            try:
                info = m.allocate(rid, len(seq), token_ids=seq)
            except OutOfBlocks:
                continue
            seqs[rid] = seq
            check_state(rid, seq[: info.num_hit_tokens])  # the hit's checkpoint, or zeros
            write(rid, info.num_hit_tokens)
            m.commit(rid, seq[info.num_hit_tokens :])
            check(rid)
        elif choice == 1 and live:
            rid = live[rng.integers(0, len(live))]
            k = int(rng.integers(1, 5))
            if len(seqs[rid]) + k > 48:
                continue
            try:
                m.extend(rid, k)
            except OutOfBlocks:
                continue
            start = len(seqs[rid])
            seqs[rid] = seqs[rid] + rng.integers(0, 1000, k).tolist()
            write(rid, start)
            m.commit(rid, seqs[rid][start:])
            check(rid)
        elif choice == 2 and live:
            rid = live[rng.integers(0, len(live))]
            check(rid)
            m.free(rid)
            del seqs[rid]
        if cycle % 200 == 0:
            for rid in seqs:
                if rid not in suspended:
                    check(rid)
            for pg, lru in host.lru.items():
                for g, root, key in lru:
                    assert host.copier.pending[pg].host_write == set()
                    assert host.state_of(m.parts.coord.cache, g, root, key) in (
                        BlockState.HOST,
                        BlockState.BOTH,
                    )
    stats = {**m.host_stats(), "hazard_launches": host.copier.stats.copy_hazard_launches}
    assert stats["offloaded_blocks"] > 500 and stats["onboarded_blocks"] > 100
    assert stats["dropped_blocks"] > 0
    if m.parts.state is not None:  # hits restored from checkpoints, states suspended and back
        # Per 100 cycles: about 2.3 restores, 11 states suspended and 8 resumed (seeds 5, 6).
        assert m.parts.state.restores > cycles // 100
        assert min(stats["offloaded_states"], stats["onboarded_states"]) > cycles // 40
    for rid in list(seqs):
        if rid in suspended:
            m.resume(rid)
        check(rid)
        m.free(rid)
    # No leaked slot in either tier: every device slot free again, every host slot free or
    # indexed exactly once.
    assert m.num_free_blocks() == m.num_total_blocks()
    if m.parts.state is not None:
        assert m.parts.state.num_free_live == 4 and (m.parts.state.slot_of == -1).all()
        assert sorted(host.state_free) == list(range(host.state_slots))
    for pg in host.num_slots:
        assert host.held[pg] == 0
        used = sorted(host.lru[pg].values())
        assert len(set(used)) == len(used)
        assert sorted([*used, *host.free[pg]]) == list(range(host.num_slots[pg]))
    return stats


@pytest.mark.slow
def test_the_service_offloads_and_onboards_and_says_so() -> None:
    """A real ``kvcm serve``: the registered model has a host tier; stats and metrics show
    the blocks that went to the host and came back."""
    import httpx
    from servers import serve_process

    from kvcm_client import KVCacheClient

    with serve_process(model=False) as (url, _, _), KVCacheClient(url) as kv:
        kv.register_model(
            layers=[{"layer_id": 0, "num_kv_heads": 1, "head_dim": 8}],
            num_blocks=4,
            tokens_per_block=4,
            max_seq_len=64,
            null_page=False,
            host_memory_bytes=1 << 16,
        )
        prompt = list(range(9))
        kv.allocate("a", 9, token_ids=prompt)
        kv.commit("a", prompt)
        kv.free("a")
        kv.allocate("b", 16)  # every slot: a's 2 cached blocks go to the host
        kv.free("b")
        assert kv.probe_tiers(prompt) == (0, 8)
        assert kv.allocate("c", 9, token_ids=prompt).num_hit_tokens == 8
        handle = kv.request("c").handle
        kv.suspend("c")  # preempted: 3 blocks to the host, the device empty
        assert kv.num_free_blocks() == 4
        from kvcm_client.errors import RequestSuspended

        with pytest.raises(RequestSuspended):
            kv.extend("c", 1)
        assert kv.resume("c").handle == handle
        kv.free("c")
        host = kv.stats().host_tier
        assert host is not None
        # Out: 2 evicted, 3 suspended. Back: 2 onboarded, and 1 resumed: c's two full
        # blocks stayed cached on the device (idle) and the resume took them back there.
        assert (host.offloaded_blocks, host.onboarded_blocks, host.host_used) == (5, 3, {0: 0})
        # The CPU copies each batch as it is queued: evict, onboard, suspend, resume.
        assert host.copy_launches == 4 and host.copy_seconds > 0
        text = httpx.get(f"{url}/metrics").text
        assert "kvcm_host_onboarded_blocks_total 3.0" in text
        assert "kvcm_host_copy_launches_total 4.0" in text
        assert 'kvcm_ops_total{op="suspend",result="ok"} 1.0' in text
        assert 'kvcm_host_slots{pool_group="0"}' in text


@pytest.mark.slow
def test_kvcm_serve_host_memory_flag_and_suspend_over_the_step_channel(tmp_path: Path) -> None:
    import httpx
    from servers import serve_process

    from kvcm_client import KVCacheClient

    # The embedded model's slot: 32 layers x 16 tokens x 8 heads x 128 x 2 bytes (fp16)
    # for the keys, the same for the values: 2 MiB.
    sock = tmp_path / "s.sock"
    args = ("--default-model", "--num-blocks", "4", "--host-memory", "8MiB")
    with (
        serve_process(*args, "--step-socket", str(sock)) as (url, _, _),
        KVCacheClient(url, step_socket=sock) as kv,
    ):
        host = kv.stats().host_tier
        assert host is not None and host.host_slots == {0: 4}
        kv.allocate("a", 20)  # 2 blocks (the null page takes slot 0: 3 usable)
        assert kv.suspend("a").num_tokens == 20 and kv.num_free_blocks() == 3
        assert kv.resume("a").num_tokens == 20 and kv.num_free_blocks() == 1
        text = httpx.get(f"{url}/metrics").text
        for op in ("suspend", "resume"):
            assert f'kvcm_step_channel_frames_total{{op="{op}",result="ok"}} 1.0' in text


def test_suspend_moves_a_request_to_the_host_and_resume_brings_it_back() -> None:
    from kvcm_client.errors import RequestSuspended

    m = manager([layer(0)], num_blocks=6, host_memory_bytes=1 << 16)
    words = _words(m)
    a = m.allocate("a", 10)  # 3 blocks
    for b, slot in enumerate(m.block_table("a")[0]):
        words[slot] = 500 + b
    m.commit("a", list(range(6)))
    info = m.suspend("a")
    assert info.num_tokens == 10 and info.num_committed == 6
    assert m.num_free_blocks() == 6 and m.host_stats()["host_used"] == {0: 0}
    assert m.parts.host is not None and m.parts.host.held[0] == 3
    for op in (
        lambda: m.extend("a", 1),
        lambda: m.extend_many(["a"]),
        lambda: m.commit_many(["a"], [[1]]),
        lambda: m.slot_mappings(["a"]),
        lambda: m.block_table("a"),
        lambda: m.suspend("a"),
    ):
        with pytest.raises(RequestSuspended):
            op()
    out = m.step_columns(extend=[a.handle])  # its handle names nothing while suspended
    assert out.status["extend"].tolist() == [status_of("unknown_request")]
    results = m.step([{"op": "extend", "request_id": "a", "num_new_tokens": 1}])
    assert results[0].error is not None and results[0].error.code == "request_suspended"
    m.allocate("x", 24)  # every slot, overwritten
    words[:] = -1
    with pytest.raises(OutOfBlocks):
        m.resume("a")  # no room: nothing changes
    assert "a" in m.parts.requests.suspended and m.parts.host.held[0] == 3
    m.free("x")
    back = m.resume("a")
    assert back.handle == a.handle and back.num_tokens == 10
    assert [int(words[s][0]) for s in m.block_table("a")[0]] == [500, 501, 502]
    assert m.committed_tokens("a") == list(range(6)) and m.parts.host.held[0] == 0
    m.extend("a", 3)  # an ordinary request again
    m.free("a")
    assert m.num_free_blocks() == 6


def test_a_window_onboards_only_the_blocks_its_hit_needs() -> None:
    # W 8, tpb 4: a hit of 4 blocks (16 tokens) needs blocks [(16 + 1 - 8) // 4, 4) = [2, 4).
    m = manager([layer(0, sliding_window=8)], num_blocks=6, host_memory_bytes=1 << 16)
    prompt = list(range(100, 117))
    m.allocate("a", 17, token_ids=prompt)
    m.commit("a", prompt)  # blocks 0-3 published
    m.free("a")
    m.allocate("x", 24)  # every slot: the four go to the host
    m.free("x")
    assert m.probe_tiers(prompt) == (0, 16)
    info = m.allocate("b", 17, token_ids=prompt)
    assert info.num_hit_tokens == 16 and m.block_table("b") == [[-1, -1, 0, 1, 2]]
    stats = m.host_stats()
    assert (stats["onboarded_blocks"], stats["host_used"]) == (2, {0: 2})  # 0, 1 stay there


def test_resume_takes_back_the_published_blocks_still_cached_on_the_device() -> None:
    m = manager([layer(0)], num_blocks=8, host_memory_bytes=1 << 16)
    words = _words(m)
    prompt = list(range(10))
    m.allocate("a", 10, token_ids=prompt)  # blocks 0, 1 full (published at commit), 2 partial
    table = m.block_table("a")[0]
    for b, slot in enumerate(table):
        words[slot] = 700 + b
    m.commit("a", prompt)
    m.suspend("a")  # all 3 copied to private host slots; 0 and 1 stay cached, idle
    m.allocate("b", 10, token_ids=prompt)  # a prefix hit: b shares blocks 0 and 1
    assert table == [0, 1, 2] and m.block_table("b") == [[0, 1, 3]]
    before = m.host_stats()["onboarded_blocks"]
    m.resume("a")
    # Blocks 0 and 1 come back in place (shared with b, no copy); block 2 is copied into
    # a new slot (slot 2 was freed at the suspend, the queue's head is 4 now).
    got = m.block_table("a")[0]
    assert got == [0, 1, 4]
    assert m.host_stats()["onboarded_blocks"] == before + 1
    assert [int(words[s][0]) for s in got] == [700, 701, 702]
    assert m.parts.host is not None and m.parts.host.held[0] == 0
    m.free("b")
    m.free("a")
    assert m.num_free_blocks() == 8


def test_resume_copies_back_the_published_blocks_evicted_meanwhile() -> None:
    m = manager([layer(0)], num_blocks=4, host_memory_bytes=1 << 16)
    words = _words(m)
    prompt = list(range(10))
    m.allocate("a", 10, token_ids=prompt)
    table = m.block_table("a")[0]
    for b, slot in enumerate(table):
        words[slot] = 800 + b
    m.commit("a", prompt)
    m.suspend("a")
    m.allocate("x", 16)  # every slot: a's cached blocks are evicted (to the host's LRU)
    words[:] = -1
    m.free("x")
    before = m.host_stats()["onboarded_blocks"]
    m.resume("a")
    assert m.host_stats()["onboarded_blocks"] == before + 3  # all three from its own copies
    assert [int(words[s][0]) for s in m.block_table("a")[0]] == [800, 801, 802]
    m.free("a")
    assert m.num_free_blocks() == 4


def test_a_suspend_the_host_cannot_hold_changes_nothing() -> None:
    m = manager([layer(0)], num_blocks=8, host_memory_bytes=1 << 8)  # 2 host slots
    m.allocate("a", 12)  # 3 blocks
    with pytest.raises(OutOfBlocks) as exc:
        m.suspend("a")
    assert exc.value.detail["tier"] == "host"
    assert m.block_table("a") == [[0, 1, 2]] and m.num_free_blocks() == 5


def test_freeing_a_suspended_request_frees_its_host_slots() -> None:
    m = manager([layer(0)], num_blocks=8, host_memory_bytes=1 << 16)
    m.allocate("a", 12)
    m.suspend("a")
    m.free("a")
    assert m.parts.host is not None and m.parts.host.held[0] == 0
    assert sorted(m.parts.host.free[0]) == list(range(m.parts.host.num_slots[0]))
    assert m.request_ids() == [] and m.num_free_blocks() == 8


def test_estimate_reports_the_host_tier_and_its_suspended_capacity_holds() -> None:
    """The estimate says how many requests of seq_len the host holds suspended: exactly
    that many suspends of such requests succeed, one more is refused."""
    m = manager([layer(0)], num_blocks=16, max_requests=8, host_memory_bytes=10 * 128)
    est = m.estimate(12)  # 3 blocks a request; 10 host slots: 3 requests
    assert est.pool_groups[0].host_slots == 10 and est.host_max_requests == 3
    assert manager([layer(0)], num_blocks=16).estimate(12).host_max_requests is None
    for i in range(4):
        m.allocate(f"r{i}", 12)
    for i in range(3):
        m.suspend(f"r{i}")
    with pytest.raises(OutOfBlocks):
        m.suspend("r3")


def test_an_all_or_nothing_step_does_not_onboard_and_its_undo_corrupts_nothing() -> None:
    """Onboarding writes pages into device slots; an undone step would hand those slots back
    to the cache entries they held. So an allocate inside ``atomic=True`` serves only the
    device hit, and an undone step leaves every cached page as it was."""
    m = manager([layer(0)], num_blocks=4, host_memory_bytes=1 << 16)
    words = _words(m)
    first = list(range(9))
    m.allocate("a", 9, token_ids=first)
    m.commit("a", first)
    for b, slot in enumerate(m.block_table("a")[0]):
        words[slot] = 100 + b
    m.free("a")
    m.allocate("b", 16)
    m.free("b")  # a's two blocks are on the host now
    out = m.step(
        [
            {"op": "allocate", "request_id": "c", "num_tokens": 9, "token_ids": first},
            {"op": "extend", "request_id": "c", "num_new_tokens": 40},  # fails: all undone
        ],
        atomic=True,
    )
    assert [r.ok for r in out] == [False, False] and m.host_stats()["onboarded_blocks"] == 0
    assert m.allocate("c", 9, token_ids=first).num_hit_tokens == 8  # onboarded now
    assert [int(words[s][0]) for s in m.block_table("c")[0][:2]] == [100, 101]


def test_suspend_and_resume_are_sections_of_the_columnar_step_and_ops_of_step() -> None:
    """A scheduler preempts in its step: suspends run after frees and rewinds, resumes
    before extends and allocates; by handle in ``step_columns`` (the resumed one by the
    handle it had), by id in ``step``; never in an all-or-nothing step."""
    m = manager([layer(0)], num_blocks=6, host_memory_bytes=1 << 16)
    a = m.allocate("a", 8).handle  # 2 blocks
    b = m.allocate("b", 8).handle  # 2 blocks
    out = m.step_columns(
        suspend=[a],
        extend=[b],
        num_new_tokens=8,  # b needs 2 more blocks: 2 free + a's 2 freed by its suspend
        allocate=[{"request_id": "c", "num_tokens": 12}],  # 3 more, 2 are free: refused
    )
    assert out.status["suspend"].tolist() == [0] and out.status["extend"].tolist() == [0]
    assert out.status["allocate"].tolist() == [status_of("out_of_blocks")]
    assert m.request("a").handle == a and m.num_free_blocks() == 2
    out = m.step_columns(free=[b], resume=[a, b])  # b freed first; its handle names nothing
    assert out.status["resume"].tolist() == [0, status_of("unknown_request")]
    assert m.block_table("a")[0] != [] and m.request("a").num_tokens == 8
    out = m.step_columns(resume=[a])  # a is live: not suspended
    assert out.status["resume"].tolist() == [status_of("invalid_argument")]
    results = m.step(
        [
            {"op": "suspend", "request_id": "a"},
            {"op": "allocate", "request_id": "d", "num_tokens": 4},
            {"op": "resume", "request_id": "a"},
        ]
    )
    assert [r.ok for r in results] == [True, True, True]
    assert results[0].request is not None and results[0].request.handle == a
    assert m.request("a").num_tokens == 8 and m.request_ids() == ["a", "d"]
    with pytest.raises(InvalidArgument):
        m.step_columns(suspend=[a], atomic=True)
    atomic = m.step([{"op": "suspend", "request_id": "a"}], atomic=True)
    assert atomic[0].error is not None and atomic[0].error.code == "invalid_argument"
    assert m.block_table("a")[0] != []  # nothing changed


def test_a_copied_manager_s_host_tier_copies_into_its_own_memory() -> None:
    """copy.deepcopy of a manager with a host tier (tests twin managers so): the copy's
    copier uses its own tensors' addresses, so with the original gone a suspend and resume
    on the copy bring its pages back (the original's addresses were freed memory)."""
    import copy
    import gc

    m = manager([layer(0)], num_blocks=6, host_memory_bytes=1 << 16)
    m.allocate("a", 10)
    twin = copy.deepcopy(m)
    del m
    gc.collect()
    copier = twin.parts.host.copier
    for pool, chunks in copier.regions.items():
        assert copier._bases[pool].tolist() == [c.data_ptr() for c in chunks]
        assert copier._device_at[pool][0] == copier.device_pools[pool].data_ptr()
    words = _words(twin)
    for b, slot in enumerate(twin.block_table("a")[0]):
        words[slot] = 700 + b
    twin.suspend("a")
    twin.allocate("x", 24)  # every slot, overwritten
    words[:] = -1
    twin.free("x")
    twin.resume("a")
    assert [int(words[s][0]) for s in twin.block_table("a")[0]] == [700, 701, 702]

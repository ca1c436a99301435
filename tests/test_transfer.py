"""KV moves between two managers in two processes over NIXL (UCX, DRAM to DRAM): hand-off
and pull, prefix hits, refusals, deadlines, a peer killed, a pull freed
(docs/disaggregation.md). Every moved block is compared byte for byte (its whole slot in
every pool), and the decode side's other slots are checked untouched."""

from __future__ import annotations

import time
from typing import Any

import pytest
import torch

pytest.importorskip("nixl_cu12", reason="the transfer extra (nixl-cu12) is not installed")

from transfer_peer import Peer, digests, state_digest, wait_done, wait_free

from kvcm import transfer_engine, transfers
from kvcm.manager import KVCacheManager
from kvcm_client.errors import (
    DuplicateRequest,
    KVInFlight,
    LayoutMismatch,
    ScopeMismatch,
    TransferUnavailable,
    UnknownPeer,
)

TPB = 4


def config(name: str, **over: Any) -> dict[str, Any]:
    """Two full-attention K/V layers, a key-only layer (its own pool) and a sliding-window
    layer with a sink (its own layer group), null page on: 2 layer groups, 3 pools."""
    layers = [
        {"layer_id": 0, "num_kv_heads": 2, "head_dim": 8, "dtype": "fp16"},
        {"layer_id": 1, "num_kv_heads": 2, "head_dim": 8, "dtype": "fp16"},
        {"layer_id": 2, "num_kv_heads": 1, "head_dim": 16, "dtype": "fp16", "kv_factor": 1},
        {
            "layer_id": 3,
            "num_kv_heads": 2,
            "head_dim": 8,
            "dtype": "fp16",
            "sliding_window": 8,
            "sink_tokens": 4,
        },
    ]
    base = {
        "layers": layers,
        "tokens_per_block": TPB,
        "num_blocks": 64,
        "max_requests": 8,
        "max_seq_len": 128,
        "null_page": True,
        "transfer": "nixl",
        "transfer_name": name,
    }
    return {**base, **over}


@pytest.fixture(scope="module")
def peer() -> Any:
    p = Peer(config("prefill"))
    yield p
    p.stop()


@pytest.fixture
def local() -> Any:
    m = KVCacheManager(config("decode"))
    yield m
    m.close()


def prefill(
    peer: Peer, rid: str, tokens: list[int], seed: int, hand_off: bool = True, **kw: Any
) -> Any:
    """Run a request's chunked prefill on the peer (8 tokens a chunk, random KV written
    into each chunk's blocks), then hand it off (or free it: its blocks stay cached)."""
    hit = peer.call("allocate", rid, min(8, len(tokens)), tokens[:8], **kw).num_hit_tokens
    for start in range(0, len(tokens), 8):
        if start:
            peer.call("extend", rid, min(8, len(tokens) - start))
        peer.call("fill", rid, seed + start)
        peer.call("commit", rid, tokens[max(start, hit) : start + 8])
    if not hand_off:
        return peer.call("free", rid)
    return peer.call("hand_off", rid, 20.0)


def moved_slots(m: KVCacheManager, rid: str, first: int = 0) -> set[tuple[int, int]]:
    """(pool group, slot) of the request's held blocks from position ``first`` on."""
    row = m.parts.requests.rows[rid]
    return {
        (int(g.pool_group), s)
        for g in m.layout.layer_groups
        for s in m.parts.coord.block_list(g.group_id, row)[first:]
        if s >= 0
    }


def scribble(m: KVCacheManager, seed: int) -> list[Any]:
    """Random bytes in every slot but the null page; returns a copy of the pools."""
    gen = torch.Generator().manual_seed(seed)
    for t in m.memory.tensors:
        t[1:] = torch.randint(0, 256, t[1:].shape, dtype=torch.uint8, generator=gen)
    return [t.clone() for t in m.memory.tensors]


def untouched(m: KVCacheManager, snapshot: list[Any], written: set[tuple[int, int]]) -> bool:
    """Whether every slot outside ``written`` holds its snapshot's bytes (slot 0, the null
    page, included)."""
    for pool, t, old in zip(m.layout.pools, m.memory.tensors, snapshot, strict=True):
        keep = torch.ones(t.shape[0], dtype=torch.bool)
        for pg, slot in written:
            if pg == int(pool.pool_group):
                keep[slot] = False
        if not torch.equal(t[keep], old[keep]):
            return False
    return True


def held_blocks(m: KVCacheManager, rid: str, first: int = 0) -> int:
    row = m.parts.requests.rows[rid]
    return sum(
        s >= 0
        for g in m.layout.layer_groups
        for s in m.parts.coord.block_list(g.group_id, row)[first:]
    )


def test_pull_moves_every_block_byte_for_byte(peer: Peer, local: KVCacheManager) -> None:
    local.connect_peer(peer.agent.metadata)
    free_peer = peer.call("num_free_blocks")
    free_local = local.num_free_blocks()
    tokens = list(range(1000, 1030))  # 30 tokens: 8 blocks, the last one partial
    export = prefill(peer, "p1", tokens, seed=1)
    # The window group releases blocks between its sink and its window: the export lists
    # them as -1, as block_table does.
    assert export.blocks[1][0] >= 0 and -1 in export.blocks[1]
    assert len(export.blocks[0]) == 8 and export.token_ids == tokens
    source = peer.call("digests", "p1")
    with pytest.raises(KVInFlight):
        peer.call("extend", "p1", 1)
    snapshot = scribble(local, seed=2)

    state = local.pull("d1", export)
    assert state.state == "pulling"
    assert state.blocks == held_blocks(local, "d1") == 8 + sum(s >= 0 for s in export.blocks[1])
    with pytest.raises(KVInFlight):
        local.extend("d1", 1)
    with pytest.raises(KVInFlight):
        local.commit("d1", [1])
    done = wait_done(local, "d1")
    assert done.state == "ready", done
    # The next step's answer says so too (a scheduler needs no transfer_status), once.
    pulls = local.step_columns().pulls
    assert pulls is not None and [(p.request_id, p.state) for p in pulls] == [("d1", "ready")]
    assert local.step_columns().pulls is None
    info = local.request("d1")
    assert (info.num_tokens, info.num_committed, info.num_hit_tokens) == (30, 30, 0)
    assert (done.handle, done.num_committed) == (info.handle, 30)
    assert local.committed_tokens("d1") == tokens
    assert digests(local, "d1") == source
    assert untouched(local, snapshot, moved_slots(local, "d1"))
    # The request runs now; the peer freed its copy on the puller's message.
    local.extend("d1", 1)
    assert wait_free(peer, free_peer) == free_peer
    local.free("d1")
    assert local.num_free_blocks() == free_local


def test_pull_moves_only_what_the_puller_misses(peer: Peer, local: KVCacheManager) -> None:
    """Blocks the decode side caches are hits: they move nothing and stay as they were;
    the pulled full blocks are published (a later request hits them here)."""
    local.connect_peer(peer.agent.metadata)
    tokens = list(range(2000, 2022))  # 22 tokens: 5 full blocks and a partial one
    local.allocate("warm", 12, tokens[:12])
    local.commit("warm", tokens[:12])  # 3 full blocks cached here
    local.free("warm")
    export = prefill(peer, "p2", tokens, seed=3)
    source = peer.call("digests", "p2")
    snapshot = scribble(local, seed=4)
    state = local.pull("d2", export)
    info = local.request("d2")
    assert info.num_hit_tokens == 12
    # The hit positions of the window group are released or hits: only later ones move.
    assert state.blocks == held_blocks(local, "d2", first=3)
    assert wait_done(local, "d2").state == "ready"
    assert local.committed_tokens("d2") == tokens
    mine = digests(local, "d2")
    assert mine[0][3:] == source[0][3:] and mine[1][3:] == source[1][3:]
    assert untouched(local, snapshot, moved_slots(local, "d2", first=3))
    assert local.probe([*tokens, 7]) == 20  # its 5 full blocks are cached here now
    local.free("d2")


def test_refusals_change_nothing(peer: Peer, local: KVCacheManager) -> None:
    export = prefill(peer, "p3", list(range(3000, 3010)), seed=5, cache_salt="tenant-a")
    free = local.num_free_blocks()
    with pytest.raises(UnknownPeer):  # not connected yet
        local.pull("d3", export, cache_salt="tenant-a")
    local.connect_peer(peer.agent.metadata)
    with pytest.raises(ScopeMismatch):
        local.pull("d3", export)  # no salt: another scope
    with pytest.raises(ScopeMismatch):
        local.pull("d3", export, cache_salt="tenant-b")
    with pytest.raises(ScopeMismatch):  # a LoRA is a scope too
        local.pull("d3", export, lora_id=3, cache_salt="tenant-a")
    local.allocate("d3", 4)
    with pytest.raises(DuplicateRequest):
        local.pull("d3", export, cache_salt="tenant-a")
    local.free("d3")
    assert local.num_free_blocks() == free and local.request_ids() == []
    # The right scope pulls.
    assert local.pull("d3", export, cache_salt="tenant-a").state in ("pulling", "ready")
    assert wait_done(local, "d3").state == "ready"
    local.free("d3")


@pytest.mark.parametrize(
    ("change", "named"),
    [
        ({"tokens_per_block": 8}, "tokens_per_block"),
        ({"layers": "heads"}, "layer 1 num_kv_heads"),
        ({"layers": "dtype"}, "layer 0 dtype"),
    ],
)
def test_layout_mismatch_is_named(peer: Peer, change: dict[str, Any], named: str) -> None:
    over = dict(change)
    if over.get("layers") == "heads":
        layers = config("x")["layers"]
        layers[1] = {**layers[1], "num_kv_heads": 1}  # another TP split
        over["layers"] = layers
    elif over.get("layers") == "dtype":
        layers = config("x")["layers"]
        layers[0] = {**layers[0], "dtype": "bf16"}
        over["layers"] = layers
    m = KVCacheManager(config("other", **over))
    try:
        m.connect_peer(peer.agent.metadata)
        export = prefill(peer, f"p-{named}", list(range(10)), seed=6)
        free = m.num_free_blocks()
        with pytest.raises(LayoutMismatch) as err:
            m.pull("d", export)
        assert any(d.startswith(named) for d in err.value.detail["differences"])
        assert m.num_free_blocks() == free and m.request_ids() == []
    finally:
        m.close()


def test_peer_deadline_unpins_and_free_waits(peer: Peer) -> None:
    """A hand-off nobody pulls is freed at its deadline (blocks back, kept cached); a
    scheduler's free of it before then leaves it pinned."""
    free = peer.call("num_free_blocks")
    tokens = list(range(4000, 4009))
    peer.call("allocate", "p4", 9, tokens)
    peer.call("commit", "p4", tokens)
    peer.call("hand_off", "p4", 0.3)
    peer.call("free", "p4")  # waits for the pull or the deadline
    assert "p4" in peer.call("request_ids")
    time.sleep(0.4)
    assert wait_free(peer, free) == free
    assert "p4" not in peer.call("request_ids")
    assert peer.call("probe", tokens) == 8  # its two full blocks stay cached


def test_pull_past_its_deadline_fails_cleanly(local: KVCacheManager) -> None:
    """A peer that stops answering (SIGSTOP-like: killed here before the READ) leaves the
    pull failed at its deadline, its blocks back, nothing committed or published."""
    p = Peer(config("dying"))
    try:
        local.connect_peer(p.agent.metadata)
        export = prefill(p, "p5", list(range(5000, 5020)), seed=7)
        free = local.num_free_blocks()
        p.kill()
        # NIXL refuses to post to a dead peer (failed at once), or the READ fails later.
        state = local.pull("d5", export, deadline_s=2.0)
        if state.state == "pulling":
            state = wait_done(local, "d5", timeout=30)
        assert state.state == "failed" and state.error["code"] == "transfer_failed", state
        assert local.num_free_blocks() == free and local.request_ids() == []
        assert local.probe(list(range(5000, 5020))) == 0
        assert [e for e in local.events().events if e.kind == "block_stored"] == []
    finally:
        p.stop()


def test_free_during_pull_returns_blocks(peer: Peer, local: KVCacheManager) -> None:
    local.connect_peer(peer.agent.metadata)
    free = local.num_free_blocks()
    export = prefill(peer, "p6", list(range(6000, 6040)), seed=8)
    local.pull("d6", export)
    local.free("d6")
    for _ in range(1000):
        if local.request_ids() == [] and not local.transfers_busy:
            break
        local.poll_transfers()
        time.sleep(0.001)
    assert local.request_ids() == [] and local.num_free_blocks() == free
    assert local.probe(list(range(6000, 6040))) == 0  # nothing half-written published
    assert local.transfer_status(["d6"])[0].state == "unknown"
    # The id is free again: a new pull of the same export works.
    local.pull("d6", export)
    assert wait_done(local, "d6").state == "ready"
    local.free("d6")


def test_without_the_engine_the_config_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(transfer_engine, "_MODULES", ("kvcm_no_such_module",))
    with pytest.raises(TransferUnavailable) as err:
        KVCacheManager(config("none"))
    assert "kvcm[transfer]" in err.value.message
    m = KVCacheManager({**config("none"), "transfer": None})
    with pytest.raises(TransferUnavailable):
        m.transfer_agent()
    m.close()


def test_peer_killed_mid_transfer(local: KVCacheManager) -> None:
    """SIGKILL while a 96 MiB READ runs: the pull ends ``failed`` (its blocks back, nothing
    committed or published) or, had the READ finished first, ``ready`` with every byte
    equal to the source's; never anything in between."""
    big = {
        "layers": [{"layer_id": 0, "num_kv_heads": 16, "head_dim": 128, "dtype": "fp16"}],
        "tokens_per_block": 64,
        "num_blocks": 400,
        "max_requests": 2,
        "max_seq_len": 32768,
        "transfer": "nixl",
    }
    p = Peer({**big, "transfer_name": "big"})
    m = KVCacheManager({**big, "transfer_name": "big-decode"})
    try:
        m.connect_peer(p.agent.metadata)
        tokens = list(range(24_000))  # 375 blocks of 256 KiB: 96 MiB
        p.call("allocate", "p", len(tokens), tokens)
        p.call("fill", "p", 9)
        p.call("commit", "p", tokens)
        source = p.call("digests", "p")
        export = p.call("hand_off", "p", 30.0)
        free = m.num_free_blocks()
        state = m.pull("d", export, deadline_s=20.0)
        p.kill()
        if state.state == "pulling":
            state = wait_done(m, "d", timeout=60)
        if state.state == "ready":
            assert digests(m, "d") == source
            m.free("d")
        else:
            assert state.state == "failed" and state.error["code"] == "transfer_failed"
            assert m.probe(tokens) == 0
            assert [e for e in m.events().events if e.kind == "block_stored"] == []
        assert m.num_free_blocks() == free and m.request_ids() == []
    finally:
        m.close()
        p.stop()


def test_fetch_a_prefix_the_peer_caches(peer: Peer, local: KVCacheManager) -> None:
    """A prompt whose first 24 tokens the peer caches and whose first 4 this side does:
    the peer pins its prefix (an internal request), blocks 1 to 5 move, the request is
    ready with 24 tokens committed, and they are published here (events, later hits)."""
    local.connect_peer(peer.agent.metadata)
    prompt = list(range(7000, 7030))
    prefill(peer, "p7", prompt[:25], seed=10, hand_off=False)  # 6 full blocks cached
    free_peer = peer.call("num_free_blocks")
    local.allocate("warm", 4, prompt[:4])
    local.commit("warm", prompt[:4])
    local.free("warm")
    seq = local.last_event_seq

    export = peer.call("export_prefix", prompt, None, None, 20.0)
    assert export.token_ids == prompt[:24] and export.request_id.startswith("kvcm-fetch-")
    source = peer.call("digests", export.request_id, 24)
    with pytest.raises(KVInFlight):  # the peer's pin takes no op
        peer.call("extend", export.request_id, 1)
    state = local.fetch("f", 30, prompt, export)
    assert state.state in ("pulling", "ready")
    assert wait_done(local, "f").state == "ready"
    info = local.request("f")
    assert (info.num_tokens, info.num_committed, info.num_hit_tokens) == (30, 24, 4)
    mine = digests(local, "f", 24)
    assert mine[0][1:] == source[0][1:]  # block 0 was a hit here
    stored = [e for e in local.events(after=seq).events if e.kind == "block_stored"]
    assert len(stored) > 0 and local.probe(prompt) == 24
    local.commit("f", prompt[24:])  # the scheduler prefills the rest
    assert wait_free(peer, free_peer) == free_peer  # the peer's pin is gone
    local.free("f")


def test_fetch_with_nothing_cached_at_the_peer(peer: Peer, local: KVCacheManager) -> None:
    local.connect_peer(peer.agent.metadata)
    prompt = list(range(8000, 8010))
    export = peer.call("export_prefix", prompt, None, None, 20.0)
    assert export.token_ids == [] and export.request_id == ""
    state = local.fetch("n", 10, prompt, export)
    assert state.state == "ready" and state.blocks == 0
    assert local.request("n").num_committed == 0
    local.free("n")


def hybrid(name: str) -> dict[str, Any]:
    """``config`` with two state layers (one state group) checkpointed every block."""
    states = [
        {
            "layer_id": 10 + i,
            "buffers": [{"name": "conv", "shape": [3, 8]}, {"name": "ssm", "shape": [4, 4]}],
        }
        for i in range(2)
    ]
    return {**config(name), "state_layers": states, "state_checkpoint_stride": 1}


def test_a_hybrid_pull_moves_its_state_and_a_fetch_the_checkpoint() -> None:
    """A hybrid's live state moves with its blocks (the state after its committed tokens),
    and a prefix fetch brings the peer's state at the prefix; the pulled commits save
    checkpoints here, so a later request hits the prefix locally with that state."""
    p = Peer(hybrid("hybrid-prefill"))
    m = KVCacheManager(hybrid("hybrid-decode"))
    try:
        m.connect_peer(p.agent.metadata)
        tokens = list(range(9000, 9014))  # 14 tokens: 3 full blocks
        p.call("allocate", "h", 14, tokens)
        p.call("fill", "h", 21)
        p.call("fill_state", "h", 22)
        p.call("commit", "h", tokens)
        source, state = p.call("digests", "h"), p.call("state_digest", "h")
        export = p.call("hand_off", "h", 20.0)
        assert export.state_slot >= 0 and len(export.state_regions) == 1
        m.pull("h", export)
        assert wait_done(m, "h").state == "ready"
        assert digests(m, "h") == source
        assert state_digest(m, "h") == state
        m.free("h")

        # The peer caches a 12-token prefix with its checkpoint: the state filled before
        # the commit of 12 tokens is what that commit saves and a hit restores.
        prompt = list(range(9100, 9120))
        p.call("allocate", "c", 13, prompt[:13])
        p.call("fill", "c", 23)
        p.call("fill_state", "c", 24)
        p.call("commit", "c", prompt[:12])  # a checkpoint of this state at 3 blocks
        p.call("free", "c")
        export = p.call("export_prefix", prompt, None, None, 20.0)
        assert export.token_ids == prompt[:12]
        checkpoint = p.call("state_digest", export.request_id)  # the hit restored it
        m.fetch("f", 20, prompt, export)
        assert wait_done(m, "f").state == "ready"
        assert m.request("f").num_committed == 12
        assert state_digest(m, "f") == checkpoint
        m.free("f")
        # Fetched and committed here: a later request hits it, its state restored from the
        # checkpoint the commit saved.
        m.allocate("g", 20, prompt)
        assert m.request("g").num_hit_tokens == 12
        assert state_digest(m, "g") == checkpoint
    finally:
        m.close()
        p.stop()


def test_pieces_split_by_bytes() -> None:
    """80 descriptors of 2 MiB: pieces of 32, 32 and 16; one descriptor past the limit is a
    piece of its own."""
    two = 2 << 20
    groups = {("DRAM", 0, "DRAM", 0): [(i * two, 10**9 + i * two, two) for i in range(80)]}
    assert [p.local.shape[0] for p in transfers._pieces(groups)] == [32, 32, 16]
    big = {("DRAM", 0, "DRAM", 0): [(0, 0, 100 << 20), (1, 1, 8)]}
    pieces = transfers._pieces(big)
    assert [p.local.shape[0] for p in pieces] == [1, 1] and pieces[0].nbytes == 100 << 20
    assert pieces[1].remote.tolist() == [[1, 8]]


def test_a_pull_in_many_pieces(
    peer: Peer, local: KVCacheManager, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every descriptor its own READ, each posted when the one before ended: the same bytes."""
    monkeypatch.setattr(transfers, "PIECE_BYTES", 1)
    posted = []
    post = transfers._post
    monkeypatch.setattr(transfers, "_post", lambda *a: posted.append(1) or post(*a))
    local.connect_peer(peer.agent.metadata)
    tokens = list(range(11000, 11030))
    export = prefill(peer, "p9", tokens, seed=31)
    source = peer.call("digests", "p9")
    state = local.pull("d9", export)
    assert wait_done(local, "d9").state == "ready"
    assert digests(local, "d9") == source
    # A descriptor per (block, pool): 8 blocks of group 0 in 2 pools, group 1's in 1.
    assert len(posted) == 8 * 2 + (state.blocks - 8)
    local.free("d9")

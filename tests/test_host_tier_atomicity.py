"""Ops that refuse change nothing, the host tier included (docs/host-tier.md#ops-that-refuse).

An op that raises, and an all-or-nothing step that stops, leave every count, index, event and
byte as they were: no block offloaded or onboarded, no host slot taken or freed, no KV event a
router could follow. The random test compares the whole state before and after every refused
op, the bytes of every host slot in use included, so that an undo that put back the
bookkeeping but not the bytes (a host slot a refused step overwrote) is caught too.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import pytest
import torch
from helpers import layer, manager, manager_state, same

from kvcm import InvalidArgument, KVCacheManager, KVCMError, OutOfBlocks
from kvcm_client.errors import status_of
from kvcm_client.models import AllocateOp, ExtendOp, FreeOp

TPB = 4


def host_manager(num_blocks: int, **kw: Any) -> KVCacheManager:
    return manager([layer(0)], num_blocks=num_blocks, host_memory_bytes=65536, **kw)


def everything(m: KVCacheManager) -> list[Any]:
    """What a refused op must leave as it was: the manager's state (tables, queues, cache,
    events, the host tier's LRU and free slots), the host tier's counts and held slots, the
    suspended requests, the bytes of every host slot that holds something, and the state
    layers' slots and bytes."""
    host = m.parts.host
    assert host is not None
    stats = m.host_stats()
    for moved in ("copy_launches", "copy_hazard_launches", "copy_seconds"):
        del stats[moved]  # work done, not state: an undone step did launch its copies
    used = {pg: sorted([*lru.values(), *held_slots(m, pg)]) for pg, lru in host.lru.items()}
    pages = [
        torch.cat(host.regions[pool.pool_id].chunks)[used[pool.pool_group]].numpy()
        for pool in m.layout.pools
    ]
    return [
        manager_state(m),
        stats,
        dict(host.held),
        sorted(host.state_free),
        {r: m.request(r) for r in m.request_ids()},
        sorted(m.parts.requests.suspended),
        m.last_event_seq,
        pages,
        None
        if m.parts.state is None
        else (m.parts.state.slot_of.copy(), [t.numpy().copy() for t in m.parts.state.memory]),
    ]


def held_slots(m: KVCacheManager, pg: int) -> list[int]:
    """Host slots suspended requests hold in pool group ``pg``."""
    out: list[int] = []
    for saved in m.parts.requests.suspended.values():
        for g, (_, slots) in enumerate(saved.blocks):
            if m.parts.coord.group_pool[g] == pg:
                out += slots
    return out


def test_a_failed_atomic_step_keeps_no_offload() -> None:
    """Issue 31, 1: the allocate of a stopped step evicted two cached blocks to the host;
    its undo takes the offloads back (counts, LRU, metrics) with the device cache."""
    m = host_manager(4)
    m.allocate("a", 9, token_ids=list(range(9)))
    m.commit("a", list(range(9)))
    m.free("a")
    before = everything(m)
    ops = [
        AllocateOp(request_id="b", num_tokens=16),
        ExtendOp(request_id="nope", num_new_tokens=1),
    ]
    results = m.step(ops, atomic=True)
    assert [r.error.code for r in results if r.error] == ["step_aborted", "unknown_request"]
    assert same(everything(m), before)
    assert m.host_stats()["offloaded_blocks"] == 0 and m.host_stats()["host_used"] == {0: 0}
    assert m.probe_tiers(list(range(9))) == (8, 0)  # still on the device, not on the host
    out = m.step_columns(allocate=[{"request_id": "b", "num_tokens": 16}], extend=[12345])
    assert out.ok is False  # not atomic: the allocate stays, the extend fails alone
    assert m.host_stats()["offloaded_blocks"] == 2 and m.probe_tiers(list(range(9))) == (0, 8)
    m.free("b")
    before = everything(m)
    out = m.step_columns(
        allocate=[{"request_id": "c", "num_tokens": 16}], extend=[12345], atomic=True
    )
    assert out.ok is False and same(everything(m), before)


def test_an_allocate_that_does_not_fit_onboards_nothing() -> None:
    """Issue 31, 2: a prompt whose hit is on the host, in a request too long for the free
    slots, is refused before its blocks are brought back or any event is logged."""
    m = host_manager(6)
    prompt = list(range(40))
    m.allocate("a", 9, token_ids=prompt[:9])
    m.commit("a", prompt[:9])
    m.free("a")
    m.allocate("b", 24)
    m.free("b")  # took every slot: a's two blocks went to the host
    assert m.probe_tiers(prompt[:25]) == (0, 8)
    before = everything(m)
    with pytest.raises(OutOfBlocks) as exc:
        m.allocate("c", 25, token_ids=prompt[:25])  # 7 blocks, 6 slots
    assert exc.value.detail["needed"] == 7 and exc.value.detail["free"] == 6
    assert same(everything(m), before)
    assert m.probe_tiers(prompt[:25]) == (0, 8)
    out = m.step_columns(allocate=[{"request_id": "c", "num_tokens": 25, "token_ids": prompt[:25]}])
    assert out.status["allocate"].tolist() == [status_of(OutOfBlocks.code)]
    assert same(everything(m), before)
    info = m.allocate("c", 21, token_ids=prompt[:21])  # 6 blocks: fits, onboards the two
    assert info.num_hit_tokens == 8 and m.probe_tiers(prompt[:9]) == (8, 0)


def test_a_step_frees_a_suspended_request_as_free_does() -> None:
    """Issue 31, 3: ``free`` of a suspended request in a step (ops and columns), as
    ``free()`` and the docs allow; in an all-or-nothing step that stops, it stays suspended
    with its host copies."""
    m = host_manager(8)
    for rid in ("a", "b", "c"):
        m.allocate(rid, 5)
        m.suspend(rid)
    held = m.parts.host.held[0]
    assert held == 6
    results = m.step([FreeOp(request_id="a")])
    assert results[0].ok and "a" not in m.request_ids() and m.parts.host.held[0] == 4
    handle = m.request("b").handle
    out = m.step_columns(free=[handle])
    assert out.status["free"].tolist() == [0] and out.freed_ids == ["b"]
    assert m.parts.host.held[0] == 2
    before = everything(m)
    results = m.step(
        [FreeOp(request_id="c"), ExtendOp(request_id="nope", num_new_tokens=1)], atomic=True
    )
    assert not results[0].ok and same(everything(m), before)
    assert m.resume("c").num_tokens == 5


def test_an_atomic_step_offloads_only_into_slots_free_when_it_began() -> None:
    """What makes its undo exact and cheap: within an all-or-nothing step, a block evicted
    while the host is full is dropped (the host keeps its blocks, no byte of them is
    overwritten), and the slots of a suspended request the step frees are reused only after
    it. The same step, not atomic, offloads at the cost of the host's oldest blocks."""
    slot_bytes = host_manager(4).layout.pool_groups[0].slot_bytes
    prompts = [list(range(k * 100, k * 100 + 9)) for k in range(3)]

    def filled(atomic: bool) -> tuple[KVCacheManager, list[Any]]:
        """p0's two blocks on the (full) host, p1's two cached on the device; then a step
        that takes every device slot, evicting p1's."""
        m = manager([layer(0)], num_blocks=4, host_memory_bytes=2 * slot_bytes)
        for i, p in enumerate(prompts[:2]):
            m.allocate(f"p{i}", 9, token_ids=p)
            m.commit(f"p{i}", p)
            m.free(f"p{i}")
            if i == 0:
                m.allocate("f", 16)  # p0's blocks to the host
                m.free("f")
        assert m.parts.host is not None and m.parts.host.num_used(0) == 2
        assert m.probe_tiers(prompts[0]) == (0, 8) and m.probe_tiers(prompts[1]) == (8, 0)
        return m, m.step([{"op": "allocate", "request_id": "x", "num_tokens": 16}], atomic=atomic)

    m, results = filled(atomic=True)
    assert results[0].ok and m.host_stats()["host_used"] == {0: 2}
    assert m.probe_tiers(prompts[0]) == (0, 8)  # the host kept p0's blocks: p1's dropped
    assert m.host_stats()["dropped_blocks"] == 2
    m, results = filled(atomic=False)
    assert results[0].ok and m.probe_tiers(prompts[0]) == (0, 0)  # dropped for p1's
    assert m.probe_tiers(prompts[1]) == (0, 8)


def test_an_atomic_step_does_not_reuse_the_slots_of_a_suspended_request_it_frees() -> None:
    m = manager([layer(0)], num_blocks=4, host_memory_bytes=65536)
    m.allocate("s", 8)
    m.suspend("s")  # 2 host slots held
    m.allocate("a", 9, token_ids=list(range(9)))
    m.commit("a", list(range(9)))
    m.free("a")  # a's 2 blocks cached on the device
    host = m.parts.host
    assert host is not None
    free_before = list(host.free[0])
    out = m.step(
        [
            {"op": "free", "request_id": "s"},
            {"op": "allocate", "request_id": "x", "num_tokens": 16},  # evicts a's blocks
        ],
        atomic=True,
    )
    assert all(r.ok for r in out)
    stored = list(host.lru[0].values())
    assert stored == free_before[::-1][:2]  # taken from the free list, not s's slots
    assert host.held[0] == 0 and len(host.free[0]) + len(stored) == host.num_slots[0]


def test_a_tier_hit_is_cut_where_state_layers_resume_before_it_onboards() -> None:
    """A host hit of 5 blocks when the state's checkpoints are every 8 blocks resumes at 0:
    the allocate checks its fit with that hit, refuses before any copy when it does not
    fit, and ``probe_tiers`` says what it would onboard (nothing)."""
    shape: dict[str, Any] = {
        "num_blocks": 10,
        "max_requests": 4,
        "max_seq_len": 64,
        "state_checkpoint_stride": 8,
        **{k: v for k, v in STATE.items() if k == "state_layers"},
    }
    slot_bytes = manager([layer(0)], **shape).layout.pool_groups[0].slot_bytes
    m = manager([layer(0)], host_memory_bytes=6 * slot_bytes, **shape)
    prompt = list(range(100, 140))
    m.allocate("a", 33, token_ids=prompt[:33])
    m.commit("a", prompt[:33])  # blocks 0-7, a checkpoint at block 8's boundary
    m.free("a")
    m.allocate("f", 40)  # takes every slot: a's blocks go to the host, which keeps 5
    m.free("f")
    m.allocate("b", 9, token_ids=prompt[:9])
    m.commit("b", prompt[:9])  # b holds blocks 0-1 on the device
    device, host = m.probe_tiers(prompt[:33])
    assert device == 0 and host == 0  # no checkpoint below the tiers' 5 blocks
    before = everything(m)
    with pytest.raises(OutOfBlocks):
        m.allocate("c", 33, token_ids=prompt[:33])  # 9 blocks, 7 free: nothing onboarded
    assert same(everything(m), before)


def test_repeated_caller_given_block_keys_are_refused_before_anything() -> None:
    from kvcm import block_keys

    m = host_manager(6)
    prompt = list(range(13))
    m.allocate("a", 9, token_ids=prompt[:9])
    m.commit("a", prompt[:9])
    m.free("a")
    m.allocate("f", 24)
    m.free("f")  # a's blocks on the host
    k0 = block_keys(prompt[:9], 4)[0]
    before = everything(m)
    with pytest.raises(InvalidArgument, match="repeat"):
        m.allocate("c", 13, token_ids=prompt, block_keys=[k0, k0, k0])
    assert same(everything(m), before)


def test_the_prefix_cache_is_not_reset_inside_a_transaction() -> None:
    m = host_manager(4)
    with m.transaction(), pytest.raises(InvalidArgument, match="transaction"):
        m.reset_prefix_cache()


# -- the class: every refused op, at random ---------------------------------------------------


def _random_op(
    m: KVCacheManager,
    rng: np.random.Generator,
    prompts: list[list[int]],
    prefilled: list[tuple[str, list[int], int]],
) -> Any:
    """One op that may fail, as a zero-argument callable; an allocate that succeeds adds
    its request, prompt and hit to ``prefilled`` (the engine then commits the prompt)."""
    live = [r for r in m.request_ids() if r not in m.parts.requests.suspended]
    suspended = sorted(m.parts.requests.suspended)
    rid = f"r{rng.integers(0, 12)}"
    prompt = prompts[rng.integers(0, len(prompts))]
    n = int(rng.integers(1, len(prompt) + 1))
    kind = rng.integers(0, 8)
    if kind == 0:
        lookahead = int(rng.integers(0, 3))

        def allocate() -> Any:
            info = m.allocate(rid, n, token_ids=prompt[:n], lookahead=lookahead)
            prefilled.append((rid, prompt[:n], info.num_hit_tokens))
            return info

        return allocate
    if kind == 1 and live:
        return lambda: m.extend(live[rng.integers(0, len(live))], int(rng.integers(1, 12)))
    if kind == 2 and live:
        r = live[rng.integers(0, len(live))]
        return lambda: m.commit(r, [int(t) for t in rng.integers(-1, 50, rng.integers(1, 6))])
    if kind == 3 and live:
        return lambda: m.suspend(live[rng.integers(0, len(live))])
    if kind == 4 and suspended:
        return lambda: m.resume(suspended[rng.integers(0, len(suspended))])
    if kind == 5 and (live or suspended):
        pool = live + suspended
        return lambda: m.free(pool[rng.integers(0, len(pool))])
    # A step of random ops, all or nothing, often with a last op that fails.
    ops: list[dict[str, Any]] = []
    for _ in range(int(rng.integers(1, 5))):
        pick = rng.integers(0, 4)
        if pick == 0:
            k = int(rng.integers(1, len(prompt) + 1))
            ops.append(
                {
                    "op": "allocate",
                    "request_id": f"r{rng.integers(0, 12)}",
                    "num_tokens": k,
                    "token_ids": prompt[:k],
                }
            )
        elif pick == 1 and live:
            r = live[rng.integers(0, len(live))]
            ops.append({"op": "extend", "request_id": r, "num_new_tokens": int(rng.integers(1, 9))})
        elif pick == 2 and (live or suspended):
            pool = live + suspended
            ops.append({"op": "free", "request_id": pool[rng.integers(0, len(pool))]})
        else:
            ops.append(
                {"op": "allocate", "request_id": "x", "num_tokens": int(rng.integers(8, 40))}
            )
    if rng.random() < 0.6:
        ops.append({"op": "extend", "request_id": "nope", "num_new_tokens": 1})
    return lambda: m.step(ops, atomic=True)


STATE: dict[str, Any] = {
    "state_layers": [{"layer_id": 9, "buffers": [{"name": "sum", "shape": [2], "dtype": "fp32"}]}],
    "state_live_slots": 6,
    "state_checkpoints": 8,
}


@pytest.mark.parametrize(
    ("seed", "model"),
    [(0, "full"), (1, "full"), (2, "window"), (3, "window"), (4, "state"), (5, "state")],
)
def test_random_refused_ops_change_nothing_and_kept_blocks_keep_their_bytes(
    seed: int, model: str
) -> None:
    """Random allocates (prompts sharing prefixes), extends, commits, suspends, resumes,
    frees and all-or-nothing steps on a device pool and a host tier both much smaller than
    the working set, so that refused ops happen while blocks are being evicted, offloaded,
    dropped by the host's LRU and onboarded: every refused one leaves ``everything`` as it
    was. The host's bytes are those of a block checksum each op writes into the pages of
    its request (as an engine writes KV), so a byte a refused step moved shows."""
    rng = np.random.default_rng(seed)
    # A sliding window of 8 tokens beside full attention shares one pool group (twice the
    # slots); the state layer's host share comes out of the same budget.
    layers = [layer(0, sliding_window=8), layer(1)] if model == "window" else [layer(0)]
    shape: dict[str, Any] = {
        "num_blocks": 20 if model == "window" else 10,
        "max_requests": 8,
        "max_seq_len": 40,
        **(STATE if model == "state" else {}),
    }
    slot_bytes = manager(layers, **shape).layout.pool_groups[0].slot_bytes
    m = manager(layers, host_memory_bytes=8 * slot_bytes, **shape)  # drops happen
    assert m.parts.host is not None and 4 <= m.parts.host.num_slots[0] <= 8
    pool = m.memory.tensors[m.layout.pool_groups[0].pools[0]]
    words = pool.view(torch.int64).numpy()
    families = [rng.integers(0, 1000, 40).tolist() for _ in range(6)]
    prompts = [f[:n] for f in families for n in (9, 17, 33)]
    refused = steps_refused = 0
    for n in range(400):
        before = everything(m)
        prefilled: list[tuple[str, list[int], int]] = []
        op = _random_op(m, rng, prompts, prefilled)
        try:
            result = op()
        except KVCMError:
            refused += 1
            assert same(everything(m), before)
            continue
        stopped = isinstance(result, Sequence) and result and not result[-1].ok
        if stopped:  # an all-or-nothing step: every result an error
            steps_refused += 1
            assert same(everything(m), before)
            continue
        for rid, prompt, hit in prefilled:  # the engine computed the prompt's KV
            m.commit(rid, prompt[hit:])
        for rid in m.request_ids():  # the engine writes each live block's KV
            if rid not in m.parts.requests.suspended:
                for table in m.block_table(rid):
                    for slot in table:
                        if slot >= 0:
                            words[slot, 0] = n * 1000 + slot
    assert refused > 40 and steps_refused > 40
    assert m.host_stats()["dropped_blocks"] > 0 and m.host_stats()["onboarded_blocks"] > 0

"""The host tier's copies (kvcm.tier_copies) and block states (kvcm.host_tier.BlockState):
segments, batches and their hazards, the state of a block through offload, onboard and
recompute, and a consumer reading the tables while copies are in flight."""

from __future__ import annotations

import threading
import time
from contextlib import nullcontext
from typing import Any

import numpy as np
import pytest
import torch
from helpers import layer, manager

import kvcm_kernels
from kvcm import KVCacheManager, block_keys
from kvcm.hashing import root_key
from kvcm.host_tier import BlockState
from kvcm.tier_copies import TierCopier

TPB = 4


def test_segments_cut_slots_into_pieces() -> None:
    # The worked example of kvcm_kernels.block_copy: two 80 KiB slots, pieces of 32 KiB.
    p, h = 1 << 40, 1 << 41
    rows = kvcm_kernels.segments(np.array([3, 5]) * 81920 + p, np.array([0, 1]) * 81920 + h, 81920)
    assert rows.tolist() == [[p + 245760, h, 81920], [p + 409600, h + 81920, 81920]]
    assert kvcm_kernels.pieces(rows).tolist() == [
        [p + 245760, h, 32768],
        [p + 278528, h + 32768, 32768],
        [p + 311296, h + 65536, 16384],
        [p + 409600, h + 81920, 32768],
        [p + 442368, h + 114688, 32768],
        [p + 475136, h + 147456, 16384],
    ]


def test_the_reference_copies_every_segment() -> None:
    rng = np.random.default_rng(0)
    src = rng.integers(0, 256, (6, 96), dtype=np.uint8)
    dst = np.zeros((4, 96), dtype=np.uint8)
    desc = kvcm_kernels.segments(
        src.ctypes.data + np.array([5, 0, 2]) * 96, dst.ctypes.data + np.array([1, 3, 0]) * 96, 96
    )
    kvcm_kernels.copy_segments(desc, torch.device("cpu"))
    assert (dst[[1, 3, 0]] == src[[5, 0, 2]]).all() and not dst[2].any()


def test_the_reference_refuses_segments_that_depend_on_each_other() -> None:
    buf = np.zeros(256, dtype=np.uint8)
    a = buf.ctypes.data
    ok = np.array([[a, a + 64, 32], [a + 32, a + 128, 32], [a + 96, a + 160, 32]])
    kvcm_kernels.copy_segments_reference(ok)  # reads and writes all disjoint
    with pytest.raises(ValueError, match="write the same bytes"):
        kvcm_kernels.copy_segments_reference(np.array([[a, a + 64, 32], [a + 32, a + 80, 32]]))
    with pytest.raises(ValueError, match="reads bytes another one writes"):
        kvcm_kernels.copy_segments_reference(np.array([[a, a + 64, 32], [a + 90, a + 160, 8]]))


def _copier(immediate: bool) -> tuple[TierCopier, torch.Tensor, list[torch.Tensor]]:
    """One pool group of one pool: 12 device slots of 48 bytes, a host region of 8 slots in
    chunks of 3 (so host slots 3-5 are chunk 1)."""
    device = torch.arange(12 * 48, dtype=torch.int64).remainder(251).to(torch.uint8).view(12, 48)
    chunks = [torch.full((3, 48), 200 + c, dtype=torch.uint8) for c in range(2)]
    chunks.append(torch.full((2, 48), 202, dtype=torch.uint8))
    return (
        TierCopier([device], {0: chunks}, {0: [0]}, torch.device("cpu"), immediate),
        device,
        chunks,
    )


def test_copies_wait_for_the_batch_and_a_hazard_launches_early() -> None:
    copier, device, chunks = _copier(immediate=False)
    old7, old9, host4 = device[7].clone(), device[9].clone(), chunks[1][1].clone()
    copier.queue(0, True, [7, 9], [0, 4])  # evict 7 and 9 to host 0 and 4
    copier.queue(0, True, [2], [6])  # no slot in common: same batch
    assert copier.stats.copy_launches == 0 and copier.queued == 2
    assert copier.busy_device_slots(0) == {2, 7, 9} and copier.writing_host(0, 4)
    assert (chunks[1][1] == host4).all()  # nothing copied yet
    copier.queue(0, False, [7], [5])  # onboard host 5 into device 7, which a copy reads
    assert (copier.stats.copy_launches, copier.stats.copy_hazard_launches) == (1, 1)
    assert (chunks[0][0] == old7).all() and (chunks[1][1] == old9).all()
    assert copier.busy_device_slots(0) == {7} and copier.writing_device(0, 7)
    copier.queue(0, True, [1], [5])  # writes host 5, which the queued copy in reads
    assert copier.stats.copy_hazard_launches == 2
    assert (device[7] == 201).all()  # host 5 is chunk 1, row 2
    copier.queue(0, True, [3], [5])  # writes host 5 again: another hazard
    copier.finish()
    stats = copier.stats
    assert (stats.copy_launches, stats.copy_hazard_launches, copier.queued) == (4, 3, 0)
    assert (chunks[1][2] == device[3]).all() and not copier.busy_device_slots(0)


def test_immediate_copies_run_as_they_are_queued() -> None:
    copier, device, chunks = _copier(immediate=True)
    copier.queue(0, True, [4, 11], [7, 3])
    assert copier.stats.copy_launches == 1 and copier.queued == 0
    assert (chunks[2][1] == device[4]).all() and (chunks[1][0] == device[11]).all()
    copier.queue(0, False, [0], [7])
    assert (device[0] == device[4]).all()


def _deferred(m: KVCacheManager) -> list[dict[tuple[int, int], BlockState | None]]:
    """Make the CPU manager's copies wait for the op's end (as on CUDA), and record the
    state of every block of ``_keys`` at each op's end, before its copies complete."""
    host = m.parts.host
    assert host is not None
    host.copier.immediate = False
    seen: list[dict[tuple[int, int], BlockState | None]] = []
    finish = host.copier.finish

    def observed_finish() -> None:
        seen.append(_states(m))
        finish()

    host.copier.finish = observed_finish  # type: ignore[method-assign]
    return seen


_PROMPTS = {p: [p * 100 + t for t in range(9)] for p in range(3)}  # 2 full blocks each


def _states(m: KVCacheManager) -> dict[tuple[int, int], BlockState | None]:
    host = m.parts.host
    assert host is not None
    return {
        (p, b): host.state_of(m.parts.coord.cache, 0, root_key(), key)
        for p, prompt in _PROMPTS.items()
        for b, key in enumerate(block_keys(prompt, TPB))
    }


def _run(m: KVCacheManager, rid: str, p: int) -> Any:
    info = m.allocate(rid, 9, token_ids=_PROMPTS[p])
    m.commit(rid, _PROMPTS[p][info.num_hit_tokens :])
    return info


def test_a_block_goes_device_copying_out_host_copying_in_device() -> None:
    # 6 device slots, 8 host slots; each prompt fills 2 blocks and a partial third.
    m = manager([layer(0)], num_blocks=6, host_memory_bytes=8 * 128)
    seen = _deferred(m)
    D, OUT, H, IN = (BlockState.DEVICE, BlockState.COPYING_OUT, BlockState.HOST,
                     BlockState.COPYING_IN)  # fmt: skip
    for rid, p in (("a", 0), ("b", 1)):
        _run(m, rid, p)
        m.free(rid)
    assert [_states(m)[p, b] for p in (0, 1) for b in (0, 1)] == [D] * 4
    info = _run(m, "c", 2)  # takes a's slots (freed tail first): [2, 1, 0]
    assert info.num_hit_tokens == 0 and m.block_table("c") == [[2, 1, 0]]
    assert seen[-2][0, 0] == seen[-2][0, 1] == OUT  # at the allocate's end (then commit's)
    assert _states(m)[0, 0] == _states(m)[0, 1] == H
    m.free("c")
    copier = m.parts.host.copier  # type: ignore[union-attr]
    hazards = copier.stats.copy_hazard_launches
    # Prompt 0 again: its blocks onboard into slots 5 and 4; 4 held prompt 1's block 1
    # (b had [3, 4, 5]), whose copy out is launched first (a hazard), then d's third block
    # evicts prompt 1's block 0 from slot 3 into a free host slot (not the two the copies
    # in read: those go back to the far end of the free list).
    info = _run(m, "d", 0)
    assert info.num_hit_tokens == 8 and m.block_table("d") == [[5, 4, 3]]
    at_end = seen[-2]  # the allocate's end; the commit's is seen[-1]
    assert at_end[0, 0] == at_end[0, 1] == IN
    assert at_end[1, 0] == OUT and at_end[1, 1] == H  # the CPU's launched copies are done
    assert copier.stats.copy_hazard_launches == hazards + 1
    states = _states(m)
    assert states[0, 0] == states[0, 1] == D and states[1, 0] == states[1, 1] == H
    stats = m.host_stats()
    assert (stats["offloaded_blocks"], stats["onboarded_blocks"]) == (4, 2)


def test_a_recomputed_host_block_is_on_both_and_eviction_needs_no_copy() -> None:
    m = manager([layer(0)], num_blocks=6, host_memory_bytes=8 * 128)
    for rid, p in (("a", 0), ("b", 1), ("c", 2)):
        _run(m, rid, p)
        m.free(rid)
    assert _states(m)[0, 0] == _states(m)[0, 1] == BlockState.HOST
    # Recompute prompt 0 without onboarding (an all-or-nothing step does not onboard): its
    # commit publishes both blocks on the device while the host keeps its copies.
    with m.transaction():
        info = m.allocate("d", 9, token_ids=_PROMPTS[0])
        m.commit("d", _PROMPTS[0][info.num_hit_tokens :])
    assert info.num_hit_tokens == 0 and m.block_table("d") == [[5, 4, 3]]
    assert _states(m)[0, 0] == _states(m)[0, 1] == BlockState.BOTH
    m.free("d")
    _run(m, "e", 1)  # onboards prompt 1 into [0, 1], evicting prompt 2 (copied out)
    m.free("e")
    assert m.host_stats()["offloaded_blocks"] == 6
    seen = _deferred(m)
    _run(m, "f", 2)  # onboards prompt 2 into [3, 4]: evicts prompt 0's blocks, no copy
    assert m.block_table("f") == [[3, 4, 5]]
    assert seen[-2][0, 0] == seen[-2][0, 1] == BlockState.HOST  # the allocate's end
    assert seen[-2][2, 0] == seen[-2][2, 1] == BlockState.COPYING_IN
    assert m.host_stats()["offloaded_blocks"] == 6


def _consumer_violations(monkeypatch: pytest.MonkeyPatch, immediate: bool) -> tuple[int, int]:
    """Run prefix-sharing requests on a tiny pool with slow copies, while a thread reads the
    page tables during every copy: returns (reads during a copy, table cells it saw holding
    a slot whose copy was in flight)."""
    m = manager([layer(0)], num_blocks=6, host_memory_bytes=8 * 128)
    host = m.parts.host
    assert host is not None
    host.copier.immediate = immediate
    in_copy = threading.Event()
    done = threading.Event()
    real = kvcm_kernels.copy_segments

    def slow_copy(desc: np.ndarray, device: torch.device) -> Any:
        in_copy.set()
        time.sleep(0.002)  # a long copy: the consumer reads the tables meanwhile
        out = real(desc, device)
        in_copy.clear()
        return out

    reads, bad = 0, 0

    def consumer() -> None:
        nonlocal reads, bad
        coord = m.parts.coord
        while not done.is_set():
            if not in_copy.wait(0.001):
                continue
            live = [r for r in range(coord.tables.shape[1]) if m.parts.requests.ids[r] is not None]
            cells = {int(s) for r in live for s in coord.tables[0][r] if s > coord.empty}
            busy = set(host.copier.busy_device_slots(0))
            if in_copy.is_set():
                reads += 1
                bad += len(cells & busy)

    thread = threading.Thread(target=consumer)
    monkeypatch.setattr(kvcm_kernels, "copy_segments", slow_copy)
    thread.start()
    try:
        for i in range(30):
            _run(m, f"r{i}", i % 3)
            m.free(f"r{i}")
    finally:
        monkeypatch.undo()
        done.set()
        thread.join()
    return reads, bad


def test_a_consumer_reading_the_tables_never_sees_a_slot_in_flight(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    reads, bad = _consumer_violations(monkeypatch, immediate=True)
    assert reads > 10 and bad == 0
    # The same consumer does catch it when copies are left for the op's end on the CPU,
    # where table cells are visible as soon as they are written (why the CPU copies now).
    reads, bad = _consumer_violations(monkeypatch, immediate=False)
    assert reads > 10 and bad > 0


def run_random_copies(
    copier: TierCopier,
    device: torch.Tensor,
    chunks: list[torch.Tensor],
    rng: np.random.Generator,
    steps: int,
    max_copies: int,
    host_slots: int,
) -> None:
    """Queue random copies of pool group 0 (up to ``max_copies`` blocks each, either way,
    finishing now and then) and check every byte against making each copy alone, in order
    (also on CUDA: tests/gpu/test_tier_copies_gpu.py)."""
    want_dev = device.cpu().clone()
    want_host = torch.cat([c.clone() for c in chunks])
    for _ in range(steps):
        n = int(rng.integers(1, max_copies + 1))
        out = bool(rng.integers(0, 2))
        d = rng.choice(device.shape[0], n, replace=False).tolist()
        h = rng.choice(host_slots, n, replace=False).tolist()
        copier.queue(0, out, d, h)
        if out:
            want_host[h] = want_dev[d]
        else:
            want_dev[d] = want_host[h]
        if rng.random() < 0.1:
            copier.finish()
            assert not copier.busy_device_slots(0)
    copier.finish()
    assert torch.equal(device.cpu(), want_dev) and torch.equal(torch.cat(chunks), want_host)


@pytest.mark.parametrize("seed", [0, 1])
def test_random_copy_batches_equal_copies_one_by_one(seed: int) -> None:
    """Queues of random copies with every kind of hazard, batched, against running each copy
    on its own in order."""
    copier, device, chunks = _copier(immediate=False)
    run_random_copies(copier, device, chunks, np.random.default_rng(seed), 300, 3, 8)
    assert copier.stats.copy_hazard_launches > 10


class _FakeRuntime:
    """CUDA's runtime calls ``TierCopier._copy_now`` makes, on host memory: memcpyAsync is a
    memmove now, events are only recorded in ``waits`` (there is no stream to order);
    ``busy``: whether the current stream (handle 3) has work in flight."""

    def __init__(self) -> None:
        self.copies: list[tuple[int, int, int]] = []
        self.waits: list[tuple[str, int, int]] = []
        self.busy = False

    def streamQuery(self, stream: int) -> int:
        assert stream == 3
        return 600 if self.busy else 0  # cudaErrorNotReady / cudaSuccess

    def memcpyAsync(self, dst: int, src: int, n: int, kind: int, stream: int) -> None:
        import ctypes

        assert kind == 4 and stream == 7
        self.copies.append((dst, src, n))
        ctypes.memmove(dst, src, n)

    def eventRecord(self, event: int, stream: int) -> None:
        self.waits.append(("record", event, stream))

    def streamWaitEvent(self, stream: int, event: int, flags: int) -> None:
        self.waits.append(("wait", stream, event))

    def eventSynchronize(self, event: int) -> None:
        pass


def test_copies_on_the_copy_engines_go_out_as_queued(monkeypatch: pytest.MonkeyPatch) -> None:
    """The CUDA short path (slots of at least ``dma_min_bytes``: one memcpyAsync per block and
    pool, as queued), run on host memory through a fake runtime: its addresses, its slots in
    flight until ``finish``, and no batch."""
    copier, device, chunks = _copier(immediate=False)
    rt = _FakeRuntime()
    copier.stream = object()  # type: ignore[assignment]  # stands for the tier's stream
    copier._rt, copier._stream, copier._ready, copier._done = rt, 7, 1, 2
    copier._engines = {0: True}  # the 48-byte slots go to the "copy engines"
    monkeypatch.setattr(kvcm_kernels, "current_stream_handle", lambda index: 3)
    monkeypatch.setattr(kvcm_kernels.block_copy, "on_device", lambda index: nullcontext())
    old5, old7 = device[5].clone(), device[7].clone()
    rt.busy = True  # the copies out wait for the current stream's work
    copier.queue(0, True, [5, 7], [4, 0])  # host 4 is chunk 1, row 1
    assert rt.waits == [("record", 1, 3), ("wait", 7, 1), ("record", 2, 7)]
    assert len(rt.copies) == 2 and copier.queued == 0 and copier.stats.copy_launches == 1
    assert rt.copies[0] == (chunks[1][1].data_ptr(), device[5].data_ptr(), 48)
    assert (chunks[1][1] == old5).all() and (chunks[0][0] == old7).all()
    assert copier.busy_device_slots(0) == {5, 7} and copier.writing_host(0, 4)
    rt.busy, rt.waits = False, []  # an idle current stream: nothing to wait for
    copier.queue(0, False, [5], [0])  # back into device 5: stream order, no hazard launch
    assert rt.waits == [("record", 2, 7)]
    assert (device[5] == old7).all() and copier.stats.copy_hazard_launches == 0
    copier.finish()
    assert not copier.busy_device_slots(0) and not copier._launched

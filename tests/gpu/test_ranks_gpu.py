"""Ranks on CUDA (kvcm.ranks): every rank's device tables and fused step kernel against the
CPU reference over random engine steps, and the TP 2 x PP 2 engine of tests/test_ranks.py
served from ``kvcm serve`` on the GPU, mapped through CUDA IPC by a process per rank.

Ranks go to ``cuda:{r % device_count}``: on a one-GPU machine, four logical ranks on one card
(their own pools and tables each, as on four cards)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from servers import serve_process
from test_ranks import RANKS, a_process_per_rank, config, every_rank_against_dense, ranked_config

from kvcm import KVCacheManager
from kvcm_client.errors import KVCMError


def _devices(n: int) -> list[str]:
    return [f"cuda:{r % torch.cuda.device_count()}" for r in range(n)]


def test_every_ranks_tables_and_slot_mappings_match_the_cpu_reference() -> None:
    """300 random steps (allocate, extend with lookahead, rewind, free) on a
    4-rank CUDA manager and a CPU one; after each, some ranks ask for their slot mappings
    (the fused kernel: their queued edits plus the mapping) and others not, so ranks fall
    behind by several steps: every rank's mapping and device tables equal the CPU's."""
    ranks = [r | {"device": d} for r, d in zip(RANKS, _devices(4), strict=True)]
    gpu = KVCacheManager(config(ranks=ranks, num_blocks=64, max_requests=8))
    cpu = KVCacheManager(config(num_blocks=64, max_requests=8))
    rng = np.random.default_rng(0)
    live: list[str] = []
    for step in range(300):
        kind, n, ahead = rng.integers(0, 4), int(rng.integers(1, 20)), int(rng.integers(0, 3))
        for m in (gpu, cpu):
            try:
                if kind == 0 or not live:
                    m.allocate(f"r{step}", n)
                elif kind == 1:
                    m.extend_many(live, lookahead=ahead)
                elif kind == 2 and m.request(live[0]).num_tokens > 2:
                    m.rewind(live[0], 1)
                else:
                    m.free(live[-1])
            except KVCMError:
                pass  # refused alike on both (asserted below through the tables)
        live = cpu.request_ids()
        assert gpu.request_ids() == live
        if not live:
            continue
        want = cpu.slot_mappings(live).numpy()
        for r in range(4):
            if r and rng.random() < 0.5:
                continue  # this rank falls behind: its edits wait in its queue
            got = gpu.rank(r).slot_mappings(live)
            assert got.device == gpu.rank(r).device and np.array_equal(got.cpu().numpy(), want)
            assert torch.equal(gpu.rank(r).page_tables().cpu(), cpu.page_tables())
    for r in range(4):
        assert torch.equal(gpu.rank(r).page_tables().cpu(), cpu.page_tables())


def test_a_tp_pp_engine_on_the_gpu_attends_like_dense_attention(tmp_path: Path) -> None:
    pytest.importorskip("cupy")
    with serve_process("--config", str(ranked_config(tmp_path, "cuda:0"))) as (url, _, _):
        every_rank_against_dense(url)
        a_process_per_rank(url)


@pytest.mark.parametrize("kernels", ["cupy", "reference"])
def test_an_undone_step_leaves_every_ranks_device_tables_equal_to_the_host(
    kernels: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Slot mappings inside a transaction take the edits to every rank (the manager's
    ``_sync_other_ranks``); the undo must edit them back. With the torch reference kernels
    too (``KVCM_KERNELS=reference``), whose table edits come from pinned host memory."""
    if kernels == "reference":
        monkeypatch.setenv("KVCM_KERNELS", "reference")
    ranks = [r | {"device": d} for r, d in zip(RANKS, _devices(4), strict=True)]
    m = KVCacheManager(config(ranks=ranks, num_blocks=64))
    m.allocate("a", 5)
    m.slot_mappings(["a"])
    with m.transaction() as undo:
        m.allocate("b", 9)
        m.slot_mappings(["a", "b"])
        undo()
    m.slot_mappings(["a"])
    host = torch.from_numpy(m.parts.coord.tables)
    for r in range(4):
        assert torch.equal(m.rank(r)._tables.tensor.cpu(), host), r

"""The null page on cuda:0: the CUDA manager against the CPU manager, both with
``null_page=True``, on random steps; the CUDA tables (shared through IPC or not) hold 0 where
there is no page; a tile-loading consumer in another process reads them through CUDA IPC."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from servers import serve_process
from test_null_page import decode_tiles_against_dense, write_tile_config

from kvcm import KVCacheManager, KVCMError
from kvcm_client.models import AllocateOp, ExtendOp

DEVICE = "cuda:0"
LAYERS = [
    {"layer_id": 0, "num_kv_heads": 2, "head_dim": 8, "sliding_window": 12, "sink_tokens": 3},
    {"layer_id": 1, "num_kv_heads": 2, "head_dim": 8},
    {"layer_id": 2, "num_kv_heads": 1, "head_dim": 16, "kv_factor": 1},
    {"layer_id": 3, "num_kv_heads": 2, "head_dim": 16, "dtype": "nvfp4"},
]
#: (layer, role) whose page indices are compared: a window layer's value, a key-only layer,
#: an nvfp4 scale (its own pool).
INDEXED = ((0, "value"), (2, "key"), (3, "key_scale"))


CONFIG = {
    "layers": LAYERS,
    "tokens_per_block": 4,
    "max_requests": 16,
    "max_seq_len": 128,
    "num_blocks": 150,
    "null_page": True,
}


def _pair() -> tuple[KVCacheManager, KVCacheManager]:
    return KVCacheManager(CONFIG), KVCacheManager(CONFIG | {"device": DEVICE})


def test_cuda_manager_with_the_null_page_matches_cpu_on_random_steps() -> None:
    """Allocates with prompts of three families (prefix hits), commits, batched extends,
    rewinds, frees and all-or-nothing steps, the same on both managers. After every op the
    CUDA manager's slot mappings (fused with the pending table edits, or not), page tables,
    page indices (all modes) and block tables equal the CPU manager's; at the end slot 0 of
    every CUDA pool is still zero."""
    rng = np.random.default_rng(11)
    cpu, gpu = _pair()
    families = [rng.integers(0, 50, size=160).tolist() for _ in range(3)]
    family: dict[str, int] = {}

    def both(op: Callable[[KVCacheManager], Any]) -> None:
        out = []
        for m in (cpu, gpu):
            try:
                out.append(op(m))
            except KVCMError as exc:
                out.append(exc.code)
        assert out[0] == out[1]

    for step in range(300):
        live = cpu.request_ids()
        r = rng.random()
        if not live or r < 0.2:
            rid, f, n = f"r{step}", int(rng.integers(3)), int(rng.integers(1, 40))
            family[rid] = f
            both(lambda m, rid=rid, f=f, n=n: m.allocate(rid, n, token_ids=families[f][:n]))
        elif r < 0.3:
            rid = live[int(rng.integers(len(live)))]
            both(lambda m, rid=rid: m.free(rid))
        elif r < 0.4:
            rid = live[int(rng.integers(len(live)))]
            info = cpu.request(rid)
            ids = families[family[rid]][info.num_committed : info.num_tokens]
            both(lambda m, rid=rid, ids=ids: m.commit(rid, ids))
        elif r < 0.5:
            rid, k = live[int(rng.integers(len(live)))], int(rng.integers(1, 5))
            both(lambda m, rid=rid, k=k: m.rewind(rid, k))
        elif r < 0.6:
            # All or nothing: an allocate past max_seq_len (128) undoes the extends.
            rid, f, n = f"x{step}", int(rng.integers(3)), int(rng.integers(1, 160))
            family[rid] = f
            ops: list[Any] = [ExtendOp(request_id=x, num_new_tokens=2) for x in live[:4]]
            ops.append(AllocateOp(request_id=rid, num_tokens=n, token_ids=families[f][:n]))
            both(lambda m, ops=ops: m.step(ops, atomic=True))
        else:
            ids = [x for x in live if cpu.request(x).num_tokens < 120]
            both(lambda m, ids=ids: m.extend_many(ids))
        live = cpu.request_ids()
        assert gpu.request_ids() == live
        if live:
            # The first read after ops applies their edits: fused with this slot mapping.
            if step % 3 == 0:
                a, b = cpu.slot_mappings(live), gpu.slot_mappings(live)
            elif step % 3 == 1:
                pad = int(cpu.slot_mappings(live).shape[1]) + 5
                a, b = cpu.slot_mapping(live, 0, pad_to=pad), gpu.slot_mapping(live, 0, pad_to=pad)
            else:  # every position: those of released window blocks map to -1, not slot 0
                counts = [cpu.request(x).num_tokens for x in live]
                a, b = cpu.slot_mappings(live, counts), gpu.slot_mappings(live, counts)
            assert torch.equal(a, b.cpu())
            assert not ((a >= 0) & (a < cpu.tokens_per_block)).any()
        tables = gpu.page_tables()
        assert tables.device.type == "cuda" and int(tables.min()) == 0
        assert torch.equal(tables.cpu(), cpu.page_tables())
        for rid in live:
            assert gpu.block_table(rid) == cpu.block_table(rid)
        if live:
            for lid, role in INDEXED:
                for mode, per_layer in (("slot", False), ("kernel", False), ("kernel", True)):
                    a = cpu.page_indices(live, lid, role, mode=mode, per_layer=per_layer)
                    b = gpu.page_indices(live, lid, role, mode=mode, per_layer=per_layer)
                    assert torch.equal(a, b.cpu())
        assert gpu.stats() == cpu.stats()
    for pool in gpu.memory.tensors:
        assert pool.is_cuda and int(pool[0].count_nonzero()) == 0


def test_cuda_copy_tokens_with_the_null_page_matches_cpu() -> None:
    cpu, gpu = _pair()
    torch.manual_seed(3)
    for a, b in zip(cpu.memory.tensors, gpu.memory.tensors, strict=True):
        a.copy_(torch.randint(0, 256, a.shape, dtype=torch.uint8))
        a[0].zero_()  # the null page, as the managers left it
        b.copy_(a)
    for m in (cpu, gpu):
        m.allocate("a", 20, lookahead=4)
        m.allocate("b", 9)
        m.extend_many(["a", "b"], [2, 1], [4, 0])
        m.copy_tokens(["a", "a", "b", "a"], [22, 23, 9, 1], [20, 21, 5, 0])
    for a, b in zip(cpu.memory.tensors, gpu.memory.tensors, strict=True):
        assert torch.equal(a, b.cpu())
        assert int(b[0].count_nonzero()) == 0


def test_shared_cuda_tables_hold_the_null_page() -> None:
    """With ``share=True`` the device tables are the IPC-exported memory: 0 from the start,
    0 for released blocks, back to all 0 after the frees."""
    pytest.importorskip("cupy", reason="sharing CUDA pools needs CuPy")
    cpu = KVCacheManager(CONFIG)
    gpu = KVCacheManager(CONFIG | {"device": DEVICE, "share": True})
    assert gpu.pools().null_page and gpu.describe().null_page
    tables = gpu.page_tables()  # the shared memory itself
    assert int(tables.count_nonzero()) == 0
    for m in (cpu, gpu):
        m.allocate("a", 30)
        for _ in range(20):
            m.extend("a", 1)  # past the window of 12: layer group 0 releases blocks
    gpu.sync_tables()
    assert torch.equal(tables.cpu(), cpu.page_tables()) and int(tables.min()) == 0
    row, window = gpu.request("a").row, gpu.block_table("a")[0]
    assert -1 in window
    assert tables[0, row, : len(window)].tolist() == [max(s, 0) for s in window]
    gpu.free("a")
    gpu.sync_tables()
    assert int(tables.count_nonzero()) == 0
    gpu.close()


def test_a_tile_loading_consumer_over_cuda_ipc_equals_dense_attention(tmp_path: Path) -> None:
    """``kvcm serve --device cuda:0`` with the null page; this process maps its pools and
    tables through CUDA IPC and loads whole tiles of every row (tests/test_null_page.py)."""
    pytest.importorskip("cupy", reason="CUDA IPC needs CuPy")
    config = write_tile_config(tmp_path, DEVICE)
    with serve_process("--config", str(config)) as (url, _, _):
        worst = decode_tiles_against_dense(url)
    assert worst < 1e-4  # GPU float32 rounding, as in test_shared_cuda.py

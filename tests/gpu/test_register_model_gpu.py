"""Registering a model on CUDA: the free-memory check reads the device, the new pools and tables
live on it, and shared CUDA pools (kept until the process exits) are not counted as freed."""

from __future__ import annotations

import pytest
import torch
from helpers import layer
from servers import serve_in_thread

from kvcm import InsufficientMemory, KVCacheManager
from kvcm.footprint import held_bytes
from kvcm.server.app import create_app
from kvcm_client import KVCacheClient

SMALL = {"layers": [layer(0), layer(1)], "tokens_per_block": 4, "max_seq_len": 32}


def test_the_manager_registers_a_model_on_the_gpu() -> None:
    m = KVCacheManager({**SMALL, "device": "cuda:0", "num_blocks": 33})
    # Pools (33 slots of 2 layers x K+V x 64 bytes) and tables (256 rows x 8 blocks of int32)
    # on the device, the tables' host copy besides.
    assert held_bytes(m.parts) == (33 * 256 + 256 * 8 * 4, 256 * 8 * 4)
    info = m.register_model(layers=[layer(0, head_dim=64)], memory_bytes=64 << 20)
    assert (info.config.device, m.layer_view(0, "key").device.type) == ("cuda:0", "cuda")
    m.allocate("a", 100)
    assert m.page_table(0).device.type == "cuda" and m.block_table("a")[0][:2] == [1, 2]
    m.free("a")
    free = torch.cuda.mem_get_info(0)[0]
    with pytest.raises(InsufficientMemory) as exc:
        m.register_model(layers=[layer(0)], memory_bytes=free + (64 << 30))
    assert exc.value.detail["free_bytes"] < exc.value.detail["needed_bytes"]
    assert m.generation == info.generation and m.num_free_blocks() == m.num_total_blocks()


def test_a_service_registers_shared_cuda_pools() -> None:
    pytest.importorskip("cupy")
    app = create_app(None, defaults={"device": "cuda:0", "share": True})
    with serve_in_thread(app) as url, KVCacheClient(url) as kv:
        first = kv.register_model(**SMALL, num_blocks=33)
        assert kv.pools().pools[0].kind == "cuda_ipc"
        assert held_bytes(app.state.kvcm.manager) == (0, 0)  # kept until the process exits
        second = kv.register_model(layers=[layer(0, head_dim=64)], memory_bytes=64 << 20)
        assert second.generation != first.generation and second.config.device == "cuda:0"
        # CUDA IPC handles open in another process only (tests/gpu/test_shared_cuda.py).
        layout = kv.pools()
        assert layout.generation == second.generation and layout.device == "cuda:0"
        assert {s.kind for s in layout.pools} == {"cuda_ipc"}

"""CUDA IPC end to end: ``kvcm serve --device cuda:0`` owns the pools and page tables, this
process maps them through CUDA IPC handles and computes paged attention through them."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from servers import serve_process
from test_shared_consumer import decode_against_dense, write_config

from kvcm_client import KVCacheClient


def test_cuda_pools_and_tables_map_into_another_process(tmp_path: Path) -> None:
    pytest.importorskip("cupy")
    with serve_process("--config", str(write_config(tmp_path, "cuda:0"))) as (url, _, _):
        with KVCacheClient(url) as kv:
            layout = kv.pools()
            assert layout.device == "cuda:0"
            assert {s.kind for s in layout.pools} == {"cuda_ipc"}
            assert all(s.device_uuid for s in layout.pools)
            with kv.attach() as att:
                assert att.layer_view(0, "key").device.type == "cuda"
                assert att.page_tables.device.type == "cuda"
        worst = decode_against_dense(url, steps=100)
    assert worst < 1e-5  # 7.2e-7 on the H200 (bench/runs/2026-12-02-h200-run6-shared-cuda.log)
    assert torch.cuda.is_available()

"""``KVCacheManager.decode_step`` on cuda:0 against ``step_columns`` of the same extends on a
twin manager: equal statuses, block counts, slot mappings (on the device, or from the host's
tables for a stream-ordered step) and device page tables after every step, with the general
path's steps (frees, allocates, stale handles) between them."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvcm import KVCacheManager, native

pytestmark = pytest.mark.skipif(not native.available(), reason="kvcm._native is not built")

LAYERS = [
    {"layer_id": 0, "num_kv_heads": 2, "head_dim": 8, "sliding_window": 12, "sink_tokens": 3},
    {"layer_id": 1, "num_kv_heads": 2, "head_dim": 8},
    {"layer_id": 2, "num_kv_heads": 1, "head_dim": 16, "kv_factor": 1},
]


@pytest.mark.parametrize("share", [False, True])
def test_decode_step_on_cuda_equals_step_columns(share: bool) -> None:
    pytest.importorskip("cupy")
    cfg = {
        "layers": LAYERS,
        "tokens_per_block": 4,
        "max_requests": 16,
        "max_seq_len": 128,
        "num_blocks": 300,
        "device": "cuda:0",
        "share": share,
    }
    own, general = KVCacheManager(cfg), KVCacheManager(cfg)
    rng = np.random.default_rng(11)
    live: list[int] = []
    stale: list[int] = []
    ran = 0
    for step in range(150):
        cols: dict[str, object] = {}
        if live and rng.random() < 0.15:
            gone = live.pop(int(rng.integers(len(live))))
            cols["free"] = [gone]
            stale.append(gone)
        if len(live) < 12 and rng.random() < 0.3:
            cols["allocate"] = [{"request_id": f"r{step}", "num_tokens": int(rng.integers(1, 30))}]
        if cols:
            outs = [m.step_columns(**cols) for m in (own, general)]
            assert outs[0].status["allocate"].tolist() == outs[1].status["allocate"].tolist()
            live += [int(h) for h in outs[0].handles if h]
        handles = list(live)
        if stale and rng.random() < 0.1:
            handles.append(stale[-1])  # a missed free: the general path
        new = int(rng.integers(1, 4)) if rng.random() < 0.2 else 1
        ordered = share and bool(step % 2)
        kw = {"map_slots": True, "stream_ordered": ordered}
        extend = np.array(handles, dtype=np.int64)
        a = own.decode_step(extend, new, **kw)
        b = general.step_columns(extend=extend, num_new_tokens=new, **kw)
        ran += a.ok
        assert a.status["extend"].tolist() == b.status["extend"].tolist(), step
        assert a.new_blocks.tolist() == b.new_blocks.tolist(), step
        assert a.slot_mapping.device == b.slot_mapping.device
        assert torch.equal(a.slot_mapping.cpu(), b.slot_mapping.cpu()), step
        torch.cuda.synchronize()
        assert torch.equal(own.page_tables(), general.page_tables()), step
        for i, h in enumerate(handles):
            if a.status["extend"][i] != 0 and h in live:  # past max_seq_len: done
                live.remove(h)
                own.step_columns(free=[h])
                general.step_columns(free=[h])
    assert ran > 100

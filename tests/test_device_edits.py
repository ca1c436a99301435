"""The edit log that keeps device page tables current, replayed on a CPU mirror."""

from __future__ import annotations

import numpy as np
import torch
from helpers import layer, manager

import kvcm_kernels
from kvcm import KVCMError


def test_replaying_edits_reproduces_the_host_tables(rng: np.random.Generator) -> None:
    m = manager(
        [layer(0, sliding_window=6, sink_tokens=2), layer(1), layer(2, kv_factor=1)],
        num_blocks=50,
    )
    coord = m.parts.coord
    coord.edits = []  # what the manager does for a CUDA device
    mirror = torch.from_numpy(coord.tables.copy())
    live: list[str] = []
    for step in range(400):
        ops = int(rng.integers(1, 4))  # several ops between syncs need de-duplication
        for k in range(ops):
            try:
                if not live or rng.random() < 0.25:
                    m.allocate(f"r{step}-{k}", int(rng.integers(1, 30)))
                    live.append(f"r{step}-{k}")
                elif rng.random() < 0.15:
                    m.free(live.pop(int(rng.integers(len(live)))))
                elif rng.random() < 0.15:
                    rid = live[int(rng.integers(len(live)))]
                    if m.request(rid).num_tokens > 1:
                        m.rewind(rid, 1)
                else:
                    m.extend_many(live, [int(x) for x in rng.integers(1, 3, size=len(live))])
            except KVCMError:  # out of blocks or rows, too long: nothing changed
                pass
        edits = coord.take_edits()
        key = (edits[:, 0].astype(np.int64) * 8 + edits[:, 1]) * 16 + edits[:, 2]
        assert np.unique(key).size == key.size  # one edit per cell
        kvcm_kernels.apply_page_table_edits(mirror, torch.from_numpy(edits))
        assert np.array_equal(mirror.numpy(), coord.tables)
        assert coord.ops_since_take == 0 and not coord.edits

"""The edit log that keeps device page tables current, replayed on a CPU mirror."""

from __future__ import annotations

import numpy as np
import pytest
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


def test_a_mapping_output_is_reused_only_once_nothing_holds_it() -> None:
    """``Outputs`` (the CUDA step's slot-mapping tensors; its logic is the device's on the
    CPU too): a slot's tensor comes back only when the caller dropped it and every view of
    it, for the same shape and stream; a held tensor, a held view or another shape or
    stream gets a fresh one, and what the caller holds keeps its values."""
    from kvcm.device_tables import Outputs

    outs = Outputs(torch.device("cpu"))
    depth = Outputs.DEPTH
    first = outs.take((1, 8), 5)
    first.fill_(11)
    ptr = first.data_ptr()
    kept = [first]
    kept += [outs.take((1, 8), 5) for _ in range(depth - 1)]
    assert len({t.data_ptr() for t in kept}) == depth
    again = outs.take((1, 8), 5)  # slot 0, its tensor still held
    assert again.data_ptr() != ptr and kept[0].data_ptr() == ptr
    assert (kept[0] == 11).all()

    del first, kept, again  # slot 0 now holds the second tensor it made; drop it too
    ptrs = [outs.take((1, 8), 5).data_ptr() for _ in range(depth)]  # each dropped at once
    assert [outs.take((1, 8), 5).data_ptr() for _ in range(depth)] == ptrs

    view = outs.take((1, 8), 5)[0]  # only a view kept: its storage is held
    for _ in range(depth - 1):
        outs.take((1, 8), 5)
    assert outs.take((1, 8), 5).data_ptr() != view.data_ptr()
    for _ in range(depth - 1):
        outs.take((1, 8), 5)
    other = outs.take((2, 8), 5)  # another shape: a fresh tensor of that shape
    assert other.shape == (2, 8)
    for _ in range(depth - 1):
        outs.take((1, 8), 5)
    other_ptr = other.data_ptr()
    del other
    assert outs.take((2, 8), 7).data_ptr() != other_ptr  # another stream: fresh too


def test_without_torchs_use_counts_no_mapping_output_is_reused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A torch without the private use counts ``Outputs`` reads: every take is a fresh
    tensor, and the ring keeps none."""
    from kvcm import device_tables

    monkeypatch.setattr(device_tables, "_REUSE", False)
    outs = device_tables.Outputs(torch.device("cpu"))
    kept = [outs.take((1, 8), 5) for _ in range(2 * outs.DEPTH)]
    assert len({id(t) for t in kept}) == len(kept) and outs._held == [None] * outs.DEPTH

"""The torch references of kvcm_kernels against element-by-element brute force."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import kvcm_kernels


def _random_table(rng: np.random.Generator, rows: int, cols: int) -> torch.Tensor:
    table = rng.integers(0, 50_000, size=(rows, cols)).astype(np.int32)
    table[rng.random((rows, cols)) < 0.3] = -1
    return torch.from_numpy(table)


@pytest.mark.parametrize("n,cols", [(0, 4), (1, 1), (7, 33), (64, 128)])
@pytest.mark.parametrize("multiplier,offset", [(1, 0), (3, 0), (3, 2), (32, 31)])
def test_kernel_page_indices_reference(
    rng: np.random.Generator, n: int, cols: int, multiplier: int, offset: int
) -> None:
    table = _random_table(rng, 70, cols)
    rows = torch.from_numpy(rng.integers(0, 70, size=n))
    got = kvcm_kernels.kernel_page_indices(table, rows, multiplier, offset)
    assert got.shape == (n, cols) and got.dtype == torch.int32
    for i in range(n):
        for j in range(cols):
            s = int(table[rows[i], j])
            assert int(got[i, j]) == (-1 if s < 0 else s * multiplier + offset)


@pytest.mark.parametrize("n", [0, 1, 5, 40])
@pytest.mark.parametrize("tpb", [1, 16])
def test_slot_mapping_reference(rng: np.random.Generator, n: int, tpb: int) -> None:
    cols = 12
    table = _random_table(rng, 50, cols)
    rows = torch.from_numpy(rng.choice(50, size=n, replace=False))
    counts = rng.integers(0, 9, size=n)
    qsl = np.concatenate([[0], np.cumsum(counts)])
    positions = np.concatenate(
        [rng.integers(0, cols * tpb, size=c) for c in counts] or [np.zeros(0, np.int64)]
    ).astype(np.int64)
    pad_to = int(qsl[-1]) + int(rng.integers(0, 5))
    got = kvcm_kernels.slot_mapping(
        table, rows, torch.from_numpy(qsl), torch.from_numpy(positions), tpb, pad_to
    )
    assert got.shape == (pad_to,) and got.dtype == torch.int64
    expect = []
    for i in range(n):
        for t in range(qsl[i], qsl[i + 1]):
            p = int(positions[t])
            s = int(table[rows[i], p // tpb])
            expect.append(-1 if s < 0 else s * tpb + p % tpb)
    expect += [-1] * (pad_to - len(expect))
    assert got.tolist() == expect

"""The torch references of kvcm_kernels against element-by-element brute force."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers import relocations

import kvcm_kernels
from kvcm_kernels import kv_copy


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
@pytest.mark.parametrize("min_live", [0, 1])
def test_slot_mapping_reference(rng: np.random.Generator, n: int, tpb: int, min_live: int) -> None:
    """``min_live`` 1 is the null page: slot 0 is no page, like -1."""
    cols = 12
    table = _random_table(rng, 50, cols)
    table[torch.from_numpy(rng.random((50, cols)) < 0.2)] = 0
    rows = torch.from_numpy(rng.choice(50, size=n, replace=False))
    counts = rng.integers(0, 9, size=n)
    qsl = np.concatenate([[0], np.cumsum(counts)])
    positions = np.concatenate(
        [rng.integers(0, cols * tpb, size=c) for c in counts] or [np.zeros(0, np.int64)]
    ).astype(np.int64)
    pad_to = int(qsl[-1]) + int(rng.integers(0, 5))
    got = kvcm_kernels.slot_mapping(
        table,
        rows,
        torch.from_numpy(qsl),
        torch.from_numpy(positions),
        tpb,
        pad_to,
        min_live=min_live,
    )
    assert got.shape == (pad_to,) and got.dtype == torch.int64
    expect = []
    for i in range(n):
        for t in range(qsl[i], qsl[i + 1]):
            p = int(positions[t])
            s = int(table[rows[i], p // tpb])
            expect.append(-1 if s < min_live else s * tpb + p % tpb)
    expect += [-1] * (pad_to - len(expect))
    assert got.tolist() == expect


def test_slot_mapping_reference_for_all_groups_at_once(rng: np.random.Generator) -> None:
    tables = torch.from_numpy(rng.integers(-1, 100, size=(3, 10, 6)).astype(np.int32))
    rows = torch.tensor([4, 0, 9])
    qsl = torch.tensor([0, 2, 2, 5])
    positions = torch.tensor([0, 7, 3, 4, 23])
    got = kvcm_kernels.slot_mapping(tables, rows, qsl, positions, 4, 7)
    assert got.shape == (3, 7)
    for g in range(3):
        single = kvcm_kernels.slot_mapping(tables[g], rows, qsl, positions, 4, 7)
        assert got[g].tolist() == single.tolist()


@pytest.mark.parametrize("seed", range(6))
def test_the_host_slot_mapping_equals_the_reference(seed: int) -> None:
    """``slot_mapping_host`` (the CPU manager's numpy path) against the torch reference on
    random tables of several groups, -1 and null-page entries, empty and padded batches."""
    rng = np.random.default_rng(seed)
    groups, cols, tpb = int(rng.integers(1, 4)), 9, int(rng.choice([1, 4, 16]))
    tables = rng.integers(-1, 60, size=(groups, 30, cols)).astype(np.int32)
    n = int(rng.integers(0, 12))
    rows = rng.choice(30, size=n, replace=False).astype(np.int64)
    counts = rng.integers(0, 6, size=n)
    positions = rng.integers(0, cols * tpb, size=int(counts.sum())).astype(np.int64)
    qsl = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
    pad_to = int(counts.sum()) + int(rng.integers(0, 4))
    for min_live in (0, 1):
        want = kvcm_kernels.slot_mapping(
            torch.from_numpy(tables),
            torch.from_numpy(rows),
            torch.from_numpy(qsl),
            torch.from_numpy(positions),
            tpb,
            pad_to,
            min_live=min_live,
        )
        got = kvcm_kernels.slot_mapping_host(
            tables, np.repeat(rows, counts), positions, tpb, pad_to, min_live
        )
        assert got.dtype == np.int64 and got.tolist() == want.tolist()


@pytest.mark.parametrize("n", [0, 1, 300])
def test_apply_page_table_edits_reference(rng: np.random.Generator, n: int) -> None:
    tables = _random_table(rng, 3 * 20, 16).view(3, 20, 16)
    cells = rng.choice(3 * 20 * 16, size=n, replace=False)
    g, rest = np.divmod(cells, 20 * 16)
    r, p = np.divmod(rest, 16)
    s = rng.integers(-1, 1000, size=n)
    edits = torch.from_numpy(np.stack([g, r, p, s], axis=1).astype(np.int32))
    expect = tables.clone()
    for i in range(n):
        expect[g[i], r[i], p[i]] = int(s[i])
    kvcm_kernels.apply_page_table_edits(tables, edits)
    assert torch.equal(tables, expect)


def test_layer_pointers_reference(rng: np.random.Generator) -> None:
    pointers = torch.from_numpy(rng.integers(1 << 20, 1 << 40, size=(3, 2)))
    page_bytes = torch.tensor([512, 64, 1024])
    pool_map = torch.full((5, 4, 2), -1, dtype=torch.int32)
    pool_map[0, 0] = torch.tensor([0, 0])
    pool_map[0, 1] = torch.tensor([0, 0])
    pool_map[3, 1] = torch.tensor([0, 2])
    pool_map[3, 3] = torch.tensor([1, 2])
    pool_map[4, 2] = torch.tensor([2, 5])
    got = kvcm_kernels.layer_pointers(pointers, pool_map, page_bytes, torch.tensor([0, 1, 0, 1]))
    for layer in range(5):
        for role in range(4):
            pool, offset = pool_map[layer, role].tolist()
            want = 0 if pool < 0 else int(pointers[pool, role % 2]) + offset * int(page_bytes[pool])
            assert int(got[layer, role]) == want


def _byte_copies(
    tables: torch.Tensor,
    ops: torch.Tensor,
    pools: list[kvcm_kernels.TokenCopyPool],
    tpb: int,
    min_live: int = 0,
) -> list[torch.Tensor]:
    """The pools after ``ops``, copied byte range by byte range from a snapshot (by value)."""
    out = [p.memory.clone() for p in pools]
    for p, mem in zip(pools, out, strict=True):
        tb = p.bytes_per_buffer // tpb
        for row, src, dst in ops.tolist():
            s = int(tables[p.group, row, src // tpb])
            d = int(tables[p.group, row, dst // tpb])
            if s < min_live or d < min_live:
                continue
            for j in range(p.num_buffers):
                a = j * p.bytes_per_buffer + (src % tpb) * tb
                b = j * p.bytes_per_buffer + (dst % tpb) * tb
                mem[d, b : b + tb] = p.memory[s, a : a + tb]
    # Pools that share memory (layer groups of one pool group) hold distinct slots: merge.
    for i, p in enumerate(pools):
        for j in range(i):
            if pools[j].memory.data_ptr() == p.memory.data_ptr():
                changed = out[i] != p.memory
                out[j][changed] = out[i][changed]
                out[i] = out[j]
    return out


@pytest.mark.parametrize("min_live", [0, 1])
def test_copy_tokens_reference_against_byte_copies(rng: np.random.Generator, min_live: int) -> None:
    """With ``min_live`` 1 (the null page) the ops reading or writing slot 0 are skipped: row 0
    reads slot 0 in group 0 and writes slot 0 in group 1."""
    tpb = 4
    tables = torch.from_numpy(
        np.array([[[2, 0, -1], [1, 3, -1]], [[0, 1, 2], [3, -1, -1]]], dtype=np.int32)
    )
    pools = [
        kvcm_kernels.TokenCopyPool(
            0, torch.from_numpy(rng.integers(0, 256, (4, 3 * 24), np.uint8)), 24, 3
        ),
        kvcm_kernels.TokenCopyPool(
            1, torch.from_numpy(rng.integers(0, 256, (4, 2 * 8), np.uint8)), 8, 2
        ),
    ]
    # (row, src, dst): row 0 moves token 6 to 1; row 1 moves token 2 to 5 (group 1 block 1 is -1).
    ops = torch.tensor([[0, 6, 1], [1, 2, 5]])
    expect = _byte_copies(tables, ops, pools, tpb, min_live)
    before = [p.memory.clone() for p in pools]
    kvcm_kernels.copy_tokens(tables, ops, pools, tpb, min_live=min_live)
    for p, mem, old in zip(pools, expect, before, strict=True):
        assert torch.equal(p.memory, mem)
        if min_live:
            assert torch.equal(p.memory[0], old[0])


def _copy_case(
    rng: np.random.Generator, num_ops: int, tpb: int = 4
) -> tuple[torch.Tensor, torch.Tensor, list[kvcm_kernels.TokenCopyPool]]:
    """Tables of two layer groups that share pool memory (distinct slots, like one pool
    group) plus a third group with its own pools, and overlapping relocations over them."""
    rows, cols, slots = 6, 5, 64
    perm = rng.permutation(slots)
    tables = np.stack(
        [
            perm[: rows * cols].reshape(rows, cols),
            perm[rows * cols : 2 * rows * cols].reshape(rows, cols),
            rng.permutation(slots)[: rows * cols].reshape(rows, cols),
        ]
    ).astype(np.int32)
    tables[rng.random(tables.shape) < 0.05] = -1

    def mem(num_buffers: int, token_bytes: int) -> torch.Tensor:
        size = (slots, num_buffers * tpb * token_bytes)
        return torch.from_numpy(rng.integers(0, 256, size, np.uint8))

    shared_data, shared_scale = mem(3, 24), mem(2, 3)
    pools = [
        kvcm_kernels.TokenCopyPool(0, shared_data, tpb * 24, 3),
        kvcm_kernels.TokenCopyPool(0, shared_scale, tpb * 3, 2),
        kvcm_kernels.TokenCopyPool(1, shared_data, tpb * 24, 3),
        kvcm_kernels.TokenCopyPool(1, shared_scale, tpb * 3, 2),
        kvcm_kernels.TokenCopyPool(2, mem(1, 576), tpb * 576, 1),
        kvcm_kernels.TokenCopyPool(2, mem(4, 1), tpb * 1, 4),
    ]
    ops = torch.from_numpy(relocations(rng, rows, cols * tpb, num_ops))
    return torch.from_numpy(tables), ops, pools


@pytest.mark.parametrize("seed", range(6))
def test_copy_tokens_reference_copies_by_value(seed: int) -> None:
    """Chains, cycles and repeated sources: every op reads what its source held before."""
    rng = np.random.default_rng(seed)
    tables, ops, pools = _copy_case(rng, int(rng.integers(1, 60)))
    expect = _byte_copies(tables, ops, pools, 4)
    kvcm_kernels.copy_tokens(tables, ops, pools, 4)
    for p, mem in zip(pools, expect, strict=True):
        assert torch.equal(p.memory, mem)


def _run_cuda_descriptors(
    tables: torch.Tensor,
    ops: torch.Tensor,
    pools: list[kvcm_kernels.TokenCopyPool],
    tpb: int,
    disjoint: bool,
) -> None:
    """kv_copy.cu in Python, one op after another, on the descriptors and passes that
    ``copy_tokens_cuda`` would launch: checks the host side of the CUDA path without a GPU."""
    num_ops = ops.shape[0]
    desc, passes = kv_copy._descriptors(pools, tpb, num_ops, disjoint)
    stride = max(per_op for _, _, per_op in passes)
    assert stride % kv_copy.ALIGN == 0 and (desc[:, 7] % kv_copy.ALIGN == 0).all()
    assert (desc[:, 5] % desc[:, 6] == 0).all()  # whole units of the copy width
    memories = {p.memory.data_ptr(): p.memory.view(-1) for p in pools}
    scratch = torch.zeros(num_ops * stride, dtype=torch.uint8)
    for first, count, per_op in passes:
        rows = desc[first : first + count]
        # A pass stays within the scratch budget unless it is one buffer of one row.
        assert per_op * num_ops <= kv_copy.SCRATCH_BYTES or disjoint or rows[:, 4].sum() == 1
        for mode in (kv_copy.DIRECT,) if disjoint else (kv_copy.GATHER, kv_copy.SCATTER):
            for group, address, slot_bytes, bpb, nbuf, tb, _, offset in rows.tolist():
                base = max(b for b in memories if b <= address)
                flat, start = memories[base], address - base
                for k, (row, src, dst) in enumerate(ops.tolist()):
                    s = int(tables[group, row, src // tpb])
                    d = int(tables[group, row, dst // tpb])
                    if s < 0 or d < 0:
                        continue
                    for j in range(nbuf):
                        a = start + s * slot_bytes + j * bpb + (src % tpb) * tb
                        b = start + d * slot_bytes + j * bpb + (dst % tpb) * tb
                        c = k * stride + offset + j * tb
                        if mode == kv_copy.DIRECT:
                            flat[b : b + tb] = flat[a : a + tb].clone()
                        elif mode == kv_copy.GATHER:
                            scratch[c : c + tb] = flat[a : a + tb]
                        else:
                            flat[b : b + tb] = scratch[c : c + tb]


@pytest.mark.parametrize("scratch_bytes", [1, 200, 1000, 64 << 20])
@pytest.mark.parametrize("seed", range(3))
def test_cuda_descriptors_split_into_passes_that_copy_by_value(
    monkeypatch: pytest.MonkeyPatch, scratch_bytes: int, seed: int
) -> None:
    """Staged passes cover every buffer once and stay exact however small the scratch."""
    monkeypatch.setattr(kv_copy, "SCRATCH_BYTES", scratch_bytes)
    rng = np.random.default_rng(seed)
    tables, ops, pools = _copy_case(rng, 12)
    desc, passes = kv_copy._descriptors(pools, 4, ops.shape[0], direct=False)
    covered = sorted(
        (address + j * bpb, group)
        for group, address, _, bpb, nbuf, *_ in desc.tolist()
        for j in range(nbuf)
    )
    every = sorted(
        (p.memory.data_ptr() + j * p.bytes_per_buffer, p.group)
        for p in pools
        for j in range(p.num_buffers)
    )
    assert covered == every
    assert sum(count for _, count, _ in passes) == len(desc)
    expect = _byte_copies(tables, ops, pools, 4)
    _run_cuda_descriptors(tables, ops, pools, 4, disjoint=False)
    for p, mem in zip(pools, expect, strict=True):
        assert torch.equal(p.memory, mem)


def test_cuda_descriptors_copy_disjoint_ops_directly(rng: np.random.Generator) -> None:
    tables, _, pools = _copy_case(rng, 0)
    # Sources 0..9 of every row, destinations 10..19: no destination is read.
    ops = torch.tensor([[r, i, 10 + (i * 7) % 10] for r in range(6) for i in range(10)])
    desc, passes = kv_copy._descriptors(pools, 4, ops.shape[0], direct=True)
    assert len(desc) == len(pools) and passes == [(0, len(pools), 0)]
    expect = _byte_copies(tables, ops, pools, 4)
    _run_cuda_descriptors(tables, ops, pools, 4, disjoint=True)
    for p, mem in zip(pools, expect, strict=True):
        assert torch.equal(p.memory, mem)


def test_every_kernel_writes_a_given_output_in_full(rng: np.random.Generator) -> None:
    tables = _random_table(rng, 2 * 9, 8).view(2, 9, 8)
    rows = torch.tensor([3, 0, 8])
    qsl = torch.tensor([0, 1, 1, 3])
    positions = torch.tensor([5, 0, 31])
    edits = torch.tensor([[1, 0, 0, 77], [0, 8, 7, -1]])
    poison = 0x5A5A5A5A

    out = torch.full((3, 8), poison, dtype=torch.int32)
    got = kvcm_kernels.kernel_page_indices(tables[0], rows, 2, 1, out)
    assert got.data_ptr() == out.data_ptr() and poison not in out.tolist()[0]
    assert torch.equal(out, kvcm_kernels.kernel_page_indices(tables[0], rows, 2, 1))

    out64 = torch.full((2, 6), poison, dtype=torch.int64)
    got = kvcm_kernels.slot_mapping(tables, rows, qsl, positions, 4, 6, out64)
    assert got.data_ptr() == out64.data_ptr()
    assert torch.equal(out64, kvcm_kernels.slot_mapping(tables, rows, qsl, positions, 4, 6))

    fused = torch.full((1, 6), poison, dtype=torch.int64)
    got = kvcm_kernels.apply_edits_and_map_slots(
        tables, edits, rows, qsl, positions, 4, 6, 1, 1, fused
    )
    assert got.data_ptr() == fused.data_ptr()
    assert int(tables[1, 0, 0]) == 77 and int(tables[0, 8, 7]) == -1
    assert torch.equal(fused[0], kvcm_kernels.slot_mapping(tables[1], rows, qsl, positions, 4, 6))

    pool_map = torch.tensor([[[0, 1], [0, 1], [-1, -1], [-1, -1]]], dtype=torch.int32)
    ptrs = torch.full((1, 4), poison, dtype=torch.int64)
    got = kvcm_kernels.layer_pointers(
        torch.tensor([[1000, 1100]]),
        pool_map,
        torch.tensor([200]),
        torch.tensor([0, 1, 0, 1]),
        ptrs,
    )
    assert got.data_ptr() == ptrs.data_ptr() and ptrs.tolist() == [[1200, 1300, 0, 0]]


def test_step_tables_reference_with_the_null_page() -> None:
    """min_live 1: an edit that writes the null page (0) releases the block, so the token of
    that block maps to -1, not to slot 0; the other token maps as usual."""
    tables = torch.full((1, 4, 3), 0, dtype=torch.int32)
    tables[0, 3, :2] = torch.tensor([9, 5], dtype=torch.int32)
    edits = torch.tensor([[0, 3, 0, 0]])  # block 0 of row 3 released
    args = (torch.tensor([3]), torch.tensor([0, 2]), torch.tensor([2, 5]), 4, 3)
    got = kvcm_kernels.apply_edits_and_map_slots(tables, edits, *args, min_live=1)
    assert got.tolist() == [[-1, 5 * 4 + 1, -1]]
    assert tables[0, 3].tolist() == [0, 5, 0]

"""Every CuPy kernel against its torch reference on fresh random inputs, outputs poisoned."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers import relocations

import kvcm_kernels
from kvcm_kernels import _dispatch, kv_copy
from kvcm_kernels.kv_copy import copy_tokens_reference
from kvcm_kernels.page_indices import kernel_page_indices_reference
from kvcm_kernels.page_table_edits import apply_page_table_edits_reference
from kvcm_kernels.pointers import layer_pointers_reference
from kvcm_kernels.slot_mapping import slot_mapping_reference
from kvcm_kernels.step_tables import SINGLE_BLOCK_LIMIT, apply_edits_and_map_slots_reference

if not torch.cuda.is_available():
    pytest.skip("no CUDA device: GPU tests run on the GPU machine only", allow_module_level=True)
pytest.importorskip("cupy", reason="the GPU kernels need CuPy")
CUDA = torch.device("cuda", 0)
POISON32 = 0x5A5A5A5A
POISON64 = 0x5A5A5A5A5A5A5A5A
COPY_TPB = 16


@pytest.fixture
def rng() -> np.random.Generator:
    return np.random.default_rng()  # fresh inputs every run


def _table(
    rng: np.random.Generator, shape: tuple[int, ...], high: int = 1 << 20, empty: int = -1
) -> np.ndarray:
    """Random slots, 30% of them ``empty`` (no page: -1, or the null page 0)."""
    t = rng.integers(0, high, size=shape).astype(np.int32)
    t[rng.random(shape) < 0.3] = empty
    return t


def test_gpu_path_is_taken() -> None:
    assert _dispatch.gpu_path(torch.zeros(1, device=CUDA))


@pytest.mark.parametrize(
    "rows,cols,n",
    [(1, 1, 0), (1, 1, 1), (7, 33, 7), (64, 128, 200), (1024, 1024, 1024), (4096, 8192, 4096)],
)
@pytest.mark.parametrize("multiplier,offset", [(1, 0), (3, 2), (64, 63)])
def test_kernel_page_indices(
    rng: np.random.Generator, rows: int, cols: int, n: int, multiplier: int, offset: int
) -> None:
    table = _table(rng, (rows, cols))
    idx = rng.integers(0, rows, size=n)
    expect = kernel_page_indices_reference(
        torch.from_numpy(table), torch.from_numpy(idx), multiplier, offset
    )
    out = torch.full((n, cols), POISON32, dtype=torch.int32, device=CUDA)
    got = kvcm_kernels.kernel_page_indices(
        torch.from_numpy(table).to(CUDA), torch.from_numpy(idx).to(CUDA), multiplier, offset, out
    )
    assert got.data_ptr() == out.data_ptr()
    assert torch.equal(got.cpu(), expect)


@pytest.mark.parametrize("groups", [1, 3])
@pytest.mark.parametrize("n,extra", [(0, 0), (0, 5), (1, 0), (37, 3), (1024, 100), (4096, 0)])
@pytest.mark.parametrize("min_live", [0, 1])
def test_slot_mapping(
    rng: np.random.Generator, groups: int, n: int, extra: int, min_live: int
) -> None:
    """min_live 1 is the null page: tables hold 0 where there is no page, mapped to -1."""
    rows_total, cols, tpb = max(n, 1) * 2, 64, 16
    tables = _table(rng, (groups, rows_total, cols), empty=min_live - 1)
    rows = rng.choice(rows_total, size=n, replace=False)
    counts = rng.integers(0, 20, size=n)
    counts[rng.random(n) < 0.2] = 0
    qsl = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
    positions = rng.integers(0, cols * tpb, size=int(qsl[-1])).astype(np.int64)
    pad_to = int(qsl[-1]) + extra
    cpu = [torch.from_numpy(a) for a in (tables, rows, qsl, positions)]
    expect = slot_mapping_reference(*cpu, tpb, pad_to, min_live=min_live)
    if min_live:
        assert not ((expect >= 0) & (expect < tpb)).any()  # nothing maps into slot 0
    out = torch.full((groups, pad_to), POISON64, dtype=torch.int64, device=CUDA)
    got = kvcm_kernels.slot_mapping(*(t.to(CUDA) for t in cpu), tpb, pad_to, out, min_live=min_live)
    assert got.data_ptr() == out.data_ptr()
    assert torch.equal(got.cpu(), expect)
    single = kvcm_kernels.slot_mapping(
        *(t.to(CUDA) for t in [cpu[0][0], *cpu[1:]]), tpb, pad_to, min_live=min_live
    )
    assert torch.equal(single.cpu(), expect[0])


@pytest.mark.parametrize("num_edits", [0, 1, 1000, 200_000])
def test_apply_page_table_edits(rng: np.random.Generator, num_edits: int) -> None:
    shape = (4, 1024, 2048)
    tables = _table(rng, shape)
    edits = _unique_edits(rng, shape, num_edits)
    expect = torch.from_numpy(tables.copy())
    apply_page_table_edits_reference(expect, torch.from_numpy(edits))
    dev = torch.from_numpy(tables).to(CUDA)
    kvcm_kernels.apply_page_table_edits(dev, torch.from_numpy(edits).to(CUDA))
    assert torch.equal(dev.cpu(), expect)


def _unique_edits(
    rng: np.random.Generator, shape: tuple[int, int, int], k: int, empty: int = -1
) -> np.ndarray:
    """k edits of distinct cells; a quarter of them release (write ``empty``)."""
    cells = rng.choice(shape[0] * shape[1] * shape[2], size=k, replace=False)
    g, rest = np.divmod(cells, shape[1] * shape[2])
    r, p = np.divmod(rest, shape[2])
    slots = rng.integers(0, 1 << 20, size=k)
    slots[rng.random(k) < 0.25] = empty
    return np.stack([g, r, p, slots], axis=1).astype(np.int64)


@pytest.mark.parametrize(
    "groups,first,count,n,num_edits,extra",
    [
        (1, 0, 1, 0, 0, 4),
        (1, 0, 1, 1, 1, 0),
        (4, 0, 4, 256, 150, 0),
        (4, 2, 1, 256, 150, 7),
        (3, 0, 3, 700, 5000, 10),
        (2, 0, 2, 1024, SINGLE_BLOCK_LIMIT, 0),  # past one block: the two-kernel path
        (1, 0, 1, 5000, 10, 3),  # qsl too long to stage in shared memory
    ],
)
@pytest.mark.parametrize("pinned", [False, True])
@pytest.mark.parametrize("min_live", [0, 1])
def test_apply_edits_and_map_slots(
    rng: np.random.Generator,
    pinned: bool,
    min_live: int,
    groups: int,
    first: int,
    count: int,
    n: int,
    num_edits: int,
    extra: int,
) -> None:
    shape, tpb = (groups, max(2 * n, 1), 64), 16
    tables = _table(rng, shape, empty=min_live - 1)
    edits = _unique_edits(rng, shape, num_edits, empty=min_live - 1)
    rows = rng.choice(shape[1], size=n, replace=False)
    counts = rng.integers(0, 3, size=n)
    qsl = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
    positions = rng.integers(0, shape[2] * tpb, size=int(qsl[-1])).astype(np.int64)
    pad_to = int(qsl[-1]) + extra
    cpu_tables = torch.from_numpy(tables.copy())
    cpu = [torch.from_numpy(a) for a in (edits, rows, qsl, positions)]
    expect = apply_edits_and_map_slots_reference(
        cpu_tables, *cpu, tpb, pad_to, first, count, min_live=min_live
    )
    dev_tables = torch.from_numpy(tables).to(CUDA)
    out = torch.full((count, pad_to), POISON64, dtype=torch.int64, device=CUDA)
    got = kvcm_kernels.apply_edits_and_map_slots(
        dev_tables,
        *(t.pin_memory() if pinned else t.to(CUDA) for t in cpu),
        tpb,
        pad_to,
        first,
        count,
        out,
        min_live,
    )
    assert got.data_ptr() == out.data_ptr()
    assert torch.equal(got.cpu(), expect)
    assert torch.equal(dev_tables.cpu(), cpu_tables)


@pytest.mark.parametrize("layers,pools,roles", [(1, 1, 4), (61, 7, 5), (1000, 40, 7)])
def test_layer_pointers(rng: np.random.Generator, layers: int, pools: int, roles: int) -> None:
    pointers = torch.from_numpy(rng.integers(1 << 30, 1 << 46, size=(pools, 2)))
    page_bytes = torch.from_numpy(rng.integers(1, 1 << 20, size=pools))
    pool_map = np.stack(
        [rng.integers(-1, pools, size=(layers, roles)), rng.integers(0, 64, size=(layers, roles))],
        axis=2,
    ).astype(np.int32)
    # An odd role count (extra roles) puts role r of layer l at an odd or even flat index.
    page_role = torch.from_numpy(rng.integers(0, 2, size=roles).astype(np.int32))
    expect = layer_pointers_reference(pointers, torch.from_numpy(pool_map), page_bytes, page_role)
    out = torch.full((layers, roles), POISON64, dtype=torch.int64, device=CUDA)
    got = kvcm_kernels.layer_pointers(
        pointers.to(CUDA),
        torch.from_numpy(pool_map).to(CUDA),
        page_bytes.to(CUDA),
        page_role.to(CUDA),
        out,
    )
    assert got.data_ptr() == out.data_ptr()
    assert torch.equal(got.cpu(), expect)


def _copy_case(
    rng: np.random.Generator, num_ops: int, token_bytes: int, disjoint: bool, min_live: int = 0
) -> tuple[np.ndarray, np.ndarray, list[tuple[int, int, int, int]], list[torch.Tensor]]:
    """Tables, ops and pools for a token copy: layer groups 0 and 1 share two memories with
    distinct slots (one pool group, as in the manager), group 2 has two of its own. Pools
    are (group, memory, buffers, token bytes); the fixed ones (6, 576 and 40 bytes per token)
    mix copy widths 2, 16 and 8 with the parametrized one in one launch, so a wide pool's
    scratch region after a narrow one must stay aligned."""
    rows, cols = 128, 16
    cells = rows * cols
    slots = 2 * cells + 64
    perm = rng.permutation(slots)
    tables = np.stack([perm[:cells], perm[cells : 2 * cells], rng.permutation(slots)[:cells]])
    tables = tables.reshape(3, rows, cols).astype(np.int32)
    tables[rng.random(tables.shape) < 0.05] = min_live - 1  # no page: -1, or the null page 0
    pools = [
        (0, 0, 3, token_bytes),
        (1, 0, 3, token_bytes),
        (0, 1, 2, 6),
        (1, 1, 2, 6),
        (2, 2, 1, 576),
        (2, 3, 5, 40),
    ]
    sizes = {mem: nb * COPY_TPB * tb for _, mem, nb, tb in pools}
    mems = [
        torch.randint(0, 256, (slots, sizes[i]), dtype=torch.uint8, device=CUDA).cpu()
        for i in range(len(sizes))
    ]
    half = cols * COPY_TPB // 2
    if disjoint:  # sources from the first half of a row, destinations from the second
        keys = rng.choice(rows * half, size=num_ops, replace=False)
        src = rng.integers(0, half, size=num_ops)
        ops = np.stack([keys // half, src, keys % half + half], axis=1).astype(np.int64)
    else:
        ops = relocations(rng, rows, 2 * half, num_ops)
    return tables, ops, pools, mems


def _check_copy(
    tables: np.ndarray,
    ops: np.ndarray,
    pools: list[tuple[int, int, int, int]],
    mems: list[torch.Tensor],
    disjoint: bool = False,
    min_live: int = 0,
) -> None:
    """The CuPy copy against the reference, from the same bytes; with ``min_live`` 1 (the
    null page) ops whose source or destination page is 0 are skipped and slot 0 stays."""

    def copy_pools(device: torch.device) -> list[kvcm_kernels.TokenCopyPool]:
        on_device = [m.clone().to(device) for m in mems]
        return [
            kvcm_kernels.TokenCopyPool(g, on_device[mem], COPY_TPB * tb, nb)
            for g, mem, nb, tb in pools
        ]

    cpu_pools = copy_pools(torch.device("cpu"))
    copy_tokens_reference(
        torch.from_numpy(tables), torch.from_numpy(ops), cpu_pools, COPY_TPB, min_live=min_live
    )
    gpu_pools = copy_pools(CUDA)
    kvcm_kernels.copy_tokens(
        torch.from_numpy(tables).to(CUDA),
        torch.from_numpy(ops).to(CUDA),
        gpu_pools,
        COPY_TPB,
        disjoint=disjoint,
        min_live=min_live,
    )
    for a, b, (_, mem, _, _) in zip(cpu_pools, gpu_pools, pools, strict=True):
        assert torch.equal(a.memory, b.memory.cpu())
        if min_live:  # the null page (slot 0) is neither read nor written
            assert torch.equal(b.memory[0].cpu(), mems[mem][0])


@pytest.mark.parametrize("num_ops", [0, 1, 64, 3000, 12000])
@pytest.mark.parametrize("token_bytes", [1, 2, 6, 8, 16, 24, 576])
@pytest.mark.parametrize("disjoint", [False, True])
@pytest.mark.parametrize("min_live", [0, 1])
def test_copy_tokens(
    rng: np.random.Generator, num_ops: int, token_bytes: int, disjoint: bool, min_live: int
) -> None:
    """Chains, cycles and repeated sources (gather then scatter), or with ``disjoint`` ops
    whose destinations nobody reads (one launch), against the reference."""
    case = _copy_case(rng, num_ops, token_bytes, disjoint, min_live)
    _check_copy(*case, disjoint=disjoint, min_live=min_live)


@pytest.mark.parametrize("scratch_bytes", [1, 4096, 1 << 20])
def test_copy_tokens_in_several_passes(
    rng: np.random.Generator, monkeypatch: pytest.MonkeyPatch, scratch_bytes: int
) -> None:
    """A small scratch splits the copy by buffers into many gather/scatter passes."""
    monkeypatch.setattr(kv_copy, "SCRATCH_BYTES", scratch_bytes)
    tables, ops, pools, mems = _copy_case(rng, 3000, 24, disjoint=False)
    per_op = sum(nb * tb for _, _, nb, tb in pools)  # staged bytes per op, unaligned
    assert per_op * len(ops) > scratch_bytes  # more than one pass
    _check_copy(tables, ops, pools, mems)

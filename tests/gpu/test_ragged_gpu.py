"""The CuPy ragged page-indices kernel against its torch reference on fresh random inputs, and
a CUDA manager's ``ragged_page_indices`` against a CPU manager's over the same steps."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import kvcm_kernels
from kvcm_kernels import ragged_pages
from kvcm_kernels.ragged_pages import ragged_page_indices_reference

if not torch.cuda.is_available():
    pytest.skip("no CUDA device: GPU tests run on the GPU machine only", allow_module_level=True)
pytest.importorskip("cupy", reason="the GPU kernels need CuPy")
CUDA = torch.device("cuda", 0)


@pytest.fixture
def rng() -> np.random.Generator:
    return np.random.default_rng()  # fresh inputs every run


def _inputs(
    rng: np.random.Generator, num_rows: int, cols: int, n: int, tpb: int, cp: int, min_live: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A table with runs of pages and holes (empty: ``min_live - 1``), rows (repeats too) and
    lengths from 0 to past what a row covers."""
    table = rng.integers(min_live, 1 << 20, size=(num_rows, cols)).astype(np.int32)
    table[rng.random((num_rows, cols)) < 0.2] = min_live - 1
    for r in range(num_rows):  # a released run, as a window leaves
        a, b = sorted(rng.integers(0, cols + 1, size=2))
        table[r, a:b] = min_live - 1
    rows = rng.integers(0, num_rows, size=n).astype(np.int64)
    lengths = rng.integers(0, cols * cp * tpb + 2 * tpb, size=n).astype(np.int64)
    lengths[rng.random(n) < 0.1] = 0
    return table, rows, lengths


@pytest.mark.parametrize("n,cols", [(0, 8), (1, 1), (5, 7), (31, 33), (33, 64), (300, 129)])
@pytest.mark.parametrize("cp,sinks", [(1, 0), (1, 2), (3, 0), (3, 4)])
@pytest.mark.parametrize("min_live", [0, 1])
@pytest.mark.parametrize("given", ["nothing", "total", "indptr"])
def test_ragged_page_indices_kernel_equals_reference(
    rng: np.random.Generator, n: int, cols: int, cp: int, sinks: int, min_live: int, given: str
) -> None:
    """Both kernels: the one-block count and scan (sized by ``total`` or by reading the count
    back), and the many-block one placed by the caller's ``indptr``."""
    tpb, multiplier, offset = 16, 3, 2
    cp_rank = int(rng.integers(cp))
    table, rows, lengths = _inputs(rng, max(n, 1) + 3, cols, n, tpb, cp, min_live)
    args = (tpb, multiplier, offset, sinks, min_live, cp, cp_rank)
    want = ragged_page_indices_reference(
        torch.from_numpy(table), torch.from_numpy(rows), torch.from_numpy(lengths), *args
    )
    total = int(want[0][-1]) if given != "nothing" else None
    indptr = want[0].to(CUDA, torch.int64) if given == "indptr" else None
    # Poison the allocator's next blocks: every output element must be written.
    torch.full((1 << 20,), 0x5A5A5A5A, dtype=torch.int32, device=CUDA)
    got = kvcm_kernels.ragged_page_indices(
        torch.from_numpy(table).to(CUDA),
        torch.from_numpy(rows).to(CUDA),
        torch.from_numpy(lengths).to(CUDA),
        *args,
        total=total,
        indptr=indptr,
    )
    names = ("indptr", "indices", "last_page_len", "first_token", "num_sink_pages")
    for name, g, w in zip(names, got, want, strict=True):
        assert g.is_cuda and g.dtype == torch.int32, name
        assert torch.equal(g.cpu(), w), name


@pytest.mark.parametrize("placed", [False, True])
def test_many_requests_and_long_rows(rng: np.random.Generator, placed: bool) -> None:
    """Past one round of 32 warps many times over, rows longer than a warp's 32 lanes."""
    table, rows, lengths = _inputs(rng, 4096, 2048, 4096, 16, 1, 1)
    args = (16, 2, 1, 1, 1, 1, 0)
    want = ragged_page_indices_reference(
        torch.from_numpy(table), torch.from_numpy(rows), torch.from_numpy(lengths), *args
    )
    got = ragged_pages.ragged_page_indices_cuda(
        torch.from_numpy(table).to(CUDA),
        torch.from_numpy(rows).to(CUDA),
        torch.from_numpy(lengths).to(CUDA),
        *args,
        total=int(want[0][-1]),
        indptr=want[0].to(CUDA, torch.int64) if placed else None,
    )
    for g, w in zip(got, want, strict=True):
        assert torch.equal(g.cpu(), w)


def test_a_short_indptr_range_drops_pages_and_writes_nothing_outside(
    rng: np.random.Generator,
) -> None:
    """The placed kernel writes request i's pages inside [indptr[i], indptr[i + 1]) only:
    given half of each count, each range holds the first half of the request's pages."""
    table, rows, lengths = _inputs(rng, 40, 64, 37, 16, 1, 0)
    args = (16, 1, 0, 0, 0, 1, 0)
    want = ragged_page_indices_reference(
        torch.from_numpy(table), torch.from_numpy(rows), torch.from_numpy(lengths), *args
    )
    counts = (want[0][1:] - want[0][:-1]).to(torch.int64)
    half = torch.cat([torch.zeros(1, dtype=torch.int64), torch.cumsum(counts // 2, 0)])
    got = ragged_pages.ragged_page_indices_cuda(
        torch.from_numpy(table).to(CUDA),
        torch.from_numpy(rows).to(CUDA),
        torch.from_numpy(lengths).to(CUDA),
        *args,
        indptr=half.to(CUDA),
    )
    assert got[0].cpu().tolist() == half.tolist()
    indices = got[1].cpu().tolist()
    assert len(indices) == int(half[-1])
    for i in range(37):
        start = int(want[0][i])
        expect = want[1][start : start + int(counts[i]) // 2].tolist()
        assert indices[int(half[i]) : int(half[i + 1])] == expect


def _outcome(call, m):  # type: ignore[no-untyped-def]
    try:
        call(m)
    except Exception as exc:  # the same refusal on both managers
        return type(exc).__name__
    return "ok"


@pytest.mark.parametrize("null_page", [False, True])
def test_cuda_manager_equals_cpu_manager_over_random_steps(
    rng: np.random.Generator, null_page: bool
) -> None:
    """The same ops on a CUDA and a CPU manager (a window with sinks, the null page, prefix
    hits, chunks, rewinds, commits): equal ragged pages, the CUDA ones sized by the
    bookkeeping's count with no wait for the device."""
    kvcm = pytest.importorskip("kvcm")
    layers = [
        {"layer_id": 0, "num_kv_heads": 1, "head_dim": 8, "sliding_window": 8, "sink_tokens": 3},
        {"layer_id": 1, "num_kv_heads": 1, "head_dim": 8},
        {"layer_id": 2, "num_kv_heads": 1, "head_dim": 8, "kv_factor": 1},
    ]
    config = {
        "layers": layers,
        "tokens_per_block": 4,
        "max_requests": 8,
        "max_seq_len": 64,
        "null_page": null_page,
    }
    cpu = kvcm.KVCacheManager({**config, "num_blocks": 120})
    gpu = kvcm.KVCacheManager({**config, "num_blocks": 120, "device": "cuda:0"})
    tokens = [int(t) for t in rng.integers(1, 4, size=64)]  # few ids: prompts share prefixes
    for step in range(300):
        ids = cpu.request_ids()
        kind = int(rng.integers(5))
        if (kind == 0 and len(ids) < 6) or not ids:
            rid, n = f"r{step}", int(rng.integers(1, 30))

            def call(m, rid=rid, n=n):  # type: ignore[no-untyped-def]
                return m.allocate(rid, n, token_ids=tokens[:n])
        else:
            rid, k = ids[int(rng.integers(len(ids)))], int(rng.integers(1, 6))
            if kind == 1:

                def call(m, rid=rid, k=k):  # type: ignore[no-untyped-def]
                    return m.extend(rid, k)
            elif kind == 2:

                def call(m, rid=rid, k=k):  # type: ignore[no-untyped-def]
                    return m.rewind(rid, k)
            elif kind == 3:

                def call(m, rid=rid):  # type: ignore[no-untyped-def]
                    info = m.request(rid)
                    return m.commit(rid, tokens[info.num_committed : info.num_tokens])
            else:

                def call(m, rid=rid):  # type: ignore[no-untyped-def]
                    return m.free(rid)

        assert _outcome(call, cpu) == _outcome(call, gpu), step
        ids = cpu.request_ids()
        for lid, role, per_layer in ((0, "key", False), (1, "value", True), (2, "key", True)):
            want = cpu.ragged_page_indices(ids, lid, role, per_layer)
            got = gpu.ragged_page_indices(ids, lid, role, per_layer)
            for name in ("indptr", "indices", "last_page_len", "first_token", "num_sink_pages"):
                assert torch.equal(getattr(got, name).cpu(), getattr(want, name)), (step, name)

"""KV copy between token positions of the same request, for every layer and role at once.

The primitive behind accepted-draft-token relocation: for each op (row, src, dst), the entries
of token ``src`` in every buffer of every pool of every layer group (key, value and scales) are
copied to token ``dst`` of the same request. A pool is described by a ``TokenCopyPool``: its
layer group, its memory ``[num_slots, slot_bytes]`` (uint8), its bytes per buffer and buffer
count. Token t of buffer j in slot s starts at byte
``s * slot_bytes + j * bytes_per_buffer + (t % tokens_per_block) * token_bytes``, with
``token_bytes = bytes_per_buffer / tokens_per_block``.

Example (tokens_per_block 4, one pool K0 V0 of 32-byte buffers, token_bytes 8): op (row 0,
src 5, dst 2) with table row [3, 9] copies bytes 9 * 64 + [8, 16) and 9 * 64 + 32 + [8, 16) to
3 * 64 + [16, 24) and 3 * 64 + 32 + [16, 24). Ops whose source or destination has no page (a
slot below ``min_live``: -1, or 0 with the null page, which must stay zero) are skipped.

Copies are by value: every read happens before every write, so ``dst[i]`` gets what
``src[i]`` held before the call even when it is another op's destination. Relocating an
accepted draft path is such a chain: 45 -> 44 and 46 -> 45 must give 44 the old 45, not the
new one (46). Sources may repeat and chains may close into cycles (a swap 3 -> 7, 7 -> 3);
destinations must be distinct bytes: distinct (row, position) pairs, and layer groups that
share a pool's memory never hold the same slot (the manager's tables guarantee both).

The reference gathers every source token of every pool, then scatters. On CUDA, one launch
copies pool to pool when the caller says no destination is another op's source
(``disjoint=True``); otherwise a gather launch stages the sources in a scratch buffer and a
scatter launch writes them, and stream order puts every read before every write. The scratch
holds at most ``SCRATCH_BYTES`` (or one buffer's tokens of all ops, if more): a larger copy is
split by buffers into several gather/scatter passes, which is exact because distinct buffers
are distinct bytes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from ._dispatch import gpu_path, i32, i64, launch, ptr

THREADS = 128
#: Bytes of staged tokens per gather/scatter pass (the scratch buffer's size).
SCRATCH_BYTES = 64 << 20
#: Alignment of each descriptor's scratch region: the widest unit a thread copies (int4).
ALIGN = 16
#: int64 fields per descriptor, as kv_copy.cu reads them.
DESC_FIELDS = 8
DIRECT, GATHER, SCATTER = 0, 1, 2


@dataclass(frozen=True, slots=True)
class TokenCopyPool:
    group: int
    memory: torch.Tensor
    bytes_per_buffer: int
    num_buffers: int


def copy_tokens_reference(
    tables: torch.Tensor,
    ops: torch.Tensor,
    pools: Sequence[TokenCopyPool],
    tokens_per_block: int,
    disjoint: bool = False,
    min_live: int = 0,
) -> None:
    """Gather the sources of all pools (advanced indexing copies), then scatter them all.

    ``disjoint`` changes nothing here: gathering first is always exact.
    """
    if ops.shape[0] == 0:
        return
    rows, src, dst = ops[:, 0], ops[:, 1], ops[:, 2]
    tpb = tokens_per_block
    moves = []
    for pool in pools:
        mem = pool.memory.view(-1, pool.num_buffers, tpb, pool.bytes_per_buffer // tpb)
        table = tables[pool.group]
        src_slot = table[rows, src // tpb].long()
        dst_slot = table[rows, dst // tpb].long()
        ok = (src_slot >= min_live) & (dst_slot >= min_live)
        tokens = mem[src_slot[ok], :, (src % tpb)[ok], :]
        moves.append((mem, dst_slot[ok], (dst % tpb)[ok], tokens))
    for mem, slot, offset, tokens in moves:
        mem[slot, :, offset, :] = tokens


def _width(token_bytes: int) -> int:
    return next(w for w in (16, 8, 4, 2, 1) if token_bytes % w == 0)


def _descriptors(
    pools: Sequence[TokenCopyPool], tokens_per_block: int, num_ops: int, direct: bool
) -> tuple[np.ndarray, list[tuple[int, int, int]]]:
    """Descriptor rows for kv_copy.cu and the passes: (first row, rows, scratch bytes per op).

    A row is (layer group, address of its first buffer in slot 0, slot bytes, bytes per
    buffer, buffers, token bytes, copy width, scratch offset in an op's staged bytes). Staged,
    a pool's buffers are split into rows that fill passes of at most ``SCRATCH_BYTES`` over
    all ops, each row's region aligned to 16 bytes for int4 copies. Example: 1000 ops and a
    pool of 300 buffers of 576-byte tokens: 64 MiB / 1000 ops = 67108, 67104 bytes per op
    once aligned, 116 buffers per pass, so rows of 116, 116 and 68 buffers in three passes.
    ``direct``: one row per pool, one pass, no scratch.
    """
    tpb = tokens_per_block
    # Scratch bytes per op, a multiple of ALIGN, so that aligning a row keeps it within.
    budget = SCRATCH_BYTES // max(num_ops, 1) // ALIGN * ALIGN
    rows: list[list[int]] = []
    passes: list[tuple[int, int, int]] = []
    first = used = 0
    for p in pools:
        bpb, slot_bytes = p.bytes_per_buffer, p.memory.shape[1]
        token_bytes = bpb // tpb
        width = _width(token_bytes)
        start = 0
        while start < p.num_buffers:
            count = p.num_buffers - start
            if not direct:
                fit = (budget - used) // token_bytes
                if fit < 1 and used:  # this pass is full: close it
                    passes.append((first, len(rows) - first, used))
                    first, used = len(rows), 0
                    continue
                count = min(count, max(fit, 1))
            address = p.memory.data_ptr() + start * bpb
            rows.append([p.group, address, slot_bytes, bpb, count, token_bytes, width, used])
            used += -(-count * token_bytes // ALIGN) * ALIGN
            start += count
    passes.append((first, len(rows) - first, 0 if direct else used))
    return np.array(rows, dtype=np.int64).reshape(-1, DESC_FIELDS), passes


def copy_tokens_cuda(
    tables: torch.Tensor,
    ops: torch.Tensor,
    pools: Sequence[TokenCopyPool],
    tokens_per_block: int,
    disjoint: bool = False,
    min_live: int = 0,
) -> None:
    num_ops = ops.shape[0]
    if num_ops == 0 or not pools:
        return
    desc, passes = _descriptors(pools, tokens_per_block, num_ops, disjoint)
    desc_dev = torch.from_numpy(desc).to(tables.device)
    _, table_rows, cols = tables.shape
    stride = max(per_op for _, _, per_op in passes)
    modes = (DIRECT,) if disjoint else (GATHER, SCATTER)
    scratch = None
    if not disjoint:
        # Freed at return: torch's allocator hands it out again only to work queued on this
        # stream after these launches.
        scratch = torch.empty(num_ops * stride, dtype=torch.uint8, device=tables.device)
    for first, count, _ in passes:
        for mode in modes:
            launch(
                "kv_copy",
                "copy_tokens",
                tables.device,
                (num_ops, count),
                (THREADS,),
                (
                    ptr(tables),
                    ptr(ops),
                    np.uint64(desc_dev.data_ptr() + first * DESC_FIELDS * 8),
                    i32(table_rows),
                    i32(cols),
                    i32(tokens_per_block),
                    np.uint64(0) if scratch is None else ptr(scratch),
                    i64(stride),
                    i32(mode),
                    i32(min_live),
                ),
            )


def copy_tokens(
    tables: torch.Tensor,
    ops: torch.Tensor,
    pools: Sequence[TokenCopyPool],
    tokens_per_block: int,
    disjoint: bool = False,
    min_live: int = 0,
) -> None:
    """Copy token entries in place, by value; ``tables`` int32 ``[G, R, B]``, ``ops`` int64
    ``[K, 3]`` (row, src, dst) with distinct destinations.

    ``disjoint=True`` promises that no destination is another op's source, which lets CUDA
    copy in one launch instead of a gather and a scatter (an op that copies a token onto
    itself is harmless there: each thread reads its bytes before writing them). An op whose
    source or destination slot is below ``min_live`` (no page: -1, or the null page 0) is
    skipped.
    """
    args = (pools, tokens_per_block, disjoint, min_live)
    if gpu_path(tables, ops, *(p.memory for p in pools)):
        copy_tokens_cuda(tables.contiguous(), ops.contiguous(), *args)
    else:
        copy_tokens_reference(tables, ops, *args)

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
3 * 64 + [16, 24) and 3 * 64 + 32 + [16, 24). Sources and destinations must be disjoint;
ops whose source or destination has no page (a slot below ``min_live``: -1, or 0 with the null
page, which must stay zero) are skipped.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from ._dispatch import gpu_path, i32, launch, ptr

THREADS = 128


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
    min_live: int = 0,
) -> None:
    if ops.shape[0] == 0:
        return
    rows, src, dst = ops[:, 0], ops[:, 1], ops[:, 2]
    for pool in pools:
        token_bytes = pool.bytes_per_buffer // tokens_per_block
        mem = pool.memory.view(-1, pool.num_buffers, tokens_per_block, token_bytes)
        table = tables[pool.group]
        src_slot = table[rows, src // tokens_per_block].long()
        dst_slot = table[rows, dst // tokens_per_block].long()
        ok = (src_slot >= min_live) & (dst_slot >= min_live)
        tokens = mem[src_slot[ok], :, (src % tokens_per_block)[ok], :]
        mem[dst_slot[ok], :, (dst % tokens_per_block)[ok], :] = tokens


def _width(token_bytes: int) -> int:
    return next(w for w in (16, 8, 4, 2, 1) if token_bytes % w == 0)


def copy_tokens_cuda(
    tables: torch.Tensor,
    ops: torch.Tensor,
    pools: Sequence[TokenCopyPool],
    tokens_per_block: int,
    min_live: int = 0,
) -> None:
    if ops.shape[0] == 0 or not pools:
        return
    desc = np.array(
        [
            [
                p.group,
                p.memory.data_ptr(),
                p.memory.shape[1],
                p.bytes_per_buffer,
                p.num_buffers,
                p.bytes_per_buffer // tokens_per_block,
                _width(p.bytes_per_buffer // tokens_per_block),
            ]
            for p in pools
        ],
        dtype=np.int64,
    )
    desc_dev = torch.from_numpy(desc).to(tables.device)
    _, rows, cols = tables.shape
    launch(
        "kv_copy",
        "copy_tokens",
        tables.device,
        (ops.shape[0], len(pools)),
        (THREADS,),
        (
            ptr(tables),
            ptr(ops),
            ptr(desc_dev),
            i32(rows),
            i32(cols),
            i32(tokens_per_block),
            i32(min_live),
        ),
    )


def copy_tokens(
    tables: torch.Tensor,
    ops: torch.Tensor,
    pools: Sequence[TokenCopyPool],
    tokens_per_block: int,
    min_live: int = 0,
) -> None:
    """Copy token entries in place; ``tables`` int32 ``[G, R, B]``, ``ops`` int64 ``[K, 3]``;
    an op whose source or destination slot is below ``min_live`` is skipped."""
    if gpu_path(tables, ops, *(p.memory for p in pools)):
        copy_tokens_cuda(tables.contiguous(), ops.contiguous(), pools, tokens_per_block, min_live)
    else:
        copy_tokens_reference(tables, ops, pools, tokens_per_block, min_live)

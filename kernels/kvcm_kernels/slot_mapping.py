"""Slot mapping: the flat KV-cache index of every new token of a batch.

For token i of request r at position p: ``slot x tokens_per_block + p % tokens_per_block`` with
slot = ``table[row(r), p // tokens_per_block]``; -1 where there is no page and for padding, so
that CUDA graphs always see ``pad_to`` entries. Given the tables of several layer groups
``[G, R, B]``, it maps the batch for each of them at once (``[G, pad_to]``).

"No page" is an entry below ``min_live``: 0 (only -1 is no page) by default, 1 with the null
page, whose tables hold slot 0 where there is no page. A token is never mapped onto the null
page: its KV would land in memory that every tile-reading kernel expects to stay zero.

Worked example (tokens_per_block 16): request 0 in row 3 with table row [7, 2, -1, ...] adds
positions 15 and 16: slot 7 offset 15 gives 127, slot 2 offset 0 gives 32. Padded to 4:
[127, 32, -1, -1]. With the null page the row reads [7, 2, 0, ...] and min_live is 1: position 32
(block 2, slot 0) maps to -1, not to 0 * 16 + 0.
"""

from __future__ import annotations

import numpy as np
import torch

from ._dispatch import blocks, gpu_path, i32, launch, ptr

THREADS = 256


def _out(tables: torch.Tensor, pad_to: int, out: torch.Tensor | None) -> torch.Tensor:
    shape = (tables.shape[0], pad_to)
    if out is None:
        return torch.empty(shape, dtype=torch.int64, device=tables.device)
    out = out.view(shape)
    assert out.dtype == torch.int64 and out.is_contiguous()
    return out


def slot_mapping_reference(
    table: torch.Tensor,
    rows: torch.Tensor,
    query_start_loc: torch.Tensor,
    positions: torch.Tensor,
    tokens_per_block: int,
    pad_to: int,
    out: torch.Tensor | None = None,
    min_live: int = 0,
) -> torch.Tensor:
    tables = table if table.dim() == 3 else table.unsqueeze(0)
    result = _out(tables, pad_to, out)
    counts = query_start_loc[1:] - query_start_loc[:-1]
    # output_size avoids a device-to-host sync on CUDA tensors.
    token_rows = torch.repeat_interleave(rows, counts, output_size=positions.numel())
    slots = tables[:, token_rows, positions // tokens_per_block].to(torch.int64)
    flat = slots * tokens_per_block + positions % tokens_per_block
    mapped = torch.where(slots >= min_live, flat, -1)
    result.fill_(-1)
    result[:, : mapped.shape[1]] = mapped
    return result if table.dim() == 3 else result[0]


def slot_mapping_host(
    tables: np.ndarray,
    token_rows: np.ndarray,
    positions: np.ndarray,
    tokens_per_block: int,
    pad_to: int,
    min_live: int = 0,
) -> np.ndarray:
    """The mapping of host tables ``[G, R, B]`` (the CPU manager's own arrays) in numpy:
    int64 ``[G, pad_to]``, token t at ``token_rows[t]``, ``positions[t]``. The CPU's step
    path: a handful of numpy calls where the torch reference makes a dozen tensor ops (a
    decode step of 16 requests: about 10 us against 60)."""
    out = np.full((tables.shape[0], pad_to), -1, dtype=np.int64)
    n = positions.size
    if n and tables.shape[0]:
        slots = tables[:, token_rows, positions // tokens_per_block]
        flat = slots.astype(np.int64) * tokens_per_block + positions % tokens_per_block
        np.copyto(out[:, :n], flat, where=slots >= min_live)
    return out


def slot_mapping_cuda(
    table: torch.Tensor,
    rows: torch.Tensor,
    query_start_loc: torch.Tensor,
    positions: torch.Tensor,
    tokens_per_block: int,
    pad_to: int,
    out: torch.Tensor | None = None,
    min_live: int = 0,
) -> torch.Tensor:
    tables = table if table.dim() == 3 else table.unsqueeze(0)
    groups, table_rows, cols = tables.shape
    out = _out(tables, pad_to, out)
    if pad_to and groups:
        launch(
            "slot_mapping",
            "slot_mapping",
            table.device,
            (blocks(pad_to, THREADS, 1024), groups),
            (THREADS,),
            (
                ptr(tables),
                ptr(rows),
                ptr(query_start_loc),
                ptr(positions),
                ptr(out),
                i32(rows.numel()),
                i32(pad_to),
                i32(table_rows),
                i32(cols),
                i32(tokens_per_block),
                i32(min_live),
            ),
        )
    return out if table.dim() == 3 else out[0]


def slot_mapping(
    table: torch.Tensor,
    rows: torch.Tensor,
    query_start_loc: torch.Tensor,
    positions: torch.Tensor,
    tokens_per_block: int,
    pad_to: int,
    out: torch.Tensor | None = None,
    min_live: int = 0,
) -> torch.Tensor:
    """int64 ``[pad_to]`` for a table ``[R, B]``, ``[G, pad_to]`` for tables ``[G, R, B]``.

    ``rows`` int64 ``[n]``; ``query_start_loc`` int64 ``[n + 1]`` (the last entry is the number of
    tokens); ``positions`` int64, one per token. ``out`` (int64 ``[G, pad_to]``) is written in
    full when given. Table entries below ``min_live`` are no page (-1 in the mapping).
    """
    args = (table, rows, query_start_loc, positions)
    if gpu_path(*args):
        contiguous = [t.contiguous() for t in args]
        return slot_mapping_cuda(*contiguous, tokens_per_block, pad_to, out, min_live)
    return slot_mapping_reference(*args, tokens_per_block, pad_to, out, min_live)

"""Kernel-mode page indices: slot x (num_buffers / kv_factor) + page offset, -1 kept.

A kernel that sees a pool as a contiguous array of one layer's ``[kv_factor, tokens_per_block,
heads, head_dim]`` pages finds slot s of a pool with ``num_buffers`` coalesced buffers at page
s x num_buffers / kv_factor (plus the layer's page offset inside the slot in per-layer mode).

Worked example: three key-only layers in one pool (num_buffers 3, kv_factor 1): slot 5 is page
15, and layer 2's page in per-layer mode is 15 + 2 = 17. One key/value layer alone in its pool
(num_buffers 2, kv_factor 2): slot 5 is page 5.
"""

from __future__ import annotations

import torch

from ._dispatch import gpu_path, i32, launch, ptr

THREADS = 256


def _out(table: torch.Tensor, n: int, out: torch.Tensor | None) -> torch.Tensor:
    if out is None:
        return torch.empty((n, table.shape[1]), dtype=torch.int32, device=table.device)
    assert out.shape == (n, table.shape[1]) and out.dtype == torch.int32 and out.is_contiguous()
    return out


def kernel_page_indices_reference(
    table: torch.Tensor,
    rows: torch.Tensor,
    multiplier: int,
    offset: int,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    pages = table.index_select(0, rows)
    result = _out(table, rows.numel(), out)
    result.copy_(torch.where(pages >= 0, pages * multiplier + offset, -1))
    return result


def kernel_page_indices_cuda(
    table: torch.Tensor,
    rows: torch.Tensor,
    multiplier: int,
    offset: int,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    n, cols = rows.numel(), table.shape[1]
    out = _out(table, n, out)
    if n == 0 or cols == 0:
        return out
    vec = cols % 4 == 0 and table.data_ptr() % 16 == 0 and out.data_ptr() % 16 == 0
    width = cols // 4 if vec else cols
    grid = (max(1, min(-(-width // THREADS), 64)), min(n, 65535))
    launch(
        "page_indices",
        "kernel_page_indices_vec4" if vec else "kernel_page_indices",
        table.device,
        grid,
        (THREADS,),
        (ptr(table), ptr(rows), ptr(out), i32(n), i32(width), i32(multiplier), i32(offset)),
    )
    return out


def kernel_page_indices(
    table: torch.Tensor,
    rows: torch.Tensor,
    multiplier: int,
    offset: int,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Rows ``rows`` (int64) of the int32 page table ``[R, B]``, as int32 kernel-mode pages.

    ``out`` (int32 ``[len(rows), B]``) is written in full when given.
    """
    if gpu_path(table, rows):
        return kernel_page_indices_cuda(
            table.contiguous(), rows.contiguous(), multiplier, offset, out
        )
    return kernel_page_indices_reference(table, rows, multiplier, offset, out)

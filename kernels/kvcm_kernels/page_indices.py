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


def kernel_page_indices(
    table: torch.Tensor, rows: torch.Tensor, multiplier: int, offset: int
) -> torch.Tensor:
    """Rows ``rows`` of the int32 page table, mapped to kernel-mode page indices (int32)."""
    pages = table.index_select(0, rows)
    return torch.where(pages >= 0, pages * multiplier + offset, -1).to(torch.int32)

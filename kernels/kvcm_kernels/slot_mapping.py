"""Slot mapping: the flat KV-cache index of every new token of a batch.

For token i of request r at position p: ``slot x tokens_per_block + p % tokens_per_block`` with
slot = ``table[row(r), p // tokens_per_block]``; -1 where the page is -1 and for padding, so that
CUDA graphs always see ``pad_to`` entries.

Worked example (tokens_per_block 16): request 0 in row 3 with table row [7, 2, -1, ...] adds
positions 15 and 16: slot 7 offset 15 gives 127, slot 2 offset 0 gives 32. Padded to 4:
[127, 32, -1, -1].
"""

from __future__ import annotations

import torch


def slot_mapping(
    table: torch.Tensor,
    rows: torch.Tensor,
    query_start_loc: torch.Tensor,
    positions: torch.Tensor,
    tokens_per_block: int,
    pad_to: int,
) -> torch.Tensor:
    """int64 ``[pad_to]``; ``query_start_loc`` has len(rows) + 1 entries, the last = #tokens."""
    counts = query_start_loc[1:] - query_start_loc[:-1]
    token_rows = torch.repeat_interleave(rows, counts)
    slots = table[token_rows, positions // tokens_per_block].to(torch.int64)
    mapped = torch.where(slots >= 0, slots * tokens_per_block + positions % tokens_per_block, -1)
    out = torch.full((pad_to,), -1, dtype=torch.int64, device=table.device)
    out[: mapped.numel()] = mapped
    return out

"""Page-table edits: one launch applies a step's changes to the tables of all layer groups.

An edit is (layer group, row, block position, slot), slot -1 for a released block. The manager
collects the edits of a step on the host and sends them in one int64 ``[E, 4]`` array (int64 so
that they travel in the same upload as the slot-mapping inputs); each table cell appears at
most once (the manager keeps the last edit of a cell).

Example: edits [[0, 3, 5, 17], [1, 3, 0, -1]] set ``tables[0, 3, 5] = 17`` and
``tables[1, 3, 0] = -1``.
"""

from __future__ import annotations

import torch

from ._dispatch import blocks, gpu_path_pinned_inputs, i32, launch, ptr

THREADS = 256


def apply_page_table_edits_reference(tables: torch.Tensor, edits: torch.Tensor) -> None:
    """In place: ``tables[g, r, p] = s`` for every edit (g, r, p, s)."""
    if edits.shape[0]:
        e = edits.to(tables.device).long()  # pinned host edits, on CUDA
        tables[e[:, 0], e[:, 1], e[:, 2]] = e[:, 3].to(tables.dtype)


def apply_page_table_edits_cuda(tables: torch.Tensor, edits: torch.Tensor) -> None:
    n = edits.shape[0]
    if n == 0:
        return
    _, rows, cols = tables.shape
    launch(
        "page_table_edits",
        "apply_page_table_edits",
        tables.device,
        (blocks(n, THREADS),),
        (THREADS,),
        (ptr(tables), ptr(edits), i32(n), i32(rows), i32(cols)),
    )


def apply_page_table_edits(tables: torch.Tensor, edits: torch.Tensor) -> None:
    """int32 ``tables [G, R, B]`` (contiguous) updated in place from int64 ``edits [E, 4]``
    (on CUDA, on the device or in pinned host memory, which the kernel reads in place)."""
    if gpu_path_pinned_inputs(tables, edits):
        apply_page_table_edits_cuda(tables, edits.contiguous())
    else:
        apply_page_table_edits_reference(tables, edits)

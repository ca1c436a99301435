"""A step's mapped tokens as the C core reads them: what ``map_slots`` maps.

``kvcm.columnar.mapped_tokens`` names them, the tables (``kvcm.views``, ``kvcm.device_tables``)
map them: on the CPU's tables by one C call, on CUDA packed with the step's table edits for
one launch. A decode step's are its handles themselves, so no array is made for them.
"""

from __future__ import annotations

import numpy as np

from .ids import ROW_MASK

#: A step's mapped tokens, as the C core reads them (``kvcm.columnar.mapped_tokens``):
#: explicit ``(rows, starts, counts)``, int64 arrays (item i: positions ``[starts[i],
#: starts[i] + counts[i])`` of page-table row ``rows[i]``), or a decode batch ``(handles,
#: lengths, n)``: the last ``n`` positions of each handle's row, ``lengths`` every row's
#: length (the coordinator's ``num_tokens``), with no array made per step. Both forms hold
#: live arrays (the step's handles, the coordinator's lengths): map them at once.
MappedItems = tuple[np.ndarray, np.ndarray, "np.ndarray | int"]


def expand_items(items: MappedItems) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``items`` as explicit ``(rows, starts, counts)``.

    Example: a decode batch ``(handles [2**32 + 3], lengths, 1)`` with row 3 at 9 tokens
    (the handle's low 32 bits are its row): ``([3], [8], [1])``.
    """
    first, second, third = items
    if not isinstance(third, int):
        return first, second, third
    rows = first & ROW_MASK
    return rows, second[rows] - third, np.full(rows.size, third, dtype=np.int64)


def mapped_total(items: MappedItems) -> int:
    """The tokens ``items`` map (each item's count, summed)."""
    first, _, third = items
    return first.size * third if isinstance(third, int) else int(third.sum())

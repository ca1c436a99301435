"""Page-table edits for an engine's own copy of the page tables (its "mirror").

An engine that cannot map kvcm's tables (another host, a table layout of its own) keeps a
copy and applies, after each step, the cells the step changed:
``step_columns(..., table_edits=True)`` answers them as int64 ``[E, 4]`` rows (layer group,
row, block position, value), the value being what the kernel-facing page table holds (a
slot; ``-1``, or ``0`` with the null page, where there is no page).

They are the coordinator's own edit log (``EditLog.take_edits``: every path that writes a
cell logs it, the C core included, and an all-or-nothing step that is undone takes its
edits back), so an answer costs what the step changed, not the size of the tables. The first
answer lists every cell that holds a page, so a copy starts filled with the empty value.
One copy per manager: the log goes to whoever asks. A manager whose device tables consume
the log (a CUDA device, several ranks) refuses: its engines map the tables (CUDA IPC)
instead.

Example (tokens_per_block 4, no null page): a step allocates a 6-token request in row 0,
slots 7 and 3 of group 0: the answer is ``[[0, 0, 0, 7], [0, 0, 1, 3]]``; freeing it later
answers ``[[0, 0, 0, -1], [0, 0, 1, -1]]``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from kvcm_client.errors import InvalidArgument

if TYPE_CHECKING:
    from .coordinator import Coordinator


class TableMirror:
    """The edit log's consumer for an engine's copy of the tables (module docstring)."""

    def __init__(self, coord: Coordinator) -> None:
        self.coord = coord
        self.started = False

    def check(self) -> None:
        """Refuse, before a step runs, what ``take`` would refuse after it: a step that
        asks for table edits where device tables consume the log fails whole, changing
        nothing."""
        if not self.started and self.coord.edits is not None:
            raise InvalidArgument(
                "table_edits needs page tables that live on the host (device cpu, one rank): "
                "on a GPU, map the tables instead (attach, CUDA IPC)"
            )

    def take(self) -> np.ndarray:
        """The cells changed since the last call, int64 ``[E, 4]`` (group, row, position,
        value); the first call lists every cell that holds a page."""
        c = self.coord
        if self.started:
            return c.take_edits()
        self.check()
        c.start_edit_log()
        self.started = True
        cells = np.nonzero(c.tables != c.empty)
        out = np.empty((cells[0].size, 4), dtype=np.int64)
        out[:, 0], out[:, 1], out[:, 2] = cells
        out[:, 3] = c.tables[cells]
        return out

"""The coordinator's edit log (what device tables replay) and its checkpoints (what an
all-or-nothing step restores): ``Coordinator`` inherits ``EditLog``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

#: One record of the edit log: (layer group, rows, positions, slots or None for ``empty``)
#: as the coordinator's writes log them, or the int64 ``[E, 4]`` edits (group, row,
#: position, slot) the C core logged itself (``Coordinator.logged``).
EditRecord = tuple[int, np.ndarray, np.ndarray, np.ndarray | None] | np.ndarray


@dataclass(slots=True)
class _Checkpoint:
    arrays: list[np.ndarray]
    pools: list[Any]
    refs: list[np.ndarray]
    cache: Any
    edits: list[EditRecord] | None
    ops_since_take: int
    takes: int


class EditLog:
    """Mixin of ``Coordinator`` (its tables, per-row arrays, pools, references and cache)."""

    tables: np.ndarray
    edits: list[EditRecord] | None
    takes: int
    ops_since_take: int
    num_tokens: np.ndarray
    history: np.ndarray
    lookahead: np.ndarray
    num_blocks: list[np.ndarray]
    released_end: list[np.ndarray]
    pools: list[Any]
    refs: list[np.ndarray]
    cache: Any

    def start_edit_log(self) -> bool:
        """Log every table edit from now on (``take_edits``), for a consumer of its own;
        False when the log is on already, which means device tables consume it."""
        if self.edits is not None:
            return False
        self.edits = []
        self.ops_since_take = 0
        return True

    def take_edits(self) -> np.ndarray:
        """The table edits since the last call as int64 ``[E, 4]``, one per cell (the last).

        A single op never edits a cell twice, so only several ops need the de-duplication.
        A decode step's edits are the C core's records as they are (one, or one per kind:
        releases, then new blocks), so taking them costs a concatenation at most.
        """
        records = self.edits or []
        parts = [r if type(r) is np.ndarray else self._packed(r) for r in records]
        if len(parts) == 1:
            out = parts[0]
        else:
            out = np.concatenate(parts) if parts else np.empty((0, 4), dtype=np.int64)
        if self.ops_since_take > 1 and len(out) > 1:
            out = self.last_edits(out)
        if self.edits is not None:
            self.edits.clear()
        self.ops_since_take = 0
        self.takes += 1
        return out

    def _packed(self, record: tuple[int, np.ndarray, np.ndarray, np.ndarray | None]) -> np.ndarray:
        """A record of the coordinator's writes as int64 ``[E, 4]`` edits."""
        g, rows, positions, slots = record
        out = np.empty((len(rows), 4), dtype=np.int64)
        out[:, 0] = g
        out[:, 1] = rows
        out[:, 2] = positions
        out[:, 3] = self.empty if slots is None else slots
        return out

    def last_edits(self, edits: np.ndarray) -> np.ndarray:
        """Of ``edits`` in the order they were made, the last one of each cell: the table
        kernels apply a batch in parallel, so a cell must appear once."""
        _, rows, cols = self.tables.shape
        key = (edits[:, 0] * rows + edits[:, 1]) * cols + edits[:, 2]
        _, last = np.unique(key[::-1], return_index=True)
        return edits[::-1][last]

    def checkpoint(self) -> _Checkpoint:
        """Copy every piece of mutable state; ``restore`` puts it back exactly.

        Costs one copy of the host tables and of each free list, so it is taken only for
        all-or-nothing steps. Edits logged for the device tables are restored too: an edit
        that was undone on the host never reaches the device.
        """
        return _Checkpoint(
            arrays=[a.copy() for a in self._state_arrays()],
            pools=[p.checkpoint() for p in self.pools],
            refs=[r.copy() for r in self.refs],
            cache=self.cache.checkpoint(),
            edits=None if self.edits is None else list(self.edits),
            ops_since_take=self.ops_since_take,
            takes=self.takes,
        )

    def _state_arrays(self) -> tuple[np.ndarray, ...]:
        """The per-row arrays and tables that a checkpoint copies."""
        return (
            self.num_tokens,
            self.history,
            self.lookahead,
            *self.num_blocks,
            *self.released_end,
            self.tables,
        )

    def restore(self, saved: _Checkpoint) -> None:
        """Put back what ``checkpoint`` copied. Edits logged since then are dropped, unless
        some were taken meanwhile (a device table, or a rank's queue, already has them):
        then every cell the undo changes back is logged as an edit of its own.

        Example: a step allocates block 5 into row 2 of group 0, a read inside the step's
        transaction takes that edit to the device, and the step is undone: the host cell
        goes back to -1 and an edit (0, 2, 0, -1) follows, so the device cell does too.
        """
        edits, ops_since_take = saved.edits, saved.ops_since_take
        if self.edits is not None and edits is not None and self.takes != saved.takes:
            before = saved.arrays[-1]  # the tables
            changed = np.argwhere(self.tables != before)
            edits = list(self.edits)
            for g in np.unique(changed[:, 0]).tolist():
                cells = changed[changed[:, 0] == g]
                edits.append((g, cells[:, 1], cells[:, 2], before[g, cells[:, 1], cells[:, 2]]))
            ops_since_take = self.ops_since_take + 2  # several records: fold them by cell
        for dst, src in zip(self._state_arrays(), saved.arrays, strict=True):
            dst[...] = src
        for pool, state in zip(self.pools, saved.pools, strict=True):
            pool.restore(state)
        for refs, old in zip(self.refs, saved.refs, strict=True):
            refs[:] = old
        self.cache.restore(saved.cache)
        if self.edits is not None and edits is not None:
            self.edits[:] = edits
        self.ops_since_take = ops_since_take

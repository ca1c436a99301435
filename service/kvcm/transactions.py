"""All-or-nothing steps: a checkpoint of the manager's bookkeeping and an undo to it.

A checkpoint copies the coordinator's host page tables and free lists and the manager's
per-request maps; edits to lists shared with the checkpoint (a request's committed ids and
block keys) register their own undo actions in ``_undo`` while a transaction runs. The state
layers and the host tier record their own changes (``StatePools.begin``, ``HostTier.begin``)
and put them back, bytes included; the event log goes back with the prefix cache, so a
follower never sees an event of an undone step.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from .allocation import FirstAllocation
    from .manager import KVCacheManager
    from .publish import PrefixState
    from .suspension import Suspended


@dataclass(slots=True)
class _Checkpoint:
    """What an undo puts back: the coordinator's checkpoint and copies of the manager's maps
    and arrays (the maps are shallow copies: their lists are restored by ``_undo`` actions)."""

    coordinator: Any
    rows: dict[str, int]
    free_rows: list[int]
    first: dict[str, FirstAllocation]
    prefix: dict[str, PrefixState]
    hits: np.ndarray
    tokens: dict[str, bytearray]
    committed: np.ndarray
    ids: list[str | None]
    handles: np.ndarray
    suspended: dict[str, Suspended]
    suspended_handles: dict[int, str]


@contextmanager
def transaction(m: KVCacheManager) -> Iterator[Callable[[], None]]:
    """Yield an ``undo`` that puts the manager back as it was on entry.

    Undo also happens if the block raises. Nested transactions are not supported.
    """
    if m._undo is not None:
        raise RuntimeError("transactions do not nest")
    saved = _Checkpoint(
        coordinator=m._coord.checkpoint(),
        rows=dict(m._rows),
        free_rows=list(m._free_rows),
        first=dict(m._first),
        tokens=dict(m._tokens),
        committed=m._committed.copy(),
        prefix=dict(m._prefix),
        hits=m._hits.copy(),
        ids=list(m._ids),
        handles=m._handle.copy(),
        suspended=dict(m._suspended),
        suspended_handles=dict(m._suspended_handles),
    )
    m._undo = []
    if m._state is not None:
        m._state.begin()
    if m._host is not None:
        m._host.begin()

    def undo() -> None:
        assert m._undo is not None
        for action in reversed(m._undo):
            action()
        m._undo.clear()
        if m._state is not None:
            m._state.undo()
        if m._host is not None:
            m._host.undo()
        m._coord.restore(saved.coordinator)
        m._rows = dict(saved.rows)
        m._free_rows = list(saved.free_rows)
        m._first = dict(saved.first)
        m._tokens = dict(saved.tokens)
        m._committed[:] = saved.committed
        m._prefix = dict(saved.prefix)
        m._hits[:] = saved.hits
        m._ids = list(saved.ids)
        m._handle[:] = saved.handles
        m._suspended = dict(saved.suspended)
        m._suspended_handles = dict(saved.suspended_handles)

    try:
        yield undo
    except BaseException:
        undo()
        raise
    finally:
        m._undo = None
        if m._state is not None:
            m._state.end()
        if m._host is not None:
            m._host.end()

"""All-or-nothing steps: a checkpoint of every component and an undo to it.

Each component saves and puts back its own state: the coordinator its host page tables and
free lists (``Coordinator.checkpoint``), the request table its maps and arrays
(``RequestTable.checkpoint``; edits to lists the checkpoint shares, a request's committed ids
and block keys, register their own undo with ``RequestTable.record`` while a transaction
runs), the state layers and the host tier their changes, bytes included (``StatePools.begin``,
``HostTier.begin``). The event log goes back with the prefix cache, so a follower never sees
an event of an undone step.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .components import Components


@contextmanager
def transaction(m: Components) -> Iterator[Callable[[], None]]:
    """Yield an ``undo`` that puts the components back as they were on entry.

    Undo also happens if the block raises. Nested transactions are not supported.
    """
    table = m.requests
    saved_table = table.checkpoint()  # refuses a nested transaction first
    saved_coordinator = m.coord.checkpoint()
    if m.state is not None:
        m.state.begin()
    if m.host is not None:
        m.host.begin()

    def undo() -> None:
        table.restore(saved_table)
        if m.state is not None:
            m.state.undo()
        if m.host is not None:
            m.host.undo()
        m.coord.restore(saved_coordinator)

    try:
        yield undo
    except BaseException:
        undo()
        raise
    finally:
        table.close_transaction()
        if m.state is not None:
            m.state.end()
        if m.host is not None:
            m.host.end()

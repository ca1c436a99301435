"""The request table: which row and handle each live request has, what it committed and
reused, its prefix keys and first allocation, and the records of suspended requests.

A live request owns one row of the page tables and a handle, ``serial << 32 | row`` (the
row's allocations so far: a handle of a freed request names nothing). The table owns these
maps and arrays and changes them only through its methods; other components read them (the
columnar step reads ``handle`` and ``committed`` as arrays, the C core writes committed
tokens and counts into the arrays it is given: ``kvcm.commits``). An all-or-nothing step
saves the table with ``checkpoint`` and puts it back with ``restore``; edits to lists the
checkpoint shares (a request's committed ids and block keys) register their own undo with
``record`` while a transaction runs (``undo`` is not None).

Example (max_requests 4): a new table's free rows are [3 2 1 0], so ``claim("a")`` takes
row 0 with handle ``1 << 32 | 0``; after ``release(0)``, the next claim takes row 0 again
with handle ``2 << 32 | 0``, and the old handle names nothing.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from .ids import ROW_MASK as ROW_MASK  # re-exported: handles are made here

if TYPE_CHECKING:
    from .publish import PrefixState

#: Largest serial: a handle stays below 2**63 (int64). A row's serial wraps from it to 1
#: (after 2**31 - 1 allocations of that row, some days of a busy server's row 0).
MAX_SERIAL = 2**31 - 1


@dataclass(frozen=True, slots=True)
class Suspended:
    """A suspended request: per layer group, the table positions of its blocks and the
    host slots holding their pages, and the (scope, key) of those that were published
    (index into the positions -> key), whose device copies a resume can take back; the
    handle it gets back at resume; the host state slot holding its live state (-1: no
    state layers)."""

    blocks: list[tuple[np.ndarray, list[int]]]
    published: list[dict[int, tuple[bytes, bytes]]]
    handle: int
    state: int


@dataclass(slots=True)
class _Checkpoint:
    """What ``restore`` puts back: copies of the maps and arrays (the maps are shallow
    copies: the lists they share are put back by the actions ``record`` took)."""

    rows: dict[str, int]
    free_rows: list[int]
    first: dict[str, Any]
    prefix: dict[str, PrefixState]
    hits: np.ndarray
    tokens: dict[str, bytearray]
    committed: np.ndarray
    ids: list[str | None]
    handles: np.ndarray
    suspended: dict[str, Suspended]
    suspended_handles: dict[int, str]
    held: dict[str, int]


class RequestTable:
    """The bookkeeping of every request a manager holds, one row each (module docstring)."""

    __slots__ = (
        "committed",
        "first",
        "free_rows",
        "handle",
        "held",
        "hits",
        "ids",
        "order",
        "prefix",
        "rows",
        "scratch",
        "serial",
        "suspended",
        "suspended_handles",
        "tokens",
        "undo",
    )

    def __init__(self, max_requests: int, serial_base: int = 0) -> None:
        """``serial_base``: the serial rows start from (the previous model's last, after a
        registration, so that no handle of it names a request of the new one)."""
        self.rows: dict[str, int] = {}
        self.free_rows = list(range(max_requests - 1, -1, -1))
        #: Each row's request id and handle (None and -1 when free: no handle a caller
        #: passes can equal -1 with a row below max_requests), and the row's allocations so
        #: far (a handle's serial).
        self.ids: list[str | None] = [None] * max_requests
        self.handle = np.full(max_requests, -1, dtype=np.int64)
        self.serial = np.full(max_requests, serial_base, dtype=np.int64)
        #: Scratch for the distinct-rows check of a batch (``distinct_rows``).
        self.order = np.arange(max_requests, dtype=np.int64)
        self.scratch = np.zeros(max_requests, dtype=np.int64)
        #: Each live request's first allocation (``kvcm.allocation.FirstAllocation``) and
        #: prefix state (extra keys, committed blocks' keys).
        self.first: dict[str, Any] = {}
        self.prefix: dict[str, PrefixState] = {}
        #: Tokens each row got from the prefix cache at allocation.
        self.hits = np.zeros(max_requests, dtype=np.int64)
        #: Committed token ids per request, as int32 bytes (a commit appends its checked
        #: bytes, a rewind cuts them, and no Python int is made per token), and their count
        #: per row (for batch results).
        self.tokens: dict[str, bytearray] = {}
        self.committed = np.zeros(max_requests, dtype=np.int64)
        #: Undo actions for list edits while an all-or-nothing step runs (None: none runs).
        self.undo: list[Callable[[], None]] | None = None
        #: Suspended requests, and the handle each gets back, to its id (a resume by handle).
        self.suspended: dict[str, Suspended] = {}
        self.suspended_handles: dict[int, str] = {}
        #: Requests whose KV is moving between sidecars (a pull into them, a hand-off from
        #: them; ``kvcm.transfers``), and the handle each gets back: until then their handle
        #: names nothing, so no op reaches them.
        self.held: dict[str, int] = {}

    # -- rows and handles -------------------------------------------------------------------

    def next_row(self) -> int | None:
        """The row the next ``claim`` takes (the one an allocate grows first), or None."""
        return self.free_rows[-1] if self.free_rows else None

    def claim(self, request_id: str) -> tuple[int, int]:
        """Give ``request_id`` the last free row and a new handle for it; returns the row and
        the handle. Example: row 5's serial 3 gives handle ``4 << 32 | 5``; its serial
        ``MAX_SERIAL`` gives ``1 << 32 | 5`` (it wraps, also in csrc/allocate.c)."""
        serial = self.serial.item(self.free_rows[-1]) % MAX_SERIAL + 1
        taken = self.free_rows.pop()
        self.rows[request_id] = taken
        self.ids[taken] = request_id
        self.serial[taken] = serial
        handle = (serial << 32) | taken
        self.handle[taken] = handle
        return taken, handle

    def start(
        self, request_id: str, row: int, first: Any, prefix: PrefixState, data: bytes, hit: int
    ) -> None:
        """Record a claimed row's first allocation: its prefix state, and its hit of ``hit``
        tokens (their int32 ``data``) as committed."""
        self.tokens[request_id] = bytearray(data)
        self.committed[row] = hit
        self.hits[row] = hit
        self.prefix[request_id] = prefix
        self.first[request_id] = first

    def release(self, row: int) -> str:
        """Forget a live row's request (its blocks are the coordinator's to give back);
        returns its id."""
        request_id = self.ids[row]
        assert request_id is not None
        self.ids[row] = None
        self.handle[row] = -1
        del self.rows[request_id]
        del self.first[request_id]
        del self.tokens[request_id]
        del self.prefix[request_id]
        self.held.pop(request_id, None)
        self.committed[row] = 0
        self.hits[row] = 0
        self.free_rows.append(row)
        return request_id

    def handle_rows(self, handles: np.ndarray) -> tuple[np.ndarray, np.ndarray | None]:
        """Rows of int64 handles, and a mask of the live ones (None when all are live).

        Example: handle ``2 << 32 | 7`` is row 7 if row 7's request is its second
        allocation; after that request's free it names nothing (the row's next request has
        serial 3).
        """
        max_requests = self.handle.size
        rows = handles & ROW_MASK
        if handles.size and int(rows.max()) >= max_requests:
            inside = rows < max_requests
            rows = np.where(inside, rows, 0)
            live = inside & (self.handle[rows] == handles)
            return rows, live
        # Live handles are > 0 and a free row holds -1, whose row bits are past every row:
        # so a handle of 0 or below never matches.
        live = self.handle[rows] == handles
        return rows, (None if live.all() else live)

    def distinct_rows(self, rows: np.ndarray) -> bool:
        """Whether no row is named twice: each row's cell of the scratch array gets the
        index of its last item, which is each item's own only if no row repeats (a sort,
        ``np.unique``, costs 5x more at 256 rows). Example: rows [4, 9, 4]: cells 4 and 9
        get 2 and 1, and item 0 reads 2: not distinct."""
        index = np.arange(rows.size)
        scratch = self.scratch
        scratch[rows] = index
        return bool((scratch[rows] == index).all())

    def live_distinct_handles(self, handles: np.ndarray) -> np.ndarray | None:
        """The rows of ``handles`` if each is live and no row repeats (an extend batch's
        check), else None; ``order`` and ``scratch`` are the work arrays."""
        n = handles.size
        if n > self.handle.size:  # cannot all be distinct live rows
            return None
        rows = handles & ROW_MASK
        if int(rows.max()) >= self.handle.size:
            return None
        order = self.order[:n]
        scratch = self.scratch
        scratch[rows] = order
        if not ((scratch[rows] == order) & (self.handle[rows] == handles)).all():
            return None
        return rows

    # -- commits -----------------------------------------------------------------------------

    def set_committed(self, rows: np.ndarray | int, counts: np.ndarray | int) -> None:
        """Rows' committed counts (their token bytes are already appended)."""
        self.committed[rows] = counts

    def cut(self, request_id: str, row: int, new_len: int, tokens_per_block: int) -> None:
        """Drop the block keys and committed ids past ``new_len`` tokens (a rewind), undone
        by a transaction. Example (tokens_per_block 4): 10 committed ids and keys of blocks
        0 and 1, cut to 6: the key of block 1 and ids 6..9 go."""
        state = self.prefix[request_id]
        dropped = state.keys[new_len // tokens_per_block :]
        del state.keys[new_len // tokens_per_block :]
        if self.undo is not None and dropped:
            self.undo.append(lambda: state.keys.extend(dropped))
        tokens = self.tokens[request_id]
        if len(tokens) > 4 * new_len:
            tail = tokens[4 * new_len :]
            del tokens[4 * new_len :]
            self.committed[row] = new_len
            if self.undo is not None:
                self.undo.append(lambda: tokens.extend(tail))

    def record(self, action: Callable[[], None]) -> None:
        """Register how to undo an edit of a list the checkpoint shares (a transaction runs:
        ``undo`` is not None)."""
        assert self.undo is not None
        self.undo.append(action)

    # -- suspension --------------------------------------------------------------------------

    def suspend(self, row: int, saved: Suspended) -> None:
        """Record a live row's request as suspended: its handle names nothing until
        ``resume`` gives it back."""
        request_id = self.ids[row]
        assert request_id is not None
        self.suspended[request_id] = saved
        self.suspended_handles[saved.handle] = request_id
        self.handle[row] = -1

    def resume(self, request_id: str, row: int) -> None:
        """The suspended request has its blocks back: its handle names it again."""
        saved = self.suspended.pop(request_id)
        del self.suspended_handles[saved.handle]
        self.handle[row] = saved.handle

    def drop_suspended(self, request_id: str) -> Suspended | None:
        """Forget a request's suspension record (it is being freed); returns it, or None
        if it was not suspended."""
        saved = self.suspended.pop(request_id, None)
        if saved is not None:
            del self.suspended_handles[saved.handle]
        return saved

    # -- KV in flight ------------------------------------------------------------------------

    def hold(self, row: int) -> None:
        """Take a live row's handle away while its KV moves (``release`` forgets it)."""
        request_id = self.ids[row]
        assert request_id is not None
        self.held[request_id] = self.handle.item(row)
        self.handle[row] = -1

    def unhold(self, request_id: str, row: int) -> None:
        """The move ended: the request's handle names it again."""
        self.handle[row] = self.held.pop(request_id)

    # -- transactions ------------------------------------------------------------------------

    def checkpoint(self) -> _Checkpoint:
        """Copies of the table, and ``undo`` opened for the lists it shares."""
        if self.undo is not None:
            raise RuntimeError("transactions do not nest")
        saved = _Checkpoint(
            rows=dict(self.rows),
            free_rows=list(self.free_rows),
            first=dict(self.first),
            tokens=dict(self.tokens),
            committed=self.committed.copy(),
            prefix=dict(self.prefix),
            hits=self.hits.copy(),
            ids=list(self.ids),
            handles=self.handle.copy(),
            suspended=dict(self.suspended),
            suspended_handles=dict(self.suspended_handles),
            held=dict(self.held),
        )
        self.undo = []
        return saved

    def restore(self, saved: _Checkpoint) -> None:
        """Put the table back as ``saved`` had it: the recorded undo actions, last first,
        then the copies (arrays in place: the C core holds them)."""
        assert self.undo is not None
        for action in reversed(self.undo):
            action()
        self.undo.clear()
        self.rows = dict(saved.rows)
        self.free_rows = list(saved.free_rows)
        self.first = dict(saved.first)
        self.tokens = dict(saved.tokens)
        self.committed[:] = saved.committed
        self.prefix = dict(saved.prefix)
        self.hits[:] = saved.hits
        self.ids = list(saved.ids)
        self.handle[:] = saved.handles
        self.suspended = dict(saved.suspended)
        self.suspended_handles = dict(saved.suspended_handles)
        self.held = dict(saved.held)

    def close_transaction(self) -> None:
        """The transaction ended (kept or undone): list edits need no undo again."""
        self.undo = None

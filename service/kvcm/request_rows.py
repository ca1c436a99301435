"""Request rows and handles: which page-table row a request id or handle names, and the
row-level edits every op is built from (extend, rewind, free).

A live request owns one row of the page tables and a handle, ``serial << 32 | row``; the
request table owns that bookkeeping (``kvcm.request_table``), the coordinator the row's
blocks. These functions check a row's op and change both through their methods.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import TYPE_CHECKING

import numpy as np
from pydantic import BaseModel

from kvcm_client.errors import (
    InvalidArgument,
    KVCMError,
    KVInFlight,
    RequestSuspended,
    RewindIntoSharedBlock,
    SequenceTooLong,
    UnknownRequest,
)
from kvcm_client.models import RequestInfo

from . import native, native_rows, state_requests
from .counts import MAX_COUNT, _count, _counts

if TYPE_CHECKING:
    from .components import Components

from .request_table import ROW_MASK as ROW_MASK  # re-exported: the columnar step reads it


def row_of(m: Components, request_id: str, suspended: bool = False) -> int:
    """The row of a live request; ``RequestSuspended`` for a suspended one unless
    ``suspended`` (what reads its bookkeeping, frees or resumes it)."""
    try:
        found = m.requests.rows[request_id]
    except (KeyError, TypeError):
        raise _not_found(request_id) from None
    if not suspended and request_id in m.requests.suspended:
        raise RequestSuspended(
            f"request {request_id!r} is suspended: resume it first", request_id=request_id
        )
    if m.requests.held and request_id in m.requests.held and not suspended:
        raise in_flight(request_id)
    return found


def in_flight(request_id: str) -> KVInFlight:
    """The error of an op on a request whose KV is moving (``kvcm.transfers``)."""
    return KVInFlight(
        f"request {request_id[:64]!r}'s KV is moving between sidecars: wait for "
        "transfer_status to say ready",
        request_id=request_id[:64],
    )


def _not_found(request_id: object) -> InvalidArgument | UnknownRequest:
    """The error for an id no live request has: ``invalid_argument`` for one that is not a
    string (bytes among them), as ``allocate`` and the wire models refuse it, so that every
    path names it alike; else ``unknown_request``."""
    if not isinstance(request_id, str):
        return InvalidArgument(
            f"a request id is a string, not {type(request_id).__name__}", request_id=None
        )
    shown = request_id[:64]
    return UnknownRequest(f"unknown request {shown!r}", request_id=shown)


def rows_of(m: Components, request_ids: Sequence[str]) -> np.ndarray:
    """The rows of live, not suspended requests, in ``request_ids`` order."""
    # A str is a collection too: "ab" would be the requests "a" and "b".
    if isinstance(request_ids, str | bytes) or not isinstance(request_ids, Collection):
        raise InvalidArgument("request_ids must be a list of request ids", request_ids=None)
    rows = m.requests.rows
    try:
        found = np.fromiter((rows[r] for r in request_ids), dtype=np.int64, count=len(request_ids))
    except (KeyError, TypeError):
        missing = next(r for r in request_ids if not isinstance(r, str) or r not in rows)
        raise _not_found(missing) from None
    if m.requests.suspended:
        for r in request_ids:
            if r in m.requests.suspended:
                raise RequestSuspended(f"request {r!r} is suspended: resume it first", request_id=r)
    if m.requests.held:
        for r in request_ids:
            if r in m.requests.held:
                raise in_flight(r)
    return found


def check_len(m: Components, request_id: str, total: int) -> None:
    """Refuse a request that would hold more than ``max_seq_len`` tokens."""
    if total > m.config.max_seq_len:
        raise SequenceTooLong(
            f"request {request_id!r} would hold {total} tokens (with lookahead), "
            f"max_seq_len is {m.config.max_seq_len}",
            request_id=request_id,
            num_tokens=total,
            max_seq_len=m.config.max_seq_len,
        )


#: Every field of ``RequestInfo``: what ``trusted_info`` marks as set.
_INFO_FIELDS = frozenset(RequestInfo.model_fields)
_set_dict = BaseModel.__dict__["__dict__"].__set__
_set_fields = BaseModel.__dict__["__pydantic_fields_set__"].__set__
_set_extra = BaseModel.__dict__["__pydantic_extra__"].__set__
_set_private = BaseModel.__dict__["__pydantic_private__"].__set__


def trusted_info(fields: dict[str, object]) -> RequestInfo:
    """A ``RequestInfo`` of fields the manager computed itself (ints of its own arrays and a
    checked id), without validating them again: validation is 1.6 us of a single op's
    3 us budget (issue 13). The instance is the same as a validated one (equal, frozen, the
    same dump), as pydantic's own ``model_construct`` builds it, only faster."""
    info = object.__new__(RequestInfo)
    _set_dict(info, fields)
    _set_fields(info, set(_INFO_FIELDS))  # its own set: model_copy(update=...) adds to it
    _set_extra(info, None)
    _set_private(info, None)
    return info


def info(m: Components, request_id: str, row: int) -> RequestInfo:
    """The request's ``RequestInfo``; a suspended one shows the handle it gets back."""
    c = m.coord
    n = c.num_tokens.item(row)  # .item: a Python int at half the cost of int(a[row])
    saved = m.requests.suspended.get(request_id)
    return trusted_info(
        {
            "request_id": request_id,
            "row": row,
            "num_tokens": n,
            "capacity": n + c.lookahead.item(row),
            "num_committed": m.requests.committed.item(row),
            "num_hit_tokens": m.requests.hits.item(row),
            "handle": m.requests.handle.item(row) if saved is None else saved.handle,
            "state_slot": m.state_slot.item(row),
        }
    )


def blocks_of(m: Components, row: int) -> int:
    """Block positions a row holds, summed over layer groups (a loop, not a generator: a
    step calls it per allocate)."""
    total = 0
    for counts in m.coord.num_blocks:
        total += counts.item(row)
    return total


# -- extend --------------------------------------------------------------------------------


def extend_row(m: Components, row: int, num_new_tokens: int, lookahead: int) -> int:
    """Extend one row (a columnar step's item); returns the block positions added."""
    if not (type(num_new_tokens) is int and 0 < num_new_tokens <= MAX_COUNT):
        num_new_tokens = _count("num_new_tokens", num_new_tokens, 1)
    if not (type(lookahead) is int and 0 <= lookahead <= MAX_COUNT):
        lookahead = _count("lookahead", lookahead, 0)
    total = m.coord.num_tokens.item(row) + num_new_tokens + lookahead
    if total > m.config.max_seq_len:
        check_len(m, m.requests.ids[row] or "", total)
    return m.coord.grow_one(row, num_new_tokens, lookahead)


def extend_many(
    m: Components,
    request_ids: Sequence[str],
    num_new_tokens: int | Sequence[int],
    lookahead: int | Sequence[int],
) -> None:
    """Extend distinct requests at once (one decode step), all or nothing."""
    rows = rows_of(m, request_ids)
    n = rows.size
    seen = np.zeros(m.config.max_requests, dtype=bool)
    seen[rows] = True
    if int(seen.sum()) != n:
        raise InvalidArgument("extend_many needs distinct request ids", num_ids=n)
    new = _counts("num_new_tokens", num_new_tokens, n, 1)
    ahead = _counts("lookahead", lookahead, n, 0)
    total = m.coord.num_tokens[rows] + new + ahead
    if n and int(total.max()) > m.config.max_seq_len:
        i = int(total.argmax())
        check_len(m, request_ids[i], int(total[i]))
    m.coord.grow(rows, new, ahead, False)


def extend_handles(
    m: Components, handles: np.ndarray, new: np.ndarray | int, ahead: np.ndarray | int
) -> tuple[np.ndarray, np.ndarray] | None:
    """A decode step's fast path: extend live, distinct handles as one batch, as if one
    after another; (rows, blocks each added), or None (nothing changed) if any handle is
    not live, one repeats, or the batch does not fit item after item: the caller then
    runs the items one by one.

    Distinct rows: each writes its position into ``scratch``; a repeated row keeps only
    its last write, so an earlier position reads back something else.
    """
    core = native.core
    if core is not None and m.coord.plain:
        done = m.native_decode.extend(core, m, handles, new, ahead)
        if done is not False:  # False: a batch only the numpy plan below plans
            return done
    rows = m.requests.live_distinct_handles(handles)
    if rows is None:
        return None
    c = m.coord
    history = c.num_tokens[rows]
    length = history + new
    capacity = length + ahead if type(ahead) is not int or ahead else length
    if int(capacity.max()) > m.config.max_seq_len:
        return None
    try:
        return rows, c.grow_rows(rows, history, length, capacity, ahead, in_order=True)
    except KVCMError:
        return None


def live_distinct_rows(m: Components, handles: np.ndarray) -> np.ndarray | None:
    """The rows of ``handles`` if every one is live and no row repeats (a batch of a step's
    commits), else None: one C call (``live_rows``) with the core, the request table's
    ``handle_rows`` and ``distinct_rows`` without (some five numpy calls, 5 us of a 16-commit
    step)."""
    core = native.core
    if core is not None and m.coord.plain:
        decode = m.native_decode
        if core.live_rows(handles, decode.arrays(core, m), decode.rows):
            return decode.rows[: handles.size].copy()  # the decode batch's work array
        return None
    rows, live = m.requests.handle_rows(handles)
    return rows if live is None and m.requests.distinct_rows(rows) else None


def failing_extends(
    m: Components, handles: np.ndarray, new: np.ndarray | int, ahead: np.ndarray | int
) -> np.ndarray | None:
    """Indices of the items of a batch of extends that fail on their own: a handle that is
    not live, or a length past ``max_seq_len``. None when live items repeat a row (item
    after item, the second one sees the first one's length: no batch then).

    Example (max_seq_len 64): handles of rows at 10, 64 and 20 tokens, +1 each, and a
    freed request's handle: items 1 and 3 fail, so [1, 3].
    """
    rows, live = m.requests.handle_rows(handles)
    ok = np.ones(handles.size, dtype=bool) if live is None else live.copy()
    if not m.requests.distinct_rows(rows[ok]):
        return None
    total = m.coord.num_tokens[rows] + new + ahead
    ok &= total <= m.config.max_seq_len
    return np.flatnonzero(~ok)


# -- rewind and free -----------------------------------------------------------------------


def rewind_row(m: Components, row: int, num_tokens: int) -> None:
    """Drop a live row's last ``num_tokens`` tokens, its block keys and committed ids past
    the new length with them (undone by a transaction's undo)."""
    request_id = m.requests.ids[row]
    assert request_id is not None
    length = int(m.coord.num_tokens[row])
    num_tokens = _count("num_tokens", num_tokens, 1)
    if num_tokens >= length:
        raise InvalidArgument(
            f"request {request_id!r} has {length} tokens; rewind removes at most "
            f"{length - 1} (free the request to drop all)",
            request_id=request_id,
            num_tokens=num_tokens,
        )
    new_len = length - num_tokens
    writable = _writable_cached(m, request_id, row, new_len)
    prefix = m.requests.prefix[request_id]
    key = state_requests.check_rewind(m, row, prefix, new_len)
    m.coord.rewind(row, num_tokens)  # may still refuse (a window's released blocks)
    if key is not None:
        state_requests.apply_rewind(m, row, prefix.root, key)
    for pg, slots in writable.items():
        m.coord.cache.uncache(pg, slots)
    m.requests.cut(request_id, row, new_len, m.tokens_per_block)


def _writable_cached(
    m: Components, request_id: str, row: int, new_len: int
) -> dict[int, list[int]]:
    """Cached blocks a rewind to ``new_len`` would make the request write into again.

    Blocks from ``new_len // tokens_per_block`` on will be overwritten; one that another
    request shares cannot be (``RewindIntoSharedBlock``), one only this request holds is
    taken out of the cache. Returns those, per pool group.
    """
    c = m.coord
    tpb = m.tokens_per_block
    keep = -(-(new_len + int(c.lookahead[row])) // tpb)
    out: dict[int, list[int]] = {}
    for g in range(len(m.layout.layer_groups)):
        pg = c.group_pool[g]
        held = c.tables[g][row, new_len // tpb : keep]
        for slot in held[held > c.empty].tolist():
            if not c.cache.cached[pg][slot]:
                continue
            if c.refs[pg][slot] > 1:
                raise RewindIntoSharedBlock(
                    f"rewinding {request_id!r} to {new_len} tokens would overwrite a "
                    "block other requests share",
                    request_id=request_id,
                    num_tokens=new_len,
                )
            out.setdefault(pg, []).append(slot)
    return out


def free_row(m: Components, row: int) -> str:
    """Free a live row; returns its request id."""
    request_id = m.requests.ids[row]
    assert request_id is not None
    native_rows.release(m, row)
    state_requests.release(m, row)
    return m.requests.release(row)

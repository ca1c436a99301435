"""Request rows and handles: which page-table row a request id or handle names, and the
row-level edits every op is built from (claim, extend, rewind, free).

A live request owns one row of the page tables and a handle, ``serial << 32 | row`` (the
row's allocations so far: a handle of a freed request names nothing). The bookkeeping lives
on the manager (``_rows``, ``_ids``, ``_handle``, ...) so that a transaction can save and
restore it in one place (``kvcm.transactions``); these functions read and edit it.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import TYPE_CHECKING

import numpy as np
from pydantic import BaseModel

from kvcm_client.errors import (
    InvalidArgument,
    KVCMError,
    RequestSuspended,
    RewindIntoSharedBlock,
    SequenceTooLong,
    UnknownRequest,
)
from kvcm_client.models import RequestInfo

from . import native, native_rows, state_requests
from .counts import MAX_COUNT, _count, _counts

if TYPE_CHECKING:
    from .manager import KVCacheManager

#: Low 32 bits of a handle: the row.
ROW_MASK = 0xFFFFFFFF
#: Largest serial: a handle stays below 2**63 (int64). A row's serial wraps from it to 1
#: (after 2**31 - 1 allocations of that row, some days of a busy server's row 0).
MAX_SERIAL = 2**31 - 1


def row_of(m: KVCacheManager, request_id: str, suspended: bool = False) -> int:
    """The row of a live request; ``RequestSuspended`` for a suspended one unless
    ``suspended`` (what reads its bookkeeping, frees or resumes it)."""
    try:
        found = m._rows[request_id]
    except (KeyError, TypeError):
        raise _not_found(request_id) from None
    if not suspended and request_id in m._suspended:
        raise RequestSuspended(
            f"request {request_id!r} is suspended: resume it first", request_id=request_id
        )
    return found


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


def rows_of(m: KVCacheManager, request_ids: Sequence[str]) -> np.ndarray:
    """The rows of live, not suspended requests, in ``request_ids`` order."""
    # A str is a collection too: "ab" would be the requests "a" and "b".
    if isinstance(request_ids, str | bytes) or not isinstance(request_ids, Collection):
        raise InvalidArgument("request_ids must be a list of request ids", request_ids=None)
    rows = m._rows
    try:
        found = np.fromiter((rows[r] for r in request_ids), dtype=np.int64, count=len(request_ids))
    except (KeyError, TypeError):
        missing = next(r for r in request_ids if not isinstance(r, str) or r not in rows)
        raise _not_found(missing) from None
    if m._suspended:
        for r in request_ids:
            if r in m._suspended:
                raise RequestSuspended(f"request {r!r} is suspended: resume it first", request_id=r)
    return found


def handle_rows(m: KVCacheManager, handles: np.ndarray) -> tuple[np.ndarray, np.ndarray | None]:
    """Rows of int64 handles, and a mask of the live ones (None when all are live).

    Example: handle ``2 << 32 | 7`` is row 7 if row 7's request is its second allocation;
    after that request's free it names nothing (the row's next request has serial 3).
    """
    max_requests = m.config.max_requests
    rows = handles & ROW_MASK
    if handles.size and int(rows.max()) >= max_requests:
        inside = rows < max_requests
        rows = np.where(inside, rows, 0)
        live = inside & (m._handle[rows] == handles)
        return rows, live
    # Live handles are > 0 and a free row holds -1, whose row bits are past every row:
    # so a handle of 0 or below never matches.
    live = m._handle[rows] == handles
    return rows, (None if live.all() else live)


def claim(m: KVCacheManager, request_id: str) -> tuple[int, int]:
    """Give ``request_id`` the last free row (the one allocate grew) and a new handle for
    it; returns the row and the handle. Example: row 5's serial 3 gives handle ``4 << 32 |
    5``; its serial ``MAX_SERIAL`` gives ``1 << 32 | 5`` (it wraps, also in csrc/allocate.c)."""
    serial = m._serial.item(m._free_rows[-1]) % MAX_SERIAL + 1
    taken = m._free_rows.pop()
    m._rows[request_id] = taken
    m._ids[taken] = request_id
    m._serial[taken] = serial
    handle = (serial << 32) | taken
    m._handle[taken] = handle
    return taken, handle


def check_len(m: KVCacheManager, request_id: str, total: int) -> None:
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


def info(m: KVCacheManager, request_id: str, row: int) -> RequestInfo:
    """The request's ``RequestInfo``; a suspended one shows the handle it gets back."""
    c = m._coord
    n = c.num_tokens.item(row)  # .item: a Python int at half the cost of int(a[row])
    saved = m._suspended.get(request_id)
    return trusted_info(
        {
            "request_id": request_id,
            "row": row,
            "num_tokens": n,
            "capacity": n + c.lookahead.item(row),
            "num_committed": m._committed.item(row),
            "num_hit_tokens": m._hits.item(row),
            "handle": m._handle.item(row) if saved is None else saved.handle,
            "state_slot": m._state_slot.item(row),
        }
    )


def blocks_of(m: KVCacheManager, row: int) -> int:
    """Block positions a row holds, summed over layer groups (a loop, not a generator: a
    step calls it per allocate)."""
    total = 0
    for counts in m._coord.num_blocks:
        total += counts.item(row)
    return total


# -- extend --------------------------------------------------------------------------------


def extend_row(m: KVCacheManager, row: int, num_new_tokens: int, lookahead: int) -> int:
    """Extend one row (a columnar step's item); returns the block positions added."""
    if not (type(num_new_tokens) is int and 0 < num_new_tokens <= MAX_COUNT):
        num_new_tokens = _count("num_new_tokens", num_new_tokens, 1)
    if not (type(lookahead) is int and 0 <= lookahead <= MAX_COUNT):
        lookahead = _count("lookahead", lookahead, 0)
    total = m._coord.num_tokens.item(row) + num_new_tokens + lookahead
    if total > m.config.max_seq_len:
        check_len(m, m._ids[row] or "", total)
    return m._coord.grow_one(row, num_new_tokens, lookahead)


def extend_many(
    m: KVCacheManager,
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
    total = m._coord.num_tokens[rows] + new + ahead
    if n and int(total.max()) > m.config.max_seq_len:
        i = int(total.argmax())
        check_len(m, request_ids[i], int(total[i]))
    m._coord.grow(rows, new, ahead, False)


def extend_handles(
    m: KVCacheManager, handles: np.ndarray, new: np.ndarray | int, ahead: np.ndarray | int
) -> tuple[np.ndarray, np.ndarray] | None:
    """A decode step's fast path: extend live, distinct handles as one batch, as if one
    after another; (rows, blocks each added), or None (nothing changed) if any handle is
    not live, one repeats, or the batch does not fit item after item: the caller then
    runs the items one by one.

    Distinct rows: each writes its position into ``scratch``; a repeated row keeps only
    its last write, so an earlier position reads back something else.
    """
    core = native.core
    if core is not None and m._coord.plain:
        done = m._native_decode.extend(core, m, handles, new, ahead)
        if done is not False:  # False: a batch only the numpy plan below plans
            return done
    n = handles.size
    if n > m.config.max_requests:  # cannot all be distinct live rows
        return None
    rows = handles & ROW_MASK
    if int(rows.max()) >= m.config.max_requests:
        return None
    order = m._order[:n]
    scratch = m._scratch
    scratch[rows] = order
    if not ((scratch[rows] == order) & (m._handle[rows] == handles)).all():
        return None
    c = m._coord
    history = c.num_tokens[rows]
    length = history + new
    capacity = length + ahead if type(ahead) is not int or ahead else length
    if int(capacity.max()) > m.config.max_seq_len:
        return None
    try:
        return rows, c.grow_rows(rows, history, length, capacity, ahead, in_order=True)
    except KVCMError:
        return None


def distinct_rows(m: KVCacheManager, rows: np.ndarray) -> bool:
    """Whether no row is named twice: each row's cell of the scratch array gets the index of
    its last item, which is each item's own only if no row repeats (a sort, ``np.unique``,
    costs 5x more at 256 rows). Example: rows [4, 9, 4]: cells 4 and 9 get 2 and 1, and item
    0 reads 2: not distinct."""
    index = np.arange(rows.size)
    scratch = m._scratch
    scratch[rows] = index
    return bool((scratch[rows] == index).all())


def live_distinct_rows(m: KVCacheManager, handles: np.ndarray) -> np.ndarray | None:
    """The rows of ``handles`` if every one is live and no row repeats (a batch of a step's
    commits), else None: one C call (``live_rows``) with the core, ``handle_rows`` and
    ``distinct_rows`` without (some five numpy calls, 5 us of a 16-commit step)."""
    core = native.core
    if core is not None and m._coord.plain:
        decode = m._native_decode
        if core.live_rows(handles, decode.arrays(core, m), decode.rows):
            return decode.rows[: handles.size].copy()  # the decode batch's work array
        return None
    rows, live = handle_rows(m, handles)
    return rows if live is None and distinct_rows(m, rows) else None


def failing_extends(
    m: KVCacheManager, handles: np.ndarray, new: np.ndarray | int, ahead: np.ndarray | int
) -> np.ndarray | None:
    """Indices of the items of a batch of extends that fail on their own: a handle that is
    not live, or a length past ``max_seq_len``. None when live items repeat a row (item
    after item, the second one sees the first one's length: no batch then).

    Example (max_seq_len 64): handles of rows at 10, 64 and 20 tokens, +1 each, and a
    freed request's handle: items 1 and 3 fail, so [1, 3].
    """
    rows, live = handle_rows(m, handles)
    ok = np.ones(handles.size, dtype=bool) if live is None else live.copy()
    if not distinct_rows(m, rows[ok]):
        return None
    total = m._coord.num_tokens[rows] + new + ahead
    ok &= total <= m.config.max_seq_len
    return np.flatnonzero(~ok)


# -- rewind and free -----------------------------------------------------------------------


def rewind_row(m: KVCacheManager, row: int, num_tokens: int) -> None:
    """Drop a live row's last ``num_tokens`` tokens, its block keys and committed ids past
    the new length with them (undone by a transaction's undo)."""
    request_id = m._ids[row]
    assert request_id is not None
    length = int(m._coord.num_tokens[row])
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
    prefix = m._prefix[request_id]
    key = state_requests.check_rewind(m, row, prefix, new_len)
    m._coord.rewind(row, num_tokens)  # may still refuse (a window's released blocks)
    if key is not None:
        state_requests.apply_rewind(m, row, prefix.root, key)
    for pg, slots in writable.items():
        m._coord.cache.uncache(pg, slots)
    tpb = m.tokens_per_block
    state = m._prefix[request_id]
    dropped = state.keys[new_len // tpb :]
    del state.keys[new_len // tpb :]
    if m._undo is not None and dropped:
        m._undo.append(lambda: state.keys.extend(dropped))
    tokens = m._tokens[request_id]
    if len(tokens) > 4 * new_len:
        tail = tokens[4 * new_len :]
        del tokens[4 * new_len :]
        m._committed[row] = new_len
        if m._undo is not None:
            m._undo.append(lambda: tokens.extend(tail))


def _writable_cached(
    m: KVCacheManager, request_id: str, row: int, new_len: int
) -> dict[int, list[int]]:
    """Cached blocks a rewind to ``new_len`` would make the request write into again.

    Blocks from ``new_len // tokens_per_block`` on will be overwritten; one that another
    request shares cannot be (``RewindIntoSharedBlock``), one only this request holds is
    taken out of the cache. Returns those, per pool group.
    """
    c = m._coord
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


def free_row(m: KVCacheManager, row: int) -> str:
    """Free a live row; returns its request id."""
    request_id = m._ids[row]
    assert request_id is not None
    native_rows.release(m, row)
    state_requests.release(m, row)
    m._ids[row] = None
    m._handle[row] = -1
    del m._rows[request_id]
    del m._first[request_id]
    del m._tokens[request_id]
    del m._prefix[request_id]
    m._committed[row] = 0
    m._hits[row] = 0
    m._free_rows.append(row)
    return request_id

"""Committing computed tokens: the request's committed ids grow and the blocks they fill
are published for reuse (``kvcm.publish``; docs/prefix-reuse.md).

Committed ids are kept per request as int32 bytes (``_tokens``): a commit appends its
checked bytes, a rewind cuts them, and no Python int is made per token. Every commit is
atomic, and undone by a transaction's undo.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import TYPE_CHECKING

import numpy as np

from kvcm_client.errors import InvalidArgument
from kvcm_client.models import RequestInfo

from . import native, request_rows, state_requests
from .hashing import token_data
from .publish import PrefixState, publish

if TYPE_CHECKING:
    from .components import Components


def commit(m: Components, request_id: str, token_ids: Sequence[int]) -> RequestInfo:
    """Record that the KV of the request's next ``len(token_ids)`` tokens is computed.

    Committed tokens are a prefix of the request: a request of 10 tokens with 4 committed
    accepts at most 6 more. ``rewind`` drops committed tokens past the new length.
    Every block the committed prefix fills is keyed and published for reuse in each
    reusable layer group (a ``block_stored`` event), unless that key is cached already.
    Blocks holding the prompt's own tokens take the keys allocate computed for them
    (``commit_keys``); other blocks are hashed.
    """
    row = request_rows.row_of(m, request_id)
    commit_row(m, row, token_ids)
    return request_rows.info(m, request_id, row)


def commit_row(m: Components, row: int, token_ids: Sequence[int]) -> None:
    """``commit`` of a live row (a columnar step's item)."""
    request_id = m.requests.ids[row]
    assert request_id is not None
    data = token_data(token_ids)
    _check(m, request_id, row, len(data) // 4)
    _append(m, request_id, row, data)


def commit_batch(
    m: Components,
    rows: np.ndarray,
    token_ids: Sequence[Sequence[int]],
    item: Callable[[int, Callable[[], None]], object],
) -> bool:
    """A step's commits of distinct live rows as one batch, when every item passes its
    checks; False, with nothing changed, if one would not (the items then run one by one
    and each names its error). Items run in order, as ``commit_row`` of each would (no
    item's check depends on another's append), and stop where the step stops.

    Most of a decode step's commits add a token and fill no block: each run of those is
    appended here with no call per item. An item that fills a block (its committed tokens
    reach a block past its keys: exactly when ``publish`` has work) runs ``_append`` through
    ``item(index, fn)``, the step's item runner: a failed publish is that item's error, and
    an error that stops the step raises before any later item is applied.

    With the C core, and neither state layers nor an all-or-nothing step, the items run in
    C (``_batch_in_c``), publishing included.

    Example (tokens_per_block 4): requests at 5, 7 and 2 committed tokens commit one token
    each: the first is appended (6 tokens, block 1 not full), the second publishes block 1
    (8 tokens), then the third is appended.
    """
    core = native.core
    data = core.pack_token_lists(token_ids) if core is not None else None
    if data is None:  # no C core, or some list the Python checks must judge
        try:
            data = [token_data(t) for t in token_ids]
        except Exception:  # any error is that item's own: the items then run one by one
            return False
    if core is not None and m.state is None and m.requests.undo is None:
        return _batch_in_c(core, m, rows, data, item)
    tokens, ids, prefix = m.requests.tokens, m.requests.ids, m.requests.prefix
    rids = list(map(ids.__getitem__, rows.tolist()))
    held = list(map(tokens.__getitem__, rids))
    states = list(map(prefix.__getitem__, rids))
    n = len(held)
    total = np.fromiter(map(len, held), dtype=np.int64, count=n)
    total += np.fromiter(map(len, data), dtype=np.int64, count=n)
    if (total > 4 * m.coord.num_tokens[rows]).any():
        return False
    # With state layers (checkpoints) or inside an all-or-nothing step (undo actions), every
    # item takes the full path.
    if m.state is None and m.requests.undo is None:
        keyed = np.fromiter((len(st.keys) for st in states), dtype=np.int64, count=n)
        full = np.flatnonzero(total // (4 * m.tokens_per_block) > keyed).tolist()
    else:
        full = list(range(n))
    start = 0
    appended: list[int] = []  # their counts are written once, also when the step stops
    try:
        for i in [*full, n]:
            # the items before i fill no block: appended, nothing to publish
            for done, chunk in zip(held[start:i], data[start:i], strict=True):
                done += chunk
            appended.extend(range(start, i))
            if i < n:
                row, fn = int(rows[i]), _append
                item(i, functools.partial(fn, m, rids[i], row, data[i], held[i], states[i]))
            start = i + 1
    finally:
        if appended:
            done_items = np.array(appended, dtype=np.int64)
            m.requests.set_committed(rows[done_items], total[done_items] // 4)
    return True


def _batch_in_c(
    core: ModuleType,
    m: Components,
    rows: np.ndarray,
    data: list[bytes],
    item: Callable[[int, Callable[[], None]], object],
) -> bool:
    """``commit_batch`` by the C core's ``commit_run`` (docs/native.md): it runs the items in
    order, appending and publishing as ``_append`` does, and hands back the few it leaves
    to Python (a block to key with multimodal items), which run here
    through ``item`` before it goes on. An item that failed in C changed nothing and is
    reported through ``item`` too, so a stop still comes before any later item."""
    args = (
        m.requests.ids,
        m.requests.tokens,
        m.requests.prefix,
        m.requests.committed,
        m.native_decode.arrays(core, m),
    )
    cache = m.coord.cache
    n = len(data)
    i = 0
    while i < n:
        done = core.commit_run(rows, data, i, *args, cache)
        if done is None:  # an item that does not fit (only when starting at 0)
            return False
        if type(done) is tuple:
            i, exc = done
            item(i, functools.partial(_reraise, exc))
        elif done < n:
            i = done
            row = int(rows[i])
            rid = m.requests.ids[row]
            assert rid is not None
            item(i, functools.partial(_append, m, rid, row, data[i]))
        else:
            break
        i += 1
    return True


def _reraise(exc: BaseException) -> None:
    raise exc


def commit_many(
    m: Components, request_ids: Sequence[str], token_ids: Sequence[Sequence[int]]
) -> None:
    """Commit ``token_ids[i]`` to ``request_ids[i]`` (distinct requests: the end of one
    forward pass), all or nothing: every id, token list and length is checked before any
    request is committed, so a refused call changes nothing. Each commit is ``commit``'s.
    """
    rows = request_rows.rows_of(m, request_ids)
    n = rows.size
    if len(set(rows.tolist())) != n:
        raise InvalidArgument("commit_many needs distinct request ids", num_ids=n)
    if isinstance(token_ids, str | bytes) or not isinstance(token_ids, Sequence):
        raise InvalidArgument("token_ids must be a list of token id lists", token_ids=None)
    if len(token_ids) != n:
        raise InvalidArgument(
            f"commit_many got {n} request ids and {len(token_ids)} token id lists",
            num_ids=n,
            num_token_id_lists=len(token_ids),
        )
    checked = [token_data(t) for t in token_ids]
    ids = list(request_ids)
    for request_id, row, data in zip(ids, rows.tolist(), checked, strict=True):
        _check(m, request_id, row, len(data) // 4)
    for request_id, row, data in zip(ids, rows.tolist(), checked, strict=True):
        _append(m, request_id, row, data)


def committed_tokens(m: Components, request_id: str) -> list[int]:
    """The committed token ids of a request, in order (a copy)."""
    request_rows.row_of(m, request_id, suspended=True)
    return np.frombuffer(bytes(m.requests.tokens[request_id]), dtype="<i4").tolist()


def _check(m: Components, request_id: str, row: int, num_new: int) -> None:
    """Refuse committing ``num_new`` more tokens than the request has uncommitted."""
    done = len(m.requests.tokens[request_id]) // 4
    length = int(m.coord.num_tokens[row])
    if done + num_new > length:
        raise InvalidArgument(
            f"request {request_id!r} has {length} tokens and {done} committed; "
            f"{num_new} more do not fit",
            request_id=request_id,
            num_tokens=length,
            num_committed=done,
            num_new=num_new,
        )


def _append(
    m: Components,
    request_id: str,
    row: int,
    data: bytes,
    held: bytearray | None = None,
    state: PrefixState | None = None,
) -> None:
    """Append checked tokens (``data``: their int32 bytes) and publish the blocks they
    fill; a publish that raises changes nothing. (``held`` and ``state``: the request's
    committed bytes and prefix state, when the caller has them.)"""
    if held is None:
        held = m.requests.tokens[request_id]
    if state is None:
        state = m.requests.prefix[request_id]
    done = len(held) // 4
    have = len(state.keys)
    held += data
    try:
        publish(m.coord, state, row, held, done, data)
    except BaseException:  # a refused commit changes nothing
        del held[4 * done :]
        del state.keys[have:]
        raise
    m.requests.set_committed(row, len(held) // 4)
    state_requests.after_commit(m, row, state, done)
    if m.requests.undo is not None:
        m.requests.record(lambda: held.__delitem__(slice(4 * done, None)))
        m.requests.record(lambda: state.keys.__delitem__(slice(have, None)))

"""Committing computed tokens: the request's committed ids grow and the blocks they fill
are published for reuse (``kvcm.publish``; docs/prefix-reuse.md).

Committed ids are kept per request as int32 bytes (``_tokens``): a commit appends its
checked bytes, a rewind cuts them, and no Python int is made per token. Every commit is
atomic, and undone by a transaction's undo.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from kvcm_client.errors import InvalidArgument
from kvcm_client.models import RequestInfo

from . import request_rows, state_requests
from .hashing import token_data
from .publish import publish

if TYPE_CHECKING:
    from .manager import KVCacheManager


def commit(m: KVCacheManager, request_id: str, token_ids: Sequence[int]) -> RequestInfo:
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


def commit_row(m: KVCacheManager, row: int, token_ids: Sequence[int]) -> None:
    """``commit`` of a live row (a columnar step's item)."""
    request_id = m._ids[row]
    assert request_id is not None
    data = token_data(token_ids)
    _check(m, request_id, row, len(data) // 4)
    _append(m, request_id, row, data)


def commit_many(
    m: KVCacheManager, request_ids: Sequence[str], token_ids: Sequence[Sequence[int]]
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


def committed_tokens(m: KVCacheManager, request_id: str) -> list[int]:
    """The committed token ids of a request, in order (a copy)."""
    request_rows.row_of(m, request_id, suspended=True)
    return np.frombuffer(bytes(m._tokens[request_id]), dtype="<i4").tolist()


def _check(m: KVCacheManager, request_id: str, row: int, num_new: int) -> None:
    """Refuse committing ``num_new`` more tokens than the request has uncommitted."""
    done = len(m._tokens[request_id]) // 4
    length = int(m._coord.num_tokens[row])
    if done + num_new > length:
        raise InvalidArgument(
            f"request {request_id!r} has {length} tokens and {done} committed; "
            f"{num_new} more do not fit",
            request_id=request_id,
            num_tokens=length,
            num_committed=done,
            num_new=num_new,
        )


def _append(m: KVCacheManager, request_id: str, row: int, data: bytes) -> None:
    """Append checked tokens (``data``: their int32 bytes) and publish the blocks they
    fill; a publish that raises changes nothing."""
    held = m._tokens[request_id]
    done = len(held) // 4
    state = m._prefix[request_id]
    have = len(state.keys)
    held += data
    try:
        publish(m._coord, state, row, held, done, data)
    except BaseException:  # a refused commit changes nothing
        del held[4 * done :]
        del state.keys[have:]
        raise
    m._committed[row] = len(held) // 4
    state_requests.after_commit(m, row, state, done)
    if m._undo is not None:
        m._undo.append(lambda: held.__delitem__(slice(4 * done, None)))
        m._undo.append(lambda: state.keys.__delitem__(slice(have, None)))

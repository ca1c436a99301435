"""Starting a request (``KVCacheManager.allocate``): its arguments checked, its prefix hit
and new blocks (``kvcm.prefix_reuse``), its row and handle (``kvcm.request_rows``), and the
record that makes an identical retry return the first result.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvcm_client.errors import DuplicateRequest, InvalidArgument, RequestLimitReached
from kvcm_client.models import RequestInfo

from . import prefix_reuse, request_rows, state_requests
from .counts import _count
from .hashing import MultimodalItem, multimodal_items, root_key

if TYPE_CHECKING:
    from .manager import KVCacheManager

#: Longest request id: ids are echoed in results and kept per request.
MAX_REQUEST_ID = 256


@dataclass(frozen=True, slots=True)
class FirstAllocation:
    """What an allocate was called with and returned, so an identical retry returns it again."""

    args: tuple[Any, ...]
    result: RequestInfo


def allocate(
    m: KVCacheManager,
    request_id: str,
    num_tokens: int,
    token_ids: Sequence[int] | None,
    lookahead: int,
    lora_id: int | str | None,
    cache_salt: str | None,
    multimodal: Sequence[MultimodalItem | dict[str, Any]] | None,
    block_keys: Sequence[bytes | str] | None,
) -> RequestInfo:
    """``KVCacheManager.allocate`` (its docstring says what it does); raises before anything
    changes."""
    if not isinstance(request_id, str) or not 0 < len(request_id) <= MAX_REQUEST_ID:
        raise InvalidArgument(
            f"request_id must be a string of 1 to {MAX_REQUEST_ID} characters",
            request_id=None,
        )
    num_tokens = _count("num_tokens", num_tokens, 1)
    lookahead = _count("lookahead", lookahead, 0)
    tokens, data = prefix_reuse.read_prompt(m, token_ids, num_tokens)
    items = multimodal_items(multimodal)
    root = root_key(lora_id, cache_salt)
    # A retry is recognised by its prompt's int32 bytes (immutable: the caller's list,
    # which ``tokens`` may be, can change after the call).
    args = (num_tokens, lookahead, data, lora_id, cache_salt, items)
    first = m._first.get(request_id)
    if first is not None:
        if first.args == args:
            return first.result
        raise DuplicateRequest(
            f"request {request_id!r} is already allocated with other arguments "
            f"(num_tokens={first.args[0]}, lookahead={first.args[1]})",
            request_id=request_id,
            num_tokens=first.args[0],
            lookahead=first.args[1],
        )
    request_rows.check_len(m, request_id, num_tokens + lookahead)
    if not m._free_rows:
        raise RequestLimitReached(
            f"all {m.config.max_requests} page-table rows are in use",
            max_requests=m.config.max_requests,
        )
    state_requests.check_room(m, request_id)
    hit_tokens, state = prefix_reuse.reuse_prefix(
        m,
        m._free_rows[-1],
        num_tokens,
        lookahead,
        tokens,
        data,
        root,
        items,
        lora_id,
        cache_salt is not None,
        block_keys,
    )
    row = request_rows.claim(m, request_id)
    m._tokens[request_id] = bytearray(data[: 4 * hit_tokens])
    m._committed[row] = hit_tokens
    m._hits[row] = hit_tokens
    m._prefix[request_id] = state
    info = request_rows.info(m, request_id, row)
    m._first[request_id] = FirstAllocation(args, info)
    return info

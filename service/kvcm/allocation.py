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

# Longest request id: the wire models' schema publishes it (also in allocate.c).
from kvcm_client.specs import MAX_REQUEST_ID as MAX_REQUEST_ID

from . import native, native_rows, prefix_reuse, request_rows, state_requests
from .counts import _count
from .hashing import MultimodalItem, multimodal_items, root_key
from .publish import PrefixState

if TYPE_CHECKING:
    from .components import Components


#: The root key of requests without a LoRA or a salt: the C core keys only those.
_ROOT = root_key()


@dataclass(frozen=True, slots=True)
class FirstAllocation:
    """What an allocate was called with and gave its request, so that an identical retry
    returns the same result. The ``RequestInfo`` is built when asked for: a columnar step
    reads only the handle and the hit, and building the model was a sixth of an allocate.

    Example: ``FirstAllocation(args=(20, 2, b"", None, None, ()), request_id="a", row=3,
    handle=1 << 32 | 3, hit_tokens=0, state_slot=-1).result`` is request "a" in row 3 with
    20 tokens, capacity 22 (20 + lookahead 2) and nothing committed."""

    args: tuple[Any, ...]
    request_id: str
    row: int
    handle: int
    hit_tokens: int
    state_slot: int

    @property
    def num_tokens(self) -> int:
        """The length it allocated: ``num_tokens``, or with ``max_new_tokens`` (a seventh
        item of ``args``) the hit and at most that many tokens past it."""
        args = self.args
        return args[0] if len(args) == 6 else min(args[0], self.hit_tokens + args[6])

    @property
    def result(self) -> RequestInfo:
        num_tokens, lookahead = self.num_tokens, self.args[1]
        return request_rows.trusted_info(
            {
                "request_id": self.request_id,
                "row": self.row,
                "num_tokens": num_tokens,
                "capacity": num_tokens + lookahead,
                "num_committed": self.hit_tokens,
                "num_hit_tokens": self.hit_tokens,
                "handle": self.handle,
                "state_slot": self.state_slot,
            }
        )


def c_args(m: Components) -> tuple[Any, ...] | None:
    """What the C core's ``allocate_one`` takes besides the op and the manager; None where
    every allocate takes the Python path: no C core, context-parallel ranks, a host tier
    (whose onboarding and offloading are Python's) or state layers. Fixed for the manager's
    life (its arrays, queues and flags change in place), so made once."""
    core = native.core
    if core is None:
        return None
    decode = m.native_decode
    if decode.allocate_args is None:
        decode.allocate_args = _c_args(core, m) or ()
    return decode.allocate_args or None


def _c_args(core: Any, m: Components) -> tuple[Any, ...] | None:
    c = m.coord
    if not c.plain or m.host is not None or m.state is not None:
        return None
    decode = m.native_decode
    context, pools, sinks = decode.row_args(core, m)
    # Prompts: keyed with the SHA extensions (else hashlib, in Python, is as fast) and hit
    # where every layer group is full attention and reusable.
    prompts = decode.hits_in_c(m) and bool(core.HAVE_SHA_EXTENSIONS)
    classes = (PrefixState, FirstAllocation)
    return (
        c.cache,
        context,
        pools,
        sinks,
        decode.cached(m),
        classes,
        _ROOT,
        m.config.max_seq_len,
        prompts,
    )


def prompt_keys(
    m: Components, ops: list[dict[str, Any]], fast: tuple[Any, ...] | None
) -> list[Any] | None:
    """A step's prompts keyed two at a time in C (``prompt_keys``: two SHA-256 chains at
    once, 8.3 -> 5.8 us for two 512-token prompts on the development VM), per op its
    (bytes, keys) for ``start_op`` or None; None where fewer than two allocates have a
    prompt that ``allocate_one`` keys (each then keys its own)."""
    if fast is None or not fast[-1] or len(ops) < 2:
        return None
    if sum(op["token_ids"] is not None for op in ops) < 2:
        return None
    try:
        return native.core.prompt_keys(ops, _ROOT, m.coord.tokens_per_block)
    except Exception:  # (no memory): each op keys its own, its error that item's status
        return None


def start_op(
    m: Components, op: dict[str, Any], fast: tuple[Any, ...] | None, keyed: Any = None
) -> FirstAllocation:
    """``start`` of a step's allocate op (``kvcm.columnar_parse``'s dict, every field set):
    in C (``allocate_one``, with ``fast``: ``c_args``; ``keyed``: its prompt as
    ``prompt_keys`` keyed it) when the op is of the usual kind (an id, counts, maybe a
    prompt's ids; no LoRA, salt, multimodal items or given keys), not a retry, and fits;
    else in Python, which also names every error."""
    if fast is not None and op["max_new_tokens"] is None:
        done = native.core.allocate_one(op, m.requests, *fast, keyed)
        if done is not None:
            first, hit, added, evict = done
            c = m.coord
            if evict or c.edits is not None:  # (no host tier here: c_args)
                native_rows.placed(c, first.row, hit, added, evict)
            else:  # nothing to evict or log: placed's count only
                c.ops_since_take += 2 if hit else 1
            return first
    first = start(m, **op)
    if m.state is not None and m.host is not None:
        # The new request's live slot may be one a suspend of this step gave up: its zeroing
        # is made after that suspend's copy out, as ``KVCacheManager.allocate`` settles
        # (kvcm.suspension). Other managers' steps settle once, at their end.
        m.host.copier.finish()
        m.state.flush()
    return first


def start(
    m: Components,
    request_id: str,
    num_tokens: int,
    token_ids: Sequence[int] | None = None,
    lookahead: int = 0,
    lora_id: int | str | None = None,
    cache_salt: str | None = None,
    multimodal: Sequence[MultimodalItem | dict[str, Any]] | None = None,
    block_keys: Sequence[bytes | str] | None = None,
    max_new_tokens: int | None = None,
) -> FirstAllocation:
    """``KVCacheManager.allocate`` (its docstring says what it does), returning what its
    ``RequestInfo`` is built from (``.result``): the first allocation's record for a retry.
    Raises before anything changes."""
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
    # which ``tokens`` may be, can change after the call), and ``max_new_tokens`` if given.
    args: tuple[Any, ...] = (num_tokens, lookahead, data, lora_id, cache_salt, items)
    if max_new_tokens is not None:
        max_new_tokens = _count("max_new_tokens", max_new_tokens, 1)
        if tokens is None or block_keys is not None:
            raise InvalidArgument(
                "max_new_tokens sizes a request by its prompt's hit: it needs token_ids "
                "(and kvcm's own keys, not block_keys)"
            )
        args = (*args, max_new_tokens)
    first = m.requests.first.get(request_id)
    if first is not None:
        if first.args == args:
            return first
        raise DuplicateRequest(
            f"request {request_id!r} is already allocated with other arguments "
            f"(num_tokens={first.args[0]}, lookahead={first.args[1]})",
            request_id=request_id,
            num_tokens=first.args[0],
            lookahead=first.args[1],
        )
    row = m.requests.next_row()
    if row is None:
        raise RequestLimitReached(
            f"all {m.config.max_requests} page-table rows are in use",
            max_requests=m.config.max_requests,
        )
    state_requests.check_room(m, request_id)
    keys = None
    if max_new_tokens is not None:
        assert tokens is not None
        hit, keys = prefix_reuse.reusable(m, tokens, data, root, items)
        num_tokens = min(num_tokens, hit + max_new_tokens)
        tokens, data = tokens[:num_tokens], data[: 4 * num_tokens]
        keys = keys[: num_tokens // m.tokens_per_block]
    request_rows.check_len(m, request_id, num_tokens + lookahead)
    hit_tokens, state = prefix_reuse.reuse_prefix(
        m,
        row,
        num_tokens,
        lookahead,
        tokens,
        data,
        root,
        items,
        lora_id,
        cache_salt is not None,
        block_keys,
        keys,
    )
    row, handle = m.requests.claim(request_id)
    first = FirstAllocation(args, request_id, row, handle, hit_tokens, m.state_slot.item(row))
    m.requests.start(request_id, row, first, state, data[: 4 * hit_tokens], hit_tokens)
    return first

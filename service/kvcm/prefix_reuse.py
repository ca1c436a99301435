"""Prefix reuse when a request starts: the prompt's block keys, the longest cached prefix
every layer group can serve (onboarded from the host tier first), and the probes that ask
what a prompt would reuse without claiming anything (docs/prefix-reuse.md).

A prompt is checked for length before it is hashed (hashing is the costliest thing an
allocate or probe does), and caller-given ``block_keys`` save the hashing but not the check
of the ids.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from kvcm_client.errors import InvalidArgument, SequenceTooLong

from . import native_rows, state_requests
from .hashing import (
    KEY_BYTES,
    MultimodalItem,
    chain_keys,
    multimodal_items,
    root_key,
    token_bytes,
    token_ids_of,
)
from .host_tier import onboard_prefix, tier_hit
from .prefix_cache import find_hit, hit_cap
from .publish import PrefixState

if TYPE_CHECKING:
    from .components import Components


def read_prompt(
    m: Components, token_ids: Sequence[int] | None, num_tokens: int
) -> tuple[list[int] | None, bytes]:
    """An allocate's prompt as ints and int32 bytes ((None, b"") without one), checked, also
    when the caller gives its ``block_keys`` (they save the hashing, not the check of the
    ids: an id outside [0, 2**31) would make the request's later commits unhashable)."""
    if token_ids is None:
        return None, b""
    check_prompt(m, token_ids, num_tokens)
    if type(token_ids) is list:  # the caller's list as is: no int made per token
        return token_ids, token_bytes(token_ids)
    return token_ids_of(token_ids)


def reuse_prefix(
    m: Components,
    row: int,
    num_tokens: int,
    lookahead: int,
    tokens: list[int] | None,
    data: bytes,
    root: bytes,
    items: tuple[MultimodalItem, ...],
    lora_id: int | str | None,
    has_salt: bool,
    block_keys: Sequence[bytes | str] | None,
    hashed: list[bytes] | None = None,
) -> tuple[int, PrefixState]:
    """Give a new request's free ``row`` its blocks: the longest cached prefix of its prompt
    (none without ``tokens``), then new blocks for the rest and ``lookahead``. Returns the
    tokens reused and the request's prefix state; raises before anything changes.
    ``hashed``: the prompt's keys, hashed here already (``reusable``)."""
    keys: list[bytes] = []
    tpb = m.tokens_per_block
    c = m.coord
    if hashed is not None:
        keys = hashed
    elif tokens is not None:
        keys = _keys_of(m, tokens, data, root, items, block_keys)
    # Caller-given keys are checked past the hit, which only the Python path does.
    hit = (
        None
        if block_keys is not None
        else native_rows.start(m, row, root, keys, num_tokens, lookahead)
    )
    if hit is None:
        hit = _place_in_python(
            m, row, num_tokens, lookahead, keys, tokens, data, root, lora_id, has_salt, block_keys
        )
    hit_tokens = hit * tpb
    state_requests.start(m, row, root, keys, hit)
    if tokens is not None:
        stats = c.cache.stats
        stats.queries += 1
        stats.query_tokens += num_tokens
        stats.hit_tokens += hit_tokens
    # Only keys kvcm hashed itself are kept for commits. Caller-given keys are not, even
    # those that hit: a hit proves a key is cached, not that it is these tokens' key, and a
    # commit after a rewind below the hit would publish the request's own tokens under it.
    kept = keys if block_keys is None else []
    return hit_tokens, PrefixState(root, lora_id, has_salt, items, keys[:hit], data, kept)


def _place_in_python(
    m: Components,
    row: int,
    num_tokens: int,
    lookahead: int,
    keys: list[bytes],
    tokens: list[int] | None,
    data: bytes,
    root: bytes,
    lora_id: int | str | None,
    has_salt: bool,
    block_keys: Sequence[bytes | str] | None,
) -> int:
    """``native_rows.start``'s work where the C core leaves it (windows, a host tier, state
    layers, caller-given keys, no core): the hit found and placed by the coordinator, then
    the blocks past it. Returns the hit in blocks; raises before anything changes."""
    hit = 0
    tpb = m.tokens_per_block
    c = m.coord
    if tokens is not None:
        if block_keys is not None:  # (those of the hit are cached keys, so well formed)
            _check_key_sizes(keys)
        # Not inside an all-or-nothing step: onboarding writes pages into device slots,
        # and an undo would give those slots back to the cache entries they had.
        if m.host is not None and m.requests.undo is None:
            onboard_prefix(
                c,
                m.host,
                root,
                keys,
                _tier_hit(m, root, keys, hit_cap(len(keys), num_tokens, tpb)),
                num_tokens + lookahead,
                data,
                lora_id,
                has_salt,
                m.windows,
            )
        hit, hits, ends = state_requests.cut_to_checkpoint(
            m,
            root,
            keys,
            find_hit(c.cache, root, keys, num_tokens, tpb, m.windows),
            lambda n: find_hit(c.cache, root, keys, n, tpb, m.windows),
        )
    if hit:
        need, idle = c.hit_need(hits, num_tokens + lookahead)
        c.check_fits(need)
        c.place_hits(row, hits, idle, ends, hit * tpb)
    native_rows.grow(m, row, num_tokens - hit * tpb, lookahead)
    return hit


def reusable(
    m: Components,
    tokens: list[int],
    data: bytes,
    root: bytes,
    items: tuple[MultimodalItem, ...],
) -> tuple[int, list[bytes]]:
    """The tokens an allocate of this prompt would reuse now (the device's hit, or with a
    host tier what the two tiers serve together, each cut where state layers resume), and
    the prompt's keys: what ``allocate(..., max_new_tokens=k)`` sizes a request by, with
    no call of the scheduler's own (``probe``). Claims nothing.

    Example (tokens_per_block 4): 2 cached blocks of a 21-token prompt and k = 8: 8 tokens
    reused, so the request is allocated 8 + 8 = 16 tokens."""
    keys = chain_keys(root, data, m.tokens_per_block, 0, items)
    tpb = m.tokens_per_block
    cache = m.coord.cache

    def find(n: int) -> tuple[int, Any, Any]:
        return find_hit(cache, root, keys, n, tpb, m.windows, True)

    hit, _, _ = state_requests.cut_to_checkpoint(m, root, keys, find(len(tokens)), find)
    if m.host is not None and all(cache.reusable):
        hit = max(hit, _tier_hit(m, root, keys, hit_cap(len(keys), len(tokens), tpb)))
    return hit * tpb, keys


def probe(
    m: Components,
    token_ids: Sequence[int],
    lora_id: int | str | None = None,
    cache_salt: str | None = None,
    multimodal: Sequence[MultimodalItem | dict[str, Any]] | None = None,
    block_keys: Sequence[bytes | str] | None = None,
) -> int:
    """Tokens a new request with this prompt would reuse now; claims nothing."""
    check_prompt(m, token_ids, None)
    if block_keys is not None:
        # Only the prompt's length is used (a probe claims nothing), but it must have one.
        if isinstance(token_ids, str | bytes) or not isinstance(token_ids, Sequence | np.ndarray):
            raise InvalidArgument("token_ids must be a sequence of ints", token_ids=None)
        tokens, data = token_ids, b""  # type: ignore[assignment]
    else:
        tokens, data = token_ids_of(token_ids)
    if len(tokens) == 0:
        return 0
    root = root_key(lora_id, cache_salt)
    keys = _keys_of(m, tokens, data, root, multimodal_items(multimodal), block_keys)
    tpb = m.tokens_per_block

    def find(n: int) -> tuple[int, Any, Any]:
        return find_hit(m.coord.cache, root, keys, n, tpb, m.windows, True)

    hit, _, _ = state_requests.cut_to_checkpoint(m, root, keys, find(len(tokens)), find)
    return hit * tpb


def probe_tiers(
    m: Components,
    token_ids: Sequence[int],
    lora_id: int | str | None = None,
    cache_salt: str | None = None,
) -> tuple[int, int]:
    """(tokens a new request would reuse from the device now, tokens more it would
    onboard from the host tier): the longest hit the device serves (as ``probe``), and the
    longest whose needed blocks the device and the host hold together (a window needs only
    its sinks and last blocks); claims nothing."""
    check_prompt(m, token_ids, None)
    tokens, data = token_ids_of(token_ids)
    root = root_key(lora_id, cache_salt)
    keys = chain_keys(root, data, m.tokens_per_block, 0, ())
    cache = m.coord.cache
    tpb = m.tokens_per_block
    cap = hit_cap(len(keys), len(tokens), tpb)
    if cap <= 0 or not all(cache.reusable):
        return 0, 0

    def find(n: int) -> tuple[int, Any, Any]:
        return find_hit(cache, root, keys, n, tpb, m.windows, True)

    device, _, _ = state_requests.cut_to_checkpoint(m, root, keys, find(len(tokens)), find)
    both = 0 if m.host is None else _tier_hit(m, root, keys, cap)
    return device * tpb, max(both - device, 0) * tpb


def _tier_hit(m: Components, root: bytes, keys: list[bytes], cap: int) -> int:
    """The longest hit of at most ``cap`` blocks that the device and the host tier serve
    together (``tier_hit``), cut where state layers can resume (as ``cut_to_checkpoint``
    cuts a device hit): nothing past it is worth a copy in, and an allocate checks its fit
    with the hit it will place. Example: stride 8, checkpoints at block 8; the tiers hold
    blocks 0-4: ``tier_hit`` gives 5, the cut 0 (no checkpoint below 5)."""
    host = m.host
    assert host is not None
    c = m.coord
    tpb = m.tokens_per_block
    b = tier_hit(c.cache, host, root, keys, cap, tpb, m.windows)
    while b and (cut := state_requests.checkpointed_hit(m, root, keys, b)) < b:
        b = tier_hit(c.cache, host, root, keys, cut, tpb, m.windows)
    return b


def check_prompt(m: Components, token_ids: Any, num_tokens: int | None) -> None:
    """Refuse a prompt of the wrong length before any work on it (hashing a prompt is the
    costliest thing an allocate or probe does): ``num_tokens`` ids, or at most
    ``max_seq_len`` for a probe (a longer one can never be a request)."""
    if type(token_ids) is not list and (  # a list, the usual case, is checked first
        not isinstance(token_ids, Sequence | np.ndarray) or isinstance(token_ids, str | bytes)
    ):
        raise InvalidArgument("token_ids must be a sequence of ints", token_ids=None)
    n = len(token_ids)
    if num_tokens is not None and n != num_tokens:
        raise InvalidArgument(
            f"token_ids has {n} ids for num_tokens={num_tokens}",
            num_tokens=num_tokens,
            num_token_ids=n,
        )
    if n > m.config.max_seq_len:
        raise SequenceTooLong(
            f"a prompt of {n} tokens is past max_seq_len={m.config.max_seq_len}",
            num_tokens=n,
            max_seq_len=m.config.max_seq_len,
        )


def _keys_of(
    m: Components,
    tokens: list[int],
    data: bytes,
    root: bytes,
    items: tuple[MultimodalItem, ...],
    given: Sequence[bytes | str] | None,
) -> list[bytes]:
    """The prompt's block keys: ``given`` (checked for shape), or hashed from ``data``."""
    full = len(tokens) // m.tokens_per_block
    if given is None:
        return chain_keys(root, data, m.tokens_per_block, 0, items)
    if isinstance(given, str | bytes) or not isinstance(given, Sequence):
        raise InvalidArgument("block_keys must be a list of keys", block_keys=None)
    # Only the count is checked here: a malformed key is in no index, so it can never hit;
    # reuse_prefix names one past the hit as the client's error. Hex strings (the wire form)
    # and other bytes types are converted, so the keys the request keeps are plain bytes.
    keys = given if type(given) is list else list(given)
    if any(type(k) is not bytes for k in keys):  # hex strings, bytes subclasses, views
        try:
            keys = [bytes.fromhex(k) if isinstance(k, str) else bytes(k) for k in keys]
        except (TypeError, ValueError):
            raise InvalidArgument("block_keys must be 32-byte keys (bytes or hex)") from None
    if len(keys) != full:
        raise InvalidArgument(
            f"block_keys must be the {full} keys of the full blocks of token_ids",
            num_keys=len(keys),
        )
    if len(set(keys)) != len(keys):
        # A prompt's keys chain through their parents, so they never repeat; repeated ones
        # would place one cached block at several positions of the request.
        raise InvalidArgument("block_keys repeat a key: they must be distinct")
    return keys


def _check_key_sizes(keys: list[bytes]) -> None:
    """Refuse caller-given keys that are not 32 bytes (those past the hit: the hit's are
    cached keys already). A malformed key could never hit, but it is a client's bug worth
    naming."""
    try:
        sizes = set(map(len, keys))
    except TypeError:
        sizes = {0}
    if sizes - {KEY_BYTES}:
        raise InvalidArgument("block_keys must be 32-byte keys (bytes or hex)")

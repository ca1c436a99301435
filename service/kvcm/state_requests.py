"""What requests do to their state slots (docs/state-layers.md): a new request takes a live
slot (``OutOfBlocks`` when none is free) and gives it back when it is freed; a prefix hit
lands only where every state group has a checkpoint and restores it; a commit that ends on a
checkpoint boundary saves one; a rewind below the committed length goes back to a checkpoint
or is refused (``StateNotRewindable``), since a recurrent state cannot undo tokens.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from kvcm_client.errors import InvalidArgument, OutOfBlocks, StateNotRewindable

from .publish import PrefixState

if TYPE_CHECKING:
    from .components import Components


def checkpointed_hit(m: Components, root: bytes, keys: list[bytes], hit: int) -> int:
    """The longest hit of at most ``hit`` blocks at which every state group has a checkpoint
    (a multiple of the stride); ``hit`` itself without state layers. Example: stride 2,
    a hit of 5 blocks, checkpoints keyed by blocks 1 and 3: 4."""
    st = m.state
    if st is None or not hit:
        return hit
    if not st.restorable():
        return 0
    b = hit - hit % st.stride
    while b and not st.has(root, keys[b - 1]):
        b -= st.stride
    return b


def cut_to_checkpoint(
    m: Components,
    root: bytes,
    keys: list[bytes],
    found: tuple[int, Any, Any],
    find: Callable[[int], tuple[int, Any, Any]],
) -> tuple[int, Any, Any]:
    """``find_hit``'s result ``found`` cut to a hit state layers can resume at: ``find(n)``
    runs ``find_hit`` again for a prompt of ``n`` tokens (a window may cut that hit further,
    to one that needs a checkpoint of its own). Without state layers, ``found`` itself."""
    while found[0] and (b := checkpointed_hit(m, root, keys, found[0])) < found[0]:
        found = find(b * m.tokens_per_block + 1)
    return found


def check_room(m: Components, request_id: str) -> None:
    """``OutOfBlocks`` when no live state slot is free (what an allocate or a resume of
    ``request_id`` needs first); nothing to check without state layers."""
    st = m.state
    if st is not None and not st.num_free_live:
        raise OutOfBlocks(
            f"request {request_id!r} needs a live state slot and all {st.live} are taken "
            "(state_live_slots)",
            request_id=request_id,
            state_live_slots=st.live,
            free=0,
        )


def start(m: Components, row: int, root: bytes, keys: list[bytes], hit: int) -> None:
    """A new request in ``row`` with a hit of ``hit`` blocks takes a live slot (``check_room``
    said one is free): its state starts from zeros, or from the checkpoint at the hit."""
    st = m.state
    if st is None:
        return
    slot = st.take(row)
    if hit:
        st.restore(slot, root, keys[hit - 1])
    else:
        st.start(slot)


def release(m: Components, row: int) -> None:
    """The request in ``row`` is freed: its live slot is free again."""
    if m.state is not None:
        m.state.release(row)


def after_commit(m: Components, row: int, prefix: PrefixState, before: int) -> None:
    """Save a checkpoint if the commit took the committed length from ``before`` to a
    multiple of the stride (in tokens: stride x tokens_per_block). Example: tpb 4, stride 2:
    a commit from 6 to 8 tokens saves one keyed by block 1; one from 8 to 10 does not."""
    st = m.state
    if st is None:
        return
    length = int(m.requests.committed[row])
    every = st.stride * m.tokens_per_block
    if length > before and length % every == 0:
        st.save(int(st.slot_of[row]), prefix.root, prefix.keys[length // m.tokens_per_block - 1])


def check_rewind(m: Components, row: int, prefix: PrefixState, new_len: int) -> bytes | None:
    """The checkpoint key a rewind to ``new_len`` must restore (None: the state stays),
    or ``StateNotRewindable`` below the committed length without a checkpoint of exactly
    that prefix; changes nothing (``apply_rewind`` does, once the rewind can no longer
    fail)."""
    st = m.state
    committed = int(m.requests.committed[row])
    if st is None or new_len >= committed:
        return None
    tpb = m.tokens_per_block
    # new_len >= 1: a rewind keeps at least one token.
    key = prefix.keys[new_len // tpb - 1] if new_len >= tpb else None
    if new_len % (st.stride * tpb) or key is None or not st.has(prefix.root, key):
        raise StateNotRewindable(
            f"request {m.requests.ids[row]!r} has {committed} committed tokens and its state has "
            f"no checkpoint at {new_len}: a rewind below the committed length must end at a "
            "checkpoint",
            request_id=m.requests.ids[row],
            num_committed=committed,
            num_tokens=new_len,
        )
    if m.requests.undo is not None:
        raise InvalidArgument(
            "a rewind that restores state cannot run inside an all-or-nothing step "
            "(its copy cannot be undone)",
            request_id=m.requests.ids[row],
        )
    return key


def apply_rewind(m: Components, row: int, root: bytes, key: bytes) -> None:
    """Restore the checkpoint ``check_rewind`` found into the row's live state."""
    st = m.state
    assert st is not None
    st.restore(int(st.slot_of[row]), root, key)

"""Suspending a request to the host tier and resuming it (docs/host-tier.md).

A suspend moves a request's blocks to host slots and frees their device slots, and with state
layers its live state to a host state slot, freeing its live slot (docs/state-layers.md); the
request keeps its id, row, length, committed tokens and keys, but its handle names nothing
until a resume brings the blocks back into new device slots and the state into a new live
slot. Both copy pages, so neither can run inside an all-or-nothing step (an undo cannot take a
copy back).

The state's copies go through the host tier's copier, batched and ordered with the blocks'.
State copies the op queued before them are made first (a rewind's restore into the slot a
suspend copies out, a commit's checkpoint of a slot a free gave up and a resume copies into):
``StatePools.flush``. Those queued after them (a new request's zeroing of the slot a suspend
gave up) are made when the op settles, after the tier's copies have completed
(``kvcm.manager._settle``; an allocate settles itself, also inside a step:
``kvcm.allocation.start_op``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from kvcm_client.errors import InvalidArgument, OutOfBlocks
from kvcm_client.models import RequestInfo

from . import request_rows, state_requests
from .request_table import Suspended

if TYPE_CHECKING:
    from .components import Components


def suspend(m: Components, request_id: str) -> RequestInfo:
    """Move a request's blocks to the host tier and free their device slots; it keeps
    its id, row, length, committed tokens and keys, and answers ``request_suspended`` to
    every op but ``request``, ``committed_tokens``, ``free`` and ``resume`` (its handle
    names nothing until it is resumed). ``OutOfBlocks`` (detail ``tier="host"``) when
    the host tier cannot hold them even after dropping its cached blocks; nothing
    changes then (docs/host-tier.md). With state layers its live state goes to a host state
    slot and its live slot is freed (``OutOfBlocks`` too when no host state slot is free)."""
    row = request_rows.row_of(m, request_id)
    suspend_row(m, row)
    return request_rows.info(m, request_id, row)


def suspend_row(m: Components, row: int) -> None:
    """``suspend`` of a live row (a columnar step's item)."""
    request_id = m.requests.ids[row]
    assert request_id is not None
    host = m.host
    if host is None:
        raise InvalidArgument("suspend needs a host tier (host_memory_bytes)")
    if m.requests.undo is not None:
        raise InvalidArgument("suspend and resume cannot run inside an all-or-nothing step")
    c = m.coord
    blocks = []
    need: dict[int, int] = {}
    for g in range(len(m.layout.layer_groups)):
        seg = c.tables[g][row, : int(c.num_blocks[g][row])]
        positions = np.flatnonzero(seg > c.empty)
        blocks.append((positions, seg[positions].tolist()))
        pg = c.group_pool[g]
        need[pg] = need.get(pg, 0) + positions.size
    for pg, n in need.items():
        if n > host.room(pg):
            raise OutOfBlocks(
                f"the host tier of pool group {pg} has room for {host.room(pg)} of the "
                f"{n} blocks to suspend",
                pool_group=pg,
                needed=n,
                free=host.room(pg),
                tier="host",
            )
    st = m.state
    if st is not None and not host.state_free:
        raise OutOfBlocks(
            f"the host tier's {host.state_slots} state slots hold suspended requests' states "
            "already",
            state_slots=host.state_slots,
            free=0,
            tier="host",
        )
    saved = []
    published = []
    for g, (positions, slots) in enumerate(blocks):
        pg = c.group_pool[g]
        keys = c.cache.slot_key[pg]
        published.append(
            {i: keys[s][1:] for i, s in enumerate(slots) if s in keys and keys[s][0] == g}
        )
        saved.append((positions, host.hold(pg, slots) if slots else []))
        if slots:
            c.unref(pg, np.array(slots[::-1], dtype=np.int64))  # tail first, as a free
            c.set_cells(g, row, positions, None)
    state = -1
    if st is not None:
        st.flush()  # the op's queued state copies first: they may write this slot
        state = host.hold_state(st.release(row))
    m.requests.suspend(row, Suspended(saved, published, int(m.requests.handle[row]), state))


def resume(m: Components, request_id: str) -> RequestInfo:
    """Bring a suspended request's blocks back and rewrite its table row, and its state
    into a new live slot (docs/state-layers.md); ``OutOfBlocks`` when the device has too
    few free slots or no free live state slot, and nothing changes. The request has its
    handle back.

    A block that was published and is still cached on the device is taken back where it
    is (no copy; shared if other requests hold it); the others get new slots and their
    pages from the host. Example (tokens_per_block 4): a 9-token request with 8 committed
    tokens is suspended; its two full blocks stay cached in slots 5 and 6. If nothing
    evicted them, the resume takes 5 and 6 again and copies only the partial third block.
    """
    row = request_rows.row_of(m, request_id, suspended=True)
    saved = m.requests.suspended.get(request_id)
    if saved is None:
        raise InvalidArgument(f"request {request_id!r} is not suspended", request_id=request_id)
    if m.requests.undo is not None:
        raise InvalidArgument("suspend and resume cannot run inside an all-or-nothing step")
    host = m.host
    assert host is not None
    c = m.coord
    # Per layer group: the device slot of each block still cached there (-1: copy it).
    found = []
    need = [0] * len(c.pools)
    for g, (positions, _) in enumerate(saved.blocks):
        pg = c.group_pool[g]
        at = np.full(positions.size, -1, dtype=np.int64)
        for i, (root, key) in saved.published[g].items():
            at[i] = c.cache.scope(g, root).get(key, -1)
        found.append(at)
        # An idle cached slot leaves the free queue too; a shared one does not.
        need[pg] += positions.size - int((c.refs[pg][at[at >= 0]] > 0).sum())
    c.check_fits(need)
    state_requests.check_room(m, request_id)
    for g, at in enumerate(found):  # first, so that the slots taken below cannot evict them
        pg = c.group_pool[g]
        back = at[at >= 0]
        c.pools[pg].claim(back[c.refs[pg][back] == 0])
        c.refs[pg][back] += 1
    for g, ((positions, host_slots), at) in enumerate(zip(saved.blocks, found, strict=True)):
        if not host_slots:
            continue
        pg = c.group_pool[g]
        copy = np.flatnonzero(at < 0)
        host.discard(pg, [host_slots[i] for i in np.flatnonzero(at >= 0).tolist()])
        if copy.size:
            slots = c.take(pg, copy.size)
            host.give_back(pg, [host_slots[i] for i in copy.tolist()], slots.tolist())
            at[copy] = slots
        c.set_cells(g, row, positions, at)
    c.ops_since_take += 1
    st = m.state
    if st is not None:
        st.flush()  # the op's queued state copies first: they may involve the new slot
        host.give_back_state(saved.state, st.take(row))
    m.requests.resume(request_id, row)
    return request_rows.info(m, request_id, row)


def free_suspended(m: Components, handle: int) -> str:
    """Free the suspended request that had ``handle`` (a step's ``free`` names it so, as a
    ``resume`` does): its host copies and its row; returns its id."""
    request_id = m.requests.suspended_handles[handle]
    row = m.requests.rows[request_id]
    discard(m, request_id)
    return request_rows.free_row(m, row)


def discard(m: Components, request_id: str) -> None:
    """Drop a request's host copies if it is suspended (it is being freed)."""
    saved = m.requests.drop_suspended(request_id)
    if saved is None:
        return
    assert m.host is not None
    for g, (_, host_slots) in enumerate(saved.blocks):
        m.host.discard(m.coord.group_pool[g], host_slots)
    if saved.state >= 0:
        m.host.discard_state(saved.state)

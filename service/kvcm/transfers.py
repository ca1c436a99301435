"""KV moves between sidecars: hand-offs out of this manager, pulls into it
(docs/disaggregation.md).

The flow of a disaggregated request, prefill sidecar P and decode sidecar D:

1. P's scheduler commits the prompt and calls ``hand_off(rid, deadline_s)``: P pins the
   request (no op reaches it, ``kv_in_flight``) and answers a ``KVExport``: its committed
   tokens, the slot of every block position, the registered regions, its scope digest, its
   layout facts and a one-time ``notify`` message.
2. D's scheduler calls ``pull(rid, export)``: D checks the layout and the scope before
   anything changes, allocates the request with the export's tokens (so the blocks D already
   caches are hits, not transfers), and posts one READ per memory kind with one descriptor
   per missing (block, pool): a slot of every pool of the block's pool group. The request is
   held (``pulling``) meanwhile.
3. ``poll`` (each step while a move runs; the service's loop) finds the READ done: D commits
   the export's tokens, which publishes the full blocks (``block_stored`` events), gives the
   request its handle back (``ready``) and sends P the ``notify`` message; P frees its
   request (its blocks stay cached, as any free leaves them).

What cannot happen: a block half written is never published (D commits only after the READ
completes; a failed pull frees its blocks uncommitted), a block is never read after P reused
it (P unpins on the message or at the deadline only; a scheduler's ``free`` of a handed-off
request waits for the same), and D never returns a block that a READ may still write (a
cancelled READ NIXL cannot abort keeps its blocks until NIXL says it ended).

Example (tokens_per_block 4): P hands off 10 committed tokens in blocks [7, 3, 9] of its one
group; D caches the first 4 tokens already, so ``pull`` allocates 10 tokens with a hit of 4,
D's blocks [2, 5, 6], and reads P's slots 3 and 9 into D's 5 and 6 in every pool of the
group: 2 descriptors per pool.
"""

from __future__ import annotations

import hashlib
import secrets
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from kvcm_client.errors import (
    DuplicateRequest,
    InvalidArgument,
    KVCMError,
    LayoutMismatch,
    OutOfBlocks,
    RequestLimitReached,
    ScopeMismatch,
    TransferFailed,
    TransferUnavailable,
    UnknownPeer,
    UnknownRequest,
)
from kvcm_client.transfer import KVExport, PullState, TransferRegion

from . import allocation, commits, prefix_reuse, request_rows
from .hashing import root_key
from .transfer_engine import NixlEngine, Xfer, memory_kind
from .transfer_state import Lent, Pull, Transfers

if TYPE_CHECKING:
    from .components import Components


#: Most bytes one posted READ moves. Where UCX copies inside the post (``cma`` between
#: processes of one host, about 3 GB/s here), a post holds the sidecar's loop while it
#: copies: a 4 GiB pull posted whole stalled it 1.3 s (bench/bench_transfer.py). In pieces,
#: each posted when the one before ended (``poll``), a post holds it about 20 ms; over RDMA,
#: where a post returns at once, a piece costs a poll interval.
PIECE_BYTES = 64 << 20


@dataclass(frozen=True, slots=True)
class Piece:
    """One READ to post: (address, bytes) rows here and at the peer, and each side's memory
    (kind, device)."""

    local: np.ndarray
    remote: np.ndarray
    local_memory: tuple[str, int]
    remote_memory: tuple[str, int]

    @property
    def nbytes(self) -> int:
        return int(self.local[:, 1].sum())


def _pieces(groups: dict[tuple[str, int, str, int], list[tuple[int, int, int]]]) -> list[Piece]:
    """The READs of a pull: per memory kind, descriptors in runs of at most ``PIECE_BYTES``
    (one descriptor larger than that is a piece of its own). Example: 80 blocks of 2 MiB of
    one kind make pieces of 32, 32 and 16 descriptors."""
    out = []
    for (kind, device, remote_kind, remote_device), rows in groups.items():
        table = np.asarray(rows, dtype=np.int64)
        ends = np.cumsum(table[:, 2])
        start = 0
        while start < len(table):
            base = ends[start - 1] if start else 0
            stop = max(start + 1, int(np.searchsorted(ends, base + PIECE_BYTES, side="right")))
            part = table[start:stop]
            out.append(
                Piece(
                    part[:, [0, 2]], part[:, [1, 2]], (kind, device), (remote_kind, remote_device)
                )
            )
            start = stop
    return out


def _post(t: Transfers, peer: str, piece: Piece) -> Xfer:
    return t.engine.read(peer, piece.local, piece.remote, piece.local_memory, piece.remote_memory)


def scope_digest(root: bytes) -> str:
    """The scope of a request on the wire: a digest of its root key (LoRA and cache salt),
    so a salt never leaves the sidecar."""
    return hashlib.blake2b(root, digest_size=16).hexdigest()


# -- building the endpoint ---------------------------------------------------------------------


def layout_facts(m: Components) -> dict[str, Any]:
    """What two sidecars' layouts must share for a block to move as it is: the block size,
    every layer's spec (heads after the TP split, dtype, window), the layer groups, and each
    pool's slot bytes (which fixes the order of the buffers in a slot)."""
    layout = m.layout
    return {
        "tokens_per_block": layout.tokens_per_block,
        "layers": {
            str(int(lid)): spec.model_dump(mode="json", exclude={"layer_id"})
            for lid, spec in sorted(layout.layers.items())
        },
        "layer_groups": [[int(s.layer_id) for s in g.layers] for g in layout.layer_groups],
        "pools": [[int(p.pool_group), p.slot_bytes] for p in layout.pools],
        "state_layers": [s.model_dump(mode="json") for s in m.config.state_layers],
    }


def layout_differences(here: dict[str, Any], there: dict[str, Any]) -> list[str]:
    """Each fact that differs, in words. Example: ``["tokens_per_block: 16 here, 32 at the
    peer", "layer 3 num_kv_heads: 8 here, 4 at the peer"]``."""
    out: list[str] = []
    for key in ("tokens_per_block", "layer_groups", "pools", "state_layers"):
        if here.get(key) != there.get(key):
            out.append(f"{key}: {here.get(key)} here, {there.get(key)} at the peer")
    mine, theirs = here.get("layers", {}), there.get("layers", {})
    for lid in sorted(set(mine) | set(theirs), key=int):
        a, b = mine.get(lid), theirs.get(lid)
        if a is None or b is None:
            out.append(
                f"layer {lid}: {'absent' if a is None else 'present'} here, "
                f"{'absent' if b is None else 'present'} at the peer"
            )
            continue
        for name in sorted(set(a) | set(b)):
            if a.get(name) != b.get(name):
                out.append(f"layer {lid} {name}: {a.get(name)} here, {b.get(name)} at the peer")
    return out


def build(m: Components) -> Transfers:
    """The endpoint of a manager whose config asks for one: a NIXL agent named
    ``<transfer_name>-<generation>`` over the pools, the host tier and the state slots."""
    config = m.config
    if len(m.ranks) > 1 or config.context_parallel > 1:
        raise TransferUnavailable(
            "KV transfer supports one rank for now (ranks and context parallelism: not yet)",
            backend="nixl",
        )
    tensors = list(m.memory.tensors)
    regions = [
        _region(int(pool.pool_id), int(pool.pool_group), tensor)
        for pool, tensor in zip(m.layout.pools, m.memory.tensors, strict=True)
    ]
    state_regions = [_region(g, 0, t) for g, t in enumerate(m.state.memory)] if m.state else []
    if m.host is not None:
        tensors += m.host.tensors()
    if m.state is not None:
        tensors += list(m.state.memory)
    engine = NixlEngine(f"{config.transfer_name}-{m.generation}", tensors)
    return Transfers(engine, regions, state_regions, layout_facts(m))


def _region(pool: int, pool_group: int, tensor: torch.Tensor) -> TransferRegion:
    """A ``[slots, slot_bytes]`` uint8 tensor as a ``TransferRegion``."""
    kind, device = memory_kind(tensor)
    return TransferRegion(
        pool=pool,
        pool_group=pool_group,
        address=tensor.data_ptr(),
        slot_bytes=int(tensor.shape[1]),
        num_slots=int(tensor.shape[0]),
        memory=kind,  # type: ignore[arg-type]
        device_id=device,
    )


def endpoint(m: Components) -> Transfers:
    if m.transfers is None:
        raise TransferUnavailable(
            "this manager has no transfer endpoint: start it with transfer='nixl' "
            "(kvcm serve --transfer nixl)",
            backend=None,
        )
    return m.transfers


# -- the prefill side --------------------------------------------------------------------------


def hand_off(m: Components, request_id: str, deadline_s: float) -> KVExport:
    """Pin a request's committed blocks for a peer's pull and describe them (module
    docstring, step 1). Its blocks past the committed tokens are not listed; the request
    takes no op until the peer's pull ends or ``deadline_s`` passes, then it is freed (its
    full blocks stay cached, as any free leaves them)."""
    t = endpoint(m)
    if not 0 < deadline_s <= 3600:
        raise InvalidArgument("deadline_s must be in (0, 3600]", deadline_s=deadline_s)
    if m.requests.undo is not None:
        raise InvalidArgument("hand_off cannot run inside a transaction")
    row = request_rows.row_of(m, request_id)
    tokens = commits.committed_tokens(m, request_id)
    if not tokens:
        raise InvalidArgument(
            f"request {request_id[:64]!r} has no committed tokens: nothing to hand off",
            request_id=request_id[:64],
        )
    tpb = m.tokens_per_block
    used = -(-len(tokens) // tpb)
    export = KVExport(
        agent=t.engine.name,
        generation=m.generation,
        request_id=request_id,
        token_ids=tokens,
        scope=scope_digest(m.requests.prefix[request_id].root),
        layout=t.layout,
        blocks=[m.coord.block_list(g.group_id, row)[:used] for g in m.layout.layer_groups],
        regions=t.regions,
        deadline=time.time() + deadline_s,
        notify=secrets.token_hex(16),
        state_slot=m.state_slot.item(row),
        state_regions=t.state_regions,
    )
    m.requests.hold(row)
    t.lend(request_id, Lent(row, export, t.clock() + deadline_s))
    return export


def export_of(m: Components, request_id: str, scope: str) -> KVExport:
    """The export of a handed-off request, for a puller of scope ``scope`` only."""
    t = endpoint(m)
    lent = t.lent.get(request_id)
    if lent is None:
        shown = request_id[:64]
        raise UnknownRequest(f"no handed-off request {shown!r}", request_id=shown)
    if not secrets.compare_digest(lent.export.scope, scope):
        raise ScopeMismatch(
            f"request {request_id[:64]!r} belongs to another cache scope",
            request_id=request_id[:64],
        )
    return lent.export


# -- the decode side ---------------------------------------------------------------------------


def connect(m: Components, metadata: str) -> str:
    """Load a peer's transfer agent (``TransferAgent.metadata``); returns its name."""
    return endpoint(m).engine.connect(metadata)


def disconnect(m: Components, agent: str) -> None:
    """Drop a peer's agent (it restarted: its new generation is another agent)."""
    endpoint(m).engine.forget(agent)


def _match_windows(m: Components, row: int, export: KVExport) -> None:
    """Release the pulled request's window blocks that the peer had released: it allocated
    the whole prompt at once, so it holds every position, but the KV of those the peer
    released is gone (and no attention reads it). Left held, they would be published with
    bytes nobody wrote. Example (sink 1 block): the peer lists [4, -1, -1, 9, 12]: positions
    1 and 2 are released here too."""
    for g in m.layout.layer_groups:
        remote = export.blocks[int(g.group_id)]
        released = [pos for pos, slot in enumerate(remote) if slot < 0]
        if released and g.sliding_window is not None:
            m.coord.release_window(int(g.group_id), row, released[-1] + 1)


def _plan(
    m: Components, t: Transfers, row: int, hit: int, export: KVExport
) -> tuple[dict[tuple[str, int, str, int], list[tuple[int, int, int]]], int]:
    """The READ descriptors of a pull, grouped by (local kind, device, remote kind,
    device): (local address, remote address, bytes) rows, and the blocks they move.

    Positions from ``hit // tokens_per_block`` up move; a position whose local slot a window
    released moves nothing; one that D holds but P released is a layout error (equal
    windows release the same positions)."""
    tpb = m.tokens_per_block
    first, used = hit // tpb, -(-len(export.token_ids) // tpb)
    remote_regions = {r.pool: r for r in export.regions}
    groups: dict[tuple[str, int, str, int], list[tuple[int, int, int]]] = {}
    moved = 0
    for g in m.layout.layer_groups:
        local = m.coord.block_list(g.group_id, row)
        remote = export.blocks[int(g.group_id)]
        pools = m.layout.pool_groups[int(g.pool_group)].pools
        for pos in range(first, used):
            slot = local[pos] if pos < len(local) else -1
            if slot < 0:
                continue
            peer_slot = remote[pos] if pos < len(remote) else -1
            if peer_slot < 0:
                raise LayoutMismatch(
                    f"the peer holds no block at position {pos} of layer group {int(g.group_id)}",
                    differences=[f"layer group {int(g.group_id)} position {pos}"],
                )
            moved += 1
            for p in pools:
                tensor = m.memory.tensors[int(p)]
                region = remote_regions[int(p)]
                if peer_slot >= region.num_slots:
                    raise LayoutMismatch(
                        f"the peer's slot {peer_slot} is outside its pool {int(p)}",
                        differences=[f"pool {int(p)} slots"],
                    )
                size = int(tensor.shape[1])
                kind, device = memory_kind(tensor)
                key = (kind, device, region.memory, region.device_id)
                groups.setdefault(key, []).append(
                    (
                        tensor.data_ptr() + slot * size,
                        region.address + peer_slot * region.slot_bytes,
                        size,
                    )
                )
    return groups, moved


def _check(
    m: Components,
    t: Transfers,
    request_id: str,
    export: KVExport,
    lora_id: int | str | None,
    cache_salt: str | None,
    deadline_s: float,
) -> None:
    """What a pull or a fetch refuses before anything changes: a bad deadline, a
    transaction, another layout, another scope, a peer not connected, a live id."""
    if not 0 < deadline_s <= 3600:
        raise InvalidArgument("deadline_s must be in (0, 3600]", deadline_s=deadline_s)
    if m.requests.undo is not None:
        raise InvalidArgument("a pull cannot run inside a transaction")
    differences = layout_differences(t.layout, export.layout)
    if differences:
        raise LayoutMismatch(
            f"the peer's KV layout differs: {'; '.join(differences[:4])}",
            differences=differences[:32],
        )
    if len(export.blocks) != len(m.layout.layer_groups):
        raise LayoutMismatch(
            "the export lists another number of layer groups", differences=["layer_groups"]
        )
    if scope_digest(root_key(lora_id, cache_salt)) != export.scope:
        raise ScopeMismatch(
            "the pull names another cache scope (LoRA, cache salt) than the peer's request",
            request_id=request_id[:64],
        )
    if export.token_ids and export.agent not in t.engine.peers:
        raise UnknownPeer(
            f"transfer agent {export.agent!r} is not connected (connect_peer first; a restarted "
            "peer is a new agent)",
            peer=export.agent,
        )
    if request_id in m.requests.rows or request_id in t.pulls:
        shown = request_id[:64]
        raise DuplicateRequest(f"request {shown!r} is live", request_id=shown)


def _plan_state(
    m: Components,
    row: int,
    export: KVExport,
    groups: dict[tuple[str, int, str, int], list[tuple[int, int, int]]],
) -> None:
    """A hybrid's live state moves too: the peer's, after its committed tokens, replaces
    the one the allocation restored (its hit is shorter, or there would be nothing to pull).
    One descriptor per state group, into the same READs."""
    if m.state is None:
        return
    slot = m.state_slot.item(row)
    if export.state_slot < 0 or slot < 0 or len(export.state_regions) != len(m.state.memory):
        raise LayoutMismatch(
            "the export carries no state for this model's state layers",
            differences=["state_slot"],
        )
    for tensor, region in zip(m.state.memory, export.state_regions, strict=True):
        size = int(tensor.shape[1])
        if region.slot_bytes != size or export.state_slot >= region.num_slots:
            raise LayoutMismatch("the peer's state slots differ", differences=["state slot bytes"])
        kind, device = memory_kind(tensor)
        groups.setdefault((kind, device, region.memory, region.device_id), []).append(
            (
                tensor.data_ptr() + slot * size,
                region.address + export.state_slot * region.slot_bytes,
                size,
            )
        )


def pull(
    m: Components,
    request_id: str,
    export: KVExport,
    lookahead: int = 0,
    lora_id: int | str | None = None,
    cache_salt: str | None = None,
    deadline_s: float = 30.0,
) -> PullState:
    """Start ``request_id`` with the KV of a peer's handed-off request (module docstring,
    step 2). Checks first, then allocates ``len(export.token_ids)`` tokens plus
    ``lookahead`` (the blocks this manager caches already are its hit and move nothing)
    and posts the READs; the request is ``pulling`` until ``poll`` finds them done, or
    ``ready`` at once when nothing needs to move. A refusal changes nothing."""
    t = endpoint(m)
    _check(m, t, request_id, export, lora_id, cache_salt, deadline_s)
    if not export.token_ids:
        raise InvalidArgument("the export holds no tokens: nothing to pull")
    tokens = export.token_ids
    return _start(
        m, t, request_id, export, len(tokens), tokens, lookahead, lora_id, cache_salt, deadline_s
    )


def export_prefix(
    m: Components,
    token_ids: list[int],
    lora_id: int | str | None,
    cache_salt: str | None,
    deadline_s: float,
) -> KVExport:
    """The peer side of a prefix fetch: pin the longest prefix of ``token_ids`` this
    manager caches (block-aligned, at most all but the last token, as a hit) and describe
    it like a hand-off; an export without tokens when nothing is cached, or when this
    manager has no row or block free to pin it (a fetch is an optimisation: the fetcher then
    computes the prefix itself).

    The blocks are pinned by an internal request (``kvcm-fetch-<hex>``, a row until the
    puller is done or the deadline passes) of the prefix plus one token, whose hit is the
    prefix: example (tokens_per_block 4), 10 prompt tokens of which 8 are cached: the
    request holds 9 tokens, 8 committed, and the export lists those 8."""
    t = endpoint(m)
    if not 0 < deadline_s <= 3600:
        raise InvalidArgument("deadline_s must be in (0, 3600]", deadline_s=deadline_s)
    hit = prefix_reuse.probe(m, token_ids, lora_id, cache_salt)
    if hit:
        request_id = f"kvcm-fetch-{secrets.token_hex(8)}"
        prefix = list(token_ids[: hit + 1])
        try:
            allocation.start(
                m, request_id, hit + 1, prefix, 0, lora_id, cache_salt, None, None, None
            )
        except (OutOfBlocks, RequestLimitReached):
            hit = 0  # no room to pin it: the fetcher computes the prefix itself
    if not hit:
        return KVExport(
            agent=t.engine.name,
            generation=m.generation,
            request_id="",
            token_ids=[],
            scope=scope_digest(root_key(lora_id, cache_salt)),
            layout=t.layout,
            blocks=[[] for _ in m.layout.layer_groups],
            regions=t.regions,
            deadline=time.time() + deadline_s,
            notify="",
            state_regions=t.state_regions,
        )
    return hand_off(m, request_id, deadline_s)


def fetch(
    m: Components,
    request_id: str,
    num_tokens: int,
    token_ids: list[int],
    export: KVExport,
    lookahead: int = 0,
    lora_id: int | str | None = None,
    cache_salt: str | None = None,
    deadline_s: float = 30.0,
) -> PullState:
    """Allocate ``request_id`` (``num_tokens`` tokens, its prompt ``token_ids``) with the
    prefix a peer caches (``export_prefix``'s export) pulled into it: the blocks this
    manager caches already are hits, the rest of the peer's prefix moves, and once it is
    here it is committed and published (``block_stored`` events), so later requests hit it
    locally. ``pulling`` until then; the scheduler then prefills from ``num_committed``.
    Example (tokens_per_block 4): a 30-token prompt, 4 tokens cached here, 24 at the peer:
    blocks 1 to 5 move, and the request is ready with 24 tokens committed."""
    t = endpoint(m)
    _check(m, t, request_id, export, lora_id, cache_salt, deadline_s)
    cached = export.token_ids
    if list(token_ids[: len(cached)]) != cached or len(cached) >= num_tokens:
        raise InvalidArgument(
            "the peer's prefix is not a proper prefix of the prompt",
            request_id=request_id[:64],
        )
    return _start(
        m, t, request_id, export, num_tokens, token_ids, lookahead, lora_id, cache_salt, deadline_s
    )


def _start(
    m: Components,
    t: Transfers,
    request_id: str,
    export: KVExport,
    num_tokens: int,
    tokens: list[int],
    lookahead: int,
    lora_id: int | str | None,
    cache_salt: str | None,
    deadline_s: float,
) -> PullState:
    """Allocate the request, post its READs and hold it (``pull`` and ``fetch``, checked)."""
    started = allocation.start(
        m, request_id, num_tokens, tokens, lookahead, lora_id, cache_salt, None, None, None
    )
    row, hit = started.row, started.hit_tokens
    xfers: list[Xfer] = []
    try:
        m.settle()  # the allocation's own state copies land first: the READ comes after
        _match_windows(m, row, export)
        groups, moved = _plan(m, t, row, hit, export)
        if hit < len(export.token_ids):
            _plan_state(m, row, export, groups)
        pieces = _pieces(groups)
        if pieces:
            xfers.append(_post(t, export.agent, pieces[0]))
    except TransferFailed as exc:  # NIXL refused to post (the peer died): a failed pull
        for x in xfers:
            t.engine.release(x)
        request_rows.free_row(m, row)
        failed = PullState(request_id=request_id, state="failed", error=exc.to_dict())
        t.record(failed)
        return failed
    except BaseException:
        for x in xfers:
            t.engine.release(x)
        request_rows.free_row(m, row)
        raise
    pull = Pull(
        request_id=request_id,
        row=row,
        xfers=xfers,
        tokens=export.token_ids[hit:],
        peer=export.agent,
        notify=export.notify.encode(),
        deadline=t.clock() + deadline_s,
        blocks=moved,
        nbytes=sum(piece.nbytes for piece in pieces),
        queued=pieces[1:],
    )
    m.requests.hold(row)
    t.start(pull)
    if not xfers:
        _complete(m, t, pull)
    return status(m, [request_id])[0]


def _complete(m: Components, t: Transfers, pull: Pull) -> None:
    """The READs ended: commit the pulled tokens (publishing the full blocks), give the
    request its handle back and tell the peer."""
    for i, x in enumerate(pull.xfers):
        if i not in pull.done:
            t.engine.release(x)
    m.requests.unhold(pull.request_id, pull.row)
    if pull.tokens:
        commits.commit_row(m, pull.row, pull.tokens)
    t.finish(
        pull.request_id,
        PullState(
            request_id=pull.request_id,
            state="ready",
            blocks=pull.blocks,
            bytes=pull.nbytes,
            handle=m.requests.handle.item(pull.row),
            num_committed=m.requests.committed.item(pull.row),
        ),
    )
    if pull.notify:  # a peer with nothing cached pinned nothing
        t.engine.notify(pull.peer, pull.notify)


def _fail(m: Components, t: Transfers, pull: Pull, error: KVCMError) -> None:
    """A pull that cannot end well: its blocks go back uncommitted (nothing published)."""
    request_rows.free_row(m, pull.row)
    t.finish(
        pull.request_id,
        PullState(
            request_id=pull.request_id,
            state="failed",
            blocks=pull.blocks,
            bytes=pull.nbytes,
            error=error.to_dict(),
        ),
    )


def _settled(t: Transfers, pull: Pull, abort: bool) -> bool:
    """Whether none of the pull's READs can still write: each ended, or (``abort``) was
    released, which aborts it in NIXL. Ended ones are released."""
    for i, x in enumerate(pull.xfers):
        if i in pull.done:
            continue
        state = t.engine.state(x)
        if state in ("DONE", "ERR") or abort:
            if t.engine.release(x):
                pull.done.add(i)
            if state == "ERR" and pull.error is None:
                pull.error = TransferFailed(
                    f"the read from {pull.peer!r} failed (the peer died or dropped it)",
                    peer=pull.peer,
                )
    return len(pull.done) == len(pull.xfers)


def poll(m: Components) -> None:
    """Advance the moves (module docstring, step 3): finished pulls, pulls past their
    deadline, cancelled ones, and on the prefill side the pullers' messages and the lent
    requests past their deadline. Local only: it asks the engine, never the peer."""
    t = m.transfers
    if t is None or not t.busy:
        return
    now = t.clock()
    for pull in list(t.pulls.values()):
        late = now > pull.deadline
        if pull.cancelled or late:
            pull.queued.clear()  # nothing more is posted
        if pull.cancelled:
            if _settled(t, pull, abort=True):
                request_rows.free_row(m, pull.row)
                t.finish(pull.request_id, None)
            continue
        pending = [i for i in range(len(pull.xfers)) if i not in pull.done]
        states = [t.engine.state(pull.xfers[i]) for i in pending]
        if "ERR" in states or late:
            if late and pull.error is None:
                pull.error = TransferFailed(
                    f"the pull from {pull.peer!r} passed its deadline", peer=pull.peer
                )
            if _settled(t, pull, abort=True):
                assert pull.error is not None or "ERR" in states
                _fail(m, t, pull, pull.error or TransferFailed("the read failed", peer=pull.peer))
            continue
        if all(s == "DONE" for s in states):
            for i in pending:
                t.engine.release(pull.xfers[i])
                pull.done.add(i)
            if not pull.queued:
                _complete(m, t, pull)
                continue
            try:  # the next piece
                pull.xfers.append(_post(t, pull.peer, pull.queued.pop(0)))
            except TransferFailed as exc:
                pull.queued.clear()
                _settled(t, pull, abort=True)
                _fail(m, t, pull, exc)
    for _sender, message in t.engine.notifications():
        request_id = t.by_notify.get(message)
        if request_id is not None:  # the one-time message is the puller's proof
            _release_lent(m, t, request_id)
    for request_id, lent in list(t.lent.items()):
        if now > lent.deadline:
            _release_lent(m, t, request_id)


def _release_lent(m: Components, t: Transfers, request_id: str) -> None:
    lent = t.unlend(request_id)
    m.requests.unhold(request_id, lent.row)
    request_rows.free_row(m, lent.row)


def free(m: Components, request_id: str) -> None:
    """A scheduler's ``free`` of a request whose KV moves: a pull is cancelled (its blocks
    return once no READ can write them; its id at once unless NIXL cannot abort the READ),
    a handed-off request stays pinned until its puller is done or its deadline passes."""
    t = m.transfers
    assert t is not None
    pull = t.pulls.get(request_id)
    if pull is not None:
        pull.cancelled = True
        poll(m)
        return
    # A lent request: nothing to do now; the message or the deadline frees it.
    assert request_id in t.lent


def status(m: Components, request_ids: Sequence[str]) -> list[PullState]:
    """Where each pull stands (``PullState``); ``unknown`` for an id with none."""
    t = endpoint(m)
    out = []
    for rid in request_ids:
        pull = t.pulls.get(rid)
        if pull is not None and not pull.cancelled:
            out.append(
                PullState(request_id=rid, state="pulling", blocks=pull.blocks, bytes=pull.nbytes)
            )
            continue
        done = t.outcomes.get(rid)
        out.append(done if done is not None else PullState(request_id=rid, state="unknown"))
    return out

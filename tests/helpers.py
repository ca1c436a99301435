"""Tiny specs and comparison helpers shared by the tests."""

from __future__ import annotations

import socket
import threading
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
from oracle import Oracle, OracleGroup

from kvcm import KVCacheManager
from kvcm_client.step_channel import HEADER


class _NoMetric:
    @staticmethod
    def inc() -> None:
        pass


class _ChannelMetrics:
    step_channel_connections = _NoMetric()


class ChannelState:
    """What a step channel connection (``kvcm.server.step_channel._Connection``) reads of
    its channel's ``ServiceState``: a fake channel's ``state``."""

    metrics = _ChannelMetrics()


class FakeStepChannel(threading.Thread):
    """A fake step channel on a Unix socket, for client tests: accepts connections one
    after another and hands each to ``serve`` (which ``frames`` helps read)."""

    def __init__(self, path: Path) -> None:
        super().__init__(daemon=True)
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.listener.bind(str(path))
        self.listener.listen(8)

    def run(self) -> None:
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            with conn:
                self.serve(conn)

    def serve(self, conn: socket.socket) -> None:
        raise NotImplementedError

    @staticmethod
    def frames(conn: socket.socket) -> Iterator[bytes]:
        """Each frame's body as it arrives whole (``b""``: a doorbell), until the client
        closes."""
        data = b""
        while chunk := conn.recv(65536):
            data += chunk
            while len(data) >= HEADER.size:
                end = HEADER.size + HEADER.unpack_from(data)[0]
                if len(data) < end:
                    break
                body, data = data[HEADER.size : end], data[end:]
                yield body


class FakeTransport:
    """A step channel connection's transport that keeps what is written to it."""

    def __init__(self) -> None:
        self.out = bytearray()
        self.closed = False

    def write(self, data: bytes) -> None:
        self.out += data

    def close(self) -> None:
        self.closed = True

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass

    def get_extra_info(self, name: str) -> None:
        return None


def layer(i: int, **kw: object) -> dict[str, object]:
    spec: dict[str, object] = {"layer_id": i, "num_kv_heads": 2, "head_dim": 4, "dtype": "fp16"}
    spec.update(kw)
    return spec


def manager(layers: list[dict[str, object]], **kw: object) -> KVCacheManager:
    cfg: dict[str, object] = {
        "layers": layers,
        "tokens_per_block": 4,
        "max_requests": 8,
        "max_seq_len": 64,
    }
    cfg.update(kw)
    if "memory_bytes" not in cfg:
        cfg.setdefault("num_blocks", 16)
    return KVCacheManager(cfg)


def relocations(
    rng: np.random.Generator, num_rows: int, num_positions: int, num_ops: int
) -> np.ndarray:
    """Random token-copy ops, int64 ``[num_ops, 3]`` (row, src, dst), destinations distinct.

    Each row's sources start as a shuffle of its destinations (cycles and swaps), then about
    a third are redrawn anywhere in the row: that opens cycles into chains and makes sources
    repeat or lie where no op writes. Example: a row with destinations 3, 7, 9 might get
    sources 9, 3, 7 (a 3-cycle), then 9, 3, 4 (4 -> 9 -> 3 -> 7, a chain).
    """
    keys = rng.choice(num_rows * num_positions, size=num_ops, replace=False)
    rows, dst = keys // num_positions, keys % num_positions
    # Both orders list the ops row by row; the second shuffles them within each row.
    by_row = np.argsort(rows, kind="stable")
    shuffled = np.lexsort((rng.random(num_ops), rows))
    src = np.empty_like(dst)
    src[by_row] = dst[shuffled]
    redraw = rng.random(num_ops) < 1 / 3
    src[redraw] = rng.integers(num_positions, size=int(redraw.sum()))
    return np.stack([rows, src, dst], axis=1).astype(np.int64)


def copy_positions(m: KVCacheManager, rid: str) -> tuple[np.ndarray, np.ndarray]:
    """(readable, writable) positions of a request: blocks held in every layer group; and of
    those, blocks past its committed full blocks (hit or published ones are never written)."""
    info, tpb = m.request(rid), m.tokens_per_block
    pos = np.arange(info.capacity)
    live = np.all([np.array(b)[pos // tpb] >= 0 for b in m.block_table(rid)], axis=0)
    readable = pos[live]
    return readable, readable[readable >= info.num_committed // tpb * tpb]


def random_copy_ops(
    rng: np.random.Generator, m: KVCacheManager
) -> tuple[list[str], list[int], list[int]]:
    """Tree paths, chains, cycles, broadcasts and stray copies over the live requests, with
    distinct destinations per request."""
    ids: list[str] = []
    srcs: list[int] = []
    dsts: list[int] = []
    for rid in m.request_ids():
        readable, writable = copy_positions(m, rid)
        can_read = set(readable.tolist())
        used: set[int] = set()
        for _ in range(int(rng.integers(0, 4)) if writable.size else 0):
            kind = rng.integers(4)
            k = int(rng.integers(1, min(6, writable.size) + 1))
            if kind == 0:  # an accepted path: k nodes of the draft region onto its start
                start = int(rng.integers(max(writable.size - 10, 0), writable.size))
                region = writable[start:]
                k = min(k, region.size)
                src = rng.choice(region, size=k, replace=False)
                dst = region[:k]
            elif kind == 1:  # a chain shifting a run of positions back by one
                start = int(rng.integers(0, writable.size - k + 1))
                dst = writable[start : start + k]
                src = dst + 1
            elif kind == 2:  # a cycle
                dst = rng.choice(writable, size=k, replace=False)
                src = np.roll(dst, 1)
            else:  # from anywhere readable, shared blocks included
                dst = rng.choice(writable, size=k, replace=False)
                src = rng.choice(readable, size=k)
            for s, d in zip(src.tolist(), dst.tolist(), strict=True):
                if d not in used and s in can_read:
                    used.add(d)
                    ids.append(rid)
                    srcs.append(s)
                    dsts.append(d)
    order = rng.permutation(len(ids))
    return [ids[i] for i in order], [srcs[i] for i in order], [dsts[i] for i in order]


def oracle_for(m: KVCacheManager) -> Oracle:
    groups = [
        OracleGroup(g.sliding_window, g.sink_blocks, g.pool_group) for g in m.layout.layer_groups
    ]
    slots = [m.num_total_blocks(pg.pool_group_id) for pg in m.layout.pool_groups]
    return Oracle(groups, slots, m.tokens_per_block, int(m.config.null_page))


def assert_matches(m: KVCacheManager, o: Oracle) -> None:
    """Same requests, same block ids per position, same free counts; the page tables hold the
    null page 0 where the block tables hold -1 when ``null_page`` is on."""
    empty = 0 if m.config.null_page else -1
    assert sorted(m.request_ids()) == sorted(o.requests)
    for rid, req in o.requests.items():
        info = m.request(rid)
        assert (info.num_tokens, info.capacity) == (req.length, req.length + req.lookahead)
        assert m.block_table(rid) == req.blocks, rid
        for g, blocks in enumerate(req.blocks):
            row = m.page_table(g)[info.row].numpy()
            assert row[: len(blocks)].tolist() == [b if b >= 0 else empty for b in blocks]
            assert (row[len(blocks) :] == empty).all()
    assert m.num_free_blocks() == o.num_free()
    for pg, free in enumerate(o.free):
        assert m.parts.coord.pools[pg].free_order().tolist() == list(free)


def manager_state(m: KVCacheManager) -> list[Any]:
    """What two managers given the same ops must agree on (the C core against numpy): tables,
    counters, references, the free queues (order and ring), the cache index, the KV event
    log, the host tier's LRU and free slots, the edits since the last take."""
    c = m.parts.coord
    ops = c.ops_since_take
    edits = c.take_edits() if c.edits is not None else None
    host = m.parts.host
    return [
        c.tables.copy(),
        c.num_tokens.copy(),
        c.history.copy(),
        c.lookahead.copy(),
        [b.copy() for b in c.num_blocks],
        [r.copy() for r in c.released_end],
        [r.copy() for r in c.refs],
        [p.free_order() for p in c.pools],
        [p.checkpoint() for p in c.pools],  # the ring itself: where compactions happened
        [dict(k) for k in c.cache.slot_key],
        [f.copy() for f in c.cache.cached],
        (c.cache.log.last_seq, list(c.cache.log.events)),
        None if host is None else ({pg: list(lru.items()) for pg, lru in host.lru.items()}),
        None if host is None else ({pg: list(free) for pg, free in host.free.items()}),
        ops,
        edits,
        m.parts.requests.handle.copy(),
        m.parts.requests.committed.copy(),
    ]


def same(a: Any, b: Any) -> bool:
    """Deep equality of ``manager_state`` values (arrays by shape and contents)."""
    if isinstance(a, np.ndarray):
        return isinstance(b, np.ndarray) and a.shape == b.shape and bool(np.array_equal(a, b))
    if isinstance(a, list | tuple):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    return bool(a == b)


class CoreSpy:
    """The C core (``kvcm.native.core``) of one manager, counting what its calls returned,
    so that a test knows which path ran (``native.core = CoreSpy(m)``).

    ``results`` counts row ops by outcome: ``grow tuple`` / ``release tuple`` (ran in C),
    ``grow NoneType`` (did not fit: numpy names the error), ``release int`` (a queue to
    compact first), ``grow released`` (left to numpy because a sliding window releases
    blocks: its rule), and ``grow bool`` / ``release bool`` (left to numpy otherwise: never
    expected); prefix hits: ``hit int`` (placed in C), ``hit miss`` (none), ``hit NoneType``
    (did not fit), ``hit bool`` (left to numpy). Decode batches: ``planned`` in C,
    ``around`` failing items, ``deferred`` to the numpy plan (only a batch with more items
    than rows may be); their window releases: ``window True`` (in C), ``window False`` (left
    to numpy)."""

    def __init__(self, m: KVCacheManager) -> None:
        from kvcm import native

        self._core = native._built
        self._coord = m.parts.coord
        self.planned = 0
        self.deferred = 0
        self.around = 0
        self.results: Counter[str] = Counter()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._core, name)

    def decode_plan(self, *args: Any) -> Any:
        out = self._core.decode_plan(*args)
        self.planned += type(out) is tuple
        self.around += type(out) is tuple and bool(out[2])
        self.deferred += out is False and args[0].size <= self._coord.num_tokens.size
        return out

    def decode_take(self, *args: Any) -> Any:
        out = self._core.decode_take(*args)
        self.results["take tuple" if type(out) is tuple else f"take {out}"] += 1
        self.results["take evict"] += type(out) is tuple and any(out)
        return out

    def decode_release(self, *args: Any) -> Any:
        out = self._core.decode_release(*args)
        self.results[f"window {out}"] += 1
        return out

    def row_grow(self, *args: Any) -> Any:
        row = args[0]
        c = self._coord
        releases = 0 <= row < c.num_tokens.size and any(
            policy.released_end(c.num_tokens[row : row + 1], c.released_end[g][row : row + 1])[0]
            > c.released_end[g][row]
            for g, policy in enumerate(c.policies)
        )
        out = self._core.row_grow(*args)
        kind = type(out).__name__
        self.results["grow released" if out is False and releases else f"grow {kind}"] += 1
        return out

    def row_release(self, *args: Any) -> Any:
        out = self._core.row_release(*args)
        self.results[f"release {type(out).__name__}"] += 1
        return out

    def allocate_one(self, *args: Any) -> Any:
        out = self._core.allocate_one(*args)
        kind = "python" if out is None else "hit" if out[1] else "no hit"
        self.results[f"allocate {kind}"] += 1
        if len(args) > 11 and args[11] is not None:
            self.results["allocate keyed"] += 1
        return out

    def row_start(self, *args: Any) -> Any:
        out = self._core.row_start(*args)
        kind = type(out).__name__ if type(out) is not tuple else "hit" if out[0] else "grow"
        self.results[f"start {kind}"] += 1
        self.results["start evict"] += type(out) is tuple and out[2]
        return out


def engine_handles(rng: np.random.Generator, live: list[int], stale: list[int]) -> list[int]:
    """A step's extend handles as engines send them: the live ones shuffled, now and then
    with what only the general path runs: a stale handle (a missed free), a row named
    twice, or a handle nobody holds."""
    handles = list(live)
    rng.shuffle(handles)
    kind = rng.random()
    if stale and kind < 0.1:
        handles.insert(int(rng.integers(len(handles) + 1)), stale[-1])  # a missed free
    elif handles and kind < 0.15:
        handles.append(handles[0])  # a row named twice
    elif kind < 0.18:
        handles.append(2**40 + 3 if rng.random() < 0.5 else -1)  # a handle nobody holds
    return handles

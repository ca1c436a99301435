"""A second sidecar for the transfer tests: a ``KVCacheManager`` with a transfer endpoint in
its own process (spawned), driven over a pipe.

``Peer.call(name, *args)`` runs a manager method there and returns its result (or raises its
error here); ``fill`` writes seeded random bytes into every slot a request holds and
``digests`` hashes them, so a test compares every byte that moved. Between calls the peer
polls its transfers, as the service's loop does, so a puller's message unpins its blocks.
"""

from __future__ import annotations

import contextlib
import hashlib
import multiprocessing as mp
import os
import signal
import time
from multiprocessing.connection import Connection
from typing import Any

import numpy as np

from kvcm.manager import KVCacheManager


def slot_bytes(m: KVCacheManager, group: int, slot: int) -> bytes:
    """Every byte of ``slot`` in each pool of the layer group's pool group, in pool order."""
    pools = m.layout.pool_groups[int(m.layout.layer_groups[group].pool_group)].pools
    return b"".join(m.memory.tensors[int(p)][slot].numpy().tobytes() for p in pools)


def digests(m: KVCacheManager, request_id: str, upto_tokens: int | None = None) -> list[list[str]]:
    """Per layer group, the sha256 of each held block's whole slot ("" for a released one),
    for the positions of the first ``upto_tokens`` tokens (all held positions: None)."""
    table = m.parts.coord.block_list
    row = m.parts.requests.rows[request_id]
    out = []
    for g in m.layout.layer_groups:
        slots = table(g.group_id, row)
        if upto_tokens is not None:
            slots = slots[: -(-upto_tokens // m.tokens_per_block)]
        out.append(
            [
                hashlib.sha256(slot_bytes(m, int(g.group_id), s)).hexdigest() if s >= 0 else ""
                for s in slots
            ]
        )
    return out


def pool_digest(m: KVCacheManager, skip: set[tuple[int, int]] = frozenset()) -> str:
    """sha256 over every pool's bytes, leaving out the (pool group, slot) pairs in ``skip``."""
    h = hashlib.sha256()
    for pool, tensor in zip(m.layout.pools, m.memory.tensors, strict=True):
        raw = tensor.numpy()
        keep = np.ones(raw.shape[0], dtype=bool)
        for pg, slot in skip:
            if pg == int(pool.pool_group):
                keep[slot] = False
        h.update(raw[keep].tobytes())
    return h.hexdigest()


def fill(m: KVCacheManager, request_id: str, seed: int) -> None:
    """Seeded random bytes in every slot the request holds, in every pool of its groups."""
    rng = np.random.default_rng(seed)
    row = m.parts.requests.rows[request_id]
    for g in m.layout.layer_groups:
        pools = m.layout.pool_groups[int(g.pool_group)].pools
        for s in m.parts.coord.block_list(g.group_id, row):
            if s < 0:
                continue
            for p in pools:
                t = m.memory.tensors[int(p)]
                t[s] = torch_bytes(rng.integers(0, 256, t.shape[1], dtype=np.uint8))


def fill_state(m: KVCacheManager, request_id: str, seed: int) -> None:
    """Seeded random bytes in the request's live state slot of every state group."""
    rng = np.random.default_rng(seed)
    slot = m.parts.state_slot.item(m.parts.requests.rows[request_id])
    for t in m.parts.state.memory:
        t[slot] = torch_bytes(rng.integers(0, 256, t.shape[1], dtype=np.uint8))


def state_digest(m: KVCacheManager, request_id: str) -> str:
    """sha256 of the request's live state slots, group after group."""
    slot = m.parts.state_slot.item(m.parts.requests.rows[request_id])
    return hashlib.sha256(
        b"".join(t[slot].numpy().tobytes() for t in m.parts.state.memory)
    ).hexdigest()


def torch_bytes(a: np.ndarray) -> Any:
    import torch

    return torch.from_numpy(a)


def _serve(conn: Connection, config: dict[str, Any]) -> None:
    try:
        m = KVCacheManager(config)
    except BaseException as exc:  # report a refused config to the test
        conn.send(("error", exc))
        return
    conn.send(("ok", m.transfer_agent()))
    helpers = {
        "fill": fill,
        "digests": digests,
        "pool_digest": pool_digest,
        "fill_state": fill_state,
        "state_digest": state_digest,
    }
    while True:
        if not conn.poll(0.001):
            if m.transfers_busy:
                m.poll_transfers()
            continue
        name, args, kwargs = conn.recv()
        if name == "stop":
            m.close()
            conn.send(("ok", None))
            return
        try:
            if name in helpers:
                result = helpers[name](m, *args, **kwargs)
            elif name == "num_free_blocks":
                m.poll_transfers()
                result = m.num_free_blocks()
            else:
                result = getattr(m, name)(*args, **kwargs)
            conn.send(("ok", result))
        except BaseException as exc:
            conn.send(("error", exc))


class Peer:
    """A manager in another process (module docstring)."""

    def __init__(self, config: dict[str, Any]) -> None:
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.process = ctx.Process(target=_serve, args=(child, config), daemon=True)
        self.process.start()
        self.agent = self._answer(60.0)

    def _answer(self, timeout: float) -> Any:
        if not self.conn.poll(timeout):
            raise TimeoutError("the peer did not answer")
        kind, value = self.conn.recv()
        if kind == "error":
            raise value
        return value

    def call(self, name: str, *args: Any, **kwargs: Any) -> Any:
        self.conn.send((name, args, kwargs))
        return self._answer(60.0)

    def kill(self) -> None:
        """SIGKILL: no cleanup, as a crashed sidecar."""
        assert self.process.pid is not None
        os.kill(self.process.pid, signal.SIGKILL)
        self.process.join(10)

    def stop(self) -> None:
        if self.process.is_alive():
            with contextlib.suppress(EOFError, BrokenPipeError, TimeoutError):
                self.call("stop")
            self.process.join(10)
        if self.process.is_alive():
            self.kill()


def wait_done(m: KVCacheManager, request_id: str, timeout: float = 30.0) -> Any:
    """Poll until the pull of ``request_id`` is no longer ``pulling``; its ``PullState``."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        state = m.transfer_status([request_id])[0]
        if state.state != "pulling":
            return state
        time.sleep(0.001)
    raise TimeoutError(f"pull of {request_id!r} still running")


def wait_free(peer: Peer, expected: int, timeout: float = 30.0) -> int:
    """Ask the peer for its free blocks until they are ``expected`` (or time runs out)."""
    end = time.monotonic() + timeout
    free = peer.call("num_free_blocks")
    while free != expected and time.monotonic() < end:
        time.sleep(0.005)
        free = peer.call("num_free_blocks")
    return free

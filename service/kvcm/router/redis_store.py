"""The index in Redis: shared by router replicas, and still there when a router restarts.

Layout (``redis_scripts`` has the keys and the scripts): one string per block key, its
holder mask as a bit string (the bits of 64 sidecars with one layer group fit in 16 bytes,
so a route reads a 32k-token prompt's 2048 masks with one ``MGET`` of ~32 KiB), plus a
small hash per sidecar (its cursor) and one of slots. Memory grows with the blocks the
sidecars cache, not with their history: a removal that empties a mask deletes its key.

A sidecar's new load goes into a fresh slot in chunks; a script then makes it the
sidecar's and marks the old slot dead in one step: from then on no route counts the old
bits. ``sweep`` clears dead slots' bits later (a ``SCAN`` of the block keys, one script per
batch) and only then frees the slots for reuse, so a reused slot never inherits bits.
Slots have leases that the routers following them renew; a load that stalls or a sidecar
no router has followed for a lease (it left the fleet) is swept the same way.

Every write checks the sidecar's cursor in the same script (``store`` module doc). A Redis
restarted empty lacks ``ns:meta``'s epoch: ``check`` notices, and the service loads every
sidecar again. A Redis that cannot be reached raises ``IndexUnavailable``.
"""

from __future__ import annotations

import asyncio
import secrets
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from typing import Any

from kvcm_client.errors import IndexUnavailable

from . import redis_scripts as lua
from .keyspace import KeySpace
from .store import Applied, Cursor, Group, Op, Walk, member

#: Masks read before a walk first says whether it wants more; later reads double.
FIRST_CHUNK = 256
#: Keys one write script sets at most (a script blocks Redis while it runs).
WRITE_CHUNK = 8192
#: Block keys one sweep script clears.
SWEEP_CHUNK = 1000
#: Seconds one Redis call may take before the store counts Redis as unreachable.
CALL_TIMEOUT_S = 10.0


def redis_offset(bit: int) -> int:
    """The bit offset (``SETBIT``) of a mask bit: Redis numbers a byte's bits from the top,
    ``int.from_bytes(..., "little")`` from the bottom."""
    return (bit & ~7) | (7 - (bit & 7))


def _bulk(value: bytes) -> bytes:
    """A RESP bulk string."""
    return b"$%d\r\n%s\r\n" % (len(value), value)


def mask_of(value: bytes | None) -> int:
    return int.from_bytes(value, "little") if value else 0


class RedisStore:
    def __init__(
        self,
        url: str,
        namespace: str = "kvcm",
        *,
        lease_s: float = 60.0,
        max_slots: int = 1024,
    ) -> None:
        import redis.asyncio as aioredis  # the router extra: only a Redis index needs it
        from redis import exceptions

        # Each call has its deadline in _reachable (asyncio.timeout), the sweep's SCAN pages
        # included, rather than a socket_timeout: one place that turns every Redis failure
        # and stall into IndexUnavailable.
        self.redis = aioredis.Redis.from_url(url, socket_connect_timeout=5)
        self.url = url
        self._down = (exceptions.ConnectionError, exceptions.TimeoutError)
        self.lease_ms = int(lease_s * 1000)
        self.max_slots = max_slots
        ns = namespace.encode()
        self.meta = ns + b":meta"
        self.slots = ns + b":slots"
        self.free = ns + b":free"
        self.next = ns + b":next"
        self.cursor_prefix = ns + b":sc:"
        self.block_prefix = ns + b":b:"
        self.lock = ns + b":sweeping"
        self._lua = {name: self.redis.register_script(getattr(lua, name)) for name in lua.SCRIPTS}
        self.epoch: bytes | None = None
        self.space: KeySpace | None = None
        self.width = 0

    @asynccontextmanager
    async def _reachable(self) -> AsyncIterator[None]:
        """Redis calls within ``CALL_TIMEOUT_S``, their failures as ``IndexUnavailable``."""
        try:
            async with asyncio.timeout(CALL_TIMEOUT_S):
                yield
        except (*self._down, TimeoutError) as exc:
            raise IndexUnavailable(
                f"the index store (redis) cannot be reached: {type(exc).__name__}: {exc}"
            ) from None

    async def _run(self, script: str, keys: Sequence[bytes], args: Sequence[Any]) -> Any:
        async with self._reachable():
            return await self._lua[script](keys=list(keys), args=list(args))

    def _key(self, sidecar: str) -> bytes:
        return self.cursor_prefix + sidecar.encode()

    async def bind(self, space: KeySpace) -> KeySpace:
        epoch, stored = await self._run(
            "BIND", [self.meta], [secrets.token_hex(8), space.to_json()]
        )
        self.epoch = epoch
        self.space = KeySpace.from_json(stored)
        self.width = 2 * len(self.space.groups)
        return self.space

    async def check(self) -> bool:
        async with self._reachable():  # also before any sidecar: readiness says Redis answers
            epoch = await self.redis.hget(self.meta, "epoch")
        if self.space is None or epoch == self.epoch:
            return True
        await self.bind(self.space)  # the marker again, for every router sharing it
        return False

    async def cursor(self, sidecar: str) -> Cursor | None:
        async with self._reachable():
            slot, generation, last = await self.redis.hmget(
                self._key(sidecar), "slot", "generation", "last_seq"
            )
        if slot is None or generation is None or last is None:
            return None
        return Cursor(int(slot), generation.decode(), int(last))

    async def replace(
        self,
        sidecar: str,
        generation: str,
        last_seq: int,
        groups: Sequence[Group],
        expect: Cursor | None = None,
    ) -> Cursor | None:
        name = sidecar.encode()
        slot = await self._run(
            "CLAIM", [self.slots, self.free, self.next], [name, self.lease_ms, self.max_slots]
        )
        if slot == -3:
            raise IndexUnavailable(
                "the index's free-slot bookkeeping was lost (evicted? its Redis needs "
                "maxmemory-policy noeviction): a slot in use was offered; retrying skips it"
            )
        if slot < 0:
            raise IndexUnavailable(
                f"every one of the index's {self.max_slots} slots is taken (sidecars and loads "
                "not yet swept)",
                max_slots=self.max_slots,
            )
        keys: list[bytes] = [self.slots]
        runs: list[int] = []
        for g in groups:
            offset = redis_offset(member(slot, self.width, g.group, g.tier))
            for i in range(0, len(g.keys), WRITE_CHUNK):
                part = g.keys[i : i + WRITE_CHUNK]
                if len(keys) - 1 + len(part) > WRITE_CHUNK:
                    await self._write(slot, name, keys, runs)
                    keys, runs = [self.slots], []
                keys += [self.block_prefix + k for k in part]
                runs += [offset, len(part)]
        if runs:
            await self._write(slot, name, keys, runs)
        args = [slot, name, generation, last_seq, self.lease_ms]
        if expect is not None:
            args += [expect.slot, expect.generation]
        old = await self._run("ACTIVATE", [self.slots, self._key(sidecar)], args)
        if old == -2:
            raise IndexUnavailable(f"the load of {sidecar} outlived its lease and was dropped")
        if old == -3:
            return None
        return Cursor(slot, generation, last_seq)

    async def _write(self, slot: int, name: bytes, keys: list[bytes], runs: list[int]) -> None:
        if not await self._run("WRITE", keys, [slot, name, self.lease_ms, *runs]):
            raise IndexUnavailable("a load outlived its lease and was dropped")

    async def apply(self, sidecar: str, cursor: Cursor, ops: Sequence[Op]) -> Applied:
        key = self._key(sidecar)
        i = 0
        result = Applied("ok", cursor)
        while i < len(ops):  # a script per WRITE_CHUNK keys (an op is never split)
            keys, args = [key], [cursor.slot, cursor.generation]
            while i < len(ops) and (len(keys) == 1 or len(keys) + len(ops[i].keys) <= WRITE_CHUNK):
                op = ops[i]
                offset = redis_offset(member(cursor.slot, self.width, op.group, op.tier))
                args += [op.seq, int(op.stored), offset, len(op.keys)]
                keys += [self.block_prefix + k for k in op.keys]
                i += 1
            answer = await self._run("APPLY", keys, args)
            status = answer[0].decode()
            if status == "stale":
                return Applied("stale", await self.cursor(sidecar))
            cursor = Cursor(cursor.slot, cursor.generation, int(answer[1]))
            result = Applied("gap" if status == "gap" else "ok", cursor)
            if status == "gap":
                break
        return result

    async def lookup(self, sidecars: Sequence[str], keys: Sequence[bytes], walk: Walk) -> None:
        blocks = [self.block_prefix + k for k in keys]
        async with self._reachable():
            fields = b"$4\r\nslot\r\n$10\r\ngeneration\r\n$8\r\nlast_seq\r\n"
            packed = b"".join(
                b"*5\r\n$5\r\nHMGET\r\n%s%s" % (_bulk(self._key(s)), fields) for s in sidecars
            )
            answers = await self._exchange(packed, len(sidecars)) if sidecars else []
            walk.start(
                {
                    sidecar: Cursor(int(slot), generation.decode(), int(last))
                    for sidecar, (slot, generation, last) in zip(sidecars, answers, strict=True)
                    if slot is not None and generation is not None and last is not None
                }
            )
            start, size = 0, FIRST_CHUNK
            while start < len(blocks):
                chunk = blocks[start : start + size]
                head = b"$%d\r\n" % len(chunk[0])  # block keys all have one length
                mget = b"*%d\r\n$4\r\nMGET\r\n%s%s\r\n" % (
                    len(chunk) + 1,
                    head,
                    (b"\r\n" + head).join(chunk),
                )
                (values,) = await self._exchange(mget, 1)
                if not walk.feed([mask_of(v) for v in values]):
                    return
                start, size = start + size, 2 * size

    async def _exchange(self, packed: bytes, replies: int) -> list[Any]:
        """Send commands packed here (RESP) on one connection and read their replies.

        A route's reads are packed here, not by redis-py, which packs at about 1.4 us an
        argument in Python: 2.8 ms for a 32k-token prompt's 2048 keys, where one
        ``bytes.join`` takes about 50 us."""
        pool = self.redis.connection_pool
        conn = await pool.get_connection()
        try:
            await conn.send_packed_command(packed)
            return [await conn.read_response() for _ in range(replies)]
        except BaseException:
            await conn.disconnect()  # replies may still be on their way: not reusable
            raise
        finally:
            await pool.release(conn)

    async def renew(self, sidecars: Sequence[str]) -> list[str]:
        if not sidecars:
            return []
        args: list[Any] = [self.lease_ms, self.cursor_prefix, *(s.encode() for s in sidecars)]
        return [s.decode() for s in await self._run("RENEW", [self.slots], args)]

    async def sweep(self) -> int:
        """Clear the bits of dead slots (and of loads and sidecars whose lease ran out),
        then free those slots; returns how many block keys changed. One router sweeps at a
        time (a lock key, extended at every batch); the others return 0 meanwhile. Each
        batch clears only slots still dead then, and only while the lock is this sweep's: a
        sweep that lost its lock (it ran out mid-scan, or Redis restarted empty) stops."""
        token = secrets.token_hex(8)
        lock_ms = 10 * self.lease_ms
        async with self._reachable():
            if not await self.redis.set(self.lock, token, nx=True, px=lock_ms):
                return 0
        try:
            dead = [
                int(s) for s in await self._run("SWEEP_BEGIN", [self.slots], [self.cursor_prefix])
            ]
            if not dead:
                return 0
            changed, cursor = 0, None
            while cursor != 0:
                async with self._reachable():
                    cursor, batch = await self.redis.scan(
                        cursor or 0, match=self.block_prefix + b"*", count=SWEEP_CHUNK
                    )
                if batch:
                    done = await self._run(
                        "SWEEP_KEYS",
                        [self.lock, self.slots, *batch],
                        [token, lock_ms, self.width, *dead],
                    )
                    if done < 0:
                        return changed
                    changed += done
            await self._run("SWEEP_END", [self.lock, self.slots, self.free], [token, *dead])
            return changed
        finally:
            await self._run("UNLOCK", [self.lock], [token])

    async def close(self) -> None:
        await self.redis.aclose()

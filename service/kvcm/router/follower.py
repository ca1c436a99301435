"""Follows one sidecar into the index store: a snapshot, then long-polls of its events.

A follower loads a snapshot when it has nothing of the sidecar (or the store has nothing),
when a batch is of another generation (the sidecar restarted or registered another model),
when the sidecar says events were lost, or when the store was emptied under it (``resync``).
An ``all_blocks_cleared`` event becomes an empty load at its sequence number, so the
sidecar's older entries go at once as with a new generation. Before the first load of a
generation it checks the sidecar's model (``ModelGate``): a sidecar of another model is
refused, and asked again every ``refused_retry_s``.

A router restarted on a Redis index resumes from the store's cursor (the sidecar's
generation unchanged): no snapshot, only the events since. ``ingest`` is the one write
path for events, whether from HTTP or from a benchmark's synthetic batches.

The sidecar's stats (``free_blocks``, ``running_requests``) are polled every ``stats_s``.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence
from contextlib import suppress
from typing import Protocol

from kvcm_client.errors import (
    IndexUnavailable,
    KVCMError,
    ModelMismatch,
    NoModel,
    StaleGeneration,
)
from kvcm_client.models import IndexSnapshot, KVEvent, KVEvents, ModelInfo, Stats
from kvcm_client.routing import SidecarState, SidecarStatus

from .keyspace import ModelGate
from .store import TIERS, Cursor, Group, IndexStore, Op

log = logging.getLogger("kvcm.router")


class Source(Protocol):
    """What a follower asks a sidecar (``AsyncKVCacheClient`` has these)."""

    async def model(self) -> ModelInfo: ...

    async def index_snapshot(self) -> IndexSnapshot: ...

    async def events(
        self, after: int = 0, limit: int = 1000, timeout_s: float = 0.0
    ) -> KVEvents: ...

    async def stats(self) -> Stats: ...

    def reconnect(self) -> None: ...


def ops_of(events: Sequence[KVEvent]) -> list[Op | int]:
    """Events as store ops, with the sequence number of each ``all_blocks_cleared`` in
    their place."""
    out: list[Op | int] = []
    for e in events:
        if e.kind == "all_blocks_cleared":
            out.append(e.seq)
        else:
            assert e.layer_group is not None
            keys = tuple(map(bytes.fromhex, e.block_keys))
            out.append(Op(e.seq, e.kind == "block_stored", e.layer_group, TIERS[e.tier], keys))
    return out


def groups_of(snapshot: IndexSnapshot) -> list[Group]:
    return [
        Group(g.layer_group, TIERS[g.tier], list(map(bytes.fromhex, g.block_keys)))
        for g in snapshot.groups
    ]


class Follower:
    def __init__(
        self,
        name: str,
        url: str,
        source: Source,
        store: IndexStore,
        gate: ModelGate,
        *,
        poll_s: float = 5.0,
        limit: int = 1000,
        stats_s: float = 1.0,
        retry_s: float = 0.2,
        refused_retry_s: float = 5.0,
        on_events: Callable[[str, int], None] | None = None,
    ) -> None:
        self.name = name
        self.url = url
        self.source = source
        self.store = store
        self.gate = gate
        self.poll_s = poll_s
        self.limit = limit
        self.stats_s = stats_s
        self.retry_s = retry_s
        self.refused_retry_s = refused_retry_s
        self.on_events = on_events
        self.state: SidecarState = "connecting"
        self.error: str | None = None
        self.snapshots = 0
        self.cursor: Cursor | None = None
        self.admitted: str | None = None
        self.needs_snapshot = True
        self.resumable = True
        self.loading = False
        self.free_blocks: int | None = None
        self.running_requests: int | None = None
        self.stopping = False
        self._wake = asyncio.Event()

    def status(self) -> SidecarStatus:
        return SidecarStatus(
            name=self.name,
            url=self.url,
            state=self.state,
            generation=self.cursor.generation if self.cursor else None,
            last_seq=self.cursor.last_seq if self.cursor else None,
            snapshots=self.snapshots,
            error=self.error,
            free_blocks=self.free_blocks,
            running_requests=self.running_requests,
        )

    def resync(self) -> None:
        """Load a snapshot now (the store was emptied), even in the middle of a poll."""
        self.needs_snapshot = True
        self._wake.set()

    async def run(self) -> None:
        await asyncio.gather(self._follow(), self._watch_stats())

    async def _follow(self) -> None:
        backoff = self.retry_s
        while not self.stopping:
            try:
                await self.step()
                backoff = self.retry_s
                continue
            except StaleGeneration:  # the sidecar restarted: its old keys go at the load
                self.needs_snapshot, self.resumable = True, False
                continue
            except ModelMismatch as exc:
                self._failed("refused", exc)
                delay = self.refused_retry_s
            except IndexUnavailable as exc:
                self.error = exc.message
                delay = backoff
            except NoModel as exc:
                self._failed("connecting", exc)
                delay = backoff
            except KVCMError as exc:  # ServiceUnavailable and the sidecar's other answers
                self._failed("unreachable", exc)
                delay = backoff
            except Exception as exc:  # a bug: logged, and the follower goes on
                log.exception("sidecar %s: follower failed", self.name)
                self.state, self.error = "unreachable", f"{type(exc).__name__}: {exc}"
                delay = backoff
            backoff = min(2 * backoff, 2.0)
            await self._pause(delay)

    def _failed(self, state: SidecarState, exc: KVCMError) -> None:
        if (self.state, self.error) != (state, exc.message):
            log.warning("sidecar %s: %s: %s", self.name, exc.code, exc.message)
        self.state, self.error = state, exc.message

    async def _pause(self, seconds: float) -> None:
        with suppress(TimeoutError):
            await asyncio.wait_for(self._wake.wait(), seconds)
        self._wake.clear()

    async def step(self) -> None:
        """One round: resume or load if needed, then one long-poll of events, ingested."""
        if self.resumable:
            await self._resume()
        if self.needs_snapshot:
            await self.load()
            if self.needs_snapshot:
                return
        batch = await self._poll()
        if batch is not None:
            await self.ingest(batch)

    async def _resume(self) -> None:
        """Start from the store's cursor (a restarted router on Redis), if the sidecar is
        still in that generation; else leave it to a snapshot."""
        cursor = await self.store.cursor(self.name)
        if cursor is not None:
            self.source.reconnect()  # the stats poller may have pinned an older generation
            info = await self.source.model()
            if info.generation == cursor.generation:
                await self.gate.admit(self.name, info, self.store.bind)
                self.admitted = cursor.generation
                self.cursor, self.needs_snapshot = cursor, False
                self.state, self.error = "following", None
        self.resumable = False

    async def load(self) -> None:
        """Replace the sidecar's entries with a snapshot of it. A ``resync`` while it runs
        is not lost: the flag is cleared first, and set again on any failure."""
        if self.state == "connecting":
            self.state = "syncing"
        self.needs_snapshot, self.loading = False, True
        try:
            self.source.reconnect()
            snapshot = await self.source.index_snapshot()
            if snapshot.generation != self.admitted:
                info = await self.source.model()
                if info.generation != snapshot.generation:
                    raise StaleGeneration("the sidecar changed generation during the load")
                await self.gate.admit(self.name, info, self.store.bind)
                self.admitted = snapshot.generation
            cursor = await self.store.replace(
                self.name, snapshot.generation, snapshot.last_seq, groups_of(snapshot)
            )
            assert cursor is not None  # a load expects no cursor: never refused
            self.cursor = cursor
        except BaseException:
            self.needs_snapshot = True
            raise
        finally:
            self.loading = False
        self.snapshots += 1
        self.state, self.error = "following", None
        log.info(
            "sidecar %s: loaded a snapshot of generation %s at seq %d",
            self.name,
            snapshot.generation[:12],
            snapshot.last_seq,
        )

    async def _poll(self) -> KVEvents | None:
        """The next batch of events, or None when ``resync`` cut the wait short."""
        assert self.cursor is not None
        poll = asyncio.ensure_future(
            self.source.events(self.cursor.last_seq, self.limit, timeout_s=self.poll_s)
        )
        wake = asyncio.ensure_future(self._wake.wait())
        try:
            done, _ = await asyncio.wait({poll, wake}, return_when=asyncio.FIRST_COMPLETED)
        finally:  # also when the router stops: no task is left behind
            for task in (poll, wake):
                task.cancel()
        if poll in done:
            return poll.result()
        with suppress(asyncio.CancelledError, KVCMError):
            await poll
        self._wake.clear()
        return None

    async def ingest(self, batch: KVEvents) -> None:
        """Apply a batch of the sidecar's events to the store (or ask for a snapshot)."""
        if self.cursor is None or self.needs_snapshot:
            return
        if batch.generation != self.cursor.generation or batch.lost:
            self.needs_snapshot = True
            return
        segment: list[Op] = []
        for item in ops_of(batch.events):
            if isinstance(item, Op):
                segment.append(item)
                continue
            if item <= self.cursor.last_seq:
                continue
            if not await self._apply(segment):
                return
            segment = []
            cleared = await self.store.replace(
                self.name, self.cursor.generation, item, [], expect=self.cursor
            )
            if cleared is None:  # another router moved the cursor: go on from the store's
                stored = await self.store.cursor(self.name)
                if stored is None:
                    self.needs_snapshot = True
                else:
                    self.cursor = stored
                return
            self.cursor = cleared
        if await self._apply(segment) and self.on_events is not None:
            self.on_events(self.name, len(batch.events))
        if not self.needs_snapshot:
            self.state, self.error = "following", None

    async def _apply(self, ops: list[Op]) -> bool:
        assert self.cursor is not None
        if not ops:
            return True
        result = await self.store.apply(self.name, self.cursor, ops)
        if result.status == "ok":
            self.cursor = result.cursor
            return True
        # Another router moved the cursor (a load of its own), or the store is behind: go
        # on from the store's cursor; with none left, load.
        if result.cursor is None:
            self.needs_snapshot = True
        else:
            self.cursor = result.cursor
        return False

    async def _watch_stats(self) -> None:
        while not self.stopping:
            with suppress(KVCMError):  # the follow loop reports what is wrong
                stats = await self.source.stats()
                self.free_blocks = stats.request_free_blocks
                self.running_requests = stats.num_requests
            await asyncio.sleep(self.stats_s)

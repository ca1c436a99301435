"""The router: its followers, the store's upkeep, and the route call.

``route`` hashes a prompt as the sidecars do (``kvcm.hashing``'s ``block_keys``, with the
key space's ``tokens_per_block``, a slice at a time), reads the masks of its reusable
blocks and ranks the sidecars being followed now. Upkeep runs every ``upkeep_s``: it checks
the store's marker (an emptied Redis: every follower loads again), renews the followed
sidecars' leases, and every ``sweep_s`` sweeps dead slots.
"""

from __future__ import annotations

import asyncio
import logging
import re
from collections.abc import Sequence
from contextlib import suppress
from time import monotonic, perf_counter

from kvcm_client.errors import IndexUnavailable, InvalidArgument, NoModel
from kvcm_client.routing import (
    FetchPlan,
    GroupHit,
    RouteRequest,
    RouteResult,
    Sidecars,
    SidecarScore,
    SidecarStatus,
)

from ..hashing import KEY_BYTES, chain_keys, multimodal_items, root_key, token_bytes
from .follower import Follower
from .keyspace import KeySpace, ModelGate
from .metrics import RouterMetrics
from .scorer import Hits, Walk
from .store import IndexStore

log = logging.getLogger("kvcm.router")

_HEX_KEY = re.compile(rf"[0-9a-fA-F]{{{2 * KEY_BYTES}}}")


#: Blocks hashed between two yields to the event loop: a 32k-token prompt is 2048 blocks
#: (about 1.3 ms of hashing here), which would hold up the followers' event writes that long.
HASH_SLICE = 256


async def prompt_keys(request: RouteRequest, space: KeySpace) -> tuple[list[bytes], int]:
    """The prompt's block keys, exactly ``kvcm.block_keys`` (hashed a slice at a time), and
    how many of them a request could reuse: all full blocks but the one holding the last
    token for token ids (``probe``'s rule), every given key."""
    tpb = space.tokens_per_block
    if request.token_ids is not None:
        data = token_bytes(request.token_ids)
        items = multimodal_items(request.multimodal)
        parent = root_key(request.lora_id, request.cache_salt)
        keys: list[bytes] = []
        step = 4 * tpb * HASH_SLICE
        for start in range(0, len(data) - len(data) % (4 * tpb), step):
            if keys:
                await asyncio.sleep(0)
                parent = keys[-1]
            keys += chain_keys(parent, data[start : start + step], tpb, len(keys), items)
        n = len(request.token_ids)
        return keys, min(len(keys), (n - 1) // tpb) if n else 0
    assert request.block_keys is not None
    for i, key in enumerate(request.block_keys):
        if not _HEX_KEY.fullmatch(key):
            raise InvalidArgument(f"block_keys[{i}] is not {KEY_BYTES} bytes in hex", index=i)
    keys = [bytes.fromhex(k) for k in request.block_keys]
    return keys, len(keys)


def rank(scores: Sequence[SidecarScore]) -> list[SidecarScore]:
    """Best first: more hit blocks, more on the device, fewer running requests, more free
    blocks (unknown load last), then by name."""
    big = 1 << 62
    return sorted(
        scores,
        key=lambda s: (
            -s.hit_blocks,
            -s.device_hit_blocks,
            big if s.running_requests is None else s.running_requests,
            -(s.free_blocks or 0),
            s.sidecar,
        ),
    )


def fetch_plan(scores: Sequence[SidecarScore]) -> FetchPlan | None:
    """The least loaded sidecar, and the peer it should fetch a longer prefix from
    (``FetchPlan``). Example: a holds 10 blocks with 8 running, b 2 blocks with 1 running:
    run on b, fetch 8 blocks from a. Sidecars whose load is unknown are not run on."""
    known = [s for s in scores if s.running_requests is not None]
    if not known:
        return None
    run = min(known, key=lambda s: (s.running_requests, -(s.free_blocks or 0), s.sidecar))
    longest = max(scores, key=lambda s: (s.device_hit_blocks, s.sidecar == run.sidecar))
    if longest.sidecar == run.sidecar or longest.device_hit_blocks <= run.hit_blocks:
        return FetchPlan(
            run_on=run.sidecar,
            run_on_url=run.url,
            fetch_from=None,
            fetch_from_url=None,
            fetch_blocks=0,
            hit_blocks=run.hit_blocks,
        )
    return FetchPlan(
        run_on=run.sidecar,
        run_on_url=run.url,
        fetch_from=longest.sidecar,
        fetch_from_url=longest.url,
        fetch_blocks=longest.device_hit_blocks - run.hit_blocks,
        hit_blocks=longest.device_hit_blocks,
    )


class Router:
    def __init__(
        self,
        store: IndexStore,
        gate: ModelGate,
        followers: Sequence[Follower],
        *,
        upkeep_s: float = 1.0,
        sweep_s: float = 10.0,
    ) -> None:
        self.store = store
        self.gate = gate
        self.followers = list(followers)
        self.upkeep_s = upkeep_s
        self.sweep_s = sweep_s
        self.metrics = RouterMetrics(self.statuses)
        self.store_error: str | None = None
        self.stopping = False
        self._tasks: list[asyncio.Task[None]] = []
        for f in self.followers:
            f.on_events = lambda _, n: self.metrics.events.inc(n)

    def statuses(self) -> list[SidecarStatus]:
        return [f.status() for f in self.followers]

    def sidecars(self) -> Sidecars:
        return Sidecars(sidecars=self.statuses())

    async def start(self) -> None:
        self._tasks = [asyncio.create_task(f.run()) for f in self.followers]
        self._tasks.append(asyncio.create_task(self._upkeep()))

    async def stop(self) -> None:
        """Cancel the loops; each also checks ``stopping`` at every turn: redis-py's asyncio
        client swallows a task's cancellation now and then (redis/redis-py#2028 and #2551:
        here 28 to 63 of 150 cancellations of a loop of Redis calls, and a router that
        stopped only when killed, 2 shutdowns in 3)."""
        self.stopping = True
        for f in self.followers:
            f.stopping = True
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with suppress(asyncio.CancelledError):
                await task
        await self.store.close()

    async def _upkeep(self) -> None:
        last_sweep = monotonic()
        while not self.stopping:
            await asyncio.sleep(self.upkeep_s)
            try:
                sweep = monotonic() - last_sweep >= self.sweep_s
                if sweep:
                    last_sweep = monotonic()
                await self.upkeep(sweep=sweep)
                self.store_error = None
            except IndexUnavailable as exc:
                if self.store_error is None:
                    log.warning("%s", exc.message)
                self.store_error = exc.message
            except Exception:  # never let upkeep die; the next round tries again
                log.exception("router upkeep failed")

    async def upkeep(self, *, sweep: bool = False) -> None:
        """One round of upkeep: the store's marker, the leases, and a sweep if asked.

        A lease is renewed by sidecar name, on whatever slot the store's cursor points at
        (another router's load included); a sidecar that has no live cursor any more (its
        lease ran out while this router did not renew it, e.g. while the sidecar could not
        be reached) is loaded again: an idle follower would not notice otherwise."""
        if not await self.store.check():
            log.warning("the index store was emptied: loading every sidecar again")
            for f in self.followers:
                f.resync()
        else:
            following = [f.name for f in self.followers if f.state == "following" and f.cursor]
            missing = set(await self.store.renew(following))
            for f in self.followers:
                if f.name in missing and not f.loading:  # a load under way brings one
                    log.warning("sidecar %s: the index lost its entries: loading it again", f.name)
                    f.resync()
        if sweep:
            changed = await self.store.sweep()
            if changed:
                log.info("swept dropped slots' bits from %d block keys", changed)

    def space(self) -> KeySpace:
        if self.gate.space is None:
            raise NoModel(
                "the router knows no sidecar's model yet (none has answered): it cannot hash "
                "prompts as they do"
            )
        return self.gate.space

    async def route(self, request: RouteRequest) -> RouteResult:
        start = perf_counter()
        space = self.space()
        keys, cap = await prompt_keys(request, space)
        following = {f.name: f for f in self.followers if f.state == "following"}
        walk = Walk(space, cap)
        await self.store.lookup(list(following), keys[:cap], walk)
        tpb = space.tokens_per_block
        scores = [
            self._score(following[name], walk.cursors[name].generation, hits, tpb)
            for name, hits in walk.hits().items()
        ]
        ranked = rank(scores)
        result = RouteResult.model_construct(
            tokens_per_block=tpb,
            num_blocks=walk.cap,
            scores=ranked,
            plan=fetch_plan(ranked) if request.fetch_plan else None,
        )
        self.metrics.routes.observe(perf_counter() - start)
        return result

    @staticmethod
    def _score(f: Follower, generation: str, hits: Hits, tpb: int) -> SidecarScore:
        """Built without validation (``model_construct``): every field is the router's own,
        of the right type, and validating 64 scores would cost a route ~0.3 ms."""
        return SidecarScore.model_construct(
            sidecar=f.name,
            url=f.url,
            generation=generation,
            hit_blocks=hits.hit_blocks,
            device_hit_blocks=hits.device_hit_blocks,
            hit_tokens=hits.hit_blocks * tpb,
            groups=[
                GroupHit.model_construct(layer_group=g, device_blocks=d, host_blocks=h)
                for g, (d, h) in enumerate(hits.groups)
            ],
            free_blocks=f.free_blocks,
            running_requests=f.running_requests,
        )

"""What the pools can hold and what they hold now: the capacity estimate, the budget check,
free and total blocks, and the stats (docs/sizing.md). Reads only; no op changes anything here.
"""

from __future__ import annotations

from dataclasses import asdict
from typing import TYPE_CHECKING, Any

from kvcm_client.errors import InvalidArgument
from kvcm_client.models import Estimate, HostTierStats, ModelInfo, PrefixCacheStats, Stats
from kvcm_client.state import StateGroupEstimate

from .counts import _count
from .ids import PoolGroupId
from .sizing import StepShape
from .state_pools import group_checkpoints

if TYPE_CHECKING:
    from .components import Components


def estimate(
    m: Components,
    seq_len: int,
    num_requests: int | None = None,
    *,
    prefill_chunk: int | None = None,
    lookahead: int | None = None,
) -> Estimate:
    """Capacity for requests of ``seq_len`` tokens grown by ops of at most
    ``prefill_chunk`` new tokens, each with ``lookahead`` draft slots (both default to the
    config's ``max_prefill_chunk`` and ``max_lookahead``; a chunk >= seq_len is a whole
    prompt in one op). Exact: N fit and N + 1 do not (docs/sizing.md); with fewer live
    state slots than rows, N is at most those (``limited_by="state_slots"``). With a host
    tier, ``host_max_requests`` suspends of such requests succeed (the least over pool
    groups' ``host_requests`` and the host state slots)."""
    shape = m.sizing.shape
    if prefill_chunk is not None:
        shape = StepShape(_count("prefill_chunk", prefill_chunk, 1), shape.lookahead)
    if lookahead is not None:
        shape = StepShape(shape.chunk, _count("lookahead", lookahead, 0))
    seq_len = _count("seq_len", seq_len, 1)
    st = m.state
    rows = m.config.max_requests
    live = rows if st is None else st.live
    usable = m.coord.usable_slots()
    if m.coord.cp > 1:  # per context-parallel rank: every class holds as many slots
        pools = enumerate(m.coord.pools)
        usable = {PoolGroupId(pg): pool.classes[0].num_usable for pg, pool in pools}
    est = m.sizing.estimate(seq_len, usable, min(rows, live), num_requests, shape)
    host = m.host
    if st is not None:
        update: dict[str, Any] = {
            "state_groups": tuple(
                StateGroupEstimate(
                    state_group_id=int(g.group_id),
                    layer_ids=g.layers,
                    slot_bytes=g.slot_bytes,
                    state_bytes=g.state_bytes,
                    live_slots=st.live,
                    checkpoint_slots=group_checkpoints(g, st.num_checkpoints),
                    host_slots=0 if host is None else host.state_slots,
                )
                for g in st.groups
            ),
            "state_bytes": sum(t.numel() for t in st.memory),
        }
        if live < rows and est.limited_by == "max_requests":
            update["limited_by"] = "state_slots"
        est = est.model_copy(update=update)
    if host is None:
        return est
    pools = tuple(
        p.model_copy(
            update={
                "host_slots": host.num_slots[p.pool_group_id],
                "host_requests": host.num_slots[p.pool_group_id] // max(p.blocks_per_request, 1),
            }
        )
        for p in est.pool_groups
    )
    host_requests = min(p.host_requests for p in pools)
    if st is not None:
        host_requests = min(host_requests, host.state_slots)
    return est.model_copy(update={"pool_groups": pools, "host_max_requests": host_requests})


def check_budget(m: Components) -> None:
    """Raise ``InsufficientMemory`` if not one ``max_seq_len`` request fits the budget
    (with the config's prefill chunk and lookahead); the error names the largest
    ``max_seq_len`` that would. Nothing to check with ``num_blocks``."""
    if m.config.memory_bytes is not None:
        m.sizing.check_budget(m.config.memory_bytes, m.slots, int(m.config.null_page))


def num_free_blocks(m: Components, pool_group: int | None = None) -> int:
    """Free slots of ``pool_group``; without one, the blocks a new request can still get
    in every layer group: per pool group its free slots // the layer groups sharing it,
    the least over pool groups (a request takes a block in each layer group at once).
    With context parallelism a request's block b needs a slot of class b mod cp, so a pool
    group with f_c such blocks free in class c gives the longest new request, min over c
    of f_c x cp + c blocks (its positions of class c are ceil((k - c) / cp) <= f_c); with
    ``pool_group`` the slots free in all classes.

    Example: one pool group of 100 free slots shared by a window and a full group: 50.
    With cp 2 and free slots [0, 4] per class: 0 (block 0 needs class 0).
    """
    pools = m.coord.pools
    if pool_group is None:
        return min(
            _request_blocks(m, pool.num_free, pool, len(pg.layer_groups))
            for pool, pg in zip(pools, m.layout.pool_groups, strict=True)
        )
    return pools[_pool_group(m, pool_group)].num_free


def num_total_blocks(m: Components, pool_group: int | None = None) -> int:
    """Usable slots of ``pool_group`` (the null page's is not one); without one, what
    ``num_free_blocks()`` gives on an empty manager (so the two are equal once every
    request is freed)."""
    usable = m.coord.usable_slots()
    if pool_group is None:
        return min(
            _request_blocks(m, usable[pg.pool_group_id], pool, len(pg.layer_groups), True)
            for pool, pg in zip(m.coord.pools, m.layout.pool_groups, strict=True)
        )
    return usable[PoolGroupId(_pool_group(m, pool_group))]


def _request_blocks(m: Components, slots: int, pool: Any, groups: int, usable: bool = False) -> int:
    """Blocks per layer group a new request can get from one pool group: its ``slots`` //
    ``groups``, or per class with context parallelism (``num_free_blocks``), of the free
    slots (or the usable ones)."""
    cp = m.coord.cp
    if cp == 1:
        return slots // groups
    per_class = [p.num_usable if usable else p.num_free for p in pool.classes]
    return min((n // groups) * cp + c for c, n in enumerate(per_class))


def _pool_group(m: Components, pool_group: int) -> int:
    """``pool_group`` if the manager has it (``InvalidArgument`` if not)."""
    if not 0 <= pool_group < len(m.coord.pools):
        raise InvalidArgument(f"no pool group {pool_group}", pool_group=pool_group)
    return pool_group


def stats(m: Components) -> Stats:
    """Requests, blocks per pool group, the prefix cache's and the host tier's counters."""
    free = {i: p.num_free for i, p in enumerate(m.coord.pools)}
    total = {int(k): v for k, v in m.coord.usable_slots().items()}
    cache = m.coord.cache
    st = cache.stats
    return Stats(
        num_requests=len(m.requests.rows),
        free_blocks=free,
        used_blocks={i: total[i] - free[i] for i in free},
        total_blocks=total,
        request_free_blocks=num_free_blocks(m),
        request_total_blocks=num_total_blocks(m),
        prefix_cache=PrefixCacheStats(
            queries=st.queries,
            query_tokens=st.query_tokens,
            hit_tokens=st.hit_tokens,
            hit_rate=st.hit_tokens / st.query_tokens if st.query_tokens else 0.0,
            stored_blocks=st.stored_blocks,
            evictions=st.evictions,
            cached_blocks={i: cache.num_cached(i) for i in free},
        ),
        host_tier=HostTierStats(**host_stats(m)) if m.host is not None else None,
    )


def host_stats(m: Components) -> dict[str, Any]:
    """The host tier's counters and occupancy ({} without one)."""
    host = m.host
    if host is None:
        return {}
    state_used = host.state_slots - len(host.state_free)
    return {
        **asdict(host.stats),
        "host_slots": {int(pg): n for pg, n in host.num_slots.items()},
        "host_used": {int(pg): host.num_used(pg) for pg in host.num_slots},
        "state_host_slots": {g: host.state_slots for g in range(len(host.state_target))},
        "state_host_used": {g: state_used for g in range(len(host.state_target))},
    }


def model_info(manager: Components) -> ModelInfo:
    """The answer of ``register_model`` and ``GET /v1/model``."""
    cfg = manager.config
    return ModelInfo(
        generation=manager.generation,
        config=cfg,
        layout=manager.views.describe(),
        estimate=estimate(manager, cfg.max_seq_len - cfg.max_lookahead),
    )

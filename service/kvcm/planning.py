"""What a manager of a config is before any memory is taken: its device, layout, sizing and
slots per pool group, and the checks construction makes (``kvcm.manager``'s ``_build``, and
a registration before it closes the model it replaces).
"""

from __future__ import annotations

import torch

from kvcm_client.errors import DeviceUnavailable, InsufficientMemory, InvalidArgument
from kvcm_client.models import ManagerConfig

from . import footprint
from .ids import PoolGroupId
from .layout import Layout, build_layout
from .ranks import RankPlan, plan_ranks
from .sizing import Sizing, StepShape
from .state_pools import build_state_groups, state_memory


def resolve_device(name: str) -> torch.device:
    """The torch device ``name`` says, refused before any memory is taken: only cpu and an
    existing cuda[:N] (``InvalidArgument``, ``DeviceUnavailable``)."""
    try:
        device = torch.device(name)
    except RuntimeError as exc:
        raise InvalidArgument(f"unknown device {name!r}", device=name) from exc
    if device.type == "cpu":
        return device
    if device.type != "cuda":
        raise InvalidArgument(f"device must be cpu or cuda[:N], got {name!r}", device=name)
    if not torch.cuda.is_available():
        raise DeviceUnavailable(f"device {name!r} asked for but CUDA is not available")
    index = 0 if device.index is None else device.index
    if index >= torch.cuda.device_count():
        raise DeviceUnavailable(
            f"device {name!r} asked for but only {torch.cuda.device_count()} CUDA devices exist"
        )
    return torch.device("cuda", index)


def _check_null_page_room(slots: dict[PoolGroupId, int]) -> None:
    """Refuse pool groups that the null page, which takes slot 0, would leave no slot."""
    for pg, n in slots.items():
        if n < 2:
            raise InsufficientMemory(
                f"pool group {pg} has {n} slot and the null page takes it: null_page needs "
                "at least 2 slots per pool group",
                pool_group=int(pg),
                num_slots=n,
            )


def plan(
    cfg: ManagerConfig, check_budget: bool = True
) -> tuple[torch.device, Layout, Sizing, dict[PoolGroupId, int], list[RankPlan]]:
    """What a manager of ``cfg`` is, before any memory: device, layout, sizing, slots per
    pool group and its ranks (``kvcm.ranks``; rank 0 is the device and layout). Raises what
    construction refuses (a budget of no slot or, with ``check_budget``, of less than one
    ``max_seq_len`` request; no room for the null page; ranks that do not match)."""
    device = resolve_device(cfg.device)
    layout = build_layout(cfg.layers, cfg.tokens_per_block)
    state = state_memory(cfg)
    shape = StepShape(cfg.max_prefill_chunk, cfg.max_lookahead)
    sizing = Sizing(layout, cfg.max_seq_len, shape, state, cfg.context_parallel)
    if cfg.num_blocks is not None:
        slots = {pg.pool_group_id: cfg.num_blocks for pg in layout.pool_groups}
    else:
        assert cfg.memory_bytes is not None
        if cfg.memory_bytes <= state:
            raise InsufficientMemory(
                f"memory_bytes={cfg.memory_bytes} does not cover the state layers' "
                f"{state} bytes (live slots and checkpoints)",
                memory_bytes=cfg.memory_bytes,
                state_bytes=state,
            )
        slots = sizing.slots_for_budget(cfg.memory_bytes, int(cfg.null_page))
    ranks, slots, limiting = plan_ranks(cfg, layout, slots, resolve_device)
    if cfg.memory_bytes is not None and check_budget:
        rank, limit = (0, sizing) if limiting is None else limiting
        try:
            limit.check_budget(cfg.memory_bytes, slots, int(cfg.null_page))
        except InsufficientMemory as exc:
            if len(ranks) > 1:
                exc.detail["rank"] = rank
            raise
    if cfg.null_page:  # per context-parallel rank: each reserves its own slot 0
        _check_null_page_room({pg: n // cfg.context_parallel for pg, n in slots.items()})
    return device, layout, sizing, slots, ranks


def check_config(cfg: ManagerConfig, freed: tuple[int, int] = (0, 0)) -> None:
    """Everything building ``cfg`` checks, without building it, and that its memory is free
    (``footprint.check_room``, counting ``freed`` as free): what a registration must pass
    before the model it replaces is closed."""
    resolve_device(cfg.device)
    footprint.check_room(cfg, build_layout(cfg.layers, cfg.tokens_per_block), freed)
    plan(cfg)


def host_slots(
    cfg: ManagerConfig, layout: Layout, slots: dict[PoolGroupId, int]
) -> tuple[dict[int, int], int]:
    """Host-tier slots per pool group, and per state group, for ``host_memory_bytes``, split
    in proportion to their device bytes: a pool group's slots, a state group's live slots
    (what a suspend moves; checkpoints stay on the device). Each gets ``floor(share /
    slot_bytes)`` slots, a state group at most ``max_requests`` (no more requests can be
    suspended at once); every state group gets the same number (its share is in proportion
    to its slot bytes). Example: one pool group of 100 slots of 1000 bytes and one state
    group of 4 live slots of 25,000 bytes (100,000 bytes each), 400,000 host bytes: 200 host
    slots for the pool group, 8 for the state group (if max_requests is at least 8)."""
    assert cfg.host_memory_bytes is not None
    budget = cfg.host_memory_bytes
    device = {
        int(pg.pool_group_id): slots[pg.pool_group_id] * pg.slot_bytes for pg in layout.pool_groups
    }
    groups = build_state_groups(cfg.state_layers)
    live = cfg.num_state_live_slots
    total = sum(device.values()) + sum(g.slot_bytes * live for g in groups)
    pools = {
        int(pg.pool_group_id): budget * device[int(pg.pool_group_id)] // total // pg.slot_bytes
        for pg in layout.pool_groups
    }
    states = min(cfg.max_requests, budget * live // total) if groups else 0
    return pools, states

"""The ranks of a tensor- or pipeline-parallel engine that one manager serves (docs/ranks.md).

The ranks of one engine share its schedule: with tensor parallelism every rank holds the same
block ids for the same requests (its own heads of every layer); with pipeline parallelism
each stage holds its own layers, again with the same block ids. So the manager keeps one
bookkeeping (the coordinator: one allocator per pool group, one set of block ids, one set of
host page tables) and, per rank, what lives on that rank's device: the pools of its layers,
its device page tables and its views (``Rank``).

For one allocator to serve every rank, the ranks must agree on what a block id means: the
same layer groups (lifecycles: sliding window, sink blocks, owner, reuse), numbered alike,
and the same layer groups sharing a pool group. Their pools may differ (a stage of 20 layers
has bigger slots than one of 12; tensor parallelism divides heads): each rank sizes its own
slots, and every pool group gets the fewest slots any rank's budget gives it.

Worked example (16-token blocks): an engine with 2 pipeline stages, stage 0 layers 0-1
(window 128, full), stage 1 layers 0-1 (rank-local ids; the same kinds). Both ranks have
layer groups 0 (window) and 1 (full) in pool group 0. A request that grows to 40 tokens gets
slots [5, 6, 7] in group 1: ``m.rank(0).page_table(1)`` and ``m.rank(1).page_table(1)`` hold
them in its row, and slot 5 is a page of stage 0's layer 1 in rank 0's pool and of stage
1's layer 1 in rank 1's.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from kvcm_client.errors import InvalidArgument
from kvcm_client.models import LayerSpec, ManagerConfig, SharedSegment

from .context_parallel import table_width
from .coordinator import Coordinator
from .device_tables import DeviceTables, EditQueues
from .ids import PoolGroupId
from .layout import GroupKey, Layout, build_layout, group_keys
from .pools import PoolMemory
from .shared_memory import CudaSegments, SharedSegments
from .sizing import Sizing, StepShape
from .views import TablesAndViews


@dataclass(frozen=True, slots=True)
class RankPlan:
    """What one rank is before any memory: its device, layout and rank-local config (the
    engine's config with this rank's layers and device)."""

    rank: int
    device: torch.device
    layout: Layout
    config: ManagerConfig


def plan_ranks(
    cfg: ManagerConfig,
    layout: Layout,
    slots: dict[PoolGroupId, int],
    resolve: Callable[[str], torch.device],
) -> tuple[list[RankPlan], dict[PoolGroupId, int], tuple[int, Sizing] | None]:
    """Every rank's plan (rank 0's is ``layout`` on ``cfg.device``), the slots per pool
    group that every rank can hold: with ``memory_bytes`` (a budget per rank), the fewest
    any rank's split gives; and the rank whose split that is, with its sizing, when it is
    not rank 0 (its budget is the one to check). Refuses ranks whose layer groups or pool
    groups do not match rank 0's, or whose devices are of another type
    (``InvalidArgument``)."""
    device0 = resolve(cfg.device)
    plans = [RankPlan(0, device0, layout, cfg)]
    keys = group_keys(layout)
    pool_groups = [g.pool_group for g in layout.layer_groups]
    for rank, spec in enumerate(cfg.ranks[1:], start=1):
        device = resolve(spec.device)
        if device.type != device0.type:
            raise InvalidArgument(
                f"rank {rank} is on {spec.device} and rank 0 on {cfg.device}: all ranks must be "
                "on devices of one type",
                rank=rank,
                device=spec.device,
            )
        try:
            mine = build_layout(spec.layers, cfg.tokens_per_block, keys)
        except ValueError:
            raise InvalidArgument(
                f"rank {rank}'s layer groups (window, sink blocks, owner, reuse) are "
                f"{_keys_of(spec.layers, cfg.tokens_per_block)}, rank 0's {keys}: the ranks "
                "of one engine must have the same kinds of layers",
                rank=rank,
            ) from None
        if [g.pool_group for g in mine.layer_groups] != pool_groups:
            raise InvalidArgument(
                f"rank {rank} shares pool groups between other layer groups than rank 0 "
                "(their pages have other shapes): one allocator cannot serve both",
                rank=rank,
            )
        local = cfg.model_copy(update={"layers": list(spec.layers), "device": spec.device})
        plans.append(RankPlan(rank, device, mine, local))
    limiting = None
    if cfg.memory_bytes is not None and len(plans) > 1:
        shape = StepShape(cfg.max_prefill_chunk, cfg.max_lookahead)
        for plan in plans[1:]:
            sizing = Sizing(plan.layout, cfg.max_seq_len, shape)
            theirs = sizing.slots_for_budget(cfg.memory_bytes, int(cfg.null_page))
            if sum(theirs.values()) < sum(slots.values()):
                limiting = (plan.rank, sizing)
            slots = {pg: min(n, theirs[pg]) for pg, n in slots.items()}
    return plans, slots, limiting


def _keys_of(layers: list[LayerSpec], tokens_per_block: int) -> list[GroupKey]:
    return group_keys(build_layout(layers, tokens_per_block))


@dataclass(frozen=True, slots=True)
class Rank:
    """One rank's memory, device page tables and views (rank 0's are the manager's own)."""

    plan: RankPlan
    memory: PoolMemory
    tables: DeviceTables
    views: TablesAndViews
    table_segment: SharedSegment | None
    """Where a consumer of this rank maps the page tables (with ``share``)."""


def build_rank(
    plan: RankPlan,
    slots: dict[PoolGroupId, int],
    coord: Coordinator,
    queues: EditQueues | None,
    rows_of: Callable[[Sequence[str]], np.ndarray],
    segments: SharedSegments | CudaSegments | None,
    cpu_table_segment: SharedSegment | None,
) -> Rank:
    """Rank ``plan.rank`` (>= 1): its pools on its device (``slots``: its share of them); on
    the CPU it reads the host tables like rank 0 (and maps rank 0's table segment), on CUDA,
    or as a context-parallel rank, it gets tables of its own that take their edits from
    ``queues``. ``segments``: the manager's CPU segments, or a new CUDA one
    per rank (its own device) when sharing."""
    cfg, device = plan.config, plan.device
    memory = PoolMemory(plan.layout, slots, device, segments, cfg.null_page)
    table_segment, table_memory = cpu_table_segment, None
    cp = (cfg.context_parallel, cfg.ranks[plan.rank].cp_rank)
    if segments is not None and (device.type == "cuda" or cp[0] > 1):
        # Tables of its own: on CUDA, or a context-parallel rank's local ones anywhere.
        groups, rows, cols = coord.tables.shape
        width = table_width(cols, cp[0])
        table_segment, table_memory = segments.allocate(4 * groups * rows * width)
    tables = DeviceTables(coord, device, table_memory, queues, plan.rank, cp)
    views = TablesAndViews(cfg, plan.layout, device, memory, slots, coord, tables, rows_of, cp[1])
    return Rank(plan, memory, tables, views, table_segment)

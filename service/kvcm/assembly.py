"""Building a manager: its pools, bookkeeping, tables, views and ranks, from a config.

``KVCacheManager`` is the façade over the components this puts together: the coordinator
(one bookkeeping for every rank), the device tables and the tables-and-views component of
each rank (``kvcm.ranks``), the state pools and the host tier. ``register_model`` builds a
manager anew through here too.
"""

from __future__ import annotations

import uuid
import weakref
from collections.abc import Sequence

import numpy as np
import torch

from kvcm_client.models import ManagerConfig

from . import request_rows, transfers
from .components import Components
from .context_parallel import table_width
from .coordinator import Coordinator
from .device_tables import DeviceTables, EditQueues
from .host_tier import HostTier
from .native_step import NativeDecode
from .planning import host_slots, plan
from .pools import PoolMemory
from .ranks import Rank, build_rank
from .request_table import RequestTable
from .shared_memory import CudaSegments, SharedSegments
from .state_pools import StatePools, build_state_groups
from .step_order import StepOrder
from .table_mirror import TableMirror
from .views import TablesAndViews


def build(config: ManagerConfig, check_budget: bool = True, serial_base: int = 0) -> Components:
    """The components for ``config``; ``serial_base``: the handle serial its rows start from
    (the previous model's last, after a registration)."""
    cfg = config
    device, layout, sizing, slots, rank_plans = plan(cfg, check_budget)
    generation = uuid.uuid4().hex
    segments: SharedSegments | CudaSegments | None = None
    tables_buffer = None
    table_memory = None
    table_segment = None
    if cfg.share:
        segments = (
            SharedSegments(generation) if device.type == "cpu" else CudaSegments(generation, device)
        )
    rank_slots = {pg: n // cfg.context_parallel for pg, n in slots.items()}
    memory = PoolMemory(layout, rank_slots, device, segments, cfg.null_page)
    if segments is not None:
        ng = len(layout.layer_groups)
        # A context-parallel rank shares its own tables (a share of the positions and
        # the always-empty column), not the host's.
        width = table_width(cfg.max_blocks_per_request, cfg.context_parallel)
        table_bytes = 4 * ng * cfg.max_requests * width
        table_segment, table_memory = segments.allocate(table_bytes)
        if device.type == "cpu" and cfg.context_parallel == 1:
            tables_buffer = table_memory.numpy().data  # the host tables are the shared ones
    coord = Coordinator(
        layout,
        slots,
        cfg.max_requests,
        cfg.max_blocks_per_request,
        tables_buffer,
        cfg.null_page,
        cfg.kv_events,
        cfg.kv_event_buffer,
        cfg.context_parallel,
    )
    requests = RequestTable(cfg.max_requests, serial_base)
    #: Several ranks on CUDA, or context-parallel ranks (tables of their own pages): each
    #: rank's device tables take the edits from a queue.
    queues = (
        EditQueues(coord, len(rank_plans))
        if len(rank_plans) > 1 and (device.type == "cuda" or cfg.context_parallel > 1)
        else None
    )
    # Stream-ordered steps (kvcm.step_order): shared CUDA tables of one rank, whose edits
    # one stream applies.
    order = (
        StepOrder(segments.index)
        if isinstance(segments, CudaSegments) and len(rank_plans) == 1 and cfg.context_parallel == 1
        else None
    )
    tables = DeviceTables(
        coord,
        device,
        None if tables_buffer is not None else table_memory,
        queues,
        cp=(cfg.context_parallel, 0),
        order=order,
    )
    state = (
        StatePools(
            build_state_groups(cfg.state_layers),
            cfg.max_requests,
            cfg.num_state_live_slots,
            cfg.num_state_checkpoints,
            cfg.state_checkpoint_stride,
            device,
            segments,
        )
        if cfg.state_layers
        else None
    )
    host = None
    if cfg.host_memory_bytes is not None:
        pool_slots, state_slots = host_slots(cfg, layout, slots)
        host = HostTier(
            layout,
            memory.tensors,
            pool_slots,
            device,
            coord.cache.log,
            [] if state is None else state.memory,
            state_slots,
        )
    coord.host = host
    # The views and other ranks map request ids to rows through the components, held
    # weakly: no cycle keeps the pools alive past the manager (the server freezes the
    # collector).
    rows_of = _WeakRowsOf()
    views = TablesAndViews(cfg, layout, device, memory, rank_slots, coord, tables, rows_of)
    ranks = [
        Rank(rank_plans[0], memory, tables, views, table_segment),
        *(
            build_rank(
                p,
                rank_slots,
                coord,
                queues,
                rows_of,
                _rank_segments(segments, generation, p.device),
                table_segment,
            )
            for p in rank_plans[1:]
        ),
    ]
    parts = Components(
        config=cfg,
        device=device,
        layout=layout,
        sizing=sizing,
        slots=slots,
        rank_slots=rank_slots,
        tokens_per_block=cfg.tokens_per_block,
        max_blocks_per_request=cfg.max_blocks_per_request,
        max_step_tokens=cfg.max_requests * cfg.max_seq_len,
        generation=generation,
        segments=segments,
        table_segment=table_segment,
        memory=memory,
        coord=coord,
        requests=requests,
        native_decode=NativeDecode(cfg.max_requests, len(layout.layer_groups)),
        tables=tables,
        windows=[(g.sliding_window, g.sink_blocks) for g in layout.layer_groups],
        state=state,
        state_slot=(
            np.full(cfg.max_requests, -1, dtype=np.int64) if state is None else state.slot_of
        ),
        host=host,
        views=views,
        ranks=ranks,
        mirror=TableMirror(coord),
    )
    rows_of.bind(parts)
    if cfg.transfer is not None:
        try:
            parts.transfers = transfers.build(parts)
        except BaseException:
            if parts.segments is not None:
                parts.segments.close()
            raise
    return parts


class _WeakRowsOf:
    """``request_rows.rows_of`` of a ``Components`` held weakly (bound once it is built)."""

    __slots__ = ("ref",)

    def __init__(self) -> None:
        self.ref: weakref.ref[Components] | None = None

    def bind(self, parts: Components) -> None:
        self.ref = weakref.ref(parts)

    def __call__(self, request_ids: Sequence[str]) -> np.ndarray:
        assert self.ref is not None
        parts = self.ref()
        assert parts is not None, "the manager is gone"
        return request_rows.rows_of(parts, request_ids)


def _rank_segments(
    segments: SharedSegments | CudaSegments | None, generation: str, device: torch.device
) -> SharedSegments | CudaSegments | None:
    """Where a rank's shared pools go: the manager's CPU segments, a CUDA set per rank."""
    if segments is None or device.type == "cpu":
        return segments
    return CudaSegments(generation, device)

"""Building a manager: its pools, bookkeeping, tables, views and ranks, from a config.

``KVCacheManager`` is the façade over the components this puts together: the coordinator
(one bookkeeping for every rank), the device tables and the tables-and-views component of
each rank (``kvcm.ranks``), the state pools and the host tier. ``register_model`` builds a
manager anew through here too.
"""

from __future__ import annotations

import uuid
import weakref
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import numpy as np
import torch

from kvcm_client.models import ManagerConfig

from .context_parallel import table_width
from .coordinator import Coordinator
from .device_tables import DeviceTables, EditQueues
from .host_tier import HostTier
from .native_step import NativeDecode
from .planning import host_slots, plan
from .pools import PoolMemory
from .ranks import Rank, build_rank
from .shared_memory import CudaSegments, SharedSegments
from .state_pools import StatePools, build_state_groups
from .views import TablesAndViews

if TYPE_CHECKING:
    from .manager import KVCacheManager


def build(
    m: KVCacheManager, config: ManagerConfig, check_budget: bool = True, serial_base: int = 0
) -> None:
    """Set everything ``m`` holds for ``config``; ``serial_base``: the handle serial its
    rows start from (the previous model's last, after a registration)."""
    m.config = cfg = config
    m.device, m.layout, m._sizing, m._slots, rank_plans = plan(cfg, check_budget)
    m.tokens_per_block = cfg.tokens_per_block
    m.max_blocks_per_request = cfg.max_blocks_per_request
    #: Most positions one step can map (every row at ``max_seq_len``): the bound of a slot
    #: mapping's ``pad_to``, whose output is allocated up front (int64 per group).
    m.max_step_tokens = cfg.max_requests * cfg.max_seq_len
    #: Changes at every construction: shared descriptors of another one are refused.
    m.generation = uuid.uuid4().hex
    m._segments = None
    tables_buffer = None
    table_memory = None
    if cfg.share:
        m._segments = (
            SharedSegments(m.generation)
            if m.device.type == "cpu"
            else CudaSegments(m.generation, m.device)
        )
    #: Slots each rank's pools hold: all of them, or a context-parallel rank's share.
    m._rank_slots = {pg: n // cfg.context_parallel for pg, n in m._slots.items()}
    m.memory = PoolMemory(m.layout, m._rank_slots, m.device, m._segments, cfg.null_page)
    if m._segments is not None:
        ng = len(m.layout.layer_groups)
        # A context-parallel rank shares its own tables (a share of the positions and
        # the always-empty column), not the host's.
        width = table_width(m.max_blocks_per_request, cfg.context_parallel)
        table_bytes = 4 * ng * cfg.max_requests * width
        m._table_segment, table_memory = m._segments.allocate(table_bytes)
        if m.device.type == "cpu" and cfg.context_parallel == 1:
            tables_buffer = table_memory.numpy().data  # the host tables are the shared ones
    m._coord = Coordinator(
        m.layout,
        m._slots,
        cfg.max_requests,
        m.max_blocks_per_request,
        tables_buffer,
        cfg.null_page,
        cfg.kv_events,
        cfg.kv_event_buffer,
        cfg.context_parallel,
    )
    m._rows = {}
    m._free_rows = list(range(cfg.max_requests - 1, -1, -1))
    #: Each row's request id and handle (None and -1 when free: no handle a caller passes
    #: can equal -1 with a row below max_requests), and the row's allocations so far (a
    #: handle's serial: kvcm.request_rows).
    m._ids = [None] * cfg.max_requests
    m._handle = np.full(cfg.max_requests, -1, dtype=np.int64)
    m._serial = np.full(cfg.max_requests, serial_base, dtype=np.int64)
    #: Scratch for the distinct-rows check of a batch of extends.
    m._order = np.arange(cfg.max_requests, dtype=np.int64)
    m._scratch = np.zeros(cfg.max_requests, dtype=np.int64)
    m._native_decode = NativeDecode(cfg.max_requests, len(m.layout.layer_groups))
    m._first = {}
    m._prefix = {}
    #: Tokens each row got from the prefix cache at allocation.
    m._hits = np.zeros(cfg.max_requests, dtype=np.int64)
    #: Committed token ids per request, and their count per row (for batch results).
    #: (Committed ids as int32 bytes: a commit appends its checked bytes, a rewind cuts
    #: them, and no Python int is made per token; ``committed_tokens`` decodes them.)
    m._tokens = {}
    m._committed = np.zeros(cfg.max_requests, dtype=np.int64)
    #: Undo actions for token-list edits while an all-or-nothing step runs.
    m._undo = None
    #: Several ranks on CUDA, or context-parallel ranks (tables of their own pages): each
    #: rank's device tables take the edits from a queue.
    queues = (
        EditQueues(m._coord, len(rank_plans))
        if len(rank_plans) > 1 and (m.device.type == "cuda" or cfg.context_parallel > 1)
        else None
    )
    m._tables = DeviceTables(
        m._coord,
        m.device,
        None if tables_buffer is not None else table_memory,
        queues,
        cp=(cfg.context_parallel, 0),
    )
    m._windows = [(g.sliding_window, g.sink_blocks) for g in m.layout.layer_groups]
    #: State layers (docs/state-layers.md): live slots, checkpoints; None without.
    m._state = (
        StatePools(
            build_state_groups(cfg.state_layers),
            cfg.max_requests,
            cfg.num_state_live_slots,
            cfg.num_state_checkpoints,
            cfg.state_checkpoint_stride,
            m.device,
            m._segments,
        )
        if cfg.state_layers
        else None
    )
    #: Each row's live state slot (-1: none); the state pools' own array when there are
    #: state layers.
    m._state_slot = (
        np.full(cfg.max_requests, -1, dtype=np.int64) if m._state is None else m._state.slot_of
    )
    m._host = None
    if cfg.host_memory_bytes is not None:
        pool_slots, state_slots = host_slots(cfg, m.layout, m._slots)
        m._host = HostTier(
            m.layout,
            m.memory.tensors,
            pool_slots,
            m.device,
            m._coord.cache.log,
            [] if m._state is None else m._state.memory,
            state_slots,
        )
    m._coord.host = m._host
    #: Suspended requests: their blocks' positions and host slots per layer group.
    m._suspended = {}
    #: The handle each suspended request gets back, to its id (a resume by handle).
    m._suspended_handles = {}
    m._views = TablesAndViews(
        cfg,
        m.layout,
        m.device,
        m.memory,
        m._rank_slots,
        m._coord,
        m._tables,
        _weak(m._rows_of),
    )
    table_segment = m._table_segment if m._segments is not None else None
    m._ranks = [
        Rank(rank_plans[0], m.memory, m._tables, m._views, table_segment),
        *(
            build_rank(
                p,
                m._rank_slots,
                m._coord,
                queues,
                _weak(m._rows_of),
                _rank_segments(m, p.device),
                table_segment,
            )
            for p in rank_plans[1:]
        ),
    ]


def _weak(method: Callable[[Sequence[str]], np.ndarray]) -> Callable[[Sequence[str]], np.ndarray]:
    """``method`` holding its object weakly: a component the manager owns keeps no cycle back
    to it, so its pools go with its last reference (the server freezes the collector)."""
    ref = weakref.WeakMethod(method)

    def call(request_ids: Sequence[str]) -> np.ndarray:
        bound = ref()
        assert bound is not None, "the manager is gone"
        return bound(request_ids)

    return call


def _rank_segments(m: KVCacheManager, device: torch.device) -> SharedSegments | CudaSegments | None:
    """Where a rank's shared pools go: the manager's CPU segments, a CUDA set per rank."""
    if m._segments is None or device.type == "cpu":
        return m._segments
    return CudaSegments(m.generation, device)

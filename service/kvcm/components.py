"""The components a ``KVCacheManager`` composes, in one record that the manager's operation
modules take (``kvcm.allocation``, ``kvcm.commits``, ``kvcm.columnar``, ...).

Each field is a component that owns its state and changes it through its methods: the
coordinator its block tables and references (and through it the block pools and the prefix
cache), the request table its rows, handles, tokens, commits and suspension records, the host
tier its slots and copies, the state pools their slots, the device tables and views theirs.
``kvcm.assembly`` builds the record; nothing replaces a field afterwards (``register_model``
builds a new record). The rest are the plan the components were built from: config, layout,
sizes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

if TYPE_CHECKING:
    from kvcm_client.models import ManagerConfig

    from .coordinator import Coordinator
    from .device_tables import DeviceTables
    from .host_tier import HostTier
    from .ids import PoolGroupId
    from .layout import Layout
    from .native_step import NativeDecode
    from .pools import PoolMemory
    from .ranks import Rank
    from .request_table import RequestTable
    from .shared_memory import CudaSegments, SharedSegments
    from .sizing import Sizing
    from .state_pools import StatePools
    from .table_mirror import TableMirror
    from .transfer_state import Transfers
    from .views import TablesAndViews


@dataclass(slots=True, eq=False, weakref_slot=True)
class Components:
    """One manager's components (module docstring)."""

    config: ManagerConfig
    device: torch.device
    layout: Layout
    sizing: Sizing
    #: Slots of each pool group, and each rank's share (all of them, or a context-parallel
    #: rank's).
    slots: dict[PoolGroupId, int]
    rank_slots: dict[PoolGroupId, int]
    tokens_per_block: int
    max_blocks_per_request: int
    #: Most positions one step can map (every row at ``max_seq_len``): the bound of a slot
    #: mapping's ``pad_to``, whose output is allocated up front (int64 per group).
    max_step_tokens: int
    #: Changes at every construction: shared descriptors of another one are refused.
    generation: str
    segments: SharedSegments | CudaSegments | None
    table_segment: object | None
    memory: PoolMemory
    coord: Coordinator
    requests: RequestTable
    native_decode: NativeDecode
    tables: DeviceTables
    #: Each layer group's (sliding window, sink blocks).
    windows: list[tuple[int | None, int]]
    #: State layers (docs/state-layers.md): live slots, checkpoints; None without.
    state: StatePools | None
    #: Each row's live state slot (-1: none); the state pools' own array when there are
    #: state layers.
    state_slot: np.ndarray
    host: HostTier | None
    views: TablesAndViews
    ranks: list[Rank]
    #: The shadow of the host tables that ``step_columns(table_edits=True)`` diffs against.
    mirror: TableMirror
    #: The transfer endpoint (``kvcm.transfers``): None unless the config asks for one.
    #: Set once by ``kvcm.assembly`` after the pools exist (it registers them).
    transfers: Transfers | None = None

    def settle(self) -> None:
        """Complete the copies the op queued: the host tier's (kvcm.tier_copies) and the
        state layers' (kvcm.state_pools).

        A step queues its copies and launches them in batches; its caller may write a slot
        the step evicted, or read a block it onboarded, as soon as it answers, so every
        public op that can take or give back slots settles before it answers, also when it
        raises.
        """
        if self.host is not None:
            self.host.copier.finish()
        if self.state is not None:
            self.state.flush()

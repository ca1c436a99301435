"""The layout a manager describes (``describe``) and the descriptors a consumer of its shared
pools maps (``shared_layout``): ``TablesAndViews`` inherits ``LayoutDescriptors``."""

from __future__ import annotations

from typing import Any

import torch

from kvcm_client.models import (
    BufferInfo,
    DroppedLayer,
    LayerGroupInfo,
    ManagerConfig,
    PoolGroupInfo,
    PoolInfo,
    SharedBuffer,
    SharedLayout,
    SharedSegment,
)
from kvcm_client.models import Layout as LayoutInfo

from .ids import PoolGroupId
from .layout import Layout
from .pools import PoolMemory, role_dtype
from .shared_memory import strided


class LayoutDescriptors:
    """Mixin of ``TablesAndViews`` (its layout, memory, device tables, pointers and
    ``sync_tables``)."""

    config: ManagerConfig
    cp: int
    cp_rank: int
    layout: Layout
    device: torch.device
    memory: PoolMemory
    tokens_per_block: int
    max_blocks_per_request: int
    role_index: dict[str, int]
    _slots: dict[PoolGroupId, int]
    _tables: Any
    _layer_pointers: torch.Tensor

    def describe(self) -> LayoutInfo:
        """Layer groups, pool groups, pools and every (layer, role) buffer with its address;
        ``roles`` is the role index order of the pointer tables, ``dropped_layers`` the layers
        without KV cache."""
        lay = self.layout
        pointers = self._layer_pointers.cpu()
        buffers = []
        for (lid, role), place in lay.placements.items():
            layer = lay.layers[lid]
            view = self.memory.layer_view(lid, role)
            buffers.append(
                BufferInfo(
                    layer_id=lid,
                    role=role,
                    layer_group=place.layer_group,
                    pool=place.pool,
                    offset_bytes=place.offset_bytes,
                    bytes_per_block=place.bytes_per_buffer,
                    page_stride_bytes=lay.pools[place.pool].slot_bytes,
                    base_address=int(pointers[lid, self.role_index[role]]),
                    shape=tuple(view.shape),
                    dtype=str(role_dtype(layer, role)).removeprefix("torch."),
                )
            )
        buffers.sort(key=lambda b: (b.layer_id, self.role_index[b.role]))
        return LayoutInfo(
            tokens_per_block=lay.tokens_per_block,
            device=str(self.device),
            max_requests=self.config.max_requests,
            max_blocks_per_request=self.max_blocks_per_request,
            context_parallel=self.cp,
            cp_rank=self.cp_rank,
            page_table_width=int(self._tables.tensor.shape[2]),
            roles=lay.roles,
            layer_groups=tuple(
                LayerGroupInfo(
                    group_id=g.group_id,
                    pool_group=g.pool_group,
                    layer_ids=tuple(layer.layer_id for layer in g.layers),
                    sliding_window=g.sliding_window,
                    sink_blocks=g.sink_blocks,
                    owner=g.owner,
                    reuse=g.reuse,
                    bytes_per_token=g.bytes_per_token,
                )
                for g in lay.layer_groups
            ),
            pool_groups=tuple(
                PoolGroupInfo(
                    pool_group_id=pg.pool_group_id,
                    layer_groups=pg.layer_groups,
                    pools=pg.pools,
                    num_slots=self._slots[pg.pool_group_id],
                    slot_bytes=pg.slot_bytes,
                )
                for pg in lay.pool_groups
            ),
            pools=tuple(
                PoolInfo(
                    pool_id=p.pool_id,
                    pool_group=p.pool_group,
                    kind=p.kind,
                    kv_factor=p.kv_factor,
                    num_buffers=p.num_buffers,
                    bytes_per_buffer=p.bytes_per_buffer,
                    slot_bytes=p.slot_bytes,
                    num_slots=self._slots[p.pool_group],
                    nbytes=self._slots[p.pool_group] * p.slot_bytes,
                    base_address=self.memory.base_address(p.pool_id),
                )
                for p in lay.pools
            ),
            buffers=tuple(buffers),
            dropped_layers=tuple(
                DroppedLayer(layer_id=lid, reason=reason) for lid, reason in lay.dropped.items()
            ),
            null_page=self.config.null_page,
        )

    def shared_layout(self, generation: str, page_tables: SharedSegment) -> SharedLayout:
        """The descriptors a consumer maps (``KVCacheManager.pools``): every (layer, role)
        view with its strides, the pools' segments and ``page_tables``, the segment of the
        page tables (up to date: they are synced first)."""
        lay = self.layout
        buffers = []
        for (lid, role), place in sorted(
            lay.placements.items(), key=lambda kv: (kv[0][0], self.role_index[kv[0][1]])
        ):
            buffers.append(
                SharedBuffer(
                    layer_id=lid,
                    role=role,
                    layer_group=place.layer_group,
                    pool=place.pool,
                    **strided(self.memory.layer_view(lid, role)),
                )
            )
        self.sync_tables()  # CUDA: what a consumer maps is up to date
        tables = self._tables.tensor
        return SharedLayout(
            generation=generation,
            device=str(self.device),
            tokens_per_block=self.tokens_per_block,
            layers=list(self.config.layers),
            layer_group_of={
                int(layer.layer_id): int(g.group_id) for g in lay.layer_groups for layer in g.layers
            },
            pools=list(self.memory.segments),
            buffers=buffers,
            page_tables=page_tables,
            page_table_shape=tuple(tables.shape),
            null_page=self.config.null_page,
            context_parallel=self.cp,
            cp_rank=self.cp_rank,
        )

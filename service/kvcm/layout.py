"""Grouping of layers into layer groups, pools and pool groups (DESIGN.md section 3).

Pure bookkeeping: no memory is touched here, so sizing can run before anything is allocated.

- A *layer group* is the set of layers whose blocks are born and die together: equal
  (sliding_window, sink blocks, owner, reuse). A request owns one block list per layer group.
- Inside a layer group, buffers with equal (coalescing_group, kind, kv_factor, bytes per block)
  share a *pool*: slot s holds all of them, layer order then role order (K0 V0 K1 V1 ...).
  kv_factor is part of the key (a refinement of DESIGN.md) so that the kernel-mode index
  slot x num_buffers / kv_factor is always a whole number.
- The pools of a layer group are in a canonical order: data before scale, then kv_factor,
  bytes per buffer and buffer count, largest first, then coalescing group. The order in which
  a group lists its layers (or dtypes) does not change it, so two groups with the same pools
  have the same *pool signature* (the tuple of their pools' shape keys).
- Layer groups with the same pool signature share one *pool group*: the same physical memory
  and one slot allocator, so blocks move between them on demand. Their pools are matched by
  position in that canonical order.
- A layer's buffers are its roles (``LayerSpec.buffers``): key, value, its extra buffers
  (key-only pages, kv_factor 1, e.g. a sparse-attention indexer's keys) and nvfp4 scales.
  Extra buffers pool like any other buffer of their layer group.
- A layer without KV heads (``num_kv_heads`` 0, attention-free) has no buffers: it is left
  out of every group and listed in ``Layout.dropped`` with the reason ``no_kv_heads``.
- ``Layout.roles`` is the role index order of the pointer tables: ``ROLES`` (key, value,
  key_scale, value_scale), then the sorted distinct extra roles of the kept layers. It
  depends only on which role names the model has, not on layer order.

Worked example (tokens_per_block 16): layers 0..3 alternate window-128 and full attention, all
8 heads x 128 dims bf16 key/value. Layer group 0 = {0, 2} (window), 1 = {1, 3} (full). Each has
one pool of 4 buffers (K V K V) of 16 * 8 * 128 * 2 = 32 KiB, so the slot layouts match and
both groups live in pool group 0 with slot_bytes 128 KiB. Had group 0 been {fp8 layer 0,
bf16 layer 2} and group 1 {bf16 layer 1, fp8 layer 3}, both would still list the bf16 pool
(2 buffers of 32 KiB) before the fp8 pool (2 of 16 KiB) and share one pool group.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from kvcm_client.models import ROLES, LayerSpec, Role

from .ids import LayerGroupId, LayerId, PoolGroupId, PoolId

PoolKind = Literal["data", "scale"]


@dataclass(frozen=True, slots=True)
class PoolLayout:
    """One pool of a layer group: the buffers that share a slot, in slot order."""

    kind: PoolKind
    kv_factor: int
    bytes_per_buffer: int
    coalescing_group: int
    buffers: tuple[tuple[LayerId, Role], ...]

    @property
    def num_buffers(self) -> int:
        return len(self.buffers)

    @property
    def slot_bytes(self) -> int:
        return self.num_buffers * self.bytes_per_buffer

    @property
    def shape_key(self) -> tuple[str, int, int, int]:
        """What must match for two layer groups to share this pool's memory."""
        return (self.kind, self.kv_factor, self.bytes_per_buffer, self.num_buffers)

    @property
    def order_key(self) -> tuple[bool, int, int, int, int]:
        """The canonical position of the pool in its layer group (see the module docstring)."""
        return (
            self.kind == "scale",
            -self.kv_factor,
            -self.bytes_per_buffer,
            -self.num_buffers,
            self.coalescing_group,
        )


@dataclass(frozen=True, slots=True)
class LayerGroupLayout:
    group_id: LayerGroupId
    pool_group: PoolGroupId
    layers: tuple[LayerSpec, ...]
    sliding_window: int | None
    sink_blocks: int
    owner: str
    reuse: str
    pools: tuple[PoolLayout, ...]
    physical_pools: tuple[PoolId, ...]
    """Physical pool of each entry of ``pools`` (same order)."""

    @property
    def bytes_per_token(self) -> int:
        return sum(buf.bytes_per_token for layer in self.layers for buf in layer.buffers())


@dataclass(frozen=True, slots=True)
class PhysicalPool:
    """One raw allocation: ``num_slots`` x ``slot_bytes``, shared by a pool group's groups."""

    pool_id: PoolId
    pool_group: PoolGroupId
    kind: PoolKind
    kv_factor: int
    bytes_per_buffer: int
    num_buffers: int

    @property
    def slot_bytes(self) -> int:
        return self.num_buffers * self.bytes_per_buffer


@dataclass(frozen=True, slots=True)
class PoolGroupLayout:
    pool_group_id: PoolGroupId
    layer_groups: tuple[LayerGroupId, ...]
    pools: tuple[PoolId, ...]
    slot_bytes: int
    """Bytes one slot takes across all of the group's pools (data and scale)."""


@dataclass(frozen=True, slots=True)
class BufferPlacement:
    """Where (layer, role) lives: pool, buffer index in the slot and kernel-mode page offset.

    ``page_offset`` is the layer's page index inside the slot for kernels that see the pool as
    an array of ``[kv_factor, tokens_per_block, heads, head_dim]`` pages: buffer index //
    kv_factor. In a pool K0 V0 K1 V1, layer 1's key is buffer 2, page offset 1.
    """

    layer_id: LayerId
    role: Role
    layer_group: LayerGroupId
    pool: PoolId
    buffer_index: int
    bytes_per_buffer: int
    kv_factor: int
    num_buffers: int

    @property
    def offset_bytes(self) -> int:
        return self.buffer_index * self.bytes_per_buffer

    @property
    def page_offset(self) -> int:
        return self.buffer_index // self.kv_factor


@dataclass(frozen=True, slots=True)
class Layout:
    tokens_per_block: int
    layer_groups: tuple[LayerGroupLayout, ...]
    pool_groups: tuple[PoolGroupLayout, ...]
    pools: tuple[PhysicalPool, ...]
    placements: dict[tuple[LayerId, Role], BufferPlacement]
    layers: dict[LayerId, LayerSpec]
    """The layers that have buffers (dropped layers are not here)."""
    dropped: dict[LayerId, str]
    """Layers left out of the layout, with the reason code (``no_kv_heads``)."""
    roles: tuple[Role, ...]
    """Role index order of the pointer tables (see the module docstring)."""

    @property
    def num_layer_ids(self) -> int:
        """Rows of the per-layer tables: every layer id of the config, dropped ones included."""
        return max([*self.layers, *self.dropped]) + 1


#: A layer group's lifecycle: (sliding window, sink blocks, owner, reuse).
GroupKey = tuple[int | None, int, str, str]


def _group_key(layer: LayerSpec, tokens_per_block: int) -> GroupKey:
    sink_blocks = -(-layer.sink_tokens // tokens_per_block)
    return (layer.sliding_window, sink_blocks, layer.owner, layer.reuse)


def _pools_of(layers: list[LayerSpec], tokens_per_block: int) -> tuple[PoolLayout, ...]:
    buckets: dict[tuple[int, str, int, int], list[tuple[LayerId, Role]]] = {}
    for layer in layers:
        for buf in layer.buffers():
            bpb = buf.bytes_per_token * tokens_per_block
            key = (layer.coalescing_group, buf.kind, buf.kv_factor, bpb)
            buckets.setdefault(key, []).append((LayerId(layer.layer_id), buf.role))
    pools = (
        PoolLayout(
            kind=kind,  # type: ignore[arg-type]
            kv_factor=kv,
            bytes_per_buffer=bpb,
            coalescing_group=cg,
            buffers=tuple(bufs),
        )
        for (cg, kind, kv, bpb), bufs in buckets.items()
    )
    return tuple(sorted(pools, key=lambda pool: pool.order_key))


def role_order(layers: list[LayerSpec]) -> tuple[Role, ...]:
    """``ROLES``, then the sorted distinct extra roles (e.g. index_key) of ``layers``."""
    extra = {role for layer in layers for role in layer.roles() if role not in ROLES}
    return (*ROLES, *sorted(extra))


def group_keys(layout: Layout) -> list[GroupKey]:
    """Each layer group's lifecycle (sliding window, sink blocks, owner, reuse), in order."""
    return [(g.sliding_window, g.sink_blocks, g.owner, g.reuse) for g in layout.layer_groups]


def build_layout(
    layers: list[LayerSpec], tokens_per_block: int, group_order: list[GroupKey] | None = None
) -> Layout:
    """The layout of ``layers``; layer groups are numbered in the order their first layers
    come, or by ``group_order`` (another rank's ``group_keys``, which must list the same
    lifecycles: ``ValueError`` otherwise), so that the ranks of one engine agree on ids."""
    dropped = {LayerId(s.layer_id): "no_kv_heads" for s in layers if not s.num_kv_heads}
    ordered = sorted((spec for spec in layers if spec.num_kv_heads), key=lambda spec: spec.layer_id)
    by_key: dict[GroupKey, list[LayerSpec]] = {}
    for layer in ordered:
        by_key.setdefault(_group_key(layer, tokens_per_block), []).append(layer)
    if group_order is not None:
        if sorted(by_key, key=repr) != sorted(group_order, key=repr):
            raise ValueError(f"layer groups {list(by_key)} are not {group_order}")
        by_key = {key: by_key[key] for key in group_order}

    # Pool groups: layer groups with the same pool signature (canonical order) share memory.
    signatures: dict[tuple[tuple[str, int, int, int], ...], PoolGroupId] = {}
    members: dict[PoolGroupId, list[LayerGroupId]] = {}
    grouped: list[tuple[GroupKey, list[LayerSpec], tuple[PoolLayout, ...]]]
    grouped = [(key, group, _pools_of(group, tokens_per_block)) for key, group in by_key.items()]
    for gid, (_, _, pools) in enumerate(grouped):
        sig = tuple(pool.shape_key for pool in pools)
        pg = signatures.setdefault(sig, PoolGroupId(len(signatures)))
        members.setdefault(pg, []).append(LayerGroupId(gid))

    physical: list[PhysicalPool] = []
    pool_groups: list[PoolGroupLayout] = []
    for sig, pg in signatures.items():
        ids = []
        for kind, kv, bpb, nbuf in sig:
            pid = PoolId(len(physical))
            physical.append(PhysicalPool(pid, pg, kind, kv, bpb, nbuf))  # type: ignore[arg-type]
            ids.append(pid)
        slot_bytes = sum(physical[p].slot_bytes for p in ids)
        pool_groups.append(PoolGroupLayout(pg, tuple(members[pg]), tuple(ids), slot_bytes))

    layer_groups: list[LayerGroupLayout] = []
    placements: dict[tuple[LayerId, Role], BufferPlacement] = {}
    for gid, ((window, sink_blocks, owner, reuse), group, pools) in enumerate(grouped):
        sig = tuple(pool.shape_key for pool in pools)
        pg = signatures[sig]
        phys = pool_groups[pg].pools
        layer_groups.append(
            LayerGroupLayout(
                group_id=LayerGroupId(gid),
                pool_group=pg,
                layers=tuple(group),
                sliding_window=window,
                sink_blocks=sink_blocks,
                owner=owner,
                reuse=reuse,
                pools=pools,
                physical_pools=phys,
            )
        )
        for pool, pid in zip(pools, phys, strict=True):
            for index, (lid, role) in enumerate(pool.buffers):
                placements[(lid, role)] = BufferPlacement(
                    layer_id=lid,
                    role=role,
                    layer_group=LayerGroupId(gid),
                    pool=pid,
                    buffer_index=index,
                    bytes_per_buffer=pool.bytes_per_buffer,
                    kv_factor=pool.kv_factor,
                    num_buffers=pool.num_buffers,
                )
    return Layout(
        tokens_per_block=tokens_per_block,
        layer_groups=tuple(layer_groups),
        pool_groups=tuple(pool_groups),
        pools=tuple(physical),
        placements=placements,
        layers={LayerId(spec.layer_id): spec for spec in ordered},
        dropped=dropped,
        roles=role_order(ordered),
    )

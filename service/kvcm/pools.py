"""The KV memory: one raw byte allocation per physical pool, and typed views that alias it.

A pool is ``num_slots x slot_bytes`` bytes; slot s holds the pool's buffers in slot order, each
``bytes_per_buffer`` long. The view of (layer, role) starts at the buffer's offset and steps
by the whole slot, so ``view[s]`` is that layer's page in slot s and a write through the view
lands in the pool.

Worked example: a pool K0 V0 K1 V1 of 2 heads x 4 dims fp16, 16 tokens per block: each buffer is
16 * 2 * 4 * 2 = 256 bytes, a slot 1024 bytes. ``layer_view(1, "value")`` starts at byte 768
and has strides (512, 8, 4, 1) in fp16 elements.

nvfp4 data views are uint8 with a last dimension of head_dim / 2 (two values per byte);
scale views are float8_e4m3fn ``[num_slots, tokens_per_block, heads * head_dim / 16]``.
Extra buffers (e.g. ``index_key``) are viewed like a key, with their own heads, head_dim and
dtype.

With the null page, slot 0 of every pool is zeroed here and then never written: it is never
handed out, slot mappings never point into it and token copies skip it. Tile-reading kernels
load it for every missing page and mask only the scores; a masked weight of 0 times a NaN value
is still NaN, so the page must hold finite values in every dtype, and zero bytes are that
(private pools come from ``torch.empty``, whose bytes could be anything).
"""

from __future__ import annotations

import torch

from kvcm_client.models import NVFP4_GROUP, LayerSpec, Role, SharedSegment

from .ids import LayerId, PoolGroupId
from .layout import BufferPlacement, Layout
from .shared_memory import CudaSegments, SharedSegments

TORCH_DTYPES: dict[str, torch.dtype] = {
    "fp32": torch.float32,
    "fp16": torch.float16,
    "bf16": torch.bfloat16,
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
    "nvfp4": torch.uint8,
}
SCALE_DTYPE = torch.float8_e4m3fn


def role_dtype(layer: LayerSpec, role: Role) -> torch.dtype:
    buf = layer.buffer(role)
    return SCALE_DTYPE if buf.kind == "scale" else TORCH_DTYPES[buf.dtype]


def token_shape(layer: LayerSpec, role: Role) -> tuple[int, ...]:
    """Shape of one token's entry of (layer, role), in elements of ``role_dtype``."""
    buf = layer.buffer(role)
    if buf.kind == "scale":
        return (buf.num_heads * buf.head_dim // NVFP4_GROUP,)
    if buf.dtype == "nvfp4":
        return (buf.num_heads, buf.head_dim // 2)
    return (buf.num_heads, buf.head_dim)


def _contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides, acc = [], 1
    for dim in reversed(shape):
        strides.append(acc)
        acc *= dim
    return tuple(reversed(strides))


class PoolMemory:
    """One raw allocation per pool; from named shared-memory segments when ``segments``."""

    def __init__(
        self,
        layout: Layout,
        slots: dict[PoolGroupId, int],
        device: torch.device,
        segments: SharedSegments | CudaSegments | None = None,
        null_page: bool = False,
    ) -> None:
        self.layout = layout
        self.device = device
        self.segments: list[SharedSegment] = []
        self.tensors = []
        for pool in layout.pools:
            shape = (slots[pool.pool_group], pool.slot_bytes)
            if segments is None:
                self.tensors.append(torch.empty(shape, dtype=torch.uint8, device=device))
                continue
            segment, raw = segments.allocate(shape[0] * shape[1])
            self.segments.append(segment)
            self.tensors.append(raw.view(shape))
        if null_page:
            for tensor in self.tensors:
                tensor[0].zero_()

    def base_address(self, pool_id: int) -> int:
        return self.tensors[pool_id].data_ptr()

    def _view(self, place: BufferPlacement, roles_in_page: int) -> torch.Tensor:
        layer = self.layout.layers[place.layer_id]
        dtype = role_dtype(layer, place.role)
        pool = self.tensors[place.pool]
        typed = pool.view(dtype)
        element = typed.element_size()
        inner = (self.layout.tokens_per_block, *token_shape(layer, place.role))
        inner_strides = _contiguous_strides(inner)
        shape = (pool.shape[0], *((roles_in_page,) if roles_in_page > 1 else ()), *inner)
        page = place.bytes_per_buffer // element
        strides = (
            pool.shape[1] // element,
            *((page,) if roles_in_page > 1 else ()),
            *inner_strides,
        )
        return typed.as_strided(shape, strides, place.offset_bytes // element)

    def layer_view(self, layer_id: LayerId, role: Role) -> torch.Tensor:
        return self._view(self.layout.placements[(layer_id, role)], 1)

    def kv_view(self, layer_id: LayerId) -> torch.Tensor:
        """``[num_slots, kv_factor, tokens_per_block, heads, head_dim]`` (key-only: no kv dim)."""
        layer = self.layout.layers[layer_id]
        return self._view(self.layout.placements[(layer_id, "key")], layer.kv_factor)

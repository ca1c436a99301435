"""Per-layer pointer tables, for kernels that take one base pointer per (layer, role).

From the per-pool table (base address of the first and second role of a page), the
layer-to-(pool, page offset) map and each pool's page size (kv_factor x bytes per buffer):
``out[l, r] = pointer_table[pool, r % 2] + page_offset * page_bytes[pool]``. Roles are indexed
key, value, key_scale, value_scale, so r % 2 picks the first or second role of a page.

Example: pool 0 at B holds K0 V0 K1 V1 in 256-byte buffers (page 512 bytes): layer 1's value
(pool 0, page offset 1) is at B + 256 + 1 * 512 = B + 768.
"""

from __future__ import annotations

import torch

from ._dispatch import blocks, gpu_path, i32, launch, ptr

THREADS = 128


def _out(pool_map: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    if out is None:
        return torch.empty(pool_map.shape[:2], dtype=torch.int64, device=pool_map.device)
    assert out.shape == pool_map.shape[:2] and out.dtype == torch.int64 and out.is_contiguous()
    return out


def layer_pointers_reference(
    pointer_table: torch.Tensor,
    pool_map: torch.Tensor,
    page_bytes: torch.Tensor,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    pool = pool_map[..., 0].long()
    offset = pool_map[..., 1].long()
    role = torch.arange(pool_map.shape[1], device=pool_map.device) % 2
    valid = pool >= 0
    safe = pool.clamp(min=0)
    address = pointer_table[safe, role.expand_as(safe)] + offset * page_bytes[safe]
    result = _out(pool_map, out)
    result.copy_(torch.where(valid, address, 0))
    return result


def layer_pointers_cuda(
    pointer_table: torch.Tensor,
    pool_map: torch.Tensor,
    page_bytes: torch.Tensor,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    out = _out(pool_map, out)
    n = out.numel()
    if n:
        launch(
            "pointers",
            "layer_pointers",
            pool_map.device,
            (blocks(n, THREADS),),
            (THREADS,),
            (ptr(pointer_table), ptr(pool_map), ptr(page_bytes), ptr(out), i32(n)),
        )
    return out


def layer_pointers(
    pointer_table: torch.Tensor,
    pool_map: torch.Tensor,
    page_bytes: torch.Tensor,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """int64 ``[L, 4]`` from int64 ``[P, 2]``, int32 ``[L, 4, 2]`` and int64 ``[P]``."""
    args = (pointer_table, pool_map, page_bytes)
    if gpu_path(*args):
        return layer_pointers_cuda(*(t.contiguous() for t in args), out)
    return layer_pointers_reference(*args, out)

"""Per-layer pointer tables, for kernels that take one base pointer per (layer, role).

From the per-pool table (base address of the first and second role of a page), the
layer-to-(pool, page offset) map, each pool's page size (kv_factor x bytes per buffer) and
each role's column in its page (``page_role``: 1 for value and value_scale, 0 for key,
key_scale and extra roles, which are key-only pages):
``out[l, r] = pointer_table[pool, page_role[r]] + page_offset * page_bytes[pool]``. The role
axis has any length: the manager's is ``describe().roles`` (ROLES, then extra roles).

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
    page_role: torch.Tensor,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    pool = pool_map[..., 0].long()
    offset = pool_map[..., 1].long()
    role = page_role.long()
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
    page_role: torch.Tensor,
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
            (
                ptr(pointer_table),
                ptr(pool_map),
                ptr(page_bytes),
                ptr(page_role),
                ptr(out),
                i32(n),
                i32(pool_map.shape[1]),
            ),
        )
    return out


def layer_pointers(
    pointer_table: torch.Tensor,
    pool_map: torch.Tensor,
    page_bytes: torch.Tensor,
    page_role: torch.Tensor,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """int64 ``[L, R]`` from int64 ``[P, 2]``, int32 ``[L, R, 2]``, int64 ``[P]`` and int32
    ``[R]``."""
    args = (pointer_table, pool_map, page_bytes, page_role.to(torch.int32))
    if gpu_path(*args):
        return layer_pointers_cuda(*(t.contiguous() for t in args), out)
    return layer_pointers_reference(*args, out)

"""Batched copies of byte segments between device memory and pinned host memory.

The host tier's copies (``kvcm.tier_copies``): every block a step offloads or onboards is one
segment per pool (a slot is one contiguous row on both sides), cut into pieces of at most
``PIECE_BYTES`` so that one large slot still spreads over many thread blocks. A batch is an
int64 ``[k, 3]`` array of (source address, destination address, bytes); on CUDA one launch
copies all of it, reading the array from pinned host memory, on the CPU the reference copies
segment by segment with ``memmove``. Segments must not overlap each other's destinations or
read another's destination (the copier launches dependent copies in separate batches).

Example: two 80 KiB slots, device slots 3 and 5 of a pool at address P to host rows 0 and 1
of a region at H: ``segments(P + [3, 5] * 81920, H + [0, 1] * 81920, 81920)`` gives 6 rows,
(P + 245760, H, 32768), (P + 278528, H + 32768, 32768), (P + 311296, H + 65536, 16384), then
the same for slot 5.
"""

from __future__ import annotations

import ctypes

import numpy as np
import torch

from ._dispatch import blocks, i64, launch, ptr

#: Largest piece of a segment one thread block copies at a time.
PIECE_BYTES = 32 << 10
THREADS = 256
#: Thread blocks of a launch by default (a grid-stride loop covers more pieces). A copy over
#: PCIe needs few of them to keep the link busy; fewer leave more of the GPU to compute that
#: runs beside the copy (bench/bench_host_tier.py measures both).
MAX_BLOCKS = 64


def segments(src: np.ndarray, dst: np.ndarray, nbytes: int) -> np.ndarray:
    """Rows (source, destination, bytes) copying ``nbytes`` from each ``src[i]`` to
    ``dst[i]``, in pieces of at most ``PIECE_BYTES``."""
    offsets = np.arange(0, nbytes, PIECE_BYTES, dtype=np.int64)
    out = np.empty((len(src), len(offsets), 3), dtype=np.int64)
    out[:, :, 0] = np.asarray(src, dtype=np.int64)[:, None] + offsets
    out[:, :, 1] = np.asarray(dst, dtype=np.int64)[:, None] + offsets
    out[:, :, 2] = np.minimum(PIECE_BYTES, nbytes - offsets)
    return out.reshape(-1, 3)


def copy_segments_reference(desc: np.ndarray) -> None:
    """Copy each segment with ``memmove`` (CPU addresses only)."""
    for src, dst, n in desc.tolist():
        ctypes.memmove(dst, src, n)


def copy_segments(
    desc: np.ndarray, device: torch.device, max_blocks: int = MAX_BLOCKS
) -> torch.Tensor | None:
    """Copy every segment of ``desc``: on CUDA one launch of at most ``max_blocks`` thread
    blocks on torch's current stream, reading ``desc`` from a pinned copy that is returned
    (keep it until the launch has completed); on the CPU, now, with the reference."""
    if device.type != "cuda":
        copy_segments_reference(desc)
        return None
    pinned = torch.empty(desc.shape, dtype=torch.int64, pin_memory=True)
    pinned.numpy()[...] = desc
    count = int(desc.shape[0])
    launch(
        "block_copy",
        "copy_segments",
        device,
        (blocks(count, 1, max_blocks),),
        (THREADS,),
        (ptr(pinned), i64(count)),
    )
    return pinned

"""Batched copies of byte segments between device memory and pinned host memory.

The host tier's copies (``kvcm.tier_copies``): every block a step offloads or onboards is one
segment per pool (a slot is one contiguous row on both sides). A batch is an int64 ``[k, 3]``
array of (source address, destination address, bytes). On CUDA, segments of at least
``dma_min_bytes`` go to the copy engines, one ``cudaMemcpyAsync`` each (they take no SMs, and
a call is short next to the copy of such a segment); the others are cut into pieces of at
most ``PIECE_BYTES`` and copied by one kernel launch that reads the pieces from pinned host
memory (many small slots, as with a pool per layer, would cost a call each otherwise). On the
CPU the reference copies segment by segment with ``memmove``. Segments must not overlap each
other's destinations or read another's destination (the copier launches dependent copies in
separate batches; the reference checks it).

Example: two 80 KiB slots, device slots 3 and 5 of a pool at address P to host rows 0 and 1
of a region at H: ``segments(P + [3, 5] * 81920, H + [0, 1] * 81920, 81920)`` gives rows
(P + 245760, H, 81920) and (P + 409600, H + 81920, 81920); ``pieces`` cuts the first into
(P + 245760, H, 32768), (P + 278528, H + 32768, 32768), (P + 311296, H + 65536, 16384).
"""

from __future__ import annotations

import ctypes
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import numpy as np
import torch

from ._dispatch import _cupy, blocks, i64, launch, ptr

#: Largest piece of a segment one thread block copies at a time.
PIECE_BYTES = 32 << 10
THREADS = 256
#: Thread blocks of a launch by default (a grid-stride loop covers more pieces). A copy over
#: PCIe needs few of them to keep the link busy; fewer leave more of the GPU to compute that
#: runs beside the copy (bench/bench_host_tier.py measures both).
MAX_BLOCKS = 64


#: Segments of at least this many bytes go to the copy engines on CUDA.
DMA_MIN_BYTES = 256 << 10
#: ``cudaMemcpyDefault``: the direction follows from the addresses (unified addressing).
MEMCPY_DEFAULT = 4


def segments(src: np.ndarray, dst: np.ndarray, nbytes: int) -> np.ndarray:
    """Rows (source, destination, bytes) copying ``nbytes`` from each ``src[i]`` to
    ``dst[i]``."""
    out = np.empty((len(src), 3), dtype=np.int64)
    out[:, 0], out[:, 1], out[:, 2] = src, dst, nbytes
    return out


def pieces(desc: np.ndarray) -> np.ndarray:
    """The segments cut into pieces of at most ``PIECE_BYTES``, in order."""
    count = -(-desc[:, 2] // PIECE_BYTES)
    rows = np.repeat(np.arange(desc.shape[0]), count)
    first = np.cumsum(count) - count
    offset = (np.arange(rows.size) - first[rows]) * PIECE_BYTES
    out = np.empty((rows.size, 3), dtype=np.int64)
    out[:, 0] = desc[rows, 0] + offset
    out[:, 1] = desc[rows, 1] + offset
    out[:, 2] = np.minimum(PIECE_BYTES, desc[rows, 2] - offset)
    return out


def check_independent(desc: np.ndarray) -> None:
    """Refuse a batch whose segments depend on each other: one writing bytes another writes
    or reads. The kernel copies them in parallel, so such a batch would race on the GPU; the
    reference checks it so that the CPU catches what would race there."""
    src, dst, n = desc[:, 0], desc[:, 1], desc[:, 2]
    order = np.argsort(dst, kind="stable")
    start, end = dst[order], dst[order] + n[order]
    if (end[:-1] > start[1:]).any():
        raise ValueError("two segments of a batch write the same bytes")
    # The destination that starts last before a source ends is the only one that can overlap
    # it (destinations are disjoint and sorted).
    last = np.searchsorted(start, src + n, side="left") - 1
    if ((last >= 0) & (end[np.maximum(last, 0)] > src)).any():
        raise ValueError("a segment of a batch reads bytes another one writes")


def copy_segments_reference(desc: np.ndarray) -> None:
    """Copy each segment with ``memmove`` (CPU addresses only), after ``check_independent``."""
    check_independent(desc)
    for src, dst, n in desc.tolist():
        ctypes.memmove(dst, src, n)


def cuda_runtime() -> Any:
    """CuPy's CUDA runtime module (raw calls: a few cost less than one torch stream call);
    None without CuPy."""
    cupy = _cupy()
    return None if cupy is None else cupy.cuda.runtime


def destroy_events(runtime: Any, events: tuple[int, ...]) -> None:
    """Wait for raw events, then destroy them (a ``weakref.finalize`` callback of their
    owner, which runs before the owner's buffers go: work they fence may still read them)."""
    for event in events:
        runtime.eventSynchronize(event)
        runtime.eventDestroy(event)


def on_device(index: int) -> AbstractContextManager[object]:
    """Make device ``index`` current for raw runtime calls (a no-op when it is already):
    stream handle 0, torch's default stream, means the current device's, and an event
    recorded on a stream of another device fails."""
    if torch.cuda.current_device() == index:
        return nullcontext()
    return torch.cuda.device(index)


def copy_segments(
    desc: np.ndarray,
    device: torch.device,
    max_blocks: int = MAX_BLOCKS,
    dma_min_bytes: int = DMA_MIN_BYTES,
    stream_handle: int | None = None,
) -> torch.Tensor | None:
    """Copy every segment of ``desc``. On CUDA, on torch's current stream (or the stream of
    raw handle ``stream_handle``): the large ones on the copy engines, the others in one
    launch of at most ``max_blocks`` thread blocks that reads its pieces from a pinned array,
    which is returned (keep it until the launch has completed). On the CPU, now, with the
    reference."""
    if device.type != "cuda":
        copy_segments_reference(desc)
        return None
    if stream_handle is None:
        index = device.index if device.index is not None else torch.cuda.current_device()
        stream_handle = torch.cuda.current_stream(index).cuda_stream
    large = desc[:, 2] >= dma_min_bytes
    if large.any():
        runtime = cuda_runtime()
        for src, dst, n in desc[large].tolist():
            runtime.memcpyAsync(dst, src, n, MEMCPY_DEFAULT, stream_handle)
        desc = desc[~large]
    if not desc.shape[0]:
        return None
    cut = pieces(desc)
    pinned = torch.empty(cut.shape, dtype=torch.int64, pin_memory=True)
    pinned.numpy()[...] = cut
    count = int(cut.shape[0])
    launch(
        "block_copy",
        "copy_segments",
        device,
        (blocks(count, 1, max_blocks),),
        (THREADS,),
        (ptr(pinned), i64(count)),
        stream_handle=stream_handle,
    )
    return pinned

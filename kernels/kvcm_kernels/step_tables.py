"""A scheduler step's device work fused: apply the page-table edits, then the slot mapping.

Per decode step the GPU work is tiny (a few hundred edits, one slot per request and layer
group), so launches and copies dominate. This family does both in one launch of one thread
block, fed by one upload; it equals ``apply_page_table_edits`` followed by ``slot_mapping`` on
the layer groups ``[first_group, first_group + num_groups)``. Past ``SINGLE_BLOCK_LIMIT`` units
of work (edits plus outputs), one block would be slow, and it runs as the two kernels.

Example: edits [[0, 3, 1, 9]] then positions [17] of row 3 with tokens_per_block 16: the
mapping reads the edited entry, 9 * 16 + 1 = 145. Entries below ``min_live`` are no page, as in
``slot_mapping`` (1 with the null page: an edit [0, 3, 1, 0] releases the block, and position
17 maps to -1).
"""

from __future__ import annotations

import ctypes
import os

import numpy as np
import torch

from ._dispatch import _cupy, _function, gpu_path_pinned_inputs, i32, launch, ptr
from .page_table_edits import apply_page_table_edits
from .slot_mapping import slot_mapping

THREADS = 1024
SINGLE_BLOCK_LIMIT = 1 << 15
STAGED_QSL_LIMIT = 4096  # qsl entries staged in shared memory (32 KiB)


def apply_edits_and_map_slots_reference(
    tables: torch.Tensor,
    edits: torch.Tensor,
    rows: torch.Tensor,
    query_start_loc: torch.Tensor,
    positions: torch.Tensor,
    tokens_per_block: int,
    pad_to: int,
    first_group: int,
    num_groups: int,
    out: torch.Tensor | None = None,
    min_live: int = 0,
) -> torch.Tensor:
    apply_page_table_edits(tables, edits)
    window = tables[first_group : first_group + num_groups]
    return slot_mapping(
        window, rows, query_start_loc, positions, tokens_per_block, pad_to, out, min_live
    )


def apply_edits_and_map_slots_cuda(
    tables: torch.Tensor,
    edits: torch.Tensor,
    rows: torch.Tensor,
    query_start_loc: torch.Tensor,
    positions: torch.Tensor,
    tokens_per_block: int,
    pad_to: int,
    first_group: int,
    num_groups: int,
    out: torch.Tensor | None = None,
    min_live: int = 0,
) -> torch.Tensor:
    if edits.shape[0] + num_groups * pad_to > SINGLE_BLOCK_LIMIT:
        # Too much for one block: the two kernels, with the inputs on the device (they may be
        # pinned host tensors; the copies are asynchronous and stream-ordered).
        dev = [
            t.to(tables.device, non_blocking=True)
            for t in (edits, rows, query_start_loc, positions)
        ]
        return apply_edits_and_map_slots_reference(
            tables, *dev, tokens_per_block, pad_to, first_group, num_groups, out, min_live
        )
    _, table_rows, cols = tables.shape
    staged = rows.numel() + 1 <= STAGED_QSL_LIMIT
    if out is None:
        out = torch.empty((num_groups, pad_to), dtype=torch.int64, device=tables.device)
    out = out.view(num_groups, pad_to)
    launch(
        "step_tables",
        "apply_edits_and_map_slots",
        tables.device,
        (1,),
        (THREADS,),
        (
            ptr(tables),
            ptr(edits),
            i32(edits.shape[0]),
            ptr(rows),
            ptr(query_start_loc),
            ptr(positions),
            ptr(out),
            i32(rows.numel()),
            i32(pad_to),
            i32(first_group),
            i32(num_groups),
            i32(table_rows),
            i32(cols),
            i32(tokens_per_block),
            i32(min_live),
            i32(int(staged)),
        ),
        shared_mem=8 * (rows.numel() + 1) if staged else 0,
    )
    return out


def apply_edits_and_map_slots(
    tables: torch.Tensor,
    edits: torch.Tensor,
    rows: torch.Tensor,
    query_start_loc: torch.Tensor,
    positions: torch.Tensor,
    tokens_per_block: int,
    pad_to: int,
    first_group: int = 0,
    num_groups: int | None = None,
    out: torch.Tensor | None = None,
    min_live: int = 0,
) -> torch.Tensor:
    """Edits (int64 ``[E, 4]``) applied to ``tables [G, R, B]`` in place; returns the int64
    ``[num_groups, pad_to]`` slot mapping of the batch on the edited tables (in ``out`` when
    given; entries below ``min_live`` are no page). With CUDA tables, the four inputs may be
    CUDA tensors or pinned host tensors."""
    groups = tables.shape[0] - first_group if num_groups is None else num_groups
    inputs = (edits, rows, query_start_loc, positions)
    if gpu_path_pinned_inputs(tables, *inputs):
        return apply_edits_and_map_slots_cuda(
            tables.contiguous(),
            *(t.contiguous() for t in inputs),
            tokens_per_block,
            pad_to,
            first_group,
            groups,
            out,
            min_live,
        )
    on_device = (t.to(tables.device) for t in inputs)
    return apply_edits_and_map_slots_reference(
        tables, *on_device, tokens_per_block, pad_to, first_group, groups, out, min_live
    )


class StepLaunch:
    """``apply_edits_and_map_slots_cuda`` for one device at the least host cost per step.

    CuPy's kernel call turns each of the kernel's sixteen arguments into a C value, enters
    the device and the stream as context managers and looks the function up for the current
    device; a scheduler step pays that every time. Here the function is looked up once, the
    arguments are written in place into one array whose addresses the driver reads
    (``cuLaunchKernel``'s ``kernelParams``: an int parameter reads the low four bytes of its
    8-byte slot, little-endian), and the launch is one driver call on the stream handle the
    caller took. The inputs are one packed pinned buffer: rows ``[n]``, query_start_loc
    ``[n + 1]``, positions ``[total]``, edits ``[E, 4]``, int64, back to back.

    Example: 2 requests, 3 tokens, 1 edit at host address A: rows at A, query_start_loc at
    A + 16, positions at A + 40, the edit at A + 64 (8 bytes an entry).
    """

    ARGS = 16

    def __init__(self, tables: torch.Tensor, index: int) -> None:
        cupy = _cupy()
        self.index = index
        self._launch = cupy.cuda.driver.launchKernel
        self._current = cupy.cuda.runtime.getDevice
        with cupy.cuda.Device(index):
            kernel = _function("step_tables", "apply_edits_and_map_slots", index)
            self._fn = int(kernel.kernel.ptr)
        self._args = np.zeros(self.ARGS, dtype=np.int64)
        base = self._args.ctypes.data
        self._params = np.arange(base, base + 8 * self.ARGS, 8, dtype=np.uint64)
        self._params_ptr = int(self._params.ctypes.data)
        self._tables = tables  # kept alive: its address is in every launch
        _, table_rows, cols = tables.shape
        self._args[0], self._args[11], self._args[12] = tables.data_ptr(), table_rows, cols

    @classmethod
    def create(cls, tables: torch.Tensor) -> StepLaunch | None:
        """One for these CUDA ``tables [G, R, B]`` (int32, contiguous: the launches write
        them in place) where CuPy can launch there; None where the step takes the usual
        dispatch (no CuPy: the references)."""
        if not tables.is_cuda or not tables.is_contiguous() or _cupy() is None:
            return None
        return cls(tables, tables.device.index)

    @property
    def kernel(self) -> int:
        """The kernel's ``CUfunction`` handle on this device (for a launch made elsewhere:
        ``kvcm._native.step_launch``)."""
        return self._fn

    def fits(self, num_edits: int, outputs: int) -> bool:
        """Whether one launch takes this step (``num_edits`` edits, ``outputs`` slot-mapping
        entries): not with ``KVCM_KERNELS=reference``, on another current device, or for
        more work than one block takes (then the usual dispatch runs it as two kernels)."""
        return (
            num_edits + outputs <= SINGLE_BLOCK_LIMIT
            and self._current() == self.index
            and os.environ.get("KVCM_KERNELS") != "reference"
        )

    def __call__(
        self,
        address: int,
        n: int,
        total: int,
        num_edits: int,
        tokens_per_block: int,
        first_group: int,
        out: torch.Tensor,
        min_live: int,
        stream: int,
    ) -> bool:
        """Launch on ``stream`` (a raw handle on this device) for the packed inputs at host
        ``address``, writing ``out [num_groups, pad_to]``; False, with nothing launched,
        where the usual dispatch must run it: ``KVCM_KERNELS=reference``, another current
        device, or more work than one block takes."""
        num_groups, pad_to = out.shape
        if not self.fits(num_edits, num_groups * pad_to):
            return False
        staged = n + 1 <= STAGED_QSL_LIMIT
        qsl = address + 8 * n
        positions = qsl + 8 * (n + 1)
        a = self._args  # 0, 11 and 12 (the tables' address and shape) are set once
        a[1:11] = (
            positions + 8 * total,  # the edits
            num_edits,
            address,  # the rows
            qsl,
            positions,
            out.data_ptr(),
            n,
            pad_to,
            first_group,
            num_groups,
        )
        a[13:] = (tokens_per_block, min_live, int(staged))
        shared = 8 * (n + 1) if staged else 0
        self._launch(self._fn, 1, 1, 1, THREADS, 1, 1, shared, stream, self._params_ptr, 0)
        return True


def driver_entry_points() -> tuple[int, int, int] | None:
    """The addresses of ``cuLaunchKernel``, ``cuEventRecord`` and ``cuEventSynchronize`` in
    the CUDA driver this process loaded (CuPy and torch load ``libcuda.so.1``), for C code
    that launches a step without a Python call per driver call (``kvcm._native
    .step_launch``); None without a driver. All are the driver API's stable symbols (a
    launch names its stream: no per-thread default stream variant is needed)."""
    try:
        lib = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None
    names = ("cuLaunchKernel", "cuEventRecord", "cuEventSynchronize")
    addresses = tuple(ctypes.cast(getattr(lib, name), ctypes.c_void_p).value for name in names)
    if not all(addresses):
        return None
    launch, record, sync = addresses
    return launch, record, sync

"""Whether a ``ManagerConfig`` fits the memory this machine has free, before anything is built.

A model registered at run time comes over the network: a ``num_blocks`` of 2**31 - 1, a
``max_requests`` of 10**9 or a layer id of 2**31 would make construction allocate terabytes,
which ends in an allocator error after the old model is gone, or in the kernel's OOM killer.
So a registration is checked against free memory first (``check_room``) and refused with
``insufficient_memory`` while the old model is still served.

The count is an upper bound of what construction allocates, cheap to compute from the layout:

- the pools: ``num_blocks`` slots of every pool group, or the ``memory_bytes`` budget;
- the page tables (int32 per layer group x row x block, a host copy too on CUDA) and the
  pointer tables (per layer id and role);
- bookkeeping per slot (free ring, positions, reference counts, cache flags: ``SLOT_BYTES``)
  and per row;
- the sizing curves: int64 arrays over every length up to ``max_seq_len`` (``CURVE_ARRAYS``
  per layer group and a few more).

On the CPU all of it is host memory; on CUDA the pools and the device tables are device
memory and the rest host memory. Free memory is ``MemAvailable`` (or the cgroup's limit less
its usage, whichever is smaller) and ``torch.cuda.mem_get_info``, plus what closing the old
model gives back (``held_bytes``). The count is not a promise that the pages exist: POSIX
shared memory and ``torch.empty`` commit pages as they are touched, as at start.
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from kvcm_client.errors import InsufficientMemory
from kvcm_client.models import ManagerConfig

from .layout import Layout
from .state_pools import state_memory

if TYPE_CHECKING:
    from collections.abc import Iterator

    from .components import Components

#: Host bytes of bookkeeping per slot: the free ring (2 x int32), positions (int64),
#: reference counts (int32), cache flags, and room for the prefix cache's index.
SLOT_BYTES = 48
#: Host bytes of bookkeeping per row and layer group (lengths, block counts, released ends).
ROW_BYTES = 64
#: int64 arrays over every length the sizing curves keep per layer group, and besides them.
CURVE_ARRAYS = 6
CURVE_BASE_ARRAYS = 8


def need_bytes(config: ManagerConfig, layout: Layout) -> tuple[int, int]:
    """(device bytes, host bytes) that building ``config`` takes at most; on the CPU the
    device bytes are host bytes too (the caller adds them up)."""
    groups = len(layout.layer_groups)
    pool_groups = layout.pool_groups
    if config.num_blocks is not None:
        pools = config.num_blocks * sum(pg.slot_bytes for pg in pool_groups)
        pools += state_memory(config)
        slots = config.num_blocks * len(pool_groups)
    else:
        assert config.memory_bytes is not None
        pools = config.memory_bytes  # the state layers' bytes included
        slots = sum(config.memory_bytes // pg.slot_bytes + 1 for pg in pool_groups)
    tables = 4 * groups * config.max_requests * config.max_blocks_per_request
    pointers = 16 * (layout.num_layer_ids * len(layout.roles) + len(layout.pools))
    curves = 8 * config.max_seq_len * (CURVE_BASE_ARRAYS + CURVE_ARRAYS * groups)
    host = (
        tables
        + pointers
        + SLOT_BYTES * slots
        + ROW_BYTES * config.max_requests * (groups + 1)
        + curves
    )
    return pools + tables + pointers, host


def held_bytes(manager: Components) -> tuple[int, int]:
    """(device bytes, host bytes) that closing ``manager`` gives back: its pools and tables.
    Shared CUDA pools are kept until the process exits (consumers may map them): none."""
    if manager.device.type == "cuda" and manager.config.share:
        return 0, 0
    pools = sum(t.numel() * t.element_size() for t in manager.memory.tensors)
    if manager.state is not None:
        pools += sum(t.numel() for t in manager.state.memory)
    tables = int(manager.views.page_tables().numel()) * 4
    if manager.device.type == "cuda":
        return pools + tables, tables
    return pools + tables, 0


def free_host_bytes() -> int:
    """Host memory this process may still take: ``MemAvailable``, bounded by the cgroup's
    ``memory.max`` less its ``memory.current`` (a container's limit) where there is one."""
    free = _meminfo_available()
    cgroup = Path("/sys/fs/cgroup")
    try:
        limit = (cgroup / "memory.max").read_text().strip()
        if limit != "max":
            used = int((cgroup / "memory.current").read_text())
            free = min(free, max(int(limit) - used, 0))
    except (OSError, ValueError):
        pass
    return free


def _meminfo_available() -> int:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def check_room(config: ManagerConfig, layout: Layout, freed: tuple[int, int] = (0, 0)) -> None:
    """Raise ``InsufficientMemory`` if building ``config`` needs more than is free, counting
    ``freed`` (``held_bytes`` of the model it replaces) as free."""
    device_need, host_need = need_bytes(config, layout)
    host_free = free_host_bytes() + freed[1]
    device = torch.device(config.device)
    if device.type == "cuda":
        device_free = torch.cuda.mem_get_info(device)[0] + freed[0]
        _refuse_over(device_need, device_free, f"free memory on {config.device}")
    else:
        host_need += device_need
        host_free += freed[0]
    _refuse_over(host_need, host_free, "free host memory")


def _refuse_over(need: int, free: int, what: str) -> None:
    if need > free:
        raise InsufficientMemory(
            f"this model needs up to {need} bytes and there are {free} bytes of {what} "
            "(pools, page tables, bookkeeping and sizing): give a smaller memory_bytes, "
            "num_blocks, max_requests or max_seq_len",
            needed_bytes=need,
            free_bytes=free,
        )


@contextmanager
def allocating() -> Iterator[None]:
    """Allocator failures while a checked config is built, as ``InsufficientMemory`` (the
    check counts free memory, which another process may take meanwhile)."""
    try:
        yield
    except (MemoryError, torch.OutOfMemoryError) as exc:
        raise InsufficientMemory(f"allocating the model failed: {exc}") from exc
    except RuntimeError as exc:
        if "alloc" not in str(exc):  # a bug, not an allocator saying no
            raise
        raise InsufficientMemory(f"allocating the model failed: {exc}") from exc

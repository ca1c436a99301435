"""Mappable allocations for the pools and page tables when sharing is on.

On the CPU each one is a named POSIX shared-memory segment; on CUDA its own ``cudaMalloc``
allocation (rounded up to 2 MiB, never carved from a caching allocator, so that its IPC
handle covers exactly it) exported with ``cudaIpcGetMemHandle``. The manager's process owns
them. POSIX segments are unlinked when the manager closes or its process exits: processes that
still map one keep their mapping until they unmap it, so a consumer never reads freed memory,
but nothing new attaches to an old generation. CUDA allocations live until the process exits.

A process killed with its resource tracker (a container kill) unlinks nothing, so each
generation's segments are named ``kvcm-<generation>-...`` and the generation holds an
exclusive ``flock`` on ``/dev/shm/kvcm-<generation>.lock`` while it lives. At start, a new
generation takes every other generation's lock it can get, which only a dead owner allows
(the kernel drops a process's locks when it dies, across pid namespaces too), and unlinks
that generation's segments and lock.
"""

from __future__ import annotations

import atexit
import base64
import contextlib
import fcntl
import logging
import os
import uuid
from multiprocessing import shared_memory
from pathlib import Path
from typing import Any

import torch

from kvcm_client import shared
from kvcm_client.errors import InsufficientMemory
from kvcm_client.models import SharedSegment

CUDA_ALIGN = 2 << 20
#: Where Linux keeps POSIX shared memory.
SHM_DIR = Path("/dev/shm")
_log = logging.getLogger("kvcm")


def strided(view: torch.Tensor) -> dict[str, Any]:
    """How a consumer rebuilds ``view`` from its segment (``torch.as_strided`` of the
    segment in ``dtype`` elements): the fields shared descriptors carry."""
    return {
        "dtype": str(view.dtype).removeprefix("torch."),
        "shape": tuple(view.shape),
        "strides": tuple(view.stride()),
        "offset": view.storage_offset(),
    }


def reclaim_dead_generations(shm_dir: Path = SHM_DIR) -> list[str]:
    """Unlink the segments of every generation whose process is gone; returns their names.

    A generation is gone when its lock can be taken: a live owner holds it exclusively.
    """
    reclaimed: list[str] = []
    for lock_path in sorted(shm_dir.glob("kvcm-*.lock")):
        prefix = lock_path.name.removesuffix(".lock")
        try:
            fd = os.open(lock_path, os.O_RDWR)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:  # held: that generation is alive
            os.close(fd)
            continue
        try:
            for segment in shm_dir.glob(f"{prefix}-*"):
                with contextlib.suppress(FileNotFoundError):
                    segment.unlink()
                    reclaimed.append(segment.name)
            with contextlib.suppress(FileNotFoundError):
                lock_path.unlink()
        finally:
            os.close(fd)
    if reclaimed:
        _log.warning("reclaimed %d shared segments of dead kvcm processes", len(reclaimed))
    return reclaimed


class SharedSegments:
    """POSIX shared-memory segments (the CPU)."""

    def __init__(self, generation: str) -> None:
        self.generation = generation
        self._prefix = f"kvcm-{generation[:12]}"
        self._segments: list[shared_memory.SharedMemory] = []
        self._lock_fd: int | None = None
        if SHM_DIR.is_dir():
            reclaim_dead_generations()
            lock_path = SHM_DIR / f"{self._prefix}.lock"
            self._lock_fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o600)
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        atexit.register(self.close)

    def allocate(self, nbytes: int) -> tuple[SharedSegment, torch.Tensor]:
        """A new zero-filled segment of ``nbytes`` and a uint8 tensor over it."""
        name = f"{self._prefix}-{len(self._segments)}-{uuid.uuid4().hex[:6]}"
        try:
            segment = shared_memory.SharedMemory(name=name, create=True, size=max(nbytes, 1))
        except OSError as exc:
            raise InsufficientMemory(
                f"cannot create a {nbytes}-byte shared-memory segment: {exc.strerror} "
                "(is /dev/shm large enough?)",
                nbytes=nbytes,
            ) from None
        self._segments.append(segment)
        tensor = torch.frombuffer(segment.buf, dtype=torch.uint8, count=max(nbytes, 1))[:nbytes]
        return SharedSegment(kind="shm", name=segment.name, nbytes=nbytes), tensor

    def close(self) -> None:
        """Unlink every segment and the generation's lock (idempotent)."""
        for segment in self._segments:
            with contextlib.suppress(FileNotFoundError):
                segment.unlink()
        self._segments.clear()
        if self._lock_fd is not None:
            with contextlib.suppress(FileNotFoundError):
                (SHM_DIR / f"{self._prefix}.lock").unlink()
            os.close(self._lock_fd)
            self._lock_fd = None


def device_uuid(index: int) -> str:
    """The CUDA device's UUID as hex: how a consumer finds the same GPU whatever its
    CUDA_VISIBLE_DEVICES numbering."""
    cupy = cupy_for_ipc()
    return bytes(cupy.cuda.runtime.getDeviceProperties(index)["uuid"]).hex()


def cupy_for_ipc() -> Any:
    """CuPy for sharing CUDA pools, or ``DeviceUnavailable`` naming CuPy and why, logged in
    the service's log (``kvcm_client.shared.cupy_for_ipc``)."""
    return shared.cupy_for_ipc("sharing CUDA pools", "the gpu extra", _log)


class CudaSegments:
    """Plain ``cudaMalloc`` allocations with CUDA IPC handles (through CuPy)."""

    def __init__(self, generation: str, device: torch.device) -> None:
        cupy = cupy_for_ipc()
        self.generation = generation
        self.device = device
        self.index = 0 if device.index is None else device.index
        self.uuid = device_uuid(self.index)
        self._cupy = cupy
        self._keep: list[Any] = []

    def allocate(self, nbytes: int) -> tuple[SharedSegment, torch.Tensor]:
        cupy = self._cupy
        size = -(-max(nbytes, 1) // CUDA_ALIGN) * CUDA_ALIGN
        with cupy.cuda.Device(self.index):
            try:
                memory = cupy.cuda.Memory(size)  # cudaMalloc, not a memory pool
            except cupy.cuda.memory.OutOfMemoryError:
                raise InsufficientMemory(
                    f"cannot allocate {size} bytes on {self.device}", nbytes=size
                ) from None
            cupy.cuda.runtime.memset(memory.ptr, 0, size)
            handle = cupy.cuda.runtime.ipcGetMemHandle(memory.ptr)
            array = cupy.ndarray(
                (nbytes,), dtype=cupy.uint8, memptr=cupy.cuda.MemoryPointer(memory, 0)
            )
            tensor = torch.as_tensor(array, device=self.device)
        self._keep.append((memory, array))
        segment = SharedSegment(
            kind="cuda_ipc",
            handle=base64.b64encode(bytes(handle)).decode(),
            device_uuid=self.uuid,
            nbytes=nbytes,
        )
        return segment, tensor

    def close(self) -> None:
        """CUDA allocations stay until the process exits (consumers may map them)."""

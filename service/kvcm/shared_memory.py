"""Named POSIX shared-memory segments that hold the pools and page tables when sharing is on.

The manager's process creates and owns them; the inference server maps them by name
(``kvcm_client.attach``). They are unlinked when the manager closes or its process exits:
processes that still map one keep their mapping until they unmap it (POSIX semantics), so a
consumer never reads freed memory, but nothing new can attach to an old generation.
"""

from __future__ import annotations

import atexit
import contextlib
import uuid
from multiprocessing import shared_memory

from kvcm_client.errors import InsufficientMemory


class SharedSegments:
    def __init__(self, generation: str) -> None:
        self.generation = generation
        self._segments: list[shared_memory.SharedMemory] = []
        atexit.register(self.close)

    def allocate(self, nbytes: int) -> shared_memory.SharedMemory:
        """A new zero-filled segment of at least ``nbytes`` (at least one page)."""
        name = f"kvcm-{self.generation[:12]}-{len(self._segments)}-{uuid.uuid4().hex[:6]}"
        try:
            segment = shared_memory.SharedMemory(name=name, create=True, size=max(nbytes, 1))
        except OSError as exc:
            raise InsufficientMemory(
                f"cannot create a {nbytes}-byte shared-memory segment: {exc.strerror} "
                "(is /dev/shm large enough?)",
                nbytes=nbytes,
            ) from None
        self._segments.append(segment)
        return segment

    def close(self) -> None:
        """Unlink every segment (idempotent)."""
        for segment in self._segments:
            with contextlib.suppress(FileNotFoundError):
                segment.unlink()
        self._segments.clear()

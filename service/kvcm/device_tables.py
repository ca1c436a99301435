"""Page tables on the manager's device, kept in step with the host tables.

On the CPU the device tables are the host tables (one shared array, nothing to do). On CUDA
the host keeps the bookkeeping and the coordinator logs every table edit; ``sync`` sends the
edits since the last sync through a reused pinned buffer and applies them with one kernel
launch for all layer groups (``kvcm_kernels.apply_page_table_edits``). The manager syncs at
the end of every batched step and before anything reads the device tables.
"""

from __future__ import annotations

import numpy as np
import torch

import kvcm_kernels

from .coordinator import Coordinator


class Uploader:
    """Copies small host arrays to the device without a synchronous pageable copy.

    The staging buffer is pinned and reused: before overwriting it, wait for the event of the
    previous copy (normally long done). The returned device tensor is valid for work queued on
    the current stream before the next upload.
    """

    def __init__(self, device: torch.device, dtype: torch.dtype) -> None:
        self.device = device
        self.dtype = dtype
        self._host = torch.empty(0, dtype=dtype, pin_memory=True)
        self._dev = torch.empty(0, dtype=dtype, device=device)
        self._event = torch.cuda.Event()
        self._pending = False

    def __call__(self, array: np.ndarray) -> torch.Tensor:
        n = array.size
        if self._pending:
            self._event.synchronize()
        if n > self._host.numel():
            cap = max(n, 2 * self._host.numel(), 4096)
            self._host = torch.empty(cap, dtype=self.dtype, pin_memory=True)
            self._dev = torch.empty(cap, dtype=self.dtype, device=self.device)
        self._host[:n].numpy()[:] = array.reshape(-1)
        dev = self._dev[:n]
        dev.copy_(self._host[:n], non_blocking=True)
        self._event.record(torch.cuda.current_stream(self.device))
        self._pending = True
        return dev.view(array.shape)


class DeviceTables:
    def __init__(self, coordinator: Coordinator, device: torch.device) -> None:
        self._coord = coordinator
        self.device = device
        host = coordinator.tables
        if device.type == "cpu":
            self.tensor = torch.from_numpy(host)
            self._upload: Uploader | None = None
        else:
            self.tensor = torch.from_numpy(host).to(device)
            coordinator.edits = []
            self._upload = Uploader(device, torch.int32)

    def sync(self) -> torch.Tensor:
        """Apply pending edits (one launch) and return the tables ``[groups, rows, blocks]``."""
        if self._upload is not None and self._coord.ops_since_take:
            edits = self._coord.take_edits()
            if edits.shape[0]:
                kvcm_kernels.apply_page_table_edits(self.tensor, self._upload(edits))
        return self.tensor

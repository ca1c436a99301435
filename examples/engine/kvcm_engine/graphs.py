"""Decode forwards on the paged-attention kernels, replayed from CUDA graphs.

A decode forward (every request computes one token) of the example engine launches a few
hundred kernels: the model's own (projections, RoPE, norms, the MLP) and kvcm's two per layer
(``store_kv`` and ``paged_attention``). Launched one by one from Python they take longer on the
host than on the GPU, so a 1B model's decode step is host-bound. ``DecodeGraphs`` captures the
forward once per batch size bucket into a CUDA graph whose inputs are static device buffers,
and replays it: per step the host writes the step's inputs into those buffers (one copy from
pinned memory, plus one device copy of the slot mapping where kvcm answered it on the device)
and launches the graph.

What the graph reads, per bucket of ``B`` requests (``B`` a power of two, or the engine's
``max_running``; a step of R <= B requests fills the other B - R rows with padding):

- ``staged`` (int64, one buffer): the token ids ``[B, 1]``, positions ``[B, 1]``, the slot
  mapping ``[groups, B]`` (kvcm's, request after request) and the kernels' ``meta`` ``[4, B]``
  (page-table row, cached length, new tokens, first slot; ``step_meta``). A padding row has
  ``count`` 0 and slot -1: the store kernel writes nothing for it and the attention kernel
  reads nothing (its output row is zeros); its logits are never read.
- kvcm's page tables, in place: the graph holds their address, and kvcm edits them in place
  before each replay, on the same stream (the in-process manager's tables, or the attached
  IPC tables of a sidecar). A backend whose tables move (another address) is captured again.
- the pools, in place (the layer views' addresses).

Inside the graph: ``meta`` is converted to int32, the missing-page flags are zeroed, the model
runs with a ``KVCMCache`` on ``PagedTables`` of those buffers, and the next tokens and the flags
land in one int64 buffer that the host reads after the replay (the step's one wait).

Without capture (``capture=False``: the CPU, where the kernels' torch references run, and the
tests of this path there) the same function runs eagerly on the same static buffers, so
everything but the capture itself is exercised without a GPU. The first replay of a bucket
runs the forward once on a side stream (Triton's compiles, transformers' lazy set-up), then
captures it; both write the same keys and values at the same slots as the replay does.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from .cache import KVCMCache, LayerInfo, PagedTables


def buckets(max_batch: int) -> list[int]:
    """The batch sizes captured: powers of two below ``max_batch``, then ``max_batch``.
    Example: 12 gives [1, 2, 4, 8, 12]."""
    out, b = [], 1
    while b < max_batch:
        out.append(b)
        b *= 2
    return [*out, max_batch]


class _Bucket:
    """The static buffers (and, once captured, the graph) of one batch size."""

    def __init__(self, size: int, groups: int, device: torch.device, pinned: bool) -> None:
        self.size = b = size
        n = 6 * b + groups * b
        self.host = torch.zeros(n, dtype=torch.int64, pin_memory=pinned)
        self.host_np = self.host.numpy()
        self.staged = torch.zeros(n, dtype=torch.int64, device=device)
        self.ids = self.staged[:b].view(b, 1)
        self.pos = self.staged[b : 2 * b].view(b, 1)
        self.slots = self.staged[2 * b : (2 + groups) * b].view(groups, b)
        self.meta64 = self.staged[(2 + groups) * b :].view(4, b)
        self.meta = torch.zeros(4, b, dtype=torch.int32, device=device)
        self.miss = torch.zeros(groups, dtype=torch.int32, device=device)
        self.graph: Any = None
        self.tables_ptr = 0
        self.result: torch.Tensor | None = None


@dataclass(frozen=True, slots=True)
class Launched:
    """A decode forward queued by ``DecodeGraphs.launch``: its result buffer (the graph's),
    its request count, bucket size and group count, and the event recorded after it (None
    on the CPU)."""

    result: torch.Tensor
    requests: int
    size: int
    groups: int
    done: torch.cuda.Event | None

    def busy(self) -> bool:
        """Whether the device still computes the forward (never on the CPU, where it ran
        when it was launched)."""
        return self.done is not None and not self.done.query()

    def collect(self) -> tuple[list[int], list[int]]:
        """The next tokens and the groups' missing flags (waits for the forward)."""
        out = self.result.tolist()
        r, size = self.requests, self.size
        return out[:r], out[size : size + self.groups]


class DoneEvent:
    """The CUDA event recorded after each forward of one launcher (``DecodeGraphs.launch``,
    the engine's eager ``_launch``): one forward of it is in flight at a time, so one event,
    made on first use and recorded again each launch, serves them all."""

    __slots__ = ("_event",)

    def __init__(self) -> None:
        self._event: torch.cuda.Event | None = None

    def record(self, result: torch.Tensor) -> torch.cuda.Event | None:
        """Record the event after the work queued so far on ``result``'s device (the
        forward that writes ``result``); None on the CPU, where it is done already."""
        if not result.is_cuda:
            return None
        if self._event is None:
            self._event = torch.cuda.Event()
        self._event.record(torch.cuda.current_stream(result.device))
        return self._event


class DecodeGraphs:
    """The engine's decode forwards on static buffers, captured in CUDA graphs (see the module
    docstring). ``launch(ids, rows, starts, slots, tables)`` queues one; its ``collect``
    returns the next token of each request and the missing-page flags of each layer
    group."""

    def __init__(
        self,
        model: torch.nn.Module,
        view: Callable[[int, str], torch.Tensor],
        layers: dict[int, LayerInfo],
        windows: Sequence[int | None],
        empty: int,
        forward: Callable[[KVCMCache, torch.Tensor, torch.Tensor, int], torch.Tensor],
        max_batch: int,
        device: torch.device,
        capture: bool,
    ) -> None:
        """``forward(cache, ids, pos, batch)``: the model's paged forward, returning the next
        tokens ``[batch]`` (the engine's, so that both paths run the same code)."""
        self._model = model
        self._view = view
        self._layers = layers
        self._windows = list(windows)
        self._empty = empty
        self._forward = forward
        self._device = device
        self.capture = capture
        self.sizes = buckets(max_batch)
        self._buckets: dict[int, _Bucket] = {}
        self._pool: Any = None
        self._done = DoneEvent()
        #: Forwards replayed (or, without capture, run on the static buffers), and captures.
        self.replays = 0
        self.captures = 0
        #: Why a capture failed (the forwards then run eagerly on the static buffers), or None.
        self.failed: str | None = None

    def fits(self, counts: Sequence[int]) -> bool:
        """Whether a forward of these new-token counts runs here: all decodes, few enough."""
        return bool(counts) and len(counts) <= self.sizes[-1] and all(c == 1 for c in counts)

    def _bucket(self, r: int) -> _Bucket:
        size = next(s for s in self.sizes if s >= r)
        b = self._buckets.get(size)
        if b is None:
            b = self._buckets[size] = _Bucket(
                size, len(self._windows), self._device, pinned=self.capture
            )
        return b

    def launch(
        self,
        ids: Sequence[int],
        rows: Sequence[int],
        starts: Sequence[int],
        slots: torch.Tensor,
        tables: torch.Tensor,
    ) -> Launched:
        """One decode forward of ``len(ids)`` requests, queued (replayed): token ``ids[i]`` at
        position ``starts[i]`` of the request in page-table row ``rows[i]``, its slots
        ``slots[:, i]`` (``[groups, R]``, kvcm's). ``Launched.collect`` reads its next tokens
        and the groups' missing flags, so that the host can plan the next step meanwhile.
        The bucket's buffers stay the forward's until then: collect it before the next
        launch."""
        r = len(ids)
        b = self._bucket(r)
        size, g = b.size, len(self._windows)
        h = b.host_np
        h[:] = 0
        h[:r] = ids
        h[size : size + r] = starts
        at = (2 + g) * size  # meta: rows, starts, counts, firsts
        h[at : at + r] = rows
        h[at + size : at + size + r] = starts
        h[at + 2 * size : at + 2 * size + r] = 1
        h[at + 3 * size : at + 3 * size + r] = np.arange(r)
        slot_rows = h[2 * size : at].reshape(g, size)
        slot_rows[:] = -1
        on_device = slots.device.type != "cpu"
        if not on_device:
            slot_rows[:, :r] = slots.numpy()
        b.staged.copy_(b.host, non_blocking=self.capture)
        if on_device:
            b.slots[:, :r].copy_(slots)
        captured = self.capture and self.failed is None
        result = self._replay(b, tables) if captured else self._step(b, tables)
        self.replays += 1
        return Launched(result, r, size, g, self._done.record(result))

    def _step(self, b: _Bucket, tables: torch.Tensor) -> torch.Tensor:
        """The forward on ``b``'s buffers: what the graph holds."""
        b.miss.zero_()
        b.meta.copy_(b.meta64)
        paged = PagedTables(
            tables,
            b.slots,
            b.meta,
            self._windows,
            self._empty,
            b.miss,
            [b.miss[g : g + 1] for g in range(len(self._windows))],
        )
        cache = KVCMCache(self._view, self._layers, paged)
        best = self._forward(cache, b.ids, b.pos, b.size)
        return torch.cat([best, b.miss.to(best.dtype)])

    def _replay(self, b: _Bucket, tables: torch.Tensor) -> torch.Tensor:
        if b.graph is None or b.tables_ptr != tables.data_ptr():
            try:
                self._capture(b, tables)
            except Exception as exc:  # the forward still runs, without graphs
                self.failed = f"{type(exc).__name__}: {exc}"
                warnings.warn(
                    f"kvcm_engine: the decode forward could not be captured in a CUDA graph "
                    f"({self.failed}); decodes run without graphs",
                    RuntimeWarning,
                    stacklevel=3,
                )
                torch.cuda.synchronize(self._device)
                return self._step(b, tables)
        assert b.result is not None
        b.graph.replay()
        return b.result

    def _capture(self, b: _Bucket, tables: torch.Tensor) -> None:
        side = torch.cuda.Stream(self._device)
        side.wait_stream(torch.cuda.current_stream(self._device))
        with torch.cuda.stream(side):
            self._step(b, tables)  # warm-up: compiles, lazy set-up (same writes as the replay)
        torch.cuda.current_stream(self._device).wait_stream(side)
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            b.result = self._step(b, tables)
        b.graph, b.tables_ptr = graph, tables.data_ptr()
        self.captures += 1

"""The engine: a transformers model that keeps its KV cache in kvcm, run step by step.

Per step (``Engine.step``): the scheduler makes kvcm's step call (commit, free, extend,
allocate), whose answer carries the slot mapping of the tokens the engine computes
(``map_slots``: one call per step; on a GPU the call also brings the page tables up to
date); the engine reads the page tables in place (``page_tables``: the in-process manager's
tensor, or the attached shared/IPC memory), and runs one forward of the model with a
``KVCMCache``: the model's attention writes the new keys and values at the slot mapping and
reads the history through the page tables. The logits of each request's last column pick its
next token (greedy).

Two backends give the same engine: ``Backend.in_process(manager)`` and
``Backend.sidecar(client)`` (HTTP for the calls, the attached pools for the memory).

A hybrid model (state layers: gated delta nets, Mamba-2 or Mamba-1 mixers; the families of
``models.STATE_PATHS``) also runs its recurrent layers on kvcm's state slots
(``StepStates``: gathered before the forward, written back after it). Its requests run in
forwards of equal token counts, never left-padded: a padding column would go through the
recurrence and change the state (attention masks it; a recurrent layer has no mask that
undoes an input). Decodes batch together (one token each), prefill chunks go with the chunks
of their own length. Its scheduler ends prefill chunks on block boundaries (``align``), where
kvcm checkpoints the state for prefix hits. A family whose multi-token scan starts from a
zero state (Jamba's Mamba-1) runs a chunk that continues a state (from a position above 0:
a prompt's later chunks, the prefill after a prefix hit or a resume) one token per forward
(``_forwards``); a model with recurrent layers of a family the engine does not implement is
refused (``UnsupportedFamily``) when the engine is made.
"""

from __future__ import annotations

import contextlib
import inspect
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
import torch

from .cache import (
    CacheMiss,
    KVCMCache,
    LayerInfo,
    PagedTables,
    StepStates,
    StepTables,
    missing_group,
)
from .graphs import DecodeGraphs, DoneEvent, Launched
from .models import BuiltModel, UnsupportedFamily, hybrid_unsupported, state_path
from .scheduler import Request, Scheduler, Work

#: A plan's forwards, each with its slot mapping, and the page tables they read (None: no
#: forward).
Prepared = tuple[list[tuple[list[Work], torch.Tensor]], torch.Tensor | None]


@dataclass(frozen=True, slots=True)
class Backend:
    """Where the calls go and where the memory is."""

    kvcm: Any
    """``step_columns`` (with ``map_slots``) and ``probe``: a ``KVCacheManager`` or
    ``KVCacheClient``."""
    view: Callable[[int, str], torch.Tensor]
    page_tables: Callable[[], torch.Tensor]
    layers: dict[int, LayerInfo]
    windows: list[int | None]
    tokens_per_block: int
    null_page: bool
    state_view: Callable[[int, str], torch.Tensor] | None = None
    """kvcm's ``state_view`` (a hybrid model's state layers; None without)."""
    state_buffers: dict[int, tuple[str, str]] = field(default_factory=dict)
    """Per state layer: its conv buffer's name, then its recurrent one's."""
    state_slots: Callable[[list[str], list[int]], torch.Tensor] | None = None
    """The state slots of requests (by kvcm id and page-table row)."""
    step_order: Any = None
    """A stream-ordered sidecar's ``Attachment`` (``wait_step`` before the step's forwards,
    ``step_done`` after them; its step calls pass ``stream_ordered``), or None."""
    ordered: bool = True
    """Whether a step's table edits come after the forwards already queued on the device:
    in process (one stream) or a stream-ordered sidecar; what planning ahead needs
    (``Engine``'s ``overlap``)."""

    @staticmethod
    def _make(
        kvcm: Any,
        view: Any,
        tables: Any,
        shared: Any,
        state_view: Any = None,
        state_slots: Any = None,
        step_order: Any = None,
        ordered: bool = True,
    ) -> Backend:
        layers = {
            spec.layer_id: LayerInfo(
                shared.layer_group_of[spec.layer_id], spec.kv_factor, spec.sliding_window
            )
            for spec in shared.layers
            if spec.num_kv_heads
        }
        windows: list[int | None] = [None] * (max(i.group for i in layers.values()) + 1)
        for spec in shared.layers:
            if spec.num_kv_heads:
                if spec.sink_tokens:
                    raise ValueError("the example engine has no attention sinks")
                windows[layers[spec.layer_id].group] = spec.sliding_window
        return Backend(
            kvcm,
            view,
            tables,
            layers,
            windows,
            shared.tokens_per_block,
            shared.null_page,
            state_view if shared.state_layers else None,
            {s.layer_id: (s.buffers[0].name, s.buffers[1].name) for s in shared.state_layers},
            state_slots if shared.state_layers else None,
            step_order,
            ordered,
        )

    @staticmethod
    def in_process(manager: Any) -> Backend:
        """The manager in this process (its ``pools()`` needs ``share`` only for the layout,
        so the layout is read from its config instead)."""
        cfg = manager.config
        shared = _LayoutView(
            cfg.layers,
            {
                s.layer_id: int(manager.layer_group_of(s.layer_id))
                for s in cfg.layers
                if s.num_kv_heads
            },
            cfg.tokens_per_block,
            cfg.null_page,
            cfg.state_layers,
        )
        return Backend._make(
            manager,
            manager.layer_view,
            manager.page_tables,
            shared,
            manager.state_view,
            lambda ids, rows: manager.state_indices(ids),
        )

    @staticmethod
    def sidecar(client: Any, stream_order: bool = False) -> Backend:
        """A ``KVCacheClient``: calls over HTTP, pools and page tables attached (shared memory
        on the CPU, CUDA IPC on a GPU). A hybrid model's state slots are the requests' rows
        (the step's answers carry no slots): kvcm gives the request in row r live slot r,
        resumed ones too, when every row has one (``state_live_slots`` left at
        ``max_requests``). ``stream_order`` (a CUDA sidecar sharing its tables): stream-ordered
        steps (``Backend.step_order``), which let the engine plan a step ahead."""
        attachment = client.attach(stream_order=stream_order)
        layout = attachment.layout
        if layout.state_layers:
            config = client.model().config
            if config.num_state_live_slots != config.max_requests:
                raise ValueError(
                    "the sidecar backend reads a request's state slot as its row: register "
                    "the model with state_live_slots left at max_requests"
                )
        return Backend._make(
            client,
            attachment.layer_view,
            lambda: attachment.page_tables,
            layout,
            attachment.state_view,
            lambda ids, rows: torch.tensor(rows),
            attachment if stream_order else None,
            ordered=stream_order,
        )


@dataclass(frozen=True, slots=True)
class _LayoutView:
    layers: Sequence[Any]
    layer_group_of: dict[int, int]
    tokens_per_block: int
    null_page: bool
    state_layers: Sequence[Any]


@dataclass(slots=True)
class EngineStats:
    steps: int = 0
    forwards: int = 0
    tokens_computed: int = 0
    tokens_generated: int = 0
    kvcm_s: float = 0.0
    model_s: float = 0.0
    wall_s: float = 0.0
    step_s: list[float] = field(default_factory=list)
    kvcm_step_s: list[float] = field(default_factory=list)
    """Each step's time in kvcm (its calls, the mapping cut per batch, the tables read); a
    step planned ahead counts its call here too, though it ran in the step before."""
    kvcm_exposed_s: float = 0.0
    """The part of ``kvcm_s`` the steps waited for: all of it but the calls planned ahead
    that ended while the device still computed the forward before them (those the forward
    hid; one that ended after it counts whole, though the forward hid part of it)."""
    planned_ahead: int = 0
    """Steps planned (their kvcm call made) while the forward of the step before computed
    (``overlap``)."""
    hidden: int = 0
    """Of ``planned_ahead``, those whose call ended before that forward did."""


class Engine:
    """Continuous batching of ``model`` on kvcm (see the module docstring)."""

    def __init__(
        self,
        built: BuiltModel,
        backend: Backend,
        *,
        chunk: int = 32,
        max_batch_tokens: int = 64,
        max_running: int = 16,
        preempt: Literal["free", "suspend"] = "free",
        attention: Literal["auto", "paged", "gather"] = "auto",
        hand_off_s: float | None = None,
        cuda_graphs: bool | Literal["auto"] = "auto",
        overlap: bool | Literal["auto"] = "auto",
    ) -> None:
        """``hand_off_s``: a prefill engine of a disaggregated pair hands its finished
        requests off for this many seconds (``Scheduler``, docs/disaggregation.md).
        ``cuda_graphs``: decode forwards replayed from CUDA graphs (``graphs.DecodeGraphs``);
        ``auto`` on the paged path on a CUDA device for a model without state layers;
        ``True`` elsewhere on the paged path runs the same static-buffer forward without
        capture (the CPU tests of that path). ``overlap``: while a step's forward computes
        (a decode's replay, or a prefill's launches), plan the next step and make its kvcm
        call (``Engine.step``); ``auto`` wherever the
        decodes run on the graphs' buffers and the backend is ``ordered`` (or the device is
        the CPU, where a forward is done when it returns)."""
        self.model = built.model
        self.backend = backend
        family = built.hf_config.get("model_type")
        self._path = state_path(built.hf_config)  # UnsupportedFamily: a state path not here
        self._hybrid = backend.state_view is not None
        if self._hybrid and self._path is None:
            raise UnsupportedFamily(family, "kvcm holds state layers for it")
        if self._path is not None and not self._hybrid:
            raise ValueError(
                f"{family} has {self._path.mixer} layers: register it with kvcm as a hybrid "
                "(kvcm.hf_state), so that kvcm holds their state"
            )
        if self._hybrid and (why := hybrid_unsupported()) is not None:
            raise RuntimeError(why)
        self.scheduler = Scheduler(
            backend.kvcm,
            chunk=chunk,
            max_batch_tokens=max_batch_tokens,
            max_running=max_running,
            align=backend.tokens_per_block if self._hybrid else 1,
            preempt=preempt,
            hand_off_s=hand_off_s,
            stream_ordered=backend.step_order is not None,
        )
        self.stats = EngineStats()
        self._views: dict[tuple[int, str], torch.Tensor] = {}
        self._views_of: Backend | None = None
        config = self.model.config
        self._device = next(self.model.parameters()).device
        self._dtype = next(self.model.parameters()).dtype
        # The model's recurrent layer i keeps its state in kvcm state layer _state_ids[i].
        offset = (
            config.num_hidden_layers
            if self._path is not None and self._path.state_ids_after_attention
            else 0
        )
        self._state_ids = {layer - offset: layer for layer in backend.state_buffers}
        self._mask_groups = self._masks(getattr(config, "layer_types", None))
        params = inspect.signature(self.model.forward).parameters
        # transformers renamed past_key_values to cache in 5.x.
        self._cache_arg = "cache" if "cache" in params else "past_key_values"
        #: "paged" (the attention reads kvcm's pages in place: kvcm_kernels.paged_attention)
        #: or "gather" (the history is gathered out of the pages for the model's attention).
        self.attention = self._attention_path(attention)
        # The configs that the attention modules read their implementation from.
        self._attention_configs = list(
            {
                id(m.config): m.config
                for m in self.model.modules()
                if getattr(m, "layer_idx", None) in backend.layers
                and hasattr(getattr(m, "config", None), "_attn_implementation")
            }.values()
        )
        self.graphs = self._decode_graphs(cuda_graphs, max_running)
        self.overlap = self._overlap(overlap)
        #: The next step's plan and kvcm time (all, exposed), made during this one (overlap).
        self._ahead: tuple[list[Work], float, float, Prepared | None] | None = None
        #: Recorded after each eager forward on CUDA (``_launch``).
        self._done = DoneEvent()

    def _view(self, layer_id: int, role: str) -> torch.Tensor:
        """The backend's pool view, made once per layer and role (a view costs microseconds
        to make, and a forward asks for two to four per layer); made again for a new
        backend."""
        if self._views_of is not self.backend:
            self._views, self._views_of = {}, self.backend
        view = self._views.get((layer_id, role))
        if view is None:
            view = self._views[layer_id, role] = self.backend.view(layer_id, role)
        return view

    def _attention_path(self, attention: str) -> Literal["paged", "gather"]:
        """``auto``: the paged-attention kernel where it runs (Triton, a CUDA device, and
        every attention layer of key and value: an MLA latent is gathered), the gather
        otherwise; ``paged`` forces the kernel path (an error for MLA), which without Triton
        runs the kernels' torch references: slow, for tests of the path on the CPU."""
        if attention == "gather":
            return "gather"
        if attention not in ("auto", "paged"):
            raise ValueError(f"attention must be auto, paged or gather, not {attention!r}")
        if any(info.kv_factor != 2 for info in self.backend.layers.values()):
            if attention == "paged":
                raise ValueError(
                    "the paged-attention kernel reads key/value layers: this model has "
                    "key-only (MLA latent) attention layers, which the gather path runs"
                )
            return "gather"
        if attention == "paged":
            return "paged"
        from kvcm_kernels.paged_attention import triton_usable

        probe = self._view(next(iter(self.backend.layers)), "key")
        return "paged" if probe.is_cuda and triton_usable(probe) else "gather"

    def _decode_graphs(
        self, cuda_graphs: bool | Literal["auto"], max_running: int
    ) -> DecodeGraphs | None:
        """The decode forwards' graphs (``cuda_graphs``, see ``__init__``), or None."""
        if cuda_graphs not in (True, False, "auto"):
            raise ValueError(f"cuda_graphs must be True, False or 'auto', not {cuda_graphs!r}")
        capture = self._device.type == "cuda"
        if cuda_graphs == "auto":
            cuda_graphs = capture and self.attention == "paged" and not self._hybrid
        if not cuda_graphs:
            return None
        if self.attention != "paged" or self._hybrid:
            raise ValueError("cuda_graphs needs the paged attention path and no state layers")
        b = self.backend
        return DecodeGraphs(
            self.model,
            self._view,
            b.layers,
            b.windows,
            0 if b.null_page else -1,
            self._graph_forward,
            max_running,
            self._device,
            capture,
        )

    def _overlap(self, overlap: bool | Literal["auto"]) -> bool:
        """Whether steps are planned ahead (``overlap``, see ``__init__``)."""
        if overlap not in (True, False, "auto"):
            raise ValueError(f"overlap must be True, False or 'auto', not {overlap!r}")
        ordered = self.backend.ordered or self._device.type != "cuda"
        if overlap is True:
            if self.graphs is None:
                raise ValueError("overlap needs the decode graphs (cuda_graphs)")
            if not ordered:
                raise ValueError(
                    "overlap needs a backend whose table edits wait for the queued forward: "
                    "in process, or a sidecar with stream_order"
                )
        return overlap is not False and self.graphs is not None and ordered

    def _masks(self, types: Sequence[str] | None) -> dict[str, int | None] | None:
        """Which kvcm layer group's mask each layer type takes (a dict), or None where the
        model takes one mask. Models with several layer types take a mask per type; a
        recurrent type (a state layer in kvcm) and a cacheless one (Nemotron-H's MLP and MoE
        layers) take none: a hybrid's batches are unpadded. A hybrid always gets the dict, with
        ``full_attention`` and ``linear_attention`` (Falcon-H1's one type, ``hybrid``, runs
        both; its model reads those two keys)."""
        b = self.backend
        if not self._hybrid and not (types and len(set(types)) > 1):
            if len(b.windows) != 1:
                raise ValueError("a model with one layer type needs one kvcm layer group")
            return None
        groups: dict[str, int | None] = {}
        for layer, kind in enumerate(types or []):
            info = b.layers.get(layer)
            if info is None and layer not in self._state_ids and kind not in ("mlp", "moe"):
                raise ValueError(f"layer {layer} ({kind}) is not one of kvcm's layers")
            g = None if info is None else info.group
            if groups.setdefault(kind, g) != g:
                raise ValueError(f"layers of type {kind} are in several kvcm layer groups")
        if self._hybrid:
            groups.setdefault("linear_attention", None)
            if "full_attention" not in groups:
                if len(b.windows) != 1:
                    raise ValueError("a hybrid's attention layers need one kvcm layer group")
                groups["full_attention"] = 0
        return groups

    def add(self, request: Request) -> None:
        self.scheduler.add(request)

    def run(self, arrivals: Sequence[Request], max_steps: int = 100_000) -> list[Request]:
        """Run until every request finished; request i joins at step ``arrival_step``."""
        pending = sorted(arrivals, key=lambda r: r.arrival_step)
        begin = time.perf_counter()
        step = 0
        while pending or not self.scheduler.idle:
            while pending and pending[0].arrival_step <= step:
                self.add(pending.pop(0))
            self.step()
            step += 1
            if step > max_steps:
                raise RuntimeError(f"not finished after {max_steps} steps")
        if self._ahead is not None:  # planned during the last step: nothing left but frees
            _, kvcm_s, exposed_s, _ = self._ahead
            self._ahead = None
            self.stats.kvcm_s += kvcm_s
            self.stats.kvcm_exposed_s += exposed_s
        self.stats.wall_s += time.perf_counter() - begin
        return sorted(self.scheduler.finished, key=lambda r: r.request_id)

    def step(self) -> None:
        """One step: its plan (made now, or during the step before: ``overlap``), its
        forwards, their tokens. With ``overlap``, a step that is one forward (a decode on the
        graphs' buffers, or a prefill or mixed step) launches it, then advances the scheduler
        with the tokens unknown
        (``Scheduler.advance``) and plans the next step, kvcm call included, while the device
        computes, and only then reads the tokens back (``Request.settle``). The order on the
        device stays the step's: the next call's table edits are queued after this forward
        (one stream in process; a stream-ordered sidecar waits for ``step_done``). A request
        added meanwhile joins a step later. A plan made ahead comes with its forwards'
        slot mappings cut and the tables in hand (``_prepare``), so the step launches at
        once."""
        begin = time.perf_counter()
        prepared: Prepared | None = None
        if self._ahead is not None:
            plan, kvcm_s, exposed_s, prepared = self._ahead
            self._ahead = None
        else:
            plan = self.scheduler.schedule()
            kvcm_s = exposed_s = time.perf_counter() - begin
        if prepared is None:  # (a plan made ahead whose preparing failed: again, now)
            t = time.perf_counter()
            prepared = self._prepare(plan)
            spent = time.perf_counter() - t
            kvcm_s += spent
            exposed_s += spent
        batches, tables = prepared
        self.stats.steps += 1
        order = self.backend.step_order
        if order is not None:
            order.wait_step()  # the forwards read the tables after this step's edits
        next_tokens: dict[str, int] = {}
        for batch, slots in batches:
            t = time.perf_counter()
            graph = self.graphs is not None and self.graphs.fits([w.count for w in batch])
            forwards = [(batch, slots)] if graph else self._forwards(batch, slots)
            launch = self._graph_launch if graph else self._launch
            for work, work_slots in forwards:
                launched = launch(work, work_slots, tables)
                if self.overlap and len(batches) == 1 and len(forwards) == 1:
                    self.stats.model_s += time.perf_counter() - t
                    self._overlapped(plan, launched)
                    self._account(begin, kvcm_s, exposed_s)
                    return
                best, miss = launched.collect()
                self._check_pages(work, miss)
                next_tokens.update(self._emit(work, best))
            self.stats.model_s += time.perf_counter() - t
        if order is not None:
            order.step_done()
        self.scheduler.finish_step(plan, next_tokens)
        self._account(begin, kvcm_s, exposed_s)

    def _overlapped(self, plan: list[Work], launched: Launched) -> None:
        """While ``launched`` (the whole of ``plan``) computes: advance the scheduler past
        ``plan`` and plan the next step; then read the tokens back and settle them. The
        tokens are settled whatever fails meanwhile (the plan ahead, the missing-page
        check), so that no unknown token stays."""
        order = self.backend.step_order
        if order is not None:
            order.step_done()  # the next step's edits wait for this forward on the device
        emitted = self.scheduler.advance(plan)
        try:
            t = time.perf_counter()
            ahead = self.scheduler.schedule()
            # Kept before it is prepared: its kvcm call ran, so the plan must not be lost if
            # preparing it fails (the step prepares it again).
            self._ahead = (ahead, time.perf_counter() - t, time.perf_counter() - t, None)
            prepared = self._prepare(ahead)
            spent = time.perf_counter() - t
            hidden = launched.busy()  # still computing: the forward hid the whole call
        finally:
            t = time.perf_counter()
            best, miss = launched.collect()
            self.stats.model_s += time.perf_counter() - t
            column = {w.request.request_id: i for i, w in enumerate(plan)}
            for r in emitted:
                r.settle(best[column[r.request_id]])
            self.scheduler.landed(plan)
            self._count(plan, len(emitted))
        self._ahead = (ahead, spent, 0.0 if hidden else spent, prepared)
        self.stats.planned_ahead += 1
        self.stats.hidden += hidden
        self._check_pages(plan, miss)

    def _account(self, begin: float, kvcm_s: float, exposed_s: float) -> None:
        self.stats.kvcm_s += kvcm_s
        self.stats.kvcm_exposed_s += exposed_s
        self.stats.kvcm_step_s.append(kvcm_s)
        self.stats.step_s.append(time.perf_counter() - begin)

    def _prepare(self, plan: list[Work]) -> Prepared:
        """``plan``'s forwards, each with its slot mapping (``_slots``), and the page tables
        they read: the host work between a plan and its launch, done while the step before
        computes when the plan is made ahead. The tables of a step are one tensor for all of
        its forwards (no kvcm call runs between them)."""
        mappings: dict[int, torch.Tensor] = {}
        batches = [(batch, self._slots(batch, mappings)) for batch in self._batches(plan)]
        return batches, self.backend.page_tables() if batches else None

    def _slots(self, batch: list[Work], mappings: dict[int, torch.Tensor]) -> torch.Tensor:
        """The batch's slot mapping ``[groups, sum(counts)]``, request after request, cut from
        the mappings the step's kvcm calls answered (``Scheduler.slots_of``): a tensor in
        process, per group an int64 buffer from a client (``mappings`` keeps each one's
        tensor for the step's other batches)."""
        parts = []
        for w in batch:
            mapping, column = self.scheduler.slots_of[w.request.request_id]
            tensor = mappings.get(id(mapping))
            if tensor is None:
                tensor = mappings[id(mapping)] = _as_tensor(mapping)
            if parts and parts[-1][0] is tensor and parts[-1][2] == column:
                parts[-1][2] = column + w.count  # the columns go on: one slice
            else:
                parts.append([tensor, column, column + w.count])
        slices = [t[:, a:b] for t, a, b in parts]
        return slices[0] if len(slices) == 1 else torch.cat(slices, dim=1)

    def _batches(self, plan: list[Work]) -> list[list[Work]]:
        """The forwards of a step: the whole plan in one, left-padded; a hybrid model's in
        one per token count, in the plan's order of counts (none padded: see the module
        docstring). Example: counts [1, 1, 16, 7, 16] give [1, 1], [16, 16], [7]."""
        if not plan:
            return []
        if not self._hybrid:
            return [plan]
        by_count: dict[tuple[int, bool], list[Work]] = {}
        for w in plan:
            by_count.setdefault((w.count, self._token_by_token(w)), []).append(w)
        return list(by_count.values())

    def _token_by_token(self, w: Work) -> bool:
        """Whether ``w`` runs one token per forward: it continues a state (from a position
        above 0) with several tokens, in a family whose multi-token scan starts from zeros."""
        path = self._path
        return path is not None and not path.scan_continues and w.start > 0 and w.count > 1

    def _forwards(
        self, batch: list[Work], slots: torch.Tensor
    ) -> list[tuple[list[Work], torch.Tensor]]:
        """The forwards of one batch (equal counts, for a hybrid) and their slot mappings
        (``slots`` ``[groups, sum(counts)]``, request after request): the batch in one, or,
        for work that runs token by token, one forward per token position j with each
        request's token j (columns ``i * count + j``). Example: 2 requests of 3 tokens from
        positions 8 and 20 give forwards of (8, 20), (9, 21), (10, 22), one token each."""
        if not self._token_by_token(batch[0]):
            return [(batch, slots)]
        count = batch[0].count
        return [
            (
                [Work(w.request, w.start + j, 1) for w in batch],
                slots[:, [i * count + j for i in range(len(batch))]],
            )
            for j in range(count)
        ]

    @torch.no_grad()
    def _launch(self, plan: list[Work], slots: torch.Tensor, tables: torch.Tensor) -> Launched:
        """One eager forward of ``plan`` (left-padded to its longest work), queued: on CUDA
        the host returns once its kernels are launched, and ``Launched.collect`` reads its
        next tokens (and, on the paged path, the groups' missing-page flags) back."""
        b = self.backend
        q = max(w.count for w in plan)
        ids = torch.zeros(len(plan), q, dtype=torch.long)
        pos = torch.zeros(len(plan), q, dtype=torch.long)
        for i, w in enumerate(plan):
            seq = w.request.seq
            ids[i, q - w.count :] = torch.tensor(seq[w.start : w.start + w.count])
            pos[i, q - w.count :] = torch.arange(w.start, w.start + w.count)
        rows = [w.request.row for w in plan]
        starts = [w.start for w in plan]
        counts = [w.count for w in plan]
        step_tables: StepTables | PagedTables
        if self.attention == "paged":
            # No gather tables and no mask: the kernel reads the page tables and masks itself.
            step_tables = PagedTables.build(
                tables, slots, rows, starts, counts, b.windows, b.null_page
            )
            unused = torch.empty((len(plan), 1, q, 1), dtype=self._dtype, device=self._device)
            masks = [unused] * len(b.windows)
        else:
            step_tables = StepTables.build(
                tables,
                slots,
                rows,
                starts,
                counts,
                b.windows,
                b.tokens_per_block,
                b.null_page,
                self._dtype,
            )
            masks = [t.mask for t in step_tables.groups]
        mask = self._mask_arg(masks)
        states = None
        if b.state_view is not None:
            assert b.state_slots is not None
            state_slots = b.state_slots(
                [w.request.kv_id for w in plan], [w.request.row for w in plan]
            )
            states = StepStates(b.state_view, b.state_buffers, state_slots)
        cache = KVCMCache(self._view, b.layers, step_tables, states, self._state_ids)
        out = self._call_model(
            cache, ids.to(self._device), pos.to(self._device), mask, self.attention == "paged"
        )
        if states is not None:
            states.write_back()
        result = out.logits[:, -1].float().argmax(dim=-1)
        groups = 0
        if isinstance(step_tables, PagedTables):
            # The kernels' missing-page flags come back with the tokens (one read).
            groups = len(step_tables.miss)
            result = torch.cat([result, step_tables.miss.to(result.dtype)])
        return Launched(result, len(plan), len(plan), groups, self._done.record(result))

    def _emit(self, plan: list[Work], best: Sequence[int]) -> dict[str, int]:
        """A forward's next tokens, by request, for the requests it finished computing."""
        done = {
            w.request.request_id: token
            for w, token in zip(plan, best, strict=True)
            if w.start + w.count == len(w.request.seq)
        }
        self._count(plan, len(done))
        return done

    def _count(self, plan: list[Work], generated: int) -> None:
        self.stats.forwards += 1
        self.stats.tokens_computed += sum(w.count for w in plan)
        self.stats.tokens_generated += generated

    def _mask_arg(self, masks: list[torch.Tensor]) -> Any:
        """The model's ``attention_mask``: the one group's mask, or one per layer type."""
        if self._mask_groups is None:
            return masks[0]
        return {kind: None if g is None else masks[g] for kind, g in self._mask_groups.items()}

    def _call_model(
        self, cache: KVCMCache, ids: torch.Tensor, pos: torch.Tensor, mask: Any, paged: bool
    ) -> Any:
        """One forward of the model on ``cache`` (the paged forward's context on the kernel
        path)."""
        with cache.paged_forward(self._attention_configs) if paged else contextlib.nullcontext():
            return self.model(
                input_ids=ids,
                position_ids=pos,
                attention_mask=mask,
                use_cache=True,
                logits_to_keep=1,
                **{self._cache_arg: cache},
            )

    def _graph_forward(
        self, cache: KVCMCache, ids: torch.Tensor, pos: torch.Tensor, batch: int
    ) -> torch.Tensor:
        """The decode forward that ``DecodeGraphs`` captures: the next tokens ``[batch]``."""
        unused = torch.empty((batch, 1, 1, 1), dtype=self._dtype, device=self._device)
        mask = self._mask_arg([unused] * len(self.backend.windows))
        out = self._call_model(cache, ids, pos, mask, True)
        return out.logits[:, -1].float().argmax(dim=-1)

    @torch.no_grad()
    def _graph_launch(
        self, plan: list[Work], slots: torch.Tensor, tables: torch.Tensor
    ) -> Launched:
        """A decode forward through ``self.graphs`` (a replay of its CUDA graph), queued."""
        assert self.graphs is not None
        return self.graphs.launch(
            [w.request.seq[w.start] for w in plan],
            [w.request.row for w in plan],
            [w.start for w in plan],
            slots,
            tables,
        )

    def _check_pages(self, plan: list[Work], miss: Sequence[int]) -> None:
        """``CacheMiss`` where a forward's kernels flagged a missing page (the paged path)."""
        g = missing_group(miss)
        if g is not None:
            raise CacheMiss(
                f"layer group {g}: a position the model needs has no page in kvcm's page "
                f"table (rows {[w.request.row for w in plan]})"
            )


def _as_tensor(mapping: Any) -> torch.Tensor:
    """A step's slot mapping as an int64 tensor ``[groups, tokens]``: the manager's tensor as
    it is, a client's int64 buffer per group stacked."""
    if isinstance(mapping, torch.Tensor):
        return mapping
    return torch.from_numpy(np.array(mapping, dtype=np.int64))


def reference_outputs(built: BuiltModel, requests: Sequence[Request]) -> dict[str, list[int]]:
    """The oracle: transformers' own ``generate`` (greedy, its own dense cache), one request
    at a time, on the same model."""
    out = {}
    device = next(built.model.parameters()).device
    for r in requests:
        ids = torch.tensor([r.prompt], device=device)
        gen = built.model.generate(
            ids, do_sample=False, max_new_tokens=r.max_new_tokens, pad_token_id=0
        )
        out[r.request_id] = gen[0, len(r.prompt) :].tolist()
    return out

"""``KVCacheManager``: the in-process kvcm API (DESIGN.md sections 3 to 5, 7 and 10).

The manager is a façade: it validates arguments, delegates and turns state into results. Its
components (``kvcm.components``, built by ``kvcm.assembly``) own the state: the request table
its rows, handles, tokens and commits (``kvcm.request_table``), the coordinator the block
tables and references, the host tier its slots, the state pools theirs, the tables-and-views
component the device tables and views of each rank (``kvcm.ranks``). The operations over them
are modules that take the components: starting a request (``kvcm.allocation``), rows and
handles (``kvcm.request_rows``), prefix reuse (``kvcm.prefix_reuse``), commits
(``kvcm.commits``), suspension (``kvcm.suspension``), transactions (``kvcm.transactions``),
capacity and stats (``kvcm.capacity``), steps (``kvcm.columnar``, ``kvcm.op_steps``);
docs/architecture.md draws the layers. Every op is atomic: it raises before anything
changes, or it completes.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager
from typing import Any, Literal, TypeVar

import numpy as np
import torch

from kvcm_client.errors import (
    InvalidArgument,
    KVEventsDisabled,
    PrefixCacheInUse,
    RequestsLive,
    StreamOrderUnavailable,
    UnknownLayer,
)
from kvcm_client.models import (
    AllocateOp,
    Estimate,
    IndexSnapshot,
    KVEvents,
    ManagerConfig,
    ModelInfo,
    Op,
    OpResult,
    RequestInfo,
    Role,
    SharedLayout,
    SnapshotGroup,
    Stats,
)
from kvcm_client.models import Layout as LayoutInfo

# Most ops in one step, and most of them that are not extends (``step``): the wire models'
# schema publishes them, so they live with them. Re-exported: tests patch them here.
from kvcm_client.specs import MAX_STEP_OPS as MAX_STEP_OPS
from kvcm_client.specs import MAX_STEP_OTHER_OPS as MAX_STEP_OTHER_OPS
from kvcm_client.transfer import KVExport, PullState, TransferAgent

from . import (
    allocation,
    assembly,
    capacity,
    commits,
    footprint,
    prefix_reuse,
    registration,
    request_rows,
    suspension,
    transactions,
    transfers,
)
from .allocation import MAX_REQUEST_ID as MAX_REQUEST_ID  # re-exported: tests read it
from .columnar import decode, mapped_tokens, rehearse, rehearse_decode, run_columns
from .columnar_parse import parse_columns, parse_keywords
from .columnar_types import StepOutcome
from .components import Components
from .counts import MAX_COUNT as MAX_COUNT  # re-exported: the bound tests and tools read
from .counts import _count
from .hashing import MultimodalItem
from .ids import LayerGroupId
from .layout import BufferPlacement
from .mapped_items import MappedItems, expand_items
from .op_steps import OpResults, execute_ops
from .ops import op_dicts
from .planning import check_config
from .planning import resolve_device as resolve_device  # re-exported: the server uses it
from .views import TablesAndViews

_F = TypeVar("_F", bound=Callable[..., Any])


def _doc(source: Callable[..., Any]) -> Callable[[_F], _F]:
    """Give a delegating method the docstring of the method it calls (what ``help`` shows)."""

    def wrap(method: _F) -> _F:
        method.__doc__ = source.__doc__
        return method

    return wrap


def _settle(m: KVCacheManager) -> None:
    """``Components.settle``: the copies the op queued, completed before it answers."""
    m.parts.settle()


def _settles(method: _F) -> _F:
    """``method``, then ``_settle`` (``extend``, the decode token's op, calls it itself: this
    wrapper's call is a tenth of its cost)."""

    @functools.wraps(method)
    def call(self: KVCacheManager, *args: Any, **kwargs: Any) -> Any:
        try:
            return method(self, *args, **kwargs)
        finally:
            _settle(self)

    return call  # type: ignore[return-value]


#: ``step_columns``' default ragged_layers: none (checked by identity, a step's cost).
_NO_LAYERS: tuple[int, ...] = ()


class KVCacheManager:
    """Owns the pools, the page tables and the requests of an engine's ranks."""

    #: The components (``kvcm.components``): what tools and tests read; each changes only
    #: through its own methods.
    parts: Components

    def __init__(self, config: ManagerConfig | dict[str, Any], check_budget: bool = True) -> None:
        """Build the pools; a ``memory_bytes`` budget that cannot hold one ``max_seq_len``
        request is refused (``InsufficientMemory``) unless ``check_budget`` is False (for
        tools that report the layout anyway, like ``kvcm estimate``)."""
        self._build(ManagerConfig.model_validate(config), check_budget)

    def _build(
        self, config: ManagerConfig, check_budget: bool = True, serial_base: int = 0
    ) -> None:
        """Everything ``__init__`` sets (``kvcm.assembly``); ``register_model`` builds a
        manager anew with it (``serial_base``: the previous model's last handle serial, so
        that no handle of it ever names a request of the new one)."""
        self.parts = parts = assembly.build(config, check_budget, serial_base)
        self.config = config
        self.device = parts.device
        self.layout = parts.layout
        self.memory = parts.memory
        self.generation = parts.generation
        self.tokens_per_block = parts.tokens_per_block
        self.max_blocks_per_request = parts.max_blocks_per_request
        #: Most positions one step can map (every row at ``max_seq_len``): the bound of a
        #: slot mapping's ``pad_to``, whose output is allocated up front (int64 per group).
        self.max_step_tokens = parts.max_step_tokens

    # -- requests ----------------------------------------------------------------------------

    @_doc(request_rows.rows_of)
    def _rows_of(self, request_ids: Sequence[str]) -> np.ndarray:
        return request_rows.rows_of(self.parts, request_ids)

    @_settles
    def allocate(
        self,
        request_id: str,
        num_tokens: int,
        token_ids: Sequence[int] | None = None,
        lookahead: int = 0,
        lora_id: int | str | None = None,
        cache_salt: str | None = None,
        multimodal: Sequence[MultimodalItem | dict[str, Any]] | None = None,
        block_keys: Sequence[bytes | str] | None = None,
        max_new_tokens: int | None = None,
    ) -> RequestInfo:
        """Start a request of ``num_tokens`` tokens plus ``lookahead`` draft slots.

        With ``token_ids`` (the prompt, ``num_tokens`` ids) the request reuses the longest
        cached prefix every layer group can serve, block-aligned and at most num_tokens - 1
        tokens (the last prompt token is always computed): ``num_hit_tokens`` of the result,
        already committed. ``lora_id``, ``cache_salt`` and ``multimodal`` items are the extra
        keys of its blocks (docs/prefix-reuse.md); ``block_keys``, when given, must be
        ``kvcm.block_keys`` of the same tokens and extras (it saves hashing them again).

        ``max_new_tokens=k`` sizes the request by its hit, for a scheduler's chunked prefill
        without a ``probe`` first: ``token_ids`` are the whole sequence known so far
        (``num_tokens`` of them), and the request gets the tokens it reuses plus at most k more,
        ``min(num_tokens, hit + k)`` (its result's ``num_tokens``; the hit counts the host tier
        too). Example (tokens_per_block 16): a 300-token prompt whose first 128 tokens are
        cached, k = 64: 192 tokens, 128 of them hit.

        Idempotent while the request lives: the same call again (same id, same arguments)
        returns the first result and allocates nothing, so a scheduler can retry an allocate
        whose answer it lost. Other arguments for a live id raise ``DuplicateRequest``.
        """
        return allocation.start(
            self.parts,
            request_id,
            num_tokens,
            token_ids,
            lookahead,
            lora_id,
            cache_salt,
            multimodal,
            block_keys,
            max_new_tokens,
        ).result

    @_doc(prefix_reuse.probe_tiers)
    def probe_tiers(
        self,
        token_ids: Sequence[int],
        lora_id: int | str | None = None,
        cache_salt: str | None = None,
    ) -> tuple[int, int]:
        return prefix_reuse.probe_tiers(self.parts, token_ids, lora_id, cache_salt)

    @_doc(capacity.host_stats)
    def host_stats(self) -> dict[str, Any]:
        return capacity.host_stats(self.parts)

    @_settles
    @_doc(suspension.suspend)
    def suspend(self, request_id: str) -> RequestInfo:
        return suspension.suspend(self.parts, request_id)

    @_settles
    @_doc(suspension.resume)
    def resume(self, request_id: str) -> RequestInfo:
        return suspension.resume(self.parts, request_id)

    @_doc(prefix_reuse.probe)
    def probe(
        self,
        token_ids: Sequence[int],
        lora_id: int | str | None = None,
        cache_salt: str | None = None,
        multimodal: Sequence[MultimodalItem | dict[str, Any]] | None = None,
        block_keys: Sequence[bytes | str] | None = None,
    ) -> int:
        return prefix_reuse.probe(
            self.parts, token_ids, lora_id, cache_salt, multimodal, block_keys
        )

    def reset_prefix_cache(self) -> None:
        """Forget every cached block (an ``all_blocks_cleared`` event); refused while any
        request holds blocks, since their blocks may be published again."""
        if self.parts.requests.rows:
            raise PrefixCacheInUse(
                f"{len(self.parts.requests.rows)} requests hold blocks; free them first",
                num_requests=len(self.parts.requests.rows),
            )
        if (
            self.parts.requests.undo is not None
        ):  # (its undo would leave the host tier's index empty)
            raise InvalidArgument("the prefix cache cannot be reset inside a transaction")
        self.parts.coord.cache.clear()
        if self.parts.host is not None:
            self.parts.host.clear()
        if self.parts.state is not None:
            self.parts.state.clear()

    @property
    def last_event_seq(self) -> int:
        """Sequence number of the newest KV event (0 before any)."""
        return self.parts.coord.cache.log.last_seq

    def events(self, after: int = 0, limit: int = 1000) -> KVEvents:
        """KV events with a sequence number above ``after`` (at most ``limit``); built from the
        log's compact records now. ``KVEventsDisabled`` with ``kv_events=False``."""
        after = _count("after", after, 0, 2**63 - 1)
        limit = _count("limit", limit, 1)
        log = self.parts.coord.cache.log
        if not log.enabled:
            raise KVEventsDisabled(
                "this manager records no KV events (kv_events=False, kvcm serve --no-kv-events)"
            )
        events, lost = log.after(after, limit)
        return KVEvents.model_validate(
            {
                "events": events,
                "last_seq": log.last_seq,
                "lost": lost,
                "generation": self.generation,
            }
        )

    def index_snapshot(self) -> IndexSnapshot:
        """Every block key cached now, per layer group and tier, with the sequence number of
        the last event it includes: load it, then follow ``events(after=last_seq)``."""
        cache = self.parts.coord.cache
        groups = [
            SnapshotGroup(
                layer_group=g,
                tier="device",
                block_keys=[k.hex() for scope in index.values() for k in scope],
            )
            for g, index in enumerate(cache.index)
        ]
        if self.parts.host is not None:
            host: dict[int, list[str]] = {}
            for lru in self.parts.host.lru.values():
                for g, _, key in lru:
                    host.setdefault(g, []).append(key.hex())
            groups += [
                SnapshotGroup(layer_group=g, tier="host", block_keys=keys)
                for g, keys in sorted(host.items())
            ]
        return IndexSnapshot(generation=self.generation, last_seq=cache.log.last_seq, groups=groups)

    def extend(self, request_id: str, num_new_tokens: int, lookahead: int = 0) -> RequestInfo:
        """Add ``num_new_tokens`` tokens; ``lookahead`` replaces the reserved draft slots."""
        try:  # ``_settles`` without its wrapper's call (see there)
            row = request_rows.row_of(self.parts, request_id)
            request_rows.extend_row(self.parts, row, num_new_tokens, lookahead)
            return request_rows.info(self.parts, request_id, row)
        finally:
            _settle(self)

    @_settles
    @_doc(request_rows.extend_many)
    def extend_many(
        self,
        request_ids: Sequence[str],
        num_new_tokens: int | Sequence[int] = 1,
        lookahead: int | Sequence[int] = 0,
    ) -> None:
        request_rows.extend_many(self.parts, request_ids, num_new_tokens, lookahead)

    @_settles
    def rewind(self, request_id: str, num_tokens: int) -> RequestInfo:
        """Drop the last ``num_tokens`` tokens (rejected drafts); at least one token stays."""
        row = request_rows.row_of(self.parts, request_id)
        request_rows.rewind_row(self.parts, row, num_tokens)
        return request_rows.info(self.parts, request_id, row)

    @_doc(commits.commit)
    @_settles
    def commit(self, request_id: str, token_ids: Sequence[int]) -> RequestInfo:
        return commits.commit(self.parts, request_id, token_ids)

    @_doc(commits.commit_many)
    @_settles
    def commit_many(self, request_ids: Sequence[str], token_ids: Sequence[Sequence[int]]) -> None:
        commits.commit_many(self.parts, request_ids, token_ids)

    @_doc(commits.committed_tokens)
    def committed_tokens(self, request_id: str) -> list[int]:
        return commits.committed_tokens(self.parts, request_id)

    def free(self, request_id: str) -> None:
        """End a request: its blocks go back to the pools (cached ones stay cached). A
        request whose KV moves between sidecars ends when the move lets it
        (``kvcm.transfers.free``)."""
        row = request_rows.row_of(self.parts, request_id, suspended=True)
        if self.parts.requests.held and request_id in self.parts.requests.held:
            transfers.free(self.parts, request_id)
            return
        suspension.discard(self.parts, request_id)
        request_rows.free_row(self.parts, row)

    def rehearse_columns(self, columns: Mapping[str, Any]) -> None:
        """Rehearse a step without running it: ``columns`` (``step_columns``' sections as
        keywords) are parsed as the step would parse them and, for a decode step (extends
        alone, one count for all), the batch is planned and its slots mapped in C into
        scratch, changing nothing here: no state, no event, no count. For a sidecar's
        busy-poll mode, which rehearses the last step while it waits for the next
        (``kvcm.server.step_channel``): after milliseconds of other work a step's rows,
        tables and code have left the caches, and the next step pays for it. A malformed
        ``columns`` raises ``InvalidArgument`` as the step would.

        Example: ``m.rehearse_columns({"extend": handles})`` before
        ``m.step_columns(extend=handles)`` changes nothing that the step reads or answers.
        """
        rehearse(self.parts, parse_keywords(columns))

    def rehearse_decode(
        self, extend: np.ndarray, num_new_tokens: int = 1, lookahead: int = 0
    ) -> None:
        """``rehearse_columns`` of ``decode_step``'s arguments, without the parse: the
        batch planned and its slots mapped in C into scratch, changing nothing, where
        ``decode_step`` would run it as the C core's batch (``extend`` an int64 array of two
        handles or more, one count and one lookahead for all); nothing otherwise (a
        rehearsal is optional: nothing is checked or raised). What busy-poll mode
        rehearses for a decode step's frame seen again, which the step channel answers
        through ``decode_step``: the rehearsal warms the path the next step takes.

        Example: ``m.rehearse_decode(np.array([h1, h2]))`` before
        ``m.decode_step(np.array([h1, h2]))`` changes nothing that the step reads or
        answers."""
        if (
            type(extend) is np.ndarray
            and extend.dtype == np.int64
            and extend.ndim == 1
            and extend.flags.c_contiguous
        ):
            rehearse_decode(self.parts, extend, num_new_tokens, lookahead)

    def step_columns(
        self,
        *,
        free: Sequence[int] | np.ndarray = (),
        rewind: Sequence[int] | np.ndarray = (),
        rewind_tokens: int | Sequence[int] | np.ndarray = 1,
        commit: Sequence[int] | np.ndarray = (),
        commit_tokens: Sequence[Sequence[int]] = (),
        extend: Sequence[int] | np.ndarray = (),
        num_new_tokens: int | Sequence[int] | np.ndarray = 1,
        lookahead: int | Sequence[int] | np.ndarray = 0,
        allocate: Sequence[AllocateOp | dict[str, Any]] = (),
        suspend: Sequence[int] | np.ndarray = (),
        resume: Sequence[int] | np.ndarray = (),
        atomic: bool = False,
        map_slots: bool = False,
        table_edits: bool = False,
        ragged_layers: Sequence[int] = _NO_LAYERS,
        stream_ordered: bool = False,
    ) -> StepOutcome:
        """One scheduler step as arrays: the primary API (docs/requests.md#the-columnar-step).

        Requests are named by handles (``RequestInfo.handle``, ``StepOutcome.handles`` of
        their allocate). Sections run in order: ``commit`` (handles, ``commit_tokens``: each
        one's newly computed token ids), ``free`` (handles), ``rewind`` (handles,
        ``rewind_tokens`` to drop), ``suspend`` (handles: to the host tier), ``resume`` (the
        handles the suspended requests had), ``extend`` (handles, ``num_new_tokens``,
        ``lookahead``: ints or one per handle), ``allocate`` (``AllocateOp`` models or their
        dicts). Each item is atomic on its own; ``atomic=True`` makes the step all or nothing
        (then without suspends and resumes, which copy pages). A malformed step
        raises ``InvalidArgument`` and runs nothing; an item's own failure is its status.

        Example: ``m.step_columns(free=[h0], extend=[h1, h2], allocate=[{"request_id": "c",
        "num_tokens": 9}])`` frees h0's request, adds a token to two others, starts "c";
        ``out.status["extend"]`` is ``[0, 0]`` when both fit, ``out.handles[0]`` is c's handle.

        ``map_slots=True`` also maps the tokens the engine computes for this step
        (``out.slot_mapping``: every layer group's slots of each successful extend's new
        tokens, then each successful allocate's past its hit; ``kvcm.columnar.mapped_tokens``),
        as ``slot_mappings`` would, in the same call: one round trip per step for a sidecar.
        On CUDA its memory is handed out again once nothing refers to it, in the current
        stream's order, as torch's allocator reuses freed memory (docs/kernels.md): keep the
        tensor while another stream, or code given only its address, still reads it.
        ``table_edits=True`` also answers the page-table cells changed since the last such
        answer (``out.table_edits``, int64 ``[E, 4]``: group, row, position, value), for an
        engine that keeps its own copy of the tables (``kvcm.table_mirror``). Where pulls
        or fetches from other sidecars ended since the last step, ``out.pulls`` lists their
        ``PullState`` (ready, with the handle, or failed), so a scheduler needs no
        ``transfer_status`` call (docs/disaggregation.md). ``ragged_layers`` (layer ids) also
        answers, per layer, the ragged pages of the requests the step maps
        (``out.ragged[layer]``, ``ragged_page_indices(..., per_layer=True)`` of those
        requests, in ``slot_mapping``'s order): a FlashInfer-style kernel's metadata for the
        forward, in the same call.

        ``stream_ordered=True`` (shared CUDA tables of one rank, else
        ``StreamOrderUnavailable``) returns without waiting for the device: the step's table
        edits are queued on the manager's stream after the consumers' done events and
        followed by the step event (``kvcm.step_order``), and ``out.slot_mapping`` is a host
        tensor mapped from the host's tables (the same values). An engine in another process
        makes its stream wait on the step event before it reads the tables
        (docs/shared-memory.md#stream-ordered-steps); one in this process that uses the
        manager's stream needs nothing. Not with ``ragged_layers`` (device results).
        """
        # Settles as ``_settles`` does, written out: the wrapper's argument passing costs a
        # step's twelve keywords a third of a microsecond.
        try:
            if type(atomic) is not bool or type(map_slots) is not bool:
                name = "atomic" if type(atomic) is not bool else "map_slots"
                raise InvalidArgument(f"{name} must be a bool")
            if type(table_edits) is not bool:
                raise InvalidArgument("table_edits must be a bool")
            if table_edits:
                self.parts.mirror.check()
            layers = () if ragged_layers is _NO_LAYERS else self._ragged_layers(ragged_layers)
            if stream_ordered is not False:
                self._check_stream_order(stream_ordered, layers)
            cols = parse_columns(
                free,
                rewind,
                rewind_tokens,
                commit,
                commit_tokens,
                extend,
                num_new_tokens,
                lookahead,
                allocate,
                suspend,
                resume,
            )
            if atomic and (cols.suspend.size or cols.resume.size):
                raise InvalidArgument("suspend and resume cannot be part of an all-or-nothing step")
            moves = self.parts.transfers
            if moves is not None and moves.busy:
                transfers.poll(self.parts)  # a pull that ended runs in this step
            sizes = cols.sizes()
            total = sum(sizes.values())
            if total > MAX_STEP_OPS or total - sizes["extend"] > MAX_STEP_OTHER_OPS:
                self._check_step_size(total, total - sizes["extend"])
            self.parts.tables.before_writes()
            out = run_columns(self.parts, cols, atomic, sizes)
            items = None
            if map_slots or layers:
                items = mapped_tokens(self.parts.coord.num_tokens, cols, out)
            return self._answer(out, items, map_slots, table_edits, stream_ordered, layers)
        finally:
            _settle(self)

    def decode_step(
        self,
        extend: np.ndarray,
        num_new_tokens: int = 1,
        lookahead: int = 0,
        *,
        map_slots: bool = False,
        table_edits: bool = False,
        stream_ordered: bool = False,
    ) -> StepOutcome:
        """An engine's decode step: ``step_columns(extend=extend,
        num_new_tokens=num_new_tokens, lookahead=lookahead, map_slots=map_slots,
        table_edits=table_edits, stream_ordered=stream_ordered)``, the same outcome and the
        same state after it, through a path of its own where the step is the C core's
        decode batch: ``extend`` an int64 array of two distinct live handles or more, one
        count and one lookahead for all, each request fitting. Anything else (a stale
        handle, a request past max_seq_len, a list of handles, counts per item, a bad
        argument) runs as ``step_columns``, which reports it as it always does.

        Why: at an engine's cadence (a step every 5-30 ms) every line of the step runs
        cold, and the general step's checks, sections and outcome cost a decode step more
        than the batch itself (docs/requests.md#the-decode-step). The step channel answers
        a decode step's frame through it (docs/step-channel.md).

        Example: ``m.decode_step(np.array([h1, h2]))`` adds a token to two requests:
        ``out.status["extend"]`` is ``[0, 0]``, as ``step_columns(extend=[h1, h2])``'s."""
        parts = self.parts
        moves = parts.transfers
        if (  # checked arguments of a step the batch may run (else step_columns says why)
            type(extend) is np.ndarray
            and extend.dtype == np.int64
            and extend.ndim == 1
            and extend.flags.c_contiguous
            and extend.size <= MAX_STEP_OPS
            and type(num_new_tokens) is int
            and 1 <= num_new_tokens <= MAX_COUNT
            and type(lookahead) is int
            and 0 <= lookahead <= MAX_COUNT
            and type(map_slots) is bool
            and type(table_edits) is bool
            and type(stream_ordered) is bool
            and (moves is None or not moves.busy)
        ):
            try:
                if table_edits:
                    parts.mirror.check()
                if stream_ordered:
                    self._check_stream_order(stream_ordered, ())
                parts.tables.before_writes()
                out = decode(parts, extend, num_new_tokens, lookahead)
                if out is not None:
                    # mapped_tokens' form of a decode step: its handles as they came
                    items = (extend, parts.coord.num_tokens, num_new_tokens) if map_slots else None
                    return self._answer(out, items, map_slots, table_edits, stream_ordered, ())
            finally:
                _settle(self)
        return self.step_columns(
            extend=extend,
            num_new_tokens=num_new_tokens,
            lookahead=lookahead,
            map_slots=map_slots,
            table_edits=table_edits,
            stream_ordered=stream_ordered,
        )

    def _answer(
        self,
        out: StepOutcome,
        items: MappedItems | None,
        map_slots: bool,
        table_edits: bool,
        stream_ordered: bool,
        layers: tuple[int, ...],
    ) -> StepOutcome:
        """A step's outcome completed with what it was asked for: its slot mapping
        (``items``: the tokens it maps, with ``map_slots`` or ``layers``), ragged pages,
        the stream order's publish, the table edits and the pulls that ended."""
        parts = self.parts
        if items is not None:
            if stream_ordered:
                out.slot_mapping = parts.views.map_tokens_host(items)
            elif map_slots:
                out.slot_mapping = parts.views.map_tokens(items)
                self._sync_other_ranks()
            if layers:
                views, rows = parts.views, expand_items(items)[0]
                out.ragged = {k: views.ragged_rows(rows, k, "key", True) for k in layers}
        if stream_ordered:
            # The step's state and host-tier copies first, then the edits and the event
            # after them all: an engine that waits on the event sees the step whole.
            parts.settle()
            parts.tables.publish()
        if table_edits:
            out.table_edits = parts.mirror.take()
        moves = parts.transfers
        if moves is not None and moves.ended:
            out.pulls = moves.take_ended()
        return out

    def _check_stream_order(self, stream_ordered: object, layers: tuple[int, ...]) -> None:
        """``step_columns``' stream_ordered checked before the step runs: a bool, on shared
        CUDA tables of one rank, without ragged layers (whose answer is read from the
        device)."""
        if type(stream_ordered) is not bool:
            raise InvalidArgument("stream_ordered must be a bool")
        if self.parts.tables.order is None:
            raise StreamOrderUnavailable(
                "stream_ordered needs page tables in shared CUDA memory on one rank "
                f"(device {self.device}, share={self.config.share}, "
                f"{len(self.parts.ranks)} rank(s)): answer without it",
                reason=self._no_stream_order_reason(),
            )
        if layers:
            raise InvalidArgument(
                "ragged_layers cannot go with stream_ordered (ragged pages are read from the "
                "device): ask ragged_page_indices after the step",
                ragged_layers=list(layers),
            )

    def _no_stream_order_reason(self) -> str:
        """Why this manager has no step order: ``device`` (not CUDA), ``not_shared`` or
        ``ranks`` (several ranks, or context parallelism)."""
        if self.device.type != "cuda":
            return "device"
        if not self.config.share:
            return "not_shared"
        return "ranks"

    def watch_consumer(self, consumer_id: str, done_event: str) -> None:
        """Make later table edits wait, on the manager's stream, for consumer
        ``consumer_id``'s done event (a base64 CUDA IPC event handle it records after its
        forward's reads of the tables; docs/shared-memory.md#stream-ordered-steps). Shared
        CUDA tables of one rank only (``StreamOrderUnavailable``); a bad handle is
        ``InvalidArgument``; either changes nothing."""
        order = self.parts.tables.order
        if order is None:
            raise StreamOrderUnavailable(
                "done events need page tables in shared CUDA memory on one rank",
                reason=self._no_stream_order_reason(),
            )
        order.watch(consumer_id, done_event)

    def forget_consumer(self, consumer_id: str) -> None:
        """Stop waiting on a consumer's done event (it detached or died); no-op if none."""
        order = self.parts.tables.order
        if order is not None:
            order.forget(consumer_id)

    def _ragged_layers(self, layers: Sequence[int]) -> tuple[int, ...]:
        """``step_columns``' ragged_layers checked before the step runs: distinct layer ids
        of layers with a key (``UnknownLayer`` otherwise, as ``ragged_page_indices``)."""
        if (
            not isinstance(layers, Sequence | np.ndarray)
            or (isinstance(layers, np.ndarray) and layers.ndim != 1)
            or isinstance(layers, str | bytes)
            or not all(type(k) is int or isinstance(k, np.integer) for k in layers)
        ):
            raise InvalidArgument("ragged_layers must be a list of layer ids")
        out = tuple(int(k) for k in layers)
        if len(set(out)) != len(out):
            raise InvalidArgument("ragged_layers names a layer twice", ragged_layers=list(out))
        for k in out:
            self.parts.views.placement(k, "key")
        return out

    def _check_step_size(self, num_ops: int, others: int) -> None:
        if num_ops > MAX_STEP_OPS or others > MAX_STEP_OTHER_OPS:
            raise InvalidArgument(
                f"a step takes at most {MAX_STEP_OPS} ops, {MAX_STEP_OTHER_OPS} of them other "
                f"than extends; got {num_ops} ({others}): split it",
                num_ops=num_ops,
                num_other_ops=others,
                max_ops=MAX_STEP_OPS,
                max_other_ops=MAX_STEP_OTHER_OPS,
            )

    @_settles
    def step(
        self, ops: Sequence[Op | dict[str, Any]], atomic: bool = False, brief: bool = False
    ) -> Sequence[OpResult]:
        """Run ops in order, each atomic on its own; one result per op (``OpResults``: a
        sequence whose models are built when read).

        Ops are models or their dicts. ``atomic=True`` makes the whole step all or nothing:
        at the first failing op every earlier op is undone; that op's result carries its
        error and every other op's result the error ``step_aborted`` (detail ``failed_op``:
        the failing op's index). It costs a copy of the host page tables and free lists.
        ``brief=True`` leaves ``request`` out of successful extends' results (the scheduler
        knows their lengths; rows never change), which is most of a decode step's answer.
        See ``step_plain`` for how runs of extends are batched.
        """
        for name, flag in (("atomic", atomic), ("brief", brief)):
            if type(flag) is not bool:
                raise InvalidArgument(f"{name} must be a bool, got {type(flag).__name__}")
        return OpResults(self.step_plain(op_dicts(list(ops)), atomic, brief))

    @_settles
    def step_plain(
        self, ops: list[dict[str, Any]], atomic: bool = False, brief: bool = False
    ) -> list[dict[str, Any]]:
        """``step`` on validated op dicts (``kvcm.ops.plain_ops``), with result dicts.

        The form the service uses: no model per op either way. A run of consecutive extends
        of distinct requests (a decode step, also between the frees and allocates of finished
        and new requests) runs as one batch, checked to fit op after op; if it does not, its
        ops run one by one, so each op's outcome is the same as running the ops in order.
        (A batch releases its stale window blocks before it takes new ones, so the order of
        the free list after it can differ from one-by-one runs.) At most ``MAX_STEP_OPS`` ops,
        at most ``MAX_STEP_OTHER_OPS`` of them other than extends, so that one call's work
        stays bounded.
        """
        self._check_step_size(len(ops), len(ops) - sum(1 for op in ops if op["op"] == "extend"))
        if self.parts.transfers is not None and self.parts.transfers.busy:
            transfers.poll(self.parts)  # a pull that ended runs in this step
        if not atomic:
            return execute_ops(self.parts, ops, False, brief)
        with self.transaction() as undo:
            results = execute_ops(self.parts, ops, True, brief)
            if results and not results[-1]["ok"]:  # stopped: every result is an error
                undo()
            return results

    @_doc(transactions.transaction)
    def transaction(self) -> AbstractContextManager[Callable[[], None]]:
        return transactions.transaction(self.parts)

    def request(self, request_id: str) -> RequestInfo:
        row = request_rows.row_of(self.parts, request_id, suspended=True)
        return request_rows.info(self.parts, request_id, row)

    def request_ids(self) -> list[str]:
        return list(self.parts.requests.rows)

    def block_table(self, request_id: str) -> list[list[int]]:
        """The request's block ids per layer group, by block position; -1 = released.

        Bookkeeping, not a kernel input: -1 even with the null page (the page tables hold 0).
        """
        row = request_rows.row_of(self.parts, request_id)
        return [self.parts.coord.block_list(g.group_id, row) for g in self.layout.layer_groups]

    # -- tables (the tables-and-views component's; ``kvcm.views``) ----------------------------

    def table_edits(self) -> np.ndarray:
        """The page-table cells changed since the last ``table_edits`` (or step with
        ``table_edits=True``), int64 ``[E, 4]``: layer group, row, position, value
        (``kvcm.table_mirror``); the first call lists every cell that holds a page."""
        return self.parts.mirror.take()

    @_doc(TablesAndViews.page_table)
    def page_table(self, layer_group: int) -> torch.Tensor:
        return self.parts.views.page_table(layer_group)

    @_doc(TablesAndViews.page_tables)
    def page_tables(self) -> torch.Tensor:
        return self.parts.views.page_tables()

    @_doc(TablesAndViews.sync_tables)
    def sync_tables(self) -> None:
        for rank in self.parts.ranks:
            rank.views.sync_tables()

    # -- ranks (kvcm.ranks; docs/ranks.md) -----------------------------------------------------

    @property
    def num_ranks(self) -> int:
        return len(self.parts.ranks)

    def rank(self, rank: int) -> TablesAndViews:
        """Rank ``rank``'s tables and views: ``page_table``, ``page_indices``,
        ``slot_mapping(s)``, ``pointer_table``, ``kv_view``, ``layer_view``, ``describe``,
        with the same arguments as the manager's own methods, which are rank 0's. Layer ids
        are that rank's; requests and block ids are the same on every rank."""
        if type(rank) is not int or not 0 <= rank < len(self.parts.ranks):
            raise InvalidArgument(
                f"rank {rank!r}: this manager has {len(self.parts.ranks)} ranks",
                rank=str(rank),
                num_ranks=len(self.parts.ranks),
            )
        return self.parts.ranks[rank].views

    def _placement(self, layer_id: int, role: str) -> BufferPlacement:
        return self.parts.views.placement(layer_id, role)

    @_doc(TablesAndViews.page_indices)
    def page_indices(
        self,
        request_ids: Sequence[str],
        layer_id: int,
        role: Role = "key",
        mode: Literal["slot", "kernel"] = "slot",
        per_layer: bool = False,
    ) -> torch.Tensor:
        return self.parts.views.page_indices(request_ids, layer_id, role, mode, per_layer)

    @_doc(TablesAndViews.ragged_page_indices)
    def ragged_page_indices(
        self, request_ids: Sequence[str], layer_id: int, role: Role = "key", per_layer: bool = False
    ) -> TablesAndViews.RaggedPages:
        return self.parts.views.ragged_page_indices(request_ids, layer_id, role, per_layer)

    @_doc(TablesAndViews.slot_mapping)
    def slot_mapping(
        self,
        request_ids: Sequence[str],
        layer_id: int,
        num_tokens: int | Sequence[int] | None = None,
        pad_to: int | None = None,
    ) -> torch.Tensor:
        out = self.parts.views.slot_mapping(request_ids, layer_id, num_tokens, pad_to)
        self._sync_other_ranks()
        return out

    @_doc(TablesAndViews.slot_mappings)
    def slot_mappings(
        self,
        request_ids: Sequence[str],
        num_tokens: int | Sequence[int] | None = None,
        pad_to: int | None = None,
    ) -> torch.Tensor:
        out = self.parts.views.slot_mappings(request_ids, num_tokens, pad_to)
        self._sync_other_ranks()
        return out

    def _sync_other_ranks(self) -> None:
        """The step's table edits on every rank's device too (a launch per rank on CUDA): the
        scheduler asks for the slot mappings once per step, and every rank's kernels then
        read current tables (rank 0's got the edits fused with the mapping)."""
        for rank in self.parts.ranks[1:]:
            rank.views.sync_tables()

    @_doc(TablesAndViews.copy_tokens)
    def copy_tokens(
        self,
        request_ids: Sequence[str],
        src_positions: Sequence[int],
        dst_positions: Sequence[int],
    ) -> None:
        for rank in self.parts.ranks:  # each checks the same bookkeeping: all refuse, or none
            rank.views.copy_tokens(request_ids, src_positions, dst_positions)

    @_doc(TablesAndViews.pointer_table)
    def pointer_table(self) -> torch.Tensor:
        return self.parts.views.pointer_table()

    @_doc(TablesAndViews.layer_pool_map)
    def layer_pool_map(self) -> torch.Tensor:
        return self.parts.views.layer_pool_map()

    @_doc(TablesAndViews.layer_pointer_table)
    def layer_pointer_table(self) -> torch.Tensor:
        return self.parts.views.layer_pointer_table()

    # -- memory views ------------------------------------------------------------------------

    @_doc(TablesAndViews.kv_view)
    def kv_view(self, layer_id: int) -> torch.Tensor:
        return self.parts.views.kv_view(layer_id)

    @_doc(TablesAndViews.layer_view)
    def layer_view(self, layer_id: int, role: Role) -> torch.Tensor:
        return self.parts.views.layer_view(layer_id, role)

    # -- state layers (kvcm.state_pools; docs/state-layers.md) --------------------------------

    def state_view(self, layer_id: int, buffer: str) -> torch.Tensor:
        """Buffer ``buffer`` of state layer ``layer_id``, ``[live slots + checkpoints,
        *shape]`` of its dtype on the manager's device: index it by ``state_indices`` (the
        first ``state_live_slots`` are live states). ``UnknownLayer`` for a layer or buffer
        the config does not have."""
        if self.parts.state is None:
            raise UnknownLayer(f"no state layer {layer_id}: the config has none", layer_id=layer_id)
        return self.parts.state.view(layer_id, buffer)

    def state_indices(self, request_ids: Sequence[str], group: int = 0) -> torch.Tensor:
        """The live state slot of each request in state group ``group``, int32 on the
        manager's device, for kernels (``RequestInfo.state_slot``: the same in every group;
        its page-table row unless ``state_live_slots`` is below ``max_requests``).
        ``RequestSuspended`` for a suspended request: it holds no slot."""
        if self.parts.state is None:
            raise InvalidArgument("the config has no state layers", state_group=group)
        self.parts.state.group_of(group)
        rows = self._rows_of(request_ids)
        return torch.from_numpy(self.parts.state.slot_of[rows].astype(np.int32)).to(self.device)

    # -- layout and sizing -------------------------------------------------------------------

    @_doc(TablesAndViews.describe)
    def describe(self) -> LayoutInfo:
        return self.parts.views.describe()

    @_doc(capacity.estimate)
    def estimate(
        self,
        seq_len: int,
        num_requests: int | None = None,
        *,
        prefill_chunk: int | None = None,
        lookahead: int | None = None,
    ) -> Estimate:
        return capacity.estimate(
            self.parts, seq_len, num_requests, prefill_chunk=prefill_chunk, lookahead=lookahead
        )

    @_doc(capacity.check_budget)
    def check_budget(self) -> None:
        capacity.check_budget(self.parts)

    @_doc(capacity.num_free_blocks)
    def num_free_blocks(self, pool_group: int | None = None) -> int:
        return capacity.num_free_blocks(self.parts, pool_group)

    @_doc(capacity.num_total_blocks)
    def num_total_blocks(self, pool_group: int | None = None) -> int:
        return capacity.num_total_blocks(self.parts, pool_group)

    @_doc(capacity.stats)
    def stats(self) -> Stats:
        return capacity.stats(self.parts)

    def pools(self, rank: int = 0) -> SharedLayout:
        """Descriptors of the shared pools and page tables of rank ``rank`` (needs
        ``share=True``).

        A consumer maps them with ``kvcm_client.attach``: views per (layer, role) with the
        strides of ``layer_view`` and the page tables ``[groups, max_requests, max_blocks]``,
        which the manager edits in place (on the CPU they are the manager's own tables).
        """
        views = self.rank(rank)
        if self.parts.segments is None:
            raise InvalidArgument("this manager was built without share=True: nothing to map")
        table_segment = self.parts.ranks[rank].table_segment
        assert table_segment is not None
        layout = views.shared_layout(self.generation, table_segment)
        if rank:
            return layout.model_copy(update={"rank": rank})
        order = self.parts.tables.order
        if order is not None:
            layout = layout.model_copy(update={"step_event": order.handle})
        if self.parts.state is None:
            return layout
        return layout.model_copy(
            update={
                "state_layers": list(self.config.state_layers),
                "state_pools": list(self.parts.state.segments),
                "state_buffers": self.parts.state.shared_buffers(),
            }
        )

    def close(self) -> None:
        """Unlink the shared segments (mappings that exist stay valid until unmapped) and
        deregister the memory from the transfer engine."""
        if self.parts.transfers is not None:
            self.parts.transfers.close()
        if self.parts.segments is not None:
            self.parts.segments.close()

    # -- KV moves between sidecars (docs/disaggregation.md) ------------------------------------

    def transfer_agent(self) -> TransferAgent:
        """This manager's transfer agent: name and metadata a peer loads to pull from it."""
        return transfers.endpoint(self.parts).agent(self.generation)

    @_doc(transfers.connect)
    def connect_peer(self, metadata: str) -> str:
        return transfers.connect(self.parts, metadata)

    def connected_agents(self) -> frozenset[str]:
        """The peers' transfer agents loaded now (``connect_peer``); none after a model
        registration, which starts a new agent."""
        return frozenset(transfers.endpoint(self.parts).engine.peers)

    @_doc(transfers.disconnect)
    def disconnect_peer(self, agent: str) -> None:
        transfers.disconnect(self.parts, agent)

    @_doc(transfers.hand_off)
    def hand_off(self, request_id: str, deadline_s: float = 30.0) -> KVExport:
        return transfers.hand_off(self.parts, request_id, deadline_s)

    @_doc(transfers.export_of)
    def export_of(self, request_id: str, scope: str) -> KVExport:
        return transfers.export_of(self.parts, request_id, scope)

    @_settles
    @_doc(transfers.pull)
    def pull(
        self,
        request_id: str,
        export: KVExport | dict[str, Any],
        lookahead: int = 0,
        lora_id: int | str | None = None,
        cache_salt: str | None = None,
        deadline_s: float = 30.0,
    ) -> PullState:
        return transfers.pull(
            self.parts,
            request_id,
            KVExport.model_validate(export),
            lookahead,
            lora_id,
            cache_salt,
            deadline_s,
        )

    @_settles
    @_doc(transfers.export_prefix)
    def export_prefix(
        self,
        token_ids: Sequence[int],
        lora_id: int | str | None = None,
        cache_salt: str | None = None,
        deadline_s: float = 30.0,
    ) -> KVExport:
        return transfers.export_prefix(self.parts, list(token_ids), lora_id, cache_salt, deadline_s)

    @_settles
    @_doc(transfers.fetch)
    def fetch(
        self,
        request_id: str,
        num_tokens: int,
        token_ids: Sequence[int],
        export: KVExport | dict[str, Any],
        lookahead: int = 0,
        lora_id: int | str | None = None,
        cache_salt: str | None = None,
        deadline_s: float = 30.0,
    ) -> PullState:
        return transfers.fetch(
            self.parts,
            request_id,
            num_tokens,
            list(token_ids),
            KVExport.model_validate(export),
            lookahead,
            lora_id,
            cache_salt,
            deadline_s,
        )

    @_settles
    @_doc(transfers.poll)
    def poll_transfers(self) -> None:
        transfers.poll(self.parts)

    @_doc(transfers.status)
    def transfer_status(self, request_ids: Sequence[str]) -> list[PullState]:
        transfers.poll(self.parts)
        return transfers.status(self.parts, request_ids)

    @property
    def transfers_busy(self) -> bool:
        """Whether a KV move runs (a pull or a hand-off): ``poll_transfers`` has work."""
        t = self.parts.transfers
        return t is not None and t.busy

    # -- the model -----------------------------------------------------------------------------

    def model(self) -> ModelInfo:
        """The model this manager serves: config, layout, estimate and generation."""
        return capacity.model_info(self.parts)

    def register_model(
        self, config: ManagerConfig | dict[str, Any] | None = None, /, **fields: Any
    ) -> ModelInfo:
        """Replace the model: a ``ManagerConfig``, or the fields of a ``ModelRegistration``
        as keyword arguments (``layers`` or ``hf_config``, budget and sizing; this manager's
        device, share and budget where they say nothing). Everything is checked first
        (``InvalidArgument``, ``InsufficientMemory``: the new pools must fit the memory free
        once these are closed), and refused with ``RequestsLive`` while any request is live;
        a refusal changes nothing. Then the pools are closed and the manager is built anew in
        place, in a new generation. Should the allocation itself fail (another process took
        the memory meanwhile), the previous model is built again, in a new generation, and
        the error raised."""
        new = registration.resolve(config, fields, registration.defaults_of(self.config))
        check_config(new, footprint.held_bytes(self.parts))
        if self.parts.requests.rows:
            raise RequestsLive(
                f"{len(self.parts.requests.rows)} requests are live: free them before registering "
                "a model",
                num_requests=len(self.parts.requests.rows),
            )
        previous = self.config
        serials = int(self.parts.requests.serial.max())
        self.close()
        self.__dict__.clear()  # drop the old pools before the new ones are allocated
        try:
            with footprint.allocating():
                self._build(new, serial_base=serials)
        except BaseException:
            self.__dict__.clear()
            self._build(previous, check_budget=False, serial_base=serials)  # built before
            raise
        return self.model()

    def layer_group_of(self, layer_id: int) -> LayerGroupId:
        return self._placement(layer_id, "key").layer_group

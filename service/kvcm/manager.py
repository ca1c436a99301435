"""``KVCacheManager``: the in-process kvcm API (DESIGN.md sections 3 to 5 and 7).

The manager validates arguments, maps request ids to page-table rows and turns state into
results; block bookkeeping is the coordinator's, memory the pools', index math kvcm_kernels'.
Every op is atomic: it raises before anything changes, or it completes.
"""

from __future__ import annotations

import functools
import logging
import uuid
import weakref
from collections.abc import Callable, Collection, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from typing import Any, Literal, TypeVar

import numpy as np
import torch
from pydantic import TypeAdapter, ValidationError

from kvcm_client.errors import (
    DeviceUnavailable,
    DuplicateRequest,
    InsufficientMemory,
    InvalidArgument,
    KVCMError,
    KVEventsDisabled,
    OutOfBlocks,
    PrefixCacheInUse,
    RequestLimitReached,
    RequestsLive,
    RequestSuspended,
    RewindIntoSharedBlock,
    SequenceTooLong,
    UnknownRequest,
    invalid_from_validation,
)
from kvcm_client.models import (
    AllocateOp,
    CommitOp,
    Estimate,
    ExtendOp,
    FreeOp,
    HostTierStats,
    KVEvents,
    ManagerConfig,
    ModelInfo,
    Op,
    OpResult,
    PrefixCacheStats,
    RequestInfo,
    ResumeOp,
    RewindOp,
    Role,
    SharedBuffer,
    SharedLayout,
    Stats,
    SuspendOp,
)
from kvcm_client.models import Layout as LayoutInfo

from . import footprint, registration
from .columnar import (
    ROW_MASK,
    OpResults,
    StepOutcome,
    parse_columns,
    run_columns,
)
from .coordinator import Coordinator
from .counts import MAX_COUNT as MAX_COUNT  # re-exported: the bound tests and tools read
from .counts import _count, _counts
from .device_tables import DeviceTables
from .hashing import (
    KEY_BYTES,
    MultimodalItem,
    chain_keys,
    multimodal_items,
    root_key,
    token_bytes,
)
from .host_tier import HostTier, onboard_prefix
from .ids import LayerGroupId, PoolGroupId
from .layout import BufferPlacement, Layout, build_layout
from .op_steps import execute_ops
from .ops import plain_ops
from .pools import PoolMemory
from .prefix_cache import find_hit
from .publish import PrefixState, publish
from .shared_memory import CudaSegments, SharedSegments
from .sizing import Sizing, StepShape
from .views import TablesAndViews

_log = logging.getLogger("kvcm")
_OPS = TypeAdapter(list[Op])
#: Op models without nested models (AllocateOp may hold multimodal models: it is dumped).
_FLAT_OPS = (ExtendOp, RewindOp, CommitOp, FreeOp, SuspendOp, ResumeOp)


def resolve_device(name: str) -> torch.device:
    try:
        device = torch.device(name)
    except RuntimeError as exc:
        raise InvalidArgument(f"unknown device {name!r}", device=name) from exc
    if device.type == "cpu":
        return device
    if device.type != "cuda":
        raise InvalidArgument(f"device must be cpu or cuda[:N], got {name!r}", device=name)
    if not torch.cuda.is_available():
        raise DeviceUnavailable(f"device {name!r} asked for but CUDA is not available")
    index = 0 if device.index is None else device.index
    if index >= torch.cuda.device_count():
        raise DeviceUnavailable(
            f"device {name!r} asked for but only {torch.cuda.device_count()} CUDA devices exist"
        )
    return torch.device("cuda", index)


#: Longest request id: ids are echoed in results and kept per request.
MAX_REQUEST_ID = 256
#: Most ops in one step, and most of them that are not extends: bounds the work (and the
#: event-loop time) of one service call to tens of ms (bench/loop_latency.py). Extends run
#: batched at well under a microsecond each; allocates, frees, commits and rewinds cost about
#: 10 us each. A scheduler step has an extend per running request and a few of the others.
MAX_STEP_OPS = 8192
MAX_STEP_OTHER_OPS = 1024


def _token_ids(value: Any) -> tuple[list[int], bytes]:
    """Validated token ids as plain ints and as the int32 bytes block keys hash.

    Python counts a bool as an int, and so does this check; the wire refuses bools.
    """
    data = _token_data(value)
    return np.frombuffer(data, dtype="<i4").tolist(), data


def _token_data(value: Any) -> bytes:
    """``_token_ids``' bytes only: what a commit keeps (it makes no int per token)."""
    if not isinstance(value, Sequence | np.ndarray):
        raise InvalidArgument("token_ids must be a sequence of ints", token_ids=None)
    return token_bytes(value)


def _check_key_sizes(keys: list[bytes]) -> None:
    """Refuse caller-given keys that are not 32 bytes (those past the hit: the hit's are
    cached keys already). A malformed key could never hit, but it is a client's bug worth
    naming."""
    try:
        sizes = set(map(len, keys))
    except TypeError:
        sizes = {0}
    if sizes - {KEY_BYTES}:
        raise InvalidArgument("block_keys must be 32-byte keys (bytes or hex)")


def _check_null_page_room(slots: dict[PoolGroupId, int]) -> None:
    """Refuse pool groups that the null page, which takes slot 0, would leave no slot."""
    for pg, n in slots.items():
        if n < 2:
            raise InsufficientMemory(
                f"pool group {pg} has {n} slot and the null page takes it: null_page needs "
                "at least 2 slots per pool group",
                pool_group=int(pg),
                num_slots=n,
            )


_F = TypeVar("_F", bound=Callable[..., Any])


def _doc(source: Callable[..., Any]) -> Callable[[_F], _F]:
    """Give a delegating method the docstring of the method it calls (what ``help`` shows)."""

    def wrap(method: _F) -> _F:
        method.__doc__ = source.__doc__
        return method

    return wrap


def _settles(method: _F) -> _F:
    """Return only once the host-tier copies the op queued have completed (kvcm.tier_copies).

    A step queues its copies and launches them in batches; its caller may write a slot the
    step evicted, or read a block it onboarded, as soon as it answers, so every public op
    that can take or give back slots waits for its copies here, also when it raises.
    """

    @functools.wraps(method)
    def call(self: KVCacheManager, *args: Any, **kwargs: Any) -> Any:
        try:
            return method(self, *args, **kwargs)
        finally:
            if self._host is not None:
                self._host.copier.finish()

    return call  # type: ignore[return-value]


def _weak(method: Callable[[Sequence[str]], np.ndarray]) -> Callable[[Sequence[str]], np.ndarray]:
    """``method`` holding its object weakly: a component the manager owns keeps no cycle back
    to it, so its pools go with its last reference (the server freezes the collector)."""
    ref = weakref.WeakMethod(method)

    def call(request_ids: Sequence[str]) -> np.ndarray:
        bound = ref()
        assert bound is not None, "the manager is gone"
        return bound(request_ids)

    return call


@dataclass(frozen=True, slots=True)
class _FirstAllocation:
    """What an allocate was called with and returned, so an identical retry returns it again."""

    args: tuple[Any, ...]
    result: RequestInfo


@dataclass(frozen=True, slots=True)
class _Suspended:
    """A suspended request: per layer group, the table positions of its blocks and the
    host slots holding their pages; the handle it gets back at resume."""

    blocks: list[tuple[np.ndarray, list[int]]]
    handle: int


@dataclass(slots=True)
class _Checkpoint:
    coordinator: Any
    rows: dict[str, int]
    free_rows: list[int]
    first: dict[str, _FirstAllocation]
    prefix: dict[str, PrefixState]
    hits: np.ndarray
    tokens: dict[str, list[int]]
    committed: np.ndarray
    ids: list[str | None]
    handles: np.ndarray


def _plan(
    cfg: ManagerConfig, check_budget: bool = True
) -> tuple[torch.device, Layout, Sizing, dict[PoolGroupId, int]]:
    """What a manager of ``cfg`` is, before any memory: device, layout, sizing and slots per
    pool group. Raises what construction refuses (a budget of no slot or, with
    ``check_budget``, of less than one ``max_seq_len`` request; no room for the null page)."""
    device = resolve_device(cfg.device)
    layout = build_layout(cfg.layers, cfg.tokens_per_block)
    sizing = Sizing(layout, cfg.max_seq_len, StepShape(cfg.max_prefill_chunk, cfg.max_lookahead))
    if cfg.num_blocks is not None:
        slots = {pg.pool_group_id: cfg.num_blocks for pg in layout.pool_groups}
    else:
        assert cfg.memory_bytes is not None
        slots = sizing.slots_for_budget(cfg.memory_bytes, int(cfg.null_page))
        if check_budget:
            sizing.check_budget(cfg.memory_bytes, slots, int(cfg.null_page))
    if cfg.null_page:
        _check_null_page_room(slots)
    return device, layout, sizing, slots


def check_config(cfg: ManagerConfig, freed: tuple[int, int] = (0, 0)) -> None:
    """Everything building ``cfg`` checks, without building it, and that its memory is free
    (``footprint.check_room``, counting ``freed`` as free): what a registration must pass
    before the model it replaces is closed."""
    resolve_device(cfg.device)
    footprint.check_room(cfg, build_layout(cfg.layers, cfg.tokens_per_block), freed)
    _plan(cfg)


class KVCacheManager:
    """Owns the pools, the page tables and the requests of one rank."""

    def __init__(self, config: ManagerConfig | dict[str, Any], check_budget: bool = True) -> None:
        """Build the pools; a ``memory_bytes`` budget that cannot hold one ``max_seq_len``
        request is refused (``InsufficientMemory``) unless ``check_budget`` is False (for
        tools that report the layout anyway, like ``kvcm estimate``)."""
        self._build(ManagerConfig.model_validate(config), check_budget)

    def _build(
        self, config: ManagerConfig, check_budget: bool = True, serial_base: int = 0
    ) -> None:
        """Everything ``__init__`` sets; ``register_model`` builds a manager anew with it
        (``serial_base``: the previous model's last handle serial, so that no handle of it
        ever names a request of the new one)."""
        self.config = cfg = config
        self.device, self.layout, self._sizing, self._slots = _plan(cfg, check_budget)
        self.tokens_per_block = cfg.tokens_per_block
        self.max_blocks_per_request = cfg.max_blocks_per_request
        #: Most positions one step can map (every row at ``max_seq_len``): the bound of a slot
        #: mapping's ``pad_to``, whose output is allocated up front (int64 per group).
        self.max_step_tokens = cfg.max_requests * cfg.max_seq_len
        #: Changes at every construction: shared descriptors of another one are refused.
        self.generation = uuid.uuid4().hex
        self._segments: SharedSegments | CudaSegments | None = None
        tables_buffer = None
        table_memory = None
        if cfg.share:
            self._segments = (
                SharedSegments(self.generation)
                if self.device.type == "cpu"
                else CudaSegments(self.generation, self.device)
            )
        self.memory = PoolMemory(
            self.layout, self._slots, self.device, self._segments, cfg.null_page
        )
        if self._segments is not None:
            ng = len(self.layout.layer_groups)
            table_bytes = 4 * ng * cfg.max_requests * self.max_blocks_per_request
            self._table_segment, table_memory = self._segments.allocate(table_bytes)
            if self.device.type == "cpu":  # the host tables are the shared ones
                tables_buffer = table_memory.numpy().data
        self._coord = Coordinator(
            self.layout,
            self._slots,
            cfg.max_requests,
            self.max_blocks_per_request,
            tables_buffer,
            cfg.null_page,
            cfg.kv_events,
        )
        self._rows: dict[str, int] = {}
        self._free_rows = list(range(cfg.max_requests - 1, -1, -1))
        #: Each row's request id and handle (None and -1 when free: no handle a caller passes
        #: can equal -1 with a row below max_requests), and the row's allocations so far (a
        #: handle's serial: kvcm.columnar).
        self._ids: list[str | None] = [None] * cfg.max_requests
        self._handle = np.full(cfg.max_requests, -1, dtype=np.int64)
        self._serial = np.full(cfg.max_requests, serial_base, dtype=np.int64)
        #: Scratch for the distinct-rows check of a batch of extends.
        self._order = np.arange(cfg.max_requests, dtype=np.int64)
        self._scratch = np.zeros(cfg.max_requests, dtype=np.int64)
        self._first: dict[str, _FirstAllocation] = {}
        self._prefix: dict[str, PrefixState] = {}
        #: Tokens each row got from the prefix cache at allocation.
        self._hits = np.zeros(cfg.max_requests, dtype=np.int64)
        #: Committed token ids per request, and their count per row (for batch results).
        #: (Committed ids as int32 bytes: a commit appends its checked bytes, a rewind cuts
        #: them, and no Python int is made per token; ``committed_tokens`` decodes them.)
        self._tokens: dict[str, bytearray] = {}
        self._committed = np.zeros(cfg.max_requests, dtype=np.int64)
        #: Undo actions for token-list edits while an all-or-nothing step runs.
        self._undo: list[Callable[[], None]] | None = None
        self._tables = DeviceTables(
            self._coord, self.device, None if self.device.type == "cpu" else table_memory
        )
        self._windows = [(g.sliding_window, g.sink_blocks) for g in self.layout.layer_groups]
        self._host = self._host_tier(cfg)
        self._coord.host = self._host
        #: Suspended requests: their blocks' positions and host slots per layer group.
        self._suspended: dict[str, _Suspended] = {}
        #: The handle each suspended request gets back, to its id (a resume by handle).
        self._suspended_handles: dict[int, str] = {}
        self._views = TablesAndViews(
            cfg,
            self.layout,
            self.device,
            self.memory,
            self._slots,
            self._coord,
            self._tables,
            _weak(self._rows_of),
        )

    def _host_tier(self, cfg: ManagerConfig) -> HostTier | None:
        """The host tier of ``host_memory_bytes``, split between pool groups in proportion
        to their device bytes (each gets ``floor(share / slot_bytes)`` slots)."""
        if cfg.host_memory_bytes is None:
            return None
        device = {
            int(pg.pool_group_id): self._slots[pg.pool_group_id] * pg.slot_bytes
            for pg in self.layout.pool_groups
        }
        total = sum(device.values())
        host = {
            int(pg.pool_group_id): cfg.host_memory_bytes
            * device[int(pg.pool_group_id)]
            // total
            // pg.slot_bytes
            for pg in self.layout.pool_groups
        }
        return HostTier(self.layout, self.memory.tensors, host, self.device, self._coord.cache.log)

    # -- requests ----------------------------------------------------------------------------

    def _row(self, request_id: str, suspended: bool = False) -> int:
        """The row of a live request; ``RequestSuspended`` for a suspended one unless
        ``suspended`` (what reads its bookkeeping, frees or resumes it)."""
        try:
            row = self._rows[request_id]
        except (KeyError, TypeError):
            shown = str(request_id)[:64]
            raise UnknownRequest(f"unknown request {shown!r}", request_id=shown) from None
        if not suspended and request_id in self._suspended:
            raise RequestSuspended(
                f"request {request_id!r} is suspended: resume it first", request_id=request_id
            )
        return row

    def _rows_of(self, request_ids: Sequence[str]) -> np.ndarray:
        # A str is a collection too: "ab" would be the requests "a" and "b".
        if isinstance(request_ids, str | bytes) or not isinstance(request_ids, Collection):
            raise InvalidArgument("request_ids must be a list of request ids", request_ids=None)
        rows = self._rows
        try:
            found = np.fromiter(
                (rows[r] for r in request_ids), dtype=np.int64, count=len(request_ids)
            )
        except (KeyError, TypeError):
            missing = next(r for r in request_ids if not isinstance(r, str) or r not in rows)
            shown = str(missing)[:64]
            raise UnknownRequest(f"unknown request {shown!r}", request_id=shown) from None
        if self._suspended:
            for r in request_ids:
                if r in self._suspended:
                    raise RequestSuspended(
                        f"request {r!r} is suspended: resume it first", request_id=r
                    )
        return found

    def _handle_rows(self, handles: np.ndarray) -> tuple[np.ndarray, np.ndarray | None]:
        """Rows of int64 handles, and a mask of the live ones (None when all are live).

        Example: handle ``2 << 32 | 7`` is row 7 if row 7's request is its second allocation;
        after that request's free it names nothing (the row's next request has serial 3).
        """
        rows = handles & ROW_MASK
        if handles.size and int(rows.max()) >= self.config.max_requests:
            inside = rows < self.config.max_requests
            rows = np.where(inside, rows, 0)
            live = inside & (self._handle[rows] == handles)
            return rows, live
        # Live handles are > 0 and a free row holds -1, whose row bits are past every row:
        # so a handle of 0 or below never matches.
        live = self._handle[rows] == handles
        return rows, (None if live.all() else live)

    def _extend_handles(
        self, handles: np.ndarray, new: np.ndarray | int, ahead: np.ndarray | int
    ) -> tuple[np.ndarray, np.ndarray] | None:
        """A decode step's fast path: extend live, distinct handles as one batch, as if one
        after another; (rows, blocks each added), or None (nothing changed) if any handle is
        not live, one repeats, or the batch does not fit item after item: the caller then
        runs the items one by one.

        Distinct rows: each writes its position into ``scratch``; a repeated row keeps only
        its last write, so an earlier position reads back something else.
        """
        n = handles.size
        if n > self.config.max_requests:  # cannot all be distinct live rows
            return None
        rows = handles & ROW_MASK
        if int(rows.max()) >= self.config.max_requests:
            return None
        order = self._order[:n]
        scratch = self._scratch
        scratch[rows] = order
        if not ((scratch[rows] == order) & (self._handle[rows] == handles)).all():
            return None
        c = self._coord
        history = c.num_tokens[rows]
        length = history + new
        capacity = length + ahead if type(ahead) is not int or ahead else length
        if int(capacity.max()) > self.config.max_seq_len:
            return None
        try:
            return rows, c.grow_rows(rows, history, length, capacity, ahead, in_order=True)
        except KVCMError:
            return None

    def _check_len(self, request_id: str, total: int) -> None:
        if total > self.config.max_seq_len:
            raise SequenceTooLong(
                f"request {request_id!r} would hold {total} tokens (with lookahead), "
                f"max_seq_len is {self.config.max_seq_len}",
                request_id=request_id,
                num_tokens=total,
                max_seq_len=self.config.max_seq_len,
            )

    def _info(self, request_id: str, row: int) -> RequestInfo:
        c = self._coord
        n = int(c.num_tokens[row])
        saved = self._suspended.get(request_id)
        return RequestInfo(
            request_id=request_id,
            row=row,
            num_tokens=n,
            capacity=n + int(c.lookahead[row]),
            num_committed=int(self._committed[row]),
            num_hit_tokens=int(self._hits[row]),
            handle=int(self._handle[row]) if saved is None else saved.handle,
        )

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
    ) -> RequestInfo:
        """Start a request of ``num_tokens`` tokens plus ``lookahead`` draft slots.

        With ``token_ids`` (the prompt, ``num_tokens`` ids) the request reuses the longest
        cached prefix every layer group can serve, block-aligned and at most num_tokens - 1
        tokens (the last prompt token is always computed): ``num_hit_tokens`` of the result,
        already committed. ``lora_id``, ``cache_salt`` and ``multimodal`` items are the extra
        keys of its blocks (docs/prefix-reuse.md); ``block_keys``, when given, must be
        ``kvcm.block_keys`` of the same tokens and extras (it saves hashing them again).

        Idempotent while the request lives: the same call again (same id, same arguments)
        returns the first result and allocates nothing, so a scheduler can retry an allocate
        whose answer it lost. Other arguments for a live id raise ``DuplicateRequest``.
        """
        if not isinstance(request_id, str) or not 0 < len(request_id) <= MAX_REQUEST_ID:
            raise InvalidArgument(
                f"request_id must be a string of 1 to {MAX_REQUEST_ID} characters",
                request_id=None,
            )
        num_tokens = _count("num_tokens", num_tokens, 1)
        lookahead = _count("lookahead", lookahead, 0)
        # With block_keys the caller's keys save the hashing but not the check of the ids:
        # an id outside [0, 2**31) would make the request's later commits unhashable.
        tokens, data = None, b""
        if token_ids is not None:
            self._check_prompt(token_ids, num_tokens)
            if block_keys is not None:
                data = token_bytes(token_ids)
                tokens = token_ids if type(token_ids) is list else list(token_ids)
            else:
                tokens, data = _token_ids(token_ids)
        items = multimodal_items(multimodal)
        root = root_key(lora_id, cache_salt)
        # The prompt is compared by value on a retry; it is not copied (schedulers resend the
        # same list, and copying 4k ids costs as much as the rest of an allocate).
        args = (num_tokens, lookahead, tokens, lora_id, cache_salt, items)
        first = self._first.get(request_id)
        if first is not None:
            if first.args == args:
                return first.result
            raise DuplicateRequest(
                f"request {request_id!r} is already allocated with other arguments "
                f"(num_tokens={first.args[0]}, lookahead={first.args[1]})",
                request_id=request_id,
                num_tokens=first.args[0],
                lookahead=first.args[1],
            )
        self._check_len(request_id, num_tokens + lookahead)
        if not self._free_rows:
            raise RequestLimitReached(
                f"all {self.config.max_requests} page-table rows are in use",
                max_requests=self.config.max_requests,
            )
        keys: list[bytes] = []
        hit = 0
        if tokens is not None:
            keys = self._keys_of(tokens, data, root, items, block_keys)
            # Not inside an all-or-nothing step: onboarding writes pages into device slots,
            # and an undo would give those slots back to the cache entries they had.
            if self._host is not None and self._undo is None:
                self._onboard(root, keys, num_tokens, data, lora_id, cache_salt is not None)
            hit, hits, ends = find_hit(
                self._coord.cache, root, keys, num_tokens, self.tokens_per_block, self._windows
            )
            if block_keys is not None:
                _check_key_sizes(keys[hit:])
        row = self._free_rows[-1]
        c = self._coord
        if hit:
            need, idle = c.hit_need(hits, num_tokens + lookahead)
            c.check_fits(need)
            hit_tokens = hit * self.tokens_per_block
            c.place_hits(row, hits, idle, ends, hit_tokens)
            c.grow_one(row, num_tokens - hit_tokens, lookahead)
        else:
            hit_tokens = 0
            c.grow_one(row, num_tokens, lookahead)
        if tokens is not None:
            stats = c.cache.stats
            stats.queries += 1
            stats.query_tokens += num_tokens
            stats.hit_tokens += hit_tokens
        self._free_rows.pop()
        self._rows[request_id] = row
        self._ids[row] = request_id
        self._serial[row] += 1
        self._handle[row] = (int(self._serial[row]) << 32) | row
        self._tokens[request_id] = bytearray(data[: 4 * hit_tokens])
        self._committed[row] = hit_tokens
        self._hits[row] = hit_tokens
        # Only keys kvcm hashed itself are kept for commits: caller-given keys are untrusted
        # past the hit (a client could pass another scope's keys), so commits hash those.
        kept = keys if block_keys is None else keys[:hit]
        self._prefix[request_id] = PrefixState(
            root, lora_id, cache_salt is not None, items, keys[:hit], data, kept
        )
        info = self._info(request_id, row)
        self._first[request_id] = _FirstAllocation(args, info)
        return info

    def _onboard(
        self,
        root: bytes,
        keys: list[bytes],
        num_tokens: int,
        data: bytes,
        lora_id: int | str | None,
        has_salt: bool,
    ) -> None:
        assert self._host is not None
        cap = min(len(keys), (num_tokens - 1) // self.tokens_per_block)
        onboard_prefix(self._coord, self._host, root, keys, cap, data, lora_id, has_salt)

    def probe_tiers(
        self,
        token_ids: Sequence[int],
        lora_id: int | str | None = None,
        cache_salt: str | None = None,
    ) -> tuple[int, int]:
        """(tokens a new request would reuse from the device now, tokens more it would
        onboard from the host tier): the run of the prompt's blocks every layer group holds
        on the device, then the run held on the device or the host; claims nothing."""
        self._check_prompt(token_ids, None)
        tokens, data = _token_ids(token_ids)
        root = root_key(lora_id, cache_salt)
        keys = chain_keys(root, data, self.tokens_per_block, 0, ())
        cache = self._coord.cache
        tpb = self.tokens_per_block
        cap = min(len(keys), (len(tokens) - 1) // tpb) if tokens else 0
        if cap <= 0 or not all(cache.reusable):
            return 0, 0
        index = [cache.scope(g, root) for g in range(len(self.layout.layer_groups))]
        device = 0
        while device < cap and all(keys[device] in i for i in index):
            device += 1
        if device and any(w is not None for w, _ in self._windows):
            device = self.probe(token_ids, lora_id, cache_salt) // tpb
        end = device
        host = self._host
        while (
            host is not None
            and end < cap
            and all(keys[end] in i or host.holds(g, root, keys[end]) for g, i in enumerate(index))
        ):
            end += 1
        return device * tpb, (end - device) * tpb

    def host_stats(self) -> dict[str, Any]:
        """The host tier's counters and occupancy ({} without one)."""
        host = self._host
        if host is None:
            return {}
        return {
            **asdict(host.stats),
            "host_slots": {int(pg): n for pg, n in host.num_slots.items()},
            "host_used": {int(pg): host.num_used(pg) for pg in host.num_slots},
        }

    @_settles
    def suspend(self, request_id: str) -> RequestInfo:
        """Move a request's blocks to the host tier and free their device slots; it keeps
        its id, row, length, committed tokens and keys, and answers ``request_suspended`` to
        every op but ``request``, ``committed_tokens``, ``free`` and ``resume`` (its handle
        names nothing until it is resumed). ``OutOfBlocks`` (detail ``tier="host"``) when
        the host tier cannot hold them even after dropping its cached blocks; nothing
        changes then (docs/host-tier.md)."""
        row = self._row(request_id)
        self._suspend_row(row)
        return self._info(request_id, row)

    def _suspend_row(self, row: int) -> None:
        """``suspend`` of a live row (a columnar step's item)."""
        request_id = self._ids[row]
        assert request_id is not None
        host = self._host
        if host is None:
            raise InvalidArgument("suspend needs a host tier (host_memory_bytes)")
        if self._undo is not None:
            raise InvalidArgument("suspend and resume cannot run inside an all-or-nothing step")
        c = self._coord
        blocks = []
        need: dict[int, int] = {}
        for g in range(len(self.layout.layer_groups)):
            seg = c.tables[g][row, : int(c.num_blocks[g][row])]
            positions = np.flatnonzero(seg > c.empty)
            blocks.append((positions, seg[positions].tolist()))
            pg = c.group_pool[g]
            need[pg] = need.get(pg, 0) + positions.size
        for pg, n in need.items():
            if n > host.room(pg):
                raise OutOfBlocks(
                    f"the host tier of pool group {pg} has room for {host.room(pg)} of the "
                    f"{n} blocks to suspend",
                    pool_group=pg,
                    needed=n,
                    free=host.room(pg),
                    tier="host",
                )
        saved = []
        for g, (positions, slots) in enumerate(blocks):
            pg = c.group_pool[g]
            saved.append((positions, host.hold(pg, slots) if slots else []))
            if slots:
                c._unref(pg, np.array(slots[::-1], dtype=np.int64))  # tail first, as a free
                c._set(g, row, positions, None)
        handle = int(self._handle[row])
        self._suspended[request_id] = _Suspended(saved, handle)
        self._suspended_handles[handle] = request_id
        self._handle[row] = -1

    @_settles
    def resume(self, request_id: str) -> RequestInfo:
        """Bring a suspended request's blocks back into new device slots and rewrite its
        table row; ``OutOfBlocks`` when the device has too few free slots, and nothing
        changes. The request has its handle back."""
        row = self._row(request_id, suspended=True)
        saved = self._suspended.get(request_id)
        if saved is None:
            raise InvalidArgument(f"request {request_id!r} is not suspended", request_id=request_id)
        if self._undo is not None:
            raise InvalidArgument("suspend and resume cannot run inside an all-or-nothing step")
        assert self._host is not None
        c = self._coord
        need = [0] * len(c.pools)
        for g, (positions, _) in enumerate(saved.blocks):
            need[c.group_pool[g]] += positions.size
        c.check_fits(need)
        for g, (positions, host_slots) in enumerate(saved.blocks):
            if not host_slots:
                continue
            pg = c.group_pool[g]
            slots = c._take(pg, len(host_slots))
            self._host.give_back(pg, host_slots, slots.tolist())
            c._set(g, row, positions, slots)
        c.ops_since_take += 1
        del self._suspended[request_id]
        del self._suspended_handles[saved.handle]
        self._handle[row] = saved.handle
        return self._info(request_id, row)

    def _check_prompt(self, token_ids: Any, num_tokens: int | None) -> None:
        """Refuse a prompt of the wrong length before any work on it (hashing a prompt is the
        costliest thing an allocate or probe does): ``num_tokens`` ids, or at most
        ``max_seq_len`` for a probe (a longer one can never be a request)."""
        if not isinstance(token_ids, Sequence | np.ndarray) or isinstance(token_ids, str | bytes):
            raise InvalidArgument("token_ids must be a sequence of ints", token_ids=None)
        n = len(token_ids)
        if num_tokens is not None and n != num_tokens:
            raise InvalidArgument(
                f"token_ids has {n} ids for num_tokens={num_tokens}",
                num_tokens=num_tokens,
                num_token_ids=n,
            )
        if n > self.config.max_seq_len:
            raise SequenceTooLong(
                f"a prompt of {n} tokens is past max_seq_len={self.config.max_seq_len}",
                num_tokens=n,
                max_seq_len=self.config.max_seq_len,
            )

    def _keys_of(
        self,
        tokens: list[int],
        data: bytes,
        root: bytes,
        items: tuple[MultimodalItem, ...],
        given: Sequence[bytes | str] | None,
    ) -> list[bytes]:
        """The prompt's block keys: ``given`` (checked for shape), or hashed from ``data``."""
        full = len(tokens) // self.tokens_per_block
        if given is None:
            return chain_keys(root, data, self.tokens_per_block, 0, items)
        if isinstance(given, str | bytes) or not isinstance(given, Sequence):
            raise InvalidArgument("block_keys must be a list of keys", block_keys=None)
        # Only the count is checked here: a malformed key is in no index, so it can never hit.
        # allocate checks the size of the keys past the hit, which commits may publish. Hex
        # strings (the wire form) are converted.
        keys = given if type(given) is list else list(given)
        if keys and type(keys[0]) is not bytes:
            try:
                keys = [bytes.fromhex(k) if isinstance(k, str) else bytes(k) for k in keys]
            except (TypeError, ValueError):
                raise InvalidArgument("block_keys must be 32-byte keys (bytes or hex)") from None
        if len(keys) != full:
            raise InvalidArgument(
                f"block_keys must be the {full} keys of the full blocks of token_ids",
                num_keys=len(keys),
            )
        return keys

    def probe(
        self,
        token_ids: Sequence[int],
        lora_id: int | str | None = None,
        cache_salt: str | None = None,
        multimodal: Sequence[MultimodalItem | dict[str, Any]] | None = None,
        block_keys: Sequence[bytes | str] | None = None,
    ) -> int:
        """Tokens a new request with this prompt would reuse now; claims nothing."""
        self._check_prompt(token_ids, None)
        if block_keys is not None:
            # Only the prompt's length is used (a probe claims nothing), but it must have one.
            if isinstance(token_ids, str | bytes) or not isinstance(
                token_ids, Sequence | np.ndarray
            ):
                raise InvalidArgument("token_ids must be a sequence of ints", token_ids=None)
            tokens, data = token_ids, b""  # type: ignore[assignment]
        else:
            tokens, data = _token_ids(token_ids)
        if len(tokens) == 0:
            return 0
        root = root_key(lora_id, cache_salt)
        keys = self._keys_of(tokens, data, root, multimodal_items(multimodal), block_keys)
        hit, _, _ = find_hit(
            self._coord.cache, root, keys, len(tokens), self.tokens_per_block, self._windows, True
        )
        return hit * self.tokens_per_block

    def reset_prefix_cache(self) -> None:
        """Forget every cached block (an ``all_blocks_cleared`` event); refused while any
        request holds blocks, since their blocks may be published again."""
        if self._rows:
            raise PrefixCacheInUse(
                f"{len(self._rows)} requests hold blocks; free them first",
                num_requests=len(self._rows),
            )
        self._coord.cache.clear()
        if self._host is not None:
            self._host.clear()

    @property
    def last_event_seq(self) -> int:
        """Sequence number of the newest KV event (0 before any)."""
        return self._coord.cache.log.last_seq

    def events(self, after: int = 0, limit: int = 1000) -> KVEvents:
        """KV events with a sequence number above ``after`` (at most ``limit``); built from the
        log's compact records now. ``KVEventsDisabled`` with ``kv_events=False``."""
        after = _count("after", after, 0, 2**63 - 1)
        limit = _count("limit", limit, 1)
        log = self._coord.cache.log
        if not log.enabled:
            raise KVEventsDisabled(
                "this manager records no KV events (kv_events=False, kvcm serve --no-kv-events)"
            )
        events, lost = log.after(after, limit)
        return KVEvents.model_validate({"events": events, "last_seq": log.last_seq, "lost": lost})

    @_settles
    def extend(self, request_id: str, num_new_tokens: int, lookahead: int = 0) -> RequestInfo:
        """Add ``num_new_tokens`` tokens; ``lookahead`` replaces the reserved draft slots."""
        row = self._row(request_id)
        self._extend_row(row, num_new_tokens, lookahead)
        return self._info(request_id, row)

    def _extend_row(self, row: int, num_new_tokens: int, lookahead: int) -> int:
        """Extend one row (a columnar step's item); returns the block positions added."""
        if not (type(num_new_tokens) is int and 0 < num_new_tokens <= MAX_COUNT):
            num_new_tokens = _count("num_new_tokens", num_new_tokens, 1)
        if not (type(lookahead) is int and 0 <= lookahead <= MAX_COUNT):
            lookahead = _count("lookahead", lookahead, 0)
        total = int(self._coord.num_tokens[row]) + num_new_tokens + lookahead
        if total > self.config.max_seq_len:
            self._check_len(self._ids[row] or "", total)
        return self._coord.grow_one(row, num_new_tokens, lookahead)

    @_settles
    def extend_many(
        self,
        request_ids: Sequence[str],
        num_new_tokens: int | Sequence[int] = 1,
        lookahead: int | Sequence[int] = 0,
    ) -> None:
        """Extend distinct requests at once (one decode step), all or nothing."""
        self._extend(request_ids, num_new_tokens, lookahead, in_order=False)

    def _extend(
        self,
        request_ids: Sequence[str],
        num_new_tokens: int | Sequence[int],
        lookahead: int | Sequence[int],
        in_order: bool,
    ) -> np.ndarray:
        """``extend_many``; returns the rows (in ``request_ids`` order)."""
        rows = self._rows_of(request_ids)
        n = rows.size
        seen = np.zeros(self.config.max_requests, dtype=bool)
        seen[rows] = True
        if int(seen.sum()) != n:
            raise InvalidArgument("extend_many needs distinct request ids", num_ids=n)
        new = _counts("num_new_tokens", num_new_tokens, n, 1)
        ahead = _counts("lookahead", lookahead, n, 0)
        total = self._coord.num_tokens[rows] + new + ahead
        if n and int(total.max()) > self.config.max_seq_len:
            i = int(total.argmax())
            self._check_len(request_ids[i], int(total[i]))
        self._coord.grow(rows, new, ahead, in_order)
        return rows

    @_settles
    def rewind(self, request_id: str, num_tokens: int) -> RequestInfo:
        """Drop the last ``num_tokens`` tokens (rejected drafts); at least one token stays."""
        row = self._row(request_id)
        self._rewind_row(row, num_tokens)
        return self._info(request_id, row)

    def _rewind_row(self, row: int, num_tokens: int) -> None:
        request_id = self._ids[row]
        assert request_id is not None
        length = int(self._coord.num_tokens[row])
        num_tokens = _count("num_tokens", num_tokens, 1)
        if num_tokens >= length:
            raise InvalidArgument(
                f"request {request_id!r} has {length} tokens; rewind removes at most "
                f"{length - 1} (free the request to drop all)",
                request_id=request_id,
                num_tokens=num_tokens,
            )
        new_len = length - num_tokens
        writable = self._writable_cached(request_id, row, new_len)
        self._coord.rewind(row, num_tokens)
        for pg, slots in writable.items():
            self._coord.cache.uncache(pg, slots)
        state = self._prefix[request_id]
        dropped = state.keys[new_len // self.tokens_per_block :]
        del state.keys[new_len // self.tokens_per_block :]
        if self._undo is not None and dropped:
            self._undo.append(lambda: state.keys.extend(dropped))
        tokens = self._tokens[request_id]
        if len(tokens) > 4 * new_len:
            tail = tokens[4 * new_len :]
            del tokens[4 * new_len :]
            self._committed[row] = new_len
            if self._undo is not None:
                self._undo.append(lambda: tokens.extend(tail))

    def _writable_cached(self, request_id: str, row: int, new_len: int) -> dict[int, list[int]]:
        """Cached blocks a rewind to ``new_len`` would make the request write into again.

        Blocks from ``new_len // tokens_per_block`` on will be overwritten; one that another
        request shares cannot be (``RewindIntoSharedBlock``), one only this request holds is
        taken out of the cache. Returns those, per pool group.
        """
        c = self._coord
        keep = -(-(new_len + int(c.lookahead[row])) // self.tokens_per_block)
        out: dict[int, list[int]] = {}
        for g in range(len(self.layout.layer_groups)):
            pg = c.group_pool[g]
            held = c.tables[g][row, new_len // self.tokens_per_block : keep]
            for slot in held[held > c.empty].tolist():
                if not c.cache.cached[pg][slot]:
                    continue
                if c.refs[pg][slot] > 1:
                    raise RewindIntoSharedBlock(
                        f"rewinding {request_id!r} to {new_len} tokens would overwrite a "
                        "block other requests share",
                        request_id=request_id,
                        num_tokens=new_len,
                    )
                out.setdefault(pg, []).append(slot)
        return out

    def commit(self, request_id: str, token_ids: Sequence[int]) -> RequestInfo:
        """Record that the KV of the request's next ``len(token_ids)`` tokens is computed.

        Committed tokens are a prefix of the request: a request of 10 tokens with 4 committed
        accepts at most 6 more. ``rewind`` drops committed tokens past the new length.
        Every block the committed prefix fills is keyed and published for reuse in each
        reusable layer group (a ``block_stored`` event), unless that key is cached already.
        Blocks holding the prompt's own tokens take the keys allocate computed for them
        (``commit_keys``); other blocks are hashed.
        """
        row = self._row(request_id)
        self._commit_row(row, token_ids)
        return self._info(request_id, row)

    def _commit_row(self, row: int, token_ids: Sequence[int]) -> None:
        request_id = self._ids[row]
        assert request_id is not None
        data = _token_data(token_ids)
        self._check_commit(request_id, row, len(data) // 4)
        self._commit(request_id, row, data)

    def commit_many(self, request_ids: Sequence[str], token_ids: Sequence[Sequence[int]]) -> None:
        """Commit ``token_ids[i]`` to ``request_ids[i]`` (distinct requests: the end of one
        forward pass), all or nothing: every id, token list and length is checked before any
        request is committed, so a refused call changes nothing. Each commit is ``commit``'s.
        """
        rows = self._rows_of(request_ids)
        n = rows.size
        if len(set(rows.tolist())) != n:
            raise InvalidArgument("commit_many needs distinct request ids", num_ids=n)
        if isinstance(token_ids, str | bytes) or not isinstance(token_ids, Sequence):
            raise InvalidArgument("token_ids must be a list of token id lists", token_ids=None)
        if len(token_ids) != n:
            raise InvalidArgument(
                f"commit_many got {n} request ids and {len(token_ids)} token id lists",
                num_ids=n,
                num_token_id_lists=len(token_ids),
            )
        checked = [_token_data(t) for t in token_ids]
        ids = list(request_ids)
        for request_id, row, data in zip(ids, rows.tolist(), checked, strict=True):
            self._check_commit(request_id, row, len(data) // 4)
        for request_id, row, data in zip(ids, rows.tolist(), checked, strict=True):
            self._commit(request_id, row, data)

    def _check_commit(self, request_id: str, row: int, num_new: int) -> None:
        """Refuse committing ``num_new`` more tokens than the request has uncommitted."""
        done = len(self._tokens[request_id]) // 4
        length = int(self._coord.num_tokens[row])
        if done + num_new > length:
            raise InvalidArgument(
                f"request {request_id!r} has {length} tokens and {done} committed; "
                f"{num_new} more do not fit",
                request_id=request_id,
                num_tokens=length,
                num_committed=done,
                num_new=num_new,
            )

    def _commit(self, request_id: str, row: int, data: bytes) -> None:
        """Append checked tokens (``data``: their int32 bytes) and publish the blocks they
        fill; a publish that raises changes nothing."""
        held = self._tokens[request_id]
        done = len(held) // 4
        state = self._prefix[request_id]
        have = len(state.keys)
        held += data
        try:
            publish(self._coord, state, row, held, done, data)
        except BaseException:  # a refused commit changes nothing
            del held[4 * done :]
            del state.keys[have:]
            raise
        self._committed[row] = len(held) // 4
        if self._undo is not None:
            self._undo.append(lambda: held.__delitem__(slice(4 * done, None)))
            self._undo.append(lambda: state.keys.__delitem__(slice(have, None)))

    def committed_tokens(self, request_id: str) -> list[int]:
        """The committed token ids of a request, in order (a copy)."""
        self._row(request_id, suspended=True)
        return np.frombuffer(bytes(self._tokens[request_id]), dtype="<i4").tolist()

    def free(self, request_id: str) -> None:
        """End a request: its blocks go back to the pools (cached ones stay cached)."""
        row = self._row(request_id, suspended=True)
        saved = self._suspended.pop(request_id, None)
        if saved is not None:
            del self._suspended_handles[saved.handle]
            assert self._host is not None
            for g, (_, host_slots) in enumerate(saved.blocks):
                self._host.discard(self._coord.group_pool[g], host_slots)
        self._free_row(row)

    def _free_row(self, row: int) -> str:
        """Free a live row; returns its request id."""
        request_id = self._ids[row]
        assert request_id is not None
        self._coord.release_row(row)
        self._ids[row] = None
        self._handle[row] = -1
        del self._rows[request_id]
        del self._first[request_id]
        del self._tokens[request_id]
        del self._prefix[request_id]
        self._committed[row] = 0
        self._hits[row] = 0
        self._free_rows.append(row)
        return request_id

    def _blocks_of(self, row: int) -> int:
        """Block positions a row holds, summed over layer groups."""
        return sum(int(n[row]) for n in self._coord.num_blocks)

    @_settles
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
        """
        if type(atomic) is not bool:
            raise InvalidArgument(f"atomic must be a bool, got {type(atomic).__name__}")
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
        sizes = cols.sizes()
        total = sum(sizes.values())
        self._check_step_size(total, total - sizes["extend"])
        return run_columns(self, cols, atomic)

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
        items = list(ops)
        plain = plain_ops(items)
        if plain is None and all(type(o) in _FLAT_OPS for o in items):
            # Validated frozen models: their fields are already the plain dict.
            plain = [dict(o.__dict__) for o in items]
        if plain is None:
            try:
                models = _OPS.validate_python(items)
            except ValidationError as exc:
                raise invalid_from_validation(exc.errors()) from None
            plain = [m.model_dump() for m in models]
        return OpResults(self.step_plain(plain, atomic, brief))

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
        if not atomic:
            return execute_ops(self, ops, False, brief)
        with self.transaction() as undo:
            results = execute_ops(self, ops, True, brief)
            if results and not results[-1]["ok"]:  # stopped: every result is an error
                undo()
            return results

    @contextmanager
    def transaction(self) -> Iterator[Callable[[], None]]:
        """Yield an ``undo`` that puts the manager back as it was on entry.

        Undo also happens if the block raises. Nested transactions are not supported.
        """
        if self._undo is not None:
            raise RuntimeError("transactions do not nest")
        saved = _Checkpoint(
            coordinator=self._coord.checkpoint(),
            rows=dict(self._rows),
            free_rows=list(self._free_rows),
            first=dict(self._first),
            tokens=dict(self._tokens),
            committed=self._committed.copy(),
            prefix=dict(self._prefix),
            hits=self._hits.copy(),
            ids=list(self._ids),
            handles=self._handle.copy(),
        )
        self._undo = []

        def undo() -> None:
            assert self._undo is not None
            for action in reversed(self._undo):
                action()
            self._undo.clear()
            self._coord.restore(saved.coordinator)
            self._rows = dict(saved.rows)
            self._free_rows = list(saved.free_rows)
            self._first = dict(saved.first)
            self._tokens = dict(saved.tokens)
            self._committed[:] = saved.committed
            self._prefix = dict(saved.prefix)
            self._hits[:] = saved.hits
            self._ids = list(saved.ids)
            self._handle[:] = saved.handles

        try:
            yield undo
        except BaseException:
            undo()
            raise
        finally:
            self._undo = None

    def request(self, request_id: str) -> RequestInfo:
        return self._info(request_id, self._row(request_id, suspended=True))

    def request_ids(self) -> list[str]:
        return list(self._rows)

    def block_table(self, request_id: str) -> list[list[int]]:
        """The request's block ids per layer group, by block position; -1 = released.

        Bookkeeping, not a kernel input: -1 even with the null page (the page tables hold 0).
        """
        row = self._row(request_id)
        return [self._coord.block_list(g.group_id, row) for g in self.layout.layer_groups]

    # -- tables (the tables-and-views component's; ``kvcm.views``) ----------------------------

    @_doc(TablesAndViews.page_table)
    def page_table(self, layer_group: int) -> torch.Tensor:
        return self._views.page_table(layer_group)

    @_doc(TablesAndViews.page_tables)
    def page_tables(self) -> torch.Tensor:
        return self._views.page_tables()

    @_doc(TablesAndViews.sync_tables)
    def sync_tables(self) -> None:
        self._views.sync_tables()

    def _placement(self, layer_id: int, role: str) -> BufferPlacement:
        return self._views.placement(layer_id, role)

    @_doc(TablesAndViews.page_indices)
    def page_indices(
        self,
        request_ids: Sequence[str],
        layer_id: int,
        role: Role = "key",
        mode: Literal["slot", "kernel"] = "slot",
        per_layer: bool = False,
    ) -> torch.Tensor:
        return self._views.page_indices(request_ids, layer_id, role, mode, per_layer)

    @_doc(TablesAndViews.slot_mapping)
    def slot_mapping(
        self,
        request_ids: Sequence[str],
        layer_id: int,
        num_tokens: int | Sequence[int] | None = None,
        pad_to: int | None = None,
    ) -> torch.Tensor:
        return self._views.slot_mapping(request_ids, layer_id, num_tokens, pad_to)

    @_doc(TablesAndViews.slot_mappings)
    def slot_mappings(
        self,
        request_ids: Sequence[str],
        num_tokens: int | Sequence[int] | None = None,
        pad_to: int | None = None,
    ) -> torch.Tensor:
        return self._views.slot_mappings(request_ids, num_tokens, pad_to)

    @_doc(TablesAndViews.copy_tokens)
    def copy_tokens(
        self,
        request_ids: Sequence[str],
        src_positions: Sequence[int],
        dst_positions: Sequence[int],
    ) -> None:
        self._views.copy_tokens(request_ids, src_positions, dst_positions)

    @_doc(TablesAndViews.pointer_table)
    def pointer_table(self) -> torch.Tensor:
        return self._views.pointer_table()

    @_doc(TablesAndViews.layer_pool_map)
    def layer_pool_map(self) -> torch.Tensor:
        return self._views.layer_pool_map()

    @_doc(TablesAndViews.layer_pointer_table)
    def layer_pointer_table(self) -> torch.Tensor:
        return self._views.layer_pointer_table()

    # -- memory views ------------------------------------------------------------------------

    @_doc(TablesAndViews.kv_view)
    def kv_view(self, layer_id: int) -> torch.Tensor:
        return self._views.kv_view(layer_id)

    @_doc(TablesAndViews.layer_view)
    def layer_view(self, layer_id: int, role: Role) -> torch.Tensor:
        return self._views.layer_view(layer_id, role)

    # -- layout and sizing -------------------------------------------------------------------

    @_doc(TablesAndViews.describe)
    def describe(self) -> LayoutInfo:
        return self._views.describe()

    def estimate(
        self,
        seq_len: int,
        num_requests: int | None = None,
        *,
        prefill_chunk: int | None = None,
        lookahead: int | None = None,
    ) -> Estimate:
        """Capacity for requests of ``seq_len`` tokens grown by ops of at most
        ``prefill_chunk`` new tokens, each with ``lookahead`` draft slots (both default to the
        config's ``max_prefill_chunk`` and ``max_lookahead``; a chunk >= seq_len is a whole
        prompt in one op). Exact: N fit and N + 1 do not (docs/sizing.md)."""
        shape = self._sizing.shape
        if prefill_chunk is not None:
            shape = StepShape(_count("prefill_chunk", prefill_chunk, 1), shape.lookahead)
        if lookahead is not None:
            shape = StepShape(shape.chunk, _count("lookahead", lookahead, 0))
        seq_len = _count("seq_len", seq_len, 1)
        est = self._sizing.estimate(
            seq_len, self._usable_slots(), self.config.max_requests, num_requests, shape
        )
        host = self._host
        if host is None:
            return est
        pools = tuple(
            p.model_copy(
                update={
                    "host_slots": host.num_slots[p.pool_group_id],
                    "host_requests": host.num_slots[p.pool_group_id]
                    // max(p.blocks_per_request, 1),
                }
            )
            for p in est.pool_groups
        )
        return est.model_copy(
            update={
                "pool_groups": pools,
                "host_max_requests": min(p.host_requests for p in pools),
            }
        )

    def check_budget(self) -> None:
        """Raise ``InsufficientMemory`` if not one ``max_seq_len`` request fits the budget
        (with the config's prefill chunk and lookahead); the error names the largest
        ``max_seq_len`` that would. Nothing to check with ``num_blocks``."""
        if self.config.memory_bytes is not None:
            self._sizing.check_budget(
                self.config.memory_bytes, self._slots, int(self.config.null_page)
            )

    def _usable_slots(self) -> dict[PoolGroupId, int]:
        return self._coord.usable_slots()

    def num_free_blocks(self, pool_group: int | None = None) -> int:
        """Free slots of ``pool_group``; without one, the blocks a new request can still get
        in every layer group: per pool group its free slots // the layer groups sharing it,
        the least over pool groups (a request takes a block in each layer group at once).

        Example: one pool group of 100 free slots shared by a window and a full group: 50.
        """
        pools = self._coord.pools
        if pool_group is None:
            return min(
                pool.num_free // len(pg.layer_groups)
                for pool, pg in zip(pools, self.layout.pool_groups, strict=True)
            )
        return pools[self._pool_group(pool_group)].num_free

    def num_total_blocks(self, pool_group: int | None = None) -> int:
        """Usable slots of ``pool_group`` (the null page's is not one); without one, what
        ``num_free_blocks()`` gives on an empty manager (so the two are equal once every
        request is freed)."""
        usable = self._usable_slots()
        if pool_group is None:
            return min(
                usable[pg.pool_group_id] // len(pg.layer_groups) for pg in self.layout.pool_groups
            )
        return usable[PoolGroupId(self._pool_group(pool_group))]

    def _pool_group(self, pool_group: int) -> int:
        if not 0 <= pool_group < len(self._coord.pools):
            raise InvalidArgument(f"no pool group {pool_group}", pool_group=pool_group)
        return pool_group

    def stats(self) -> Stats:
        free = {i: p.num_free for i, p in enumerate(self._coord.pools)}
        total = {int(k): v for k, v in self._coord.usable_slots().items()}
        cache = self._coord.cache
        st = cache.stats
        return Stats(
            num_requests=len(self._rows),
            free_blocks=free,
            used_blocks={i: total[i] - free[i] for i in free},
            total_blocks=total,
            request_free_blocks=self.num_free_blocks(),
            request_total_blocks=self.num_total_blocks(),
            prefix_cache=PrefixCacheStats(
                queries=st.queries,
                query_tokens=st.query_tokens,
                hit_tokens=st.hit_tokens,
                hit_rate=st.hit_tokens / st.query_tokens if st.query_tokens else 0.0,
                stored_blocks=st.stored_blocks,
                evictions=st.evictions,
                cached_blocks={i: cache.num_cached(i) for i in free},
            ),
            host_tier=HostTierStats(**self.host_stats()) if self._host is not None else None,
        )

    def pools(self) -> SharedLayout:
        """Descriptors of the shared pools and page tables (needs ``share=True``).

        A consumer maps them with ``kvcm_client.attach``: views per (layer, role) with the
        strides of ``layer_view`` and the page tables ``[groups, max_requests, max_blocks]``,
        which the manager edits in place (on the CPU they are the manager's own tables).
        """
        if self._segments is None:
            raise InvalidArgument("this manager was built without share=True: nothing to map")
        lay = self.layout
        buffers = []
        for (lid, role), place in sorted(
            lay.placements.items(), key=lambda kv: (kv[0][0], self._views.role_index[kv[0][1]])
        ):
            view = self.memory.layer_view(lid, role)
            buffers.append(
                SharedBuffer(
                    layer_id=lid,
                    role=role,
                    layer_group=place.layer_group,
                    pool=place.pool,
                    dtype=str(view.dtype).removeprefix("torch."),
                    shape=tuple(view.shape),
                    strides=tuple(view.stride()),
                    offset=view.storage_offset(),
                )
            )
        self.sync_tables()  # CUDA: what a consumer maps is up to date
        tables = self._coord.tables
        return SharedLayout(
            generation=self.generation,
            device=str(self.device),
            tokens_per_block=self.tokens_per_block,
            layers=list(self.config.layers),
            layer_group_of={
                int(layer.layer_id): int(g.group_id) for g in lay.layer_groups for layer in g.layers
            },
            pools=list(self.memory.segments),
            buffers=buffers,
            page_tables=self._table_segment,
            page_table_shape=tables.shape,
            null_page=self.config.null_page,
        )

    def close(self) -> None:
        """Unlink the shared segments (mappings that exist stay valid until unmapped)."""
        if self._segments is not None:
            self._segments.close()

    # -- the model -----------------------------------------------------------------------------

    def model(self) -> ModelInfo:
        """The model this manager serves: config, layout, estimate and generation."""
        return registration.model_info(self)

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
        check_config(new, footprint.held_bytes(self))
        if self._rows:
            raise RequestsLive(
                f"{len(self._rows)} requests are live: free them before registering a model",
                num_requests=len(self._rows),
            )
        previous = self.config
        serials = int(self._serial.max())
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

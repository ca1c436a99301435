"""The columnar step: one scheduler step as arrays in, arrays out (docs/requests.md).

A scheduler step is a batch: the tokens whose KV the last forward pass computed (commits),
the requests that finished (frees), the rejected drafts (rewinds), one extend per running
request and a few new requests (allocates). Requests are named by integer handles, which carry
their page-table row, so the step looks up no string id; results are status arrays, with the
full error of each failed item on the side.

Sections run in this order, each item atomic on its own, in its position:

    commit -> free -> rewind -> suspend -> resume -> extend -> allocate

Commits first, so that a request that finished publishes its last blocks before its free, and
a new request of the same step hits what the last pass computed; frees and rewinds before
extends and allocates, so that the blocks they give back serve the step; suspends (a
preemption to the host tier) before resumes, and both before extends and allocates, so that
preempted requests come back before new ones start. Suspends and resumes copy pages, so they
cannot be part of an all-or-nothing step. (A rewind drops only tokens
past the new length, so committing the accepted tokens of a verified draft and rewinding the
rejected ones work in this order.) A section of extends of distinct requests runs as one
vectorised batch when it fits as a whole, item after item; otherwise its items run one by one
(the same outcome, item by item). ``atomic=True`` makes the step all or nothing.

Handles: ``(serial << 32) | row``, ``serial`` >= 1 counting the row's allocations, so a handle
kept past a free never names the row's next request (it gets ``unknown_request``). Example:
row 5 allocated for the third time has handle ``3 << 32 | 5 = 12884901893``.
"""

from __future__ import annotations

import logging
from array import array
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from kvcm_client.errors import (
    InternalError,
    InvalidArgument,
    KVCMError,
    StepAborted,
    UnknownRequest,
    status_of,
)
from kvcm_client.models import AllocateOp, OpResult

from . import request_rows
from .commits import commit_row
from .counts import MAX_COUNT, _count, _counts
from .suspension import suspend_row

if TYPE_CHECKING:
    from .manager import KVCacheManager

_log = logging.getLogger("kvcm")

#: The sections of a step, in the order they run.
SECTIONS = ("commit", "free", "rewind", "suspend", "resume", "extend", "allocate")
_OK = 0
_ABORTED = status_of(StepAborted.code)
_UNKNOWN = status_of(UnknownRequest.code)
_ALLOCATE_KEYS = frozenset(AllocateOp.model_fields) - {"op"}
_ALLOCATE_DEFAULTS: dict[str, Any] = {
    "lookahead": 0,
    "token_ids": None,
    "lora_id": None,
    "cache_salt": None,
    "multimodal": None,
    "block_keys": None,
}


@dataclass(slots=True)
class ItemError:
    """The error of one item: its section, its index in that section, the error."""

    section: str
    index: int
    error: KVCMError

    def to_dict(self) -> dict[str, Any]:
        return {"section": self.section, "index": self.index, **self.error.to_dict()}


@dataclass(slots=True)
class StepColumns:
    """A validated columnar step (``parse_columns``): handles and counts as int64 arrays."""

    free: np.ndarray
    rewind: np.ndarray
    rewind_tokens: np.ndarray | int | list[int]
    suspend: np.ndarray
    resume: np.ndarray
    commit: np.ndarray
    commit_tokens: Sequence[Any]
    extend: np.ndarray
    num_new_tokens: np.ndarray | int | list[int]
    """Checked counts: an array, or one int for all; unchecked ints as a list (only run item
    by item, each item checking its own)."""
    lookahead: np.ndarray | int | list[int]
    allocate: list[dict[str, Any]]
    """(Not frozen: a step builds one per call, and a frozen dataclass costs a microsecond
    more to build. Nothing changes it after ``parse_columns``.)"""

    def sizes(self) -> dict[str, int]:
        return {
            "free": self.free.size,
            "rewind": self.rewind.size,
            "suspend": self.suspend.size,
            "resume": self.resume.size,
            "commit": self.commit.size,
            "extend": self.extend.size,
            "allocate": len(self.allocate),
        }


@dataclass(slots=True)
class StepOutcome:
    """What a columnar step did: a status per item (0 ok, else ``STATUS_CODES``' index of
    its error), block counts, the allocated handles, the errors of failed items.

    ``new_blocks``: block positions an extend added to the request's table rows, summed over
    layer groups. ``allocate_new_blocks`` the same for an allocate (prefix-hit blocks
    included). ``failed``: (section, index) of the item that stopped the step (an
    all-or-nothing step's first failure, or an internal error), whose other unapplied items
    have status ``step_aborted``; None when the step ran to the end.
    """

    status: dict[str, np.ndarray]
    new_blocks: np.ndarray
    handles: np.ndarray
    hit_tokens: np.ndarray
    allocate_new_blocks: np.ndarray
    errors: list[ItemError] = field(default_factory=list)
    failed: tuple[str, int] | None = None
    freed_ids: list[str] = field(default_factory=list)
    allocated_ids: list[str] = field(default_factory=list)
    infos: list[Any] = field(default_factory=list)
    """Per allocate, the ``RequestInfo`` it returned (None where it failed): for a retry,
    the first allocation's result, as ``allocate`` answers it."""

    @property
    def ok(self) -> bool:
        return not self.errors and self.failed is None

    def to_json(self) -> dict[str, Any]:
        """The ``StepColumnsResponse`` of ``POST /v1/step_columns`` (lists)."""
        return {
            "status": {s: a.tolist() for s, a in self.status.items()},
            "new_blocks": self.new_blocks.tolist(),
            "handles": self.handles.tolist(),
            "hit_tokens": self.hit_tokens.tolist(),
            "allocate_new_blocks": self.allocate_new_blocks.tolist(),
            "errors": [e.to_dict() for e in self.errors],
            "failed": None if self.failed is None else list(self.failed),
        }

    def to_wire(self) -> dict[str, Any]:
        """The result map of the step channel (docs/step-channel.md#step_columns): arrays as
        little-endian bytes (int16 status, int32 block counts, int64 handles and tokens);
        empty sections, empty arrays and an empty error list are left out."""
        out: dict[str, Any] = {
            "status": {s: a.astype("<i2").tobytes() for s, a in self.status.items() if a.size}
        }
        if self.new_blocks.size:
            out["new_blocks"] = self.new_blocks.astype("<i4").tobytes()
        if self.handles.size:
            out["handles"] = self.handles.astype("<i8").tobytes()
            out["hit_tokens"] = self.hit_tokens.astype("<i8").tobytes()
            out["allocate_new_blocks"] = self.allocate_new_blocks.astype("<i4").tobytes()
        if self.errors:
            out["errors"] = [e.to_dict() for e in self.errors]
        if self.failed is not None:
            out["failed"] = list(self.failed)
        return out


# -- parsing -------------------------------------------------------------------------------------


_NO_HANDLES = np.zeros(0, dtype=np.int64)
_NO_HANDLES.flags.writeable = False


def _handles(name: str, value: Any) -> np.ndarray:
    """Handles as int64: any sequence or 1-d array of ints (not bools)."""
    if type(value) is np.ndarray and value.dtype == np.int64 and value.ndim == 1:
        return value
    if (type(value) is tuple or type(value) is list) and not value:
        return _NO_HANDLES
    if isinstance(value, np.ndarray):
        arr = value
    elif isinstance(value, array):  # the client's int64 arrays: no copy
        arr = np.frombuffer(value, dtype=np.int64) if value.typecode == "q" else np.asarray(value)
    elif isinstance(value, str | bytes) or not isinstance(value, Sequence):
        raise InvalidArgument(f"{name} must be a sequence of handles", **{name: None})
    else:
        if bool in map(type, value):
            raise InvalidArgument(f"{name} must be ints, not bools", **{name: None})
        arr = np.asarray(value)
    if arr.ndim != 1 or (arr.size and arr.dtype.kind not in "iu"):
        raise InvalidArgument(f"{name} must be a 1-d sequence of ints", **{name: None})
    if arr.dtype == np.int64:
        return arr
    if arr.size and arr.dtype.kind == "u" and int(arr.max()) >= 2**63:
        # No live handle is that large: those items become 0 (unknown), the others stay.
        return np.where(arr >= 2**63, 0, arr).astype(np.int64)
    return arr.astype(np.int64)


def _allocates(value: Any) -> list[dict[str, Any]]:
    if isinstance(value, str | bytes | Mapping) or not isinstance(value, Sequence):
        raise InvalidArgument("allocate must be a sequence of allocate ops", allocate=None)
    out = []
    for item in value:
        if isinstance(item, AllocateOp):
            op = item.model_dump()
            del op["op"]
            out.append(op)
            continue
        if type(item) is not dict or not item.keys() <= _ALLOCATE_KEYS | {"op"}:
            raise InvalidArgument(
                f"each allocate is an AllocateOp or its dict (keys {sorted(_ALLOCATE_KEYS)})",
                allocate=None,
            )
        if item.get("op", "allocate") != "allocate":
            raise InvalidArgument("an allocate item's op must be 'allocate'", allocate=None)
        if "request_id" not in item or "num_tokens" not in item:
            raise InvalidArgument("each allocate needs request_id and num_tokens", allocate=None)
        op = {**_ALLOCATE_DEFAULTS, **item}
        op.pop("op", None)
        out.append(op)
    return out


def parse_columns(
    free: Any = (),
    rewind: Any = (),
    rewind_tokens: Any = 1,
    commit: Any = (),
    commit_tokens: Any = (),
    extend: Any = (),
    num_new_tokens: Any = 1,
    lookahead: Any = 0,
    allocate: Any = (),
    suspend: Any = (),
    resume: Any = (),
) -> StepColumns:
    """Check the shape of a step (raises ``InvalidArgument``, before anything runs); each
    item's own arguments are checked when it runs (a bad one fails that item only)."""
    free_h = _handles("free", free)
    rewind_h = _handles("rewind", rewind)
    commit_h = _handles("commit", commit)
    extend_h = _handles("extend", extend)
    plain = type(commit_tokens) is list or type(commit_tokens) is tuple
    if not plain and (
        isinstance(commit_tokens, str | bytes)
        or not isinstance(commit_tokens, Sequence | np.ndarray)
    ):
        raise InvalidArgument("commit_tokens must be a list of token id lists", commit=None)
    if len(commit_tokens) != commit_h.size:
        raise InvalidArgument(
            f"{commit_h.size} commits and {len(commit_tokens)} token id lists",
            num_commits=commit_h.size,
            num_token_id_lists=len(commit_tokens),
        )
    return StepColumns(
        free=free_h,
        rewind=rewind_h,
        rewind_tokens=_counts_of("rewind_tokens", rewind_tokens, rewind_h.size, 1),
        suspend=_handles("suspend", suspend),
        resume=_handles("resume", resume),
        commit=commit_h,
        commit_tokens=commit_tokens,
        extend=extend_h,
        num_new_tokens=_counts_of("num_new_tokens", num_new_tokens, extend_h.size, 1),
        lookahead=_counts_of("lookahead", lookahead, extend_h.size, 0),
        allocate=(
            []
            if (type(allocate) is tuple or type(allocate) is list) and not allocate
            else _allocates(allocate)
        ),
    )


def _counts_of(name: str, value: Any, n: int, minimum: int) -> np.ndarray | int:
    """Checked counts: one int stays an int (numpy broadcasts it), else an array of n."""
    if type(value) is int:
        return _count(name, value, minimum)
    return _counts(name, value, n, minimum)


_WIRE_KEYS = frozenset(
    {
        "free",
        "rewind",
        "rewind_tokens",
        "commit",
        "commit_tokens",
        "commit_lengths",
        "extend",
        "num_new_tokens",
        "lookahead",
        "allocate",
        "atomic",
        "suspend",
        "resume",
    }
)


def _wire_ints(name: str, value: Any, dtype: str) -> Any:
    """Raw little-endian bytes as an array; lists and ints are left to ``parse_columns``."""
    if type(value) is not bytes:
        return value
    size = np.dtype(dtype).itemsize
    if len(value) % size:
        raise InvalidArgument(f"{name} bytes are not whole {dtype} values", **{name: None})
    return np.frombuffer(value, dtype=dtype)


def columns_from_wire(args: dict[str, Any]) -> dict[str, Any]:
    """A ``step_columns`` frame's args as ``KVCacheManager.step_columns`` keyword arguments
    (docs/step-channel.md#step_columns): int64 bytes become arrays (no copy), commit tokens
    (int32 bytes and a length per commit, or a list of lists) a list per commit."""
    if not args.keys() <= _WIRE_KEYS:
        unknown = sorted(str(k) for k in args.keys() - _WIRE_KEYS)
        raise InvalidArgument(f"unknown step_columns fields: {unknown}")
    out = {
        k: _wire_ints(k, v, "<i8")
        for k, v in args.items()
        if k not in ("commit_tokens", "commit_lengths")
    }
    tokens = args.get("commit_tokens", [])
    if type(tokens) is bytes:
        flat = _wire_ints("commit_tokens", tokens, "<i4")
        lengths = _wire_ints("commit_lengths", args.get("commit_lengths", b""), "<i8")
        if (
            not isinstance(lengths, np.ndarray)
            or (lengths.size and not 0 <= int(lengths.min()) <= int(lengths.max()) <= MAX_COUNT)
            or int(lengths.sum()) != flat.size
        ):
            raise InvalidArgument("commit_lengths must be the lengths of commit_tokens' parts")
        ends = np.cumsum(lengths).tolist()
        starts = [0, *ends[:-1]] if ends else []
        values = flat.tolist()
        tokens = [values[a:b] for a, b in zip(starts, ends, strict=True)]
    elif "commit_lengths" in args:
        raise InvalidArgument("commit_lengths goes with commit_tokens as int32 bytes")
    out["commit_tokens"] = tokens
    return out


# -- running -------------------------------------------------------------------------------------


#: Empty results, shared (nothing writes into an empty array).
_NONE16 = np.zeros(0, dtype=np.int16)
_NONE32 = np.zeros(0, dtype=np.int32)
_NONE64 = np.zeros(0, dtype=np.int64)


def _ints(values: np.ndarray | int | list[int], n: int) -> list[int]:
    if isinstance(values, np.ndarray):
        return values.tolist()
    return [values] * n if type(values) is int else values


def _pick(values: Any, indices: np.ndarray) -> Any:
    """Items ``indices`` of a per-item column; one int for all stays that int."""
    return values[indices] if isinstance(values, np.ndarray) else values


class _Stop(Exception):
    """Raised inside ``_execute`` to stop the step at a failed item."""


class _Run:
    """One step's execution: fills ``out`` section by section."""

    def __init__(self, m: KVCacheManager, cols: StepColumns, stop_on_error: bool) -> None:
        self.m = m
        self.cols = cols
        self.stop_on_error = stop_on_error
        sizes = cols.sizes()
        na = sizes["allocate"]
        self.out = StepOutcome(
            status={s: np.zeros(n, dtype=np.int16) if n else _NONE16 for s, n in sizes.items()},
            new_blocks=np.zeros(sizes["extend"], dtype=np.int32),
            handles=np.zeros(na, dtype=np.int64) if na else _NONE64,
            hit_tokens=np.zeros(na, dtype=np.int64) if na else _NONE64,
            allocate_new_blocks=np.zeros(na, dtype=np.int32) if na else _NONE32,
        )

    def fail(self, section: str, index: int, exc: KVCMError) -> None:
        # The result keeps the error, not its traceback: the traceback's frames hold this
        # run, whose result holds the error, a cycle per failed item that only the garbage
        # collector frees (a step of 256 failing items cost 7.8 ms instead of 1.2).
        exc.__traceback__ = None
        self.out.status[section][index] = status_of(exc.code)
        self.out.errors.append(ItemError(section, index, exc))
        if self.stop_on_error or exc.code == InternalError.code:
            self.out.failed = (section, index)
            raise _Stop

    def item(self, section: str, index: int, fn: Callable[[], Any]) -> Any:
        """Run one item; its error becomes its status. None when it failed."""
        try:
            return fn()
        except KVCMError as exc:
            self.fail(section, index, exc)
        except Exception as exc:  # a bug: logged, reported as this item's result
            _log.exception("step item %s[%d] failed with an internal error", section, index)
            self.fail(
                section,
                index,
                InternalError(f"internal error in {section} ({type(exc).__name__}); logged"),
            )
        return None

    def unknown(self, section: str, index: int, handle: int) -> None:
        self.fail(
            section, index, UnknownRequest(f"no live request has handle {handle}", handle=handle)
        )

    def run(self) -> StepOutcome:
        try:
            self.commits()
            self.frees()
            self.rewinds()
            self.suspends()
            self.resumes()
            self.extends()
            self.allocates()
        except _Stop:
            self.abort_rest()
        return self.out

    def abort_rest(self) -> None:
        """Mark every item after the failed one ``step_aborted`` (an all-or-nothing step's
        earlier items too: ``run_columns`` undid them)."""
        assert self.out.failed is not None
        section, index = self.out.failed
        at = SECTIONS.index(section)
        for s in SECTIONS[at:]:
            status = self.out.status[s]
            start = index + 1 if s == section else 0
            status[start:] = _ABORTED
        if not self.stop_on_error:
            return
        for s in SECTIONS[: at + 1]:
            status = self.out.status[s]
            end = index if s == section else status.size
            status[:end] = _ABORTED
        self.out.new_blocks[:] = 0
        self.out.handles[:] = 0
        self.out.hit_tokens[:] = 0
        self.out.allocate_new_blocks[:] = 0
        self.out.freed_ids.clear()
        self.out.allocated_ids.clear()
        self.out.infos = [None] * len(self.out.infos)

    # -- sections ------------------------------------------------------------------------------

    def each_row(self, section: str, run: Callable[[int, int], Any], recheck: bool = False) -> None:
        """``run(index, row)`` for each item of a section of handles, in order, as an item;
        a handle that is not live is ``unknown_request``. ``recheck``: liveness is checked
        again per item, since an earlier item of the section may have freed (or suspended)
        the row."""
        handles = getattr(self.cols, section)
        if not handles.size:
            return
        rows, live = request_rows.handle_rows(self.m, handles)
        current = self.m._handle
        for i, row in enumerate(rows.tolist()):
            if (live is not None and not live[i]) or (recheck and current[row] != handles[i]):
                self.unknown(section, i, int(handles[i]))
                continue
            self.item(section, i, lambda i=i, row=row: run(i, row))

    def frees(self) -> None:
        m, freed = self.m, self.out.freed_ids
        self.each_row(
            "free", lambda _, row: freed.append(request_rows.free_row(m, row)), recheck=True
        )

    def rewinds(self) -> None:
        m, counts = self.m, _ints(self.cols.rewind_tokens, self.cols.rewind.size)
        self.each_row("rewind", lambda i, row: request_rows.rewind_row(m, row, counts[i]))

    def commits(self) -> None:
        m, tokens = self.m, self.cols.commit_tokens
        self.each_row("commit", lambda i, row: commit_row(m, row, tokens[i]))

    def suspends(self) -> None:
        m = self.m
        self.each_row("suspend", lambda _, row: suspend_row(m, row), recheck=True)

    def resumes(self) -> None:
        """By the handle the request had: kept for it while it is suspended."""
        m = self.m
        for i, handle in enumerate(self.cols.resume.tolist()):
            rid = m._suspended_handles.get(handle)
            if rid is None:
                rows, live = request_rows.handle_rows(m, np.array([handle], dtype=np.int64))
                if live is None:  # a live request: not suspended
                    rid = m._ids[int(rows[0])]
                    self.fail(
                        "resume",
                        i,
                        InvalidArgument(f"request {rid!r} is not suspended", request_id=rid),
                    )
                else:
                    self.unknown("resume", i, handle)
                continue
            self.item("resume", i, lambda rid=rid: m.resume(rid))

    def extends(self) -> None:
        cols = self.cols
        handles = cols.extend
        n = handles.size
        if n == 0:
            return
        m = self.m
        if n > 1 and type(cols.num_new_tokens) is not list and type(cols.lookahead) is not list:
            done = request_rows.extend_handles(m, handles, cols.num_new_tokens, cols.lookahead)
            if done is not None:
                self.out.new_blocks[:] = done[1]
                return
            if self.extends_around_failures():
                return
        self.extend_items(np.arange(n))

    def extend_items(self, indices: np.ndarray) -> None:
        """Extend items ``indices`` of the section one by one (the path of any batch)."""
        cols, m = self.cols, self.m
        handles = cols.extend[indices]
        rows, live = request_rows.handle_rows(m, handles)
        new = _ints(_pick(cols.num_new_tokens, indices), indices.size)
        ahead = _ints(_pick(cols.lookahead, indices), indices.size)
        for j, (i, row) in enumerate(zip(indices.tolist(), rows.tolist(), strict=True)):
            if live is not None and not live[j]:
                self.unknown("extend", i, int(handles[j]))
                continue
            added = self.item(
                "extend",
                i,
                lambda row=row, k=new[j], a=ahead[j]: request_rows.extend_row(m, row, k, a),
            )
            if added is not None:
                self.out.new_blocks[i] = added

    def extends_around_failures(self) -> bool:
        """The batch path for a decode step where some items fail on their own (a stale
        handle, a request past ``max_seq_len``): the others as one batch, then the failing
        ones one by one, so that one bad item does not cost the step the per-item path of
        all of them (~3 us each). Failing items change nothing, so running them last gives
        what item after item gives. Stopping at the first error (an atomic step), only the
        items before it run as the batch. False (nothing changed) when items repeat a row
        or the batch does not fit item after item: the caller runs every item one by one.

        Example: handles [h0, stale, h2, h3], h3 at max_seq_len: h0 and h2 extend as one
        batch, then items 1 and 3 fail (``unknown_request``, ``sequence_too_long``).
        """
        cols = self.cols
        bad = request_rows.failing_extends(self.m, cols.extend, cols.num_new_tokens, cols.lookahead)
        if bad is None or not bad.size:
            return False
        good = np.ones(cols.extend.size, dtype=bool)
        good[bad] = False
        if self.stop_on_error:
            good[bad[0] :] = False
        run = np.flatnonzero(good)
        if run.size:
            done = request_rows.extend_handles(
                self.m,
                cols.extend[run],
                _pick(cols.num_new_tokens, run),
                _pick(cols.lookahead, run),
            )
            if done is None:
                return False
            self.out.new_blocks[run] = done[1]
        self.extend_items(bad)
        return True

    def allocates(self) -> None:
        m = self.m
        out = self.out
        out.infos = [None] * len(self.cols.allocate)
        for i, op in enumerate(self.cols.allocate):
            rid = op["request_id"]
            retry = isinstance(rid, str) and rid in m._rows  # the same allocate again, or a dup
            info = self.item("allocate", i, lambda op=op: m.allocate(**op))
            if info is None:
                continue
            out.infos[i] = info
            out.handles[i] = info.handle
            out.hit_tokens[i] = info.num_hit_tokens
            if not retry:  # a retry allocates nothing
                out.allocate_new_blocks[i] = request_rows.blocks_of(m, info.row)
                out.allocated_ids.append(info.request_id)


def execute(m: KVCacheManager, cols: StepColumns, stop_on_error: bool) -> StepOutcome:
    """Run a parsed step on ``m``, stopping at the first failed item with ``stop_on_error``
    (the caller's transaction undoes what ran), else only at an internal error."""
    return _Run(m, cols, stop_on_error).run()


def run_columns(m: KVCacheManager, cols: StepColumns, atomic: bool) -> StepOutcome:
    """Run a parsed step on ``m``; all or nothing with ``atomic``."""
    if not atomic:
        return execute(m, cols, False)
    with m.transaction() as undo:
        out = execute(m, cols, True)
        if out.failed is not None:
            undo()
        return out


class OpResults(Sequence[OpResult]):
    """``step``'s results, one ``OpResult`` per op, each built when first read.

    Validating 256 result models costs more than running the step (about 2 us an op, against
    1 us for the step itself); a scheduler that reads only failures, or only ``len``, pays for
    what it reads. Compares equal to a list of the same results.
    """

    __slots__ = ("_built", "_dicts")

    def __init__(self, dicts: list[dict[str, Any]]) -> None:
        self._dicts = dicts
        self._built: list[OpResult | None] = [None] * len(dicts)

    def __len__(self) -> int:
        return len(self._dicts)

    def _one(self, i: int) -> OpResult:
        found = self._built[i]
        if found is None:
            found = self._built[i] = OpResult.model_validate(self._dicts[i])
        return found

    def __getitem__(self, i: Any) -> Any:
        if isinstance(i, slice):
            return [self._one(k) for k in range(*i.indices(len(self._dicts)))]
        return self._one(range(len(self._dicts))[i])

    def __eq__(self, other: object) -> bool:
        if isinstance(other, OpResults | list | tuple):
            return len(other) == len(self) and all(a == b for a, b in zip(self, other, strict=True))
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return repr(list(self))


#: Rank of each op kind in a step's section order.
RANK = {section: i for i, section in enumerate(SECTIONS)}


def op_segments(ops: list[dict[str, Any]]) -> list[tuple[int, int]]:
    """Split a list of ops into [start, end) pieces that each run as one columnar step with
    the same outcome as running their ops in list order: within a piece the kinds follow the
    section order and no request id repeats (so each op's result, read at the end of its
    piece, is also its state right after the op).

    Example: commit a, free b, extend c, allocate d, extend e gives (0, 4), (4, 5): the
    extend after an allocate starts a new piece; so would a second op on c.
    """
    pieces = []
    start, last = 0, -1
    seen: set[str] = set()
    for i, op in enumerate(ops):
        rank = RANK[op["op"]]
        rid = op["request_id"]
        if rank < last or rid in seen:
            pieces.append((start, i))
            start = i
            seen = set()
        last = rank
        seen.add(rid)
    if start < len(ops):
        pieces.append((start, len(ops)))
    return pieces

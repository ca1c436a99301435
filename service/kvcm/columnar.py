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
vectorised batch when it fits as a whole, item after item; items that fail on their own (a
stale handle, a request past max_seq_len) are taken out of the batch and fail alone;
otherwise its items run one by one (the same outcome, item by item). ``atomic=True`` makes
the step all or nothing.

This module runs a step; ``columnar_parse`` checks its shape, ``columnar_types`` holds the
parsed step and its outcome, and ``op_steps`` runs an op list as columnar steps.

Handles: ``(serial << 32) | row``, ``serial`` >= 1 counting the row's allocations, so a handle
kept past a free never names the row's next request (it gets ``unknown_request``). Example:
row 5 allocated for the third time has handle ``3 << 32 | 5 = 12884901893``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
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

from . import allocation, native, request_rows
from .columnar_types import SECTIONS, ItemError, StepColumns, StepOutcome
from .commits import commit_batch, commit_row
from .mapped_items import MappedItems
from .suspension import free_suspended, resume, suspend_row
from .transactions import transaction

if TYPE_CHECKING:
    from .components import Components

_log = logging.getLogger("kvcm")
_OK = 0
_ABORTED = status_of(StepAborted.code)
_UNKNOWN = status_of(UnknownRequest.code)

#: Sections of at most this many handles run in Python ints (``each_of_few``): numpy's
#: vector calls cost more than they save below that.
_FEW = 8

#: Empty results, shared (nothing writes into an empty array).
_NONE16 = np.zeros(0, dtype=np.int16)
_NONE32 = np.zeros(0, dtype=np.int32)
_NONE64 = np.zeros(0, dtype=np.int64)


def _zeros(dtype: type, size: int) -> np.ndarray:
    out = np.zeros(size, dtype=dtype)
    out.flags.writeable = False
    return out


#: What a step's statuses and extends' block counts start as: read-only views of these
#: zeros, no array made per section and step. An item that fails makes its section's
#: statuses a writable copy first (``_Run.status``); a batch of extends puts its own counts
#: in, item-by-item extends a writable copy (``_Run.new_blocks``). Steps are at most
#: ``MAX_STEP_OPS`` (8192) items; a longer section (only from a caller that skips that
#: check) gets arrays of its own.
_ZEROS16 = _zeros(np.int16, 8192)
_ZEROS32 = _zeros(np.int32, 8192)


def _view(zeros: np.ndarray, n: int) -> np.ndarray:
    if n > zeros.size:
        return np.zeros(n, dtype=zeros.dtype)
    return zeros[:n]


_MAX_ZEROS = _ZEROS16.size


def _zero_status(n: int) -> np.ndarray:
    """The statuses of a section of ``n`` items over ``_MAX_ZEROS``, or of none."""
    return np.zeros(n, dtype=np.int16) if n else _NONE16


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

    def __init__(
        self,
        m: Components,
        cols: StepColumns,
        stop_on_error: bool,
        sizes: dict[str, int] | None = None,
    ) -> None:
        self.m = m
        self.cols = cols
        self.stop_on_error = stop_on_error
        self.sizes = sizes = cols.sizes() if sizes is None else sizes
        na, ne = sizes["allocate"], sizes["extend"]
        zeros, most = _ZEROS16, _MAX_ZEROS
        self.out = StepOutcome(  # positional: the fields in order (a third cheaper)
            # a view of its own per section: a caller may reshape the one it gets
            {s: zeros[:n] if 0 < n <= most else _zero_status(n) for s, n in sizes.items()},
            _view(_ZEROS32, ne) if ne else _NONE32,
            np.zeros(na, dtype=np.int64) if na else _NONE64,
            np.zeros(na, dtype=np.int64) if na else _NONE64,
            np.zeros(na, dtype=np.int32) if na else _NONE32,
        )

    def fail(self, section: str, index: int, exc: KVCMError) -> None:
        # The result keeps the error, not its traceback: the traceback's frames hold this
        # run, whose result holds the error, a cycle per failed item that only the garbage
        # collector frees (a step of 256 failing items cost 7.8 ms instead of 1.2).
        exc.__traceback__ = None
        self.status(section)[index] = status_of(exc.code)
        self.out.errors.append(ItemError(section, index, exc))
        if self.stop_on_error or exc.code == InternalError.code:
            self.out.failed = (section, index)
            raise _Stop

    def status(self, section: str) -> np.ndarray:
        """The section's statuses, made writable (a copy of the shared zeros) to write."""
        status = self.out.status[section]
        if not status.flags.writeable:
            status = self.out.status[section] = status.copy()
        return status

    def new_blocks(self) -> np.ndarray:
        """The extends' block counts, made writable (a copy of the shared zeros) to write."""
        counts = self.out.new_blocks
        if not counts.flags.writeable:
            counts = self.out.new_blocks = counts.copy()
        return counts

    def item(self, section: str, index: int, fn: Callable[[], Any]) -> Any:
        """Run one item; its error becomes its status. None when it failed."""
        try:
            return fn()
        except Exception as exc:
            self.raised(section, index, exc)
        return None

    def raised(self, section: str, index: int, exc: Exception) -> None:
        """An item raised ``exc`` (in an ``except`` clause): its status, or, for anything
        but a ``KVCMError`` (a bug), logged and reported as the item's internal error."""
        if not isinstance(exc, KVCMError):
            _log.exception("step item %s[%d] failed with an internal error", section, index)
            exc = InternalError(f"internal error in {section} ({type(exc).__name__}); logged")
        self.fail(section, index, exc)

    def unknown(self, section: str, index: int, handle: int) -> None:
        self.fail(
            section, index, UnknownRequest(f"no live request has handle {handle}", handle=handle)
        )

    def run(self) -> StepOutcome:
        sizes = self.sizes
        try:
            # Only the sections with items: a decode step has one (a call each costs ~0.3 us).
            if sizes["commit"]:
                self.commits()
            if sizes["free"]:
                self.frees()
            if sizes["rewind"]:
                self.rewinds()
            if sizes["suspend"]:
                self.suspends()
            if sizes["resume"]:
                self.resumes()
            if sizes["extend"]:
                self.extends()
            if sizes["allocate"]:
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
            start = index + 1 if s == section else 0
            if start < self.out.status[s].size:
                self.status(s)[start:] = _ABORTED
        if not self.stop_on_error:
            return
        for s in SECTIONS[: at + 1]:
            end = index if s == section else self.out.status[s].size
            if end:
                self.status(s)[:end] = _ABORTED
        self.out.new_blocks = _view(_ZEROS32, self.out.new_blocks.size)
        self.out.handles[:] = 0
        self.out.hit_tokens[:] = 0
        self.out.allocate_new_blocks[:] = 0
        self.out.freed_ids.clear()
        self.out.allocated_ids.clear()
        self.out.firsts = [None] * len(self.out.firsts)

    # -- sections ------------------------------------------------------------------------------

    def each_row(self, section: str, run: Callable[[int, int], Any], recheck: bool = False) -> None:
        """``run(index, row)`` for each item of a section of handles, in order, as an item;
        a handle that is not live is ``unknown_request``. ``recheck``: liveness is checked
        again per item, since an earlier item of the section may have freed (or suspended)
        the row."""
        handles = getattr(self.cols, section)
        if not handles.size:
            return
        if handles.size <= _FEW:
            self.each_of_few(section, run, handles.tolist())
            return
        rows, live = self.m.requests.handle_rows(handles)
        current = self.m.requests.handle
        for i, row in enumerate(rows.tolist()):
            if (live is not None and not live[i]) or (recheck and current[row] != handles[i]):
                self.unknown(section, i, int(handles[i]))
                continue
            self.item(section, i, lambda i=i, row=row: run(i, row))

    def each_of_few(self, section: str, run: Callable[[int, int], Any], handles: list[int]) -> None:
        """``each_row`` of a few handles (a step's frees): Python ints, no numpy call, and
        liveness checked as each item runs. Example: handle ``3 << 32 | 5`` is row 5, live
        while row 5's handle is that one."""
        current = self.m.requests.handle
        max_requests = current.size
        for i, handle in enumerate(handles):
            row = handle & request_rows.ROW_MASK
            if row >= max_requests or current.item(row) != handle:
                self.unknown(section, i, handle)
                continue
            self.item(section, i, lambda i=i, row=row: run(i, row))

    def frees(self) -> None:
        """``each_of_few`` written out (a call and a closure less per free; liveness checked
        as each item runs, since an earlier item may free the same request). A suspended
        request is named by the handle it had, as in ``resume``, and freed as ``free()``
        frees it: its host copies too."""
        m, freed = self.m, self.out.freed_ids
        current = m.requests.handle
        max_requests = current.size
        for i, handle in enumerate(self.cols.free.tolist()):
            row = handle & request_rows.ROW_MASK
            live = row < max_requests and current.item(row) == handle
            if not live and handle not in m.requests.suspended_handles:
                self.unknown("free", i, handle)
                continue
            try:
                freed.append(request_rows.free_row(m, row) if live else free_suspended(m, handle))
            except Exception as exc:
                self.raised("free", i, exc)

    def rewinds(self) -> None:
        m, counts = self.m, _ints(self.cols.rewind_tokens, self.cols.rewind.size)
        self.each_row("rewind", lambda i, row: request_rows.rewind_row(m, row, counts[i]))

    def commits(self) -> None:
        """As one batch when every item passes its checks (``commits.commit_batch``: a
        decode step commits each running request's new token), else item by item."""
        m, cols = self.m, self.cols
        if cols.commit.size > 1:
            rows = request_rows.live_distinct_rows(m, cols.commit)
            if rows is not None and commit_batch(m, rows, cols.commit_tokens, self.commit_item):
                return
        tokens = cols.commit_tokens
        self.each_row("commit", lambda i, row: commit_row(m, row, tokens[i]))

    def commit_item(self, index: int, fn: Callable[[], None]) -> None:
        self.item("commit", index, fn)

    def suspends(self) -> None:
        m = self.m
        self.each_row("suspend", lambda _, row: suspend_row(m, row), recheck=True)

    def resumes(self) -> None:
        """By the handle the request had: kept for it while it is suspended."""
        m = self.m
        for i, handle in enumerate(self.cols.resume.tolist()):
            rid = m.requests.suspended_handles.get(handle)
            if rid is None:
                rows, live = m.requests.handle_rows(np.array([handle], dtype=np.int64))
                if live is None:  # a live request: not suspended
                    rid = m.requests.ids[int(rows[0])]
                    self.fail(
                        "resume",
                        i,
                        InvalidArgument(f"request {rid!r} is not suspended", request_id=rid),
                    )
                else:
                    self.unknown("resume", i, handle)
                continue
            self.item("resume", i, lambda rid=rid: _resume(m, rid))

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
                self.out.new_blocks = np.asarray(done[1], dtype=np.int32)
                return
            if self.extends_around_failures():
                return
        self.extend_items(np.arange(n))

    def extend_items(self, indices: np.ndarray) -> None:
        """Extend items ``indices`` of the section one by one (the path of any batch)."""
        cols, m = self.cols, self.m
        handles = cols.extend[indices]
        rows, live = m.requests.handle_rows(handles)
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
                self.new_blocks()[i] = added

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
        cols, m = self.cols, self.m
        core = native.core
        if core is not None and m.coord.plain and not self.stop_on_error:
            done = m.native_decode.extend_around_failures(
                core, m, cols.extend, cols.num_new_tokens, cols.lookahead
            )
            if done is None:  # repeated rows, or no fit: item by item
                return False
            if done is not False:
                kept, added, failing = done
                self.new_blocks()[kept] = added
                self.extend_items(np.array(failing, dtype=np.int64))
                return True
        bad = request_rows.failing_extends(m, cols.extend, cols.num_new_tokens, cols.lookahead)
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
            self.new_blocks()[run] = done[1]
        self.extend_items(bad)
        return True

    def allocates(self) -> None:
        m = self.m
        out = self.out
        firsts = out.firsts = [None] * len(self.cols.allocate)
        fast = allocation.c_args(m)
        keyed = allocation.prompt_keys(m, self.cols.allocate, fast)
        for i, op in enumerate(self.cols.allocate):
            rid = op["request_id"]
            retry = (
                isinstance(rid, str) and rid in m.requests.rows
            )  # the same allocate again, or a dup
            # The step settles its copies once, at its end (``step_columns``).
            try:
                first = allocation.start_op(m, op, fast, None if keyed is None else keyed[i])
            except Exception as exc:
                self.raised("allocate", i, exc)
                continue
            firsts[i] = first
            out.handles[i] = first.handle
            out.hit_tokens[i] = first.hit_tokens
            if not retry:  # a retry allocates nothing
                out.allocate_new_blocks[i] = request_rows.blocks_of(m, first.row)
                out.allocated_ids.append(rid)


def execute(
    m: Components,
    cols: StepColumns,
    stop_on_error: bool,
    sizes: dict[str, int] | None = None,
) -> StepOutcome:
    """Run a parsed step on ``m``, stopping at the first failed item with ``stop_on_error``
    (the caller's transaction undoes what ran), else only at an internal error.
    ``sizes``: ``cols.sizes()`` if the caller has it."""
    return _Run(m, cols, stop_on_error, sizes).run()


def mapped_tokens(lengths: np.ndarray, cols: StepColumns, out: StepOutcome) -> MappedItems:
    """The tokens of a step's items that the engine computes now (``kvcm.mapped_items``):
    each successful extend's ``num_new_tokens`` (the last ones of its request; ``lengths``:
    every row's length after the step), then each successful allocate's tokens past its hit
    (the first allocation's, for a retry); failed items add none. What ``map_slots`` maps,
    in that order. A step of extends alone that all ran, with one count for all (a decode
    step), is its handles as they came: ``(handles, lengths, count)``.

    Example: extends of rows 3 and 5 by one token each (row 5's failed), row 3 at 9 tokens
    after the step, and an allocate of 20 tokens with a 16-token hit in row 0: rows [3, 0],
    starts [8, 16], counts [1, 4].
    """
    new = cols.num_new_tokens
    if not out.errors:  # every item ran (a decode step): no masks
        if type(new) is int and not len(cols.allocate):
            return cols.extend, lengths, new
        rows = cols.extend & request_rows.ROW_MASK
        if type(new) is int:
            counts = np.full(rows.size, new, dtype=np.int64)
        else:
            counts = np.asarray(new, dtype=np.int64)
        starts = lengths[rows] - counts
        if not len(cols.allocate):
            return rows, starts, counts
    else:
        ok = out.status["extend"] == 0
        rows = cols.extend[ok] & request_rows.ROW_MASK
        if type(new) is int:
            counts = np.full(rows.size, new, dtype=np.int64)
        elif type(new) is list:  # unchecked ints: those of successful items are counts
            counts = np.array(
                [n for n, fine in zip(new, ok.tolist(), strict=True) if fine], np.int64
            )
        else:
            counts = new[ok]
        starts = lengths[rows] - counts
    done = np.flatnonzero(out.status["allocate"] == 0)
    if done.size:
        hits = out.hit_tokens[done]
        firsts = out.firsts  # (their lengths: num_tokens, or sized by max_new_tokens)
        wanted = np.array([firsts[i].num_tokens for i in done.tolist()], np.int64)
        rows = np.concatenate([rows, out.handles[done] & request_rows.ROW_MASK])
        starts = np.concatenate([starts, hits])
        counts = np.concatenate([counts, wanted - hits])
    return rows, starts, counts


def _resume(m: Components, request_id: str) -> object:
    """A step's ``resume``: its copies completed before the step goes on, as
    ``KVCacheManager.resume`` completes them before it answers."""
    try:
        return resume(m, request_id)
    finally:
        m.settle()


def rehearse(m: Components, cols: StepColumns) -> None:
    """A decode step's rehearsal (``KVCacheManager.rehearse_columns``): where ``cols`` are
    extends alone of two requests or more with one count each for all, their batch plan
    and last tokens' mapping in C (``rehearse_decode``), changing no state; nothing for any
    other step or without the C core."""
    sizes = cols.sizes()
    if sum(sizes.values()) == sizes["extend"]:
        rehearse_decode(m, cols.extend, cols.num_new_tokens, cols.lookahead)


def rehearse_decode(m: Components, handles: np.ndarray, new: object, ahead: object) -> None:
    """A decode batch's rehearsal (``KVCacheManager.rehearse_decode``): for two handles or
    more with one count and one lookahead for all, on the C core and a coordinator without
    context parallelism, its plan and its last tokens' mapping in C
    (``NativeDecode.rehearse``), changing no state; nothing otherwise. ``handles``: an
    int64 array."""
    core = native.core
    if core is None or not m.coord.plain or handles.size < 2:
        return
    if type(new) is int and type(ahead) is int:
        m.native_decode.rehearse(core, m, handles, new, ahead)


#: A decode step's statuses, but its extends': every other section is empty (the order of
#: ``StepColumns.sizes``, which ``_Run`` follows).
_DECODE_STATUS = dict.fromkeys(("free", "rewind", "suspend", "resume", "commit"), _NONE16)


def decode(m: Components, handles: np.ndarray, new: int, ahead: int) -> StepOutcome | None:
    """A decode step, ``handles`` extended by ``new`` tokens each with ``ahead`` lookahead,
    as ``execute`` runs a step of extends alone, through fewer lines: the C batch
    (``NativeDecode.extend``) and its outcome, no ``StepColumns``, no ``_Run``, no section
    dispatch. None, with nothing changed, where the step is not that batch (no C core, a
    context-parallel coordinator, fewer than two handles, more than ``_MAX_ZEROS``, or a
    batch the C plan leaves to numpy or to item after item: a stale handle, a repeated
    row, a request past max_seq_len): the caller runs it the general way
    (``KVCacheManager.decode_step``). ``handles``: a checked int64 array; ``new`` and
    ``ahead``: checked counts.

    Why: at an engine's cadence every line of the step runs cold (docs/step-channel.md),
    and the general step's sections, checks and outcome cost a decode step more than its
    batch does. Example: handles of rows 3 and 5, ``new`` 1, ``ahead`` 0, row 5 crossing
    into a new block: ``status["extend"]`` ``[0, 0]``, ``new_blocks`` ``[0, 1]``, as
    ``step_columns(extend=handles)`` answers.
    """
    core = native.core
    if core is None or not m.coord.plain or not 2 <= handles.size <= _MAX_ZEROS:
        return None
    done = m.native_decode.extend(core, m, handles, new, ahead)
    if done is None or done is False:
        return None
    status = dict(_DECODE_STATUS, extend=_ZEROS16[: handles.size], allocate=_NONE16)
    added = np.asarray(done[1], dtype=np.int32)
    return StepOutcome(status, added, _NONE64, _NONE64, _NONE32)


def run_columns(
    m: Components, cols: StepColumns, atomic: bool, sizes: dict[str, int] | None = None
) -> StepOutcome:
    """Run a parsed step on ``m``; all or nothing with ``atomic``."""
    if not atomic:
        return execute(m, cols, False, sizes)
    with transaction(m) as undo:
        out = execute(m, cols, True, sizes)
        if out.failed is not None:
            undo()
        return out

"""``step(ops)``, the op-list form of a step, as a layer over the columnar step.

An op list runs as pieces (``op_segments``), each one columnar step: its ids
become handles, its results come back as one result dict per op in list order, the
``OpResult`` dumps the service sends (``KVCacheManager.step_plain``). Each op's result is
read at the end of its piece, which is also its state right after the op (a piece never
names a request twice).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from kvcm_client.errors import RequestSuspended, StepAborted, UnknownRequest
from kvcm_client.models import OpResult

from . import request_rows
from .columnar import execute
from .columnar_types import SECTIONS, StepColumns, StepOutcome
from .counts import MAX_COUNT

if TYPE_CHECKING:
    from .components import Components

#: A result slot not filled yet (``piece_results``); never returned.
_PLACEHOLDER: dict[str, Any] = {}


def execute_ops(
    m: Components, ops: list[dict[str, Any]], stop_on_error: bool, brief: bool
) -> list[dict[str, Any]]:
    """Run op dicts as columnar steps (``op_segments``), results back in op order."""
    results: list[dict[str, Any]] = []
    for start, end in op_segments(ops):
        piece = ops[start:end]
        cols, where = columns_of(m, piece)
        out = execute(m, cols, stop_on_error)
        results_of_piece = piece_results(m, piece, where, out, brief)
        if out.failed is not None:
            section, index = out.failed
            at = where[section][index]
            applied = None if stop_on_error else results + results_of_piece[:at]
            return aborted(len(ops), start + at, results_of_piece[at], applied)
        results += results_of_piece
    return results


def handles_of(m: Components, request_ids: list[str]) -> np.ndarray:
    """Handles of ids; 0 (no request) for an id that is not live."""
    get = m.requests.rows.get
    rows = np.array([get(r, -1) for r in request_ids], dtype=np.int64)
    handles = m.requests.handle[rows]
    handles[rows < 0] = 0
    return handles


def handles_or_suspended(m: Components, request_ids: list[str]) -> np.ndarray:
    """``handles_of``, with a suspended request named by the handle it gets back (what the
    columnar ``free`` and ``resume`` take for one)."""
    handles = handles_of(m, request_ids)
    if m.requests.suspended:
        for i, r in enumerate(request_ids):
            saved = m.requests.suspended.get(r)
            if saved is not None:
                handles[i] = saved.handle
    return handles


def columns_of(
    m: Components, piece: list[dict[str, Any]]
) -> tuple[StepColumns, dict[str, list[int]]]:
    """A piece of op dicts as columns, and each section's op positions in the piece."""
    where: dict[str, list[int]] = {s: [] for s in SECTIONS}
    ids: dict[str, list[str]] = {s: [] for s in SECTIONS}
    for j, op in enumerate(piece):
        kind = op["op"]
        where[kind].append(j)
        ids[kind].append(op["request_id"])
    ext = [piece[j] for j in where["extend"]]
    new = [op["num_new_tokens"] for op in ext]
    ahead = [op["lookahead"] for op in ext]
    cols = StepColumns(
        free=handles_or_suspended(m, ids["free"]),
        rewind=handles_of(m, ids["rewind"]),
        rewind_tokens=[piece[j]["num_tokens"] for j in where["rewind"]],
        commit=handles_of(m, ids["commit"]),
        commit_tokens=[piece[j]["token_ids"] for j in where["commit"]],
        extend=handles_of(m, ids["extend"]),
        # Counts in range go as arrays (a batch may run); others stay ints, so that each
        # item checks its own and fails alone (a count past int64 has no array).
        num_new_tokens=(
            np.array(new, dtype=np.int64)
            if new and min(new) >= 1 and max(new) <= MAX_COUNT
            else new
        ),
        lookahead=(
            np.array(ahead, dtype=np.int64)
            if ahead and min(ahead) >= 0 and max(ahead) <= MAX_COUNT
            else ahead
        ),
        allocate=[{k: v for k, v in piece[j].items() if k != "op"} for j in where["allocate"]],
        suspend=handles_of(m, ids["suspend"]),
        # A live id's handle: "not suspended"; an unknown one unknown.
        resume=handles_or_suspended(m, ids["resume"]),
    )
    return cols, where


def piece_results(
    m: Components,
    piece: list[dict[str, Any]],
    where: dict[str, list[int]],
    out: StepOutcome,
    brief: bool,
) -> list[dict[str, Any]]:
    """The result dict of each op of a piece (``step_aborted`` placeholders for ops the
    step did not run: the caller replaces them)."""
    results: list[dict[str, Any]] = [_PLACEHOLDER] * len(piece)
    for section in SECTIONS:
        status = out.status[section]
        positions = where[section]
        if not positions:
            continue
        if section == "extend" and not status.any():
            if brief:
                for j in positions:
                    results[j] = {"ok": True, "request": None, "error": None}
            else:
                eids = [piece[j]["request_id"] for j in positions]
                rows = request_rows.rows_of(m, eids)
                for j, r in zip(positions, result_dicts(m, eids, rows), strict=True):
                    results[j] = r
            continue
        for k, (j, code) in enumerate(zip(positions, status.tolist(), strict=True)):
            if code:
                continue
            rid = piece[j]["request_id"]
            if section == "free" or (brief and section == "extend"):
                results[j] = {"ok": True, "request": None, "error": None}
            else:
                # An allocate answers what it returned (a retry: the first result).
                first = out.firsts[k] if section == "allocate" else None
                info = (
                    request_rows.info(m, rid, m.requests.rows[rid])
                    if first is None
                    else first.result
                )
                results[j] = {"ok": True, "request": info.model_dump(), "error": None}
    for e in out.errors:
        j = where[e.section][e.index]
        exc = e.error
        if isinstance(exc, UnknownRequest):
            rid = piece[j]["request_id"]
            shown = str(rid)[:64]
            if isinstance(rid, str) and rid in m.requests.suspended:
                exc = RequestSuspended(f"request {shown!r} is suspended", request_id=shown)
            elif isinstance(rid, str) and rid in m.requests.held:
                exc = request_rows.in_flight(rid)
            else:
                exc = UnknownRequest(f"unknown request {shown!r}", request_id=shown)
        results[j] = {"ok": False, "request": None, "error": exc.to_dict()}
    return results


def aborted(
    n: int,
    failed: int,
    result: dict[str, Any],
    applied: list[dict[str, Any]] | None = None,
) -> list[dict[str, Any]]:
    """Results of a step stopped at op ``failed``: ``applied`` (the results before it,
    kept; None for an all-or-nothing step, whose earlier ops were undone), that op's
    result, and ``step_aborted`` for every op not applied."""
    code = result["error"]["code"]
    what = "of this all-or-nothing step " if applied is None else ""
    aborted = {
        "ok": False,
        "request": None,
        "error": {
            "code": StepAborted.code,
            "message": f"not applied: op {failed} {what}failed ({code})",
            "detail": {"failed_op": failed},
        },
    }
    head = applied[:failed] if applied is not None else [aborted] * failed
    return [*head, result, *([aborted] * (n - failed - 1))]


def result_dicts(
    m: Components, request_ids: Sequence[str], rows: np.ndarray
) -> list[dict[str, Any]]:
    """The ``OpResult`` dicts of successful extends of these rows (``model_dump`` form)."""
    c = m.coord
    lengths = c.num_tokens[rows]
    capacity = (lengths + c.lookahead[rows]).tolist()
    committed = m.requests.committed[rows].tolist()
    hits = m.requests.hits[rows].tolist()
    handles = m.requests.handle[rows].tolist()
    state_slots = m.state_slot[rows].tolist()
    return [
        {
            "ok": True,
            "request": {
                "request_id": i,
                "row": r,
                "num_tokens": n,
                "capacity": cap,
                "num_committed": k,
                "num_hit_tokens": h,
                "handle": hd,
                "state_slot": ss,
            },
            "error": None,
        }
        for i, r, n, cap, k, h, hd, ss in zip(
            request_ids,
            rows.tolist(),
            lengths.tolist(),
            capacity,
            committed,
            hits,
            handles,
            state_slots,
            strict=True,
        )
    ]


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

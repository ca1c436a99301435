"""Checking a columnar step's shape before it runs (``parse_columns``), and the step channel's
wire form of its arguments (``columns_from_wire``, docs/step-channel.md#step_columns).

The shape is checked as a whole (a malformed step is refused and changes nothing); each
item's own arguments are checked when it runs, so that a bad one fails only that item.
"""

from __future__ import annotations

from array import array
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from kvcm_client.errors import InvalidArgument
from kvcm_client.models import AllocateOp

from . import native
from .columnar_types import StepColumns
from .counts import MAX_COUNT, _count, _counts
from .ops import OP_FIELDS

_ALLOCATE_KEYS = frozenset(AllocateOp.model_fields) - {"op"}
_ALLOCATE_KEYS_OP = _ALLOCATE_KEYS | {"op"}
#: An allocate's optional fields and their defaults: the op list's (``kvcm.ops``).
_ALLOCATE_DEFAULTS: dict[str, Any] = OP_FIELDS["allocate"][1]


_NO_HANDLES = np.zeros(0, dtype=np.int64)
_NO_HANDLES.flags.writeable = False


def _handles(name: str, value: Any) -> np.ndarray:
    """Handles as a contiguous int64 array (what the C decode path reads): any sequence or
    1-d array of ints (not bools)."""
    plain = type(value) is tuple or type(value) is list  # no abc checks for these
    if plain:
        if not value:  # a section left out
            return _NO_HANDLES
        core = native.core
        packed = core.pack_handles(value) if core is not None else None
        if packed is not None:  # ints in int64's range (no bool): numpy infers nothing
            return np.frombuffer(packed, dtype=np.int64)
    if (
        type(value) is np.ndarray
        and value.dtype == np.int64
        and value.ndim == 1
        and value.flags.c_contiguous
    ):
        return value
    if isinstance(value, np.ndarray):
        arr = value
    elif isinstance(value, array):  # the client's int64 arrays: no copy
        arr = np.frombuffer(value, dtype=np.int64) if value.typecode == "q" else np.asarray(value)
    elif not plain and (isinstance(value, str | bytes) or not isinstance(value, Sequence)):
        raise InvalidArgument(f"{name} must be a sequence of handles", **{name: None})
    else:
        if bool in map(type, value):
            raise InvalidArgument(f"{name} must be ints, not bools", **{name: None})
        arr = np.asarray(value)
    if arr.ndim != 1 or (arr.size and arr.dtype.kind not in "iu"):
        raise InvalidArgument(f"{name} must be a 1-d sequence of ints", **{name: None})
    if arr.dtype == np.int64:
        return np.ascontiguousarray(arr)
    if arr.size and arr.dtype.kind == "u" and int(arr.max()) >= 2**63:
        # No live handle is that large: those items become 0 (unknown), the others stay.
        return np.where(arr >= 2**63, 0, arr).astype(np.int64)
    return arr.astype(np.int64)


def _allocates(value: Any) -> list[dict[str, Any]]:
    if (type(value) is not list and type(value) is not tuple) and (
        isinstance(value, str | bytes | Mapping) or not isinstance(value, Sequence)
    ):
        raise InvalidArgument("allocate must be a sequence of allocate ops", allocate=None)
    out = []
    for item in value:
        if type(item) is not dict and isinstance(item, AllocateOp):
            op = item.model_dump()
            del op["op"]
            out.append(op)
            continue
        if type(item) is not dict or not item.keys() <= _ALLOCATE_KEYS_OP:
            raise InvalidArgument(
                f"each allocate is an AllocateOp or its dict (keys {sorted(_ALLOCATE_KEYS)})",
                allocate=None,
            )
        if item.get("op", "allocate") != "allocate":
            raise InvalidArgument("an allocate item's op must be 'allocate'", allocate=None)
        if "request_id" not in item or "num_tokens" not in item:
            raise InvalidArgument("each allocate needs request_id and num_tokens", allocate=None)
        op = {**_ALLOCATE_DEFAULTS, **item}
        if "op" in op:
            del op["op"]
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
    return StepColumns(  # positional, the fields in order (keywords cost a third more)
        free_h,
        rewind_h,
        _counts_of("rewind_tokens", rewind_tokens, rewind_h.size, 1),
        _handles("suspend", suspend),
        _handles("resume", resume),
        commit_h,
        commit_tokens,
        extend_h,
        _counts_of("num_new_tokens", num_new_tokens, extend_h.size, 1),
        _counts_of("lookahead", lookahead, extend_h.size, 0),
        (
            []
            if (type(allocate) is tuple or type(allocate) is list) and not allocate
            else _allocates(allocate)
        ),
    )


def parse_keywords(columns: Mapping[str, Any]) -> StepColumns:
    """``parse_columns`` of ``step_columns``' keyword arguments (``columns_from_wire``'s), the
    step's sections only: the shape check alone, without the manager (busy-poll mode's
    rehearsal: ``StepChannel.rehearse``)."""
    get = columns.get
    return parse_columns(
        get("free", ()),
        get("rewind", ()),
        get("rewind_tokens", 1),
        get("commit", ()),
        get("commit_tokens", ()),
        get("extend", ()),
        get("num_new_tokens", 1),
        get("lookahead", 0),
        get("allocate", ()),
        get("suspend", ()),
        get("resume", ()),
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
        "map_slots",
        "stream_ordered",
        "table_edits",
        "ragged_layers",
        "suspend",
        "resume",
    }
)


_ITEMSIZE = {"<i8": 8, "<i4": 4}


def _wire_ints(name: str, value: Any, dtype: str) -> Any:
    """Raw little-endian bytes as an array; lists and ints are left to ``parse_columns``."""
    if type(value) is not bytes:
        return value
    if len(value) % _ITEMSIZE[dtype]:
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

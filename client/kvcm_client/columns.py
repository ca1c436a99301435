"""The columnar step on the wire, client side (docs/step-channel.md#step_columns), no numpy.

Handles and counts travel as raw little-endian int64 bytes (``array('q')`` here, any int64
numpy array as is), commit tokens as one int32 array and a length per commit; results come
back as raw arrays and are read only when asked: ``StepColumnsResult.ok`` needs none of them.
"""

from __future__ import annotations

import sys
from array import array
from collections.abc import Mapping, Sequence
from typing import Any

from .bodies import RaggedPageIndices
from .errors import STATUS_CODES, InvalidArgument, KVCMError, error_from_dict
from .transfer import PullState

#: The sections of a step, in the order they run.
SECTIONS = ("commit", "free", "rewind", "suspend", "resume", "extend", "allocate")
_LITTLE = sys.byteorder == "little"
#: The values each array code holds (a numpy array is checked against it before its cast).
_RANGE = {"q": (-(2**63), 2**63 - 1), "i": (-(2**31), 2**31 - 1)}
_SIZE = {"q": 8, "i": 4}
#: numpy's byte orders of a little-endian array ("=" native, "|" one byte wide).
_NATIVE = ("<", "=") if _LITTLE else ("<",)


def _raw(values: Any, name: str, code: str) -> bytes:
    """Ints as little-endian bytes of ``code`` ('q' int64, 'i' int32)."""
    kind = type(values)
    if kind is array and values.typecode == code and _LITTLE:  # the usual: no abc checks
        return values.tobytes()
    if kind is list:
        return _from_list(values, name, code)
    if isinstance(values, bytes | bytearray | memoryview):
        return bytes(values)
    dtype = getattr(values, "dtype", None)
    if dtype is not None:  # a numpy array: no numpy import needed to convert it
        if dtype.kind == "i" and dtype.itemsize == _SIZE[code] and dtype.byteorder in _NATIVE:
            # Signed ints of the code's own width and byte order (a decode step's int64
            # handles): every value fits, so no scan for the range and no cast (a cold
            # min, max and astype cost ~6 us after an engine's forward).
            return values.tobytes()
        if values.size:
            low, high = _RANGE[code]
            if dtype.kind not in "iu" or not low <= int(values.min()) <= int(values.max()) <= high:
                raise InvalidArgument(
                    f"{name} must be ints in [{low}, {high}]: a cast would wrap", **{name: None}
                )
        return values.astype("<i8" if code == "q" else "<i4").tobytes()
    if isinstance(values, str) or not isinstance(values, Sequence | array):
        raise InvalidArgument(f"{name} must be a sequence of ints", **{name: None})
    if isinstance(values, array) and values.typecode == code and _LITTLE:
        return values.tobytes()
    return _from_list(values, name, code)


def int64_bytes(values: Any, name: str) -> bytes:
    """``values`` (handles) as the wire's little-endian int64 bytes, checked as a
    ``step_columns`` section's (``InvalidArgument`` naming ``name``)."""
    return _raw(values, name, "q")


def _from_list(values: Any, name: str, code: str) -> bytes:
    """A sequence of Python ints (not bools) as ``_raw``'s bytes."""
    if bool in map(type, values):
        raise InvalidArgument(f"{name} must be ints, not bools", **{name: None})
    try:
        out = array(code, values)
    except (TypeError, OverflowError) as exc:
        raise InvalidArgument(f"{name} must be ints in range: {exc}", **{name: None}) from None
    if not _LITTLE:  # pragma: no cover - no big-endian hosts in CI
        out.byteswap()
    return out.tobytes()


def _counts(values: Any, name: str) -> Any:
    """One count as an int (a numpy integer scalar too, as the manager takes it), several
    as int64 bytes."""
    if isinstance(values, int) and not isinstance(values, bool):
        return values
    dtype = getattr(values, "dtype", None)
    if dtype is not None and dtype.kind in "iu" and getattr(values, "ndim", None) == 0:
        return int(values)
    return _raw(values, name, "q")


def wire_columns(
    free: Any = (),
    rewind: Any = (),
    rewind_tokens: Any = 1,
    commit: Any = (),
    commit_tokens: Any = (),
    extend: Any = (),
    num_new_tokens: Any = 1,
    lookahead: Any = 0,
    allocate: Any = (),
    atomic: bool = False,
    suspend: Any = (),
    resume: Any = (),
    map_slots: bool = False,
    table_edits: bool = False,
    ragged_layers: Any = (),
    stream_ordered: bool = False,
) -> dict[str, Any]:
    """The ``args`` map of a ``step_columns`` frame. Empty sections are left out."""
    args: dict[str, Any] = {}
    if len(free):
        args["free"] = _raw(free, "free", "q")
    if len(rewind):
        args["rewind"] = _raw(rewind, "rewind", "q")
        args["rewind_tokens"] = _counts(rewind_tokens, "rewind_tokens")
    if len(commit):
        if isinstance(commit_tokens, str | bytes) or not isinstance(commit_tokens, Sequence):
            raise InvalidArgument("commit_tokens must be a list of token id lists", commit=None)
        args["commit"] = _raw(commit, "commit", "q")
        args["commit_lengths"] = _raw([len(t) for t in commit_tokens], "commit_tokens", "q")
        args["commit_tokens"] = b"".join(_raw(t, "commit_tokens", "i") for t in commit_tokens)
    if len(extend):
        args["extend"] = _raw(extend, "extend", "q")
        args["num_new_tokens"] = _counts(num_new_tokens, "num_new_tokens")
        args["lookahead"] = _counts(lookahead, "lookahead")
    if len(allocate):
        args["allocate"] = [_allocate(op) for op in allocate]
    if len(suspend):
        args["suspend"] = _raw(suspend, "suspend", "q")
    if len(resume):
        args["resume"] = _raw(resume, "resume", "q")
    if atomic:
        args["atomic"] = atomic
    if map_slots:
        args["map_slots"] = map_slots
    if table_edits:
        args["table_edits"] = table_edits
    if stream_ordered is not False:  # a non-bool goes too: the service refuses it
        args["stream_ordered"] = stream_ordered
    if len(ragged_layers):
        # numpy scalars as Python values of their own type: the service checks them
        args["ragged_layers"] = [k.item() if hasattr(k, "item") else k for k in ragged_layers]
    return args


def _allocate(op: Any) -> Any:
    if hasattr(op, "model_dump"):
        return op.model_dump(mode="json", exclude_defaults=True)
    return op


def json_columns(**columns: Any) -> dict[str, Any]:
    """The body of ``POST /v1/step_columns``: the same step with lists."""
    out: dict[str, Any] = {}
    for name, value in columns.items():
        if name == "allocate":
            out[name] = [_allocate(op) for op in value]
        elif hasattr(value, "tolist"):
            out[name] = value.tolist()
        elif name == "commit_tokens":
            out[name] = [t.tolist() if hasattr(t, "tolist") else list(t) for t in value]
        elif isinstance(value, Sequence | array) and not isinstance(value, str):
            out[name] = list(value)
        else:
            out[name] = value
    return out


class ItemError:
    """A failed item: section, index in that section, the typed error."""

    __slots__ = ("error", "index", "section")

    def __init__(self, section: str, index: int, error: KVCMError) -> None:
        self.section = section
        self.index = index
        self.error = error

    def __repr__(self) -> str:
        return f"ItemError({self.section!r}, {self.index}, {self.error.code!r})"


class StepColumnsResult:
    """A columnar step's answer, decoded on first read.

    ``status[section]``: a status per item (0 ok, else ``STATUS_CODES`` index);
    ``new_blocks`` per extend; ``handles``, ``hit_tokens``, ``allocate_new_blocks`` per
    allocate; ``errors`` the failed items with typed errors; ``failed`` the item that stopped
    the step, if any. ``ok`` is True when every item succeeded (read without decoding).
    """

    __slots__ = ("_cache", "_raw")

    def __init__(self, raw: Mapping[str, Any]) -> None:
        self._raw = raw
        self._cache: dict[str, Any] = {}

    @property
    def ok(self) -> bool:
        raw = self._raw
        return not raw.get("errors") and raw.get("failed") is None

    def _ints(self, name: str, code: str, value: Any) -> list[int]:
        if isinstance(value, list):
            return value
        view = memoryview(value)
        if not _LITTLE:  # pragma: no cover
            swapped = array(code, value)
            swapped.byteswap()
            return swapped.tolist()
        return view.cast(code).tolist()

    @property
    def status(self) -> dict[str, list[int]]:
        if "status" not in self._cache:
            raw = self._raw["status"]
            self._cache["status"] = {s: self._ints(s, "h", raw.get(s, [])) for s in SECTIONS}
        return self._cache["status"]

    def codes(self, section: str) -> list[str]:
        """The status of each item of a section as error codes ('ok' for success)."""
        return [
            STATUS_CODES[s] if s < len(STATUS_CODES) else "kvcm_error" for s in self.status[section]
        ]

    def _array(self, name: str, code: str) -> list[int]:
        if name not in self._cache:
            self._cache[name] = self._ints(name, code, self._raw.get(name, []))
        return self._cache[name]

    @property
    def new_blocks(self) -> list[int]:
        return self._array("new_blocks", "i")

    @property
    def handles(self) -> list[int]:
        return self._array("handles", "q")

    @property
    def hit_tokens(self) -> list[int]:
        return self._array("hit_tokens", "q")

    @property
    def allocate_new_blocks(self) -> list[int]:
        return self._array("allocate_new_blocks", "i")

    @property
    def errors(self) -> list[ItemError]:
        return [
            ItemError(e["section"], e["index"], error_from_dict(e))
            for e in self._raw.get("errors", [])
        ]

    @property
    def failed(self) -> tuple[str, int] | None:
        f = self._raw.get("failed")
        return None if f is None else (f[0], f[1])

    @property
    def slot_mapping(self) -> list[array] | None:
        """With ``map_slots``: per layer group, the slots of the tokens computed for this step
        (each successful extend's new tokens, then each successful allocate's past its hit)
        as an int64 ``array('q')``, -1 where a window released the page: a buffer that
        ``numpy.asarray`` or ``torch.frombuffer`` reads without a copy (``numpy.array(...)``
        of the list is ``[groups, tokens]``). None without ``map_slots``."""
        if "slot_mapping" not in self._cache:
            raw = self._raw.get("slot_mapping")
            if raw is None:
                return None
            if isinstance(raw, list):  # HTTP's JSON lists
                self._cache["slot_mapping"] = [array("q", group) for group in raw]
            else:  # the step channel's raw little-endian int64 bytes, [groups, tokens]
                groups, tokens = raw["shape"]
                data, width = raw["data"], 8 * tokens
                rows = []
                for g in range(groups):
                    row = array("q", data[g * width : (g + 1) * width])
                    if not _LITTLE:  # pragma: no cover
                        row.byteswap()
                    rows.append(row)
                self._cache["slot_mapping"] = rows
        return self._cache["slot_mapping"]

    @property
    def table_edits(self) -> array | None:
        """With ``table_edits``: the page-table cells changed since the last answer that had
        them, flat int64 ``array('q')`` of (group, row, position, value) rows:
        ``numpy.asarray(edits).reshape(-1, 4)``; apply with
        ``mirror[e[:, 0], e[:, 1], e[:, 2]] = e[:, 3]``. None without ``table_edits``."""
        if "table_edits" not in self._cache:
            raw = self._raw.get("table_edits")
            if raw is None:
                return None
            if isinstance(raw, list):  # HTTP's JSON lists
                self._cache["table_edits"] = array("q", [v for edit in raw for v in edit])
            else:  # the step channel's raw little-endian int64 bytes
                edits = array("q", raw)
                if not _LITTLE:  # pragma: no cover
                    edits.byteswap()
                self._cache["table_edits"] = edits
        return self._cache["table_edits"]

    @property
    def ragged(self) -> dict[int, RaggedPageIndices] | None:
        """With ``ragged_layers``: per layer id, the ragged (CSR) pages of the requests the
        step maps, in ``slot_mapping``'s order (``RaggedPageIndices``); None without."""
        if "ragged" not in self._cache:
            raw = self._raw.get("ragged")
            if raw is None:
                return None
            self._cache["ragged"] = {
                int(layer): RaggedPageIndices(
                    **{name: _int32_list(v) for name, v in arrays.items()}
                )
                for layer, arrays in raw.items()
            }
        return self._cache["ragged"]

    @property
    def pulls(self) -> list[PullState] | None:
        """Pulls and fetches from other sidecars that ended since the last step's answer
        (``PullState``: ready with the request's handle, or failed with its error); None
        when none did (docs/disaggregation.md)."""
        raw = self._raw.get("pulls")
        return None if raw is None else [PullState.model_validate(p) for p in raw]

    def __repr__(self) -> str:
        return f"StepColumnsResult(ok={self.ok}, errors={self.errors!r})"


def _int32_list(value: Any) -> list[int]:
    """JSON's list, or the step channel's little-endian int32 bytes, as a list."""
    if isinstance(value, list):
        return value
    out = array("i", value)
    if not _LITTLE:  # pragma: no cover
        out.byteswap()
    return out.tolist()

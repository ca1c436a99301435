"""The columnar step's types (``kvcm.columnar``): a parsed step, its outcome, an item's error.

Results are arrays, one status per item (0 ok, else the index of its error's code in
``STATUS_CODES``), so that a step of 256 items builds no object per item unless one fails.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvcm_client.errors import KVCMError

#: The sections of a step, in the order they run.
SECTIONS = ("commit", "free", "rewind", "suspend", "resume", "extend", "allocate")


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
    have status ``step_aborted``; None when the step ran to the end. Statuses of sections
    without a failure, and zero block counts, may be read-only views of shared zeros
    (``kvcm.columnar``): the outcome's to read.
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
    firsts: list[Any] = field(default_factory=list)
    """Per allocate, its ``kvcm.allocation.FirstAllocation`` (None where it failed): what
    ``infos`` are built from when someone reads them."""
    slot_mapping: Any = None
    """With ``map_slots``: the slot mapping (a tensor on the manager's device, int64
    ``[groups, tokens]``) of the tokens the engine computes for this step's items: each
    successful extend's new tokens, then each successful allocate's past its hit, in item
    order (``kvcm.columnar.mapped_tokens``); None without."""
    pulls: list[Any] | None = None
    """The ``PullState`` of the pulls and fetches that ended since the last step's answer
    (``kvcm.transfers``); None when none did."""
    table_edits: np.ndarray | None = None
    """With ``table_edits``: the page-table cells changed since the last answer that had
    them, int64 ``[E, 4]`` (group, row, position, value; ``kvcm.table_mirror``)."""
    ragged: dict[int, Any] | None = None
    """With ``ragged_layers``: per layer id, the ``RaggedPages`` (``kvcm.views``) of the
    requests the step maps, in ``slot_mapping``'s order, kernel-mode per-layer indices."""

    @property
    def infos(self) -> list[Any]:
        """Per allocate, the ``RequestInfo`` it returned (None where it failed): for a retry,
        the first allocation's result, as ``allocate`` answers it."""
        return [None if f is None else f.result for f in self.firsts]

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
            **(
                {}
                if self.slot_mapping is None
                else {"slot_mapping": self.slot_mapping.cpu().tolist()}
            ),
            **({} if self.table_edits is None else {"table_edits": self.table_edits.tolist()}),
            **(
                {}
                if self.ragged is None
                else {"ragged": {str(k): _ragged(v, _lists) for k, v in self.ragged.items()}}
            ),
            **({} if self.pulls is None else {"pulls": [p.model_dump() for p in self.pulls]}),
        }

    def to_wire(self) -> dict[str, Any]:
        """The result map of the step channel (docs/step-channel.md#step_columns): arrays as
        little-endian bytes (int16 status, int32 block counts, int64 handles and tokens);
        empty sections, empty arrays and an empty error list are left out."""
        out: dict[str, Any] = {
            "status": {s: _wire(a, _I2) for s, a in self.status.items() if a.size}
        }
        if self.new_blocks.size:
            out["new_blocks"] = _wire(self.new_blocks, _I4)
        if self.handles.size:
            out["handles"] = _wire(self.handles, _I8)
            out["hit_tokens"] = _wire(self.hit_tokens, _I8)
            out["allocate_new_blocks"] = _wire(self.allocate_new_blocks, _I4)
        if self.errors:
            out["errors"] = [e.to_dict() for e in self.errors]
        if self.failed is not None:
            out["failed"] = list(self.failed)
        if self.slot_mapping is not None:
            mapping = self.slot_mapping.cpu().numpy()
            out["slot_mapping"] = {"shape": list(mapping.shape), "data": _wire(mapping, _I8)}
        if self.table_edits is not None:
            out["table_edits"] = _wire(self.table_edits, _I8)
        if self.ragged is not None:
            out["ragged"] = {str(k): _ragged(v, _int32_bytes) for k, v in self.ragged.items()}
        if self.pulls is not None:
            out["pulls"] = [p.model_dump() for p in self.pulls]
        return out


_I2, _I4, _I8 = np.dtype("<i2"), np.dtype("<i4"), np.dtype("<i8")


def _wire(values: np.ndarray, dtype: np.dtype[Any]) -> bytes:
    """``values`` as little-endian bytes of ``dtype``: no copy to convert where they are
    already that (the native int arrays of a little-endian host)."""
    if values.dtype == dtype:
        return values.tobytes()
    return values.astype(dtype).tobytes()


#: The arrays of a ``RaggedPages``, in the order the answers list them.
RAGGED_FIELDS = ("indptr", "indices", "last_page_len", "first_token", "num_sink_pages")


def _lists(t: Any) -> list[int]:
    return t.cpu().tolist()


def _int32_bytes(t: Any) -> bytes:
    return _wire(t.cpu().numpy(), _I4)


def _ragged(pages: Any, encode: Any) -> dict[str, Any]:
    """A ``RaggedPages``' arrays as JSON lists or little-endian int32 bytes."""
    return {name: encode(getattr(pages, name)) for name in RAGGED_FIELDS}

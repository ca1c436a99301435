"""Validation of the count arguments ops take (tokens, positions, lookahead, bounds).

Counts are plain ints, never bools, bounded before any arithmetic; a count's error names
the argument and shows the value (as a string past int64, which JSON encoders refuse).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from kvcm_client.errors import InvalidArgument

# The largest count (tokens, positions, lookahead) any op takes: the wire models' schema
# publishes it, so it lives with them; re-exported here for the service's modules.
from kvcm_client.specs import MAX_COUNT as MAX_COUNT


def _shown(value: int) -> int | str:
    """An int for an error's detail: as a string past int64, which JSON encoders refuse."""
    return int(value) if -(2**63) <= value < 2**63 else str(value)


def _count(name: str, value: Any, minimum: int, maximum: int = MAX_COUNT) -> int:
    if type(value) is int and minimum <= value <= maximum:  # the usual case, checked first
        return value
    if isinstance(value, bool) or not isinstance(value, int | np.integer):
        raise InvalidArgument(f"{name} must be an int, got {type(value).__name__}", **{name: None})
    if not minimum <= value <= maximum:
        raise InvalidArgument(
            f"{name} must be in [{minimum}, {maximum}], got {_shown(value)}",
            **{name: _shown(value)},
        )
    return int(value)


def _counts(name: str, value: int | Sequence[int], n: int, minimum: int) -> np.ndarray:
    if isinstance(value, int | np.integer) and not isinstance(value, bool):
        _count(name, value, minimum)
        return np.full(n, value, dtype=np.int64)
    arr = np.asarray(value)
    # numpy reads [True, 2] as ints: a bool is no count here either (as in _count).
    if (
        arr.shape != (n,)
        or (arr.dtype.kind not in "iu" and arr.size)
        or (isinstance(value, list | tuple) and bool in map(type, value))
    ):
        raise InvalidArgument(f"{name} must be an int or {n} ints", **{name: None})
    # Checked before the cast: a uint64 of 2**63 would turn negative in int64.
    if n and not (minimum <= int(arr.min()) and int(arr.max()) <= MAX_COUNT):
        raise InvalidArgument(
            f"{name} must be ints in [{minimum}, {MAX_COUNT}]",
            **{name: _shown(int(arr.min()) if int(arr.min()) < minimum else int(arr.max()))},
        )
    return np.ascontiguousarray(arr, dtype=np.int64)  # as the C decode path reads it

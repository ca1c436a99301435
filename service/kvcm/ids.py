"""Distinct id types, so that a slot is never passed where a layer id is expected."""

from typing import NewType

#: Low 32 bits of a request handle (``RequestInfo.handle``): its page-table row; the high bits
#: are the row's serial, so a stale handle never names the row's next request.
ROW_MASK = 0xFFFFFFFF

LayerId = NewType("LayerId", int)
LayerGroupId = NewType("LayerGroupId", int)
PoolGroupId = NewType("PoolGroupId", int)
PoolId = NewType("PoolId", int)
StateGroupId = NewType("StateGroupId", int)
SlotId = NewType("SlotId", int)
"""A block id: an int32 index into every pool of a pool group; -1 means "no page" (kernel-facing
tables hold the null page 0 instead when ``null_page`` is on)."""

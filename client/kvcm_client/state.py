"""Specs of state layers: the recurrent state of Mamba and linear-attention layers
(docs/state-layers.md).

A state layer keeps, per request, a few fixed-size tensors that its kernels update in place
as tokens go through it (Mamba-2: a convolution window and the SSM state; a gated delta net:
its convolution windows and the recurrent matrix), instead of one entry per token. kvcm gives
each request one state slot per state group and keeps checkpoints of it for prefix reuse.
"""

from __future__ import annotations

import math
import re
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator
from pydantic_core import PydanticCustomError

#: dtypes of state buffers and their bytes per element.
StateDType = Literal["fp32", "fp16", "bf16"]
STATE_DTYPE_BYTES: dict[str, int] = {"fp32": 4, "fp16": 2, "bf16": 2}
#: What a state buffer's name looks like: a lowercase identifier.
STATE_NAME = re.compile(r"[a-z][a-z0-9_]{0,63}")


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class StateBuffer(_Frozen):
    """One named tensor of a state layer, per request: for Mamba-2, ``conv`` of shape
    ``[conv_dim, d_conv - 1]`` and ``ssm`` of shape ``[heads, head_dim, d_state]``."""

    name: str
    shape: Annotated[tuple[Annotated[int, Field(gt=0)], ...], Field(min_length=1)]
    dtype: StateDType = "bf16"

    @model_validator(mode="after")
    def _rules(self) -> StateBuffer:
        if not STATE_NAME.fullmatch(self.name):
            raise PydanticCustomError(
                "state_buffer_name",
                "state buffer name '{name}' must be a lowercase identifier (a-z, 0-9, _; "
                "first a letter; at most 64 characters)",
                {"name": self.name},
            )
        return self

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * STATE_DTYPE_BYTES[self.dtype]


class StateLayerSpec(_Frozen):
    """One state layer on this rank (rank-local id, shapes already divided by TP).

    Layers with equal ``owner`` and ``reuse`` form a state group: their state lives and dies
    together, one slot per request. ``reuse="none"``: no checkpoints, so a prefix hit never
    restores this group (and then never happens: the group cannot resume mid-prompt).
    """

    layer_id: Annotated[int, Field(ge=0)]
    buffers: Annotated[tuple[StateBuffer, ...], Field(min_length=1)]
    owner: Literal["target", "draft"] = "target"
    reuse: Literal["reusable", "none"] = "reusable"

    @model_validator(mode="after")
    def _rules(self) -> StateLayerSpec:
        names = [b.name for b in self.buffers]
        if len(set(names)) < len(names):
            raise PydanticCustomError(
                "duplicate_state_buffer",
                "state layer {layer_id}: buffer names must be unique, got {names}",
                {"layer_id": self.layer_id, "names": names},
            )
        return self

    @property
    def nbytes(self) -> int:
        """Bytes of this layer's state for one request."""
        return sum(b.nbytes for b in self.buffers)


class StateGroupEstimate(_Frozen):
    """One state group in ``estimate()``: its slot, exactly the state of its layers for one
    request plus at most 15 bytes of alignment per buffer, and its slots."""

    state_group_id: int
    layer_ids: tuple[int, ...]
    slot_bytes: int
    state_bytes: int
    """Bytes of the state itself per request (the sum of its buffers, no alignment)."""
    live_slots: int
    """``state_live_slots``: one per request row by default (then state never limits how
    many requests run); a request holds one while it is not suspended."""
    checkpoint_slots: int
    host_slots: int = 0
    """Host tier slots for suspended requests' states, the same number in every group; 0
    without a host tier."""


class SharedStateBuffer(_Frozen):
    """Where buffer ``name`` of state layer ``layer_id`` lives in its state group's segment
    (``SharedLayout.state_pools[state_group]``): a strided view in ``dtype`` elements,
    ``[slots, *shape]``, the live state of page-table row r at ``view[r]``."""

    layer_id: int
    name: str
    state_group: int
    dtype: str
    shape: tuple[int, ...]
    strides: tuple[int, ...]
    offset: int

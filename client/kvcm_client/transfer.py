"""Wire models of KV moves between sidecars (docs/disaggregation.md).

A prefill sidecar hands a request off (``hand_off``): it keeps the request's blocks pinned and
answers a ``KVExport``, which says where every block lives in its registered memory. A decode
sidecar pulls from it (``pull``): it reserves blocks, reads the missing ones straight into
them with one transfer-engine READ per pool, and reports the request ``pulling`` until the
read completes (``transfer_status``). The export carries no token of the peer's and no salt:
the scope is a digest, the layout a list of facts both sides compare.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field

from .results import LoraId
from .specs import NonNegCount, PositiveCount, RequestId, StrictStr, TokenId, _Frozen

#: A peer's name: what ``kvcm serve --peer NAME=URL`` and ``--transfer-name`` take.
PeerName = Annotated[str, Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")]
#: Seconds a hand-off stays pinned, a pull may take.
Deadline = Annotated[float, Field(gt=0, le=3600)]


class TransferRegion(_Frozen):
    """One registered pool of a sidecar: ``num_slots`` slots of ``slot_bytes`` from
    ``address`` in its process (``DRAM`` on the CPU, ``VRAM`` on GPU ``device_id``)."""

    pool: int
    pool_group: int
    address: int
    slot_bytes: int
    num_slots: int
    memory: Literal["DRAM", "VRAM"]
    device_id: int = 0


class KVExport(_Frozen):
    """A handed-off request, as a puller needs it.

    ``blocks[g][p]`` is the slot of block position ``p`` in layer group ``g`` (-1: released
    by a window), the same positions as ``block_table``; a hybrid's live state, the state
    after its committed tokens, is slot ``state_slot`` of each of ``state_regions``;
    ``token_ids`` are its committed tokens, whose KV the blocks hold; ``scope`` is the digest
    of its LoRA and cache salt; ``layout`` the facts a puller's layout must equal;
    ``notify`` the message a finished pull sends so that the sidecar unpins the blocks
    before ``deadline`` (Unix seconds).
    """

    agent: str
    generation: str
    request_id: str
    token_ids: list[int]
    scope: str
    layout: dict[str, Any]
    blocks: list[list[int]]
    regions: list[TransferRegion]
    deadline: float
    notify: str
    state_slot: int = -1
    """A hybrid's live state slot (the same id in every state group; -1: no state layers)."""
    state_regions: list[TransferRegion] = Field(default_factory=list)
    """The state groups' slots, one region per group (``pool`` is the group)."""


class TransferAgent(_Frozen):
    """A sidecar's transfer agent: its name and NIXL metadata (base64), which a peer loads
    to read from it (``GET /v1/transfer/agent``, behind the token)."""

    name: str
    generation: str
    backend: str
    metadata: str


class HandOffRequest(_Frozen):
    """``POST /v1/transfer/hand_off``: pin ``request_id`` for a pull for ``deadline_s``."""

    request_id: RequestId
    deadline_s: Deadline = 30.0


class PullRequest(_Frozen):
    """``POST /v1/transfer/pull``: start ``request_id`` here with the KV of ``peer``'s
    request ``peer_request_id`` (a peer of the operator's ``--peer`` list)."""

    request_id: RequestId
    peer: PeerName
    peer_request_id: RequestId
    lookahead: NonNegCount = 0
    lora_id: LoraId | None = None
    cache_salt: StrictStr | None = None
    deadline_s: Deadline = 30.0


class FetchRequest(_Frozen):
    """``POST /v1/transfer/fetch``: allocate ``request_id`` (``num_tokens`` tokens, prompt
    ``token_ids``) with the longest prefix of it that ``peer`` caches pulled in first."""

    request_id: RequestId
    peer: PeerName
    num_tokens: PositiveCount
    token_ids: list[TokenId]
    lookahead: NonNegCount = 0
    lora_id: LoraId | None = None
    cache_salt: StrictStr | None = None
    deadline_s: Deadline = 30.0


class PrefixRequest(_Frozen):
    """``POST /v1/transfer/prefix`` (peer to peer): pin the longest cached prefix of
    ``token_ids`` in the scope of ``lora_id`` and ``cache_salt`` and export it."""

    token_ids: list[TokenId]
    lora_id: LoraId | None = None
    cache_salt: StrictStr | None = None
    deadline_s: Deadline = 30.0


class ExportRequest(_Frozen):
    """``POST /v1/transfer/export`` (peer to peer): the export of a handed-off request, if
    its scope is ``scope``."""

    request_id: RequestId
    scope: Annotated[str, Field(max_length=64)]


class PullState(_Frozen):
    """Where a pulled request stands: ``pulling`` (not runnable yet), ``ready`` (its KV is
    here and committed), ``failed`` (``error`` says why; its blocks are back in the pool and
    its id is free) or ``unknown`` (no pull of that id)."""

    request_id: str
    state: Literal["pulling", "ready", "failed", "unknown"]
    blocks: int = 0
    bytes: int = 0
    handle: int = 0
    """Once ``ready``: the request's handle (for the columnar step); 0 before."""
    num_committed: int = 0
    """Once ``ready``: its committed tokens (the pulled ones and its hit)."""
    error: dict[str, Any] | None = None


class PullStates(_Frozen):
    states: list[PullState]


class TransferStatusRequest(_Frozen):
    request_ids: Annotated[list[RequestId], Field(max_length=4096)]

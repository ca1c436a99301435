"""Wire models: the one schema shared by the manager, the service and the clients.

Specs are validated here so that a bad spec is refused with a message naming the layer and the
rule before any memory is touched. Custom rules raise ``PydanticCustomError`` with a stable
``type`` (e.g. ``nvfp4_head_dim``) that callers can match on.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, Strict, model_validator
from pydantic_core import PydanticCustomError

from .state import SharedStateBuffer, StateGroupEstimate, StateLayerSpec

DType = Literal["fp32", "fp16", "bf16", "fp8_e4m3", "fp8_e5m2", "nvfp4"]
StandardRole = Literal["key", "value", "key_scale", "value_scale"]
#: The four standard roles. A layer may add extra roles (``LayerSpec.extra_buffers``), so a
#: role in general is a ``str``: a standard role, an extra buffer's role, or ``<extra>_scale``.
ROLES: tuple[StandardRole, ...] = ("key", "value", "key_scale", "value_scale")
Role = str
#: What an extra buffer's role looks like: a lowercase identifier.
ROLE_NAME = re.compile(r"[a-z][a-z0-9_]{0,63}")

#: Storage bits per element. nvfp4 packs two values per byte; its scales are fp8 (see below).
DTYPE_BITS: dict[str, int] = {
    "fp32": 32,
    "fp16": 16,
    "bf16": 16,
    "fp8_e4m3": 8,
    "fp8_e5m2": 8,
    "nvfp4": 4,
}
#: nvfp4 stores one fp8 scale per this many values.
NVFP4_GROUP = 16

PosInt = Annotated[int, Field(gt=0)]
NonNegInt = Annotated[int, Field(ge=0)]
#: Counts in ops: strict, so 2.0 and true are refused on the wire as they are in process.
#: Ranges are the manager's to check, so both paths raise the same error.
Count = Annotated[int, Strict()]


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


@dataclass(frozen=True, slots=True)
class RoleBuffer:
    """What one role of a layer stores per token, and which pools it may join.

    ``kind`` "scale" is an nvfp4 scale buffer: one fp8 scale per 16 values of the data role it
    belongs to (its ``dtype`` is that role's, nvfp4). ``kv_factor`` is the page width of the
    pools the buffer may join: the layer's for key, value and their scales, 1 for extra
    buffers, which are key-only pages (one entry per token).
    """

    role: Role
    kind: Literal["data", "scale"]
    kv_factor: int
    num_heads: int
    head_dim: int
    dtype: DType

    @property
    def bytes_per_token(self) -> int:
        """heads x head_dim x dtype bytes; a scale buffer is heads x head_dim / 16 bytes."""
        values = self.num_heads * self.head_dim
        if self.kind == "scale":
            return values // NVFP4_GROUP
        return values * DTYPE_BITS[self.dtype] // 8


class ExtraBuffer(_Frozen):
    """A per-token buffer of a layer beside its key and value, e.g. the key of DeepSeek-V3.2's
    lightning indexer (1 head x 128 dims): a key-only page (one entry per token) in the
    layer's blocks, so it is allocated, released and reused with them.

    ``role`` names it in views, page indices, pointer tables and shared descriptors. The rules
    that involve the layer (name, uniqueness, nvfp4 shape) are checked by ``LayerSpec``, so
    that the error names the layer. An nvfp4 extra buffer gets a ``<role>_scale`` buffer, as
    the key does.
    """

    role: str
    num_heads: PosInt
    head_dim: PosInt
    dtype: DType = "bf16"


def _nvfp4_rules(lid: int, what: str, heads: int, head_dim: int) -> None:
    if head_dim % 2:
        raise PydanticCustomError(
            "nvfp4_head_dim",
            "layer {layer_id}: nvfp4 needs an even head_dim (two values per byte), "
            "got {head_dim}{what}",
            {"layer_id": lid, "head_dim": head_dim, "what": what},
        )
    if (heads * head_dim) % NVFP4_GROUP:
        raise PydanticCustomError(
            "nvfp4_group",
            "layer {layer_id}: nvfp4 needs heads x head_dim divisible by 16 "
            "(one scale per 16 values), got {n}{what}",
            {"layer_id": lid, "n": heads * head_dim, "what": what},
        )


class LayerSpec(_Frozen):
    """One attention layer on this rank (ids are rank-local; heads already divided by TP).

    ``num_kv_heads`` 0 is a layer without KV cache (attention-free, e.g. in some hybrid
    configs): the layout drops it and ``describe().dropped_layers`` reports it, so that layer
    ids can stay the model's. ``extra_buffers`` are key-only buffers that live and die with
    the layer's blocks (see ``ExtraBuffer``).
    """

    layer_id: NonNegInt
    num_kv_heads: NonNegInt
    head_dim: PosInt
    kv_factor: Literal[1, 2] = 2
    dtype: DType = "bf16"
    sliding_window: PosInt | None = None
    sink_tokens: NonNegInt = 0
    reuse: Literal["reusable", "none"] = "reusable"
    owner: Literal["target", "draft"] = "target"
    coalescing_group: NonNegInt = 0
    extra_buffers: tuple[ExtraBuffer, ...] = ()

    @model_validator(mode="after")
    def _rules(self) -> LayerSpec:
        lid = self.layer_id
        if self.dtype == "nvfp4":
            _nvfp4_rules(lid, "", self.num_kv_heads, self.head_dim)
        if self.sink_tokens and self.sliding_window is None:
            raise PydanticCustomError(
                "sink_without_window",
                "layer {layer_id}: sink_tokens ({sink_tokens}) need a sliding_window",
                {"layer_id": lid, "sink_tokens": self.sink_tokens},
            )
        if self.extra_buffers and not self.num_kv_heads:
            raise PydanticCustomError(
                "extra_buffers_without_kv",
                "layer {layer_id}: extra buffers need KV heads (num_kv_heads=0 leaves the "
                "layer without blocks to hold them)",
                {"layer_id": lid},
            )
        seen: set[str] = set(ROLES)
        for extra in self.extra_buffers:
            role = extra.role
            if role in ROLES:
                raise PydanticCustomError(
                    "extra_role_reserved",
                    "layer {layer_id}: extra buffer role '{role}' is a standard role "
                    "(key, value, key_scale, value_scale)",
                    {"layer_id": lid, "role": role},
                )
            if not ROLE_NAME.fullmatch(role):
                raise PydanticCustomError(
                    "extra_role_name",
                    "layer {layer_id}: extra buffer role '{role}' must be a lowercase "
                    "identifier (a-z, 0-9, _; first a letter; at most 64 characters)",
                    {"layer_id": lid, "role": role},
                )
            if extra.dtype == "nvfp4":
                _nvfp4_rules(lid, f" (extra buffer '{role}')", extra.num_heads, extra.head_dim)
            names = (role, f"{role}_scale") if extra.dtype == "nvfp4" else (role,)
            for name in names:
                if name in seen:
                    raise PydanticCustomError(
                        "duplicate_extra_role",
                        "layer {layer_id}: role '{role}' appears twice (an nvfp4 extra "
                        "buffer also has a <role>_scale buffer)",
                        {"layer_id": lid, "role": name},
                    )
                seen.add(name)
        return self

    def buffers(self) -> tuple[RoleBuffer, ...]:
        """Every role's buffer in slot order: key, value, the extra buffers in the order given,
        then the nvfp4 scales of those (key_scale, value_scale, <extra>_scale). Empty for a
        layer without KV heads.
        """
        if not self.num_kv_heads:
            return ()
        kv, heads, dim, dtype = self.kv_factor, self.num_kv_heads, self.head_dim, self.dtype
        data = [RoleBuffer("key", "data", kv, heads, dim, dtype)]
        if kv == 2:
            data.append(RoleBuffer("value", "data", kv, heads, dim, dtype))
        data += [
            RoleBuffer(e.role, "data", 1, e.num_heads, e.head_dim, e.dtype)
            for e in self.extra_buffers
        ]
        scales = [
            RoleBuffer(f"{b.role}_scale", "scale", b.kv_factor, b.num_heads, b.head_dim, b.dtype)
            for b in data
            if b.dtype == "nvfp4"
        ]
        return (*data, *scales)

    def buffer(self, role: Role) -> RoleBuffer:
        """The buffer of ``role``; ``KeyError`` if the layer has none."""
        for buf in self.buffers():
            if buf.role == role:
                return buf
        raise KeyError(f"layer {self.layer_id} has no role '{role}'")

    def roles(self) -> tuple[Role, ...]:
        """Role names in slot order (see ``buffers``)."""
        return tuple(buf.role for buf in self.buffers())

    def bytes_per_token(self, role: Role) -> int:
        """heads x head_dim x dtype bytes; an nvfp4 scale role is heads x head_dim / 16 bytes.

        Example: 8 heads x 128 dims in nvfp4 is 8 * 128 / 2 = 512 bytes per token for "key" and
        8 * 128 / 16 = 64 bytes per token for "key_scale"; an fp8 extra buffer of 1 head x 128
        dims is 128 bytes per token.
        """
        return self.buffer(role).bytes_per_token


#: Most ranks one manager serves (an 8-GPU node, or 8 logical ranks per GPU in tests).
MAX_RANKS = 64


class RankSpec(_Frozen):
    """One GPU of a tensor- or pipeline-parallel engine (docs/ranks.md): its device and its
    layers, with rank-local ids and heads already divided by tensor parallelism; a pipeline
    stage lists only its own layers."""

    device: str
    layers: Annotated[list[LayerSpec], Field(min_length=1)]
    cp_rank: NonNegInt = 0
    """This rank's place among the engine's context-parallel ranks (Helix decode context
    parallelism, docs/ranks.md#context-parallelism): it holds the pages of block positions b
    with b mod ``context_parallel`` == ``cp_rank``. 0 without context parallelism."""


class ManagerConfig(_Frozen):
    """Everything the manager needs; exactly one of ``num_blocks`` and ``memory_bytes``.

    ``num_blocks`` is the number of slots of every pool group; ``memory_bytes`` is the KV budget
    that sizing splits between pool groups (docs/sizing.md). ``max_seq_len`` bounds tokens plus
    lookahead of one request and so fixes the page-table width.
    """

    layers: Annotated[list[LayerSpec], Field(min_length=1)]
    tokens_per_block: PosInt = 16
    device: str = "cpu"
    max_requests: PosInt = 256
    max_seq_len: PosInt = 8192
    num_blocks: PosInt | None = None
    memory_bytes: PosInt | None = None
    share: bool = False
    """Put the pools and page tables where another process can map them (POSIX shared memory
    on the CPU); ``pools()`` describes them and ``kvcm_client.attach`` maps them."""
    max_prefill_chunk: PosInt | None = None
    """Most new tokens one op (allocate or extend) adds: the engine's prefill chunk. None: a
    whole prompt in one op. Sizing only (docs/sizing.md): ops are not refused past it."""
    max_lookahead: NonNegInt = 0
    """Draft slots each request reserves (speculative decoding). Sizing only, like the chunk."""
    null_page: bool = False
    """Reserve slot 0 of every pool group as a zero-filled null page, and write its index (0)
    instead of -1 wherever a kernel-facing table has no page (page tables, page indices, the
    shared tables). Attention kernels that load whole tiles of pages read entries past a
    request's live pages and those of released window blocks; -1 there is an out-of-bounds
    read. ``block_table`` and slot mappings keep -1. Each pool group then has one usable slot
    fewer than it allocates: ``num_blocks`` and ``memory_bytes`` still size the memory,
    ``num_total_blocks`` and ``stats`` count usable slots (docs/index-contract.md)."""
    kv_events: bool = True
    """Record KV events (``events()``, ``GET /v1/events``). Off, publishing and evicting
    record nothing and ``events()`` raises ``kv_events_disabled`` (409): for a replica no
    router follows."""
    kv_event_buffer: PosInt = 10_000
    """Events kept for replay: a follower may ask for any sequence number of the last this
    many; one that falls further behind gets ``lost`` and resynchronises from a snapshot."""
    host_memory_bytes: PosInt | None = None
    """A host tier of about this many bytes (docs/host-tier.md): cached blocks the device
    evicts are copied there instead of dropped, and prefix hits on them are copied back. It
    is split between pool groups in proportion to their device bytes. ``suspend`` and
    ``resume`` need one."""
    state_layers: list[StateLayerSpec] = []
    """Recurrent state layers of a hybrid model (Mamba, linear attention; docs/state-layers.md):
    one state slot per request per state group, checkpoints for prefix reuse. Layer ids are
    unique across ``layers`` and ``state_layers``."""
    state_checkpoint_stride: PosInt = 1
    """A commit that leaves a request's committed length on a multiple of this many blocks
    saves a checkpoint of its state (prefix hits then land on those multiples)."""
    state_checkpoints: NonNegInt | None = None
    """Checkpoint slots per state group (evicted least recently used); None: max_requests.
    Their bytes come out of ``memory_bytes`` before the KV pools are sized."""
    state_live_slots: PosInt | None = None
    """Live state slots per state group, at most ``max_requests``; None: ``max_requests``
    (one per row, so state never limits how many requests run). Fewer: a suspended request,
    which keeps its row, holds none (its state waits on the host tier), and an allocate or
    resume that finds none free is ``OutOfBlocks`` (docs/state-layers.md)."""
    ranks: Annotated[list[RankSpec], Field(max_length=MAX_RANKS)] = []
    """The ranks of a tensor- or pipeline-parallel engine (docs/ranks.md): one allocator and
    one set of block ids for all, pools and device page tables per rank. Rank 0 is
    ``layers`` and ``device``, which default to its own when left out; empty: one rank."""
    context_parallel: Annotated[int, Field(ge=1, le=MAX_RANKS)] = 1
    """Context-parallel ranks (Helix, docs/ranks.md#context-parallelism): block position b of
    a request lives on the ranks whose ``cp_rank`` is b mod ``context_parallel``, each of
    which holds 1/``context_parallel`` of every pool group's slots. 1: every rank holds every
    block."""

    @model_validator(mode="before")
    @classmethod
    def _rank_zero(cls, data: Any) -> Any:
        """``layers`` and ``device`` default to rank 0's."""
        if isinstance(data, dict) and data.get("ranks"):
            first = data["ranks"][0]
            get = first.get if isinstance(first, dict) else lambda k: getattr(first, k, None)
            data = {"layers": get("layers"), "device": get("device"), **data}
        return data

    @model_validator(mode="after")
    def _rules(self) -> ManagerConfig:
        _unique_ids([*self.layers, *self.state_layers])
        for spec in self.ranks[1:]:
            _unique_ids(spec.layers)
        if self.ranks and (
            self.ranks[0].layers != self.layers or self.ranks[0].device != self.device
        ):
            raise PydanticCustomError(
                "rank_zero_mismatch",
                "ranks[0] must have the config's layers and device (leave those out)",
                {},
            )
        if len(self.ranks) > 1 and (self.host_memory_bytes is not None or self.state_layers):
            raise PydanticCustomError(
                "ranks_unsupported",
                "several ranks do not combine with a host tier or state layers yet",
                {},
            )
        self._context_parallel_rules()
        if self.max_lookahead >= self.max_seq_len:
            raise PydanticCustomError(
                "lookahead_too_long",
                "max_lookahead ({max_lookahead}) must be below max_seq_len ({max_seq_len})",
                {"max_lookahead": self.max_lookahead, "max_seq_len": self.max_seq_len},
            )
        for rank, layers in enumerate([self.layers, *(spec.layers for spec in self.ranks[1:])]):
            if not any(layer.num_kv_heads for layer in layers):
                raise PydanticCustomError(
                    "no_kv_layers",
                    "every layer of rank {rank} has num_kv_heads=0: no KV cache to manage",
                    {"rank": rank},
                )
        if (self.num_blocks is None) == (self.memory_bytes is None):
            raise PydanticCustomError(
                "blocks_or_memory",
                "give exactly one of num_blocks and memory_bytes",
                {},
            )
        if self.state_live_slots is not None and self.state_live_slots > self.max_requests:
            raise PydanticCustomError(
                "state_live_slots",
                "state_live_slots ({state_live_slots}) must be at most max_requests "
                "({max_requests}): a request holds at most one",
                {"state_live_slots": self.state_live_slots, "max_requests": self.max_requests},
            )
        return self

    def _context_parallel_rules(self) -> None:
        """Every CP rank present, rank 0 among CP rank 0's, slots divisible by the ranks;
        what context parallelism does not combine with yet is refused."""
        cp = self.context_parallel
        classes = [spec.cp_rank for spec in self.ranks] or [0]
        if classes[0] != 0 or set(classes) != set(range(cp)):
            raise PydanticCustomError(
                "cp_ranks_mismatch",
                "with context_parallel={cp} the ranks' cp_rank must cover 0..{last}, rank 0 "
                "having 0; they are {classes}",
                {"cp": cp, "last": cp - 1, "classes": classes},
            )
        if cp == 1:
            return
        if self.memory_bytes is not None:
            raise PydanticCustomError(
                "ranks_unsupported",
                "context parallelism does not combine with memory_bytes yet: give num_blocks",
                {},
            )
        if self.num_blocks is not None and self.num_blocks % cp:
            raise PydanticCustomError(
                "cp_num_blocks",
                "num_blocks ({num_blocks}) must be a multiple of context_parallel ({cp}): "
                "each context-parallel rank holds an equal share",
                {"num_blocks": self.num_blocks, "cp": cp},
            )

    @property
    def max_blocks_per_request(self) -> int:
        return -(-self.max_seq_len // self.tokens_per_block)

    @property
    def num_ranks(self) -> int:
        return max(len(self.ranks), 1)

    @property
    def num_state_checkpoints(self) -> int:
        """Checkpoint slots per state group."""
        return self.max_requests if self.state_checkpoints is None else self.state_checkpoints

    @property
    def num_state_live_slots(self) -> int:
        """Live state slots per state group."""
        return self.max_requests if self.state_live_slots is None else self.state_live_slots


def _unique_ids(layers: list[Any]) -> None:
    seen: set[int] = set()
    for layer in layers:
        if layer.layer_id in seen:
            raise PydanticCustomError(
                "duplicate_layer_id",
                "layer {layer_id}: layer ids must be unique",
                {"layer_id": layer.layer_id},
            )
        seen.add(layer.layer_id)


# --- requests ---------------------------------------------------------------------------------


class RequestInfo(_Frozen):
    """A request after an op: its page-table row, length and reserved capacity in tokens."""

    request_id: str
    row: int
    num_tokens: int
    capacity: int
    num_committed: int = 0
    num_hit_tokens: int = 0
    handle: int = 0
    """The request's integer handle for ``step_columns`` (its row in the low 32 bits, an
    allocation count above them, so a handle kept past a free never names the row's next
    request); 0 where no handle applies."""
    state_slot: int = -1
    """Its live state slot, the same in every state group (docs/state-layers.md): the index
    of ``state_view`` that ``state_indices`` gives; -1 without state layers, and while it is
    suspended."""


class MultimodalInput(_Frozen):
    """A multimodal item at prompt positions [start, start + length); ``digest`` names its
    content (e.g. a hash of the image), so equal tokens with other images do not share KV."""

    digest: str
    start: Count
    length: Count


class AllocateOp(_Frozen):
    op: Literal["allocate"] = "allocate"
    request_id: str
    num_tokens: Count
    token_ids: list[Count] | None = None
    lookahead: Count = 0
    lora_id: Annotated[int, Strict()] | Annotated[str, Strict()] | None = None
    cache_salt: Annotated[str, Strict()] | None = None
    multimodal: list[MultimodalInput] | None = None
    block_keys: list[str] | None = None


class ExtendOp(_Frozen):
    op: Literal["extend"] = "extend"
    request_id: str
    num_new_tokens: Count
    lookahead: Count = 0


class RewindOp(_Frozen):
    op: Literal["rewind"] = "rewind"
    request_id: str
    num_tokens: Count


class CommitOp(_Frozen):
    op: Literal["commit"] = "commit"
    request_id: str
    token_ids: list[Count]


class FreeOp(_Frozen):
    op: Literal["free"] = "free"
    request_id: str


class SuspendOp(_Frozen):
    """Move the request's blocks to the host tier (docs/host-tier.md)."""

    op: Literal["suspend"] = "suspend"
    request_id: str


class ResumeOp(_Frozen):
    """Bring a suspended request's blocks back into new device slots."""

    op: Literal["resume"] = "resume"
    request_id: str


Op = Annotated[
    AllocateOp | ExtendOp | RewindOp | CommitOp | FreeOp | SuspendOp | ResumeOp,
    Field(discriminator="op"),
]


class ErrorInfo(_Frozen):
    code: str
    message: str
    detail: dict[str, object] = {}


class OpResult(_Frozen):
    """One result per op of a step: ``request`` on success (None after a free), else ``error``."""

    ok: bool
    request: RequestInfo | None = None
    error: ErrorInfo | None = None


# --- layout -----------------------------------------------------------------------------------


class BufferInfo(_Frozen):
    """Where one (layer, role) lives: its pool, byte offset inside a slot, and addresses."""

    layer_id: int
    role: Role
    layer_group: int
    pool: int
    offset_bytes: int
    bytes_per_block: int
    page_stride_bytes: int
    base_address: int
    shape: tuple[int, ...]
    dtype: str


class PoolInfo(_Frozen):
    pool_id: int
    pool_group: int
    kind: Literal["data", "scale"]
    kv_factor: int
    num_buffers: int
    bytes_per_buffer: int
    slot_bytes: int
    num_slots: int
    nbytes: int
    base_address: int


class LayerGroupInfo(_Frozen):
    group_id: int
    pool_group: int
    layer_ids: tuple[int, ...]
    sliding_window: int | None
    sink_blocks: int
    owner: str
    reuse: str
    bytes_per_token: int


class PoolGroupInfo(_Frozen):
    pool_group_id: int
    layer_groups: tuple[int, ...]
    pools: tuple[int, ...]
    num_slots: int
    slot_bytes: int


class DroppedLayer(_Frozen):
    """A layer of the config that has no place in the layout; ``reason`` is a stable code
    (``no_kv_heads``: num_kv_heads is 0, an attention-free layer)."""

    layer_id: int
    reason: str


class Layout(_Frozen):
    """What ``describe()`` reports. ``roles`` is the role index order of the pointer tables
    (``layer_pool_map``, ``layer_pointer_table``): ``ROLES``, then the sorted distinct extra
    roles of the layout's layers. ``num_slots`` and ``nbytes`` count allocated slots, the null
    page's included; ``null_page``: slot 0 is the null page, 0 in a table is no page."""

    tokens_per_block: int
    device: str
    max_requests: int
    max_blocks_per_request: int
    roles: tuple[str, ...]
    layer_groups: tuple[LayerGroupInfo, ...]
    pool_groups: tuple[PoolGroupInfo, ...]
    pools: tuple[PoolInfo, ...]
    buffers: tuple[BufferInfo, ...]
    dropped_layers: tuple[DroppedLayer, ...] = ()
    null_page: bool = False


# --- sizing -----------------------------------------------------------------------------------


class LayerGroupEstimate(_Frozen):
    group_id: int
    bytes_per_token: int
    blocks_per_request: int
    fixed_blocks: int | None
    """Peak blocks of a sliding-window group however long the request grows; None if full."""


class PoolGroupEstimate(_Frozen):
    pool_group_id: int
    num_slots: int
    slot_bytes: int
    blocks_per_request: int
    max_requests: int
    required_blocks: int | None = None
    host_slots: int = 0
    """Slots of the host tier (docs/host-tier.md); 0 without one."""
    host_requests: int = 0
    """Requests of ``seq_len`` the host tier holds at once (suspended): host_slots //
    blocks_per_request."""


class Estimate(_Frozen):
    """Capacity at ``seq_len`` for requests that grow by ops of at most ``prefill_chunk`` new
    tokens (None: a whole prompt in one op), each reserving ``lookahead`` draft slots
    (docs/sizing.md)."""

    seq_len: int
    prefill_chunk: int | None = None
    lookahead: int = 0
    bytes_per_token: dict[int, int]
    fixed_bytes_per_request: int
    max_tokens: int
    max_requests: int
    limited_by: Literal["memory", "max_requests", "state_slots"]
    layer_groups: tuple[LayerGroupEstimate, ...]
    pool_groups: tuple[PoolGroupEstimate, ...]
    num_requests: int | None = None
    fits: bool | None = None
    host_max_requests: int | None = None
    """With a host tier: requests of ``seq_len`` it can hold suspended at once besides the
    ``max_requests`` on the device (the least over pool groups); None without one."""
    state_groups: tuple[StateGroupEstimate, ...] = ()
    """State layers' groups (docs/state-layers.md); their bytes are ``state_bytes``."""
    state_bytes: int = 0
    """Device bytes of every state group's live and checkpoint slots, out of ``memory_bytes``
    before the KV pools are sized."""


class PrefixCacheStats(_Frozen):
    """Prefix reuse since start: allocations with token ids are the queries (probes are not).

    ``hit_rate`` is hit_tokens / query_tokens; ``cached_blocks`` counts the blocks that a hit
    could reuse now (in use or free), per pool group.
    """

    queries: int
    query_tokens: int
    hit_tokens: int
    hit_rate: float
    stored_blocks: int
    evictions: int
    cached_blocks: dict[int, int]


class HostTierStats(_Frozen):
    """The host tier's counters since start, and its slots per pool group."""

    offloaded_blocks: int
    offloaded_bytes: int
    onboarded_blocks: int
    onboarded_bytes: int
    dropped_blocks: int
    """Host blocks dropped to make room (its own LRU)."""
    copy_launches: int = 0
    """Batches of copies launched (one per step unless two copies of a step share a slot)."""
    copy_hazard_launches: int = 0
    """Of those, batches launched early because two copies of a step shared a slot."""
    copy_seconds: float = 0.0
    """Time ops spent launching the tier's copies and waiting for them."""
    host_slots: dict[int, int]
    host_used: dict[int, int]
    offloaded_states: int = 0
    """Suspended requests' live states copied to the host (docs/state-layers.md)."""
    onboarded_states: int = 0
    """Live states copied back by resumes."""
    state_host_slots: dict[int, int] = {}
    """Host slots for suspended requests' states, per state group."""
    state_host_used: dict[int, int] = {}
    """Of those, the ones holding a suspended request's state."""


class Stats(_Frozen):
    """Slot counts per pool group (usable slots: the null page's slot 0 is not one), and what
    one new request can get in every layer group (``request_free_blocks``:
    ``num_free_blocks()``; ``request_total_blocks``: the same on an empty manager)."""

    num_requests: int
    free_blocks: dict[int, int]
    used_blocks: dict[int, int]
    total_blocks: dict[int, int]
    request_free_blocks: int
    request_total_blocks: int
    prefix_cache: PrefixCacheStats | None = None
    host_tier: HostTierStats | None = None
    """None without a host tier (docs/host-tier.md)."""


class KVEvent(_Frozen):
    """One change of the prefix cache. ``block_stored``: ``block_keys`` (hex) of one layer
    group, their ``parent_key`` (None for a first block), their ``token_ids`` (None for salted
    blocks: a salted tenant's prompt never leaves in events), the LoRA id and whether a cache
    salt was used; ``block_removed``: keys evicted or taken out;
    ``all_blocks_cleared``: everything forgotten."""

    seq: int
    kind: Literal["block_stored", "block_removed", "all_blocks_cleared"]
    layer_group: int | None = None
    block_keys: list[str] = []
    parent_key: str | None = None
    token_ids: list[int] | None = None
    lora_id: int | str | None = None
    has_salt: bool | None = None
    tier: Literal["device", "host"] = "device"
    """Where the blocks are stored or removed: the device pools or the host tier (whose
    events carry keys only)."""


class KVEvents(_Frozen):
    """Events after the asked sequence number; ``lost``: some were already dropped from the
    bounded log (the reader fell behind and should resynchronise from ``index_snapshot``).

    ``generation`` is the manager's epoch: it changes at every start and registration, and
    sequence numbers start again at 1 in a new one, so a follower that sees another
    generation than its index was built from drops that index and resynchronises.
    """

    events: list[KVEvent]
    last_seq: int
    lost: bool
    generation: str = ""


class SnapshotGroup(_Frozen):
    """The block keys (hex) of one layer group cached in one tier."""

    layer_group: int
    tier: Literal["device", "host"]
    block_keys: list[str]


class IndexSnapshot(_Frozen):
    """What a manager caches now, consistent with its events up to ``last_seq``: a follower
    that loads it and then applies the events after ``last_seq`` has the manager's index
    (docs/prefix-reuse.md#following-the-index)."""

    generation: str
    last_seq: int
    groups: list[SnapshotGroup]


class ProbeRequest(_Frozen):
    token_ids: list[Count]
    lora_id: Annotated[int, Strict()] | Annotated[str, Strict()] | None = None
    cache_salt: Annotated[str, Strict()] | None = None
    multimodal: list[MultimodalInput] | None = None
    block_keys: list[str] | None = None


class ProbeResult(_Frozen):
    num_hit_tokens: int


class ProbeTiersRequest(_Frozen):
    token_ids: list[Count]
    lora_id: Annotated[int, Strict()] | Annotated[str, Strict()] | None = None
    cache_salt: Annotated[str, Strict()] | None = None


class ProbeTiersResult(_Frozen):
    """Tokens a new request would reuse from the device now, and how many more it would
    onboard from the host tier (docs/host-tier.md)."""

    device_tokens: int
    host_tokens: int


class RequestRef(_Frozen):
    """A request by id (``/v1/suspend``, ``/v1/resume``)."""

    request_id: str


# --- service wire bodies ----------------------------------------------------------------------
# Bodies of the HTTP routes that are not an op model themselves. Ops (AllocateOp, ...) are the
# bodies of their own routes, so the in-process ``step`` and the wire share one schema.


class StepRequest(_Frozen):
    """``atomic``: all or nothing. ``brief``: successful extends answer without ``request``."""

    ops: list[Op]
    atomic: Annotated[bool, Strict()] = False
    brief: Annotated[bool, Strict()] = False


class StepResponse(_Frozen):
    results: list[OpResult]


Handle = Annotated[int, Strict()]


class StepColumnsRequest(_Frozen):
    """A columnar step (docs/requests.md#the-columnar-step): requests by handle, sections
    run commit, free, rewind, suspend, resume, extend, allocate; counts are one int or one
    per handle."""

    free: list[Handle] = []
    rewind: list[Handle] = []
    rewind_tokens: Count | list[Count] = 1
    commit: list[Handle] = []
    commit_tokens: list[list[Count]] = []
    extend: list[Handle] = []
    num_new_tokens: Count | list[Count] = 1
    lookahead: Count | list[Count] = 0
    allocate: list[AllocateOp] = []
    suspend: list[Handle] = []
    resume: list[Handle] = []
    atomic: Annotated[bool, Strict()] = False


class ItemErrorInfo(_Frozen):
    """The error of one item of a columnar step: its section and index in that section."""

    section: str
    index: int
    code: str
    message: str
    detail: dict[str, object] = {}


class StepColumnsResponse(_Frozen):
    """Per section a status per item (0 ok, else the index of its error code in
    ``kvcm_client.errors.STATUS_CODES``); ``new_blocks`` per extend, ``handles``,
    ``hit_tokens`` and ``allocate_new_blocks`` per allocate (0 where it failed); ``failed``:
    the item that stopped the step, if one did."""

    status: dict[str, list[int]]
    new_blocks: list[int]
    handles: list[int]
    hit_tokens: list[int]
    allocate_new_blocks: list[int]
    errors: list[ItemErrorInfo] = []
    failed: tuple[str, int] | None = None


class ExtendManyRequest(_Frozen):
    request_ids: list[str]
    num_new_tokens: Count | list[Count] = 1
    lookahead: Count | list[Count] = 0


class CommitManyRequest(_Frozen):
    """``commit_many``: ``token_ids[i]`` are committed to ``request_ids[i]``."""

    request_ids: list[str]
    token_ids: list[list[Count]]


class PageIndicesRequest(_Frozen):
    request_ids: list[str]
    layer_id: Count
    role: Role = "key"
    mode: Literal["slot", "kernel"] = "slot"
    per_layer: bool = False


class SlotMappingRequest(_Frozen):
    """``layer_id`` None maps every layer group (``slot_mappings``)."""

    request_ids: list[str]
    layer_id: Count | None = None
    num_tokens: Count | list[Count] | None = None
    pad_to: Count | None = None


class IndexRows(_Frozen):
    """A small int table sent as rows (page indices, block tables, slot mappings per group)."""

    rows: list[list[int]]


class IndexRow(_Frozen):
    row: list[int]


class RequestIds(_Frozen):
    request_ids: list[str]


class SessionRequest(_Frozen):
    ttl_s: Annotated[float, Strict(), Field(gt=0, le=86_400)] | None = None
    """Seconds; strict, so ``true`` is refused (``1`` is taken as 1.0, as JSON has one number
    type)."""


class SessionInfo(_Frozen):
    """A lease: requests allocated under it are freed when it is not renewed within ttl_s."""

    session_id: str
    ttl_s: float
    expires_in_s: float
    num_requests: int


class Health(_Frozen):
    """``/livez`` and ``/readyz``: ``no_model`` until a model is registered (``/readyz``)."""

    status: Literal["ok", "not_ready", "no_model"]
    detail: str = ""


class SessionClosed(_Frozen):
    session_id: str
    freed_requests: int


class EmptyBody(_Frozen):
    """The body of routes that take no arguments (``{}``)."""


# --- registering a model at run time (POST /v1/model) --------------------------------------------

StrictPosInt = Annotated[int, Strict(), Field(gt=0)]
StrictBool = Annotated[bool, Strict()]


class ModelRegistration(_Frozen):
    """A model for a running service or manager: its layers, and how to size them.

    Exactly one source: ``layers`` (this rank's layer specs) or ``hf_config`` (a Hugging Face
    ``config.json`` as an object; ``kv_dtype`` and ``tensor_parallel`` apply to it as to
    ``kvcm serve --model-config``, and its ``max_position_embeddings`` is ``max_seq_len``
    unless one is given). At most one budget: ``memory_bytes`` or ``num_blocks``. Fields left
    out take the service's flags (the manager's device, share and budget in process), then the
    defaults of ``kvcm serve`` (16 tokens per block, 256 requests, 4096 tokens, the null page
    on, 1 GiB). The device is always the service's own (docs/service.md#registering-a-model).
    """

    layers: Annotated[list[LayerSpec], Field(min_length=1)] | None = None
    hf_config: dict[str, Any] | None = None
    kv_dtype: DType | None = None
    """The dtype of every layer's KV (of ``layers`` too)."""
    tensor_parallel: StrictPosInt | None = None
    """Ranks an ``hf_config``'s KV heads are split over (``layers`` are per rank already)."""
    memory_bytes: StrictPosInt | None = None
    num_blocks: StrictPosInt | None = None
    tokens_per_block: StrictPosInt | None = None
    max_seq_len: StrictPosInt | None = None
    max_requests: StrictPosInt | None = None
    max_prefill_chunk: StrictPosInt | None = None
    max_lookahead: Annotated[int, Strict(), Field(ge=0)] | None = None
    null_page: StrictBool | None = None
    share: StrictBool | None = None
    kv_events: StrictBool | None = None
    """Record KV events (``ManagerConfig.kv_events``); None: as the service (on by default)."""
    host_memory_bytes: StrictPosInt | None = None
    """A host tier of this many bytes (``ManagerConfig.host_memory_bytes``); None: as the
    service (``kvcm serve --host-memory``; none by default)."""
    state_layers: list[StateLayerSpec] | None = None
    """With ``layers``: the model's recurrent state layers (``ManagerConfig.state_layers``)."""
    state_checkpoint_stride: StrictPosInt | None = None
    state_checkpoints: Annotated[int, Strict(), Field(ge=0)] | None = None
    state_live_slots: StrictPosInt | None = None

    @model_validator(mode="after")
    def _rules(self) -> ModelRegistration:
        if (self.layers is None) == (self.hf_config is None):
            raise PydanticCustomError(
                "one_model_source", "give exactly one of layers and hf_config", {}
            )
        if self.memory_bytes is not None and self.num_blocks is not None:
            raise PydanticCustomError(
                "blocks_or_memory", "give at most one of num_blocks and memory_bytes", {}
            )
        if self.layers is not None and self.tensor_parallel is not None:
            raise PydanticCustomError(
                "tensor_parallel_with_layers",
                "tensor_parallel splits an hf_config's KV heads; layers are per rank already",
                {},
            )
        return self


class ModelInfo(_Frozen):
    """The model a service or manager serves (``GET /v1/model``, ``register_model``): the
    config in effect (every default resolved), the layout ``describe()`` gives, the capacity
    at the longest request (``estimate(max_seq_len - max_lookahead)``) and the generation,
    which changes with every registration."""

    generation: str
    config: ManagerConfig
    layout: Layout
    estimate: Estimate


# --- shared memory (the inference server's view of the pools) ----------------------------------


class SharedSegment(_Frozen):
    """One mappable allocation: a POSIX shared-memory segment (``name``) on the CPU, or a
    CUDA allocation (``handle``: its base64 CUDA IPC handle, on the GPU ``device_uuid``)."""

    kind: Literal["shm", "cuda_ipc"]
    name: str | None = None
    handle: str | None = None
    device_uuid: str | None = None
    nbytes: int


class SharedBuffer(_Frozen):
    """Where (layer, role) lives in its pool's segment: a strided view in ``dtype`` elements,
    ``[num_slots, tokens_per_block, ...]``, the page of slot s at ``view[s]``."""

    layer_id: int
    role: Role
    layer_group: int
    pool: int
    dtype: str
    shape: tuple[int, ...]
    strides: tuple[int, ...]
    offset: int


class SharedLayout(_Frozen):
    """Everything a consumer needs to map the pools and page tables without copying.

    ``generation`` changes at every start of the service: descriptors of an earlier start
    describe memory that no longer exists, and ``attach`` refuses them.
    """

    generation: str
    device: str
    tokens_per_block: int
    layers: list[LayerSpec]
    layer_group_of: dict[int, int]
    pools: list[SharedSegment]
    buffers: list[SharedBuffer]
    page_tables: SharedSegment
    page_table_shape: tuple[int, int, int]
    null_page: bool = False
    """Where a page table has no page it holds 0 (the zeroed null page), not -1."""
    state_layers: list[StateLayerSpec] = []
    state_pools: list[SharedSegment] = []
    """One segment per state group (docs/state-layers.md)."""
    state_buffers: list[SharedStateBuffer] = []
    rank: int = 0
    """The rank of a tensor- or pipeline-parallel engine these are (docs/ranks.md)."""
    context_parallel: int = 1
    cp_rank: int = 0
    """With context parallelism (docs/ranks.md#context-parallelism) the page tables are this
    rank's own: entry j of a row is global block j * context_parallel + cp_rank, and the
    pools hold this rank's share of the slots."""


class ConsumerRequest(_Frozen):
    pid: Annotated[int, Strict(), Field(gt=0, le=2**31 - 1)]
    """A process id (pid_t is a 32-bit int)."""
    generation: str


class ConsumerInfo(_Frozen):
    consumer_id: str
    pid: int
    generation: str


class Consumers(_Frozen):
    consumers: list[ConsumerInfo]

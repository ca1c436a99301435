"""Specs and the manager's config: layers, ranks, ``ManagerConfig`` (``kvcm_client.models``).

Specs are validated here so that a bad spec is refused with a message naming the layer and the
rule before any memory is touched. Custom rules raise ``PydanticCustomError`` with a stable
``type`` (e.g. ``nvfp4_head_dim``) that callers can match on.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, GetJsonSchemaHandler, Strict, model_validator
from pydantic.json_schema import JsonSchemaValue
from pydantic_core import CoreSchema, PydanticCustomError

from .state import StateLayerSpec

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

# --- limits the manager enforces, published by the wire models' JSON schema -------------------
# The service imports these (the client never imports the service), so the document and the
# checks read one number.

#: Longest request id in characters: ids are echoed in results and kept per request
#: (``kvcm.allocation`` checks it; the C core has its own copy in allocate.c).
MAX_REQUEST_ID = 256
#: Largest count (tokens, positions, lookahead) any op takes. Counts are bounded before any
#: arithmetic, so that no int64 sum of a few of them can wrap (2**63 - 1 + 2 would).
MAX_COUNT = 2**31 - 1
#: Largest token id: ids are kept and hashed as int32 (``kvcm.hashing.token_bytes``).
MAX_TOKEN_ID = 2**31 - 1
#: int64's range: request handles, int LoRA ids, KV event sequence numbers.
INT64_MIN = -(2**63)
INT64_MAX = 2**63 - 1
#: Most ops in one step, and most of them that are not extends (``KVCacheManager.step``):
#: bounds the work (and the event-loop time) of one service call to tens of ms
#: (bench/loop_latency.py). Extends run batched at well under a microsecond each;
#: allocates, frees, commits and rewinds cost about 10 us each. A scheduler step has an
#: extend per running request and a few of the others.
MAX_STEP_OPS = 8192
MAX_STEP_OTHER_OPS = 1024
#: Bytes of a block key (SHA-256); on the wire a key is its hex (``kvcm.hashing.KEY_BYTES``).
BLOCK_KEY_BYTES = 32


class Documented:
    """JSON-schema keywords (``minimum``, ``maxLength``, ``required``, ``description``, ...)
    that a field's schema publishes while pydantic does not check them.

    Ranges of ops are the manager's to check, so that a call in process, over HTTP and over
    the step channel is refused with the same error (``invalid_argument`` naming the
    argument, never a pydantic message); the OpenAPI document must still state them, or a
    request the document calls valid gets a 422. ``Annotated[int, Strict(),
    Documented({"minimum": 1})]`` is such a field: strict on type, documented on range.
    """

    __slots__ = ("keywords",)

    def __init__(self, keywords: dict[str, Any]) -> None:
        self.keywords = keywords

    def __repr__(self) -> str:
        return f"Documented({self.keywords!r})"

    def __get_pydantic_json_schema__(
        self, core_schema: CoreSchema, handler: GetJsonSchemaHandler
    ) -> JsonSchemaValue:
        schema = dict(handler(core_schema))
        schema.update(self.keywords)
        return schema


#: Counts in ops: strict, so 2.0 and true are refused on the wire as they are in process.
#: Ranges are the manager's to check, so both paths raise the same error.
Count = Annotated[int, Strict()]
#: A count of at least 1 (tokens an op adds or removes), as the manager checks it.
PositiveCount = Annotated[int, Strict(), Documented({"minimum": 1, "maximum": MAX_COUNT})]
#: A count of at least 0 (lookahead, tokens of a slot mapping), as the manager checks it.
NonNegCount = Annotated[int, Strict(), Documented({"minimum": 0, "maximum": MAX_COUNT})]
#: A token id (int32, not negative), as the manager checks it.
TokenId = Annotated[int, Strict(), Documented({"minimum": 0, "maximum": MAX_TOKEN_ID})]
#: A str that stays one: msgpack binary (the step channel) and bytes in process are refused,
#: not decoded (pydantic's lax mode would turn b"a" into "a").
StrictStr = Annotated[str, Strict()]
#: A request id: a str (strict, see ``StrictStr``) of 1 to ``MAX_REQUEST_ID`` characters. An
#: allocate refuses other ids (``invalid_argument``); other ops answer ``unknown_request``.
RequestId = Annotated[str, Strict(), Documented({"minLength": 1, "maxLength": MAX_REQUEST_ID})]


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
    transfer: Literal["nixl"] | None = None
    """Register the pools, the host tier and the state slots with a transfer engine so that
    other sidecars can pull this one's blocks and it can pull theirs (``"nixl"``: NIXL over
    UCX, ``pip install 'kvcm[transfer]'``; docs/disaggregation.md). None: no endpoint."""
    transfer_name: Annotated[str, Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")] = "kvcm"
    """This sidecar's name among its peers; its transfer agent is named after it and the
    generation (``<name>-<generation>``), so a restarted sidecar is a new agent."""

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

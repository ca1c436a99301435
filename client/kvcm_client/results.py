"""What the manager answers (``kvcm_client.models``): requests and op results, the layout, sizing
estimates, stats, KV events and probes."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, Strict

from .specs import (
    BLOCK_KEY_BYTES,
    INT64_MAX,
    INT64_MIN,
    MAX_TOKEN_ID,
    Documented,
    NonNegCount,
    PositiveCount,
    RequestId,
    Role,
    StrictStr,
    TokenId,
    _Frozen,
)
from .state import StateGroupEstimate

# --- requests ---------------------------------------------------------------------------------


class RequestInfo(_Frozen):
    """A request after an op: its page-table row, length and reserved capacity in tokens."""

    request_id: RequestId
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

    digest: StrictStr
    start: Annotated[int, Strict(), Documented({"minimum": 0})]
    length: Annotated[int, Strict(), Documented({"minimum": 1})]


#: A LoRA adapter's id: an int64 or a str (both strict: true, 2.0 and bytes are refused).
LoraId = (
    Annotated[int, Strict(), Documented({"minimum": INT64_MIN, "maximum": INT64_MAX})] | StrictStr
)
#: A block key on the wire: its bytes in hex (``kvcm.block_keys``). In process the manager
#: also takes the raw bytes (``KVCacheManager.allocate``), the op models only the hex.
BlockKey = Annotated[
    str, Strict(), Documented({"pattern": f"^[0-9a-fA-F]{{{2 * BLOCK_KEY_BYTES}}}$"})
]
#: What the document says of a prompt's token ids beyond their range.
_PROMPT_IDS = (
    f"token ids in [0, {MAX_TOKEN_ID}]; at most the model's max_seq_len of them "
    "(GET /v1/model: config.max_seq_len), else sequence_too_long"
)
_BLOCK_KEYS = (
    f"The prompt's block keys (kvcm.block_keys: {BLOCK_KEY_BYTES} bytes each, in hex), one per "
    "full block of token_ids: len(token_ids) // tokens_per_block of the model's; saves hashing"
)
_MAX_SEQ_LEN = "the model's max_seq_len (GET /v1/model: config.max_seq_len), else sequence_too_long"


class AllocateOp(_Frozen):
    op: Literal["allocate"] = "allocate"
    request_id: RequestId
    num_tokens: PositiveCount = Field(
        description=f"The request's tokens; with lookahead at most {_MAX_SEQ_LEN}"
    )
    token_ids: list[TokenId] | None = Field(
        None, description=f"The prompt, exactly num_tokens ids: {_PROMPT_IDS}"
    )
    lookahead: NonNegCount = Field(0, description="Draft slots reserved past the tokens")
    lora_id: LoraId | None = None
    cache_salt: StrictStr | None = None
    multimodal: list[MultimodalInput] | None = None
    block_keys: list[BlockKey] | None = Field(None, description=_BLOCK_KEYS)
    max_new_tokens: PositiveCount | None = Field(
        None,
        description=(
            "Size the request by its hit: token_ids are the whole sequence, and it gets the "
            "tokens it reuses plus at most this many (min(num_tokens, hit + max_new_tokens)), "
            "no probe needed; needs token_ids, not block_keys"
        ),
    )


class ExtendOp(_Frozen):
    op: Literal["extend"] = "extend"
    request_id: RequestId
    num_new_tokens: PositiveCount = Field(
        description="Tokens added; the request's tokens, these and lookahead at most "
        + _MAX_SEQ_LEN
    )
    lookahead: NonNegCount = Field(0, description="Draft slots reserved past the tokens")


class RewindOp(_Frozen):
    op: Literal["rewind"] = "rewind"
    request_id: RequestId
    num_tokens: PositiveCount = Field(
        description="Tokens dropped from the end: fewer than the request has (free drops all)"
    )


class CommitOp(_Frozen):
    op: Literal["commit"] = "commit"
    request_id: RequestId
    token_ids: list[TokenId] = Field(
        description=f"Token ids in [0, {MAX_TOKEN_ID}], at most the request's tokens not "
        "committed yet"
    )


class FreeOp(_Frozen):
    op: Literal["free"] = "free"
    request_id: RequestId


class SuspendOp(_Frozen):
    """Move the request's blocks to the host tier (docs/host-tier.md)."""

    op: Literal["suspend"] = "suspend"
    request_id: RequestId


class ResumeOp(_Frozen):
    """Bring a suspended request's blocks back into new device slots."""

    op: Literal["resume"] = "resume"
    request_id: RequestId


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
    context_parallel: int = 1
    cp_rank: int = 0
    page_table_width: int = 0
    """Entries per row of this rank's page tables: ``max_blocks_per_request``, or with
    context parallelism the rank's share of the positions and one always-empty entry
    (docs/ranks.md#context-parallelism)."""


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
    token_ids: list[TokenId] = Field(description=f"The prompt: {_PROMPT_IDS}")
    lora_id: LoraId | None = None
    cache_salt: StrictStr | None = None
    multimodal: list[MultimodalInput] | None = None
    block_keys: list[BlockKey] | None = Field(None, description=_BLOCK_KEYS)


class ProbeResult(_Frozen):
    num_hit_tokens: int


class ProbeTiersRequest(_Frozen):
    token_ids: list[TokenId] = Field(description=f"The prompt: {_PROMPT_IDS}")
    lora_id: LoraId | None = None
    cache_salt: StrictStr | None = None


class ProbeTiersResult(_Frozen):
    """Tokens a new request would reuse from the device now, and how many more it would
    onboard from the host tier (docs/host-tier.md)."""

    device_tokens: int
    host_tokens: int


class RequestRef(_Frozen):
    """A request by id (``/v1/suspend``, ``/v1/resume``)."""

    request_id: RequestId

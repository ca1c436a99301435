"""The service's request and response bodies (``kvcm_client.models``): steps, tables, sessions,
model registration, and the shared-memory descriptors a consumer maps."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, Strict, model_validator
from pydantic_core import PydanticCustomError

from .results import AllocateOp, Estimate, Layout, Op, OpResult
from .specs import (
    INT64_MAX,
    INT64_MIN,
    MAX_STEP_OPS,
    MAX_STEP_OTHER_OPS,
    Documented,
    DType,
    LayerSpec,
    ManagerConfig,
    NonNegCount,
    PositiveCount,
    RequestId,
    Role,
    StrictStr,
    TokenId,
    _Frozen,
)
from .state import SharedStateBuffer, StateLayerSpec
from .transfer import PullState

# --- service wire bodies ----------------------------------------------------------------------
# Bodies of the HTTP routes that are not an op model themselves. Ops (AllocateOp, ...) are the
# bodies of their own routes, so the in-process ``step`` and the wire share one schema.


_STEP_LIMIT = (
    f"at most {MAX_STEP_OPS} ops, at most {MAX_STEP_OTHER_OPS} of them other than extends "
    "(else invalid_argument: split the step)"
)
_ATOMIC = "All or nothing (then without suspends and resumes, which copy pages)"
#: An op of a step: its ``op`` is required there (it picks the model), while the body of an
#: op's own route may leave it out.
StepOp = Annotated[Op, Documented({"required": ["op"]})]


class StepRequest(_Frozen):
    """``atomic``: all or nothing. ``brief``: successful extends answer without ``request``."""

    ops: Annotated[list[StepOp], Documented({"maxItems": MAX_STEP_OPS})] = Field(
        description=f"The ops, run in order: {_STEP_LIMIT}"
    )
    atomic: Annotated[bool, Strict()] = Field(False, description=_ATOMIC)
    brief: Annotated[bool, Strict()] = False


class StepResponse(_Frozen):
    results: list[OpResult]


#: A request's handle (``RequestInfo.handle``): an int64; one no live request has is that
#: item's ``unknown_request``.
Handle = Annotated[int, Strict(), Documented({"minimum": INT64_MIN, "maximum": INT64_MAX})]
#: A section of extends, and one of other ops: each at most what a whole step takes.
_Extends = Annotated[list[Handle], Documented({"maxItems": MAX_STEP_OPS})]
_Others = Annotated[list[Handle], Documented({"maxItems": MAX_STEP_OTHER_OPS})]
_ONE_PER = "One int for every item, or one per item of the section {}, in its order"


class RaggedPageIndices(_Frozen):
    """Requests' pages as FlashInfer's ragged (CSR) paged-KV arrays (docs/index-contract.md).

    Request i's pages are ``indices[indptr[i]:indptr[i + 1]]``, kernel-mode indices as
    ``page_indices(mode="kernel")`` gives them, of the blocks that hold its tokens and that
    it holds; the first ``num_sink_pages[i]`` are sink blocks, the rest hold positions from
    ``first_token[i]`` on, one block after another; the last holds ``last_page_len[i]``
    tokens (1..tokens_per_block; 0 where a context-parallel rank holds none of its blocks)."""

    indptr: list[int]
    indices: list[int]
    last_page_len: list[int]
    first_token: list[int]
    num_sink_pages: list[int]


class StepColumnsRequest(_Frozen):
    """A columnar step (docs/requests.md#the-columnar-step): requests by handle, sections
    run commit, free, rewind, suspend, resume, extend, allocate; counts are one int or one
    per handle. All sections together take at most ``MAX_STEP_OPS`` items, at most
    ``MAX_STEP_OTHER_OPS`` of them outside ``extend``."""

    free: _Others = []
    rewind: _Others = []
    rewind_tokens: PositiveCount | list[PositiveCount] = Field(
        1, description=_ONE_PER.format("rewind") + "; fewer than the request's tokens"
    )
    commit: _Others = []
    commit_tokens: Annotated[list[list[TokenId]], Documented({"maxItems": MAX_STEP_OTHER_OPS})] = (
        Field([], description="One token id list per item of commit, in its order")
    )
    extend: _Extends = []
    num_new_tokens: PositiveCount | list[PositiveCount] = Field(
        1, description=_ONE_PER.format("extend")
    )
    lookahead: NonNegCount | list[NonNegCount] = Field(0, description=_ONE_PER.format("extend"))
    allocate: Annotated[list[AllocateOp], Documented({"maxItems": MAX_STEP_OTHER_OPS})] = []
    suspend: _Others = []
    resume: _Others = []
    atomic: Annotated[bool, Strict()] = Field(False, description=_ATOMIC)
    map_slots: Annotated[bool, Strict()] = Field(
        False,
        description=(
            "Also answer slot_mapping: every layer group's slots of the tokens computed for "
            "this step (each successful extend's new tokens, then each successful "
            "allocate's past its hit)"
        ),
    )
    table_edits: Annotated[bool, Strict()] = Field(
        False,
        description=(
            "Also answer table_edits: the page-table cells changed since the last answer "
            "that had them, [group, row, position, value] each, for an engine's own copy of "
            "the tables (the first answer lists every cell that holds a page)"
        ),
    )
    ragged_layers: Annotated[list[LayerId], Documented({"maxItems": 1024})] = Field(
        [],
        description=(
            "Also answer ragged: per layer id listed here, FlashInfer's ragged (CSR) "
            "pages of the requests the step maps, in slot_mapping's order "
            "(ragged_page_indices with per_layer=true)"
        ),
    )
    stream_ordered: Annotated[bool, Strict()] = Field(
        False,
        description=(
            "Answer without waiting for the device (shared CUDA tables of one rank): the "
            "step's table edits are followed by a record of the layout's step_event, on "
            "which the engine's stream waits before it reads the tables; slot_mapping is "
            "computed from the host's tables"
        ),
    )


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
    slot_mapping: list[list[int]] | None = None
    """With ``map_slots``: ``[groups][tokens]``, -1 where a window released the page."""
    table_edits: list[Annotated[list[int], Documented({"minItems": 4, "maxItems": 4})]] | None = (
        None
    )
    """With ``table_edits``: ``[group, row, position, value]`` per changed cell."""
    ragged: dict[str, RaggedPageIndices] | None = None
    """With ``ragged_layers``: per layer id, the ragged pages of the requests the step maps."""
    pulls: list[PullState] | None = None
    """Pulls and fetches from other sidecars that ended since the last step's answer."""


#: Request ids that must be distinct (one op each of a batch).
DistinctRequestIds = Annotated[list[RequestId], Documented({"uniqueItems": True})]
_PER_ID = "One int for every request, or one per request id, in their order"


class ExtendManyRequest(_Frozen):
    request_ids: DistinctRequestIds
    num_new_tokens: PositiveCount | list[PositiveCount] = Field(1, description=_PER_ID)
    lookahead: NonNegCount | list[NonNegCount] = Field(0, description=_PER_ID)


class CommitManyRequest(_Frozen):
    """``commit_many``: ``token_ids[i]`` are committed to ``request_ids[i]``."""

    request_ids: DistinctRequestIds
    token_ids: list[list[TokenId]] = Field(
        description="One token id list per request id, in their order"
    )


#: A layer id in a request (``LayerSpec.layer_id``, not negative): one the model lacks is
#: ``unknown_layer``, the manager's to say.
LayerId = Annotated[int, Strict(), Documented({"minimum": 0})]
_LAYER = "One of the model's layer ids with a KV cache (GET /v1/layout), else unknown_layer"


class PageIndicesRequest(_Frozen):
    request_ids: list[RequestId]
    layer_id: LayerId = Field(description=_LAYER)
    role: StrictStr = Field("key", description="One of the layer's roles (GET /v1/layout)")
    mode: Literal["slot", "kernel"] = "slot"
    per_layer: bool = Field(False, description="Needs mode 'kernel'")


class RaggedPageIndicesRequest(_Frozen):
    request_ids: list[RequestId]
    layer_id: LayerId = Field(description=_LAYER)
    role: StrictStr = Field("key", description="One of the layer's roles (GET /v1/layout)")
    per_layer: bool = Field(False, description="Add the layer's page offset in the slot")


class SlotMappingRequest(_Frozen):
    """``layer_id`` None maps every layer group (``slot_mappings``); ``slot_mapping`` needs
    one (``OneLayerSlotMappingRequest`` documents its body)."""

    request_ids: list[RequestId]
    layer_id: LayerId | None = Field(None, description=_LAYER)
    num_tokens: NonNegCount | list[NonNegCount] | None = Field(
        None,
        description="New tokens to map, at most each request's length: "
        + _PER_ID
        + "; None: the tokens its latest allocate or extend added",
    )
    pad_to: NonNegCount | None = Field(
        None,
        description="Pad the mapping with -1 to this many entries: at least the tokens "
        "mapped, at most the model's max_requests x max_seq_len",
    )


class OneLayerSlotMappingRequest(SlotMappingRequest):
    """The body of ``POST /v1/slot_mapping`` as its document states it: ``layer_id``
    required. The route parses ``SlotMappingRequest`` and refuses one without a layer
    (``invalid_argument``); the schema says so up front."""

    layer_id: LayerId = Field(description=_LAYER)


class IndexRows(_Frozen):
    """A small int table sent as rows (page indices, block tables, slot mappings per group)."""

    rows: list[list[int]]


class IndexRow(_Frozen):
    row: list[int]


class RequestIds(_Frozen):
    request_ids: list[RequestId]


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
    transfer: Literal["nixl"] | None = None
    """A transfer endpoint (``ManagerConfig.transfer``); None: as the service
    (``kvcm serve --transfer``)."""

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
    step_event: str | None = None
    """Shared CUDA tables of one rank: the base64 IPC handle of the step event, recorded on
    the service's stream after each stream-ordered step's table edits
    (docs/shared-memory.md#stream-ordered-steps); None elsewhere."""


class ConsumerRequest(_Frozen):
    pid: Annotated[int, Strict(), Field(gt=0, le=2**31 - 1)]
    """A process id (pid_t is a 32-bit int)."""
    generation: StrictStr
    done_event: Annotated[StrictStr | None, Field(max_length=128)] = None
    """The base64 IPC handle of an interprocess CUDA event this consumer records after its
    forward's last read of the page tables: the service's edits wait on it
    (docs/shared-memory.md#stream-ordered-steps). Needs shared CUDA tables of one rank."""


class ConsumerInfo(_Frozen):
    consumer_id: str
    pid: int
    generation: str


class Consumers(_Frozen):
    consumers: list[ConsumerInfo]

"""Wire models: the one schema shared by the manager, the service and the clients.

They live in three modules by what they describe: ``specs`` (layers, ranks, the manager's
config), ``results`` (what the manager answers) and ``bodies`` (the service's request and
response bodies, model registration, shared-memory descriptors). This module is the one to
import them from.
"""

from __future__ import annotations

from .bodies import (
    CommitManyRequest as CommitManyRequest,
)
from .bodies import (
    ConsumerInfo as ConsumerInfo,
)
from .bodies import (
    ConsumerRequest as ConsumerRequest,
)
from .bodies import (
    Consumers as Consumers,
)
from .bodies import (
    DistinctRequestIds as DistinctRequestIds,
)
from .bodies import (
    EmptyBody as EmptyBody,
)
from .bodies import (
    ExtendManyRequest as ExtendManyRequest,
)
from .bodies import (
    Handle as Handle,
)
from .bodies import (
    Health as Health,
)
from .bodies import (
    IndexRow as IndexRow,
)
from .bodies import (
    IndexRows as IndexRows,
)
from .bodies import (
    ItemErrorInfo as ItemErrorInfo,
)
from .bodies import (
    LayerId as LayerId,
)
from .bodies import (
    ModelInfo as ModelInfo,
)
from .bodies import (
    ModelRegistration as ModelRegistration,
)
from .bodies import (
    OneLayerSlotMappingRequest as OneLayerSlotMappingRequest,
)
from .bodies import (
    PageIndicesRequest as PageIndicesRequest,
)
from .bodies import (
    RaggedPageIndices as RaggedPageIndices,
)
from .bodies import (
    RaggedPageIndicesRequest as RaggedPageIndicesRequest,
)
from .bodies import (
    RequestIds as RequestIds,
)
from .bodies import (
    SessionClosed as SessionClosed,
)
from .bodies import (
    SessionInfo as SessionInfo,
)
from .bodies import (
    SessionRequest as SessionRequest,
)
from .bodies import (
    SharedBuffer as SharedBuffer,
)
from .bodies import (
    SharedLayout as SharedLayout,
)
from .bodies import (
    SharedSegment as SharedSegment,
)
from .bodies import (
    SlotMappingRequest as SlotMappingRequest,
)
from .bodies import (
    StepColumnsRequest as StepColumnsRequest,
)
from .bodies import (
    StepColumnsResponse as StepColumnsResponse,
)
from .bodies import (
    StepOp as StepOp,
)
from .bodies import (
    StepRequest as StepRequest,
)
from .bodies import (
    StepResponse as StepResponse,
)
from .bodies import (
    StrictBool as StrictBool,
)
from .bodies import (
    StrictPosInt as StrictPosInt,
)
from .results import (
    AllocateOp as AllocateOp,
)
from .results import (
    BlockKey as BlockKey,
)
from .results import (
    BufferInfo as BufferInfo,
)
from .results import (
    CommitOp as CommitOp,
)
from .results import (
    DroppedLayer as DroppedLayer,
)
from .results import (
    ErrorInfo as ErrorInfo,
)
from .results import (
    Estimate as Estimate,
)
from .results import (
    ExtendOp as ExtendOp,
)
from .results import (
    FreeOp as FreeOp,
)
from .results import (
    HostTierStats as HostTierStats,
)
from .results import (
    IndexSnapshot as IndexSnapshot,
)
from .results import (
    KVEvent as KVEvent,
)
from .results import (
    KVEvents as KVEvents,
)
from .results import (
    LayerGroupEstimate as LayerGroupEstimate,
)
from .results import (
    LayerGroupInfo as LayerGroupInfo,
)
from .results import (
    Layout as Layout,
)
from .results import (
    LoraId as LoraId,
)
from .results import (
    MultimodalInput as MultimodalInput,
)
from .results import (
    Op as Op,
)
from .results import (
    OpResult as OpResult,
)
from .results import (
    PoolGroupEstimate as PoolGroupEstimate,
)
from .results import (
    PoolGroupInfo as PoolGroupInfo,
)
from .results import (
    PoolInfo as PoolInfo,
)
from .results import (
    PrefixCacheStats as PrefixCacheStats,
)
from .results import (
    ProbeRequest as ProbeRequest,
)
from .results import (
    ProbeResult as ProbeResult,
)
from .results import (
    ProbeTiersRequest as ProbeTiersRequest,
)
from .results import (
    ProbeTiersResult as ProbeTiersResult,
)
from .results import (
    RequestInfo as RequestInfo,
)
from .results import (
    RequestRef as RequestRef,
)
from .results import (
    ResumeOp as ResumeOp,
)
from .results import (
    RewindOp as RewindOp,
)
from .results import (
    SnapshotGroup as SnapshotGroup,
)
from .results import (
    Stats as Stats,
)
from .results import (
    SuspendOp as SuspendOp,
)
from .specs import (
    BLOCK_KEY_BYTES as BLOCK_KEY_BYTES,
)
from .specs import (
    DTYPE_BITS as DTYPE_BITS,
)
from .specs import (
    INT64_MAX as INT64_MAX,
)
from .specs import (
    INT64_MIN as INT64_MIN,
)
from .specs import (
    MAX_COUNT as MAX_COUNT,
)
from .specs import (
    MAX_RANKS as MAX_RANKS,
)
from .specs import (
    MAX_REQUEST_ID as MAX_REQUEST_ID,
)
from .specs import (
    MAX_STEP_OPS as MAX_STEP_OPS,
)
from .specs import (
    MAX_STEP_OTHER_OPS as MAX_STEP_OTHER_OPS,
)
from .specs import (
    MAX_TOKEN_ID as MAX_TOKEN_ID,
)
from .specs import (
    NVFP4_GROUP as NVFP4_GROUP,
)
from .specs import (
    ROLE_NAME as ROLE_NAME,
)
from .specs import (
    ROLES as ROLES,
)
from .specs import (
    Count as Count,
)
from .specs import (
    Documented as Documented,
)
from .specs import (
    DType as DType,
)
from .specs import (
    ExtraBuffer as ExtraBuffer,
)
from .specs import (
    LayerSpec as LayerSpec,
)
from .specs import (
    ManagerConfig as ManagerConfig,
)
from .specs import (
    NonNegCount as NonNegCount,
)
from .specs import (
    NonNegInt as NonNegInt,
)
from .specs import (
    PosInt as PosInt,
)
from .specs import (
    PositiveCount as PositiveCount,
)
from .specs import (
    RankSpec as RankSpec,
)
from .specs import (
    RequestId as RequestId,
)
from .specs import (
    Role as Role,
)
from .specs import (
    RoleBuffer as RoleBuffer,
)
from .specs import (
    StandardRole as StandardRole,
)
from .specs import (
    StrictStr as StrictStr,
)
from .specs import (
    TokenId as TokenId,
)
from .specs import (
    _Frozen as _Frozen,
)

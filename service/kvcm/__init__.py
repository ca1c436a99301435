"""kvcm: a unified KV-cache manager for LLM inference (in process, and later as a sidecar)."""

from kvcm_client.errors import (
    DeviceUnavailable,
    DuplicateRequest,
    InsufficientMemory,
    InvalidArgument,
    InvalidRewind,
    KVCMError,
    OutOfBlocks,
    RequestLimitReached,
    RequestsLive,
    SequenceTooLong,
    UnknownLayer,
    UnknownRequest,
)
from kvcm_client.models import ExtraBuffer, LayerSpec, ManagerConfig, ModelInfo

from .hashing import MultimodalItem, block_keys
from .manager import KVCacheManager

__all__ = [
    "DeviceUnavailable",
    "DuplicateRequest",
    "ExtraBuffer",
    "InsufficientMemory",
    "InvalidArgument",
    "InvalidRewind",
    "KVCMError",
    "KVCacheManager",
    "LayerSpec",
    "ManagerConfig",
    "ModelInfo",
    "MultimodalItem",
    "OutOfBlocks",
    "RequestLimitReached",
    "RequestsLive",
    "SequenceTooLong",
    "UnknownLayer",
    "UnknownRequest",
    "block_keys",
]

"""kvcm: a unified KV-cache manager for LLM inference (in process, and later as a sidecar).

``KVCacheManager``, ``MultimodalItem`` and ``block_keys`` are imported on first use (they need
torch and numpy), so that ``import kvcm.cli`` (``kvcm --help``) starts without them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

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
from kvcm_client.models import ExtraBuffer, LayerSpec, ManagerConfig, ModelInfo, RankSpec

if TYPE_CHECKING:
    from .hashing import MultimodalItem, block_keys
    from .manager import KVCacheManager

#: The names imported on first use, and their modules.
_LAZY = {"KVCacheManager": "manager", "MultimodalItem": "hashing", "block_keys": "hashing"}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    from importlib import import_module

    value = getattr(import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


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
    "RankSpec",
    "RequestLimitReached",
    "RequestsLive",
    "SequenceTooLong",
    "UnknownLayer",
    "UnknownRequest",
    "block_keys",
]

"""kvcm_client: the wire models, typed errors and HTTP clients of the kvcm sidecar.

Depends on httpx and pydantic only (no torch, no numpy), so a scheduler can install it alone.
"""

from . import errors, models
from .async_client import AsyncKVCacheClient
from .client import KVCacheClient
from .shared import Attachment, attach  # torch is imported only when attaching

__all__ = ["AsyncKVCacheClient", "Attachment", "KVCacheClient", "attach", "errors", "models"]

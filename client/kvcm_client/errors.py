"""Typed errors shared by the in-process manager, the service and the clients.

Every error carries a stable machine-readable ``code`` and the HTTP status the service maps it
to, so a scheduler can switch between the in-process manager and the sidecar and still catch
the same exception types. ``detail`` holds the numbers behind the message (ids, counts), never
secrets.
"""

from __future__ import annotations

from typing import Any, ClassVar


class KVCMError(Exception):
    """Base of all kvcm errors; ``code`` is stable across releases, ``message`` is for people."""

    code: ClassVar[str] = "kvcm_error"
    status: ClassVar[int] = 400

    def __init__(self, message: str, **detail: Any) -> None:
        super().__init__(message)
        self.message = message
        self.detail = detail

    def to_dict(self) -> dict[str, Any]:
        return {"code": self.code, "message": self.message, "detail": self.detail}


class InvalidArgument(KVCMError):
    """An argument is out of its range (a zero count, a negative lookahead, a bad role)."""

    code = "invalid_argument"
    status = 422


class SequenceTooLong(InvalidArgument):
    """The request would exceed ``max_seq_len`` (tokens plus lookahead)."""

    code = "sequence_too_long"
    status = 413


class UnknownRequest(KVCMError):
    code = "unknown_request"
    status = 404


class UnknownLayer(KVCMError):
    code = "unknown_layer"
    status = 404


class DuplicateRequest(KVCMError):
    code = "duplicate_request"
    status = 409


class InvalidRewind(KVCMError):
    """A rewind would need KV that a sliding window has already released."""

    code = "rewind_past_window"
    status = 409


class OutOfBlocks(KVCMError):
    """A normal outcome: the pools cannot hold the op. Nothing was changed."""

    code = "out_of_blocks"
    status = 507


class RequestLimitReached(KVCMError):
    """Every page-table row is taken (``max_requests`` running requests)."""

    code = "max_requests_reached"
    status = 507


class InsufficientMemory(KVCMError):
    """The memory budget cannot hold a single slot of some pool group."""

    code = "insufficient_memory"
    status = 422


class DeviceUnavailable(KVCMError):
    code = "device_unavailable"
    status = 422


ERRORS_BY_CODE: dict[str, type[KVCMError]] = {
    cls.code: cls
    for cls in (
        KVCMError,
        InvalidArgument,
        SequenceTooLong,
        UnknownRequest,
        UnknownLayer,
        DuplicateRequest,
        InvalidRewind,
        OutOfBlocks,
        RequestLimitReached,
        InsufficientMemory,
        DeviceUnavailable,
    )
}

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
    """No live request has that id (never allocated, freed, or freed by a lease expiry)."""

    code = "unknown_request"
    status = 404


class UnknownLayer(KVCMError):
    """No layer with that id in the layout (or it has no KV cache and was dropped)."""

    code = "unknown_layer"
    status = 404


class DuplicateRequest(KVCMError):
    """The request id is live with other arguments (the same allocate again is a retry)."""

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
    """The memory budget cannot hold one ``max_seq_len`` request (or one slot of some pool
    group), or the model's memory is not free on the device (a registration)."""

    code = "insufficient_memory"
    status = 422


class UnsupportedModel(InvalidArgument):
    """The model config describes attention kvcm does not model (e.g. linear attention)."""

    code = "unsupported_model"


class DeviceUnavailable(KVCMError):
    """The configured device cannot be used (no CUDA, or no such GPU)."""

    code = "device_unavailable"
    status = 422


class RewindIntoSharedBlock(KVCMError):
    """A rewind would make the request overwrite a cached block other requests share."""

    code = "rewind_into_shared_block"
    status = 409


class CopyIntoSharedBlock(KVCMError):
    """A token copy would overwrite a block other requests share or the prefix cache publishes.

    Such a block's KV is what other requests read, or will get on a prefix hit, under the key
    of the tokens it was computed for; writing another token's KV there would corrupt them.
    """

    code = "copy_into_shared_block"
    status = 409


class PrefixCacheInUse(KVCMError):
    """``reset_prefix_cache`` while requests hold blocks."""

    code = "prefix_cache_in_use"
    status = 409


class KVEventsDisabled(KVCMError):
    """``events`` of a manager built with ``kv_events=False``: it records none."""

    code = "kv_events_disabled"
    status = 409


class StaleGeneration(KVCMError):
    """Shared-memory descriptors of an earlier start of the service (or a gone segment)."""

    code = "stale_generation"
    status = 409


class RequestsLive(KVCMError):
    """A new model cannot be registered while requests are live: free them first (their
    blocks would be lost with the old pools). Nothing was changed."""

    code = "requests_live"
    status = 409


class RequestSuspended(KVCMError):
    """The request is suspended (its blocks are on the host tier): resume it first."""

    code = "request_suspended"
    status = 409


class StateNotRewindable(KVCMError):
    """A rewind below a request's committed length where its recurrent state has no
    checkpoint: state layers cannot undo tokens, only go back to a saved checkpoint (at a
    multiple of ``state_checkpoint_stride`` blocks, still kept)."""

    code = "state_not_rewindable"
    status = 409


class StepAborted(KVCMError):
    """An op of an all-or-nothing step that was not applied because another op failed."""

    code = "step_aborted"
    status = 409


class MalformedRequest(KVCMError):
    """The HTTP body is not valid JSON (the service's 400)."""

    code = "malformed_request"
    status = 400


class Unauthorized(KVCMError):
    """A mutating route was called without the bearer token the service was started with."""

    code = "unauthorized"
    status = 401


class NotFound(KVCMError):
    """No such route (a client/service version mismatch, or a typo in a URL)."""

    code = "not_found"
    status = 404


class MethodNotAllowed(KVCMError):
    """The route exists, but not with this HTTP method."""

    code = "method_not_allowed"
    status = 405


class UnknownSession(KVCMError):
    """The lease session does not exist or has expired (its requests were freed)."""

    code = "unknown_session"
    status = 404


class PayloadTooLarge(KVCMError):
    """The request body exceeds the service's size limit."""

    code = "payload_too_large"
    status = 413


class InternalError(KVCMError):
    """A bug in kvcm: the service logged it; the op may or may not have been applied."""

    code = "internal_error"
    status = 500


class UnknownConsumer(KVCMError):
    """No consumer with that id (never registered, detached already, or forgotten dead)."""

    code = "unknown_consumer"
    status = 404


class LimitReached(KVCMError):
    """A bounded service resource is full (sessions, consumers); retry after freeing some."""

    code = "limit_reached"
    status = 429


class ServiceUnavailable(KVCMError):
    """The client could not reach the service (after its retries, where the op allowed them)."""

    code = "service_unavailable"
    status = 503


class NoModel(KVCMError):
    """The service has no model yet: register one (``POST /v1/model``, ``register_model``)."""

    code = "no_model"
    status = 503


class ModelMismatch(KVCMError):
    """A sidecar serves a model whose block keys differ from the router's (another
    ``tokens_per_block``, other layer groups): the router cannot score it, so it does not
    follow it (``kvcm router``, docs/router.md)."""

    code = "model_mismatch"
    status = 409


class IndexUnavailable(KVCMError):
    """The router's index store (Redis) cannot be reached now; the router keeps trying and
    rebuilds what it lost (docs/router.md)."""

    code = "index_unavailable"
    status = 503


class ModelWaitTimeout(NoModel):
    """``wait_for_model`` gave up: the service still had no model when its time ran out
    (raised by the clients, never sent by the service)."""

    code = "model_wait_timeout"


class KVInFlight(KVCMError):
    """The request's KV is moving between sidecars (a pull into it, or a hand-off from it):
    it takes no op but ``free`` until the move ends; ``transfer_status`` says when
    (docs/disaggregation.md)."""

    code = "kv_in_flight"
    status = 409


class LayoutMismatch(KVCMError):
    """Two sidecars' KV layouts differ (block size, a layer's dtype or heads, the layer
    groups, the pools' slots): blocks cannot move between them as they are. ``detail``
    names each difference; nothing moved."""

    code = "layout_mismatch"
    status = 409


class ScopeMismatch(KVCMError):
    """A pull named another cache scope (LoRA, cache salt) than the request it pulls from:
    a sidecar never serves blocks of one scope to another."""

    code = "scope_mismatch"
    status = 403


class TransferUnavailable(KVCMError):
    """This manager has no transfer endpoint (started without ``--transfer``), or the
    transfer engine (NIXL: ``pip install 'kvcm[transfer]'``) is not installed."""

    code = "transfer_unavailable"
    status = 409


class TransferFailed(KVCMError):
    """A move of KV between sidecars failed (the peer died, its deadline passed, the
    transfer engine reported an error); the blocks reserved for it went back to the pool."""

    code = "transfer_failed"
    status = 502


class UnknownPeer(KVCMError):
    """The peer is not one this sidecar's operator configured (``--peer``), or its
    transfer agent is not connected."""

    code = "unknown_peer"
    status = 404


class RingUnavailable(KVCMError):
    """The step channel offers no shared-memory ring here: the service is not in busy-poll
    mode, or the machine is not x86-64 Linux (``detail.reason``). The socket serves instead."""

    code = "ring_unavailable"
    status = 409


class StreamOrderUnavailable(KVCMError):
    """A stream-ordered step or a consumer's done event needs a manager whose page tables
    are shared CUDA memory on one rank (docs/shared-memory.md#stream-ordered-steps): this one
    is on the CPU, not shared, or spread over ranks (``detail.reason``). Nothing changed."""

    code = "stream_order_unavailable"
    status = 409


class PeerUnreachable(KVCMError):
    """A configured peer did not answer (down, restarting, or refusing the token)."""

    code = "peer_unreachable"
    status = 503


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
        UnsupportedModel,
        DeviceUnavailable,
        RequestsLive,
        StepAborted,
        RequestSuspended,
        StateNotRewindable,
        StaleGeneration,
        RewindIntoSharedBlock,
        CopyIntoSharedBlock,
        PrefixCacheInUse,
        KVEventsDisabled,
        MalformedRequest,
        Unauthorized,
        NotFound,
        MethodNotAllowed,
        UnknownSession,
        PayloadTooLarge,
        InternalError,
        LimitReached,
        UnknownConsumer,
        ServiceUnavailable,
        NoModel,
        ModelWaitTimeout,
        ModelMismatch,
        IndexUnavailable,
        KVInFlight,
        LayoutMismatch,
        ScopeMismatch,
        TransferUnavailable,
        TransferFailed,
        UnknownPeer,
        PeerUnreachable,
        RingUnavailable,
        StreamOrderUnavailable,
    )
}


#: The numeric status of each code in columnar step results (``step_columns``): the index in
#: this tuple; 0 is success. Append only: a number never changes meaning. The op errors come
#: first (the ones a step item can get); any code not listed maps to 1, ``kvcm_error``.
STATUS_CODES: tuple[str, ...] = (
    "ok",
    "kvcm_error",
    "invalid_argument",
    "sequence_too_long",
    "unknown_request",
    "duplicate_request",
    "rewind_past_window",
    "out_of_blocks",
    "max_requests_reached",
    "rewind_into_shared_block",
    "step_aborted",
    "internal_error",
    "unknown_layer",
    "insufficient_memory",
    "unsupported_model",
    "device_unavailable",
    "requests_live",
    "stale_generation",
    "copy_into_shared_block",
    "prefix_cache_in_use",
    "kv_events_disabled",
    "malformed_request",
    "unauthorized",
    "not_found",
    "method_not_allowed",
    "unknown_session",
    "payload_too_large",
    "limit_reached",
    "unknown_consumer",
    "service_unavailable",
    "no_model",
    "model_wait_timeout",
    "request_suspended",
    "state_not_rewindable",
    "model_mismatch",
    "index_unavailable",
    "kv_in_flight",
    "layout_mismatch",
    "scope_mismatch",
    "transfer_unavailable",
    "transfer_failed",
    "unknown_peer",
    "peer_unreachable",
    "ring_unavailable",
    "stream_order_unavailable",
)
STATUS_OF: dict[str, int] = {code: i for i, code in enumerate(STATUS_CODES)}


def status_of(code: str) -> int:
    """The numeric status of an error code (1, ``kvcm_error``, for a code this side lacks)."""
    return STATUS_OF.get(code, 1)


def error_from_dict(body: dict[str, Any], status: int = 400) -> KVCMError:
    """Rebuild the typed error a service response describes (unknown codes stay KVCMError).

    The instance's ``code`` is the one the service sent, so a newer service's codes survive an
    older client.
    """
    code = str(body.get("code", "kvcm_error"))
    message = str(body.get("message", ""))
    detail = body.get("detail") or {}
    cls = ERRORS_BY_CODE.get(code)
    err = (cls or KVCMError)(message)
    err.detail = dict(detail) if isinstance(detail, dict) else {"detail": detail}
    if cls is None:
        err.code = code  # type: ignore[misc]
        err.status = status  # type: ignore[misc]
    return err


def invalid_from_validation(errors: list[Any]) -> KVCMError:
    """Pydantic validation errors as ``InvalidArgument`` (``MalformedRequest`` for bad JSON).

    The detail keeps location, message and type of at most 20 errors: enough to fix the call,
    small enough for a log line, and JSON-safe (pydantic's ``ctx`` may hold exceptions).
    """
    slim = [
        {
            "loc": [str(part) for part in e.get("loc", ())],
            "msg": str(e.get("msg", "")),
            "type": str(e.get("type", "")),
        }
        for e in errors[:20]
    ]
    if any(e["type"] == "json_invalid" for e in slim):
        return MalformedRequest("request body is not valid JSON", errors=slim)
    first = slim[0] if slim else {"loc": [], "msg": "invalid input"}
    where = ".".join(first["loc"]) or "body"
    return InvalidArgument(f"{where}: {first['msg']}", errors=slim)

"""The OpenAPI document of the service and its offline docs page.

``ROUTES`` is the one table of what every route can answer besides its success: the error
classes of ``kvcm_client.errors`` it may raise, whether it reads a JSON body (400
``malformed_request``, 413 ``payload_too_large``, 422 ``invalid_argument``), whether it needs
the bearer token (401 ``unauthorized``) and whether it renews the caller's lease from the
``X-KVCM-Session`` header (404 ``unknown_session``); every route refuses a request naming
another service generation (409 ``stale_generation``). Statuses and codes come from the classes,
so the document cannot drift from ``errors.py``; every route answers 500 ``internal_error``
on a bug. The document is built with the app and fails if a route has no entry or an entry no
route, so a new route cannot ship undocumented. Every error response is the ``Error`` component
(``{code, message, detail}``), its ``code`` narrowed to the codes of that status on that route;
FastAPI's ``HTTPValidationError`` is gone (the service never answers with it).

A request the document calls valid gets no 422 for a reason a schema can state: the wire
models publish the limits the manager enforces (``kvcm_client.specs.Documented``),
``QUERY_LIMITS`` those of query parameters (FastAPI documents their types only) and
``DOCUMENTED_BODIES`` a route's body where it needs more than the model it parses. Limits that
depend on the model (``max_seq_len``, its layers and roles) or on state are in the fields'
descriptions and the error responses'.

``/docs`` is a self-contained page (``docs.html``: no CDN, no external URL) that reads
``/openapi.json`` and renders routes, parameters, bodies, schemas and statuses.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from importlib.resources import files
from typing import Any

from fastapi import FastAPI, Request
from fastapi.openapi.utils import get_openapi
from fastapi.responses import HTMLResponse
from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from kvcm_client.errors import (
    DeviceUnavailable,
    DuplicateRequest,
    InsufficientMemory,
    InternalError,
    InvalidArgument,
    InvalidRewind,
    KVCMError,
    KVEventsDisabled,
    KVInFlight,
    LayoutMismatch,
    LimitReached,
    MalformedRequest,
    NoModel,
    NotFound,
    OutOfBlocks,
    PayloadTooLarge,
    PeerUnreachable,
    PrefixCacheInUse,
    RequestLimitReached,
    RequestsLive,
    RequestSuspended,
    RewindIntoSharedBlock,
    ScopeMismatch,
    SequenceTooLong,
    StaleGeneration,
    StateNotRewindable,
    StreamOrderUnavailable,
    TransferUnavailable,
    Unauthorized,
    UnknownConsumer,
    UnknownLayer,
    UnknownPeer,
    UnknownRequest,
    UnknownSession,
    UnsupportedModel,
)
from kvcm_client.models import OneLayerSlotMappingRequest, SlotMappingRequest
from kvcm_client.specs import INT64_MAX, MAX_COUNT, MAX_REQUEST_ID

from .leases import Leases

_JSON = "application/json"
ERROR_SCHEMA = "Error"
SESSION_HEADER = "X-KVCM-Session"
BEARER = "bearer"

Errors = tuple[type[KVCMError], ...]


@dataclass(frozen=True, slots=True)
class RouteDoc:
    """What one route can answer besides success (see the module doc)."""

    errors: Errors = ()
    body: bool = False
    body_required: bool = True
    auth: bool = False
    session: bool = False
    extra: dict[int, dict[str, Any]] | None = None
    """Non-error statuses the route answers with beside its success, as OpenAPI responses."""
    generation: bool = True
    """The route refuses a caller pinned to another service generation (the sidecar's
    ``Generation`` middleware); a router has no generation."""
    notes: tuple[tuple[type[KVCMError], str], ...] = ()
    """Lines that explain an error on this route better than the table-wide ``_NOTES``."""

    def error_classes(self) -> Errors:
        """Every error class of the route, in status order (ties: the table's order)."""
        out: list[type[KVCMError]] = []
        if self.body:
            out += [MalformedRequest, PayloadTooLarge, InvalidArgument]
        if self.auth:
            out.append(Unauthorized)
        if self.session:
            out.append(UnknownSession)
        out += self.errors
        if self.generation:  # any route, for a client that pinned another generation
            out.append(StaleGeneration)
        out.append(InternalError)
        unique = list(dict.fromkeys(out))
        return tuple(sorted(unique, key=lambda cls: cls.status))


#: Routes that need the model: 503 ``no_model`` until one is registered.
_MODEL = (NoModel,)
#: Requests named by id: in a body, or the ``request_id`` query parameter (only a host tier
#: suspends them; those routes answer ``request_suspended`` for a suspended one).
_REQUEST = (*_MODEL, UnknownRequest)
_LIVE = (*_REQUEST, RequestSuspended, KVInFlight)
#: Ops that grow a request.
_GROW = (*_REQUEST, SequenceTooLong, OutOfBlocks)
#: A path id with a '/' (as %2F) names no route: 404 ``not_found``.
_PATH_ID = (NotFound,)

#: The body limit (``app.default_body_limit``; tests/test_openapi.py holds the two to it).
_BODY_LIMIT = (
    (
        PayloadTooLarge,
        "the body is over the service's limit, checked before it is parsed: `kvcm serve "
        "--max-body-bytes`, by default the larger of 1 MiB and 64 KiB + 8 bytes per token of "
        "the model's max_seq_len",
    ),
)
#: What a 422 ``invalid_argument`` means on any route, and besides on suspend and resume.
_INVALID = (
    "an argument is out of its range or of the wrong type (the schema states both; an integer "
    "written with a fraction or an exponent, such as 2.0, is refused), or does not fit the "
    "model or the request's state (the field's description says how); detail.errors lists the "
    "fields when the body or query failed validation"
)
_NO_HOST_TIER = "; the manager has no host tier (host_memory_bytes)"


def _notes(invalid: str) -> tuple[tuple[type[KVCMError], str], ...]:
    """A body route's notes, with more reasons for its ``invalid_argument``."""
    return (*_BODY_LIMIT, (InvalidArgument, _INVALID + invalid))


#: An op route: a body, the token, the lease header; ``_OP`` with the body limit's note.
_OP_ROUTE: dict[str, Any] = {"body": True, "auth": True, "session": True}
_OP: dict[str, Any] = {**_OP_ROUTE, "notes": _BODY_LIMIT}
_READ: dict[str, Any] = {"body": True, "notes": _BODY_LIMIT}

#: route (method, path) -> what it can answer besides success. The one table; see the module doc.
ROUTES: dict[tuple[str, str], RouteDoc] = {
    ("POST", "/v1/allocate"): RouteDoc(
        (*_MODEL, SequenceTooLong, DuplicateRequest, OutOfBlocks, RequestLimitReached), **_OP
    ),
    ("POST", "/v1/extend"): RouteDoc((*_GROW, RequestSuspended, KVInFlight), **_OP),
    ("POST", "/v1/extend_many"): RouteDoc((*_GROW, RequestSuspended, KVInFlight), **_OP),
    ("POST", "/v1/rewind"): RouteDoc(
        (*_LIVE, InvalidRewind, RewindIntoSharedBlock, StateNotRewindable), **_OP
    ),
    ("POST", "/v1/commit"): RouteDoc(_LIVE, **_OP),
    ("POST", "/v1/commit_many"): RouteDoc(_LIVE, **_OP),
    ("POST", "/v1/free"): RouteDoc(_REQUEST, **_OP),
    ("POST", "/v1/suspend"): RouteDoc(
        (*_LIVE, InvalidArgument, OutOfBlocks), **_OP_ROUTE, notes=_notes(_NO_HOST_TIER)
    ),
    ("POST", "/v1/resume"): RouteDoc(
        (*_REQUEST, InvalidArgument, OutOfBlocks),
        **_OP_ROUTE,
        notes=_notes(f"{_NO_HOST_TIER}; the request is not suspended"),
    ),
    # Op errors are results of a step (200), not its status.
    ("POST", "/v1/step"): RouteDoc(_MODEL, **_OP),
    ("POST", "/v1/step_columns"): RouteDoc(
        (*_MODEL, StreamOrderUnavailable),
        **_OP_ROUTE,
        notes=(
            *_BODY_LIMIT,
            (
                StreamOrderUnavailable,
                "stream_ordered on a manager without shared CUDA tables of one rank",
            ),
        ),
    ),
    ("POST", "/v1/page_indices"): RouteDoc((*_LIVE, UnknownLayer), **_READ),
    ("POST", "/v1/ragged_page_indices"): RouteDoc((*_LIVE, UnknownLayer), **_READ),
    ("POST", "/v1/slot_mapping"): RouteDoc((*_LIVE, UnknownLayer), **_READ),
    ("POST", "/v1/slot_mappings"): RouteDoc(_LIVE, **_READ),
    ("POST", "/v1/probe"): RouteDoc((*_MODEL, SequenceTooLong), **_READ),
    ("POST", "/v1/probe_tiers"): RouteDoc((*_MODEL, SequenceTooLong), **_READ),
    ("POST", "/v1/reset_prefix_cache"): RouteDoc(
        (*_MODEL, PrefixCacheInUse), body=True, auth=True, notes=_BODY_LIMIT
    ),
    ("GET", "/v1/events"): RouteDoc((InvalidArgument, *_MODEL, KVEventsDisabled), auth=True),
    # KV moves between sidecars (docs/disaggregation.md): every route behind the token.
    ("GET", "/v1/transfer/agent"): RouteDoc((*_MODEL, TransferUnavailable), auth=True),
    ("POST", "/v1/transfer/hand_off"): RouteDoc(
        (*_LIVE, TransferUnavailable), body=True, auth=True, notes=_BODY_LIMIT
    ),
    ("POST", "/v1/transfer/export"): RouteDoc(
        (*_REQUEST, ScopeMismatch, TransferUnavailable), body=True, auth=True, notes=_BODY_LIMIT
    ),
    ("POST", "/v1/transfer/pull"): RouteDoc(
        (
            *_MODEL,
            UnknownRequest,
            DuplicateRequest,
            OutOfBlocks,
            SequenceTooLong,
            RequestLimitReached,
            ScopeMismatch,
            LayoutMismatch,
            UnknownPeer,
            PeerUnreachable,
            TransferUnavailable,
        ),
        body=True,
        auth=True,
        notes=_BODY_LIMIT,
    ),
    ("POST", "/v1/transfer/status"): RouteDoc((*_MODEL, TransferUnavailable), **_READ),
    ("POST", "/v1/transfer/prefix"): RouteDoc(
        (*_MODEL, SequenceTooLong, TransferUnavailable),
        body=True,
        auth=True,
        notes=_BODY_LIMIT,
    ),
    ("POST", "/v1/transfer/fetch"): RouteDoc(
        (
            *_MODEL,
            DuplicateRequest,
            OutOfBlocks,
            SequenceTooLong,
            RequestLimitReached,
            LayoutMismatch,
            UnknownPeer,
            PeerUnreachable,
            TransferUnavailable,
        ),
        body=True,
        auth=True,
        notes=_BODY_LIMIT,
    ),
    ("GET", "/v1/index/snapshot"): RouteDoc(_MODEL, auth=True),
    ("GET", "/v1/layout"): RouteDoc(_MODEL),
    ("GET", "/v1/estimate"): RouteDoc((InvalidArgument, *_MODEL)),
    ("GET", "/v1/stats"): RouteDoc(_MODEL),
    ("GET", "/v1/requests"): RouteDoc(_MODEL),
    ("GET", "/v1/request"): RouteDoc((InvalidArgument, *_REQUEST)),
    ("GET", "/v1/block_table"): RouteDoc((InvalidArgument, *_LIVE)),
    ("GET", "/v1/committed_tokens"): RouteDoc((InvalidArgument, *_REQUEST), auth=True),
    # 422 when the manager was built without share=True.
    ("GET", "/v1/pools"): RouteDoc((InvalidArgument, *_MODEL)),
    ("POST", "/v1/consumers"): RouteDoc(
        (StaleGeneration, LimitReached, StreamOrderUnavailable, *_MODEL),
        body=True,
        auth=True,
        notes=(
            *_BODY_LIMIT,
            (LimitReached, "the table of attached consumers is full: detach one first"),
            (
                StreamOrderUnavailable,
                "a done_event on a manager without shared CUDA tables of one rank",
            ),
        ),
    ),
    ("GET", "/v1/consumers"): RouteDoc(),
    ("DELETE", "/v1/consumers/{consumer_id}"): RouteDoc((UnknownConsumer, *_PATH_ID), auth=True),
    ("POST", "/v1/sessions"): RouteDoc(
        (LimitReached,),
        body=True,
        body_required=False,
        auth=True,
        notes=(
            *_BODY_LIMIT,
            (LimitReached, f"{Leases.MAX_SESSIONS} sessions are open: close one or let it expire"),
        ),
    ),
    ("GET", "/v1/sessions/{session_id}"): RouteDoc((UnknownSession, *_PATH_ID)),
    ("POST", "/v1/sessions/{session_id}/renew"): RouteDoc((UnknownSession, *_PATH_ID), auth=True),
    ("DELETE", "/v1/sessions/{session_id}"): RouteDoc((UnknownSession, *_PATH_ID), auth=True),
    # Every refusal changes nothing (docs/service.md#registering-a-model).
    ("POST", "/v1/model"): RouteDoc(
        (InsufficientMemory, UnsupportedModel, DeviceUnavailable, RequestsLive),
        body=True,
        auth=True,
        notes=_BODY_LIMIT,
    ),
    ("GET", "/v1/model"): RouteDoc(_MODEL),
    ("GET", "/livez"): RouteDoc(),
    ("GET", "/readyz"): RouteDoc(
        extra={
            503: {
                "description": "Not ready: starting or shutting down (status `not_ready`), "
                "or no model registered yet (status `no_model`)",
                "content": {_JSON: {"schema": {"$ref": "#/components/schemas/Health"}}},
            }
        }
    ),
    ("GET", "/metrics"): RouteDoc(),
}

_REQUEST_ID = {"minLength": 1, "maxLength": MAX_REQUEST_ID}
_MAX_SEQ_LEN = "the model's max_seq_len (GET /v1/model: config.max_seq_len)"

#: What the document says of query parameters beyond their types: route -> parameter ->
#: JSON-schema keywords of its value (the manager checks them), or ``description`` of the
#: parameter. ``build`` fails on a parameter the app lacks, so the table cannot go stale.
QUERY_LIMITS: dict[tuple[str, str], dict[str, dict[str, Any]]] = {
    ("GET", "/v1/events"): {
        "after": {"minimum": 0, "maximum": INT64_MAX},
        "limit": {"minimum": 1, "maximum": MAX_COUNT},
        "timeout_s": {
            "description": "Seconds to wait for an event when there is none (a finite "
            "number; at most 60 are waited, 0 or less: none)"
        },
    },
    ("GET", "/v1/estimate"): {
        "seq_len": {
            "minimum": 1,
            "maximum": MAX_COUNT,
            "description": f"At most {_MAX_SEQ_LEN} less the lookahead",
        },
        "num_requests": {"minimum": 0},
        "prefill_chunk": {"minimum": 1, "maximum": MAX_COUNT},
        "lookahead": {"minimum": 0, "maximum": MAX_COUNT},
    },
    ("GET", "/v1/pools"): {
        "rank": {"minimum": 0, "description": "Below the model's number of ranks"},
    },
    ("GET", "/v1/request"): {"request_id": _REQUEST_ID},
    ("GET", "/v1/block_table"): {"request_id": _REQUEST_ID},
    ("GET", "/v1/committed_tokens"): {"request_id": _REQUEST_ID},
}

#: Bodies the document states more precisely than the model the route parses: the route
#: refuses what the documented model's extra rules exclude. ``/v1/slot_mapping`` shares
#: ``SlotMappingRequest`` with ``/v1/slot_mappings`` but needs its ``layer_id``.
DOCUMENTED_BODIES: dict[str, tuple[type[BaseModel], type[BaseModel]]] = {
    "/v1/slot_mapping": (SlotMappingRequest, OneLayerSlotMappingRequest),
}

#: Codes that a route-specific note explains better than the class's docstring.
_NOTES = {
    NotFound: "the path id holds a '/' (sent as %2F), so the path names no route",
    InvalidArgument: _INVALID,
    Unauthorized: "the route needs 'Authorization: Bearer <KVCM_API_TOKEN>' (only when the "
    "service runs with a token)",
    InternalError: "a bug in kvcm: the service logged it",
}


def describe(cls: type[KVCMError], doc: RouteDoc | None = None) -> str:
    """One line about an error class: the route's note, the table's, else the class
    docstring's first paragraph."""
    note = dict(doc.notes).get(cls) if doc is not None else None
    note = note or _NOTES.get(cls)
    if note:
        return note
    doc = (cls.__doc__ or "").strip().split("\n\n")[0]
    return " ".join(doc.split()).rstrip(".") or cls.code


def error_schema() -> dict[str, Any]:
    return {
        "title": ERROR_SCHEMA,
        "description": "Every error answer of the service. `code` is stable across releases "
        "(kvcm_client.errors has one exception class per code); `message` is for people; "
        "`detail` holds the numbers behind the message.",
        "type": "object",
        "properties": {
            "code": {"type": "string", "title": "Code"},
            "message": {"type": "string", "title": "Message"},
            "detail": {"type": "object", "title": "Detail", "additionalProperties": True},
        },
        "required": ["code", "message", "detail"],
        "additionalProperties": False,
    }


def error_responses(doc: RouteDoc) -> dict[str, dict[str, Any]]:
    """The OpenAPI responses of a route's errors: one per status, codes narrowed to its own."""
    by_status: dict[int, list[type[KVCMError]]] = {}
    for cls in doc.error_classes():
        by_status.setdefault(cls.status, []).append(cls)
    out: dict[str, dict[str, Any]] = {}
    for status, classes in by_status.items():
        codes = list(dict.fromkeys(cls.code for cls in classes))
        out[str(status)] = {
            "description": "; ".join(f"`{cls.code}`: {describe(cls, doc)}" for cls in classes),
            "content": {
                _JSON: {
                    "schema": {
                        "allOf": [{"$ref": f"#/components/schemas/{ERROR_SCHEMA}"}],
                        "properties": {"code": {"enum": codes}},
                    }
                }
            },
        }
    return out


def documented_statuses(schema: dict[str, Any], method: str, path: str) -> dict[int, set[str]]:
    """Status -> error codes a route's document lists (empty set: not an error response)."""
    out: dict[int, set[str]] = {}
    responses = schema["paths"][path][method.lower()]["responses"]
    for status, response in responses.items():
        body = response.get("content", {}).get(_JSON, {}).get("schema", {})
        out[int(status)] = set(body.get("properties", {}).get("code", {}).get("enum", []))
    return out


def build(
    app: FastAPI,
    bodies: dict[str, type[BaseModel]],
    auth_required: bool,
    routes: dict[tuple[str, str], RouteDoc] | None = None,
) -> dict[str, Any]:
    """The OpenAPI document of ``app``; ``bodies``: raw-body routes' request models by path;
    ``routes``: the app's table (the sidecar's ``ROUTES`` by default; the router has its own).

    ``auth_required``: the service runs with a token, so the guarded routes' bearer
    requirement is a must (without a token it is optional: any or no header is accepted).
    """
    schema = get_openapi(
        title=app.title,
        version=app.version,
        summary=app.summary,
        description=app.description,
        routes=app.routes,
    )
    components = schema.setdefault("components", {}).setdefault("schemas", {})
    bodies = _documented_bodies(bodies)
    _, defs = models_json_schema(
        [(model, "validation") for model in bodies.values()],
        ref_template="#/components/schemas/{model}",
    )
    for name, body_schema in defs.get("$defs", {}).items():
        components.setdefault(name, body_schema)
    components[ERROR_SCHEMA] = error_schema()
    schema["components"]["securitySchemes"] = {
        BEARER: {
            "type": "http",
            "scheme": "bearer",
            "description": "KVCM_API_TOKEN; needed only when the service runs with one",
        }
    }
    table = ROUTES if routes is None else routes
    seen: set[tuple[str, str]] = set()
    for path, item in schema["paths"].items():
        for method, operation in item.items():
            key = (method.upper(), path)
            doc = table.get(key)
            if doc is None:
                raise RuntimeError(f"{method.upper()} {path} has no entry in its ROUTES table")
            seen.add(key)
            body = bodies.get(path) if method == "post" else None  # bodies are POSTs'
            _document(operation, doc, body, auth_required)
    missing = set(table) - seen
    if missing:
        raise RuntimeError(f"the ROUTES table names routes the app lacks: {sorted(missing)}")
    if routes is None:  # the sidecar's document: its query parameters' limits
        _query_limits(schema)
    for name in ("HTTPValidationError", "ValidationError"):
        components.pop(name, None)
    text = json.dumps(schema)
    if "HTTPValidationError" in text:  # pragma: no cover - a route of FastAPI's own making
        raise RuntimeError("the document still refers to HTTPValidationError")
    return schema


def _documented_bodies(bodies: dict[str, type[BaseModel]]) -> dict[str, type[BaseModel]]:
    """``bodies`` with ``DOCUMENTED_BODIES``' models where a route parses the model they
    refine (a route that parses another model keeps it: the refinement no longer holds)."""
    out = dict(bodies)
    for path, (parsed, documented) in DOCUMENTED_BODIES.items():
        if out.get(path) is parsed:
            out[path] = documented
    return out


def _query_limits(schema: dict[str, Any]) -> None:
    """Add ``QUERY_LIMITS`` to the query parameters' schemas (the integer or string branch
    of an optional one's ``anyOf``, so that leaving it out stays valid)."""
    for (method, path), limits in QUERY_LIMITS.items():
        operation = schema["paths"].get(path, {}).get(method.lower())
        if operation is None:
            raise RuntimeError(f"QUERY_LIMITS names {method} {path}, which the app lacks")
        params = {p["name"]: p for p in operation.get("parameters", []) if p["in"] == "query"}
        for name, keywords in limits.items():
            param = params.get(name)
            if param is None:
                raise RuntimeError(f"QUERY_LIMITS names {method} {path}?{name}, which it lacks")
            keywords = dict(keywords)
            if "description" in keywords:
                param["description"] = keywords.pop("description")
            value = param["schema"]
            branches = [b for b in value.get("anyOf", [value]) if b.get("type") != "null"]
            for branch in branches:
                branch.update(keywords)


def _document(
    operation: dict[str, Any],
    doc: RouteDoc,
    body: type[BaseModel] | None,
    auth_required: bool,
) -> None:
    if doc.body != (body is not None):
        raise RuntimeError(f"{operation.get('operationId')}: ROUTES and the body models differ")
    if body is not None:
        operation["requestBody"] = {
            "required": doc.body_required,
            "content": {_JSON: {"schema": {"$ref": f"#/components/schemas/{body.__name__}"}}},
        }
    responses = {
        status: response
        for status, response in operation.get("responses", {}).items()
        if int(status) < 400
    }
    for status, response in (doc.extra or {}).items():
        responses[str(status)] = response
    responses.update(error_responses(doc))
    operation["responses"] = dict(sorted(responses.items()))
    if doc.auth:
        operation["security"] = [{BEARER: []}] if auth_required else [{BEARER: []}, {}]
    if doc.session:
        operation.setdefault("parameters", []).append(
            {
                "name": SESSION_HEADER,
                "in": "header",
                "required": False,
                "schema": {"type": "string"},
                "description": "A lease session id (POST /v1/sessions): renews it, and "
                "requests allocated with it belong to it",
            }
        )


def install(
    app: FastAPI,
    bodies: dict[str, type[BaseModel]],
    auth_required: bool,
    routes: dict[tuple[str, str], RouteDoc] | None = None,
) -> None:
    """Serve the document at ``app.openapi_url`` and the offline docs page at ``/docs``."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            app.openapi_schema = build(app, bodies, auth_required, routes)
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
    openapi()  # now: a route missing from ROUTES fails create_app, not a later /openapi.json
    page = files(__package__).joinpath("docs.html").read_text(encoding="utf-8")

    @app.get("/docs", include_in_schema=False)
    async def docs(request: Request) -> HTMLResponse:
        root = request.scope.get("root_path", "").rstrip("/")
        url = json.dumps(f"{root}{app.openapi_url}")
        return HTMLResponse(page.replace("__OPENAPI_URL__", url.replace("<", "\\u003c")))

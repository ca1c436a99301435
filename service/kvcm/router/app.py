"""The router's HTTP service: ``POST /v1/route``, ``GET /v1/sidecars``, probes and metrics.

Errors are the sidecar's: ``{code, message, detail}`` with the error's status (400
malformed JSON, 413 a body over the limit, 422 invalid arguments, 503 ``no_model`` before
any sidecar told the router its model, 503 ``index_unavailable`` while Redis cannot be
reached). ``ROUTES`` documents them (``kvcm.server.openapi``), and tests/test_router.py
provokes each. Nothing here changes a sidecar or reveals a prompt (scores only), so the
routes need no token; bind to loopback (the default) or a private network.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.responses import PlainTextResponse, Response
from pydantic import BaseModel, ValidationError

from kvcm_client.errors import (
    IndexUnavailable,
    NoModel,
    invalid_from_validation,
)
from kvcm_client.models import Health
from kvcm_client.routing import RouteRequest, RouteResult, Sidecars

from ..server import openapi
from ..server.errors import JSON, install_error_handlers
from ..server.middleware import BodyLimit
from .service import Router

log = logging.getLogger("kvcm.router")

#: Room for a prompt of about 500k tokens of 6-digit ids.
DEFAULT_BODY_LIMIT = 4 << 20
#: Bodies larger than this are parsed in a worker thread (as the sidecar's).
OFFLOAD_BYTES = 256 << 10

_NOT_READY = {
    503: {
        "description": "Not ready: the index store cannot be reached (status `not_ready`), "
        "or no sidecar told the router its model yet (status `no_model`)",
        "content": {JSON: {"schema": {"$ref": "#/components/schemas/Health"}}},
    }
}
_NO_MODEL_NOTE = (
    NoModel,
    "no sidecar has told the router its model yet, so it cannot hash prompts as they do",
)

#: What each route can answer besides success (``kvcm.server.openapi.RouteDoc``).
ROUTES: dict[tuple[str, str], openapi.RouteDoc] = {
    ("POST", "/v1/route"): openapi.RouteDoc(
        (NoModel, IndexUnavailable), body=True, generation=False, notes=(_NO_MODEL_NOTE,)
    ),
    ("GET", "/v1/sidecars"): openapi.RouteDoc(generation=False),
    ("GET", "/livez"): openapi.RouteDoc(generation=False),
    ("GET", "/readyz"): openapi.RouteDoc(generation=False, extra=_NOT_READY),
    ("GET", "/metrics"): openapi.RouteDoc(generation=False),
}


def _parse(data: bytes) -> RouteRequest:
    try:
        return RouteRequest.model_validate_json(data)
    except ValidationError as exc:
        raise invalid_from_validation(exc.errors()) from None


def _json(model: BaseModel, status: int = 200) -> Response:
    return Response(model.model_dump_json().encode(), status_code=status, media_type=JSON)


def create_router_app(router: Router, *, max_body_bytes: int = DEFAULT_BODY_LIMIT) -> FastAPI:
    """The app over ``router``; its lifespan starts and stops the followers."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await router.start()
        log.info("kvcm router up: following %d sidecars", len(router.followers))
        try:
            yield
        finally:
            await router.stop()

    app = FastAPI(
        title="kvcm router",
        version="1",
        summary="Scores kvcm sidecars by the prefix of a prompt they cache",
        lifespan=lifespan,
        docs_url=None,
        redoc_url=None,
    )
    app.state.router = router

    @app.post("/v1/route", response_model=RouteResult, tags=["routing"])
    async def route(request: Request) -> Response:
        """Each followed sidecar's hits for a prompt and its load, best first."""
        data = await request.body()
        # A long prompt's parse (~5 ms for 128k tokens) in a worker thread: the event loop
        # keeps writing the followers' events meanwhile (as the sidecar's large bodies).
        body = await asyncio.to_thread(_parse, data) if len(data) > OFFLOAD_BYTES else _parse(data)
        return _json(await router.route(body))

    @app.get("/v1/sidecars", response_model=Sidecars, tags=["routing"])
    async def sidecars() -> Response:
        """How the router follows each sidecar."""
        return _json(router.sidecars())

    @app.get("/livez", response_model=Health, tags=["probes"])
    async def livez() -> Response:
        return _json(Health(status="ok"))

    @app.get("/readyz", response_model=Health, tags=["probes"])
    async def readyz() -> Response:
        """200 once the router can score: its index store answers and it knows the model."""
        if router.store_error is not None:
            return _json(Health(status="not_ready", detail=router.store_error), 503)
        if router.gate.space is None:
            return _json(Health(status="no_model", detail=_NO_MODEL_NOTE[1]), 503)
        return _json(Health(status="ok"))

    @app.get("/metrics", tags=["probes"], response_class=PlainTextResponse)
    async def metrics() -> Response:
        return Response(router.metrics.render(), media_type="text/plain; version=0.0.4")

    install_error_handlers(app, log)

    openapi.install(app, {"/v1/route": RouteRequest}, auth_required=False, routes=ROUTES)
    app.add_middleware(BodyLimit, limit=lambda: max_body_bytes)
    return app

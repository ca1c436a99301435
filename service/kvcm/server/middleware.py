"""ASGI middleware: the service generation, the request-body size limit and the per-route
HTTP counter.

Both are plain ASGI (no ``BaseHTTPMiddleware``), so they add a few microseconds, not a task
per request.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import TYPE_CHECKING

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from kvcm_client.errors import PayloadTooLarge, StaleGeneration

if TYPE_CHECKING:  # the router uses this module without the manager (and torch)
    from .metrics import Metrics


async def _send_error(
    send: Send,
    status: int,
    body: dict[str, object],
    extra: list[tuple[bytes, bytes]] | None = None,
) -> None:
    payload = json.dumps(body).encode()
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(payload)).encode()),
                *(extra or []),
            ],
        }
    )
    await send({"type": "http.response.body", "body": payload})


#: Header with the service generation: on every response, and on requests of clients that
#: pinned one (a restart of the service cannot go unnoticed).
GENERATION_HEADER = "x-kvcm-generation"


class Generation:
    """Stamp every response with the service generation; refuse (409 ``stale_generation``)
    a request that names another one, before the route runs, so a client that has not noticed
    a restart (or a newly registered model) never applies an op to the new state.

    ``generation`` gives the generation now: a registration changes it, and its answer already
    carries the new one (the header is read when the response starts)."""

    def __init__(self, app: ASGIApp, generation: Callable[[], str]) -> None:
        self.app = app
        self.generation = generation

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        name = GENERATION_HEADER.encode()
        current = self.generation().encode()
        for header, value in scope["headers"]:
            if header == name and value != current:
                shown = value[:32].decode(errors="replace")
                err = StaleGeneration(
                    f"this client pinned generation {shown!r}; the service is now "
                    f"{current[:12].decode()} (restarted, or a new model was registered): "
                    "reconnect (docs/service.md)",
                    generation=shown,
                )
                await _send_error(send, err.status, err.to_dict(), [(name, current)])
                return

        async def stamped(message: Message) -> None:
            if message["type"] == "http.response.start":
                stamp = (name, self.generation().encode())
                message["headers"] = [*message.get("headers", []), stamp]
            await send(message)

        await self.app(scope, receive, stamped)


class BodyLimit:
    """Refuse bodies over ``limit()`` bytes with 413 ``payload_too_large``.

    A declared Content-Length over the limit is refused before the body is read; a chunked
    body is counted as it arrives and refused once it passes the limit. The limit is read per
    request: by default it follows the model's ``max_seq_len``, which a registration changes.
    """

    def __init__(self, app: ASGIApp, limit: Callable[[], int]) -> None:
        self.app = app
        self.limit = limit

    def _error(self, limit: int, size: int | None) -> PayloadTooLarge:
        return PayloadTooLarge(f"request body over the {limit}-byte limit", limit=limit, size=size)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        limit = self.limit()
        for name, value in scope["headers"]:
            if name == b"content-length":
                try:
                    declared = int(value)
                except ValueError:
                    declared = 0
                if declared > limit:
                    await _send_error(send, 413, self._error(limit, declared).to_dict())
                    return
        received = 0

        async def counted() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:
                    raise self._error(limit, None)
            return message

        await self.app(scope, counted, send)


class CountResponses:
    """``kvcm_http_requests_total{route, status}`` by route template (not raw path)."""

    def __init__(self, app: ASGIApp, metrics: Metrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = 500

        async def watch(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, watch)
        finally:
            route = scope.get("route")
            path = getattr(route, "path", "unmatched")
            self.metrics.http.labels(path, str(status)).inc()

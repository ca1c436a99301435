"""ASGI middleware: the service generation, the request-body size limit and the per-route
HTTP counter.

Both are plain ASGI (no ``BaseHTTPMiddleware``), so they add a few microseconds, not a task
per request.
"""

from __future__ import annotations

import json

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from kvcm_client.errors import PayloadTooLarge, StaleGeneration

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
    a restart never applies an op to the new service's state."""

    def __init__(self, app: ASGIApp, generation: str) -> None:
        self.app = app
        self.generation = generation.encode()
        self.header = (GENERATION_HEADER.encode(), self.generation)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        for name, value in scope["headers"]:
            if name == self.header[0] and value != self.generation:
                shown = value[:32].decode(errors="replace")
                err = StaleGeneration(
                    f"this client pinned generation {shown!r}; the service restarted as "
                    f"{self.generation[:12].decode()}: reconnect (docs/service.md)",
                    generation=shown,
                )
                await _send_error(send, err.status, err.to_dict(), [self.header])
                return

        async def stamped(message: Message) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", []), self.header]
            await send(message)

        await self.app(scope, receive, stamped)


class BodyLimit:
    """Refuse bodies over ``limit`` bytes with 413 ``payload_too_large``.

    A declared Content-Length over the limit is refused before the body is read; a chunked
    body is counted as it arrives and refused once it passes the limit.
    """

    def __init__(self, app: ASGIApp, limit: int) -> None:
        self.app = app
        self.limit = limit

    def _error(self, size: int | None) -> PayloadTooLarge:
        return PayloadTooLarge(
            f"request body over the {self.limit}-byte limit", limit=self.limit, size=size
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        for name, value in scope["headers"]:
            if name == b"content-length":
                try:
                    declared = int(value)
                except ValueError:
                    declared = 0
                if declared > self.limit:
                    await _send_error(send, 413, self._error(declared).to_dict())
                    return
        received = 0

        async def counted() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.limit:
                    raise self._error(None)
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

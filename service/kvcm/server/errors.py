"""Errors as JSON answers with a stable ``code``, and the exception handlers that make every
failure one: shared by the sidecar's app and the router's (which loads no torch, so nothing
here imports the manager)."""

from __future__ import annotations

import json
import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from kvcm_client.errors import (
    InternalError,
    KVCMError,
    MethodNotAllowed,
    NotFound,
    invalid_from_validation,
)

JSON = "application/json"


def error_response(exc: KVCMError) -> Response:
    """``exc`` as its JSON body (code, message, detail) with its HTTP status."""
    body = json.dumps(exc.to_dict(), default=str).encode()
    return Response(body, status_code=exc.status, media_type=JSON)


def install_error_handlers(app: FastAPI, log: logging.Logger) -> None:
    """Typed errors, validation failures, unknown routes and methods, and anything else an
    endpoint raises, as ``error_response``s (an unexpected one logged with its traceback,
    answered without it)."""

    @app.exception_handler(KVCMError)
    async def kvcm_error(_: Request, exc: KVCMError) -> Response:
        return error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def invalid(_: Request, exc: RequestValidationError) -> Response:
        return error_response(invalid_from_validation(list(exc.errors())))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> Response:
        if exc.status_code == 404:
            return error_response(NotFound(f"no route {request.url.path}"))
        if exc.status_code == 405:
            answer = error_response(
                MethodNotAllowed(f"{request.method} is not allowed on {request.url.path}")
            )
            answer.headers.update(exc.headers or {})  # Allow: the methods the path takes
            return answer
        err = KVCMError(str(exc.detail))
        err.status = exc.status_code  # type: ignore[misc]
        return error_response(err)

    @app.exception_handler(ClientDisconnect)
    async def gone(request: Request, _: ClientDisconnect) -> Response:
        # The client went away (or was cut off mid-body): nobody reads this, and it is no bug.
        log.debug("client left during %s %s", request.method, request.url.path)
        return Response(status_code=400)

    @app.exception_handler(Exception)
    async def internal(request: Request, exc: Exception) -> Response:
        log.exception("internal error on %s %s", request.method, request.url.path)
        return error_response(InternalError(f"internal error: {type(exc).__name__}"))

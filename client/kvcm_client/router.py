"""``RouterClient`` and ``AsyncRouterClient``: ask a ``kvcm router`` which sidecar holds most
of a prompt (docs/router.md). httpx and pydantic only: a scheduler or a gateway installs
``kvcm-client`` alone.

    with RouterClient("http://127.0.0.1:8480") as router:
        best = router.route(token_ids=prompt, cache_salt="tenant-a").scores[0]
        print(best.url, best.hit_tokens)

Both calls only read, so a call whose connection failed is resent (``retries`` times, with
a doubling ``backoff_s``); then it raises ``ServiceUnavailable``. Errors are the typed
``kvcm_client.errors`` of the router's answer (``invalid_argument``, ``no_model``,
``index_unavailable``, ...).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from typing import Any, TypeVar

import httpx

from . import _calls as calls
from .errors import ServiceUnavailable
from .routing import RouteResult, Sidecars, SidecarStatus

T = TypeVar("T")

DEFAULT_ROUTER_URL = "http://127.0.0.1:8480"


def _route(
    token_ids: Sequence[int] | None,
    block_keys: Sequence[bytes | str] | None,
    lora_id: int | str | None,
    cache_salt: str | None,
    multimodal: Sequence[Any] | None,
    fetch_plan: bool = False,
) -> calls.Call[RouteResult]:
    body = calls.prompt_body(token_ids, lora_id, cache_salt, multimodal, block_keys)
    if fetch_plan:
        body["fetch_plan"] = True
    return calls.Call(
        "POST",
        "/v1/route",
        RouteResult.model_validate_json,
        calls.encode(body),
        idempotent=True,
    )


def _sidecars() -> calls.Call[list[SidecarStatus]]:
    return calls.Call(
        "GET",
        "/v1/sidecars",
        lambda raw: Sidecars.model_validate_json(raw).sidecars,
        idempotent=True,
    )


def _unavailable(call: calls.Call[Any], exc: httpx.TransportError, attempts: int) -> Exception:
    return ServiceUnavailable(
        f"{call.method} {call.path} failed after {attempts} attempt(s): "
        f"{type(exc).__name__}: {exc}",
        path=call.path,
        attempts=attempts,
    )


_HEADERS = {"content-type": "application/json"}


class RouterClient:
    """Blocking client of one router."""

    def __init__(
        self,
        base_url: str = DEFAULT_ROUTER_URL,
        *,
        timeout: float = 10.0,
        retries: int = 2,
        backoff_s: float = 0.05,
    ) -> None:
        self._http = httpx.Client(base_url=base_url.rstrip("/"), timeout=timeout)
        self.retries = retries
        self.backoff_s = backoff_s

    def __enter__(self) -> RouterClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._http.close()

    def _run(self, call: calls.Call[T]) -> T:
        for attempt in range(self.retries + 1):
            try:
                resp = self._http.request(
                    call.method, call.path, content=call.body, headers=_HEADERS
                )
                break
            except httpx.TransportError as exc:
                if attempt == self.retries:
                    raise _unavailable(call, exc, attempt + 1) from exc
                time.sleep(self.backoff_s * 2**attempt)
        calls.raise_for_status(resp.status_code, resp.content)
        return call.parse(resp.content)

    def route(
        self,
        token_ids: Sequence[int] | None = None,
        *,
        block_keys: Sequence[bytes | str] | None = None,
        lora_id: int | str | None = None,
        cache_salt: str | None = None,
        multimodal: Sequence[Any] | None = None,
        fetch_plan: bool = False,
    ) -> RouteResult:
        """Each followed sidecar's score for the prompt, best first (``RouteResult``);
        ``fetch_plan``: also where to run it by load and what to fetch from which peer
        (``RouteResult.plan``, docs/disaggregation.md)."""
        return self._run(_route(token_ids, block_keys, lora_id, cache_salt, multimodal, fetch_plan))

    def sidecars(self) -> list[SidecarStatus]:
        """How the router follows each sidecar it was given."""
        return self._run(_sidecars())


class AsyncRouterClient:
    """The same over ``httpx.AsyncClient``."""

    def __init__(
        self,
        base_url: str = DEFAULT_ROUTER_URL,
        *,
        timeout: float = 10.0,
        retries: int = 2,
        backoff_s: float = 0.05,
    ) -> None:
        self._http = httpx.AsyncClient(base_url=base_url.rstrip("/"), timeout=timeout)
        self.retries = retries
        self.backoff_s = backoff_s

    async def __aenter__(self) -> AsyncRouterClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        await self._http.aclose()

    async def _run(self, call: calls.Call[T]) -> T:
        for attempt in range(self.retries + 1):
            try:
                resp = await self._http.request(
                    call.method, call.path, content=call.body, headers=_HEADERS
                )
                break
            except httpx.TransportError as exc:
                if attempt == self.retries:
                    raise _unavailable(call, exc, attempt + 1) from exc
                await asyncio.sleep(self.backoff_s * 2**attempt)
        calls.raise_for_status(resp.status_code, resp.content)
        return call.parse(resp.content)

    async def route(
        self,
        token_ids: Sequence[int] | None = None,
        *,
        block_keys: Sequence[bytes | str] | None = None,
        lora_id: int | str | None = None,
        cache_salt: str | None = None,
        multimodal: Sequence[Any] | None = None,
        fetch_plan: bool = False,
    ) -> RouteResult:
        return await self._run(
            _route(token_ids, block_keys, lora_id, cache_salt, multimodal, fetch_plan)
        )

    async def sidecars(self) -> list[SidecarStatus]:
        return await self._run(_sidecars())

"""What both clients share: the service's headers, the retry rule of a call that failed in
transit, timeouts, and the generation a client pins (``KVCacheClient``, ``AsyncKVCacheClient``).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from itertools import chain, repeat
from pathlib import Path
from typing import Any

import httpx

from . import _calls as calls
from .errors import (
    ModelWaitTimeout,
    ServiceUnavailable,
    StaleGeneration,
    UnknownSession,
)

DEFAULT_URL = "http://127.0.0.1:8470"
SESSION_HEADER = "X-KVCM-Session"
#: The service generation: answered on every response; sent back once pinned (see pin).
GENERATION_HEADER = "X-KVCM-Generation"
NEVER_SENT = (httpx.ConnectError, httpx.ConnectTimeout, httpx.PoolTimeout)


def token_or_env(token: str | None) -> str | None:
    return token if token is not None else os.environ.get("KVCM_API_TOKEN")


def base_and_headers(
    base_url: str, uds: str | Path | None, token: str | None
) -> tuple[str, dict[str, str]]:
    token = token_or_env(token)
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    return ("http://kvcm" if uds is not None else base_url.rstrip("/")), headers


def retryable(exc: httpx.TransportError, call: calls.Call[Any]) -> bool:
    return isinstance(exc, NEVER_SENT) or call.idempotent


def unavailable(exc: httpx.TransportError, call: calls.Call[Any], attempts: int) -> Exception:
    return ServiceUnavailable(
        f"{call.method} {call.path} failed after {attempts} attempt(s): "
        f"{type(exc).__name__}: {exc}",
        path=call.path,
        attempts=attempts,
    )


def call_timeout(default: httpx.Timeout, call: calls.Call[Any]) -> httpx.Timeout:
    """The client's timeouts, with a long-poll's wait added to the read timeout."""
    if not call.wait_s or default.read is None:
        return default
    return httpx.Timeout(
        connect=default.connect,
        read=default.read + call.wait_s,
        write=default.write,
        pool=default.pool,
    )


def call_headers(session_id: str | None, generation: str | None) -> dict[str, str]:
    headers = {"content-type": "application/json"}
    if session_id:
        headers[SESSION_HEADER] = session_id
    if generation:
        headers[GENERATION_HEADER] = generation
    return headers


def generation_after(call: calls.Call[Any], pinned: str | None, answered: str | None) -> str | None:
    """The generation to keep after an answer: the answer's after a registration, else
    ``pin``'s."""
    if call.repins and answered is not None:
        return answered
    return pin(pinned, answered)


def pin(pinned: str | None, answered: str | None) -> str | None:
    """The generation to keep: the first one a service answered with. Requests carry it, so
    a restarted service refuses them (409 ``stale_generation``) before applying anything;
    this check covers answers that did not go through that check."""
    if answered is None or pinned is None:
        return pinned or answered
    if answered != pinned:
        raise StaleGeneration(
            f"the service restarted (generation {answered[:12]}, this client pinned "
            f"{pinned[:12]}): call reconnect() and rebuild the requests",
            generation=answered,
        )
    return pinned


def check_same_generation(mapped: str, service: str) -> None:
    """An attachment's check: its pools must be the service's now. The client's own pin is
    not enough: a client that registered a model is pinned to the new generation, while
    its earlier attachment still maps the old pools."""
    if mapped != service:
        raise StaleGeneration(
            f"these mappings are of generation {mapped[:12]}; the service is {service[:12]} "
            "(a new model or a restart): close them and attach again",
            generation=service,
        )


def poll_delays() -> Iterator[float]:
    """Seconds between ``wait_for_model``'s polls: 20 ms, doubling up to half a second."""
    return chain((0.02, 0.04, 0.08, 0.16, 0.32), repeat(0.5))


def wait_timeout_error(timeout_s: float, last: Exception) -> ModelWaitTimeout:
    return ModelWaitTimeout(
        f"the service had no model after {timeout_s} s (last answer: {last})",
        timeout_s=timeout_s,
        last_code=getattr(last, "code", None),
    )


def given_fields(given: dict[str, Any]) -> dict[str, Any]:
    """A method's keyword arguments as a body's fields (``self`` is not one)."""
    return {k: v for k, v in given.items() if k != "self"}


def require_session(session_id: str | None) -> str:
    if session_id is None:
        raise UnknownSession("no session on this client: call open_session() first")
    return session_id

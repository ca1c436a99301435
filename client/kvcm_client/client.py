"""``KVCacheClient`` and ``AsyncKVCacheClient``: the manager's API over HTTP.

Method names, parameters and exceptions are those of ``kvcm.KVCacheManager``, so a scheduler
can swap the in-process manager for the sidecar. Tables come back as lists of ints (the client
needs no torch): ``page_indices`` is ``list[list[int]]`` where the manager returns an int32
tensor, ``slot_mapping`` a ``list[int]``.

With ``step_socket`` (``kvcm serve --step-socket``) the clients send the step-path calls
(``step``, ``extend_many``, ``slot_mapping(s)``, ``probe``, ``allocate``, ``extend``,
``rewind``, ``commit``, ``free``) over that Unix socket as msgpack frames instead, with the
same results and errors (docs/step-channel.md); the async client does the same on an asyncio
stream.

Connections are kept alive (one pool per client). A call that fails to connect is retried (it
never reached the service); a call whose connection broke after it was sent is retried only if
the op is idempotent (reads, and ``allocate``, which the manager makes idempotent). When the
retries run out the call raises ``ServiceUnavailable``.

    with KVCacheClient("http://127.0.0.1:8470") as kv:
        kv.allocate("r1", 100)
        kv.step([{"op": "extend", "request_id": "r1", "num_new_tokens": 1}])
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections.abc import AsyncIterator, Iterator, Sequence
from itertools import chain, repeat
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, TypeVar

import httpx

from . import _calls as calls
from . import step_channel as channel
from .columns import StepColumnsResult, wire_columns
from .errors import (
    ModelWaitTimeout,
    NoModel,
    ServiceUnavailable,
    StaleGeneration,
    UnknownConsumer,
    UnknownSession,
)
from .models import (
    ConsumerInfo,
    DType,
    Estimate,
    IndexSnapshot,
    KVEvents,
    LayerSpec,
    Layout,
    ModelInfo,
    OpResult,
    RequestInfo,
    SessionClosed,
    SessionInfo,
    SharedLayout,
    Stats,
)
from .state import StateLayerSpec

if TYPE_CHECKING:
    from .shared import Attachment

T = TypeVar("T")

DEFAULT_URL = "http://127.0.0.1:8470"
SESSION_HEADER = "X-KVCM-Session"
#: The service generation: answered on every response; sent back once pinned (see _pin).
GENERATION_HEADER = "X-KVCM-Generation"
_NEVER_SENT = (httpx.ConnectError, httpx.ConnectTimeout, httpx.PoolTimeout)


def _token(token: str | None) -> str | None:
    return token if token is not None else os.environ.get("KVCM_API_TOKEN")


def _setup(base_url: str, uds: str | Path | None, token: str | None) -> tuple[str, dict[str, str]]:
    token = _token(token)
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    return ("http://kvcm" if uds is not None else base_url.rstrip("/")), headers


def _retryable(exc: httpx.TransportError, call: calls.Call[Any]) -> bool:
    return isinstance(exc, _NEVER_SENT) or call.idempotent


def _unavailable(exc: httpx.TransportError, call: calls.Call[Any], attempts: int) -> Exception:
    return ServiceUnavailable(
        f"{call.method} {call.path} failed after {attempts} attempt(s): "
        f"{type(exc).__name__}: {exc}",
        path=call.path,
        attempts=attempts,
    )


def _timeout(default: httpx.Timeout, call: calls.Call[Any]) -> httpx.Timeout:
    """The client's timeouts, with a long-poll's wait added to the read timeout."""
    if not call.wait_s or default.read is None:
        return default
    return httpx.Timeout(
        connect=default.connect,
        read=default.read + call.wait_s,
        write=default.write,
        pool=default.pool,
    )


def _headers(session_id: str | None, generation: str | None) -> dict[str, str]:
    headers = {"content-type": "application/json"}
    if session_id:
        headers[SESSION_HEADER] = session_id
    if generation:
        headers[GENERATION_HEADER] = generation
    return headers


def _generation_after(
    call: calls.Call[Any], pinned: str | None, answered: str | None
) -> str | None:
    """The generation to keep after an answer: the answer's after a registration, else
    ``_pin``'s."""
    if call.repins and answered is not None:
        return answered
    return _pin(pinned, answered)


def _pin(pinned: str | None, answered: str | None) -> str | None:
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


def _same_generation(mapped: str, service: str) -> None:
    """An attachment's check: its pools must be the service's now. The client's own pin is
    not enough: a client that registered a model is pinned to the new generation, while
    its earlier attachment still maps the old pools."""
    if mapped != service:
        raise StaleGeneration(
            f"these mappings are of generation {mapped[:12]}; the service is {service[:12]} "
            "(a new model or a restart): close them and attach again",
            generation=service,
        )


def _poll_delays() -> Iterator[float]:
    """Seconds between ``wait_for_model``'s polls: 20 ms, doubling up to half a second."""
    return chain((0.02, 0.04, 0.08, 0.16, 0.32), repeat(0.5))


def _wait_timeout(timeout_s: float, last: Exception) -> ModelWaitTimeout:
    return ModelWaitTimeout(
        f"the service had no model after {timeout_s} s (last answer: {last})",
        timeout_s=timeout_s,
        last_code=getattr(last, "code", None),
    )


def _fields(given: dict[str, Any]) -> dict[str, Any]:
    """A method's keyword arguments as a body's fields (``self`` is not one)."""
    return {k: v for k, v in given.items() if k != "self"}


def _session(session_id: str | None) -> str:
    if session_id is None:
        raise UnknownSession("no session on this client: call open_session() first")
    return session_id


class KVCacheClient:
    """Blocking client. Not thread-safe across sessions; one client per scheduler thread."""

    def __init__(
        self,
        base_url: str = DEFAULT_URL,
        *,
        uds: str | Path | None = None,
        step_socket: str | Path | None = None,
        token: str | None = None,
        timeout: float = 10.0,
        retries: int = 2,
        backoff_s: float = 0.05,
    ) -> None:
        """``step_socket``: the service's step channel (``kvcm serve --step-socket``); the
        step-path methods (``step``, ``extend_many``, ``slot_mapping(s)``, ``probe``,
        ``allocate``, ``extend``, ``rewind``, ``commit``, ``free``) go over it, the rest
        over HTTP (docs/step-channel.md)."""
        url, headers = _setup(base_url, uds, token)
        self._token = _token(token)
        self._channel = (
            None
            if step_socket is None
            else channel.StepSocket(str(step_socket), timeout, retries, backoff_s)
        )
        transport = httpx.HTTPTransport(uds=str(uds)) if uds is not None else None
        self._http = httpx.Client(
            base_url=url,
            headers=headers,
            timeout=timeout,
            transport=transport,
            limits=httpx.Limits(max_keepalive_connections=4, keepalive_expiry=60),
        )
        self.retries = retries
        self.backoff_s = backoff_s
        self.session_id: str | None = None
        #: The service generation this client pinned (the first one it saw); see reconnect().
        self.generation: str | None = None

    def __enter__(self) -> KVCacheClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._http.close()
        if self._channel is not None:
            self._channel.close()

    def _fast(self, call: channel.StepCall[T], fallback: calls.Call[T] | None) -> T:
        """``call`` over the step channel if this client has one, else ``fallback`` (HTTP)."""
        if self._channel is None:
            assert fallback is not None
            return self._run(fallback)
        header = {"session": self.session_id, "generation": self.generation, "token": self._token}
        answer = self._channel.call(call, {k: v for k, v in header.items() if v is not None})
        result = channel.result_of(call, answer)
        self.generation = _pin(self.generation, answer.get("generation"))
        return result

    def _run(self, call: calls.Call[T]) -> T:
        headers = _headers(self.session_id, self.generation if call.pinned else None)
        for attempt in range(self.retries + 1):
            try:
                resp = self._http.request(
                    call.method,
                    call.path,
                    content=call.body,
                    params=call.params,
                    headers=headers,
                    timeout=_timeout(self._http.timeout, call),
                )
                break
            except httpx.TransportError as exc:
                if attempt == self.retries or not _retryable(exc, call):
                    raise _unavailable(exc, call, attempt + 1) from exc
                time.sleep(self.backoff_s * 2**attempt)
        calls.raise_for_status(resp.status_code, resp.content)
        answered = resp.headers.get(GENERATION_HEADER)
        self.generation = _generation_after(call, self.generation, answered)
        return call.parse(resp.content)

    # -- the manager's methods -----------------------------------------------------------------

    def allocate(
        self,
        request_id: str,
        num_tokens: int,
        token_ids: Sequence[int] | None = None,
        lookahead: int = 0,
        lora_id: int | str | None = None,
        cache_salt: str | None = None,
        multimodal: Sequence[Any] | None = None,
        block_keys: Sequence[bytes | str] | None = None,
    ) -> RequestInfo:
        given = (request_id, num_tokens, token_ids, lookahead)
        prompt = (lora_id, cache_salt, multimodal, block_keys)
        return self._fast(channel.allocate(*given, *prompt), calls.allocate(*given, *prompt))

    def probe(
        self,
        token_ids: Sequence[int],
        lora_id: int | str | None = None,
        cache_salt: str | None = None,
        multimodal: Sequence[Any] | None = None,
        block_keys: Sequence[bytes | str] | None = None,
    ) -> int:
        given = (token_ids, lora_id, cache_salt, multimodal, block_keys)
        return self._fast(channel.probe(*given), calls.probe(*given))

    def reset_prefix_cache(self) -> None:
        return self._run(calls.reset_prefix_cache())

    def events(self, after: int = 0, limit: int = 1000, timeout_s: float = 0.0) -> KVEvents:
        """Events after ``after``; with ``timeout_s`` the service waits that long for one."""
        return self._run(calls.events(after, limit, timeout_s))

    def index_snapshot(self) -> IndexSnapshot:
        """Every block key cached now, per layer group and tier, and the sequence number of
        the last event it includes (``KVCacheManager.index_snapshot``)."""
        return self._run(calls.index_snapshot())

    def follow_events(self, after: int = 0, timeout_s: float = 10.0) -> Iterator[KVEvents]:
        """Long-poll forever: each batch of new events as it comes (empty ones skipped)."""
        while True:
            batch = self.events(after, timeout_s=timeout_s)
            after = batch.last_seq
            if batch.events or batch.lost:
                yield batch

    def extend(self, request_id: str, num_new_tokens: int, lookahead: int = 0) -> RequestInfo:
        given = (request_id, num_new_tokens, lookahead)
        return self._fast(channel.extend(*given), calls.extend(*given))

    def extend_many(
        self,
        request_ids: Sequence[str],
        num_new_tokens: int | Sequence[int] = 1,
        lookahead: int | Sequence[int] = 0,
    ) -> None:
        given = (request_ids, num_new_tokens, lookahead)
        return self._fast(channel.extend_many(*given), calls.extend_many(*given))

    def rewind(self, request_id: str, num_tokens: int) -> RequestInfo:
        return self._fast(
            channel.rewind(request_id, num_tokens), calls.rewind(request_id, num_tokens)
        )

    def commit(self, request_id: str, token_ids: Sequence[int]) -> RequestInfo:
        return self._fast(
            channel.commit(request_id, token_ids), calls.commit(request_id, token_ids)
        )

    def free(self, request_id: str) -> None:
        return self._fast(channel.free(request_id), calls.free(request_id))

    def step(self, ops: Sequence[Any], atomic: bool = False, brief: bool = False) -> list[OpResult]:
        return self._fast(channel.step(ops, atomic, brief), calls.step(ops, atomic, brief))

    def step_columns(
        self,
        *,
        free: Any = (),
        rewind: Any = (),
        rewind_tokens: Any = 1,
        commit: Any = (),
        commit_tokens: Any = (),
        extend: Any = (),
        num_new_tokens: Any = 1,
        lookahead: Any = 0,
        allocate: Any = (),
        suspend: Any = (),
        resume: Any = (),
        atomic: bool = False,
    ) -> StepColumnsResult:
        """The columnar step (``KVCacheManager.step_columns``; docs/requests.md): requests
        by handle, a status per item, results decoded when read. Over the step channel when
        this client has one (raw int64 arrays), else ``POST /v1/step_columns``."""
        columns = _fields(locals())
        if self._channel is None:
            return self._run(calls.step_columns(columns))
        return self._fast(channel.step_columns(wire_columns(**columns)), None)

    def suspend(self, request_id: str) -> RequestInfo:
        """``KVCacheManager.suspend``: the request's blocks to the host tier."""
        return self._fast(channel.suspend(request_id), calls.suspend(request_id))

    def resume(self, request_id: str) -> RequestInfo:
        """``KVCacheManager.resume``: back into new device slots."""
        return self._fast(channel.resume(request_id), calls.resume(request_id))

    def probe_tiers(
        self,
        token_ids: Sequence[int],
        lora_id: int | str | None = None,
        cache_salt: str | None = None,
    ) -> tuple[int, int]:
        """``KVCacheManager.probe_tiers``: (device tokens, host tokens) a prompt would reuse."""
        return self._run(calls.probe_tiers(token_ids, lora_id, cache_salt))

    def request(self, request_id: str) -> RequestInfo:
        return self._run(calls.request(request_id))

    def request_ids(self) -> list[str]:
        return self._run(calls.request_ids())

    def block_table(self, request_id: str) -> list[list[int]]:
        return self._run(calls.block_table(request_id))

    def committed_tokens(self, request_id: str) -> list[int]:
        return self._run(calls.committed_tokens(request_id))

    def page_indices(
        self,
        request_ids: Sequence[str],
        layer_id: int,
        role: str = "key",
        mode: Literal["slot", "kernel"] = "slot",
        per_layer: bool = False,
    ) -> list[list[int]]:
        return self._run(calls.page_indices(request_ids, layer_id, role, mode, per_layer))

    def slot_mapping(
        self,
        request_ids: Sequence[str],
        layer_id: int,
        num_tokens: int | Sequence[int] | None = None,
        pad_to: int | None = None,
    ) -> list[int]:
        given = (request_ids, layer_id, num_tokens, pad_to)
        return self._fast(channel.slot_mapping(*given), calls.slot_mapping(*given))

    def slot_mappings(
        self,
        request_ids: Sequence[str],
        num_tokens: int | Sequence[int] | None = None,
        pad_to: int | None = None,
    ) -> list[list[int]]:
        given = (request_ids, None, num_tokens, pad_to)
        return self._fast(channel.slot_mapping(*given), calls.slot_mapping(*given))

    def describe(self) -> Layout:
        return self._run(calls.describe())

    def estimate(
        self,
        seq_len: int,
        num_requests: int | None = None,
        *,
        prefill_chunk: int | None = None,
        lookahead: int | None = None,
    ) -> Estimate:
        return self._run(calls.estimate(seq_len, num_requests, prefill_chunk, lookahead))

    def stats(self) -> Stats:
        return self._run(calls.stats())

    def num_free_blocks(self, pool_group: int | None = None) -> int:
        return calls.free_blocks(self.stats(), pool_group)

    def num_total_blocks(self, pool_group: int | None = None) -> int:
        return calls.total_blocks(self.stats(), pool_group)

    # -- the model -----------------------------------------------------------------------------

    def register_model(
        self,
        *,
        layers: Sequence[LayerSpec | dict[str, Any]] | None = None,
        hf_config: dict[str, Any] | None = None,
        kv_dtype: DType | None = None,
        tensor_parallel: int | None = None,
        memory_bytes: int | None = None,
        num_blocks: int | None = None,
        tokens_per_block: int | None = None,
        max_seq_len: int | None = None,
        max_requests: int | None = None,
        max_prefill_chunk: int | None = None,
        max_lookahead: int | None = None,
        null_page: bool | None = None,
        share: bool | None = None,
        kv_events: bool | None = None,
        host_memory_bytes: int | None = None,
        state_layers: Sequence[StateLayerSpec | dict[str, Any]] | None = None,
        state_checkpoint_stride: int | None = None,
        state_checkpoints: int | None = None,
        state_live_slots: int | None = None,
    ) -> ModelInfo:
        """Register the model (``ModelRegistration``: ``layers`` or ``hf_config``, at most
        one budget; what is left out takes the service's flags). Refused while requests are
        live (``RequestsLive``); a refusal changes nothing. On success the service is in a
        new generation and this client is pinned to it; other clients get
        ``StaleGeneration`` on their next call."""
        return self._run(calls.register_model(_fields(locals())))

    def model(self) -> ModelInfo:
        """The model served now (``NoModel`` if there is none yet)."""
        return self._run(calls.model())

    def wait_for_model(self, timeout_s: float = 60.0) -> Layout:
        """Wait until the service has a model (or is up at all), then return its layout.

        Polls ``GET /v1/model`` (20 ms, doubling up to 0.5 s) without the pinned generation,
        and pins the model's generation if this client had none (a client that pinned
        another gets ``StaleGeneration``: ``reconnect()`` first). ``ModelWaitTimeout`` once
        ``timeout_s`` have passed."""
        deadline = time.monotonic() + timeout_s
        delays = _poll_delays()
        while True:
            try:
                return self._run(calls.model(pinned=False)).layout
            except (NoModel, ServiceUnavailable) as exc:
                last = exc
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise _wait_timeout(timeout_s, last)
            time.sleep(min(next(delays), remaining))

    # -- shared memory (the inference server's side) -------------------------------------------

    def pools(self, rank: int = 0) -> SharedLayout:
        """Descriptors of the service's shared pools and page tables (of rank ``rank`` of a
        tensor- or pipeline-parallel engine: docs/ranks.md)."""
        return self._run(calls.pools(rank))

    def attach(self, rank: int = 0) -> Attachment:
        """Map the pools and page tables (of rank ``rank``) here and register this process
        as a consumer; ``close()`` on the result unregisters it."""
        from .shared import Attachment, require_torch

        require_torch()  # before the service hears of this consumer
        layout = self.pools(rank)
        info = self._run(calls.register_consumer(os.getpid(), layout.generation))
        return Attachment(
            layout,
            on_close=lambda: self._unregister(info.consumer_id),
            check=lambda: _same_generation(layout.generation, self.check_generation()),
        )

    def _unregister(self, consumer_id: str) -> None:
        # Already gone: a retried delete, a consumer the service forgot (thought dead, or of
        # pools a new model replaced), or a service of another generation.
        with contextlib.suppress(UnknownConsumer, StaleGeneration):
            self._run(calls.unregister_consumer(consumer_id))

    def consumers(self) -> list[ConsumerInfo]:
        return self._run(calls.consumers())

    # -- leases --------------------------------------------------------------------------------

    def check_generation(self) -> str:
        """One cheap call (``GET /livez``): the pinned generation, or ``StaleGeneration`` if
        the service restarted since this client pinned it."""
        self._run(calls.livez())
        assert self.generation is not None
        return self.generation

    def reconnect(self) -> None:
        """Forget the pinned generation and the session, after a ``StaleGeneration``: the next
        call pins the new service (docs/service.md has the engine's whole procedure)."""
        self.generation = None
        self.session_id = None

    def open_session(self, ttl_s: float | None = None) -> SessionInfo:
        """Start a lease; later calls renew it and requests allocated here belong to it."""
        info = self._run(calls.open_session(ttl_s))
        self.session_id = info.session_id
        return info

    def renew_session(self) -> SessionInfo:
        return self._run(calls.renew_session(_session(self.session_id)))

    def close_session(self) -> SessionClosed:
        """End the lease now; the service frees its requests."""
        closed = self._run(calls.close_session(_session(self.session_id)))
        self.session_id = None
        return closed

    def commit_many(self, request_ids: Sequence[str], token_ids: Sequence[Sequence[int]]) -> None:
        """``KVCacheManager.commit_many``: one call for a forward pass's commits."""
        self._run(calls.commit_many(request_ids, token_ids))


class AsyncKVCacheClient:
    """The same API as ``KVCacheClient`` with ``async`` methods (httpx.AsyncClient)."""

    def __init__(
        self,
        base_url: str = DEFAULT_URL,
        *,
        uds: str | Path | None = None,
        step_socket: str | Path | None = None,
        token: str | None = None,
        timeout: float = 10.0,
        retries: int = 2,
        backoff_s: float = 0.05,
    ) -> None:
        """As ``KVCacheClient``; the step channel is an asyncio stream."""
        url, headers = _setup(base_url, uds, token)
        self._token = _token(token)
        self._channel = (
            None
            if step_socket is None
            else channel.AsyncStepSocket(str(step_socket), timeout, retries, backoff_s)
        )
        transport = httpx.AsyncHTTPTransport(uds=str(uds)) if uds is not None else None
        self._http = httpx.AsyncClient(
            base_url=url,
            headers=headers,
            timeout=timeout,
            transport=transport,
            limits=httpx.Limits(max_keepalive_connections=16, keepalive_expiry=60),
        )
        self.retries = retries
        self.backoff_s = backoff_s
        self.session_id: str | None = None
        #: The service generation this client pinned (the first one it saw); see reconnect().
        self.generation: str | None = None

    async def __aenter__(self) -> AsyncKVCacheClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        await self._http.aclose()
        if self._channel is not None:
            await self._channel.aclose()

    async def _fast(self, call: channel.StepCall[T], fallback: calls.Call[T] | None) -> T:
        """As ``KVCacheClient._fast``."""
        if self._channel is None:
            assert fallback is not None
            return await self._run(fallback)
        header = {"session": self.session_id, "generation": self.generation, "token": self._token}
        answer = await self._channel.call(call, {k: v for k, v in header.items() if v is not None})
        result = channel.result_of(call, answer)
        self.generation = _pin(self.generation, answer.get("generation"))
        return result

    async def _run(self, call: calls.Call[T]) -> T:
        headers = _headers(self.session_id, self.generation if call.pinned else None)
        for attempt in range(self.retries + 1):
            try:
                resp = await self._http.request(
                    call.method,
                    call.path,
                    content=call.body,
                    params=call.params,
                    headers=headers,
                    timeout=_timeout(self._http.timeout, call),
                )
                break
            except httpx.TransportError as exc:
                if attempt == self.retries or not _retryable(exc, call):
                    raise _unavailable(exc, call, attempt + 1) from exc
                await asyncio.sleep(self.backoff_s * 2**attempt)
        calls.raise_for_status(resp.status_code, resp.content)
        answered = resp.headers.get(GENERATION_HEADER)
        self.generation = _generation_after(call, self.generation, answered)
        return call.parse(resp.content)

    async def allocate(
        self,
        request_id: str,
        num_tokens: int,
        token_ids: Sequence[int] | None = None,
        lookahead: int = 0,
        lora_id: int | str | None = None,
        cache_salt: str | None = None,
        multimodal: Sequence[Any] | None = None,
        block_keys: Sequence[bytes | str] | None = None,
    ) -> RequestInfo:
        given = (request_id, num_tokens, token_ids, lookahead)
        prompt = (lora_id, cache_salt, multimodal, block_keys)
        return await self._fast(channel.allocate(*given, *prompt), calls.allocate(*given, *prompt))

    async def probe(
        self,
        token_ids: Sequence[int],
        lora_id: int | str | None = None,
        cache_salt: str | None = None,
        multimodal: Sequence[Any] | None = None,
        block_keys: Sequence[bytes | str] | None = None,
    ) -> int:
        given = (token_ids, lora_id, cache_salt, multimodal, block_keys)
        return await self._fast(channel.probe(*given), calls.probe(*given))

    async def reset_prefix_cache(self) -> None:
        return await self._run(calls.reset_prefix_cache())

    async def events(self, after: int = 0, limit: int = 1000, timeout_s: float = 0.0) -> KVEvents:
        return await self._run(calls.events(after, limit, timeout_s))

    async def index_snapshot(self) -> IndexSnapshot:
        return await self._run(calls.index_snapshot())

    async def follow_events(
        self, after: int = 0, timeout_s: float = 10.0
    ) -> AsyncIterator[KVEvents]:
        """Long-poll forever: each batch of new events as it comes (empty ones skipped)."""
        while True:
            batch = await self.events(after, timeout_s=timeout_s)
            after = batch.last_seq
            if batch.events or batch.lost:
                yield batch

    async def extend(self, request_id: str, num_new_tokens: int, lookahead: int = 0) -> RequestInfo:
        given = (request_id, num_new_tokens, lookahead)
        return await self._fast(channel.extend(*given), calls.extend(*given))

    async def extend_many(
        self,
        request_ids: Sequence[str],
        num_new_tokens: int | Sequence[int] = 1,
        lookahead: int | Sequence[int] = 0,
    ) -> None:
        given = (request_ids, num_new_tokens, lookahead)
        return await self._fast(channel.extend_many(*given), calls.extend_many(*given))

    async def rewind(self, request_id: str, num_tokens: int) -> RequestInfo:
        given = (request_id, num_tokens)
        return await self._fast(channel.rewind(*given), calls.rewind(*given))

    async def commit(self, request_id: str, token_ids: Sequence[int]) -> RequestInfo:
        given = (request_id, token_ids)
        return await self._fast(channel.commit(*given), calls.commit(*given))

    async def free(self, request_id: str) -> None:
        return await self._fast(channel.free(request_id), calls.free(request_id))

    async def step(
        self, ops: Sequence[Any], atomic: bool = False, brief: bool = False
    ) -> list[OpResult]:
        given = (ops, atomic, brief)
        return await self._fast(channel.step(*given), calls.step(*given))

    async def step_columns(
        self,
        *,
        free: Any = (),
        rewind: Any = (),
        rewind_tokens: Any = 1,
        commit: Any = (),
        commit_tokens: Any = (),
        extend: Any = (),
        num_new_tokens: Any = 1,
        lookahead: Any = 0,
        allocate: Any = (),
        suspend: Any = (),
        resume: Any = (),
        atomic: bool = False,
    ) -> StepColumnsResult:
        """The columnar step (``KVCacheManager.step_columns``; docs/requests.md): requests
        by handle, a status per item, results decoded when read. Over the step channel when
        this client has one (raw int64 arrays), else ``POST /v1/step_columns``."""
        columns = _fields(locals())
        if self._channel is None:
            return await self._run(calls.step_columns(columns))
        return await self._fast(channel.step_columns(wire_columns(**columns)), None)

    async def suspend(self, request_id: str) -> RequestInfo:
        return await self._fast(channel.suspend(request_id), calls.suspend(request_id))

    async def resume(self, request_id: str) -> RequestInfo:
        return await self._fast(channel.resume(request_id), calls.resume(request_id))

    async def probe_tiers(
        self,
        token_ids: Sequence[int],
        lora_id: int | str | None = None,
        cache_salt: str | None = None,
    ) -> tuple[int, int]:
        return await self._run(calls.probe_tiers(token_ids, lora_id, cache_salt))

    async def request(self, request_id: str) -> RequestInfo:
        return await self._run(calls.request(request_id))

    async def request_ids(self) -> list[str]:
        return await self._run(calls.request_ids())

    async def block_table(self, request_id: str) -> list[list[int]]:
        return await self._run(calls.block_table(request_id))

    async def committed_tokens(self, request_id: str) -> list[int]:
        return await self._run(calls.committed_tokens(request_id))

    async def page_indices(
        self,
        request_ids: Sequence[str],
        layer_id: int,
        role: str = "key",
        mode: Literal["slot", "kernel"] = "slot",
        per_layer: bool = False,
    ) -> list[list[int]]:
        return await self._run(calls.page_indices(request_ids, layer_id, role, mode, per_layer))

    async def slot_mapping(
        self,
        request_ids: Sequence[str],
        layer_id: int,
        num_tokens: int | Sequence[int] | None = None,
        pad_to: int | None = None,
    ) -> list[int]:
        given = (request_ids, layer_id, num_tokens, pad_to)
        return await self._fast(channel.slot_mapping(*given), calls.slot_mapping(*given))

    async def slot_mappings(
        self,
        request_ids: Sequence[str],
        num_tokens: int | Sequence[int] | None = None,
        pad_to: int | None = None,
    ) -> list[list[int]]:
        given = (request_ids, None, num_tokens, pad_to)
        return await self._fast(channel.slot_mapping(*given), calls.slot_mapping(*given))

    async def describe(self) -> Layout:
        return await self._run(calls.describe())

    async def estimate(
        self,
        seq_len: int,
        num_requests: int | None = None,
        *,
        prefill_chunk: int | None = None,
        lookahead: int | None = None,
    ) -> Estimate:
        return await self._run(calls.estimate(seq_len, num_requests, prefill_chunk, lookahead))

    async def stats(self) -> Stats:
        return await self._run(calls.stats())

    async def num_free_blocks(self, pool_group: int | None = None) -> int:
        return calls.free_blocks(await self.stats(), pool_group)

    async def num_total_blocks(self, pool_group: int | None = None) -> int:
        return calls.total_blocks(await self.stats(), pool_group)

    async def register_model(
        self,
        *,
        layers: Sequence[LayerSpec | dict[str, Any]] | None = None,
        hf_config: dict[str, Any] | None = None,
        kv_dtype: DType | None = None,
        tensor_parallel: int | None = None,
        memory_bytes: int | None = None,
        num_blocks: int | None = None,
        tokens_per_block: int | None = None,
        max_seq_len: int | None = None,
        max_requests: int | None = None,
        max_prefill_chunk: int | None = None,
        max_lookahead: int | None = None,
        null_page: bool | None = None,
        share: bool | None = None,
        kv_events: bool | None = None,
        host_memory_bytes: int | None = None,
        state_layers: Sequence[StateLayerSpec | dict[str, Any]] | None = None,
        state_checkpoint_stride: int | None = None,
        state_checkpoints: int | None = None,
        state_live_slots: int | None = None,
    ) -> ModelInfo:
        """As ``KVCacheClient.register_model``."""
        return await self._run(calls.register_model(_fields(locals())))

    async def model(self) -> ModelInfo:
        return await self._run(calls.model())

    async def wait_for_model(self, timeout_s: float = 60.0) -> Layout:
        """As ``KVCacheClient.wait_for_model``."""
        deadline = time.monotonic() + timeout_s
        delays = _poll_delays()
        while True:
            try:
                return (await self._run(calls.model(pinned=False))).layout
            except (NoModel, ServiceUnavailable) as exc:
                last = exc
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise _wait_timeout(timeout_s, last)
            await asyncio.sleep(min(next(delays), remaining))

    async def pools(self, rank: int = 0) -> SharedLayout:
        return await self._run(calls.pools(rank))

    async def attach(self, rank: int = 0) -> Attachment:
        """As ``KVCacheClient.attach``; call ``detach(attachment)`` to unregister."""
        from .shared import Attachment, require_torch

        require_torch()
        layout = await self.pools(rank)
        info = await self._run(calls.register_consumer(os.getpid(), layout.generation))
        attachment = Attachment(layout)
        attachment.consumer_id = info.consumer_id  # type: ignore[attr-defined]
        return attachment

    async def detach(self, attachment: Attachment) -> None:
        consumer_id = attachment.consumer_id  # type: ignore[attr-defined]
        with contextlib.suppress(UnknownConsumer, StaleGeneration):  # as in the sync client
            await self._run(calls.unregister_consumer(consumer_id))
        attachment.close()

    async def consumers(self) -> list[ConsumerInfo]:
        return await self._run(calls.consumers())

    async def check_generation(self) -> str:
        """As ``KVCacheClient.check_generation``."""
        await self._run(calls.livez())
        assert self.generation is not None
        return self.generation

    def reconnect(self) -> None:
        """As ``KVCacheClient.reconnect``."""
        self.generation = None
        self.session_id = None

    async def open_session(self, ttl_s: float | None = None) -> SessionInfo:
        info = await self._run(calls.open_session(ttl_s))
        self.session_id = info.session_id
        return info

    async def renew_session(self) -> SessionInfo:
        return await self._run(calls.renew_session(_session(self.session_id)))

    async def close_session(self) -> SessionClosed:
        closed = await self._run(calls.close_session(_session(self.session_id)))
        self.session_id = None
        return closed

    async def commit_many(
        self, request_ids: Sequence[str], token_ids: Sequence[Sequence[int]]
    ) -> None:
        """As ``KVCacheClient.commit_many``."""
        await self._run(calls.commit_many(request_ids, token_ids))

"""``AsyncKVCacheClient``: ``KVCacheClient``'s API with ``async`` methods (httpx.AsyncClient,
and the step channel on an asyncio stream); see ``kvcm_client.client`` for the contract."""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, TypeVar

import httpx

from . import _calls as calls
from . import step_channel as channel
from ._http import (
    DEFAULT_URL,
    GENERATION_HEADER,
    base_and_headers,
    call_headers,
    call_timeout,
    generation_after,
    given_fields,
    pin,
    poll_delays,
    require_session,
    retryable,
    token_or_env,
    unavailable,
    wait_timeout_error,
)
from .columns import StepColumnsResult, wire_columns
from .errors import (
    InvalidArgument,
    NoModel,
    ServiceUnavailable,
    StaleGeneration,
    UnknownConsumer,
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
    RaggedPageIndices,
    RequestInfo,
    SessionClosed,
    SessionInfo,
    SharedLayout,
    Stats,
)
from .state import StateLayerSpec
from .transfer import KVExport, PullState, TransferAgent

if TYPE_CHECKING:
    from .shared import Attachment


T = TypeVar("T")


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
        step_wake_after_s: float | None = channel.WAKE_AFTER_S,
    ) -> None:
        """As ``KVCacheClient``; the step channel is an asyncio stream."""
        url, headers = base_and_headers(base_url, uds, token)
        self._token = token_or_env(token)
        self._channel = (
            None
            if step_socket is None
            else channel.AsyncStepSocket(
                str(step_socket), timeout, retries, backoff_s, wake_after_s=step_wake_after_s
            )
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

    async def _fast(self, call: channel.StepCall[T], fallback: calls.Call[T]) -> T:
        """As ``KVCacheClient._fast``."""
        if self._channel is None:
            return await self._run(fallback)
        self._channel.wake()
        return await self._over_channel(call)

    async def _over_channel(self, call: channel.StepCall[T]) -> T:
        """As ``KVCacheClient._over_channel``."""
        assert self._channel is not None
        header = channel.header(self.session_id, self.generation, self._token)
        answer = await self._channel.call(call, header)
        result = channel.result_of(call, answer)
        self.generation = pin(self.generation, answer.get("generation"))
        return result

    async def _run(self, call: calls.Call[T]) -> T:
        headers = call_headers(self.session_id, self.generation if call.pinned else None)
        for attempt in range(self.retries + 1):
            try:
                resp = await self._http.request(
                    call.method,
                    call.path,
                    content=call.body,
                    params=call.params,
                    headers=headers,
                    timeout=call_timeout(self._http.timeout, call),
                )
                break
            except httpx.TransportError as exc:
                if attempt == self.retries or not retryable(exc, call):
                    raise unavailable(exc, call, attempt + 1) from exc
                await asyncio.sleep(self.backoff_s * 2**attempt)
        calls.raise_for_status(resp.status_code, resp.content)
        answered = resp.headers.get(GENERATION_HEADER)
        self.generation = generation_after(call, self.generation, answered)
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
        max_new_tokens: int | None = None,
    ) -> RequestInfo:
        given = (request_id, num_tokens, token_ids, lookahead)
        prompt = (lora_id, cache_salt, multimodal, block_keys, max_new_tokens)
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

    # -- KV moves between sidecars (docs/disaggregation.md) --------------------------------

    async def transfer_agent(self) -> TransferAgent:
        """The service's transfer agent (name, NIXL metadata); needs the token."""
        return await self._run(calls.transfer_agent())

    async def hand_off(self, request_id: str, deadline_s: float = 30.0) -> KVExport:
        """Pin a committed request for a peer's pull (``KVCacheManager.hand_off``); the
        service frees it when the peer's pull ends or ``deadline_s`` passes."""
        return await self._run(calls.hand_off(request_id, deadline_s))

    async def pull(
        self,
        request_id: str,
        peer: str,
        peer_request_id: str,
        lookahead: int = 0,
        lora_id: int | str | None = None,
        cache_salt: str | None = None,
        deadline_s: float = 30.0,
    ) -> PullState:
        """Start ``request_id`` with the KV of request ``peer_request_id`` handed off by
        ``peer`` (a name of the service's ``--peer`` list): ``pulling`` until
        ``transfer_status`` says ``ready`` (``KVCacheManager.pull``)."""
        return await self._run(
            calls.pull(
                request_id, peer, peer_request_id, lookahead, lora_id, cache_salt, deadline_s
            )
        )

    async def fetch(
        self,
        request_id: str,
        peer: str,
        num_tokens: int,
        token_ids: Sequence[int],
        lookahead: int = 0,
        lora_id: int | str | None = None,
        cache_salt: str | None = None,
        deadline_s: float = 30.0,
    ) -> PullState:
        """Allocate ``request_id`` with the longest prefix of ``token_ids`` that ``peer``
        caches pulled in first (``KVCacheManager.fetch``): ``pulling`` until
        ``transfer_status`` says ``ready``, then prefill from ``num_committed``."""
        return await self._run(
            calls.fetch(
                request_id,
                peer,
                num_tokens,
                token_ids,
                lookahead,
                lora_id,
                cache_salt,
                deadline_s,
            )
        )

    async def transfer_status(self, request_ids: Sequence[str]) -> list[PullState]:
        """Where each pull stands: pulling, ready, failed (with its error) or unknown."""
        return await self._run(calls.transfer_status(request_ids))

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
        map_slots: bool = False,
        table_edits: bool = False,
        ragged_layers: Any = (),
        stream_ordered: bool = False,
    ) -> StepColumnsResult:
        """The columnar step (``KVCacheManager.step_columns``; docs/requests.md): requests
        by handle, a status per item, results decoded when read. Over the step channel when
        this client has one (raw int64 arrays), else ``POST /v1/step_columns``."""
        columns = given_fields(locals())
        if self._channel is None:
            return await self._run(calls.step_columns(columns))
        self._channel.wake()  # before the frame is built (docs/step-channel.md)
        return await self._over_channel(channel.step_columns(wire_columns(**columns)))

    async def decode_step(
        self,
        extend: Any,
        num_new_tokens: int = 1,
        lookahead: int = 0,
        *,
        map_slots: bool = False,
        table_edits: bool = False,
        stream_ordered: bool = False,
    ) -> StepColumnsResult:
        """An engine's decode step (``KVCacheManager.decode_step``): ``step_columns`` of
        these extends alone."""
        return await self.step_columns(
            extend=extend,
            num_new_tokens=num_new_tokens,
            lookahead=lookahead,
            map_slots=map_slots,
            table_edits=table_edits,
            stream_ordered=stream_ordered,
        )

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

    async def ragged_page_indices(
        self,
        request_ids: Sequence[str],
        layer_id: int,
        role: str = "key",
        per_layer: bool = False,
    ) -> RaggedPageIndices:
        """The manager's ``ragged_page_indices`` with lists for its tensors."""
        return await self._run(calls.ragged_page_indices(request_ids, layer_id, role, per_layer))

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
        return await self._run(calls.register_model(given_fields(locals())))

    async def model(self) -> ModelInfo:
        return await self._run(calls.model())

    async def wait_for_model(self, timeout_s: float = 60.0) -> Layout:
        """As ``KVCacheClient.wait_for_model``."""
        deadline = time.monotonic() + timeout_s
        delays = poll_delays()
        while True:
            try:
                return (await self._run(calls.model(pinned=False))).layout
            except (NoModel, ServiceUnavailable) as exc:
                last = exc
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise wait_timeout_error(timeout_s, last)
            await asyncio.sleep(min(next(delays), remaining))

    async def pools(self, rank: int = 0) -> SharedLayout:
        return await self._run(calls.pools(rank))

    async def attach(self, rank: int = 0, stream_order: bool = False) -> Attachment:
        """As ``KVCacheClient.attach``; call ``detach(attachment)`` to unregister."""
        from .shared import Attachment, StepEvents, require_torch

        if type(stream_order) is not bool:
            raise InvalidArgument("stream_order must be a bool")
        require_torch()
        layout = await self.pools(rank)
        events = StepEvents(layout) if stream_order else None
        try:
            done = None if events is None else events.done_handle
            info = await self._run(calls.register_consumer(os.getpid(), layout.generation, done))
        except BaseException:
            if events is not None:
                events.close()
            raise
        try:
            attachment = Attachment(layout, events=events)
        except BaseException:  # as in the sync client: a mapping that failed leaves no consumer
            with contextlib.suppress(Exception):  # the mapping's error is the one to see
                await self._run(calls.unregister_consumer(info.consumer_id))
            if events is not None:
                events.close()
            raise
        attachment.consumer_id = info.consumer_id  # type: ignore[attr-defined]
        return attachment

    async def detach(self, attachment: Attachment) -> None:
        consumer_id = attachment.consumer_id  # type: ignore[attr-defined]
        with contextlib.suppress(UnknownConsumer, StaleGeneration):  # as in the sync client
            await self._run(calls.unregister_consumer(consumer_id))
        attachment.close(unregistered=True)

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
        return await self._run(calls.renew_session(require_session(self.session_id)))

    async def close_session(self) -> SessionClosed:
        closed = await self._run(calls.close_session(require_session(self.session_id)))
        self.session_id = None
        return closed

    async def commit_many(
        self, request_ids: Sequence[str], token_ids: Sequence[Sequence[int]]
    ) -> None:
        """As ``KVCacheClient.commit_many``."""
        await self._run(calls.commit_many(request_ids, token_ids))

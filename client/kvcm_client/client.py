"""``KVCacheClient`` (and ``AsyncKVCacheClient``, in ``async_client``): the manager's API over
HTTP.

Method names, parameters and exceptions are those of ``kvcm.KVCacheManager``, so a scheduler
can swap the in-process manager for the sidecar. Tables come back as lists of ints (the client
needs no torch): ``page_indices`` is ``list[list[int]]`` where the manager returns an int32
tensor, ``slot_mapping`` a ``list[int]``, ``ragged_page_indices`` a ``RaggedPageIndices`` of
lists where the manager's ``RaggedPages`` holds tensors.

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

import contextlib
import os
import time
from collections.abc import Iterator, Sequence
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
    check_same_generation,
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
from .columns import StepColumnsResult, int64_bytes, wire_columns
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
#: The default of ``step_columns``' sections: a step whose sections but ``extend`` are all
#: this (left out, or given as ``()``) is a decode step (``_decode``).
_NONE: tuple[()] = ()


def _decode_key(
    extend: Any,
    num_new_tokens: Any,
    lookahead: Any,
    map_slots: Any,
    table_edits: Any,
    stream_ordered: Any,
) -> tuple[int, int, bool, bool, bool] | None:
    """The counts and flags of a decode step's frame (``DecodeFrames``' key, less the
    header), or None where the call is not one: counts that are not one exact int each
    (per request, a bool), flags that are not bools, no handles."""
    if (
        type(num_new_tokens) is int
        and type(lookahead) is int
        and type(map_slots) is bool
        and type(table_edits) is bool
        and type(stream_ordered) is bool
        and len(extend)
    ):
        return (num_new_tokens, lookahead, map_slots, table_edits, stream_ordered)
    return None


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
        step_wake_after_s: float | None = channel.WAKE_AFTER_S,
        step_ring: bool = False,
    ) -> None:
        """``step_socket``: the service's step channel (``kvcm serve --step-socket``); the
        step-path methods (``step``, ``extend_many``, ``slot_mapping(s)``, ``probe``,
        ``allocate``, ``extend``, ``rewind``, ``commit``, ``free``) go over it, the rest
        over HTTP (docs/step-channel.md). ``step_wake_after_s``: a call after the channel
        was idle this long rings the service's doorbell first (None: never; "The doorbell"
        there). ``step_ring=True``: the frames go through a shared-memory ring where the
        service offers one (busy-poll mode, x86-64 Linux), else over the socket as before
        ("The shared-memory ring" there; ``ring_attached`` says which)."""
        url, headers = base_and_headers(base_url, uds, token)
        self._token = token_or_env(token)
        self._channel = (
            None
            if step_socket is None
            else channel.StepSocket(
                str(step_socket),
                timeout,
                retries,
                backoff_s,
                wake_after_s=step_wake_after_s,
                ring=step_ring,
                token=self._token,
            )
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

    @property
    def ring_attached(self) -> bool:
        """Whether the step channel's calls go through a shared-memory ring now."""
        return self._channel is not None and self._channel.ring is not None

    @property
    def ring_refusal(self) -> str | None:
        """Why the service refused the ring last asked for (its error code), if it did."""
        return None if self._channel is None else self._channel.ring_refusal

    def __enter__(self) -> KVCacheClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._http.close()
        if self._channel is not None:
            self._channel.close()

    def _fast(self, call: channel.StepCall[T], fallback: calls.Call[T]) -> T:
        """``call`` over the step channel if this client has one, else ``fallback`` (HTTP)."""
        if self._channel is None:
            return self._run(fallback)
        self._channel.wake()
        return self._over_channel(call)

    def _over_channel(self, call: channel.StepCall[T]) -> T:
        """``call`` over the step channel, its doorbell already rung if due (``wake``, once
        per call: a second one, after a frame that took longer than the window to build,
        would only wake the service again)."""
        assert self._channel is not None
        header = channel.header(self.session_id, self.generation, self._token)
        return self._answered(call, self._channel.call(call, header))

    def _answered(self, call: channel.StepCall[T], answer: dict[str, Any]) -> T:
        """``call``'s result from its step channel answer, the generation pinned by it."""
        result = channel.result_of(call, answer)
        self.generation = pin(self.generation, answer.get("generation"))
        return result

    def _run(self, call: calls.Call[T]) -> T:
        headers = call_headers(self.session_id, self.generation if call.pinned else None)
        for attempt in range(self.retries + 1):
            try:
                resp = self._http.request(
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
                time.sleep(self.backoff_s * 2**attempt)
        calls.raise_for_status(resp.status_code, resp.content)
        answered = resp.headers.get(GENERATION_HEADER)
        self.generation = generation_after(call, self.generation, answered)
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
        max_new_tokens: int | None = None,
    ) -> RequestInfo:
        given = (request_id, num_tokens, token_ids, lookahead)
        prompt = (lora_id, cache_salt, multimodal, block_keys, max_new_tokens)
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

    # -- KV moves between sidecars (docs/disaggregation.md) --------------------------------

    def transfer_agent(self) -> TransferAgent:
        """The service's transfer agent (name, NIXL metadata); needs the token."""
        return self._run(calls.transfer_agent())

    def hand_off(self, request_id: str, deadline_s: float = 30.0) -> KVExport:
        """Pin a committed request for a peer's pull (``KVCacheManager.hand_off``); the
        service frees it when the peer's pull ends or ``deadline_s`` passes."""
        return self._run(calls.hand_off(request_id, deadline_s))

    def pull(
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
        return self._run(
            calls.pull(
                request_id, peer, peer_request_id, lookahead, lora_id, cache_salt, deadline_s
            )
        )

    def fetch(
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
        return self._run(
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

    def transfer_status(self, request_ids: Sequence[str]) -> list[PullState]:
        """Where each pull stands: pulling, ready, failed (with its error) or unknown."""
        return self._run(calls.transfer_status(request_ids))

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
        free: Any = _NONE,
        rewind: Any = _NONE,
        rewind_tokens: Any = 1,
        commit: Any = _NONE,
        commit_tokens: Any = (),
        extend: Any = (),
        num_new_tokens: Any = 1,
        lookahead: Any = 0,
        allocate: Any = _NONE,
        suspend: Any = _NONE,
        resume: Any = _NONE,
        atomic: bool = False,
        map_slots: bool = False,
        table_edits: bool = False,
        ragged_layers: Any = _NONE,
        stream_ordered: bool = False,
    ) -> StepColumnsResult:
        """The columnar step (``KVCacheManager.step_columns``; docs/requests.md): requests
        by handle, a status per item, results decoded when read. Over the step channel when
        this client has one (raw int64 arrays), else ``POST /v1/step_columns``.
        ``map_slots=True``: ``.slot_mapping`` of the step's computed tokens, in the same
        round trip; ``table_edits=True``: ``.table_edits``, the page-table cells changed
        since the last answer that had them (for an engine's own copy of the tables);
        ``ragged_layers=[layer ids]``: ``.ragged``, per layer the ragged (CSR) pages of the
        requests the step maps, for a FlashInfer-style kernel; ``stream_ordered=True``
        (a CUDA sidecar sharing its tables): the answer does not wait for the device, and
        the engine's stream waits on the step event instead (``Attachment.wait_step``;
        docs/shared-memory.md#stream-ordered-steps)."""
        if self._channel is None:  # (before any local: the fields are ``locals()``)
            return self._run(calls.step_columns(given_fields(locals())))
        ch = self._channel
        if (  # a decode step (extends alone, one count each): its frame from cached pieces
            free is _NONE
            and rewind is _NONE
            and commit is _NONE
            and allocate is _NONE
            and suspend is _NONE
            and resume is _NONE
            and ragged_layers is _NONE
            and atomic is False
            and (
                key := _decode_key(
                    extend, num_new_tokens, lookahead, map_slots, table_edits, stream_ordered
                )
            )
        ):
            return self._decode(ch, extend, key)
        ch.wake()  # before the frame is built (docs/step-channel.md)
        args = wire_columns(
            free=free,
            rewind=rewind,
            rewind_tokens=rewind_tokens,
            commit=commit,
            commit_tokens=commit_tokens,
            extend=extend,
            num_new_tokens=num_new_tokens,
            lookahead=lookahead,
            allocate=allocate,
            atomic=atomic,
            suspend=suspend,
            resume=resume,
            map_slots=map_slots,
            table_edits=table_edits,
            ragged_layers=ragged_layers,
            stream_ordered=stream_ordered,
        )
        return self._over_channel(channel.step_columns(args))

    def decode_step(
        self,
        extend: Any,
        num_new_tokens: int = 1,
        lookahead: int = 0,
        *,
        map_slots: bool = False,
        table_edits: bool = False,
        stream_ordered: bool = False,
    ) -> StepColumnsResult:
        """An engine's decode step (``KVCacheManager.decode_step``): ``step_columns(extend=
        extend, num_new_tokens=..., lookahead=..., map_slots=..., table_edits=...,
        stream_ordered=...)``, the same call, answer and errors, through the client's
        shortest path. Why: at an engine's cadence every line a call runs is cold, and the
        general entry (sixteen sections, each checked) cost a decode step through the ring
        ~10 us at the median on the development VM (docs/step-channel.md, "The decode
        step's own call"). Counts per request, or no step channel, take ``step_columns``.

        Example: ``kv.decode_step(handles, map_slots=True).slot_mapping`` is the slots of
        the one token each request adds, as ``kv.step_columns(extend=handles,
        map_slots=True)``'s."""
        ch = self._channel
        key = _decode_key(extend, num_new_tokens, lookahead, map_slots, table_edits, stream_ordered)
        if ch is None or key is None:
            return self.step_columns(
                extend=extend,
                num_new_tokens=num_new_tokens,
                lookahead=lookahead,
                map_slots=map_slots,
                table_edits=table_edits,
                stream_ordered=stream_ordered,
            )
        return self._decode(ch, extend, key)

    def _decode(
        self, ch: channel.StepSocket, extend: Any, counts_and_flags: tuple[Any, ...]
    ) -> StepColumnsResult:
        """``step_columns`` of a decode step over ``ch`` (``DecodeFrames``: the same frame
        as the general path's, built in one join, or the last one again). The doorbell is
        rung before the frame is built on a socket; a ring rings after its post where the
        service sleeps (``StepSocket._over_ring``), and a decode frame is built in
        microseconds, so the ring's call skips the early look at the clock."""
        if ch.ring is None:
            ch.wake()
        handles = int64_bytes(extend, "extend")
        key = (*counts_and_flags, self.session_id, self.generation, self._token)
        answer = ch.call_frame(channel.DECODE, ch.decode_frames.frame(handles, key))
        result, pinned = answer.get("result"), self.generation
        if (  # the usual (no error, the generation pinned): ``_answered``'s outcome, sooner
            type(result) is dict
            and pinned is not None
            and answer.get("generation") == pinned
            and "error" not in answer
        ):
            return StepColumnsResult(result)
        return self._answered(channel.DECODE, answer)

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

    def ragged_page_indices(
        self,
        request_ids: Sequence[str],
        layer_id: int,
        role: str = "key",
        per_layer: bool = False,
    ) -> RaggedPageIndices:
        """The manager's ``ragged_page_indices`` with lists for its tensors."""
        return self._run(calls.ragged_page_indices(request_ids, layer_id, role, per_layer))

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
        return self._run(calls.register_model(given_fields(locals())))

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
        delays = poll_delays()
        while True:
            try:
                return self._run(calls.model(pinned=False)).layout
            except (NoModel, ServiceUnavailable) as exc:
                last = exc
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise wait_timeout_error(timeout_s, last)
            time.sleep(min(next(delays), remaining))

    # -- shared memory (the inference server's side) -------------------------------------------

    def pools(self, rank: int = 0) -> SharedLayout:
        """Descriptors of the service's shared pools and page tables (of rank ``rank`` of a
        tensor- or pipeline-parallel engine: docs/ranks.md)."""
        return self._run(calls.pools(rank))

    def attach(self, rank: int = 0, stream_order: bool = False) -> Attachment:
        """Map the pools and page tables (of rank ``rank``) here and register this process
        as a consumer; ``close()`` on the result unregisters it. ``stream_order=True`` (a
        CUDA service sharing the tables of one rank, else ``StreamOrderUnavailable`` and no
        consumer) also opens the service's step event and registers a done event of this
        process: ``Attachment.wait_step`` and ``step_done`` for
        ``step_columns(stream_ordered=True)`` (docs/shared-memory.md#stream-ordered-steps)."""
        from .shared import Attachment, StepEvents, require_torch

        if type(stream_order) is not bool:
            raise InvalidArgument("stream_order must be a bool")
        require_torch()  # before the service hears of this consumer
        layout = self.pools(rank)
        events = StepEvents(layout) if stream_order else None
        try:
            done = None if events is None else events.done_handle
            info = self._run(calls.register_consumer(os.getpid(), layout.generation, done))
        except BaseException:
            if events is not None:
                events.close()
            raise
        try:
            return Attachment(
                layout,
                on_close=lambda: self._unregister(info.consumer_id),
                check=lambda: check_same_generation(layout.generation, self.check_generation()),
                events=events,
            )
        except BaseException:  # nothing mapped (no CuPy for CUDA pools, say): no consumer
            with contextlib.suppress(Exception):  # the mapping's error is the one to see
                self._unregister(info.consumer_id)
            if events is not None:
                events.close()
            raise

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
        return self._run(calls.renew_session(require_session(self.session_id)))

    def close_session(self) -> SessionClosed:
        """End the lease now; the service frees its requests."""
        closed = self._run(calls.close_session(require_session(self.session_id)))
        self.session_id = None
        return closed

    def commit_many(self, request_ids: Sequence[str], token_ids: Sequence[Sequence[int]]) -> None:
        """``KVCacheManager.commit_many``: one call for a forward pass's commits."""
        self._run(calls.commit_many(request_ids, token_ids))

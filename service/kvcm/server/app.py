"""The FastAPI app: versioned ``/v1`` routes over one manager, JSON errors, probes and metrics.

Routes are named after the manager's methods (``POST /v1/allocate`` takes an ``AllocateOp``
and returns what ``KVCacheManager.allocate`` returns), so the wire schema is the op models of
``kvcm_client.models`` and nothing else. Op routes parse the raw body with pydantic-core
(``model_validate_json``) and encode results straight to bytes; that keeps a 256-op step well
under a millisecond. ``openapi.py`` adds their request schemas to the OpenAPI document (FastAPI
does not see a body parameter) and documents every route's error statuses from one table.

Errors are ``{code, message, detail}`` with the error's HTTP status: 400 malformed JSON, 401
missing token, 404 unknown request/session/route, 409 duplicate/conflict, 413 too long or too
large, 422 invalid arguments, 429 too many sessions or consumers, 503 no model yet, 507 out of
blocks or rows. Bad input never yields a 500.

The model may come later than the service (``POST /v1/model``): until then every route that
needs the manager answers 503 ``no_model``, and a registration replaces the manager, so routes
read ``state.manager`` on every call and never keep one.
"""

from __future__ import annotations

import asyncio
import gc
import hmac
import logging
import math
from collections.abc import AsyncIterator, Callable, Mapping
from contextlib import asynccontextmanager, suppress
from pathlib import Path
from time import perf_counter
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.responses import PlainTextResponse, Response
from pydantic import BaseModel, ValidationError

from kvcm_client.errors import (
    InvalidArgument,
    SequenceTooLong,
    Unauthorized,
    invalid_from_validation,
)
from kvcm_client.models import (
    AllocateOp,
    CommitManyRequest,
    CommitOp,
    ConsumerInfo,
    ConsumerRequest,
    Consumers,
    EmptyBody,
    Estimate,
    ExtendManyRequest,
    ExtendOp,
    FreeOp,
    Health,
    IndexRow,
    IndexRows,
    IndexSnapshot,
    KVEvents,
    Layout,
    ModelInfo,
    ModelRegistration,
    PageIndicesRequest,
    ProbeRequest,
    ProbeResult,
    ProbeTiersRequest,
    ProbeTiersResult,
    RaggedPageIndices,
    RaggedPageIndicesRequest,
    RequestIds,
    RequestInfo,
    RequestRef,
    RewindOp,
    SessionClosed,
    SessionInfo,
    SessionRequest,
    SharedLayout,
    SlotMappingRequest,
    Stats,
    StepColumnsRequest,
    StepColumnsResponse,
    StepRequest,
    StepResponse,
)

from ..manager import KVCacheManager, resolve_device
from . import openapi, transfer_routes
from .errors import JSON, install_error_handlers
from .middleware import BodyLimit, CountResponses, Generation
from .state import ServiceState
from .step_channel import StepChannel
from .step_poll import DEFAULT_POLL_US

log = logging.getLogger("kvcm.server")

SESSION_HEADER = "x-kvcm-session"


#: Bodies larger than this are parsed in a worker thread, not on the event loop.
OFFLOAD_BYTES = 256 << 10


def default_body_limit(max_seq_len: int) -> int:
    """The largest body a real call needs, with room: a prompt of ``max_seq_len`` ids of up to
    6 digits (vocabularies stay under 10**6), a comma and a space each, plus 64 KiB; at least
    1 MiB (a step of ``MAX_STEP_OPS`` ops is well under). 131072 tokens give 1.1 MiB.
    Bounding the body bounds the parse, the one part of a call whose cost grows with what a
    client sends before any check."""
    return max(1 << 20, (64 << 10) + 8 * max_seq_len)


M = TypeVar("M", bound=BaseModel)


def _json(model: BaseModel, status: int = 200) -> Response:
    return Response(model.model_dump_json().encode(), status_code=status, media_type=JSON)


def create_app(
    manager: KVCacheManager | None,
    *,
    lease_ttl_s: float = 30.0,
    max_body_bytes: int | None = None,
    api_token: str | None = None,
    clock: Callable[[], float] | None = None,
    defaults: Mapping[str, Any] | None = None,
    step_socket: Path | None = None,
    step_poll_us: float = DEFAULT_POLL_US,
    step_spin_s: float = 0.0,
    request_timeout: float = 10.0,
    kv_events_zmq: str | None = None,
    peers: Mapping[str, tuple[str, str | None]] | None = None,
) -> FastAPI:
    """An app serving ``manager`` (None: no model until one is registered); ``api_token``
    (if set) guards every mutating route. ``max_body_bytes`` defaults to
    ``default_body_limit`` of the model's ``max_seq_len``, and follows a registered model.
    ``defaults``: what a registered model takes where it says nothing (``ServiceState``).
    ``step_socket``: also serve the step channel there (``step_channel``), with the same
    token and body limit, each frame due whole within ``request_timeout`` seconds, polling
    up to ``step_poll_us`` for a client's next frame (``step_poll``), or ``step_spin_s``
    after every answer (busy-poll mode, ``StepChannel.spin``).
    ``kv_events_zmq``: also publish the KV events in vLLM's format on a ZeroMQ PUB socket
    bound there (``vllm_events``). ``peers``: the sidecars this one may pull KV from, name to
    (URL, token) (``transfer_routes``, docs/disaggregation.md)."""
    state = ServiceState(
        manager, lease_ttl_s, *(() if clock is None else (clock,)), defaults=defaults
    )
    if kv_events_zmq is not None:
        from .vllm_events import VllmEventPublisher

        state.event_publisher = VllmEventPublisher(kv_events_zmq)

    def body_limit() -> int:
        """The body (and frame) limit now: it follows a registered model's max_seq_len."""
        if max_body_bytes is None:
            return default_body_limit(state.max_seq_len)
        return max_body_bytes

    channel = StepChannel(
        state,
        api_token.encode() if api_token else None,
        body_limit,
        request_timeout,
        step_poll_us,
        step_spin_s,
    )

    transfer_peers = transfer_routes.Peers(peers or {})
    poller = transfer_routes.Poller(state)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        reaper = asyncio.create_task(_reap(state))
        polling = asyncio.create_task(poller.run())
        if step_socket is not None:
            await channel.start(step_socket)
        # Everything built so far (torch, the app, the manager) lives as long as the process:
        # move it out of the collector's generations, so that the collections a step's
        # short-lived result dicts trigger do not walk it (several ms each otherwise).
        gc.collect()
        gc.freeze()
        state.loop = asyncio.get_running_loop()
        state.ready = True
        if manager is None:
            log.info("kvcm up with no model, waiting for POST /v1/model; auth %s", auth)
        else:
            log.info("kvcm ready: %s; auth %s", _summary(manager), auth)
        try:
            yield
        finally:
            state.ready = False
            await channel.stop()
            reaper.cancel()
            polling.cancel()
            with suppress(asyncio.CancelledError):
                await reaper
            with suppress(asyncio.CancelledError):
                await polling
            await transfer_peers.close()
            if state.current is not None:
                state.current.close()  # unlink shared segments; existing mappings stay valid

    app = FastAPI(
        title="kvcm",
        version="1",
        summary="KV-cache manager sidecar",
        lifespan=lifespan,
        docs_url=None,  # FastAPI's Swagger UI loads from a CDN: openapi.install serves /docs
        redoc_url=None,
    )
    app.state.kvcm = state
    token = api_token.encode() if api_token else None
    auth = "on" if api_token else "off"

    def authorize(request: Request) -> None:
        if token is None:
            return
        given = request.headers.get("authorization", "")
        scheme, _, value = given.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(value.encode(), token):
            raise Unauthorized("this route needs 'Authorization: Bearer <KVCM_API_TOKEN>'")

    def session_of(request: Request) -> str | None:
        return request.headers.get(SESSION_HEADER)

    bodies: dict[str, type[BaseModel]] = {}

    def mgr() -> KVCacheManager:
        return state.manager

    def rpc(
        path: str,
        body: type[BaseModel],
        response: type[BaseModel] | None,
        call: Callable[[Any, str | None], Any],
        mutating: bool = True,
        summary: str = "",
        parse: Callable[[bytes], Any] | None = None,
        one_prompt: bool = False,
    ) -> None:
        """Register ``POST path``: ``call(parse(body bytes), session id)``, timed and counted.

        ``parse`` defaults to validating ``body``; with a ``parse`` of its own, ``call``
        returns the answer's bytes. Parsing touches no state, so a large body is parsed in a
        worker thread (the event loop keeps answering small calls meanwhile); ``call`` runs on
        the loop, so manager calls never interleave. ``one_prompt``: the body holds at most
        one prompt, so a body with more commas than a max_seq_len prompt and its keys can
        have is refused before it is parsed (a count is ~0.1 ms a MiB; the parse ~30 ms).
        Every such route needs the model: without one it answers 503 before reading the body.
        """
        latency = state.metrics.latency.labels(path)
        raw = parse is not None
        if parse is None:

            def parse(data: bytes) -> Any:
                try:
                    return body.model_validate_json(data)
                except ValidationError as exc:
                    raise invalid_from_validation(exc.errors()) from None

        async def endpoint(request: Request) -> Response:
            if mutating:
                authorize(request)
            max_seq_len = mgr().config.max_seq_len
            data = await request.body()
            session = session_of(request)
            # Commas of the largest one-prompt body: the ids, a key per block, multimodal
            # items and the other fields (generous: only junk comes near it).
            if one_prompt and data.count(b",") > 2 * max_seq_len + 4096:
                raise SequenceTooLong(
                    f"the body holds more items than a prompt of max_seq_len={max_seq_len} "
                    "tokens and its keys",
                    max_seq_len=max_seq_len,
                )
            if len(data) > OFFLOAD_BYTES:
                parsed = await asyncio.to_thread(parse, data)
            else:
                parsed = parse(data)
            start = perf_counter()
            if raw:
                answer = call(parsed, session)
                latency.observe(perf_counter() - start)
                state.notify_events()
                return Response(answer, media_type=JSON)
            result = call(parsed, session)
            latency.observe(perf_counter() - start)
            state.notify_events()
            if result is None:
                return Response(status_code=204)
            return _json(result)

        bodies[path] = body
        app.add_api_route(
            path,
            endpoint,
            methods=["POST"],
            summary=summary,
            response_model=response,
            status_code=200 if response is not None else 204,
            tags=["ops" if mutating else "tables"],
        )

    rpc(
        "/v1/allocate",
        AllocateOp,
        RequestInfo,
        state.allocate,
        summary="allocate a request",
        one_prompt=True,
    )
    rpc("/v1/extend", ExtendOp, RequestInfo, state.extend, summary="add tokens to a request")
    rpc("/v1/extend_many", ExtendManyRequest, None, state.extend_many, summary="decode step")
    rpc("/v1/rewind", RewindOp, RequestInfo, state.rewind, summary="drop the last tokens")
    rpc("/v1/commit", CommitOp, RequestInfo, state.commit, summary="record computed tokens")
    rpc(
        "/v1/commit_many",
        CommitManyRequest,
        None,
        state.commit_many,
        summary="record computed tokens of many requests (all or nothing)",
    )
    rpc("/v1/free", FreeOp, None, state.free, summary="free a request")
    rpc(
        "/v1/suspend",
        RequestRef,
        RequestInfo,
        state.suspend,
        summary="move a request's blocks to the host tier (preemption without recompute)",
    )
    rpc(
        "/v1/resume",
        RequestRef,
        RequestInfo,
        state.resume,
        summary="bring a suspended request's blocks back into new device slots",
    )
    rpc(
        "/v1/step",
        StepRequest,
        StepResponse,
        state.run_step,
        summary="a batch of ops in order, one result each (atomic: all or nothing)",
        parse=state.parse_step,
    )
    rpc(
        "/v1/step_columns",
        StepColumnsRequest,
        StepColumnsResponse,
        lambda r, session: StepColumnsResponse.model_validate(
            state.step_columns(r.model_dump(exclude_unset=True), session).to_json()
        ),
        summary="a columnar step: requests by handle, sections commit, free, rewind, extend, "
        "allocate; a status per item",
    )
    rpc(
        "/v1/page_indices",
        PageIndicesRequest,
        IndexRows,
        lambda r, _: IndexRows(
            rows=mgr().page_indices(r.request_ids, r.layer_id, r.role, r.mode, r.per_layer).tolist()
        ),
        mutating=False,
        summary="page indices (slot or kernel mode) of requests for one layer",
    )

    def ragged_page_indices(r: RaggedPageIndicesRequest, _: str | None) -> RaggedPageIndices:
        out = mgr().ragged_page_indices(r.request_ids, r.layer_id, r.role, r.per_layer)
        return RaggedPageIndices(
            indptr=out.indptr.tolist(),
            indices=out.indices.tolist(),
            last_page_len=out.last_page_len.tolist(),
            first_token=out.first_token.tolist(),
            num_sink_pages=out.num_sink_pages.tolist(),
        )

    rpc(
        "/v1/ragged_page_indices",
        RaggedPageIndicesRequest,
        RaggedPageIndices,
        ragged_page_indices,
        mutating=False,
        summary="ragged (CSR) kernel-mode page indices of requests for one layer, "
        "FlashInfer's layout",
    )

    def slot_mapping(r: SlotMappingRequest, _: str | None) -> IndexRow:
        row = mgr().slot_mapping(r.request_ids, _layer(r.layer_id), r.num_tokens, r.pad_to)
        return IndexRow(row=row.tolist())

    rpc(
        "/v1/slot_mapping",
        SlotMappingRequest,
        IndexRow,
        slot_mapping,
        mutating=False,
        summary="slot mapping of the step's new tokens for one layer",
    )
    rpc(
        "/v1/slot_mappings",
        SlotMappingRequest,
        IndexRows,
        lambda r, _: IndexRows(
            rows=mgr().slot_mappings(r.request_ids, r.num_tokens, r.pad_to).tolist()
        ),
        mutating=False,
        summary="slot mappings of every layer group",
    )

    rpc(
        "/v1/probe_tiers",
        ProbeTiersRequest,
        ProbeTiersResult,
        lambda r, _: ProbeTiersResult(
            **dict(
                zip(
                    ("device_tokens", "host_tokens"),
                    mgr().probe_tiers(r.token_ids, r.lora_id, r.cache_salt),
                    strict=True,
                )
            )
        ),
        mutating=False,
        summary="tokens a new request would reuse from the device and from the host tier",
    )
    rpc(
        "/v1/probe",
        ProbeRequest,
        ProbeResult,
        lambda r, _: ProbeResult(
            num_hit_tokens=mgr().probe(
                r.token_ids,
                r.lora_id,
                r.cache_salt,
                r.multimodal,
                r.block_keys,
            )
        ),
        one_prompt=True,
        mutating=False,
        summary="tokens a new request with this prompt would reuse (claims nothing)",
    )
    rpc(
        "/v1/reset_prefix_cache",
        EmptyBody,
        None,
        lambda _, __: mgr().reset_prefix_cache(),
        summary="forget every cached block (refused while requests hold blocks)",
    )

    transfer_routes.install(
        app, state, authorize, token is not None, transfer_peers, poller, bodies
    )

    @app.get("/v1/events", response_model=KVEvents, tags=["prefix cache"])
    async def events(
        request: Request, after: int = 0, limit: int = 1000, timeout_s: float = 0.0
    ) -> Response:
        """KV events after ``after``; waits up to ``timeout_s`` (at most 60) for one. Needs the
        token when one is set: events name what is cached (token ids of unsalted blocks)."""
        authorize(request)
        if not math.isfinite(timeout_s):
            raise InvalidArgument("timeout_s must be a finite number of seconds")
        batch = mgr().events(after, limit)
        generation = state.generation
        deadline = asyncio.get_running_loop().time() + min(max(timeout_s, 0.0), 60.0)
        while not batch.events and not batch.lost and not state.closing:
            remaining = deadline - asyncio.get_running_loop().time()
            if remaining <= 0:
                break
            if state.event_wave is None:
                state.event_wave = asyncio.Event()
            try:
                await asyncio.wait_for(state.event_wave.wait(), remaining)
            except TimeoutError:
                break
            if state.generation != generation:  # a new model: the caller must reconnect
                break
            batch = mgr().events(after, limit)
        return _json(batch)

    @app.get("/v1/index/snapshot", response_model=IndexSnapshot, tags=["prefix cache"])
    async def index_snapshot(request: Request) -> Response:
        """Every block key cached now, per layer group and tier, with the sequence number of
        the last event it includes (a follower loads it, then follows ``/v1/events``). Needs
        the token when one is set, as the events do."""
        authorize(request)
        return _json(mgr().index_snapshot())

    @app.get("/v1/layout", response_model=Layout, tags=["layout"])
    async def layout() -> Response:
        return _json(mgr().describe())

    @app.get("/v1/estimate", response_model=Estimate, tags=["layout"])
    async def estimate(
        seq_len: int,
        num_requests: int | None = None,
        prefill_chunk: int | None = None,
        lookahead: int | None = None,
    ) -> Response:
        return _json(
            mgr().estimate(seq_len, num_requests, prefill_chunk=prefill_chunk, lookahead=lookahead)
        )

    @app.get("/v1/stats", response_model=Stats, tags=["layout"])
    async def stats() -> Response:
        return _json(mgr().stats())

    @app.get("/v1/requests", response_model=RequestIds, tags=["tables"])
    async def requests() -> Response:
        return _json(RequestIds(request_ids=mgr().request_ids()))

    @app.get("/v1/request", response_model=RequestInfo, tags=["tables"])
    async def request_info(request_id: str) -> Response:
        return _json(mgr().request(request_id))

    @app.get("/v1/block_table", response_model=IndexRows, tags=["tables"])
    async def block_table(request_id: str) -> Response:
        return _json(IndexRows(rows=mgr().block_table(request_id)))

    @app.get("/v1/committed_tokens", response_model=IndexRow, tags=["tables"])
    async def committed_tokens(request: Request, request_id: str) -> Response:
        """A request's prompt so far: needs the token when one is set."""
        authorize(request)
        return _json(IndexRow(row=mgr().committed_tokens(request_id)))

    # -- shared memory -------------------------------------------------------------------------

    @app.get("/v1/pools", response_model=SharedLayout, tags=["shared memory"])
    async def pools(rank: int = 0) -> Response:
        """The shared pools and page tables of rank ``rank`` (docs/ranks.md)."""
        return _json(mgr().pools(rank))

    async def parse_body(request: Request, model: type[M], optional: bool = False) -> M | None:
        """The body as ``model``, read after the token check (an unauthenticated caller gets
        401 before any parsing) and through the body limit (413 also for chunked bodies)."""
        authorize(request)
        data = await request.body()
        if optional and not data.strip():
            return None
        try:
            return model.model_validate_json(data)
        except ValidationError as exc:
            raise invalid_from_validation(exc.errors()) from None

    @app.post("/v1/consumers", response_model=ConsumerInfo, tags=["shared memory"])
    async def register_consumer(request: Request) -> Response:
        body = await parse_body(request, ConsumerRequest)
        assert body is not None
        return _json(state.register_consumer(body))

    bodies["/v1/consumers"] = ConsumerRequest

    @app.get("/v1/consumers", response_model=Consumers, tags=["shared memory"])
    async def consumers() -> Response:
        state.prune_consumers()
        return _json(Consumers(consumers=list(state.consumers.values())))

    @app.delete("/v1/consumers/{consumer_id}", status_code=204, tags=["shared memory"])
    async def unregister_consumer(request: Request, consumer_id: str) -> Response:
        authorize(request)
        state.unregister_consumer(consumer_id)
        return Response(status_code=204)

    # -- the model -----------------------------------------------------------------------------

    registering = state.metrics.latency.labels("/v1/model")

    @app.post("/v1/model", response_model=ModelInfo, tags=["model"])
    async def register_model(request: Request) -> Response:
        """Register the model: ``layers`` or ``hf_config``, budget and sizing (the service's
        flags where the body says nothing; the device is the service's). Checked first, and
        refused while requests are live; a refusal changes nothing. Then the old pools are
        closed and the new model is built in a new generation (docs/service.md)."""
        body = await parse_body(request, ModelRegistration)
        assert body is not None
        start = perf_counter()
        info = state.register_model(body)
        registering.observe(perf_counter() - start)
        log.info("kvcm model registered: %s", _summary(state.manager))
        return _json(info)

    bodies["/v1/model"] = ModelRegistration

    @app.get("/v1/model", response_model=ModelInfo, tags=["model"])
    async def model() -> Response:
        """The model served now: its config, layout, estimate and generation."""
        return _json(mgr().model())

    # -- sessions ------------------------------------------------------------------------------

    @app.post("/v1/sessions", response_model=SessionInfo, tags=["sessions"])
    async def open_session(request: Request) -> Response:
        body = await parse_body(request, SessionRequest, optional=True)
        return _json(state.open_session(body.ttl_s if body else None))

    bodies["/v1/sessions"] = SessionRequest

    @app.get("/v1/sessions/{session_id}", response_model=SessionInfo, tags=["sessions"])
    async def session_info(session_id: str) -> Response:
        return _json(state.leases.info(session_id))

    @app.post("/v1/sessions/{session_id}/renew", response_model=SessionInfo, tags=["sessions"])
    async def renew_session(request: Request, session_id: str) -> Response:
        authorize(request)
        state.leases.renew(session_id)
        return _json(state.leases.info(session_id))

    @app.delete("/v1/sessions/{session_id}", response_model=SessionClosed, tags=["sessions"])
    async def close_session(request: Request, session_id: str) -> Response:
        authorize(request)
        freed = state.close_session(session_id)
        return _json(SessionClosed(session_id=session_id, freed_requests=freed))

    add_probe_routes(app, state)

    # -- errors --------------------------------------------------------------------------------

    install_error_handlers(app, log)

    openapi.install(app, bodies, auth_required=token is not None)
    app.add_middleware(BodyLimit, limit=body_limit)
    app.add_middleware(CountResponses, metrics=state.metrics)
    app.add_middleware(Generation, generation=lambda: state.generation)
    return app


def _summary(manager: KVCacheManager) -> str:
    """One log line about a model: its size, sizing and device."""
    layout = manager.layout
    slots = sum(manager.num_total_blocks(pg) for pg in range(len(layout.pool_groups)))
    return (
        f"{len(manager.config.layers)} layers, {len(layout.layer_groups)} layer groups, "
        f"{slots} slots, max_seq_len {manager.config.max_seq_len}, device {manager.device}, "
        f"generation {manager.generation[:12]}"
    )


def add_probe_routes(app: FastAPI, state: ServiceState) -> None:
    """``/livez``, ``/readyz`` and ``/metrics``: the read-only routes probes and scrapers need."""

    @app.get("/livez", response_model=Health, tags=["probes"])
    async def livez() -> Response:
        return _json(Health(status="ok"))

    @app.get("/readyz", response_model=Health, tags=["probes"])
    async def readyz() -> Response:
        """200 once the service serves a model; 503 while starting or stopping, and with
        status ``no_model`` until a model is registered (``POST /v1/model``)."""
        if not state.ready:
            return _json(Health(status="not_ready", detail="starting or shutting down"), 503)
        if state.current is None:
            detail = "no model: register one with POST /v1/model"
            return _json(Health(status="no_model", detail=detail), 503)
        return _json(Health(status="ok"))

    @app.get("/metrics", tags=["probes"], response_class=PlainTextResponse)
    async def metrics() -> Response:
        return Response(state.metrics.render(), media_type="text/plain; version=0.0.4")


def create_probe_app(main: FastAPI) -> FastAPI:
    """A second app over the same state with only the probe routes.

    ``kvcm serve --metrics-port`` serves it on its own TCP socket, so that kubelet probes and
    Prometheus reach a service whose API listens on a Unix socket only. Its errors (an unknown
    path, a method a probe does not take) have the service's JSON shape with a stable ``code``
    (``not_found``, ``method_not_allowed``), as docs/service.md promises of every error, not
    FastAPI's ``{"detail": ...}``.
    """
    app = FastAPI(title="kvcm probes", openapi_url=None, docs_url=None, redoc_url=None)
    add_probe_routes(app, main.state.kvcm)
    install_error_handlers(app, log)
    return app


def _layer(layer_id: int | None) -> int:
    if layer_id is None:
        raise InvalidArgument("slot_mapping needs a layer_id (slot_mappings maps every group)")
    return layer_id


async def _reap(state: ServiceState) -> None:
    """Free expired sessions' requests; wakes at the next deadline (at least once a second)."""
    leases = state.leases
    while True:
        deadline = leases.next_deadline()
        delay = 1.0 if deadline is None else min(1.0, max(0.01, deadline - leases.clock()))
        await asyncio.sleep(delay)
        try:
            freed = state.expire()
            state.prune_consumers()
        except Exception:  # never let the reaper die; the next round tries again
            log.exception("lease reaper failed")
            continue
        if freed:
            log.info("lease expiry freed %d requests", freed)


def app_from_settings(settings: Any) -> FastAPI:
    """Build the manager and the app from ``Settings`` (what ``kvcm serve`` runs); with no
    model source, the app starts without a model (its device is checked now, not at the
    first registration)."""
    if settings.has_model:
        manager = KVCacheManager(settings.manager_config())
    else:
        manager = None
        resolve_device(settings.device or "cpu")
    token = settings.api_token.get_secret_value() if settings.api_token else None
    return create_app(
        manager,
        lease_ttl_s=settings.lease_ttl,
        max_body_bytes=settings.max_body_bytes,
        api_token=token,
        defaults=settings.registration_defaults(manager.config if manager else None),
        step_socket=settings.step_socket,
        step_poll_us=settings.step_poll_us,
        step_spin_s=settings.step_spin_s,
        request_timeout=settings.request_timeout,
        kv_events_zmq=settings.kv_events_zmq,
        peers=settings.peers(),
    )

"""The transfer routes of the service (docs/disaggregation.md): a sidecar's agent metadata,
hand-offs, exports to peers, pulls from peers, and the loop that advances moves.

Who talks to whom: a decode sidecar's ``POST /v1/transfer/pull`` names a peer of its
operator's ``--peer NAME=URL`` list (never an address from the request); the sidecar asks
that peer, with the peer's token, for its agent (``GET /v1/transfer/agent``, loaded once per
peer generation) and for the export of the request (``POST /v1/transfer/export``, which
carries the scope digest: a peer answers only for the request's own scope); then it reads
the blocks with NIXL. Every transfer route needs the token, and ``--transfer`` needs one.

Concurrency: the awaits (calls to the peer) come before the manager call, which runs on the
loop without awaiting, as every route does (``server.state``).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Mapping
from typing import Any

import httpx
from fastapi import FastAPI, Request, Response
from pydantic import BaseModel, ValidationError

from kvcm_client.errors import (
    KVCMError,
    PeerUnreachable,
    TransferUnavailable,
    Unauthorized,
    UnknownPeer,
    error_from_dict,
    invalid_from_validation,
)
from kvcm_client.transfer import (
    ExportRequest,
    FetchRequest,
    HandOffRequest,
    KVExport,
    PrefixRequest,
    PullRequest,
    PullState,
    PullStates,
    TransferAgent,
    TransferStatusRequest,
)

from ..hashing import root_key
from ..transfers import scope_digest
from .state import ServiceState

log = logging.getLogger("kvcm.transfer")
JSON = "application/json"
#: Seconds a call to a peer may take (the export is small; the agent metadata a few KiB).
PEER_TIMEOUT_S = 10.0
#: How often the loop polls while a move runs.
POLL_S = 0.0005


class Peers:
    """The peers an operator configured (name -> URL, token) and the agent each runs now."""

    def __init__(self, peers: Mapping[str, tuple[str, str | None]]) -> None:
        self.peers = dict(peers)
        #: Peer name -> the agent name loaded from it (its generation: a restart is new).
        self.agents: dict[str, str] = {}
        self.client: httpx.AsyncClient | None = None

    async def call(self, name: str, method: str, path: str, body: BaseModel | None) -> bytes:
        """One call to a configured peer; its typed error, or ``PeerUnreachable``."""
        url, token = self.peers[name]
        if self.client is None:
            self.client = httpx.AsyncClient(timeout=PEER_TIMEOUT_S, trust_env=False)
        headers = {"authorization": f"Bearer {token}"} if token else {}
        content = None if body is None else body.model_dump_json().encode()
        if content is not None:
            headers["content-type"] = JSON
        try:
            answer = await self.client.request(method, url + path, content=content, headers=headers)
        except httpx.HTTPError as exc:
            raise PeerUnreachable(
                f"peer {name!r} did not answer: {type(exc).__name__}", peer=name
            ) from None
        if answer.status_code >= 400:
            try:
                error = error_from_dict(answer.json(), answer.status_code)
            except ValueError:
                error = PeerUnreachable(f"peer {name!r} answered HTTP {answer.status_code}")
            if isinstance(error, Unauthorized):  # the peer refused our token: not our caller's
                error = PeerUnreachable(f"peer {name!r} refused this sidecar's token", peer=name)
            raise error
        return answer.content

    async def close(self) -> None:
        if self.client is not None:
            await self.client.aclose()


class Poller:
    """Advances the moves while any runs (``KVCacheManager.poll_transfers``), every
    ``POLL_S``; idle, it waits to be woken by a hand-off or a pull, so an idle sidecar burns
    nothing."""

    def __init__(self, state: ServiceState) -> None:
        self.state = state
        self.wake = asyncio.Event()

    async def run(self) -> None:
        while True:
            await self.wake.wait()
            self.wake.clear()
            while True:
                manager = self.state.current
                if manager is None or not manager.transfers_busy:
                    break
                try:
                    manager.poll_transfers()
                except KVCMError as exc:  # a poll's own errors end in the pull's outcome
                    log.warning("transfer poll: %s", exc.message)
                self.state.notify_events()
                await asyncio.sleep(POLL_S)


def _parse(model: type[Any], data: bytes) -> Any:
    try:
        return model.model_validate_json(data)
    except ValidationError as exc:
        raise invalid_from_validation(exc.errors()) from None


def _json(model: BaseModel) -> Response:
    return Response(model.model_dump_json().encode(), media_type=JSON)


def install(
    app: FastAPI,
    state: ServiceState,
    authorize: Callable[[Request], None],
    token_set: bool,
    peers: Peers,
    poller: Poller,
    bodies: dict[str, type[BaseModel]],
) -> None:
    """Register the ``/v1/transfer/*`` routes (module docstring); ``bodies`` gets their
    request bodies (the OpenAPI document's)."""
    bodies["/v1/transfer/hand_off"] = HandOffRequest
    bodies["/v1/transfer/export"] = ExportRequest
    bodies["/v1/transfer/pull"] = PullRequest
    bodies["/v1/transfer/status"] = TransferStatusRequest
    bodies["/v1/transfer/prefix"] = PrefixRequest
    bodies["/v1/transfer/fetch"] = FetchRequest

    async def connected(peer: str, found: KVExport) -> None:
        """Load ``peer``'s agent unless the one the export names is loaded already."""
        if not found.token_ids or found.agent in state.manager.connected_agents():
            return
        agent = TransferAgent.model_validate_json(
            await peers.call(peer, "GET", "/v1/transfer/agent", None)
        )
        if agent.name != found.agent:
            raise PeerUnreachable(f"peer {peer!r} restarted while this pull asked it", peer=peer)
        old = peers.agents.get(peer)
        if old is not None and old in state.manager.connected_agents():
            state.manager.disconnect_peer(old)  # its previous life
        state.manager.connect_peer(agent.metadata)
        peers.agents[peer] = agent.name

    def configured(peer: str) -> None:
        if state.manager.parts.transfers is None:
            raise TransferUnavailable(
                "this sidecar has no transfer endpoint (kvcm serve --transfer nixl)", backend=None
            )
        if peer not in peers.peers:
            raise UnknownPeer(
                f"peer {peer!r} is not configured here (kvcm serve --peer NAME=URL)", peer=peer
            )

    def guard(request: Request) -> None:
        """The model first (``no_model``), then the token: every transfer route needs one."""
        _ = state.manager
        if not token_set:
            raise Unauthorized("the transfer routes need the service to run with KVCM_API_TOKEN")
        authorize(request)

    @app.get("/v1/transfer/agent", response_model=TransferAgent, tags=["transfer"])
    async def agent(request: Request) -> Response:
        """This sidecar's transfer agent: its name and NIXL metadata (peers load it)."""
        guard(request)
        return _json(state.manager.transfer_agent())

    @app.post("/v1/transfer/hand_off", response_model=KVExport, tags=["transfer"])
    async def hand_off(request: Request) -> Response:
        """Pin a committed request for a peer's pull; freed when the pull ends or at the
        deadline (``KVCacheManager.hand_off``)."""
        data = await request.body()  # read whole before any answer (keep-alive)
        guard(request)
        body = _parse(HandOffRequest, data)
        export = state.manager.hand_off(body.request_id, body.deadline_s)
        poller.wake.set()
        return _json(export)

    @app.post("/v1/transfer/export", response_model=KVExport, tags=["transfer"])
    async def export(request: Request) -> Response:
        """A handed-off request's export, for a peer pulling it in the same scope."""
        data = await request.body()  # read whole before any answer (keep-alive)
        guard(request)
        body = _parse(ExportRequest, data)
        return _json(state.manager.export_of(body.request_id, body.scope))

    @app.post("/v1/transfer/pull", response_model=PullState, tags=["transfer"])
    async def pull(request: Request) -> Response:
        """Start a request with the KV a configured peer handed off (``pulling`` until
        ``/v1/transfer/status`` says ``ready``)."""
        data = await request.body()  # read whole before any answer (keep-alive)
        guard(request)
        body: PullRequest = _parse(PullRequest, data)
        configured(body.peer)
        scope = scope_digest(root_key(body.lora_id, body.cache_salt))
        found = KVExport.model_validate_json(
            await peers.call(
                body.peer,
                "POST",
                "/v1/transfer/export",
                ExportRequest(request_id=body.peer_request_id, scope=scope),
            )
        )
        await connected(body.peer, found)
        result = state.manager.pull(
            body.request_id,
            found,
            body.lookahead,
            body.lora_id,
            body.cache_salt,
            body.deadline_s,
        )
        poller.wake.set()
        state.notify_events()
        return _json(result)

    @app.post("/v1/transfer/prefix", response_model=KVExport, tags=["transfer"])
    async def prefix(request: Request) -> Response:
        """Pin the longest cached prefix of a prompt for a peer's fetch and export it (no
        tokens: nothing cached). ``KVCacheManager.export_prefix``."""
        data = await request.body()  # read whole before any answer (keep-alive)
        guard(request)
        body: PrefixRequest = _parse(PrefixRequest, data)
        export = state.manager.export_prefix(
            body.token_ids, body.lora_id, body.cache_salt, body.deadline_s
        )
        poller.wake.set()
        return _json(export)

    @app.post("/v1/transfer/fetch", response_model=PullState, tags=["transfer"])
    async def fetch(request: Request) -> Response:
        """Allocate a request with the prefix a configured peer caches pulled in first
        (``KVCacheManager.fetch``); ``pulling`` until ``/v1/transfer/status`` says ready."""
        data = await request.body()  # read whole before any answer (keep-alive)
        guard(request)
        body: FetchRequest = _parse(FetchRequest, data)
        configured(body.peer)
        found = KVExport.model_validate_json(
            await peers.call(
                body.peer,
                "POST",
                "/v1/transfer/prefix",
                PrefixRequest(
                    token_ids=body.token_ids,
                    lora_id=body.lora_id,
                    cache_salt=body.cache_salt,
                    deadline_s=body.deadline_s,
                ),
            )
        )
        await connected(body.peer, found)
        result = state.manager.fetch(
            body.request_id,
            body.num_tokens,
            body.token_ids,
            found,
            body.lookahead,
            body.lora_id,
            body.cache_salt,
            body.deadline_s,
        )
        poller.wake.set()
        state.notify_events()
        return _json(result)

    @app.post("/v1/transfer/status", response_model=PullStates, tags=["transfer"])
    async def status(request: Request) -> Response:
        """Where each pull stands: pulling, ready, failed (with its error) or unknown."""
        body = _parse(TransferStatusRequest, await request.body())
        return _json(PullStates(states=state.manager.transfer_status(body.request_ids)))

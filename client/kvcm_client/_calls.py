"""Sans-IO description of every service call: route, body, whether a retry is safe, parser.

The sync and async clients only differ in how they send a ``Call``; everything else (the
route of each method, its body, how the answer is read) lives here once. Bodies are built
from plain values without client-side validation, so bad arguments are refused by the
service with the same error types the in-process manager raises.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from pydantic import BaseModel, TypeAdapter

from .columns import StepColumnsResult, json_columns
from .errors import KVCMError, error_from_dict
from .models import (
    ConsumerInfo,
    Consumers,
    Estimate,
    Health,
    IndexRow,
    IndexRows,
    IndexSnapshot,
    KVEvents,
    Layout,
    ModelInfo,
    OpResult,
    ProbeResult,
    ProbeTiersResult,
    RaggedPageIndices,
    RequestIds,
    RequestInfo,
    SessionClosed,
    SessionInfo,
    SharedLayout,
    Stats,
    StepResponse,
)
from .transfer import KVExport, PullState, PullStates, TransferAgent

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class Call(Generic[T]):
    method: str
    path: str
    parse: Callable[[bytes], T]
    body: bytes | None = None
    params: dict[str, Any] | None = None
    idempotent: bool = False
    """Safe to resend after the connection broke mid-call (the op may have been applied)."""
    wait_s: float = 0.0
    """How long the service may hold the call on purpose (a long-poll): added to the
    client's read timeout, so a poll is not cut off and resent."""
    pinned: bool = True
    """Send the pinned generation (a service of another one refuses the call). Off for
    ``wait_for_model``'s polls, which wait for whatever model comes."""
    repins: bool = False
    """The answer's generation replaces the pinned one: a registration starts a new
    generation and its client goes on in it."""


def _default(value: Any) -> Any:
    if hasattr(value, "__index__"):  # numpy and torch integers
        return value.__index__()
    if hasattr(value, "tolist"):  # numpy arrays
        return value.tolist()
    if isinstance(value, BaseModel):
        return value.model_dump()
    raise TypeError(f"cannot send {type(value).__name__} to kvcm")


def encode(body: dict[str, Any]) -> bytes:
    return json.dumps(body, default=_default, separators=(",", ":")).encode()


def _model(model: type[BaseModel]) -> Callable[[bytes], Any]:
    return model.model_validate_json


def _none(_: bytes) -> None:
    return None


def _rows(raw: bytes) -> list[list[int]]:
    return IndexRows.model_validate_json(raw).rows


def _row(raw: bytes) -> list[int]:
    return IndexRow.model_validate_json(raw).row


def _results(raw: bytes) -> list[OpResult]:
    return StepResponse.model_validate_json(raw).results


def _ids(raw: bytes) -> list[str]:
    return RequestIds.model_validate_json(raw).request_ids


_INTS = TypeAdapter(int)


def raise_for_status(status: int, content: bytes) -> None:
    """Raise the typed error a non-2xx answer describes."""
    if status < 400:
        return
    try:
        body = json.loads(content)
    except ValueError:
        body = None
    if not isinstance(body, dict) or "code" not in body:
        err = KVCMError(f"HTTP {status}: {content[:200]!r}")
        err.code = "http_error"  # type: ignore[misc]
        err.status = status  # type: ignore[misc]
        raise err
    raise error_from_dict(body, status)


def _post(path: str, parse: Callable[[bytes], T], idempotent: bool = False, **body: Any) -> Call[T]:
    return Call("POST", path, parse, encode(body), idempotent=idempotent)


def _get(path: str, parse: Callable[[bytes], T], **params: Any) -> Call[T]:
    return Call(
        "GET",
        path,
        parse,
        params={k: v for k, v in params.items() if v is not None},
        idempotent=True,
    )


# -- one builder per manager method ------------------------------------------------------------


def prompt_body(
    token_ids: Any, lora_id: Any, cache_salt: Any, multimodal: Any, block_keys: Any
) -> dict[str, Any]:
    """The prefix-reuse fields, with bytes keys as hex (only the fields that are set)."""
    keys = None if block_keys is None else [_hex(k) for k in block_keys]
    given = {
        "token_ids": None if token_ids is None else list(token_ids),
        "lora_id": lora_id,
        "cache_salt": cache_salt,
        "multimodal": None if multimodal is None else [_item(m) for m in multimodal],
        "block_keys": keys,
    }
    return {k: v for k, v in given.items() if v is not None}


def _hex(key: Any) -> Any:
    return key.hex() if isinstance(key, bytes | bytearray) else key


def _item(item: Any) -> Any:
    if hasattr(item, "digest") and not isinstance(item, dict):
        return {"digest": item.digest, "start": item.start, "length": item.length}
    return item


def allocate(
    request_id: str,
    num_tokens: int,
    token_ids: Any,
    lookahead: int,
    lora_id: Any = None,
    cache_salt: Any = None,
    multimodal: Any = None,
    block_keys: Any = None,
    max_new_tokens: int | None = None,
) -> Call[RequestInfo]:
    # Retrying is safe: the manager returns the first result for an identical allocate.
    sized = {} if max_new_tokens is None else {"max_new_tokens": max_new_tokens}
    return _post(
        "/v1/allocate",
        _model(RequestInfo),
        idempotent=True,
        request_id=request_id,
        num_tokens=num_tokens,
        lookahead=lookahead,
        **prompt_body(token_ids, lora_id, cache_salt, multimodal, block_keys),
        **sized,
    )


def probe(
    token_ids: Any, lora_id: Any, cache_salt: Any, multimodal: Any, block_keys: Any
) -> Call[int]:
    body = {"token_ids": token_ids} | prompt_body(None, lora_id, cache_salt, multimodal, block_keys)
    return _post(
        "/v1/probe",
        lambda raw: ProbeResult.model_validate_json(raw).num_hit_tokens,
        idempotent=True,
        **body,
    )


def reset_prefix_cache() -> Call[None]:
    return _post("/v1/reset_prefix_cache", _none, idempotent=True)


def events(after: int, limit: int, timeout_s: float) -> Call[KVEvents]:
    call = _get(
        "/v1/events", _model(KVEvents), after=after, limit=limit, timeout_s=timeout_s or None
    )
    # The service waits at most 60 s.
    return dataclasses.replace(call, wait_s=min(max(float(timeout_s), 0.0), 60.0))


def index_snapshot() -> Call[IndexSnapshot]:
    return _get("/v1/index/snapshot", _model(IndexSnapshot))


def extend(request_id: str, num_new_tokens: int, lookahead: int) -> Call[RequestInfo]:
    return _post(
        "/v1/extend",
        _model(RequestInfo),
        request_id=request_id,
        num_new_tokens=num_new_tokens,
        lookahead=lookahead,
    )


def extend_many(
    request_ids: Sequence[str], num_new_tokens: int | Sequence[int], lookahead: int | Sequence[int]
) -> Call[None]:
    return _post(
        "/v1/extend_many",
        _none,
        request_ids=list(request_ids),
        num_new_tokens=num_new_tokens,
        lookahead=lookahead,
    )


def rewind(request_id: str, num_tokens: int) -> Call[RequestInfo]:
    return _post("/v1/rewind", _model(RequestInfo), request_id=request_id, num_tokens=num_tokens)


def commit(request_id: str, token_ids: Sequence[int]) -> Call[RequestInfo]:
    return _post(
        "/v1/commit", _model(RequestInfo), request_id=request_id, token_ids=list(token_ids)
    )


def commit_many(request_ids: Sequence[str], token_ids: Sequence[Sequence[int]]) -> Call[None]:
    return _post(
        "/v1/commit_many",
        _none,
        request_ids=list(request_ids),
        token_ids=[list(t) for t in token_ids],
    )


def free(request_id: str) -> Call[None]:
    return _post("/v1/free", _none, request_id=request_id)


def step(ops: Sequence[Any], atomic: bool, brief: bool) -> Call[list[OpResult]]:
    return _post("/v1/step", _results, ops=list(ops), atomic=atomic, brief=brief)


def _columns_result(raw: bytes) -> StepColumnsResult:
    return StepColumnsResult(json.loads(raw))


def step_columns(columns: dict[str, Any]) -> Call[StepColumnsResult]:
    return _post("/v1/step_columns", _columns_result, **json_columns(**columns))


def suspend(request_id: str) -> Call[RequestInfo]:
    return _post("/v1/suspend", _model(RequestInfo), request_id=request_id)


def resume(request_id: str) -> Call[RequestInfo]:
    return _post("/v1/resume", _model(RequestInfo), request_id=request_id)


def probe_tiers(token_ids: Any, lora_id: Any, cache_salt: Any) -> Call[tuple[int, int]]:
    def parse(raw: bytes) -> tuple[int, int]:
        result = ProbeTiersResult.model_validate_json(raw)
        return result.device_tokens, result.host_tokens

    body = {"token_ids": token_ids} | prompt_body(None, lora_id, cache_salt, None, None)
    return _post("/v1/probe_tiers", parse, idempotent=True, **body)


def request(request_id: str) -> Call[RequestInfo]:
    return _get("/v1/request", _model(RequestInfo), request_id=request_id)


def request_ids() -> Call[list[str]]:
    return _get("/v1/requests", _ids)


def block_table(request_id: str) -> Call[list[list[int]]]:
    return _get("/v1/block_table", _rows, request_id=request_id)


def committed_tokens(request_id: str) -> Call[list[int]]:
    return _get("/v1/committed_tokens", _row, request_id=request_id)


def page_indices(
    request_ids: Sequence[str], layer_id: int, role: str, mode: str, per_layer: bool
) -> Call[list[list[int]]]:
    return _post(
        "/v1/page_indices",
        _rows,
        idempotent=True,
        request_ids=list(request_ids),
        layer_id=layer_id,
        role=role,
        mode=mode,
        per_layer=per_layer,
    )


def ragged_page_indices(
    request_ids: Sequence[str], layer_id: int, role: str, per_layer: bool
) -> Call[RaggedPageIndices]:
    return _post(
        "/v1/ragged_page_indices",
        _model(RaggedPageIndices),
        idempotent=True,
        request_ids=list(request_ids),
        layer_id=layer_id,
        role=role,
        per_layer=per_layer,
    )


def slot_mapping(
    request_ids: Sequence[str],
    layer_id: int | None,
    num_tokens: int | Sequence[int] | None,
    pad_to: int | None,
) -> Call[Any]:
    path, parse = (
        ("/v1/slot_mapping", _row) if layer_id is not None else ("/v1/slot_mappings", _rows)
    )
    return _post(
        path,
        parse,
        idempotent=True,
        request_ids=list(request_ids),
        layer_id=layer_id,
        num_tokens=num_tokens,
        pad_to=pad_to,
    )


def describe() -> Call[Layout]:
    return _get("/v1/layout", _model(Layout))


def estimate(
    seq_len: int, num_requests: int | None, prefill_chunk: int | None, lookahead: int | None
) -> Call[Estimate]:
    return _get(
        "/v1/estimate",
        _model(Estimate),
        seq_len=seq_len,
        num_requests=num_requests,
        prefill_chunk=prefill_chunk,
        lookahead=lookahead,
    )


def stats() -> Call[Stats]:
    return _get("/v1/stats", _model(Stats))


def open_session(ttl_s: float | None) -> Call[SessionInfo]:
    return _post("/v1/sessions", _model(SessionInfo), ttl_s=ttl_s)


def renew_session(session_id: str) -> Call[SessionInfo]:
    return Call("POST", f"/v1/sessions/{session_id}/renew", _model(SessionInfo), idempotent=True)


def close_session(session_id: str) -> Call[SessionClosed]:
    return Call("DELETE", f"/v1/sessions/{session_id}", _model(SessionClosed))


def free_blocks(stats: Stats, pool_group: int | None) -> int:
    """``num_free_blocks`` from a ``Stats`` (the client's source for it)."""
    if pool_group is None:
        return stats.request_free_blocks
    return _pool_group_value(stats.free_blocks, pool_group)


def total_blocks(stats: Stats, pool_group: int | None) -> int:
    if pool_group is None:
        return stats.request_total_blocks
    return _pool_group_value(stats.total_blocks, pool_group)


def _pool_group_value(values: dict[int, int], pool_group: int) -> int:
    from .errors import InvalidArgument

    key = _INTS.validate_python(pool_group)
    if key not in values:
        raise InvalidArgument(f"no pool group {pool_group}", pool_group=pool_group)
    return values[key]


def register_model(fields: dict[str, Any]) -> Call[ModelInfo]:
    """``POST /v1/model`` with the fields that are set. Never resent: a registration that
    went through has replaced the model (and the resend would be refused as stale)."""
    body = {k: v for k, v in fields.items() if v is not None}
    call = _post("/v1/model", _model(ModelInfo), **body)
    return dataclasses.replace(call, repins=True)


def model(pinned: bool = True) -> Call[ModelInfo]:
    return dataclasses.replace(_get("/v1/model", _model(ModelInfo)), pinned=pinned)


def livez() -> Call[Health]:
    return _get("/livez", _model(Health))


def pools(rank: int = 0) -> Call[SharedLayout]:
    return _get("/v1/pools", _model(SharedLayout), rank=rank or None)


def register_consumer(
    pid: int, generation: str, done_event: str | None = None
) -> Call[ConsumerInfo]:
    # Left out when None: a service from before stream-ordered steps refuses unknown keys.
    extra = {} if done_event is None else {"done_event": done_event}
    return _post("/v1/consumers", _model(ConsumerInfo), pid=pid, generation=generation, **extra)


def unregister_consumer(consumer_id: str) -> Call[None]:
    return Call("DELETE", f"/v1/consumers/{consumer_id}", _none, idempotent=True)


def consumers() -> Call[list[ConsumerInfo]]:
    return _get("/v1/consumers", lambda raw: Consumers.model_validate_json(raw).consumers)


# -- KV moves between sidecars (docs/disaggregation.md) ------------------------------------------


def transfer_agent() -> Call[TransferAgent]:
    return _get("/v1/transfer/agent", _model(TransferAgent))


def hand_off(request_id: str, deadline_s: float) -> Call[KVExport]:
    return _post(
        "/v1/transfer/hand_off", _model(KVExport), request_id=request_id, deadline_s=deadline_s
    )


def pull(
    request_id: str,
    peer: str,
    peer_request_id: str,
    lookahead: int,
    lora_id: Any,
    cache_salt: Any,
    deadline_s: float,
) -> Call[PullState]:
    body = {
        "request_id": request_id,
        "peer": peer,
        "peer_request_id": peer_request_id,
        "lookahead": lookahead,
        "deadline_s": deadline_s,
    }
    body |= {k: v for k, v in (("lora_id", lora_id), ("cache_salt", cache_salt)) if v is not None}
    return _post("/v1/transfer/pull", _model(PullState), **body)


def fetch(
    request_id: str,
    peer: str,
    num_tokens: int,
    token_ids: Any,
    lookahead: int,
    lora_id: Any,
    cache_salt: Any,
    deadline_s: float,
) -> Call[PullState]:
    body = {
        "request_id": request_id,
        "peer": peer,
        "num_tokens": num_tokens,
        "token_ids": token_ids,
        "lookahead": lookahead,
        "deadline_s": deadline_s,
    }
    body |= {k: v for k, v in (("lora_id", lora_id), ("cache_salt", cache_salt)) if v is not None}
    return _post("/v1/transfer/fetch", _model(PullState), **body)


def transfer_status(request_ids: Sequence[str]) -> Call[list[PullState]]:
    return _post(
        "/v1/transfer/status",
        lambda raw: PullStates.model_validate_json(raw).states,
        idempotent=True,
        request_ids=list(request_ids),
    )

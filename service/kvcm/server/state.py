"""The one owner of the manager inside the service: ops, leases, op counts and the model.

The service may have no model (``kvcm serve`` without a model source) until one is
registered: ``manager`` raises ``NoModel`` (503) meanwhile, and the generation is one of its
own, so that clients pinned to it notice the registration. ``register_model`` replaces the
model (docs/service.md#registering-a-model).

Concurrency rule: every method here runs on the event-loop thread (all routes are ``async
def`` and call these methods without awaiting in between), so two HTTP calls never interleave
inside the manager and no lock is needed. A failed op raises before it changes anything (the
manager's contract), so neither the leases nor the counters see half an op.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
import time
import uuid
from collections import Counter as Tally
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

import numpy as np
import orjson
from pydantic import ValidationError

from kvcm_client.errors import (
    STATUS_CODES,
    KVCMError,
    LimitReached,
    NoModel,
    StaleGeneration,
    UnknownConsumer,
    UnknownRequest,
    invalid_from_validation,
)
from kvcm_client.models import (
    AllocateOp,
    CommitManyRequest,
    CommitOp,
    ConsumerInfo,
    ConsumerRequest,
    ExtendManyRequest,
    ExtendOp,
    FreeOp,
    ModelInfo,
    ModelRegistration,
    RequestInfo,
    RequestRef,
    RewindOp,
    SessionInfo,
    StepRequest,
)

from .. import footprint, registration
from ..columnar_types import StepOutcome
from ..manager import KVCacheManager, check_config
from ..ops import plain_step
from .leases import Leases
from .metrics import Metrics

T = TypeVar("T")

#: Work a call leaves for after its answer is out: (function, arguments) pairs, run in order
#: by whoever sent the answer (``StepChannel.answer_first``), before anything else runs on
#: the event loop.
Due = list[tuple[Callable[..., None], tuple[Any, ...]]]


def _alive(pid: int) -> bool:
    """Whether process ``pid`` runs (needs a shared pid namespace across containers)."""
    try:
        os.kill(pid, 0)
    except (ProcessLookupError, OverflowError, ValueError):  # no such pid can exist
        return False
    except PermissionError:
        return True
    try:  # a zombie (exited, not yet reaped by its parent) is gone too
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return True


class ServiceState:
    def __init__(
        self,
        manager: KVCacheManager | None,
        lease_ttl_s: float,
        clock: Callable[[], float] = time.monotonic,
        defaults: Mapping[str, Any] | None = None,
    ) -> None:
        #: The manager, None until a model is registered (``manager`` raises then).
        self.current = manager
        #: The generation while there is no model.
        self._idle_generation = uuid.uuid4().hex
        if defaults is None:
            defaults = {} if manager is None else registration.defaults_of(manager.config)
        #: What a registered model takes where it says nothing (``Settings.registration_defaults``;
        #: by default the device, share and budget of the manager the service starts with).
        self.defaults = dict(defaults)
        self.leases = Leases(lease_ttl_s, clock)
        #: Processes that mapped the shared pools, by consumer id.
        self.consumers: dict[str, ConsumerInfo] = {}
        self.metrics = Metrics(lambda: self.current, self.leases, self.consumers)
        self.ready = False
        #: Set (and replaced) whenever new KV events exist: long-polling readers wait on it.
        self.event_wave: asyncio.Event | None = None
        self._seen_seq = 0
        #: Also publishes the events in vLLM's format (``vllm_events``), when asked for.
        self.event_publisher: Any = None
        #: Set at shutdown: long-polls answer at once instead of being cut off.
        self.closing = False
        self.loop: asyncio.AbstractEventLoop | None = None

    @property
    def manager(self) -> KVCacheManager:
        """The manager; ``NoModel`` (503) while the service has no model."""
        if self.current is None:
            raise NoModel(
                "the service has no model yet: register one (POST /v1/model, "
                "register_model) or start kvcm serve with a model source"
            )
        return self.current

    @property
    def generation(self) -> str:
        """The service generation: the manager's, or the service's own while it has none."""
        return self._idle_generation if self.current is None else self.current.generation

    @property
    def max_seq_len(self) -> int:
        """The model's ``max_seq_len``, or the default one while there is no model."""
        if self.current is None:
            return int(registration.SIZING_DEFAULTS["max_seq_len"])
        return self.current.config.max_seq_len

    def register_model(self, body: ModelRegistration) -> ModelInfo:
        """Build the registered model (the manager's ``register_model``: checked first, and
        refused while requests are live). A new generation forgets the consumers of the old
        pools and answers the ``/v1/events`` long-polls, whose clients must reconnect."""
        try:
            config = registration.to_config(body, self.defaults)
        except ValidationError as exc:
            raise invalid_from_validation(exc.errors()) from None
        before = self.generation
        try:
            if self.current is not None:
                return self.current.register_model(config)
            check_config(config)
            with footprint.allocating():
                self.current = KVCacheManager(config)
            return self.current.model()
        finally:
            if self.generation != before:
                self.consumers.clear()
                self._seen_seq = self.current.last_event_seq if self.current else 0
                self._wake_long_polls()
                self.event_wave = None  # the next long-poll waits on a fresh one

    def begin_shutdown(self) -> None:
        """Stop reporting ready and answer every open long-poll now. Safe from a signal
        handler or another thread (the wake-up is handed to the event loop)."""
        self.closing = True
        self.ready = False
        if self.loop is not None and not self.loop.is_closed():
            self.loop.call_soon_threadsafe(self._wake_long_polls)

    def _wake_long_polls(self) -> None:
        if self.event_wave is not None:
            self.event_wave.set()

    def notify_events(self) -> None:
        """Wake the ``/v1/events`` long-polls if the manager logged events since last time."""
        last = self.manager.last_event_seq
        if last != self._seen_seq:
            self._seen_seq = last
            if self.event_publisher is not None:
                self.event_publisher.publish(self.manager)
            if self.event_wave is not None:
                self.event_wave.set()
            self.event_wave = asyncio.Event()

    def _counted(self, op: str, fn: Callable[[], T]) -> T:
        try:
            out = fn()
        except KVCMError as exc:
            self.metrics.ops.labels(op, exc.code).inc()
            raise
        self.metrics.ops.labels(op, "ok").inc()
        return out

    def touch(self, session_id: str | None) -> None:
        """Renew the caller's lease (every call that names a session does)."""
        if session_id is not None:
            self.leases.renew(session_id)

    # -- ops -----------------------------------------------------------------------------------

    def allocate(self, op: AllocateOp, session_id: str | None) -> RequestInfo:
        self.touch(session_id)
        m = self.manager
        info = self._counted(
            "allocate",
            lambda: m.allocate(
                op.request_id,
                op.num_tokens,
                op.token_ids,
                op.lookahead,
                op.lora_id,
                op.cache_salt,
                op.multimodal,
                op.block_keys,
                op.max_new_tokens,
            ),
        )
        if session_id is not None:
            self.leases.adopt(session_id, op.request_id)
        return info

    def extend(self, op: ExtendOp, session_id: str | None) -> RequestInfo:
        self.touch(session_id)
        m = self.manager
        return self._counted(
            "extend", lambda: m.extend(op.request_id, op.num_new_tokens, op.lookahead)
        )

    def extend_many(self, req: ExtendManyRequest, session_id: str | None) -> None:
        self.touch(session_id)
        m = self.manager
        self._counted(
            "extend_many",
            lambda: m.extend_many(req.request_ids, req.num_new_tokens, req.lookahead),
        )

    def rewind(self, op: RewindOp, session_id: str | None) -> RequestInfo:
        self.touch(session_id)
        return self._counted("rewind", lambda: self.manager.rewind(op.request_id, op.num_tokens))

    def commit(self, op: CommitOp, session_id: str | None) -> RequestInfo:
        self.touch(session_id)
        return self._counted("commit", lambda: self.manager.commit(op.request_id, op.token_ids))

    def commit_many(self, req: CommitManyRequest, session_id: str | None) -> None:
        self.touch(session_id)
        m = self.manager
        self._counted("commit_many", lambda: m.commit_many(req.request_ids, req.token_ids))

    def free(self, op: FreeOp, session_id: str | None) -> None:
        self.touch(session_id)
        self._counted("free", lambda: self.manager.free(op.request_id))
        self.leases.release(op.request_id)

    def suspend(self, op: RequestRef, session_id: str | None) -> RequestInfo:
        self.touch(session_id)
        return self._counted("suspend", lambda: self.manager.suspend(op.request_id))

    def resume(self, op: RequestRef, session_id: str | None) -> RequestInfo:
        self.touch(session_id)
        return self._counted("resume", lambda: self.manager.resume(op.request_id))

    @staticmethod
    def parse_step(raw: bytes) -> tuple[list[dict[str, Any]], bool, bool]:
        """A ``POST /v1/step`` body as (ops, atomic, brief); touches no state, so a large
        body can be parsed off the event loop.

        Bodies that ``plain_step`` accepts (every well-formed step) skip the models (orjson).
        Anything else is validated by ``StepRequest`` and refused with its errors; orjson is
        not the judge there since it reads integers past 64 bits as floats.
        """
        try:
            parsed = plain_step(orjson.loads(raw))
        except orjson.JSONDecodeError:
            parsed = None
        if parsed is None:
            try:
                req = StepRequest.model_validate_json(raw)
            except ValidationError as exc:
                raise invalid_from_validation(exc.errors()) from None
            parsed = [op.model_dump() for op in req.ops], req.atomic, req.brief
        return parsed

    def step_json(self, raw: bytes, session_id: str | None) -> bytes:
        """``POST /v1/step`` from body bytes to answer bytes: ``parse_step``, then
        ``run_step``; orjson out."""
        return self.run_step(self.parse_step(raw), session_id)

    def run_step(
        self, parsed: tuple[list[dict[str, Any]], bool, bool], session_id: str | None
    ) -> bytes:
        return orjson.dumps({"results": self.step_results(parsed, session_id)})

    def step_results(
        self, parsed: tuple[list[dict[str, Any]], bool, bool], session_id: str | None
    ) -> list[dict[str, Any]]:
        """A parsed step's result dicts (``step_plain``'s), leases and op counts updated:
        the step of both transports (HTTP encodes them as JSON, the step channel as msgpack)."""
        ops, atomic, brief = parsed
        self.touch(session_id)
        results = self.manager.step_plain(ops, atomic, brief)
        self._account(ops, results, session_id)
        return results

    def _account(
        self, ops: list[dict[str, Any]], results: list[dict[str, Any]], session_id: str | None
    ) -> None:
        tally: Tally[tuple[str, str]] = Tally()
        extends = 0
        for op, r in zip(ops, results, strict=True):
            kind = op["op"]
            if not r["ok"]:
                tally[kind, r["error"]["code"]] += 1
            elif kind == "extend":
                extends += 1
            else:
                tally[kind, "ok"] += 1
                if kind == "allocate" and session_id is not None:
                    self.leases.adopt(session_id, op["request_id"])
                elif kind == "free":
                    self.leases.release(op["request_id"])
        if extends:
            tally["extend", "ok"] = extends
        self.metrics.count_ops(tally)

    def step_columns(
        self, columns: dict[str, Any], session_id: str | None, due: Due | None = None
    ) -> StepOutcome:
        """A columnar step (``KVCacheManager.step_columns`` keyword arguments) with leases
        and op counts updated: the step of ``POST /v1/step_columns`` and the step channel.
        ``due``: the counts and leases are added to it, for the caller to run once the
        answer is out (the step channel's ``answer_first``), instead of before returning."""
        self.touch(session_id)
        return self._stepped(self.manager.step_columns(**columns), session_id, due)

    def decode_step(
        self,
        handles: np.ndarray,
        num_new_tokens: int,
        lookahead: int,
        flags: tuple[Any, Any, Any],
        session_id: str | None,
        due: Due | None = None,
    ) -> StepOutcome:
        """A decode step (``KVCacheManager.decode_step``; ``flags``: map_slots,
        table_edits, stream_ordered, as they came: the manager checks them), with leases
        and op counts updated (or added to ``due``) as ``step_columns``: the step channel's
        path for a decode step's frame."""
        self.touch(session_id)
        map_slots, table_edits, stream_ordered = flags
        out = self.manager.decode_step(
            handles,
            num_new_tokens,
            lookahead,
            map_slots=map_slots,
            table_edits=table_edits,
            stream_ordered=stream_ordered,
        )
        return self._stepped(out, session_id, due)

    def _stepped(self, out: StepOutcome, session_id: str | None, due: Due | None) -> StepOutcome:
        """``_account_step`` now, or added to ``due``."""
        if due is None:
            self._account_step(out, session_id)
        else:
            due.append((self._account_step, (out, session_id)))
        return out

    def _account_step(self, out: StepOutcome, session_id: str | None) -> None:
        """A columnar step's outcome counted (ops by section and status) and its requests'
        leases adopted or released."""
        metrics = self.metrics
        if out.ok:  # every item ok: a count per section, no tally (every step pays this)
            metrics.ops_ok_later(out.status)
        else:
            tally: Tally[tuple[str, str]] = Tally()
            for section, status in out.status.items():
                failed = status[status != 0].tolist()
                if status.size - len(failed):
                    tally[section, "ok"] += status.size - len(failed)
                for code in failed:
                    tally[section, STATUS_CODES[code]] += 1
            metrics.count_ops(tally)
        if session_id is not None:
            for rid in out.allocated_ids:
                self.leases.adopt(session_id, rid)
        for rid in out.freed_ids:
            self.leases.release(rid)

    # -- consumers (processes that mapped the shared pools) -------------------------------------

    #: Most consumers at once (one per inference-server process, a few per GPU).
    MAX_CONSUMERS = 256

    def register_consumer(self, req: ConsumerRequest) -> ConsumerInfo:
        if len(self.consumers) >= self.MAX_CONSUMERS:
            self.prune_consumers()
        if len(self.consumers) >= self.MAX_CONSUMERS:
            raise LimitReached(
                f"{self.MAX_CONSUMERS} consumers are attached; detach one first",
                max_consumers=self.MAX_CONSUMERS,
            )
        if req.generation != self.manager.generation:
            raise StaleGeneration(
                f"descriptors of generation {req.generation[:12]}; this service is "
                f"{self.manager.generation[:12]}: fetch /v1/pools again",
                generation=req.generation,
            )
        info = ConsumerInfo(
            consumer_id=secrets.token_urlsafe(9), pid=req.pid, generation=req.generation
        )
        if req.done_event is not None:  # refused before the consumer counts
            self.manager.watch_consumer(info.consumer_id, req.done_event)
        self.consumers[info.consumer_id] = info
        return info

    def unregister_consumer(self, consumer_id: str) -> None:
        if self.consumers.pop(consumer_id, None) is None:
            shown = consumer_id[:64]
            raise UnknownConsumer(f"no consumer {shown!r}", consumer_id=shown)
        self.manager.forget_consumer(consumer_id)

    def prune_consumers(self) -> int:
        """Forget consumers whose process is gone (died without detaching), and their done
        events: a dead engine's reads no longer hold the service's edits back."""
        dead = [c for c, info in self.consumers.items() if not _alive(info.pid)]
        for consumer_id in dead:
            del self.consumers[consumer_id]
            self.manager.forget_consumer(consumer_id)
        return len(dead)

    # -- sessions ------------------------------------------------------------------------------

    def open_session(self, ttl_s: float | None) -> SessionInfo:
        return self.leases.open(ttl_s)

    def close_session(self, session_id: str) -> int:
        """End a session now and free its requests; returns how many were freed."""
        freed = self.leases.close(session_id)
        for rid in freed:
            self.manager.free(rid)
        self.metrics.count_ops(Tally({("free", "ok"): len(freed)}))
        return len(freed)

    def expire(self) -> int:
        """Free the requests of every session whose lease ran out; returns how many."""
        freed = 0
        for _, request_ids in self.leases.expired():
            for rid in request_ids:
                with contextlib.suppress(UnknownRequest):  # freed some other way meanwhile
                    self.manager.free(rid)
            freed += len(request_ids)
            self.metrics.lease_sessions_expired.inc()
        if freed:
            self.metrics.lease_requests_freed.inc(freed)
        return freed

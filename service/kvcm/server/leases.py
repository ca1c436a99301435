"""Lease sessions: a scheduler's requests are freed when it stops renewing its session.

A scheduler opens a session (``POST /v1/sessions``) and sends its id in the ``X-KVCM-Session``
header; every call with that header renews the lease, and a request allocated with it belongs
to the session. A scheduler that crashes stops calling, so ``ttl_s`` after its last call the
reaper frees its requests: their blocks go back to the pools instead of leaking until restart.

Time comes from an injectable monotonic clock, so tests move time instead of sleeping.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from kvcm_client.errors import LimitReached, UnknownSession
from kvcm_client.models import SessionInfo


@dataclass(slots=True)
class _Session:
    ttl_s: float
    deadline: float
    request_ids: set[str] = field(default_factory=set)


class Leases:
    #: Most sessions at once: each costs memory and a reaper check (one per scheduler).
    MAX_SESSIONS = 1024

    def __init__(self, default_ttl_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.default_ttl_s = default_ttl_s
        self.clock = clock
        self._sessions: dict[str, _Session] = {}
        self._owner: dict[str, str] = {}

    def __len__(self) -> int:
        return len(self._sessions)

    def open(self, ttl_s: float | None = None) -> SessionInfo:
        ttl = self.default_ttl_s if ttl_s is None else ttl_s
        if len(self._sessions) >= self.MAX_SESSIONS:
            raise LimitReached(
                f"{self.MAX_SESSIONS} sessions are open; close one or let it expire",
                max_sessions=self.MAX_SESSIONS,
            )
        sid = secrets.token_urlsafe(12)
        self._sessions[sid] = _Session(ttl, self.clock() + ttl)
        return self.info(sid)

    def _get(self, session_id: str) -> _Session:
        session = self._sessions.get(session_id)
        if session is None:
            raise UnknownSession(
                f"unknown or expired session {session_id[:64]!r}", session_id=session_id[:64]
            )
        return session

    def info(self, session_id: str) -> SessionInfo:
        s = self._get(session_id)
        return SessionInfo(
            session_id=session_id,
            ttl_s=s.ttl_s,
            expires_in_s=max(0.0, s.deadline - self.clock()),
            num_requests=len(s.request_ids),
        )

    def renew(self, session_id: str) -> None:
        s = self._get(session_id)
        s.deadline = self.clock() + s.ttl_s

    def adopt(self, session_id: str, request_id: str) -> None:
        """``request_id`` (just allocated) belongs to the session; the first owner stays."""
        if request_id not in self._owner:
            self._owner[request_id] = session_id
            self._sessions[session_id].request_ids.add(request_id)

    def release(self, request_id: str) -> None:
        """The request was freed: it belongs to no session any more."""
        sid = self._owner.pop(request_id, None)
        if sid is not None:
            self._sessions[sid].request_ids.discard(request_id)

    def close(self, session_id: str) -> list[str]:
        """End the session now; returns its requests, which the caller frees."""
        s = self._get(session_id)
        del self._sessions[session_id]
        for rid in s.request_ids:
            del self._owner[rid]
        return sorted(s.request_ids)

    def expired(self) -> list[tuple[str, list[str]]]:
        """End every session past its deadline; returns (session, its requests) to free."""
        now = self.clock()
        gone = [sid for sid, s in self._sessions.items() if s.deadline <= now]
        return [(sid, self.close(sid)) for sid in gone]

    def next_deadline(self) -> float | None:
        return min((s.deadline for s in self._sessions.values()), default=None)

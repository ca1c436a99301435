"""The HTTP protocol with a deadline on reading each request (uvicorn has none).

uvicorn closes idle keep-alive connections, but a client that opens a connection and sends
nothing, or sends its headers or body a byte at a time, holds its connection (and the memory of
a request in flight) for as long as it likes: 300 such connections stayed open for as long as
a test kept them. Here every request must arrive whole (headers and body) within
``read_timeout`` seconds of its first byte, or of the connection's opening for the first one;
otherwise the connection is closed. Time spent answering does not count: the deadline stops at
the request's last byte and starts again at the next request's first.

It extends uvicorn's httptools protocol (``uvicorn[standard]``, a dependency). Where httptools
is missing, ``with_deadline`` falls back to uvicorn's h11 protocol without the deadline, and
says so in the log, rather than failing to serve.
"""

from __future__ import annotations

import asyncio
import logging
from asyncio import TimerHandle
from typing import Any

try:
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
except ImportError:  # httptools is not installed
    HttpToolsProtocol = None  # type: ignore[assignment,misc]

_log = logging.getLogger("kvcm")


class DeadlineProtocol(HttpToolsProtocol or asyncio.Protocol):  # type: ignore[misc]
    """``HttpToolsProtocol`` plus the read deadline (``with_deadline`` sets ``read_timeout``)."""

    read_timeout = 10.0

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._read_deadline: TimerHandle | None = None

    def _arm(self) -> None:
        self._disarm()
        self._read_deadline = self.loop.call_later(self.read_timeout, self._too_slow)

    def _disarm(self) -> None:
        if self._read_deadline is not None:
            self._read_deadline.cancel()
            self._read_deadline = None

    def _too_slow(self) -> None:
        self._read_deadline = None
        if not self.transport.is_closing():
            self.transport.close()

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._arm()

    def on_message_complete(self) -> None:
        self._disarm()
        super().on_message_complete()


def with_deadline(read_timeout: float) -> type[DeadlineProtocol] | str:
    """The protocol for ``uvicorn.Config(http=...)``: the class with this read deadline, or
    ``"h11"`` (no deadline, logged) where httptools is missing."""
    if HttpToolsProtocol is None:
        _log.warning("httptools is not installed: serving without a request read deadline")
        return "h11"
    return type("DeadlineProtocol", (DeadlineProtocol,), {"read_timeout": read_timeout})

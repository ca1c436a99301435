"""The service's side of a step ring (``kvcm_client.step_ring``; docs/step-channel.md, "The
shared-memory ring"): a connection's frames through shared memory, polled by the busy-poll
mode's spin instead of read from the socket.

The ring serves what the socket does, the same way: each frame goes through
``StepChannel.handle`` (the same checks, limits, metrics and order), and an answer too large
for its area goes over the socket instead. The client's body is copied out of the mapping
before it is parsed, so a client that keeps writing cannot change a frame under its parser.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

from kvcm import native
from kvcm_client.step_ring import (
    ANSWER_LEN,
    ANSWER_REPEATS,
    ANSWER_SEQ,
    AWAKE_UNTIL,
    ON_SOCKET,
    REQUEST_LEN,
    REQUEST_REPEATS,
    REQUEST_SEQ,
    Ring,
)

#: Rings a service keeps at once (each maps 2 MiB of shared memory); beyond, ``limit_reached``
#: and the client stays on its socket.
MAX_RINGS = 64
#: Nanoseconds the busy poll watches the rings in C (``kvcm._native.ring_watch``) between two
#: polls of the sockets; without the C core, it looks ``RING_LOOKS`` times in Python instead
#: (about as long on the development VM: ~0.3 us a look).
RING_WATCH_NS = 10_000
RING_LOOKS = 16
#: The largest frame body a ring keeps a copy of after taking it, for a frame that repeats
#: it (``ServiceRing.take``): a decode step's is ~2 KiB for 256 requests; up to 1 MiB kept
#: per ring, of 64, would hold memory for frames that rarely repeat.
KEEP_BYTES = 64 << 10


class ServiceRing:
    """One connection's ring, the service's side: it owns the mapping and the count of the
    frames it took."""

    def __init__(self, slot: int) -> None:
        self.ring, peer = Ring.create(slot)
        self._peer_fd: int | None = peer
        self.slot = slot
        #: The last request's sequence number taken (the next frame is ``seq + 1``).
        self.seq = 0
        #: The answer body the answer area holds (the last one written there).
        self._held: bytes | None = None
        #: The last frame's body taken (a copy, up to ``KEEP_BYTES``), which a frame that
        #: repeats it is.
        self._taken: bytes | None = None

    def give_fd(self) -> int:
        """The fd to send to the client, once (the caller closes it after sending)."""
        fd, self._peer_fd = self._peer_fd, None
        if fd is None:
            raise RuntimeError("the ring's fd was given already")
        return fd

    def pending(self) -> bool:
        """Whether the client published its next frame."""
        return self.ring.words[REQUEST_SEQ] == self.seq + 1

    def take(self, limit: int) -> bytes | int:
        """The next frame's body (a copy), or its length when over the slot or ``limit``
        (the channel's frame limit now, which a registered model may have lowered since the
        ring was made): refused. A frame the client says repeats the last
        (``REQUEST_REPEATS``) is the last body taken, the very object, not read from the
        area again: the same bytes, whatever the area holds. A client that says so wrongly
        only gets its last frame run again, which it could have sent anyway."""
        words = self.ring.words
        self.seq = seq = self.seq + 1
        taken = self._taken
        if taken is not None and words[REQUEST_REPEATS] == seq and len(taken) <= limit:
            return taken
        self._taken = None
        n = words[REQUEST_LEN]
        if n > min(self.slot, limit):
            return n
        taken = bytes(self.ring.request[:n])
        if n <= KEEP_BYTES:
            self._taken = taken
        return taken

    def reply(self, body: bytes) -> bool:
        """Publish the answer to the frame last taken; False when it does not fit (the
        caller sends it over the socket and then ``replied_on_socket``). An answer equal to
        the last one written is not written again, only its sequence number, in
        ``ANSWER_REPEATS`` too: the client reads the answer it kept (a decode step's answer
        is the same until a request crosses a block boundary). A client that writes into
        its answer area itself reads what it wrote: its ring is its own."""
        n = len(body)
        if n > self.slot:
            return False
        words = self.ring.words
        if body != self._held:
            self._held = None  # (the area is not the last answer's while it is written)
            self.ring.answer[:n] = body
            self._held = body
        else:  # the client may read the answer it kept of the last one
            words[ANSWER_REPEATS] = self.seq
        words[ANSWER_LEN] = n
        words[ANSWER_SEQ] = self.seq  # last: the client reads the answer once it sees this
        return True

    def replied_on_socket(self) -> None:
        """The answer to the frame last taken went over the socket, whole."""
        words = self.ring.words
        words[ANSWER_LEN] = ON_SOCKET
        words[ANSWER_SEQ] = self.seq

    def awake_until(self, ns: int) -> None:
        """Tell the client until when the service polls (CLOCK_MONOTONIC ns; 0: asleep)."""
        self.ring.words[AWAKE_UNTIL] = ns

    def close(self) -> None:
        if self._peer_fd is not None:  # never sent
            os.close(self._peer_fd)
            self._peer_fd = None
        self.ring.close()


def watch(rings: Sequence[ServiceRing], ns: int) -> bool:
    """Whether one of ``rings`` holds its client's next frame, watched for up to ``ns``
    nanoseconds (0: one look): the busy poll's look at the rings.

    Why in C where it is built: a look in Python (a call and a memoryview index) takes ~0.3
    us, and the spin's round of looks, socket poll and yield let a frame wait ~5 us at the
    median to be seen (development VM, ``bench/ring_timeline.py``); C's watch is a load and a
    PAUSE a look, and sees a frame within a fraction of a microsecond. Without the C core,
    ``RING_LOOKS`` looks in Python (one for ``ns`` 0)."""
    core = native.core
    if core is not None:
        words = tuple([r.ring.words for r in rings])
        wants = tuple([r.seq + 1 for r in rings])
        return core.ring_watch(words, REQUEST_SEQ, wants, ns) >= 0
    for _ in range(RING_LOOKS if ns else 1):
        for r in rings:
            if r.pending():
                return True
    return False

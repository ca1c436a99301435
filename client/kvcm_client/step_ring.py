"""The step ring: the step channel's frames through shared memory (docs/step-channel.md,
"The shared-memory ring").

A service in busy-poll mode (``kvcm serve --step-spin-s``) polls for the next frame anyway;
over the socket each frame still pays four system calls and a wake-up of the reader on each
side, tens of microseconds at an engine's cadence (and most of the tail). Over the ring a frame
is a copy into a mapping both processes share and an 8-byte store the service's poll sees.

A connection asks for its ring with the ``ring`` op; the answer brings a memfd
(``SCM_RIGHTS``), so only that peer can map it. The mapping (``slot`` from the answer):

=============================  ===============================================================
bytes                          what
=============================  ===============================================================
word 8 (byte 64)               request sequence number, written by the client *last*
word 9 (byte 72)               request length in bytes
word 10 (byte 80)              the last request whose body repeats the one before it
word 16 (byte 128)             answer sequence number, written by the service *last*
word 17 (byte 136)             answer length (``ON_SOCKET``: the answer came over the socket)
word 18 (byte 144)             the last answer whose body repeats the one before it
word 24 (byte 192)             until when the service polls, CLOCK_MONOTONIC ns (0: asleep)
[4096, 4096 + slot)            the request's msgpack body (the frame without its length prefix)
[4096 + slot, 4096 + 2 slot)   the answer's msgpack body
=============================  ===============================================================

Sequence numbers count from 1, each side's words in a cache line of their own. A reader
waits for the exact next number, so a store seen half done (never the next number) is never
taken for a frame. x86-64 only: its stores become visible in program order, so a sequence
number seen means the body before it is there too (a weaker memory model would need fences
Python does not have); elsewhere the service refuses the ring and the socket serves.

A body equal to the last one its side wrote is not written again: the writer stores the
body's sequence number in its side's "repeats" word (10, 18) before the sequence number
itself, and the reader, which kept the last body it read, need not read the area again (a
decode step with the same requests as the last, and its answer between block crossings). A
repeats word that holds an older number says nothing of the body now, and a peer that never
writes it (an older one) only has its bodies read every time.

Example: the client's 3rd call writes its 2,080-byte body at 4096, then word 9 = 2080, then
word 8 = 3; the service, polling word 8 for 3, copies the body out, runs it, writes the answer
at 4096 + slot, word 17 = its length, then word 16 = 3, which the client was polling for. Its
4th call, the same frame again, writes word 10 = 4, then word 8 = 4: the service runs the body
it copied out for frame 3.
"""

from __future__ import annotations

import fcntl
import mmap
import os
import platform
import time

#: The op that asks for a ring (on the socket; not one of ``step_channel.OPS``: it runs nothing).
RING_OP = "ring"
#: Bytes before the bodies: the words above, a page.
HEADER_BYTES = 4096
#: Bytes of each body area (the service may offer less: its frame limit).
SLOT_BYTES = 1 << 20
#: The words (8-byte indices into the header page).
REQUEST_SEQ, REQUEST_LEN, REQUEST_REPEATS = 8, 9, 10
ANSWER_SEQ, ANSWER_LEN, ANSWER_REPEATS = 16, 17, 18
AWAKE_UNTIL = 24
#: An answer too large for its area went over the socket instead, whole, as a frame.
ON_SOCKET = (1 << 64) - 1
#: The seals a ring's memfd carries: its size fixed for good.
SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL
#: Architectures whose stores are seen in program order (see the module docstring).
ORDERED = frozenset({"x86_64", "AMD64", "amd64"})


def supported() -> bool:
    """Whether this machine can run a ring (Linux memfds, x86-64's store order)."""
    return hasattr(os, "memfd_create") and platform.machine() in ORDERED


def ring_bytes(slot: int) -> int:
    """The mapping's size for ``slot`` bytes each way."""
    return HEADER_BYTES + 2 * slot


class Ring:
    """One side's view of a ring: the mapping, its words and its two body areas. The
    service makes it (``create``), the client maps the fd it was sent (``Ring(fd, slot)``)."""

    def __init__(self, fd: int, slot: int) -> None:
        """Map ``fd`` (``ring_bytes(slot)`` long); the fd is closed once mapped."""
        try:
            self._map = mmap.mmap(fd, ring_bytes(slot))
        finally:
            os.close(fd)
        self.slot = slot
        view = memoryview(self._map)
        #: The header's words: native stores of 8 aligned bytes each.
        self.words = view[:HEADER_BYTES].cast("Q")
        self.request = view[HEADER_BYTES : HEADER_BYTES + slot]
        self.answer = view[HEADER_BYTES + slot : HEADER_BYTES + 2 * slot]

    @classmethod
    def create(cls, slot: int) -> tuple[Ring, int]:
        """A new ring and a duplicate of its fd to send to the peer (the caller closes it).
        Its size is sealed: a peer that could shrink the memfd would make the service's
        next look at it a SIGBUS."""
        fd = os.memfd_create("kvcm-step-ring", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(fd, ring_bytes(slot))
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, SEALS)
            peer = os.dup(fd)
        except BaseException:
            os.close(fd)
            raise
        try:
            return cls(fd, slot), peer
        except BaseException:
            os.close(peer)
            raise

    def close(self) -> None:
        """Unmap (the views first: a mapping with views exported cannot close)."""
        for view in (self.words, self.request, self.answer):
            view.release()
        self._map.close()


class ClientRing(Ring):
    """The client's side: one call at a time, in order."""

    def __init__(self, fd: int, slot: int) -> None:
        """Map a ring the service sent; refused (``OSError``) unless its size is sealed."""
        if fcntl.fcntl(fd, fcntl.F_GET_SEALS) & SEALS != SEALS:
            os.close(fd)
            raise OSError("the step ring's memfd is not sealed")
        super().__init__(fd, slot)
        self.seq = int(self.words[REQUEST_SEQ])
        #: The frame whose body the request area holds (the service only reads the area).
        self._held: bytes | None = None

    def post(self, frame: bytes, start: int) -> int:
        """Publish ``frame[start:]`` (at most ``slot`` bytes: the frame less its length
        prefix) as the next request; its sequence number. A frame equal to the last one
        posted is not written again, only its sequence number, in ``REQUEST_REPEATS`` too:
        its body is in the area still (and in the service's copy of the last frame), and
        each cache line written is one the service's core must fetch again. An
        engine's decode step with the same requests as the last is such a frame; writing
        its 2 KiB again took ~3 us, cold, on the development VM (2 KiB of handles: 32 lines
        fetched from the service's core, one by one)."""
        words = self.words
        seq = self.seq + 1
        if frame != self._held:
            self._held = None  # (the area is not the last frame's while it is written)
            n = len(frame) - start
            self.request[:n] = memoryview(frame)[start:]
            words[REQUEST_LEN] = n
            self._held = frame
        else:  # the service may take the body it kept of the last frame
            words[REQUEST_REPEATS] = seq
        self.seq = seq
        words[REQUEST_SEQ] = seq  # last: the service takes the frame once it sees this
        return seq

    def awake(self) -> bool:
        """Whether the service says it polls now (no doorbell needed), with 50 us to spare."""
        return self.words[AWAKE_UNTIL] > time.perf_counter_ns() + 50_000

    def answered(self, seq: int) -> bool:
        return self.words[ANSWER_SEQ] == seq

    def answer_body(self) -> bytes | None:
        """The answer's body once ``answered`` (a copy: no view of the mapping outlives the
        call, so the ring can always be closed); None when it came over the socket."""
        n = self.words[ANSWER_LEN]
        return None if n == ON_SOCKET else bytes(self.answer[:n])

    def answer_repeats(self, seq: int) -> bool:
        """Whether the answer to ``seq`` (once ``answered``) is the body the answer area
        held before it, not written again (the service says so: ``ANSWER_REPEATS``)."""
        return self.words[ANSWER_REPEATS] == seq

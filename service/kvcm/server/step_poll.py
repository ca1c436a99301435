"""The step channel's poll after an answer: wait for a client's next frame awake, briefly,
when that client has been sending its next frame soon after each answer.

Why: between two frames the service sleeps in the event loop. On a virtual machine a
sleeping core is halted, and waking it for the next frame costs tens of microseconds, after
which the step runs on cold caches: measured on the 2-core development VM, the load test's
step through the typed client took 150 us at the median with the service sleeping between
frames, and 99 us with it polling for up to 300 us after each answer (bench/RESULTS.md,
2026-12-05).

The poll is adaptive, so that an engine whose next call comes milliseconds later pays
nothing for it (it rings the doorbell, below, instead): the service polls after answering an
op on a connection only when the last answer to that op on that connection was followed by
the connection's next frame within the window. Keyed by op because engines alternate: a
``step_columns`` followed at once by a ``slot_mappings``, then a long wait for the model. A
poll that runs out of time turns the poll off for that op until a frame follows it within
the window again, so at most every other answer is followed by a poll that runs out, and
polls that keep running out back off exponentially (``GapPredictor``); an idle service never
polls. The poll watches every connection of the channel (a frame on any of them ends it),
yields the core between looks, and holds the event loop for at most the window: HTTP
requests wait that long at most. On one CPU (the process's affinity) the service never
polls: its client needs that core to send the frame the poll waits for.

Example (window 300 us): answers to ``step_columns`` followed by the next frame 120 us later
are each followed by a poll that the frame ends; a client that then pauses for 20 ms makes
one poll run out (300 us of a core spent), and the service sleeps after the answers that
follow until a frame comes within 300 us of one.

A client whose call begins after a longer pause rings the doorbell (a zero-length frame)
before it builds the frame; the service polls for that frame at once (``GapPredictor.rang``),
so the frame finds it awake.
"""

from __future__ import annotations

import select
from collections.abc import Callable
from os import sched_yield
from time import perf_counter_ns

#: Microseconds the service polls for a client's next frame after an answer, where the last
#: answer to the op was followed that soon (``kvcm serve --step-poll-us``).
DEFAULT_POLL_US = 300.0
#: The key of the doorbell (a zero-length frame) in ``GapPredictor``'s back-off and in the
#: frame metrics: the client rang it as a call began, so its frame follows.
WAKE = "wake"
#: The prefix of the keys, in ``GapPredictor``'s back-off, of the polls after the first
#: answer to each op that follows a doorbell (the client's burst may go on): "burst step".
BURST = "burst "


class FramePoll:
    """The file descriptors of a channel's connections, polled together without blocking."""

    def __init__(self, window_us: float) -> None:
        self.window_ns = int(window_us * 1000)
        self._poll = select.poll()

    def add(self, fd: int) -> None:
        self._poll.register(fd, select.POLLIN)

    def remove(self, fd: int) -> None:
        self._poll.unregister(fd)

    def wait(
        self,
        window_ns: int | None = None,
        ready: Callable[[], bool] | None = None,
        idle: Callable[[], None] | None = None,
    ) -> bool:
        """Poll until a connection has bytes to read or ``ready()`` says so (True; the step
        rings' look) or the window passes (False; ``window_ns``, default this poll's),
        yielding the core between looks: a client that shares it gets to send its frame.
        ``idle``: work that changes nothing, run every ``IDLE_EVERY_NS`` of the wait (the
        busy poll's rehearsal, ``StepChannel.rehearse``)."""
        poll = self._poll.poll
        until = perf_counter_ns() + (self.window_ns if window_ns is None else window_ns)
        if ready is not None or idle is not None:
            return self._wait_busy(until, ready, idle)
        while not poll(0):
            if perf_counter_ns() >= until:
                return False
            sched_yield()
        return True

    #: How often ``wait``'s ``idle`` runs. Measured on the development VM, a step run again
    #: after 50 us of other work costs what it does back to back, after 1 ms 18% more, after
    #: 5 ms 57% more (the caches and predictors it warmed are taken by other work meanwhile).
    IDLE_EVERY_NS = 100_000

    def _wait_busy(
        self, until: int, ready: Callable[[], bool] | None, idle: Callable[[], None] | None
    ) -> bool:
        """``wait`` with rings or idle work: ``ready()`` watches the rings for a while
        (``step_ring.watch``: a system call is a microsecond or more on a virtual machine,
        a look at a ring a load from shared memory), then the sockets are polled and the
        core yielded; after ``idle`` ran, every source is looked at again before the next
        yield."""
        poll = self._poll.poll
        ready = ready or _never
        idle_at = perf_counter_ns() + self.IDLE_EVERY_NS if idle is not None else until
        while True:
            if ready():
                return True
            if poll(0):
                return True
            now = perf_counter_ns()
            if now >= until:
                return False
            if idle is not None and now >= idle_at:
                idle()
                idle_at = perf_counter_ns() + self.IDLE_EVERY_NS
                continue
            sched_yield()


def _never() -> bool:
    return False


class GapPredictor:
    """One connection's record of which ops' answers were followed soon by its next frame,
    and of its polls that ran out. ``clock``: nanoseconds (``perf_counter_ns``; tests pass
    their own).

    Back-off: after ``k`` polls in a row for an op that ran out, the next ``2**k - 1``
    answers that would be polled for are not (``k`` at most ``MAX_MISSES``), so a client
    whose frames never come within the window however short its gaps look (its core taken
    by others) costs ever fewer polls. A poll that a frame ends starts over.

    A doorbell starts a burst: the first answer after it is polled for whatever the op's
    record says (a client back from an idle spell often sends several frames in a row, and
    its op's record is of its last burst's end), with a back-off of its own per op (``BURST``:
    a client whose op lists take it a millisecond to read backs off there, not where its
    columnar steps follow one another at once).

    Example: answers to ``step_columns`` 120 us apart, then a pause of 40 ms (the poll after
    the last answer runs out: the op skips its next poll), a doorbell, and answers 120 us
    apart again: the doorbell's poll and the poll after the first answer (the burst's) end
    by a frame, the second answer's poll is the one skipped, and the polls after the answers
    that follow end by a frame. Without the burst, the first answer's poll would not run
    either (its frame came 40 ms after the last answer).
    """

    MAX_MISSES = 10

    __slots__ = (
        "answered_ns",
        "answered_op",
        "burst",
        "clock",
        "misses",
        "skip",
        "soon",
        "window_ns",
    )

    def __init__(self, window_ns: int, clock: Callable[[], int] = perf_counter_ns) -> None:
        self.window_ns = window_ns
        self.clock = clock
        self.soon: dict[str, bool] = {}
        self.misses: dict[str, int] = {}
        self.skip: dict[str, int] = {}
        self.answered_op: str | None = None
        self.answered_ns = 0
        self.burst = False  # a doorbell rang; no answer since

    def answered(self, op: str) -> str | None:
        """An answer to ``op`` was sent; whether to poll for the next frame now: the key the
        poll counts under (``poll_ended``), or None."""
        self.answered_op = op
        self.answered_ns = self.clock()
        if self.burst:
            self.burst = False
            key = BURST + op
            if self._due(key):
                return key
        return op if self.soon.get(op, False) and self._due(op) else None

    def rang(self) -> str | None:
        """The doorbell rang; whether to poll for the frame it announces: ``WAKE``, unless
        polls after doorbells back off (a client that rings and then sends nothing within
        the window), then None. A burst begins either way."""
        self.burst = True
        return WAKE if self._due(WAKE) else None

    def _due(self, key: str) -> bool:
        """Whether a poll counted under ``key`` runs, or is one its back-off skips."""
        skip = self.skip.get(key, 0)
        if skip:
            self.skip[key] = skip - 1
            return False
        return True

    def poll_ended(self, key: str, frame: bool) -> None:
        """The poll counted under ``key`` (``answered``'s or ``rang``'s) ended: by a frame,
        or it ran out. (A poll decided but not run, its answer partly unsent, is not
        counted: nothing of it carries over.)"""
        if frame:
            self.misses[key] = 0
            return
        misses = self.misses[key] = min(self.misses.get(key, 0) + 1, self.MAX_MISSES)
        self.skip[key] = (1 << misses) - 1

    def frame_began(self) -> None:
        """The first bytes of a frame arrived: record whether they followed the last answer
        within the window."""
        op = self.answered_op
        if op is not None:
            self.soon[op] = self.clock() - self.answered_ns <= self.window_ns
            self.answered_op = None

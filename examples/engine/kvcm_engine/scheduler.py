"""A continuous-batching scheduler that drives kvcm once per step.

Each step it decides which requests compute how many tokens under a token budget (decodes
first, then prefill chunks of at most ``chunk`` tokens, then new requests), and sends kvcm one
columnar ``step_columns`` call (docs/requests.md#the-columnar-step) with, in its section order:
``commit`` of the tokens computed since (their blocks become reusable prefixes: a prompt's
chunk by chunk, a request's output every 64 steps and when it ends, ``Scheduler._commits``),
``free`` of finished requests, ``extend`` of running ones and ``allocate`` of new ones (with
their token ids, so they reuse cached prefixes). It passes only the sections the step has,
so a step of decodes alone is bare extends: a decode frame over the step channel. Running
requests are named by their kvcm handle; only new ones by id. The call asks for the slot
mapping of the tokens it adds (``map_slots``), so the engine needs no other call for it
(``slots_of``).

When an ``extend`` finds no free block (``out_of_blocks``) the newest running request is
preempted: freed, and put back at the head of the queue to be recomputed later from its
prompt and the tokens it generated so far (which then mostly hit the prefix cache). That
takes one more call per preemption; a step without preemption is one ``step_columns`` call (its
allocates sized by kvcm: ``max_new_tokens``), plus, for a hybrid, one ``probe`` per newly
admitted request (its first chunk must end on a block boundary past its cached prefix).

With ``preempt="suspend"`` (kvcm with a host tier) the victim is suspended instead: the
tokens its extend of this step added and it has not computed are rewound, then its blocks
(and a hybrid's live state) go to the host tier, and it keeps its row and handle. Suspended
requests are resumed, oldest first, in the next steps' calls (the ``resume`` section, before
``extend`` and ``allocate``) and compute again from the step after; new requests wait while
any is suspended. A victim with nothing computed yet, or one the host cannot hold, is freed.

Disaggregated prefill and decode (docs/disaggregation.md): a prefill engine's scheduler
(``hand_off_s``) hands each finished request off instead of freeing it (its last commit runs
first, in the step's call), one ``hand_off`` call each, and lists it in ``handed_off``. A
decode engine's request that names its prefill (``Request.source``: the peer and its kv id;
its output holds the prefill's first token) is admitted by a ``pull``; it waits until a
step's answer lists it ended (``StepColumnsResult.pulls``: no call of its own), and runs
from the next step once ``ready``, with its prompt computed and committed: its first decode
step computes the first token's KV. A pull
that fails falls back to computing the prompt here. A request with ``fetch_from`` first
fetches the prefix that peer caches (``fetch``), then prefills the rest here.

Sequence arithmetic: a request's sequence is prompt + output; the KV of ``seq[:computed]`` is
in the cache. Worked example (tokens_per_block 2, chunk 4, a 10-token prompt whose first 2
tokens are cached): the allocate asks for 2 + 4 = 6 tokens and computes positions 2..5; the
next steps extend by 4 (6..9), and the last chunk's logits give output token 0; then each
decode step extends by 1 and computes the previous output token.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

from kvcm_client.errors import KVCMError

#: Statuses that mean "no room now": the scheduler preempts or waits instead of failing.
_ROOM = frozenset({"out_of_blocks", "max_requests_reached"})
ROW_MASK = 0xFFFFFFFF
#: With ``commit_output="batched"``, running requests' generated tokens are committed every
#: this many steps (and when each ends): 63 of 64 decode steps commit nothing, and a commit
#: holds at most 64 tokens of each request's output (4 bytes each on the step channel).
OUTPUT_COMMIT_STEPS = 64
#: The token a request emits before the forward that picks it has been read back
#: (``Scheduler.advance``): never sent to kvcm, replaced by ``Scheduler.settle``.
UNKNOWN = -1


class KVCM(Protocol):
    """What the scheduler calls: ``KVCacheManager`` in process or ``KVCacheClient``."""

    def step_columns(self, **columns: Any) -> Any: ...

    def probe(self, token_ids: Any) -> int: ...


@dataclass(slots=True)
class Request:
    """One generation request; ``kv_id`` names it in kvcm (a new one per admission)."""

    request_id: str
    prompt: list[int]
    max_new_tokens: int
    arrival_step: int = 0
    output: list[int] = field(default_factory=list)
    computed: int = 0
    committed: int = 0
    row: int = -1
    handle: int = 0
    admissions: int = 0
    hit_tokens: int = 0
    source: tuple[str, str] | None = None
    """Disaggregated decode: (peer, the request's kv id there), whose KV is pulled."""
    fetch_from: str | None = None
    """A peer to fetch the prompt's cached prefix from before prefilling the rest."""
    held: int = 0
    """Tokens kvcm holds for it: ``computed`` plus what this step's ops added."""
    in_flight: int = 0
    """Of ``computed``, the tokens of a forward not read back yet (``Scheduler.advance``):
    their KV may not be written yet, so they are not committed (a peer could fetch the
    block as a prefix meanwhile) until ``Scheduler.landed``."""
    seq: list[int] = field(init=False)
    """prompt + output, kept as tokens are emitted (``emit``; read, never changed, by
    others): the scheduler slices it every step, and building it anew each time was a
    tenth of the step's kvcm time."""

    def __post_init__(self) -> None:
        self.seq = [*self.prompt, *self.output]

    def emit(self, token: int) -> None:
        """The model's next token (``UNKNOWN`` until it is read back: ``settle``)."""
        self.output.append(token)
        self.seq.append(token)

    def settle(self, token: int) -> None:
        """The value of the token emitted last as ``UNKNOWN``."""
        if self.output[-1] != UNKNOWN:
            raise RuntimeError(f"request {self.request_id}: its last token is already known")
        self.output[-1] = self.seq[-1] = token

    @property
    def kv_id(self) -> str:
        return f"{self.request_id}#{self.admissions}"

    @property
    def done(self) -> bool:
        return len(self.output) >= self.max_new_tokens


@dataclass(frozen=True, slots=True)
class Work:
    """A request computes ``count`` tokens from position ``start`` in this step."""

    request: Request
    start: int
    count: int


@dataclass(slots=True)
class SchedulerStats:
    steps: int = 0
    kvcm_calls: int = 0
    preemptions: int = 0
    hit_tokens: int = 0
    admitted: int = 0
    suspends: int = 0
    resumes: int = 0
    pulls: int = 0
    pulled_tokens: int = 0
    fetched_tokens: int = 0
    moved_blocks: int = 0
    pull_failures: int = 0
    call_s: float = 0.0
    """Time inside kvcm's ``step_columns`` calls (the rest of a step's kvcm time is the
    scheduler's own planning and the engine's cut of the mapping)."""


def _extends(plan: list[Work]) -> dict[str, Any]:
    """The ``extend`` section of ``plan``: its handles and their counts, one int when all
    are equal (a decode step's 1)."""
    counts = [w.count for w in plan]
    same = all(c == counts[0] for c in counts)
    return {
        "extend": [w.request.handle for w in plan],
        "num_new_tokens": counts[0] if same else counts,
    }


class Scheduler:
    """Queues, the token budget and the kvcm calls; the engine runs the model."""

    def __init__(
        self,
        kvcm: KVCM,
        *,
        chunk: int,
        max_batch_tokens: int,
        max_running: int,
        align: int = 1,
        preempt: Literal["free", "suspend"] = "free",
        hand_off_s: float | None = None,
        stream_ordered: bool = False,
        commit_output: Literal["batched", "each_step"] | None = None,
    ) -> None:
        """``align``: a prefill chunk that stops short of the sequence's end ends on a
        multiple of this many tokens where it can (``_chunk``); ``commit_output``: when a
        request's generated tokens are committed (``_commits``; by default ``batched``, and
        ``each_step`` where ``align`` > 1: a hybrid's); ``preempt``: how a victim
        gives its blocks back (the module docstring); ``hand_off_s``: a prefill engine's, hand
        finished requests off for this many seconds instead of freeing them;
        ``stream_ordered``: the step calls ask a CUDA sidecar for stream-ordered steps (its
        edits wait for the engine's done event on the device, and its answer for nothing:
        docs/shared-memory.md#stream-ordered-steps)."""
        if chunk < 1 or max_batch_tokens < 1 or max_running < 1 or align < 1:
            raise ValueError("chunk, max_batch_tokens, max_running and align must be positive")
        if preempt not in ("free", "suspend"):
            raise ValueError(f"preempt must be 'free' or 'suspend', got {preempt!r}")
        if commit_output is None:
            commit_output = "each_step" if align > 1 else "batched"
        if commit_output not in ("batched", "each_step"):
            raise ValueError(f"commit_output must be 'batched' or 'each_step': {commit_output!r}")
        self.commit_output = commit_output
        self.kvcm = kvcm
        self.chunk = chunk
        self.align = align
        self.preempt = preempt
        self.max_batch_tokens = max_batch_tokens
        self.max_running = max_running
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # admission order: the last one is the newest
        self.finished: list[Request] = []
        self._to_free: list[Request] = []
        self.suspended: deque[Request] = deque()  # the longest suspended first
        self.hand_off_s = hand_off_s
        self._order = {"stream_ordered": True} if stream_ordered else {}
        #: Handed-off requests (``hand_off_s``), in order: what a decode engine pulls.
        self.handed_off: list[Request] = []
        #: Requests whose KV a pull or a fetch brings, waiting for ``ready``.
        self.pulling: list[Request] = []
        #: This step's rewinds (handle, tokens) and frees of fetched requests that landed.
        self._rewinds: list[tuple[int, int]] = []
        self._free_now: list[int] = []
        #: Pulls the step answers so far said ended, for the next step to take in.
        self._ended: list[Any] = []
        self.stats = SchedulerStats()
        #: This step's slot mapping per planned request (by ``request_id``): the mapping its
        #: kvcm call answered (``map_slots``) and the column its tokens start at.
        self.slots_of: dict[str, tuple[Any, int]] = {}

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    @property
    def idle(self) -> bool:
        return not (self.waiting or self.running or self._to_free or self.suspended or self.pulling)

    def _commits(self) -> tuple[list[int], list[list[int]]]:
        """This step's commits: per request, the tokens computed (and read back) since its
        last commit. With ``commit_output="batched"`` a running request's generated tokens
        wait for its end (its free, hand-off or preemption) or for every
        ``OUTPUT_COMMIT_STEPS``-th step, whichever comes first: the other decode steps
        commit nothing and are bare extends, the step an engine sends most (a decode frame
        over the step channel, docs/step-channel.md), and no step commits more than that
        many steps' output of each request (a frame's size stays bounded); its prompt is
        committed chunk by chunk, for the requests that share it. ``"each_step"`` commits
        each token the step after it is computed: a hybrid's state is checkpointed only
        where a commit ends on a block boundary. Example (batched): a 40-token prompt in
        chunks of 16, then 5 new tokens (4 decode steps compute positions 40-43; the last
        token's KV is never needed): commits end at 16, 32 and 40 in the steps after those
        chunks, then at 44 in the step that frees it."""
        handles: list[int] = []
        tokens: list[list[int]] = []
        output = self.commit_output == "each_step" or not self.stats.steps % OUTPUT_COMMIT_STEPS
        for r in self.running:
            self._pending(r, len(r.seq) if output else len(r.prompt), handles, tokens)
        for r in self._to_free:
            self._pending(r, len(r.seq), handles, tokens)
        return handles, tokens

    @staticmethod
    def _pending(r: Request, limit: int, handles: list[int], tokens: list[list[int]]) -> None:
        """Add ``r``'s commit of its computed tokens up to ``limit``, if any, and record it."""
        end = min(r.computed - r.in_flight, limit)
        if end > r.committed:
            handles.append(r.handle)
            tokens.append(r.seq[r.committed : end])
            r.committed = end

    def schedule(self) -> list[Work]:
        """Plan this step and make kvcm's step call; return the work the model does."""
        self.stats.steps += 1
        budget = self.max_batch_tokens
        commit, commit_tokens = self._commits()
        handing = self._to_free if self.hand_off_s is not None else []
        free = [] if handing else [r.handle for r in self._to_free]
        self._to_free = []
        ended, self._ended = self._ended, []
        self._landed(ended)
        free += self._free_now
        rewinds, self._rewinds, self._free_now = self._rewinds, [], []
        plan: list[Work] = []
        # Decodes first (one token each), then prefill chunks, in admission order.
        for decoding in (True, False):
            for r in self.running:
                pending = len(r.seq) - r.computed
                if (pending == 1) != decoding or budget == 0:
                    continue
                n = self._chunk(r.computed, pending, budget)
                budget -= n
                plan.append(Work(r, r.computed, n))
        resume = list(self.suspended)[: max(0, self.max_running - len(self.running))]
        admits = [] if self.suspended else self._candidates(budget)
        moving = [a for a in admits if a[0].source is not None or a[0].fetch_from is not None]
        if moving:
            admits = [a for a in admits if a not in moving]
            self._start_moves([r for r, _, _ in moving])
        allocate = []
        for r, n, k in admits:
            r.admissions += 1
            op = {"request_id": r.kv_id, "num_tokens": n, "token_ids": r.seq[:n]}
            allocate.append(op if k is None else {**op, "max_new_tokens": k})
        self.slots_of = {}
        # Only the sections the step has: a step of extends alone by one count is a decode
        # step's call, which a client sends as a decode frame.
        columns: dict[str, Any] = {}
        if commit:
            columns.update(commit=commit, commit_tokens=commit_tokens)
        if free:
            columns["free"] = free
        if rewinds:
            columns.update(rewind=[h for h, _ in rewinds], rewind_tokens=[n for _, n in rewinds])
        if resume:
            columns["resume"] = [r.handle for r in resume]
        if plan:
            columns.update(_extends(plan))
        if allocate:
            columns["allocate"] = allocate
        out = self._call(**columns)
        for r in handing:  # committed by the call above: pinned for the decode engine
            self.stats.kvcm_calls += 1
            self.kvcm.hand_off(r.kv_id, self.hand_off_s)
            self.handed_off.append(r)
        failed, column = self._extended(out, plan)
        for r, status in zip(resume, out.status["resume"], strict=True):
            if not status:  # back, with its blocks and state; it computes from the next step
                self.suspended.remove(r)
                self.running.append(r)
                self.stats.resumes += 1
        hits = out.hit_tokens
        for i, ((r, n, k), status) in enumerate(zip(admits, out.status["allocate"], strict=True)):
            if status:  # no room yet: it stays in the queue, in its place
                r.admissions -= 1
                continue
            self.waiting.remove(r)
            hit = int(hits[i])
            length = n if k is None else min(n, hit + k)  # what kvcm allocated
            r.handle = int(out.handles[i])
            r.row, r.computed = r.handle & ROW_MASK, hit
            r.committed, r.held = hit, length
            r.hit_tokens += hit
            self.stats.hit_tokens += hit
            self.stats.admitted += 1
            self.running.append(r)
            plan.append(Work(r, r.computed, length - r.computed))
            self.slots_of[r.request_id] = (out.slot_mapping, column)
            column += length - hit
        if admits and not self.running:
            # Nothing runs, so nothing will free blocks: the head of the queue can never fit.
            r, n, _ = admits[0]
            raise RuntimeError(
                f"request {r.request_id} does not fit the pool even alone "
                f"(its first allocation of {n} tokens was refused)"
            )
        return self._preempt_for(failed, plan)

    def _start_moves(self, requests: list[Request]) -> None:
        """Admit requests whose KV moves from a peer: a ``pull`` of a handed-off request
        (``source``) or a ``fetch`` of a cached prefix (``fetch_from``); they wait in
        ``pulling`` until ``_landed`` sees them ready."""
        for r in requests:
            self.waiting.remove(r)
            r.admissions += 1
            self.stats.kvcm_calls += 1
            try:
                if r.source is not None:
                    state = self.kvcm.pull(r.kv_id, r.source[0], r.source[1])
                else:
                    assert r.fetch_from is not None
                    state = self.kvcm.fetch(r.kv_id, r.fetch_from, len(r.seq), r.seq)
            except KVCMError as exc:
                if exc.code in _ROOM:  # no room yet: it waits in its place
                    r.admissions -= 1
                    self.waiting.appendleft(r)
                    continue
                # The peer is gone, restarted, or never had it: compute it here.
                self._fall_back(r)
                continue
            self.pulling.append(r)
            if state.state != "pulling":  # failed, or nothing to move: ready at once
                self._landed([state])

    def _fall_back(self, r: Request) -> None:
        """A pull or fetch that cannot bring the KV: the request computes its sequence here
        (a pulled one's first token stays: greedy decoding gives it again anyway)."""
        self.stats.pull_failures += 1
        r.source = r.fetch_from = None
        r.computed = r.committed = r.held = 0
        r.row, r.handle = -1, 0
        self.waiting.appendleft(r)

    def _landed(self, states: list[Any]) -> None:
        """Pulls and fetches that ended (``PullState`` of a step's answer, or of the call
        itself): ready ones run (their committed tokens computed), failed ones go back to
        the queue to be computed here. States of requests not waiting are ignored (one
        that landed at once is listed again by the next step)."""
        waiting = {r.kv_id: r for r in self.pulling}
        for state in states:
            r = waiting.pop(state.request_id, None)
            if r is None:
                continue
            self.pulling.remove(r)
            if state.state != "ready":  # compute it here instead (its sequence as it is)
                self._fall_back(r)
                continue
            r.handle, r.row = state.handle, state.handle & ROW_MASK
            r.computed = r.committed = state.num_committed
            self.stats.admitted += 1
            self.stats.moved_blocks += state.blocks
            if r.source is not None:  # its prompt, all of it: it decodes from here
                r.held = r.computed
                self.stats.pulls += 1
                self.stats.pulled_tokens += r.computed
            else:  # the fetch allocated the whole prompt: the uncomputed rest goes back
                self.stats.fetched_tokens += r.computed
                if r.computed == 0:  # nothing came: compute it all here
                    self._free_now.append(r.handle)
                    r.fetch_from, r.handle, r.row = None, 0, -1
                    self.waiting.appendleft(r)
                    continue
                self._rewinds.append((r.handle, len(r.seq) - r.computed))
                r.held = r.computed
            self.running.append(r)

    def _candidates(self, budget: int) -> list[tuple[Request, int, int | None]]:
        """Waiting requests to allocate this step: (request, ``num_tokens``,
        ``max_new_tokens``). Their first allocation is the cached prefix plus a chunk (kvcm
        caps a hit below the sequence's length, so at least one token is computed). kvcm
        sizes it by the hit it finds (``max_new_tokens``: no call of its own), the budget
        reserving the whole chunk; a chunk that must end on a block boundary (``align``: a
        hybrid's) is sized here, after a ``probe`` of the hit."""
        out: list[tuple[Request, int, int | None]] = []
        for r in self.waiting:
            if budget <= 0 or len(self.running) + len(out) >= self.max_running:
                break
            seq = r.seq
            if seq[-1] == UNKNOWN:  # a victim of a step planned ahead: settled before this
                raise RuntimeError(f"request {r.request_id}: its last token is not known yet")
            if self.align == 1:
                k = min(self.chunk, budget)
                budget -= k
                out.append((r, len(seq), k))
                continue
            self.stats.kvcm_calls += 1
            hit = self.kvcm.probe(seq)
            n = hit + self._chunk(hit, len(seq) - hit, budget)
            budget -= n - hit
            out.append((r, n, None))
        return out

    def _chunk(self, start: int, pending: int, budget: int) -> int:
        """Tokens a request computes from position ``start`` with ``pending`` to go: at most a
        chunk and the budget; a chunk that stops short of the end is cut back to end on a
        multiple of ``align`` when that leaves any (a hybrid model's state is checkpointed
        only where its commits end on block boundaries). Example: align 4, start 6, 30
        pending, chunk 16, budget 48: 14 tokens, ending at 20."""
        n = min(pending, self.chunk, budget)
        if n < pending:
            aligned = (start + n) // self.align * self.align - start
            if aligned > 0:
                n = aligned
        return n

    def _mapped(self, out: Any, extended: list[Work]) -> int:
        """Record where the successful extends' tokens are in ``out``'s slot mapping (they
        come first, in order); returns the column the allocates' tokens start at."""
        column = 0
        for w in extended:
            self.slots_of[w.request.request_id] = (out.slot_mapping, column)
            column += w.count
        return column

    def _call(self, **columns: Any) -> Any:
        """One ``step_columns`` call, with the slot mapping of the tokens it adds
        (``map_slots``: no second call for it); any failure but "no room" for an extend, an
        allocate, a suspend or a resume is a bug here."""
        self.stats.kvcm_calls += 1
        begin = time.perf_counter()
        out = self.kvcm.step_columns(**columns, **self._order, map_slots=True)
        self.stats.call_s += time.perf_counter() - begin
        if out.pulls:
            self._ended += out.pulls
        if not out.ok:
            bad = [
                e
                for e in out.errors
                if e.section not in ("extend", "allocate", "suspend", "resume")
                or e.error.code not in _ROOM
            ]
            if bad or out.failed is not None:
                raise RuntimeError(f"kvcm refused part of a step: {bad}")
        return out

    def _preempt_for(self, failed: list[Work], plan: list[Work]) -> list[Work]:
        """Preempt the newest running requests until every failed extend succeeds (or was
        itself preempted); returns the plan without the preempted requests."""
        while failed:
            victim = self.running.pop()
            self.stats.preemptions += 1
            plan = [w for w in plan if w.request is not victim]
            failed = [w for w in failed if w.request is not victim]
            suspend = self.preempt == "suspend" and victim.computed > 0
            commit: list[int] = []
            commit_tokens: list[list[int]] = []
            self._pending(victim, len(victim.seq), commit, commit_tokens)
            pending = {"commit": commit, "commit_tokens": commit_tokens} if commit else {}
            while True:
                out = self._call(
                    **pending,
                    **(self._suspend_columns(victim) if suspend else {"free": [victim.handle]}),
                    **(_extends(failed) if failed else {}),
                )
                pending = {}  # committed by the first call, whatever its suspend's status
                # The extends that fit ran, whatever the suspend did (what its rewind gave
                # back may have made room): only the others go into a call again.
                failed, _ = self._extended(out, failed)
                if not suspend or not out.status["suspend"][0]:
                    break
                suspend = False  # the host tier cannot hold it: freed instead
            if suspend:
                self.suspended.append(victim)
                self.stats.suspends += 1
            else:
                victim.source = victim.fetch_from = None  # recomputed here, not pulled again
                victim.computed = victim.committed = victim.held = 0
                victim.row, victim.handle = -1, 0
                self.waiting.appendleft(victim)
        return plan

    def _extended(self, out: Any, tried: list[Work]) -> tuple[list[Work], int]:
        """Take in the answer ``out`` to the extends of ``tried`` (its ``extend`` section):
        those that ran hold their tokens and are mapped. Returns the others, and the column
        of ``out``'s slot mapping where its allocates' tokens start (``_mapped``)."""
        statuses = out.status["extend"]
        ran = [w for w, status in zip(tried, statuses, strict=True) if not status]
        for w in ran:
            w.request.held += w.count
        failed = [w for w, status in zip(tried, statuses, strict=True) if status]
        return failed, self._mapped(out, ran)

    def _suspend_columns(self, victim: Request) -> dict[str, Any]:
        """Suspend ``victim``, after rewinding what its extend of this step added (kvcm keeps
        the computed tokens only; their commit, if any was pending, goes first in the same
        call: ``_preempt_for``)."""
        tail = victim.held - victim.computed
        victim.held = victim.computed
        return {
            "rewind": [victim.handle] if tail else [],
            "rewind_tokens": tail or 1,
            "suspend": [victim.handle],
        }

    def finish_step(self, plan: list[Work], next_tokens: dict[str, int]) -> None:
        """Record a forward: the work is computed; requests whose sequence is now all computed
        take their next token (``next_tokens`` by request_id); finished ones are freed in the
        next step (after their last commit)."""
        for r in self.advance(plan):
            r.settle(next_tokens[r.request_id])
        self.landed(plan)

    def advance(self, plan: list[Work]) -> list[Request]:
        """Record a forward whose next tokens are not read back yet, so that the next step
        can be planned (and its kvcm call made) while the device still computes this one:
        the work is computed but in flight (not committed before ``landed``), requests whose
        sequence is now all computed emit ``UNKNOWN`` (returned, in plan order, for
        ``Request.settle``), finished ones are freed in the next step. Nothing in that plan
        reads an unknown token: its commits end before the work in flight; a request it
        preempts is allocated again only in a later step; a decode's input token is read
        when its forward is launched, after ``settle``. A request finishes on
        ``max_new_tokens`` alone, so the plan does not depend on the token's value. (A
        request that finishes in that forward is freed by the plan made meanwhile, so its
        last token is never committed: the prefix cache misses at most that block.)"""
        emitted = []
        for w in plan:
            r = w.request
            r.computed = w.start + w.count
            r.in_flight = w.count
            if r.computed == len(r.seq):
                r.emit(UNKNOWN)
                emitted.append(r)
                if r.done:
                    self.running.remove(r)
                    self._to_free.append(r)
                    self.finished.append(r)
        return emitted

    def landed(self, plan: list[Work]) -> None:
        """The forward of ``plan`` is read back: its KV is written, and commits may take it."""
        for w in plan:
            w.request.in_flight = 0

"""Sizing: memory budget to slots, and capacity estimates that agree exactly with the allocator.

The unit of every estimate is the engine's step shape: a request reaches L tokens through ops
(its allocate, then extends) that each add at most C tokens (``prefill_chunk``; a whole prompt
in one op when C >= L) and reserve D draft slots (``lookahead``). An op that takes a request
from history h to e = min(h + C, L) tokens leaves a layer group holding

    held(h) = ceil((e + D) / tpb) - max(0, (h + 1 - W) // tpb - S)

blocks (the second term only for a sliding window W with S sink blocks: the released run
``[S, (h + 1 - W) // tpb)``, see attention.py). A pool group's need for a request of L tokens
is the peak over every history h < L of the sum over its layer groups. Every h is reachable by
such a request (an allocate of h <= C tokens, or of C and extends up to h), and every op of any
request that keeps to the shape holds at most that peak, smaller chunks, rewinds and lower
lookahead included. So with ``slots >= N x peak``, any N requests that keep to the shape fit
up to L tokens, in lockstep or not; and N + 1 requests that all take the worst history do not.

Worked example (tpb 16, window 128, no sinks, L = 1024, C = 512, D = 0): from h = 510 the op
reaches 1022 tokens: ceil(1022 / 16) = 64 blocks, minus (511 - 128) // 16 = 23 released, so 41
blocks. The aligned chunks (h = 0, 512) peak at 40; the misaligned history 510 is the worst.

Computing the peak for every L at once (h runs over [0, L)): for h <= L - C - 1 the op is not
clipped by L, and its held count does not depend on L, so a running maximum of the unclipped
curve covers those h; for h >= L - C the op reaches L, and the largest of those held counts is
at h = max(0, L - C), since the released count only grows with h.

Budget split between pool groups (docs/sizing.md): each pool group gets the share of
``memory_bytes`` that one request of ``max_seq_len - D`` tokens takes in it, so all pool groups
run out at the same number of such requests:
``slots[pg] = reserved + budget * peak[pg] // sum(peak[q] * slot_bytes[q])``, where
``budget`` is what is left after the ``reserved`` slots (the null page) of every pool group.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from kvcm_client.errors import InsufficientMemory, InvalidArgument
from kvcm_client.models import Estimate, LayerGroupEstimate, PoolGroupEstimate

from .context_parallel import local_count
from .ids import PoolGroupId
from .layout import Layout


@dataclass(frozen=True, slots=True)
class StepShape:
    """How requests grow: at most ``chunk`` new tokens per op, ``lookahead`` draft slots."""

    chunk: int | None
    lookahead: int


@dataclass(frozen=True, slots=True)
class Curves:
    """Peak blocks per request for every length L in [1, max_len] (index L - 1)."""

    max_len: int
    group: list[np.ndarray]
    """Blocks each layer group alone needs."""
    pool: list[np.ndarray]
    """Slots each pool group needs (its layer groups together, at the same history)."""
    fixed: list[int | None]
    """Peak of each sliding-window group however long the request grows (None: full
    attention, or a window group when one op may add a whole prompt)."""


class Sizing:
    """Peak-block curves of a layout by step shape, computed once per shape."""

    #: Shapes whose curves are kept (estimates are asked for a handful of shapes).
    CACHED = 8

    def __init__(
        self,
        layout: Layout,
        max_seq_len: int,
        shape: StepShape,
        fixed_bytes: int = 0,
        context_parallel: int = 1,
    ) -> None:
        """``fixed_bytes``: what a budget pays before the KV pools (the state layers').
        ``context_parallel`` > 1: every count is per context-parallel rank (slot class,
        ``kvcm.context_parallel``), the most any rank holds."""
        self.context_parallel = context_parallel
        self.layout = layout
        self.max_seq_len = max_seq_len
        self.shape = shape
        self.fixed_bytes = fixed_bytes
        self._cache: dict[StepShape, Curves] = {}

    def curves(self, shape: StepShape) -> Curves:
        found = self._cache.get(shape)
        if found is None:
            if len(self._cache) >= self.CACHED:
                self._cache.pop(next(iter(self._cache)))
            found = self._cache[shape] = self._compute(shape)
        return found

    def _compute(self, shape: StepShape) -> Curves:
        tpb = self.layout.tokens_per_block
        max_len = self.max_seq_len - shape.lookahead
        chunk = max_len if shape.chunk is None else min(shape.chunk, max_len)
        ahead = shape.lookahead
        h = np.arange(max_len, dtype=np.int64)  # histories
        length = h + 1  # lengths L, index L - 1
        start = np.maximum(0, length - chunk)  # first history whose op reaches L

        def blocks(tokens: np.ndarray) -> np.ndarray:
            return -(-(tokens + ahead) // tpb)

        def released(history: np.ndarray, window: int | None, sinks: int) -> np.ndarray:
            if window is None:
                return np.zeros_like(history)
            return np.maximum(0, (history + 1 - window) // tpb - sinks)

        cp = self.context_parallel
        curves = [
            self._class_curves(blocks, released, h, length, start, chunk, shape, c)
            for c in range(cp)
        ]
        if cp == 1:
            return curves[0]
        # Each rank holds its own class: the most any class needs, L by L.
        return Curves(
            max_len=max_len,
            group=[
                np.maximum.reduce([k.group[i] for k in curves]) for i in range(len(curves[0].group))
            ],
            pool=[
                np.maximum.reduce([k.pool[i] for k in curves]) for i in range(len(curves[0].pool))
            ],
            fixed=[
                None if f is None else max(k.fixed[i] or 0 for k in curves)
                for i, f in enumerate(curves[0].fixed)
            ],
        )

    def _class_curves(
        self,
        blocks: Callable[[np.ndarray], np.ndarray],
        released: Callable[[np.ndarray, int | None, int], np.ndarray],
        h: np.ndarray,
        length: np.ndarray,
        start: np.ndarray,
        chunk: int,
        shape: StepShape,
        c: int,
    ) -> Curves:
        """The curves of slot class c (all of them without context parallelism): of the
        blocks an op leaves held, those at positions of class c. With cp ranks a window's
        held run [S + released, end) and its sinks [0, S) count ``local_count`` each."""
        tpb, cp = self.layout.tokens_per_block, self.context_parallel

        def held(
            history: np.ndarray, end: np.ndarray, window: int | None, sinks: int
        ) -> np.ndarray:
            gone = released(history, window, sinks)
            if cp == 1:
                return blocks(end) - gone
            first = local_count(sinks, cp, c)
            return local_count(blocks(end), cp, c) - (local_count(sinks + gone, cp, c) - first)

        unclipped, clipped, fixed = [], [], []
        for g in self.layout.layer_groups:
            unclipped.append(held(h, h + chunk, g.sliding_window, g.sink_blocks))
            clipped.append(held(start, length, g.sliding_window, g.sink_blocks))
            if g.sliding_window is None or shape.chunk is None:
                fixed.append(None)
                continue
            # Past h = W - 1 + S x tpb the unclipped count repeats with period tpb (cp x tpb
            # per class).
            span = g.sliding_window + (g.sink_blocks + 1) * tpb * cp
            horizon = np.arange(span, dtype=np.int64)
            fixed.append(int(held(horizon, horizon + chunk, g.sliding_window, g.sink_blocks).max()))

        def peak(members: list[int]) -> np.ndarray:
            free_running = np.maximum.accumulate(sum(unclipped[g] for g in members))
            before = length - chunk - 1  # last history whose op is not clipped by L
            earlier = np.where(before >= 0, free_running[np.maximum(before, 0)], 0)
            return np.maximum(earlier, sum(clipped[g] for g in members))

        return Curves(
            max_len=int(length[-1]) if length.size else 0,
            group=[peak([g.group_id]) for g in self.layout.layer_groups],
            pool=[peak(list(pg.layer_groups)) for pg in self.layout.pool_groups],
            fixed=fixed,
        )

    def _cost(self, curves: Curves) -> np.ndarray:
        """Bytes one request of L tokens takes in all pool groups, for every L (index L - 1)."""
        pools = self.layout.pool_groups
        return sum(peak * pg.slot_bytes for peak, pg in zip(curves.pool, pools, strict=True))

    def _budget(self, memory_bytes: int, reserved: int) -> int:
        """What the split shares out: the budget less ``reserved`` slots of every pool group
        and the fixed bytes."""
        reserved_bytes = reserved * sum(pg.slot_bytes for pg in self.layout.pool_groups)
        return memory_bytes - reserved_bytes - self.fixed_bytes

    def slots_for_budget(self, memory_bytes: int, reserved: int = 0) -> dict[PoolGroupId, int]:
        """Slots per pool group for a budget, ``reserved`` of them outside the split."""
        curves = self.curves(self.shape)
        total = int(self._cost(curves)[-1])
        budget = self._budget(memory_bytes, reserved)
        slots = {
            pg.pool_group_id: reserved + max(budget, 0) * int(peak[-1]) // total
            for peak, pg in zip(curves.pool, self.layout.pool_groups, strict=True)
        }
        for pg in self.layout.pool_groups:
            if slots[pg.pool_group_id] == reserved:
                raise InsufficientMemory(
                    f"memory_bytes={memory_bytes} leaves pool group {pg.pool_group_id} no slot "
                    f"(one slot there is {pg.slot_bytes} bytes; the budget needs at least "
                    f"{memory_bytes - budget + -(-total // int(curves.pool[pg.pool_group_id][-1]))}"
                    " bytes)",
                    memory_bytes=memory_bytes,
                    pool_group=pg.pool_group_id,
                )
        return slots

    def check_budget(self, memory_bytes: int, slots: dict[PoolGroupId, int], reserved: int) -> None:
        """Refuse a budget that cannot hold one request of ``max_seq_len`` tokens.

        Names the largest ``max_seq_len`` this budget would hold: one request of L tokens fits
        the split made for L exactly when the budget left after the reserved slots covers
        ``sum(peak[q](L) x slot_bytes[q])`` (then the floor in the split takes nothing from
        it), so it is the last L whose cost is within that budget, plus the lookahead.
        """
        curves = self.curves(self.shape)
        pools = self.layout.pool_groups
        if all(
            slots[pg.pool_group_id] - reserved >= int(curves.pool[pg.pool_group_id][-1])
            for pg in pools
        ):
            return
        budget = self._budget(memory_bytes, reserved)
        cost = self._cost(curves)
        longest = int(np.searchsorted(cost, budget, side="right"))
        fits = longest + self.shape.lookahead if longest else 0
        raise InsufficientMemory(
            f"memory_bytes={memory_bytes} cannot hold one request of max_seq_len="
            f"{self.max_seq_len} tokens (prefill chunk {self.shape.chunk or 'whole prompt'}, "
            f"lookahead {self.shape.lookahead}; it needs {int(cost[-1]) + memory_bytes - budget}"
            f" bytes); the largest max_seq_len this budget holds is {fits}",
            memory_bytes=memory_bytes,
            max_seq_len=self.max_seq_len,
            max_seq_len_that_fits=fits,
            needed_bytes=int(cost[-1]) + memory_bytes - budget,
        )

    def estimate(
        self,
        seq_len: int,
        usable: dict[PoolGroupId, int],
        max_requests: int,
        num_requests: int | None = None,
        shape: StepShape | None = None,
    ) -> Estimate:
        """Capacity at ``seq_len`` for ``shape`` (the config's by default) over ``usable``
        slots per pool group (slots less any reserved null page)."""
        shape = shape or self.shape
        if not 1 <= seq_len <= self.max_seq_len - shape.lookahead:
            raise InvalidArgument(
                f"seq_len must be in [1, max_seq_len - lookahead = "
                f"{self.max_seq_len - shape.lookahead}], got {seq_len}",
                seq_len=seq_len,
                lookahead=shape.lookahead,
            )
        if num_requests is not None and num_requests < 0:
            raise InvalidArgument(
                f"num_requests must be >= 0, got {num_requests}", num_requests=num_requests
            )
        curves = self.curves(shape)
        tpb = self.layout.tokens_per_block
        pool_estimates = []
        max_tokens = curves.max_len
        for pg, peak in zip(self.layout.pool_groups, curves.pool, strict=True):
            n_slots = usable[pg.pool_group_id]
            per_request = int(peak[seq_len - 1])
            # Largest L with peak[L - 1] <= slots: peak is non-decreasing.
            max_tokens = min(max_tokens, int(np.searchsorted(peak, n_slots, side="right")))
            pool_estimates.append(
                PoolGroupEstimate(
                    pool_group_id=pg.pool_group_id,
                    num_slots=n_slots,
                    slot_bytes=pg.slot_bytes,
                    blocks_per_request=per_request,
                    max_requests=n_slots // per_request,
                    required_blocks=None if num_requests is None else num_requests * per_request,
                )
            )
        memory_limit = min(p.max_requests for p in pool_estimates)
        group_estimates = []
        fixed_bytes = 0
        for g, fixed, peak in zip(
            self.layout.layer_groups, curves.fixed, curves.group, strict=True
        ):
            if fixed is not None:
                fixed_bytes += fixed * g.bytes_per_token * tpb
            group_estimates.append(
                LayerGroupEstimate(
                    group_id=g.group_id,
                    bytes_per_token=g.bytes_per_token,
                    blocks_per_request=int(peak[seq_len - 1]),
                    fixed_blocks=fixed,
                )
            )
        fit = min(memory_limit, max_requests)
        return Estimate(
            seq_len=seq_len,
            prefill_chunk=shape.chunk,
            lookahead=shape.lookahead,
            bytes_per_token={g.group_id: g.bytes_per_token for g in self.layout.layer_groups},
            fixed_bytes_per_request=fixed_bytes,
            max_tokens=max_tokens,
            max_requests=fit,
            limited_by="memory" if memory_limit <= max_requests else "max_requests",
            layer_groups=tuple(group_estimates),
            pool_groups=tuple(pool_estimates),
            num_requests=num_requests,
            fits=None if num_requests is None else num_requests <= fit,
        )

"""A brute-force model of the manager's block bookkeeping, one block at a time in plain Python.

It applies DESIGN.md section 5 literally (stale range [min(blocks(h), S), max(S, (h + 1 - W) //
tpb)) within the blocks the history holds) with a deque per pool group, so the tests can
compare exact block ids, not only counts. It knows the manager's documented orders: within an
op, stale blocks of every layer group are released (by position) before new blocks are taken
(layer group order, then request order); a freed request returns its blocks tail first.
"""

from __future__ import annotations

import copy
from collections import deque
from dataclasses import dataclass, field


class OracleOutOfBlocks(Exception):
    pass


@dataclass
class OracleGroup:
    window: int | None
    sink_blocks: int
    pool_group: int


@dataclass
class OracleRequest:
    length: int = 0
    history: int = 0
    lookahead: int = 0
    blocks: list[list[int]] = field(default_factory=list)


def blocks_for(tokens: int, tpb: int) -> int:
    return -(-tokens // tpb)


class Oracle:
    def __init__(
        self, groups: list[OracleGroup], slots: list[int], tpb: int, first_slot: int = 0
    ) -> None:
        """``slots`` usable per pool group, numbered from ``first_slot`` (1 with the null page,
        whose slot 0 is never handed out)."""
        self.groups = groups
        self.tpb = tpb
        self.free = [deque(range(first_slot, first_slot + n)) for n in slots]
        self.requests: dict[str, OracleRequest] = {}

    def _stale(self, g: OracleGroup, h: int) -> range:
        if g.window is None:
            return range(0)
        s = g.sink_blocks
        held_by_history = blocks_for(h, self.tpb)
        start = min(held_by_history, s)
        end = max(s, (h + 1 - g.window) // self.tpb)
        return range(start, min(end, held_by_history))

    def grow_batch(self, items: list[tuple[str, int, int]], new: bool = False) -> None:
        """items: (request_id, new tokens, lookahead); all or nothing, batch order."""
        saved = (copy.deepcopy(self.requests), copy.deepcopy(self.free))
        try:
            for rid, _, _ in items:
                if new:
                    self.requests[rid] = OracleRequest(blocks=[[] for _ in self.groups])
            for gi, g in enumerate(self.groups):
                for rid, _, _ in items:
                    req = self.requests[rid]
                    row = req.blocks[gi]
                    for p in self._stale(g, req.length):
                        if row[p] >= 0:
                            self.free[g.pool_group].append(row[p])
                            row[p] = -1
            for gi, g in enumerate(self.groups):
                for rid, n, la in items:
                    req = self.requests[rid]
                    row = req.blocks[gi]
                    while len(row) < blocks_for(req.length + n + la, self.tpb):
                        if not self.free[g.pool_group]:
                            raise OracleOutOfBlocks
                        row.append(self.free[g.pool_group].popleft())
            for rid, n, la in items:
                req = self.requests[rid]
                req.history = req.length
                req.length += n
                req.lookahead = la
        except OracleOutOfBlocks:
            self.requests, self.free = saved
            raise

    def allocate(self, rid: str, n: int, la: int = 0) -> None:
        self.grow_batch([(rid, n, la)], new=True)

    def extend(self, rid: str, n: int, la: int = 0) -> None:
        self.grow_batch([(rid, n, la)])

    def rewind(self, rid: str, n: int) -> None:
        req = self.requests[rid]
        req.length -= n
        req.history = min(req.history, req.length)
        keep = blocks_for(req.length + req.lookahead, self.tpb)
        for gi, g in enumerate(self.groups):
            self._free_tail(g, req.blocks[gi], keep)

    def free_request(self, rid: str) -> None:
        req = self.requests.pop(rid)
        for gi, g in enumerate(self.groups):
            self._free_tail(g, req.blocks[gi], 0)

    def _free_tail(self, g: OracleGroup, row: list[int], keep: int) -> None:
        while len(row) > keep:
            slot = row.pop()
            if slot >= 0:
                self.free[g.pool_group].append(slot)

    def num_free(self) -> int:
        """Blocks a new request can get in every layer group: per pool group, free slots //
        the layer groups sharing it, the least over pool groups."""
        sharing = [sum(g.pool_group == pg for g in self.groups) for pg in range(len(self.free))]
        return min(len(f) // n for f, n in zip(self.free, sharing, strict=True))

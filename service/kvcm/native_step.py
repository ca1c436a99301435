"""A decode step's batch of extends in C (``kvcm._native``): the numpy path's plan in one
pass over the rows, the same blocks, tables, edits and counters (tests/test_native.py).

Only for coordinators whose plan has no per-class or per-window part (one context-parallel
class, no sliding window): there an extend releases nothing, so a batch that fits as a whole
fits item after item, and planning is: for each row, the block positions from its current
count up to ceil(capacity / tokens_per_block), in every layer group. Slots are still taken
and tables written by the coordinator (``_take``, ``_set``: the free queue, evictions, the
host tier and the device-table edits stay in one place).

Example (tokens_per_block 16, one layer group): handles of rows 3 and 8, at 16 and 20 tokens,
+1 token each. The plan gives row 3's block position 1 (17 tokens need 2 blocks), nothing for
row 8; one slot is taken, written at table[0][3, 1], and the counters become 17 and 21 tokens,
with 2 blocks each; the items' new blocks are [1, 0].
"""

from __future__ import annotations

from types import ModuleType
from typing import TYPE_CHECKING, Any

import numpy as np

from kvcm_client.errors import KVCMError

if TYPE_CHECKING:
    from .manager import KVCacheManager

#: Planned new blocks a layer group may take in one batch, per row of the manager: a decode
#: step takes at most one per row; a batch that needs more (a chunked prefill's extends) takes
#: the numpy path, where its size does not matter.
_PER_ROW = 2


class NativeDecode:
    """The work arrays of one manager's C decode path (no allocation per step)."""

    __slots__ = ("items", "positions", "rows")

    def __init__(self, max_requests: int, num_groups: int) -> None:
        self.rows = np.zeros(max_requests, dtype=np.int64)
        self.items = np.zeros((num_groups, _PER_ROW * max_requests), dtype=np.int64)
        self.positions = np.zeros_like(self.items)

    def extend(
        self, core: ModuleType, m: KVCacheManager, handles: np.ndarray, new: Any, ahead: Any
    ) -> tuple[np.ndarray, np.ndarray] | None:
        """``request_rows.extend_handles`` in C: (rows, new blocks per item) or None, with
        nothing changed, when the batch needs the general path."""
        c = m._coord
        blocks = tuple(c.num_blocks)
        counts = core.decode_plan(
            handles,
            new,
            ahead,
            m._handle,
            m._scratch,
            c.num_tokens,
            blocks,
            m.config.max_seq_len,
            c.tokens_per_block,
            self.rows,
            self.items,
            self.positions,
        )
        if counts is None:
            return None
        need = [0] * len(c.pools)
        for g, k in enumerate(counts):
            need[c.group_pool[g]] += k
        try:
            c.check_fits(need)
        except KVCMError:
            return None
        rows = self.rows[: handles.size].copy()
        for g, k in enumerate(counts):
            if k:
                positions = self.positions[g, :k].copy()  # kept by the edit log
                slots = c._take(c.group_pool[g], k, positions)
                c._set(g, rows[self.items[g, :k]], positions, slots)
        added = np.empty(rows.size, dtype=np.int32)
        tpb = c.tokens_per_block
        history, lookahead = c.history, c.lookahead
        core.decode_commit(rows, new, ahead, c.num_tokens, history, lookahead, blocks, tpb, added)
        c.ops_since_take += 1
        return rows, added

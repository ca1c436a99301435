"""The coordinator's prefix hits: what a new request with cached blocks needs, and placing
those blocks in its row (``Coordinator`` inherits ``PrefixHits``; kvcm.prefix_reuse finds the
hits)."""

from __future__ import annotations

from typing import Any

import numpy as np

from .context_parallel import class_counts, slot_classes


class PrefixHits:
    """Mixin of ``Coordinator`` (its state and its ``_zeros`` and ``set_cells``)."""

    tokens_per_block: int
    cp: int
    empty: int
    group_pool: list[int]
    windowed: list[bool]
    pools: list[Any]
    refs: list[np.ndarray]
    num_tokens: np.ndarray
    history: np.ndarray
    num_blocks: list[np.ndarray]
    released_end: list[np.ndarray]
    ops_since_take: int

    def hit_need(self, hits: list[np.ndarray], capacity: int) -> tuple[list[int], list[np.ndarray]]:
        """Free slots per pool group a new request with these hit blocks needs in all, and
        per layer group the hit slots nobody holds (they come out of the queue).

        ``hits[g]`` holds the slot of each of the first blocks (-1 where a window does not
        need it); the blocks past the hit up to ``capacity`` tokens are new.
        """
        want = -(-capacity // self.tokens_per_block)
        need = self._zeros()
        idle = []
        for g, slots in enumerate(hits):
            pg = self.group_pool[g]
            live = slots[slots >= 0] if self.windowed[g] else slots
            unheld = live[self.refs[pg][live] == 0]
            idle.append(unheld)
            if self.cp == 1:
                need[pg] += max(want - slots.size, 0) + unheld.size
            else:
                new = class_counts(slots.size, max(want, slots.size), self.cp)
                need[pg] += new + slot_classes(unheld, self.cp)
        return need, idle

    def place_hits(
        self,
        row: int,
        hits: list[np.ndarray],
        idle: list[np.ndarray],
        released_end: list[int],
        num_tokens: int,
    ) -> None:
        """Give an empty row the hit blocks (shared, refs + 1) as its first ``num_tokens``;
        ``idle`` (from ``hit_need``) are those in the free queue."""
        for g, slots in enumerate(hits):
            pg = self.group_pool[g]
            live = slots[slots >= 0] if self.windowed[g] else slots
            self.pools[pg].claim(idle[g])
            self.refs[pg][live] += 1
            n = slots.size
            # Hits mark blocks a window does not need with -1; the table holds ``empty``
            # there: max(-1, empty) is empty in both modes, and live slots are above it.
            self.set_cells(g, row, slice(0, n), np.maximum(slots, self.empty))
            self.num_blocks[g][row] = n
            self.released_end[g][row] = released_end[g]
        self.num_tokens[row] = num_tokens
        self.history[row] = num_tokens
        self.ops_since_take += 1

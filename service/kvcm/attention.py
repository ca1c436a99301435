"""One policy per attention type: which blocks of a request a layer group may release.

Both policies work on numpy arrays of requests at once (the decode step calls them once per
layer group, not once per request).

Sliding window (DESIGN.md section 5): a request's history h is its length before the tokens of
its latest allocate/extend; the first of those tokens still attends W tokens back, to position
h + 1 - W. With S sink blocks the stale blocks are
``[min(blocks(h), S), max(S, (h + 1 - W) // tokens_per_block))`` taken within the blocks the
history holds; since (h + 1 - W) // tokens_per_block <= blocks(h), the range is empty until
blocks(h) > S and is then ``[S, (h + 1 - W) // tokens_per_block)``. Released blocks therefore
always form the run ``[S, released_end)``, and a request only needs to remember
``released_end`` (S while nothing is released).

Worked example: W = 128, 4 sink tokens (S = 1 block), tokens_per_block 16. Decoding from
h = 160 to 161: (161 - 128) // 16 = 2, so blocks [1, 2) are stale: block 1 is released, block 0
(the sink) and blocks 2.. stay. Block 2 holds positions 32..47, and position 160 attends back
to 33, so block 2 is still needed.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True, slots=True)
class FullAttention:
    tokens_per_block: int
    sink_blocks: int = 0

    @property
    def sliding_window(self) -> None:
        return None

    def released_end(self, history: np.ndarray, released_end: np.ndarray) -> np.ndarray:
        return released_end

    def first_needed_block(self, length: int) -> int:
        return 0

    def held_after_step(self, history: np.ndarray) -> np.ndarray:
        """Blocks held after growing from h to h + 1 tokens (lookahead 0)."""
        return -(-(history + 1) // self.tokens_per_block)

    def fixed_blocks(self) -> int | None:
        return None


@dataclass(frozen=True, slots=True)
class SlidingWindow:
    tokens_per_block: int
    window: int
    sink_blocks: int

    @property
    def sliding_window(self) -> int:
        return self.window

    def released_end(self, history: np.ndarray, released_end: np.ndarray) -> np.ndarray:
        """New end of the released run [S, end) after an op whose history is ``history``."""
        return np.maximum(released_end, (history + 1 - self.window) // self.tokens_per_block)

    def first_needed_block(self, length: int) -> int:
        """First non-sink block the next token (at position ``length``) attends to."""
        return max(self.sink_blocks, (length + 1 - self.window) // self.tokens_per_block)

    def held_after_step(self, history: np.ndarray) -> np.ndarray:
        allocated = -(-(history + 1) // self.tokens_per_block)
        stale_end = (history + 1 - self.window) // self.tokens_per_block
        return allocated - np.maximum(0, stale_end - self.sink_blocks)

    def fixed_blocks(self) -> int:
        """Peak blocks held however long the request grows.

        Past h = W + (S + 1) x tokens_per_block the held count is periodic with period
        tokens_per_block, so one period beyond that point covers every value.
        """
        horizon = self.window + (self.sink_blocks + 2) * self.tokens_per_block
        return int(self.held_after_step(np.arange(horizon, dtype=np.int64)).max())


AttentionPolicy = FullAttention | SlidingWindow


def policy_for(window: int | None, sink_blocks: int, tokens_per_block: int) -> AttentionPolicy:
    if window is None:
        return FullAttention(tokens_per_block)
    return SlidingWindow(tokens_per_block, window, sink_blocks)

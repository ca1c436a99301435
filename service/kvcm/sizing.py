"""Sizing: memory budget to slots, and capacity estimates that agree exactly with the allocator.

The unit of every estimate is a request that grows one token per step (decode, or chunked
prefill in chunks of one token) with lookahead 0. Such a request of history h holds, in each
layer group, ``policy.held_after_step(h)`` blocks right after its op. A pool group's need for a
request of L tokens is the peak over h < L of the sum over its layer groups: the allocator
checks each op against free slots, so N such requests fit up to L tokens exactly when
N x peak <= slots. A single ``allocate(L)`` (whole prefill in one step) needs
ceil(L / tokens_per_block) blocks in every layer group, sliding or not.

Budget split between pool groups (docs/sizing.md): each pool group gets the share of
``memory_bytes`` that one ``max_seq_len`` request takes in it, so all pool groups run out at
the same number of max-length requests:
``slots[pg] = memory_bytes * peak[pg] // sum(peak[q] * slot_bytes[q])``.
"""

from __future__ import annotations

import numpy as np

from kvcm_client.errors import InsufficientMemory, InvalidArgument
from kvcm_client.models import Estimate, LayerGroupEstimate, PoolGroupEstimate

from .attention import AttentionPolicy, policy_for
from .ids import PoolGroupId
from .layout import Layout


class Sizing:
    """Peak-block curves of a layout up to ``max_seq_len``, computed once."""

    def __init__(self, layout: Layout, max_seq_len: int) -> None:
        self.layout = layout
        self.max_seq_len = max_seq_len
        tpb = layout.tokens_per_block
        self.policies: list[AttentionPolicy] = [
            policy_for(g.sliding_window, g.sink_blocks, tpb) for g in layout.layer_groups
        ]
        history = np.arange(max_seq_len, dtype=np.int64)
        self.held = [p.held_after_step(history) for p in self.policies]
        #: peak_group[g][L - 1]: blocks layer group g alone needs for a request of L tokens.
        self.peak_group = [np.maximum.accumulate(h) for h in self.held]
        #: peak_pool[pg][L - 1]: slots pool group pg needs for a request of L tokens.
        self.peak_pool: list[np.ndarray] = []
        for pg in layout.pool_groups:
            total = np.zeros(max_seq_len, dtype=np.int64)
            for g in pg.layer_groups:
                total += self.held[g]
            self.peak_pool.append(np.maximum.accumulate(total))

    def slots_for_budget(self, memory_bytes: int) -> dict[PoolGroupId, int]:
        weights = [
            int(peak[-1]) * pg.slot_bytes
            for peak, pg in zip(self.peak_pool, self.layout.pool_groups, strict=True)
        ]
        total = sum(weights)
        slots = {
            pg.pool_group_id: memory_bytes * int(peak[-1]) // total
            for peak, pg in zip(self.peak_pool, self.layout.pool_groups, strict=True)
        }
        for pg in self.layout.pool_groups:
            if slots[pg.pool_group_id] == 0:
                raise InsufficientMemory(
                    f"memory_bytes={memory_bytes} leaves pool group {pg.pool_group_id} no slot "
                    f"(one slot there is {pg.slot_bytes} bytes; the budget needs at least "
                    f"{-(-total // int(self.peak_pool[pg.pool_group_id][-1]))} bytes)",
                    memory_bytes=memory_bytes,
                    pool_group=pg.pool_group_id,
                )
        return slots

    def estimate(
        self,
        seq_len: int,
        slots: dict[PoolGroupId, int],
        max_requests: int,
        num_requests: int | None = None,
    ) -> Estimate:
        if not 1 <= seq_len <= self.max_seq_len:
            raise InvalidArgument(
                f"seq_len must be in [1, max_seq_len={self.max_seq_len}], got {seq_len}",
                seq_len=seq_len,
            )
        if num_requests is not None and num_requests < 0:
            raise InvalidArgument(
                f"num_requests must be >= 0, got {num_requests}", num_requests=num_requests
            )
        tpb = self.layout.tokens_per_block
        pool_estimates = []
        max_tokens = self.max_seq_len
        for pg, peak in zip(self.layout.pool_groups, self.peak_pool, strict=True):
            n_slots = slots[pg.pool_group_id]
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
        for g, policy in zip(self.layout.layer_groups, self.policies, strict=True):
            fixed = policy.fixed_blocks()
            if fixed is not None:
                fixed_bytes += fixed * g.bytes_per_token * tpb
            group_estimates.append(
                LayerGroupEstimate(
                    group_id=g.group_id,
                    bytes_per_token=g.bytes_per_token,
                    blocks_per_request=int(self.peak_group[g.group_id][seq_len - 1]),
                    fixed_blocks=fixed,
                )
            )
        fit = min(memory_limit, max_requests)
        return Estimate(
            seq_len=seq_len,
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

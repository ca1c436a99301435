"""A transformers cache object whose storage is kvcm's pools, indexed by kvcm's tables.

transformers' attention modules call ``cache.update(key, value, layer_idx)`` with the step's
new keys and values and attend to whatever it returns. ``KVCMCache.update`` writes the new
ones at kvcm's slot mapping into the layer's pool view and returns the request's history
gathered through kvcm's page table, so the model's own attention code (its projections, RoPE,
softcapping, GQA and MLA up-projection) runs unchanged on kvcm's memory. MLA layers (DeepSeek)
hand the cache their compressed latent and rotary key; kvcm stores the two side by side as
one key-only page (kv_lora_rank + qk_rope_head_dim values), as its layer spec says.

A forward is a padded batch of R requests and Q query columns, left-padded so that every
request's last new token sits in column Q - 1 (the one whose logits pick the next token).
Worked example (tokens_per_block 4, one full-attention group): a request with 6 tokens
cached and 2 new ones in a batch of Q = 3 has queries at columns 1, 2 = positions 6, 7; its
slot mapping from kvcm is [22, 23] (slot 5, offsets 2 and 3), so its keys go to
``view[5, 2]`` and ``view[5, 3]``; its history is positions 0..7, read from page-table row
entries [p // 4] at offsets p % 4: with the row [9, 5, ...] position 6 is ``view[5, 2]``.
A sliding-window group with window W reads positions from ``first_query - W + 1`` on only.

``StepTables.build`` refuses (``CacheMiss``) a step in which the model needs a position whose
page kvcm does not hold: a window released too early or a missing page would otherwise only
show as wrong tokens.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch


class CacheMiss(RuntimeError):
    """The model needs a key that kvcm's page table does not point to."""


@dataclass(frozen=True, slots=True)
class LayerInfo:
    """What the cache needs of one layer's kvcm spec."""

    group: int
    kv_factor: int
    window: int | None


@dataclass(frozen=True, slots=True)
class GroupTables:
    """One layer group's reads and writes in a forward.

    ``read_blocks``/``read_offsets`` ``[R, L]``: where history column k of each request lives;
    ``read_keep`` ``[R, L, 1, 1]``: the columns that hold a written key. A masked column still
    enters ``q @ k`` before the additive mask, and the unwritten tail of a block may hold
    anything, NaN included: with the null page the other columns read its zeros (slot 0,
    offset 0) and ``read_keep`` is None; without it they are zeroed after the gather;
    ``write_blocks``/``write_offsets`` ``[N]`` with ``write_rows``/``write_cols``: where each
    of the N new tokens goes (tokens kvcm maps to -1, released by a window, are left out);
    ``mask`` ``[R, 1, Q, L]``: additive (0 = attend, dtype min = masked).
    """

    read_blocks: torch.Tensor
    read_offsets: torch.Tensor
    read_keep: torch.Tensor | None
    write_rows: torch.Tensor
    write_cols: torch.Tensor
    write_blocks: torch.Tensor
    write_offsets: torch.Tensor
    mask: torch.Tensor


@dataclass(frozen=True, slots=True)
class StepTables:
    """Everything a forward reads from kvcm, per layer group."""

    groups: list[GroupTables]

    @staticmethod
    def build(
        page_tables: torch.Tensor,
        slot_mapping: torch.Tensor,
        rows: Sequence[int],
        starts: Sequence[int],
        counts: Sequence[int],
        windows: Sequence[int | None],
        tokens_per_block: int,
        null_page: bool,
        dtype: torch.dtype,
    ) -> StepTables:
        """Tables for requests at page-table ``rows`` that have ``starts[i]`` tokens cached and
        compute ``counts[i]`` new ones; ``slot_mapping`` ``[groups, sum(counts)]`` is kvcm's
        for those new tokens, request after request; ``windows[g]`` is group g's window."""
        device = page_tables.device
        tpb = tokens_per_block
        r = len(rows)
        q = max(counts)
        start = torch.tensor(starts, device=device)
        count = torch.tensor(counts, device=device)
        end = start + count
        row = torch.tensor(rows, device=device)
        # Query column j of request i is position start + j - (q - count) (left padding).
        col = torch.arange(q, device=device)
        qpos = start[:, None] + col[None, :] - (q - count)[:, None]
        real = qpos >= start[:, None]
        # New token t (flat, request-major) is request req[t] at column cols[t].
        req = torch.repeat_interleave(torch.arange(r, device=device), count)
        first = torch.cumsum(count, 0) - count
        cols = (q - count)[req] + torch.arange(int(count.sum()), device=device) - first[req]
        slot_mapping = slot_mapping.to(device)
        empty = 0 if null_page else -1
        min_value = torch.finfo(dtype).min
        out = []
        for g, window in enumerate(windows):
            lo = torch.zeros_like(start) if window is None else (start - window + 1).clamp(min=0)
            width = int((end - lo).max())
            pos = lo[:, None] + torch.arange(width, device=device)[None, :]  # [R, L]
            valid = pos < end[:, None]
            block = (pos // tpb).clamp(max=page_tables.shape[-1] - 1)
            pages = page_tables[g][row[:, None], block].long()
            held = pages > empty
            allowed = valid[:, None, :] & (pos[:, None, :] <= qpos[:, :, None])
            if window is not None:
                allowed &= qpos[:, :, None] - pos[:, None, :] < window
            allowed &= real[:, :, None]
            missing = allowed & ~held[:, None, :]
            if bool(missing.any()):
                i, _, k = (int(x[0]) for x in missing.nonzero(as_tuple=True))
                raise CacheMiss(
                    f"layer group {g}: position {int(pos[i, k])} of the request in page-table "
                    f"row {rows[i]} is needed but its page-table entry is "
                    f"{int(pages[i, k])}"
                )
            # Padding queries attend to column 0 only, so that no row is all masked (NaN).
            allowed[:, :, 0] |= ~real
            keep = valid & held
            slots = slot_mapping[g]
            new = slots >= 0
            out.append(
                GroupTables(
                    read_blocks=torch.where(keep, pages, 0),
                    read_offsets=torch.where(keep, pos % tpb, 0),
                    read_keep=None if null_page else keep[:, :, None, None],
                    write_rows=req[new],
                    write_cols=cols[new],
                    write_blocks=slots[new] // tpb,
                    write_offsets=slots[new] % tpb,
                    mask=torch.where(allowed, 0.0, min_value).to(dtype)[:, None],
                )
            )
        return StepTables(out)


class KVCMCache:
    """The ``cache`` argument of a transformers model forward, backed by kvcm.

    ``view(layer_id, role)`` is kvcm's pool view of that layer and role
    ``[num_slots, tokens_per_block, heads, head_dim]`` (the in-process manager's or an
    attachment's ``layer_view``).
    """

    def __init__(
        self,
        view: Callable[[int, str], torch.Tensor],
        layers: dict[int, LayerInfo],
        tables: StepTables,
    ) -> None:
        self._view = view
        self._layers = layers
        self._tables = tables

    def update(
        self,
        key_states: torch.Tensor,
        value_states: torch.Tensor,
        layer_idx: int,
        *_: Any,
        **__: Any,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Store ``[R, heads, Q, dim]`` new keys and values; return ``[R, heads, L, dim]``."""
        info = self._layers[layer_idx]
        t = self._tables.groups[info.group]
        latent = info.kv_factor == 1
        if latent:  # MLA: latent and rotary key side by side in one key-only page
            parts = (key_states.shape[-1], value_states.shape[-1])
            key_states = torch.cat((key_states, value_states), dim=-1)
        roles = ("key",) if latent else ("key", "value")
        history = []
        for role, states in zip(roles, (key_states, value_states), strict=False):
            view = self._view(layer_idx, role)
            new = states.transpose(1, 2)[t.write_rows, t.write_cols]  # [N, heads, dim]
            view[t.write_blocks, t.write_offsets] = new.to(view.dtype)
            read = view[t.read_blocks, t.read_offsets].to(states.dtype)
            if t.read_keep is not None:
                read = torch.where(t.read_keep, read, 0)
            history.append(read.transpose(1, 2))
        if latent:
            return tuple(torch.split(history[0], parts, dim=-1))  # type: ignore[return-value]
        return history[0], history[1]
